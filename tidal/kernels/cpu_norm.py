"""RMSNorm for float32 on CPU in one C++ pass per row (``csrc/norm_cpu.cpp``), one wrapper.

Why: torch's ``F.rms_norm`` on CPU is a chain of 5-6 ops: ~7 us for one 1024-wide row and
~26-50 us for 32, where this takes ~2 and ~5. A model calls it 2-3 times a layer, so at
decode sizes it was a visible share of the step. ``F.rms_norm`` stays the
reference and the fallback; the two differ by the order of the sum of squares (an ulp).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.kernels.cpu_ext import kernel_available


def rms_norm_cpu_ok(x: Tensor) -> bool:
    """Whether ``rms_norm_cpu`` takes ``x``: float32 on CPU, the extension loaded."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and kernel_available()


def rms_norm_cpu(
    x: Tensor,  # [..., D] float32 CPU
    weight: Tensor | None,  # [D] float32, or None: normalise only
    eps: float,
) -> Tensor:  # [..., D] float32, a new tensor
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))``, transformers' float32 formula."""
    return torch.ops.tidal_cpu.rms_norm(x, weight, eps)
