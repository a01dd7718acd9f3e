# pyright: reportArgumentType=false, reportCallIssue=false
# (triton.jit signatures type launch constants as tl.constexpr; tl tensors index as x[:, None])
"""Fused router: softmax over expert logits, top-k, optional renormalisation.

``weights = softmax(logits)[ids]`` with ``ids`` the ``top_k`` largest probabilities of a
row (ties -> the lower expert id); with ``renormalize`` the k weights are divided by
their sum (Qwen3 ``norm_topk_prob``; Mixtral's "top-k, then softmax over the k" is the
same thing). Math in fp32 whatever the logits dtype.

Only this rule (``Routing.plain_softmax`` in ``tidal/moe/router.py``): sigmoid scores,
correction biases and group-limited choice are computed by ``tidal/moe/router.py``'s
``route`` in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, top_k] float32 out
    ids_ptr,  # [T, top_k] int64 out
    num_tokens,
    num_experts,
    stride_lt,
    top_k,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < num_tokens
    col_mask = cols < num_experts
    mask = row_mask[:, None] & col_mask[None, :]
    logits = tl.load(
        logits_ptr + rows[:, None] * stride_lt + cols[None, :], mask=mask, other=-float("inf")
    ).to(tl.float32)
    # Fully masked (padding) rows would give 0/0: give them a finite max.
    row_max = tl.where(row_mask, tl.max(logits, axis=1), 0.0)
    exp = tl.where(mask, tl.exp(logits - row_max[:, None]), 0.0)
    probs = exp / tl.maximum(tl.sum(exp, axis=1), 1e-30)[:, None]
    # Masked lanes sit below every real probability (>= 0) so they are never picked.
    probs = tl.where(col_mask[None, :], probs, -1.0)

    # The k picks are gathered in registers and stored once, after renormalising.
    ks = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_id = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for k in range(0, top_k):
        best = tl.max(probs, axis=1)
        # Lowest id among the maxima: deterministic ties.
        best_id = tl.min(tl.where(probs == best[:, None], cols[None, :], BLOCK_E), axis=1)
        top_w = tl.where(ks[None, :] == k, best[:, None], top_w)
        top_id = tl.where(ks[None, :] == k, best_id[:, None], top_id)
        probs = tl.where(cols[None, :] == best_id[:, None], -2.0, probs)
    if RENORMALIZE:
        top_w = top_w / tl.maximum(tl.sum(top_w, axis=1), 1e-20)[:, None]
    out = rows[:, None] * top_k + ks[None, :]
    out_mask = row_mask[:, None] & (ks[None, :] < top_k)
    tl.store(weights_ptr + out, top_w, mask=out_mask)
    tl.store(ids_ptr + out, top_id.to(tl.int64), mask=out_mask)


def topk_softmax(
    logits: Tensor,  # [T, E] float32/float16/bfloat16
    top_k: int,
    renormalize: bool,
) -> tuple[Tensor, Tensor]:  # weights [T, top_k] float32, ids [T, top_k] int64
    """Top-k of the softmax of router logits, fused in one launch."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits must be float32/float16/bfloat16, got {logits.dtype}")
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the expert dim")
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}], got {top_k}")
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(experts)
    # Several rows per program when rows are short; keeps tiles ~4K elements.
    block_t = max(1, min(16, 4096 // block_e, triton.next_power_of_2(tokens)))
    _topk_softmax_kernel[(triton.cdiv(tokens, block_t),)](
        logits, weights, ids, tokens, experts, logits.stride(0), top_k,
        RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=max(2, triton.next_power_of_2(top_k)),
    )  # fmt: skip
    return weights, ids


def topk_softmax_reference(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
