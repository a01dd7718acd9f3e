"""No silent thread death, piece by piece and without processes: the engine's
input and output threads, the coordinator's loop and the clients' readers on in-process
(``inproc://``) or temporary ``ipc://`` sockets. A bad frame is dropped and counted; a
failure that is not one bad frame turns into a clean death path. (With real processes:
tests/distributed/test_io_thread_faults.py.)"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
import zmq.asyncio

from tests.waiting import wait_until
from tidal.dp_coordinator.proc import CoordinatorAddresses, _CoordinatorLoop, _StopFlag
from tidal.dp_coordinator.state import CoordinatorState
from tidal.engine_core.proc import TO_CLIENT, EngineCoreProc, EngineIOThreadError, LoopProgress
from tidal.frontend.async_client import AsyncMPClient, PendingCalls
from tidal.frontend.liveness_monitor import LivenessMonitor
from tidal.frontend.migrator import Migrator
from tidal.frontend.router import Router
from tidal.frontend.transport import EngineTransport
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import (
    COORDINATOR_READY,
    ENGINE_OUTPUTS_DECODER,
    STATS_DECODER,
    CoordinatorReady,
    DPStatsRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequestType,
    FinishReason,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
    encode,
)
from tidal.protocol.topology import Topology
from tidal.utils.dropped import DropCounter

T = EngineCoreRequestType


# ---------------------------------------------------------------------- DropCounter


def test_drop_counter_counts_every_drop_and_rate_limits_the_log(caplog):
    counter = DropCounter("me", logging.getLogger("drops"), log_interval_s=60)
    with caplog.at_level(logging.ERROR, logger="drops"):
        for _ in range(5):
            counter.drop("frame", ValueError("bad"))
        counter.drop("other", "why")
    assert counter.counts() == {"frame": 5, "other": 1} and counter.total == 6
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "me: dropped a frame (1 so far): ValueError: bad",
        "me: dropped a other (1 so far): why",
    ]


# ------------------------------------------------------------------ the engine's threads


class _Core:
    executor = SimpleNamespace(call=lambda method: False)  # worker.waiting_on_peers

    def weird(self) -> Any:
        return {"x": object()}


def _engine(ctx: zmq.Context | None = None, **addresses: Any) -> EngineCoreProc:
    """An EngineCoreProc with only what its I/O threads use (no handshake, no model)."""
    proc = EngineCoreProc.__new__(EngineCoreProc)
    proc.engine_id = 3
    proc.progress = LoopProgress()
    proc.input_queue = queue.Queue()
    proc.output_queue = queue.Queue()
    proc.dropped = DropCounter("engine 3", logging.getLogger("test"))
    proc._io_failure = None
    proc.ctx = ctx
    proc._stop_io = threading.Event()
    proc.coordinator_ready = threading.Event()
    proc.coordinator_wave = 0
    proc._curve = None
    proc.engine_core = _Core()
    proc.addresses = SimpleNamespace(
        output_address=None, coordinator_output=None, coordinator_input=None, **addresses
    )
    return proc


def test_engine_input_drops_undecodable_client_requests():
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"\x03\x00")
    try:
        router.bind("inproc://engine-in")
        dealer.connect("inproc://engine-in")
        proc = _engine()
        bad = [[b"\x7f", b"\x90"], [T.ABORT.value], [b""], [T.UTILITY.value, b"\x94"]]
        good = [T.ABORT.value, encode(["a", "b"])]
        for frames in [*bad, good]:
            router.send_multipart([b"\x03\x00", *frames])
            assert dealer.poll(5000)
            proc._read_client_request(dealer)
        assert proc.dropped.counts() == {"client request": len(bad)}
        assert proc.input_queue.get_nowait() == (T.ABORT, ["a", "b"])
        assert proc.input_queue.empty()
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_engine_input_drops_garbage_from_the_coordinator():
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        pub.bind("inproc://coord-pub")
        sub.connect("inproc://coord-pub")
        proc = _engine()
        bad = [
            [b"junk"],
            [COORDINATOR_READY, b"\xc1"],
            [T.START_DP_WAVE.value, b"\x92"],
            [COORDINATOR_READY, encode(CoordinatorReady(2, 4, False)), b"extra"],
            [b"kind", b"\x90"],
        ]
        for frames in [*bad, [COORDINATOR_READY, encode(CoordinatorReady(2, 4, False))]]:
            # A PUB drops what it sends before the subscription arrives: resend until read.
            for _ in range(500):
                pub.send_multipart(frames)
                if sub.poll(10):
                    break
            proc._read_coordinator_message(sub)
        assert proc.dropped.counts() == {"coordinator message": len(bad)}
        assert proc.coordinator_ready.is_set() and proc.coordinator_wave == 4
    finally:
        pub.close(0)
        sub.close(0)
        ctx.term()


def test_unencodable_utility_result_fails_that_call():
    proc = _engine()
    proc._call_utility(UtilityRequest(0, 7, "weird", []))
    dest, frame = proc.output_queue.get_nowait()
    assert dest == TO_CLIENT and isinstance(frame, bytes)  # encoded on the busy loop
    out = ENGINE_OUTPUTS_DECODER.decode(frame).utility_output
    assert out.call_id == 7 and out.result is None
    assert out.failure_message.startswith("weird failed: its result cannot be sent: TypeError")


def test_unencodable_outputs_are_replaced_or_dropped():
    proc = _engine()
    # A utility output (queued as an object): the call fails.
    util = EngineCoreOutputs(utility_output=UtilityOutput(5, result=object()))
    out = ENGINE_OUTPUTS_DECODER.decode(proc._encode_outputs(util)).utility_output
    assert out.call_id == 5 and "could not send the result" in out.failure_message
    # Request outputs: each request fails (ERROR finish) and is aborted in the engine.
    bad = EngineCoreOutput("r1", [object()])  # type: ignore[list-item]
    outs = EngineCoreOutputs(outputs=[bad, EngineCoreOutput("r2", [1]), bad])
    got = ENGINE_OUTPUTS_DECODER.decode(proc._encode_outputs(outs))
    assert [(o.request_id, o.finish_reason) for o in got.outputs] == [
        ("r1", FinishReason.ERROR),
        ("r2", FinishReason.ERROR),
    ]
    assert got.finished_requests == {"r1", "r2"}
    assert "could not send the request's output" in got.outputs[0].stop_reason
    assert proc.input_queue.get_nowait() == (T.ABORT, ["r1", "r2"])
    # Anything else: dropped.
    stats = EngineCoreOutputs(scheduler_stats=SchedulerStats(), dead_reason=object())  # type: ignore[arg-type]
    assert proc._encode_outputs(stats) is None
    assert proc.dropped.counts() == {"output message": 3}


def test_output_thread_goes_on_after_a_bad_message_and_dies_loudly():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://engine-out")
    proc = _engine(ctx)
    proc.addresses.output_address = "inproc://engine-out"
    proc._output_thread = threading.Thread(target=proc._output_loop, daemon=True)
    proc._input_thread = threading.current_thread()
    proc._output_thread.start()
    try:
        proc._send_outputs(EngineCoreOutputs(dead_reason=object()))  # type: ignore[arg-type]
        proc._send_outputs(EngineCoreOutputs(wave_complete=1))
        assert pull.poll(5000)
        assert ENGINE_OUTPUTS_DECODER.decode(pull.recv()).wave_complete == 1
        assert proc.dropped.counts() == {"output message": 1}
        proc._check_io_threads()  # all well
        # A failure that is not one message (a bug: no socket for this destination).
        proc.output_queue.put_nowait((42, b"x"))
        proc._output_thread.join(5)
        assert not proc._output_thread.is_alive()
        assert pull.poll(5000)
        dead = ENGINE_OUTPUTS_DECODER.decode(pull.recv())
        assert (
            dead.engine_dead and "engine 3: its output thread failed: KeyError" in dead.dead_reason
        )
        with pytest.raises(EngineIOThreadError, match="output thread failed"):
            proc._check_io_threads()
    finally:
        proc.output_queue.put_nowait(None)
        pull.close(0)
        ctx.term()


# ---------------------------------------------------------------- the coordinator loop


def test_coordinator_loop_drops_bad_messages_on_every_socket(tmp_path):
    ctx = zmq.Context()
    stop = _StopFlag()
    loop = _CoordinatorLoop(ctx, CoordinatorAddresses.ipc(str(tmp_path)), CoordinatorState(2), stop)
    addrs = loop.bound_addresses()
    real_handle = loop.state.handle

    def handle(msg: Any, now: float) -> Any:
        if isinstance(msg, EngineCoreOutputs) and msg.engine_id == 66:
            raise RuntimeError("a bug")
        return real_handle(msg, now)

    loop.state.handle = handle
    runner = threading.Thread(target=loop.run, args=(None,), daemon=True)
    runner.start()
    socks: list[zmq.Socket] = []
    try:
        push = ctx.socket(zmq.PUSH)
        xsub = ctx.socket(zmq.XSUB)
        dealer = ctx.socket(zmq.DEALER)
        socks += [push, xsub, dealer]
        push.connect(addrs.engine_input)
        xsub.connect(addrs.frontend_publish)
        dealer.connect(addrs.stats)
        for frame in [b"\xc1", b"", encode("x"), encode(EngineCoreOutputs(engine_id=66))]:
            push.send(frame)
        for frame in [b"\x02junk", encode([1, 2]), b"\xc1"]:
            xsub.send(frame)
        dealer.send_multipart([b"\xc1", b"junk"])
        assert dealer.poll(5000)
        assert dealer.recv_multipart()[0] == b"\xc1"
        assert wait_until(lambda: loop.dropped.total == 7, 10)
        assert loop.dropped.counts() == {"engine message": 4, "frontend message": 3}
        # Still serving.
        push.send(encode(EngineCoreOutputs(engine_id=1, scheduler_stats=SchedulerStats(2, 1))))
        dealer.send(encode(DPStatsRequest()))
        assert wait_until(lambda: loop.state.full_stats(time.monotonic()).ranks[1].waiting == 1, 10)
        assert dealer.poll(5000)
        assert STATS_DECODER.decode(dealer.recv()).num_engines == 2
        assert runner.is_alive()
    finally:
        stop.stopped = True
        runner.join(5)
        for s in socks:
            s.close(0)
        loop.close()
        ctx.term()


# ---------------------------------------------------------------- the clients' readers


def _async_client(ctx: zmq.asyncio.Context) -> AsyncMPClient:
    """An AsyncMPClient with only what its readers use (no engines, no coordinator)."""
    client = AsyncMPClient.__new__(AsyncMPClient)
    client.calls = PendingCalls()
    client._queue = asyncio.Queue()
    client.transport = object.__new__(EngineTransport)  # only its failure state
    client.transport.dead_reason = None
    client._closed = False
    client.dropped = DropCounter("client", logging.getLogger("test"))
    client.router = Router(client.transport, Topology.initial(1), None, None)
    client.migrator = Migrator(None, client.router, client._deliver_injected)
    client.monitor = LivenessMonitor(
        client.router,
        None,  # no processes
        None,
        stall_s=0.0,
        fail=client._fail,
        fail_calls_to=client.calls.fail_engine,
    )
    return client


def test_async_reader_drops_bad_frames_and_fails_the_client_on_a_bug():
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        client = _async_client(ctx)
        pull = ctx.socket(zmq.PULL)
        pull.bind("inproc://async-out")
        push = ctx.socket(zmq.PUSH)
        push.connect("inproc://async-out")
        reader = asyncio.get_running_loop().create_task(client._read_outputs(pull))
        _, call = client.calls.open("sleep", (), 0)
        try:
            for frame in [b"\xc1", b"", encode("x")]:
                await push.send(frame)
            await push.send(encode(EngineCoreOutputs(engine_id=1, timestamp=1.0)))
            outs = await asyncio.wait_for(client._queue.get(), 5)
            assert outs.engine_id == 1
            assert client.dropped.counts() == {"engine output frame": 3}
            assert not reader.done()

            def bug(outs: EngineCoreOutputs) -> bool:
                raise RuntimeError("a bug")

            client._on_outputs = bug
            await push.send(encode(EngineCoreOutputs(engine_id=1)))
            await asyncio.wait_for(reader, 5)  # ended, and not silently:
            assert client.dead_reason == "the client's output reader failed: RuntimeError: a bug"
            with pytest.raises(EngineDeadError, match="reader failed"):
                await asyncio.wait_for(call, 5)
            dead = await asyncio.wait_for(client._queue.get(), 5)
            assert dead.engine_dead
        finally:
            reader.cancel()
            push.close(0)
            pull.close(0)
            ctx.term()

    asyncio.run(main())
