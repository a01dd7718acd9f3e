"""RMSNorm with transformers' numerics (normalise in float32, cast, then scale)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype: Any = None, device: Any = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:  # [..., dim], normalised over the last dim
        if x.dtype == torch.float32:
            # One fused op; equal to the float32 formula below (tested against transformers).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
