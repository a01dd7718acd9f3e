"""EngineProcManager for elastic EP with real (stand-in) engine processes: spawn joiners
with the new topology in their handshake, wait for their READY, stop chosen ones, and a
monitor that watches a changing set and reports only the exits nobody asked for."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import zmq

from tests.waiting import wait_until
from tidal.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
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
