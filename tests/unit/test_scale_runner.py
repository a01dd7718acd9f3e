"""ScaleRunner alone: one operation's phases and rollback with no healing policy, and what
it tells its observer (``RunnerObserver``), in order. The controller's behaviour as a
whole is in test_scale_controller.py and test_scale_recovery.py."""

from __future__ import annotations

from tests.unit.test_scale_controller import T, of, one
from tidal.frontend.scaling.scale_events import (
    AdmitScale,
    EngineExited,
    MigrateRequests,
    PublishTopology,
    RecordResult,
    SendAbort,
    SendPrepare,
)
from tidal.frontend.scaling.scale_records import (
    OperationRecord,
    ScalePhase,
    ScaleRequest,
    ScaleTrigger,
)
from tidal.frontend.scaling.scale_runner import ScaleRunner, ServedState
from tidal.protocol.elastic import ScaleEvent, ScaleReport
from tidal.protocol.topology import Topology


class Recorder:
    """A ``RunnerObserver`` that writes down what it is told."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def admitting(self, request: ScaleRequest, served: ServedState) -> ScaleRequest:
        self.calls.append(("admitting", request.operation_id, served.is_scaling))
        return request

    def member_died(self, engine_id: int, epoch: int, now: float, cause: str) -> None:
        self.calls.append(("member_died", engine_id, epoch, cause))

    def group_failed(self, engine_id: int, cause: str, now: float) -> None:
        self.calls.append(("group_failed", engine_id, cause))

    def committed(self, record: OperationRecord, topology: Topology, now: float) -> None:
        self.calls.append(("committed", record.operation_id, tuple(topology.engine_ids)))

    def ended(self, record: OperationRecord, now: float, served: ServedState) -> None:
        self.calls.append(("ended", record.operation_id, record.phase, served.is_scaling))


def all_report(r: ScaleRunner, engines, event: ScaleEvent, now: float, **kw) -> list:
    out = []
    for e in engines:
        rec = r.current
        assert rec is not None
        out += r.handle(ScaleReport(rec.operation_id, e, rec.to_epoch, event, **kw), now)
    return out


def runner(n: int, observer: Recorder | None = None) -> ScaleRunner:
    return ScaleRunner(Topology.initial(n), 8, timeouts=T, observer=observer)


def test_without_a_policy_a_death_is_recorded_and_nothing_is_asked():
    r = runner(3)
    out = r.handle(EngineExited(1, "killed"), 1.0)
    assert out == [MigrateRequests(1, None, None)]
    assert r.dead == {1} and r.live_members == (0, 2) and not r.is_scaling
    assert r.next_deadline() is None and not of(out, AdmitScale)
    # The next operation removes the dead member.
    resp, out = r.request_scale(ScaleRequest(2, operation_id="down"), 2.0)
    assert resp.record.dead == [1] and one(out, SendPrepare).engine_ids == (0, 2)


def test_observer_hears_a_commit_and_then_the_end():
    rec = Recorder()
    r = runner(2, rec)
    r.request_scale(ScaleRequest(1, operation_id="down"), 1.0)
    all_report(r, [0, 1], ScaleEvent.PREPARED, 2.0)
    out = all_report(r, [0, 1], ScaleEvent.COMMITTED, 3.0, step=1)
    assert one(out, PublishTopology).topology.engine_ids == [0]
    out = r.handle(EngineExited(1, "left"), 4.0)
    assert one(out, RecordResult).record.phase is ScalePhase.SUCCEEDED
    assert rec.calls == [
        ("admitting", "down", False),
        ("committed", "down", (0,)),
        ("ended", "down", ScalePhase.SUCCEEDED, False),  # nothing runs once it is told
    ]


def test_observer_hears_a_death_before_the_rollback_it_causes():
    rec = Recorder()
    r = runner(3, rec)
    r.request_scale(ScaleRequest(2, operation_id="down"), 1.0)
    out = r.handle(EngineExited(0, "killed"), 2.0)
    assert of(out, SendAbort) and one(out, RecordResult).record.phase is ScalePhase.ROLLED_BACK
    assert rec.calls[1:] == [
        ("member_died", 0, 0, "killed"),
        ("ended", "down", ScalePhase.ROLLED_BACK, False),
    ]


def test_group_failures_of_the_served_epoch_only_reach_the_observer():
    rec = Recorder()
    r = runner(2, rec)
    assert r.handle(ScaleReport("", 1, 0, ScaleEvent.GROUP_FAILED, cause="x"), 1.0) == []
    r.handle(ScaleReport("", 1, 7, ScaleEvent.GROUP_FAILED, cause="old"), 1.0)  # other epoch
    r.handle(ScaleReport("", 9, 0, ScaleEvent.GROUP_FAILED), 1.0)  # not a member
    assert rec.calls == [("group_failed", 1, "x")]


def test_a_rebuild_plans_fresh_groups_for_the_same_engines():
    r = runner(2)
    req = ScaleRequest(2, operation_id="rebuild-1", trigger=ScaleTrigger.REBUILD)
    resp, out = r.request_scale(req, 1.0)
    prep = one(out, SendPrepare).message
    assert prep.rebuild and resp.record.trigger is ScaleTrigger.REBUILD
    assert prep.topology.engine_ids == [0, 1] and prep.epoch == 1
