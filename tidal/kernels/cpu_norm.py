"""RMSNorm on CPU in one C++ pass per row (``csrc/norm_cpu.cpp``): float32, and bfloat16 /
float16 rows with float32 math and transformers' roundings. Three checked wrappers: the
norm, the residual add fused before it, and the per-head Q/K norm fused with the rotary
embedding (which also serves the rotary alone).

Why: torch's ``F.rms_norm`` on CPU is a chain of 5-6 ops: ~7 us for one 1024-wide row and
~26-50 us for 32, where this takes ~2 and ~5. A model calls it 2-3 times a layer, so at
decode sizes it was a visible share of the step. ``F.rms_norm`` stays the
reference and the fallback; the two differ by the order of the sum of squares (an ulp).
The fused two replace 2 and 7-9 small ops (``x + delta`` then the norm; norm, two weight
products, then mul, roll, mul, add): at batch-1 decode on 2 cores the ops' overhead, not
their bytes, was the cost. They are bit for bit the C++ norm and the torch ops they
replace, in every dtype (each product and sum rounded where torch rounds it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.kernels.cpu_ext import kernel_available

# What the C++ RMSNorm reads and writes (x, its weight and the output share one).
NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_cpu_ok(x: Tensor, weight: Tensor | None = None) -> bool:
    """Whether ``rms_norm_cpu`` takes ``x`` (and ``weight``): a ``NORM_DTYPES`` dtype on CPU,
    the weight of x's dtype, the extension loaded."""
    return (
        x.dtype in NORM_DTYPES
        and (weight is None or weight.dtype == x.dtype)
        and x.device.type == "cpu"
        and kernel_available()
    )


def rms_norm_cpu(
    x: Tensor,  # [..., D] NORM_DTYPES, CPU
    weight: Tensor | None,  # [D] x's dtype, or None: normalise only
    eps: float,
) -> Tensor:  # [..., D] x's dtype, a new tensor
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))``, transformers' formula: in float32,
    for 16-bit x the normalised row rounded to x's dtype before the weight (as
    ``tidal.layers.norm._rms_norm_hf``)."""
    return torch.ops.tidal_cpu.rms_norm(x, weight, eps)


def add_rms_norm_cpu(
    x: Tensor,  # [..., D] NORM_DTYPES, CPU (the residual stream)
    delta: Tensor,  # x's shape and dtype (a sublayer's output)
    weight: Tensor,  # [D] x's dtype
    eps: float,
) -> tuple[Tensor, Tensor]:  # (x + delta, rms_norm_cpu(x + delta)), new tensors
    """The residual add and the norm of its result in one pass, bit for bit ``x + delta``
    (rounded to x's dtype, as torch rounds it) then ``rms_norm_cpu``."""
    return torch.ops.tidal_cpu.add_rms_norm(x, delta, weight, eps)


def norm_rope_cpu_ok(x: Tensor) -> bool:
    """Whether ``norm_rope_cpu`` takes ``x``: [T, H, Dh] of a ``NORM_DTYPES`` dtype on CPU,
    its last dimension contiguous, the extension loaded."""
    return (
        x.dtype in NORM_DTYPES
        and x.device.type == "cpu"
        and x.dim() == 3
        and x.stride(2) == 1
        and kernel_available()
    )


def norm_rope_cpu(
    x: Tensor,  # [T, H, Dh] last dim contiguous (rows and heads may be strided: q|k of qkv)
    cos: Tensor,  # [T, 1, R] x's dtype (RotaryEmbedding.cos_sin), R even, R <= Dh
    signed_sin: Tensor,  # [T, 1, R] x's dtype
    weights: tuple[Tensor, Tensor] | None = None,  # ([Dh], [Dh]) x's dtype; None: no norm
    split: int = 0,  # heads before it take weights[0] (q_norm), the rest weights[1]
    eps: float = 0.0,
) -> Tensor:  # [T, H, Dh] x's dtype, a new contiguous tensor
    """Optional per-head RMSNorm (``rms_norm_cpu`` of each head, then its group's weight
    multiplied in x's dtype), then the rotary embedding ``x * cos + roll(x, R / 2) *
    signed_sin`` on the first R dims of each head, the rest copied: bit for bit
    ``rms_norm_heads`` then ``apply_partial_rotary``'s torch expression."""
    wq, wk = weights if weights is not None else (None, None)
    return torch.ops.tidal_cpu.norm_rope(x, cos, signed_sin, wq, wk, split, eps)
