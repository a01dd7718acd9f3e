"""FP8 (``float8_e4m3fn``) block-scaled weights on CPU, decoded in registers by the C++
kernel (``csrc/fp8_cpu.cpp``): pack once, then ``fp8_linear`` per call; one checked
wrapper.

Why: the torch reference dequantizes the whole weight every call (a float copy written and
read again), so an FP8 checkpoint streams more bytes a token than a float32 one; the kernel
reads the FP8 bytes once (a quarter of float32's) and multiplies by the block scale as it
decodes, w8a16: activations float32 or bf16, float32 accumulation, the output in the
activations' dtype. Two decodes, both measured (``select.py``): e4m3 -> fp16 -> float32
(every CPU with AVX-512) and, the ``dot-`` variants, e4m3 -> bf16 by table lookup into
``vdpbf16ps`` (AVX512-BF16 and VBMI; activations rounded to bf16, so offered for bf16
models only).

Scales: DeepSeek-V3's layout, ``scale_inv [ceil(N/bn), ceil(K/bk)]`` float32 per
``bn x bk`` block (the dequantized weight is ``w * scale_inv`` block by block), or one
per-tensor value; the pack holds them per output row and k chunk (``row_scales``), so any
``bn`` works. ``Fp8CpuLinear`` has the ``pack(weight, row_scales, block_k)`` / ``(x, packed,
bias)`` shape of a pluggable FP8 linear kernel. MoE experts: ``pack_fp8_experts`` and
``fp8_fused_experts``, the C++ fused MoE (``csrc/moe_cpu.cpp``) reading FP8 blocks of its
float32 layout (``cpu_moe.CpuPackedExperts``) with the scales beside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from tidal.kernels.cpu_ext import PREFETCH_HINTS, kernel_available, kernel_status, native_args
from tidal.kernels.cpu_linear import BLOCK, copy_blocks
from tidal.kernels.cpu_moe import (
    DOWN_BLOCK,
    GATE_BLOCK,
    checked_run,
    pack_down_blocks,
    run_fused_moe,
    unpack_down_blocks,
)
from tidal.kernels.host_memory import empty_huge

FP8_DTYPE = torch.float8_e4m3fn
DEFAULT_BLOCK = (128, 128)  # (bn, bk): DeepSeek-V3's weight_block_size
# The hint of an FP8 kernel served without a measured variant (the ops' default).
FP8_EMPTY_PREFETCH = PREFETCH_HINTS["t0"]


@dataclass(frozen=True)
class PackedFp8Linear:
    """``weight [N, K]`` FP8 as ``w [N_pad/64, K, 64]`` uint8 (its bytes, column blocks as
    ``cpu_linear``'s pack) and ``scales [N_pad/64, ceil(K/block_k), 64]`` float32 (row
    ``64j + c``'s scale per k chunk); zero past N."""

    w: Tensor
    scales: Tensor
    out_features: int
    in_features: int
    block_k: int

    def unpack(self) -> tuple[Tensor, Tensor]:  # ([N, K] float8_e4m3fn, [N, C] float32)
        """The FP8 weight (exact: its bytes) and its row scales back."""
        blocks, k, block = self.w.shape
        n = self.out_features
        weight = self.w.permute(0, 2, 1).reshape(blocks * block, k)[:n].contiguous()
        scales = self.scales.permute(0, 2, 1).reshape(blocks * block, -1)[:n].contiguous()
        return weight.view(FP8_DTYPE), scales


def row_scales(
    scale_inv: Tensor,  # [ceil(N/bn), ceil(K/bk)] block scales, or one per-tensor value
    rows: int,  # N
    cols: int,  # K
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> Tensor:  # [N, ceil(K/bk)] float32
    """A checkpoint's scales of an ``[N, K]`` weight per output row and k chunk; ValueError
    saying the shape expected when ``scale_inv`` fits neither form."""
    bn, bk = block
    chunks = math.ceil(cols / bk)
    if scale_inv.numel() == 1:
        return scale_inv.reshape(1, 1).float().expand(rows, chunks).contiguous()
    want = (math.ceil(rows / bn), chunks)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)}, expected {want} ({bn}x{bk} blocks of "
            f"a [{rows}, {cols}] weight) or one per-tensor value"
        )
    return scale_inv.float().repeat_interleave(bn, dim=0)[:rows].contiguous()


def pack_fp8_rows(weight: Tensor, scales: Tensor, block_k: int) -> PackedFp8Linear:
    """``weight [N, K]`` float8_e4m3fn with row scales ``[N, ceil(K/block_k)]`` packed for
    ``fp8_linear``."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(f"the FP8 linear takes a float8_e4m3fn [N, K] weight, got {weight.dtype}")
    n, k = weight.shape
    if block_k < 1 or tuple(scales.shape) != (n, math.ceil(k / block_k)):
        raise ValueError(
            f"row scales {tuple(scales.shape)} do not match a [{n}, {k}] weight in k chunks "
            f"of {block_k}: expected ({n}, {math.ceil(k / block_k)})"
        )
    blocks = -(-n // BLOCK)
    w = empty_huge((blocks, k, BLOCK), torch.uint8)  # streamed at decode: huge pages
    copy_blocks(w[None], weight.view(torch.uint8)[None], BLOCK)
    s = torch.zeros(blocks, scales.shape[1], BLOCK)
    copy_blocks(s[None], scales.float()[None], BLOCK)
    return PackedFp8Linear(w, s, n, k, block_k)


def pack_fp8_linear(
    weight: Tensor,  # [N, K] float8_e4m3fn
    scale_inv: Tensor,  # [ceil(N/bn), ceil(K/bk)] float32, or per-tensor
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> PackedFp8Linear:
    """A checkpoint's FP8 weight and its ``weight_scale_inv`` packed for ``fp8_linear``."""
    n, k = weight.shape
    return pack_fp8_rows(weight, row_scales(scale_inv, n, k, block), block[1])


def fp8_linear(
    x: Tensor,  # [T, K] float32 or bf16
    packed: PackedFp8Linear,
    bias: Tensor | None = None,  # [N]
    prefetch: int = 1,  # cpu_ext.PREFETCH_HINTS value (t0 by default)
    dot: bool = False,  # the dot kernel (x rounded to bf16; cpu_ext.fp8_dot_available)
    amx: bool = False,  # the AMX kernel (x rounded to bf16; cpu_ext.fp8_amx_available)
) -> Tensor:  # [T, N], x's dtype
    """``x @ dequant(weight).T (+ bias)``, the weight decoded in registers."""
    if x.dim() != 2 or x.shape[1] != packed.in_features:
        raise ValueError(
            f"x {tuple(x.shape)} does not match the weight's {packed.in_features} inputs"
        )
    if not kernel_available():
        raise RuntimeError(f"the C++ FP8 linear is unavailable: {kernel_status()}")
    if x.stride(1) != 1:
        x = x.contiguous()
    return torch.ops.tidal_cpu.fp8_linear(
        x, packed.w, packed.scales, bias, packed.out_features, packed.block_k, prefetch, dot, amx
    )


class Fp8CpuLinear:
    """The C++ FP8 linear as a pluggable kernel: ``pack(weight, row_scales, block_k)``
    once (the only copy: ``unpack`` gives the weight and scales back, exact), then
    ``self(x, packed, bias, variant)`` per forward (any leading dims of x; ``variant``: the
    measured prefetch hint, ``select.Candidate.variant``)."""

    def pack(self, weight: Tensor, scales: Tensor, block_k: int) -> PackedFp8Linear:
        return pack_fp8_rows(weight, scales, block_k)

    def unpack(self, packed: PackedFp8Linear) -> tuple[Tensor, Tensor]:
        return packed.unpack()

    def __call__(
        self, x: Tensor, packed: PackedFp8Linear, bias: Tensor | None, variant: str = ""
    ) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = fp8_linear(rows, packed, bias, *native_args(variant, FP8_EMPTY_PREFETCH))
        return out.reshape(*x.shape[:-1], packed.out_features)


@dataclass(frozen=True)
class PackedFp8Experts:
    """A layer's FP8 experts in ``cpu_moe.CpuPackedExperts``' blocked layout, as bytes:
    ``w13 [E, I_pad/32, H, 64]`` and ``w2 [S, E, R, I_pad, 64]`` uint8, with each
    block's column scales per k chunk: ``s13 [E, I_pad/32, ceil(H/bk), 64]`` (the w13
    blocks' 32 gate then 32 up columns), ``s2 [S, E, R, ceil(I_pad/bk), 64]``."""

    w13: Tensor
    s13: Tensor
    w2: Tensor
    s2: Tensor
    hidden: int
    inter: int
    block_k: int

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def unpack(self, slots: list[int] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(w13 [S, 2I, H], w2 [S, H, I])`` float8_e4m3fn and their row scales
        ``(s13 [S, 2I, ceil(H/bk)], s2 [S, H, ceil(I/bk)])`` of ``slots`` (None: all), back
        from the pack, exact (copies): what expert moves read when this is the only copy."""
        return tuple(self.unpack_part(i, slots) for i in range(4))  # type: ignore[return-value]

    def unpack_part(self, part: int, slots: list[int] | None = None) -> Tensor:
        """One of ``unpack``'s four tensors (0: w13, 1: w2, 2: s13, 3: s2)."""
        idx = list(range(self.num_experts)) if slots is None else list(slots)
        n, hidden, inter = len(idx), self.hidden, self.inter
        if part in (0, 2):  # [S, G, C, 2, 32] -> [S, 2, G*32, C], cut to I: gate rows, up rows
            src = (self.w13 if part == 0 else self.s13)[idx]
            g, depth = src.shape[1], src.shape[2]
            halves = src.view(n, g, depth, 2, GATE_BLOCK).permute(0, 3, 1, 4, 2)
            out = halves.reshape(n, 2, g * GATE_BLOCK, depth)[:, :, :inter]
            out = out.reshape(n, 2 * inter, depth)
        else:  # [S, E, R, C, 64] -> [n, S*R*64, C], cut to H rows (and the scales' chunks)
            out = unpack_down_blocks(self.w2 if part == 1 else self.s2, idx, False)[:, :hidden]
            out = out[:, :, : (inter if part == 1 else math.ceil(inter / self.block_k))]
        out = out.contiguous()
        return out.view(FP8_DTYPE) if part < 2 else out


def pack_fp8_experts_rows(
    w13: Tensor,  # [E, 2I, H] float8_e4m3fn
    s13: Tensor,  # [E, 2I, ceil(H/bk)] float32 row scales
    w2: Tensor,  # [E, H, I] float8_e4m3fn
    s2: Tensor,  # [E, H, ceil(I/bk)] float32 row scales
    block_k: int,
    run: int | None = None,  # R of w2 (a divisor of H_pad/64); default cpu_moe.down_run
) -> PackedFp8Experts:
    """Experts with per-row scales packed for ``fp8_fused_experts``."""
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 experts must be float8_e4m3fn, got {w13.dtype}/{w2.dtype}")
    num, two_i, hidden = w13.shape
    inter = two_i // 2
    if tuple(w2.shape) != (num, hidden, inter):
        raise ValueError(f"w2 {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}")
    up_c, down_c = math.ceil(hidden / block_k), math.ceil(inter / block_k)
    if tuple(s13.shape) != (num, two_i, up_c) or tuple(s2.shape) != (num, hidden, down_c):
        raise ValueError(
            f"row scales {tuple(s13.shape)}/{tuple(s2.shape)} do not match the experts: "
            f"expected ({num}, {two_i}, {up_c})/({num}, {hidden}, {down_c})"
        )
    inter_pad = -(-inter // GATE_BLOCK) * GATE_BLOCK
    gate_blocks, down_blocks = inter_pad // GATE_BLOCK, -(-hidden // DOWN_BLOCK)
    pw13 = empty_huge((num, gate_blocks, hidden, 2 * GATE_BLOCK), torch.uint8)
    ps13 = torch.zeros(num, gate_blocks, up_c, 2 * GATE_BLOCK)
    for packed, src in ((pw13, w13.view(torch.uint8)), (ps13, s13.float())):
        halves = packed.view(num, gate_blocks, packed.shape[2], 2, GATE_BLOCK)
        for half, rows in enumerate((src[:, :inter], src[:, inter:])):  # gate, up
            copy_blocks(halves[:, :, :, half], rows, GATE_BLOCK)
    run = checked_run(down_blocks, run)
    pw2 = empty_huge((down_blocks // run, num, run, inter_pad, DOWN_BLOCK), torch.uint8)
    pack_down_blocks(pw2, w2.view(torch.uint8), False)
    ps2 = torch.zeros(down_blocks // run, num, run, math.ceil(inter_pad / block_k), DOWN_BLOCK)
    pack_down_blocks(ps2, s2.float(), False)
    return PackedFp8Experts(pw13, ps13, pw2, ps2, hidden, inter, block_k)


def pack_fp8_experts(
    w13: Tensor,  # [E, 2I, H] float8_e4m3fn
    w13_scale_inv: Tensor,  # [E, ceil(2I/bn), ceil(H/bk)] (or [E] / [E, 1, 1] per tensor)
    w2: Tensor,  # [E, H, I] float8_e4m3fn
    w2_scale_inv: Tensor,  # [E, ceil(H/bn), ceil(I/bk)] (or per tensor)
    block: tuple[int, int] = DEFAULT_BLOCK,
    run: int | None = None,  # R of w2 (pack_fp8_experts_rows)
) -> PackedFp8Experts:
    """A checkpoint's FP8 experts and their ``weight_scale_inv`` packed for
    ``fp8_fused_experts``."""
    num, two_i, hidden = w13.shape
    inter = w2.shape[2]
    s13 = torch.stack([row_scales(w13_scale_inv[e], two_i, hidden, block) for e in range(num)])
    s2 = torch.stack([row_scales(w2_scale_inv[e], hidden, inter, block) for e in range(num)])
    return pack_fp8_experts_rows(w13, s13, w2, s2, block[1], run)


def fp8_fused_experts(
    hidden: Tensor,  # [T, H] float32 or bf16
    packed: PackedFp8Experts,
    topk_weights: Tensor,  # [T, K]
    topk_ids: Tensor,  # [T, K] global ids
    expert_map: Tensor | None = None,  # [E_global] int32: global id -> local slot or -1
    apply_router_weight: bool = True,
    prefetch: int = 1,  # cpu_ext.PREFETCH_HINTS value (t0 by default)
    dot: bool = False,  # the dot kernel (activations rounded to bf16)
    amx: bool = False,  # the AMX kernel (activations rounded to bf16)
) -> Tensor:  # [T, H], hidden's dtype
    """One MoE layer's FP8 experts (SiLU-and-mul), the weights decoded in registers."""
    return run_fused_moe(
        hidden, packed.hidden, packed.w13, packed.w2, topk_weights, topk_ids, expert_map,
        apply_router_weight, prefetch, dot, packed.s13, packed.s2, packed.block_k, amx=amx,
    )  # fmt: skip


class Fp8CpuExperts:
    """The C++ FP8 experts as a pluggable kernel: ``pack(w13, w2, w13_scale, w2_scale,
    block_k)`` (row scales) once per write -- the only copy: ``unpack`` gives the four
    back, exact -- then ``self(x, packed, topk_weights, topk_ids, expert_map, variant)``."""

    def pack(
        self, w13: Tensor, w2: Tensor, w13_scale: Tensor, w2_scale: Tensor, block_k: int
    ) -> PackedFp8Experts:
        return pack_fp8_experts_rows(w13, w13_scale, w2, w2_scale, block_k)

    def unpack(
        self, packed: PackedFp8Experts, slots: list[int] | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return packed.unpack(slots)

    def unpack_part(self, packed: PackedFp8Experts, part: int) -> Tensor:
        return packed.unpack_part(part)

    def __call__(
        self,
        x: Tensor,  # [T, H] float32 or bf16
        packed: PackedFp8Experts,
        topk_weights: Tensor,  # [T, K] float32
        topk_ids: Tensor,  # [T, K] int64 global ids
        expert_map: Tensor | None,  # [E_global] int32
        variant: str = "",
    ) -> Tensor:  # [T, H], x's dtype
        return fp8_fused_experts(
            x, packed, topk_weights, topk_ids, expert_map, True,
            *native_args(variant, FP8_EMPTY_PREFETCH),
        )  # fmt: skip
