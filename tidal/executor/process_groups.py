"""The process groups one worker serves with, and how a worker's place maps to its ranks in
them (docs/architecture.md#tensor-parallel). Shared by the worker (launch groups) and its elastic state (standby
groups, swapped in at a commit), so neither needs the other.

A DP rank of TP size N is N workers (TP ranks 0..N-1). With DP position ``d``:

- TP group: the rank's own N workers (its own store, the engine's), rank ``t``;
- DP group ``dp`` (TP rank 0) or ``dp.tp{t}``: the t-th workers of every DP rank, rank
  ``d``. The one of the TP-rank-0 workers carries the busy loop's consensus; each of
  them agrees the per-forward token counts for its own workers;
- EP group ``ep``: every worker of every rank, rank ``d * N + t`` (the expert placement
  has one row per worker, in that order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidal.distributed.groups import StatelessGroup


def dp_prefix(tp_rank: int) -> str:
    """Store prefix of the DP group of TP rank ``tp_rank`` (the launch one; standby ones
    add ``e{epoch}/`` before it)."""
    return "dp" if tp_rank == 0 else f"dp.tp{tp_rank}"


def worker_rank(position: int, tp_rank: int, tp_size: int) -> int:
    """The worker's rank in a group over every worker of the DP ranks (EP, transfers):
    DP position ``position``, TP rank ``tp_rank``."""
    return position * tp_size + tp_rank


@dataclass
class WorkerGroups:
    """The DP/EP groups a worker serves with now and their TCPStore client; elastic EP
    replaces them at a commit (``tidal/executor/elastic.py``)."""

    dp: StatelessGroup | None = None
    ep: StatelessGroup | None = None
    store: Any = None

    def take(self) -> list[Any]:
        """Hand over the current groups and store (for retiring), leaving none."""
        old = [g for g in (self.ep, self.dp, self.store) if g is not None]
        self.dp = self.ep = self.store = None
        return old

    def destroy(self) -> None:
        """Destroy the current groups (idempotent, waits for no peer)."""
        for g in (self.ep, self.dp):
            if g is not None:
                g.destroy()
        self.dp = self.ep = self.store = None
