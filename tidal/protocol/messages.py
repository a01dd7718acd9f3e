"""Every message that crosses a process boundary: msgspec Structs, encoded as msgpack.

One decoder per direction, one dispatcher on the receiving side. Nothing here is pickled.
Request-type frames are one byte (``EngineCoreRequestType``) followed by the payload.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from tidal.protocol.elastic import ScaleReport
from tidal.protocol.topology import Topology
from tidal.sampling_params import SamplingParams


@enum.unique
class EngineCoreRequestType(enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    # Sentinel placed on the engine's input queue by its own signal handler.
    EXECUTOR_FAILED = b"\x04"
    # Elastic EP: a ``ScaleMessage`` (ScalePrepare | ScaleCommit | ScaleAbort).
    SCALE = b"\x05"
    # Frontend liveness, no payload, every HEARTBEAT_INTERVAL_S (docs/architecture.md#faults): an
    # engine that got one and then hears nothing for --frontend-timeout exits.
    HEARTBEAT = b"\x06"


# Liveness both ways (docs/architecture.md#faults): the frontend sends HEARTBEAT to every member, an
# engine's output thread sends ``EngineCoreOutputs(heartbeat=True)`` when it sent nothing
# else for an interval. Silence is a death: of any engine (local or headless: a frozen
# process keeps its sentinel) for the frontend after HEARTBEAT_TIMEOUT_S; of the frontend
# for an engine after ``ParallelConfig.frontend_timeout`` -- longer, because a frontend
# event loop stalled by a burst of work must not make every engine exit.
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 3.0


@enum.unique
class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, stop token id or stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # client abort, disconnect or engine failure
    # The engine could not serve this request (invalid, or it made the engine raise);
    # ``stop_reason`` carries the message. Only this request fails, never the rank.
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, omit_defaults=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    # SamplingParams is its own wire form: msgspec checks its field table while decoding.
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    client_index: int = 0
    current_wave: int = 0
    data_parallel_rank: int | None = None
    # A resumed request (docs/architecture.md#elastic-migration): the last this many prompt tokens are outputs
    # already produced elsewhere. They count as outputs for max/min_tokens, penalties and
    # the seeded sampler's output position; 0 <= k < len(prompt_token_ids).
    num_output_tokens: int = 0


class Logprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: the chosen token first, then the top-k."""

    token_ids: list[int]  # [1 + k]
    logprobs: list[float]  # [1 + k]
    rank: int  # 1-based rank of the chosen token in the full distribution


class RequestTimings(msgspec.Struct, array_like=True):
    """Seconds a request spent on the engine that finished it, each phase measured on that
    engine's own clock (docs/operations.md#metrics): queued (added, not yet scheduled),
    prefill (first scheduled until its first token) and decode (first token to finish).
    A migrated request counts from its arrival on this engine."""

    queued_s: float
    prefill_s: float
    decode_s: float


class EngineCoreOutput(msgspec.Struct, omit_defaults=True, array_like=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    new_prompt_logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # With ERROR: the engine refused the request as invalid input when admitting it (it
    # never ran); False: it failed while running. The frontend answers 400 or 500.
    invalid_request: bool = False
    # On the output that finishes it: where its time on this engine went.
    timings: RequestTimings | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, omit_defaults=True, array_like=True):
    call_id: int
    failure_message: str | None = None
    result: Any = None


class SchedulerStats(msgspec.Struct, omit_defaults=True, array_like=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preempted: int = 0
    step_counter: int = 0
    current_wave: int = 0
    num_requests_total: int = 0  # cumulative requests added to this rank (DP coordinator)
    num_generation_tokens_total: int = 0  # cumulative output tokens this engine generated
    # Tokens scheduled in each step since the previous stats message (the newest, bounded).
    iteration_tokens: list[int] = []


class EngineProgress(msgspec.Struct, array_like=True):
    """Where an engine's busy loop is, in its heartbeats (the stall watchdog): the
    iterations it began so far, whether it is inside one (not idle, waiting for input),
    and whether it waits in a collective for its peers there."""

    iterations: int
    busy: bool
    waiting_on_peers: bool


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True, array_like=True):
    engine_id: int = 0  # the sender's engine id (== its DP rank only at launch)
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: set[str] | None = None
    # DP wave control: the wave that just completed (sent by rank 0) / a wave to start.
    wave_complete: int | None = None
    start_wave: int | None = None
    # Set on the last message of an engine that hit a fatal error.
    engine_dead: bool = False
    dead_reason: str | None = None
    # Elastic EP: this engine's progress in a scale operation (docs/architecture.md#elastic-protocol).
    scale_report: ScaleReport | None = None
    # Liveness only (nothing else set but ``progress``): see HEARTBEAT_INTERVAL_S.
    heartbeat: bool = False
    progress: EngineProgress | None = None


class UtilityRequest(msgspec.Struct, array_like=True):
    client_index: int
    call_id: int
    method_name: str
    args: list[Any]


def encode(obj: Any) -> bytes:
    return _ENCODER.encode(obj)


_ENCODER = msgspec.msgpack.Encoder()


def engine_identity(engine_id: int) -> bytes:
    """The ZMQ identity of engine ``engine_id`` on the frontend's ROUTER: 2 bytes,
    little-endian (``tidal.protocol.topology.MAX_ENGINE_ID`` bounds the ids)."""
    return engine_id.to_bytes(2, "little")


def engine_id_of(identity: bytes) -> int:
    """Inverse of ``engine_identity``."""
    return int.from_bytes(identity, "little")


# ---- Engine startup handshake ----


class EngineHello(msgspec.Struct, array_like=True):
    """Engine -> frontend, first message on the handshake socket."""

    engine_id: int
    pid: int
    host: str = ""  # the engine's host name (``/stats`` ``ranks[].node`` on mp)


class EngineAddresses(msgspec.Struct, array_like=True):
    """Frontend -> engine reply to HELLO: where to connect, and the deployment it joins."""

    input_address: str
    output_address: str
    coordinator_input: str | None = None  # engine SUBscribes here (START_DP_WAVE)
    coordinator_output: str | None = None  # engine PUSHes stats/wave events here
    # ``EngineConfig.config_hash()`` of the frontend: what every engine must share with it.
    parallel_config_hash: str = ""
    # The live DP group: the engine's rank is its position here, the group size is
    # ``topology.size`` and ``topology.store_address`` hosts the groups' TCPStore. An
    # engine whose id is not in it refuses to start. None: a single engine, no groups.
    topology: Topology | None = None
    # Elastic EP: this engine joins ``topology`` (a new epoch) in a scale operation. It
    # loads the non-expert weights, allocates its expert slots, sends READY and waits for
    # the operation's ScalePrepare; it joins the groups only at the commit.
    joining: bool = False
    # Set: this process may not start as this engine (the frontend started another
    # process for that id: an engine id never runs twice); it exits without READY.
    refused: str | None = None


class EngineReady(msgspec.Struct, array_like=True):
    """Engine -> frontend once the model is loaded and the KV cache allocated."""

    engine_id: int
    parallel_config_hash: str
    num_blocks: int
    error: str | None = None
    # The rank's worker processes in TP rank order (its own pid at TP size 1): /stats.
    worker_pids: list[int] = []


# ---- DP coordinator ----
# Wire protocol of tidal/dp_coordinator (see its state.py docstring for the wave rules).
# Coordinator -> engines (XPUB, two frames [kind, payload]):
#   [EngineCoreRequestType.START_DP_WAVE.value, StartDPWave] or [COORDINATOR_READY, CoordinatorReady]
# Engines -> coordinator (PUSH -> PULL, one frame): EngineCoreOutputs (stats / wave events).
# Coordinator -> frontends (XPUB, one frame): DPLoadSnapshot.
# Frontends -> coordinator (XSUB upstream, one frame): FrontendToCoordinator.
# /stats (DEALER/REQ -> ROUTER): DPStatsRequest -> DPCoordinatorStats.

COORDINATOR_READY = b"READY"  # kind frame; never a valid EngineCoreRequestType byte


class StartDPWave(msgspec.Struct, array_like=True):
    """Coordinator -> engines: join the collective loop for ``wave``."""

    wave: int
    exclude_engine_id: int | None = None  # that engine already started on its own


class CoordinatorReady(msgspec.Struct, array_like=True):
    """Coordinator -> engines, sent each time an engine subscribes (engines that are
    already past their handshake ignore it). Carries the wave so a late or new rank
    starts from the group's wave instead of 0."""

    num_engines: int
    wave: int
    running: bool
    epoch: int = 0  # of the coordinator's topology


class DPWakeUp(msgspec.Struct, tag="wake", array_like=True):
    """Frontend -> coordinator: the first request of ``wave`` (which the frontend believed
    paused) went to engine ``engine_id``; wake the others. Engine ids are never reused,
    so this means the same in every topology epoch and carries none."""

    wave: int
    engine_id: int


class DPSetTopology(msgspec.Struct, tag="topology", array_like=True):
    """Frontend (scale controller) -> coordinator: the DP group is now ``topology``
    (elastic EP commit). One with an epoch older than the coordinator's is dropped."""

    topology: Topology


FrontendToCoordinator = DPWakeUp | DPSetTopology


class DPStatsRequest(msgspec.Struct, tag="stats", array_like=True):
    """Anyone -> coordinator's stats ROUTER: reply with DPCoordinatorStats."""


class DPLoadSnapshot(msgspec.Struct, array_like=True):
    """Coordinator -> frontends: the published load (at most every 100 ms + heartbeats)."""

    seq: int  # increases by one per publication
    timestamp: float  # coordinator's monotonic clock
    # The topology the load describes: entry i is engine ``engine_ids[i]`` (rank i) in
    # ``epoch``. A frontend on a newer epoch drops the snapshot (docs/architecture.md#elastic-identity).
    epoch: int
    engine_ids: list[int]
    wave: int
    running: bool
    counts: list[list[int]]  # [num_engines][2]: [waiting, running]
    kv_usage: list[float]  # [num_engines], 0..1


class DPRankStats(msgspec.Struct):
    """One rank in ``/stats`` (a JSON object, so not array_like)."""

    rank: int  # position in the coordinator's topology
    engine_id: int
    waiting: int
    running: int
    kv_usage: float
    requests_total: int
    dead: bool
    history: list[tuple[float, int, int]]  # (t, waiting, running), oldest first
    generation_tokens_total: int = 0  # cumulative output tokens (per-rank tokens/s)


class DPCoordinatorStats(msgspec.Struct):
    """Full coordinator state for ``/stats`` and the dashboard. Times are on the
    coordinator's monotonic clock: an entry's age is ``timestamp - t``."""

    timestamp: float
    num_engines: int
    wave: int
    running: bool
    waves_completed: int
    epoch: int
    ignored_messages: int  # from engines outside the topology, and stale topologies
    start_wave_broadcasts: int
    ranks: list[DPRankStats]


# One decoder per message direction (msgspec decoders are reusable and cheaper than
# ``msgspec.msgpack.decode(..., type=...)`` per call).
ENGINE_OUTPUTS_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)
FRONTEND_DECODER = msgspec.msgpack.Decoder(FrontendToCoordinator)
SNAPSHOT_DECODER = msgspec.msgpack.Decoder(DPLoadSnapshot)
STATS_DECODER = msgspec.msgpack.Decoder(DPCoordinatorStats)
_START_DECODER = msgspec.msgpack.Decoder(StartDPWave)
_READY_DECODER = msgspec.msgpack.Decoder(CoordinatorReady)


def decode_engine_message(frames: list[bytes]) -> StartDPWave | CoordinatorReady:
    """Decode one ``[kind, payload]`` message an engine received from the coordinator's
    ``engine_publish`` socket."""
    kind, payload = frames
    if kind == COORDINATOR_READY:
        return _READY_DECODER.decode(payload)
    if kind == EngineCoreRequestType.START_DP_WAVE.value:
        return _START_DECODER.decode(payload)
    raise ValueError(f"unknown coordinator message kind {kind!r}")
