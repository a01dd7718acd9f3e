"""Name a process so ``ps``/``top``/psutil show what it is (Linux ``comm``, 15 chars)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15


def set_process_name(name: str) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except OSError:
        pass  # naming is a convenience, never a reason to fail
