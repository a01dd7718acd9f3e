"""What crosses between an engine core and its worker processes (tensor parallelism,
docs/architecture.md#tensor-parallel): the shared-memory queue's handle, the worker's launch, the calls broadcast
to every worker and their replies, and the step's input in its wire form.

Wire (``tidal/executor/multiproc.py`` and ``tidal/executor/worker_proc.py``; the launch
payload a worker reads on its stdin, like an engine's, sits beside its entry point):

- engine -> every worker: one ``WorkerCall`` per call, msgpack, through the shared-memory
  broadcast queue (``tidal/distributed/shm_queue.py``); its ``args`` are the msgpack of
  the called method's positional arguments, decoded by the worker into that method's
  annotated parameter types (one decoder per method, built from its signature);
- worker -> engine: ``WorkerReply`` on a PUSH socket to the engine's PULL; the result is
  decoded by the engine into the method's annotated return type.

``StepInput`` is a ``SchedulerOutput`` without the scheduler's objects: a request's data
(prompt, outputs so far, block table, sampling parameters) crosses once, when a worker
first sees it (``WorkerRequest``); afterwards only what changed since the last step
(``WorkerChunk``: new output tokens, appended blocks). The executor keeps the mirror of
what the workers hold and the workers the requests themselves; ``forget`` drops finished
ones on both sides.

Pure: msgspec and the standard library (bottom layer). No pickle, no tensor: tensors
travel only inside process groups.
"""

from __future__ import annotations

import enum

import msgspec

from tidal.sampling_params import SamplingParams


class ShmQueueHandle(msgspec.Struct, frozen=True, array_like=True):
    """How a reader attaches to a ``ShmQueueWriter``'s ring (``tidal/distributed/shm_queue``):
    the segment's name under /dev/shm (or an inherited descriptor, when the creator has
    unlinked it already), its geometry, and the ZMQ address large payloads overflow to."""

    name: str
    num_readers: int
    num_chunks: int
    chunk_bytes: int
    overflow_address: str


@enum.unique
class ReplyMode(enum.IntEnum):
    """Which workers answer a call. Every worker answers a failure whatever the mode: the
    engine must learn at once that a worker left the rank's sequence of collectives."""

    ALL = 0  # every worker's result, in TP rank order
    DRIVER = 1  # TP rank 0's only (the step's output, the DP consensus)


class WorkerCall(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    method: str  # "<namespace>.<method>", an exported worker method (tidal/executor/rpc.py)
    args: msgspec.Raw  # msgpack of the positional arguments (a list)
    reply: ReplyMode = ReplyMode.ALL
    # Run on a thread of its own in the worker (the engine called it from a helper thread:
    # elastic rendezvous and transfers), so the worker keeps stepping meanwhile.
    background: bool = False
    # Only TP rank 0 runs it (the DP group's consensus is the rank-0 workers').
    driver_only: bool = False


@enum.unique
class WorkerErrorKind(enum.IntEnum):
    NONE = 0
    # A collective of the DP/EP groups failed (a peer rank died): the engine recovers
    # (``tidal.distributed.groups.GroupFailure``, docs/architecture.md#faults).
    GROUP_FAILURE = 1
    # Anything else: the call failed on this worker. A failure inside the forward leaves
    # the rank's workers out of step, so the engine treats it as the rank's death.
    ERROR = 2


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    tp_rank: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    error: str | None = None
    error_kind: WorkerErrorKind = WorkerErrorKind.NONE


class WorkerHello(msgspec.Struct, array_like=True):
    """Worker -> engine, first message: attached to the queue, ready for calls."""

    tp_rank: int
    pid: int


class WorkerRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the workers have not seen yet (or must rebuild): all of its state."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = []
    block_ids: list[int] = []
    eos_token_id: int | None = None


class WorkerChunk(msgspec.Struct, array_like=True, omit_defaults=True):
    """One scheduled chunk, in batch order: compute KV for tokens
    ``[start, start + num_new_tokens)``; first append what changed since the last step."""

    request_id: str
    start: int
    num_new_tokens: int
    new_output_token_ids: list[int] = []
    new_block_ids: list[int] = []


class StepInput(msgspec.Struct, array_like=True, omit_defaults=True):
    new_requests: list[WorkerRequest] = []
    chunks: list[WorkerChunk] = []
    forget: list[str] = []  # requests the workers drop (finished, aborted, replaced)
    # The scheduler's grammar bitmasks of this step (``SchedulerOutput.grammar_bitmask``).
    grammar_bitmask: dict[str, bytes] = {}
