"""Runs one elastic EP operation at a time: admission, phases, rollback (docs/architecture.md#elastic).

Pure: no sockets, processes or clocks. ``request_scale(request, now)`` admits an operation
(or answers it is a duplicate or a conflict), ``handle(event, now)`` applies what the
engines and the process manager report, ``tick(now)`` fires deadlines; each returns the
actions to carry out, in order. It owns what is served (``topology``, the members known
``dead``) and the operations' records. *When* to heal after a rank death is not decided
here but by the ``RunnerObserver`` it tells (``HealPolicy``,
``tidal.frontend.scaling.scale_healing``); ``ScaleController`` joins the two. The engines'
side is ``tidal.elastic.state``; the plan ``tidal.elastic.plan``; the messages
``tidal.protocol.elastic``; the events and actions ``tidal.frontend.scaling.scale_events``;
the request, deadlines, phases and record ``tidal.frontend.scaling.scale_records``.

Phases of one operation (each with a deadline; timings are kept in its record)::

    PLANNED --(joiners)--> STARTING_ENGINES --all ready--> PREPARING
    PLANNED --(none)-------------------------------------> PREPARING
    PREPARING --all PREPARED: ScaleCommit--> COMMITTING --first COMMITTED--> (publish)
        --all new members COMMITTED--> FINISHING --leaving engines exited--> SUCCEEDED
    STARTING_ENGINES | PREPARING | COMMITTING (outcome open) --failure--> ROLLED_BACK
    COMMITTING --deadline, no engine reported the outcome--> FAILED (unresolved)

- PLANNED: ``plan_scale`` validated and planned it (``ScalePlanError`` -> HTTP 400, the
  operation is not admitted and occupies nothing).
- STARTING_ENGINES: ``SpawnEngines``; each new engine's startup handshake -> ``EngineStarted``.
- PREPARING: ``ExcludeFromRouting`` (leaving engines) *then* ``SendPrepare`` to every
  participant; leaving engines hand back what they could not finish (``MigrateRequests``).
- COMMITTING: ``ScaleCommit`` sent; the engines decide by consensus (the all-reduced flag,
  see ``tidal.elastic.state``), and the controller *learns* the outcome from the first
  COMMITTED or ROLLED_BACK/FAILED report -- it never guesses it. On COMMITTED it
  publishes the new topology (coordinator, balancer, wave state, ownership table).
- FINISHING: leaving engines are stopped and reaped.

Rollback (docs/architecture.md#elastic-rollback) -- any failure before the outcome is known: ``SendAbort`` (engines destroy
their standby groups and staged experts), ``StopEngines`` for the new engines (their ids
are retired, never reused), ``RestoreRouting`` for the leaving ones; the survivors were
never touched. The caller gets the cause; the controller is idle again at the old
topology, so the next operation starts from a clean state.

A member found dead (``EngineExited`` of a current engine) is recorded and its requests
migrate at once (``MigrateRequests(engine, None)``) -- unless every other live member is
leaving (excluded from routing: the one staying in a scale-down died), then once the
operation's outcome makes one routable again (after the rollback's ``RestoreRouting``,
or the commit's ``PublishTopology``); the next operation removes it
(``dead`` in its plan: no copy is taken from it, the consensus runs on the standby
group), so "scale to the same size" replaces it.

Races, and why each is impossible by construction
-------------------------------------------------
1. An engine dies during prepare: ``EngineExited`` -> rollback; a dead current member
   also has its requests migrated and is removed by the next operation. A prepare can
   never block the next operation (vllm#53947): the rollback leaves nothing pending.
2. An engine dies during commit: the outcome is the engines' consensus, not the
   controller's; it waits for the first report (the others' collectives fail, they roll
   back and say so, or they committed and say so). Only a *decider* -- an engine whose
   flag the consensus needs: a current member, or every new member when the consensus
   runs on the standby barrier -- can make it a rollback once COMMIT is out. A joiner
   that fails after COMMIT has no say (the survivors may still commit): it is stopped,
   and if they commit it is a dead member of the new epoch -- also when its failure is
   reported after the operation ended. A new member that dies after the commit is a
   rank death of the new epoch: recorded dead, requests migrated, replaced next time.
   When every participant is gone or rolled back, no live engine can be serving the
   new epoch whatever the dead did: that settles it as a rollback at once (also for an
   operation whose outcome was unknown -- otherwise it would block every later one).
3. A timeout racing a late success. There is one decision point for "may commit" (the
   controller, which sends ``ScaleCommit`` only with every PREPARED in hand before its
   deadline, otherwise ``ScaleAbort``) and one for "did commit" (the engines' all-reduce).
   A PREPARED after the PREPARING deadline belongs to a finished operation and is
   ignored: no engine can commit without the COMMIT that was never sent. The COMMITTING
   deadline decides nothing: with no report it ends the call FAILED ("outcome unknown")
   and refuses new operations until a report resolves it; a late COMMITTED is then
   adopted (the engines switched, so the topology must follow), a late ROLLED_BACK
   stops the new engines. A failed commit can never leave the API refusing requests
   (vllm#50778): requests are never refused because of scaling at all.
4. A repeated operation id returns the first operation's record (running or finished)
   and starts nothing; a different id while one runs is a conflict (409). Every report
   carries the operation id and epoch: reports of another operation are ignored.
5. Scale-down of a rank with requests in flight: ``ExcludeFromRouting`` comes before
   ``SendPrepare`` on the same FIFO socket, so every request this frontend routed to it
   arrives before the PREPARE; a later one (another frontend) is handed back at once;
   the rest is finished or handed back and migrated (``tidal.elastic.migration``), and
   the ownership table drops the old engine's outputs once the request has moved. A
   HANDED_BACK report is acted on whatever became of its operation: the operation may
   have rolled back while the report was in flight, but the engine stopped those
   requests all the same (the model check found this one).
6. A stale snapshot after the commit (vllm#55772): the topology is published with
   epoch + 1 and every receiver drops snapshots of an older epoch; leaving engines are
   excluded from routing before the prepare and absent from the new topology; engine ids
   are never reused, so a late message of a removed or rolled-back engine can never be
   taken for a member's.
7. Leftovers (vllm#37357, #37131): new engines of a rolled-back operation are stopped,
   leaving engines are stopped and reaped in FINISHING (forced at its deadline), and
   every engine-side exit path destroys its standby or old groups.

The invariant all of this keeps, and that tests/unit/test_scale_controller.py
model-checks under random interleavings and faults: once quiet, what the controller
serves is what the live engines serve (every live member of its topology at its epoch,
no other live engine at any), each operation's engines all switched at one step or none
of the live ones did, epochs only increase, and no request is lost or changed.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol, assert_never

from tidal.elastic.plan import (
    ScalePlan,
    ScalePlanError,
    plan_scale,
    validate_size,
)
from tidal.frontend.scaling.scale_events import (
    Action,
    EngineExited,
    EngineStarted,
    ExcludeFromRouting,
    MigrateRequests,
    PublishTopology,
    RecordResult,
    RequestsMigrated,
    RestoreRouting,
    SendAbort,
    SendCommit,
    SendPrepare,
    SpawnEngines,
    StopEngines,
)
from tidal.frontend.scaling.scale_records import (
    Admission,
    OperationRecord,
    PhaseTiming,
    ScaleOutcome,
    ScalePhase,
    ScaleRequest,
    ScaleResponse,
    ScaleTimeouts,
    ScaleTrigger,
)
from tidal.moe.placement import PlacementStrategy
from tidal.protocol.elastic import (
    ScaleAbort,
    ScaleCommit,
    ScaleEvent,
    ScalePrepare,
    ScaleReport,
)
from tidal.protocol.topology import Topology
from tidal.utils.cpu_threads import threads_per_rank

# What the runner handles; ``RequestsMigrated`` is counted by ``count_migrated``.
RunnerEvent = EngineStarted | EngineExited | ScaleReport


class ServedState(Protocol):
    """What is served, as the runner holds it: read by ``HealPolicy`` to decide."""

    @property
    def topology(self) -> Topology: ...

    @property
    def dead(self) -> set[int]: ...

    @property
    def live_members(self) -> tuple[int, ...]: ...

    @property
    def is_scaling(self) -> bool: ...

    @property
    def current(self) -> OperationRecord | None: ...

    @property
    def history(self) -> Mapping[str, OperationRecord]: ...

    @property
    def num_experts(self) -> int: ...

    def validate(self, new_size: int) -> None: ...


class RunnerObserver(Protocol):
    """What the runner tells the healing policy (``HealPolicy``), at the moment it happens."""

    def admitting(self, request: ScaleRequest, served: ServedState) -> ScaleRequest:
        """A request that is no duplicate is about to be admitted: the request to admit
        (a recovery is sized from the members alive now); ``ScalePlanError`` refuses it."""
        ...

    def member_died(self, engine_id: int, epoch: int, now: float, cause: str) -> None:
        """A member of the served topology (``epoch``) was found dead."""
        ...

    def group_failed(self, engine_id: int, cause: str, now: float) -> None:
        """A member's collective failed (``GROUP_FAILED`` of the served epoch)."""
        ...

    def committed(self, record: OperationRecord, topology: Topology, now: float) -> None:
        """The engines switched to ``topology``, the one ``record``'s operation planned."""
        ...

    def ended(self, record: OperationRecord, now: float, served: ServedState) -> None:
        """An operation finished (nothing runs now; its outcome may be unknown)."""
        ...


class _Unobserved:
    """No healing policy: the runner alone (its unit tests)."""

    def admitting(self, request: ScaleRequest, served: ServedState) -> ScaleRequest:
        return request

    def member_died(self, engine_id: int, epoch: int, now: float, cause: str) -> None:
        pass

    def group_failed(self, engine_id: int, cause: str, now: float) -> None:
        pass

    def committed(self, record: OperationRecord, topology: Topology, now: float) -> None:
        pass

    def ended(self, record: OperationRecord, now: float, served: ServedState) -> None:
        pass


class Operation:
    """The running operation: its plan and what each engine reported."""

    def __init__(self, record: OperationRecord, plan: ScalePlan, prepare: ScalePrepare) -> None:
        self.record = record
        self.plan = plan
        self.prepare = prepare
        self.deadline = math.inf
        self.ready: set[int] = set()  # joiners that finished their handshake
        self.prepared: set[int] = set()
        self.committed: set[int] = set()
        self.exited: set[int] = set()  # participants gone during the operation
        self.rolled: set[int] = set()  # participants that reported FAILED / ROLLED_BACK
        self.prepare_sent = False
        self.outcome: ScaleOutcome | None = None  # once known
        # Members that died while no engine could take their requests (the others were
        # leaving, so excluded from routing): migrated once the outcome restores routing.
        self.deferred: list[int] = []

    @property
    def old_mode(self) -> bool:
        return self.prepare.old_group_usable

    @property
    def new_members(self) -> tuple[int, ...]:
        return tuple(self.plan.new_topology.engine_ids)

    def nobody_can_commit(self) -> bool:
        """Every participant is gone or rolled back (terminal): whatever the deciders
        did before dying, no live engine serves the new epoch -- a joiner would have
        reported COMMITTED had the survivors committed and completed its barrier."""
        return set(self.plan.participants) <= self.exited | self.rolled | set(self.plan.dead)

    def alive(self, ids: Sequence[int]) -> tuple[int, ...]:
        gone = self.exited | set(self.plan.dead)
        return tuple(e for e in ids if e not in gone)

    def deciders(self) -> set[int]:
        """Engines whose failure report means the operation cannot commit. Before COMMIT
        is sent, all of them (nobody commits without it). After it, only the engines
        whose flag the consensus needs: the current group's members (its all-reduce), or
        the new members (the standby barrier) when the current group is broken. A joiner
        failing after COMMIT in the first case has no say: the others may still commit,
        making it a dead member of the new epoch (engine state race 4)."""
        if self.record.phase in (ScalePhase.STARTING_ENGINES, ScalePhase.PREPARING):
            return set(self.plan.participants)
        if self.old_mode:
            return set(self.plan.old_topology.engine_ids)
        return set(self.new_members)


class ScaleRunner:
    """Admits scale operations one at a time and drives each through its phases."""

    def __init__(
        self,
        topology: Topology,
        num_experts: int,
        num_redundant: int = 0,
        *,
        bytes_per_expert: int = 0,
        strategy: PlacementStrategy | str = PlacementStrategy.LINEAR,
        timeouts: ScaleTimeouts | None = None,
        cpu_cores: int | None = None,
        history_len: int = 256,
        observer: RunnerObserver | None = None,
    ) -> None:
        self.topology = topology  # the committed one: what is served
        self.num_experts = num_experts
        self.num_redundant = num_redundant
        self.bytes_per_expert = bytes_per_expert
        self.strategy = strategy
        self.timeouts = timeouts or ScaleTimeouts()
        self.cpu_cores = cpu_cores
        self.history_len = history_len
        self.observer: RunnerObserver = observer or _Unobserved()
        self.dead: set[int] = set()  # current members known dead (removed by the next op)
        self.history: OrderedDict[str, OperationRecord] = OrderedDict()
        self.ignored_reports = 0  # of another operation or epoch (race 4)
        self.running: Operation | None = None
        self.unresolved: Operation | None = None  # FAILED with the outcome unknown
        self._sequence = 0

    # ------------------------------------------------------------------ queries

    @property
    def is_scaling(self) -> bool:
        """``/is_scaling_elastic_ep``: an operation runs (or its outcome is unknown)."""
        return self.running is not None or self.unresolved is not None

    @property
    def current(self) -> OperationRecord | None:
        op = self.running or self.unresolved
        return None if op is None else op.record

    def next_deadline(self) -> float | None:
        """The running operation's phase deadline (None: nothing runs)."""
        return None if self.running is None else self.running.deadline

    @property
    def live_members(self) -> tuple[int, ...]:
        return tuple(e for e in self.topology.engine_ids if e not in self.dead)

    def validate(self, new_size: int) -> None:
        """ScalePlanError (HTTP 400) if ``new_size`` cannot be served."""
        validate_size(new_size, self.num_experts, self.num_redundant, self.topology.tp_size)

    # ------------------------------------------------------------------ admission

    def request_scale(
        self,
        request: ScaleRequest,
        now: float,
        *,
        load: Sequence[float] | None = None,
        store_address: str | None = None,
    ) -> tuple[ScaleResponse, list[Action]]:
        """Admit one operation. Raises ``ScalePlanError`` (HTTP 400) for a request that
        cannot be served; never for a duplicate or a conflict (those are answers)."""
        op_id = request.operation_id
        if op_id is not None:
            if not isinstance(op_id, str) or not 0 < len(op_id) <= 256:
                raise ScalePlanError("operation_id must be a string of 1 to 256 characters")
            if op_id in self.history:  # race 4: the first result, nothing started
                return ScaleResponse(Admission.DUPLICATE, self.history[op_id]), []
        request = self.observer.admitting(request, self)
        busy = self.running or self.unresolved
        if busy is not None:
            return ScaleResponse(Admission.CONFLICT, busy.record), []
        drain = request.drain_timeout_s
        if not isinstance(drain, int | float) or not math.isfinite(drain) or drain < 0:
            raise ScalePlanError(f"drain_timeout must be a finite number >= 0, got {drain!r}")
        self._sequence += 1
        seq = self._sequence
        if op_id is None:
            op_id = f"scale-{seq}"
            while op_id in self.history:
                op_id += "'"
        dead = sorted(self.dead)
        remove = set(request.remove) | self.dead
        rebuild = request.trigger is ScaleTrigger.REBUILD
        if request.new_size == self.topology.size and not remove and not rebuild:
            self.validate(request.new_size)  # a no-op still answers 400 when invalid
            record = self._new_record(op_id, seq, request, now)
            record.phase = ScalePhase.SUCCEEDED
            record.finished_at = now
            record.warnings.append(f"already at {request.new_size} engine(s): nothing to do")
            self._remember(record)
            return ScaleResponse(Admission.STARTED, record), [RecordResult(record)]
        plan = plan_scale(
            self.topology,
            request.new_size,
            self.num_experts,
            self.num_redundant,
            bytes_per_expert=self.bytes_per_expert,
            remove=remove,
            dead=dead,
            strategy=self.strategy,
            load=load,
            store_address=store_address,
            rebuild=rebuild,
        )
        t = self.timeouts
        prepare = ScalePrepare(
            operation_id=op_id,
            sequence=seq,
            topology=plan.new_topology,
            leaving=list(plan.leaving),
            joining=list(plan.joining),
            transfers=plan.transfer_specs(),
            drain_timeout_s=float(drain),
            rendezvous_timeout_s=t.rendezvous_s,
            transfer_timeout_s=t.transfer_s,
            commit_timeout_s=t.engine_commit_s,
            dead=list(plan.dead),
            threads_per_rank=(
                None
                if self.cpu_cores is None
                else threads_per_rank(self.cpu_cores, plan.to_size * self.topology.tp_size)
            ),
            rebuild=rebuild and not plan.dead,
        )
        record = self._new_record(op_id, seq, request, now)
        record.to_epoch = plan.epoch
        record.joining, record.leaving, record.dead = (
            list(plan.joining),
            list(plan.leaving),
            list(plan.dead),
        )
        record.experts_moved = plan.experts_moved
        record.bytes_moved, record.min_bytes = plan.bytes_moved, plan.min_bytes
        record.p2p_bytes, record.disk_bytes = plan.p2p_bytes, plan.disk_bytes
        record.phases.append(PhaseTiming(ScalePhase.PLANNED, now))
        self._remember(record)
        op = self.running = Operation(record, plan, prepare)
        actions: list[Action] = []
        if plan.joining:
            self._enter(op, ScalePhase.STARTING_ENGINES, now, t.start_engines_s)
            actions.append(SpawnEngines(op_id, plan.joining, plan.new_topology))
        else:
            actions += self._start_prepare(op, now)
        return ScaleResponse(Admission.STARTED, record), actions

    # ------------------------------------------------------------------ events

    def handle(self, event: RunnerEvent, now: float) -> list[Action]:
        match event:
            case ScaleReport():
                return self._on_report(event, now)
            case EngineExited():
                return self._on_exit(event, now)
            case EngineStarted():
                return self._on_ready(event.engine_id, now)
            case _:
                assert_never(event)

    def count_migrated(self, event: RequestsMigrated) -> None:
        """Requests of ``event.engine_id`` resumed elsewhere: counted in the record of the
        operation they moved in."""
        rec = self.history.get(event.operation_id) if event.operation_id else None
        if rec is not None:
            rec.requests_migrated += event.count

    def tick(self, now: float) -> list[Action]:
        """The running operation's phase deadline passed: roll back, give up, move on."""
        op = self.running
        if op is None or now < op.deadline:
            return []
        ph, t = op.record.phase, self.timeouts
        if ph is ScalePhase.STARTING_ENGINES:
            late = sorted(set(op.plan.joining) - op.ready)
            return self._rollback(
                op, now, f"new engines {late} not ready after {t.start_engines_s:g}s"
            )
        if ph is ScalePhase.PREPARING:
            late = sorted(set(op.alive(op.plan.participants)) - op.prepared)
            limit = t.prepare_s + op.prepare.drain_timeout_s
            return self._rollback(op, now, f"engines {late} not prepared after {limit:g}s")
        if ph is ScalePhase.COMMITTING:
            if op.outcome is None:
                return self._fail_unknown(op, now)
            missing = sorted(set(op.alive(op.new_members)) - op.committed)
            op.record.warnings.append(
                f"engines {missing} did not report COMMITTED within {t.commit_s:g}s"
            )
            return self._start_finishing(op, now)
        if ph is ScalePhase.FINISHING:
            left = op.alive(op.plan.leaving)
            op.record.warnings.append(
                f"leaving engines {list(left)} did not exit within {t.finish_s:g}s: killed"
            )
            out: list[Action] = [StopEngines(left, "did not exit after leaving", force=True)]
            return out + self._finish(op, now, ScalePhase.SUCCEEDED, None)
        return []

    # ------------------------------------------------------------------ phases

    def _new_record(
        self, op_id: str, seq: int, request: ScaleRequest, now: float
    ) -> OperationRecord:
        return OperationRecord(
            operation_id=op_id,
            sequence=seq,
            from_size=self.topology.size,
            to_size=request.new_size,
            from_epoch=self.topology.epoch,
            to_epoch=self.topology.epoch,
            started_at=now,
            drain_timeout_s=float(request.drain_timeout_s),
            trigger=request.trigger,
        )

    def _remember(self, record: OperationRecord) -> None:
        self.history[record.operation_id] = record
        while len(self.history) > self.history_len:
            self.history.popitem(last=False)

    def _enter(self, op: Operation, phase: ScalePhase, now: float, timeout: float) -> None:
        if op.record.phases:
            op.record.phases[-1].ended = now
        op.record.phase = phase
        op.record.phases.append(PhaseTiming(phase, now))
        op.deadline = now + timeout

    def _start_prepare(self, op: Operation, now: float) -> list[Action]:
        t = self.timeouts
        self._enter(op, ScalePhase.PREPARING, now, t.prepare_s + op.prepare.drain_timeout_s)
        op.prepare_sent = True
        out: list[Action] = []
        leaving = op.alive(op.plan.leaving)
        if leaving:  # before the PREPARE, on the same FIFO sockets (race 5)
            out.append(ExcludeFromRouting(leaving))
        out.append(SendPrepare(op.alive(op.plan.participants), op.prepare))
        return out

    def _on_ready(self, engine_id: int, now: float) -> list[Action]:
        op = self.running
        if op is None or engine_id not in op.plan.joining:
            return []
        op.ready.add(engine_id)
        if op.record.phase is ScalePhase.STARTING_ENGINES and op.ready >= set(op.plan.joining):
            return self._start_prepare(op, now)
        return []

    def _mine(self, op: Operation | None, r: ScaleReport) -> bool:
        return (
            op is not None
            and r.operation_id == op.record.operation_id
            and r.epoch == op.plan.epoch
            and r.engine_id in op.plan.participants
        )

    def _on_report(self, r: ScaleReport, now: float) -> list[Action]:
        op = self.running
        if r.event is ScaleEvent.HANDED_BACK:
            # Whatever became of its operation (it may have rolled back while the report
            # was in flight), the engine has stopped these requests: they must move.
            if not r.request_ids:
                return []
            return [MigrateRequests(r.engine_id, tuple(r.request_ids), r.operation_id)]
        if r.event is ScaleEvent.GROUP_FAILED:
            if r.epoch == self.topology.epoch and r.engine_id in self.topology:
                self.observer.group_failed(r.engine_id, r.cause or "collective failed", now)
            return []
        if not self._mine(op, r):
            if self._mine(self.unresolved, r):
                return self._resolve_late(r, now)
            return self._late_report(r)
        assert op is not None
        ev, ph = r.event, op.record.phase
        match ev:
            case ScaleEvent.PREPARED:
                if ph is not ScalePhase.PREPARING:
                    return []
                if r.engine_id not in op.prepared:
                    op.record.bytes_received += r.bytes_received  # measured by the engine
                op.prepared.add(r.engine_id)
                if op.prepared >= set(op.alive(op.plan.participants)):
                    self._enter(op, ScalePhase.COMMITTING, now, self.timeouts.commit_s)
                    msg = ScaleCommit(op.record.operation_id, op.plan.epoch)
                    return [SendCommit(op.alive(op.plan.participants), msg)]
                return []
            case ScaleEvent.COMMITTED:
                return self._on_committed(op, r, now)
            case ScaleEvent.FAILED | ScaleEvent.ROLLED_BACK:
                op.rolled.add(r.engine_id)
                if r.engine_id not in op.deciders():
                    # No say in the outcome (a joiner with the current group's consensus, a
                    # leaving engine with the standby barrier's) and useless either way: if
                    # the others commit it is a dead member of the new epoch.
                    op.record.warnings.append(f"engine {r.engine_id}: {ev} ({r.cause})")
                    out: list[Action] = []
                    if r.engine_id not in op.exited:
                        op.exited.add(r.engine_id)
                        out.append(StopEngines((r.engine_id,), f"{ev} after COMMIT", force=True))
                    return out + self._settle(op, now)
                if op.outcome is ScaleOutcome.COMMITTED:
                    op.record.warnings.append(
                        f"inconsistent: engine {r.engine_id} reported {ev} after a commit"
                    )
                    return []
                return self._rollback(op, now, f"engine {r.engine_id}: {r.cause or ev}")
            case ScaleEvent.LEFT | ScaleEvent.HANDED_BACK | ScaleEvent.GROUP_FAILED:
                return []  # LEFT: the exit itself is what FINISHING waits for; others: above
            case _:
                assert_never(ev)

    def _late_report(self, r: ScaleReport) -> list[Action]:
        """A report of a finished operation: ignored (race 3 / 4) -- unless a member of the
        topology that operation committed says it rolled back: it is not serving the
        epoch it belongs to (a joiner with no say, state race 4), so it is stopped like a
        dead rank and the next operation replaces it."""
        rec = self.history.get(r.operation_id)
        committed = rec is not None and (
            rec.phase is ScalePhase.SUCCEEDED or rec.resolution is ScaleOutcome.COMMITTED
        )
        if (
            committed
            and r.event in (ScaleEvent.FAILED, ScaleEvent.ROLLED_BACK)
            and r.epoch == self.topology.epoch
            and r.engine_id in self.topology
            and r.engine_id not in self.dead
        ):
            assert rec is not None
            rec.warnings.append(f"engine {r.engine_id}: {r.event} after the commit ({r.cause})")
            self.dead.add(r.engine_id)
            return [StopEngines((r.engine_id,), f"{r.event} after the commit", force=True)]
        self.ignored_reports += 1
        return []

    def _on_committed(self, op: Operation, r: ScaleReport, now: float) -> list[Action]:
        if op.record.phase is not ScalePhase.COMMITTING and op.outcome is None:
            # COMMITTED before the controller sent COMMIT cannot happen; keep it loud.
            op.record.warnings.append(f"engine {r.engine_id} COMMITTED in phase {op.record.phase}")
        op.committed.add(r.engine_id)
        out: list[Action] = []
        if op.outcome is None:
            op.outcome = ScaleOutcome.COMMITTED
            out += self._adopt(op, now)
        if op.record.phase is ScalePhase.COMMITTING and op.committed >= set(
            op.alive(op.new_members)
        ):
            out += self._start_finishing(op, now)
        return out

    def _adopt(self, op: Operation, now: float) -> list[Action]:
        """The engines switched: serve the new topology from now on."""
        new = op.plan.new_topology
        self.topology = new
        self.observer.committed(op.record, new, now)
        # Members that died or rolled back during the operation (a joiner with no say,
        # state race 4) are dead members of the new epoch: stopped, replaced next time.
        self.dead = (self.dead | op.exited | op.rolled) & set(new.engine_ids)
        out: list[Action] = [PublishTopology(new), *self._release_deferred(op)]
        still_running = tuple(e for e in new.engine_ids if e in op.rolled - op.exited)
        if still_running:
            op.exited |= set(still_running)
            out.append(StopEngines(still_running, "rolled back while the others committed", True))
        return out

    def _start_finishing(self, op: Operation, now: float) -> list[Action]:
        self._enter(op, ScalePhase.FINISHING, now, self.timeouts.finish_s)
        left = op.alive(op.plan.leaving)
        if not left:
            return self._finish(op, now, ScalePhase.SUCCEEDED, None)
        return [StopEngines(left, "left the deployment")]

    def _on_exit(self, ev: EngineExited, now: float) -> list[Action]:
        e, op = ev.engine_id, self.running
        # Whatever the ownership table still gives it resumes elsewhere: nothing is lost,
        # whichever phase it died in (a leaving engine normally has nothing left).
        running = self.running or self.unresolved
        out: list[Action] = []
        if running is not None and not self._routable_besides(running, e):
            # Only leaving engines are left to route to, so a move now would fail every
            # request; the rollback (or the commit) that ends this operation makes a
            # target routable again, and moves them then.
            running.deferred.append(e)
        else:
            out.append(
                MigrateRequests(e, None, None if running is None else running.record.operation_id)
            )
        if e in self.topology and e not in self.dead:
            self.dead.add(e)  # a member of what is served: the next operation removes it
            self.observer.member_died(e, self.topology.epoch, now, ev.cause)
        late = self.unresolved
        if late is not None and e in late.plan.participants:
            late.exited.add(e)
            if late.nobody_can_commit():
                out += self._resolve(late, ScaleOutcome.ROLLED_BACK, now)
        if op is None or e not in op.plan.participants or e in op.exited:
            return out
        op.exited.add(e)
        ph, what = op.record.phase, f"engine {e} died during {op.record.phase}: {ev.cause}"
        if ph in (ScalePhase.STARTING_ENGINES, ScalePhase.PREPARING):
            return out + self._rollback(op, now, what)
        if ph is ScalePhase.COMMITTING:
            if op.outcome is None or e not in op.plan.leaving:
                op.record.warnings.append(what)  # race 2: the engines' reports decide
            if op.outcome is ScaleOutcome.COMMITTED and op.committed >= set(
                op.alive(op.new_members)
            ):
                out += self._start_finishing(op, now)
            out += self._settle(op, now)
        elif ph is ScalePhase.FINISHING:
            if e not in op.plan.leaving:
                op.record.warnings.append(what)  # a rank death of the new epoch
            elif not op.alive(op.plan.leaving):
                out += self._finish(op, now, ScalePhase.SUCCEEDED, None)
        return out

    def _rollback(self, op: Operation, now: float, cause: str) -> list[Action]:
        op.outcome = ScaleOutcome.ROLLED_BACK
        out: list[Action] = []
        if op.prepare_sent:
            msg = ScaleAbort(op.record.operation_id, op.plan.epoch, cause)
            out.append(SendAbort(op.alive(op.plan.participants), msg))
        joining = op.alive(op.plan.joining)
        if joining:
            out.append(StopEngines(joining, f"scale operation rolled back: {cause}", force=True))
        leaving = op.alive(op.plan.leaving)
        if leaving and op.prepare_sent:
            out.append(RestoreRouting(leaving))
        out += self._release_deferred(op)  # after RestoreRouting: they are targets again
        # The joiners' ids were handed out: never again (their late messages stay former).
        self.topology = self.topology.retire_ids(op.plan.joining)
        return out + self._finish(op, now, ScalePhase.ROLLED_BACK, cause)

    def _routable_besides(self, op: Operation, engine_id: int) -> bool:
        """Whether a live member other than ``engine_id`` takes requests while ``op``
        runs (its leaving engines are excluded from routing once the PREPARE is out)."""
        excluded = set(op.plan.leaving) if op.prepare_sent else set()
        return any(m != engine_id and m not in excluded for m in self.live_members)

    def _release_deferred(self, op: Operation) -> list[Action]:
        """The deferred moves, once routing follows the operation's outcome."""
        out: list[Action] = [MigrateRequests(e, None, op.record.operation_id) for e in op.deferred]
        op.deferred.clear()
        return out

    def _settle(self, op: Operation, now: float) -> list[Action]:
        """Outcome open, and nobody left who could commit: it is a rollback."""
        if op.outcome is None and op is self.running and op.nobody_can_commit():
            return self._rollback(op, now, "every engine that could commit died or rolled back")
        return []

    def _fail_unknown(self, op: Operation, now: float) -> list[Action]:
        cause = (
            f"no engine reported the outcome of the commit within {self.timeouts.commit_s:g}s; "
            "new operations wait until one does"
        )
        out = self._finish(op, now, ScalePhase.FAILED, cause)
        self.unresolved = op
        return out

    def _resolve_late(self, r: ScaleReport, now: float) -> list[Action]:
        op = self.unresolved
        assert op is not None
        if r.event is ScaleEvent.COMMITTED:
            return self._resolve(op, ScaleOutcome.COMMITTED, now)
        if r.event in (ScaleEvent.FAILED, ScaleEvent.ROLLED_BACK):
            op.rolled.add(r.engine_id)
            if r.engine_id in op.deciders() or op.nobody_can_commit():
                return self._resolve(op, ScaleOutcome.ROLLED_BACK, now)
        return []

    def _resolve(self, op: Operation, outcome: ScaleOutcome, now: float) -> list[Action]:
        """The outcome of a FAILED (unknown) operation, learnt late: follow the engines."""
        out: list[Action] = []
        op.outcome = op.record.resolution = outcome
        if outcome is ScaleOutcome.COMMITTED:
            out += self._adopt(op, now)
            left = op.alive(op.plan.leaving)
            if left:
                out.append(StopEngines(left, "left the deployment"))
        else:
            joining = op.alive(op.plan.joining)
            if joining:
                out.append(StopEngines(joining, "scale operation rolled back", force=True))
            leaving = op.alive(op.plan.leaving)
            if leaving:
                out.append(RestoreRouting(leaving))
            out += self._release_deferred(op)
            self.topology = self.topology.retire_ids(op.plan.joining)
        op.record.warnings.append(f"outcome learnt at {now:.3f}: {op.outcome}")
        self.unresolved = None
        return out + [RecordResult(op.record)]

    def _finish(
        self, op: Operation, now: float, phase: ScalePhase, cause: str | None
    ) -> list[Action]:
        rec = op.record
        if rec.phases:
            rec.phases[-1].ended = now
        rec.phase = phase
        rec.finished_at = now
        rec.cause = cause
        self.running = None
        self.observer.ended(rec, now, self)
        return [RecordResult(rec)]
