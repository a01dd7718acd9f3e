"""Intel OpenMP's per-process files in /dev/shm, which the benchmarks' peers leave.

vLLM preloads Intel's OpenMP runtime, which registers each process as
``/dev/shm/__KMP_REGISTERED_LIB_<pid>_<n>`` and removes the file only when the process
exits normally: a peer stopped by a signal (or exiting abruptly) leaves it. The benchmarks
that run vLLM take the set before a run and remove, after it, the new files whose
processes are gone.
"""

from __future__ import annotations

import time
from pathlib import Path

PATTERN = "__KMP_REGISTERED_LIB_*"


def registrations() -> set[Path]:
    return set(Path("/dev/shm").glob(PATTERN))


def remove_dead(new: set[Path], wait_s: float = 0.0) -> None:
    """Remove those of ``new`` whose process is gone, waiting up to ``wait_s`` for
    processes still exiting (a process group just SIGKILLed); a live one keeps its file."""
    deadline = time.monotonic() + wait_s
    for path in sorted(new):
        pid = path.name.removeprefix(PATTERN[:-1]).split("_")[0]
        while pid.isdigit() and Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
