"""Where the offline ``LLM`` runs its engine core, and an in-process engine interrupted
mid-step (Ctrl-C) staying usable."""

from __future__ import annotations

import dataclasses

import psutil
import pytest

from tidal import LLM, SamplingParams
from tidal.frontend.core_client import InprocClient
from tidal.launch.engine_args import EngineArgs
from tidal.launch.llm import runs_in_process

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _prompts(n: int, length: int) -> list[dict[str, list[int]]]:
    # Longer than a KV block, so the prefill step fills (and could cache) whole blocks.
    return [
        {"prompt_token_ids": [(7 * i + 3 * j) % 500 + 1 for j in range(length)]} for i in range(n)
    ]


def test_where_the_engine_runs(qwen3_ckpt) -> None:
    one = EngineArgs(model=qwen3_ckpt, dtype="float32").create_engine_config()
    assert runs_in_process(one)
    assert not runs_in_process(dataclasses.replace(one, device="cuda"))
    for kw in ({"data_parallel_size": 2}, {"enable_elastic_ep": True}):
        cfg = EngineArgs(model=qwen3_ckpt, dtype="float32", **kw).create_engine_config()
        assert not runs_in_process(cfg), kw


def test_default_llm_on_one_cpu_rank_runs_in_process(qwen3_ckpt) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = LLM(qwen3_ckpt, dtype="float32")
    try:
        assert isinstance(llm.client, InprocClient) and not llm.multiprocess
        assert {p.pid for p in psutil.Process().children(recursive=True)} == before
        out = llm.generate(_prompts(2, 20), PARAMS, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    finally:
        llm.shutdown()


def test_ctrl_c_mid_step_leaves_the_in_process_engine_usable(qwen3_ckpt) -> None:
    """A KeyboardInterrupt where the forward would run: generate aborts its requests, and
    the next generate, on the same prompts, returns what an uninterrupted engine returns
    (no request left behind, no unwritten KV block served from the prefix cache)."""
    prompts = _prompts(3, 40)
    ref = LLM(qwen3_ckpt, dtype="float32", multiprocess=False)
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, PARAMS, use_tqdm=False)]
    finally:
        ref.shutdown()

    llm = LLM(qwen3_ckpt, dtype="float32", multiprocess=False)
    engine = llm.client.engine
    runner = engine.executor.worker.model_runner
    run = runner.execute_model
    calls = {"n": 0}

    def interrupted_once(sched):
        calls["n"] += 1
        if calls["n"] == 1:  # the prefill step, as if Ctrl-C landed before its KV writes
            raise KeyboardInterrupt
        return run(sched)

    runner.execute_model = interrupted_once
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, PARAMS, use_tqdm=False)
        assert not engine.has_unfinished_requests()
        assert not llm.output_processor.has_unfinished()
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        assert got == want
    finally:
        llm.shutdown()


def test_async_scheduling_gives_the_synchronous_tokens(qwen3_ckpt) -> None:
    """The real runner with --async-scheduling: its placeholders are filled from the
    previous step's sampled ids, seeded rows draw at the right output position, and
    requests that read their outputs (penalties) wait for them: every token as without."""
    prompts = _prompts(4, 20)
    params = [
        PARAMS,
        SamplingParams(temperature=1.0, seed=7, max_tokens=8),
        SamplingParams(temperature=0.8, seed=3, max_tokens=5, min_tokens=3, top_k=20),
        SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.3),
    ]
    got = {}
    for mode in (False, True):
        llm = LLM(qwen3_ckpt, dtype="float32", multiprocess=False, async_scheduling=mode)
        try:
            out = llm.generate(prompts, params, use_tqdm=False)
            got[mode] = [o.outputs[0].token_ids for o in out]
        finally:
            llm.shutdown()
    assert got[True] == got[False]
    assert [len(t) for t in got[True]] == [6, 8, 5, 6]
