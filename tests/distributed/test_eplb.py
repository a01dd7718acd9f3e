"""EPLB on real processes (gloo, 127.0.0.1), EP=2 with 2 redundant experts (5 slots/rank).

Each rank runs its own requests against the EP worker and an in-process full model (the
reference) and checks, at every step, greedy tokens and logits. Around the rebalances:
- the automatic one fires at exactly ``eplb_interval`` forwards (a dummy step here, so the
  window holds exactly the load gathered before it) and installs the placement that
  ``plan_rebalance`` computes from the global load, identically on every rank;
- after each rebalance every slot's w13/w2 hold the checkpoint's weights of the expert the
  new placement puts there, and the expert map / dispatcher placement agree;
- the same prompt gives the same logits before and after a rebalance.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_ep_model import (
    ATOL,
    BLOCKS_PER_REQ,
    DUMMY,
    NUM_BLOCKS,
    REST,
    _capture_logits,
    _config,
    _sched,
    _single,
)

INTERVAL = 6
REDUNDANT = 2
A, B, X, Y = range(4)  # X and Y: the same prompt, before and after the first rebalance


def _requests(rank: int, vocab: int):
    from tidal.engine_core.request import Request
    from tidal.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(300 + rank)
    shared = torch.randint(3, vocab, (5,), generator=g).tolist()
    prompts = [
        torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3 + 2 * rank, 6 + rank)
    ]
    prompts += [shared, shared]
    reqs = []
    for i, p in enumerate(prompts):
        req = Request(f"e{rank}-{i}", p, SamplingParams(temperature=0.0, max_tokens=32))
        req.block_ids = list(range(1 + i * BLOCKS_PER_REQ, 1 + (i + 1) * BLOCKS_PER_REQ))
        reqs.append(req)
    return reqs


def _scripts(rank: int) -> tuple[list, list, list]:
    before = [  # steps 1..6; step 6 (a dummy everywhere) triggers the rebalance
        [(X, REST), (A, REST)],
        DUMMY if rank == 1 else [(A, REST), (B, 3)],
        [(A, REST), (B, REST)],
        [(A, REST), (B, REST)],
        DUMMY if rank == 0 else [(B, REST)],
        DUMMY,
    ]
    between = [[(Y, REST), (A, REST)], [(A, REST), (B, REST)], DUMMY if rank else [(B, REST)]]
    after = [[(A, REST), (B, REST)], [(A, REST)], [(B, REST)], [(A, REST), (B, REST)]]
    return before, between, after


class _Pair:
    """The EP worker and the reference runner, stepped together."""

    def __init__(self, worker, ref, reqs) -> None:
        self.worker, self.ref, self.reqs = worker, ref, reqs
        self.ep_logits = _capture_logits(worker.model_runner)
        self.ref_logits = _capture_logits(ref)

    def run(self, steps: list) -> list[torch.Tensor]:
        """Run steps; returns the EP logits of each step that sampled."""
        out = []
        for step in steps:
            if step is DUMMY:
                self.worker.model_runner.execute_dummy_batch()
                continue
            n = len(self.ep_logits)
            sched = _sched(step, self.reqs)
            got = self.worker.model_runner.execute_model(sched)
            want = self.ref.execute_model(sched)
            assert got.sampled_token_ids == want.sampled_token_ids, (got, want)
            for sr in sched.scheduled:
                sr.request.num_computed_tokens += sr.num_new_tokens
                for tok in got.sampled_token_ids.get(sr.request.request_id, []):
                    sr.request.append_output_token(tok)
            if len(self.ep_logits) > n:
                out.append(self.ep_logits[-1])
        return out

    def check_logits(self) -> None:
        assert len(self.ep_logits) == len(self.ref_logits) > 0
        for g, w in zip(self.ep_logits, self.ref_logits):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=1e-5)


def _global_load(worker, layer_ids: list[int], num_experts: int) -> list[list[int]]:
    """Sum of every rank's get_expert_load(), gathered by the test (not by EPLB)."""
    loads = worker.dp_group.all_gather_object(worker.model_runner.get_expert_load())
    return [[sum(ld[i][e] for ld in loads) for e in range(num_experts)] for i in layer_ids]


def _check_weights(runner, ref, rank: int) -> None:
    eplb = runner.eplb
    for moe, full, placement in zip(
        runner.model.moe_layers(), ref.model.moe_layers(), eplb.placements
    ):
        ids = placement.local_expert_ids(rank)
        assert moe.local_expert_ids == ids
        assert moe.expert_map.tolist() == placement.expert_map_for_rank(rank)
        assert moe.dispatcher.placement == placement
        got, want = moe.read_weights(["w13", "w2"]), full.read_weights(["w13", "w2"])
        for slot, e in enumerate(ids):  # the reference holds expert e in slot e
            assert torch.equal(got["w13"][slot], want["w13"][e]), (slot, e)
            assert torch.equal(got["w2"][slot], want["w2"][e]), (slot, e)
            if moe.expert_bias:  # GPT-OSS: the biases moved with their experts
                assert torch.equal(moe.w13_bias[slot], full.w13_bias[e]), (slot, e)
                assert torch.equal(moe.w2_bias[slot], full.w2_bias[e]), (slot, e)


def _eplb_rank(rank: int, world: int, port: int, path: str, backend: str) -> dict:
    from tidal.executor.model_runner import ModelRunner
    from tidal.executor.worker import Worker
    from tidal.moe.eplb import plan_rebalance

    cfg = _config(
        path, rank, world, port, all2all_backend=backend, enable_eplb=True,
        num_redundant_experts=REDUNDANT, eplb_window=32, eplb_interval=INTERVAL,
    )  # fmt: skip
    worker = Worker(cfg, dist_timeout_s=120)  # covers the ranks' start-up skew
    worker.init_distributed()
    worker.load_model()
    worker.initialize_kv_cache(NUM_BLOCKS)
    ref = ModelRunner(_single(cfg), torch.device("cpu"))
    ref.load_model()
    ref.initialize_kv_cache(NUM_BLOCKS)
    runner, eplb = worker.model_runner, worker.model_runner.eplb
    pair = _Pair(worker, ref, _requests(rank, cfg.model.hf_config.vocab_size))
    before, between, after = _scripts(rank)
    layer_ids, E = eplb.layer_ids, runner.model.spec.num_experts
    initial = list(eplb.placements)
    _check_weights(runner, ref, rank)

    x_logits = pair.run(before[:-1])[0][:1]  # X is the first sampled row of step 1
    assert eplb.num_rebalances == 0 and eplb.steps == INTERVAL - 1
    expected = plan_rebalance(_global_load(worker, layer_ids, E), initial, REDUNDANT)
    pair.run(before[-1:])  # the INTERVAL-th forward: rebalances on every rank
    assert eplb.num_rebalances == 1 and eplb.placements == expected
    _check_weights(runner, ref, rank)
    y_logits = pair.run(between)[0][:1]
    torch.testing.assert_close(y_logits, x_logits, atol=ATOL, rtol=1e-5)
    assert pair.reqs[X].output_token_ids == pair.reqs[Y].output_token_ids

    first = list(eplb.placements)
    expected2 = plan_rebalance(_global_load(worker, layer_ids, E), first, REDUNDANT)
    worker.model_runner.rebalance_experts()  # forced, on every rank at the same step boundary
    assert eplb.num_rebalances == 2 and eplb.placements == expected2
    _check_weights(runner, ref, rank)
    pair.run(after)
    assert eplb.steps == len(before) + len(between) + len(after)
    assert eplb.num_rebalances == 3  # step 12: automatic again
    _check_weights(runner, ref, rank)
    pair.check_logits()
    worker.shutdown()
    return {
        "initial": [p.physical_to_logical for p in initial],
        "first": [p.physical_to_logical for p in first],
        "final": [p.physical_to_logical for p in eplb.placements],
        "outputs": [r.output_token_ids for r in pair.reqs],
    }


@pytest.mark.parametrize(
    ("backend", "model_type"),
    [
        ("allgather_reducescatter", "qwen3_moe"),
        ("all2all", "qwen3_moe"),
        ("all2all", "gpt_oss"),  # expert biases cross the ranks with their experts
    ],
)
def test_eplb_rebalance_moves_experts_and_keeps_outputs(
    run_ranks_on_ports, tiny_ckpt, backend, model_type
):
    path = tiny_ckpt(model_type)
    results = run_ranks_on_ports(_eplb_rank, 2, path, backend, timeout_s=240)
    # Every rank computed the same placements (plan determinism across ranks).
    assert results[0]["first"] == results[1]["first"]
    assert results[0]["final"] == results[1]["final"]
    # The first rebalance really moved experts (this seeded load is skewed enough).
    assert results[0]["first"] != results[0]["initial"]
    for res in results:
        assert all(len(out) >= 1 for out in res["outputs"])
