"""FP8 (``float8_e4m3fn``) block quantization in plain torch: the reference path of FP8
weights (docs/architecture.md#quantization) and the tiny FP8 checkpoints' quantizer.

Checkpoint form (DeepSeek-V3's): a weight ``q [N, K]`` float8 with ``scale_inv
[ceil(N/bn), ceil(K/bk)]`` float32, one multiplier per ``bn x bk`` block (the last row and
column of blocks may be partial): ``w[n, k] = q[n, k] * scale_inv[n // bn, k // bk]``.

Held form (what a layer keeps): the same ``q`` and *row* scales ``[N, ceil(K/bk)]``, the
checkpoint's block rows repeated over their ``bn`` rows. A fused weight made of several
checkpoint tensors stacked by rows (q|k|v, gate|up) keeps each part's own scales even where
a part ends inside a block (``moe_intermediate_size`` 192 with 128-row blocks), and a row
block of the weight (an expert, a part) is a row block of its scales. It costs ``4 / bk``
bytes per weight byte (3% at bk = 128).

A per-tensor scale (``weight_scale``, one float) is a block as large as the tensor.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_fp8_blocks(
    w: Tensor,  # [N, K] float
    block: tuple[int, int],
) -> tuple[Tensor, Tensor]:  # q [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] f32
    """Per ``block``: scale = amax / 448 (1 for an all-zero block), ``q = w / scale``
    rounded to FP8; ``scale_inv`` is that scale (the checkpoint's dequant multiplier)."""
    bn, bk = block
    n, k = w.shape
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = w.new_zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:n, :k] = w
    blocks = padded.view(rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(1, 3))  # [rows, cols]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(rows * bn, cols * bk)[:n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def row_scales(
    scale_inv: Tensor,  # [ceil(N/bn), ceil(K/bk)] block scales, or one per-tensor scale
    rows: int,  # N
    cols: int,  # K
    block: tuple[int, int],
) -> Tensor:  # [N, ceil(K/bk)] float32, the held form
    """The checkpoint's scales of an ``[N, K]`` weight in the held form (module docstring).
    ValueError (saying the shape expected) when ``scale_inv`` fits neither form."""
    bn, bk = block
    kb = math.ceil(cols / bk)
    if scale_inv.numel() == 1:  # per tensor
        return scale_inv.reshape(1, 1).float().expand(rows, kb).contiguous()
    want = (math.ceil(rows / bn), kb)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale shape {tuple(scale_inv.shape)}, expected {want} ({bn}x{bk} blocks of a "
            f"[{rows}, {cols}] weight) or one per-tensor value"
        )
    return scale_inv.float().repeat_interleave(bn, dim=0)[:rows].contiguous()


def fp8_values(q: Tensor) -> Tensor:  # float8_e4m3fn [...] -> bfloat16 [...], exact
    """``q``'s values, by moving e4m3's sign, exponent and mantissa bits into bfloat16's
    fields (its exponent is biased by 7, bfloat16's by 127: hence the 2**120): exact for
    every finite value (a NaN byte, which no checkpoint holds, reads as 480). Vectorised
    integer ops: torch's own float8 conversion is an elementwise loop on CPU, 3x slower
    on the tiny checkpoints' weights (benchmarks/fp8.py)."""
    u = q.view(torch.uint8).to(torch.int16)
    bits = ((u & 0x80) << 8) | ((u & 0x7F) << 4)  # 0x80 << 8 wraps to int16's sign bit
    return bits.view(torch.bfloat16) * 2.0**120


def dequantize_fp8_rows(
    q: Tensor,  # [..., N, K] float8_e4m3fn
    scales: Tensor,  # [..., N, ceil(K/bk)] float32 (the held form)
    block_k: int,
    dtype: torch.dtype,
) -> Tensor:  # [..., N, K] in dtype
    """The weight the held FP8 form stands for, computed in float32 then cast: with
    ``dtype`` float32 exactly the dequantized checkpoint's values."""
    k, blocks = q.shape[-1], scales.shape[-1]
    values = fp8_values(q).float()
    if k == blocks * block_k:  # whole blocks: scale each as a view, nothing repeated
        split = values.view(*q.shape[:-1], blocks, block_k) * scales.unsqueeze(-1)
        return split.view(q.shape).to(dtype)
    full = scales.repeat_interleave(block_k, dim=-1)[..., :k]
    return (values * full).to(dtype)


def dequantize_fp8_blocks(
    q: Tensor,  # [N, K] float8_e4m3fn
    scale_inv: Tensor,  # [ceil(N/bn), ceil(K/bk)] or per-tensor
    block: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> Tensor:  # [N, K]
    """A checkpoint tensor's values (the parity tests' float32 reference checkpoint)."""
    n, k = q.shape
    return dequantize_fp8_rows(q, row_scales(scale_inv, n, k, block), block[1], dtype)
