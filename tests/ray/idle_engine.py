"""A stand-in engine for the Ray launcher's tests (``python -m tests.ray.idle_engine``): it
reads its launch payload (and names itself after it, as an engine does) and waits;
SIGTERM ends it with exit code 0."""

from __future__ import annotations

import signal
import threading

from tidal.utils.procs import read_child_launch

if __name__ == "__main__":
    read_child_launch()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
