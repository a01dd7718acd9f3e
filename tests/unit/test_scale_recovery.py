"""ScaleController, rank death (docs/architecture.md#faults): a member's exit is an emergency scale-down
the controller asks for itself (``AdmitScale``, trigger "recovery"), retried after
``recovery_retry_s``, followed by a restore (trigger "restore") when enabled, and
``FailDeployment`` when nothing is left to serve. Driven exactly as the driver does: each
``AdmitScale`` goes back through ``request_scale``; the test plays the engines."""

from __future__ import annotations

import pytest

from tests.unit.test_scale_controller import T, all_report, ctl, of, one, rep
from tidal.elastic.plan import ScalePlanError
from tidal.frontend.scaling.scale_controller import ScaleController
from tidal.frontend.scaling.scale_events import (
    AdmitScale,
    EngineExited,
    EngineStarted,
    FailDeployment,
    MigrateRequests,
    PublishTopology,
    RecordResult,
    RequestsMigrated,
    SendAbort,
    SendCommit,
    SendPrepare,
    SpawnEngines,
    StopEngines,
)
from tidal.frontend.scaling.scale_records import Admission, ScalePhase, ScaleRequest
from tidal.protocol.elastic import ScaleEvent, ScaleReport
from tidal.protocol.topology import Topology

STORE = "127.0.0.1:1"


def admit(c: ScaleController, actions: list, now: float):
    """What the driver does with the one ``AdmitScale`` among ``actions``."""
    ask = one(actions, AdmitScale)
    resp, out = c.request_scale(ask.request, now, store_address=STORE)
    assert resp.admission is Admission.STARTED
    return ask.request, resp.record, out


def recover_ok(c: ScaleController, now: float, actions: list):
    """Admit the recovery in ``actions`` and let every survivor prepare and commit."""
    req, rec, out = admit(c, actions, now)
    targets = one(out, SendPrepare).engine_ids
    out = all_report(c, targets, ScaleEvent.PREPARED, now + 1)
    out += all_report(c, targets, ScaleEvent.COMMITTED, now + 2, step=1)
    assert rec.phase is ScalePhase.SUCCEEDED, rec
    return req, rec, out


def group_failed(c: ScaleController, e: int, epoch: int | None = None, cause="x"):
    epoch = c.topology.epoch if epoch is None else epoch
    return ScaleReport("", e, epoch, ScaleEvent.GROUP_FAILED, cause=cause)


# ----------------------------------------------------------------------------- recovery


def test_deaths_found_together_are_recovered_by_one_operation():
    """Ranks of a lost host, or killed at once, are found moments apart: the recovery
    waits ``death_settle_s`` from the first, and one operation removes them all."""
    c = ctl(4, recover=True, death_settle_s=0.25)
    out = c.handle(EngineExited(1, "no heartbeat"), 10.0)
    assert out == [MigrateRequests(1, None, None)] and c.next_deadline() == 10.25
    out = c.handle(EngineExited(3, "no heartbeat"), 10.1)
    assert out == [MigrateRequests(3, None, None)] and c.next_deadline() == 10.25
    assert c.tick(10.2) == []
    req, rec, out = recover_ok(c, 10.25, c.tick(10.25))
    assert req.new_size == 2 and rec.dead == [1, 3], rec
    assert c.topology.engine_ids == [0, 2] and c.dead == set()
    assert [r.trigger for r in c.history.values()] == ["recovery"]
    assert c.next_deadline() is None  # nothing left to heal


def test_a_death_after_the_settle_is_a_recovery_of_its_own():
    c = ctl(4, recover=True, death_settle_s=0.25)
    c.handle(EngineExited(1), 10.0)
    req, rec, out = admit(c, c.tick(10.25), 10.25)
    assert rec.dead == [1]
    out = c.handle(EngineExited(3), 10.5)  # during its prepare: it rolls back
    assert one(out, RecordResult).record.phase is ScalePhase.ROLLED_BACK
    req, rec, out = recover_ok(c, 11.0, c.tick(11.0) or c.tick(11.5))
    assert rec.dead == [1, 3] and c.topology.engine_ids == [0, 2]


def test_member_death_is_recovered_without_it():
    c = ctl(3, recover=True)
    assert c.degraded is None and c.next_deadline() is None
    out = c.handle(EngineExited(1, "segfault"), 10.0)
    assert out[0] == MigrateRequests(1, None, None)
    ask = out[1]
    assert isinstance(ask, AdmitScale) and len(out) == 2
    req = ask.request
    assert req.trigger == "recovery" and req.new_size == 2 == len(c.live_members)
    assert req.operation_id is not None and req.operation_id.startswith("recover-")
    assert c.dead == {1} and c.live_members == (0, 2)
    assert "dead" in (c.degraded or "")
    c.handle(RequestsMigrated(1, 3), 10.1)  # the answer to MigrateRequests(1, None, None)
    assert c.handle(EngineExited(1), 10.2) == [MigrateRequests(1, None, None)]  # once
    assert c.tick(10.3) == []  # asked already: not again while the ask is out

    resp, out = c.request_scale(req, 11.0, store_address=STORE)
    rec = resp.record
    assert resp.admission is Admission.STARTED and rec.operation_id == req.operation_id
    prep = one(out, SendPrepare)  # nothing is sent to the dead engine, nobody joins
    assert prep.engine_ids == (0, 2) and not of(out, SpawnEngines)
    assert prep.message.dead == [1] and prep.message.leaving == [1]
    assert not prep.message.old_group_usable  # the survivors' groups are broken
    assert prep.message.topology.engine_ids == [0, 2]
    assert prep.message.topology.store_address == STORE
    assert rec.dead == [1] and rec.trigger == "recovery" and c.is_scaling
    assert "dead" in (c.degraded or "")

    assert c.handle(rep(c, 0, ScaleEvent.PREPARED), 12.0) == []
    out = c.handle(rep(c, 2, ScaleEvent.PREPARED), 12.5)
    assert one(out, SendCommit).engine_ids == (0, 2)
    out = c.handle(rep(c, 0, ScaleEvent.COMMITTED, step=8), 13.0)
    assert one(out, PublishTopology).topology.engine_ids == [0, 2]
    assert c.topology.epoch == 1 and c.dead == set()
    assert c.degraded == f"recovery {rec.operation_id} running"  # engine 2 still to commit
    out = c.handle(rep(c, 2, ScaleEvent.COMMITTED, step=8), 13.5)
    assert one(out, RecordResult).record is rec
    assert not of(out, AdmitScale)  # no restore without restore_size
    assert rec.phase is ScalePhase.SUCCEEDED and rec.finished_at == 13.5
    assert [t.phase for t in rec.phases][-2:] == [ScalePhase.COMMITTING, ScalePhase.FINISHING]
    assert c.degraded is None and not c.is_scaling

    f = c.faults()
    assert f["rank_deaths"] == 1 and f["recovered"] == 1
    assert f["recovery_s_last"] == 13.0 - 10.0  # commit (adopted) minus death
    assert f["dead"] == [] and f["failed_groups"] == {} and f["degraded"] is None
    (death,) = f["deaths"]
    assert death["engine_id"] == 1 and death["epoch"] == 0 and death["at"] == 10.0
    assert death["cause"] == "segfault" and death["requests_migrated"] == 3
    assert death["recovered_by"] == rec.operation_id and death["recovered_at"] == 13.0
    assert death["recovery_s"] == 3.0
    assert c.handle(RequestsMigrated(1, 5), 14.0) == []  # recovered: no longer counted
    assert c.policy.deaths[0].requests_migrated == 3
    assert c.tick(100.0) == []


def test_records_name_their_trigger():
    c = ctl(3, recover=True)
    resp, _ = c.request_scale(ScaleRequest(2, operation_id="api-down"), 0.0)
    assert resp.record.trigger == "api" and resp.record.to_dict()["trigger"] == "api"
    out = c.handle(rep(c, 0, ScaleEvent.FAILED, cause="boom"), 1.0)  # roll it back
    assert resp.record.phase is ScalePhase.ROLLED_BACK and not of(out, AdmitScale)
    out = c.handle(EngineExited(2, "oom"), 2.0)
    _, rec, _ = recover_ok(c, 2.0, out)
    assert rec.trigger == "recovery" and rec.to_dict()["trigger"] == "recovery"
    assert c.history[rec.operation_id] is rec
    assert c.history["api-down"].trigger == "api"


def test_restore_follows_a_committed_recovery():
    c = ctl(3, recover=True, restore_size=3)
    out = c.handle(EngineExited(1), 0.0)
    req, rec, out = admit(c, out, 0.5)
    all_report(c, [0, 2], ScaleEvent.PREPARED, 1.0)
    out = c.handle(rep(c, 0, ScaleEvent.COMMITTED, step=1), 2.0)
    assert of(out, PublishTopology) and not of(out, AdmitScale)  # not while it runs
    out = c.handle(rep(c, 2, ScaleEvent.COMMITTED, step=1), 2.5)
    assert rec.phase is ScalePhase.SUCCEEDED and c.topology.size == 2
    assert of(out, RecordResult) and out.index(one(out, RecordResult)) < len(out) - 1
    restore = one(out, AdmitScale).request
    assert restore.trigger == "restore" and restore.new_size == 3
    assert restore.operation_id is not None and restore.operation_id.startswith("restore-")
    assert restore.operation_id != req.operation_id
    assert c.tick(3.0) == []  # asked once

    # The normal scale-up path: a fresh engine joins.
    resp, out = c.request_scale(restore, 3.0, store_address=STORE)
    rrec = resp.record
    assert rrec.trigger == "restore" and one(out, SpawnEngines).engine_ids == (3,)
    out = c.handle(EngineStarted(3), 3.5)
    assert one(out, SendPrepare).engine_ids == (0, 2, 3)
    all_report(c, [0, 2, 3], ScaleEvent.PREPARED, 4.0)
    out = all_report(c, [0, 2, 3], ScaleEvent.COMMITTED, 5.0, step=1)
    assert rrec.phase is ScalePhase.SUCCEEDED and c.topology.engine_ids == [0, 2, 3]
    assert not of(out, AdmitScale) and c.policy.restore_size == 3
    assert c.tick(50.0) == [] and c.degraded is None


def test_a_failed_restore_is_asked_again_after_the_retry_delay():
    c = ctl(3, recover=True, restore_size=3, recovery_retry_s=2.0)
    _, _, out = recover_ok(c, 0.0, c.handle(EngineExited(1), 0.0))
    restore = one(out, AdmitScale).request
    resp, _ = c.request_scale(restore, 3.0, store_address=STORE)
    out = c.tick(3.0 + T.start_engines_s)  # the joiner never got ready
    assert resp.record.phase is ScalePhase.ROLLED_BACK and not of(out, AdmitScale)
    assert c.next_deadline() == 13.0 + 2.0
    assert c.tick(14.9) == []
    again = one(c.tick(15.0), AdmitScale).request
    assert again.trigger == "restore" and again.new_size == 3
    assert again.operation_id != restore.operation_id


def test_an_api_scale_that_succeeds_sets_the_size_to_restore():
    c = ctl(3, recover=True, restore_size=3)
    out = c.handle(EngineExited(1), 0.0)
    req, rec, _ = admit(c, out, 0.0)
    # The caller's operation is admitted between the commit and the restore ask.
    all_report(c, [0, 2], ScaleEvent.PREPARED, 1.0)
    out = all_report(c, [0, 2], ScaleEvent.COMMITTED, 2.0, step=1)
    restore = one(out, AdmitScale).request
    api, _ = c.request_scale(ScaleRequest(2, operation_id="api", remove=(0,)), 2.1)
    assert api.admission is Admission.STARTED  # it came first
    busy, out = c.request_scale(restore, 2.2, store_address=STORE)
    assert busy.admission is Admission.CONFLICT and out == []
    out = c.handle(EngineStarted(3), 2.3)
    all_report(c, [0, 2, 3], ScaleEvent.PREPARED, 2.4)
    out = all_report(c, [2, 3], ScaleEvent.COMMITTED, 2.5, step=1)
    out += c.handle(EngineExited(0), 2.6)  # it left
    assert api.record.phase is ScalePhase.SUCCEEDED and c.topology.engine_ids == [2, 3]
    assert c.policy.restore_size == 2 and not of(out, AdmitScale)
    assert c.tick(100.0) == [] and c.dead == set()


def test_an_api_scale_down_after_restore_is_kept():
    c = ctl(3, recover=True, restore_size=3)
    resp, _ = c.request_scale(ScaleRequest(2, operation_id="down"), 0.0)
    all_report(c, [0, 1, 2], ScaleEvent.PREPARED, 1.0)
    all_report(c, [0, 1], ScaleEvent.COMMITTED, 2.0, step=1)
    out = c.handle(EngineExited(2), 3.0)
    assert resp.record.phase is ScalePhase.SUCCEEDED and c.policy.restore_size == 2
    assert not of(out, AdmitScale) and c.tick(100.0) == []
    # A death now recovers to 1, then restores to the caller's 2, not the launch's 3.
    _, _, out = recover_ok(c, 200.0, c.handle(EngineExited(1), 200.0))
    restore = one(out, AdmitScale).request
    assert restore.trigger == "restore" and restore.new_size == 2


def test_a_recovery_that_rolls_back_is_asked_again_after_the_retry_delay():
    c = ctl(3, recover=True, recovery_retry_s=1.5)
    first = one(c.handle(EngineExited(1), 0.0), AdmitScale).request
    _, rec, _ = admit(c, [AdmitScale(first)], 0.5)
    out = c.handle(rep(c, 0, ScaleEvent.FAILED, cause="rendezvous timed out"), 2.0)
    assert rec.phase is ScalePhase.ROLLED_BACK and one(out, SendAbort).engine_ids == (0, 2)
    assert not of(out, AdmitScale)  # not at once: after the retry delay
    assert c.dead == {1} and "dead" in (c.degraded or "")
    assert c.next_deadline() == 2.0 + 1.5
    assert c.tick(3.4) == []
    again = one(c.tick(3.5), AdmitScale).request
    assert again.trigger == "recovery" and again.new_size == 2
    assert again.operation_id != first.operation_id
    assert again.operation_id.startswith("recover-")
    assert c.tick(3.6) == []
    _, rec2, _ = recover_ok(c, 4.0, [AdmitScale(again)])
    assert c.topology.engine_ids == [0, 2] and c.dead == set()
    f = c.faults()
    assert f["rank_deaths"] == 1 and f["recovered"] == 1 and f["recovery_s_last"] == 6.0
    assert c.policy.deaths[0].recovered_by == rec2.operation_id


def test_a_recovery_past_its_prepare_deadline_is_asked_again():
    c = ctl(3, recover=True, recovery_retry_s=1.0)
    _, rec, _ = admit(c, c.handle(EngineExited(2), 0.0), 0.0)
    c.handle(rep(c, 0, ScaleEvent.PREPARED), 1.0)
    assert c.next_deadline() == T.prepare_s
    out = c.tick(T.prepare_s)
    assert rec.phase is ScalePhase.ROLLED_BACK and not of(out, AdmitScale)
    assert c.next_deadline() == T.prepare_s + 1.0
    assert one(c.tick(T.prepare_s + 1.0), AdmitScale).request.trigger == "recovery"


def test_admission_failed():
    c = ctl(3, recover=True, recovery_retry_s=2.0)
    first = one(c.handle(EngineExited(1), 0.0), AdmitScale).request
    c.admission_failed(first, 0.5)  # e.g. no store could be made
    assert c.next_deadline() == 2.5 and not c.is_scaling and c.history == {}
    assert c.tick(2.4) == []
    again = one(c.tick(2.5), AdmitScale).request
    assert again.trigger == "recovery" and again.operation_id != first.operation_id
    assert c.tick(10.0) == []  # the new ask is out
    # A caller's request that failed admission changes nothing.
    c.admission_failed(ScaleRequest(9, operation_id="api"), 11.0)
    assert c.tick(100.0) == []
    c.request_scale(again, 101.0, store_address=STORE)  # our ask came back: admitted
    assert c.current is not None and c.current.operation_id == again.operation_id


def test_admission_failed_of_an_api_request_does_nothing():
    c = ctl(2, recover=True)
    c.admission_failed(ScaleRequest(9), 0.0)
    assert c.next_deadline() is None and c.tick(10.0) == [] and c.degraded is None


def test_death_during_an_api_scale_up_rolls_back_then_recovers():
    c = ctl(2, recover=True)
    resp, _ = c.request_scale(ScaleRequest(3, operation_id="up"), 0.0)
    c.handle(EngineStarted(2), 0.5)
    c.handle(rep(c, 0, ScaleEvent.PREPARED), 0.6)
    out = c.handle(EngineExited(1, "killed"), 1.0)
    assert out[0] == MigrateRequests(1, None, "up")
    assert one(out, SendAbort).engine_ids == (0, 2)
    assert one(out, StopEngines).engine_ids == (2,)
    assert resp.record.phase is ScalePhase.ROLLED_BACK
    assert resp.record.cause == "engine 1 died during preparing: killed"
    # The rollback is reported before the recovery is asked, in the same call.
    kinds = [type(a) for a in out]
    assert kinds.index(RecordResult) < kinds.index(AdmitScale) == len(kinds) - 1
    req = one(out, AdmitScale).request
    assert req.trigger == "recovery" and req.new_size == 1
    _, rec, out = admit(c, out, 1.1)
    prep = one(out, SendPrepare)
    assert prep.engine_ids == (0,) and prep.message.dead == [1]
    assert rec.joining == [] and c.topology.next_id == 3  # joiner 2's id stays retired
    # The stopped joiner's exit is no member's: nothing more.
    assert c.handle(EngineExited(2, "stopped"), 1.2) == [MigrateRequests(2, None, rec.operation_id)]
    c.handle(rep(c, 0, ScaleEvent.PREPARED), 1.5)
    out = c.handle(rep(c, 0, ScaleEvent.COMMITTED, step=1), 2.0)
    assert one(out, PublishTopology).topology.engine_ids == [0]
    assert rec.phase is ScalePhase.SUCCEEDED and c.faults()["recovered"] == 1


def test_death_during_a_running_operation_waits_for_it():
    """A member dying while an operation commits: the recovery is asked only after."""
    c = ctl(3, recover=True)
    resp, _ = c.request_scale(ScaleRequest(4, operation_id="up"), 0.0)
    c.handle(EngineStarted(3), 0.1)
    all_report(c, [0, 1, 2, 3], ScaleEvent.PREPARED, 0.2)
    out = c.handle(EngineExited(2, "killed"), 0.5)  # mid-commit: the reports decide
    assert not of(out, AdmitScale) and resp.record.phase is ScalePhase.COMMITTING
    assert c.dead == {2}
    out = c.handle(rep(c, 0, ScaleEvent.ROLLED_BACK, cause="DP group failed"), 0.6)
    assert resp.record.phase is ScalePhase.ROLLED_BACK
    req = one(out, AdmitScale).request
    assert req.trigger == "recovery" and req.new_size == 2


def test_every_member_dead_fails_the_deployment_once():
    c = ctl(2, recover=True, recovery_retry_s=1.0)
    _, rec, out = admit(c, c.handle(EngineExited(0), 0.0), 0.1)
    assert one(out, SendPrepare).engine_ids == (1,)
    out = c.handle(EngineExited(1, "killed"), 0.5)  # the last one, during the recovery
    assert rec.phase is ScalePhase.ROLLED_BACK and c.live_members == ()
    assert not of(out, FailDeployment) and not of(out, AdmitScale)
    assert c.next_deadline() == 1.5
    out = c.tick(1.5)
    assert len(out) == 1 and isinstance(out[0], FailDeployment)
    assert "dead" in out[0].reason
    assert c.next_deadline() is None
    assert c.tick(2.5) == [] and c.tick(100.0) == []
    assert c.handle(RequestsMigrated(1, 0), 101.0) == []
    assert c.faults()["rank_deaths"] == 2 and c.faults()["recovered"] == 0


def test_every_member_dead_with_no_operation_fails_the_deployment():
    c = ctl(1, recover=True)
    out = c.handle(EngineExited(0, "oom"), 0.0)
    assert out == [MigrateRequests(0, None, None), FailDeployment(out[1].reason)]
    assert c.tick(1.0) == [] and c.tick(10.0) == [] and c.next_deadline() is None


# ----------------------------------------------------------------------------- group failed


def test_group_failed_is_kept_until_the_next_commit():
    c = ctl(3, recover=True)
    assert c.handle(group_failed(c, 1, cause="NCCL timeout"), 1.0) == []
    assert c.policy.failed_groups == {1: "NCCL timeout"}
    assert "[1]" in (c.degraded or "") and "failed" in (c.degraded or "")
    assert c.faults()["failed_groups"] == {1: "NCCL timeout"}
    assert c.handle(group_failed(c, 2, cause=None), 1.1) == []
    assert c.policy.failed_groups == {1: "NCCL timeout", 2: "collective failed"}
    # Another epoch, or an engine that is no member: ignored.
    assert c.handle(group_failed(c, 0, epoch=5), 1.2) == []
    assert c.handle(group_failed(c, 9), 1.3) == []
    assert set(c.policy.failed_groups) == {1, 2}
    assert c.next_deadline() == 1.0 + c.policy.rebuild_grace_s  # a death may still explain it
    # A later operation that commits gives every member new groups (admitted before the
    # rebuild would be asked).
    resp, _ = c.request_scale(ScaleRequest(2, operation_id="down"), 1.5)
    all_report(c, [0, 1, 2], ScaleEvent.PREPARED, 2.0)
    assert c.policy.failed_groups  # not before the commit
    c.handle(rep(c, 0, ScaleEvent.COMMITTED, step=1), 3.0)
    assert c.policy.failed_groups == {} and c.faults()["failed_groups"] == {}
    c.handle(rep(c, 1, ScaleEvent.COMMITTED, step=1), 3.1)
    c.handle(EngineExited(2), 3.2)
    assert resp.record.phase is ScalePhase.SUCCEEDED and c.degraded is None
    assert c.next_deadline() is None and c.tick(100.0) == []  # no rebuild left to ask
    # The old epoch's reports are ignored now.
    assert c.handle(group_failed(c, 0, epoch=0), 104.0) == [] and c.policy.failed_groups == {}


def test_group_failed_with_nobody_dead_is_rebuilt_by_the_same_engines():
    c = ctl(3, recover=True)
    assert c.handle(group_failed(c, 1), 1.0) == []
    assert c.tick(1.0 + c.policy.rebuild_grace_s - 0.1) == []  # a death may still explain it
    ask = one(c.tick(1.0 + c.policy.rebuild_grace_s), AdmitScale)
    assert ask.request.trigger == "rebuild" and ask.request.new_size == 3
    resp, out = c.request_scale(ask.request, 7.0, store_address=STORE)
    prep = one(out, SendPrepare)
    assert not of(out, SpawnEngines) and prep.engine_ids == (0, 1, 2)
    msg = prep.message
    assert msg.rebuild and not msg.dead and not msg.old_group_usable
    assert msg.topology.engine_ids == [0, 1, 2] and msg.topology.epoch == 1
    assert msg.transfers == [] and not msg.leaving and not msg.joining
    all_report(c, [0, 1, 2], ScaleEvent.PREPARED, 8.0)
    all_report(c, [0, 1, 2], ScaleEvent.COMMITTED, 9.0, step=0)
    assert resp.record.phase is ScalePhase.SUCCEEDED and resp.record.trigger == "rebuild"
    assert c.policy.failed_groups == {} and c.degraded is None and c.next_deadline() is None


def test_a_rebuild_that_rolls_back_is_asked_again():
    c = ctl(2, recover=True)
    c.handle(group_failed(c, 0), 0.0)
    ask = one(c.tick(c.policy.rebuild_grace_s), AdmitScale)
    resp, _ = c.request_scale(ask.request, 6.0, store_address=STORE)
    c.handle(rep(c, 1, ScaleEvent.FAILED, cause="rendezvous timed out"), 7.0)
    assert resp.record.phase is ScalePhase.ROLLED_BACK
    assert c.next_deadline() == 7.0 + c.policy.recovery_retry_s
    again = one(c.tick(7.0 + c.policy.recovery_retry_s), AdmitScale)
    assert (
        again.request.trigger == "rebuild"
        and again.request.operation_id != ask.request.operation_id
    )


def test_a_death_after_group_failed_is_a_recovery_not_a_rebuild():
    c = ctl(3, recover=True)
    c.handle(group_failed(c, 0), 0.0)
    out = c.handle(EngineExited(2), 1.0)  # within the grace: the death explains it
    assert one(out, AdmitScale).request.trigger == "recovery"


def test_group_failed_after_a_death_is_cleared_by_the_recovery():
    c = ctl(3, recover=True)
    out = c.handle(EngineExited(1), 0.0)
    assert c.handle(group_failed(c, 0), 0.1) == []  # a survivor's collective failed
    assert c.policy.failed_groups == {0: "x"}
    recover_ok(c, 1.0, out)
    assert c.policy.failed_groups == {} and c.degraded is None


def test_a_rolled_back_operation_keeps_the_failed_groups():
    c = ctl(2, recover=True)
    c.handle(group_failed(c, 0), 0.0)
    resp, _ = c.request_scale(ScaleRequest(1, operation_id="a"), 1.0)
    c.handle(rep(c, 1, ScaleEvent.FAILED, cause="no"), 2.0)
    assert resp.record.phase is ScalePhase.ROLLED_BACK
    assert c.policy.failed_groups == {0: "x"} and c.degraded is not None


# ----------------------------------------------------------------------------- off, sizes


def test_without_recover_nothing_is_asked():
    c = ctl(3)
    assert c.recover is False
    assert c.handle(EngineExited(1, "oom"), 0.0) == [MigrateRequests(1, None)]
    assert c.dead == {1} and c.policy.deaths[0].cause == "oom"
    assert c.tick(10.0) == [] and c.tick(1000.0) == []
    # An operation that rolls back does not ask either.
    resp, _ = c.request_scale(ScaleRequest(3, operation_id="a"), 1001.0)
    assert resp.record.dead == [1] and resp.record.trigger == "api"
    out = c.handle(rep(c, 0, ScaleEvent.FAILED, cause="no"), 1002.0)
    assert resp.record.phase is ScalePhase.ROLLED_BACK and not of(out, AdmitScale)
    assert c.tick(5000.0) == []
    # Everything dead: the client fails it, not the controller.
    out = c.handle(EngineExited(0), 5001.0) + c.handle(EngineExited(2), 5002.0)
    assert not of(out, FailDeployment) and not of(out, AdmitScale)
    assert c.tick(6000.0) == []


def test_the_recovery_asks_the_largest_valid_size_or_the_minimum():
    # 8 experts + 16 redundant copies: a rank holds one copy of each at most, so at
    # least 3 ranks (validate_size); at most 8 (one expert each).
    c = ScaleController(
        Topology.initial(4), 8, 16, bytes_per_expert=10, timeouts=T, recover=True,
        death_settle_s=0.0,
    )
    req = one(c.handle(EngineExited(3), 0.0), AdmitScale).request
    assert req.new_size == 3 == len(c.live_members)
    _, rec, _ = recover_ok(c, 0.0, [AdmitScale(req)])
    assert c.topology.engine_ids == [0, 1, 2]
    # One more death: 2 live engines cannot hold 24 copies of 8 experts, so the recovery
    # goes to the minimum, 3, with a new engine (its experts from the survivors or disk).
    out = c.handle(EngineExited(1), 10.0)
    req = one(out, AdmitScale).request
    assert req.new_size == 3 and not of(out, FailDeployment)
    resp, out = c.request_scale(req, 10.0, store_address=STORE)
    assert resp.admission is Admission.STARTED
    spawn = one(out, SpawnEngines)
    assert len(spawn.engine_ids) == 1 and resp.record.dead == [1]


def test_the_recovery_skips_sizes_below_the_minimum():
    # 8 + 8 copies: at least 2 ranks. 3 -> one dies -> 2 (valid) -> one dies -> 2 again
    # with a new engine; nothing alive -> FailDeployment.
    c = ScaleController(
        Topology.initial(3), 8, 8, bytes_per_expert=10, timeouts=T, recover=True,
        death_settle_s=0.0,
    )
    _, _, _ = recover_ok(c, 0.0, c.handle(EngineExited(0), 0.0))
    assert c.topology.engine_ids == [1, 2]
    req = one(c.handle(EngineExited(2), 5.0), AdmitScale).request
    assert req.new_size == 2
    c2 = ctl(1, recover=True)
    assert of(c2.handle(EngineExited(0), 0.0), FailDeployment)


# ----------------------------------------------------------------------------- timers and stale asks


def test_no_deadline_left_after_a_recovery_without_restore():
    c = ctl(3, recover=True)
    recover_ok(c, 0.0, c.handle(EngineExited(1), 0.0))
    assert not c.is_scaling and c.degraded is None
    assert c.next_deadline() is None


def test_no_deadline_left_after_a_death_without_recover():
    c = ctl(3)
    c.handle(EngineExited(1), 0.0)
    assert c.next_deadline() is None


def test_a_restore_that_met_a_conflict_is_asked_again():
    c = ctl(3, recover=True, restore_size=3)
    _, _, out = recover_ok(c, 0.0, c.handle(EngineExited(1), 0.0))
    restore = one(out, AdmitScale).request
    api, _ = c.request_scale(ScaleRequest(4, operation_id="api"), 3.0)  # came first
    busy, _ = c.request_scale(restore, 3.1, store_address=STORE)
    assert busy.admission is Admission.CONFLICT
    out = c.tick(3.0 + T.start_engines_s)  # the API operation's joiners never got ready
    assert api.record.phase is ScalePhase.ROLLED_BACK and c.topology.size == 2
    assert one(out, AdmitScale).request.trigger == "restore"  # asked again at its end
    assert c.tick(1000.0) == []  # once


def test_a_stale_recovery_ask_after_every_member_died_fails_the_deployment():
    c = ctl(2, recover=True)
    ask = one(c.handle(EngineExited(0), 0.0), AdmitScale)
    assert c.handle(EngineExited(1), 0.1) == [MigrateRequests(1, None, None)]
    assert c.live_members == ()
    with pytest.raises(ScalePlanError, match="no live engine"):
        c.request_scale(ask.request, 0.2, store_address=STORE)
    c.admission_failed(ask.request, 0.2)  # what the driver does with the error
    assert c.next_deadline() == 0.2  # nothing left to wait for
    assert of(c.tick(0.2), FailDeployment)
    assert c.tick(10.0) == []
