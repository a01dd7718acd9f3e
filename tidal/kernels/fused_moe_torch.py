"""CPU fast path of the fused MoE experts: the same algorithm as the Triton kernel in torch.

``fused_experts_torch`` has the shared expert-backend signature (see
``tidal/moe/reference.py``). Token slots (token t, choice k) are sorted by local expert
so each expert's rows are contiguous; then the gate/up GEMMs, SiLU-and-mul, router
weighting, the down GEMMs, and an ``index_add_`` back to the tokens.

Strategies for the GEMMs (``strategy=``; tests pin each one against the reference):

* ``bmm``: every expert's rows padded to the busiest expert's count, one ``torch.bmm``
  for gate/up and one for down. Two parallel regions per layer instead of one or two per
  expert: with 2 threads the per-expert GEMMs of a decode batch are too small to split
  well, and this form is ~1.1-1.4x faster (32-256 tokens, ``benchmarks/moe_layer.py``),
  and degrades least when another process shares the cores (each small GEMM's OpenMP
  barrier is what stalls). With one thread, or large per-expert row counts (a 1024-token
  prefill), the padding and copies make it ~5-20% slower than the others.
* ``grouped_mm``: ``torch.nn.functional.grouped_mm``, one call for all experts (per-expert
  GEMMs in C++, every expert visited, empty or not). Needs 16-byte aligned row strides.
* ``loop``: one ``torch.mm`` per busy expert, written into one output.
* ``onednn``: one oneDNN GEMM pair per busy expert on prepacked weights
  (``PackedExperts``, given by the layer as ``packed=``); ``auto`` takes it whenever
  ``packed`` is given (CPU, float32): 2.2x the others on the 1024-wide model's block.
* ``cpp``: the C++ kernel of ``tidal/kernels/cpu_moe.py`` on its own packed layout
  (``CpuPackedExperts``, given as ``packed=``): the whole layer in one call, two parallel
  regions; ``auto`` takes it whenever such a ``packed`` is given (the layer gives one
  when the kernel was built). 1.3-4x the ``onednn`` strategy (``benchmarks/cpu_speed.py``).
* ``auto``: ``loop`` when at most half the experts have tokens (small batches: only busy
  experts cost anything); else, with more than one torch thread, ``bmm`` for small
  balanced batches (at most ``BMM_MAX_ROWS`` rows per expert and at most
  ``MAX_BMM_PADDING`` x padding: batched decode); else ``grouped_mm``.

Weight layout: the GEMMs read ``w13[e].T`` and ``w2[e].T``. When the weights have
K-major storage (``w13.transpose(1, 2)`` contiguous, made by ``k_major_experts``) these
are plain row-major matrices, the GEMM form MKL runs fastest; any other strides work
too, just slower. The layout is a property of the canonical ``w13``/``w2`` tensors
themselves (no derived copy), so weight loads and expert moves that write into them in
place keep it and can never leave a stale copy behind.

Slots whose expert is not local (expert map -1, or id out of range) sort after every
local expert and are dropped before the GEMMs, so they cost nothing and contribute zero.
The router weight scales the I-wide activation before the down GEMM rather than the
H-wide output after it (the Triton kernel and the reference do the latter): the same
product up to rounding, fewer multiplies. Accumulation over top-k is float32.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from tidal.kernels.cpu_moe import CpuPackedExperts, fused_experts_cpu
from tidal.kernels.onednn import (
    BATCH_HINT,
    pack_weight,
    packed_linear,
    prefers_packed,
    unpack_weight,
)

STRATEGIES = ("auto", "bmm", "grouped_mm", "loop", "onednn", "cpp")
# auto picks bmm (with more than one thread) while padding every expert to the busiest one
# at most doubles the rows and the busiest expert has at most BMM_MAX_ROWS rows.
MAX_BMM_PADDING = 2.0
BMM_MAX_ROWS = 128


def fused_experts_torch(
    hidden: Tensor,  # [T, H]
    w13: Tensor,  # [E_local, 2I, H]: gate rows, then up rows
    w2: Tensor,  # [E_local, H, I]
    topk_weights: Tensor,  # [T, K] float32
    topk_ids: Tensor,  # [T, K] int64 global ids
    expert_map: Tensor | None = None,  # [E_global] int32: global id -> local slot or -1
    apply_router_weight: bool = True,
    *,
    strategy: str = "auto",  # auto | bmm | grouped_mm | loop | onednn | cpp (tests pin each)
    # w13/w2 in onednn's or cpp's layout (a sole pack: then w13/w2 give only shapes)
    packed: PackedExperts | CpuPackedExperts | None = None,
) -> Tensor:  # [T, H], dtype of hidden
    num_tokens, top_k = topk_ids.shape
    num_local, two_i, hidden_size = w13.shape
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "auto" and packed is not None:
        strategy = "cpp" if isinstance(packed, CpuPackedExperts) else "onednn"
    if strategy == "onednn" and not isinstance(packed, PackedExperts):
        raise ValueError("strategy 'onednn' needs packed=PackedExperts(w13, w2)")
    if strategy == "cpp":
        if not isinstance(packed, CpuPackedExperts):
            raise ValueError("strategy 'cpp' needs packed=CpuPackedExperts(w13, w2)")
        out = fused_experts_cpu(
            _as(hidden, torch.float32),
            packed,
            topk_weights,
            topk_ids,
            expert_map,
            apply_router_weight,
        )
        return _as(out, hidden.dtype)
    out = torch.zeros((num_tokens, hidden_size), dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return _as(out, hidden.dtype)

    # Non-local slots get the sentinel num_local: they sort last and are cut off.
    slots = _local_slots(topk_ids.reshape(-1), expert_map, num_local)  # [T*K]
    counts_t = torch.bincount(slots, minlength=num_local + 1)  # [E_local + 1]
    counts = counts_t.tolist()
    num_valid = num_tokens * top_k - counts[num_local]
    if num_valid == 0:
        return _as(out, hidden.dtype)
    sorted_slots, order = torch.sort(slots, stable=True)
    order = order[:num_valid]  # [N] flat slot t*K+k, by expert
    token_idx = order // top_k  # [N]
    counts = counts[:num_local]
    weights = topk_weights.reshape(-1).index_select(0, order) if apply_router_weight else None

    strategy = _choose(strategy, counts, num_valid, hidden, two_i // 2)
    if strategy == "onednn":
        assert isinstance(packed, PackedExperts)
        x = hidden.index_select(0, token_idx)
        down = _onednn_experts(x, w13, w2, packed, weights, counts)
    elif strategy == "bmm":
        rows = _padded_rows(sorted_slots[:num_valid], counts_t[:num_local], max(counts))
        down = _bmm_experts(hidden.index_select(0, token_idx), w13, w2, weights, rows, counts)
    else:
        x = hidden.index_select(0, token_idx)
        down = _grouped_experts(x, w13, w2, weights, counts, strategy == "grouped_mm")
    out.index_add_(0, token_idx, _as(down, torch.float32))  # [N, H] summed per token
    return _as(out, hidden.dtype)


class PackedExperts:
    """oneDNN-prepacked copies of each local expert's two weight matrices, for the
    ``onednn`` strategy: one ``[2I, H]`` (gate and up) and one ``[H, I]`` (down) per slot,
    in the blocked layout oneDNN's GEMM reads at full speed.

    Why: on the CPUs measured (AMD EPYC, AVX-512) torch's float32 ``mm`` goes to MKL,
    which reaches 125-180 GFLOP/s on 2 cores at decode shapes; oneDNN with prepacked
    weights reaches 410-480 (``benchmarks/cpu_speed.py`` prints both), and the MoE block of
    the 1024-wide model runs 2.2x faster (see ``tidal/kernels/onednn.py``). When the layer's
    measured path is oneDNN it is the experts' only copy (``sole``: one copy of each weight): ``unpack``
    rebuilds the checkpoint layout (exactly, through the packed GEMM), and a write
    (``FusedMoE.write_weights``) packs it again. ``batch_hint``: the row count
    oneDNN tunes the layout for."""

    def __init__(
        self, w13: Tensor, w2: Tensor, batch_hint: int = BATCH_HINT, *, sole: bool = False
    ) -> None:
        self.w13 = [pack_weight(w13[e], batch_hint) for e in range(w13.shape[0])]
        self.w2 = [pack_weight(w2[e], batch_hint) for e in range(w2.shape[0])]
        self.shapes = (tuple(w13.shape), tuple(w2.shape))
        # The only copy (one copy per weight): every GEMM reads the pack, never
        # ``w13``/``w2`` (then shape stand-ins), even where MKL would be cheaper.
        self.sole = sole

    def unpack(self, slots: list[int] | None = None) -> tuple[Tensor, Tensor]:
        """``(w13 [S, 2I, H], w2 [S, H, I])`` of the local ``slots`` (None: all) rebuilt
        from the packs (exact, ``unpack_weight``), with ``k_major_experts``' storage."""
        return self.unpack_w13(slots), self.unpack_w2(slots)

    def unpack_w13(self, slots: list[int] | None = None) -> Tensor:  # [S, 2I, H]
        (num, two_i, hidden), _ = self.shapes
        idx = range(num) if slots is None else slots
        return _stack_k_major([unpack_weight(self.w13[e], hidden) for e in idx], two_i, hidden)

    def unpack_w2(self, slots: list[int] | None = None) -> Tensor:  # [S, H, I]
        _, (num, hidden, inter) = self.shapes
        idx = range(num) if slots is None else slots
        return _stack_k_major([unpack_weight(self.w2[e], inter) for e in idx], hidden, inter)


def _stack_k_major(mats: list[Tensor], rows: int, cols: int) -> Tensor:  # [S, rows, cols]
    """K-major ``[S, rows, cols]`` of ``mats``; S may be 0 (a transfer that keeps none of
    a worker's experts)."""
    if not mats:
        return torch.empty(0, cols, rows).transpose(1, 2)
    return _k_major_copy(torch.stack(mats))


def _onednn_experts(
    x: Tensor,  # [N, H] float32 rows sorted by expert
    w13: Tensor,  # [E, 2I, H] (the source of ``packed``)
    w2: Tensor,  # [E, H, I]
    packed: PackedExperts,
    weights: Tensor | None,  # [N] float32 router weight of each row
    counts: list[int],  # rows per expert
) -> Tensor:  # [N, H]
    """One GEMM per busy expert for gate/up, one SiLU-and-mul over all rows (a handful of
    ops instead of a handful per expert: at decode sizes the per-op cost is what is left
    besides the GEMMs), then one GEMM per busy expert for down. Each GEMM on the packed
    copy, except one row on a small expert, which MKL does cheaper (``prefers_packed``)."""
    spans = [(e, n) for e, n in enumerate(counts) if n]
    bounds = list(itertools.accumulate(n for _, n in spans))
    starts = [0, *bounds[:-1]]

    def gemm(rows: Tensor, e: int, w: Tensor, p: list[Tensor]) -> Tensor:
        if packed.sole or prefers_packed(rows.shape[0], w[e]):
            return packed_linear(rows, p[e])
        return F.linear(rows, w[e])

    gate_up = torch.cat(
        [gemm(x[s : s + n], e, w13, packed.w13) for (e, n), s in zip(spans, starts)]
    )  # [N, 2I]
    act = _swiglu(gate_up, weights)  # [N, I]
    return torch.cat(
        [gemm(act[s : s + n], e, w2, packed.w2) for (e, n), s in zip(spans, starts)]
    )  # [N, H]


def _choose(strategy: str, counts: list[int], num_valid: int, hidden: Tensor, inter: int) -> str:
    if strategy == "grouped_mm" and not _grouped_mm_ok(hidden, inter):
        raise ValueError("grouped_mm needs torch.nn.functional.grouped_mm and 16-byte strides")
    if strategy != "auto":
        return strategy
    if 2 * sum(1 for n in counts if n) <= len(counts):
        return "loop"  # few busy experts (small batches): only they cost anything
    capacity = max(counts)
    small = capacity <= BMM_MAX_ROWS and len(counts) * capacity <= MAX_BMM_PADDING * num_valid
    if small and torch.get_num_threads() > 1:
        return "bmm"
    return "grouped_mm" if _grouped_mm_ok(hidden, inter) else "loop"


def _swiglu(gate_up: Tensor, weights: Tensor | None) -> Tensor:  # [..., 2I] -> [..., I]
    inter = gate_up.shape[-1] // 2
    act = F.silu(gate_up[..., :inter]).mul_(gate_up[..., inter:])
    if weights is not None:  # router weight on the I-wide activation, before down
        act.mul_(_as(weights, act.dtype).unsqueeze(-1))
    return act


def _grouped_experts(
    x: Tensor,  # [N, H] rows sorted by expert
    w13: Tensor,  # [E, 2I, H]
    w2: Tensor,  # [E, H, I]
    weights: Tensor | None,  # [N] float32 router weight of each row
    counts: list[int],  # rows per expert
    grouped: bool,  # grouped_mm (one call) or a loop over busy experts
) -> Tensor:  # [N, H]
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, H, 2I], [E, I, H]
    if grouped:
        offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=x.device)
        act = _swiglu(F.grouped_mm(x, w13_t, offs=offs), weights)
        return F.grouped_mm(act, w2_t, offs=offs)
    act = _swiglu(_looped_mm(x, w13_t, counts), weights)
    return _looped_mm(act, w2_t, counts)


def _padded_rows(
    sorted_slots: Tensor,  # [N] local expert of each sorted row, ascending
    counts: Tensor,  # [E] int64 rows per expert
    capacity: int,  # rows per expert after padding (the busiest expert's count)
) -> Tensor:  # [N] int64: row of each sorted row in the padded [E * capacity] layout
    starts = counts.cumsum(0) - counts  # [E] first sorted row of each expert
    rank = torch.arange(sorted_slots.shape[0], device=sorted_slots.device) - starts[sorted_slots]
    return sorted_slots * capacity + rank


def _bmm_experts(
    x: Tensor,  # [N, H] rows sorted by expert
    w13: Tensor,  # [E, 2I, H]
    w2: Tensor,  # [E, H, I]
    weights: Tensor | None,  # [N] float32
    rows: Tensor,  # [N] int64 row in the padded layout (from _padded_rows)
    counts: list[int],  # rows per expert
) -> Tensor:  # [N, H]
    """Every expert padded to the same row count, two ``bmm`` calls. Padding rows are
    zero, so their activations are silu(0) * 0 = 0 and they are never read back."""
    num_experts, capacity = w13.shape[0], max(counts)
    padded = x.new_zeros((num_experts * capacity, x.shape[1])).index_copy_(0, rows, x)
    gate_up = torch.bmm(padded.view(num_experts, capacity, -1), w13.transpose(1, 2))
    pad_weights = None
    if weights is not None:
        pad_weights = weights.new_zeros(num_experts * capacity).index_copy_(0, rows, weights)
        pad_weights = pad_weights.view(num_experts, capacity)
    act = _swiglu(gate_up, pad_weights)  # [E, C, I]
    down = torch.bmm(act, w2.transpose(1, 2))  # [E, C, H]
    return down.view(num_experts * capacity, -1).index_select(0, rows)


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)`` without the call when it would be a no-op (hot path: every op counts)."""
    return t if t.dtype == dtype else t.to(dtype)


def k_major_experts(w13: Tensor, w2: Tensor) -> tuple[Tensor, Tensor]:
    """Copies of ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` with the same shapes and values but
    K-major storage (each expert's matrix stored transposed), the layout the GEMMs above
    read fastest. Assign them to the parameters' ``.data`` once, before serving."""
    return _k_major_copy(w13), _k_major_copy(w2)


def empty_k_major_experts(w13: Tensor, w2: Tensor) -> tuple[Tensor, Tensor]:
    """Uninitialised tensors shaped like ``w13``/``w2`` with ``k_major_experts``' storage,
    for weights about to be written (no copy of values nobody will read)."""
    return _empty_k_major(w13), _empty_k_major(w2)


def is_k_major(w: Tensor) -> bool:
    """Whether ``w [E, N, K]`` has the K-major storage of ``k_major_experts``."""
    return w.transpose(1, 2).is_contiguous()


def _empty_k_major(w: Tensor) -> Tensor:
    return torch.empty(
        (w.shape[0], w.shape[2], w.shape[1]), dtype=w.dtype, device=w.device
    ).transpose(1, 2)


def _k_major_copy(w: Tensor) -> Tensor:
    return _empty_k_major(w).copy_(w)


def _local_slots(
    flat_ids: Tensor,  # [N] int64 global ids
    expert_map: Tensor | None,  # [E_global] int32
    num_local: int,
) -> Tensor:  # [N] in [0, num_local]; num_local = not on this rank
    if expert_map is None:
        # No map: ids are local slots already; out-of-range ones still contribute zero.
        # clamp to [-1, num_local], then -1 -> num_local: two ops instead of four.
        return flat_ids.clamp(-1, num_local).remainder_(num_local + 1)
    slots = expert_map[flat_ids]  # int32, -1 = elsewhere
    return slots.masked_fill(slots < 0, num_local)


def _grouped_mm_ok(hidden: Tensor, inter: int) -> bool:
    """grouped_mm exists and the operands' row strides are multiples of 16 bytes."""
    if not hasattr(F, "grouped_mm") or hidden.device.type != "cpu":
        return False
    per_16_bytes = 16 // hidden.element_size()
    return hidden.shape[1] % per_16_bytes == 0 and inter % per_16_bytes == 0


def _looped_mm(
    x: Tensor,  # [N, K_in] rows sorted by expert
    weight_t: Tensor,  # [E, K_in, N_out]: each expert's weight, transposed
    counts: list[int],  # rows per expert, sum == N
) -> Tensor:  # [N, N_out]
    """One matmul per non-empty expert, written into one output. ``split``/``unbind``
    make all the views in one call each (cheaper than slicing per expert in Python)."""
    out = x.new_empty((x.shape[0], weight_t.shape[2]))
    xs, outs = x.split_with_sizes(counts), out.split_with_sizes(counts)
    for x_e, w_e, out_e, n in zip(xs, weight_t.unbind(0), outs, counts):
        if n:
            torch.mm(x_e, w_e, out=out_e)
    return out
