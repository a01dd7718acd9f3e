"""Which CPU cores each engine rank's threads run on (docs/architecture.md#tensor-parallel): core groups
are handed out and returned like device slots (``device_slots.py``), never derived from
the engine id.

Why pin: several ranks on one host each run an OpenMP pool sized to their share of the
cores. Unpinned, the kernel scheduler moves their threads across all the cores, so one
rank's threads land on a core another rank's are using (a pool thread that waits for its
core stalls its whole parallel region) and lose their caches on each move. A rank pinned
to its own contiguous group (NUMA node by node, so a group is inside one node where it can
be) keeps its cache lines and its memory local. Measured on 2 cores (AMD EPYC Zen 4,
``benchmarks/serving.py --dp 2 --peer-ref . --launch-args '--cpu-affinity auto'
--peer-launch-args '--cpu-affinity off'``, aiperf, 16 streams, 3 rounds each, alternated):
pinned 1,281 out tok/s at 747 ms a request, unpinned 1,149 at 830 ms.

``--cpu-affinity`` (``parse_affinity``):

* ``auto``: pinned where the host runs several ranks and each of their workers (DP ranks
  x TP workers) gets at least a core: one group per local rank, ``len(cores) // ranks``
  cores each, which the rank's TP workers share: each worker's mask is the whole group and
  its thread count its share of it. They meet at every layer's all-reduce, so a worker
  whose core is taken a moment (by the rank's engine core or the frontend) must be free to
  run on its peer's (measured on 2 cores, ``launch -tp 2``, aiperf, 16 streams, 2 rounds
  each: a core per worker served 481 out tok/s, the shared mask 586). Cores the split
  leaves over are in no group: the frontend runs there. One rank alone (``launch`` with
  one rank, with or without TP, the offline engine) is never pinned: it shares every core
  with its frontend, which the kernel places best;
* ``off``: never pinned;
* an explicit list, one group per local rank, ``|``-separated, each in the kernel's cpulist
  format (``0-7|8-15``), like vLLM's ``VLLM_CPU_OMP_THREADS_BIND``.

A rank started when every group is taken (an elastic scale-up past the launch size) runs
unpinned rather than doubling up with a pinned one.

Pure: no torch; ``host_cores`` reads ``/sys`` and the affinity mask, ``pin_process`` sets it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

MAX_CPU_ID = 1 << 16  # Linux's own limit (CONFIG_NR_CPUS) is 8192
AFFINITY_HELP = "auto | off | an explicit core list per local rank, e.g. 0-7|8-15"


def parse_affinity(value: str) -> str | list[tuple[int, ...]]:
    """``auto``, ``off`` or the explicit groups of ``value``; ``ValueError`` naming what is
    wrong (the flag's check, at start)."""
    v = value.strip()
    if v in ("auto", "off"):
        return v
    try:
        groups = [tuple(parse_cpu_list(part)) for part in v.split("|")]
    except ValueError:
        groups = []
    if not groups or any(not g for g in groups):
        raise ValueError(f"cpu_affinity must be {AFFINITY_HELP}; got {value!r}")
    seen: set[int] = set()
    for g in groups:
        if seen & set(g):
            raise ValueError(f"cpu_affinity: groups overlap on cores {sorted(seen & set(g))}")
        seen |= set(g)
    return groups


def plan_groups(
    mode: str, cores: Sequence[int], local_ranks: int, tp_size: int
) -> list[tuple[int, ...]] | None:
    """The core groups of a host's ranks (one per local rank), or None: not pinned.
    ``cores``: the host's usable cores in the order to cut them (``host_cores``)."""
    parsed = parse_affinity(mode)
    if parsed == "off" or local_ranks < 1:
        return None
    if parsed == "auto":
        if local_ranks < 2 or len(cores) < local_ranks * tp_size:
            return None
        return core_groups(cores, local_ranks)
    assert isinstance(parsed, list)
    usable = set(cores)
    outside = sorted(c for g in parsed for c in g if c not in usable)
    if outside:
        raise ValueError(f"cpu_affinity: cores {outside} are not usable by this process")
    if len(parsed) < local_ranks:
        raise ValueError(
            f"cpu_affinity gives {len(parsed)} core group(s) for {local_ranks} local rank(s)"
        )
    return parsed


def core_groups(cores: Sequence[int], groups: int) -> list[tuple[int, ...]]:
    """``cores`` (in the order to cut them: NUMA node by node) cut into ``groups``
    contiguous groups of ``len(cores) // groups``; the remainder is in none."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    size = len(cores) // groups
    if size < 1:
        raise ValueError(f"{len(cores)} cores cannot make {groups} groups")
    return [tuple(cores[i * size : (i + 1) * size]) for i in range(groups)]


class CoreSlots:
    """The core groups of one host and their owners (engine ids)."""

    def __init__(self, groups: Sequence[tuple[int, ...]]) -> None:
        self.groups = [tuple(g) for g in groups]
        self._owner: dict[int, int] = {}  # group index -> engine id

    def acquire(self, owner: int) -> tuple[int, ...]:
        """The lowest free group for ``owner`` (the one it holds already, if any); ``()``
        when every group is taken: that rank runs unpinned."""
        for i, o in self._owner.items():
            if o == owner:
                return self.groups[i]
        for i, group in enumerate(self.groups):
            if i not in self._owner:
                self._owner[i] = owner
                return group
        return ()

    def release(self, owner: int) -> tuple[int, ...]:
        """Give ``owner``'s group back (idempotent)."""
        for i, o in list(self._owner.items()):
            if o == owner:
                del self._owner[i]
                return self.groups[i]
        return ()


def host_cores(sys_root: str = "/sys/devices/system/node") -> list[int]:
    """This process's usable cores, ordered NUMA node by node (then by id) so that
    contiguous groups stay inside a node where they can."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not usable:
        return list(range(os.cpu_count() or 1))
    node_of: dict[int, int] = {}
    for node_dir in sorted(Path(sys_root).glob("node[0-9]*")):
        try:
            cpus = parse_cpu_list((node_dir / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        node = int(node_dir.name[4:])
        for c in cpus:
            node_of.setdefault(c, node)
    return sorted(usable, key=lambda c: (node_of.get(c, 0), c))


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        first, last = int(lo), int(hi if dash else lo)
        if not 0 <= first <= last < MAX_CPU_ID:
            raise ValueError(f"bad cpu range {part!r}")
        out.extend(range(first, last + 1))
    return out


def pin_process(cores: Sequence[int]) -> None:
    """Pin every thread of this process to ``cores`` (threads started later inherit the
    mask of the thread that starts them)."""
    mask = set(cores)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            continue
