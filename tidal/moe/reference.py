"""The MoE oracles: a plain loop over local experts that every fast expert path is tested
against, and ``route_reference``, a per-token loop over a routing rule's definition that
every router path (``tidal/moe/router.py``'s ``route`` and the fast ones) is tested
against.

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

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tidal.moe.router import Routing, Scoring


def route_reference(
    router_logits: Tensor,  # [T, E]
    routing: Routing,
    correction_bias: Tensor | None = None,  # [E]
) -> tuple[Tensor, Tensor]:  # ([T, K] float32, [T, K] int64), ids in choice order
    """Token by token: score every expert (softmax over all, or each one's sigmoid); score
    each group of ``E / num_groups`` experts by its best (biased) score, or with a bias the
    sum of its two best; keep the best ``topk_group`` groups; take the ``top_k`` best
    (biased) experts in them; weigh each by its unbiased score, renormalise, scale."""
    logits = router_logits.double()
    num_tokens, num_experts = logits.shape
    size = num_experts // routing.num_groups
    bias = [0.0] * num_experts if correction_bias is None else correction_bias.tolist()
    all_w, all_ids = [], []
    for t in range(num_tokens):
        row = logits[t].tolist()
        if routing.scoring is Scoring.SOFTMAX:
            top = max(row)
            exp = [math.exp(x - top) for x in row]
            scores = [e / sum(exp) for e in exp]
        else:
            scores = [1.0 / (1.0 + math.exp(-x)) for x in row]
        choice = [s + b for s, b in zip(scores, bias)]
        group_score = []
        for g in range(routing.num_groups):
            best = sorted(choice[g * size : (g + 1) * size], reverse=True)
            group_score.append(sum(best[:2]) if correction_bias is not None else best[0])
        groups = sorted(range(routing.num_groups), key=lambda g: -group_score[g])
        kept = [e for e in range(num_experts) if e // size in groups[: routing.topk_group]]
        ids = sorted(kept, key=lambda e: -choice[e])[: routing.top_k]
        w = [scores[e] for e in ids]
        if routing.renormalize:
            w = [x / sum(w) for x in w]
        all_w.append([x * routing.scaling_factor for x in w])
        all_ids.append(ids)
    weights = torch.tensor(all_w, dtype=torch.float32).reshape(num_tokens, routing.top_k)
    return weights, torch.tensor(all_ids, dtype=torch.int64).reshape(num_tokens, routing.top_k)


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


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation: ``gate`` clamped above at ``limit``, ``up`` to
    ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    alpha: float
    limit: float

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def biased_experts(
    hidden: Tensor,  # [T, H]
    w13: Tensor,  # [E_local, 2I, H] gate rows, then up rows
    w2: Tensor,  # [E_local, H, I]
    b13: Tensor,  # [E_local, 2I]
    b2: Tensor,  # [E_local, H]
    topk_weights: Tensor,  # [T, K] float32
    topk_ids: Tensor,  # [T, K] int64 global ids
    expert_map: Tensor | None,  # [E_global] int32
    activation: ClampedSwiGLU | None,  # None: silu(gate) * up
) -> Tensor:  # [T, H]
    """Experts with biases on both projections (GPT-OSS): one expert at a time over the
    tokens routed to it, weighted by the router. The reference for such experts (the C++
    fused MoE computes them too, ``cpu_moe.ExpertExtras``), tested against transformers'
    experts."""
    inter = w2.shape[2]
    slots = local_slots(topk_ids, expert_map, w13.shape[0])
    out = torch.zeros_like(hidden)
    for s in torch.unique(slots[slots >= 0]).tolist():
        tok, pos = torch.where(slots == s)
        gate_up = F.linear(hidden[tok], w13[s], b13[s])  # [n, 2I]
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        act = F.silu(gate) * up if activation is None else activation(gate, up)
        y = F.linear(act, w2[s], b2[s]) * topk_weights[tok, pos, None].to(hidden.dtype)
        out.index_add_(0, tok, y)
    return out
