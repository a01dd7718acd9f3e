"""Where the Triton kernels serve, asked without importing triton (an optional extra,
and importing it fixes its compiled-or-interpreted mode for the process: the kernel
tests choose the interpreter first)."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_serves(device: Any) -> bool:
    """Whether a layer on ``device`` takes the Triton kernels by default: CUDA, with
    triton installed. CPU layers keep their C++ and torch paths."""
    return torch.device(device).type == "cuda" and triton_installed()
