"""HealPolicy alone (docs/architecture.md#faults): what it asks for, and when, given only
what it is told and a served state it reads -- no runner, no operation. The same
decisions through the whole controller are in test_scale_recovery.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tidal.elastic.plan import ScalePlanError, validate_size
from tidal.frontend.scaling.scale_events import AdmitScale, FailDeployment
from tidal.frontend.scaling.scale_healing import HealPolicy
from tidal.frontend.scaling.scale_records import (
    OperationRecord,
    ScalePhase,
    ScaleRequest,
    ScaleTrigger,
)
from tidal.protocol.topology import Topology


@dataclass
class Served:
    """A ``ServedState`` without a runner: 8 experts, sizes 1..8 valid without redundancy."""

    topology: Topology
    dead: set[int] = field(default_factory=set)
    is_scaling: bool = False
    current: OperationRecord | None = None
    history: dict[str, OperationRecord] = field(default_factory=dict)
    num_experts: int = 8
    num_redundant: int = 0

    @property
    def live_members(self) -> tuple[int, ...]:
        return tuple(e for e in self.topology.engine_ids if e not in self.dead)

    def validate(self, new_size: int) -> None:
        validate_size(new_size, self.num_experts, self.num_redundant, self.topology.tp_size)


def record(trigger: ScaleTrigger, phase: ScalePhase, op_id: str = "op") -> OperationRecord:
    return OperationRecord(op_id, 1, 3, 2, 0, 1, 0.0, phase=phase, trigger=trigger)


def ask(actions: list) -> ScaleRequest:
    (a,) = actions
    assert isinstance(a, AdmitScale)
    return a.request


def test_a_death_asks_for_one_recovery_after_the_settle_delay():
    p, s = HealPolicy(recover=True, death_settle_s=0.5), Served(Topology.initial(4))
    s.dead.add(1)
    p.member_died(1, 0, 10.0, "no heartbeat")
    s.dead.add(3)
    p.member_died(3, 0, 10.2, "no heartbeat")  # the same fault: keeps the first time
    assert p.next_deadline() == 10.5 and p.heal(10.4, s) == []
    req = ask(p.heal(10.5, s))
    assert (req.trigger, req.new_size, req.operation_id) == (ScaleTrigger.RECOVERY, 2, "recover-1")
    assert p.heal(10.6, s) == []  # asked once: waits for its admission
    assert [(d.engine_id, d.cause) for d in p.deaths] == [(1, "no heartbeat"), (3, "no heartbeat")]


def test_nothing_is_asked_while_an_operation_runs_and_its_end_rearms():
    p, s = HealPolicy(recover=True, death_settle_s=0.0), Served(Topology.initial(3))
    s.dead.add(2)
    p.member_died(2, 0, 1.0, "killed")
    s.is_scaling = True
    assert p.heal(1.0, s) == []
    s.is_scaling = False
    p.ended(record(ScaleTrigger.API, ScalePhase.ROLLED_BACK), 2.0, s)  # not a recovery: at once
    assert ask(p.heal(2.0, s)).trigger is ScaleTrigger.RECOVERY


def test_a_failed_recovery_is_asked_again_after_the_retry_delay():
    p, s = HealPolicy(recover=True, recovery_retry_s=1.5), Served(Topology.initial(3))
    s.dead.add(2)
    p.member_died(2, 0, 0.0, "killed")
    req = ask(p.heal(1.0, s))
    p.admitting(req, s)
    assert req.operation_id == "recover-1"
    p.ended(record(ScaleTrigger.RECOVERY, ScalePhase.ROLLED_BACK, req.operation_id), 2.0, s)
    assert p.next_deadline() == 3.5 and p.heal(3.4, s) == []
    again = ask(p.heal(3.5, s))
    assert again.trigger is ScaleTrigger.RECOVERY and again.operation_id == "recover-2"


def test_an_ask_id_taken_by_a_caller_gets_a_fresh_one():
    p, s = HealPolicy(recover=True, death_settle_s=0.0), Served(Topology.initial(2))
    s.history["recover-1"] = record(ScaleTrigger.API, ScalePhase.SUCCEEDED, "recover-1")
    s.dead.add(1)
    p.member_died(1, 0, 0.0, "killed")
    assert ask(p.heal(0.0, s)).operation_id == "recover-1'"


def test_with_every_member_dead_the_deployment_fails():
    p, s = HealPolicy(recover=True, death_settle_s=0.0), Served(Topology.initial(2))
    for e in (0, 1):
        s.dead.add(e)
        p.member_died(e, 0, 0.0, "killed")
    (fail,) = p.heal(0.0, s)
    assert fail == FailDeployment("every engine of the deployment is dead")
    with pytest.raises(ScalePlanError):
        p.admitting(ScaleRequest(1, trigger=ScaleTrigger.RECOVERY), s)


def test_a_recovery_is_sized_from_the_members_alive_at_its_admission():
    p, s = HealPolicy(recover=True), Served(Topology.initial(4))
    s.dead |= {1, 2}
    req = p.admitting(ScaleRequest(3, operation_id="recover-1", trigger=ScaleTrigger.RECOVERY), s)
    assert req.new_size == 2
    api = ScaleRequest(3, operation_id="x")
    assert p.admitting(api, s) is api  # a caller's request is the caller's


def test_failed_groups_with_no_death_ask_for_a_rebuild_after_the_grace():
    p, s = HealPolicy(recover=True, rebuild_grace_s=5.0), Served(Topology.initial(3))
    p.group_failed(1, "NCCL timeout", 1.0)
    p.group_failed(2, "collective failed", 2.0)
    assert p.next_deadline() == 6.0 and p.heal(5.9, s) == []
    assert p.degraded(s) == "groups of engines [1, 2] failed; recovering"
    req = ask(p.heal(6.0, s))
    assert (req.trigger, req.new_size) == (ScaleTrigger.REBUILD, 3)
    p.committed(record(ScaleTrigger.REBUILD, ScalePhase.SUCCEEDED), s.topology, 7.0)
    assert p.failed_groups == {} and p.degraded(s) is None and p.next_deadline() is None


def test_a_death_explaining_failed_groups_cancels_the_rebuild():
    p, s = HealPolicy(recover=True, death_settle_s=0.0), Served(Topology.initial(3))
    p.group_failed(0, "x", 1.0)
    s.dead.add(2)
    p.member_died(2, 0, 1.5, "killed")
    assert ask(p.heal(6.0, s)).trigger is ScaleTrigger.RECOVERY


def test_restore_follows_the_recovery_and_a_callers_size_is_kept():
    p, s = HealPolicy(recover=True, restore_size=3), Served(Topology.initial(2))
    p.ended(record(ScaleTrigger.RECOVERY, ScalePhase.SUCCEEDED), 1.0, s)
    req = ask(p.heal(1.0, s))
    assert (req.trigger, req.new_size) == (ScaleTrigger.RESTORE, 3)
    p.committed(record(ScaleTrigger.API, ScalePhase.SUCCEEDED), Topology.initial(2), 2.0)
    assert p.restore_size == 2  # a caller scaled to 2: that is the size to keep


def test_deaths_are_marked_recovered_by_the_commit_that_removed_them():
    p = HealPolicy(recover=True)
    p.member_died(1, 0, 1.0, "killed")
    p.requests_migrated(1, 4)
    p.committed(
        record(ScaleTrigger.RECOVERY, ScalePhase.SUCCEEDED, "recover-1"), Topology.initial(1), 3.0
    )
    (d,) = p.deaths
    assert (d.requests_migrated, d.recovered_by, d.recovery_s) == (4, "recover-1", 2.0)


def test_without_recover_deaths_are_recorded_and_nothing_is_asked():
    p, s = HealPolicy(recover=False, death_settle_s=0.0), Served(Topology.initial(2))
    s.dead.add(1)
    p.member_died(1, 0, 0.0, "killed")
    p.group_failed(0, "x", 0.0)
    p.ended(record(ScaleTrigger.API, ScalePhase.ROLLED_BACK), 1.0, s)
    assert p.heal(100.0, s) == [] and p.next_deadline() is None
    assert len(p.deaths) == 1 and p.degraded(s) == "engines [1] dead; recovering"
