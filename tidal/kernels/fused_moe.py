# pyright: reportArgumentType=false, reportCallIssue=false
# (triton.jit signatures type launch constants as tl.constexpr and omit num_warps/num_stages)
"""Triton fused MoE: grouped GEMMs over expert-sorted tokens.

``fused_experts`` computes, for every token t,
``out[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e`` the local
slot of ``topk_ids[t, k]``, in five launches:

1. ``moe_align_block_size``: slots ``t*top_k+k`` sorted by local expert, each expert's
   run padded to BLOCK_SIZE_M, so one GEMM row-block holds one expert's rows.
2. grouped GEMM ``hidden @ w13[e].T`` -> ``[T*top_k, 2I]`` (gate and up in one launch).
3. ``silu_and_mul`` -> ``[T*top_k, I]``.
4. grouped GEMM ``@ w2[e].T`` -> ``[T*top_k, H]``, router weight applied in the epilogue.
5. ``moe_sum`` over top_k -> ``[T, H]``.

Slots whose expert lives on another rank are sorted into blocks with expert -1; the
GEMMs write zero rows for them, so they add nothing to the sum.

Accumulation is fp32; intermediates are stored in the activation dtype (as on GPU
serving stacks). Under the Triton interpreter (CPU) bf16 ``tl.dot`` is wrong (numpy
has no bf16), so the GEMM then upcasts its tiles to fp32 (``DOT_FP32``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from tidal.kernels.activation import silu_and_mul
from tidal.kernels.moe_align import moe_align_block_size
from tidal.kernels.moe_config import MoeKernelConfig, check_moe_config, get_moe_config
from tidal.kernels.moe_sum import moe_sum

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _fused_moe_gemm_kernel(
    a_ptr,  # [rows, K]: row of slot s is s // a_row_div
    b_ptr,  # [E, N, K] expert weights
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
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped ordering: GROUP_M row-blocks share each column sweep, so the weight tiles
    # of one expert (and the activation rows) are reused from L2.
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
    c_ptrs = c_ptr + slots[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = row_mask[:, None] & n_mask[None, :]
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:
        # Remote expert: a zero contribution keeps every output row defined.
        tl.store(c_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return

    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (slots // a_row_div)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + slots, mask=row_mask, other=0.0)
        acc = acc * weight[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def is_interpreted() -> bool:
    """True when the kernels were built for the Triton interpreter (TRITON_INTERPRET=1
    set before triton was imported); they then run on CPU tensors."""
    return not isinstance(_fused_moe_gemm_kernel, JITFunction)


def _invoke_gemm(
    a: Tensor,  # [rows, K]
    b: Tensor,  # [E, N, K]
    c: Tensor,  # [T*top_k, N]
    topk_weights: Tensor,  # [T, top_k] float32
    sorted_ids: Tensor,
    expert_ids: Tensor,
    num_post_padded: Tensor,
    a_row_div: int,
    mul_routed_weight: bool,
    config: MoeKernelConfig,
) -> None:
    n, k = b.shape[1], b.shape[2]
    num_blocks = expert_ids.numel()
    grid = (num_blocks * triton.cdiv(n, config.block_size_n),)
    interpreted = is_interpreted()
    _fused_moe_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_ids, expert_ids, num_post_padded,
        n, k, c.shape[0], num_blocks, a_row_div,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1),
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        DOT_FP32=interpreted and a.dtype == torch.bfloat16,
        # fp32 models are for exactness tests: no TF32 rounding on GPUs.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        BLOCK_M=config.block_size_m, BLOCK_N=config.block_size_n,
        BLOCK_K=config.block_size_k, GROUP_M=config.group_size_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def _check_fused_args(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    expert_map: Tensor | None,
) -> None:
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"expected hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(hidden.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    tokens, hidden_size = hidden.shape
    experts, two_inter, h13 = w13.shape
    if two_inter % 2 or h13 != hidden_size or w2.shape != (experts, hidden_size, two_inter // 2):
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)} "
            f"(want [E, 2I, {hidden_size}]), w2 {tuple(w2.shape)} (want [E, {hidden_size}, I])"
        )
    if hidden.dtype not in _FLOAT_DTYPES or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise TypeError(
            f"hidden/w13/w2 must share one of float32/float16/bfloat16; got {hidden.dtype}, "
            f"{w13.dtype}, {w2.dtype}"
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
    tensors = {"hidden": hidden, "w13": w13, "w2": w2}
    tensors |= {"topk_weights": topk_weights, "topk_ids": topk_ids}
    if expert_map is not None:
        tensors["expert_map"] = expert_map
    for name, tensor in tensors.items():
        if tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device}, hidden on {hidden.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if hidden.device.type != "cuda" and not is_interpreted():
        raise RuntimeError(
            "Triton fused MoE needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
            "imported); on CPU use tidal.kernels.fused_moe_torch"
        )


def fused_experts_with_config(
    hidden: Tensor,  # [T, H] float32/float16/bfloat16
    w13: Tensor,  # [E_local, 2*I, H]: gate rows, then up rows
    w2: Tensor,  # [E_local, H, I]
    topk_weights: Tensor,  # [T, top_k] float32
    topk_ids: Tensor,  # [T, top_k] int64, global expert ids
    expert_map: Tensor | None,  # [E_global] int32: global id -> local slot or -1
    apply_router_weight: bool,
    config: MoeKernelConfig,
) -> Tensor:  # [T, H], dtype of hidden
    """``fused_experts`` with explicit launch parameters (used by tests and tuning)."""
    check_moe_config(config)
    _check_fused_args(hidden, w13, w2, topk_weights, topk_ids, expert_map)
    return _fused_experts(
        hidden, w13, w2, topk_weights, topk_ids, expert_map, apply_router_weight, config
    )


def _fused_experts(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    expert_map: Tensor | None,
    apply_router_weight: bool,
    config: MoeKernelConfig,
) -> Tensor:  # [T, H]: the launches, on arguments already checked
    tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    experts, two_inter = w13.shape[0], w13.shape[1]
    if tokens == 0 or top_k == 0:
        return torch.zeros_like(hidden)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(
        topk_ids, config.block_size_m, experts, expert_map
    )
    slots = tokens * top_k
    gate_up = torch.empty((slots, two_inter), dtype=hidden.dtype, device=hidden.device)
    _invoke_gemm(
        hidden, w13, gate_up, topk_weights, sorted_ids, expert_ids, num_post_padded,
        top_k, False, config,
    )  # fmt: skip
    act = silu_and_mul(gate_up)  # [slots, I]
    down = torch.empty((slots, hidden_size), dtype=hidden.dtype, device=hidden.device)
    _invoke_gemm(
        act, w2, down, topk_weights, sorted_ids, expert_ids, num_post_padded,
        1, apply_router_weight, config,
    )  # fmt: skip
    return moe_sum(down.view(tokens, top_k, hidden_size))


def fused_experts(
    hidden: Tensor,  # [T, H] float32/float16/bfloat16
    w13: Tensor,  # [E_local, 2*I, H]: gate rows, then up rows
    w2: Tensor,  # [E_local, H, I]
    topk_weights: Tensor,  # [T, top_k] float32
    topk_ids: Tensor,  # [T, top_k] int64, global expert ids
    expert_map: Tensor | None = None,  # [E_global] int32: global id -> local slot or -1
    apply_router_weight: bool = True,
) -> Tensor:  # [T, H], dtype of hidden
    """Triton fused MoE with the tuned (or default) block config for this batch.

    Ids with no local slot (map -1, or out of range) contribute zero.
    """
    _check_fused_args(hidden, w13, w2, topk_weights, topk_ids, expert_map)
    config = config_for(
        hidden.shape[0], w13.shape[0], w2.shape[2], topk_ids.shape[1], hidden.dtype,
        hidden.device,
    )  # fmt: skip
    return _fused_experts(
        hidden, w13, w2, topk_weights, topk_ids, expert_map, apply_router_weight, config
    )


@functools.lru_cache(maxsize=4096)
def config_for(
    m: int,
    num_experts: int,
    intermediate_size: int,
    top_k: int,
    dtype: torch.dtype,
    device: torch.device,
) -> MoeKernelConfig:
    """``get_moe_config`` for this shape on this device, looked up once per shape: the
    lookup (device name, the table's nearest batch size) cost ~20 us a call, per layer
    per step, more than a decode step's expert GEMMs on a GPU."""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return get_moe_config(
        m=m,
        num_experts=num_experts,
        intermediate_size=intermediate_size,
        top_k=top_k,
        dtype=dtype,
        device_name=device_name,
        interpret=is_interpreted(),
    )
