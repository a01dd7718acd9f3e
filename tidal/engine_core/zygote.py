"""The engine zygote: ``python -P -m tidal.engine_core.zygote EngineZygote FD``.

Imports the engine (torch, transformers, tidal) once, then forks one engine process per
request of the launcher's ``ForkServer`` (``tidal.utils.forkserver``), each running an
``EngineLaunch`` payload exactly as a cold ``python -m tidal.engine_core.entry`` would. A
joining engine of an elastic scale-up then starts in a fraction of a second instead of
spending seconds importing (docs/architecture.md#elastic-protocol).
"""

from __future__ import annotations

import os
import sys

from tidal.engine_core.entry import run_launch
from tidal.utils.forkserver import serve_forks
from tidal.utils.proctitle import set_process_name


def main() -> None:
    set_process_name(sys.argv[1] if len(sys.argv) > 1 else "EngineZygote")
    serve_forks(int(sys.argv[2]), run_launch)
    # The launcher closed the channel: nothing is left to do but flush. The interpreter's
    # teardown (torch's and transformers' modules) took half a second of every elastic
    # deployment's stop, which waits for the zygote to exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
