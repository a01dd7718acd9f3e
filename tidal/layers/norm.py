"""RMSNorm with transformers' numerics (normalise in float32, cast, then scale)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tidal.kernels.cpu_norm import rms_norm_cpu, rms_norm_cpu_ok


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype: Any = None, device: Any = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: Tensor) -> Tensor:  # [..., dim], normalised over the last dim
        if rms_norm_cpu_ok(x):  # one C++ pass (tidal/kernels/cpu_norm.py)
            return rms_norm_cpu(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            # One fused op; equal to the float32 formula (tested against transformers).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return _rms_norm_hf(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rms_norm_heads(
    x: Tensor,  # [T, heads, Dh]
    weights: tuple[Tensor, ...],  # one [Dh] weight per head group
    group_sizes: tuple[int, ...],  # heads per group, sum == heads
    eps: float,
) -> Tensor:  # [T, heads, Dh], new tensor
    """Per-head RMSNorm of several head groups in one pass (Qwen3's q_norm and k_norm over
    the joint q|k heads): normalise every head, then scale each group by its weight."""
    if x.dtype != torch.float32:
        parts = x.split(list(group_sizes), dim=1)
        return torch.cat([_rms_norm_hf(p, w, eps) for p, w in zip(parts, weights)], dim=1)
    if rms_norm_cpu_ok(x):
        out = rms_norm_cpu(x, None, eps)
    else:
        out = F.rms_norm(x, (x.shape[-1],), None, eps)
    start = 0
    for size, w in zip(group_sizes, weights):
        out[:, start : start + size].mul_(w)
        start += size
    return out


def _rms_norm_hf(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
