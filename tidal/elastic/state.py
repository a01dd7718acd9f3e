"""``ElasticEPScalingState``: one engine's part in one elastic EP operation (docs/architecture.md#elastic-protocol).

Pure: no sockets, threads, clocks or torch. The busy loop holds a ``ScaleSlot``
(``tidal.elastic.scale_slot``, which also states the busy-loop contract): it hands it
every elastic message, calls ``slot.progress(now, num_unfinished=...)`` once per
iteration at step 2 and carries out the returned actions in order; the slot creates one
``ElasticEPScalingState`` per ``ScalePrepare`` (a joining engine is started with its
PREPARE) and starts the next one only once the previous one is done. Nothing here
blocks: rendezvous, expert transfers and the standby barrier run on a helper thread,
started by ``Start*`` actions and reported back as ``JobDone`` / ``JobFailed`` inputs.
The inputs, actions and enums are in ``tidal.elastic.scale_events``.

Roles and phases (each engine derives its role from the ``ScalePrepare``)::

  survivor  IDLE -> PREPARING ----------------------> READY_TO_COMMIT -> COMMITTING -> DONE
  leaving   IDLE -> DRAINING -> MIGRATING ----------> READY_TO_COMMIT -> COMMITTING -> LEAVING
  joining   IDLE -> JOINING -> RECEIVING_EXPERTS ---> READY_TO_COMMIT -> COMMITTING -> SERVING
            every phase before COMMITTING -> ROLLED_BACK (failure, abort, timeout)
            COMMITTING -> FAILED (the busy loop never confirmed the commit: fatal)

- PREPARING / JOINING: join the standby groups of epoch + 1 (job RENDEZVOUS; they span the
  old and new members so experts can move between them). PREPARING / RECEIVING_EXPERTS /
  MIGRATING: send and receive experts (job TRANSFER, in the plan's order; received
  experts are staged, the serving weights do not change before the commit).
- DRAINING: a leaving engine accepts no new request (``accepts_new_requests``; one that
  arrives anyway is handed back at once) and finishes its own for up to ``drain_timeout``;
  then MIGRATING: ``HandBackRequests`` -- the busy loop takes every unfinished request
  out of the scheduler and feeds ``HandedBack(ids)``, reported as HANDED_BACK so the
  frontend resumes them on a survivor (docs/architecture.md#elastic-migration).
- READY_TO_COMMIT: reported PREPARED; waits for the frontend's ``ScaleCommit`` (as long
  as the others may still prepare), then raises its commit flag (below) and waits
  ``commit_timeout_s`` for the consensus.
- COMMITTING: the commit actions are out (swap groups, install the expert map, take the
  new rank, re-divide threads, destroy the old groups); ``CommitApplied`` -> COMMITTED.

Every phase has a deadline (``next_deadline()``): a timeout rolls back with its cause in
the FAILED report -- except DRAINING, whose deadline is the drain timeout (-> MIGRATING),
and COMMITTING, whose timeout is fatal (``Fatal``: some commit actions may have run).

Commit consensus: every rank switches at the same step, or none
-------------------------------------------------------------------
The current DP group's periodic all-reduce (busy-loop step 5) carries one more number per
rank, read from ``consensus_value`` at the moment of the all-reduce: the operation's
``sequence`` if the rank is in READY_TO_COMMIT *and* has the frontend's ``ScaleCommit``,
else 0 (also for a rank with no active state). The group reduces it twice, MIN and MAX,
and the busy loop feeds the result back as ``Consensus(step, ready_min, ready_max)``,
which ``progress`` applies before any other input of that call. ``ready_min == ready_max
== sequence`` means every current member raised the flag of *this* operation: every
member sees the same result at the same step and commits there (survivors and leaving
ranks alike). Anything else: keep waiting, until the READY_TO_COMMIT deadline. The
sequence (not a bool) makes a flag still raised for an older, rolled-back operation --
whose ABORT that rank has not read yet -- unable to complete a newer one's consensus.

The survivors' first collective on the new group is ``NewGroupBarrier`` (carrying the
wave and the step), which matches the barrier the joiners posted (job COMMIT_BARRIER)
right after they reported PREPARED: joiners commit when it completes, at that step, and
take the group's wave.

So *whether* to commit is decided in one place -- the all-reduce -- whose result is the
same on every rank. The one assumption: a rank dying *inside* that all-reduce makes it
fail on every survivor rather than succeed on some; that holds for gloo's and NCCL's
algorithms except for a death in the last exchange, and that residual case ends as a
rank death in whichever epoch each survivor holds, which docs/architecture.md#faults handles.

When the current group cannot all-reduce (a member is dead: an emergency scale-down,
``ScalePrepare.dead``) the consensus is the standby barrier itself: every new member
posts COMMIT_BARRIER only with the frontend's ``ScaleCommit`` (joiners too: with every
old engine dead nobody else would wait for it); it completes only when all have posted,
and a rank that gives up before posting destroys its standby groups, which fails the
barrier for the others. A rank that has posted waits for the barrier's own
result (its collective timeout); it never gives up on a timer of its own. Leaving
engines then never commit by themselves: the frontend stops them once the outcome is known.

Rollback reaches every rank by the frontend's ``ScaleAbort``, which it sends on the first
FAILED or ROLLED_BACK report while the outcome is open; that is safe even after its
``ScaleCommit``: an engine that reported a failure contributes 0, so no consensus for the
operation can complete, and a rank that reads the ABORT lowers its flag before the next
all-reduce. Each rank's own deadlines are the second way out.

Races (and why each is harmless)
--------------------------------
1. A local timeout or ABORT in the iteration of the all-reduce: progress (step 2) and
   the all-reduce (step 5) run on one thread, so the value read at the all-reduce already
   reflects a rollback of that iteration; and the result is applied before any input or
   deadline of the next call, so once all ranks were ready a late timeout cannot undo it.
2. A flag of an older operation still raised (its ABORT unread): values differ, no
   consensus; that rank reads the ABORT (FIFO, before the next PREPARE) and lowers it.
3. Survivors roll back while a joiner waits in the barrier: the standby groups are
   destroyed and the joiner's barrier fails (``JobFailed``) -> ROLLED_BACK; the
   frontend's ABORT is a second way out; the frontend stops the joiner anyway.
4. A joiner dies after PREPARED, or its barrier times out: with the current group's
   consensus the joiner has no say in the outcome -- the survivors may still commit,
   and their ``NewGroupBarrier`` then fails: a rank death in the new epoch (docs/architecture.md#faults), never
   a split commit. So the frontend does not roll back on a joiner's failure once it
   sent COMMIT (it stops that joiner; if the others commit it is a dead member), and the
   joiner's barrier timeout is long (the whole prepare of the others plus the commit).
5. A current member dies during prepare: the current group's collectives fail on the
   others (``OldGroupFailed``) before any consensus -> everyone rolls back.
6. Requests at a leaving rank: the frontend stops routing to it before it sends the
   PREPARE on the same FIFO socket; a request from another frontend arriving later is
   handed back at once (``accepts_new_requests``); a request that finishes while being
   handed back has sent its finish before the hand-back report on the same stream.
7. Messages of another operation (a late ABORT or COMMIT of a rolled-back one, a
   ``JobDone`` of a cancelled job) are ignored and counted.
8. The next PREPARE arrives before the previous state is done: the frontend starts the
   next operation once the previous one ended for *it*, so the previous ABORT and the
   next PREPARE (and even its ABORT) can come in one input drain. ``ScaleSlot`` gives
   the queued inputs to the previous state first and keeps the next operation's COMMIT /
   ABORT with its PREPARE; it never drops a PREPARE (the frontend would wait for a
   PREPARED that cannot come) nor lets one operation's message reach another's state.
9. The operation ends while a hand-back is owed (HandBackRequests out, HandedBack not in):
   the state stays active until it has reported the ids -- dropping it would lose those
   requests, which are in no scheduler any more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import assert_never

from tidal.elastic.scale_events import (
    PRE_COMMIT,
    TERMINAL,
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
    JobKind,
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
from tidal.protocol.elastic import (
    ScaleAbort,
    ScaleCommit,
    ScaleEvent,
    ScalePrepare,
    ScaleReport,
)

# --------------------------------------------------------------------------- machine


class ElasticEPScalingState:
    """One engine's part in operation ``prepare.operation_id``; see the module docstring.

    ``current_epoch``: the epoch this engine serves (None for a joiner); a PREPARE that
    is not for ``current_epoch + 1`` fails at once (stale)."""

    def __init__(self, engine_id: int, prepare: ScalePrepare, *, current_epoch: int | None = None):
        topo = prepare.topology
        if engine_id in prepare.joining:
            self.role = Role.JOINING
        elif engine_id in prepare.leaving:
            self.role = Role.LEAVING
        elif engine_id in topo:
            self.role = Role.SURVIVOR
        else:
            raise ValueError(
                f"engine {engine_id} has no part in operation {prepare.operation_id!r} "
                f"(new engines {topo.engine_ids}, leaving {prepare.leaving})"
            )
        if prepare.sequence < 1:
            raise ValueError(f"operation sequence must be >= 1, got {prepare.sequence}")
        self.engine_id = engine_id
        self.prepare = prepare
        self.operation_id = prepare.operation_id
        self.sequence = prepare.sequence
        self.epoch = topo.epoch  # the new epoch
        self.current_epoch = current_epoch  # what this engine serves (joiner: None)
        self.phase = ScalingPhase.IDLE
        self.deadline: float | None = None  # of the current phase
        self.cause: str | None = None
        self.commit_step: int | None = None
        self.commit_allowed = False
        self.requests_handed_back = 0
        self.ignored_inputs = 0  # of another operation, or of cancelled jobs (race 7)
        self.timeline: list[tuple[ScalingPhase, float]] = []
        self._jobs: dict[str, tuple[JobKind, float]] = {}  # running: kind, deadline
        self._transferred = False
        self.bytes_received: int | None = None  # measured by the transfer job
        # A ``HandBackRequests`` is out and its ``HandedBack`` not yet in: stay active even
        # if the operation ends meanwhile, or the hand-back report (and the requests in
        # it) would be lost with the dropped state.
        self._handback_pending = False

    # ---------------------------------------------------------------- properties

    @property
    def old_mode(self) -> bool:
        """The commit consensus runs on the current group's all-reduce (else on the
        standby barrier: a member of the current group is dead)."""
        return self.prepare.old_group_usable

    @property
    def active(self) -> bool:
        """The busy loop keeps calling ``progress`` while True."""
        return self.phase not in TERMINAL or self._handback_pending

    @property
    def accepts_new_requests(self) -> bool:
        """False for a leaving engine from the PREPARE on (new arrivals are handed back
        at once), True again once it rolled back."""
        return self.role is not Role.LEAVING or self.phase is ScalingPhase.ROLLED_BACK

    @property
    def consensus_value(self) -> int:
        """This rank's entry in the current group's consensus all-reduce (MIN and MAX)."""
        ready = (
            self.old_mode
            and self.role is not Role.JOINING
            and self.phase is ScalingPhase.READY_TO_COMMIT
            and self.commit_allowed
        )
        return self.sequence if ready else 0

    @property
    def holds_wave(self) -> bool:
        """OR this into ``has_unfinished``: the wave, and with it the consensus rounds,
        must not stop while this rank waits for the consensus."""
        return (
            self.old_mode
            and self.role is not Role.JOINING
            and self.phase is ScalingPhase.READY_TO_COMMIT
        )

    @property
    def barrier_posted(self) -> bool:
        return any(k is JobKind.COMMIT_BARRIER for k, _ in self._jobs.values())

    def next_deadline(self) -> float | None:
        """When ``progress`` next has a timer to check (the busy loop must not block
        past it)."""
        times = [d for _, d in self._jobs.values()]
        if self.deadline is not None:
            times.append(self.deadline)
        return min(times, default=None)

    # ---------------------------------------------------------------- progress

    def progress(
        self, now: float, inputs: Sequence[Input] = (), *, num_unfinished: int = 0
    ) -> list[Action]:
        """Apply ``inputs`` (consensus and barrier results first: race 1), advance, check
        deadlines.
        ``num_unfinished``: requests in this engine's scheduler now."""
        out: list[Action] = []
        if self.phase is ScalingPhase.IDLE:
            self._start(now, out)
        for inp in sorted(inputs, key=lambda i: not self._decides(i)):
            self._on_input(inp, now, out)
        self._advance(now, num_unfinished, out)
        self._check_deadlines(now, out)
        return out

    def _decides(self, inp: Input) -> bool:
        """A consensus result (all-reduce or barrier) is applied before anything else."""
        if isinstance(inp, Consensus):
            return True
        job = self._jobs.get(inp.job_id) if isinstance(inp, JobDone) else None
        return job is not None and job[0] is JobKind.COMMIT_BARRIER

    # ---------------------------------------------------------------- transitions

    def _enter(self, phase: ScalingPhase, now: float, timeout: float | None) -> None:
        self.phase = phase
        self.deadline = None if timeout is None else now + timeout
        self.timeline.append((phase, now))

    def _start(self, now: float, out: list[Action]) -> None:
        p = self.prepare
        first = {
            Role.SURVIVOR: (ScalingPhase.PREPARING, p.rendezvous_timeout_s + p.transfer_timeout_s),
            Role.LEAVING: (ScalingPhase.DRAINING, p.drain_timeout_s),
            Role.JOINING: (ScalingPhase.JOINING, p.rendezvous_timeout_s),
        }
        self._enter(*first[self.role], now)
        if (
            self.role is not Role.JOINING
            and self.current_epoch is not None
            and self.epoch != self.current_epoch + 1
        ):
            cause = (
                f"stale prepare: operation {self.operation_id!r} is for epoch {self.epoch}, "
                f"this engine serves epoch {self.current_epoch}"
            )
            self._rollback(now, out, cause, failed=True)
            return
        dead = set(p.dead)
        participants = tuple(e for e in (*_old_members(p), *p.joining) if e not in dead)
        self._start_job(
            JobKind.RENDEZVOUS,
            now,
            p.rendezvous_timeout_s,
            out,
            lambda job_id: StartRendezvous(
                job_id,
                self.epoch,
                p.topology.store_address,
                tuple(p.topology.engine_ids),
                participants,
                p.rendezvous_timeout_s,
            ),
        )

    def _start_job(
        self,
        kind: JobKind,
        now: float,
        timeout: float,
        out: list[Action],
        make: Callable[[str], Action],
    ) -> None:
        job_id = f"{self.operation_id}/{self.engine_id}/{kind.name.lower()}"
        if job_id in self._jobs:
            return
        # A posted barrier is answered by its own collective timeout; twice that is the
        # backstop for a helper that never answers (see ``_check_deadlines``).
        self._jobs[job_id] = (kind, now + timeout * (2 if kind is JobKind.COMMIT_BARRIER else 1))
        out.append(make(job_id))

    def _report(self, event: ScaleEvent, out: list[Action], **kw: object) -> None:
        report = ScaleReport(
            operation_id=self.operation_id,
            engine_id=self.engine_id,
            epoch=self.epoch,
            event=event,
            **kw,  # type: ignore[arg-type]
        )
        out.append(SendReport(report))

    def _mine(self, operation_id: str, epoch: int) -> bool:
        if operation_id == self.operation_id and epoch == self.epoch:
            return True
        self.ignored_inputs += 1  # race 7
        return False

    def _on_input(self, inp: Input, now: float, out: list[Action]) -> None:
        match inp:
            case Consensus():
                self._on_consensus(inp, now, out)
            case ScaleCommit():
                if self._mine(inp.operation_id, inp.epoch):
                    self.commit_allowed = True
                    if self.phase is ScalingPhase.READY_TO_COMMIT:
                        self.deadline = now + self.prepare.commit_timeout_s
                    if (
                        self._posts_barrier_on_commit()
                        and self.phase is ScalingPhase.READY_TO_COMMIT
                    ):
                        self._start_barrier(now, out)
            case ScaleAbort():
                if self._mine(inp.operation_id, inp.epoch) and self.phase in PRE_COMMIT:
                    cause = f"aborted by the frontend: {inp.cause}"
                    self._rollback(now, out, cause, failed=False)
            case JobDone():
                self._on_job_done(inp, now, out)
            case JobFailed():
                if self._jobs.pop(inp.job_id, None) is None:
                    self.ignored_inputs += 1  # cancelled or unknown (race 7)
                elif self.phase in PRE_COMMIT:
                    self._rollback(now, out, inp.cause, failed=True)
            case OldGroupFailed():
                if self.old_mode and self.role is not Role.JOINING and self.phase in PRE_COMMIT:
                    self._rollback(now, out, f"DP group failed: {inp.cause}", failed=False)
            case HandedBack():
                self._handback_pending = False
                if inp.request_ids:
                    self.requests_handed_back += len(inp.request_ids)
                    ids = list(inp.request_ids)
                    self._report(ScaleEvent.HANDED_BACK, out, request_ids=ids)
            case CommitApplied():
                if self.phase is ScalingPhase.COMMITTING:
                    self._committed(now, out)
                else:
                    self.ignored_inputs += 1
            case _:
                assert_never(inp)

    def _on_consensus(self, c: Consensus, now: float, out: list[Action]) -> None:
        if not self.old_mode or self.role is Role.JOINING:
            return  # this rank's commit is decided by the standby barrier
        if not (c.ready_min == c.ready_max == self.sequence):
            return  # someone is not ready (or ready for another operation): keep waiting
        if self.consensus_value != self.sequence:  # MIN includes this rank's value
            raise RuntimeError(
                f"consensus says every rank is ready for operation {self.sequence} at step "
                f"{c.step}, but engine {self.engine_id} was not (phase {self.phase.name}): "
                "the busy loop fed a result that does not include this rank"
            )
        self._commit(c.step, None, now, out)

    def _on_job_done(self, d: JobDone, now: float, out: list[Action]) -> None:
        job = self._jobs.pop(d.job_id, None)
        if job is None or self.phase not in PRE_COMMIT:
            self.ignored_inputs += 1  # cancelled / unknown (race 7)
            return
        kind, _ = job
        p, me = self.prepare, self.engine_id
        if kind is JobKind.RENDEZVOUS:
            if self.role is Role.JOINING:
                self._enter(ScalingPhase.RECEIVING_EXPERTS, now, p.transfer_timeout_s)
            self._start_job(
                JobKind.TRANSFER,
                now,
                p.transfer_timeout_s,
                out,
                lambda job_id: StartTransfer(
                    job_id,
                    self.epoch,
                    tuple(t for t in p.transfers if t.src_engine_id == me),
                    tuple(t for t in p.transfers if t.dst_engine_id == me),
                    p.transfer_timeout_s,
                ),
            )
        elif kind is JobKind.TRANSFER:
            self._transferred = True
            if isinstance(d.result, int):  # what the helper staged, measured
                self.bytes_received = d.result
        else:  # COMMIT_BARRIER completed: every new member posted it
            r = d.result
            if not isinstance(r, BarrierResult):
                raise TypeError(f"a commit barrier's result is a BarrierResult, got {r!r}")
            self._commit(r.step, r.wave, now, out)

    def _advance(self, now: float, num_unfinished: int, out: list[Action]) -> None:
        if self.phase is ScalingPhase.DRAINING and (
            num_unfinished == 0 or (self.deadline is not None and now >= self.deadline)
        ):
            self._enter(ScalingPhase.MIGRATING, now, self.prepare.transfer_timeout_s)
        if self.phase is ScalingPhase.MIGRATING and num_unfinished > 0:
            if not self._handback_pending:
                self._handback_pending = True
                out.append(HandBackRequests())  # whatever is unfinished now
            return
        # A leaving engine is prepared once its sends are done and its hand-back reported
        # (before PREPARED, so the frontend has the ids before it may commit).
        if (
            self._transferred
            and not self._handback_pending
            and self.phase
            in (ScalingPhase.PREPARING, ScalingPhase.MIGRATING, ScalingPhase.RECEIVING_EXPERTS)
        ):
            self._ready(now, out)

    def _ready(self, now: float, out: list[Action]) -> None:
        p = self.prepare
        # Until the COMMIT comes, the others may still be draining and moving experts;
        # the consensus itself gets ``commit_timeout_s`` from the COMMIT on.
        self._enter(ScalingPhase.READY_TO_COMMIT, now, _others_prepare(p) + p.commit_timeout_s)
        if self.commit_allowed:
            self.deadline = now + p.commit_timeout_s
        received = [t for t in p.transfers if t.dst_engine_id == self.engine_id]
        measured = self.bytes_received
        self._report(
            ScaleEvent.PREPARED,
            out,
            experts_received=len(received),
            bytes_received=sum(t.nbytes for t in received) if measured is None else measured,
        )
        if self.old_mode and self.role is Role.JOINING:
            self._start_barrier(now, out)  # the survivors decide; it follows (race 3)
        elif self.old_mode:
            out.append(EnsureWaveRunning())
        elif self._posts_barrier_on_commit() and self.commit_allowed:
            self._start_barrier(now, out)

    def _posts_barrier_on_commit(self) -> bool:
        """Standby consensus: the barrier *is* the decision, so every new member posts it
        only with the frontend's COMMIT in hand (with no survivor at all -- every old
        engine dead -- nobody else would wait for it)."""
        return not self.old_mode and self.role is not Role.LEAVING

    def _start_barrier(self, now: float, out: list[Action]) -> None:
        p = self.prepare
        if self.role is Role.JOINING and self.old_mode:
            # It posts as soon as it is prepared; the others may still be draining and
            # moving experts, then comes COMMIT and a consensus round. The frontend's
            # ABORT, or the survivors destroying the standby groups, ends it sooner.
            timeout = _others_prepare(p) + 3 * p.commit_timeout_s
        else:
            timeout = p.commit_timeout_s
        self._start_job(
            JobKind.COMMIT_BARRIER,
            now,
            timeout,
            out,
            lambda job_id: StartCommitBarrier(job_id, self.epoch, timeout),
        )

    def _commit(self, step: int, wave: int | None, now: float, out: list[Action]) -> None:
        p, topo = self.prepare, self.prepare.topology
        self.commit_step = step
        self._enter(ScalingPhase.COMMITTING, now, p.commit_timeout_s)
        for job_id in self._jobs:  # nothing should run now; abandon a stray job
            out.append(CancelJob(job_id))
        self._jobs.clear()
        old_epoch = self.epoch - 1
        if self.role is Role.LEAVING:
            out += [DestroyOldGroups(old_epoch), DestroyStandbyGroups(self.epoch)]
            return
        rank = topo.rank_of(self.engine_id)
        local = tuple(topo.placement[rank]) if topo.placement is not None else ()
        out += [
            SwapGroups(self.epoch),
            InstallExperts(self.epoch, local),
            # Joiners take the group's wave; so does everyone after a standby-barrier
            # commit (the old group broke mid-wave on some ranks, not on others: every
            # new member runs the barrier's wave, and its first all-reduce ends it).
            TakeRank(self.epoch, rank, topo.size, None if self._keeps_wave() else wave),
        ]
        if p.threads_per_rank is not None:
            out.append(SetNumThreads(p.threads_per_rank))
        if self.role is Role.SURVIVOR:
            out.append(DestroyOldGroups(old_epoch))
            if self.old_mode:
                out.append(NewGroupBarrier(self.epoch, step))

    def _keeps_wave(self) -> bool:
        return self.old_mode and self.role is not Role.JOINING

    def _committed(self, now: float, out: list[Action]) -> None:
        self.current_epoch = self.epoch
        self._report(ScaleEvent.COMMITTED, out, step=self.commit_step)
        if self.role is Role.LEAVING:
            self._enter(ScalingPhase.LEAVING, now, None)
            self._report(ScaleEvent.LEFT, out)
            out.append(Leave())
        else:
            done = ScalingPhase.SERVING if self.role is Role.JOINING else ScalingPhase.DONE
            self._enter(done, now, None)

    def _rollback(self, now: float, out: list[Action], cause: str, *, failed: bool) -> None:
        self.cause = cause
        for job_id in self._jobs:
            out.append(CancelJob(job_id))
        self._jobs.clear()
        out.append(DestroyStandbyGroups(self.epoch))
        if self.role is not Role.LEAVING:
            out.append(DiscardStagedExperts(self.epoch))
        self._enter(ScalingPhase.ROLLED_BACK, now, None)
        self._report(ScaleEvent.FAILED if failed else ScaleEvent.ROLLED_BACK, out, cause=cause)

    def _check_deadlines(self, now: float, out: list[Action]) -> None:
        if self.phase in TERMINAL:
            return
        p = self.prepare
        for kind, deadline in list(self._jobs.values()):
            if now < deadline:
                continue
            if kind is JobKind.COMMIT_BARRIER:
                # The helper is lost: this rank cannot know whether the others committed,
                # so it must neither serve nor report a rollback (the frontend counts it
                # as a death, which decides nothing).
                self._fatal(now, out, "the commit barrier did not answer within twice its timeout")
                return
            timeout = p.rendezvous_timeout_s if kind is JobKind.RENDEZVOUS else p.transfer_timeout_s
            self._rollback(
                now, out, f"{_JOB_NAMES[kind]} timed out after {timeout:g}s", failed=True
            )
            return
        if self.deadline is None or now < self.deadline:
            return
        if self.phase is ScalingPhase.DRAINING:
            return  # the drain timeout is not a failure: ``_advance`` moved on already
        if self.phase is ScalingPhase.COMMITTING:
            self._fatal(now, out, "the commit was not applied by its deadline")
        elif self.phase is ScalingPhase.READY_TO_COMMIT and self.barrier_posted:
            return  # the barrier's own timeout decides (module docstring)
        else:
            self._rollback(now, out, _PHASE_TIMEOUTS[self.phase], failed=True)

    def _fatal(self, now: float, out: list[Action], cause: str) -> None:
        self.cause = cause
        self._enter(ScalingPhase.FAILED, now, None)
        out.append(Fatal(f"engine {self.engine_id}: {cause}"))


_JOB_NAMES = {
    JobKind.RENDEZVOUS: "standby group rendezvous",
    JobKind.TRANSFER: "expert transfer",
    JobKind.COMMIT_BARRIER: "commit barrier",
}
_PHASE_TIMEOUTS = {
    ScalingPhase.PREPARING: "prepare (rendezvous + expert transfer) timed out",
    ScalingPhase.JOINING: "standby group rendezvous timed out",
    ScalingPhase.RECEIVING_EXPERTS: "expert transfer timed out",
    ScalingPhase.MIGRATING: "hand-back and expert sends timed out",
    ScalingPhase.READY_TO_COMMIT: "no commit consensus before the commit timeout",
}


def _others_prepare(p: ScalePrepare) -> float:
    """How long the slowest other participant may still be preparing."""
    return p.drain_timeout_s + p.rendezvous_timeout_s + p.transfer_timeout_s


def _old_members(p: ScalePrepare) -> tuple[int, ...]:
    """Members of the current topology: the new one's survivors plus the leaving ones."""
    new = set(p.joining)
    return (*(e for e in p.topology.engine_ids if e not in new), *p.leaving)
