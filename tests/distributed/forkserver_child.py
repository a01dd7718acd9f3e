"""A zygote for tests/distributed/test_forkserver.py: ``serve_forks`` with a child that
runs a msgpack ``[path, seconds, exit_code]`` payload: it writes its pid, parent pid and
process group to ``path``, sleeps, and exits with ``exit_code``."""

from __future__ import annotations

import os
import sys
import time

import msgspec

from tidal.utils.forkserver import serve_forks


def run(payload: bytes) -> None:
    path, seconds, code = msgspec.msgpack.decode(payload)
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {os.getppid()} {os.getpgid(0)}")
    os.replace(path + ".tmp", path)
    time.sleep(seconds)
    os._exit(code)


if __name__ == "__main__":
    serve_forks(int(sys.argv[2]), run)
