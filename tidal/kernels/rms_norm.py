# pyright: reportArgumentType=false, reportCallIssue=false
# (triton.jit signatures type launch constants as tl.constexpr and omit num_warps/num_stages)
"""RMSNorm in one Triton launch (GPU; CPU tests run it under ``TRITON_INTERPRET=1``),
with transformers' roundings (``Qwen3RMSNorm``)::

    xf = x.float(); y = xf * rsqrt(mean(xf^2) + eps)   # float32
    out = weight * y.to(x.dtype)                        # the product in x's dtype

Why: torch's ``F.rms_norm`` and the 16-bit formula are 5-7 launches a call (cast, pow,
mean, add, rsqrt, mul, cast, mul); a decoder layer calls it 2-4 times (input and
post-attention norms, Q/K norms). The product of two 16-bit values is exact in float32,
so rounding it once to x's dtype is the 16-bit multiply bit for bit; only the order of
the sum of squares differs from torch's (an ulp of the statistic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [A, B, D] rows (a, b), last dim contiguous
    w_ptr,  # [D] x's dtype (read only with HAS_WEIGHT)
    out_ptr,  # [A * B, D] contiguous
    inner,  # B
    dim,
    stride_a,
    stride_b,
    eps,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    src = x_ptr + (row // inner) * stride_a + (row % inner) * stride_b
    x = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    # transformers rounds the normalised row to x's dtype before the weight.
    y = (x * rstd).to(out_ptr.dtype.element_ty)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * dim + cols, y, mask=mask)


def _interpreted() -> bool:
    return not isinstance(_rms_norm_kernel, JITFunction)


def rms_norm_triton(
    x: Tensor,  # [..., D] NORM_DTYPES, last dim contiguous, CUDA (or interpreted)
    weight: Tensor | None,  # [D] x's dtype, or None: normalise only
    eps: float,
) -> Tensor:  # [..., D] x's dtype, a new contiguous tensor
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` with float32 statistics and, for
    16-bit x, the normalised row rounded to x's dtype before the weight (as
    ``tidal.layers.norm._rms_norm_hf``, the reference)."""
    if x.dim() < 1 or x.dtype not in NORM_DTYPES:
        raise TypeError(
            f"x must be [..., D] float32/float16/bfloat16, got {x.dtype} {tuple(x.shape)}"
        )
    dim = x.shape[-1]
    if weight is not None and (
        weight.shape != (dim,) or weight.dtype != x.dtype or weight.device != x.device
    ):
        raise ValueError(
            f"weight must be [{dim}] {x.dtype} on {x.device}, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous along its last dim")
    if x.device.type != "cuda" and not _interpreted():
        raise RuntimeError(
            "the Triton RMSNorm needs CUDA tensors (or TRITON_INTERPRET=1 set before triton "
            "is imported); on CPU use tidal.kernels.cpu_norm or tidal.layers.norm"
        )
    # Rows (a, b) of [A, B, D] with their own strides: 2-D rows and 3-D [T, heads, Dh]
    # slices of a wider tensor (Q/K norm over the q|k heads of qkv) are read in place.
    shape = x.shape
    match x.dim():
        case 1:
            outer, inner, stride_a, stride_b = 1, 1, dim, 0
        case 2:
            outer, inner, stride_a, stride_b = x.shape[0], 1, x.stride(0), 0
        case 3:
            outer, inner, stride_a, stride_b = x.shape[0], x.shape[1], x.stride(0), x.stride(1)
        case _:  # rare: one copy at most
            x = x.reshape(-1, dim)
            outer, inner, stride_a, stride_b = x.shape[0], 1, x.stride(0), 0
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if outer * inner and dim:
        _rms_norm_kernel[(outer * inner,)](
            x, weight if weight is not None else x, out, inner, dim, stride_a, stride_b, eps,
            HAS_WEIGHT=weight is not None, BLOCK_D=triton.next_power_of_2(dim),
            # one row a program: wide rows (4K-8K hidden) spread over more threads
            num_warps=max(1, min(16, triton.next_power_of_2(dim) // 512)),
        )  # fmt: skip
    return out
