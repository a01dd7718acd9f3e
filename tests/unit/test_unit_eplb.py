"""EPLB pieces without processes: the load window, the planning, the transfer plan (all
ranks simulated in one process) and the in-place weight move on one rank."""

from __future__ import annotations

import random

import pytest
import torch

from tidal.moe.eplb import (
    EplbState,
    ExpertLoadWindow,
    move_expert_weights,
    plan_rebalance,
    transfer_plan,
)
from tidal.moe.layer import FusedMoE
from tidal.moe.placement import ExpertPlacement, plan_moves, rebalance
from tidal.moe.reference import ClampedSwiGLU, fused_experts_reference
from tidal.moe.router import Routing, softmax_topk

# ---------------------------------------------------------------------- window


def test_window_keeps_last_steps_and_zeroes_dummies():
    win = ExpertLoadWindow(num_layers=2, num_experts=3, window=3)
    steps = [torch.tensor([[i, 2 * i, 0], [1, 0, i]]) for i in range(1, 6)]
    kept = []
    for i, counts in enumerate(steps):
        win.current += counts
        dummy = i == 3
        win.end_step(record=not dummy)
        kept.append(torch.zeros_like(counts) if dummy else counts)
        assert win.current.sum() == 0  # zeroed for the next step
        want = torch.stack(kept[-3:]).sum(0)
        assert torch.equal(win.total(), want), i
    assert win.steps == 5


def test_window_rejects_empty():
    with pytest.raises(ValueError, match="window"):
        ExpertLoadWindow(1, 4, 0)


def _moe(num_experts=6, top_k=2, hidden=8, inter=4, seed=0, local=None, biased=False):
    """``biased``: GPT-OSS's experts (biases, clamped SwiGLU) and router bias."""
    g = torch.Generator().manual_seed(seed)
    extra = {}
    if biased:
        extra = {
            "routing": Routing(top_k, True, router_bias=True),
            "expert_bias": True,
            "activation": ClampedSwiGLU(1.702, 0.5),
        }
    moe = FusedMoE(num_experts, top_k, hidden, inter, True, local_expert_ids=local, **extra)
    n = len(moe.local_expert_ids)
    moe.gate.data = torch.randn(num_experts, hidden, generator=g)
    moe.w13.data = torch.randn(n, 2 * inter, hidden, generator=g)
    moe.w2.data = torch.randn(n, hidden, inter, generator=g)
    if biased:
        assert moe.gate_bias is not None and moe.w13_bias is not None
        assert moe.w2_bias is not None
        moe.gate_bias.copy_(torch.randn(num_experts, generator=g))
        moe.w13_bias.copy_(torch.randn(n, 2 * inter, generator=g))
        moe.w2_bias.copy_(torch.randn(n, hidden, generator=g))
    return moe


def test_state_counts_each_layer_and_rebalances_on_interval(monkeypatch):
    layers = [_moe(seed=s) for s in (1, 2)]
    placement = ExpertPlacement.linear(6, 1)
    state = EplbState(
        layers, [1, 3], [placement] * 2, None, window=4, rebalance_interval=3, num_redundant=0
    )
    calls = []
    monkeypatch.setattr(state, "rebalance", lambda: calls.append(state.steps) or [False, False])
    g = torch.Generator().manual_seed(5)
    want = {1: torch.zeros(6, dtype=torch.int64), 3: torch.zeros(6, dtype=torch.int64)}
    for step in range(7):
        x = torch.randn(5, 8, generator=g)
        for lid, moe in zip((1, 3), layers):
            moe(x)
            gate = moe.read_weights(["gate"])["gate"]
            _, ids = softmax_topk(torch.nn.functional.linear(x, gate), 2, True)
            if step >= 3 and step != 5:  # window of 4: steps 3..6, step 5 a dummy
                want[lid] += torch.bincount(ids.reshape(-1), minlength=6)
        state.end_step(is_dummy=step == 5)
    assert calls == [3, 6]  # every 3 forwards, dummies included
    assert state.local_load() == {k: v.tolist() for k, v in want.items()}


# ---------------------------------------------------------------------- planning


def test_plan_keeps_placement_without_load_or_gain():
    old = ExpertPlacement.linear(8, 2)
    assert plan_rebalance([[0] * 8], [old], 0) == [old]
    # Uniform load over a linear placement is already balanced: nothing to gain.
    assert plan_rebalance([[5] * 8], [old], 0) == [old]


def test_plan_moves_hot_experts_apart_deterministically():
    old = ExpertPlacement.linear(8, 2, 2)
    # Linear + 2 replicas: rank 0 [0..4], rank 1 [5, 6, 7, 0, 1]; 6 and 7 are hot.
    load = [[5, 5, 5, 5, 5, 5, 90, 80], [1, 1, 1, 1, 1, 1, 1, 1]]
    new = plan_rebalance(load, [old, old], 2)
    assert new == plan_rebalance([list(r) for r in load], [old, old], 2)  # deterministic
    assert new[0] == rebalance(load[0], 2, 2) != old
    assert new[0].imbalance(load[0]) < old.imbalance(load[0])
    assert new[1] == old  # uniform: no gain


def test_plan_rejects_mismatched_layers():
    with pytest.raises(ValueError, match="layers"):
        plan_rebalance([[1] * 8], [], 0)


# ---------------------------------------------------------------------- transfers


def _simulate(old: ExpertPlacement, new: ExpertPlacement) -> list[list[int]]:
    """Every rank's slots after the transfer plan, each expert's weight being its id."""
    ep = old.ep_size
    moves = plan_moves(old, new)
    plans = [transfer_plan(moves, r, ep) for r in range(ep)]
    held = [old.local_expert_ids(r) for r in range(ep)]
    after = [list(h) for h in held]
    for dst in range(ep):
        for old_slot, new_slot in plans[dst].local:
            after[dst][new_slot] = held[dst][old_slot]
        for src in range(ep):
            rows = [held[src][s] for s in plans[src].send[dst]]  # what src sends to dst
            assert len(rows) == len(plans[dst].recv[src])
            for slot, e in zip(plans[dst].recv[src], rows):
                after[dst][slot] = e
    return after


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("E", "ep", "R"), [(8, 2, 2), (16, 4, 0), (8, 3, 1), (6, 3, 3)])
def test_transfer_plan_delivers_the_new_placement(E, ep, R, seed):
    rnd = random.Random(seed)
    old = rebalance([rnd.randint(0, 50) for _ in range(E)], ep, R)
    new = rebalance([rnd.randint(0, 50) for _ in range(E)], ep, R)
    assert _simulate(old, new) == [new.local_expert_ids(r) for r in range(ep)]
    # Only experts a rank did not hold cross the network.
    sent = sum(transfer_plan(plan_moves(old, new), r, ep).num_sent for r in range(ep))
    recv = sum(transfer_plan(plan_moves(old, new), r, ep).num_received for r in range(ep))
    missing = sum(
        len(set(new.local_expert_ids(r)) - set(old.local_expert_ids(r))) for r in range(ep)
    )
    assert sent == recv == missing


@pytest.mark.parametrize("packed", [False, True], ids=["parameters", "packed"])
def test_move_on_one_rank_permutes_slots_in_place(packed):
    """Parameters are rewritten in place; a packed layer (the default CPU path's layout,
    the only copy) is packed again, and its forward serves the moved experts."""
    moe = _moe(num_experts=6, local=[0, 1, 2, 3, 4, 5])
    w13, w2 = moe.w13.data.clone(), moe.w2.data.clone()
    ptr = moe.w13.data.data_ptr()
    if packed:
        moe.pack_weights()
        if not moe.is_released("w13"):
            pytest.skip("the default CPU path here packs nothing")
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    weights, ids = moe.route(x)
    before = fused_experts_reference(x, w13, w2, weights, ids)
    old = ExpertPlacement.from_layout(6, [[0, 1, 2, 3, 4, 5]])
    new = ExpertPlacement.from_layout(6, [[3, 0, 1, 2, 5, 4]])  # a cycle and a swap
    move_expert_weights(moe, transfer_plan(plan_moves(old, new), 0, 1), None)
    got = moe.read_weights(["w13", "w2"])
    for slot, e in enumerate(new.local_expert_ids(0)):
        assert torch.equal(got["w13"][slot], w13[e]) and torch.equal(got["w2"][slot], w2[e])
    assert moe.is_released("w13") == packed
    if not packed:
        assert moe.w13.data.data_ptr() == ptr  # same storage: updated in place
    moe.set_local_experts(new.local_expert_ids(0))  # the map follows the slots
    torch.testing.assert_close(moe.forward_experts(x, weights, ids), before, atol=1e-5, rtol=0)


@pytest.mark.parametrize("biased", [False, True], ids=["plain", "expert-biases"])
def test_installed_placement_keeps_layer_output(biased):
    """Permuting a one-rank layer's slots (weights + map together) changes nothing; the
    expert biases move with their experts."""
    moe = _moe(num_experts=6, local=[0, 1, 2, 3, 4, 5], biased=biased)
    x = torch.randn(7, 8)
    want = moe(x)
    old = ExpertPlacement.from_layout(6, [[0, 1, 2, 3, 4, 5]])
    new = ExpertPlacement.from_layout(6, [[5, 3, 1, 0, 2, 4]])
    move_expert_weights(moe, transfer_plan(plan_moves(old, new), 0, 1), None)
    moe.set_local_experts(new.local_expert_ids(0))
    torch.testing.assert_close(moe(x), want, atol=1e-6, rtol=1e-6)
