"""The MoE router for float32 or bf16 on CPU in one C++ call (``csrc/router_cpu.cpp``): logits,
softmax, top-k and renormalisation; one checked wrapper.

Why: the torch path (``tidal/moe/router.py``'s ``softmax_topk`` after the gate's linear)
is a GEMM call and four small ops, ~35 us a layer at decode sizes on 2 cores for ~1 us of
arithmetic. ``softmax_topk`` stays the reference and the fallback; the two differ by the
summation order of the logits (an ulp; with a bf16 gate the torch path also rounds the
logits to bf16 before its softmax, this path keeps them float32), so a near-tie between two experts could resolve
either way, as it already could between MKL and oneDNN.

Softmax top-k only: ``FusedMoE`` does not offer this path for another routing rule
(sigmoid scores, a correction bias, group-limited choice; ``Routing.plain_softmax``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.kernels.cpu_ext import kernel_available
from tidal.kernels.cpu_linear import DTYPES, pack_linear_weight, unpack_linear_weight


class CpuPackedGate:
    """The router's ``gate [E, H]`` as ``[E_pad/64, H, 64]``: block j holds, for each
    input column k, the gate weights of experts 64j.. (zero past E). The gate's only copy
    when the C++ router serves (``unpack`` rebuilds it; ``FusedMoE.write_weights``
    packs a written one again)."""

    def __init__(self, gate: Tensor) -> None:  # [E, H] float32 or bf16
        if gate.dtype not in DTYPES or gate.dim() != 2:
            raise ValueError(f"the CPU router takes a float32 or bf16 [E, H] gate, got {gate.dtype}")
        self.num_experts, self.hidden = gate.shape
        self.weight = pack_linear_weight(gate)  # the linear's layout

    def unpack(self) -> Tensor:  # [E, H], the gate back (exact)
        return unpack_linear_weight(self.weight, self.num_experts, self.hidden)


def router_cpu_ok(hidden: Tensor) -> bool:
    """Whether ``softmax_topk_cpu`` takes ``hidden``: float32 or bf16 on CPU, the extension
    loaded."""
    return hidden.dtype in DTYPES and hidden.device.type == "cpu" and kernel_available()


def softmax_topk_cpu(
    hidden: Tensor,  # [T, H] float32 or bf16 CPU (a float32 gate: float32 hidden)
    gate: CpuPackedGate,
    top_k: int,
    renormalize: bool,
    prefetch: int = 0,  # cpu_ext.PREFETCH_HINTS value: a per-CPU choice (select.py)
    dot: bool = False,  # a bf16 gate: the AVX512-BF16 kernel (cpu_ext.bf16_dot_available)
) -> tuple[Tensor, Tensor]:  # ([T, K] float32, [T, K] int64)
    """``softmax_topk(hidden @ gate.T, top_k, renormalize)`` in one call."""
    if not 1 <= top_k <= gate.num_experts:
        raise ValueError(f"top_k must be in [1, {gate.num_experts}], got {top_k}")
    return torch.ops.tidal_cpu.softmax_topk(
        hidden, gate.weight, gate.num_experts, top_k, renormalize, prefetch, dot
    )
