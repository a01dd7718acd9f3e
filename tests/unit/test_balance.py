"""Engine choice: the vLLM baseline score, bursts between snapshots, ties, explicit ranks,
topology changes (engines keyed by id), and the simulator comparison of the two policies
(deterministic seeds)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from tidal.dp_coordinator.balance import (
    Balancer,
    RankLoad,
    TidalPolicy,
    choose_engine,
    get_policy,
    policy_names,
)
from tidal.protocol.messages import DPLoadSnapshot
from tidal.protocol.topology import Topology

SIM_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "balance_sim.py"


def load_sim():
    spec = importlib.util.spec_from_file_location("balance_sim", SIM_PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["balance_sim"] = mod  # dataclasses resolve annotations via the module
    spec.loader.exec_module(mod)
    return mod


def snap(counts, kv=None, seq=1, epoch=0, engine_ids=None) -> DPLoadSnapshot:
    """A snapshot; by default of the launch topology (epoch 0, engine ids 0..n-1)."""
    ids = list(range(len(counts))) if engine_ids is None else engine_ids
    return DPLoadSnapshot(
        seq=seq, timestamp=0.0, epoch=epoch, engine_ids=ids, wave=0, running=False,
        counts=counts, kv_usage=kv or [0.0] * len(counts),
    )  # fmt: skip


def test_registry():
    assert {"vllm", "tidal", "tidal-p2c"} <= set(policy_names())
    with pytest.raises(ValueError, match="unknown balance policy"):
        get_policy("nope")


# ------------------------------------------------------------------ vLLM baseline


@pytest.mark.parametrize(
    "counts, want",
    [
        ([[0, 5], [1, 0], [0, 3]], 2),  # scores 5, 4, 3
        ([[0, 5], [1, 0], [0, 6]], 1),  # 5, 4, 6
        ([[2, 0], [0, 7], [1, 4]], 1),  # 8, 7, 8
    ],
)
def test_vllm_score_is_min_of_4w_plus_r(counts, want):
    assert choose_engine(counts, [0] * len(counts), policy="vllm") == want
    bal = Balancer(len(counts), "vllm")
    bal.on_snapshot(snap(counts), now=0.0)
    assert bal.choose() == want


def test_own_sends_count_as_waiting():
    # Rank 0 looks idle in the snapshot, but this frontend already sent it two requests.
    assert choose_engine([[0, 0], [0, 7]], [2, 0], policy="vllm") == 1
    assert choose_engine([[0, 0], [0, 7]], [1, 0], policy="vllm") == 0


@pytest.mark.parametrize("policy", ["vllm", "tidal"])
def test_burst_between_snapshots_is_spread(policy):
    bal = Balancer(4, policy)
    bal.on_snapshot(snap([[0, 3], [0, 3], [0, 3], [0, 3]]), now=0.0)
    sent = []
    for i in range(12):
        r = bal.choose()
        bal.on_send(r, now=0.001 * (i + 1))
        sent.append(r)
    assert sorted(sent.count(r) for r in range(4)) == [3, 3, 3, 3]


def test_vllm_forgets_own_sends_at_a_snapshot_but_tidal_does_not():
    """A snapshot built before the engines stepped does not hold the last sends."""
    for policy, expect_spread in (("vllm", False), ("tidal", True)):
        bal = Balancer(2, policy)
        bal.on_snapshot(snap([[0, 0], [0, 0]]), now=0.0)
        for _ in range(4):
            bal.on_send(0, now=0.095)  # explicit sends to rank 0 just before the snapshot
        bal.on_snapshot(snap([[0, 0], [0, 0]], seq=2), now=0.1)  # stale: shows none of them
        assert (bal.choose() == 1) == expect_spread, policy


def test_tidal_counts_own_finishes_before_the_snapshot_shows_them():
    bal = Balancer(2, "tidal")
    for _ in range(4):
        bal.on_send(0, now=-1.0)  # long-ago sends, already in the next snapshot
    bal.on_snapshot(snap([[0, 4], [0, 3]]), now=0.0)
    assert bal.loads()[0].sent == 0
    assert bal.choose() == 1
    bal.on_finish(0)
    bal.on_finish(0)
    assert bal.choose() == 0  # two slots freed on rank 0 that the snapshot cannot know
    bal.on_snapshot(snap([[0, 2], [0, 3]], seq=2), now=0.1)
    assert bal.loads()[0].finished == 0  # now the snapshot holds them


def test_own_inflight_floors_a_rank():
    # The snapshot says rank 0 is idle, but this frontend has 5 requests outstanding there.
    load = RankLoad(waiting=0, running=0, inflight=5)
    waiting, running = TidalPolicy().estimate(load, num_clients=1)
    assert waiting + running == 5


def test_capacity_is_learnt_from_saturated_snapshots():
    bal = Balancer(2, "tidal")
    bal.on_snapshot(snap([[3, 8], [0, 2]]), now=0.0)
    assert [ld.capacity for ld in bal.loads()] == [8, 0]
    w, r = TidalPolicy().estimate(RankLoad(0, 8, sent=2, capacity=8), num_clients=1)
    assert (w, r) == (2, 8)  # extra requests beyond capacity are queued, weight 4


def test_kv_usage_penalty_and_tie_break():
    # Equal counts: lower KV usage wins the tie regardless of the rotation start.
    assert choose_engine([[0, 2], [0, 2]], [0, 0], kv_usage=[0.6, 0.3], start=0) == 1
    # A nearly full KV cache outweighs one extra running request.
    assert choose_engine([[0, 2], [0, 3]], [0, 0], kv_usage=[0.99, 0.1]) == 1
    assert choose_engine([[0, 2], [0, 3]], [0, 0], kv_usage=[0.5, 0.1]) == 0


def test_ties_rotate_with_tidal_but_not_vllm():
    for policy, want in (("tidal", [0, 1, 2, 0, 1, 2]), ("vllm", [0, 0, 0, 0, 0, 0])):
        bal = Balancer(3, policy)
        got = []
        for i in range(6):
            bal.on_snapshot(snap([[0, 1]] * 3, seq=i + 1), now=float(i))  # equal load
            r = bal.choose()
            got.append(r)
            bal.on_send(r, now=float(i))
            bal.on_finish(r)
        assert got == want, policy


def test_frontends_start_at_different_ranks():
    firsts = [Balancer(4, "vllm", client_index=c, num_clients=4).choose() for c in range(4)]
    assert firsts == [0, 1, 2, 3]


def test_explicit_rank_wins_and_is_validated():
    bal = Balancer(3, "tidal")
    bal.on_snapshot(snap([[9, 9], [0, 0], [0, 0]]), now=0.0)
    assert bal.choose(data_parallel_rank=0) == 0
    for bad in (3, -1, True, "1"):
        with pytest.raises(ValueError, match="data_parallel_rank"):
            bal.choose(data_parallel_rank=bad)


def test_draining_ranks_get_nothing_automatic():
    bal = Balancer(3, "tidal")
    bal.set_draining([0])
    bal.on_snapshot(snap([[0, 0], [5, 5], [5, 5]]), now=0.0)
    assert all(bal.choose() != 0 for _ in range(5))
    assert bal.choose(data_parallel_rank=0) == 0  # explicit still allowed
    bal.set_draining([0, 1, 2])
    with pytest.raises(RuntimeError, match="draining"):
        bal.choose()


def test_a_draining_rank_takes_requests_when_every_staying_rank_is_excluded():
    # A scale-down of 3 -> 2 drains engine 2; engines 0 and 1 stay. With both of them
    # excluded (dead, or their routes gone) the operation must roll back: engine 2 takes
    # the request rather than refusing it.
    bal = Balancer(3, "tidal")
    bal.set_draining([2])
    assert bal.choose(exclude=[0]) == 1  # a staying rank left: never the draining one
    assert bal.choose(exclude=[0, 1]) == 2
    with pytest.raises(RuntimeError, match="draining"):
        bal.choose(exclude=[0, 1, 2])


def test_p2c_is_deterministic_and_picks_the_better_of_two():
    picks = []
    for _ in range(2):
        bal = Balancer(8, "tidal-p2c", seed=7)
        bal.on_snapshot(snap([[0, r] for r in range(8)]), now=0.0)
        picks.append([bal.choose() for _ in range(20)])
    assert picks[0] == picks[1]
    assert 7 not in picks[0]  # the most loaded rank never wins a pair
    assert len(set(picks[0])) > 1


def test_resize_keeps_inflight_and_drops_old_snapshots():
    bal = Balancer(2, "tidal")
    bal.on_send(1, now=0.0)
    topo = bal.topology.grown(1)
    assert bal.set_topology(topo)
    assert [ld.inflight for ld in bal.loads()] == [0, 1, 0]
    assert not bal.on_snapshot(snap([[1, 1], [1, 1]]), now=1.0)  # an old-epoch snapshot
    bal.on_snapshot(snap([[1, 1], [1, 1], [0, 0]], epoch=1), now=1.0)
    assert bal.choose() == 2
    with pytest.raises(ValueError):
        bal.set_topology(topo.without([0, 1, 2]))


# ---------------------------------------------------------------------- topology


def _loaded(n: int, policy: str = "tidal") -> Balancer:
    """n engines; engine e has e + 1 of this frontend's requests in flight."""
    bal = Balancer(n, policy)
    for e in range(n):
        for _ in range(e + 1):
            bal.on_send(e, now=0.0)
    return bal


def test_remove_an_engine_from_the_middle():
    bal = _loaded(3)
    bal.on_snapshot(snap([[0, 1], [0, 2], [0, 3]]), now=1.0)
    topo = bal.topology.without([1])
    assert bal.set_topology(topo)
    assert bal.engine_ids == [0, 2] and bal.num_engines == 2
    # Survivors keep their rows (in-flight and snapshot counts); engine 1's are gone.
    assert [(ld.inflight, ld.running) for ld in bal.loads()] == [(1, 1), (3, 3)]
    assert bal.load_of(2).inflight == 3
    bal.on_finish(1)  # a request that was on the removed engine: nothing to undo
    assert [ld.inflight for ld in bal.loads()] == [1, 3]
    assert all(bal.choose() in (0, 2) for _ in range(5))
    with pytest.raises(ValueError, match="not in topology"):
        bal.on_send(1, now=2.0)


def test_remove_a_dead_engine():
    """A dead engine reports nothing, so it looks idle: it must vanish with its removal."""
    bal = Balancer(3, "tidal")
    bal.on_snapshot(snap([[2, 8], [0, 0], [2, 8]]), now=0.0)
    assert bal.choose() == 1
    bal.set_topology(bal.topology.without([1]))
    bal.on_snapshot(snap([[2, 8], [0, 0], [2, 8]], seq=2), now=0.1)  # from before: stale
    assert bal.stale_snapshots == 1
    assert {bal.choose() for _ in range(6)} <= {0, 2}


def test_routes_by_engine_id_after_changes():
    bal = Balancer(2, "tidal")
    topo = bal.topology.without([0]).grown(2)
    assert topo.engine_ids == [1, 2, 3] and topo.epoch == 2  # id 0 is never reused
    bal.set_topology(topo)
    bal.on_snapshot(snap([[0, 5], [0, 0], [0, 9]], epoch=2, engine_ids=[1, 2, 3]), now=0.0)
    assert bal.choose() == 2
    bal.on_send(2, now=0.0)
    assert bal.load_of(2).inflight == 1 and bal.loads()[1].inflight == 1
    # An explicit data_parallel_rank is a position: rank 0 is engine 1 now.
    assert bal.choose(data_parallel_rank=0) == 1
    assert bal.choose(data_parallel_rank=2) == 3
    with pytest.raises(ValueError, match=r"valid ranks are 0\.\.2"):
        bal.choose(data_parallel_rank=3)


def test_stale_snapshot_never_resurrects_a_removed_engine():
    bal = Balancer(3, "tidal")
    bal.on_snapshot(snap([[1, 4], [1, 4], [1, 4]]), now=0.0)
    bal.set_topology(bal.topology.without([1]))
    # Published before the coordinator learnt the change: engine 1 idle, the rest busy.
    assert not bal.on_snapshot(snap([[5, 9], [0, 0], [5, 9]], seq=2), now=0.1)
    assert bal.engine_ids == [0, 2]
    assert [ld.waiting for ld in bal.loads()] == [1, 1]  # unchanged by the stale one
    assert bal.on_snapshot(snap([[0, 1], [0, 2]], seq=3, epoch=1, engine_ids=[0, 2]), 0.2)
    assert [ld.running for ld in bal.loads()] == [1, 2]


def test_newer_snapshot_applies_to_known_engines_only():
    """Another frontend's controller moved first: use what both topologies share."""
    bal = Balancer(2, "tidal")
    bal.on_snapshot(snap([[0, 3], [0, 4]]), now=0.0)
    newer = snap([[0, 7], [0, 1]], seq=2, epoch=1, engine_ids=[0, 2])
    assert bal.on_snapshot(newer, now=0.1)
    assert bal.engine_ids == [0, 1]  # engine 2 is not added by a snapshot
    assert [ld.running for ld in bal.loads()] == [7, 4]  # engine 1 keeps its last load


def test_topology_only_moves_forward():
    bal = Balancer(3, "tidal")
    t1 = bal.topology.without([2])
    assert bal.set_topology(t1)
    assert not bal.set_topology(Topology.initial(3))  # stale: ignored
    assert not bal.set_topology(t1)  # repeated
    assert bal.engine_ids == [0, 1]
    with pytest.raises(ValueError, match="two topologies"):
        bal.set_topology(Topology(1, [0, 2]))


def test_draining_by_engine_id():
    bal = Balancer(3, "tidal")
    bal.set_topology(bal.topology.without([0]))
    bal.set_draining([2])
    bal.on_snapshot(snap([[5, 5], [0, 0]], epoch=1, engine_ids=[1, 2]), now=0.0)
    assert all(bal.choose() == 1 for _ in range(4))
    with pytest.raises(ValueError, match="not in topology"):
        bal.set_draining([0])  # removed
    bal.set_topology(bal.topology.without([2]))  # the drained engine leaves
    assert bal.choose() == 1
    bal.set_topology(bal.topology.grown(1))
    assert bal.engine_ids == [1, 3]  # the new engine gets a fresh id, not 0 or 2
    bal.on_snapshot(snap([[5, 5], [0, 0]], epoch=3, engine_ids=[1, 3]), now=1.0)
    assert bal.choose() == 3


# --------------------------------------------------------------------- simulator


@pytest.fixture(scope="module")
def sim():
    return load_sim()


def test_simulator_is_deterministic(sim):
    cfg = sim.SimConfig(workload="bursty", policy="tidal", duration_ms=2000, seed=3)
    assert sim.simulate(cfg) == sim.simulate(cfg)


@pytest.mark.parametrize("workload", ["bursty", "skewed"])
def test_tidal_imbalance_not_worse_than_vllm(sim, workload):
    """Running imbalance (time-averaged max/mean per rank), summed over fixed seeds."""
    totals = {}
    for policy in ("vllm", "tidal"):
        runs = [
            sim.simulate(sim.SimConfig(workload=workload, policy=policy, seed=s, duration_ms=8000))
            for s in range(3)
        ]
        assert all(r["requests"] > 100 for r in runs)
        totals[policy] = sum(r["running_imbalance"] for r in runs)
    assert totals["tidal"] <= totals["vllm"], totals
