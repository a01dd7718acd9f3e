"""Messages of elastic EP scaling between the frontend's scale controller and the engines
(docs/architecture.md#elastic). msgspec Structs only; the state machines that send and receive them
are ``tidal.elastic.state`` (engine) and ``tidal.frontend.scaling.scale_controller`` (frontend).

Flow of one operation (the frontend sends the same message to every participant; each
engine derives its own role -- survivor, leaving or joining -- from it)::

    frontend                                  engines (old members + new ones)
    ScalePrepare(op, new topology, ...)  -->  prepare while serving
                                         <--  ScaleReport(PREPARED | FAILED | HANDED_BACK)
    ScaleCommit(op)  (all PREPARED)      -->  raise the commit flag in the DP all-reduce
    ScaleAbort(op, cause) (else)         -->  roll back
                                         <--  ScaleReport(COMMITTED | ROLLED_BACK | LEFT)

Every message carries the operation id and the *new* epoch: a message of another
operation (a late copy from a rolled-back or finished one) is ignored by its receiver.
Durations, never absolute times, cross the wire: each process applies them to its own
monotonic clock.

Pure: imports only msgspec, the standard library and the topology (bottom layer).
"""

from __future__ import annotations

import enum

import msgspec

from tidal.protocol.topology import Topology


class ExpertTransferSpec(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Copy logical expert ``expert`` (all its MoE layers) from worker ``src_tp_rank`` of
    ``src_engine_id``, its local slot ``src_slot`` (old placement), into worker
    ``dst_tp_rank`` of ``dst_engine_id``, slot ``dst_slot`` (new placement); the TP ranks
    are 0 without tensor parallelism. ``src_engine_id is None``: no live engine holds it,
    load it from disk."""

    expert: int
    dst_engine_id: int
    dst_slot: int
    src_engine_id: int | None = None
    src_slot: int = -1
    nbytes: int = 0
    src_tp_rank: int = 0
    dst_tp_rank: int = 0

    @property
    def from_disk(self) -> bool:
        return self.src_engine_id is None


class ScalePrepare(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, tag="prepare"):
    """Start preparing ``topology`` (epoch = current + 1) while serving the current one."""

    operation_id: str
    # Increases with every operation the controller starts (a rolled-back operation's
    # epoch is reused by the next one, its sequence never is): the commit flag each rank
    # puts into the DP all-reduce is this number, so a late flag of an older operation
    # can never complete the consensus of a newer one.
    sequence: int
    topology: Topology  # the new one: members in rank order, placement, standby store
    leaving: list[int]  # engine ids of the current topology that are not in the new one
    joining: list[int]  # engine ids of the new topology that are not in the current one
    transfers: list[ExpertTransferSpec]  # network and disk copies (slot-local ones excluded)
    # Leaving engines finish their own requests for up to this long, then hand the rest
    # back for migration (docs/architecture.md#elastic-migration).
    drain_timeout_s: float = 0.0
    rendezvous_timeout_s: float = 60.0  # join the standby groups
    transfer_timeout_s: float = 300.0  # send / receive experts
    commit_timeout_s: float = 30.0  # READY_TO_COMMIT -> consensus
    # Leaving engines that are dead (an emergency scale-down, docs/architecture.md#faults): nothing is
    # copied from them, and since the current DP group cannot all-reduce any more, the
    # commit consensus runs on the standby group instead (a barrier every new member posts).
    dead: list[int] = []
    # CPU: torch threads per rank after the commit (cores // local ranks); None = GPU.
    threads_per_rank: int | None = None
    # The current groups failed with nobody found dead (docs/architecture.md#faults): the same engines
    # build fresh groups of the next epoch, and the consensus is the standby barrier.
    rebuild: bool = False

    @property
    def epoch(self) -> int:
        return self.topology.epoch

    @property
    def old_group_usable(self) -> bool:
        return not self.dead and not self.rebuild


class ScaleCommit(msgspec.Struct, frozen=True, array_like=True, tag="commit"):
    """Every participant reported PREPARED: the engines may raise their commit flag."""

    operation_id: str
    epoch: int


class ScaleAbort(msgspec.Struct, frozen=True, array_like=True, tag="abort"):
    """Roll the operation back (sent only before any ``ScaleCommit`` of the operation)."""

    operation_id: str
    epoch: int
    cause: str


@enum.unique
class ScaleEvent(enum.IntEnum):
    PREPARED = 0  # ready to commit: standby groups joined, experts staged, drained
    FAILED = 1  # this engine failed its part (cause) and rolled back
    HANDED_BACK = 2  # leaving engine: these unfinished requests must migrate
    COMMITTED = 3  # switched to the new topology at consensus step ``step``
    ROLLED_BACK = 4  # rolled back because told (abort, consensus abort, group failure)
    LEFT = 5  # leaving engine: left the group, about to exit
    # Not of an operation (empty id; epoch = the one it serves): a collective of this
    # engine's groups failed (a member died, docs/architecture.md#faults); it preempted its running
    # requests and steps no more until a recovery operation commits new groups.
    GROUP_FAILED = 6

    def __str__(self) -> str:
        return self.name.lower()


class ScaleReport(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Engine -> frontend: progress of one operation on one engine."""

    operation_id: str
    engine_id: int
    epoch: int  # the operation's new epoch
    event: ScaleEvent
    cause: str | None = None
    step: int | None = None  # COMMITTED: the consensus step at which all ranks switched
    request_ids: list[str] = []  # HANDED_BACK
    experts_received: int = 0  # PREPARED: network + disk copies installed on this engine
    bytes_received: int = 0
    requests_preempted: int = 0  # GROUP_FAILED: running requests it will re-prefill


# Frontend -> engine, one ``EngineCoreRequestType.SCALE`` frame (tagged: one decoder).
ScaleMessage = ScalePrepare | ScaleCommit | ScaleAbort
