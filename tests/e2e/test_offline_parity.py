"""Greedy LLM.generate must equal transformers' generate token for token (float32), on
every path of the scheduler: each case asserts, from the engine's own counters, that it
took the path it is named for (prefix-cache hits, chunked prefill, preemption, none of
them)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tidal import LLM, SamplingParams
from tidal.kernels.cpu_ext import kernel_available, kernel_status
from tidal.kernels.onednn import onednn_available
from tidal.models.registry import model_types

MAX_TOKENS = 12


SHARED_PREFIX = 20  # tokens the last two prompts share


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    shared = torch.randint(3, vocab, (SHARED_PREFIX,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 3, 7, 16, 17, 33)]
    # Two prompts sharing a 20-token prefix (longer than one block). ``_run`` sends the
    # last one after the others have finished, so it finds the shared blocks cached:
    # sent together, both would be scheduled in the same step and neither could hit.
    prompts.append(shared + [5, 6, 7])
    prompts.append(shared + [9])
    return prompts


def _hf_greedy(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module", params=model_types())
def ckpt_and_expected(request, tiny_ckpt):
    """Every registered architecture's tiny checkpoint (its switches on)."""
    path = tiny_ckpt(request.param)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = _prompts(vocab)
    return path, prompts, _hf_greedy(path, prompts, MAX_TOKENS)


def _run(path: str, prompts: list[list[int]], **engine_kwargs) -> tuple[list[list[int]], Any, Any]:
    """Greedy outputs of ``prompts`` (the last one sent once the others have finished),
    the engine's scheduler counters afterwards and its CPU paths."""
    llm = LLM(path, dtype="float32", multiprocess=False, **engine_kwargs)
    try:
        # min_tokens masks EOS exactly like transformers' min_new_tokens does.
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        outs = []
        for batch in (prompts[:-1], prompts[-1:]):
            ids = [{"prompt_token_ids": p} for p in batch]
            outs += llm.generate(ids, params, use_tqdm=False)
        stats = llm.client.call_utility("get_stats")
        return (
            [o.outputs[0].token_ids for o in outs],
            stats,
            llm.client.call_utility("get_cpu_kernels"),
        )
    finally:
        llm.shutdown()


def _kv_groups(path: str) -> int:
    """The checkpoint's KV cache groups: its kinds of layers (GPT-OSS: sliding and full)."""
    from transformers import AutoConfig

    types = getattr(AutoConfig.from_pretrained(path), "layer_types", None) or ["full_attention"]
    return len(set(types))


def _full_blocks(tokens: int, block_size: int) -> int:
    return tokens // block_size * block_size


# (engine kwargs, what its counters must show: the least prefix-cache hit tokens, and
# whether requests were preempted). Hits: the last prompt's shared prefix, in whole
# blocks (a preempted request's recompute may hit more).
CASES = [
    pytest.param({}, _full_blocks(SHARED_PREFIX, 16), False, id="default"),
    # Budget 8 < the longest prompt (33): prompts are prefilled in chunks.
    pytest.param(
        {"max_num_batched_tokens": 8, "block_size": 4},
        _full_blocks(SHARED_PREFIX, 4),
        False,
        id="chunked-prefill",
    ),
    # 24 blocks of 4 tokens cannot hold the running requests' KV: some are preempted.
    pytest.param(
        {"num_gpu_blocks_override": 24, "block_size": 4, "max_model_len": 64},
        _full_blocks(SHARED_PREFIX, 4),
        True,
        id="preemption",
    ),
    pytest.param(
        {"enable_prefix_caching": False, "max_num_seqs": 3}, 0, False, id="no-prefix-cache"
    ),
]


@pytest.mark.parametrize(("engine_kwargs", "min_hits", "preempts"), CASES)
def test_greedy_matches_transformers(ckpt_and_expected, engine_kwargs, min_hits, preempts):
    path, prompts, expected = ckpt_and_expected
    if "max_num_batched_tokens" in engine_kwargs:
        assert max(map(len, prompts)) > engine_kwargs["max_num_batched_tokens"]
    groups = _kv_groups(path)
    if "num_gpu_blocks_override" in engine_kwargs:  # as many blocks for each group's table
        engine_kwargs = {
            **engine_kwargs, "num_gpu_blocks_override": engine_kwargs["num_gpu_blocks_override"] * groups
        }  # fmt: skip
    got, stats, _ = _run(path, prompts, **engine_kwargs)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}): {g} != {e}"
    if engine_kwargs.get("enable_prefix_caching", True):
        assert stats.prefix_cache_hits >= min_hits > 0, stats
    else:
        assert stats.prefix_cache_queries == stats.prefix_cache_hits == 0, stats
    assert (stats.num_preempted > 0) == preempts, stats


def _skip_unavailable(cpu_path: str) -> None:
    if cpu_path == "native" and not kernel_available():
        pytest.skip(kernel_status())
    if cpu_path == "onednn" and not onednn_available():
        pytest.skip("no oneDNN prepacked linear in this torch")


def _assert_served_by(kernels: dict, cpu_path: str) -> None:
    """Each op of the report served by ``cpu_path`` (or, for an op the path does not serve
    -- oneDNN has no norm or attention -- by torch)."""
    assert kernels["mode"] == cpu_path
    for op, choice in kernels["ops"].items():
        served = {choice["decode"].split(":")[0], choice["batch"].split(":")[0]}
        assert served <= {cpu_path, "torch"}, (op, choice)
        # router_logits: a routing rule the C++ router does not compute (torch serves its
        # rule on the logits oneDNN or torch computes)
        if op.startswith(("linear", "moe", "router[")) or (
            op.startswith("router_logits") and cpu_path != "native"
        ):
            assert served == {cpu_path}, (op, choice)


# The architectures whose TP shards run on every CPU path forced; the others on the
# measured choice (CI time: two worker processes start per run). Every path is forced
# for every architecture in one process (``test_greedy_matches_transformers_on_every_cpu_path``),
# and every architecture's shards are checked against the unsharded model in
# tests/distributed/test_tp_model.py.
_TP_EVERY_PATH = ("qwen3_moe", "deepseek_v3")


@pytest.mark.parametrize("cpu_path", ["auto", "native", "onednn", "torch"])
def test_greedy_matches_transformers_at_tensor_parallel_2(ckpt_and_expected, cpu_path):
    """Two TP workers (their own processes, gloo), with chunked prefill and preemption in
    the mix: the same tokens as transformers, on the measured choice and on every CPU path
    forced -- each worker holding its shard in that path's packed layout."""
    _skip_unavailable(cpu_path)
    path, prompts, expected = ckpt_and_expected
    if cpu_path != "auto" and os.path.basename(path) not in _TP_EVERY_PATH:
        pytest.skip("this architecture's TP shards run on the measured choice")
    got, _, kernels = _run(
        path,
        prompts,
        tensor_parallel_size=2,
        max_num_batched_tokens=8,
        block_size=4,
        num_gpu_blocks_override=40,
        max_model_len=64,
        cpu_kernels=cpu_path,
    )
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}) on {cpu_path}: {g} != {e}"
    assert kernels["chosen_by"] is None  # the driver chose; its peer took its choices
    if cpu_path != "auto":
        _assert_served_by(kernels, cpu_path)


# The architectures that run the DP x TP x EP case, and the dispatcher each runs it on (CI
# time: six processes start per run): one of each kind of layer the case shards -- plain
# experts with qk-norm (qwen3_moe), a gated shared expert (qwen2_moe), expert biases with
# sinks and sliding windows (gpt_oss), MLA with shared experts and grouped routing
# (deepseek_v3) -- two per dispatcher. The others' TP shards are compared with the
# unsharded model in tests/distributed/test_tp_model.py, their EP shards in test_ep_model.py
# (olmoe's experts are plain, as qwen3_moe's), and deepseek_v2's latent cache over DP
# ranks below (test_greedy_matches_transformers_at_dp2_ep).
_DP_TP_EP_BACKEND = {
    "qwen3_moe": "allgather_reducescatter",
    "qwen2_moe": "all2all",
    "gpt_oss": "all2all",
    "deepseek_v3": "allgather_reducescatter",
}


@pytest.mark.parametrize("backend", ["allgather_reducescatter", "all2all"])
def test_greedy_matches_transformers_at_dp2_tp2_ep(ckpt_and_expected, backend):
    """``--dp 2 -tp 2 --ep``: two ranks of two workers each, experts over all four, each
    worker dispatching its share of its rank's tokens."""
    path, prompts, expected = ckpt_and_expected
    model = os.path.basename(path)
    if model not in _DP_TP_EP_BACKEND:
        pytest.skip("an architecture whose layers the others here cover")
    if _DP_TP_EP_BACKEND[model] != backend:
        pytest.skip("each model runs on one dispatcher")
    llm = LLM(
        path,
        dtype="float32",
        data_parallel_size=2,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        all2all_backend=backend,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}): {g} != {e}"


# Architectures whose attention or cache differ from the others' (MLA's latent cache): also
# ``--dp 2 --ep`` without TP, each rank caching its own requests' latents.
_DP_EP = ("deepseek_v2", "deepseek_v3")


def test_greedy_matches_transformers_at_dp2_ep(ckpt_and_expected):
    """``--dp 2 --ep``: two single-worker ranks, experts split over them."""
    path, prompts, expected = ckpt_and_expected
    if os.path.basename(path) not in _DP_EP:
        pytest.skip("the DP x TP x EP case covers this architecture")
    llm = LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}): {g} != {e}"


@pytest.mark.parametrize("cpu_path", ["native", "onednn", "torch"])
def test_greedy_matches_transformers_on_every_cpu_path(ckpt_and_expected, cpu_path):
    """Whichever path the measurement picks on a machine, the tokens are transformers':
    each forced in turn, and each op served by it."""
    _skip_unavailable(cpu_path)
    path, prompts, expected = ckpt_and_expected
    got, _, kernels = _run(path, prompts, cpu_kernels=cpu_path)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}) on {cpu_path}: {g} != {e}"
    _assert_served_by(kernels, cpu_path)


def test_sliding_window_frees_blocks_and_matches_transformers(tmp_path):
    """GPT-OSS with every layer sliding (window 8): a running request's blocks behind the
    window go back to the pool, so three 45-token requests (12 blocks of 4 each when
    kept) run together in 15 blocks without a preemption, and the tokens, on prompts past
    the window with chunked prefill and decodes past it, are still transformers'."""
    from tidal.models.registry import entry_for_model_type
    from tidal.models.tiny import make_tiny_checkpoint

    entry = entry_for_model_type("gpt_oss")
    window = entry.test_config["sliding_window"]
    # The tiny_ckpt fixture's sizes, every layer sliding.
    path = make_tiny_checkpoint(
        str(tmp_path / "gpt_oss_sliding"), "gpt_oss", hidden_size=64, num_layers=2,
        num_experts=8, top_k=2, vocab_size=512, max_position_embeddings=512,
        **{**entry.test_config, "layer_types": ["sliding_attention"] * 2},
    )  # fmt: skip
    prompts = _prompts(512)[3:6]  # 16, 17 and 33 tokens
    assert min(map(len, prompts)) > window
    expected = _hf_greedy(path, prompts, MAX_TOKENS)
    llm = LLM(
        path, dtype="float32", multiprocess=False, block_size=4, num_gpu_blocks_override=16,
        max_num_batched_tokens=8, max_num_seqs=3, max_model_len=48,
    )  # fmt: skip
    try:
        assert llm.client.call_utility("get_kv_cache_info")["sliding_window"] == window
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.client.call_utility("get_stats")
    finally:
        llm.shutdown()
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"prompt {i} (len {len(prompts[i])})"
    assert stats.num_preempted == 0, stats


def test_mixed_layers_free_the_sliding_groups_blocks_and_match_transformers(tiny_ckpt):
    """GPT-OSS's alternating layers (window 8, then full attention) as two KV cache groups:
    the sliding group's blocks behind the window go back to the one pool while the full
    group keeps all of its own, so three requests that would need 50 blocks of 4 with
    every block kept run together in 39 without a preemption; the tokens, on prompts past
    the window with chunked prefill and decodes past it, are transformers'."""
    path = tiny_ckpt("gpt_oss")
    prompts = _prompts(512)[3:6]  # 16, 17 and 33 tokens
    expected = _hf_greedy(path, prompts, MAX_TOKENS)
    llm = LLM(
        path, dtype="float32", multiprocess=False, block_size=4, num_gpu_blocks_override=40,
        max_num_batched_tokens=8, max_num_seqs=3, max_model_len=48,
    )  # fmt: skip
    try:
        info = llm.client.call_utility("get_kv_cache_info")
        assert [g["sliding_window"] for g in info["kv_groups"]] == [8, None]
        assert info["sliding_window"] is None and info["tokens"] == 39 // 2 * 4
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.client.call_utility("get_stats")
        sliding, full = llm.client.call_utility("get_kv_cache_info")["kv_groups"]
    finally:
        llm.shutdown()
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"prompt {i} (len {len(prompts[i])})"
    assert stats.num_preempted == 0, stats
    # Blocks are freed when a request next allocates: last at its last decode that starts
    # a block, at p = (L - 2) // 4 * 4 (L tokens in all, the last one never computed),
    # which frees the blocks wholly before p - 8 + 1.
    lengths = [len(p) + MAX_TOKENS for p in prompts]
    freed = sum(((n - 2) // 4 * 4 - 8 + 1) // 4 for n in lengths)
    assert sliding["window_freed_blocks"] == freed == 4 + 4 + 8, sliding
    assert full["window_freed_blocks"] == 0, full
    assert sliding["blocks"] == full["blocks"] == 0  # all finished: every block back
