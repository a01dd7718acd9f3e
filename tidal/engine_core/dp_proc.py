"""DPEngineCoreProc: one data-parallel rank, the wave-synchronised busy loop of
docs/architecture.md#engine-core around an ``EngineCoreProc`` (``proc.py``: sockets, handshake,
shutdown). The wave protocol itself is written down in ``tidal.dp_coordinator.state``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tidal.distributed.groups import GroupFailure
from tidal.elastic.scale_events import Input
from tidal.engine_core.core import EngineCore
from tidal.engine_core.elastic_shell import ElasticShell
from tidal.engine_core.proc import TO_COORDINATOR, EngineCoreProc
from tidal.engine_core.request_decode import UndecodableRequest
from tidal.engine_core.wave import EngineWaveState
from tidal.executor.base import Executor
from tidal.executor.select import create_executor
from tidal.protocol.elastic import ScaleEvent, ScaleMessage, ScalePrepare, ScaleReport
from tidal.protocol.errors import EngineStartupError
from tidal.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    StartDPWave,
)
from tidal.protocol.topology import Topology

logger = logging.getLogger(__name__)

# How often the ranks of a running wave all-reduce "does anyone still have work?".
DP_ALLREDUCE_INTERVAL = 32
COORDINATOR_READY_TIMEOUT_S = 30.0


class DPEngineCoreProc(EngineCoreProc):
    """A data-parallel rank: the wave-synchronised busy loop of docs/architecture.md#engine-core.

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

    Elastic EP, and rank recovery (``ParallelConfig.reconfigurable``): an
    ``ElasticShell`` (``elastic_shell.py``) runs the engine's part of a scale operation
    (a recovery is one) from step 2, and its commit consensus rides on the step-5
    all-reduce. A *joining* engine (``EngineAddresses.joining``) starts in no group: it
    only drains input and progresses the operation until its commit. A recovery's
    PREPARE aborts, on the input thread, any collective this rank is blocked in on the
    groups it replaces (``_on_input``): a peer that froze must not hold it there.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wave = EngineWaveState(self.engine_id, self.coordinator_wave)
        self.step_counter = 0
        self.pending_pause = False
        self.paused = False
        self.num_dummy_batches = 0
        self._last_published: tuple[int, int] | None = None
        self._tokens_published: tuple[int, float] = (0, 0.0)  # (total, when)
        self._leaving = False
        self.group_failed: str | None = None  # why this rank's groups broke (until commit)
        self.num_group_failures = 0
        self.shell: ElasticShell | None = None
        if self.config.parallel.reconfigurable:
            top = self.topology
            self.shell = ElasticShell(
                self.engine_id,
                None if self.addresses.joining or top is None else top.epoch,
                self.engine_core.executor,
                _ShellHooks(self),
                expert_parallel=self.config.parallel.enable_expert_parallel,
            )

    def _build_engine_core(self) -> EngineCore:
        if self.addresses.coordinator_input and not self.coordinator_ready.wait(
            COORDINATOR_READY_TIMEOUT_S
        ):
            raise EngineStartupError(
                f"engine {self.engine_id}: no READY from the DP coordinator within "
                f"{COORDINATOR_READY_TIMEOUT_S}s"
            )
        return super()._build_engine_core()

    def _make_executor(self) -> Executor:
        # The DP/EP groups of the topology from the handshake, at this engine's position
        # there: the live size, not the launch size in the config. A joiner joins no
        # group at startup: it gets its groups and experts in the scale operation.
        return create_executor(
            self.config,
            topology=self.topology,
            engine_id=self.engine_id,
            joining=self.addresses.joining,
        )

    def run_busy_loop(self) -> None:
        while True:
            # 1. Drain the input queue (blocks only when idle and no wave is running).
            self._process_input_queue()
            # 2. Elastic EP: advance a scale operation (never blocks; an idle step 1 waits
            #    at most 50 ms, so the operation's timers are checked at least that often).
            #    No step while this rank is in no usable group: a joiner before its
            #    commit, a leaving rank after it, a rank whose group lost a member.
            if self.shell is not None:
                self.shell.progress()
                failure = self.shell.take_group_failure()  # in a commit's first collective
                if failure is not None:
                    self._on_group_failure(failure)
                if self.shell.old_group_dead and self.group_failed is None:
                    self._on_group_failure("the scale operation replaces the current groups")
                if not self.shell.serving or self._leaving or self.group_failed is not None:
                    if self._shutdown_done():
                        return
                    continue
            if self.paused:  # the group agreed to pause: requests stay queued
                if self._shutdown_done():
                    return
                continue
            # 3-6. One step of the group. A failed collective (a rank died) abandons it.
            try:
                self._step_group()
            except GroupFailure as e:
                if self.shell is None:
                    raise  # not reconfigurable (no recovery): nothing can rebuild it
                self._on_group_failure(str(e))
            # 7. On shutdown, leave between waves (or at the drain deadline): leaving
            #    mid-wave would strand the other ranks in a collective.
            if self._shutdown_done():
                return

    def _step_group(self) -> None:
        # 3. Step the engine; publish (waiting, running) when it changed.
        executed = self._process_engine_step()
        self._publish_load_if_changed()
        if not self.wave.running:
            return
        # 4. Nothing ran but the wave is running: a dummy forward keeps collectives matched.
        if not executed:
            self.engine_core.execute_dummy_batch()
            self.num_dummy_batches += 1
        # 5. Every DP_ALLREDUCE_INTERVAL steps, agree whether anyone still has work
        #    (and, elastic EP, whether every rank is ready to commit).
        if not self._group_has_work():
            # 6. The group is idle: end the wave (rank 0 reports it) and pause.
            self._end_wave()

    def _on_group_failure(self, cause: str) -> None:
        """A collective of the current groups failed, or the running operation says a
        member is dead (docs/architecture.md#faults). The step in flight is abandoned (its tokens never
        reached the scheduler); every running request is preempted by recompute (its
        outputs so far stay; it re-prefills on the new groups); the groups are destroyed
        so a peer blocked on this rank fails now rather than at its timeout; the rank
        steps no more until a commit gives it new groups (``_take_rank``). Requests that
        arrive meanwhile queue. The frontend is told (GROUP_FAILED), and its recovery
        operation removes the dead member."""
        assert self.shell is not None
        logger.warning("engine %d: DP/EP group failed: %s", self.engine_id, cause)
        self.group_failed = cause
        self.num_group_failures += 1
        if self.shell.active:
            self.shell.on_group_failed(cause)  # an operation on the old group rolls back
        self.engine_core.abandon_step()
        preempted = self.engine_core.scheduler.take_abandoned()  # also those of step()
        self.engine_core.executor.call("worker.abandon_groups")
        self.wave.running = False
        self.step_counter = 0
        self._last_published = None
        top = self.topology
        self._send_outputs(
            EngineCoreOutputs(
                scale_report=ScaleReport(
                    operation_id="",
                    engine_id=self.engine_id,
                    epoch=top.epoch if top is not None else 0,
                    event=ScaleEvent.GROUP_FAILED,
                    cause=cause,
                    requests_preempted=preempted,
                )
            )
        )

    def _has_work(self) -> bool:
        if self.paused or self.group_failed is not None:
            return False
        if self.shell is not None and not self.shell.serving:
            return False
        return self.engine_core.has_unfinished_requests() or self.wave.running

    def _may_block_when_stalled(self) -> bool:
        # In a running wave the peers wait in this rank's collectives: never block there.
        return not self.wave.running

    def _shutdown_done(self) -> bool:
        if self._leaving:
            return True  # left the group at the commit: nothing runs here any more
        return super()._shutdown_done()

    def close(self) -> None:
        if self.shell is not None:
            self.shell.close()
        super().close()

    def _on_input(self, req_type: EngineCoreRequestType, payload: Any) -> None:
        """Input thread: an operation that replaces the current groups (a dead member, or
        a rebuild) ends a collective the busy loop may be blocked in on them, now, rather
        than at the collective timeout; the busy loop then abandons that step as for any
        group failure and goes on with the operation."""
        # Attributes may not exist yet: the input thread starts before this class's
        # __init__ has run.
        if req_type is not EngineCoreRequestType.SCALE or getattr(self, "shell", None) is None:
            return
        if isinstance(payload, ScalePrepare) and not payload.old_group_usable:
            core = getattr(self, "engine_core", None)  # None while the engine starts
            if core is not None:
                cause = f"operation {payload.operation_id} replaces these groups"
                if payload.dead:
                    cause += f" (engines {list(payload.dead)} dead)"
                core.executor.call("worker.abort_collectives", payload.epoch, cause)

    def _on_scale(self, msg: ScaleMessage | Input) -> None:
        if self.shell is None:
            super()._on_scale(msg)
        else:
            self.shell.deliver(msg)

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

    def utility_sleep(self, level: int) -> int:
        """Sleep mode with DP (``EngineCore.sleep``): while its wave runs an idle rank
        still steps dummy forwards, which need the KV cache and the weights, so the group
        steps here until the wave ends (every rank idle: a few steps), then sleeps."""
        core = self.engine_core
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        if core.has_unfinished_requests():
            raise RuntimeError("requests are running; sleep when the engine is idle")
        while self.wave.running and not core.sleeping:
            try:
                self._step_group()
            except GroupFailure as e:
                if self.shell is None:
                    raise
                self._on_group_failure(str(e))
                raise RuntimeError(f"cannot sleep: the DP/EP group failed: {e}") from e
        return core.sleep(level)

    def utility_dp_state(self) -> dict[str, Any]:
        """For tests and debugging: this rank's view of the wave."""
        top = self.topology
        return {
            "rank": self.dp_rank,
            "engine_id": self.engine_id,
            "epoch": top.epoch if top is not None else 0,
            "dp_size": top.size if top is not None else 1,
            "wave": self.wave.wave,
            "running": self.wave.running,
            "step_counter": self.step_counter,
            "dummy_batches": self.num_dummy_batches,
            "paused": self.paused,
            "group_failed": self.group_failed,
            "group_failures": self.num_group_failures,
        }

    def _group_has_work(self) -> bool:
        self.step_counter += 1
        if self.step_counter % DP_ALLREDUCE_INTERVAL:
            return True
        shell = self.shell
        ready = shell.consensus_value if shell is not None else 0
        has_work = self.engine_core.has_unfinished_requests() or (
            shell is not None and shell.holds_wave
        )
        # MAX over the DP ranks: anyone has work / wants a pause; the commit flag's MAX
        # and (negated) MIN, so "every rank raised this operation's flag" is
        # ready_min == ready_max == its sequence. A failure raises GroupFailure: the
        # busy loop's ``_on_group_failure`` rolls an operation back and says so.
        any_work, pause, ready_max, neg_min = self.engine_core.executor.call(
            "worker.all_reduce_dp",
            [int(has_work), int(self.pending_pause), ready, -ready],
            "max",
        )
        if shell is not None:
            shell.on_consensus(self.step_counter, -neg_min, ready_max)
        if pause:
            self.paused = True  # phase 2: every rank sees the flag at this same step
            return False
        return bool(any_work)

    def _end_wave(self) -> None:
        completed = self.wave.on_wave_end()
        self.step_counter = 0
        if self.dp_rank == 0:  # one report per group: the rank-0 position, whoever holds it
            self._send_outputs(EngineCoreOutputs(wave_complete=completed), TO_COORDINATOR)

    def _add_request(self, req: EngineCoreRequest | UndecodableRequest) -> None:
        shell = self.shell
        if shell is not None and not shell.serving:
            # Not a member yet (a joiner): nobody routes here; hand it back if it came.
            if isinstance(req, EngineCoreRequest):
                shell.bounce(req.request_id)
            return
        if self.paused or self.group_failed is not None:
            # Queued: resume starts the wave; a broken rank keeps its wave frozen (the
            # recovery's commit sets it for every member alike).
            super()._add_request(req)
            return
        start = self.wave.on_request(req.current_wave)
        if start is not None:
            self._send_outputs(EngineCoreOutputs(start_wave=start), TO_COORDINATOR)
        if (
            shell is not None
            and not shell.accepts_new_requests
            and isinstance(req, EngineCoreRequest)
        ):
            shell.bounce(req.request_id)  # leaving: it migrates to a survivor (race 6)
            return
        super()._add_request(req)

    def _start_wave(self, msg: StartDPWave) -> None:
        if self.shell is not None and not self.shell.serving:
            return  # a joiner takes the group's wave at its commit
        if self.group_failed is not None:
            return  # frozen until the recovery's commit (see _add_request)
        self.wave.on_start_wave(msg)

    # ---- elastic EP: what the shell asks of the busy loop ------------------------------

    def _take_rank(self, topology: Topology, wave: int | None) -> None:
        self.addresses.topology = topology  # dp_rank is the position here from now on
        self.group_failed = None  # new groups: step again
        self.step_counter = 0  # the all-reduce cadence restarts together on the new group
        self._last_published = None  # tell the coordinator our load in the new epoch
        if wave is not None:  # a joiner: run the group's wave
            self.wave.wave = wave
            self.wave.running = True

    def _ensure_wave_running(self) -> None:
        if not self.wave.running and not self.paused:
            self._run_wave()

    def _publish_load_if_changed(self) -> None:
        """Send the coordinator this rank's stats when (waiting, running) changed, or when
        the generated-token counter advanced and the last publication is at least 0.5 s
        old: a rank decoding steadily keeps its load, but the dashboard's per-rank
        tokens/s needs the counter (at most 2 extra messages a second, never per step)."""
        sched = self.engine_core.scheduler
        load = (sched.num_waiting, sched.num_running)
        tokens = sched.num_generation_tokens_total
        last_tokens, last_t = self._tokens_published
        if load == self._last_published and (
            tokens == last_tokens or time.monotonic() - last_t < 0.5
        ):
            return
        self._last_published = load
        self._tokens_published = (tokens, time.monotonic())
        self._send_outputs(EngineCoreOutputs(scheduler_stats=sched.make_stats()), TO_COORDINATOR)


class _ShellHooks:
    """``EngineHooks`` for the shell: the busy loop's side, on its own thread (except
    ``post_input``, which helper threads call)."""

    def __init__(self, proc: DPEngineCoreProc) -> None:
        self.proc = proc

    def unfinished_request_ids(self) -> list[str]:
        return self.proc.engine_core.scheduler.unfinished_request_ids()

    def remove_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.proc.engine_core.abort_requests(request_ids)

    def ensure_wave_running(self) -> None:
        self.proc._ensure_wave_running()

    def current_wave(self) -> int:
        return self.proc.wave.wave

    def take_rank(self, topology: Topology, wave: int | None) -> None:
        self.proc._take_rank(topology, wave)

    def send_report(self, report: ScaleReport) -> None:
        self.proc._send_outputs(EngineCoreOutputs(scale_report=report))

    def post_input(self, item: Input) -> None:
        self.proc.input_queue.put_nowait((EngineCoreRequestType.SCALE, item))

    def leave(self) -> None:
        self.proc._leaving = True
