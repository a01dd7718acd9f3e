"""No silent thread death: malformed frames on every ZMQ socket of a real DP=2
deployment, and an unencodable utility result, while requests are in flight.

Each bad frame costs that frame alone: it is dropped and counted (the engines'
``io_stats`` utility, the client's ``dropped``), every request in flight completes with
the greedy tokens of an undisturbed run, and the utility call fails at once with a clear
error. An I/O thread that fails anyway takes its engine down cleanly: ENGINE_CORE_DEAD,
every request in flight fails (where it would otherwise wait for ever: ``DEADLINE_S`` is
only how long the test waits to see it), the process exits non-zero, and nothing is left
running after shutdown.

The engines run ``io_fault_engine`` (this folder): the real engine plus test-only
utilities that produce what msgspec cannot encode or that break an I/O thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq
from io_fault_engine import BREAK_INPUT

from tests.waiting import wait_until, wait_until_async
from tidal import LLM, SamplingParams
from tidal.config import EngineConfig
from tidal.dp_coordinator.handle import fetch_stats_async
from tidal.frontend.async_client import AsyncMPClient
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.loop_client import LoopThreadClient
from tidal.frontend.processor import ProcessedPrompt
from tidal.launch.engine_args import EngineArgs
from tidal.protocol.errors import EngineDeadError, RequestFailedError
from tidal.protocol.messages import SNAPSHOT_DECODER, EngineCoreRequestType, engine_identity

pytestmark = pytest.mark.timeout(600)

FAULT_ENGINE = "io_fault_engine"
# How long a waiter may take to fail where nothing can serve. Not a speed limit (2 loaded
# cores): without the failure path it would wait for ever, or for the client's own
# timeout, which raises a different error than the one each test expects.
DEADLINE_S = 120.0
MAX_TOKENS = 10
LONG_TOKENS = 300  # long enough to be in flight while the garbage arrives
NUM_SHORT = 8

_pack = msgspec.msgpack.encode
T = EngineCoreRequestType

# After the engine's identity frame: messages the engine's input thread must drop alone.
ENGINE_INPUT_GARBAGE = [
    [b"\x7f", b"\x90"],  # an unknown request type
    [T.UTILITY.value, b"\x94\x00"],  # truncated msgpack
    [T.ABORT.value],  # the payload frame is missing
    [T.ADD.value],  # the payload frame is missing
    [T.START_DP_WAVE.value, b"\xc1"],  # not a client request type, invalid msgpack
    [b""],  # an empty type frame
    [T.SCALE.value, _pack("not a scale message")],
]
# Not dropped but answered (an ADD that does not decode, with no readable id): still
# nothing must break.
ENGINE_INPUT_UNDECODABLE_ADD = [T.ADD.value, b"\xc1\xc1"]
# Frames on the frontend's output PULL socket that do not decode as EngineCoreOutputs.
OUTPUT_GARBAGE = [b"\xc1", b"", _pack("hello"), _pack([0, "x"]), _pack([0, [["r", [1]]]])[:-1]]
# On the coordinator's engine PULL socket, and upstream on its frontend XPUB socket
# (a first byte 0 or 1 is a subscription change there, so none of these starts so).
COORD_ENGINE_GARBAGE = [b"\xc1", b"", _pack("x"), _pack([0, "not a list"])]
COORD_FRONTEND_GARBAGE = [b"\x02junk", b"\xc1", _pack([1, 2, 3]), _pack({"a": 1})]


def _prompts() -> list[list[int]]:
    return [[3 + (7 * i + j) % 400 for j in range(2 + i % 9)] for i in range(NUM_SHORT + 2)]


def _params(i: int) -> SamplingParams:
    n = LONG_TOKENS if i >= NUM_SHORT else MAX_TOKENS
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n)


def _config(ckpt: str, dp: int) -> EngineConfig:
    args = EngineArgs(model=ckpt, dtype="float32", data_parallel_size=dp)
    return args.create_engine_config()


@pytest.fixture(scope="module")
def expected(qwen3_ckpt) -> list[list[int]]:
    """The undisturbed run: one in-process engine."""
    llm = LLM(qwen3_ckpt, dtype="float32", multiprocess=False)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in _prompts()],
            [_params(i) for i in range(len(_prompts()))],
            use_tqdm=False,
        )
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


class _FaultLLM(LLM):
    def _make_client(self) -> LoopThreadClient:
        return LoopThreadClient(self.config, entry_module=FAULT_ENGINE)


def _on_loop(client: LoopThreadClient, fn: Callable[[AsyncMPClient], None]) -> None:
    """``fn(the engine client)`` on its loop thread, where its sockets live."""
    client.call_on_loop(lambda: fn(client.client))


def _procs(client: Any) -> list[Any]:
    procs = list(client.manager.procs.values())
    if client.coordinator is not None:
        procs.append(client.coordinator.proc)
    return procs


def _assert_all_stopped(procs: list[Any]) -> None:
    assert wait_until(lambda: not any(p.is_alive() for p in procs), 30), [
        p.name for p in procs if p.is_alive()
    ]


def _within(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()``'s result or exception, failing the test if it takes over ``timeout_s``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout_s)
    assert not th.is_alive(), f"still waiting after {timeout_s} s"
    if "error" in box:
        raise box["error"]
    return box["result"]


def _send_engine_garbage(client: Any, engine_id: int) -> None:
    ident = engine_identity(engine_id)
    for frames in [*ENGINE_INPUT_GARBAGE, ENGINE_INPUT_UNDECODABLE_ADD]:
        client.input_socket.send_multipart([ident, *frames])


def _push_garbage(ctx: zmq.Context, address: str, frames: list[bytes]) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)  # delivered before close returns
    try:
        sock.connect(address)
        for f in frames:
            sock.send(f)
    finally:
        sock.close()


def _dropped(stats: dict) -> dict[str, int]:
    return stats["dropped"]


# ---------------------------------------------------------------- the async client


def test_async_garbage_on_every_socket_while_serving(qwen3_ckpt, expected):
    config = _config(qwen3_ckpt, dp=2)
    prompts = _prompts()

    async def generate(
        llm: AsyncLLM,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        rank: int | None = None,
        started: asyncio.Event | None = None,
    ) -> list[int]:
        tokens: list[int] = []
        gen = llm.generate(ProcessedPrompt(None, prompt), params, rid, data_parallel_rank=rank)
        async for out in gen:
            tokens += out.outputs[0].token_ids
            if started is not None:
                started.set()
        return tokens

    async def main() -> None:
        llm = AsyncLLM(config, client=AsyncMPClient(config, entry_module=FAULT_ENGINE))
        client = llm.client
        procs = _procs(client)
        ctx = zmq.Context()
        try:
            # The short requests anywhere, one long one on each rank.
            started = [asyncio.Event() for _ in range(2)]
            tasks = [
                asyncio.create_task(generate(llm, f"r{i}", p, _params(i)))
                for i, p in enumerate(prompts[:NUM_SHORT])
            ] + [
                asyncio.create_task(generate(llm, f"long{r}", p, _params(NUM_SHORT), r, started[r]))
                for r, p in enumerate(prompts[NUM_SHORT:])
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            assert not any(t.done() for t in tasks[NUM_SHORT:]), "nothing in flight"

            # (a) The engines' input threads: garbage to each rank.
            for engine_id in client.engine_ids:
                _send_engine_garbage(client, engine_id)
            # (b) The frontend's output PULL socket.
            _push_garbage(ctx, client.output_address, OUTPUT_GARBAGE)
            # (c) The coordinator: its engine PULL, its frontend XPUB (upstream), its stats ROUTER.
            addrs = client.coordinator.addresses
            _push_garbage(ctx, addrs.engine_input, COORD_ENGINE_GARBAGE)
            xsub = ctx.socket(zmq.XSUB)
            xsub.setsockopt(zmq.LINGER, 0)
            xsub.connect(addrs.frontend_publish)
            for f in COORD_FRONTEND_GARBAGE:
                xsub.send(f)
            xsub.send(b"\x01")  # then subscribe: the snapshot it gets proves the loop went on
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(addrs.stats)
            dealer.send_multipart([b"\xc1", b"junk"])
            # (d) Utility results that cannot be encoded fail the call, at once.
            for engine_id in client.engine_ids:
                with pytest.raises(RuntimeError, match="unencodable failed: its result cannot"):
                    await asyncio.wait_for(
                        client.call_utility_async("unencodable", engine=engine_id), DEADLINE_S
                    )
            # Request outputs that cannot be encoded fail their request, at once: one more
            # request on rank 1, started here so that its 480 tokens are still to come (on
            # a loaded host the steps above can take as long as a whole short request).
            victim_params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
            victim_started = asyncio.Event()
            victim = asyncio.create_task(
                generate(llm, "victim", [5, 6], victim_params, 1, victim_started)
            )
            await asyncio.wait_for(victim_started.wait(), 120)
            await client.call_utility_async("unencodable_output", "victim", engine=1)
            with pytest.raises(RequestFailedError, match="could not send"):
                await asyncio.wait_for(victim, DEADLINE_S)
            # Everything in flight completes as if nothing happened.
            got = await asyncio.wait_for(asyncio.gather(*tasks), 300)
            assert got == expected

            # Every bad frame was dropped alone, and counted.
            for engine_id in client.engine_ids:
                stats = await client.call_utility_async("io_stats", engine=engine_id)
                want = {"client request": len(ENGINE_INPUT_GARBAGE)}
                if engine_id == 1:
                    want["output message"] = 1
                assert _dropped(stats) == want, (engine_id, stats)
            assert await wait_until_async(lambda: client.dropped.total == len(OUTPUT_GARBAGE), 30)
            assert client.dropped.counts() == {"engine output frame": len(OUTPUT_GARBAGE)}
            # The coordinator still serves: a snapshot for the new subscriber, stats for
            # the garbage request and for a real one, with every rank's requests counted.
            assert await asyncio.wait_for(_recv(xsub, SNAPSHOT_DECODER.decode), 10)
            reply = await asyncio.wait_for(_recv_multipart(dealer), 10)
            assert reply[0] == b"\xc1"
            dp_stats = await fetch_stats_async(addrs.stats, timeout_s=10)
            assert [r.requests_total > 0 for r in dp_stats.ranks] == [True, True]
            assert all(p.is_alive() for p in procs)
            xsub.close()
            dealer.close()
        finally:
            ctx.destroy(linger=0)
            await llm.shutdown()
        _assert_all_stopped(procs)

    asyncio.run(main())


async def _recv(sock: zmq.Socket, decode: Callable[[bytes], Any]) -> Any:
    while not sock.poll(0):
        await asyncio.sleep(0.02)
    return decode(sock.recv())


async def _recv_multipart(sock: zmq.Socket) -> list[bytes]:
    while not sock.poll(0):
        await asyncio.sleep(0.02)
    return sock.recv_multipart()


# ---------------------------------------------------- the same client behind LLM's facade


def test_offline_garbage_while_serving(qwen3_ckpt, expected):
    llm = _FaultLLM(qwen3_ckpt, dtype="float32", data_parallel_size=2)
    client: LoopThreadClient = llm.client
    procs = _procs(client)
    ctx = zmq.Context()
    try:
        prompts = [llm.input_processor.tokenize({"prompt_token_ids": p}) for p in _prompts()]
        ids = [llm._add(p, _params(i)) for i, p in enumerate(prompts)]
        for engine_id in client.engine_ids:
            _on_loop(client, lambda c, e=engine_id: _send_engine_garbage(c, e))
        _push_garbage(ctx, client.client.output_address, OUTPUT_GARBAGE)
        for engine_id in client.engine_ids:
            with pytest.raises(RuntimeError, match="unencodable failed: its result cannot"):
                client.call_utility_on(engine_id, "unencodable", timeout_s=DEADLINE_S)
        got = _within(lambda: llm._run(ids, use_tqdm=False), 300)
        assert [o.outputs[0].token_ids for o in got] == expected
        for engine_id in client.engine_ids:
            stats = client.call_utility_on(engine_id, "io_stats")
            assert _dropped(stats) == {"client request": len(ENGINE_INPUT_GARBAGE)}
        assert wait_until(lambda: client.dropped.total == len(OUTPUT_GARBAGE), 30)
        assert client.dropped.counts() == {"engine output frame": len(OUTPUT_GARBAGE)}
        assert all(p.is_alive() for p in procs)
    finally:
        ctx.destroy(linger=0)
        llm.shutdown()
    _assert_all_stopped(procs)


# ------------------------------------------------- an I/O thread that fails anyway


def _long_requests(llm: LLM, n: int) -> list[str]:
    prompts = [llm.input_processor.tokenize({"prompt_token_ids": p}) for p in _prompts()[:n]]
    return [llm._add(p, _params(NUM_SHORT)) for p in prompts]


def _wait_exit(client: LoopThreadClient, engine_id: int) -> int | None:
    proc = client.manager.procs[engine_id]
    assert wait_until(lambda: proc.exitcode is not None, 30), "the engine lives on"
    return proc.exitcode


def test_output_thread_failure_fails_everything_at_once(qwen3_ckpt):
    # Without rank recovery (with it, the survivor takes the requests over: test_rank_death).
    llm = _FaultLLM(qwen3_ckpt, dtype="float32", data_parallel_size=2, rank_recovery=False)
    client: LoopThreadClient = llm.client
    procs = _procs(client)
    try:
        ids = _long_requests(llm, 4)
        with pytest.raises(EngineDeadError, match="engine 1: its output thread failed"):
            client.call_utility_on(1, "break_output_thread", timeout_s=DEADLINE_S)
        with pytest.raises(EngineDeadError, match="output thread failed"):
            _within(lambda: llm._run(ids, use_tqdm=False), DEADLINE_S)
        assert _wait_exit(client, 1) == 1
    finally:
        llm.shutdown()
    _assert_all_stopped(procs)


def test_input_thread_failure_fails_everything_at_once(qwen3_ckpt):
    llm = _FaultLLM(qwen3_ckpt, dtype="float32", multiprocess=True)
    client: LoopThreadClient = llm.client
    procs = _procs(client)
    try:
        ids = _long_requests(llm, 2)
        _on_loop(
            client,
            lambda c: c.input_socket.send_multipart([engine_identity(0), BREAK_INPUT, b""]),
        )
        with pytest.raises(EngineDeadError, match="engine 0: its input thread failed"):
            _within(lambda: llm._run(ids, use_tqdm=False), DEADLINE_S)
        assert _wait_exit(client, 0) == 1
    finally:
        llm.shutdown()
    _assert_all_stopped(procs)
