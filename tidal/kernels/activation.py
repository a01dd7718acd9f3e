# pyright: reportArgumentType=false, reportCallIssue=false
# (triton.jit signatures type launch constants as tl.constexpr and omit num_warps/num_stages)
"""SiLU-and-mul: ``out = silu(x[:, :I]) * x[:, I:]`` for the gate/up halves of a GEMM."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [M, 2 * I]
    out_ptr,  # [M, I]
    inter,  # I
    stride_xm,
    stride_om,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    # fp32 math whatever the storage dtype: silu of a half is too coarse near 0.
    gate = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xm + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_om + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``x`` [M, 2*I] -> [M, I] of the same dtype (into ``out`` when given)."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [M, 2*I], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along its last dim")
    rows, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    elif out.shape != (rows, inter) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be [{rows}, {inter}] {x.dtype} on {x.device}")
    elif out.stride(1) != 1:
        raise ValueError("out must be contiguous along its last dim")
    if rows == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x, out, inter, x.stride(0), out.stride(0), BLOCK=block)
    return out


def silu_and_mul_reference(x: Tensor) -> Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
