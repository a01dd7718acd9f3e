"""The CPU paths of the ops that hold weights -- a linear, the router's gate, a layer's
experts -- each holding its weight in the one layout it reads, and able to give the
checkpoint layout back.

Why: the packed copies beside the checkpoint-shaped weights doubled the
weights held (+1.6 GB on the 1024-wide model). Now the path chosen for an op
(``tidal/kernels/select.py``) keeps the only copy: ``native`` the C++ kernels' blocked
pack, ``onednn`` oneDNN's opaque prepacked one, ``torch`` the checkpoint-shaped tensor
itself (the layer's parameter: no object here). What needs the checkpoint layout -- expert
transfers, EPLB moves, a test reading a parameter -- gets ``unpack()``: an exact rebuild.

Each call takes the variant the selection measured for the call's shape class: for
``native`` the software prefetch hint of the C++ GEMMs (``cpu_ext.PREFETCH_HINTS``) and,
for bf16 weights, the kernel (the shift one, or the AVX512-BF16 dot one: ``dot-`` hints;
for bf16 experts and linears also the AMX one, variant ``amx``).
Weights are held in their own dtype (float32 or bf16: a bf16 checkpoint is never widened).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.kernels.cpu_ext import native_args
from tidal.kernels.cpu_linear import linear_cpu, pack_linear_weight, unpack_linear_weight
from tidal.kernels.cpu_moe import CpuPackedExperts, ExpertExtras, fused_experts_cpu
from tidal.kernels.cpu_router import CpuPackedGate, softmax_topk_cpu
from tidal.kernels.fused_moe_torch import PackedExperts, fused_experts_torch
from tidal.kernels.onednn import pack_weight, packed_linear, unpack_weight

PACKED_PATHS = ("native", "onednn")  # the paths that hold a weight in a layout of their own


def _check_path(path: str) -> None:
    if path not in PACKED_PATHS:
        raise ValueError(f"a held weight's path is one of {PACKED_PATHS}, got {path!r}")


class HeldLinear:
    """``weight [N, K]`` (float32 or bf16) in ``path``'s layout; ``self(x, bias, variant)``
    is ``x @ weight.T (+ bias)``."""

    def __init__(self, path: str, weight: Tensor) -> None:
        _check_path(path)
        self.path = path
        self.out_features, self.in_features = weight.shape
        self.packed = pack_linear_weight(weight) if path == "native" else pack_weight(weight)

    def __call__(self, x: Tensor, bias: Tensor | None, variant: str = "") -> Tensor:
        # x [T, K] the weight's dtype, last dim contiguous -> [T, N]
        if self.path == "native":
            return linear_cpu(x, self.packed, self.out_features, bias, *native_args(variant))
        return packed_linear(x.contiguous(), self.packed, bias)

    def unpack(self) -> Tensor:  # [N, K], exact
        if self.path == "native":
            return unpack_linear_weight(self.packed, self.out_features, self.in_features)
        return unpack_weight(self.packed, self.in_features)


class HeldGate:
    """The router's ``gate [E, H]`` in ``path``'s layout; ``self(hidden, top_k, renorm,
    variant)`` is ``softmax_topk(hidden @ gate.T, top_k, renorm)``."""

    def __init__(self, path: str, gate: Tensor) -> None:
        _check_path(path)
        self.path = path
        self.num_experts, self.hidden = gate.shape
        if path == "native":
            self.packed: CpuPackedGate | Tensor = CpuPackedGate(gate)
        else:
            self.packed = pack_weight(gate)

    def logits(self, hidden: Tensor) -> Tensor:  # [T, H] -> [T, E] (the onednn path)
        assert isinstance(self.packed, Tensor)
        return packed_linear(hidden.contiguous(), self.packed)

    def __call__(
        self, hidden: Tensor, top_k: int, renormalize: bool, variant: str = ""
    ) -> tuple[Tensor, Tensor] | None:  # ([T, K] float32, [T, K] int64), None: logits path
        if isinstance(self.packed, CpuPackedGate):
            hint, dot, _ = native_args(variant)
            return softmax_topk_cpu(hidden, self.packed, top_k, renormalize, hint, dot)
        return None

    def unpack(self) -> Tensor:  # [E, H], exact
        if isinstance(self.packed, CpuPackedGate):
            return self.packed.unpack()
        return unpack_weight(self.packed, self.hidden)


class HeldExperts:
    """A layer's local experts ``w13 [S, 2I, H]``, ``w2 [S, H, I]`` in ``path``'s layout;
    ``self(...)`` has the expert backends' signature (``tidal/moe/reference.py``) minus
    the weights."""

    def __init__(self, path: str, w13: Tensor, w2: Tensor) -> None:
        _check_path(path)
        self.path = path
        self.shapes = (tuple(w13.shape), tuple(w2.shape))
        self.dtype = w13.dtype
        if path == "native":
            self.packed: CpuPackedExperts | PackedExperts = CpuPackedExperts(w13, w2)
        else:
            self.packed = PackedExperts(w13, w2, sole=True)

    def __call__(
        self,
        hidden: Tensor,  # [T, H]
        topk_weights: Tensor,  # [T, K] float32
        topk_ids: Tensor,  # [T, K] int64 global ids
        expert_map: Tensor | None,  # [E_global] int32
        apply_router_weight: bool = True,
        variant: str = "",
        extras: ExpertExtras | None = None,  # biases, clamped SwiGLU: the native path only
    ) -> Tensor:  # [T, H]
        if isinstance(self.packed, CpuPackedExperts):
            hint, dot, amx = native_args(variant)
            x = hidden if hidden.dtype == self.dtype else hidden.to(self.dtype)
            out = fused_experts_cpu(
                x, self.packed, topk_weights, topk_ids, expert_map, apply_router_weight, hint, dot,
                amx=amx, extras=extras,
            )  # fmt: skip
            return out if out.dtype == hidden.dtype else out.to(hidden.dtype)
        if extras is not None:
            raise ValueError("the onednn experts add no biases and no clamped SwiGLU")
        # Shape stand-ins: with a sole pack the onednn strategy never reads w13/w2.
        w13 = torch.empty(self.shapes[0], dtype=self.dtype, device="meta")
        w2 = torch.empty(self.shapes[1], dtype=self.dtype, device="meta")
        return fused_experts_torch(
            hidden, w13, w2, topk_weights, topk_ids, expert_map, apply_router_weight,
            strategy="onednn", packed=self.packed,
        )  # fmt: skip

    def unpack(self, slots: list[int] | None = None) -> tuple[Tensor, Tensor]:
        """``(w13 [S', 2I, H], w2 [S', H, I])`` of ``slots`` (None: all), exact copies."""
        return self.packed.unpack(slots)

    def unpack_w13(self) -> Tensor:  # [S, 2I, H]
        return self.packed.unpack_w13()

    def unpack_w2(self) -> Tensor:  # [S, H, I]
        return self.packed.unpack_w2()
