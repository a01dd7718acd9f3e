"""Run the Triton kernels on CPU through the Triton interpreter when there is no GPU.

Why here and how: triton decides "interpreted or compiled" when a function is decorated
with ``@triton.jit`` (it reads ``TRITON_INTERPRET`` then), and its own library functions
(``tl.zeros``, ``tl.sum``, ...) are decorated when ``triton`` is first imported. So the
mode is per process and must be chosen before ``import triton``. This conftest (loaded
when pytest collects tests/kernels) therefore:

- with a CUDA GPU: does nothing; kernels are compiled and the tests use CUDA tensors;
- without one: sets ``TRITON_INTERPRET=1``, imports triton, pins the mode in triton's
  in-process knob and removes the variable again, so that processes started later by
  other test directories do not inherit it. The mode itself stays on in this process
  (harmless without a GPU: nothing else can launch Triton kernels on CPU).

If something imported triton in compiled mode earlier in the same pytest process (a test
module of another directory importing ``tidal.kernels.fused_moe`` at module level), the
interpreter cannot be enabled any more: every kernel test then fails with that reason.
Fix: import the Triton kernels lazily there, or run ``pytest tests/kernels`` on its own.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_VAR = "TRITON_INTERPRET"


def _enable_interpreter() -> str | None:
    """Put triton in interpreter mode for this process; the reason it cannot, or None."""
    if torch.cuda.is_available():
        return None
    if "triton" in sys.modules:
        import triton

        if triton.knobs.runtime.interpret:
            return None
        return (
            "triton was imported in compiled mode before tests/kernels/conftest.py could "
            f"set {_VAR}=1; run `pytest tests/kernels` in its own process"
        )
    preset = os.environ.get(_VAR)
    os.environ[_VAR] = "1"
    try:
        import triton
        import triton.language  # noqa: F401  (decorates triton's own library functions)
    finally:
        if preset is None:
            del os.environ[_VAR]
        else:
            os.environ[_VAR] = preset
    knobs = triton.knobs
    knobs.propagate_env, saved = False, knobs.propagate_env
    try:
        knobs.runtime.interpret = True  # in-process only: not written back to os.environ
    finally:
        knobs.propagate_env = saved
    return None


_UNAVAILABLE = _enable_interpreter()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _kernel_env():
    if _UNAVAILABLE:
        pytest.fail(_UNAVAILABLE)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the interpreter is numpy-bound; 2 shared cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def device() -> str:
    return DEVICE
