"""The C++ fused MoE kernel for float32 or bf16 weights on CPU (``csrc/moe_cpu.cpp``), one checked wrapper.

Why: at decode sizes each expert sees a few rows, so the experts' GEMMs are bound by
reading the weights once; what the torch paths add on top is per-call cost (oneDNN: ~14
us and a thread barrier per GEMM, two GEMMs per busy expert). The kernel does the whole
layer -- routing sort, gate/up with SiLU-and-mul and the router weight, down summed into
the tokens -- in one call with two parallel regions on torch's own thread pool. Experts
with biases and GPT-OSS's clamped SwiGLU (``ExpertExtras``) take the same kernel: the
biases are read unpacked at each call (the layer's own per-slot buffers, so expert moves
need nothing more), the activation is the gate/up epilogue's.

It is part of the C++ extension ``tidal/kernels/cpu_ext.py`` loads; where that was not
built the MoE layer keeps the torch path. Tests pin it against ``tidal/moe/reference.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tidal.kernels.cpu_ext import AMX_K, amx_fits, kernel_available, kernel_status
from tidal.kernels.cpu_linear import DTYPES, copy_blocks, copy_pair_blocks, packed_depth
from tidal.kernels.host_memory import empty_huge

GATE_BLOCK = 32  # intermediate columns per w13 block (the kernel's kGateBlock)
DOWN_BLOCK = 64  # output columns per w2 block (kDownBlock)


def down_run(down_blocks: int, threads: int | None = None) -> int:
    """R of a ``w2`` pack ``[S, E, R, ...]``: how many output column blocks lie together per
    expert -- the largest divisor of ``down_blocks`` that is at most one thread's share of
    the down pass (``threads``: torch's, by default), so that a thread reads one stretch
    per busy expert at decode and one stretch in all at a batch (``csrc/moe_cpu.cpp``)."""
    share = -(-down_blocks // max(1, threads or torch.get_num_threads()))
    return max(r for r in range(1, max(1, share) + 1) if down_blocks % r == 0)


def checked_run(down_blocks: int, run: int | None) -> int:
    """``run`` (``down_run``'s when None) as a pack's R, refused unless it divides
    ``down_blocks``."""
    run = run or down_run(down_blocks)
    if down_blocks % run:
        raise ValueError(f"run {run} does not divide the {down_blocks} output column blocks")
    return run


def pack_down_blocks(dst: Tensor, src: Tensor, pairs: bool) -> None:
    """``src [E, N, K]`` (``w2``, or FP8 scales ``[E, H, C]``) into ``dst [S, E, R, K', 64]``
    (bf16 ``pairs``: ``[S, E, R, K'/2, 64, 2]``), zero-filled: output column block
    ``s * R + r`` of expert ``e`` at ``dst[s, e, r]``, each stored transposed."""
    runs, _, run = dst.shape[:3]
    for s in range(runs):
        rows = src[:, s * run * DOWN_BLOCK : (s + 1) * run * DOWN_BLOCK]
        if pairs:
            copy_pair_blocks(dst[s], rows, DOWN_BLOCK)
        else:
            copy_blocks(dst[s][:, :, : src.shape[2]], rows, DOWN_BLOCK)


def unpack_down_blocks(packed: Tensor, idx: list[int], pairs: bool) -> Tensor:
    """``pack_down_blocks`` undone for experts ``idx``: ``[S, E, R, K', 64(, 2)]`` ->
    ``[len(idx), S * R * 64, K' (x 2)]`` (a copy; cut it to the real sizes)."""
    blocks = packed[:, idx]  # [S, n, R, K', 64(, 2)]
    runs, n, run, depth = blocks.shape[:4]
    if pairs:  # [S, n, R, P, 64, 2] -> [n, S, R, 64, P, 2]
        return blocks.permute(1, 0, 2, 4, 3, 5).reshape(n, runs * run * DOWN_BLOCK, 2 * depth)
    return blocks.permute(1, 0, 2, 4, 3).reshape(n, runs * run * DOWN_BLOCK, depth)


@dataclass(frozen=True)
class ExpertExtras:
    """What GPT-OSS's experts add to the plain ones: ``b13 [E_local, 2I]`` (gate biases,
    then up) and ``b2 [E_local, H]``, float32 or bf16 (either may be None), and the
    clamped SwiGLU's ``(alpha, limit)`` (None: SiLU-and-mul), as
    ``tidal/moe/reference.py``'s ``biased_experts`` and ``ClampedSwiGLU`` compute them."""

    b13: Tensor | None = None
    b2: Tensor | None = None
    clamp: tuple[float, float] | None = None  # (alpha, limit)


NO_EXTRAS = ExpertExtras()  # plain experts: no biases, SiLU-and-mul


class CpuPackedExperts:
    """Each local expert's weights in the kernel's blocked layout (see ``csrc/moe_cpu.cpp``):

    * ``w13 [E, I_pad/32, H, 64]``: block j holds, for each input column k, the 32 gate
      weights of intermediate columns 32j.. then the 32 matching up weights;
    * ``w2 [S, E, R, I_pad, 64]``: the H_pad/64 output column blocks in S runs of R
      (``down_run``); block (s, e, r) holds, for each intermediate column k, expert e's
      down weights of output columns 64(sR + r)..;

    zero past I and H. bf16 weights stay bf16, their k rows in pairs (``copy_pair_blocks``):
    ``w13 [E, I_pad/32, H_pad/2, 64, 2]``, ``w2 [S, E, R, I_pad/2, 64, 2]``.
    When the C++ path serves a layer this is the experts' only copy
    (``tidal/kernels/cpu_paths.py``): ``unpack`` rebuilds the checkpoint layout, and a
    write (``FusedMoE.write_weights``) packs it again."""

    def __init__(
        self, w13: Tensor, w2: Tensor, run: int | None = None
    ) -> None:  # [E, 2I, H], [E, H, I]; run: R of w2 (a divisor of H_pad/64; default down_run)
        if w13.dtype not in DTYPES or w2.dtype != w13.dtype:
            raise ValueError(
                f"the CPU kernel takes float32 or bf16 experts, got {w13.dtype}/{w2.dtype}"
            )
        num, two_i, hidden = w13.shape
        inter = two_i // 2
        if w2.shape != (num, hidden, inter):
            raise ValueError(f"w2 {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}")
        dtype = w13.dtype
        inter_pad = _round_up(inter, GATE_BLOCK)
        hidden_pad = _round_up(hidden, DOWN_BLOCK)
        gate_blocks, down_blocks = inter_pad // GATE_BLOCK, hidden_pad // DOWN_BLOCK
        # bf16: the k rows in pairs, one more trailing dim of 2
        pair = (2,) if dtype == torch.bfloat16 else ()
        # One strided copy per part straight into the (zeroed) destination: no padded or
        # concatenated intermediates (the 1024-wide model packs in ~1 s instead of ~3.6).
        # On huge pages: the kernel streams these in blocks scattered over all of them.
        depth = packed_depth(hidden, dtype)
        # [E, I_pad/32, H, 64] | [E, I_pad/32, H_pad/2, 64, 2]
        self.w13 = empty_huge((num, gate_blocks, depth, 2 * GATE_BLOCK, *pair), dtype)
        halves = self.w13.view(num, gate_blocks, depth, 2, GATE_BLOCK, *pair)
        # [S, E, R, I_pad, 64] | [S, E, R, I_pad/2, 64, 2]
        run = checked_run(down_blocks, run)
        self.w2 = empty_huge(
            (down_blocks // run, num, run, packed_depth(inter_pad, dtype), DOWN_BLOCK, *pair),
            dtype,
        )
        for half, rows in enumerate((w13[:, :inter], w13[:, inter:])):  # gate, up: [E, I, H]
            if pair:
                copy_pair_blocks(halves[:, :, :, half], rows, GATE_BLOCK)
            else:
                copy_blocks(halves[:, :, :, half], rows, GATE_BLOCK)
        pack_down_blocks(self.w2, w2, bool(pair))
        self.shapes = (tuple(w13.shape), tuple(w2.shape))
        self.dtype = dtype

    def unpack(self, slots: list[int] | None = None) -> tuple[Tensor, Tensor]:
        """``(w13 [S, 2I, H], w2 [S, H, I])`` of the local ``slots`` (None: all) back from
        the pack, exact (copies), with ``k_major_experts``' storage: what expert transfers,
        EPLB moves and checkpoint-shaped reads need when this pack is the only copy."""
        return self.unpack_w13(slots), self.unpack_w2(slots)

    def unpack_w13(self, slots: list[int] | None = None) -> Tensor:  # [S, 2I, H]
        (num, two_i, hidden), _ = self.shapes
        idx = list(range(num)) if slots is None else list(slots)
        gate_blocks, depth = self.w13.shape[1], self.w13.shape[2]
        if self.dtype == torch.bfloat16:
            blocks = self.w13[idx].view(len(idx), gate_blocks, depth, 2, GATE_BLOCK, 2)
            # [S, G, P, 2, 32, 2] -> [S, 2, G, 32, P, 2] = [S, 2, I_pad, H_pad]
            halves = blocks.permute(0, 3, 1, 4, 2, 5).reshape(
                len(idx), 2, gate_blocks * GATE_BLOCK, 2 * depth
            )
        else:
            blocks = self.w13[idx].view(len(idx), gate_blocks, hidden, 2, GATE_BLOCK)
            # [S, G, H, 2, 32] -> [S, 2, G, 32, H] = [S, 2, I_pad, H], cut to I (sizes spelled
            # out: S may be 0, a transfer that keeps none of a worker's experts)
            halves = blocks.permute(0, 3, 1, 4, 2).reshape(
                len(idx), 2, gate_blocks * GATE_BLOCK, hidden
            )
        out = _k_major_empty(len(idx), two_i, hidden, self.dtype)
        out.view(len(idx), 2, two_i // 2, hidden).copy_(halves[:, :, : two_i // 2, :hidden])
        return out

    def unpack_w2(self, slots: list[int] | None = None) -> Tensor:  # [S, H, I]
        _, (num, hidden, inter) = self.shapes
        idx = list(range(num)) if slots is None else list(slots)
        down = unpack_down_blocks(self.w2, idx, self.dtype == torch.bfloat16)  # [S, H_pad, I_pad]
        out = _k_major_empty(len(idx), hidden, inter, self.dtype)
        out.copy_(down[:, :hidden, :inter])
        return out


def fused_experts_cpu(
    hidden: Tensor,  # [T, H] float32 or bf16 (float32 experts: float32 hidden)
    packed: CpuPackedExperts,
    topk_weights: Tensor,  # [T, K]
    topk_ids: Tensor,  # [T, K] global ids
    expert_map: Tensor | None = None,  # [E_global] int32: global id -> local slot or -1
    apply_router_weight: bool = True,
    prefetch: int = 0,  # cpu_ext.PREFETCH_HINTS value: a per-CPU choice (select.py)
    dot: bool = False,  # bf16 experts: the AVX512-BF16 kernel (cpu_ext.bf16_dot_available)
    amx: bool = False,  # bf16 experts: the AMX tile kernel (cpu_ext.amx_available)
    extras: ExpertExtras | None = None,  # biases and the clamped SwiGLU; None: neither
) -> Tensor:  # [T, H], hidden's dtype
    """The experts of one MoE layer; slots whose expert is not local contribute zero."""
    if hidden.dtype not in DTYPES or hidden.device.type != "cpu":
        raise ValueError(f"the CPU kernel takes float32 or bf16 CPU hidden, got {hidden.dtype}")
    if amx and not amx_fits(packed.dtype, packed.shapes[0][2]):
        raise ValueError(
            f"the AMX kernel takes bf16 experts of a hidden size divisible by {AMX_K}, got "
            f"{packed.dtype} hidden {packed.shapes[0][2]}"
        )
    if extras is not None:
        (num, two_i, width), _ = packed.shapes
        for name, bias, shape in (
            ("b13", extras.b13, (num, two_i)),
            ("b2", extras.b2, (num, width)),
        ):
            if bias is not None and tuple(bias.shape) != shape:
                raise ValueError(
                    f"{name} must be {list(shape)} (the experts'), got {list(bias.shape)}"
                )
    return run_fused_moe(
        hidden, packed.shapes[0][2], packed.w13, packed.w2, topk_weights, topk_ids, expert_map,
        apply_router_weight, prefetch, dot, amx=amx, extras=extras,
    )  # fmt: skip


def run_fused_moe(
    hidden: Tensor,  # [T, width]
    width: int,  # the experts' hidden size
    w13: Tensor,  # a pack of CpuPackedExperts or PackedFp8Experts
    w2: Tensor,
    topk_weights: Tensor,  # [T, K]
    topk_ids: Tensor,  # [T, K] global ids
    expert_map: Tensor | None,  # [E_global] int32: global id -> local slot or -1
    apply_router_weight: bool,
    prefetch: int,
    dot: bool,
    *fp8: Tensor | int,  # FP8 experts: (s13, s2, block_k)
    amx: bool = False,  # bf16 or FP8 experts: the AMX tile kernel
    extras: ExpertExtras | None = None,  # biases and the clamped SwiGLU; None: neither
) -> Tensor:  # [T, H], hidden's dtype
    """``torch.ops.tidal_cpu.fused_moe``, the one checked call of the MoE kernel (float32,
    bf16 and FP8 experts)."""
    if hidden.dim() != 2 or hidden.shape[1] != width:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match the experts' width {width}")
    if not kernel_available():
        raise RuntimeError(f"the C++ MoE kernel is unavailable: {kernel_status()}")
    # The dtype checks cost less than a no-op ``.to`` (a dispatcher call each).
    if topk_weights.dtype != torch.float32:
        topk_weights = topk_weights.to(torch.float32)
    if topk_ids.dtype != torch.int64:
        topk_ids = topk_ids.to(torch.int64)
    if expert_map is not None and expert_map.dtype != torch.int32:
        expert_map = expert_map.to(torch.int32)
    extras = extras or NO_EXTRAS
    alpha, limit = extras.clamp or (0.0, 0.0)
    return torch.ops.tidal_cpu.fused_moe(
        hidden, w13, w2, topk_weights, topk_ids, expert_map, apply_router_weight, prefetch,
        dot, *fp8, amx=amx, b13=extras.b13, b2=extras.b2,
        clamped=extras.clamp is not None, alpha=alpha, limit=limit,
    )  # fmt: skip


def _k_major_empty(num: int, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
    return torch.empty(num, cols, rows, dtype=dtype).transpose(1, 2)  # [num, rows, cols], K-major


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block
