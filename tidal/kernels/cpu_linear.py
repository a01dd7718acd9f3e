"""``x @ W^T (+ bias)`` for float32 on CPU at decode sizes in one C++ call
(``csrc/linear_cpu.cpp``); one checked wrapper.

Why: oneDNN's prepacked linear is near this machine's peak on 1024-wide projections but
pays a fixed ~15-20 us a call, most of the time on small weights (the 256-wide model's
q/k/v and o projections: 26-37 us at 32 rows, for 2-4 M multiply-adds). This is 10-60%
faster at 1-32 rows and within 5% of oneDNN at 128-1024, so ``tidal/layers/linear.py``
uses it for every float32 CPU forward and keeps ``F.linear`` as the reference and the
fallback.

The pack (``copy_blocks``) is also the layout of the C++ router's gate and of the MoE
kernel's down weights: one weight matrix cut into 64-row blocks, each stored transposed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.kernels.cpu_ext import kernel_available, kernel_status
from tidal.kernels.host_memory import empty_huge

BLOCK = 64  # output columns per block of the pack (gemm.h's block_gemm width)


def pack_linear_weight(weight: Tensor) -> Tensor:  # [N, K] -> [N_pad/64, K, 64] float32
    """Block j holds, for each input column k, the weights of outputs 64j.. (zero past N)."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"the CPU linear takes a float32 [N, K] weight, got {weight.dtype}")
    out_f, in_f = weight.shape
    out = empty_huge((-(-out_f // BLOCK), in_f, BLOCK))  # streamed at decode: huge pages
    copy_blocks(out[None], weight[None], BLOCK)
    return out


def unpack_linear_weight(packed: Tensor, out_features: int) -> Tensor:  # -> [N, K] float32
    """The checkpoint-shaped weight back from ``pack_linear_weight``'s layout (exact: a copy),
    with the input-major storage ``tidal/layers/linear.py`` gives its weights."""
    blocks, in_f, block = packed.shape
    out = torch.empty(in_f, out_features, dtype=packed.dtype).t()  # [N, K], K-major storage
    out.copy_(packed.permute(0, 2, 1).reshape(blocks * block, in_f)[:out_features])
    return out


def copy_blocks(dst: Tensor, src: Tensor, block: int) -> None:
    """dst[e, j, k, c] = src[e, j * block + c, k]: src [E, N, K] cut into blocks of ``block``
    rows, each stored transposed; dst [E, ceil(N / block), K, block] (columns past N are
    left as they are). One strided copy per part, no padded intermediate."""
    num, rows, depth = src.shape
    full = rows // block
    if full:
        dst[:, :full].copy_(src[:, : full * block].reshape(num, full, block, depth).transpose(2, 3))
    if rows % block:
        dst[:, full, :, : rows % block].copy_(src[:, full * block :].transpose(1, 2))


def linear_cpu_ok(x: Tensor) -> bool:
    """Whether ``linear_cpu`` takes ``x``: float32 on CPU, the extension loaded."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and kernel_available()


def linear_cpu(
    x: Tensor,  # [T, K] float32 CPU
    packed: Tensor,  # pack_linear_weight(weight)
    out_features: int,
    bias: Tensor | None = None,  # [N] float32
    prefetch: int = 0,  # cpu_ext.PREFETCH_HINTS value: a per-CPU choice (select.py)
) -> Tensor:  # [T, N] float32
    if x.dim() != 2 or x.shape[1] != packed.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match the weight's {packed.shape[1]} inputs")
    if not kernel_available():
        raise RuntimeError(f"the C++ linear is unavailable: {kernel_status()}")
    return torch.ops.tidal_cpu.linear(x, packed, bias, out_features, prefetch)
