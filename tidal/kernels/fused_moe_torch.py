"""CPU fast path of the fused MoE experts: the same algorithm as the Triton kernel in torch.

``fused_experts_torch`` has the shared expert-backend signature (see
``tidal/moe/reference.py``). Token slots (token t, choice k) are sorted by local expert
so each expert's rows are contiguous; then one grouped GEMM for gate/up over all
experts, SiLU-and-mul, one grouped GEMM for down, router weighting, and an
``index_add_`` back to the tokens. The grouped GEMMs are ``torch.nn.functional.grouped_mm``
(one call, no per-expert Python) when this torch has it, the shapes meet its 16-byte
stride rule and most experts have tokens; otherwise a loop over the non-empty experts.

Slots whose expert is not local (expert map -1, or id out of range) sort after every
local expert and are dropped before the GEMMs, so they cost nothing and contribute zero.
The router weight scales the I-wide activation before the down GEMM rather than the
H-wide output after it (the Triton kernel and the reference do the latter): the same
product up to rounding, fewer multiplies. Accumulation over top-k is float32.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

STRATEGIES = ("auto", "grouped_mm", "loop")


def fused_experts_torch(
    hidden: Tensor,  # [T, H]
    w13: Tensor,  # [E_local, 2I, H]: gate rows, then up rows
    w2: Tensor,  # [E_local, H, I]
    topk_weights: Tensor,  # [T, K] float32
    topk_ids: Tensor,  # [T, K] int64 global ids
    expert_map: Tensor | None = None,  # [E_global] int32: global id -> local slot or -1
    apply_router_weight: bool = True,
    *,
    strategy: str = "auto",  # auto | grouped_mm | loop (tests pin each one)
) -> Tensor:  # [T, H], dtype of hidden
    num_tokens, top_k = topk_ids.shape
    num_local, two_i, hidden_size = w13.shape
    inter = two_i // 2
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    out = torch.zeros((num_tokens, hidden_size), dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return out.to(hidden.dtype)

    # Non-local slots get the sentinel num_local: they sort last and are cut off.
    slots = _local_slots(topk_ids.reshape(-1), expert_map, num_local)  # [T*K]
    counts = torch.bincount(slots, minlength=num_local + 1).tolist()  # [E_local + 1]
    num_valid = num_tokens * top_k - counts[num_local]
    if num_valid == 0:
        return out.to(hidden.dtype)
    order = torch.argsort(slots, stable=True)[:num_valid]  # [N] flat slot t*K+k, by expert
    token_idx = order // top_k  # [N]
    counts = counts[:num_local]

    use_grouped = strategy == "grouped_mm" or (
        strategy == "auto" and _grouped_mm_ok(hidden, inter) and _mostly_busy(counts)
    )
    if use_grouped:
        offs = torch.tensor(
            list(itertools.accumulate(counts)), dtype=torch.int32, device=hidden.device
        )
        linear = functools.partial(_grouped_linear, offs=offs)
    else:
        linear = functools.partial(_looped_linear, counts=counts)
    gate_up = linear(hidden.index_select(0, token_idx), w13)  # [N, 2I]
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [N, I]
    if apply_router_weight:
        act = act * topk_weights.reshape(-1).index_select(0, order).unsqueeze(1).to(act.dtype)
    out.index_add_(0, token_idx, linear(act, w2).float())  # [N, H] summed per token
    return out.to(hidden.dtype)


def _local_slots(
    flat_ids: Tensor,  # [N] int64 global ids
    expert_map: Tensor | None,  # [E_global] int32
    num_local: int,
) -> Tensor:  # [N] in [0, num_local]; num_local = not on this rank
    if expert_map is None:
        # No map: ids are local slots already; out-of-range ones still contribute zero.
        return flat_ids.masked_fill((flat_ids < 0) | (flat_ids >= num_local), num_local)
    slots = expert_map[flat_ids]  # int32, -1 = elsewhere
    return slots.masked_fill(slots < 0, num_local)


def _mostly_busy(counts: list[int]) -> bool:
    """CPU grouped_mm visits every expert, empty or not; with few busy experts (small
    batches) the loop over busy experts only is cheaper."""
    return 2 * sum(1 for n in counts if n) > len(counts)


def _grouped_mm_ok(hidden: Tensor, inter: int) -> bool:
    """grouped_mm exists and the operands' row strides are multiples of 16 bytes."""
    if not hasattr(F, "grouped_mm") or hidden.device.type != "cpu":
        return False
    per_16_bytes = 16 // hidden.element_size()
    return hidden.shape[1] % per_16_bytes == 0 and inter % per_16_bytes == 0


def _grouped_linear(
    x: Tensor,  # [N, K_in] rows sorted by expert
    weight: Tensor,  # [E, N_out, K_in]
    offs: Tensor,  # [E] int32 end row of each expert's rows
) -> Tensor:  # [N, N_out]
    return F.grouped_mm(x, weight.transpose(1, 2), offs=offs)


def _looped_linear(x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:  # [N, N_out]
    """One matmul per non-empty expert, written into one output."""
    out = x.new_empty((x.shape[0], weight.shape[1]))
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(x[start : start + n], weight[e].t(), out=out[start : start + n])
            start += n
    return out
