"""When to heal after a rank death, and with what (docs/architecture.md#faults).

Pure: no sockets, processes or clocks, and no operation of its own: ``HealPolicy`` is told
what the ``ScaleRunner`` (``tidal.frontend.scaling.scale_runner``) sees (it is the
runner's ``RunnerObserver``) and answers ``heal(now, served)`` with the operation to ask
for (``AdmitScale``), which the driver admits like a caller's; ``ScaleController`` joins
the two.

With ``recover=True``: a member's death is recorded (``deaths``; the runner migrates its
requests at once), and as soon as no operation runs the policy asks for a *recovery*
(trigger ``RECOVERY``), after ``death_settle_s`` (deaths found together -- a lost host,
ranks killed at once -- arrive as separate exits within moments; one recovery removes
them all): an operation to the largest valid size the live members can hold, with the
dead in ``dead`` -- the survivors' groups are broken (they stopped stepping at their
failed collective and queue what arrives), so its consensus is the standby barrier. A
recovery that rolls back is asked again after ``recovery_retry_s``. Once it committed,
``restore_size`` (``--elastic-restore``) asks for the size before the death (trigger
``RESTORE``, the normal scale-up path; an API scale that succeeds sets the size to
restore). With no live member left, ``FailDeployment``. ``GROUP_FAILED`` reports (a
survivor's collective failed) are kept until the next commit: ``/health`` says
"degraded" while any of this is open; if no death explains them within
``rebuild_grace_s``, a *rebuild* (trigger ``REBUILD``: the same engines, fresh groups of
the next epoch, standby-barrier consensus) brings the broken ranks back.
"""

from __future__ import annotations

import dataclasses

from tidal.elastic.plan import ScalePlanError
from tidal.frontend.scaling.scale_events import Action, AdmitScale, FailDeployment
from tidal.frontend.scaling.scale_records import (
    DeathRecord,
    OperationRecord,
    ScalePhase,
    ScaleRequest,
    ScaleTrigger,
)
from tidal.frontend.scaling.scale_runner import ServedState
from tidal.protocol.topology import Topology

# The operation id prefix of each own ask ("recover-1", "restore-2", ...).
_ASK_PREFIX = {
    ScaleTrigger.RECOVERY: "recover",
    ScaleTrigger.REBUILD: "rebuild",
    ScaleTrigger.RESTORE: "restore",
}


class HealPolicy:
    """Decides when to recover from a rank death, rebuild failed groups or restore the
    size; records the deaths and failed groups (``/stats`` ``faults``)."""

    def __init__(
        self,
        *,
        recover: bool = False,
        restore_size: int | None = None,
        recovery_retry_s: float = 1.0,
        rebuild_grace_s: float = 5.0,
        death_settle_s: float = 0.25,
        history_len: int = 256,
    ) -> None:
        self.recover = recover
        self.restore_size = restore_size
        self.recovery_retry_s = recovery_retry_s
        self.rebuild_grace_s = rebuild_grace_s
        self.death_settle_s = death_settle_s
        self.history_len = history_len
        self.deaths: list[DeathRecord] = []
        self.failed_groups: dict[int, str] = {}  # GROUP_FAILED since the last commit
        # When the next own ask of each kind is due (None: not armed).
        self._due: dict[ScaleTrigger, float | None] = dict.fromkeys(_ASK_PREFIX)
        self._asked: str | None = None  # an AdmitScale out, not yet admitted
        self._asks = 0

    # ------------------------------------------------------------------ queries

    def next_deadline(self) -> float | None:
        return min((t for t in self._due.values() if t is not None), default=None)

    def degraded(self, served: ServedState) -> str | None:
        """Why the deployment serves below its health (``/health`` 200 "degraded"), or
        None: a dead member not yet removed, a group that failed, a recovery running."""
        if served.dead:
            return f"engines {sorted(served.dead)} dead; recovering"
        if self.failed_groups:
            return f"groups of engines {sorted(self.failed_groups)} failed; recovering"
        rec = served.current
        if rec is not None and rec.trigger is ScaleTrigger.RECOVERY:
            return f"recovery {rec.operation_id} running"
        return None

    def recovery_size(self, served: ServedState) -> int | None:
        """The largest valid size the live members can hold; if they are too few for any
        (redundant experts set a minimum), the smallest valid size (new engines join);
        None with no live member: nothing can serve."""
        live = len(served.live_members)
        if live == 0:
            return None
        valid = [n for n in range(1, served.num_experts + 1) if _valid(served, n)]
        below = [n for n in valid if n <= live]
        if below:
            return max(below)
        return min(valid, default=None)

    # ------------------------------------------------------------------ what the runner tells

    def admitting(self, request: ScaleRequest, served: ServedState) -> ScaleRequest:
        if request.trigger is ScaleTrigger.API:
            return request
        self._asked = None  # our own AdmitScale came back
        if request.trigger is ScaleTrigger.RECOVERY:
            # Asked before more members died (the ask waited for its admission): size it
            # from the members alive now.
            size = self.recovery_size(served)
            if size is None:
                raise ScalePlanError("no live engine left to recover with")
            request = dataclasses.replace(request, new_size=size)
        return request

    def member_died(self, engine_id: int, epoch: int, now: float, cause: str) -> None:
        self.deaths.append(DeathRecord(engine_id, epoch, now, cause))
        del self.deaths[: -self.history_len]
        if self.recover and self._due[ScaleTrigger.RECOVERY] is None:
            # Not at once: the other deaths of the same fault arrive within moments,
            # and one recovery removes them all (a later one keeps this time).
            self._due[ScaleTrigger.RECOVERY] = now + self.death_settle_s

    def group_failed(self, engine_id: int, cause: str, now: float) -> None:
        if not self.failed_groups and self.recover:
            # A death shows up within the heartbeat timeout (at once for a local
            # engine); if none does, the same engines rebuild their groups.
            self._due[ScaleTrigger.REBUILD] = now + self.rebuild_grace_s
        self.failed_groups[engine_id] = cause

    def committed(self, record: OperationRecord, topology: Topology, now: float) -> None:
        self.failed_groups.clear()  # those groups are gone: every member has new ones
        self._due[ScaleTrigger.REBUILD] = None
        for d in self.deaths:
            if d.recovered_at is None and d.engine_id not in topology:
                d.recovered_at, d.recovered_by = now, record.operation_id
        if record.trigger is ScaleTrigger.API and self.restore_size is not None:
            self.restore_size = topology.size  # the caller's size is the one to keep

    def ended(self, record: OperationRecord, now: float, served: ServedState) -> None:
        if not self.recover:
            return
        # What to heal next: at once after another operation (an own ask that met it as
        # a conflict included), after the retry delay when this one was that very
        # healing and did not succeed.
        if served.dead:
            next_ask = ScaleTrigger.RECOVERY
        elif self.failed_groups:
            next_ask = ScaleTrigger.REBUILD
        elif self._wants_restore(served):
            next_ask = ScaleTrigger.RESTORE
        else:
            return
        again = record.phase is not ScalePhase.SUCCEEDED and record.trigger is next_ask
        self._due[next_ask] = now + (self.recovery_retry_s if again else 0.0)

    def requests_migrated(self, engine_id: int, count: int) -> None:
        """Requests of a dead member resumed elsewhere (counted in its death)."""
        for d in self.deaths:
            if d.engine_id == engine_id and d.recovered_at is None:
                d.requests_migrated += count

    def admission_failed(self, request: ScaleRequest, now: float, served: ServedState) -> None:
        """The driver could not admit our own ``AdmitScale`` (no store, a plan error):
        try again after the retry delay (at once if nothing is left to serve: the next
        ``heal`` fails the deployment)."""
        if request.trigger is ScaleTrigger.API:
            return
        self._asked = None
        self._due[request.trigger] = now + (self.recovery_retry_s if served.live_members else 0.0)

    # ------------------------------------------------------------------ the decision

    def heal(self, now: float, served: ServedState) -> list[Action]:
        """The operation to ask for now, if any: a recovery, a rebuild, a restore (in
        that order), or ``FailDeployment`` with nothing left alive."""
        if not self.recover:
            return []
        if not served.dead:
            self._due[ScaleTrigger.RECOVERY] = None  # nothing (left) to recover from
        if not self._wants_restore(served):
            self._due[ScaleTrigger.RESTORE] = None
        if served.is_scaling or self._asked is not None:
            return []  # its end re-arms the timers (``ended``)
        if self._fire(ScaleTrigger.RECOVERY, now):
            size = self.recovery_size(served)
            if size is None:
                live = len(served.live_members)
                why = (
                    "every engine of the deployment is dead"
                    if live == 0
                    else (f"no valid size for the {live} live engine(s)")
                )
                return [FailDeployment(why)]
            return [self._ask(size, ScaleTrigger.RECOVERY, served)]
        if served.dead or not self.failed_groups:
            self._due[ScaleTrigger.REBUILD] = None  # a recovery rebuilds them, or nothing is broken
        elif self._fire(ScaleTrigger.REBUILD, now):
            return [self._ask(served.topology.size, ScaleTrigger.REBUILD, served)]
        if not served.dead and self._fire(ScaleTrigger.RESTORE, now):
            assert self.restore_size is not None
            return [self._ask(self.restore_size, ScaleTrigger.RESTORE, served)]
        return []

    def _fire(self, trigger: ScaleTrigger, now: float) -> bool:
        """Whether ``trigger``'s ask is due; disarmed if so."""
        due = self._due[trigger]
        if due is None or now < due:
            return False
        self._due[trigger] = None
        return True

    def _wants_restore(self, served: ServedState) -> bool:
        return self.restore_size is not None and served.topology.size < self.restore_size

    def _ask(self, size: int, trigger: ScaleTrigger, served: ServedState) -> AdmitScale:
        self._asks += 1
        op_id = f"{_ASK_PREFIX[trigger]}-{self._asks}"
        while op_id in served.history:
            op_id += "'"
        self._asked = op_id
        return AdmitScale(ScaleRequest(size, 0.0, op_id, trigger=trigger))


def _valid(served: ServedState, size: int) -> bool:
    try:
        served.validate(size)
    except ScalePlanError:
        return False
    return True
