"""Inference-only Linear and Embedding with uninitialised storage.

Weights are created with ``torch.empty`` on the target device and dtype, and the loader
fills them, so building a model costs no random initialisation. Several checkpoint
tensors may fill row ranges of one weight (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up``)
so a layer does one matmul instead of three.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        dtype: Any = None,
        device: Any = None,
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, **kw), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, **kw), requires_grad=False) if bias else None
        )

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        out_f, in_f = self.weight.shape
        return f"in={in_f}, out={out_f}, bias={self.bias is not None}"


class Embedding(nn.Module):
    def __init__(
        self, num_embeddings: int, dim: int, *, dtype: Any = None, device: Any = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, ids: Tensor) -> Tensor:  # [T] int64 -> [T, dim]
        return F.embedding(ids, self.weight)
