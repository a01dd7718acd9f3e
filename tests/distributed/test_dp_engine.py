"""Data-parallel engine ranks (real processes, gloo, the real coordinator)."""

from __future__ import annotations

import threading

import msgspec
import pytest

from tests.waiting import wait_until
from tidal import LLM, SamplingParams
from tidal.protocol.messages import SchedulerStats

MAX_TOKENS = 10


def _prompts(n: int) -> list[dict]:
    return [
        {"prompt_token_ids": [3 + (7 * i + j) % 400 for j in range(2 + i % 9)]} for i in range(n)
    ]


def _greedy(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, dtype="float32", multiprocess=False)
    try:
        yield _greedy(llm, _prompts(12))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("dp", [2, 3])
def test_dp_greedy_equals_dp1(qwen3_ckpt, expected, dp):
    llm = LLM(qwen3_ckpt, dtype="float32", data_parallel_size=dp)
    try:
        assert _greedy(llm, _prompts(12)) == expected
        # Every rank served something (the balancer spreads a burst).
        states = [llm.client.call_utility_on(r, "dp_state") for r in range(dp)]
        assert {s["rank"] for s in states} == set(range(dp))
    finally:
        llm.shutdown()
    assert not llm.client.manager.procs or all(
        not p.is_alive() for p in llm.client.manager.procs.values()
    )


def _dp_states(llm: LLM) -> list[dict]:
    return llm.client.call_utility_all("dp_state")


def _load(llm: LLM) -> tuple[int, int]:
    """(waiting, running) requests over all ranks, as their schedulers count them now."""
    stats = [msgspec.convert(s, SchedulerStats) for s in llm.client.call_utility_all("get_stats")]
    return (sum(s.num_waiting_reqs for s in stats), sum(s.num_running_reqs for s in stats))


def test_idle_rank_runs_dummy_batches_then_pauses(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, dtype="float32", data_parallel_size=2)
    try:
        state = lambda r: llm.client.call_utility_on(r, "dp_state")  # noqa: E731
        wave0 = state(1)["wave"]
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        # Pin the only request to rank 0: rank 1 must step dummy batches meanwhile.
        from tidal.frontend.processor import ProcessedPrompt

        proc = llm.input_processor
        prompt = ProcessedPrompt(None, [5, 6, 7])
        children = llm.output_processor.add_request("pinned", None, prompt.prompt_token_ids, params)
        (req,) = proc.make_requests(children, prompt, params, data_parallel_rank=0)
        llm.client.add_request(req)
        done = []
        while not done:
            outs = llm.client.get_output()
            done = [
                r
                for r in llm.output_processor.process_outputs(outs.outputs).request_outputs
                if r.finished
            ]
        assert len(done[0].outputs[0].token_ids) == 60
        assert state(1)["dummy_batches"] > 0
        # The group goes idle: the wave ends on both ranks and dummy batches stop.
        assert wait_until(lambda: not state(0)["running"] and not state(1)["running"])
        assert state(0)["wave"] == state(1)["wave"] > wave0
        # Paused for good: rank 1's busy loop goes around once per utility call, and
        # would step a dummy batch each time were a wave still running.
        idle = state(1)
        for _ in range(5):
            assert state(1) == idle
    finally:
        llm.shutdown()


def test_bursts_across_wave_ends_never_hang(qwen3_ckpt, expected):
    """Many small bursts, spaced so requests keep arriving around wave ends."""
    llm = LLM(qwen3_ckpt, dtype="float32", data_parallel_size=2)
    prompts = _prompts(12)
    try:
        result: dict = {}

        def run() -> None:
            got = []
            for i in range(12):
                got += _greedy(llm, prompts[i : i + 1])
                # Every third burst waits for the wave to end (it then wakes paused ranks);
                # the others arrive right away, while the ranks are still ending the wave.
                if i % 3 == 0:
                    assert wait_until(lambda: not any(s["running"] for s in _dp_states(llm)))
            result["got"] = got
            result["waves"] = [s["wave"] for s in _dp_states(llm)]

        th = threading.Thread(target=run)
        th.start()
        th.join(180)
        assert not th.is_alive(), "DP engines hung"
        assert result["got"] == expected
        assert min(result["waves"]) >= 4  # the group did go idle between bursts
    finally:
        llm.shutdown()


def test_two_phase_pause_and_resume(qwen3_ckpt, expected):
    llm = LLM(qwen3_ckpt, dtype="float32", data_parallel_size=2)
    prompts = _prompts(12)
    try:
        assert llm.client.call_utility_all("pause") == [True, True]
        assert wait_until(lambda: all(s["paused"] for s in llm.client.call_utility_all("dp_state")))
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        ids = []
        for p in prompts[:4]:
            ids.append(llm._add(llm.input_processor.tokenize(p), params))
        # Paused: the requests reach the ranks and stay queued; nothing runs.
        assert wait_until(lambda: _load(llm) == (4, 0)), _load(llm)
        assert all(s["paused"] for s in _dp_states(llm))
        assert llm.client.outputs.empty()
        llm.client.call_utility_all("resume")
        got = llm._run(ids, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == expected[:4]
    finally:
        llm.shutdown()
