"""RMSNorm with transformers' numerics (normalise in float32, cast, then scale).

Paths: on CUDA one Triton launch (``tidal/kernels/rms_norm.py``, the layer's ``triton``
switch, set from its device); on CPU the C++ kernel or ``F.rms_norm`` as measured at
load (``tidal/kernels/select.py``), the kernel also folding in the residual add before
the norm (``RMSNorm.add_norm``). ``_rms_norm_hf`` is transformers' formula, the
reference of all three.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tidal.kernels.cpu_norm import NORM_DTYPES, add_rms_norm_cpu, rms_norm_cpu, rms_norm_cpu_ok
from tidal.kernels.select import Candidate, Choice, OpKey, OpSpec, kernel_candidates
from tidal.kernels.triton_device import triton_serves


class QKNorm(enum.Enum):
    """Where an attention block normalises q and k (``DecoderSpec.qk_norm``)."""

    NONE = "none"
    PER_HEAD = "per_head"  # one [Dh] weight for every q head, one for every k head (Qwen3)
    FULL_WIDTH = "full_width"  # over all of q [Hq*Dh], all of k [Hkv*Dh] (OLMoE)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype: Any = None, device: Any = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(dim, dtype=dtype, device=device), requires_grad=False
        )
        self.cpu_choice: Choice | None = None  # measured at load (select.py); None: C++
        self.triton = triton_serves(device or "cpu")  # the Triton kernel (CUDA)
        # Whether the C++ kernel takes this weight (rms_norm_cpu_ok's weight half): found
        # at the first call, not on every one (nine calls a step on a 4-layer model).
        self._cpu_kernel: bool | None = None

    def forward(self, x: Tensor) -> Tensor:  # [..., dim], normalised over the last dim
        w = self.weight
        if self.triton and x.dtype == w.dtype:
            return triton_rms_norm()(x, w, self.eps)
        if x.dtype == w.dtype and self.kernel_serves(x.numel() // x.shape[-1]):
            return rms_norm_cpu(x, w, self.eps)  # one C++ pass (cpu_norm.py)
        if x.dtype == torch.float32:
            # One fused op; equal to the float32 formula (tested against transformers).
            return F.rms_norm(x, w.shape, w, self.eps)
        return _rms_norm_hf(x, w, self.eps)

    def add_norm(self, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:  # 2 x [..., dim]
        """``(x + delta, self(x + delta))``: the residual add before a norm. Where the norm's
        measured choice is the C++ kernel, one C++ pass (``add_rms_norm_cpu``), bit for
        bit the add then the norm; else those two (the reference)."""
        w = self.weight
        rows = x.numel() // x.shape[-1]
        if x.dtype == delta.dtype == w.dtype and x.shape == delta.shape and self.kernel_serves(rows):
            return add_rms_norm_cpu(x, delta, w, self.eps)
        x = x + delta
        return x, self(x)

    def kernel_serves(self, rows: int) -> bool:
        """Whether the C++ kernel takes this weight and the choice for calls of ``rows``
        rows is it (activations of the weight's dtype; the decode plan asks it too)."""
        if self._cpu_kernel is None:
            self._cpu_kernel = rms_norm_cpu_ok(self.weight, self.weight)
        return self._cpu_kernel and self.native(rows)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self._cpu_kernel = None  # .to() / .half(): the weight's device or dtype may change
        return super()._apply(fn, *args, **kwargs)

    def native(self, rows: int) -> bool:
        """Whether calls of ``rows`` rows take the C++ kernel (where it takes them)."""
        choice = self.cpu_choice
        return choice is None or choice.for_rows(rows).path == "native"

    def cpu_ops(self) -> dict[str, OpSpec]:
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in NORM_DTYPES:
            return {}
        key = OpKey("norm", (w.shape[0],))
        return {"norm": OpSpec(key, tuple(kernel_candidates(w.dtype)), False)}

    def cpu_trial(self, op: str, candidate: Candidate, instances: int) -> Any:
        dtype = self.weight.dtype
        norm = RMSNorm(self.weight.shape[0], self.eps, dtype=dtype)
        norm.weight.data.fill_(1.0)
        norm.set_cpu_path(op, Choice.fixed(candidate, None))

        def for_rows(rows: int) -> Any:
            x = torch.full((rows, self.weight.shape[0]), 0.5, dtype=dtype)
            return lambda: norm(x)

        return for_rows

    def set_cpu_path(self, op: str, choice: Choice) -> None:
        self.cpu_choice = choice

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rms_norm_heads(
    x: Tensor,  # [T, heads, Dh]
    weights: tuple[Tensor, ...],  # one [Dh] weight per head group
    group_sizes: tuple[int, ...],  # heads per group, sum == heads
    eps: float,
    native: bool = True,  # the C++ kernel where it takes x (the norms' measured choice)
    triton: bool = False,  # the Triton kernel (the norms' ``RMSNorm.triton``)
) -> Tensor:  # [T, heads, Dh], new tensor
    """Per-head RMSNorm of several head groups in one pass (Qwen3's q_norm and k_norm over
    the joint q|k heads): normalise every head, then scale each group by its weight."""
    if triton:
        out = triton_rms_norm()(x, None, eps)  # read in place: x may be a slice of qkv
    elif native and rms_norm_cpu_ok(x):
        # Normalised (rounded to x's dtype), then scaled in x's dtype: transformers' two
        # roundings for 16-bit x, one product for float32.
        out = rms_norm_cpu(x, None, eps)
    elif x.dtype != torch.float32:
        parts = x.split(list(group_sizes), dim=1)
        return torch.cat([_rms_norm_hf(p, w, eps) for p, w in zip(parts, weights)], dim=1)
    else:
        out = F.rms_norm(x, (x.shape[-1],), None, eps)
    start = 0
    for size, w in zip(group_sizes, weights):
        out[:, start : start + size].mul_(w)
        start += size
    return out


def rms_norm_sharded(
    x: Tensor,  # [T, D_local]: this worker's block of the normalised width
    weight: Tensor,  # [D_local], the same block of the weight
    eps: float,
    width: int,  # D, the whole width (all workers' blocks)
    all_reduce: Callable[[Tensor], Tensor],  # sums over the workers holding the blocks
) -> Tensor:  # [T, D_local], new tensor
    """RMSNorm over a width split between tensor-parallel workers (OLMoE's q/k norm over
    all heads): the sums of squares are summed over the workers, so each block is
    normalised by the whole row's RMS, with transformers' numerics. One worker (the whole
    width here): the plain norm."""
    xf = x.float()
    sq = xf.pow(2).sum(-1, keepdim=True)  # [T, 1]
    if x.shape[-1] != width:
        sq = all_reduce(sq)
    return weight * (xf * torch.rsqrt(sq / width + eps)).to(x.dtype)


@functools.cache
def triton_rms_norm() -> Callable[[Tensor, Tensor | None, float], Tensor]:
    """``tidal.kernels.rms_norm.rms_norm_triton``, imported on first use (triton is
    optional, and its import fixes its mode for the process)."""
    from tidal.kernels.rms_norm import rms_norm_triton

    return rms_norm_triton


def _rms_norm_hf(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
