"""The MoE oracle: a plain loop over local experts that every fast path is tested against.

Shared signature of every expert backend (``tidal.moe.layer.EXPERT_BACKENDS``)::

    fn(hidden [T, H], w13 [E_local, 2I, H], w2 [E_local, H, I],
       topk_weights [T, K] float32, topk_ids [T, K] int64 (global ids),
       expert_map [E_global] int32 | None, apply_router_weight: bool) -> [T, H]

``w13`` holds each expert's gate rows then its up rows. ``expert_map`` maps a global
expert id to its local slot, or -1 when the expert lives on another rank; without a map
global id == local slot. Slots whose expert is not local (or out of range) contribute
zero, so summing the outputs of all ranks gives the full MoE output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def local_slots(
    topk_ids: Tensor,  # [T, K] int64 global ids
    expert_map: Tensor | None,  # [E_global] int32
    num_local_experts: int,
) -> Tensor:  # [T, K] int64, local slot or -1
    """Global expert ids -> local slots, -1 where the expert is not on this rank."""
    if expert_map is not None:
        slots = expert_map.to(torch.int64)[topk_ids]
    else:
        slots = topk_ids
    out_of_range = (slots < 0) | (slots >= num_local_experts)
    return slots.masked_fill(out_of_range, -1)


def fused_experts_reference(
    hidden: Tensor,  # [T, H]
    w13: Tensor,  # [E_local, 2I, H]
    w2: Tensor,  # [E_local, H, I]
    topk_weights: Tensor,  # [T, K] float32
    topk_ids: Tensor,  # [T, K] int64 global ids
    expert_map: Tensor | None = None,  # [E_global] int32
    apply_router_weight: bool = True,
) -> Tensor:  # [T, H], dtype of hidden
    num_local, two_i, _ = w13.shape
    inter = two_i // 2
    slots = local_slots(topk_ids, expert_map, num_local)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in range(num_local):
        token_idx, k_idx = torch.nonzero(slots == e, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        x = hidden[token_idx]
        gate = F.linear(x, w13[e, :inter])
        up = F.linear(x, w13[e, inter:])
        y = F.linear(F.silu(gate) * up, w2[e]).float()
        if apply_router_weight:
            y = y * topk_weights[token_idx, k_idx].unsqueeze(-1)
        out.index_add_(0, token_idx, y)
    return out.to(hidden.dtype)
