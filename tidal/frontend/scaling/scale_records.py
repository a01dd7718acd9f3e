"""What the scale controller (``tidal.frontend.scaling.scale_controller``) admits and records.

The request (``ScaleRequest``, who asked: ``ScaleTrigger``) and the deadlines
(``ScaleTimeouts``) it runs under; the phases of one operation (``ScalePhase``) and its
outcome once the engines decided (``ScaleOutcome``); the record the API answers and
``/stats`` lists (``OperationRecord``, with its ``PhaseTiming``s); and the admission
answer (``Admission``, ``ScaleResponse``). The ``StrEnum`` values are the wire strings of
the JSON, ``/stats`` and the metrics' labels.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@enum.unique
class ScalePhase(enum.StrEnum):
    """One operation's phase; its value is what ``phase`` / ``result`` say in the JSON."""

    PLANNED = enum.auto()
    STARTING_ENGINES = enum.auto()
    PREPARING = enum.auto()
    COMMITTING = enum.auto()
    FINISHING = enum.auto()
    SUCCEEDED = enum.auto()
    ROLLED_BACK = enum.auto()
    FAILED = enum.auto()


FINAL_PHASES = frozenset({ScalePhase.SUCCEEDED, ScalePhase.ROLLED_BACK, ScalePhase.FAILED})


@enum.unique
class ScaleTrigger(enum.StrEnum):
    """Who asked for an operation: ``trigger`` in its record
    (docs/protocols/scale-phases.md#scale-triggers)."""

    API = enum.auto()  # a caller (POST /scale_elastic_ep)
    RECOVERY = enum.auto()  # a member died: the controller removes it (docs/architecture.md#faults)
    RESTORE = enum.auto()  # back to the size before the death (--elastic-restore)
    REBUILD = enum.auto()  # groups failed with nobody dead: the same engines, fresh groups


@enum.unique
class ScaleOutcome(enum.StrEnum):
    """What the engines decided once COMMIT was out: learnt from their first report
    (``resolution`` of a FAILED record whose outcome was learnt late)."""

    COMMITTED = enum.auto()
    ROLLED_BACK = enum.auto()


@dataclass(frozen=True)
class ScaleTimeouts:
    """Deadlines, seconds. The engine-side ones travel in ``ScalePrepare``; the frontend's
    are longer, so an engine reports its own timeout before the frontend gives up."""

    start_engines_s: float = 120.0  # spawn -> startup handshake of every new engine
    prepare_s: float = 360.0  # plus the request's drain timeout
    commit_s: float = 90.0  # ScaleCommit -> the first outcome report
    finish_s: float = 30.0  # leaving engines exit
    rendezvous_s: float = 60.0  # engine: standby group rendezvous
    transfer_s: float = 240.0  # engine: expert transfer
    engine_commit_s: float = 30.0  # engine: READY_TO_COMMIT -> consensus

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if self.prepare_s < self.rendezvous_s + self.transfer_s:
            raise ValueError("prepare_s must be >= rendezvous_s + transfer_s")
        if self.commit_s < 2 * self.engine_commit_s:
            raise ValueError("commit_s must be >= 2 * engine_commit_s")


@dataclass(frozen=True)
class ScaleRequest:
    """``POST /scale_elastic_ep`` (vLLM's fields) plus engines that must leave."""

    new_size: int
    drain_timeout_s: float = 0.0
    operation_id: str | None = None
    remove: tuple[int, ...] = ()
    trigger: ScaleTrigger = ScaleTrigger.API


# ------------------------------------------------------------------------------ record


@dataclass
class PhaseTiming:
    phase: ScalePhase
    started: float
    ended: float | None = None

    @property
    def duration(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


@dataclass
class OperationRecord:
    """What ``/scale_elastic_ep`` answers and ``/stats`` lists (``to_dict``)."""

    operation_id: str
    sequence: int
    from_size: int
    to_size: int
    from_epoch: int
    to_epoch: int  # the operation's epoch (served only if it SUCCEEDED)
    started_at: float
    phase: ScalePhase = ScalePhase.PLANNED
    joining: list[int] = field(default_factory=list)
    leaving: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    drain_timeout_s: float = 0.0
    trigger: ScaleTrigger = ScaleTrigger.API  # ScaleRequest.trigger
    finished_at: float | None = None
    phases: list[PhaseTiming] = field(default_factory=list)
    experts_moved: int = 0
    bytes_moved: int = 0
    min_bytes: int = 0
    p2p_bytes: int = 0
    disk_bytes: int = 0
    # What the engines staged, as they measured it (PREPARED reports): equals
    # ``bytes_moved`` (the plan's) when every copy arrived whole.
    bytes_received: int = 0
    requests_migrated: int = 0
    cause: str | None = None
    warnings: list[str] = field(default_factory=list)
    # FAILED with the outcome unknown, then learnt from a late report.
    resolution: ScaleOutcome | None = None

    @property
    def done(self) -> bool:
        return self.phase in FINAL_PHASES

    @property
    def result(self) -> str | None:
        return self.phase.value if self.done else None

    @property
    def duration(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started_at

    def phase_durations(self) -> dict[str, float]:
        return {t.phase.value: t.duration for t in self.phases if t.duration is not None}

    def to_dict(self) -> dict[str, Any]:
        return {
            "operation_id": self.operation_id,
            "from_size": self.from_size,
            "to_size": self.to_size,
            "from_epoch": self.from_epoch,
            "to_epoch": self.to_epoch,
            "phase": self.phase.value,
            "result": self.result,
            "cause": self.cause,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "duration_s": self.duration,
            "phase_durations_s": self.phase_durations(),
            "joining": list(self.joining),
            "leaving": list(self.leaving),
            "dead": list(self.dead),
            "drain_timeout_s": self.drain_timeout_s,
            "trigger": self.trigger.value,
            "experts_moved": self.experts_moved,
            "bytes_moved": self.bytes_moved,
            "min_bytes": self.min_bytes,
            "p2p_bytes": self.p2p_bytes,
            "disk_bytes": self.disk_bytes,
            "bytes_received": self.bytes_received,
            "requests_migrated": self.requests_migrated,
            "warnings": list(self.warnings),
            "resolution": None if self.resolution is None else self.resolution.value,
        }


@enum.unique
class Admission(enum.Enum):
    STARTED = enum.auto()  # a new operation (already SUCCEEDED if there was nothing to do)
    DUPLICATE = enum.auto()  # this operation id was seen: its record (running or done)
    CONFLICT = enum.auto()  # another operation runs (or its outcome is unknown): 409


@dataclass(frozen=True)
class ScaleResponse:
    admission: Admission
    record: OperationRecord  # CONFLICT: the operation in the way

    @property
    def status_code(self) -> int:
        """HTTP status once answered (200 is sent when ``record.done``)."""
        return 409 if self.admission is Admission.CONFLICT else 200


# ------------------------------------------------------------------------------ deaths


@dataclass
class DeathRecord:
    """One member of the served topology found dead (docs/architecture.md#faults), and its recovery."""

    engine_id: int
    epoch: int  # the epoch it served
    at: float
    cause: str
    requests_migrated: int = 0
    recovered_by: str | None = None  # the operation whose commit removed it
    recovered_at: float | None = None

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.at

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "epoch": self.epoch,
            "at": self.at,
            "cause": self.cause,
            "requests_migrated": self.requests_migrated,
            "recovered_by": self.recovered_by,
            "recovered_at": self.recovered_at,
            "recovery_s": self.recovery_s,
        }


def fault_summary(
    deaths: Sequence[DeathRecord] = (),
    dead: Iterable[int] = (),
    failed_groups: Mapping[int, str] | None = None,
    degraded: str | None = None,
) -> dict[str, Any]:
    """Rank deaths and their recoveries as ``/stats`` ``faults`` shows them (the defaults:
    a deployment that never lost a rank)."""
    done = [d.recovery_s for d in deaths if d.recovery_s is not None]
    return {
        "deaths": [d.to_dict() for d in deaths],
        "rank_deaths": len(deaths),
        "recovered": len(done),
        "recovery_s_last": done[-1] if done else None,
        "dead": sorted(dead),
        "failed_groups": dict(sorted((failed_groups or {}).items())),
        "degraded": degraded,
    }
