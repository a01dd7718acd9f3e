"""DPEngineCoreProc: one data-parallel rank, the wave-synchronised busy loop of
DESIGN.md section 3 around an ``EngineCoreProc`` (``proc.py``: sockets, handshake,
shutdown). The wave protocol itself is written down in ``tidal.dp_coordinator.state``.
"""

from __future__ import annotations

from typing import Any

from tidal.engine_core.core import EngineCore
from tidal.engine_core.proc import TO_COORDINATOR, EngineCoreProc
from tidal.engine_core.request_decode import UndecodableRequest
from tidal.engine_core.wave import EngineWaveState
from tidal.executor.uniproc import UniProcExecutor
from tidal.protocol.errors import EngineStartupError
from tidal.protocol.messages import EngineCoreOutputs, EngineCoreRequest, StartDPWave

# How often the ranks of a running wave all-reduce "does anyone still have work?".
DP_ALLREDUCE_INTERVAL = 32
COORDINATOR_READY_TIMEOUT_S = 30.0


class DPEngineCoreProc(EngineCoreProc):
    """A data-parallel rank: the wave-synchronised busy loop of DESIGN.md section 3.

    While a wave runs every rank steps, idle ones with dummy batches, so expert-parallel
    collectives stay matched; every ``DP_ALLREDUCE_INTERVAL`` steps the ranks all-reduce
    ``[has_unfinished, pending_pause]`` over the DP group. The wave protocol (who starts a
    wave, which races exist) lives in ``tidal.dp_coordinator.state``; this class applies
    ``EngineWaveState``'s decisions.

    Two-phase pause (the group stops stepping at one agreed step, e.g. before a
    reconfiguration): phase 1, ``pause`` sets ``pending_pause`` on a rank and, if the group
    is idle, starts a wave so every rank reaches the next all-reduce; phase 2, that
    all-reduce shows the flag to every rank at the same step and they all pause together,
    requests staying queued. While paused a rank still records START_DP_WAVE (so a rank
    resumed earlier than another waits for it in the next collective instead of running
    alone); ``resume`` clears the pause and restarts the wave if there is work.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wave = EngineWaveState(self.engine_index, self.coordinator_wave)
        self.step_counter = 0
        self.pending_pause = False
        self.paused = False
        self.num_dummy_batches = 0
        self._last_published: tuple[int, int] | None = None

    def _build_engine_core(self) -> EngineCore:
        if self.addresses.coordinator_input and not self.coordinator_ready.wait(
            COORDINATOR_READY_TIMEOUT_S
        ):
            raise EngineStartupError(
                f"engine {self.engine_index}: no READY from the DP coordinator within "
                f"{COORDINATOR_READY_TIMEOUT_S}s"
            )
        return super()._build_engine_core()

    def _make_executor(self) -> UniProcExecutor:
        # The DP/EP groups of the topology from the handshake, at this engine's position
        # there: the live size, not the launch size in the config.
        return UniProcExecutor(self.config, topology=self.topology, engine_id=self.engine_index)

    def run_busy_loop(self) -> None:
        while True:
            # 1. Drain the input queue (blocks only when idle and no wave is running).
            self._process_input_queue()
            if self.paused:  # the group agreed to pause: requests stay queued
                if self._shutdown_done():
                    return
                continue
            # 2. Step the engine; publish (waiting, running) when it changed.
            executed = self._process_engine_step()
            self._publish_load_if_changed()
            if not self.wave.running:
                if self._shutdown_done():
                    return
                continue
            # 3. Nothing ran but the wave is running: a dummy forward keeps collectives matched.
            if not executed:
                self.engine_core.execute_dummy_batch()
                self.num_dummy_batches += 1
            # 4. Every DP_ALLREDUCE_INTERVAL steps, agree whether anyone still has work.
            if not self._group_has_work():
                # 5. The group is idle: end the wave (rank 0 reports it) and pause.
                self._end_wave()
            # 6. On shutdown, leave between waves (or at the drain deadline): leaving
            #    mid-wave would strand the other ranks in a collective.
            if self._shutdown_done():
                return

    def _has_work(self) -> bool:
        if self.paused:
            return False
        return self.engine_core.has_unfinished_requests() or self.wave.running

    def utility_pause(self) -> bool:
        """Phase 1 of a group pause (call on every rank)."""
        self.pending_pause = True
        if not self.wave.running and not self.paused:
            self._run_wave()
        return True

    def utility_resume(self) -> bool:
        self.pending_pause = False
        self.paused = False
        if self.engine_core.has_unfinished_requests() and not self.wave.running:
            self._run_wave()
        return True

    def _run_wave(self) -> None:
        """Start running the current wave and make the coordinator start the others."""
        self.wave.on_request(self.wave.wave)
        self._send_outputs(EngineCoreOutputs(start_wave=self.wave.wave), TO_COORDINATOR)

    def utility_dp_state(self) -> dict[str, Any]:
        """For tests and debugging: this rank's view of the wave."""
        top = self.topology
        return {
            "rank": self.dp_rank,
            "engine_id": self.engine_index,
            "epoch": top.epoch if top is not None else 0,
            "dp_size": top.size if top is not None else 1,
            "wave": self.wave.wave,
            "running": self.wave.running,
            "step_counter": self.step_counter,
            "dummy_batches": self.num_dummy_batches,
            "paused": self.paused,
        }

    def _group_has_work(self) -> bool:
        self.step_counter += 1
        if self.step_counter % DP_ALLREDUCE_INTERVAL:
            return True
        has_work, pause = self.engine_core.executor.all_reduce_dp(
            [int(self.engine_core.has_unfinished_requests()), int(self.pending_pause)]
        )  # summed over the DP ranks
        if pause:
            self.paused = True  # phase 2: every rank sees the flag at this same step
            return False
        return bool(has_work)

    def _end_wave(self) -> None:
        completed = self.wave.on_wave_end()
        self.step_counter = 0
        if self.dp_rank == 0:  # one report per group: the rank-0 position, whoever holds it
            self._send_outputs(EngineCoreOutputs(wave_complete=completed), TO_COORDINATOR)

    def _add_request(self, req: EngineCoreRequest | UndecodableRequest) -> None:
        if self.paused:  # queued; resume starts the wave
            super()._add_request(req)
            return
        start = self.wave.on_request(req.current_wave)
        if start is not None:
            self._send_outputs(EngineCoreOutputs(start_wave=start), TO_COORDINATOR)
        super()._add_request(req)

    def _start_wave(self, msg: StartDPWave) -> None:
        self.wave.on_start_wave(msg)

    def _publish_load_if_changed(self) -> None:
        sched = self.engine_core.scheduler
        load = (sched.num_waiting, sched.num_running)
        if load != self._last_published:
            self._last_published = load
            self._send_outputs(
                EngineCoreOutputs(scheduler_stats=sched.make_stats()), TO_COORDINATOR
            )
