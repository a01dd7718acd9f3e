"""The engine's I/O shell around elastic EP (docs/architecture.md#elastic-protocol): carries out what the pure
``ScaleSlot`` / ``ElasticEPScalingState`` (``tidal.elastic``) decide.

The busy loop (``dp_proc.DPEngineCoreProc``) owns one ``ElasticShell`` and follows the
contract in ``tidal.elastic.scale_slot``:

- step 1: SCALE frames and helper-thread results go to ``deliver`` (both arrive on the
  engine's one input queue, so a finished job wakes an idle loop at once);
- step 2: ``progress()`` runs the state and carries out its actions in order: blocking
  work (group rendezvous, expert transfers, the standby barrier) runs on a helper thread
  whose ``JobDone`` / ``JobFailed`` comes back through the input queue; everything that
  touches the serving groups or weights runs here, on the busy loop's thread;
- step 5: the DP all-reduce carries ``consensus_value`` (MIN and MAX) and ``holds_wave``;
  ``on_consensus`` / ``on_group_failed`` feed the result back.

Feedback the state needs within the same step (``HandedBack`` after a hand-back,
``CommitApplied`` after the commit actions) is delivered and progressed at once, so a
leaving engine never steps again after it destroyed its groups, and a survivor's first
step after the commit already runs on the new groups.

Why a late helper result is safe: a job the state cancelled (rollback, commit) may still
finish -- its groups were created after ``destroy_standby`` ran. The shell remembers the
epochs of cancelled jobs and destroys their standby groups and staged experts again
once the thread has ended, unless that epoch was committed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol, assert_never

from tidal.distributed.groups import GroupFailure
from tidal.elastic.scale_events import (
    Action,
    BarrierResult,
    CancelJob,
    CommitApplied,
    Consensus,
    DestroyOldGroups,
    DestroyStandbyGroups,
    DiscardStagedExperts,
    EnsureWaveRunning,
    Fatal,
    HandBackRequests,
    HandedBack,
    Input,
    InstallExperts,
    JobDone,
    JobFailed,
    Leave,
    NewGroupBarrier,
    OldGroupFailed,
    Role,
    ScalingPhase,
    SendReport,
    SetNumThreads,
    StartCommitBarrier,
    StartRendezvous,
    StartTransfer,
    SwapGroups,
    TakeRank,
)
from tidal.elastic.scale_slot import ScaleSlot
from tidal.elastic.state import ElasticEPScalingState
from tidal.executor.base import Executor
from tidal.protocol.elastic import ScaleMessage, ScaleReport
from tidal.protocol.topology import Topology

logger = logging.getLogger(__name__)

# Commit actions: after them the state needs ``CommitApplied`` in the same step.
_COMMIT_ACTIONS = (SwapGroups, InstallExperts, TakeRank, SetNumThreads, DestroyOldGroups)


class EngineHooks(Protocol):
    """What the shell needs from the busy loop that owns it."""

    def unfinished_request_ids(self) -> list[str]: ...

    def remove_requests(self, request_ids: list[str]) -> None:
        """Take them out of the scheduler (blocks freed), no finish output."""

    def ensure_wave_running(self) -> None: ...

    def current_wave(self) -> int: ...

    def take_rank(self, topology: Topology, wave: int | None) -> None:
        """Serve ``topology`` from now on (rank = position there); reset the all-reduce
        cadence; ``wave``: adopt it and run (a joiner)."""

    def send_report(self, report: ScaleReport) -> None: ...

    def post_input(self, item: Input) -> None:
        """Put a helper's result on the busy loop's input queue (thread-safe)."""

    def leave(self) -> None:
        """Stop serving and exit once the outputs are flushed."""


class ElasticShell:
    def __init__(
        self,
        engine_id: int,
        current_epoch: int | None,
        executor: Executor,
        hooks: EngineHooks,
        *,
        expert_parallel: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine_id = engine_id
        self.slot = ScaleSlot(engine_id, current_epoch)
        self.executor = executor
        self.hooks = hooks
        self.expert_parallel = expert_parallel
        self.clock = clock
        self._threads: dict[str, tuple[threading.Thread, int]] = {}  # job -> (thread, epoch)
        self._cancelled_epochs: dict[str, int] = {}  # cancelled job -> its epoch
        self._committed_epochs: set[int] = set()
        # A collective of the (new) serving groups failed inside a commit action: for the
        # busy loop to handle (``take_group_failure``) after the commit completed.
        self.group_failure: str | None = None

    # ---- queries for the busy loop ------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.slot.active

    @property
    def accepts_new_requests(self) -> bool:
        return self.slot.accepts_new_requests

    @property
    def consensus_value(self) -> int:
        return self.slot.consensus_value

    @property
    def holds_wave(self) -> bool:
        return self.slot.holds_wave

    @property
    def old_group_dead(self) -> bool:
        """The running operation removes a dead member or rebuilds failed groups
        (docs/architecture.md#faults): the current groups cannot run a collective any more, so this
        rank must not step on them."""
        s = self.slot.state
        return s is not None and s.active and not s.old_mode and s.role is not Role.JOINING

    @property
    def serving(self) -> bool:
        """False for a joiner until it committed: it is in no group and must not step."""
        return self.slot.current_epoch is not None

    def take_group_failure(self) -> str | None:
        cause, self.group_failure = self.group_failure, None
        return cause

    # ---- inputs -------------------------------------------------------------------------

    def deliver(self, msg: ScaleMessage | Input) -> None:
        self.slot.deliver(msg)

    def bounce(self, request_id: str) -> None:
        """An ADD reached this engine while it leaves: hand it back unscheduled."""
        self.slot.deliver(HandedBack((request_id,)))

    def on_consensus(self, step: int, ready_min: int, ready_max: int) -> None:
        self.slot.deliver(Consensus(step, ready_min, ready_max))
        self.progress()

    def on_group_failed(self, cause: str) -> None:
        self.slot.deliver(OldGroupFailed(cause))
        self.progress()

    # ---- step 2 -------------------------------------------------------------------------

    def progress(self) -> None:
        self._reap_threads()
        if not self.slot.active and not self.slot.has_inputs:
            return
        for _ in range(8):  # feedback rounds (hand-back, commit) within one step
            state = self.slot.state
            actions = self.slot.progress(
                self.clock(), num_unfinished=len(self.hooks.unfinished_request_ids())
            )
            feedback = self._run(actions, self.slot.state or state)
            if not feedback:
                return
            for item in feedback:
                self.slot.deliver(item)

    def _run(self, actions: list[Action], state: ElasticEPScalingState | None) -> list[Input]:
        feedback: list[Input] = []
        for a in actions:
            self._carry_out(a, state, feedback)
        committed = any(isinstance(a, _COMMIT_ACTIONS) for a in actions)
        if committed and state is not None and state.phase is ScalingPhase.COMMITTING:
            feedback.append(CommitApplied())
        return feedback

    def _carry_out(
        self, a: Action, state: ElasticEPScalingState | None, feedback: list[Input]
    ) -> None:
        prepare = None if state is None else state.prepare
        match a:
            case StartRendezvous():
                self._start_job(
                    a.job_id,
                    a.epoch,
                    lambda a=a: self.executor.call(
                        "elastic.join_standby",
                        a.epoch,
                        a.store_address or "",
                        list(a.members),
                        list(a.participants),
                        self.engine_id,
                        a.timeout_s,
                    ),
                )
            case StartTransfer():
                # Snapshot what we send here, on the thread that owns the weights.
                self.executor.call("elastic.pack_expert_sends", a.epoch, list(a.sends))
                self._start_job(
                    a.job_id,
                    a.epoch,
                    lambda a=a: self.executor.call(
                        "elastic.transfer_experts",
                        a.epoch,
                        list(a.sends),
                        list(a.receives),
                        self.engine_id,
                        a.timeout_s,
                    ),
                )
            case StartCommitBarrier():
                # MAX over the new members: a joiner's 0 never wins over a survivor's wave.
                wave = self.hooks.current_wave()
                self._start_job(
                    a.job_id,
                    a.epoch,
                    lambda a=a, w=wave: BarrierResult(
                        *self.executor.call("elastic.standby_barrier", a.epoch, w, 0)
                    ),
                )
            case CancelJob():
                entry = self._threads.get(a.job_id)
                if entry is not None:
                    self._cancelled_epochs[a.job_id] = entry[1]
            case EnsureWaveRunning():
                self.hooks.ensure_wave_running()
            case HandBackRequests():
                ids = self.hooks.unfinished_request_ids()
                self.hooks.remove_requests(ids)
                feedback.append(HandedBack(tuple(ids)))
            case SendReport():
                self.hooks.send_report(a.report)
            case DestroyStandbyGroups():
                self.executor.call("elastic.destroy_standby", a.epoch)
            case DiscardStagedExperts():
                self.executor.call("elastic.discard_staged", a.epoch)
            case SwapGroups():
                self.executor.call("elastic.swap_groups", a.epoch)
            case InstallExperts():
                topo = prepare.topology if prepare is not None else None
                if self.expert_parallel and topo is not None and topo.placement is not None:
                    rank = topo.rank_of(self.engine_id)
                    self.executor.call("elastic.install_experts", a.epoch, topo.placement, rank)
            case TakeRank():
                if prepare is None:
                    raise RuntimeError("TakeRank without the operation's topology")
                self.hooks.take_rank(prepare.topology, a.wave)
                self._committed_epochs.add(a.epoch)
            case SetNumThreads():
                self.executor.call("worker.set_num_threads", a.num_threads)
            case DestroyOldGroups():
                role = None if state is None else state.role
                if role is Role.LEAVING:
                    self.executor.call("elastic.leave_groups")
                else:
                    self.executor.call("elastic.destroy_retired_groups")
            case NewGroupBarrier():
                # The first collective of the new group: matches the joiners' barrier. A
                # joiner that died after PREPARED fails it (state race 4): the commit
                # stands -- it is a rank death of the new epoch -- and the busy loop
                # treats the group as failed once the commit is applied.
                try:
                    self.executor.call(
                        "elastic.standby_barrier", a.epoch, self.hooks.current_wave(), a.step
                    )
                except GroupFailure as e:
                    self.group_failure = str(e)
            case Leave():
                self.hooks.leave()
            case Fatal():
                raise RuntimeError(a.cause)
            case _:
                assert_never(a)

    # ---- helper threads -----------------------------------------------------------------

    def _start_job(self, job_id: str, epoch: int, work: Callable[[], object]) -> None:
        def run() -> None:
            try:
                result = work()
            except Exception as e:  # noqa: BLE001 - reported to the state as the cause
                # torch's store errors carry a C++ backtrace after their first line.
                what = str(e).split("\n", 1)[0]
                logger.warning("engine %d: %s failed: %s", self.engine_id, job_id, what)
                self.hooks.post_input(JobFailed(job_id, f"{type(e).__name__}: {what}"))
                return
            self.hooks.post_input(JobDone(job_id, result))

        t = threading.Thread(target=run, name=f"elastic-{job_id}", daemon=True)
        self._threads[job_id] = (t, epoch)
        t.start()

    def _reap_threads(self) -> None:
        for job_id, (t, epoch) in list(self._threads.items()):
            if t.is_alive():
                continue
            t.join()
            del self._threads[job_id]
            if self._cancelled_epochs.pop(job_id, None) is not None and (
                epoch not in self._committed_epochs
            ):
                # It may have built groups or staged experts after the rollback destroyed
                # them: destroy again now that nothing else can create them.
                self.executor.call("elastic.destroy_standby", epoch)
                self.executor.call("elastic.discard_staged", epoch)

    def close(self, timeout_s: float = 2.0) -> None:
        """At engine exit: standby groups of an unfinished operation go with it."""
        s = self.slot.state
        if s is not None and s.active:
            self.executor.call("elastic.destroy_standby", s.epoch)
        for t, _ in self._threads.values():
            t.join(timeout_s)

    @property
    def num_threads(self) -> int:
        return sum(1 for t, _ in self._threads.values() if t.is_alive())
