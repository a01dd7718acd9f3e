"""Expert placement, routing with replicas, move planning and EPLB (pure, no processes)."""

from __future__ import annotations

import itertools
import random

import pytest

from tidal.moe.placement import (
    DISK,
    ExpertPlacement,
    PlacementStrategy,
    engine_token_loads,
    num_transfers,
    plan_moves,
    rebalance,
    resize,
)


def _layout(p: ExpertPlacement) -> list[list[int]]:
    return [p.local_expert_ids(r) for r in range(p.ep_size)]


def _needed_transfers(old: ExpertPlacement, new: ExpertPlacement) -> int:
    """Lower bound on transfers: (new rank, expert) pairs the rank did not hold before
    (identity rank numbering)."""
    return sum(
        1
        for n in range(new.ep_size)
        for e in new.local_expert_ids(n)
        if n >= old.ep_size or e not in old.local_expert_ids(n)
    )


def test_linear_layout_and_maps():
    p = ExpertPlacement.linear(8, 2)
    assert _layout(p) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert p.physical_to_logical == tuple(range(8))  # physical id == logical id
    assert p.expert_map_for_rank(0) == [0, 1, 2, 3, -1, -1, -1, -1]
    assert p.expert_map_for_rank(1) == [-1, -1, -1, -1, 0, 1, 2, 3]
    assert p.num_redundant_experts == 0


def test_round_robin_layout_and_maps():
    p = ExpertPlacement.build("round_robin", 8, 2)
    assert _layout(p) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert p.physical_to_logical == (0, 2, 4, 6, 1, 3, 5, 7)
    assert p.expert_map_for_rank(1) == [-1, 0, -1, 1, -1, 2, -1, 3]  # logical -> local slot
    assert p.local_physical(1, 3) == 5
    assert p.local_physical(0, 3) == -1


def test_uneven_ep_size_pads_with_replicas():
    p = ExpertPlacement.linear(16, 3)
    assert p.slots_per_rank == 6 and p.num_physical_experts == 18
    assert _layout(p) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 0, 1]]
    assert p.num_redundant_experts == 2
    rr = ExpertPlacement.round_robin(16, 3)
    assert _layout(rr) == [
        [0, 3, 6, 9, 12, 15],
        [1, 4, 7, 10, 13, 0],
        [2, 5, 8, 11, 14, 1],
    ]
    hot = [1.0] * 16
    hot[9] = 50.0
    p = ExpertPlacement.linear(16, 3, load=hot)  # the hot expert gets a spare copy first
    assert p.holders(9) == [1, 2]
    hot[9], hot[13] = 1.0, 50.0  # the spare slots are on rank 2, which already holds 13
    assert ExpertPlacement.linear(16, 3, load=hot).holders(13) == [2]


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="slots per rank"):
        ExpertPlacement.linear(4, 2, num_redundant=5)
    with pytest.raises(ValueError, match="strategy"):
        ExpertPlacement.build("random", 8, 2)
    with pytest.raises(ValueError, match="twice"):
        ExpertPlacement.from_layout(4, [[0, 0], [1, 2], [3, 1]])
    with pytest.raises(ValueError, match="no physical slot"):
        ExpertPlacement.from_layout(4, [[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="same slot count"):
        ExpertPlacement.from_layout(3, [[0, 1], [2]])
    with pytest.raises(ValueError, match="entries"):
        ExpertPlacement.linear(4, 2).rank_loads([1.0, 2.0])


def _placements():
    rng = random.Random(0)
    for E, ep, R in itertools.product((3, 4, 7, 16), (1, 2, 3, 5), (0, 1, 3)):
        if -(-(E + R) // ep) > E:
            continue
        yield ExpertPlacement.linear(E, ep, R)
        yield ExpertPlacement.round_robin(E, ep, R)
        yield rebalance([rng.randint(0, 100) for _ in range(E)], ep, R)


@pytest.mark.parametrize(
    "p",
    list(_placements()),
    ids=lambda p: f"E{p.num_logical_experts}-ep{p.ep_size}-P{p.num_physical_experts}",
)
def test_every_token_expert_pair_is_computed_exactly_once(p: ExpertPlacement):
    maps = [p.expert_map_for_rank(r) for r in range(p.ep_size)]
    for r in range(p.ep_size):
        # the map and the weight list agree: slot s of rank r holds local_expert_ids(r)[s]
        for e, slot in enumerate(maps[r]):
            if slot >= 0:
                assert p.local_expert_ids(r)[slot] == e
        assert sorted(s for s in maps[r] if s >= 0) == list(range(p.slots_per_rank))
    for origin, row, e in itertools.product(
        range(p.ep_size), range(4), range(p.num_logical_experts)
    ):
        phys = p.route(e, origin, row)
        assert p.physical_to_logical[phys] == e
        # the one chosen copy is the slot the owner's expert map sends e to (the dispatch
        # tests check that no other copy computes the pair: outputs would double)
        owner = p.rank_of(phys)
        assert maps[owner][e] == phys - owner * p.slots_per_rank
        if origin in p.holders(e):
            assert owner == origin  # a local copy is always preferred


def test_replicas_share_remote_tokens():
    p = ExpertPlacement.from_layout(4, [[0, 1], [2, 0], [3, 1]])
    # rank 2 holds no copy of expert 0: its tokens alternate between ranks 0 and 1
    assert {p.rank_of(p.route(0, 2, row)) for row in range(4)} == {0, 1}
    assert p.rank_of(p.route(0, 1, 7)) == 1


def test_engine_token_loads_credit_replicas_evenly_per_layer():
    # 4 experts on 2 ranks, 3 slots each: experts 0 and 1 have a copy on both ranks in
    # layer 0; layer 1 (its own EPLB placement) replicates 2 and 3.
    layouts = {0: [0, 1, 2, 3, 0, 1], 1: [3, 2, 0, 1, 2, 3], 5: [0, 1, 2, 3, 0, 1]}
    load = {0: [10, 20, 30, 40], 1: [0, 0, 0, 8]}  # layer 5: no record, not counted
    # layer 0: rank 0 = 10/2 + 20/2 + 30, rank 1 = 10/2 + 20/2 + 40; layer 1: 8 split
    assert engine_token_loads(layouts, load, 2) == [45 + 4, 55 + 4]
    # the sum over engines is every token routed, whatever the replicas
    assert sum(engine_token_loads(layouts, load, 2)) == sum(map(sum, load.values()))


def test_engine_token_loads_a_rank_without_tokens_and_tp_workers():
    layouts = {0: [0, 1, 2, 3]}
    # rank 1 holds experts 2 and 3, which nobody routed to: 0, not left out
    assert engine_token_loads(layouts, {0: [5, 7, 0, 0]}, 2) == [12, 0]
    # 2 engines x 2 TP workers = 4 EP ranks; an engine holds its workers' experts
    assert engine_token_loads(layouts, {0: [1, 2, 3, 4]}, 2, ranks_per_engine=2) == [3, 7]
    assert engine_token_loads({}, {}, 3) == [0, 0, 0]
    with pytest.raises(ValueError, match="cannot be split evenly over 3 ranks"):
        engine_token_loads(layouts, {0: [1, 2, 3, 4]}, 3)  # a placement for another size


def test_even_credit_is_what_routing_does_for_remote_tokens():
    # The slow reference: route every (row, expert) pair from an origin without a copy;
    # over whole rotations each copy computes the same share (engine_token_loads' model).
    p = ExpertPlacement.from_layout(4, [[0, 1], [2, 0], [3, 1]])
    rows = 6  # a multiple of every replica count
    per_rank = [0, 0, 0]
    for row in range(rows):
        for e in (0, 1):
            per_rank[p.rank_of(p.route(e, 2, row))] += 1
    # origin 2 holds expert 1: its tokens stay; expert 0's alternate over ranks 0 and 1
    assert per_rank == [3, 3, rows]
    assert engine_token_loads({0: list(p.physical_to_logical)}, {0: [rows, 0, 0, 0]}, 3) == [
        3,
        3,
        0,
    ]


def test_plan_moves_linear_2_to_3_and_back():
    two, three = ExpertPlacement.linear(16, 2), ExpertPlacement.linear(16, 3)
    up = plan_moves(two, three)
    # rank 0 keeps 0-5; rank 1 needs 6, 7 (from rank 0); new rank 2 needs 12-15, 0, 1
    assert num_transfers(up) == 8 == _needed_transfers(two, three)
    remote = {(m.logical_expert, m.src_rank, m.dst_rank) for m in up if not m.local}
    assert remote == {(6, 0, 1), (7, 0, 1)} | {(e, 1, 2) for e in (12, 13, 14, 15)} | {
        (0, 0, 2),
        (1, 0, 2),
    }
    down = plan_moves(three, two)
    # rank 0 needs 6, 7 from rank 1; rank 1 needs 12-15 (only on rank 2)
    assert num_transfers(down) == 6 == _needed_transfers(three, two)
    assert {(m.logical_expert, m.src_rank) for m in down if not m.local} == {(6, 1), (7, 1)} | {
        (e, 2) for e in (12, 13, 14, 15)
    }
    # rank 1 keeps 8-11 in both directions, but in other slots: local copies, no transfer
    assert {(m.logical_expert, m.src_slot, m.dst_slot) for m in up if m.local} == {
        (e, e - 8, e - 6) for e in (8, 9, 10, 11)
    }
    assert {(m.logical_expert, m.src_slot, m.dst_slot) for m in down if m.local} == {
        (e, e - 6, e - 8) for e in (8, 9, 10, 11)
    }


def test_experts_that_stay_do_not_move():
    for old, new in [
        (ExpertPlacement.linear(16, 2), ExpertPlacement.round_robin(16, 3)),
        (ExpertPlacement.round_robin(16, 3, 2), ExpertPlacement.linear(16, 4)),
        (ExpertPlacement.linear(12, 3), rebalance(list(range(12)), 3, 3)),
    ]:
        moves = plan_moves(old, new)
        assert num_transfers(moves) == _needed_transfers(old, new)
        for m in moves:
            held = m.dst_rank < old.ep_size and m.logical_expert in old.local_expert_ids(m.dst_rank)
            assert m.local == held
            assert old.local_expert_ids(m.src_rank)[m.src_slot] == m.logical_expert
            assert new.local_expert_ids(m.dst_rank)[m.dst_slot] == m.logical_expert
        # applying the moves to the old layout yields the new one
        built = [[None] * new.slots_per_rank for _ in range(new.ep_size)]
        for n in range(min(old.ep_size, new.ep_size)):
            for s, e in enumerate(old.local_expert_ids(n)[: new.slots_per_rank]):
                if new.local_expert_ids(n)[s] == e:
                    built[n][s] = e
        for m in moves:
            built[m.dst_rank][m.dst_slot] = m.logical_expert
        assert built == _layout(new)


def test_resize_is_minimal_2_to_3_to_2():
    two = ExpertPlacement.linear(16, 2)
    three = resize(two, 3)
    # ranks 0 and 1 keep 6 experts each; only the new rank receives (6 slots): the floor
    assert num_transfers(plan_moves(two, three)) == 6
    assert all(m.dst_rank == 2 for m in plan_moves(two, three) if not m.local)
    back = resize(three, 2)
    # the 4 experts held only by the removed rank 2 must move; nothing else does
    only_on_2 = {e for e in range(16) if three.holders(e) == [2]}
    assert len(only_on_2) == 4
    moves = plan_moves(three, back)
    assert num_transfers(moves) == 4
    assert {m.logical_expert for m in moves if not m.local} == only_on_2
    # linear -> linear moves more for the same resizes
    assert num_transfers(plan_moves(two, ExpertPlacement.linear(16, 3))) > 6
    assert num_transfers(plan_moves(ExpertPlacement.linear(16, 3), two)) > 4


def test_sources_spread_and_dead_ranks_fall_back_to_disk():
    old = ExpertPlacement.from_layout(2, [[0, 1], [0, 1]])  # both ranks hold both experts
    new = ExpertPlacement.from_layout(2, [[0, 1], [0, 1], [0, 1]])
    moves = [m for m in plan_moves(old, new) if not m.local]
    assert sorted(m.src_rank for m in moves) == [0, 1]  # rank 2's copies: different holders

    three = ExpertPlacement.linear(16, 3)
    dead = plan_moves(three, resize(three, 2, rank_map={0: 0, 1: 1}), unavailable_ranks=[2])
    assert {m.logical_expert for m in dead if m.src_rank == DISK} == {12, 13, 14, 15}
    assert all(m.src_rank != 2 for m in dead)


def test_resize_with_rank_map_removes_a_middle_rank():
    three = ExpertPlacement.linear(12, 3)
    new = resize(three, 2, rank_map={0: 0, 2: 1})  # old rank 1 leaves
    moves = plan_moves(three, new, rank_map={0: 0, 2: 1})
    assert {m.logical_expert for m in moves if not m.local} == {4, 5, 6, 7}
    assert all(m.src_rank == 1 for m in moves if not m.local)
    assert new.local_expert_ids(1)[:4] == [8, 9, 10, 11]


def test_eplb_lowers_imbalance_on_skewed_load():
    load = [1000 / (i + 1) ** 1.2 for i in range(16)]  # Zipf-like: expert 0 is hot
    for ep, R in [(4, 0), (4, 4), (2, 2), (3, 2)]:
        base = ExpertPlacement.linear(16, ep, R)
        plan = rebalance(load, ep, R)
        assert plan.imbalance(load) < base.imbalance(load)
        assert plan.num_physical_experts == base.num_physical_experts
        if R:
            assert len(plan.holders(0)) > 1  # the hottest expert is replicated
    plan = rebalance(load, 4, 4)
    assert plan.imbalance(load) < 1.1
    assert sum(plan.rank_loads(load)) == pytest.approx(sum(load))


def test_eplb_always_finds_a_valid_placement():
    rng = random.Random(1)
    for _ in range(300):
        E, ep = rng.randint(1, 12), rng.randint(1, 6)
        max_R = E * ep - E
        R = rng.randint(0, max_R)
        load = [rng.choice([0, 1, rng.randint(0, 1000)]) for _ in range(E)]
        p = rebalance(load, ep, R)  # __post_init__ validates: every expert placed, no duplicates
        assert p.num_physical_experts >= E + R
        assert all(len(p.holders(e)) <= ep for e in range(E))


def test_strategy_enum_and_string_agree():
    assert ExpertPlacement.build(PlacementStrategy.LINEAR, 6, 3) == ExpertPlacement.build(
        "linear", 6, 3
    )


def test_make_room_swaps_when_only_holders_have_free_slots():
    from tidal.moe.placement import _make_room

    layout = [[0, 2], [1]]  # the free slot is on rank 1, which already holds expert 1
    r = _make_room(layout, 1, 2)
    assert r == 0 and layout == [[2], [1, 0]]
    with pytest.raises(ValueError, match="every rank already holds"):
        _make_room([[1, 0], [1]], 1, 2)
