"""Logical -> physical expert placement for an EP group (pure Python, no torch).

Vocabulary:
- *logical* expert: an expert of the model, ``0 <= e < E`` (what the router picks).
- *physical* expert (slot): one copy of a logical expert's weights on one rank. The EP
  group has ``P = ep_size * S`` physical slots, ``S`` per rank; physical id ``p`` lives on
  rank ``p // S`` in local slot ``p % S``. ``P - E`` slots are *redundant* replicas.

Every rank holds the same number of slots ``S`` so ``FusedMoE.w13`` has one shape
everywhere. When ``E + num_redundant`` is not a multiple of ``ep_size`` (16 experts on 3
ranks) we round ``P`` up and fill the spare slots with extra replicas (the hottest
experts when a load vector is given, else the lowest ids): uneven EP sizes are supported,
at the price of a few extra copies. A rank never holds two copies of one expert.

Routing with replicas (``route`` here, vectorised in ``moe/dispatch/base.py``):
each (token, logical expert) pair is computed by exactly one physical copy, chosen on the
token's origin rank ``o``: the copy on ``o`` itself if ``o`` holds one (no transfer),
otherwise ``replicas[e][(t + o) % n_replicas(e)]`` where ``t`` is the token's row on
``o``. The expert kernel still works in *logical* ids: since a rank holds at most one
copy of an expert, ``expert_map_for_rank(r)`` (logical id -> local slot or -1) is
well defined, and the dispatchers mask the (token, k) slots whose chosen copy lives on
another rank (id replaced by one this rank does not hold, weight 0).
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DISK = -1  # ExpertMove.src_rank when no live rank holds the expert: load it from disk


@enum.unique
class PlacementStrategy(enum.Enum):
    LINEAR = enum.auto()  # rank r holds a contiguous chunk of logical ids
    ROUND_ROBIN = enum.auto()  # logical e on rank e % ep_size


@dataclass(frozen=True)
class ExpertPlacement:
    num_logical_experts: int
    ep_size: int
    physical_to_logical: tuple[int, ...]  # [P]; slot p on rank p // S, local slot p % S

    def __post_init__(self) -> None:
        E, ep, P = self.num_logical_experts, self.ep_size, len(self.physical_to_logical)
        if E < 1 or ep < 1:
            raise ValueError(f"need num_logical_experts >= 1 and ep_size >= 1, got {E}, {ep}")
        if P % ep:
            raise ValueError(f"{P} physical slots cannot be split evenly over {ep} ranks")
        if any(not 0 <= e < E for e in self.physical_to_logical):
            raise ValueError(f"physical_to_logical has ids outside [0, {E})")
        missing = set(range(E)) - set(self.physical_to_logical)
        if missing:
            raise ValueError(f"logical experts {sorted(missing)} have no physical slot")
        for r in range(ep):
            ids = self.local_expert_ids(r)
            if len(set(ids)) != len(ids):
                raise ValueError(f"rank {r} holds an expert twice: {ids}")

    # -------------------------------------------------------------- sizes
    @property
    def num_physical_experts(self) -> int:
        return len(self.physical_to_logical)

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical_experts // self.ep_size

    @property
    def num_redundant_experts(self) -> int:
        return self.num_physical_experts - self.num_logical_experts

    # -------------------------------------------------------------- lookups
    def rank_of(self, physical: int) -> int:
        return physical // self.slots_per_rank

    def local_expert_ids(self, rank: int) -> list[int]:
        """Logical id held in each local slot of ``rank``: the weights that rank loads."""
        S = self.slots_per_rank
        return list(self.physical_to_logical[rank * S : (rank + 1) * S])

    def expert_map_for_rank(self, rank: int) -> list[int]:
        """``[E]`` logical id -> local slot on ``rank`` or -1: the expert kernel's map."""
        out = [-1] * self.num_logical_experts
        for slot, e in enumerate(self.local_expert_ids(rank)):
            out[e] = slot
        return out

    @functools.cached_property
    def logical_to_physical(self) -> tuple[tuple[int, ...], ...]:
        """``[E]`` -> ascending physical ids of that expert's replicas."""
        reps: list[list[int]] = [[] for _ in range(self.num_logical_experts)]
        for p, e in enumerate(self.physical_to_logical):
            reps[e].append(p)
        return tuple(tuple(r) for r in reps)

    def holders(self, logical: int) -> list[int]:
        """Ranks holding a copy of ``logical``, ascending."""
        return [self.rank_of(p) for p in self.logical_to_physical[logical]]

    def local_physical(self, rank: int, logical: int) -> int:
        """Physical id of ``logical``'s copy on ``rank``, or -1."""
        for p in self.logical_to_physical[logical]:
            if self.rank_of(p) == rank:
                return p
        return -1

    def route(self, logical: int, origin_rank: int, token_row: int) -> int:
        """The physical copy that computes (token, logical) — see the module docstring.
        The slow reference for the vectorised rule in ``moe/dispatch/base.py``."""
        local = self.local_physical(origin_rank, logical)
        if local >= 0:
            return local
        reps = self.logical_to_physical[logical]
        return reps[(token_row + origin_rank) % len(reps)]

    # -------------------------------------------------------------- load
    def rank_loads(self, load: Sequence[float]) -> list[float]:
        """Per-rank load if each logical expert's load splits evenly over its replicas."""
        self._check_load(load)
        out = [0.0] * self.ep_size
        for e, reps in enumerate(self.logical_to_physical):
            for p in reps:
                out[self.rank_of(p)] += load[e] / len(reps)
        return out

    def imbalance(self, load: Sequence[float]) -> float:
        """max / mean of ``rank_loads`` (1.0 is perfect balance)."""
        loads = self.rank_loads(load)
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    def _check_load(self, load: Sequence[float]) -> None:
        if len(load) != self.num_logical_experts:
            raise ValueError(f"load has {len(load)} entries, expected {self.num_logical_experts}")

    # -------------------------------------------------------------- constructors
    @classmethod
    def from_layout(cls, num_logical: int, layout: Sequence[Sequence[int]]) -> ExpertPlacement:
        """From per-rank lists of logical ids (one list per rank, all the same length)."""
        lengths = {len(r) for r in layout}
        if len(lengths) != 1:
            raise ValueError(f"every rank needs the same slot count, got {sorted(lengths)}")
        flat = tuple(e for r in layout for e in r)
        return cls(num_logical, len(layout), flat)

    @classmethod
    def linear(
        cls,
        num_logical: int,
        ep_size: int,
        num_redundant: int = 0,
        load: Sequence[float] | None = None,
    ) -> ExpertPlacement:
        """Rank r holds logical ids ``[r*S, (r+1)*S)``; spare slots (the tail) get replicas."""
        P, S = _physical_size(num_logical, ep_size, num_redundant)
        flat: list[int | None] = list(range(num_logical)) + [None] * (P - num_logical)
        layout = [flat[r * S : (r + 1) * S] for r in range(ep_size)]
        return cls.from_layout(num_logical, fill_free_slots(layout, num_logical, load))

    @classmethod
    def round_robin(
        cls,
        num_logical: int,
        ep_size: int,
        num_redundant: int = 0,
        load: Sequence[float] | None = None,
    ) -> ExpertPlacement:
        """Logical e on rank ``e % ep_size``, slot ``e // ep_size``; spare slots get replicas."""
        P, S = _physical_size(num_logical, ep_size, num_redundant)
        layout: list[list[int | None]] = [[None] * S for _ in range(ep_size)]
        for e in range(num_logical):
            layout[e % ep_size][e // ep_size] = e
        return cls.from_layout(num_logical, fill_free_slots(layout, num_logical, load))

    @classmethod
    def build(
        cls,
        strategy: PlacementStrategy | str,
        num_logical: int,
        ep_size: int,
        num_redundant: int = 0,
        load: Sequence[float] | None = None,
    ) -> ExpertPlacement:
        if isinstance(strategy, str):
            try:
                strategy = PlacementStrategy[strategy.upper()]
            except KeyError:
                names = ", ".join(s.name.lower() for s in PlacementStrategy)
                raise ValueError(
                    f"placement strategy must be one of {names}; got {strategy!r}"
                ) from None
        if strategy is PlacementStrategy.LINEAR:
            return cls.linear(num_logical, ep_size, num_redundant, load)
        return cls.round_robin(num_logical, ep_size, num_redundant, load)


def _physical_size(num_logical: int, ep_size: int, num_redundant: int) -> tuple[int, int]:
    """(P, S): ``E + R`` rounded up to a multiple of ``ep_size``."""
    if num_logical < 1 or ep_size < 1:
        raise ValueError(f"need num_logical >= 1 and ep_size >= 1, got {num_logical}, {ep_size}")
    if num_redundant < 0:
        raise ValueError(f"num_redundant must be >= 0, got {num_redundant}")
    S = math.ceil((num_logical + num_redundant) / ep_size)
    if S > num_logical:
        raise ValueError(
            f"{num_logical} experts + {num_redundant} redundant over {ep_size} ranks needs {S} "
            f"slots per rank, more than the {num_logical} distinct experts a rank can hold"
        )
    return S * ep_size, S


def place_uncovered(
    layout: list[list[int | None]], num_logical: int, slots_per_rank: int, covered: set[int]
) -> None:
    """Put every expert not in ``covered`` on the least-filled rank that has a free slot
    (ties: lowest rank), in expert order, so the newly placed experts spread over ranks.
    ``layout`` is filled in place; the placements that keep experts where they were
    (``resize`` here, ``tidal.elastic.plan``) call it for whatever they could not keep."""
    for e in range(num_logical):
        if e not in covered:
            n = min(
                (n for n in range(len(layout)) if len(layout[n]) < slots_per_rank),
                key=lambda n: (len(layout[n]), n),
            )
            layout[n].append(e)


def fill_free_slots(
    layout: list[list[int | None]], num_logical: int, load: Sequence[float] | None
) -> list[list[int]]:
    """Put a replica in every ``None`` slot: the expert with the highest load per copy that
    the slot's rank does not hold yet (ties: lowest id). Slots are visited slot-major so
    replicas spread over ranks. Always feasible because a rank holds fewer than E slots.

    ``layout``: one list per rank of ``num_logical``-expert ids, ``None`` for a free slot
    (filled in place); ``load``: per-expert load (None: uniform). Returns the completed
    layout, the input of ``ExpertPlacement.from_layout``. The one replica rule of every
    placement constructor here and of ``tidal.elastic.plan``."""
    load = [1.0] * num_logical if load is None else list(load)
    if len(load) != num_logical:
        raise ValueError(f"load has {len(load)} entries, expected {num_logical}")
    copies = [0] * num_logical
    for rank in layout:
        for e in rank:
            if e is not None:
                copies[e] += 1
    S = len(layout[0])
    for s in range(S):
        for rank in layout:
            if rank[s] is not None:
                continue
            held = set(rank)
            e = max(
                (e for e in range(num_logical) if e not in held),
                key=lambda e: (load[e] / copies[e] if copies[e] else math.inf, -e),
            )
            rank[s] = e
            copies[e] += 1
    return [[e for e in rank if e is not None] for rank in layout]  # type: ignore[misc]


# ---------------------------------------------------------------------- EPLB


def rebalance(load: Sequence[float], ep_size: int, num_redundant: int = 0) -> ExpertPlacement:
    """EPLB: a placement that evens out per-rank load.

    1. Replicate: starting from one copy each, give every extra slot to the expert with
       the highest load per copy (at most ``ep_size`` copies).
    2. Pack: copies (weight = load / copies), heaviest first, each to the least-loaded
       rank that has a free slot and no copy of that expert yet (ties: lowest rank).
    Every rank ends with the same number of slots; slots within a rank are sorted by
    logical id so the result is deterministic.
    """
    E = len(load)
    if any(x < 0 for x in load):
        raise ValueError("load counts must be >= 0")
    P, S = _physical_size(E, ep_size, num_redundant)
    copies = [1] * E
    for _ in range(P - E):
        e = max(
            (e for e in range(E) if copies[e] < ep_size),
            key=lambda e: (load[e] / copies[e], -e),
        )
        copies[e] += 1
    items = sorted(
        ((load[e] / copies[e], e) for e in range(E) for _ in range(copies[e])),
        key=lambda it: (-it[0], it[1]),
    )
    layout: list[list[int]] = [[] for _ in range(ep_size)]
    rank_load = [0.0] * ep_size
    for _, e in items:
        options = [r for r in range(ep_size) if len(layout[r]) < S and e not in layout[r]]
        if options:
            r = min(options, key=lambda r: (rank_load[r], r))
        else:
            r = _make_room(layout, e, S)
        layout[r].append(e)
        rank_load = [sum(load[x] / copies[x] for x in experts) for experts in layout]
    return ExpertPlacement.from_layout(E, [sorted(r) for r in layout])


def _make_room(layout: list[list[int]], e: int, S: int) -> int:
    """The only ranks with free slots already hold ``e``: move some other expert ``x``
    from a rank ``r`` without ``e`` to such a rank, and return ``r`` for ``e``."""
    for full in (r for r in range(len(layout)) if len(layout[r]) < S):
        for r, experts in enumerate(layout):
            if e in experts:
                continue
            for x in experts:
                if x not in layout[full]:
                    experts.remove(x)
                    layout[full].append(x)
                    return r
    raise ValueError(f"cannot place another copy of expert {e}: every rank already holds it")


# ---------------------------------------------------------------------- per-rank load


def engine_token_loads(
    layouts: Mapping[int, Sequence[int]],  # layer -> physical_to_logical [P]
    load: Mapping[int, Sequence[int]],  # layer -> tokens per logical expert [E]
    num_engines: int,
    ranks_per_engine: int = 1,
) -> list[float]:
    """``[num_engines]`` tokens routed to the experts each engine's EP ranks hold, summed
    over the layers both maps name (``/metrics``' ``tidal:expert_load_rank_tokens``).

    The EP group has ``num_engines * ranks_per_engine`` ranks (an engine's TP workers are
    consecutive EP ranks). A replicated expert's tokens are credited evenly to its copies
    (``ExpertPlacement.rank_loads``, the model EPLB plans with): the routing rule spreads
    a remote expert's tokens over its copies by token row, so this is exact for experts
    with one copy and the expected share for the others. An engine whose experts got no
    tokens reports 0."""
    if num_engines < 1 or ranks_per_engine < 1:
        raise ValueError(
            f"need num_engines >= 1 and ranks_per_engine >= 1, got {num_engines}, {ranks_per_engine}"
        )
    out = [0.0] * num_engines
    for layer, physical_to_logical in layouts.items():
        counts = load.get(layer)
        if counts is None:
            continue
        placement = ExpertPlacement(
            len(counts), num_engines * ranks_per_engine, tuple(physical_to_logical)
        )
        for rank, tokens in enumerate(placement.rank_loads(counts)):
            out[rank // ranks_per_engine] += tokens
    return out


# ---------------------------------------------------------------------- resizing


def resize(
    old: ExpertPlacement,
    new_ep_size: int,
    num_redundant: int = 0,
    load: Sequence[float] | None = None,
    rank_map: Mapping[int, int] | None = None,
) -> ExpertPlacement:
    """A placement for ``new_ep_size`` ranks that keeps experts where they already are, so
    ``plan_moves(old, resize(old, n))`` transfers as few experts as possible.

    ``rank_map``: old rank -> new rank for ranks that survive (default: old rank r is new
    rank r when ``r < new_ep_size``). Steps: each surviving rank keeps old experts that no
    earlier rank kept (up to the new slot count); experts left uncovered go to the
    least-filled ranks (new ranks first, as they are empty); spare slots keep old copies
    still on that rank, then take replicas by load.
    """
    E = old.num_logical_experts
    _, S = _physical_size(E, new_ep_size, num_redundant)
    rank_map = _default_rank_map(old.ep_size, new_ep_size) if rank_map is None else rank_map
    old_of_new = {n: o for o, n in rank_map.items()}

    def held_before(n: int) -> list[int]:
        return old.local_expert_ids(old_of_new[n]) if n in old_of_new else []

    layout: list[list[int | None]] = [[] for _ in range(new_ep_size)]
    covered: set[int] = set()
    for n in range(new_ep_size):
        for e in held_before(n):
            if e not in covered and len(layout[n]) < S:
                layout[n].append(e)
                covered.add(e)
    place_uncovered(layout, E, S, covered)
    for n in range(new_ep_size):  # spare slots: keep what is already here first
        for e in held_before(n):
            if len(layout[n]) < S and e not in layout[n]:
                layout[n].append(e)
        layout[n] += [None] * (S - len(layout[n]))
    return ExpertPlacement.from_layout(E, fill_free_slots(layout, E, load))


def _default_rank_map(old_ep: int, new_ep: int) -> dict[int, int]:
    return {r: r for r in range(min(old_ep, new_ep))}


@dataclass(frozen=True)
class ExpertMove:
    """Copy logical expert ``logical_expert`` from ``src_rank``'s slot ``src_slot`` (old
    placement, old rank numbering; ``src_rank == DISK`` means load from the checkpoint) to
    ``dst_rank``'s slot ``dst_slot`` (new placement, new numbering)."""

    logical_expert: int
    src_rank: int
    dst_rank: int
    dst_slot: int
    src_slot: int = -1
    local: bool = False  # same process: a slot-to-slot copy, no network transfer


def plan_moves(
    old: ExpertPlacement,
    new: ExpertPlacement,
    *,
    rank_map: Mapping[int, int] | None = None,
    unavailable_ranks: Sequence[int] = (),
) -> list[ExpertMove]:
    """Every copy a rank needs for ``new`` that it does not hold in the same slot under ``old``.

    A copy already on the destination rank is never transferred: if its slot changes it
    is a ``local`` move. Other copies come from a live holder under ``old`` (excluding
    ``unavailable_ranks``, e.g. a dead rank), choosing the holder with the fewest sends
    so far (ties: lowest rank) to spread the load; with no live holder, from ``DISK``.
    ``rank_map`` maps old ranks to new ranks (default: identity for surviving ranks).
    Returned in (dst_rank, dst_slot) order. Count transfers with ``num_transfers``.
    """
    if new.num_logical_experts != old.num_logical_experts:
        raise ValueError("old and new placements have different numbers of logical experts")
    rank_map = _default_rank_map(old.ep_size, new.ep_size) if rank_map is None else rank_map
    dead = set(unavailable_ranks)
    old_of_new = {n: o for o, n in rank_map.items() if o not in dead}
    sends = [0] * old.ep_size
    moves: list[ExpertMove] = []
    for n in range(new.ep_size):
        for slot, e in enumerate(new.local_expert_ids(n)):
            o = old_of_new.get(n)
            here = old.local_physical(o, e) if o is not None else -1
            if o is not None and here >= 0:
                old_slot = here - o * old.slots_per_rank
                if old_slot != slot:
                    moves.append(ExpertMove(e, o, n, slot, old_slot, local=True))
                continue
            holders = [h for h in old.holders(e) if h not in dead]
            if not holders:
                moves.append(ExpertMove(e, DISK, n, slot))
                continue
            src = min(holders, key=lambda h: (sends[h], h))
            sends[src] += 1
            src_slot = old.local_physical(src, e) - src * old.slots_per_rank
            moves.append(ExpertMove(e, src, n, slot, src_slot))
    return moves


def num_transfers(moves: Sequence[ExpertMove]) -> int:
    """Moves that cross ranks or come from disk (local slot copies excluded)."""
    return sum(1 for m in moves if not m.local)
