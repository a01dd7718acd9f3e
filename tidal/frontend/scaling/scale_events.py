"""Inputs and outputs of the scale controller (``tidal.frontend.scaling.scale_controller``).

The events the engines and the process manager report to ``ScaleController.handle``
(``Event``), and the actions every controller call returns for the caller to carry out in
order (``Action``). Plain frozen data: the transitions are all in the controller.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.frontend.scaling.scale_records import OperationRecord, ScaleRequest
from tidal.protocol.elastic import ScaleAbort, ScaleCommit, ScalePrepare, ScaleReport
from tidal.protocol.topology import Topology

# ------------------------------------------------------------------------------ events


@dataclass(frozen=True)
class EngineStarted:
    """A new engine finished its startup handshake (the READY message, its config hash
    matched): the scale controller's event, not the handshake message itself."""

    engine_id: int


@dataclass(frozen=True)
class EngineExited:
    """An engine process is gone (its sentinel fired, or heartbeats stopped)."""

    engine_id: int
    cause: str = "exited"


@dataclass(frozen=True)
class RequestsMigrated:
    """The frontend resumed ``count`` requests of ``engine_id`` elsewhere: the answer to
    a ``MigrateRequests`` (its ``operation_id`` echoed), counted in that operation's record."""

    engine_id: int
    count: int
    operation_id: str | None = None


Event = EngineStarted | EngineExited | RequestsMigrated | ScaleReport


# ------------------------------------------------------------------------------ actions


@dataclass(frozen=True)
class SpawnEngines:
    """Start engine processes with these fresh ids (they handshake -> ``EngineStarted``)."""

    operation_id: str
    engine_ids: tuple[int, ...]
    topology: Topology  # the one they will join


@dataclass(frozen=True)
class ExcludeFromRouting:
    """The balancer sends no new request to these engines (an overlay keyed by engine id;
    dropped for an engine once a published topology no longer holds it)."""

    engine_ids: tuple[int, ...]


@dataclass(frozen=True)
class RestoreRouting:
    engine_ids: tuple[int, ...]


@dataclass(frozen=True)
class SendPrepare:
    engine_ids: tuple[int, ...]
    message: ScalePrepare


@dataclass(frozen=True)
class SendCommit:
    engine_ids: tuple[int, ...]
    message: ScaleCommit


@dataclass(frozen=True)
class SendAbort:
    engine_ids: tuple[int, ...]
    message: ScaleAbort


@dataclass(frozen=True)
class PublishTopology:
    """Tell the coordinator (``DPSetTopology``), the balancer, the wave state and the
    ownership table; each drops anything of an older epoch from then on."""

    topology: Topology


@dataclass(frozen=True)
class StopEngines:
    """Stop these engine processes (``force``: kill now) and reap them."""

    engine_ids: tuple[int, ...]
    reason: str
    force: bool = False


@dataclass(frozen=True)
class MigrateRequests:
    """Resume on other engines the requests of ``engine_id``: those named (it handed them
    back: it has stopped them), or (None) every request the ownership table still gives
    it (it is gone). Feed back ``RequestsMigrated`` with ``operation_id``."""

    engine_id: int
    request_ids: tuple[str, ...] | None = None
    operation_id: str | None = None  # the operation it happened in, if any


@dataclass(frozen=True)
class RecordResult:
    """The operation ended: answer its caller, add it to /stats and the metrics."""

    record: OperationRecord


@dataclass(frozen=True)
class AdmitScale:
    """Start this operation as if a caller had asked (a recovery after a rank death, or
    the restore to the size before it): the driver makes its store and admits it."""

    request: ScaleRequest


@dataclass(frozen=True)
class FailDeployment:
    """No engine of the served topology is alive: nothing can serve. Fail every request
    and call now (HTTP 503 from then on)."""

    reason: str


Action = (
    AdmitScale
    | FailDeployment
    | SpawnEngines
    | ExcludeFromRouting
    | RestoreRouting
    | SendPrepare
    | SendCommit
    | SendAbort
    | PublishTopology
    | StopEngines
    | MigrateRequests
    | RecordResult
)
