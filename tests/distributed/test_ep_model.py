"""Expert-parallel model on real processes (gloo, 127.0.0.1): each rank's EP forward must
equal a single-process run of the full model on the same tokens.

Every rank holds only its share of the experts (checked), runs its own sequences with
uneven token counts (prefills, a chunked prefill, decodes) and, at some steps, only a
dummy batch while the others compute; each rank also builds the full model in-process as
the reference, so logits (1e-5) and greedy tokens are compared rank by rank.
"""

from __future__ import annotations

import pytest
import torch

ATOL = 2e-5
BLOCK = 4
BLOCKS_PER_REQ = 8
NUM_BLOCKS = 64
DUMMY = None
REST = -1  # schedule every token of the request not computed yet


def _config(path: str, rank: int, world: int, port: int, **kw):
    from tidal.launch.engine_args import EngineArgs

    args = {
        "model": path,
        "dtype": "float32",
        "device": "cpu",
        "moe_backend": "torch",
        "block_size": BLOCK,
        "num_gpu_blocks_override": NUM_BLOCKS,
        "max_model_len": 128,
        "data_parallel_size": world,
        "data_parallel_rank": rank,
        "data_parallel_master_port": port,
        "enable_expert_parallel": True,
        **kw,
    }
    return EngineArgs(**args).create_engine_config()


def _single(cfg):
    """The same engine config as one process without parallelism: the reference."""
    return cfg.with_parallel(
        data_parallel_size=1, data_parallel_rank=0, enable_expert_parallel=False
    )


def _capture_logits(runner) -> list[torch.Tensor]:
    """Record every [N, V] logits tensor the runner samples from."""
    seen: list[torch.Tensor] = []
    inner = runner.model.compute_logits

    def compute_logits(hidden):
        out = inner(hidden)
        seen.append(out.clone())
        return out

    runner.model.compute_logits = compute_logits
    return seen


def _requests(rank: int, vocab: int):
    from tidal.engine_core.request import Request
    from tidal.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(100 + rank)
    reqs = []
    for i, n in enumerate((3 + 2 * rank, 6 + rank)):
        prompt = torch.randint(3, vocab, (n,), generator=g).tolist()
        req = Request(f"r{rank}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=32))
        req.block_ids = list(range(1 + i * BLOCKS_PER_REQ, 1 + (i + 1) * BLOCKS_PER_REQ))
        reqs.append(req)
    return reqs


def _script(rank: int, world: int) -> list:
    """Per step: DUMMY, or [(request index, tokens)]; the same step count on every rank."""
    a, b = 0, 1
    steps = [
        DUMMY if rank == 1 else [(a, REST)],  # rank 1 idles while the others prefill
        [(a, REST), (b, 4)],  # a prefill (rank 1) or decode; b's first chunk
        [(a, REST), (b, REST)],  # b's last chunk samples
        [(a, REST), (b, REST)],
        DUMMY if rank == 0 else [(b, REST)],
        [(b, REST), (a, REST)],
        [(a, REST)] if rank == world - 1 else DUMMY,
    ]
    return steps


def _sched(step, reqs):
    from tidal.executor.batch import ScheduledRequest, SchedulerOutput

    scheduled = []
    for i, n in step:
        req = reqs[i]
        todo = req.num_tokens - req.num_computed_tokens if n == REST else n
        scheduled.append(ScheduledRequest(req, req.num_computed_tokens, todo))
    total = sum(s.num_new_tokens for s in scheduled)
    return SchedulerOutput(scheduled=scheduled, total_num_scheduled_tokens=total)


def _ep_forward_rank(rank: int, world: int, port: int, path: str, backend: str) -> dict:
    from tidal.executor.model_runner import ModelRunner
    from tidal.executor.worker import Worker

    cfg = _config(path, rank, world, port, all2all_backend=backend)
    worker = Worker(cfg, dist_timeout_s=120)  # covers the ranks' start-up skew
    worker.init_distributed()
    worker.load_model()
    worker.initialize_kv_cache(NUM_BLOCKS)
    ref = ModelRunner(_single(cfg), torch.device("cpu"))
    ref.load_model()
    ref.initialize_kv_cache(NUM_BLOCKS)
    runner = worker.model_runner
    ep_logits, ref_logits = _capture_logits(runner), _capture_logits(ref)
    reqs = _requests(rank, cfg.model.hf_config.vocab_size)
    sizes = []
    for step in _script(rank, world):
        if step is DUMMY:
            worker.model_runner.execute_dummy_batch()
            sizes.append(runner.moe_context.num_tokens_across_dp)
            continue
        sched = _sched(step, reqs)
        got = worker.model_runner.execute_model(sched)
        want = ref.execute_model(sched)
        sizes.append(runner.moe_context.num_tokens_across_dp)
        assert got.sampled_token_ids == want.sampled_token_ids, (got, want)
        for sr in sched.scheduled:
            sr.request.num_computed_tokens += sr.num_new_tokens
            for tok in got.sampled_token_ids.get(sr.request.request_id, []):
                sr.request.append_output_token(tok)
    assert len(ep_logits) == len(ref_logits) > 0
    for g, w in zip(ep_logits, ref_logits):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=1e-5)
    layers = runner.model.moe_layers()
    moe = layers[0]
    dispatchers = {id(m.dispatcher): m.dispatcher for m in layers}.values()
    result = {
        "local_experts": list(moe.local_expert_ids),
        "w13_slots": moe.read_weights(["w13"])["w13"].shape[0],
        "sizes": sizes,
        "outputs": [r.output_token_ids for r in reqs],
        "dispatch_calls": sum(d.stats.calls for d in dispatchers),
        "moe_layers": len(layers),
    }
    worker.shutdown()
    assert worker.dp_group is None and worker.ep_group is None
    return result


@pytest.mark.parametrize(
    ("world", "backend", "model_type"),
    [
        pytest.param(2, "allgather_reducescatter", "qwen3_moe", id="ep2-allgather-qwen3"),
        pytest.param(2, "all2all", "mixtral", id="ep2-all2all-mixtral"),
        pytest.param(3, "all2all", "qwen3_moe", id="ep3-all2all-qwen3"),
        # Shared experts (replicated on every rank), with and without a gate; GLM's
        # sigmoid group-limited routing and its dense first layer.
        pytest.param(2, "allgather_reducescatter", "glm4_moe", id="ep2-allgather-glm4"),
        pytest.param(3, "all2all", "qwen2_moe", id="ep3-all2all-qwen2"),
        # Expert biases on 3 slots each (one a replica), router bias, sliding windows.
        pytest.param(3, "allgather_reducescatter", "gpt_oss", id="ep3-allgather-gpt-oss"),
        # MLA's latent cache on each rank; V3's sigmoid groups, V2's softmax groups
        pytest.param(2, "allgather_reducescatter", "deepseek_v3", id="ep2-allgather-deepseek-v3"),
        pytest.param(2, "all2all", "deepseek_v2", id="ep2-all2all-deepseek-v2"),
    ],
)
def test_ep_forward_matches_single_process(
    run_ranks_on_ports, tiny_ckpt, world, backend, model_type
):
    path = tiny_ckpt(model_type)
    results = run_ranks_on_ports(_ep_forward_rank, world, path, backend, timeout_s=240)
    from tidal.moe.placement import ExpertPlacement

    placement = ExpertPlacement.linear(8, world)
    for rank, res in enumerate(results):
        # Each rank holds only its slots of the linear placement (8 experts on 3 ranks:
        # 3 slots each, the spare one a replica).
        assert res["local_experts"] == placement.local_expert_ids(rank)
        assert res["w13_slots"] == placement.slots_per_rank < 8
        assert all(len(out) >= 3 for out in res["outputs"])
        # One dispatch per step per MoE layer: dummy steps took part too.
        assert res["dispatch_calls"] == len(_script(rank, world)) * res["moe_layers"]
    # Every rank saw the same agreed token counts, with this rank's own count in its slot.
    assert all(r["sizes"] == results[0]["sizes"] for r in results)
    step0 = results[0]["sizes"][0]
    assert step0[1] == 1 and step0[0] == 3  # rank 1's dummy token; rank 0's 3-token prompt
    # the token counts were uneven at every step with real work on several ranks
    assert len({tuple(s) for s in results[0]["sizes"]}) > 2


# ---------------------------------------------------------------------- EngineCore


def _prompts(rank: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7 + rank)
    return [
        torch.randint(3, vocab, (n,), generator=g).tolist()
        for n in range(2 + rank, 5 + 3 * rank, 2)
    ]


def _generate_lockstep(core, dp_group, prompts, max_tokens) -> dict[str, list[int]]:
    """Drive one EngineCore per rank like the DP busy loop: a real step or a dummy one,
    then agree whether any rank still has work."""
    from tidal.protocol.messages import EngineCoreRequest
    from tidal.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"q{i}", p, params))
    tokens: dict[str, list[int]] = {f"q{i}": [] for i in range(len(prompts))}
    while True:
        outputs, executed = core.step()
        for outs in outputs.values():
            for o in outs.outputs:
                tokens[o.request_id] += o.new_token_ids
        if not executed:
            core.execute_dummy_batch()
        if dp_group is None:
            if not core.has_unfinished_requests():
                return tokens
            continue
        flag = torch.tensor([int(core.has_unfinished_requests())], dtype=torch.int64)
        if not dp_group.all_reduce(flag).item():
            return tokens


def _engine_rank(rank: int, world: int, port: int, path: str, backend: str) -> dict:
    from tidal.engine_core.core import EngineCore

    cfg = _config(path, rank, world, port, all2all_backend=backend)
    core = EngineCore(cfg)
    worker = core.executor.worker
    prompts = _prompts(rank, cfg.model.hf_config.vocab_size)
    # Different lengths per rank: ranks finish at different steps and then idle.
    got = _generate_lockstep(core, worker.dp_group, prompts, max_tokens=4 + 3 * rank)
    groups = (worker.dp_group, worker.ep_group)
    core.shutdown()
    assert all(g.is_destroyed for g in groups)
    ref = EngineCore(_single(cfg))
    want = _generate_lockstep(ref, None, prompts, max_tokens=4 + 3 * rank)
    return {"got": got, "want": want}


@pytest.mark.parametrize("backend", ["allgather_reducescatter", "all2all"])
def test_engine_core_greedy_in_lockstep(run_ranks_on_ports, qwen3_ckpt, backend):
    results = run_ranks_on_ports(_engine_rank, 2, qwen3_ckpt, backend, timeout_s=240)
    for rank, res in enumerate(results):
        assert res["got"] == res["want"], f"rank {rank}"
        assert all(len(t) == 4 + 3 * rank for t in res["got"].values())
