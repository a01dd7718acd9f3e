"""RMSNorm on CPU in one C++ pass per row (``csrc/norm_cpu.cpp``), one wrapper: float32,
and bfloat16 / float16 rows with float32 math and transformers' roundings.

Why: torch's ``F.rms_norm`` on CPU is a chain of 5-6 ops: ~7 us for one 1024-wide row and
~26-50 us for 32, where this takes ~2 and ~5. A model calls it 2-3 times a layer, so at
decode sizes it was a visible share of the step. ``F.rms_norm`` stays the
reference and the fallback; the two differ by the order of the sum of squares (an ulp).
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
