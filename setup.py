"""Builds the optional C++ extension of CPU kernels (``tidal/kernels/csrc/*.cpp``) and the
shared-memory queue's atomics (``tidal/distributed/csrc/shm_sync.c``) with the package.

Everything else is in ``pyproject.toml``. The extension is an accelerator, never a
requirement: when torch is not importable at build time, or the compiler fails, the
package installs without it and every caller uses its torch path (the same results,
slower on CPU; ``tidal.kernels.cpu_ext.kernel_status()`` says why it is missing).
"""

from setuptools import Extension, setup

# Plain C, no torch: C11 atomics and futexes for the TP broadcast queue
# (tidal/distributed/shm_queue.py; without it the queue uses its pure-Python reference).
ext_modules = [
    Extension(
        "tidal.distributed._shm_sync",
        ["tidal/distributed/csrc/shm_sync.c"],
        extra_compile_args=["-O2"],
        optional=True,
    )
]
cmdclass = {}
# The C++ kernels' sources, tidal/kernels/csrc/<name>_cpu.cpp.
_SOURCES = ("moe", "router", "linear", "norm", "attention", "fp8", "pool", "decode")
try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    print("tidal: torch is not importable at build time; the C++ CPU kernels are not built")
else:
    ext_modules.append(
        CppExtension(
            "tidal.kernels._cpu_ops",
            [f"tidal/kernels/csrc/{name}_cpu.cpp" for name in _SOURCES],
            depends=[
                "tidal/kernels/csrc/vec.h",
                "tidal/kernels/csrc/vec_half.h",
                "tidal/kernels/csrc/gemm.h",
                "tidal/kernels/csrc/amx.h",
                "tidal/kernels/csrc/pool.h",
                "tidal/kernels/csrc/ops.h",
            ],
            # -march=native: the kernel's 16-lane vectors compile to the build machine's
            # widest ISA (an editable install builds on the machine that runs it).
            # -fopenmp: at::parallel_for's inline region; the symbols resolve to the
            # OpenMP runtime torch itself loaded, so one thread pool serves both.
            extra_compile_args=["-O3", "-march=native", "-fopenmp"],
            optional=True,
        )
    )
    # torch's default backend: ninja where it is installed compiles the five sources in
    # parallel (pip install -e . took 81 s instead of 103 s on 2 cores), else it falls
    # back to one source at a time.
    cmdclass["build_ext"] = BuildExtension

setup(ext_modules=ext_modules, cmdclass=cmdclass)
