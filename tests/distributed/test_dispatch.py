"""EP dispatchers on real processes (gloo over TCP): what each rank receives, and that
dispatch -> experts -> combine equals one process computing every expert for every token.

Rank r's token t carries the code ``1000*r + t`` in hidden column 0 (the expert weights
ignore that column), so each received row proves where it came from.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.distributed.groups import StatelessGroup
from tidal.moe.dispatch import DISPATCHERS, get_dispatcher
from tidal.moe.dispatch.base import ReplicaRouter
from tidal.moe.placement import ExpertPlacement, rebalance

BACKENDS = ("allgather_reducescatter", "all2all")


def _experts_loop(hidden, w13, w2, topk_weights, topk_ids, expert_map):
    """Local copy of the reference expert loop (so this test does not depend on
    tidal/moe/reference.py): weighted sum over the token's local experts, float32."""
    inter = w13.shape[1] // 2
    slots = topk_ids if expert_map is None else expert_map.long()[topk_ids]
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        for k in range(topk_ids.shape[1]):
            s = int(slots[t, k])
            if s < 0:
                continue
            x = hidden[t].float()
            y = F.linear(
                F.silu(F.linear(x, w13[s, :inter].float())) * F.linear(x, w13[s, inter:].float()),
                w2[s].float(),
            )
            out[t] += topk_weights[t, k] * y
    return out.to(hidden.dtype)


def _problem(case: dict, ep: int):
    """The global problem, identical on every rank (same seed)."""
    g = torch.Generator().manual_seed(case["seed"])
    E, K, H, inter = case["E"], case["K"], case["H"], case["I"]
    w13 = torch.randn(E, 2 * inter, H, generator=g) * 0.3
    w13[:, :, 0] = 0  # column 0 carries the rank code; keep it out of the math
    w2 = torch.randn(E, H, inter, generator=g) * 0.3
    hidden, weights, ids = [], [], []
    for o in range(ep):
        n = case["sizes"][o]
        h = torch.randn(n, H, generator=g)
        h[:, 0] = 1000 * o + torch.arange(n)
        hidden.append(h)
        ids.append(torch.argsort(torch.rand(n, E, generator=g), dim=1)[:, :K])
        weights.append(torch.softmax(torch.randn(n, K, generator=g), dim=1))
    return w13, w2, hidden, weights, ids


def _placement(case: dict, ep: int) -> ExpertPlacement:
    kind, arg = case["placement"]
    if kind == "rebalance":
        return rebalance(arg, ep, case["R"])
    return ExpertPlacement.build(kind, case["E"], ep, case["R"])


def _expected_rows(backend, placement, ids, sizes, rank):
    """(origin, row) pairs this rank must receive, in order, from the pure routing rule."""
    rows = []
    for o, n in enumerate(sizes):
        for t in range(n):
            mine = [placement.rank_of(placement.route(int(e), o, t)) == rank for e in ids[o][t]]
            if backend == "allgather_reducescatter" or any(mine):
                rows.append((o, t))
    return rows


def _run_case(group: StatelessGroup, backend: str, case: dict) -> dict:
    rank, ep = group.rank, group.world_size
    dtype = case.get("dtype", torch.float32)
    placement = _placement(case, ep)
    w13, w2, hidden, weights, ids = _problem(case, ep)
    d = get_dispatcher(backend, group, placement)
    sizes = case["sizes"]
    res = d.dispatch(
        hidden[rank].to(dtype), weights[rank], ids[rank], sizes if case["pass_sizes"] else None
    )

    # 1. what arrived: exactly the expected rows, in order, each with its origin's routing
    expect = _expected_rows(backend, placement, ids, sizes, rank)
    codes = torch.tensor([1000.0 * o + t for o, t in expect]).to(dtype)
    assert res.hidden.dtype == dtype and res.hidden.shape == (len(expect), case["H"])
    assert torch.equal(res.hidden[:, 0], codes), (backend, rank, res.hidden[:, 0], codes)
    assert res.topk_weights.dtype == torch.float32 and res.topk_ids.dtype == torch.int64
    for i, (o, t) in enumerate(expect):
        assert torch.equal(res.hidden[i, 1:], hidden[o][t, 1:].to(dtype))
        for k, e in enumerate(ids[o][t].tolist()):
            if placement.rank_of(placement.route(e, o, t)) == rank:
                assert res.topk_ids[i, k] == e and res.topk_weights[i, k] == weights[o][t, k]
            else:  # computed elsewhere: weight 0 and an id this rank does not hold
                assert res.topk_weights[i, k] == 0
                assert d.expert_map[res.topk_ids[i, k]] == -1

    # 2. experts on the local slots, combine, compare with all experts in one process
    local = placement.local_expert_ids(rank)
    out_local = _experts_loop(
        res.hidden,
        w13[local].to(dtype),
        w2[local].to(dtype),
        res.topk_weights,
        res.topk_ids,
        d.expert_map,
    )
    out = d.combine(out_local, res.handle)
    ref = _experts_loop(hidden[rank], w13, w2, weights[rank], ids[rank], None)
    assert out.shape == (sizes[rank], case["H"]) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    s = d.stats
    return {"sent": s.dispatch_sent + s.combine_sent, "recv": s.dispatch_recv + s.combine_recv}


def _worker(rank: int, world_size: int, port: int, cases: list[dict]) -> list[dict]:
    group = StatelessGroup.create(
        host="127.0.0.1", port=port, rank=rank, world_size=world_size, prefix="ep"
    )
    try:
        return [_run_case(group, b, c) for c in cases for b in BACKENDS]
    finally:
        group.destroy()


def _cases(ep: int) -> list[dict]:
    base = {"E": 8, "K": 3, "H": 6, "I": 4, "R": 0, "pass_sizes": True}
    skew = [40, 1, 1, 9, 1, 1, 1, 20]
    if ep == 2:
        token_counts = [[5, 0], [3, 7], [1, 1]]
    else:
        token_counts = [[4, 0, 6], [1, 1, 1], [0, 0, 0]]
    cases = []
    for i, sizes in enumerate(token_counts):
        cases.append({**base, "seed": i, "sizes": sizes, "placement": ("linear", None)})
    # replicated experts (round robin + 2 spare copies; EPLB plan with hot experts copied)
    cases.append(
        {**base, "seed": 10, "sizes": token_counts[1], "placement": ("round_robin", None), "R": 2}
    )
    cases.append(
        {
            **base,
            "seed": 11,
            "sizes": token_counts[0],
            "placement": ("rebalance", skew),
            "R": ep,
            "pass_sizes": False,
        }
    )
    cases.append(
        {
            **base,
            "seed": 12,
            "sizes": token_counts[1],
            "placement": ("linear", None),
            "dtype": torch.bfloat16,
        }
    )
    return cases


@pytest.mark.parametrize("ep", [2, 3])
def test_dispatchers_match_single_process_reference(run_ranks_on_ports, ep):
    cases = _cases(ep)
    results = run_ranks_on_ports(_worker, ep, cases, timeout_s=240)
    # bytes are conserved: what the ranks sent to peers is what the peers received
    for i in range(len(cases) * len(BACKENDS)):
        assert sum(r[i]["sent"] for r in results) == sum(r[i]["recv"] for r in results)
    if ep == 3:  # 8 experts on 3 ranks: 9 slots, one spare replica
        assert ExpertPlacement.linear(8, 3).num_redundant_experts == 1


# ---------------------------------------------------------------------------- in-process


def test_vectorised_routing_matches_placement_route():
    for placement in (
        ExpertPlacement.linear(8, 3, 4),
        ExpertPlacement.round_robin(16, 4, 5),
        rebalance([50, 1, 1, 30, 2, 2, 9, 1], 3, 4),
    ):
        ids = torch.randint(0, placement.num_logical_experts, (13, 3))
        for rank in range(placement.ep_size):
            phys = ReplicaRouter(placement, rank).route(ids)
            expect = [[placement.route(int(e), rank, t) for e in ids[t]] for t in range(13)]
            assert phys.tolist() == expect


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_rank_dispatch_is_identity(backend):
    placement = ExpertPlacement.linear(4, 1)
    d = get_dispatcher(backend, None, placement)
    hidden = torch.randn(5, 6)
    ids = torch.argsort(torch.rand(5, 4), dim=1)[:, :2]
    w = torch.rand(5, 2)
    res = d.dispatch(hidden, w, ids)
    assert torch.equal(res.hidden, hidden) and torch.equal(res.topk_ids, ids)
    assert torch.equal(res.topk_weights, w)
    y = torch.randn(5, 6)
    assert torch.allclose(d.combine(y, res), y)
    assert d.stats.bytes_moved == 0  # no peers


def test_registry_errors_name_the_choices_and_requirements():
    placement = ExpertPlacement.linear(4, 1)
    with pytest.raises(ValueError, match="allgather_reducescatter, all2all"):
        get_dispatcher("nccl_magic", None, placement)
    for name in ("deepep_high_throughput", "deepep_low_latency"):
        assert name in DISPATCHERS
        with pytest.raises(RuntimeError, match="deep_ep|CUDA"):
            get_dispatcher(name, None, placement, hidden_size=8)
    with pytest.raises(ValueError, match="ep_size=2"):
        get_dispatcher("all2all", None, ExpertPlacement.linear(4, 2))
