"""EngineProcManager for elastic EP with real (stand-in) engine processes: spawn joiners
with the new topology in their handshake, wait for their READY, stop chosen ones, and a
monitor that watches a changing set and reports only the exits nobody asked for. A stop
that comes while an engine is still being started (its scale-up rolled back) cancels
that start: nothing of it keeps running or holds its cores."""

from __future__ import annotations

import os
import signal
import threading

import psutil
import pytest
import zmq

from tests.waiting import wait_until
from tidal.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tidal.frontend.launchers.mp import MPLauncher
from tidal.frontend.launchers.proc_manager import EngineProcManager, EngineStartError
from tidal.protocol.topology import Topology

pytestmark = pytest.mark.timeout(120)


def _config() -> EngineConfig:
    model = ModelConfig("m", "m", "float32", 64, 0, "Qwen3MoeForCausalLM", None)
    return EngineConfig(model, CacheConfig(), SchedulerConfig(), ParallelConfig())


def test_spawn_wait_stop_and_monitor(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_JOINER_MODES", "3:error,4:exit")
    ctx = zmq.Context()
    launch = Topology.initial(1)
    manager = EngineProcManager(
        _config(),
        launch,
        ctx,
        input_address=f"ipc://{tmp_path}/in",
        output_address=f"ipc://{tmp_path}/out",
        handshake_address=f"ipc://{tmp_path}/hs",
        entry_module="fake_joiner_engine",
        local_engines=[],
    )
    exits: list[tuple[int, int | None]] = []
    lock = threading.Lock()

    def on_exit(engine_id: int, code: int | None) -> None:
        with lock:
            exits.append((engine_id, code))

    try:
        manager.start_monitor(on_exit)
        grown = launch.with_engines([0, 1, 2])
        manager.spawn([1, 2], grown)
        manager.wait_for_joiners([1, 2], 60)  # READY(error) unless joining + topology
        assert manager.num_blocks == {1: 7, 2: 7}
        # An unexpected exit is reported with its code; the other engine keeps running.
        os.kill(manager.procs[1].pid, signal.SIGKILL)
        assert wait_until(lambda: exits, 30)
        assert exits == [(1, -signal.SIGKILL)]
        # Stopping is expected: never reported; the process is reaped and forgotten.
        codes = manager.stop([2, 99])
        assert codes == {2: -signal.SIGTERM} and 2 not in manager.procs
        manager.stop([1], force=True)  # reap the one that died
        assert manager.procs == {}
        # A joiner that fails its startup is named.
        manager.spawn([3], launch.with_engines([0, 3]))
        with pytest.raises(EngineStartError, match="boom") as err:
            manager.wait_for_joiners([3], 60)
        assert err.value.engine_id == 3
        manager.spawn([4], launch.with_engines([0, 4]))
        with pytest.raises(EngineStartError, match="exited with code 3") as err:
            manager.wait_for_joiners([4], 60)
        assert err.value.engine_id == 4
        manager.stop([3, 4], force=True)
        assert manager.procs == {}
        with lock:
            # 3 and 4 exited on their own (reported, unless stop came first); 2 was stopped.
            assert {e for e, _ in exits} <= {1, 3, 4} and exits[0] == (1, -signal.SIGKILL)
    finally:
        manager.shutdown()
        ctx.term()
    assert not manager._monitor.is_alive()


class _SlowStartLauncher(MPLauncher):
    """Starts engines only once ``gate`` opens: an engine still being started (a slow
    placement, a warm launcher that does not answer) when its scale-up rolls back."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, "fake_joiner_engine")
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.cancel_asked = threading.Event()
        self.started: dict = {}

    def start(self, engine_ids, handshake_address, *, warm):
        if warm:  # a scale-up's (the launch starts none here)
            self.entered.set()
            self.gate.wait(120)
        handles = super().start(engine_ids, handshake_address, warm=warm)
        self.started.update(handles)
        return handles

    def cancel(self, engine_ids) -> None:
        self.cancel_asked.set()


def test_stop_cancels_an_engine_still_starting(tmp_path):
    core = min(os.sched_getaffinity(0))
    config = _config().with_parallel(cpu_affinity=str(core))  # one core group: a slot to hold
    launcher = _SlowStartLauncher(config)
    assert launcher.cores is not None
    ctx = zmq.Context()
    launch = Topology.initial(1)
    manager = EngineProcManager(
        config,
        launch,
        ctx,
        input_address=f"ipc://{tmp_path}/in",
        output_address=f"ipc://{tmp_path}/out",
        handshake_address=f"ipc://{tmp_path}/hs",
        local_engines=[],
        launcher=launcher,
    )
    outcome: dict[str, object] = {}
    stopped = threading.Event()

    def spawn() -> None:
        try:
            manager.spawn([1], launch.with_engines([0, 1]))
            outcome["spawned"] = True
        except EngineStartError as e:
            outcome["error"] = e

    def stop() -> None:
        outcome["codes"] = manager.stop([1], force=True, timeout_s=60)
        stopped.set()

    spawner = threading.Thread(target=spawn)
    stopper = threading.Thread(target=stop)
    try:
        spawner.start()
        assert launcher.entered.wait(30)
        stopper.start()  # the rollback's StopEngines, while the launcher is starting it
        assert wait_until(lambda: stopped.is_set() or launcher.cancel_asked.is_set(), 30)
        launcher.gate.set()  # the start completes after the stop was asked
        spawner.join(60)
        stopper.join(60)
        assert not spawner.is_alive() and not stopper.is_alive()
        err = outcome.get("error")
        assert isinstance(err, EngineStartError), outcome
        assert err.engine_id == 1 and "stopped during its startup" in str(err)
        # The process it started is gone, and so is everything it held.
        pid = launcher.started[1].pid
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        assert manager.procs == {} and launcher.node_of(1) is None
        assert launcher.cores.acquire(2) == (core,)  # its core group is free again
        launcher.cores.release(2)
    finally:
        launcher.gate.set()
        spawner.join(60)
        stopper.join(60)
        manager.shutdown()
        ctx.term()
