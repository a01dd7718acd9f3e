"""plan_scale: new topology, placement with the fewest moves, transfer list, bytes vs the
minimum, validation. Pure, no processes."""

from __future__ import annotations

import itertools
import random

import msgspec
import pytest

from tidal.elastic.plan import (
    ScalePlan,
    ScalePlanError,
    expert_nbytes,
    max_size,
    min_size,
    plan_scale,
    validate_size,
)
from tidal.moe.placement import ExpertPlacement, num_transfers, plan_moves, resize
from tidal.protocol.elastic import (
    ExpertTransferSpec,
    ScaleEvent,
    ScalePrepare,
    ScaleReport,
)
from tidal.protocol.topology import MAX_ENGINE_ID, Topology

B = 1000  # bytes per expert in these tests


def _held(plan: ScalePlan, engine: int, new: bool) -> set[int]:
    topo = plan.new_topology if new else plan.old_topology
    pl = plan.new_placement if new else plan.old_placement
    return set(pl.local_expert_ids(topo.rank_of(engine))) if engine in topo else set()


def check_plan(plan: ScalePlan) -> None:
    """Every property a plan must have, checked from the placements alone."""
    old_t, new_t = plan.old_topology, plan.new_topology
    old_p, new_p = plan.old_placement, plan.new_placement
    assert new_t.epoch == old_t.epoch + 1
    assert new_t.size == new_p.ep_size == plan.to_size
    assert new_t.placement == [new_p.local_expert_ids(r) for r in range(new_t.size)]
    assert set(new_t.engine_ids) == set(plan.surviving) | set(plan.joining)
    assert list(new_t.engine_ids) == [*plan.surviving, *plan.joining]  # survivors keep order
    assert set(plan.leaving) == set(old_t.engine_ids) - set(new_t.engine_ids)
    assert all(j >= old_t.next_id for j in plan.joining)  # fresh ids, never reused
    assert set(plan.dead) <= set(plan.leaving)
    for o, n in plan.rank_map.items():
        assert new_t.engine_ids[n] == old_t.engine_ids[o]
    # Every expert is served after the change.
    assert {e for r in range(new_p.ep_size) for e in new_p.local_expert_ids(r)} == set(
        range(new_p.num_logical_experts)
    )
    # The needed copies, computed here independently of the plan's own count.
    needed = sorted(
        (engine, e)
        for engine in new_t.engine_ids
        for e in _held(plan, engine, new=True) - _held(plan, engine, new=False)
    )
    assert plan.min_copies == len(needed)
    assert sorted((t.dst_engine, t.expert) for t in plan.transfers) == needed  # exactly those
    assert plan.bytes_moved == plan.min_bytes == len(needed) * plan.bytes_per_expert
    assert plan.p2p_bytes + plan.disk_bytes == plan.bytes_moved
    assert plan.experts_moved == len(needed)
    dead = set(plan.dead)
    for t in plan.transfers:
        dst_rank = new_t.rank_of(t.dst_engine)
        assert new_p.local_expert_ids(dst_rank)[t.dst_slot] == t.expert
        live_holders = [
            e for e in old_t.engine_ids if e not in dead and t.expert in _held(plan, e, False)
        ]
        if t.from_disk:
            assert not live_holders and t.src_slot == -1  # disk only as the fallback
        else:
            assert t.src_engine in live_holders  # a live current owner...
            assert old_p.local_expert_ids(old_t.rank_of(t.src_engine))[t.src_slot] == t.expert
    for m in plan.slot_moves:  # free local copies: the engine already holds the expert
        assert m.expert in _held(plan, m.engine, new=False)
        assert new_p.local_expert_ids(new_t.rank_of(m.engine))[m.dst_slot] == m.expert
    assert {t.spec() for t in plan.transfers} == set(plan.transfer_specs())
    for e in plan.participants:
        assert plan.sends_of(e) == tuple(t for t in plan.transfers if t.src_engine == e)


def _layout(plan: ScalePlan) -> list[list[int]]:
    return plan.new_topology.placement or []


# ----------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_one_to_n(n):
    plan = plan_scale(Topology.initial(1), n, 8, bytes_per_expert=B)
    check_plan(plan)
    assert plan.new_topology.engine_ids == list(range(n))
    assert plan.joining == tuple(range(1, n)) and plan.leaving == ()
    assert all(t.src_engine == 0 for t in plan.transfers)  # the only owner
    assert plan.disk_bytes == 0
    # Engine 0 keeps its first slots; nothing it keeps moves.
    assert all(t.dst_engine != 0 for t in plan.transfers)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_n_to_one(n):
    plan = plan_scale(Topology.initial(n), 1, 8, bytes_per_expert=B)
    check_plan(plan)
    assert plan.new_topology.engine_ids == [0]
    assert plan.leaving == tuple(range(1, n)) and plan.joining == ()
    assert _layout(plan) == [list(range(8))] or sorted(_layout(plan)[0]) == list(range(8))
    # Engine 0 receives exactly the experts it did not have, from their owners.
    assert plan.experts_moved == 8 - len(plan.old_placement.local_expert_ids(0))
    assert {t.src_engine for t in plan.transfers} == set(range(1, n))


def test_scale_up_appends_fresh_ids_after_retired_ones():
    t = Topology.initial(2).retire_ids([2, 3])  # a rolled-back attempt used 2 and 3
    plan = plan_scale(t, 4, 8)
    assert plan.joining == (4, 5)
    assert plan.new_topology.engine_ids == [0, 1, 4, 5] and plan.new_topology.next_id == 6


def test_remove_a_middle_engine():
    t = plan_scale(Topology.initial(1), 3, 12).new_topology  # engines 0, 1, 2 at epoch 1
    plan = plan_scale(t, 2, 12, bytes_per_expert=B, remove=[1])
    check_plan(plan)
    assert plan.new_topology.engine_ids == [0, 2] and plan.leaving == (1,)
    assert plan.rank_map == {0: 0, 2: 1}  # engine 2 moves from rank 2 to rank 1
    # Survivors keep every expert they held; only engine 1's experts travel, from engine 1.
    for e in (0, 2):
        assert _held(plan, e, new=False) <= _held(plan, e, new=True)
    assert {t.src_engine for t in plan.transfers} == {1}
    assert plan.experts_moved == len(t.placement[1])


def test_default_removal_is_the_highest_ranks():
    plan = plan_scale(Topology.initial(4), 2, 8)
    assert plan.leaving == (2, 3) and plan.surviving == (0, 1)


def test_explicit_removal_plus_default():
    plan = plan_scale(Topology.initial(4), 2, 8, remove=[0])
    assert plan.leaving == (0, 3) and plan.surviving == (1, 2)
    check_plan(plan)


def test_replace_an_engine_at_the_same_size():
    plan = plan_scale(Topology.initial(3), 3, 12, bytes_per_expert=B, remove=[1], dead=[1])
    check_plan(plan)
    assert plan.new_topology.engine_ids == [0, 2, 3] and plan.joining == (3,)
    # The dead engine held its experts alone: they come from disk, to the new engine.
    assert all(t.from_disk for t in plan.transfers)
    assert plan.disk_bytes == 4 * B and plan.p2p_bytes == 0


def test_dead_engine_without_replicas_falls_back_to_disk():
    plan = plan_scale(Topology.initial(3), 2, 12, bytes_per_expert=B, dead=[1])
    check_plan(plan)
    assert plan.leaving == (1,) and plan.dead == (1,)
    assert sorted(t.expert for t in plan.transfers if t.from_disk) == [4, 5, 6, 7]
    assert plan.disk_bytes == 4 * B


def test_dead_engine_with_replicas_copies_from_the_live_replica():
    # 4 experts + 2 replicas on 3 ranks; engine 1 (dead) and engine 2 both hold 2 and 3.
    t = Topology.initial(3, placement=[[0, 1], [2, 3], [2, 3]])
    plan = plan_scale(t, 2, 4, 2, bytes_per_expert=B, remove=[1], dead=[1])
    check_plan(plan)
    assert plan.disk_bytes == 0  # every expert has a live copy
    assert all(x.src_engine in (0, 2) for x in plan.transfers)  # never the dead engine
    to_0 = [x for x in plan.transfers if x.dst_engine == 0]
    assert to_0 and all(x.expert in (2, 3) and x.src_engine == 2 for x in to_0)


@pytest.mark.parametrize(
    ("frm", "to", "r"),
    [(2, 3, 2), (3, 2, 2), (2, 4, 2), (4, 2, 2), (2, 4, 8), (4, 8, 8), (8, 2, 4)],
)
def test_with_redundant_experts(frm, to, r):
    t = Topology.initial(
        frm, placement=[ExpertPlacement.linear(8, frm, r).local_expert_ids(i) for i in range(frm)]
    )
    plan = plan_scale(t, to, 8, r, bytes_per_expert=B)
    check_plan(plan)
    assert plan.new_placement.num_physical_experts >= 8 + r


def test_sends_are_spread_over_the_owners():
    # Two engines both hold all 4 experts; two new engines need 2 each: 2 sends per owner.
    t = Topology.initial(2, placement=[[0, 1, 2, 3], [0, 1, 2, 3]])
    plan = plan_scale(t, 4, 4, 4, bytes_per_expert=B)
    check_plan(plan)
    sends = [len(plan.sends_of(e)) for e in (0, 1)]
    assert sorted(sends) == [2, 2], sends


def test_current_placement_is_taken_from_the_topology():
    rr = ExpertPlacement.round_robin(8, 2)
    t = Topology.initial(2, placement=[rr.local_expert_ids(0), rr.local_expert_ids(1)])
    plan = plan_scale(t, 4, 8, bytes_per_expert=B)
    check_plan(plan)
    assert set(_layout(plan)[0]) <= set(rr.local_expert_ids(0))  # engine 0 kept its own
    assert set(_layout(plan)[1]) <= set(rr.local_expert_ids(1))


def _max_matching(holders: dict[int, list[int]], cap: list[int]) -> int:
    """Experts -> ranks holding them, rank n taking at most cap[n]: max flow by BFS
    augmenting paths on the residual graph (independent of the plan's own matching)."""
    src, sink = "s", "t"
    res: dict[object, dict[object, int]] = {src: {}, sink: {}}

    def edge(u: object, v: object, c: int) -> None:
        res.setdefault(u, {})[v] = res.get(u, {}).get(v, 0) + c
        res.setdefault(v, {}).setdefault(u, 0)

    for e, ranks in holders.items():
        edge(src, ("e", e), 1)
        for n in ranks:
            edge(("e", e), ("r", n), 1)
    for n, c in enumerate(cap):
        edge(("r", n), sink, c)
    flow = 0
    while True:
        parent: dict[object, object] = {src: None}
        queue = [src]
        while queue and sink not in parent:
            u = queue.pop(0)
            for v, c in res[u].items():
                if c > 0 and v not in parent:
                    parent[v] = u
                    queue.append(v)
        if sink not in parent:
            return flow
        v = sink
        while parent[v] is not None:
            u = parent[v]
            res[u][v] -= 1
            res[v][u] += 1
            v = u
        flow += 1


def _optimum(plan: ScalePlan) -> int:
    """The fewest copies any placement of this size needs (module docstring of plan.py):
    max(P - sum(c_n), E - M)."""
    S, P = plan.new_placement.slots_per_rank, plan.new_placement.num_physical_experts
    E = plan.new_placement.num_logical_experts
    held = [_held(plan, e, new=False) for e in plan.new_topology.engine_ids]
    cap = [min(S, len(h)) for h in held]
    holders: dict[int, list[int]] = {}
    for n, h in enumerate(held):
        for x in h:
            holders.setdefault(x, []).append(n)
    return max(P - sum(cap), E - _max_matching(holders, cap))


def _brute_force_optimum(plan: ScalePlan) -> int:
    S, E = plan.new_placement.slots_per_rank, plan.new_placement.num_logical_experts
    held = [_held(plan, e, new=False) for e in plan.new_topology.engine_ids]
    rows = [frozenset(c) for c in itertools.combinations(range(E), S)]
    best = None
    for layout in itertools.product(rows, repeat=len(held)):
        if len(frozenset().union(*layout)) < E:
            continue
        cost = sum(len(row - h) for row, h in zip(layout, held))
        best = cost if best is None else min(best, cost)
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(150))
def test_random_plans_move_the_minimum(seed):
    rng = random.Random(seed)
    E = rng.choice([2, 4, 6, 8, 12, 16])
    R = rng.choice([0, 0, 1, E // 2, E])
    lo, hi = min_size(E, R), max_size(E)
    topo = Topology.initial(rng.randint(max(lo, 1), hi))
    for _ in range(3):  # a few successive operations, each from the last one's topology
        size = rng.randint(lo, hi)
        members = topo.engine_ids
        remove = rng.sample(members, rng.randint(0, min(2, len(members) - 1)))
        dead = rng.sample(remove, rng.randint(0, len(remove)))
        if size == topo.size and not remove:
            continue
        plan = plan_scale(topo, size, E, R, bytes_per_expert=B, remove=remove, dead=dead)
        check_plan(plan)
        assert plan.min_copies == _optimum(plan)  # no placement of this size moves fewer
        topo = plan.new_topology


@pytest.mark.parametrize("seed", range(60))
def test_small_plans_are_optimal_by_brute_force(seed):
    rng = random.Random(seed)
    E = rng.choice([3, 4, 5])
    R = rng.choice([0, 1, 2])
    lo = min_size(E, R)
    old = rng.randint(lo, min(E, 4))
    new = rng.choice([s for s in range(lo, min(E, 3) + 1) if s != old] or [old])
    remove = rng.sample(range(old), rng.randint(0, old - 1)) if new == old else []
    if new == old and not remove:
        return
    topo = Topology.initial(
        old, placement=[ExpertPlacement.linear(E, old, R).local_expert_ids(r) for r in range(old)]
    )
    plan = plan_scale(topo, new, E, R, remove=remove)
    check_plan(plan)
    assert plan.min_copies == _brute_force_optimum(plan) == _optimum(plan)


def test_fewer_moves_than_the_greedy_resize():
    # 6 experts on 4 ranks: two replicas; the last rank holds copies of 0 and 1. Removing
    # rank 2 and growing to 5: the greedy gives that rank a new expert and moves 5 copies,
    # the optimum keeps both copies in place and moves 4.
    topo = Topology.initial(4, placement=[[0, 1], [2, 3], [4, 5], [0, 1]])
    plan = plan_scale(topo, 5, 6, bytes_per_expert=B, remove=[2])
    check_plan(plan)
    greedy = resize(plan.old_placement, 5, 0, rank_map=plan.rank_map)
    moved = num_transfers(plan_moves(plan.old_placement, greedy, rank_map=plan.rank_map))
    assert plan.experts_moved == 4 < moved == 5
    assert plan.bytes_moved == plan.min_bytes == 4 * B


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [0, -1])
def test_size_below_one(bad):
    with pytest.raises(ScalePlanError, match=">= 1") as ei:
        plan_scale(Topology.initial(2), bad, 8)
    assert ei.value.minimum == 1 and ei.value.maximum == 8


@pytest.mark.parametrize("bad", [True, 2.0, "2", None])
def test_size_not_an_integer(bad):
    with pytest.raises(ScalePlanError, match="integer"):
        validate_size(bad, 8)


def test_size_above_the_number_of_experts():
    with pytest.raises(ScalePlanError, match=r"above the number of experts \(8\).*maximum is 8"):
        plan_scale(Topology.initial(2), 9, 8)


def test_size_the_placement_cannot_serve_names_the_minimum():
    # 8 experts + 2 redundant copies need 10 slots; one rank holds at most 8 distinct.
    t = Topology.initial(
        2, placement=[ExpertPlacement.linear(8, 2, 2).local_expert_ids(r) for r in range(2)]
    )
    with pytest.raises(ScalePlanError, match="the minimum is 2") as ei:
        plan_scale(t, 1, 8, 2)
    assert ei.value.minimum == 2
    assert min_size(8, 2) == 2 and min_size(8, 0) == 1 and min_size(4, 9) == 4


def test_unknown_engines_to_remove():
    with pytest.raises(ScalePlanError, match=r"remove engines \[7\]"):
        plan_scale(Topology.initial(2), 1, 8, remove=[7])
    with pytest.raises(ScalePlanError, match=r"dead engines \[7\]"):
        plan_scale(Topology.initial(2), 1, 8, dead=[7])


def test_nothing_to_change():
    with pytest.raises(ScalePlanError, match="nothing to change"):
        plan_scale(Topology.initial(2), 2, 8)


def test_engine_ids_exhausted():
    t = Topology(0, [MAX_ENGINE_ID - 1, MAX_ENGINE_ID], MAX_ENGINE_ID + 1)
    with pytest.raises(ScalePlanError, match="exhausted"):
        plan_scale(t, 3, 8)


def test_bad_current_placement():
    t = Topology.initial(2, placement=[[0, 1], [2, 3]])  # 4 experts, the model has 8
    with pytest.raises(ScalePlanError, match="placement"):
        plan_scale(t, 3, 8)


def test_expert_sizes():
    assert expert_nbytes(64, 32, 2, 4) == 3 * 64 * 32 * 2 * 4


# ----------------------------------------------------------------------------- wire


def test_messages_round_trip():
    plan = plan_scale(Topology.initial(2), 3, 8, bytes_per_expert=B)
    msg = ScalePrepare(
        operation_id="op",
        sequence=1,
        topology=plan.new_topology,
        leaving=list(plan.leaving),
        joining=list(plan.joining),
        transfers=plan.transfer_specs(),
        drain_timeout_s=1.5,
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=ScalePrepare)
    assert back == msg and back.old_group_usable and back.epoch == 1
    assert all(isinstance(t, ExpertTransferSpec) for t in back.transfers)
    disk = ExpertTransferSpec(expert=3, dst_engine_id=2, dst_slot=0)
    assert disk.from_disk and not plan.transfer_specs()[0].from_disk
    rep = ScaleReport("op", 2, 1, ScaleEvent.HANDED_BACK, request_ids=["a", "b"])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(rep), type=ScaleReport) == rep
    assert str(ScaleEvent.COMMITTED) == "committed"
