"""ScaleController: phases, rollback, conflicts, deadlines -- and a seeded model check of
the controller with N engine state machines, the ownership table and random faults under
random interleavings (no sockets, no processes)."""

from __future__ import annotations

import collections
import json
import random
from dataclasses import dataclass, field

import pytest

from tidal.elastic.migration import OwnershipTable
from tidal.elastic.plan import ScalePlan, ScalePlanError
from tidal.elastic.scale_events import (
    BarrierResult,
    CommitApplied,
    Consensus,
    DestroyStandbyGroups,
    Fatal,
    HandBackRequests,
    HandedBack,
    JobDone,
    JobFailed,
    Leave,
    NewGroupBarrier,
    OldGroupFailed,
    ScalingPhase,
    SendReport,
    StartCommitBarrier,
    StartRendezvous,
    StartTransfer,
    TakeRank,
)
from tidal.elastic.scale_slot import ScaleSlot
from tidal.frontend.scaling.scale_controller import ScaleController
from tidal.frontend.scaling.scale_events import (
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
    ScalePhase,
    ScaleRequest,
    ScaleTimeouts,
)
from tidal.protocol.elastic import (
    ScaleAbort,
    ScaleCommit,
    ScaleEvent,
    ScalePrepare,
    ScaleReport,
)
from tidal.protocol.topology import Topology

T = ScaleTimeouts(
    start_engines_s=10,
    prepare_s=40,
    commit_s=10,
    finish_s=5,
    rendezvous_s=10,
    transfer_s=20,
    engine_commit_s=5,
)


def ctl(n: int = 2, **kw) -> ScaleController:
    kw.setdefault("timeouts", T)
    kw.setdefault("death_settle_s", 0.0)  # recovery asked at once (the settle has its tests)
    return ScaleController(Topology.initial(n), 8, bytes_per_expert=10, cpu_cores=4, **kw)


def of(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def one(actions, cls):
    (a,) = of(actions, cls)
    return a


def rep(c: ScaleController, e: int, event: ScaleEvent, **kw) -> ScaleReport:
    rec = c.current
    assert rec is not None
    return ScaleReport(rec.operation_id, e, rec.to_epoch, event, **kw)


def all_report(c: ScaleController, engines, event, now, **kw) -> list:
    out = []
    for e in engines:
        out += c.handle(rep(c, e, event, **kw), now)
    return out


# ----------------------------------------------------------------------------- happy paths


def test_scale_up_end_to_end():
    c = ctl(2)
    resp, out = c.request_scale(ScaleRequest(3, operation_id="up"), 1.0)
    assert resp.admission is Admission.STARTED and resp.status_code == 200
    rec = resp.record
    assert c.is_scaling and rec.phase is ScalePhase.STARTING_ENGINES
    spawn = one(out, SpawnEngines)
    assert spawn.engine_ids == (2,) and spawn.topology.engine_ids == [0, 1, 2]
    assert c.handle(EngineStarted(7), 1.5) == []  # not ours
    out = c.handle(EngineStarted(2), 2.0)
    prep = one(out, SendPrepare)
    assert prep.engine_ids == (0, 1, 2) and rec.phase is ScalePhase.PREPARING
    msg = prep.message
    assert (msg.operation_id, msg.sequence, msg.epoch) == ("up", 1, 1)
    assert msg.joining == [2] and msg.leaving == [] and msg.old_group_usable
    assert msg.threads_per_rank == 1 and msg.rendezvous_timeout_s == 10  # 4 cores / 3
    assert all_report(c, [0, 1], ScaleEvent.PREPARED, 3.0) == []
    out = c.handle(rep(c, 2, ScaleEvent.PREPARED), 4.0)
    assert one(out, SendCommit).engine_ids == (0, 1, 2) and rec.phase is ScalePhase.COMMITTING
    out = c.handle(rep(c, 1, ScaleEvent.COMMITTED, step=64), 5.0)
    assert one(out, PublishTopology).topology.engine_ids == [0, 1, 2]
    assert c.topology.epoch == 1 and c.is_scaling
    out = all_report(c, [0, 2], ScaleEvent.COMMITTED, 5.5, step=64)
    assert one(out, RecordResult).record is rec and not c.is_scaling
    assert rec.phase is ScalePhase.SUCCEEDED and rec.result == "succeeded"
    assert (rec.from_size, rec.to_size, rec.from_epoch, rec.to_epoch) == (2, 3, 0, 1)
    assert rec.bytes_moved == rec.min_bytes > 0 and rec.experts_moved == rec.bytes_moved // 10
    assert rec.duration == 4.5
    assert rec.phase_durations() == {
        "planned": 0.0,
        "starting_engines": 1.0,
        "preparing": 2.0,
        "committing": 1.5,
        "finishing": 0.0,
    }
    json.dumps(rec.to_dict())  # what /scale_elastic_ep answers and /stats lists
    assert c.request_scale(ScaleRequest(3, operation_id="up"), 9.0) == (
        type(resp)(Admission.DUPLICATE, rec),
        [],
    )


def test_scale_down_of_a_middle_engine_with_migration():
    c = ctl(3)
    resp, out = c.request_scale(
        ScaleRequest(2, drain_timeout_s=5.0, operation_id="down", remove=(1,)), 0.0
    )
    rec = resp.record
    # The balancer stops routing to the leaving engine *before* the PREPARE is sent.
    assert [type(a) for a in out] == [ExcludeFromRouting, SendPrepare]
    assert out[0].engine_ids == (1,) and out[1].message.leaving == [1]
    assert c.next_deadline() == 0.0 + T.prepare_s + 5.0
    out = c.handle(rep(c, 1, ScaleEvent.HANDED_BACK, request_ids=["a", "b"]), 1.0)
    assert out == [MigrateRequests(1, ("a", "b"), "down")]
    c.handle(RequestsMigrated(1, 2, "down"), 1.1)
    c.handle(RequestsMigrated(1, 5, "nope"), 1.1)  # unknown operation: not counted
    out = all_report(c, [0, 1, 2], ScaleEvent.PREPARED, 2.0)
    assert one(out, SendCommit).engine_ids == (0, 1, 2)
    out = c.handle(rep(c, 1, ScaleEvent.COMMITTED, step=32), 3.0)  # the leaving one: enough
    assert one(out, PublishTopology).topology.engine_ids == [0, 2]
    out = all_report(c, [0, 2], ScaleEvent.COMMITTED, 3.1, step=32)
    assert out == [StopEngines((1,), "left the deployment")]
    assert rec.phase is ScalePhase.FINISHING
    c.handle(rep(c, 1, ScaleEvent.LEFT), 3.2)
    out = c.handle(EngineExited(1), 3.5)
    assert out[0] == MigrateRequests(1, None, "down")  # whatever the table still gives it
    assert one(out, RecordResult).record.phase is ScalePhase.SUCCEEDED
    assert rec.requests_migrated == 2 and rec.leaving == [1] and c.dead == set()


@pytest.mark.parametrize(("frm", "to"), [(1, 4), (4, 1), (1, 8), (8, 1)])
def test_one_to_n_and_back(frm, to):
    c = ctl(frm)
    resp, out = c.request_scale(ScaleRequest(to), 0.0)
    rec = resp.record
    for e in rec.joining:
        out += c.handle(EngineStarted(e), 0.5)
    prep = one(out, SendPrepare).message
    out = all_report(c, [*range(frm), *rec.joining], ScaleEvent.PREPARED, 1.0)
    out += all_report(c, prep.topology.engine_ids, ScaleEvent.COMMITTED, 2.0, step=32)
    for e in rec.leaving:
        out += c.handle(EngineExited(e), 3.0)
    assert rec.phase is ScalePhase.SUCCEEDED and c.topology.size == to
    assert rec.bytes_moved == rec.min_bytes and (rec.p2p_bytes, rec.disk_bytes) == (
        rec.bytes_moved,
        0,
    )


@pytest.mark.parametrize("sizes", [(2, 4, 2), (2, 3, 2), (4, 2, 3)])
def test_with_redundant_experts(sizes):
    c = ScaleController(Topology.initial(sizes[0]), 8, 2, bytes_per_expert=10, timeouts=T)
    for i, to in enumerate(sizes[1:]):
        resp, _ = c.request_scale(ScaleRequest(to, operation_id=f"r{i}"), float(i))
        _finish_ok(c, float(i))
        rec = resp.record
        assert c.topology.size == to and rec.bytes_moved == rec.min_bytes
        assert c.topology.placement is not None
        assert sum(len(row) for row in c.topology.placement) >= 8 + 2  # replicas kept


def test_nothing_to_do():
    c = ctl(2)
    resp, out = c.request_scale(ScaleRequest(2, operation_id="same"), 0.0)
    assert resp.record.phase is ScalePhase.SUCCEEDED and out == [RecordResult(resp.record)]
    assert "nothing to do" in resp.record.warnings[0] and not c.is_scaling
    assert c.request_scale(ScaleRequest(2, operation_id="same"), 1.0)[0].record is resp.record


# ----------------------------------------------------------------------------- admission


def test_conflict_and_duplicate_while_running():
    c = ctl(2)
    first, _ = c.request_scale(ScaleRequest(3, operation_id="a"), 0.0)
    dup, out = c.request_scale(ScaleRequest(4, operation_id="a"), 0.1)
    assert dup.admission is Admission.DUPLICATE and dup.record is first.record and out == []
    other, out = c.request_scale(ScaleRequest(4, operation_id="b"), 0.2)
    assert other.admission is Admission.CONFLICT and other.status_code == 409 and out == []
    assert other.record is first.record and "b" not in c.history
    anon, _ = c.request_scale(ScaleRequest(1), 0.3)
    assert anon.admission is Admission.CONFLICT


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        (ScaleRequest(0), ">= 1"),
        (ScaleRequest(9), "above the number of experts"),
        (ScaleRequest(3, drain_timeout_s=-1), "drain_timeout"),
        (ScaleRequest(3, drain_timeout_s=float("nan")), "drain_timeout"),
        (ScaleRequest(3, operation_id=""), "operation_id"),
        (ScaleRequest(2, remove=(5,)), "not in the current topology"),
        (ScaleRequest(2), "already"),  # same size: handled as nothing to do, see above
    ],
)
def test_invalid_requests_are_400_and_occupy_nothing(request_, match):
    c = ctl(2)
    if match == "already":
        assert c.request_scale(request_, 0.0)[0].record.phase is ScalePhase.SUCCEEDED
        return
    with pytest.raises(ScalePlanError, match=match):
        c.request_scale(request_, 0.0)
    assert not c.is_scaling and not c.history
    assert c.request_scale(ScaleRequest(3), 1.0)[0].admission is Admission.STARTED


def test_placement_minimum_is_named():
    c = ScaleController(Topology.initial(2), 8, 2, timeouts=T)
    with pytest.raises(ScalePlanError, match="minimum is 2"):
        c.request_scale(ScaleRequest(1), 0.0)
    c.request_scale(ScaleRequest(2, operation_id="noop"), 0.0)
    with pytest.raises(ScalePlanError, match="minimum is 2"):
        c.validate(1)


def test_generated_operation_ids_never_collide():
    c = ctl(2)
    c.request_scale(ScaleRequest(2, operation_id="scale-2"), 0.0)  # a user's id
    resp, _ = c.request_scale(ScaleRequest(2), 1.0)
    assert resp.record.operation_id == "scale-2'"


def test_history_is_bounded():
    c = ctl(2, history_len=3)
    for i in range(5):
        c.request_scale(ScaleRequest(2, operation_id=f"n{i}"), float(i))
    assert list(c.history) == ["n2", "n3", "n4"]


# ----------------------------------------------------------------------------- rollback


def _finish_ok(c: ScaleController, now: float) -> None:
    """Drive the current operation to success (every engine behaves)."""
    rec = c.current
    assert rec is not None
    for e in rec.joining:
        c.handle(EngineStarted(e), now)
    members = [*c.topology.engine_ids, *rec.joining]
    all_report(c, [e for e in members if e not in rec.dead], ScaleEvent.PREPARED, now)
    new = [e for e in members if e not in rec.leaving]
    all_report(c, new, ScaleEvent.COMMITTED, now, step=1)
    for e in rec.leaving:
        if e not in rec.dead:
            c.handle(EngineExited(e), now)
    assert rec.phase is ScalePhase.SUCCEEDED, rec


def test_new_engine_never_ready():
    c = ctl(2)
    resp, _ = c.request_scale(ScaleRequest(3, operation_id="a"), 0.0)
    assert c.tick(T.start_engines_s - 0.1) == []
    out = c.tick(T.start_engines_s)
    assert out[0] == StopEngines((2,), out[0].reason, force=True)
    assert not of(out, SendAbort)  # no PREPARE went out: nothing to abort
    rec = resp.record
    assert (
        rec.phase is ScalePhase.ROLLED_BACK and rec.cause == "new engines [2] not ready after 10s"
    )
    assert c.topology.epoch == 0 and c.topology.next_id == 3  # id 2 retired
    resp, out = c.request_scale(ScaleRequest(3, operation_id="b"), 20.0)
    assert one(out, SpawnEngines).engine_ids == (3,)  # a fresh id
    _finish_ok(c, 21.0)
    assert c.topology.engine_ids == [0, 1, 3]


def test_new_engine_dies_during_prepare():
    c = ctl(2)
    resp, _ = c.request_scale(ScaleRequest(4, operation_id="a"), 0.0)
    c.handle(EngineStarted(2), 0.1)
    c.handle(EngineStarted(3), 0.2)
    c.handle(rep(c, 0, ScaleEvent.PREPARED), 0.3)
    out = c.handle(EngineExited(3, "killed"), 0.4)
    abort = one(out, SendAbort)
    assert abort.engine_ids == (0, 1, 2) and abort.message.operation_id == "a"
    assert one(out, StopEngines).engine_ids == (2,)
    assert resp.record.cause == "engine 3 died during preparing: killed"
    assert c.dead == set() and c.topology.epoch == 0  # survivors untouched
    assert c.handle(rep_for(resp.record, 1, ScaleEvent.PREPARED), 0.5) == []  # late
    c.request_scale(ScaleRequest(3, operation_id="b"), 1.0)
    _finish_ok(c, 2.0)


def rep_for(rec, e, event, **kw) -> ScaleReport:
    return ScaleReport(rec.operation_id, e, rec.to_epoch, event, **kw)


def test_prepare_failure_report_rolls_back_and_restores_routing():
    c = ctl(3)
    resp, _ = c.request_scale(ScaleRequest(2, operation_id="a"), 0.0)
    out = c.handle(rep(c, 0, ScaleEvent.FAILED, cause="expert transfer timed out"), 1.0)
    assert [type(a) for a in out] == [SendAbort, RestoreRouting, RecordResult]
    assert out[1].engine_ids == (2,)
    assert resp.record.cause == "engine 0: expert transfer timed out"
    assert resp.record.phase is ScalePhase.ROLLED_BACK and c.topology.epoch == 0


def test_prepare_deadline_names_the_slow_engines():
    c = ctl(2)
    resp, _ = c.request_scale(ScaleRequest(1, drain_timeout_s=2), 0.0)
    c.handle(rep(c, 1, ScaleEvent.PREPARED), 1.0)
    assert c.tick(41.9) == []
    out = c.tick(42.0)
    assert resp.record.cause == "engines [0] not prepared after 42s"
    assert of(out, SendAbort) and of(out, RestoreRouting)
    assert c.handle(rep_for(resp.record, 0, ScaleEvent.PREPARED), 43.0) == []
    assert c.runner.ignored_reports == 1  # the late success of a finished operation


def test_survivor_death_during_prepare_then_emergency_replacement():
    c = ctl(3)
    resp, _ = c.request_scale(ScaleRequest(4, operation_id="a"), 0.0)
    c.handle(EngineStarted(3), 0.1)
    out = c.handle(EngineExited(1, "segfault"), 0.5)
    assert out[0] == MigrateRequests(1, None, "a")
    assert resp.record.phase is ScalePhase.ROLLED_BACK and c.dead == {1}
    assert one(out, StopEngines).engine_ids == (3,)
    # Same size: the dead engine is replaced; no copy is taken from it; standby consensus.
    resp, out = c.request_scale(ScaleRequest(3, operation_id="b"), 1.0)
    rec = resp.record
    assert rec.dead == [1] and rec.leaving == [1] and rec.joining == [4]
    c.handle(EngineStarted(4), 1.1)
    prep = c.runner.running.prepare  # type: ignore[union-attr]
    assert not prep.old_group_usable and prep.dead == [1]
    assert all(t.src_engine_id != 1 for t in prep.transfers)
    _finish_ok(c, 2.0)
    assert c.topology.engine_ids == [0, 2, 4] and c.dead == set()


def test_dead_member_outside_an_operation():
    c = ctl(2)
    assert c.handle(EngineExited(0, "oom"), 0.0) == [MigrateRequests(0, None)]
    assert c.dead == {0}
    resp, out = c.request_scale(ScaleRequest(1, operation_id="a"), 1.0)
    assert resp.record.dead == [0] and c.topology.engine_ids == [0, 1]
    assert one(out, SendPrepare).engine_ids == (1,)  # nothing is sent to the dead engine
    _finish_ok(c, 2.0)
    assert c.topology.engine_ids == [1] and c.dead == set()
    assert c.handle(EngineExited(0), 3.0) == [MigrateRequests(0, None)]  # former: nothing


def test_rollback_reported_during_commit():
    c = ctl(2)
    resp, _ = c.request_scale(ScaleRequest(3, operation_id="a"), 0.0)
    c.handle(EngineStarted(2), 0.1)
    all_report(c, [0, 1, 2], ScaleEvent.PREPARED, 0.2)
    out = c.handle(rep(c, 0, ScaleEvent.FAILED, cause="no commit consensus"), 1.0)
    # Safe after COMMIT: engine 0's flag is down for good, so nobody can commit.
    assert of(out, SendAbort) and one(out, StopEngines).engine_ids == (2,)
    assert resp.record.phase is ScalePhase.ROLLED_BACK
    c.request_scale(ScaleRequest(3, operation_id="b"), 2.0)
    _finish_ok(c, 3.0)


def test_joiner_failing_after_commit_has_no_say():
    c = ctl(2)
    resp, _ = c.request_scale(ScaleRequest(3, operation_id="a"), 0.0)
    c.handle(EngineStarted(2), 0.1)
    all_report(c, [0, 1, 2], ScaleEvent.PREPARED, 0.2)
    out = c.handle(rep(c, 2, ScaleEvent.FAILED, cause="barrier timed out"), 1.0)
    assert out == [StopEngines((2,), "failed after COMMIT", force=True)]
    assert resp.record.phase is ScalePhase.COMMITTING  # the survivors' consensus decides
    all_report(c, [0, 1], ScaleEvent.COMMITTED, 2.0, step=32)
    assert resp.record.phase is ScalePhase.SUCCEEDED and c.topology.engine_ids == [0, 1, 2]
    assert c.dead == {2}  # a dead member of the new epoch: the next operation replaces it
    c.handle(EngineExited(2), 2.5)
    resp, _ = c.request_scale(ScaleRequest(3, operation_id="b"), 3.0)
    assert resp.record.dead == [2] and resp.record.joining == [3]


def test_engine_death_during_commit_waits_for_the_outcome():
    c = ctl(3)
    resp, _ = c.request_scale(ScaleRequest(2, operation_id="a"), 0.0)
    all_report(c, [0, 1, 2], ScaleEvent.PREPARED, 0.1)
    out = c.handle(EngineExited(0, "killed"), 0.5)
    assert resp.record.phase is ScalePhase.COMMITTING and out == [MigrateRequests(0, None, "a")]
    out = c.handle(rep(c, 1, ScaleEvent.ROLLED_BACK, cause="DP group failed"), 0.6)
    assert resp.record.phase is ScalePhase.ROLLED_BACK and c.dead == {0}


def _down_to_one(c: ScaleController) -> None:
    """2 -> 1: engine 1 leaves (excluded from routing), engine 0 stays."""
    resp, out = c.request_scale(ScaleRequest(1, drain_timeout_s=5.0, operation_id="a"), 0.0)
    assert one(out, ExcludeFromRouting).engine_ids == (1,) and resp.record.leaving == [1]


def _restored_before_moved(out, restored: int, moved: int) -> None:
    kinds = [(type(a), getattr(a, "engine_ids", getattr(a, "engine_id", None))) for a in out]
    assert (RestoreRouting, (restored,)) in kinds and (MigrateRequests, moved) in kinds
    assert kinds.index((RestoreRouting, (restored,))) < kinds.index((MigrateRequests, moved))


def test_staying_engine_dies_during_a_scale_down_prepare():
    """Engine 0's requests move only once the rollback made engine 1 routable again:
    moved first, every one would fail (the only other engine was draining)."""
    c = ctl(2)
    _down_to_one(c)
    out = c.handle(EngineExited(0, "killed"), 0.5)
    assert c.history["a"].phase is ScalePhase.ROLLED_BACK and c.dead == {0}
    _restored_before_moved(out, 1, 0)
    assert one(out, MigrateRequests) == MigrateRequests(0, None, "a")


def test_staying_engine_dies_during_a_scale_down_commit():
    c = ctl(2)
    _down_to_one(c)
    all_report(c, [0, 1], ScaleEvent.PREPARED, 0.1)
    out = c.handle(EngineExited(0, "killed"), 0.5)
    assert of(out, MigrateRequests) == []  # engine 1 is draining, the outcome open
    out = c.handle(rep(c, 1, ScaleEvent.ROLLED_BACK, cause="DP group failed"), 0.6)
    assert c.history["a"].phase is ScalePhase.ROLLED_BACK
    _restored_before_moved(out, 1, 0)
    assert one(out, MigrateRequests) == MigrateRequests(0, None, "a")


def test_staying_engine_dies_while_a_scale_down_outcome_is_unknown():
    c = ctl(2)
    _down_to_one(c)
    all_report(c, [0, 1], ScaleEvent.PREPARED, 0.1)
    c.tick(0.1 + T.commit_s)
    rec = c.history["a"]
    assert rec.phase is ScalePhase.FAILED
    assert of(c.handle(EngineExited(0, "killed"), 11.0), MigrateRequests) == []
    out = c.handle(rep_for(rec, 1, ScaleEvent.ROLLED_BACK, cause="x"), 12.0)
    assert rec.resolution == "rolled_back"
    _restored_before_moved(out, 1, 0)


def test_commit_outcome_unknown_then_resolved_late():
    c = ctl(2)
    resp, _ = c.request_scale(ScaleRequest(1, operation_id="a"), 0.0)
    all_report(c, [0, 1], ScaleEvent.PREPARED, 0.1)
    out = c.tick(0.1 + T.commit_s)
    rec = resp.record
    assert rec.phase is ScalePhase.FAILED and "no engine reported" in (rec.cause or "")
    assert of(out, RecordResult) and c.is_scaling
    busy, _ = c.request_scale(ScaleRequest(2, operation_id="b"), 20.0)
    assert busy.admission is Admission.CONFLICT and busy.record is rec
    out = c.handle(rep_for(rec, 0, ScaleEvent.COMMITTED, step=32), 30.0)
    assert one(out, PublishTopology).topology.engine_ids == [0]
    assert one(out, StopEngines).engine_ids == (1,) and rec.resolution == "committed"
    assert not c.is_scaling and c.topology.epoch == 1
    c.request_scale(ScaleRequest(2, operation_id="b"), 31.0)
    _finish_ok(c, 32.0)


def test_commit_outcome_unknown_then_rolled_back_late():
    c = ctl(2)
    resp, _ = c.request_scale(ScaleRequest(3, operation_id="a"), 0.0)
    c.handle(EngineStarted(2), 0.0)
    all_report(c, [0, 1, 2], ScaleEvent.PREPARED, 0.1)
    c.tick(20.0)
    out = c.handle(rep_for(resp.record, 2, ScaleEvent.FAILED, cause="x"), 21.0)
    assert out == []  # a joiner has no say: still unresolved
    out = c.handle(rep_for(resp.record, 1, ScaleEvent.ROLLED_BACK, cause="x"), 22.0)
    assert one(out, StopEngines).engine_ids == (2,) and resp.record.resolution == "rolled_back"
    assert c.topology.epoch == 0 and c.topology.next_id == 3 and not c.is_scaling


def test_missing_commit_reports_and_slow_exits_are_warnings():
    c = ctl(3)
    resp, _ = c.request_scale(ScaleRequest(2, operation_id="a"), 0.0)
    all_report(c, [0, 1, 2], ScaleEvent.PREPARED, 0.0)
    c.handle(rep(c, 0, ScaleEvent.COMMITTED, step=32), 1.0)
    out = c.tick(0.0 + T.commit_s)
    assert resp.record.phase is ScalePhase.FINISHING and one(out, StopEngines).engine_ids == (2,)
    out = c.tick(10.0 + T.finish_s)
    assert one(out, StopEngines).force and resp.record.phase is ScalePhase.SUCCEEDED
    assert len(resp.record.warnings) == 2


def test_reports_of_other_operations_are_ignored():
    c = ctl(2)
    c.request_scale(ScaleRequest(1, operation_id="a"), 0.0)
    assert c.handle(ScaleReport("zzz", 0, 1, ScaleEvent.PREPARED), 0.1) == []
    assert c.handle(ScaleReport("a", 0, 7, ScaleEvent.PREPARED), 0.1) == []
    assert c.handle(ScaleReport("a", 9, 1, ScaleEvent.PREPARED), 0.1) == []
    assert c.runner.ignored_reports == 3
    with pytest.raises(AssertionError, match="unreachable"):  # assert_never: not an Event
        c.handle(object(), 0.2)  # type: ignore[arg-type]


def test_inconsistent_report_after_commit_is_only_a_warning():
    c = ctl(2)
    resp, _ = c.request_scale(ScaleRequest(1, operation_id="a"), 0.0)
    all_report(c, [0, 1], ScaleEvent.PREPARED, 0.0)
    c.handle(rep(c, 1, ScaleEvent.COMMITTED, step=32), 0.1)
    c.handle(rep(c, 0, ScaleEvent.FAILED, cause="?"), 0.2)
    assert "inconsistent" in resp.record.warnings[0]


def test_a_member_failing_after_the_operation_succeeded_is_stopped():
    c = ctl(2)
    resp, _ = c.request_scale(ScaleRequest(3, operation_id="a"), 0.0)
    c.handle(EngineStarted(2), 0.0)
    all_report(c, [0, 1, 2], ScaleEvent.PREPARED, 0.1)
    all_report(c, [0, 1], ScaleEvent.COMMITTED, 0.2, step=32)
    c.tick(0.1 + T.commit_s)  # engine 2's COMMITTED never came: finished with a warning
    assert resp.record.phase is ScalePhase.SUCCEEDED
    out = c.handle(rep_for(resp.record, 2, ScaleEvent.FAILED, cause="barrier"), 20.0)
    assert out == [StopEngines((2,), "failed after the commit", force=True)] and c.dead == {2}
    assert c.handle(rep_for(resp.record, 0, ScaleEvent.PREPARED), 21.0) == []  # just late


def test_nobody_left_who_could_commit_is_a_rollback():
    c = ctl(1)
    resp, _ = c.request_scale(ScaleRequest(3, operation_id="a"), 0.0)
    for e in (1, 2):
        c.handle(EngineStarted(e), 0.0)
    all_report(c, [0, 1, 2], ScaleEvent.PREPARED, 0.1)
    c.handle(EngineExited(0, "killed"), 0.2)  # the only survivor, mid-commit
    assert resp.record.phase is ScalePhase.COMMITTING
    c.handle(rep(c, 1, ScaleEvent.FAILED, cause="standby group destroyed"), 0.3)
    out = c.handle(rep(c, 2, ScaleEvent.FAILED, cause="standby group destroyed"), 0.4)
    assert resp.record.phase is ScalePhase.ROLLED_BACK and of(out, RecordResult)
    assert "could commit" in (resp.record.cause or "") and c.dead == {0}
    resp, out = c.request_scale(ScaleRequest(1, operation_id="b"), 1.0)  # replace it
    assert resp.record.dead == [0] and one(out, SpawnEngines).engine_ids == (3,)


def test_unresolved_operation_settles_when_nobody_could_have_committed():
    c = ctl(2)
    resp, _ = c.request_scale(ScaleRequest(1, operation_id="a"), 0.0)
    all_report(c, [0, 1], ScaleEvent.PREPARED, 0.0)
    c.tick(T.commit_s)
    assert c.is_scaling
    c.handle(EngineExited(0), 11.0)
    out = c.handle(EngineExited(1), 12.0)
    assert resp.record.resolution == "rolled_back" and of(out, RecordResult)
    assert not c.is_scaling and c.dead == {0, 1}


def test_timeouts_are_checked():
    with pytest.raises(ValueError, match="prepare_s"):
        ScaleTimeouts(prepare_s=10, rendezvous_s=10, transfer_s=10)
    with pytest.raises(ValueError, match="commit_s"):
        ScaleTimeouts(commit_s=10, engine_commit_s=10)
    with pytest.raises(ValueError, match="finish_s"):
        ScaleTimeouts(finish_s=0)


# ============================================================================ model check
#
# The controller, N engine state machines and the frontend's ownership table, connected
# by FIFO channels that a seeded scheduler delivers in random order, with helper jobs that
# finish, fail or hang, engines that die, and scale requests at random moments. Groups are
# modelled as the engines see them: the group of epoch g steps only while every member is
# alive and has switched to g; each step every member generates one token per request
# (the token at position p of request r is a pure function of (r, p), like seeded
# sampling), and every K steps it all-reduces the consensus values.

K = 4  # steps between consensus all-reduces (the real loop: 32)


def token(r: str, pos: int) -> int:
    return hash((r, pos)) & 0xFFFF


@dataclass
class SimEngine:
    id: int
    epoch: int | None  # what it serves (a joiner: None until it commits)
    alive: bool = True
    slot: ScaleSlot = None  # type: ignore[assignment]
    requests: dict[str, int] = field(default_factory=dict)  # id -> next position
    reported_group_failure: int | None = None

    def __post_init__(self) -> None:
        self.slot = ScaleSlot(self.id, self.epoch)


class World:
    def __init__(self, seed: int, n0: int, redundant: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self.c = ScaleController(
            Topology.initial(n0), 8, redundant, bytes_per_expert=1, timeouts=T, cpu_cores=2
        )
        self.engines = {i: SimEngine(i, 0) for i in range(n0)}
        self.topologies: dict[int, Topology] = {0: self.c.topology}  # committed by engines
        self.to_engine: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.to_frontend: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.jobs: dict[str, tuple[int, type]] = {}  # job id -> engine, kind
        self.barriers: dict[tuple[str, int], dict[int, int]] = {}  # (op, epoch) -> poster: step
        self.broken_barriers: set[tuple[str, int]] = set()
        self.barrier_jobs: dict[tuple[str, int], dict[int, str]] = collections.defaultdict(dict)
        self.steps: dict[int, int] = collections.defaultdict(int)
        self.pending_ready: list[int] = []
        self.table = OwnershipTable()
        self.targets: dict[str, int] = {}  # request -> total tokens
        self.streams: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.parked: list[str] = []  # waiting for an engine to route to
        self.excluded: set[int] = set()
        self.published: list[int] = [0]
        self.epochs_seen: dict[int, list[int]] = collections.defaultdict(list)
        self.commits: dict[str, dict[int, int]] = collections.defaultdict(dict)  # op -> e: step
        self.rollbacks: dict[str, set[int]] = collections.defaultdict(set)
        self.results: list = []
        self.n_requests = 0
        self.kills = 0
        self.max_kills = 2
        self.plans: dict[str, ScalePlan] = {}  # every operation started
        self.stopped: dict[str, bool] = {}  # request -> its old owner reported it stopped

    # ---------------------------------------------------------------- frontend side

    def apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, SpawnEngines):
                for e in a.engine_ids:
                    self.engines[e] = SimEngine(e, None)
                    self.pending_ready.append(e)
            elif isinstance(a, ExcludeFromRouting):
                self.excluded |= set(a.engine_ids)
            elif isinstance(a, RestoreRouting):
                self.excluded -= set(a.engine_ids)
            elif isinstance(a, SendPrepare | SendCommit | SendAbort):
                for e in a.engine_ids:
                    self.to_engine[e].append(a.message)
            elif isinstance(a, PublishTopology):
                assert a.topology.epoch > self.published[-1], "epochs only increase"
                self.published.append(a.topology.epoch)
                self.table.set_epoch(a.topology.epoch)
                self.excluded &= set(a.topology.engine_ids)
            elif isinstance(a, StopEngines):
                for e in a.engine_ids:
                    self.kill(e, a.reason)
            elif isinstance(a, MigrateRequests):
                self.migrate(a.engine_id, a.request_ids, a.operation_id)
            elif isinstance(a, RecordResult):
                self.results.append(a.record)
            else:
                raise AssertionError(a)

    def routable(self) -> list[int]:
        t = self.c.topology
        return [e for e in t.engine_ids if e not in self.excluded and e not in self.c.dead]

    def send_request(self, r: str) -> None:
        """Route ``r`` (new, or resumed at its accepted count) to an engine."""
        owner = self.table.owner(r)
        choices = [e for e in self.routable() if owner is None or self.table.can_move_to(r, e)]
        if not choices:
            self.parked.append(r)
            return
        e = self.rng.choice(choices)
        pos = len(self.streams[r])
        if owner is None:
            self.table.assign(r, e)
        else:
            self.table.migrate(r, e, pos, old_owner_stopped=self.stopped.pop(r, False))
        self.to_engine[e].append(("add", r, pos))

    def migrate(self, e: int, ids: tuple[str, ...] | None, op: str | None) -> None:
        # Named ids come from a hand-back report: that engine stopped them itself.
        handed_back = ids is not None
        moved = 0
        for r in self.table.owned_by(e) if ids is None else ids:
            a = self.table.owner(r)
            if a is None or a.engine_id != e or r in self.parked:
                continue  # finished, or already moved
            self.stopped[r] = handed_back
            if self.engines[e].alive and not handed_back:
                self.to_engine[e].append(("abort", r))
            self.send_request(r)
            moved += 1
        self.apply(self.c.handle(RequestsMigrated(e, moved, op), self.now))

    def new_request(self) -> None:
        r = f"r{self.n_requests}"
        self.n_requests += 1
        self.targets[r] = self.rng.randint(3, 30)
        self.streams[r] = []
        self.send_request(r)

    def retry_parked(self) -> None:
        parked, self.parked = self.parked, []
        for r in parked:
            if r not in self.finished:  # a dead owner's last outputs may have finished it
                self.send_request(r)

    def on_frontend_message(self, e: int, m) -> None:
        if isinstance(m, ScaleReport):
            if m.event is ScaleEvent.COMMITTED:
                self.commits[m.operation_id][m.engine_id] = m.step  # type: ignore[assignment]
            if m.event in (ScaleEvent.FAILED, ScaleEvent.ROLLED_BACK):
                self.rollbacks[m.operation_id].add(m.engine_id)
            self.apply(self.c.handle(m, self.now))
        elif m[0] == "out":
            _, r, pos, tok, last = m
            if not self.table.accept(e, r, 1):
                return
            s = self.streams[r]
            assert pos == len(s), f"{r}: position {pos} after {len(s)} tokens (gap/duplicate)"
            s.append(tok)
            if last:
                self.finished.add(r)
                self.table.finish(r)
        elif m[0] == "aborted":
            self.table.stopped(e, m[1])
        else:
            raise AssertionError(m)

    # ---------------------------------------------------------------- engine side

    def kill(self, e: int, cause: str = "killed") -> None:
        eng = self.engines[e]
        if not eng.alive:
            return
        eng.alive = False
        self.to_engine[e].clear()
        for key in list(self.barrier_jobs):  # a member died: its barrier can never complete
            self.settle_barrier(key)
        self.apply(self.c.handle(EngineExited(e, cause), self.now))

    def on_engine_message(self, eng: SimEngine, m) -> None:
        if isinstance(m, ScalePrepare | ScaleCommit | ScaleAbort):
            eng.slot.deliver(m)
        elif m[0] == "add":
            _, r, pos = m
            if not eng.slot.accepts_new_requests:
                eng.slot.deliver(HandedBack((r,)))  # bounced at once
            else:
                eng.requests[r] = pos
        elif m[0] == "abort":
            eng.requests.pop(m[1], None)
            self.to_frontend[eng.id].append(("aborted", m[1]))  # after its last output

    def progress(self, eng: SimEngine, *inputs) -> None:
        if not eng.alive:
            return
        for i in inputs:
            eng.slot.deliver(i)
        for a in eng.slot.progress(self.now, num_unfinished=len(eng.requests)):
            if not eng.alive:
                return
            self.engine_action(eng, a)
        s = eng.slot.state
        if s is not None and s.phase is ScalingPhase.COMMITTING and eng.alive:
            eng.slot.deliver(CommitApplied())  # the busy loop carried them out

    def engine_action(self, eng: SimEngine, a) -> None:
        s = eng.slot.state
        assert s is not None
        if isinstance(a, StartRendezvous | StartTransfer):
            self.jobs[a.job_id] = (eng.id, type(a))
        elif isinstance(a, StartCommitBarrier):
            key = (s.operation_id, a.epoch)
            self.barrier_jobs[key][eng.id] = a.job_id
            self.post_barrier(key, eng.id, 0)
        elif isinstance(a, NewGroupBarrier):
            self.post_barrier((s.operation_id, a.epoch), eng.id, a.step)
        elif isinstance(a, HandBackRequests):
            ids = tuple(eng.requests)
            eng.requests.clear()
            eng.slot.deliver(HandedBack(ids))
        elif isinstance(a, SendReport):
            self.to_frontend[eng.id].append(a.report)
        elif isinstance(a, TakeRank):
            assert eng.epoch is None or a.epoch > eng.epoch
            eng.epoch = a.epoch
            self.epochs_seen[eng.id].append(a.epoch)
            self.topologies[a.epoch] = s.prepare.topology
        elif isinstance(a, DestroyStandbyGroups):
            if eng.id in s.prepare.topology:  # a new member: the new groups break
                key = (s.operation_id, a.epoch)
                self.broken_barriers.add(key)
                self.settle_barrier(key)
        elif isinstance(a, Leave):
            eng.epoch = None
            self.kill(eng.id, "left")
        elif isinstance(a, Fatal):
            self.kill(eng.id, a.cause)
        # CancelJob, EnsureWaveRunning, SwapGroups, InstallExperts, SetNumThreads,
        # DestroyOldGroups, DiscardStagedExperts: nothing to model.

    def post_barrier(self, key, e: int, step: int) -> None:
        self.barriers.setdefault(key, {})[e] = step
        self.settle_barrier(key)

    def settle_barrier(self, key) -> None:
        """Complete (all members posted) or fail (a member destroyed it or died)."""
        op, epoch = key
        posted = self.barriers.get(key, {})
        topo = self._op_topology(op)
        if topo is None:
            return
        members = topo.engine_ids
        dead = any(not self.engines[m].alive for m in members if m in self.engines)
        if key in self.broken_barriers or dead:
            for e, job in self.barrier_jobs.pop(key, {}).items():
                self.engines[e].slot.deliver(JobFailed(job, "standby group destroyed"))
            return
        if all(m in posted for m in members):
            result = BarrierResult(wave=0, step=max(posted.values()))
            for e, job in self.barrier_jobs.pop(key, {}).items():
                self.engines[e].slot.deliver(JobDone(job, result))

    def _op_topology(self, op: str) -> Topology | None:
        plan = self.plans.get(op)
        return None if plan is None else plan.new_topology

    def group_step(self, g: int) -> None:
        topo = self.topologies[g]
        members = [self.engines[m] for m in topo.engine_ids]
        if any(m.epoch != g for m in members if m.alive):
            return  # not everyone switched yet (a joiner still in the barrier)
        if not all(m.alive for m in members):
            for m in members:  # a member is dead: every collective fails
                if m.alive and m.reported_group_failure != g:
                    m.reported_group_failure = g
                    self.progress(m, OldGroupFailed("a member died"))
            return
        if any(
            m.slot.state is not None and m.slot.state.phase is ScalingPhase.COMMITTING
            for m in members
        ):
            return  # mid-commit: the loop runs the commit actions before the next step
        self.steps[g] += 1
        step = self.steps[g]
        for m in members:
            for r, pos in list(m.requests.items()):
                last = pos + 1 >= self.targets[r]
                self.to_frontend[m.id].append(("out", r, pos, token(r, pos), last))
                if last:
                    del m.requests[r]
                else:
                    m.requests[r] = pos + 1
        if step % K == 0:
            values = [m.slot.consensus_value for m in members]
            c = Consensus(step, min(values), max(values))
            for m in members:
                self.progress(m, c)

    # ---------------------------------------------------------------- scheduler

    def serving_groups(self) -> list[int]:
        return sorted({e.epoch for e in self.engines.values() if e.alive and e.epoch is not None})

    def random_event(self, faults: bool, scaling: bool) -> None:
        rng = self.rng
        x = rng.random()
        chans = [(e, q) for e, q in self.to_engine.items() if q] + [
            (-1 - e, q) for e, q in self.to_frontend.items() if q
        ]
        if x < 0.30 and chans:
            # A burst from one channel: sockets move messages much faster than engines
            # make tokens, so a report does not wait behind a long backlog of outputs.
            k, q = rng.choice(chans)
            for _ in range(min(len(q), rng.randint(1, 40))):
                m = q.popleft()
                if k >= 0:
                    if self.engines[k].alive:
                        self.on_engine_message(self.engines[k], m)
                else:
                    self.on_frontend_message(-1 - k, m)
        elif x < 0.45:
            alive = [e for e in self.engines.values() if e.alive]
            if alive:
                self.progress(rng.choice(alive))
        elif x < 0.60:
            groups = self.serving_groups()
            if groups:
                self.group_step(rng.choice(groups))
        elif x < 0.70 and self.jobs:
            job = rng.choice(sorted(self.jobs))
            e, _ = self.jobs.pop(job)
            if self.engines[e].alive:
                fail = faults and rng.random() < 0.05
                self.engines[e].slot.deliver(JobFailed(job, "io") if fail else JobDone(job))
        elif x < 0.75 and self.pending_ready:
            e = self.pending_ready.pop(rng.randrange(len(self.pending_ready)))
            if faults and rng.random() < 0.05:
                return  # never starts: the start deadline handles it
            if self.engines[e].alive:
                self.apply(self.c.handle(EngineStarted(e), self.now))
        elif x < 0.83:
            # Mostly short (messages are fast next to deadlines); now and then long
            # enough for a deadline to fire.
            self.now += rng.choice([0.01, 0.05, 0.1, 0.2, 0.5]) if rng.random() < 0.97 else 8.0
            self.apply(self.c.tick(self.now))
            self.retry_parked()
        elif x < 0.90:
            if len(self.targets) - len(self.finished) < 12:
                self.new_request()
        elif x < 0.95 and scaling:
            self.scale_request(rng)
        elif faults and self.kills < self.max_kills and rng.random() < 0.3:
            alive = [e for e in self.engines.values() if e.alive]
            if len(alive) > 1:
                self.kills += 1
                self.kill(rng.choice(alive).id, "injected fault")

    def scale_request(self, rng: random.Random) -> None:
        size = rng.randint(1, 4) if self.c.runner.num_redundant == 0 else rng.randint(2, 4)
        members = self.c.topology.engine_ids
        remove = (rng.choice(members),) if len(members) > 1 and rng.random() < 0.3 else ()
        op = rng.choice([None, f"op{rng.randint(0, 6)}"])
        try:
            resp, actions = self.c.request_scale(
                ScaleRequest(size, rng.choice([0.0, 1.0, 5.0]), op, remove), self.now
            )
        except ScalePlanError:
            return
        self.track(resp)
        self.apply(actions)

    def track(self, resp) -> None:
        if resp.admission is Admission.STARTED and self.c.runner.running is not None:
            self.plans[resp.record.operation_id] = self.c.runner.running.plan

    def quiesce(self, rounds: int = 400) -> None:
        """Deliver everything, finish every job, step every group, let time pass."""
        for _ in range(rounds):
            for _ in range(200):
                chans = [(e, q) for e, q in self.to_engine.items() if q] + [
                    (-1 - e, q) for e, q in self.to_frontend.items() if q
                ]
                if not chans:
                    break
                k, q = chans[0]
                m = q.popleft()
                if k >= 0:
                    if self.engines[k].alive:
                        self.on_engine_message(self.engines[k], m)
                else:
                    self.on_frontend_message(-1 - k, m)
            for job in sorted(self.jobs):
                e, _ = self.jobs.pop(job)
                if self.engines[e].alive:
                    self.engines[e].slot.deliver(JobDone(job))
            for e in list(self.pending_ready):
                self.pending_ready.remove(e)
                if self.engines[e].alive:
                    self.apply(self.c.handle(EngineStarted(e), self.now))
            for eng in list(self.engines.values()):
                self.progress(eng)
            for g in self.serving_groups():
                self.group_step(g)
            self.now += 0.5
            self.apply(self.c.tick(self.now))
            self.retry_parked()
            idle = not self.c.is_scaling and not any(self.to_engine.values())
            if (
                idle
                and not any(self.to_frontend.values())
                and len(self.finished) == len(self.targets)
            ):
                return

    def check_commits(self) -> None:
        """Every rank of an operation commits at the same step, or none does."""
        for op, by_engine in self.commits.items():
            assert len(set(by_engine.values())) == 1, (op, by_engine)
            plan = self.plans[op]
            # No engine whose flag the consensus needs rolled back an operation that
            # committed: only a joiner (current-group consensus) or a leaving engine
            # (standby barrier) may have given up -- they have no say (state race 4).
            no_say = set(plan.joining) if plan.old_topology.engine_ids and not plan.dead else set()
            if plan.dead:
                no_say = set(plan.leaving)
            assert self.rollbacks.get(op, set()) <= no_say, (op, by_engine, self.rollbacks[op])
        for rec in self.results:
            if rec.phase is ScalePhase.SUCCEEDED and rec.from_size != rec.to_size:
                assert rec.operation_id in self.commits, rec
            if rec.phase is ScalePhase.ROLLED_BACK or rec.resolution == "rolled_back":
                # Nobody who lives on switched (an engine that committed and then died
                # before its report came makes no difference to what is served).
                committed = self.commits.get(rec.operation_id, {})
                assert not any(self.engines[e].alive for e in committed), rec
            assert rec.bytes_moved == rec.min_bytes
        for e, epochs in self.epochs_seen.items():
            assert epochs == sorted(set(epochs)), (e, epochs)

    def check_served(self) -> None:
        """What the controller serves is what the live engines serve: every live member
        of its topology is at its epoch, and no other live engine serves any epoch."""
        t = self.c.topology
        for eng in self.engines.values():
            if not eng.alive:
                continue
            if eng.id in t and eng.id not in self.c.dead:
                assert eng.epoch == t.epoch, (eng.id, eng.epoch, t)
            else:
                assert eng.epoch is None, (eng.id, eng.epoch, t)


@pytest.mark.parametrize("seed", range(120))
def test_model_check_random_interleavings(seed):
    rng = random.Random(seed)
    redundant = rng.choice([0, 0, 2])
    w = World(seed, rng.randint(2, 3), redundant)
    for _ in range(4):
        w.new_request()
    for _ in range(1500):
        w.random_event(faults=seed % 3 != 0, scaling=True)
        # An unfinished request is always owned by one engine (or, new and with no
        # engine to go to, queued at the frontend).
        for r in w.targets:
            assert r in w.finished or r in w.table or r in w.parked, r
    w.quiesce()
    w.check_commits()
    if not w.c.is_scaling:
        w.check_served()
    # Whatever happened, the next operation succeeds: it replaces dead engines.
    if w.c.is_scaling:
        w.quiesce()
    assert not w.c.is_scaling, w.c.current
    size = w.c.topology.size
    target = size if w.c.dead else (size % 3) + 2 if redundant else (size % 3) + 1
    if target == size and not w.c.dead:
        target = size + 1
    resp, actions = w.c.request_scale(ScaleRequest(target, 1.0, "final"), w.now)
    w.track(resp)
    w.apply(actions)
    w.quiesce()
    assert resp.record.phase is ScalePhase.SUCCEEDED, resp.record
    assert w.c.topology.size == target and not w.c.dead
    w.quiesce()
    w.check_commits()
    w.check_served()
    # No request lost, none changed: every stream is the unscaled one, complete.
    assert w.finished == set(w.targets), set(w.targets) - w.finished
    for r, n in w.targets.items():
        assert w.streams[r] == [token(r, p) for p in range(n)], r
    assert len(w.table) == 0
    assert w.published == sorted(set(w.published))
