"""Stable engine identity and the live topology of a deployment (docs/architecture.md#elastic-identity).

Two numbers used to be one:

- ``engine_id``: which engine *process* this is. Unique for the life of the deployment
  and never reused, so a late message from an engine that has gone can never be taken
  for one from its successor. It is the ZMQ identity (2 bytes, little-endian), the key of
  every table (coordinator, balancer, clients) and the ``engine`` label in logs and stats.
- DP rank: the engine's *position* in the current ``Topology``. It changes when an
  engine before it is removed; the collectives and the expert placement use it. With
  tensor parallelism (``tp_size`` workers per engine) the EP ranks are the workers:
  worker t of the engine at position d is EP rank ``d * tp_size + t``, and the placement
  has one row per worker.

At launch the ids are ``0..N-1`` (so id == rank and nothing changes for a fixed-size
deployment); a new engine gets ``next_id`` (the largest id ever handed out + 1).

Each reconfiguration makes ``epoch + 1``. A message whose meaning depends on the
topology (which ids a load snapshot describes, the placement, the store) carries the
epoch, and a receiver that already has a newer topology drops it: a stale snapshot must
never resurrect a removed engine. Messages keyed by engine id alone (a wake-up, a
``start_wave``) mean the same in every epoch and need none.

Pure: imports only msgspec and the standard library (bottom layer).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

# The engine id is the ZMQ identity, 2 bytes little-endian; since ids are never reused
# this bounds the number of engines started over a deployment's life, not its size.
MAX_ENGINE_ID = 2**16 - 1


class Topology(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Which engines form the DP/EP group in ``epoch``, in rank order.

    Frozen: a change is a new ``Topology`` (``with_engines``) with ``epoch + 1``. The lists
    are not copied; treat them as read-only.
    """

    epoch: int
    engine_ids: list[int]  # position = DP rank = EP rank
    # Smallest id never handed out (the allocator). At least ``max(engine_ids) + 1``: a
    # smaller value is raised to that on construction.
    next_id: int = 0
    # Expert placement, one row per EP rank (the engines' workers, in position then TP
    # rank order): the logical expert in each local slot of that rank
    # (``ExpertPlacement.local_expert_ids``). None when the deployment has no EP
    # placement to agree on.
    placement: list[list[int]] | None = None
    # TCPStore (``host:port``) of this epoch's stateless DP/EP groups; None = launch default.
    store_address: str | None = None
    # Workers per engine (tensor parallelism); the same for every engine, every epoch.
    tp_size: int = 1

    def __post_init__(self) -> None:
        # Runs on construction and on decode (msgspec turns ValueError into a
        # ValidationError there), so a malformed topology never gets into a table.
        if not _is_int(self.epoch) or self.epoch < 0:
            raise ValueError(f"topology epoch must be an int >= 0, got {self.epoch!r}")
        ids = self.engine_ids
        if not ids:
            raise ValueError("a topology needs at least one engine")
        bad = [e for e in ids if not _is_int(e) or not 0 <= e <= MAX_ENGINE_ID]
        if bad:
            raise ValueError(f"engine ids must be ints in [0, {MAX_ENGINE_ID}], got {bad}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"engine ids must be unique, got {ids}")
        if not _is_int(self.next_id) or self.next_id > MAX_ENGINE_ID + 1:
            raise ValueError(f"next_id must be an int <= {MAX_ENGINE_ID + 1}, got {self.next_id}")
        if self.next_id <= max(ids):
            msgspec.structs.force_setattr(self, "next_id", max(ids) + 1)
        if not _is_int(self.tp_size) or self.tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {self.tp_size!r}")
        if self.placement is not None:
            _check_placement(self.placement, len(ids) * self.tp_size)

    # ---------------------------------------------------------------- construction

    @classmethod
    def initial(
        cls,
        num_engines: int,
        *,
        placement: list[list[int]] | None = None,
        store_address: str | None = None,
        tp_size: int = 1,
    ) -> Topology:
        """The launch topology: epoch 0, engine ids ``0..num_engines-1`` (id == rank)."""
        if not _is_int(num_engines) or num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines!r}")
        return cls(0, list(range(num_engines)), num_engines, placement, store_address, tp_size)

    def with_engines(
        self,
        engine_ids: Iterable[int],
        *,
        placement: list[list[int]] | None = None,
        store_address: str | None = None,
    ) -> Topology:
        """The next epoch with ``engine_ids`` in this rank order.

        Each id is a current engine or a fresh one (``>= next_id``, see
        ``new_engine_ids``); an id handed out before and no longer in the topology (a
        removed or rolled-back engine) is refused, since ids are never reused. Placement
        and store describe the new positions and groups, so they are never carried over."""
        ids = list(engine_ids)
        current = set(self.engine_ids)
        reused = [e for e in ids if _is_int(e) and e not in current and e < self.next_id]
        if reused:
            raise ValueError(
                f"engine ids {reused} were used before (ids are never reused); "
                f"new engines take ids >= {self.next_id}"
            )
        next_id = max([self.next_id, *(e + 1 for e in ids if _is_int(e))])
        return Topology(self.epoch + 1, ids, next_id, placement, store_address, self.tp_size)

    def without(self, engine_ids: Iterable[int]) -> Topology:
        """The next epoch with ``engine_ids`` removed (any position; survivors keep order)."""
        gone = set(engine_ids)
        unknown = gone - set(self.engine_ids)
        if unknown:
            raise ValueError(f"engines {sorted(unknown)} are not in {self.engine_ids}")
        return self.with_engines(e for e in self.engine_ids if e not in gone)

    def grown(self, num_new: int) -> Topology:
        """The next epoch with ``num_new`` fresh engines appended (highest ranks)."""
        return self.with_engines([*self.engine_ids, *self.new_engine_ids(num_new)])

    def new_engine_ids(self, n: int) -> list[int]:
        """The ids the next ``n`` new engines get (pure: nothing is marked used until a
        topology holding them, or ``retire_ids``, is adopted)."""
        if not _is_int(n) or n < 0:
            raise ValueError(f"cannot allocate {n!r} engine ids")
        if self.next_id + n > MAX_ENGINE_ID + 1:
            raise ValueError(f"engine ids exhausted: {n} more would pass {MAX_ENGINE_ID}")
        return list(range(self.next_id, self.next_id + n))

    def retire_ids(self, engine_ids: Iterable[int]) -> Topology:
        """This topology with ``engine_ids`` marked used although they never joined (a
        rolled-back scale-up whose processes may still send a late message): the next
        attempt gets new ids. Same epoch and members: only the allocator moved, so
        nothing keyed by the epoch changes."""
        top = max(engine_ids, default=-1)
        return msgspec.structs.replace(self, next_id=max(self.next_id, top + 1))

    # ---------------------------------------------------------------- lookups

    @property
    def size(self) -> int:
        """The live DP size (engines)."""
        return len(self.engine_ids)

    @property
    def ep_size(self) -> int:
        """EP ranks: every worker of every engine."""
        return len(self.engine_ids) * self.tp_size

    @property
    def next_engine_id(self) -> int:
        """The id the next new engine gets (``new_engine_ids(1)[0]``)."""
        return self.next_id

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self.engine_ids

    def rank_of(self, engine_id: int) -> int:
        """The DP/EP rank (position) of ``engine_id``; KeyError if it is not a member."""
        try:
            return self.engine_ids.index(engine_id)
        except ValueError:
            raise KeyError(
                f"engine {engine_id} is not in topology epoch {self.epoch} "
                f"(engines {self.engine_ids})"
            ) from None

    def engine_at(self, rank: int) -> int:
        """The engine id at DP rank ``rank``; ValueError naming the valid ranks."""
        if not _is_int(rank) or not 0 <= rank < self.size:
            raise ValueError(
                f"data_parallel_rank={rank!r} is out of range: this deployment has "
                f"{self.size} DP rank(s), valid ranks are 0..{self.size - 1}"
            )
        return self.engine_ids[rank]

    def same_members(self, other: Topology) -> bool:
        """Same engines in the same order (the allocator state may differ)."""
        return self.engine_ids == other.engine_ids

    def supersedes(self, current: Topology) -> bool:
        """Whether a holder of ``current`` should move to this topology: True when it is
        newer, False when it is stale or a repeat. Two different topologies for one epoch
        mean two commits disagree: ValueError, never a silent pick."""
        if self.epoch == current.epoch and not self.same_members(current):
            raise ValueError(
                f"two topologies for epoch {self.epoch}: {current.engine_ids} and {self.engine_ids}"
            )
        return self.epoch > current.epoch


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_placement(placement: Sequence[Sequence[int]], size: int) -> None:
    if len(placement) != size:
        raise ValueError(f"placement has {len(placement)} rows for {size} EP ranks")
    slots = {len(row) for row in placement}
    if len(slots) != 1:
        raise ValueError(f"every rank must hold the same number of expert slots, got {slots}")
    for rank, row in enumerate(placement):
        if any(not _is_int(e) or e < 0 for e in row):
            raise ValueError(f"placement row {rank} has invalid expert ids: {row}")
        if len(set(row)) != len(row):
            raise ValueError(f"rank {rank} holds an expert twice: {row}")
