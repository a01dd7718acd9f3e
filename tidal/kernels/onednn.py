"""oneDNN's prepacked float32 or bf16 linear on CPU (``torch.ops.mkldnn``), one checked
wrapper (bf16: float32 accumulation, AMX tiles where the CPU has them).

Why: torch's float32 ``mm`` on CPU goes to MKL, which on the machines measured (AMD EPYC,
AVX-512, 2 cores) reaches 125-180 GFLOP/s at decode shapes; oneDNN with a weight reordered
once into its blocked layout reaches 410-480 (``benchmarks/cpu_speed.py`` prints both).
Where the measured path is oneDNN (``tidal/kernels/select.py``) the packed weight is the
only copy (``tidal/kernels/cpu_paths.py``); ``unpack_weight`` rebuilds the source.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

# Rows oneDNN tunes the packed layout for: the decode batches that dominate serving.
BATCH_HINT = 32
# oneDNN costs ~13-15 us a call however small; MKL's single-row GEMM on a small weight
# is cheaper (256x256: 4 vs 15 us; 768x256: 9 vs 18; 1024x1024: 58 vs 36 -- 2 cores,
# ``benchmarks/cpu_speed.py``). Below this many weight elements one row stays with MKL.
SMALL_WEIGHT = 1 << 19


def prefers_packed(rows: int, weight: Tensor) -> bool:
    """Whether ``rows`` rows times ``weight`` are faster on the packed copy than MKL."""
    return rows > 1 or weight.numel() >= SMALL_WEIGHT


DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """The prepacked linear is in this torch build, for ``dtype`` (float32 or bf16; bf16
    where this CPU has oneDNN's bf16 kernels). Cached: every ``Linear`` and MoE forward asks."""
    built = (
        dtype in DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )
    if not built or dtype == torch.float32:
        return built
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return probe is not None and bool(probe())


def pack_weight(weight: Tensor, batch_hint: int = BATCH_HINT) -> Tensor:
    """``weight [out, in]`` (any strides) reordered for ``packed_linear``."""
    if weight.dim() != 2 or weight.dtype not in DTYPES or weight.device.type != "cpu":
        raise ValueError(
            f"pack_weight takes a 2-D float32 or bf16 CPU weight, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x [M, in] @ weight.T (+ bias)`` -> ``[M, out]`` with a weight from ``pack_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def unpack_weight(packed: Tensor, in_features: int) -> Tensor:  # -> [out, in], its dtype
    """The weight back from ``pack_weight``'s opaque layout: ``I @ W^T`` through the packed
    GEMM itself, which is exact (each output is one weight times 1 plus zeros) for finite
    weights. Input-major storage, as ``tidal/layers/linear.py`` keeps its weights."""
    eye = torch.eye(in_features, dtype=packed.dtype)
    return packed_linear(eye, packed).t()  # [in, out] computed, viewed [out, in]
