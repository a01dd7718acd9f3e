"""The DP coordinator process's entry point: ``python -m tidal.dp_coordinator.entry``.

Started by ``DPCoordinator`` as a fresh interpreter (``tidal.utils.procs``), never with
multiprocessing's spawn, which would re-run the user's ``__main__``. It reads one
``CoordinatorLaunch`` (msgspec msgpack) from stdin.
"""

from __future__ import annotations

import msgspec

from tidal.dp_coordinator.proc import CoordinatorLaunch, run_coordinator_launch
from tidal.utils.procs import read_child_launch


def main() -> None:
    _, payload = read_child_launch()
    run_coordinator_launch(msgspec.msgpack.decode(payload, type=CoordinatorLaunch))


if __name__ == "__main__":
    main()
