"""Inputs and outputs of ``ElasticEPScalingState`` (``tidal.elastic.state``), and its enums.

The phases and roles an engine goes through in one elastic EP operation (docs/architecture.md#elastic-protocol);
the inputs the busy loop and the helper thread feed to ``progress`` (``Input``), and the
actions it returns for the busy loop to carry out in order (``Action``). Plain frozen
data: the transitions are all in ``tidal.elastic.state``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tidal.protocol.elastic import (
    ExpertTransferSpec,
    ScaleAbort,
    ScaleCommit,
    ScaleReport,
)


@enum.unique
class ScalingPhase(enum.Enum):
    IDLE = enum.auto()  # created, not yet progressed
    PREPARING = enum.auto()  # survivor: standby rendezvous, send / receive experts
    DRAINING = enum.auto()  # leaving: finishing its own requests, no new ones
    MIGRATING = enum.auto()  # leaving: unfinished requests handed back, sends finishing
    JOINING = enum.auto()  # joining: standby rendezvous
    RECEIVING_EXPERTS = enum.auto()  # joining: receiving its experts
    READY_TO_COMMIT = enum.auto()  # prepared; flag raised once the frontend allows it
    COMMITTING = enum.auto()  # commit actions out, waiting for ``CommitApplied``
    DONE = enum.auto()  # survivor: serving in the new epoch
    SERVING = enum.auto()  # joiner: serving in the new epoch
    LEAVING = enum.auto()  # leaving: left the group; the process exits
    ROLLED_BACK = enum.auto()  # serving the old epoch as before (joiner: to be stopped)
    FAILED = enum.auto()  # the commit could not be applied: fatal for this engine


TERMINAL = frozenset(
    {
        ScalingPhase.DONE,
        ScalingPhase.SERVING,
        ScalingPhase.LEAVING,
        ScalingPhase.ROLLED_BACK,
        ScalingPhase.FAILED,
    }
)
# Phases from which a rollback is still possible (nothing switched yet).
PRE_COMMIT = frozenset(
    {
        ScalingPhase.IDLE,
        ScalingPhase.PREPARING,
        ScalingPhase.DRAINING,
        ScalingPhase.MIGRATING,
        ScalingPhase.JOINING,
        ScalingPhase.RECEIVING_EXPERTS,
        ScalingPhase.READY_TO_COMMIT,
    }
)


@enum.unique
class Role(enum.Enum):
    SURVIVOR = enum.auto()
    LEAVING = enum.auto()
    JOINING = enum.auto()


@enum.unique
class JobKind(enum.Enum):
    RENDEZVOUS = enum.auto()
    TRANSFER = enum.auto()
    COMMIT_BARRIER = enum.auto()


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class JobDone:
    job_id: str
    result: object = None  # COMMIT_BARRIER: a ``BarrierResult``


@dataclass(frozen=True)
class JobFailed:
    job_id: str
    cause: str


@dataclass(frozen=True)
class BarrierResult:
    """The standby DP group's barrier all-reduce: the group's wave and step (MAX)."""

    wave: int
    step: int


@dataclass(frozen=True)
class Consensus:
    """The current DP group's all-reduce at ``step``: MIN and MAX of ``consensus_value``."""

    step: int
    ready_min: int
    ready_max: int


@dataclass(frozen=True)
class OldGroupFailed:
    """A collective on the current DP/EP group failed (a member died)."""

    cause: str


@dataclass(frozen=True)
class HandedBack:
    """The busy loop removed these unfinished requests (or bounced these new ones)."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class CommitApplied:
    """The busy loop carried out the commit actions."""


Input = (
    ScaleCommit
    | ScaleAbort
    | JobDone
    | JobFailed
    | Consensus
    | OldGroupFailed
    | HandedBack
    | CommitApplied
)


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class StartRendezvous:
    """Helper thread: join the standby groups of ``epoch`` on ``store_address`` --
    ``members`` (the new topology, rank order) form the DP/EP groups, ``participants``
    (the live old and new members) the transfer group -- and agree the KV size (MIN)."""

    job_id: str
    epoch: int
    store_address: str | None
    members: tuple[int, ...]
    participants: tuple[int, ...]
    timeout_s: float


@dataclass(frozen=True)
class StartTransfer:
    """Helper thread: send ``sends`` and receive ``receives`` (staged, not installed), in
    the order of the plan's transfer list, which every engine follows."""

    job_id: str
    epoch: int
    sends: tuple[ExpertTransferSpec, ...]
    receives: tuple[ExpertTransferSpec, ...]
    timeout_s: float


@dataclass(frozen=True)
class StartCommitBarrier:
    """Helper thread: post the standby DP group's barrier all-reduce (wave and step, MAX;
    this rank contributes 0, 0) with collective timeout ``timeout_s``; report its
    ``BarrierResult``. Completes only when every new member has posted it (a survivor
    posts it as ``NewGroupBarrier`` when it commits on the current group's consensus)."""

    job_id: str
    epoch: int
    timeout_s: float


@dataclass(frozen=True)
class CancelJob:
    """Abandon the job: its late ``JobDone`` / ``JobFailed`` is ignored."""

    job_id: str


@dataclass(frozen=True)
class EnsureWaveRunning:
    """Consensus rounds happen only while the wave runs: start it if paused (as for a
    request of an older wave: run, and tell the coordinator ``start_wave``)."""


@dataclass(frozen=True)
class HandBackRequests:
    """Take every unfinished request out of the scheduler (no finish output) and feed
    their ids back as ``HandedBack`` (even none) to the next ``progress``."""


@dataclass(frozen=True)
class SendReport:
    report: ScaleReport


@dataclass(frozen=True)
class DestroyStandbyGroups:
    """Destroy this engine's standby groups of ``epoch`` (and its store client)."""

    epoch: int


@dataclass(frozen=True)
class DiscardStagedExperts:
    epoch: int


@dataclass(frozen=True)
class SwapGroups:
    """The standby DP/EP groups of ``epoch`` become the current ones; the transfer group
    is destroyed."""

    epoch: int


@dataclass(frozen=True)
class InstallExperts:
    """Install the staged experts and slot moves: ``local_expert_ids`` per local slot
    (the expert map follows from it)."""

    epoch: int
    local_expert_ids: tuple[int, ...]


@dataclass(frozen=True)
class TakeRank:
    """Take DP/EP rank ``rank`` of ``size`` in ``epoch`` and reset the step counter (the
    all-reduce cadence restarts together on the new group). ``wave``: adopt it (joiners)."""

    epoch: int
    rank: int
    size: int
    wave: int | None = None


@dataclass(frozen=True)
class SetNumThreads:
    num_threads: int


@dataclass(frozen=True)
class DestroyOldGroups:
    """Destroy the DP/EP groups of ``epoch`` (the one being left)."""

    epoch: int


@dataclass(frozen=True)
class NewGroupBarrier:
    """Survivors, right after the swap: the first collective of the new group -- the
    barrier the joiners posted -- contributing this rank's wave (the busy loop's) and
    ``step``. Its failure is a rank death in the new epoch (docs/architecture.md#faults), not a commit failure."""

    epoch: int
    step: int


@dataclass(frozen=True)
class Leave:
    """Leaving engine: stop serving and exit once the output queue is flushed."""


@dataclass(frozen=True)
class Fatal:
    """The engine cannot continue (a half-applied commit, or no barrier answer after
    twice its timeout: the outcome is unknown to it): die with ENGINE_CORE_DEAD; the
    frontend treats it as a rank death."""

    cause: str


Action = (
    StartRendezvous
    | StartTransfer
    | StartCommitBarrier
    | CancelJob
    | EnsureWaveRunning
    | HandBackRequests
    | SendReport
    | DestroyStandbyGroups
    | DiscardStagedExperts
    | SwapGroups
    | InstallExperts
    | TakeRank
    | SetNumThreads
    | DestroyOldGroups
    | NewGroupBarrier
    | Leave
    | Fatal
)
