"""Full-step graphs for decode steps (docs/architecture.md#cuda-graphs).

A decode-only step of B requests is padded to the next size of a ladder (``capture_sizes``)
and replayed from a graph captured for that size over static input buffers, instead of
launching its few hundred kernels one by one from Python. Four parts, each testable on CPU:

* **Sizes and decisions**, pure: ``capture_sizes(max_num_seqs)``, ``pad_to`` and ``decide``
  (graph or eager for a step, and why not: ``GraphMiss``).
* **Memory**, pure: ``graph_pool_estimate`` (the graphs' pool, taken out of the KV
  budget on CUDA before capture, from one measured eager step) and
  ``pool_segment_bytes`` (the pool measured after capture).
* **Backends** behind ``GraphBackend``: ``CudaGraphBackend`` (``torch.cuda.CUDAGraph``,
  every size in one memory pool, captured largest first) and ``EmulatedGraphBackend``, the
  CPU stand-in: its capture records the addresses of the static buffers the step reads
  and its replay runs the eager step again on those very buffers, failing if any moved. So
  the CPU tests exercise what a CUDA graph needs: no new input tensors per step, and the
  same ops every step of a size (tests/unit/test_graphs.py checks the second with a
  ``TorchDispatchMode``, with host syncs too).
* **Static inputs** (``StaticDecodeInputs``): one int64 buffer on the device holding every
  input of the largest size; a size-B graph reads the first B rows of each part. A step
  fills one of two host copies (pinned on CUDA, used in turn) and copies it in with one
  transfer. With async scheduling a decode's input id is not known on the host yet (a
  placeholder): the previous step's sampled ids are copied on the device into a static
  buffer and the captured step gathers each placeholder row's id from it, so an async
  decode step replays its graph with no host sync.

Padding rows are inert: token 0 at position 0, its K/V written to slot 0 of the null
block (block 0, which no request reads) and attending to that one key (length 1: a
length of 0 would be a softmax over nothing, NaN), and MoE routing to an expert id
no rank holds with weight 0 (``MoEForwardContext.padding``): they reach no expert and
add nothing to the recorded expert load.
"""

from __future__ import annotations

import bisect
import enum
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from tidal.executor.batch import NULL_BLOCK_ID
from tidal.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


class GraphMiss(enum.Enum):
    """Why a step ran eagerly."""

    ENFORCE_EAGER = "enforce_eager"  # --enforce-eager
    NO_BACKEND = "no_backend"  # a device without graphs (CPU unless --graph-backend emulated)
    EXPERT_PARALLEL = "expert_parallel"  # EP dispatch agrees token counts on the host
    TENSOR_PARALLEL = "tensor_parallel"  # TP collectives a graph cannot hold (gloo's)
    EXPERTS_SYNC = "experts_sync"  # CUDA: experts that group tokens on the host
    PREFILL = "prefill"  # prefill chunks only
    MIXED = "mixed"  # decodes and prefill chunks together
    ABOVE_LADDER = "above_ladder"  # more decodes than the largest captured size
    CAPTURE_FAILED = "capture_failed"  # this size's capture raised
    PREPARE_FAILED = "prepare_failed"  # a request's inputs raised: the isolating eager path


# ---- sizes and decisions (pure) -------------------------------------------------------------


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The padded batch sizes: 1, 2, 4, then every multiple of 8 to 256 and of 16 above,
    up to ``max_num_seqs``, which is always the last (so every decode step has a size).
    Steps of 8 keep the padding of a large batch under 8 rows (3 % at 256)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    ladder = [1, 2, 4, *range(8, 257, 8), *range(272, max_num_seqs + 1, 16)]
    sizes = [s for s in ladder if s < max_num_seqs]
    return (*sizes, max_num_seqs)


def pad_to(sizes: Sequence[int], num: int) -> int | None:
    """The smallest size that holds ``num`` rows; None above the ladder."""
    if num < 1:
        raise ValueError(f"a step has at least one row, got {num}")
    i = bisect.bisect_left(sizes, num)
    return sizes[i] if i < len(sizes) else None


# Collective backends whose operations a CUDA graph records: NCCL's are kernels on the
# stream. Gloo's run on host threads over host tensors, which no graph can hold.
GRAPH_SAFE_COLLECTIVES = frozenset({"nccl"})


def graphs_off(
    *,
    enforce_eager: bool,
    backend: str | None,
    expert_parallel: bool,
    tensor_parallel: str | None,
    experts_on_device: bool,
) -> GraphMiss | None:
    """Why an engine replays no graph at all (None: it may). ``tensor_parallel``: the TP
    group's collective backend (None: no TP); only a CUDA graph over NCCL holds them (the
    emulating backend stands for a CUDA graph, so gloo's stay eager with it too).
    Expert parallelism never: its dispatch agrees token counts on the host every step.
    ``experts_on_device``: no MoE layer reads its routing on the host
    (``FusedMoE.experts_on_device``); only a CUDA graph needs it, the emulating backend
    replays host reads as the eager step does."""
    if enforce_eager:
        return GraphMiss.ENFORCE_EAGER
    if backend is None:
        return GraphMiss.NO_BACKEND
    if expert_parallel:
        return GraphMiss.EXPERT_PARALLEL
    if tensor_parallel is not None and (
        backend != "cuda" or tensor_parallel not in GRAPH_SAFE_COLLECTIVES
    ):
        return GraphMiss.TENSOR_PARALLEL
    if backend == "cuda" and not experts_on_device:
        return GraphMiss.EXPERTS_SYNC
    return None


@dataclass(frozen=True)
class GraphDecision:
    size: int | None  # the padded size replayed; None: eager
    miss: GraphMiss | None  # why eager (None when replayed)


def decide(
    sizes: Sequence[int],
    num_decodes: int,
    num_prefills: int,
    *,
    off: GraphMiss | None = None,
    failed: frozenset[int] | set[int] = frozenset(),
) -> GraphDecision:
    """Graph or eager for a step of ``num_decodes`` one-token rows and ``num_prefills``
    longer chunks. ``off``: why graphs are off for the whole engine (decided at load);
    ``failed``: the sizes whose capture failed. The table: docs/architecture.md#cuda-graphs."""
    if off is not None:
        return GraphDecision(None, off)
    if num_prefills:
        return GraphDecision(None, GraphMiss.MIXED if num_decodes else GraphMiss.PREFILL)
    size = pad_to(sizes, num_decodes)
    if size is None:
        return GraphDecision(None, GraphMiss.ABOVE_LADDER)
    if size in failed:
        return GraphDecision(None, GraphMiss.CAPTURE_FAILED)
    return GraphDecision(size, None)


@dataclass
class GraphStats:
    """Steps replayed and steps run eagerly by reason (``/stats`` ``cuda_graphs``)."""

    hits: int = 0
    real_rows: int = 0  # rows of the replayed steps that were requests
    padded_rows: int = 0  # rows the replayed graphs computed (requests and padding)
    misses: dict[GraphMiss, int] = field(default_factory=dict)

    def record(self, decision: GraphDecision, rows: int) -> None:
        if decision.size is not None:
            self.hits += 1
            self.real_rows += rows
            self.padded_rows += decision.size
        else:
            assert decision.miss is not None
            self.misses[decision.miss] = self.misses.get(decision.miss, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "hits": self.hits,
            "misses": {m.value: n for m, n in self.misses.items()},
            "real_rows": self.real_rows,
            "padded_rows": self.padded_rows,
        }


# ---- memory (pure) -----------------------------------------------------------------------

ALLOCATOR_SEGMENT = 2 << 20  # torch's caching allocator takes device memory in 2 MiB steps


def graph_pool_estimate(step_peak: int, sizes: Sequence[int], row_bytes: int) -> int:
    """Bytes the graphs' one memory pool will hold, before any capture (the KV cache is
    sized first): the largest size's step at its peak (``step_peak``, measured by one
    eager run of it; every smaller size, captured after it, reuses those blocks) plus the
    outputs the smaller graphs keep ([size, H], ``row_bytes`` a row), in whole segments."""
    if step_peak < 0 or row_bytes < 0:
        raise ValueError(f"a step's peak and a row's bytes are >= 0: {step_peak}, {row_bytes}")
    need = step_peak + sum(sorted(sizes)[:-1]) * row_bytes
    return -(-need // ALLOCATOR_SEGMENT) * ALLOCATOR_SEGMENT


def pool_segment_bytes(segments: Sequence[dict[str, Any]], pool: tuple[int, int]) -> int:
    """Bytes of the allocator segments (``torch.cuda.memory._snapshot()["segments"]``)
    owned by ``pool``: what the captured graphs hold, measured."""
    return sum(int(s["total_size"]) for s in segments if tuple(s["segment_pool_id"]) == pool)


# ---- backends ----------------------------------------------------------------------------


StepFn = Callable[[], Tensor]  # the step on the static buffers -> its output
# The runner's padded forward: ids [B] int64, positions [B] int64, metadata, padding [B]
# bool -> hidden [B, H].
ForwardFn = Callable[[Tensor, Tensor, AttentionMetadata, Tensor], Tensor]
BuffersFn = Callable[[], list[Tensor]]  # the tensors the step reads, as they are now


class GraphBackend(ABC):
    """Captures a step per size and replays it. ``capture`` raises if the step cannot be
    captured (the caller runs that size eagerly); ``replay`` returns the step's output."""

    name: ClassVar[str]

    @abstractmethod
    def capture(self, size: int, step: StepFn, buffers: BuffersFn) -> None: ...

    @abstractmethod
    def replay(self, size: int) -> Tensor: ...

    @abstractmethod
    def release(self) -> None:
        """Drop every graph (before the buffers they read are freed or replaced)."""

    def pool_bytes(self) -> int | None:
        """Device bytes the captured graphs hold (None: none of their own)."""
        return None


class CudaGraphBackend(GraphBackend):
    """``torch.cuda.CUDAGraph`` per size, all in one memory pool: captured largest first,
    the smaller graphs reuse the largest one's blocks."""

    name = "cuda"

    def __init__(self) -> None:
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, Tensor] = {}  # each graph's output, rewritten by replay
        self.pool: Any = None

    def capture(self, size: int, step: StepFn, buffers: BuffersFn) -> None:
        # One eager run first: lazy initialisations (Triton compiles, cuBLAS handles,
        # memoised tables) must not happen inside the capture.
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size], self.outputs[size] = graph, out

    def replay(self, size: int) -> Tensor:
        self.graphs[size].replay()
        return self.outputs[size]

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def pool_bytes(self) -> int | None:
        if self.pool is None:
            return None
        segments = torch.cuda.memory._snapshot()["segments"]  # noqa: SLF001 - no public per-pool count
        return pool_segment_bytes(segments, tuple(self.pool))


class EmulatedGraphBackend(GraphBackend):
    """The CPU stand-in: capture records the static buffers' addresses and runs the step
    once; replay checks that no buffer moved and runs the eager step again on them."""

    name = "emulated"

    def __init__(self) -> None:
        self.steps: dict[int, tuple[StepFn, BuffersFn, list[int]]] = {}
        self.replays = 0

    def capture(self, size: int, step: StepFn, buffers: BuffersFn) -> None:
        step()
        self.steps[size] = (step, buffers, [t.data_ptr() for t in buffers()])

    def replay(self, size: int) -> Tensor:
        step, buffers, ptrs = self.steps[size]
        now = [t.data_ptr() for t in buffers()]
        if now != ptrs:
            moved = [i for i, (a, b) in enumerate(zip(ptrs, now)) if a != b]
            raise RuntimeError(
                f"graph of size {size}: static buffers {moved} moved since capture "
                "(a CUDA graph would read freed memory)"
            )
        self.replays += 1
        return step()

    def release(self) -> None:
        self.steps.clear()


GRAPH_BACKENDS: dict[str, type[GraphBackend]] = {
    "cuda": CudaGraphBackend,
    "emulated": EmulatedGraphBackend,
}


def resolve_backend(name: str, device: torch.device) -> str | None:
    """``--graph-backend``: auto -> cuda on CUDA, none elsewhere; cuda needs a CUDA device."""
    if name == "auto":
        return "cuda" if device.type == "cuda" else None
    if name == "cuda" and device.type != "cuda":
        raise ValueError(f"--graph-backend cuda needs a CUDA device, the engine runs on {device}")
    if name not in GRAPH_BACKENDS:
        raise ValueError(f"--graph-backend must be auto or one of {sorted(GRAPH_BACKENDS)}")
    return name


# ---- static inputs -----------------------------------------------------------------------


# Async scheduling's previous step: its sampled ids ([N] int64, on the device) and each
# sampling request's index in them (``ModelRunner._last_sampled``).
LastSampled = tuple[Tensor, dict[str, int]]


@dataclass
class DecodeStep:
    """A decode-only step's per-request arrays (``InputBatch.prepare_decode``)."""

    ids: np.ndarray  # [n] int64 the token of each request (0 for a placeholder)
    starts: np.ndarray  # [n] int64 its position (tokens already in the cache)
    # [n, w * groups] int block table rows, w >= the blocks the longest reads; with KV
    # cache groups their tables interleaved (``block_ids``'s order)
    table: np.ndarray
    sample_rows: list[int]
    sample_reqs: list[Any]  # ScheduledRequest
    prompt_lp: list[tuple[Any, int, int]]
    # Async scheduling: (row, request id) of each row whose id is the previous step's
    # sampled token, still on the device.
    placeholders: list[tuple[int, str]] = field(default_factory=list)

    @property
    def num(self) -> int:
        return len(self.ids)


class StaticDecodeInputs:
    """Every input of a decode graph, in one int64 buffer of the largest size on the
    device: ids, positions, slots, lengths, the real-row flag and the placeholder source
    (``max_size`` each; with KV cache groups, ``groups`` > 1, each further group's slots
    follow), then the block tables (``max_size x max_blocks`` each, one per group). A
    size-B graph reads the first B entries of each part and the first B table rows.
    ``hosts`` are two copies of it on the host (pinned on CUDA), filled in turn and
    copied in one transfer; ``prev`` holds the previous step's sampled ids, copied on the
    device, which a placeholder row's ``src`` (its index there; -1: not a placeholder)
    reads."""

    PARTS = ("ids", "positions", "slots", "lens", "real", "src")

    def __init__(
        self,
        max_size: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        groups: int = 1,
    ):
        self.max_size, self.max_blocks, self.block_size = max_size, max_blocks, block_size
        self.groups = groups
        self._tables_at = (len(self.PARTS) + groups - 1) * max_size
        numel = self._tables_at + groups * max_size * max_blocks
        pin = device.type == "cuda"
        # Two host copies used in turn: with async scheduling the host fills step n+1's
        # inputs while step n's transfer may still be queued behind step n-1 on the device.
        self.hosts = [torch.zeros(numel, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.host_nps = [h.numpy() for h in self.hosts]
        # CUDA: each host copy's last transfer (an event never recorded is complete).
        self.copied = [torch.cuda.Event() for _ in range(2)] if pin else None
        self.turn = 0  # the host copy the next fill writes
        self.device_buf = torch.zeros(numel, dtype=torch.int64, device=device)  # [numel]
        self.prev = torch.zeros(max_size, dtype=torch.int64, device=device)  # [max_size]

    def part(
        self, name: str, size: int, buf: Tensor | np.ndarray | None = None, group: int = 0
    ) -> Any:
        """[size] view of one part (of ``buf``, default the device buffer); ``group``:
        whose slots."""
        b = self.device_buf if buf is None else buf
        if name == "slots" and group:
            start = (len(self.PARTS) + group - 1) * self.max_size
        else:
            start = self.PARTS.index(name) * self.max_size
        return b[start : start + size]

    def table(self, size: int, buf: Tensor | np.ndarray | None = None, group: int = 0) -> Any:
        """[size, max_blocks] view of a group's block table."""
        b = self.device_buf if buf is None else buf
        start = self._tables_at + group * self.max_size * self.max_blocks
        return b[start : start + size * self.max_blocks].reshape(size, self.max_blocks)

    def views(self, size: int) -> list[Tensor]:
        return (
            [self.part(p, size) for p in self.PARTS]
            + [self.part("slots", size, group=g) for g in range(1, self.groups)]
            + [self.table(size, group=g) for g in range(self.groups)]
            + [self.prev]
        )

    def fill(self, step: DecodeStep, size: int, last: LastSampled | None = None) -> None:
        """The first ``step.num`` rows from the step, the rest padding; then one copy to
        the device of what a size-``size`` graph reads, and (placeholders) ``last``'s
        sampled ids into ``prev``. No host sync: every copy is queued on the device."""
        n, bs = step.num, self.block_size
        if n > size:
            raise ValueError(f"{n} requests do not fit a graph of {size}")
        starts = step.starts
        needed = starts // bs + 1  # [n] blocks each row reads (its new token's included)
        if n and int(needed.max()) > self.max_blocks:
            raise ValueError(f"a sequence needs more than {self.max_blocks} blocks")
        turn = self.turn
        self.turn ^= 1
        if self.copied is not None:
            # This host copy fed the step before last, whose transfer may still be queued
            # (async scheduling waits only for the step before that): writing it before
            # that transfer ran would change that step's inputs. Normally long done.
            self.copied[turn].synchronize()
        host, h = self.hosts[turn], self.host_nps[turn]
        self.part("ids", size, h)[:n] = step.ids
        self.part("positions", size, h)[:n] = starts
        self.part("lens", size, h)[:n] = starts + 1
        self.part("real", size, h)[:n] = 1
        src = self.part("src", size, h)
        src[:] = -1
        if last is not None and step.placeholders:
            tokens, index = last  # [N] int64 on the device
            if tokens.numel() > self.max_size:
                raise ValueError(f"{tokens.numel()} sampled ids exceed {self.max_size} rows")
            # A request missing from the previous step's ids failed in it: its id stays 0
            # and its output of this step is dropped with it (as in the eager step).
            ph = step.placeholders
            src[[r for r, _ in ph]] = [index.get(rid, -1) for _, rid in ph]
            # On the device, queued after the step that sampled them: no host sync.
            self.prev[: tokens.numel()].copy_(tokens, non_blocking=True)
        # Padding: token 0 at position 0 into slot 0 of the null block, length 1, no expert.
        for name, value in (("ids", 0), ("positions", 0), ("lens", 1), ("real", 0)):
            self.part(name, size, h)[n:] = value
        rows = np.arange(n)
        groups = self.groups
        width = min(step.table.shape[1] // groups, self.max_blocks)
        cols = np.arange(width)
        for g in range(groups):
            rows_table = step.table[:, g::groups]  # [n, w] this group's
            blocks = rows_table[rows, starts // bs].astype(np.int64)
            slots = self.part("slots", size, h, group=g)
            slots[:n] = blocks * bs + starts % bs
            slots[n:] = NULL_BLOCK_ID * bs
            table = self.table(size, h, group=g)
            # Columns past a row's last block read block 0 (masked by its length anyway).
            table[:n, :width] = np.where(cols[None, :] < needed[:, None], rows_table[:, :width], 0)
            table[:n, width:] = 0
            table[n:] = NULL_BLOCK_ID
        # Asynchronous from pinned memory: the parts, then the first ``size`` rows of each
        # group's table (a group's whole table would be max_size rows a step); the event,
        # after the last copy, marks when this host copy may be written again (two fills
        # later, above).
        spans = [(0, self._tables_at)]
        for g in range(groups):
            start = self._tables_at + g * self.max_size * self.max_blocks
            spans.append((start, start + size * self.max_blocks))
        for lo, hi in spans:
            self.device_buf[lo:hi].copy_(host[lo:hi], non_blocking=True)
        if self.copied is not None:
            self.copied[turn].record()

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata of a size-``size`` graph: views of the buffer (with KV
        cache groups, group 0's, holding every group's). Its mask and memoised cache rows
        are rebuilt inside every step (``refresh``)."""
        return AttentionMetadata.grouped([
            AttentionMetadata(
                num_tokens=size,
                block_size=self.block_size,
                slot_mapping=self.part("slots", size, group=g),
                query_lens=[1] * size,
                seq_lens=[],  # on the device only (decode_seq_lens): a graph reads no host list
                decode_rows=slice(0, size),
                decode_block_table=self.table(size, group=g),
                decode_seq_lens=self.part("lens", size),
            )
            for g in range(self.groups)
        ])

    def refresh(self, meta: AttentionMetadata) -> None:
        """Inside the step: what ``build`` derives on the host, derived on the device."""
        lens = meta.decode_seq_lens
        assert lens is not None
        width = self.max_blocks * self.block_size
        keys = torch.arange(width, device=lens.device)
        mask = (keys[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, keys]
        for m in meta.groups or (meta,):
            m.decode_mask = mask
            m._rows.clear()  # noqa: SLF001 - rebuilt from this step's tables by the first layer

    def input_ids(self, size: int) -> Tensor:  # -> [size] int64
        """Inside the step: each row's input id, a placeholder's gathered from ``prev``
        (a fixed-shape gather: the same ops whether or not a row is a placeholder)."""
        ids, src = self.part("ids", size), self.part("src", size)
        return torch.where(src >= 0, self.prev.index_select(0, src.clamp(min=0)), ids)


# ---- the decode graphs of one runner -----------------------------------------------------


class DecodeGraphs:
    """The ladder, the static inputs, the backend's graphs and the counts of one model
    runner. ``forward(ids, positions, meta, padding)`` is the model's forward with the MoE
    padding mask set (the runner's)."""

    def __init__(
        self,
        backend: GraphBackend | None,
        max_num_seqs: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.backend = backend
        # Why no step replays (``graphs_off``), set by ``capture``; before it no cache is
        # bound and nothing is captured.
        self.off: GraphMiss | None = GraphMiss.NO_BACKEND
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks, self.block_size, self.device = max_blocks, block_size, device
        self.static: StaticDecodeInputs | None = None
        self.captured: list[int] = []
        self.failed: set[int] = set()
        self.capture_s = 0.0
        # Device bytes of the graphs' pool: estimated before the KV cache is sized
        # (``measure_step``, ``graph_pool_estimate``) and measured after capture.
        self.pool_estimate: int | None = None
        self.pool_bytes: int | None = None
        self.stats = GraphStats()

    @property
    def enabled(self) -> bool:
        return self.off is None

    def capture(
        self,
        forward: ForwardFn,
        cache_buffers: Callable[[], list[Tensor]],
        off: GraphMiss | None,
        kv_groups: int = 1,
    ) -> None:
        """Capture every size, largest first; a size whose capture raises runs eagerly.
        ``cache_buffers``: the KV cache tensors (a graph reads them at fixed addresses);
        ``off``: why this engine replays nothing (``graphs_off``), or None; ``kv_groups``:
        the model's KV cache groups (a block table each)."""
        self.release()
        self.off = off
        if self.backend is None or off is not None:
            return
        t0 = time.perf_counter()
        static = self.static = StaticDecodeInputs(
            self.sizes[-1], self.max_blocks, self.block_size, self.device, kv_groups
        )
        for size in reversed(self.sizes):
            meta = static.metadata(size)
            step = _step(static, size, meta, forward)
            try:
                static.fill(DecodeStep(*_empty_step(), [], [], []), size)  # all padding
                self.backend.capture(size, step, lambda s=size: static.views(s) + cache_buffers())
            except Exception as e:  # noqa: BLE001 - that size runs eagerly
                logger.warning("capturing the decode graph of %d rows failed: %s", size, e)
                self.failed.add(size)
            else:
                self.captured.append(size)
        self.capture_s = time.perf_counter() - t0
        self.pool_bytes = self.backend.pool_bytes()
        pool = "" if self.pool_bytes is None else f", pool {self.pool_bytes >> 20} MiB"
        if pool and self.pool_estimate is not None:
            pool += f" (estimated {self.pool_estimate >> 20} MiB)"
        logger.info(
            "%s graphs: %d sizes captured in %.1f s (%d failed)%s",
            self.backend.name, len(self.captured), self.capture_s, len(self.failed), pool,
        )  # fmt: skip

    def agree_failed(self, all_reduce: Callable[[Tensor], Tensor]) -> None:
        """Tensor parallelism: every worker must replay a size or run it eagerly alike (a
        replayed step's collectives move the padded rows, an eager one's the real rows
        only), so a size whose capture failed on any worker fails on all. ``all_reduce``:
        the TP group's sum, called by every worker after its capture."""
        failed = [s in self.failed for s in self.sizes]
        mine = torch.tensor(failed, dtype=torch.int32, device=self.device)  # [sizes]
        counts = all_reduce(mine)  # [sizes] int32: the workers where each size failed
        self.failed = {s for s, n in zip(self.sizes, counts.tolist()) if n}

    def padding_step(self, forward: ForwardFn, kv_groups: int = 1) -> StepFn:
        """The largest size's step over fresh static inputs, every row padding: it reads
        and writes only the null block, so a cache of that block alone is enough."""
        size = self.sizes[-1]
        static = StaticDecodeInputs(
            size, self.max_blocks, self.block_size, self.device, kv_groups
        )
        static.fill(DecodeStep(*_empty_step(), [], [], []), size)
        return _step(static, size, static.metadata(size), forward)

    def measure_step(self, forward: ForwardFn, kv_groups: int = 1) -> int:
        """CUDA, before the KV cache exists (the caller binds the null block's): the peak
        bytes one eager run of ``padding_step`` allocates (its static buffers included:
        they are allocated after the cache is sized, as the capture's are)."""
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        step = self.padding_step(forward, kv_groups)
        step()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base

    def release(self) -> None:
        if self.backend is not None:
            self.backend.release()
        self.static = None
        self.captured, self.failed = [], set()
        self.pool_bytes = None
        if self.off is None:  # nothing to replay until the next capture
            self.off = GraphMiss.NO_BACKEND

    def decide(self, num_decodes: int, num_prefills: int) -> GraphDecision:
        return decide(self.sizes, num_decodes, num_prefills, off=self.off, failed=self.failed)

    def replay(
        self, step: DecodeStep, size: int, last: LastSampled | None = None
    ) -> Tensor:  # -> [size, H]
        """Fill the static inputs (``last``: the previous step's sampled ids, for the
        step's placeholders) and replay the size's graph."""
        assert self.backend is not None and self.static is not None
        self.static.fill(step, size, last)
        return self.backend.replay(size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": None if self.backend is None else self.backend.name,
            "off": None if self.off is None else self.off.value,
            "sizes": list(self.sizes),
            "captured": sorted(self.captured),
            "capture_failed": sorted(self.failed),
            "capture_s": round(self.capture_s, 3),
            "pool_bytes": self.pool_bytes,  # measured after capture (CUDA)
            "pool_bytes_estimated": self.pool_estimate,  # taken out of the KV budget
            **self.stats.to_dict(),
        }


def _empty_step() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 1), np.int32)


def _step(
    static: StaticDecodeInputs,
    size: int,
    meta: AttentionMetadata,
    forward: ForwardFn,
) -> StepFn:
    positions, real = static.part("positions", size), static.part("real", size)

    def step() -> Tensor:  # [size, H]
        static.refresh(meta)
        ids = static.input_ids(size)  # [size] int64, placeholders filled
        return forward(ids, positions, meta, real == 0)  # padding: [size] bool

    return step
