"""The frontend's scale controller (docs/architecture.md#elastic): one elastic EP operation
at a time, and healing after rank deaths.

Pure: no sockets, processes or clocks. It joins two parts, each testable alone:
``ScaleRunner`` (``tidal.frontend.scaling.scale_runner``) runs one operation through its
phases and rolls it back, and owns what is served; ``HealPolicy``
(``tidal.frontend.scaling.scale_healing``) decides when to recover, rebuild or restore
after a death -- told by the runner as things happen, asked after every event and tick.
``request_scale(request, now)`` admits an operation, ``handle(event, now)`` applies what
the engines and the process manager report, ``tick(now)`` fires deadlines; each returns
the actions to carry out, in order (``tidal.frontend.scaling.scale_events``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, assert_never

from tidal.frontend.scaling.scale_events import (
    Action,
    EngineExited,
    EngineStarted,
    Event,
    RequestsMigrated,
)
from tidal.frontend.scaling.scale_healing import HealPolicy
from tidal.frontend.scaling.scale_records import (
    OperationRecord,
    ScaleRequest,
    ScaleResponse,
    ScaleTimeouts,
    fault_summary,
)
from tidal.frontend.scaling.scale_runner import ScaleRunner
from tidal.moe.placement import PlacementStrategy
from tidal.protocol.elastic import ScaleReport
from tidal.protocol.topology import Topology


class ScaleController:
    """Admits scale operations one at a time and heals the deployment after rank deaths."""

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
        recover: bool = False,
        restore_size: int | None = None,
        recovery_retry_s: float = 1.0,
        rebuild_grace_s: float = 5.0,
        death_settle_s: float = 0.25,
    ) -> None:
        self.policy = HealPolicy(
            recover=recover,
            restore_size=restore_size,
            recovery_retry_s=recovery_retry_s,
            rebuild_grace_s=rebuild_grace_s,
            death_settle_s=death_settle_s,
            history_len=history_len,
        )
        self.runner = ScaleRunner(
            topology,
            num_experts,
            num_redundant,
            bytes_per_expert=bytes_per_expert,
            strategy=strategy,
            timeouts=timeouts,
            cpu_cores=cpu_cores,
            history_len=history_len,
            observer=self.policy,
        )

    # ------------------------------------------------------------------ queries

    @property
    def topology(self) -> Topology:
        """The committed topology: what is served."""
        return self.runner.topology

    @property
    def dead(self) -> set[int]:
        return self.runner.dead

    @property
    def live_members(self) -> tuple[int, ...]:
        return self.runner.live_members

    @property
    def history(self) -> Mapping[str, OperationRecord]:
        return self.runner.history

    @property
    def is_scaling(self) -> bool:
        """``/is_scaling_elastic_ep``: an operation runs (or its outcome is unknown)."""
        return self.runner.is_scaling

    @property
    def current(self) -> OperationRecord | None:
        return self.runner.current

    @property
    def timeouts(self) -> ScaleTimeouts:
        return self.runner.timeouts

    @timeouts.setter
    def timeouts(self, timeouts: ScaleTimeouts) -> None:
        self.runner.timeouts = timeouts

    @property
    def recover(self) -> bool:
        """Whether rank deaths are healed (``--elastic-recover``)."""
        return self.policy.recover

    @property
    def degraded(self) -> str | None:
        return self.policy.degraded(self.runner)

    def faults(self) -> dict[str, Any]:
        """For ``/stats`` and the metrics."""
        p = self.policy
        return fault_summary(p.deaths, self.runner.dead, p.failed_groups, self.degraded)

    def next_deadline(self) -> float | None:
        if self.runner.running is not None:
            return self.runner.next_deadline()
        return self.policy.next_deadline()

    def validate(self, new_size: int) -> None:
        """ScalePlanError (HTTP 400) if ``new_size`` cannot be served."""
        self.runner.validate(new_size)

    # ------------------------------------------------------------------ inputs

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
        return self.runner.request_scale(request, now, load=load, store_address=store_address)

    def admission_failed(self, request: ScaleRequest, now: float) -> None:
        """The driver could not admit ``request`` (an own ask is asked again later)."""
        self.policy.admission_failed(request, now, self.runner)

    def handle(self, event: Event, now: float) -> list[Action]:
        match event:
            case ScaleReport() | EngineExited() | EngineStarted():
                out = self.runner.handle(event, now)
            case RequestsMigrated():
                self.runner.count_migrated(event)
                self.policy.requests_migrated(event.engine_id, event.count)
                out = []
            case _:
                assert_never(event)
        return out + self.policy.heal(now, self.runner)

    def tick(self, now: float) -> list[Action]:
        return self.runner.tick(now) + self.policy.heal(now, self.runner)
