# pyright: reportArgumentType=false, reportCallIssue=false
# (triton.jit signatures type launch constants as tl.constexpr and omit num_warps/num_stages)
"""Triton block-FP8 (w8a8) kernels, as DeepSeek-V3 runs on GPUs: activations quantized per
token and ``group`` columns at run time, weights held as FP8 with per-row, per-k-block
scales (``tidal/kernels/fp8_torch.py``'s held form), an FP8 GEMM with float32 accumulation.

- ``per_token_group_quant_fp8``: ``x [T, K]`` -> ``float8_e4m3fn [T, K]`` and float32
  scales ``[T, ceil(K/group)]``, ``scale = max(amax, AMAX_FLOOR) / 448`` per group.
- ``fp8_linear``: ``x @ W.T (+ b)`` with ``x`` quantized as above and ``W [N, K]`` FP8
  with row scales ``[N, ceil(K/group)]`` (``w8a8_block_fp8_gemm`` does the GEMM).
- ``fused_experts_fp8``: ``tidal/kernels/fused_moe.py``'s five launches with both grouped
  GEMMs in w8a8: the hidden states and the SiLU-and-mul output are quantized per token
  group; expert-indexed FP8 weights and row scales.

The activation group is the weights' k-block (128 in every published checkpoint), so
one k-block of the GEMM has one activation scale per row and one weight scale per
column: each ``BLOCK_K`` tile (``BLOCK_K`` divides the group) is one FP8 ``tl.dot``
whose float32 result is scaled and added to the float32 accumulator. On Hopper that also
bounds the FP8 tensor cores' reduced-precision accumulation to one tile.

The weights' scales come in the held *row* form ``[N, ceil(K/bk)]`` (not DeepSeek's
``[ceil(N/bn), ceil(K/bk)]``): a fused weight whose parts end inside a block keeps each
part's scales, and an expert's rows are its scales' rows. The kernel loads
``BLOCK_N`` of them per k tile either way.

The torch references are ``fp8_torch.per_token_group_quant_fp8_torch``,
``w8a8_linear_torch`` and ``fused_experts_fp8_torch`` (dequantize both operands to
float32, multiply); ``tests/kernels/test_kernel_fp8.py`` compares them.

Under the Triton interpreter (CPU, the tests) the float32 -> e4m3 cast of triton 3.x
rounds half up and loses the carry into the exponent (127.7 -> 64), so the quantizer then
rounds to the e4m3 grid in float32 itself first (``ROUND_IN_FP32``) and the cast only
re-encodes an exact value; on a GPU the cast instruction rounds to nearest even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tidal.kernels.activation import silu_and_mul
from tidal.kernels.fp8_torch import (
    ACT_AMAX_FLOOR,
    FP8_DOT_MIN_K,
    FP8_DTYPE,
    FP8_MAX,
    w8a8_group_ok,
)
from tidal.kernels.fused_moe import is_interpreted
from tidal.kernels.moe_align import moe_align_block_size
from tidal.kernels.moe_config import (
    MoeKernelConfig,
    check_moe_config,
    get_linear_config,
    get_moe_config,
)
from tidal.kernels.moe_sum import moe_sum

_ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_QUANT_ROWS = 16  # rows per quantizer program


@triton.jit
def _round_to_e4m3_grid(y):
    """``y`` (float32, |y| <= 448) rounded to the nearest e4m3 value, ties to even: adding
    then subtracting ``c``, a power of two whose float32 ulp is the e4m3 step at ``|y|``,
    makes the float32 adder do the rounding. The step is 2^(e-3) for normals (exponent
    e >= -6) and 2^-9 for subnormals."""
    bits = y.to(tl.int32, bitcast=True)
    mag = tl.abs(y)
    exp = ((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exp, -6) - 3
    c = ((step_exp + 23 + 127) << 23).to(tl.float32, bitcast=True)
    r = (mag + c) - c
    return tl.where(bits < 0, -r, r)  # the sign of y, -0.0 included


@triton.jit
def _per_token_group_quant_kernel(
    x_ptr,  # [M, K] float
    q_ptr,  # [M, K] float8_e4m3fn
    s_ptr,  # [M, G] float32
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    AMAX_FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    # Correctly rounded divisions (div_rn): the torch reference then gives the same bytes.
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR), QMAX)  # [ROWS]
    y = tl.clamp(tl.div_rn(x, scale[:, None]), -QMAX, QMAX)
    if ROUND_IN_FP32:
        y = _round_to_e4m3_grid(y)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], y.to(q_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip
    tl.store(s_ptr + rows * stride_sm + group, scale, mask=rows < M)


def _check_cuda(name: str, t: Tensor) -> None:
    if t.device.type != "cuda" and not is_interpreted():
        raise RuntimeError(
            f"Triton FP8 kernels need CUDA tensors ({name} is on {t.device}), or "
            "TRITON_INTERPRET=1 set before triton is imported; on CPU use "
            "tidal.kernels.fp8_torch"
        )


def _check_group(group: int) -> None:
    if not w8a8_group_ok(group):
        raise ValueError(
            f"block_k (the activation group) must be a power of two >= {FP8_DOT_MIN_K}, got {group}"
        )


def per_token_group_quant_fp8(
    x: Tensor,  # [M, K] float32/float16/bfloat16, rows contiguous
    group: int,  # a power of two >= 32: the weights' k-block
) -> tuple[Tensor, Tensor]:  # q [M, K] float8_e4m3fn, scales [M, ceil(K/group)] float32
    """Dynamic per-token-group FP8 quantization (CUDA, or CPU under the interpreter):
    per row and ``group`` consecutive columns (the last group may be partial),
    ``scale = max(amax, AMAX_FLOOR) / 448`` and ``q = round(x / scale)`` to nearest even.
    Bit-equal to ``fp8_torch.per_token_group_quant_fp8_torch``."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    if x.dtype not in _ACT_DTYPES:
        raise TypeError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x's rows must be contiguous (stride 1 along K)")
    _check_group(group)
    _check_cuda("x", x)
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scales
    interpreted = is_interpreted()
    grid = (triton.cdiv(m, _QUANT_ROWS), groups)
    _per_token_group_quant_kernel[grid](
        x, q, scales, m, k, x.stride(0), q.stride(0), scales.stride(0),
        AMAX_FLOOR=ACT_AMAX_FLOOR, QMAX=FP8_MAX, GROUP=group, ROWS=_QUANT_ROWS,
        ROUND_IN_FP32=interpreted,
        num_warps=1 if interpreted else 4,
    )  # fmt: skip
    return q, scales


# ---- the linear ----------------------------------------------------------------------


@triton.jit
def _w8a8_gemm_kernel(
    a_ptr,  # [M, K] float8_e4m3fn
    as_ptr,  # [M, G] float32
    b_ptr,  # [N, K] float8_e4m3fn
    bs_ptr,  # [N, G] float32
    bias_ptr,  # [N] or a dummy
    c_ptr,  # [M, N] out
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_bn,
    stride_bk,
    stride_bsn,
    stride_bsk,
    stride_cm,
    stride_cn,
    k_per_split,  # a multiple of GROUP_K: program_id(1)'s k range starts there
    GROUP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,  # > 1: c is a zeroed float32 buffer the splits add into
):
    # Grouped ordering (as the fused MoE's): GROUP_M row-blocks share a column sweep.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_m
    pid_n = (pid % pids_per_group) // group_m

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + (k_start + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + (k_start + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn
    as_ptrs = as_ptr + offs_m * stride_asm
    bs_ptrs = bs_ptr + offs_n * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = offs_k < k_end - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        kb = k0 // GROUP_K  # BLOCK_K divides GROUP_K: one scale per row/column here
        a_s = tl.load(as_ptrs + kb * stride_ask, mask=m_mask, other=0.0)  # [BLOCK_M]
        b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=n_mask, other=0.0)  # [BLOCK_N]
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS and tl.program_id(1) == 0:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    else:
        tl.atomic_add(c_ptrs, acc, mask=c_mask, sem="relaxed")


def _block_k(config: MoeKernelConfig, group: int) -> int:
    """The k tile: the config's, at least an FP8 dot's K and at most one group (powers of
    two: it divides the group)."""
    return min(max(config.block_size_k, FP8_DOT_MIN_K), group)


def w8a8_block_fp8_gemm(
    a: Tensor,  # [M, K] float8_e4m3fn
    a_scales: Tensor,  # [M, ceil(K/group)] float32
    b: Tensor,  # [N, K] float8_e4m3fn
    b_scales: Tensor,  # [N, ceil(K/group)] float32 (the held row form)
    group: int,  # the k-block of both scales: a power of two >= 32
    out_dtype: torch.dtype,
    bias: Tensor | None = None,  # [N]
    config: MoeKernelConfig | None = None,  # None: the tuned table's, else the default
) -> Tensor:  # [M, N] out_dtype
    """``(a * a_scales) @ (b * b_scales).T + bias`` with FP8 operands and float32
    accumulation; all tensors on one CUDA device (or CPU under the interpreter), ``a``
    and ``b`` with contiguous rows. ``config.split_k`` > 1 splits each output tile's k
    range (whole groups a split) over that many programs, which add float32 partial sums
    into a zeroed buffer: a decode's few output tiles then still fill the GPU."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"expected a [M, K] and b [N, K]; got {tuple(a.shape)}, {tuple(b.shape)}")
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise TypeError(f"a and b must be float8_e4m3fn, got {a.dtype}, {b.dtype}")
    _check_group(group)
    (m, k), n = a.shape, b.shape[0]
    groups = triton.cdiv(k, group)
    for name, s, rows in (("a_scales", a_scales, m), ("b_scales", b_scales, n)):
        if tuple(s.shape) != (rows, groups) or s.dtype != torch.float32:
            raise ValueError(
                f"{name} must be float32 [{rows}, {groups}] (groups of {group} of K={k}), got "
                f"{s.dtype} {tuple(s.shape)}"
            )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if out_dtype not in _ACT_DTYPES:
        raise TypeError(f"out_dtype must be float32/float16/bfloat16, got {out_dtype}")
    named = {"a": a, "a_scales": a_scales, "b": b, "b_scales": b_scales}
    if bias is not None:
        named["bias"] = bias
    for name, t in named.items():
        if t.device != a.device:
            raise ValueError(f"{name} is on {t.device}, a on {a.device}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("a and b must have contiguous rows")
    _check_cuda("a", a)
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=out_dtype, device=a.device)
    if config is None:
        device_name = torch.cuda.get_device_name(a.device) if a.is_cuda else None
        config = get_linear_config(m, n, k, FP8_DTYPE, device_name, is_interpreted())
    # Each split takes whole groups (one scale per tile); no more splits than groups.
    split_k = min(config.split_k, groups)
    k_per_split = triton.cdiv(groups, split_k) * group
    split_k = triton.cdiv(k, k_per_split)
    if split_k == 1:
        c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    else:
        c = torch.zeros((m, n), dtype=torch.float32, device=a.device)  # the splits add here
    grid = (triton.cdiv(m, config.block_size_m) * triton.cdiv(n, config.block_size_n), split_k)
    _w8a8_gemm_kernel[grid](
        a, a_scales, b, b_scales, c if bias is None else bias, c,
        m, n, k,
        a.stride(0), a.stride(1), a_scales.stride(0), a_scales.stride(1),
        b.stride(0), b.stride(1), b_scales.stride(0), b_scales.stride(1),
        c.stride(0), c.stride(1), k_per_split,
        GROUP_K=group, HAS_BIAS=bias is not None,
        BLOCK_M=config.block_size_m, BLOCK_N=config.block_size_n,
        BLOCK_K=_block_k(config, group), GROUP_M=config.group_size_m, SPLIT_K=split_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return c if split_k == 1 else c.to(out_dtype)


def fp8_linear(
    x: Tensor,  # [..., K] float32/float16/bfloat16
    weight: Tensor,  # [N, K] float8_e4m3fn
    weight_scale: Tensor,  # [N, ceil(K/block_k)] float32
    block_k: int,
    bias: Tensor | None = None,  # [N]
) -> Tensor:  # [..., N], dtype of x
    """The w8a8 linear: ``x`` quantized per token and ``block_k`` columns, then
    ``w8a8_block_fp8_gemm``."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, s = per_token_group_quant_fp8(x2, block_k)
    bias = None if bias is None else bias.to(x.dtype)
    y = w8a8_block_fp8_gemm(q, s, weight, weight_scale, block_k, x.dtype, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


# ---- the fused MoE -------------------------------------------------------------------


@triton.jit
def _fused_moe_fp8_gemm_kernel(
    a_ptr,  # [rows, K] float8_e4m3fn: row of slot s is s // a_row_div
    as_ptr,  # [rows, G] float32
    b_ptr,  # [E, N, K] float8_e4m3fn
    bs_ptr,  # [E, N, G] float32
    c_ptr,  # [T*top_k, N] out, row = slot
    topk_weights_ptr,  # [T*top_k] float32
    sorted_ids_ptr,  # [num_blocks * BLOCK_M] int32
    expert_ids_ptr,  # [num_blocks] int32
    num_post_padded_ptr,  # [1] int32
    N,
    K,
    num_slots,  # T*top_k: also the padding sentinel
    num_blocks,
    a_row_div,
    stride_am,
    stride_asm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_cm,
    GROUP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # fused_moe.py's grouped GEMM (its comments hold), with FP8 operands scaled per k block.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_m = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_m
    pid_n = (pid % pids_per_group) // group_m

    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = slots < num_slots
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    c_ptrs = c_ptr + slots[:, None] * stride_cm + offs_n[None, :]
    c_mask = row_mask[:, None] & n_mask[None, :]
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:
        tl.store(c_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return

    a_rows = slots // a_row_div
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] + offs_n[None, :] * stride_bn
    as_ptrs = as_ptr + a_rows * stride_asm
    bs_ptrs = bs_ptr + expert * stride_bse + offs_n * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        kb = k0 // GROUP_K
        a_s = tl.load(as_ptrs + kb, mask=row_mask, other=0.0)  # [BLOCK_M]
        b_s = tl.load(bs_ptrs + kb, mask=n_mask, other=0.0)  # [BLOCK_N]
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + slots, mask=row_mask, other=0.0)
        acc = acc * weight[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _invoke_fp8_gemm(
    a: Tensor,  # [rows, K] fp8
    a_scales: Tensor,  # [rows, G] float32
    b: Tensor,  # [E, N, K] fp8
    b_scales: Tensor,  # [E, N, G] float32
    c: Tensor,  # [T*top_k, N]
    topk_weights: Tensor,  # [T, top_k] float32
    align: tuple[Tensor, Tensor, Tensor],  # sorted_ids, expert_ids, num_post_padded
    a_row_div: int,
    mul_routed_weight: bool,
    group: int,
    config: MoeKernelConfig,
) -> None:
    sorted_ids, expert_ids, num_post_padded = align
    n, k = b.shape[1], b.shape[2]
    num_blocks = expert_ids.numel()
    grid = (num_blocks * triton.cdiv(n, config.block_size_n),)
    _fused_moe_fp8_gemm_kernel[grid](
        a, a_scales, b, b_scales, c, topk_weights, sorted_ids, expert_ids, num_post_padded,
        n, k, c.shape[0], num_blocks, a_row_div,
        a.stride(0), a_scales.stride(0), b.stride(0), b.stride(1),
        b_scales.stride(0), b_scales.stride(1), c.stride(0),
        GROUP_K=group, MUL_ROUTED_WEIGHT=mul_routed_weight,
        BLOCK_M=config.block_size_m, BLOCK_N=config.block_size_n,
        BLOCK_K=_block_k(config, group), GROUP_M=config.group_size_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def _check_fp8_experts(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor,
    w2_scale: Tensor,
    block_k: int,
    topk_weights: Tensor,
    topk_ids: Tensor,
    expert_map: Tensor | None,
) -> None:
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"expected hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(hidden.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    tokens, h = hidden.shape
    e, two_i = w13.shape[0], w13.shape[1]
    if two_i % 2 or tuple(w13.shape) != (e, two_i, h) or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)} "
            f"(want [E, 2I, {h}]), w2 {tuple(w2.shape)} (want [E, {h}, I])"
        )
    if hidden.dtype not in _ACT_DTYPES:
        raise TypeError(f"hidden must be float32/float16/bfloat16, got {hidden.dtype}")
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise TypeError(f"w13 and w2 must be float8_e4m3fn, got {w13.dtype}, {w2.dtype}")
    _check_group(block_k)
    want13 = (e, two_i, triton.cdiv(h, block_k))
    want2 = (e, h, triton.cdiv(two_i // 2, block_k))
    for name, s, want in (("w13_scale", w13_scale, want13), ("w2_scale", w2_scale, want2)):
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(
                f"{name} must be float32 {list(want)} (row scales of {block_k}-wide k "
                f"blocks), got {s.dtype} {tuple(s.shape)}"
            )
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != tokens:
        raise ValueError(
            f"topk_weights/topk_ids must both be [{tokens}, top_k]; got "
            f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}"
        )
    if topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32/int64, got {topk_ids.dtype}")
    named = {"hidden": hidden, "w13": w13, "w2": w2, "w13_scale": w13_scale,
             "w2_scale": w2_scale, "topk_weights": topk_weights, "topk_ids": topk_ids}  # fmt: skip
    if expert_map is not None:
        named["expert_map"] = expert_map
    for name, t in named.items():
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device}, hidden on {hidden.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    _check_cuda("hidden", hidden)


def fused_experts_fp8(
    hidden: Tensor,  # [T, H] float32/float16/bfloat16
    w13: Tensor,  # [E_local, 2*I, H] float8_e4m3fn: gate rows, then up rows
    w2: Tensor,  # [E_local, H, I] float8_e4m3fn
    w13_scale: Tensor,  # [E_local, 2*I, ceil(H/block_k)] float32 row scales
    w2_scale: Tensor,  # [E_local, H, ceil(I/block_k)] float32 row scales
    block_k: int,  # the scales' k-block and the activation group: a power of two >= 32
    topk_weights: Tensor,  # [T, top_k] float32
    topk_ids: Tensor,  # [T, top_k] int64, global expert ids
    expert_map: Tensor | None = None,  # [E_global] int32: global id -> local slot or -1
    apply_router_weight: bool = True,
    config: MoeKernelConfig | None = None,  # None: tuned table for FP8, else the default
) -> Tensor:  # [T, H], dtype of hidden
    """The Triton fused MoE in w8a8 block FP8 (CUDA, or CPU under the interpreter). The
    gate/up and down intermediates are stored in ``hidden``'s dtype, each GEMM's input
    quantized per token and ``block_k`` columns. Ids with no local slot contribute zero."""
    if config is not None:
        check_moe_config(config)
    _check_fp8_experts(
        hidden, w13, w2, w13_scale, w2_scale, block_k, topk_weights, topk_ids, expert_map
    )
    tokens, h = hidden.shape
    top_k = topk_ids.shape[1]
    experts, two_i = w13.shape[0], w13.shape[1]
    if config is None:
        config = get_moe_config(
            m=tokens, num_experts=experts, intermediate_size=two_i // 2, top_k=top_k,
            dtype=FP8_DTYPE,
            device_name=torch.cuda.get_device_name(hidden.device) if hidden.is_cuda else None,
            interpret=is_interpreted(),
        )  # fmt: skip
    if tokens == 0 or top_k == 0:
        return torch.zeros_like(hidden)
    align = moe_align_block_size(topk_ids, config.block_size_m, experts, expert_map)
    slots = tokens * top_k
    x_q, x_s = per_token_group_quant_fp8(hidden, block_k)  # [T, H] fp8, [T, G] f32
    gate_up = torch.empty((slots, two_i), dtype=hidden.dtype, device=hidden.device)
    _invoke_fp8_gemm(
        x_q, x_s, w13, w13_scale, gate_up, topk_weights, align, top_k, False, block_k, config
    )
    act_q, act_s = per_token_group_quant_fp8(silu_and_mul(gate_up), block_k)  # [slots, I]
    down = torch.empty((slots, h), dtype=hidden.dtype, device=hidden.device)
    _invoke_fp8_gemm(
        act_q, act_s, w2, w2_scale, down, topk_weights, align, 1, apply_router_weight,
        block_k, config,
    )  # fmt: skip
    return moe_sum(down.view(tokens, top_k, h))
