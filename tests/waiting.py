"""Polling for tests that wait on a condition another process brings about."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(pred: Callable[[], bool], timeout_s: float = 120.0) -> bool:
    """True as soon as ``pred()`` holds; False if it still does not after ``timeout_s``
    (generous by default: CI machines are loaded and slow, never a measure of speed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


async def wait_until_async(pred: Callable[[], bool], timeout_s: float = 120.0) -> bool:
    """``wait_until`` for a condition the running event loop brings about (it keeps
    running while this waits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.02)
    return False
