"""Plan one elastic EP reconfiguration (docs/architecture.md#elastic-protocol). Pure: no torch, no I/O.

``plan_scale(topology, new_size, num_experts, ...)`` answers, before anything moves:

- the new ``Topology`` (``epoch + 1``): survivors keep their relative order (their DP/EP
  rank is their new position), fresh engines are appended with ids from the allocator
  (``topology.new_engine_ids``; ids are never reused);
- which engines leave: dead ones (always), explicitly named ones (e.g. a middle rank),
  then the highest ranks until the size fits -- their unfinished requests migrate (docs/architecture.md#elastic-migration);
- the new expert placement with the fewest copies to move (``min_move_placement``,
  provably optimal, below; ``moe.placement.resize`` is a greedy that can move more when
  the current placement holds replicas);
- the transfer list: every expert copy some engine of the new topology needs and does not
  hold, from a live current owner (``moe.placement.plan_moves`` spreads the sends over the
  owners, fewest sends first) or from disk when no live engine holds it;
- bytes moved and the minimum for that placement change.

Why bytes moved equals the minimum (and the tests check it independently): a copy must
cross the network (or come from disk) exactly when the engine at a new rank needs an
expert it does not hold under the old placement; ``plan_moves`` emits exactly one
transfer for each such (engine, expert) pair, turns an expert the engine already holds
in another slot into a free slot-to-slot copy, and emits nothing for one already in place.
``min_copies`` is computed here from the placements alone, not from the move list.

Why ``min_move_placement`` is optimal. Let ``S`` be the new slots per rank, ``P`` the
new physical slots, ``O_n`` what the engine at new rank ``n`` holds now (empty for a new
engine), ``c_n = min(S, |O_n|)`` the most it can keep. A placement keeps ``T`` copies in
place and moves ``P - T``. Keeping ``T`` copies covering ``U`` distinct experts leaves
``E - U`` experts to place in the ``P - T`` other slots, so ``E - U <= P - T``. ``U`` is
at most ``M``, the maximum matching of experts to ranks holding them (rank ``n`` taking
at most ``c_n``), and ``T <= sum(c_n)``; so every placement moves at least
``max(P - sum(c_n), E - M)`` copies. The construction meets that bound: keep a maximum
matching (``M`` distinct experts), keep more of each rank's own experts while the free
slots still exceed the uncovered experts, put each uncovered expert in a free slot, and
fill what is left with replicas (by load).

Tensor parallelism: the EP ranks are the workers (``topology.tp_size`` per engine, worker t
of the engine at position d is EP rank ``d * tp + t``). Placements, the optimal
placement and the moves are computed over workers; engines join and leave whole, with
all their workers, and each transfer names its source and destination worker.

Validation (``ScalePlanError``, a ``ValueError``: the API answers 400 with its message):
a size below 1, above the number of experts (every rank needs at least one expert of its
own), or below the smallest size whose placement can hold every expert plus the
redundant copies (``min_size``), named in the message.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tidal.moe.placement import (
    DISK,
    ExpertPlacement,
    PlacementStrategy,
    fill_free_slots,  # the same replica rule as every other placement constructor
    place_uncovered,
    plan_moves,
)
from tidal.protocol.elastic import ExpertTransferSpec
from tidal.protocol.topology import Topology


class ScalePlanError(ValueError):
    """A scale request that cannot be planned. ``minimum`` / ``maximum`` give the valid
    size range when the size is what is wrong (for the API's error body)."""

    def __init__(
        self, message: str, *, minimum: int | None = None, maximum: int | None = None
    ) -> None:
        super().__init__(message)
        self.minimum = minimum
        self.maximum = maximum


# ---------------------------------------------------------------------------- sizes


def min_size(num_experts: int, num_redundant: int = 0, tp_size: int = 1) -> int:
    """The smallest DP size whose placement can serve: an EP rank (worker) holds at most
    one copy of each expert, so ``ceil((E + R) / n) <= E`` slots per rank, i.e.
    ``n >= ceil((E+R)/E)`` EP ranks, ``tp_size`` of them per engine."""
    _check_expert_counts(num_experts, num_redundant)
    return math.ceil(math.ceil((num_experts + num_redundant) / num_experts) / tp_size)


def max_size(num_experts: int, tp_size: int = 1) -> int:
    """The largest DP size: every EP rank (worker) must own at least one expert
    (docs/architecture.md#elastic-api)."""
    _check_expert_counts(num_experts, 0)
    return num_experts // tp_size


def validate_size(
    new_size: object, num_experts: int, num_redundant: int = 0, tp_size: int = 1
) -> int:
    """``new_size`` if a deployment of ``num_experts`` (+ redundant copies) can run at it
    with ``tp_size`` workers per engine, else ScalePlanError naming the valid range."""
    lo, hi = min_size(num_experts, num_redundant, tp_size), max_size(num_experts, tp_size)
    if not isinstance(new_size, int) or isinstance(new_size, bool):
        raise ScalePlanError(
            f"new_data_parallel_size must be an integer, got {new_size!r}", minimum=lo, maximum=hi
        )
    if new_size < 1:
        raise ScalePlanError(
            f"new_data_parallel_size must be >= 1, got {new_size}", minimum=lo, maximum=hi
        )
    if new_size > hi:
        per = "" if tp_size == 1 else f" x tensor_parallel_size {tp_size}"
        raise ScalePlanError(
            f"new_data_parallel_size={new_size}{per} is above the number of experts "
            f"({num_experts}): every rank needs at least one expert; the maximum is {hi}",
            minimum=lo,
            maximum=hi,
        )
    if new_size < lo:
        raise ScalePlanError(
            f"new_data_parallel_size={new_size} cannot serve {num_experts} experts with "
            f"{num_redundant} redundant copies (a rank holds at most one copy of each "
            f"expert); the minimum is {lo}",
            minimum=lo,
            maximum=hi,
        )
    return new_size


def expert_nbytes(
    hidden_size: int, moe_intermediate_size: int, num_moe_layers: int, dtype_bytes: int
) -> int:
    """Bytes of one logical expert over all MoE layers: ``w13 [2I, H]`` + ``w2 [H, I]``
    per layer (the placement is the same in every layer, so an expert moves whole)."""
    return 3 * hidden_size * moe_intermediate_size * num_moe_layers * dtype_bytes


def _check_expert_counts(num_experts: int, num_redundant: int) -> None:
    if num_experts < 1:
        raise ScalePlanError(f"num_experts must be >= 1, got {num_experts}")
    if num_redundant < 0:
        raise ScalePlanError(f"num_redundant must be >= 0, got {num_redundant}")


# ---------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class ExpertTransfer:
    """One expert copy over the network (``src_engine`` a live current owner) or from disk
    (``src_engine is None``), into ``dst_engine``'s slot ``dst_slot`` of the new placement."""

    expert: int
    src_engine: int | None
    dst_engine: int
    src_slot: int  # -1 from disk
    dst_slot: int
    nbytes: int
    src_tp: int = 0  # the workers (tensor parallelism)
    dst_tp: int = 0

    @property
    def from_disk(self) -> bool:
        return self.src_engine is None

    def spec(self) -> ExpertTransferSpec:
        return ExpertTransferSpec(
            expert=self.expert,
            dst_engine_id=self.dst_engine,
            dst_slot=self.dst_slot,
            src_engine_id=self.src_engine,
            src_slot=self.src_slot,
            nbytes=self.nbytes,
            src_tp_rank=self.src_tp,
            dst_tp_rank=self.dst_tp,
        )


@dataclass(frozen=True)
class SlotMove:
    """An expert an engine already holds moves to another local slot: a local copy at
    install time, no network and no bytes counted."""

    expert: int
    engine: int
    src_slot: int
    dst_slot: int
    tp: int = 0  # the engine's worker


@dataclass(frozen=True)
class ScalePlan:
    old_topology: Topology
    new_topology: Topology  # epoch + 1, with the new placement
    old_placement: ExpertPlacement
    new_placement: ExpertPlacement
    rank_map: Mapping[int, int]  # surviving engines: old rank -> new rank
    surviving: tuple[int, ...]  # engine ids in both topologies (new rank order)
    leaving: tuple[int, ...]  # in the old topology only: their requests migrate
    joining: tuple[int, ...]  # in the new topology only: fresh engines
    dead: tuple[int, ...]  # leaving engines that cannot send (no copy is taken from them)
    transfers: tuple[ExpertTransfer, ...]
    slot_moves: tuple[SlotMove, ...]
    bytes_per_expert: int
    # (engine, expert) pairs of the new placement whose engine does not hold that expert
    # under the old one: no plan can move fewer copies for this placement change.
    min_copies: int

    @property
    def from_size(self) -> int:
        return self.old_topology.size

    @property
    def to_size(self) -> int:
        return self.new_topology.size

    @property
    def epoch(self) -> int:
        return self.new_topology.epoch

    @property
    def participants(self) -> tuple[int, ...]:
        """Every engine with a part in the operation: current members, then joiners."""
        return (*self.old_topology.engine_ids, *self.joining)

    @property
    def alive_participants(self) -> tuple[int, ...]:
        return tuple(e for e in self.participants if e not in self.dead)

    @property
    def experts_moved(self) -> int:
        return len(self.transfers)

    @property
    def p2p_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers if not t.from_disk)

    @property
    def disk_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.from_disk)

    @property
    def bytes_moved(self) -> int:
        return self.p2p_bytes + self.disk_bytes

    @property
    def min_bytes(self) -> int:
        return self.min_copies * self.bytes_per_expert

    def sends_of(self, engine_id: int) -> tuple[ExpertTransfer, ...]:
        """Copies ``engine_id`` sends (in transfer-list order, which both ends follow)."""
        return tuple(t for t in self.transfers if t.src_engine == engine_id)

    def receives_of(self, engine_id: int) -> tuple[ExpertTransfer, ...]:
        """Copies ``engine_id`` receives, from peers or disk."""
        return tuple(t for t in self.transfers if t.dst_engine == engine_id)

    def transfer_specs(self) -> list[ExpertTransferSpec]:
        return [t.spec() for t in self.transfers]


def plan_scale(
    topology: Topology,
    new_size: int,
    num_experts: int,
    num_redundant: int = 0,
    *,
    bytes_per_expert: int = 0,
    remove: Iterable[int] = (),
    dead: Iterable[int] = (),
    strategy: PlacementStrategy | str = PlacementStrategy.LINEAR,
    load: Sequence[float] | None = None,
    store_address: str | None = None,
    rebuild: bool = False,
) -> ScalePlan:
    """Plan the change from ``topology`` to ``new_size`` engines.

    ``rebuild``: the same engines may stay (a new epoch with fresh groups: a collective
    failed with nobody dead, docs/architecture.md#faults); otherwise that is "nothing to change".

    ``remove``: engine ids that must leave (any rank, e.g. a middle one); ``dead``:
    engines that are gone (they leave, and no expert is copied from them). If the size
    still needs fewer engines, the highest ranks leave too; if it needs more, fresh
    engines join (so removing one engine at an unchanged size replaces it). ``load``
    (per logical expert) chooses which experts get the spare replica slots.
    ``topology.placement`` is the current placement; without one, the launch placement
    (``strategy``) of the current size is assumed.
    """
    tp = topology.tp_size
    validate_size(new_size, num_experts, num_redundant, tp)
    if bytes_per_expert < 0:
        raise ScalePlanError(f"bytes_per_expert must be >= 0, got {bytes_per_expert}")
    old_ids = list(topology.engine_ids)
    dead_set = _members(dead, topology, "dead")
    must_go = _members(remove, topology, "remove") | dead_set
    survivors = [e for e in old_ids if e not in must_go]
    while len(survivors) > new_size:  # default: the highest ranks leave
        survivors.pop()
    if survivors == old_ids and new_size == len(old_ids) and not rebuild:
        raise ScalePlanError(
            f"the deployment already has {new_size} engine(s) {old_ids}: nothing to change"
        )
    try:
        joining = topology.new_engine_ids(new_size - len(survivors))
    except ValueError as e:
        raise ScalePlanError(str(e)) from None
    keep = set(survivors)
    leaving = [e for e in old_ids if e not in keep]
    old = _current_placement(topology, num_experts, num_redundant, strategy)
    rank_map = {topology.rank_of(e): n for n, e in enumerate(survivors)}  # engines
    worker_map = {o * tp + t: n * tp + t for o, n in rank_map.items() for t in range(tp)}
    new = min_move_placement(old, new_size * tp, num_redundant, worker_map, load)
    new_ids = [*survivors, *joining]
    new_topology = topology.with_engines(
        new_ids,
        placement=[new.local_expert_ids(r) for r in range(new_size * tp)],
        store_address=store_address,
    )
    moves = plan_moves(
        old,
        new,
        rank_map=worker_map,
        unavailable_ranks=[topology.rank_of(e) * tp + t for e in dead_set for t in range(tp)],
    )
    transfers: list[ExpertTransfer] = []
    slot_moves: list[SlotMove] = []
    for m in moves:  # worker ranks -> (engine, TP rank)
        dst, dst_tp = new_ids[m.dst_rank // tp], m.dst_rank % tp
        if m.local:
            slot_moves.append(SlotMove(m.logical_expert, dst, m.src_slot, m.dst_slot, dst_tp))
            continue
        src = None if m.src_rank == DISK else old_ids[m.src_rank // tp]
        src_tp = 0 if m.src_rank == DISK else m.src_rank % tp
        transfers.append(
            ExpertTransfer(
                m.logical_expert,
                src,
                dst,
                m.src_slot,
                m.dst_slot,
                bytes_per_expert,
                src_tp,
                dst_tp,
            )  # fmt: skip
        )
    return ScalePlan(
        old_topology=topology,
        new_topology=new_topology,
        old_placement=old,
        new_placement=new,
        rank_map=rank_map,
        surviving=tuple(survivors),
        leaving=tuple(leaving),
        joining=tuple(joining),
        dead=tuple(e for e in old_ids if e in dead_set),
        transfers=tuple(transfers),
        slot_moves=tuple(slot_moves),
        bytes_per_expert=bytes_per_expert,
        min_copies=required_copies(topology, old, new_ids, new),
    )


def min_move_placement(
    old: ExpertPlacement,
    new_size: int,
    num_redundant: int = 0,
    rank_map: Mapping[int, int] | None = None,
    load: Sequence[float] | None = None,
) -> ExpertPlacement:
    """A placement for ``new_size`` ranks that moves the fewest expert copies from ``old``
    (proof in the module docstring). ``rank_map``: old rank -> new rank of the engines
    that stay (default: rank r stays rank r). Spare slots get replicas by ``load``."""
    E = old.num_logical_experts
    validate_size(new_size, E, num_redundant)
    S = math.ceil((E + num_redundant) / new_size)
    P = S * new_size
    if rank_map is None:
        rank_map = {r: r for r in range(min(old.ep_size, new_size))}
    held: list[list[int]] = [[] for _ in range(new_size)]
    for o, n in rank_map.items():
        held[n] = old.local_expert_ids(o)
    cap = [min(S, len(h)) for h in held]
    # 1. Maximum matching expert -> a rank holding it (augmenting paths; rank n takes at
    #    most cap[n]): the most distinct experts that can stay where they are.
    holders: dict[int, list[int]] = {}
    for n, h in enumerate(held):
        for e in h:
            holders.setdefault(e, []).append(n)
    kept: list[list[int]] = [[] for _ in range(new_size)]

    def augment(e: int, seen: set[int]) -> bool:
        for n in holders.get(e, ()):
            if n in seen:
                continue
            seen.add(n)
            if len(kept[n]) < cap[n]:
                kept[n].append(e)
                return True
            for other in list(kept[n]):
                if augment(other, seen):
                    kept[n].remove(other)
                    kept[n].append(e)
                    return True
        return False

    matched = sum(augment(e, set()) for e in range(E))
    # 2. Keep more of each rank's own experts while the free slots still exceed what is
    #    left uncovered (so every expert still finds a slot).
    extra = min(sum(cap), P - E + matched) - matched
    for n, h in enumerate(held):
        for e in h:
            if extra <= 0 or len(kept[n]) >= cap[n]:
                break
            if e not in kept[n]:
                kept[n].append(e)
                extra -= 1
    # 3. Each uncovered expert into a free slot, least-filled rank first (spreads them).
    layout: list[list[int | None]] = [[e for e in h if e in k] for k, h in zip(kept, held)]
    place_uncovered(layout, E, S, {e for k in kept for e in k})
    # 4. Replicas (each a copy whatever it is) by load, like every other placement.
    for row in layout:
        row += [None] * (S - len(row))
    return ExpertPlacement.from_layout(E, fill_free_slots(layout, E, load))


def required_copies(
    old_topology: Topology,
    old: ExpertPlacement,
    new_engine_ids: Sequence[int],
    new: ExpertPlacement,
) -> int:
    """(worker, expert) pairs of ``new`` whose worker does not hold that expert in ``old``:
    each needs one copy over the network or from disk, whatever the move plan."""
    tp = old_topology.tp_size
    rank = {e: r for r, e in enumerate(old_topology.engine_ids)}
    count = 0
    for n, engine in enumerate(new_engine_ids):
        for t in range(tp):
            if engine in rank:
                held = set(old.local_expert_ids(rank[engine] * tp + t))
            else:
                held = set()
            count += sum(1 for e in new.local_expert_ids(n * tp + t) if e not in held)
    return count


def _members(ids: Iterable[int], topology: Topology, what: str) -> set[int]:
    out = set(ids)
    unknown = sorted(e for e in out if e not in topology)
    if unknown:
        raise ScalePlanError(
            f"cannot {what} engines {unknown}: not in the current topology "
            f"(epoch {topology.epoch}, engines {topology.engine_ids})"
        )
    return out


def _current_placement(
    topology: Topology,
    num_experts: int,
    num_redundant: int,
    strategy: PlacementStrategy | str,
) -> ExpertPlacement:
    if topology.placement is None:
        try:
            return ExpertPlacement.build(strategy, num_experts, topology.ep_size, num_redundant)
        except ValueError as e:
            raise ScalePlanError(f"no placement for the current size: {e}") from None
    try:
        return ExpertPlacement.from_layout(num_experts, topology.placement)
    except ValueError as e:
        raise ScalePlanError(
            f"the current topology's placement does not fit {num_experts} experts: {e}"
        ) from None
