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

The w8a8 references (the GPU's Triton kernels, ``tidal/kernels/fp8_triton.py``):
``per_token_group_quant_fp8_torch`` quantizes activations per token and k-block,
``w8a8_linear_torch`` and ``fused_experts_fp8_torch`` dequantize both operands to float32
and multiply.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# An activation group's scale is at least this / 448: an all-zero group stays finite.
ACT_AMAX_FLOOR = 1e-10


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


# The smallest K of an 8-bit ``tl.dot`` on NVIDIA GPUs (16 for 16-bit operands).
FP8_DOT_MIN_K = 32


def w8a8_group_ok(group: int) -> bool:
    """Whether the Triton w8a8 kernels take this k-block as their activation group: a
    power of two (``tl.arange``) of at least ``FP8_DOT_MIN_K``; 128 in every published
    checkpoint."""
    return group >= FP8_DOT_MIN_K and group & (group - 1) == 0


def per_token_group_quant_fp8_torch(
    x: Tensor,  # [M, K] float
    group: int,
) -> tuple[Tensor, Tensor]:  # q [M, K] float8_e4m3fn, scales [M, ceil(K/group)] float32
    """Per row and ``group`` columns (the last group may be partial): ``scale =
    max(amax, ACT_AMAX_FLOOR) / 448``, ``q = x / scale`` rounded to nearest even."""
    m, k = x.shape
    groups = math.ceil(k / group)
    padded = x.new_zeros(m, groups * group, dtype=torch.float32)
    padded[:, :k] = x
    split = padded.view(m, groups, group)
    amax = split.abs().amax(dim=2).clamp_min(ACT_AMAX_FLOOR)  # [M, G]
    # A tensor divisor: CUDA turns division by a Python scalar into a product with its
    # (inexact) reciprocal, which would differ from the kernels' correctly rounded division.
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (split / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(m, groups * group)[:, :k]
    return q.to(FP8_DTYPE).contiguous(), scale


def w8a8_linear_torch(
    x: Tensor,  # [M, K] float
    weight: Tensor,  # [N, K] float8_e4m3fn
    weight_scale: Tensor,  # [N, ceil(K/group)] float32 (held row form)
    group: int,
    bias: Tensor | None = None,  # [N]
) -> Tensor:  # [M, N], dtype of x
    """The w8a8 linear's reference: ``x`` quantized per token group, both operands
    dequantized to float32, one float32 GEMM."""
    q, s = per_token_group_quant_fp8_torch(x, group)
    xd = dequantize_fp8_rows(q, s, group, torch.float32)
    y = xd @ dequantize_fp8_rows(weight, weight_scale, group, torch.float32).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fused_experts_fp8_torch(
    hidden: Tensor,  # [T, H] float
    w13: Tensor,  # [E_local, 2I, H] float8_e4m3fn
    w2: Tensor,  # [E_local, H, I] float8_e4m3fn
    w13_scale: Tensor,  # [E_local, 2I, ceil(H/group)] float32
    w2_scale: Tensor,  # [E_local, H, ceil(I/group)] float32
    group: int,
    topk_weights: Tensor,  # [T, top_k] float32
    topk_ids: Tensor,  # [T, top_k] int64 global ids
    expert_map: Tensor | None = None,  # [E_global] int32: global id -> local slot or -1
) -> Tensor:  # [T, H], dtype of hidden
    """The w8a8 fused MoE's reference, in float32: the hidden states and each expert's
    SiLU-and-mul output quantized per token group, weights dequantized, the router weight
    applied to the down projection."""
    inter = w2.shape[2]
    q, s = per_token_group_quant_fp8_torch(hidden, group)
    x = dequantize_fp8_rows(q, s, group, torch.float32)  # [T, H]
    slots = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
    slots = torch.where((slots >= 0) & (slots < w13.shape[0]), slots, -1)  # [T, K]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in torch.unique(slots[slots >= 0]).tolist():
        tok, kk = torch.nonzero(slots == e, as_tuple=True)
        h = x[tok] @ dequantize_fp8_rows(w13[e], w13_scale[e], group, torch.float32).T
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]  # [R, I]
        aq, a_s = per_token_group_quant_fp8_torch(act, group)
        act = dequantize_fp8_rows(aq, a_s, group, torch.float32)
        y = act @ dequantize_fp8_rows(w2[e], w2_scale[e], group, torch.float32).T
        out.index_add_(0, tok, y * topk_weights[tok, kk, None])
    return out.to(hidden.dtype)
