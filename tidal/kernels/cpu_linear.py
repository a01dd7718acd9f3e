"""``x @ W^T (+ bias)`` for float32 on CPU at decode sizes in one C++ call
(``csrc/linear_cpu.cpp``); one checked wrapper.

Why: oneDNN's prepacked linear is near this machine's peak on 1024-wide projections but
pays a fixed ~15-20 us a call, most of the time on small weights (the 256-wide model's
q/k/v and o projections: 26-37 us at 32 rows, for 2-4 M multiply-adds).
``tidal/layers/linear.py`` uses this for weights of at most ``SMALL_WEIGHT`` elements
and keeps ``F.linear`` as the reference and the fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tidal.kernels.cpu_ext import kernel_available, kernel_status
from tidal.kernels.host_memory import empty_huge

BLOCK = 64  # output columns per block of the pack (gemm.h's block_gemm width)


def pack_linear_weight(weight: Tensor) -> Tensor:  # [N, K] -> [N_pad/64, K, 64] float32
    """Block j holds, for each input column k, the weights of outputs 64j.. (zero past N)."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"the CPU linear takes a float32 [N, K] weight, got {weight.dtype}")
    out_f, in_f = weight.shape
    padded = -(-out_f // BLOCK) * BLOCK
    blocks = F.pad(weight, (0, 0, 0, padded - out_f)).view(padded // BLOCK, BLOCK, in_f)
    out = empty_huge((padded // BLOCK, in_f, BLOCK))  # streamed at decode: huge pages
    out.copy_(blocks.transpose(1, 2))
    return out


def linear_cpu_ok(x: Tensor) -> bool:
    """Whether ``linear_cpu`` takes ``x``: float32 on CPU, the extension loaded."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and kernel_available()


def linear_cpu(
    x: Tensor,  # [T, K] float32 CPU
    packed: Tensor,  # pack_linear_weight(weight)
    out_features: int,
    bias: Tensor | None = None,  # [N] float32
) -> Tensor:  # [T, N] float32
    if x.dim() != 2 or x.shape[1] != packed.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match the weight's {packed.shape[1]} inputs")
    if not kernel_available():
        raise RuntimeError(f"the C++ linear is unavailable: {kernel_status()}")
    return torch.ops.tidal_cpu.linear(x, packed, bias, out_features)
