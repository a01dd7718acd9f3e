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

A short OpenMP spin has a price inside a forward: between two kernels (a few microseconds
of Python) the threads fall asleep, and every kernel pays a futex wake-up. So an engine
process beside a frontend also runs Tidal's C++ kernels on their own spin pool
(``tidal/kernels/csrc/pool.h``), whose workers spin ``POOL_SPIN_US`` after each kernel
(through the gaps of a forward) and sleep between steps; torch's own ops stay on OpenMP.

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
# The C++ kernels' spin pool: microseconds its workers spin after a kernel, then sleep; 0 or
# unset: the kernels run on OpenMP. Set at spawn with the wait variables above (an operator
# who sets their own keeps OpenMP for the kernels too, unless they set this as well).
SPIN_POOL_ENV = "TIDAL_CPU_SPIN_US"
POOL_SPIN_US = 200
MAX_POOL_SPIN_US = 1_000_000
# Every variable engine_process_env sets, or leaves to an operator who set it.
ENGINE_VARS = (*_WAIT_VARS, SPIN_POOL_ENV, "OMP_NUM_THREADS")


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
        if SPIN_POOL_ENV not in parent_env:
            env[SPIN_POOL_ENV] = str(POOL_SPIN_US)
    if "OMP_NUM_THREADS" not in parent_env:
        env["OMP_NUM_THREADS"] = str(threads_per_rank(cores, local_ranks))
    return env


def pool_spin_us(env: Mapping[str, str]) -> int:
    """The kernels' spin pool window ``env`` asks for (``SPIN_POOL_ENV``), 0 (OpenMP) when
    unset; a value that is not an integer in [0, ``MAX_POOL_SPIN_US``] is a ValueError
    naming the variable."""
    raw = env.get(SPIN_POOL_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_POOL_SPIN_US:
        raise ValueError(f"{SPIN_POOL_ENV}={raw!r}: expected an integer in [0, {MAX_POOL_SPIN_US}]")
    return value
