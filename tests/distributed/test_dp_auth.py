"""The DP control plane over TCP is authenticated (ZMQ CURVE from a shared secret).

Real sockets on 127.0.0.1 and, for the deployment test, real engine processes: a frontend
(the MP client) with rank 0 local and rank 1 joining as a headless rank over TCP. A peer
without the secret -- a plain ZMQ socket, or CURVE with another secret -- never completes
a handshake, so none of its messages reach the frontend or the coordinator.
Every wait is on an event (a monitor event, a reply), never a sleep.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from tests.distributed.headless import start_with_headless, stop_processes
from tidal.distributed.zmq_auth import (
    CurveKeys,
    curve_keys,
    secure_client,
    secure_server,
    start_authenticator,
)
from tidal.dp_coordinator.handle import fetch_stats
from tidal.engine_core.proc import EngineCoreProc
from tidal.frontend.launchers.mp import spawn_headless_engines
from tidal.frontend.loop_client import LoopThreadClient
from tidal.launch.engine_args import EngineArgs
from tidal.protocol.errors import EngineStartupError
from tidal.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineHello,
    FinishReason,
    encode,
)
from tidal.sampling_params import SamplingParams

SECRET = "test-secret-0123456789abcdef"
OTHER = "another-secret-0123456789abcdef"
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_DEADLINE_MS = 60_000  # generous: only ever reached when the expected event never comes

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


def test_keys_are_derived_from_the_secret():
    a, b = curve_keys(SECRET), curve_keys(OTHER)
    assert curve_keys.__wrapped__(SECRET) == a  # deterministic: every host derives the same
    assert a.server_public != b.server_public and a.client_public != b.client_public
    assert a.server_public != a.client_public
    assert zmq.curve_public(a.server_secret) == a.server_public
    assert SECRET not in repr(a) and a.server_secret.decode() not in repr(a)
    assert curve_keys(None) is None


def test_multi_node_config_requires_a_secret(qwen3_ckpt):
    args = dict(model=qwen3_ckpt, data_parallel_size=2, data_parallel_size_local=1)
    with pytest.raises(ValueError, match="data_parallel_auth_key"):
        EngineArgs(**args).create_engine_config()
    with pytest.raises(ValueError, match="data_parallel_auth_key must be at least"):
        EngineArgs(**args, data_parallel_auth_key="short").create_engine_config()
    cfg = EngineArgs(**args, data_parallel_auth_key=SECRET).create_engine_config()
    assert SECRET not in repr(cfg)  # never printed
    # Not in the config hash (peers see it); so ranks with other secrets hash the same
    # and are told apart by the CURVE handshake instead.
    other = EngineArgs(**args, data_parallel_auth_key=OTHER).create_engine_config()
    assert cfg.config_hash() == other.config_hash()


# ----------------------------------------------------------------------- socket level


def _handshake_result(sock: zmq.Socket, monitor: zmq.Socket) -> int:
    """Wait for the first handshake outcome on ``sock``'s monitor: the event number."""
    while monitor.poll(_DEADLINE_MS):
        event = recv_monitor_message(monitor)["event"]
        if event & (_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED):
            return event
    raise AssertionError("no handshake outcome")


def _attack(
    ctx: zmq.Context, kind: int, address: str, keys: CurveKeys | None, frames: list[bytes]
) -> bool:
    """Connect a ``kind`` socket (CURVE with ``keys``, plain when None), send ``frames``,
    and return whether its handshake succeeded."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if keys is not None:
        secure_client(sock, keys, address)
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(address)
        if frames:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:  # the handshake already failed and took the pipe with it
                pass
        return _handshake_result(sock, monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_curve_server_admits_only_the_secret(ctx):
    keys = curve_keys(SECRET)
    auth = start_authenticator(ctx, keys)
    server = ctx.socket(zmq.ROUTER)
    try:
        secure_server(server, keys, "tcp://127.0.0.1:0")
        server.bind("tcp://127.0.0.1:0")
        address = server.getsockopt_string(zmq.LAST_ENDPOINT)
        hello = encode(EngineHello(0, 1))
        assert not _attack(ctx, zmq.DEALER, address, None, [hello])
        assert not _attack(ctx, zmq.DEALER, address, curve_keys(OTHER), [hello])
        # Knowing the server key is not enough: the client key must be the secret's.
        other = curve_keys(OTHER)
        forged = CurveKeys(keys.server_public, b"", other.client_public, other.client_secret)
        assert not _attack(ctx, zmq.DEALER, address, forged, [hello])
        # Those handshakes failed, so nothing of theirs can be queued: the first message
        # the server ever reads is the legitimate client's.
        assert _attack(ctx, zmq.DEALER, address, keys, [b"legit"])
        assert server.poll(_DEADLINE_MS)
        assert server.recv_multipart()[1:] == [b"legit"]
        assert not server.poll(0)
    finally:
        server.close(0)
        auth.stop()


def test_ipc_sockets_stay_plain(ctx, tmp_path):
    keys = curve_keys(SECRET)
    sock = ctx.socket(zmq.ROUTER)
    secure_server(sock, keys, f"ipc://{tmp_path}/x")
    assert not sock.curve_server
    sock.close(0)


# ----------------------------------------------- a deployment with a headless TCP rank


def _tcp_config(path: str, rpc: int, secret: str, **kw: Any):
    return EngineArgs(
        model=path,
        dtype="float32",
        device="cpu",
        max_model_len=128,
        data_parallel_size=2,
        data_parallel_size_local=1,
        data_parallel_address="127.0.0.1",
        data_parallel_rpc_port=rpc,
        data_parallel_auth_key=secret,
        **kw,
    ).create_engine_config()


def _generate(client: Any, rank: int, rid: str) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
    client.add_request(EngineCoreRequest(rid, [5, 6, 7], params, data_parallel_rank=rank))
    tokens: list[int] = []
    while True:
        for o in client.get_output().outputs:
            if o.request_id == rid:
                tokens += o.new_token_ids
                if o.finished:
                    assert o.finish_reason == FinishReason.LENGTH
                    return tokens


def _deployment(path: str) -> tuple[LoopThreadClient, list[Any]]:
    """A frontend (rank 0 local) and rank 1 started headless, joined over TCP."""
    return start_with_headless(lambda rpc: _tcp_config(path, rpc, SECRET), LoopThreadClient, 1)


def test_headless_rank_with_the_secret_serves_and_strangers_are_refused(qwen3_ckpt):
    client, headless = _deployment(qwen3_ckpt)
    ctx = zmq.Context()
    try:
        assert client.client.addresses.input.startswith("tcp://")
        want = _generate(client, 0, "r0")
        assert _generate(client, 1, "r1") == want and len(want) == 4

        # Strangers at every TCP port of the frontend and the coordinator.
        front, coord = client.client.addresses, client.coordinator.addresses
        forged_death = encode(EngineCoreOutputs(engine_dead=True, dead_reason="forged"))
        hello = encode(EngineHello(1, 1))
        targets = [
            (zmq.DEALER, front.handshake, [hello]),
            (zmq.DEALER, front.input, [b""]),  # would register as an engine
            (zmq.PUSH, front.output, [forged_death]),
            (zmq.PUSH, coord.engine_input, [forged_death]),
            (zmq.SUB, coord.engine_publish, []),
            (zmq.XSUB, coord.frontend_publish, [b"\x01"]),
            (zmq.DEALER, coord.stats, [b""]),
        ]
        for kind, address, frames in targets:
            assert address.startswith("tcp://")
            for keys in (None, curve_keys(OTHER)):
                assert not _attack(ctx, kind, address, keys, frames), address
        # The forged engine_dead never arrived: the deployment still serves on both ranks.
        assert client.dead_reason is None
        assert _generate(client, 0, "r0-again") == want
        assert _generate(client, 1, "r1-again") == want
        # With the secret, the coordinator's stats answer.
        stats = fetch_stats(coord.stats, timeout_s=60, ctx=ctx, curve=curve_keys(SECRET))
        assert stats.num_engines == 2
    finally:
        client.shutdown()
        stop_processes(headless)
        ctx.destroy(linger=0)


def test_rank_with_the_wrong_secret_fails_fast(qwen3_ckpt):
    """The frontend waits for its ranks; a rank with another secret exits at once with an
    error naming the flag (not after the handshake timeout)."""
    ctx = zmq.Context()
    keys = curve_keys(SECRET)
    auth = start_authenticator(ctx, keys)
    front = ctx.socket(zmq.ROUTER)  # the frontend's handshake socket, as AsyncMPClient binds it
    try:
        secure_server(front, keys, "tcp://127.0.0.1:0")
        front.bind("tcp://127.0.0.1:0")
        address = front.getsockopt_string(zmq.LAST_ENDPOINT)
        rpc = int(address.rsplit(":", 1)[1])
        wrong = _tcp_config(qwen3_ckpt, rpc, OTHER).with_parallel(data_parallel_rank=1)
        with pytest.raises(EngineStartupError, match="auth-key") as e:
            EngineCoreProc(wrong, 1, address)
        assert "no reply" not in str(e.value)
        assert not front.poll(0)  # the wrong rank's HELLO never reached the frontend
        # The same through a real headless process: it exits non-zero.
        procs = spawn_headless_engines(wrong.with_parallel(data_parallel_start_rank=1), address)
        try:
            procs[0].join(_DEADLINE_MS / 1000)
            assert procs[0].exitcode == 1
        finally:
            stop_processes(procs)
    finally:
        front.close(0)
        auth.stop()
        ctx.destroy(linger=0)
