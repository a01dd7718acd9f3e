"""Expert parallelism through the whole engine: DP ranks whose MoE layers are sharded.

Greedy tokens must equal the single-process engine's, for both CPU dispatchers, with an
idle rank (dummy batches), across EPLB rebalances, and after a level-2 sleep (the experts
reloaded from the checkpoint).
"""

from __future__ import annotations

import pytest

from tidal import LLM, SamplingParams

MAX_TOKENS = 8


def _prompts(n: int) -> list[dict]:
    return [
        {"prompt_token_ids": [5 + (11 * i + j) % 400 for j in range(3 + i % 7)]} for i in range(n)
    ]


def _greedy(llm: LLM, prompts: list[dict], **kw) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, **kw)]


@pytest.fixture(scope="module")
def expected(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, dtype="float32", multiprocess=False)
    try:
        yield _greedy(llm, _prompts(8))
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "dp,backend",
    [(2, "allgather_reducescatter"), (2, "all2all"), (3, "all2all")],
)
def test_ep_greedy_equals_single_process(qwen3_ckpt, expected, dp, backend):
    llm = LLM(
        qwen3_ckpt,
        dtype="float32",
        data_parallel_size=dp,
        enable_expert_parallel=True,
        all2all_backend=backend,
    )
    try:
        assert _greedy(llm, _prompts(8)) == expected
        # Only rank 0 has work: the other ranks' dummy batches pair with its forwards.
        from tidal.frontend.processor import ProcessedPrompt

        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        prompt = ProcessedPrompt(None, _prompts(1)[0]["prompt_token_ids"])
        children = llm.output_processor.add_request("solo", None, prompt.prompt_token_ids, params)
        (req,) = llm.input_processor.make_requests(children, prompt, params, data_parallel_rank=0)
        llm.client.add_request(req)
        (out,) = llm._run(["solo"], use_tqdm=False)
        assert out.outputs[0].token_ids == expected[0]
        assert llm.client.call_utility_on(1, "dp_state")["dummy_batches"] > 0
        load = llm.client.call_utility_all("get_expert_load")
        # Every rank counted the tokens its batches routed: top_k per token per layer.
        assert sum(sum(c) for rank in load for c in rank.values()) > 0
    finally:
        llm.shutdown()


def test_eplb_rebalances_without_changing_outputs(qwen3_ckpt, expected):
    llm = LLM(
        qwen3_ckpt,
        dtype="float32",
        data_parallel_size=2,
        enable_expert_parallel=True,
        enable_eplb=True,
        num_redundant_experts=2,
        eplb_window=16,
        eplb_interval=8,
    )
    try:
        first = _greedy(llm, _prompts(8))
        second = _greedy(llm, _prompts(8))
        infos = llm.client.call_utility_all("get_eplb_info")
        assert all(i["num_rebalances"] >= 1 for i in infos), infos
        assert infos[0]["layouts"] == infos[1]["layouts"]  # every rank agrees on the placement
        assert first == second == expected
        # Sleep level 2 drops every rank's experts; wake-up reloads them under one
        # placement (the first layer's, on every rank) and the tokens are the same.
        llm.sleep(level=2)
        llm.wake_up()
        after = llm.client.call_utility_all("get_eplb_info")
        layouts = [v for a in after for v in a["layouts"].values()]
        assert len(layouts) == 4 and all(v == layouts[0] for v in layouts), after
        assert _greedy(llm, _prompts(8)) == expected
    finally:
        llm.shutdown()
