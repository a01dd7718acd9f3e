"""The C++ extension of CPU kernels (``csrc/*.cpp``, ops ``torch.ops.tidal_cpu.*``):
whether this process can use it.

``pip install -e .`` builds it (``setup.py``) when torch is importable at build time and a
C++ compiler works. Every op in it is an accelerator with a torch path beside it: where it
is missing ``kernel_available()`` is False, ``kernel_status()`` says why, and the callers
keep their torch paths (same results, slower).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple

import torch

_MODULE = "tidal.kernels._cpu_ops"
# The software prefetch hint of the C++ GEMM kernels (``csrc/gemm.h`` ``Prefetch``): which
# one streams the weights at full bandwidth depends on the CPU (prefetchnta held
# an Intel Xeon to ~10 GB/s where prefetcht0 reached 26-29; an AMD EPYC measured both the
# same), so it is one of the choices ``tidal/kernels/select.py`` measures.
PREFETCH_HINTS = {"nta": 0, "t0": 1, "none": 2}
# The variant prefix of the dot kernels (AVX512-BF16 ``vdpbf16ps``, activations rounded to
# bf16): "dot-t0" is that kernel with the t0 hint; a bare hint is the shift kernel (float32
# activations) for bf16 weights, the float32 kernel for float32 ones, the fp16 decode for
# FP8 ones (whose dot kernel decodes to bf16 by table lookup, AVX512-VBMI).
DOT_PREFIX = "dot-"
# The variant of the MoE and linear kernels on AMX tiles (``csrc/amx.h``: 16 rows x 16
# columns x 32 k a tile instruction; a fixed lookahead, no hint to choose): bf16 weights,
# and FP8 ones decoded by the FP8 dot kernel's table lookup (``csrc/gemm.h``).
AMX_VARIANT = "amx"
AMX_K = 32  # k of one AMX tile step: the AMX kernels read whole steps of the input width


def amx_fits(dtype: torch.dtype, depth: int) -> bool:
    """Whether a bf16 weight read along ``depth`` inputs (a linear's in_features, the
    experts' hidden size) has an AMX candidate: bf16, ``depth`` whole tile steps."""
    return dtype == torch.bfloat16 and depth % AMX_K == 0


class NativeArgs(NamedTuple):
    """A native candidate's variant as the C++ ops take it."""

    prefetch: int  # PREFETCH_HINTS value
    dot: bool  # the dot kernel (DOT_PREFIX)
    amx: bool  # the AMX kernel (AMX_VARIANT)


@functools.cache  # a handful of variant names, parsed on every kernel call
def native_args(variant: str, empty_prefetch: int = 0) -> NativeArgs:
    """``variant`` ("t0", "dot-nta", "amx", ...) as the C++ ops' arguments; no variant
    (a path chosen without a trial) prefetches with ``empty_prefetch``."""
    dot = variant.startswith(DOT_PREFIX)
    hint = variant.removeprefix(DOT_PREFIX) if dot else variant
    prefetch = PREFETCH_HINTS.get(hint, 0) if variant else empty_prefetch
    return NativeArgs(prefetch, dot, variant == AMX_VARIANT)


@functools.cache
def kernel_status() -> str:
    """'ok', or why the kernel cannot be used in this process."""
    if hasattr(torch.ops.tidal_cpu, "fused_moe"):
        # Already registered in this process: loading a second copy would abort it (torch
        # refuses to define an op twice, from a static initializer).
        return "ok"
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or spec.origin is None:
        return "not built (pip install -e . builds it when torch and a C++ compiler are there)"
    try:
        torch.ops.load_library(spec.origin)
    except (OSError, RuntimeError) as exc:  # built against another torch, missing symbols
        return f"built but not loadable: {exc}"
    return "ok"


def set_spin_pool(spin_us: int) -> None:
    """The CPU kernels' threads (``csrc/pool.h``): their own spin pool, whose workers spin
    ``spin_us`` microseconds after a job before they sleep (> 0, at most 1e6), or torch's
    OpenMP pool (0, the default). The extension must be loaded (``kernel_available()``)."""
    torch.ops.tidal_cpu.set_spin_pool(spin_us)


def spin_pool_state() -> tuple[int, int]:
    """(the spin pool's window in microseconds, 0 when OpenMP serves; its worker threads)."""
    spin_us, workers = torch.ops.tidal_cpu.spin_pool_state()
    return int(spin_us), int(workers)


def kernel_available() -> bool:
    return kernel_status() == "ok"


@functools.cache
def bf16_dot_available() -> bool:
    """Whether the bf16 dot kernel runs here: the extension loaded and the CPU has
    AVX512-BF16 (asked at run time: the build is valid on CPUs without it)."""
    return kernel_available() and bool(torch.ops.tidal_cpu.bf16_dot_available())


@functools.cache
def fp8_amx_available() -> bool:
    """Whether the FP8 AMX kernel runs here: the FP8 dot kernel's AVX512-BF16 and VBMI,
    AMX-BF16, and the tile state granted (asked at run time)."""
    return kernel_available() and bool(torch.ops.tidal_cpu.fp8_amx_available())


@functools.cache
def fp8_dot_available() -> bool:
    """Whether the FP8 dot kernel runs here: the extension loaded and the CPU has
    AVX512-BF16 and AVX512-VBMI (asked at run time)."""
    return kernel_available() and bool(torch.ops.tidal_cpu.fp8_dot_available())


def amx_available() -> bool:
    """Whether the bf16 AMX kernels (MoE, linear) run here: the extension loaded, the CPU has
    AMX-TILE and AMX-BF16 and Linux granted this process the tile state (asked once)."""
    return kernel_available() and bool(torch.ops.tidal_cpu.amx_available())
