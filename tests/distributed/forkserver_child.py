"""A zygote for tests/distributed/test_forkserver.py: ``serve_forks`` with a child that
runs a msgpack ``[path, seconds, exit_code]`` payload: it writes its pid, parent pid and
process group to ``path``, sleeps, and exits with ``exit_code``. With
``FORKSERVER_CHILD_SLOW_FORK_S`` the zygote sleeps that long before each fork; with
``FORKSERVER_CHILD_IMPORT_S`` it is not ready for that long, with
``FORKSERVER_CHILD_DIE_BEFORE_READY`` it exits with that code before it is."""

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


def _slow_fork(seconds: float):
    fork = os.fork

    def slow() -> int:  # the zygote takes its time before each fork (test_forkserver)
        time.sleep(seconds)
        return fork()

    return slow


if __name__ == "__main__":
    # Not ready yet: still "importing" this long, or dying first with this exit code.
    time.sleep(float(os.environ.get("FORKSERVER_CHILD_IMPORT_S", "0")))
    if "FORKSERVER_CHILD_DIE_BEFORE_READY" in os.environ:
        os._exit(int(os.environ["FORKSERVER_CHILD_DIE_BEFORE_READY"]))
    delay = float(os.environ.get("FORKSERVER_CHILD_SLOW_FORK_S", "0"))
    if delay:
        os.fork = _slow_fork(delay)
    serve_forks(int(sys.argv[2]), run)
