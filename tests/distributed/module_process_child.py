"""The child of test_module_process.py (run as ``python -m module_process_child``).

Reports on the pipe whose fd number is its launch payload: its name, the payload, its
``__main__`` module and the files loaded as a main module; then waits for
a signal, or exits with code 3 when the payload asks it to."""

from __future__ import annotations

import os
import signal
import sys

import msgspec

from tidal.utils.procs import read_child_launch

if __name__ == "__main__":
    name, payload = read_child_launch()
    launch = msgspec.msgpack.decode(payload)
    report = {
        "name": name,
        "argv": sys.argv[1:],
        "launch": launch,
        "main": sys.modules["__main__"].__spec__.name,
        # multiprocessing's spawn would load the parent's main file as __mp_main__
        "main_files": sorted(
            {
                getattr(sys.modules[m], "__file__", "")
                for m in ("__main__", "__mp_main__")
                if m in sys.modules
            }
        ),
        "pgid": os.getpgid(0),
        "env": {k: os.environ.get(k) for k in launch.get("env_keys", [])},
    }
    with os.fdopen(launch["report_fd"], "wb") as f:
        f.write(msgspec.msgpack.encode(report))
    if launch["exit_code"] is not None:
        sys.exit(launch["exit_code"])
    signal.pause()
