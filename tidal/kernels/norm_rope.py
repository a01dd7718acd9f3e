# pyright: reportArgumentType=false, reportCallIssue=false
# (triton.jit signatures type launch constants as tl.constexpr and omit num_warps/num_stages)
"""Q/K norm and rotary embedding of the q|k heads in one Triton launch (GPU; CPU tests
run it under ``TRITON_INTERPRET=1``).

Per head row ``x [Dh]`` of token t, as transformers computes it in x's dtype::

    y = w * (x * rsqrt(mean(x^2) + eps)).to(dtype)     # optional per-head RMSNorm
    out[:R] = y[:R] * cos[t] + rotate_half(y[:R]) * sin[t]   # R = rotary dims
    out[R:] = y[R:]

with float32 statistics and every product and the sum rounded to x's dtype, as the
separate 16-bit ops round them. ``signed_sin`` carries rotate_half's sign
(``tidal/layers/rotary.py``), so ``rotate_half(y) * sin = roll(y, R/2) * signed_sin``.

Why: the torch path is 7 launches a layer (norm, two weight multiplies, then mul, roll,
mul, add), each reading and writing the q|k heads; this reads them once. Heads before
``split`` take the first weight (q_norm), the others the second (k_norm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _norm_rope_kernel(
    x_ptr,  # [T, H, Dh] last dim contiguous
    w1_ptr,  # [Dh] weight of heads < split (read only with NORM)
    w2_ptr,  # [Dh] weight of heads >= split
    cos_ptr,  # [T, R] (rows strided)
    sin_ptr,  # [T, R] signed sin
    out_ptr,  # [T, H, Dh] contiguous
    num_heads,
    split,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    eps,
    DH: tl.constexpr,
    ROT: tl.constexpr,  # R, even
    NORM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < DH
    rot_mask = d < ROT
    half = ROT // 2
    partner = tl.where(d < half, d + half, d - half)  # rotate_half's source, d < R
    row = x_ptr + t * stride_xt + h * stride_xh
    x = tl.load(row + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + partner, mask=rot_mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / DH + eps)
        first = h < split  # q_norm's weight, else k_norm's (both rows are tiny, cached)
        w = tl.where(
            first,
            tl.load(w1_ptr + d, mask=mask, other=0.0),
            tl.load(w2_ptr + d, mask=mask, other=0.0),
        ).to(tl.float32)
        wp = tl.where(
            first,
            tl.load(w1_ptr + partner, mask=rot_mask, other=0.0),
            tl.load(w2_ptr + partner, mask=rot_mask, other=0.0),
        ).to(tl.float32)
        # The normalised row rounded, then the weight's product rounded: two roundings.
        x = (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        xp = (wp * (xp * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=rot_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=rot_mask, other=0.0).to(tl.float32)
    rotated = (x * c).to(dtype).to(tl.float32) + (xp * s).to(dtype).to(tl.float32)
    out = tl.where(rot_mask, rotated, x)
    tl.store(out_ptr + (t * num_heads + h) * DH + d, out.to(dtype), mask=mask)


def _interpreted() -> bool:
    return not isinstance(_norm_rope_kernel, JITFunction)


def norm_rope(
    x: Tensor,  # [T, H, Dh] DTYPES, last dim contiguous (rows and heads may be strided)
    cos: Tensor,  # [T, 1, R] x's dtype (RotaryEmbedding.cos_sin), R even, R <= Dh
    signed_sin: Tensor,  # [T, 1, R] x's dtype
    weights: tuple[Tensor, Tensor] | None,  # ([Dh], [Dh]) x's dtype; None: no norm
    split: int,  # heads before it take weights[0], the rest weights[1]
    eps: float,
) -> Tensor:  # [T, H, Dh] x's dtype, a new contiguous tensor
    """Optional per-head RMSNorm (two head groups, one weight each), then the rotary
    embedding on the first R dims of every head, in one launch of grid ``[T, H]``
    (see the module docstring for the roundings)."""
    if x.dim() != 3 or x.dtype not in DTYPES:
        raise TypeError(
            f"x must be [T, H, Dh] float32/float16/bfloat16, got {x.dtype} {tuple(x.shape)}"
        )
    tokens, heads, dh = x.shape
    rot = cos.shape[-1]
    for name, table in (("cos", cos), ("signed_sin", signed_sin)):
        if table.shape != (tokens, 1, rot) or table.dtype != x.dtype or table.stride(2) != 1:
            raise ValueError(
                f"{name} must be [{tokens}, 1, R] {x.dtype}, last dim contiguous, got "
                f"{tuple(table.shape)} {table.dtype}"
            )
    if rot % 2 or not 0 < rot <= dh:
        raise ValueError(f"rotary dims must be even and in (0, {dh}], got {rot}")
    if weights is not None:
        for w in weights:
            if w.shape != (dh,) or w.dtype != x.dtype or w.device != x.device:
                raise ValueError(
                    f"norm weights must be [{dh}] {x.dtype} on {x.device}, got {tuple(w.shape)} {w.dtype}"
                )
    if not 0 <= split <= heads:
        raise ValueError(f"split must be in [0, {heads}], got {split}")
    if x.stride(2) != 1:
        raise ValueError("x must be contiguous along its last dim")
    for name, tensor in (("cos", cos), ("signed_sin", signed_sin)):
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}")
    if x.device.type != "cuda" and not _interpreted():
        raise RuntimeError(
            "the Triton norm + rotary needs CUDA tensors (or TRITON_INTERPRET=1 set before "
            "triton is imported); on CPU use tidal.layers.norm and tidal.layers.rotary"
        )
    out = torch.empty((tokens, heads, dh), dtype=x.dtype, device=x.device)
    if tokens == 0 or heads == 0:
        return out
    w1, w2 = weights if weights is not None else (x, x)  # not read without a norm
    _norm_rope_kernel[(tokens, heads)](
        x, w1, w2, cos, signed_sin, out, heads, split,
        x.stride(0), x.stride(1), cos.stride(0), signed_sin.stride(0), eps,
        DH=dh, ROT=rot, NORM=weights is not None, BLOCK_D=triton.next_power_of_2(dh),
    )  # fmt: skip
    return out
