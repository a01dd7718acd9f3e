"""ElasticEPScalingState: every role's transitions, every failure edge, the consensus rule.
Pure: no processes, no groups; jobs and collectives are inputs fed by the test."""

from __future__ import annotations

import msgspec
import pytest

from tidal.elastic.plan import plan_scale
from tidal.elastic.scale_events import (
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
from tidal.protocol.elastic import ScaleAbort, ScaleCommit, ScaleEvent, ScalePrepare
from tidal.protocol.topology import Topology

P = ScalingPhase
RDV, XFER, COMMIT_S = 10.0, 20.0, 5.0


def make_prepare(
    topo: Topology,
    size: int,
    *,
    remove=(),
    dead=(),
    drain: float = 0.0,
    seq: int = 1,
    op: str = "op",
    threads: int | None = 2,
) -> ScalePrepare:
    plan = plan_scale(topo, size, 8, bytes_per_expert=10, remove=remove, dead=dead)
    return ScalePrepare(
        operation_id=op,
        sequence=seq,
        topology=plan.new_topology,
        leaving=list(plan.leaving),
        joining=list(plan.joining),
        transfers=plan.transfer_specs(),
        drain_timeout_s=drain,
        rendezvous_timeout_s=RDV,
        transfer_timeout_s=XFER,
        commit_timeout_s=COMMIT_S,
        dead=list(plan.dead),
        threads_per_rank=threads,
    )


UP = make_prepare(Topology.initial(2), 3)  # engines 0, 1 survive; engine 2 joins
DOWN = make_prepare(Topology.initial(3), 2, remove=[1], drain=4.0)  # engine 1 leaves


def of(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def one(actions, cls):
    (a,) = of(actions, cls)
    return a


def reports(actions):
    return [a.report for a in of(actions, SendReport)]


def events(actions):
    return [r.event for r in reports(actions)]


class Engine:
    """A state plus the jobs it started, so tests read like the busy loop."""

    def __init__(self, engine_id: int, prepare: ScalePrepare, current_epoch: int | None = 0):
        self.s = ElasticEPScalingState(engine_id, prepare, current_epoch=current_epoch)
        self.jobs: dict[type, str] = {}
        self.now = 0.0
        self.log: list = []

    def step(self, *inputs, dt: float = 0.0, n: int = 0) -> list:
        self.now += dt
        out = self.s.progress(self.now, list(inputs), num_unfinished=n)
        for a in out:
            if isinstance(a, StartRendezvous | StartTransfer | StartCommitBarrier):
                self.jobs[type(a)] = a.job_id
        self.log += out
        return out

    def done(self, kind: type, result=None, **kw) -> list:
        return self.step(JobDone(self.jobs[kind], result), **kw)

    def fail(self, kind: type, cause: str = "boom", **kw) -> list:
        return self.step(JobFailed(self.jobs[kind], cause), **kw)

    def to_ready(self, n: int = 0) -> list:
        out = self.step(n=n)
        out += self.done(StartRendezvous, n=n)
        return out + self.done(StartTransfer, n=n)

    @property
    def phase(self) -> ScalingPhase:
        return self.s.phase


def _commit(p: ScalePrepare) -> ScaleCommit:
    return ScaleCommit(p.operation_id, p.epoch)


def _abort(p: ScalePrepare, cause: str = "stop") -> ScaleAbort:
    return ScaleAbort(p.operation_id, p.epoch, cause)


def _all_ready(p: ScalePrepare, step: int = 32) -> Consensus:
    return Consensus(step, p.sequence, p.sequence)


# ----------------------------------------------------------------------------- happy paths


def test_survivor_scale_up():
    e = Engine(1, UP)
    assert e.phase is P.IDLE and e.s.role is Role.SURVIVOR and e.s.active
    out = e.step()
    rdv = one(out, StartRendezvous)
    assert e.phase is P.PREPARING
    assert rdv.members == (0, 1, 2) and rdv.participants == (0, 1, 2) and rdv.epoch == 1
    out = e.done(StartRendezvous)
    xfer = one(out, StartTransfer)
    assert [t.src_engine_id for t in xfer.sends] == [1] * len(xfer.sends)
    assert all(t.dst_engine_id == 1 for t in xfer.receives)
    assert e.s.consensus_value == 0 and not e.s.holds_wave
    out = e.done(StartTransfer)
    assert e.phase is P.READY_TO_COMMIT
    assert events(out) == [ScaleEvent.PREPARED] and of(out, EnsureWaveRunning)
    assert e.s.holds_wave and e.s.consensus_value == 0  # no COMMIT from the frontend yet
    e.step(Consensus(32, 0, 1))  # someone is not ready: nothing happens
    assert e.phase is P.READY_TO_COMMIT
    e.step(_commit(UP))
    assert e.s.consensus_value == UP.sequence == 1
    out = e.step(_all_ready(UP, 64))
    assert e.phase is P.COMMITTING
    assert [type(a) for a in out] == [
        SwapGroups,
        InstallExperts,
        TakeRank,
        SetNumThreads,
        DestroyOldGroups,
        NewGroupBarrier,
    ]
    assert one(out, InstallExperts).local_expert_ids == tuple(UP.topology.placement[1])
    assert one(out, TakeRank) == TakeRank(1, 1, 3, None)
    assert one(out, DestroyOldGroups).epoch == 0 and one(out, NewGroupBarrier).step == 64
    out = e.step(CommitApplied())
    assert e.phase is P.DONE and not e.s.active
    (rep,) = reports(out)
    assert (rep.event, rep.step, rep.epoch, rep.engine_id) == (ScaleEvent.COMMITTED, 64, 1, 1)
    assert [ph for ph, _ in e.s.timeline] == [P.PREPARING, P.READY_TO_COMMIT, P.COMMITTING, P.DONE]


def test_joiner_scale_up():
    e = Engine(2, UP, current_epoch=None)
    assert e.s.role is Role.JOINING and e.s.accepts_new_requests
    e.step()
    assert e.phase is P.JOINING
    out = e.done(StartRendezvous)
    assert e.phase is P.RECEIVING_EXPERTS
    xfer = one(out, StartTransfer)
    assert not xfer.sends and {t.dst_engine_id for t in xfer.receives} == {2}
    out = e.done(StartTransfer)
    assert e.phase is P.READY_TO_COMMIT
    (rep,) = reports(out)
    assert rep.experts_received == len(xfer.receives) and rep.bytes_received == 10 * len(
        xfer.receives
    )
    one(out, StartCommitBarrier)  # posted at once: the survivors decide, it follows
    assert e.s.consensus_value == 0 and not e.s.holds_wave  # not in the current group
    e.step(Consensus(32, 1, 1))  # the current group's consensus is not the joiner's
    assert e.phase is P.READY_TO_COMMIT
    e.step(dt=COMMIT_S + 1)  # its barrier is posted: the phase timer does not abort it
    assert e.phase is P.READY_TO_COMMIT
    out = e.done(StartCommitBarrier, BarrierResult(wave=7, step=96))
    assert e.phase is P.COMMITTING
    assert [type(a) for a in out] == [SwapGroups, InstallExperts, TakeRank, SetNumThreads]
    assert one(out, TakeRank) == TakeRank(1, 2, 3, 7)  # takes the group's wave
    out = e.step(CommitApplied())
    assert e.phase is P.SERVING and reports(out)[0].step == 96


def test_leaving_drains_then_hands_back_the_rest():
    e = Engine(1, DOWN)
    assert e.s.role is Role.LEAVING and not e.s.accepts_new_requests
    e.step(n=3)
    assert e.phase is P.DRAINING
    e.done(StartRendezvous, n=3)
    e.done(StartTransfer, n=2, dt=1.0)  # sends done, still finishing its own requests
    assert e.phase is P.DRAINING
    out = e.step(n=2, dt=3.0)  # drain timeout (4 s): what still runs is handed back
    assert e.phase is P.MIGRATING and of(out, HandBackRequests)
    e.step(n=0)  # removed from the scheduler, the ids not reported yet: not prepared
    assert e.phase is P.MIGRATING and e.s.active
    out = e.step(HandedBack(("a", "b")), n=0)
    assert [r.request_ids for r in reports(out) if r.event is ScaleEvent.HANDED_BACK] == [
        ["a", "b"]
    ]
    assert e.phase is P.READY_TO_COMMIT and e.s.requests_handed_back == 2
    out = e.step(HandedBack(("late",)))  # another frontend's request, bounced on arrival
    assert reports(out)[0].request_ids == ["late"]
    e.step(_commit(DOWN))
    out = e.step(_all_ready(DOWN))
    assert [type(a) for a in out] == [DestroyOldGroups, DestroyStandbyGroups]
    out = e.step(CommitApplied())
    assert e.phase is P.LEAVING and not e.s.active and not e.s.accepts_new_requests
    assert events(out) == [ScaleEvent.COMMITTED, ScaleEvent.LEFT] and of(out, Leave)


def test_leaving_engine_that_drains_in_time_hands_back_nothing():
    e = Engine(1, DOWN)
    e.step(n=1)
    e.step(n=0, dt=1.0)
    assert e.phase is P.MIGRATING and not of(e.log, HandBackRequests)


def test_zero_drain_timeout_hands_back_at_once():
    e = Engine(2, make_prepare(Topology.initial(3), 2))
    out = e.step(n=4)
    assert e.phase is P.MIGRATING and of(out, HandBackRequests)
    e.step(n=4)  # its HandedBack is not in yet: not asked twice
    assert len(of(e.log, HandBackRequests)) == 1
    e.step(HandedBack(("a", "b", "c")), n=1)  # one arrived meanwhile: asked again
    assert len(of(e.log, HandBackRequests)) == 2


def test_a_pending_hand_back_keeps_the_state_active():
    e = Engine(2, make_prepare(Topology.initial(3), 2))
    e.step(n=2)
    assert of(e.log, HandBackRequests)
    e.step(_abort(e.s.prepare))  # the operation ends before the hand-back is reported
    assert e.phase is P.ROLLED_BACK and e.s.active  # still owes the hand-back report
    out = e.step(HandedBack(("a", "b")))
    assert reports(out)[0].request_ids == ["a", "b"] and not e.s.active


def test_survivor_scale_down_receives_the_leaving_experts():
    e = Engine(0, DOWN)
    e.step()
    xfer = one(e.done(StartRendezvous), StartTransfer)
    assert {t.src_engine_id for t in xfer.receives} <= {1}


# ----------------------------------------------------------------------------- failures


def test_rendezvous_failure_rolls_back():
    e = Engine(0, UP)
    e.step()
    out = e.fail(StartRendezvous, "store unreachable")
    assert e.phase is P.ROLLED_BACK and e.s.cause == "store unreachable"
    assert of(out, DestroyStandbyGroups) and of(out, DiscardStagedExperts)
    (rep,) = reports(out)
    assert rep.event is ScaleEvent.FAILED and rep.cause == "store unreachable"
    assert not e.s.active


@pytest.mark.parametrize(
    ("engine", "prepare", "stage", "cause"),
    [
        (0, UP, "rdv", "standby group rendezvous timed out after 10s"),
        (0, UP, "xfer", "expert transfer timed out after 20s"),
        (2, UP, "rdv", "standby group rendezvous timed out after 10s"),
        (2, UP, "xfer", "expert transfer timed out after 20s"),
        (1, DOWN, "xfer", "expert transfer timed out after 20s"),
    ],
)
def test_job_timeouts(engine, prepare, stage, cause):
    e = Engine(engine, prepare, current_epoch=None if engine in prepare.joining else 0)
    e.step()
    if stage == "xfer":
        e.done(StartRendezvous)
    job = e.jobs[StartTransfer if stage == "xfer" else StartRendezvous]
    assert e.s.next_deadline() is not None
    e.step(dt=(XFER if stage == "xfer" else RDV) - 0.01)
    assert e.phase not in (P.ROLLED_BACK,)
    out = e.step(dt=0.02)
    assert e.phase is P.ROLLED_BACK and e.s.cause == cause
    assert one(out, CancelJob).job_id == job
    assert e.step(JobDone(job)) == [] and e.s.ignored_inputs == 1  # the late success


def test_ready_to_commit_timeout():
    e = Engine(0, UP)
    e.to_ready()
    e.step(_commit(UP))
    out = e.step(dt=COMMIT_S)
    assert e.phase is P.ROLLED_BACK
    assert reports(out)[0].cause == "no commit consensus before the commit timeout"
    assert e.s.consensus_value == 0  # lowered before the next all-reduce


def test_waiting_for_the_commit_outlasts_the_others_prepare():
    e = Engine(0, DOWN)
    e.to_ready()
    assert e.s.deadline == e.now + DOWN.drain_timeout_s + RDV + XFER + COMMIT_S
    e.step(dt=COMMIT_S + 1)  # a leaving engine may still be draining: keep waiting
    assert e.phase is P.READY_TO_COMMIT
    e.step(_commit(DOWN))
    assert e.s.deadline == e.now + COMMIT_S  # from the COMMIT on: the consensus
    e.step(dt=COMMIT_S)
    assert e.phase is P.ROLLED_BACK


def test_barrier_result_is_applied_before_an_abort():
    e = Engine(2, UP, current_epoch=None)
    e.to_ready()
    e.step(_abort(UP), JobDone(e.jobs[StartCommitBarrier], BarrierResult(1, 8)))
    assert e.phase is P.COMMITTING


def test_consensus_is_applied_before_a_deadline_and_an_abort():
    e = Engine(0, UP)
    e.to_ready()
    e.step(_commit(UP))
    e.now += COMMIT_S + 1  # past the deadline, and an ABORT in the same batch
    out = e.step(_abort(UP), _all_ready(UP))
    assert e.phase is P.COMMITTING and of(out, SwapGroups)
    assert not of(out, DestroyStandbyGroups)


def test_all_ready_without_this_rank_is_a_wiring_bug():
    e = Engine(0, UP)
    e.to_ready()
    with pytest.raises(RuntimeError, match="was not"):
        e.step(_all_ready(UP))


def test_a_flag_of_another_operation_never_completes_the_consensus():
    p2 = make_prepare(Topology.initial(2), 3, seq=2, op="second")
    e = Engine(0, p2)
    e.to_ready()
    e.step(_commit(p2))
    e.step(Consensus(32, 1, 2))  # a rank still flags operation 1: MIN != MAX
    e.step(Consensus(64, 1, 1))  # everyone ready for operation 1 -- not this one
    assert e.phase is P.READY_TO_COMMIT
    e.step(Consensus(96, 2, 2))
    assert e.phase is P.COMMITTING


STAGES = {
    "idle": lambda e: None,
    "preparing": lambda e: e.step(),
    "transferring": lambda e: (e.step(), e.done(StartRendezvous)),
    "ready": lambda e: e.to_ready(),
    "ready_allowed": lambda e: (e.to_ready(), e.step(_commit(e.s.prepare))),
}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("engine", [0, 1, 2])  # survivor, leaving (DOWN) / survivor, joiner
@pytest.mark.parametrize("prepare", [UP, DOWN], ids=["up", "down"])
def test_abort_in_every_phase_before_the_commit(stage, engine, prepare):
    e = Engine(engine, prepare, current_epoch=None if engine in prepare.joining else 0)
    STAGES[stage](e)
    out = e.step(_abort(prepare, "engine 9 died"))
    assert e.phase is P.ROLLED_BACK
    assert reports(out)[-1].event is ScaleEvent.ROLLED_BACK
    assert reports(out)[-1].cause == "aborted by the frontend: engine 9 died"
    assert of(out, DestroyStandbyGroups)
    assert e.s.accepts_new_requests  # a leaving engine serves again
    assert e.s.consensus_value == 0 and not e.s.active and not e.s.holds_wave
    assert all(isinstance(a, CancelJob) for a in of(out, CancelJob))


def test_messages_of_another_operation_are_ignored():
    e = Engine(0, UP)
    e.to_ready()
    e.step(ScaleAbort("other", 1, "x"), ScaleCommit("other", 1), ScaleAbort("op", 2, "x"))
    assert e.phase is P.READY_TO_COMMIT and e.s.consensus_value == 0
    assert e.s.ignored_inputs == 3


def test_abort_after_the_commit_is_ignored():
    e = Engine(0, UP)
    e.to_ready()
    e.step(_commit(UP))
    e.step(_all_ready(UP))
    assert e.step(_abort(UP)) == [] and e.phase is P.COMMITTING
    e.step(CommitApplied())
    assert e.step(_abort(UP)) == [] and e.phase is P.DONE


def test_group_failure_during_prepare_rolls_back():
    e = Engine(0, UP)
    e.step()
    out = e.step(OldGroupFailed("rank 1 gone"))
    assert e.phase is P.ROLLED_BACK and reports(out)[0].cause == "DP group failed: rank 1 gone"
    j = Engine(2, UP, current_epoch=None)
    j.step()
    j.step(OldGroupFailed("rank 1 gone"))  # a joiner is not in the current group
    assert j.phase is P.JOINING


def test_commit_not_applied_in_time_is_fatal():
    e = Engine(0, UP)
    e.to_ready()
    e.step(_commit(UP))
    e.step(_all_ready(UP))
    out = e.step(dt=COMMIT_S)
    assert e.phase is P.FAILED and of(out, Fatal) and not e.s.active
    assert e.step(CommitApplied()) == []


def test_joiner_barrier_failure_rolls_back():
    e = Engine(2, UP, current_epoch=None)
    e.to_ready()
    out = e.fail(StartCommitBarrier, "standby group destroyed")
    assert e.phase is P.ROLLED_BACK and reports(out)[0].event is ScaleEvent.FAILED


def test_joiner_barrier_backstop():
    e = Engine(2, UP, current_epoch=None)
    e.to_ready()
    barrier = one(e.log, StartCommitBarrier)
    # The others' whole prepare (drain, rendezvous, transfer), then COMMIT and consensus.
    assert barrier.timeout_s == UP.drain_timeout_s + RDV + XFER + 3 * COMMIT_S
    e.step(dt=2 * barrier.timeout_s - 0.1)
    assert e.phase is P.READY_TO_COMMIT
    out = e.step(dt=0.2)
    assert e.phase is P.FAILED and "twice its timeout" in one(out, Fatal).cause
    assert not reports(out)  # it cannot know the outcome: no rollback report


def test_stale_prepare_fails_at_once():
    e = Engine(0, UP, current_epoch=1)  # already at epoch 1: a prepare for epoch 1 is old
    out = e.step()
    assert e.phase is P.ROLLED_BACK and "stale prepare" in reports(out)[0].cause
    assert not of(out, StartRendezvous)


def test_construction_errors():
    with pytest.raises(ValueError, match="no part"):
        ElasticEPScalingState(9, UP)
    bad = ScalePrepare("x", 0, UP.topology, [], [2], [])
    with pytest.raises(ValueError, match="sequence"):
        ElasticEPScalingState(0, bad)


def test_unknown_input():
    e = Engine(0, UP)
    with pytest.raises(AssertionError, match="unreachable"):  # assert_never: not an Input
        e.step(object())


@pytest.mark.parametrize(("engine", "prepare"), [(0, UP), (2, UP), (1, DOWN), (0, DOWN)])
def test_every_phase_has_a_deadline(engine, prepare):
    e = Engine(engine, prepare, current_epoch=None if engine in prepare.joining else 0)
    e.step(n=1)
    seen = set()
    for act in (
        lambda: e.done(StartRendezvous, n=1),
        lambda: e.done(StartTransfer, n=1),
        lambda: e.step(n=0, dt=prepare.drain_timeout_s),
        lambda: e.step(HandedBack(("r",)), n=0),
        lambda: e.step(_commit(prepare)),
    ):
        assert e.s.next_deadline() is not None, e.phase
        seen.add(e.phase)
        act()
    assert e.phase is P.READY_TO_COMMIT and e.s.next_deadline() is not None


# ----------------------------------------------------------------------------- standby mode


DEAD = make_prepare(Topology.initial(3), 2, dead=[2], remove=[2])


def test_emergency_scale_down_commits_on_the_standby_barrier():
    assert not DEAD.old_group_usable
    e = Engine(0, DEAD)
    rdv = one(e.step(), StartRendezvous)
    assert 2 not in rdv.participants  # the dead engine is nobody's peer
    out = e.done(StartRendezvous)
    assert all(t.src_engine_id is None for t in one(out, StartTransfer).receives)  # disk
    out = e.done(StartTransfer)
    assert e.phase is P.READY_TO_COMMIT
    assert not of(out, EnsureWaveRunning) and not of(out, StartCommitBarrier)
    assert e.s.consensus_value == 0 and not e.s.holds_wave
    out = e.step(_commit(DEAD))
    one(out, StartCommitBarrier)  # posted only with the frontend's COMMIT
    out = e.done(StartCommitBarrier, BarrierResult(wave=3, step=40))
    assert [type(a) for a in out] == [
        SwapGroups,
        InstallExperts,
        TakeRank,
        SetNumThreads,
        DestroyOldGroups,
    ]  # no NewGroupBarrier: the barrier was it
    assert one(out, TakeRank).wave == 3  # every new member runs the barrier's wave
    e.step(CommitApplied())
    assert e.phase is P.DONE and e.s.commit_step == 40


def test_rebuild_by_the_same_engines_commits_on_the_standby_barrier():
    """Groups that failed with nobody dead: same engines, next epoch, nothing to move."""
    plan = plan_scale(Topology.initial(3), 3, 8, bytes_per_expert=10, rebuild=True)
    assert plan.new_topology.engine_ids == [0, 1, 2] and not plan.transfers
    p = msgspec.structs.replace(make_prepare(Topology.initial(3), 2), rebuild=True)
    p = msgspec.structs.replace(p, topology=plan.new_topology, leaving=[], joining=[], transfers=[])
    assert not p.old_group_usable
    e = Engine(1, p)
    assert e.s.role is Role.SURVIVOR and not e.s.old_mode
    e.step()
    e.done(StartRendezvous)
    out = e.done(StartTransfer)
    assert not of(out, EnsureWaveRunning) and e.s.consensus_value == 0
    one(e.step(_commit(p)), StartCommitBarrier)
    out = e.done(StartCommitBarrier, BarrierResult(wave=5, step=0))
    assert one(out, TakeRank).wave == 5 and not of(out, NewGroupBarrier)
    e.step(CommitApplied())
    assert e.phase is P.DONE


def test_emergency_commit_before_ready_posts_the_barrier_when_ready():
    e = Engine(1, DEAD)
    e.step()
    e.step(_commit(DEAD))
    e.done(StartRendezvous)
    out = e.done(StartTransfer)
    one(out, StartCommitBarrier)


def test_emergency_survivor_with_a_lost_barrier_is_fatal():
    e = Engine(0, DEAD)
    e.to_ready()
    e.step(_commit(DEAD))
    e.step(dt=2 * COMMIT_S + 0.1)
    assert e.phase is P.FAILED


def test_emergency_leaving_engine_never_commits_on_its_own():
    p = make_prepare(Topology.initial(4), 2, dead=[3], remove=[3])  # engine 2 leaves alive
    e = Engine(2, p)
    e.to_ready()
    e.step(_commit(p))
    assert e.phase is P.READY_TO_COMMIT and not of(e.log, StartCommitBarrier)
    assert e.s.consensus_value == 0


# ----------------------------------------------------------------------------- lockstep


def _group_round(engines, step, inputs=None):
    """One consensus all-reduce over ``engines`` (the current group), fed back to each."""
    values = [e.s.consensus_value if e.s.active else 0 for e in engines]
    c = Consensus(step, min(values), max(values))
    for e in engines:
        if e.s.active:
            e.step(c, *(inputs or {}).get(e.s.engine_id, ()))
    return c


def test_all_ranks_commit_at_the_same_step():
    old = [Engine(i, UP) for i in (0, 1)]
    new = Engine(2, UP, current_epoch=None)
    for e in (*old, new):
        e.to_ready()
    old[0].step(_commit(UP))
    _group_round(old, 32)  # rank 1 has not read the COMMIT yet
    assert {e.phase for e in old} == {P.READY_TO_COMMIT}
    old[1].step(_commit(UP))
    _group_round(old, 64)
    assert {e.phase for e in old} == {P.COMMITTING} and {e.s.commit_step for e in old} == {64}
    wave_step = {one(e.log, NewGroupBarrier).step for e in old}
    new.done(StartCommitBarrier, BarrierResult(wave=5, step=max(wave_step)))
    for e in (*old, new):
        e.step(CommitApplied())
    assert {e.s.commit_step for e in (*old, new)} == {64}


def test_a_rank_timing_out_means_nobody_commits():
    old = [Engine(i, UP) for i in (0, 1)]
    for e in old:
        e.to_ready()
        e.step(_commit(UP))
    old[1].step(dt=COMMIT_S)  # its deadline fires in the iteration of the all-reduce
    _group_round(old, 32)
    assert old[0].phase is P.READY_TO_COMMIT and old[1].phase is P.ROLLED_BACK
    old[0].step(_abort(UP, "engine 1 failed"))  # the frontend relays the failure
    assert old[0].phase is P.ROLLED_BACK


# ----------------------------------------------------------------------------- slot


def test_slot_starts_a_prepare_and_tracks_the_epoch():
    slot = ScaleSlot(1, current_epoch=0)
    assert not slot.active and slot.accepts_new_requests and slot.consensus_value == 0
    assert slot.next_deadline() is None and not slot.holds_wave
    slot.deliver(UP)
    assert slot.active
    out = slot.progress(0.0)
    job = one(out, StartRendezvous).job_id
    slot.deliver(JobDone(job))
    xfer = one(slot.progress(0.1), StartTransfer).job_id
    slot.deliver(JobDone(xfer))
    slot.progress(0.2)
    slot.deliver(_commit(UP))
    slot.progress(0.3)
    assert slot.consensus_value == 1 and slot.holds_wave and slot.next_deadline() is not None
    slot.deliver(_all_ready(UP))
    slot.progress(0.4)
    slot.deliver(CommitApplied())
    slot.progress(0.5)
    assert slot.current_epoch == 1 and not slot.active and slot.consensus_value == 0
    slot.deliver(ScaleAbort("late", 1, "x"))  # a message for no state: dropped
    slot.progress(0.6)
    assert slot.dropped_inputs == 1


def test_slot_next_prepare_waits_for_the_previous_state_and_keeps_its_abort():
    p2 = make_prepare(Topology.initial(2), 3, seq=2, op="second")
    slot = ScaleSlot(0, current_epoch=0)
    slot.deliver(UP)
    slot.progress(0.0)
    # One input drain: the first operation's ABORT, then the second's PREPARE and ABORT.
    slot.deliver(_abort(UP, "first"))
    slot.deliver(p2)
    slot.deliver(_abort(p2, "second"))
    out = slot.progress(1.0)
    rolled = [r for r in reports(out) if r.event is ScaleEvent.ROLLED_BACK]
    assert [(r.operation_id, r.cause) for r in rolled] == [
        ("op", "aborted by the frontend: first"),
        ("second", "aborted by the frontend: second"),  # not lost with the old state
    ]
    assert slot.state is not None and slot.state.operation_id == "second"


def test_slot_prepare_waits_while_a_hand_back_is_owed():
    down = make_prepare(Topology.initial(3), 2)
    slot = ScaleSlot(2, current_epoch=0)
    slot.deliver(down)
    assert of(slot.progress(0.0, num_unfinished=2), HandBackRequests)
    slot.deliver(_abort(down))
    slot.deliver(make_prepare(Topology.initial(3), 2, seq=2, op="next"))
    slot.progress(0.1, num_unfinished=0)
    assert slot.state.operation_id == "op"  # owes the hand-back report: the PREPARE waits
    slot.deliver(HandedBack(("a", "b")))
    out = slot.progress(0.2, num_unfinished=0)
    assert reports(out)[0].request_ids == ["a", "b"]
    assert slot.state.operation_id == "next" and slot.state.phase is P.MIGRATING


def test_slot_newer_prepare_supersedes_a_waiting_one_and_strays_are_dropped():
    slot = ScaleSlot(0, current_epoch=0)
    slot.deliver(make_prepare(Topology.initial(2), 3, seq=3, op="c"))
    slot.deliver(make_prepare(Topology.initial(2), 3, seq=2, op="b"))  # older: ignored
    slot.progress(0.0)
    assert slot.state.operation_id == "c"
    other = ScaleSlot(9, current_epoch=0)  # engine 9 has no part in UP
    other.deliver(UP)
    assert other.progress(0.0) == [] and other.dropped_inputs == 1 and other.state is None
