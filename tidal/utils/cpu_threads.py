"""How an engine process's OpenMP threads wait between parallel regions, and how many
there are, by where the engine runs.

Why: OpenMP's threads spin after each parallel region before they sleep (libgomp: 300,000
spins by default, Intel's runtime: 200 ms). An engine rank beside its API server on 2
cores then holds both cores spinning between the regions of a forward and between steps,
and the API server and the engine's own I/O threads run only when the scheduler preempts
a spinner: under 16 streaming clients ``launch`` made 136-232 output tok/s at 65-114 ms
between tokens, where the same server with ``OMP_WAIT_POLICY=PASSIVE`` made 1,858-1,934 at
7 ms. Passive waiting is not free either: a sleeping thread takes a futex wake-up at every
region, which cost the single-stream offline engine in the caller's process ~28%.

So the policy depends on the deployment shape:

* the engine in the caller's process (offline ``LLM``, one CPU rank): nothing shares the
  cores between steps, so the runtime's default spin stays (it is the caller's process:
  Tidal does not change its environment);
* an engine process beside a frontend (``launch``, ``LLM(multiprocess=True)``, data
  parallel ranks, elastic joiners): its threads spin briefly (``SPIN_COUNT``: long enough
  to bridge the gaps between the parallel regions of one forward, short enough to yield
  the core to the frontend between steps), then sleep;
* several ranks on one host: each rank gets its share of the cores as its thread count.

An operator's own ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``, ``KMP_BLOCKTIME`` or
``OMP_NUM_THREADS`` wins: the defaults fill only what the environment leaves unset. They
must be in the engine's environment when it starts (the OpenMP runtime reads them when it
loads, with torch), which is why the launcher sets them at spawn.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# libgomp spins this many times after a parallel region, then sleeps on a futex and leaves
# the core to others. Measured (launch on the tiny checkpoint, aiperf, 16 streams, 2 shared
# cores, the same minutes): spin 300,000 (the default) 73-123 out tok/s at 123-194 ms per
# token; 100,000: 127-133 tok/s, 112-122 ms; 10,000: 278-302, 49-53 ms; 1,000: 650-695,
# 19-21 ms; passive (0): 637-832, 15-23 ms. 1,000 spins keep the quick wake-up between a
# forward's regions that passive waiting loses offline (single stream -28%).
SPIN_COUNT = 1_000
# Intel's OpenMP (a torch built against it, or preloaded): milliseconds of spin.
BLOCK_TIME_MS = 0
_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def threads_per_rank(cores: int, local_ranks: int) -> int:
    """Each rank on a host takes an equal share of its cores (at least one)."""
    return max(1, cores // max(1, local_ranks))


def engine_process_env(
    parent_env: Mapping[str, str], *, cores: int, local_ranks: int
) -> dict[str, str]:
    """The variables to add to an engine process's environment at spawn (beside a
    frontend, ``local_ranks`` ranks on this host of ``cores`` cores); only those the
    parent's environment does not set already."""
    env: dict[str, str] = {}
    if not any(k in parent_env for k in _WAIT_VARS):
        env["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
        env["KMP_BLOCKTIME"] = str(BLOCK_TIME_MS)
    if "OMP_NUM_THREADS" not in parent_env:
        env["OMP_NUM_THREADS"] = str(threads_per_rank(cores, local_ranks))
    return env
