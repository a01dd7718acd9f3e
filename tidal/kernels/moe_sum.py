# pyright: reportArgumentType=false, reportCallIssue=false
# (triton.jit signatures type launch constants as tl.constexpr and omit num_warps/num_stages)
"""Top-k sum: ``out[t] = sum_k x[t, k]`` over the per-slot expert outputs, in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _moe_sum_kernel(
    x_ptr,  # [T, top_k, H] contiguous
    out_ptr,  # [T, H] contiguous
    hidden,
    top_k,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_ptr = x_ptr + token * top_k * hidden + cols
    for _ in range(0, top_k):
        acc += tl.load(row_ptr, mask=mask, other=0.0).to(tl.float32)
        row_ptr += hidden
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``x`` [T, top_k, H] -> [T, H] of the same dtype (into ``out`` when given)."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, top_k, H], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    tokens, top_k, hidden = x.shape
    if out is None:
        out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    elif out.shape != (tokens, hidden) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be [{tokens}, {hidden}] {x.dtype} on {x.device}")
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if tokens == 0 or hidden == 0:
        return out
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(tokens, triton.cdiv(hidden, block))](x, out, hidden, top_k, BLOCK_H=block)
    return out


def moe_sum_reference(x: Tensor) -> Tensor:
    return x.float().sum(dim=1).to(x.dtype)
