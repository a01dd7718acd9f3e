"""The real coordinator process over real ipc sockets, with fake engines and a fake
frontend. Every receive has a timeout; the process is always shut down."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import pytest
import zmq

from tidal.dp_coordinator.handle import DPCoordinator, fetch_stats, fetch_stats_async
from tidal.dp_coordinator.proc import CoordinatorAddresses
from tidal.protocol.messages import (
    SNAPSHOT_DECODER,
    CoordinatorReady,
    DPSetTopology,
    DPWakeUp,
    EngineCoreOutputs,
    SchedulerStats,
    StartDPWave,
    decode_engine_message,
    encode,
)
from tidal.protocol.topology import Topology

# Generous: a deadline only decides how long a broken coordinator takes to fail a test.
TIMEOUT_MS = 60_000
TIMEOUT_S = TIMEOUT_MS / 1000


class FakeEngine:
    def __init__(self, ctx: zmq.Context, addrs: CoordinatorAddresses, index: int):
        self.index = index
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(addrs.engine_input)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(addrs.engine_publish)
        for s in (self.push, self.sub):
            s.setsockopt(zmq.LINGER, 0)

    def send(self, **fields) -> None:
        self.push.send(encode(EngineCoreOutputs(engine_id=self.index, **fields)))

    def recv(self, kind=None):
        """Next coordinator message (of ``kind`` if given, skipping others)."""
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while (left := deadline - time.monotonic()) > 0:
            assert self.sub.poll(int(left * 1000)), f"engine {self.index}: nothing received"
            msg = decode_engine_message(self.sub.recv_multipart())
            if kind is None or isinstance(msg, kind):
                return msg
        raise AssertionError(f"engine {self.index}: no {kind}")

    def assert_silent(self, ms: int = 200) -> None:
        """No START_DP_WAVE arrives (READYs for other engines' handshakes are fine)."""
        deadline = time.monotonic() + ms / 1000
        while (left := deadline - time.monotonic()) > 0:
            if self.sub.poll(int(left * 1000)):
                msg = decode_engine_message(self.sub.recv_multipart())
                assert not isinstance(msg, StartDPWave), msg


class FakeFrontend:
    def __init__(self, ctx: zmq.Context, addrs: CoordinatorAddresses):
        self.sock = ctx.socket(zmq.XSUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addrs.frontend_publish)
        self.sock.send(b"\x01")  # subscribe to everything

    def wait_for(self, pred, what: str):
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000)):
                break
            snap = SNAPSHOT_DECODER.decode(self.sock.recv())
            if pred(snap):
                return snap
        raise AssertionError(f"frontend: no snapshot with {what}")

    def send(self, msg) -> None:
        self.sock.send(encode(msg))  # upstream to the coordinator's XPUB


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def coordinator():
    coord = DPCoordinator(2, heartbeat_interval_s=0.5, start_timeout_s=TIMEOUT_S)
    yield coord
    coord.shutdown()


def test_ready_snapshots_waves_and_stats(ctx, coordinator):
    addrs = coordinator.addresses
    engines = [FakeEngine(ctx, addrs, i) for i in range(2)]
    for e in engines:
        ready = e.recv(CoordinatorReady)  # handshake: coordinator is up
        assert (ready.num_engines, ready.wave, ready.running) == (2, 0, False)
    front = FakeFrontend(ctx, addrs)
    front.wait_for(lambda s: s.counts == [[0, 0], [0, 0]], "the initial load")

    # Stats from an engine reach the frontend.
    engines[1].send(scheduler_stats=SchedulerStats(num_waiting_reqs=2, num_running_reqs=3))
    front.wait_for(lambda s: s.counts == [[0, 0], [2, 3]], "rank 1's load")

    # A wake-up for engine 1 broadcasts START_DP_WAVE(0) excluding engine 1.
    front.send(DPWakeUp(wave=0, engine_id=1))
    for e in engines:
        assert e.recv(StartDPWave) == StartDPWave(wave=0, exclude_engine_id=1)
    front.wait_for(lambda s: s.running and s.wave == 0, "wave 0 running")
    front.send(DPWakeUp(wave=0, engine_id=0))  # duplicate from another frontend
    engines[0].assert_silent()

    # Rank 0 reports the wave complete: wave 1, paused.
    engines[0].send(wave_complete=0)
    front.wait_for(lambda s: not s.running and s.wave == 1, "wave 1 paused")

    # A stale request on engine 1 makes it start wave 1 and tell the coordinator.
    engines[1].send(start_wave=1)
    assert engines[0].recv(StartDPWave) == StartDPWave(wave=1, exclude_engine_id=1)
    front.wait_for(lambda s: s.running and s.wave == 1, "wave 1 running")

    # Garbage does not kill the coordinator.
    engines[0].push.send(b"\xc1not msgpack")
    front.sock.send(b"\x93garbage")
    engines[0].send(scheduler_stats=SchedulerStats(num_running_reqs=4, num_requests_total=9))
    front.wait_for(lambda s: s.counts[0] == [0, 4], "rank 0's load after garbage")

    stats = fetch_stats(addrs.stats, timeout_s=TIMEOUT_S)
    assert (stats.num_engines, stats.wave, stats.running) == (2, 1, True)
    assert stats.waves_completed == 1 and stats.start_wave_broadcasts == 2
    r0, r1 = stats.ranks
    assert (r0.running, r0.requests_total, r1.waiting, r1.running) == (4, 9, 2, 3)
    assert r1.history and r1.history[-1][1:] == (2, 3)
    assert msgspec.json.decode(msgspec.json.encode(stats))["ranks"][1]["waiting"] == 2

    # Heartbeat: an unchanged state is republished.
    last = front.wait_for(lambda s: True, "any snapshot")
    front.wait_for(lambda s: s.seq > last.seq, "a heartbeat")

    # Elastic resize announced by a frontend; the new size shows in snapshots and stats.
    grown = Topology.initial(2).grown(1)
    front.send(DPSetTopology(grown))
    front.wait_for(lambda s: len(s.counts) == 3 and not s.running, "3 ranks, paused")
    stats = asyncio.run(fetch_stats_async(addrs.stats, timeout_s=TIMEOUT_S))
    assert stats.num_engines == 3 and stats.ranks[2].running == 0
    # Remove the middle engine; a stale topology then changes nothing.
    front.send(DPSetTopology(grown.without([1])))
    front.send(DPSetTopology(grown))
    snap = front.wait_for(lambda s: s.epoch == 2, "epoch 2")
    assert snap.engine_ids == [0, 2] and snap.counts[0] == [0, 4]
    stats = fetch_stats(addrs.stats, timeout_s=TIMEOUT_S)
    assert (stats.epoch, [r.engine_id for r in stats.ranks]) == (2, [0, 2])


def test_late_engine_gets_ready_with_current_wave(ctx, coordinator):
    addrs = coordinator.addresses
    first = FakeEngine(ctx, addrs, 0)
    first.recv(CoordinatorReady)
    first.send(wave_complete=4)
    front = FakeFrontend(ctx, addrs)
    front.wait_for(lambda s: s.wave == 5, "wave 5")
    late = FakeEngine(ctx, addrs, 1)
    assert late.recv(CoordinatorReady).wave == 5


def test_late_engine_gets_the_running_wave_started(ctx, coordinator):
    """A START broadcast before an engine subscribed never reaches it (slow joiner): a
    subscriber gets the running wave's START right after its READY."""
    addrs = coordinator.addresses
    first = FakeEngine(ctx, addrs, 0)
    first.recv(CoordinatorReady)
    first.send(start_wave=0)  # engine 0 runs wave 0 on its own: START(0, exclude 0)
    assert first.recv(StartDPWave) == StartDPWave(0, 0)
    late = FakeEngine(ctx, addrs, 1)
    ready = late.recv(CoordinatorReady)
    assert (ready.wave, ready.running) == (0, True)
    assert late.recv(StartDPWave) == StartDPWave(0, None)


def test_restart_serves_on_the_same_addresses_from_the_given_wave(ctx):
    coord = DPCoordinator(2, heartbeat_interval_s=0.5, start_timeout_s=TIMEOUT_S)
    try:
        addrs = coord.addresses
        engine = FakeEngine(ctx, addrs, 0)
        engine.recv(CoordinatorReady)
        front = FakeFrontend(ctx, addrs)
        front.wait_for(lambda s: s.wave == 0, "wave 0")
        tmpdir = os.path.dirname(addrs.ipc_paths()[0])
        old = coord.proc.pid
        os.kill(old, signal.SIGKILL)
        coord.proc.join(TIMEOUT_S)
        assert not coord.is_alive()
        coord.restart(Topology.initial(2).with_engines([0, 1]), wave=7)
        assert coord.is_alive() and coord.proc.pid != old and coord.restarts == 1
        assert coord.addresses == addrs and os.path.isdir(tmpdir)
        # The same sockets reconnect by themselves: a READY at the new wave, snapshots,
        # and the engine's messages are applied.
        assert engine.recv(CoordinatorReady).wave == 7
        front.wait_for(lambda s: s.wave == 7 and not s.running, "wave 7, paused")
        engine.send(start_wave=7)
        front.wait_for(lambda s: s.wave == 7 and s.running, "wave 7 running")
    finally:
        coord.shutdown()
    assert not any(os.path.exists(p) for p in addrs.ipc_paths()) and not os.path.exists(tmpdir)
    with pytest.raises(RuntimeError, match="shut down"):
        coord.restart(Topology.initial(2), wave=0)  # after a shutdown: starts nothing


def test_shutdown_leaves_nothing_behind():
    coord = DPCoordinator(2, start_timeout_s=TIMEOUT_S)
    paths = coord.addresses.ipc_paths()
    assert len(paths) == 4 and all(os.path.exists(p) for p in paths)
    tmpdir = os.path.dirname(paths[0])
    assert os.stat(tmpdir).st_mode & 0o777 == 0o700
    pid = coord.proc.pid
    coord.shutdown(timeout_s=TIMEOUT_S)  # time to exit on SIGTERM, before a SIGKILL
    coord.shutdown()  # idempotent
    assert not coord.proc.is_alive()
    assert coord.proc.exitcode == 0  # SIGTERM handled: a clean exit
    assert not any(os.path.exists(p) for p in paths) and not os.path.exists(tmpdir)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_killed_process_files_are_still_removed():
    coord = DPCoordinator(1, start_timeout_s=TIMEOUT_S)
    paths = coord.addresses.ipc_paths()
    os.kill(coord.proc.pid, signal.SIGKILL)
    coord.proc.join(TIMEOUT_S)
    assert not coord.proc.is_alive()
    coord.shutdown()
    assert not any(os.path.exists(p) for p in paths)


def test_tcp_wildcard_ports_are_resolved(ctx):
    with DPCoordinator(
        1, CoordinatorAddresses.tcp("127.0.0.1"), start_timeout_s=TIMEOUT_S
    ) as coord:
        addrs = coord.addresses
        assert all(a.startswith("tcp://127.0.0.1:") and not a.endswith("*") for a in
                   (addrs.engine_publish, addrs.engine_input, addrs.frontend_publish, addrs.stats))  # fmt: skip
        assert fetch_stats(addrs.stats, timeout_s=TIMEOUT_S).num_engines == 1
    assert not coord.proc.is_alive()


def test_bind_failure_is_reported(tmp_path):
    bad = CoordinatorAddresses.ipc(str(tmp_path / "missing-dir"))
    with pytest.raises(RuntimeError, match="failed to start"):
        DPCoordinator(1, bad, start_timeout_s=30.0)
