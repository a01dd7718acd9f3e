"""Scheduler driven by a fake model runner that simulates the paged KV cache.

``FakeRunner`` keeps, for every (block, offset) slot, a fingerprint of the token prefix
whose KV it holds. Each step it checks that every position a scheduled request attends
to (``[0, start)``) holds exactly that request's prefix *as written before this step*,
writes the new slice (never into a shared or cached block), and samples a token that is
a pure function of the request's tokens, so a recomputed request samples the same ones.
"""

from __future__ import annotations

import random
import zlib
from types import SimpleNamespace

import pytest

from tidal.config import CacheConfig, SchedulerConfig
from tidal.engine_core.request import Request, RequestStatus
from tidal.engine_core.scheduler import Scheduler
from tidal.executor.batch import NULL_BLOCK_ID, ModelRunnerOutput, SchedulerOutput
from tidal.protocol.messages import EngineCoreOutputs, FinishReason, Logprobs
from tidal.sampling_params import SamplingParams

BS = 4
EOS = 2


def make_sched(
    budget: int = 64,
    max_seqs: int = 8,
    max_model_len: int = 256,
    chunked: bool = True,
    num_blocks: int = 129,
    caching: bool = True,
    kv_window: int | None = None,
    kv_windows: tuple[int | None, ...] | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
        ),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks,
        kv_windows=kv_windows or (kv_window,),
    )


def make_req(
    rid: str,
    prompt: int | list[int],
    max_tokens: int | None = 4,
    client: int = 0,
    max_model_len: int | None = None,
    **sp,
) -> Request:
    seed = zlib.crc32(rid.encode())
    tokens = (
        prompt if isinstance(prompt, list) else [100 + (i * 7 + seed) % 50 for i in range(prompt)]
    )
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=max_tokens, **sp),
        eos_token_id=EOS,
        client_index=client,
        max_model_len=max_model_len,
    )


def det_token(req: Request) -> int:
    """A 'greedy model': the next token depends only on the tokens so far."""
    return 10 + zlib.crc32(repr(req.all_token_ids).encode()) % 40


def _fingerprints(tokens: list[int]) -> list[int]:
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class FakeRunner:
    """``window``: the model's sliding window; a step's first query (at ``start``) then
    reads only positions > start - window, and the blocks wholly before those may be
    null (freed). ``windows``: KV cache groups, each group's window (its table is every
    len(windows)-th entry of ``block_ids``); a slot's fingerprint names its group."""

    def __init__(
        self,
        sched: Scheduler,
        sample=det_token,
        window: int | None = None,
        windows: tuple[int | None, ...] | None = None,
    ) -> None:
        self.sched = sched
        self.windows = windows or (window,)
        self.sample = sample
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}  # slot -> (group, fingerprint)
        self.prompt_logprobs = False
        # ScheduledRequest.samples is live (reads num_tokens): record it before update.
        self.samples: list[bool] = []

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        pool = self.sched.kv_cache_manager.block_pool
        before = dict(self.kv)  # reads see only KV written in earlier steps
        ro = ModelRunnerOutput()
        self.samples = [sr.samples for sr in so.scheduled]
        groups = len(self.windows)
        for sr in so.scheduled:
            req, end = sr.request, sr.start + sr.num_new_tokens
            assert 0 < sr.num_new_tokens and end <= req.num_tokens
            assert len(req.block_ids) % groups == 0
            assert len(req.block_ids) // groups * BS >= end
            fps = _fingerprints(req.all_token_ids[:end])
            for g, window in enumerate(self.windows):
                table = req.block_ids[g::groups]
                first = 0 if window is None else max(0, sr.start - window + 1)
                assert NULL_BLOCK_ID not in table[first // BS :], (req, g, first)
                for p in range(first, sr.start):
                    assert before.get((table[p // BS], p % BS)) == (g, fps[p]), (req, g, p)
                for p in range(sr.start, end):
                    block = pool.blocks[table[p // BS]]
                    assert block.ref_cnt == 1 and block.block_hash is None, (req, block)
                    self.kv[(block.block_id, p % BS)] = (g, fps[p])
            if sr.samples:
                ro.sampled_token_ids[req.request_id] = [self.sample(req)]
            if self.prompt_logprobs and req.sampling_params.prompt_logprobs is not None:
                # Entry k is prompt token start + 1 + k; encode the index to check dedup.
                last = min(end, req.num_prompt_tokens - 1)
                ro.prompt_logprobs[req.request_id] = [
                    Logprobs([req.all_token_ids[j]], [-float(j)], 1)
                    for j in range(sr.start + 1, last + 1)
                ]
        return ro

    def step(self) -> tuple[SchedulerOutput, dict[int, EngineCoreOutputs]]:
        so = self.sched.schedule()
        return so, self.sched.update_from_output(so, self.execute(so))


def outputs_by_id(outs: dict[int, EngineCoreOutputs]) -> dict[str, object]:
    return {o.request_id: o for eco in outs.values() for o in eco.outputs}


def run_to_completion(runner: FakeRunner, max_steps: int = 1000) -> dict[str, list]:
    """Step until idle; returns request id -> list of its EngineCoreOutput."""
    got: dict[str, list] = {}
    for _ in range(max_steps):
        if not runner.sched.has_unfinished_requests():
            return got
        _, outs = runner.step()
        for rid, o in outputs_by_id(outs).items():
            got.setdefault(rid, []).append(o)
    raise AssertionError("did not finish")


def assert_all_blocks_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.usage == 0.0


def check_invariants(sched: Scheduler, so: SchedulerOutput) -> None:
    cfg = sched.config
    assert so.total_num_scheduled_tokens == sum(s.num_new_tokens for s in so.scheduled)
    assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    assert len({s.request.request_id for s in so.scheduled}) == len(so.scheduled)
    live = sched.running
    pool = sched.kv_cache_manager.block_pool
    for block in pool.blocks[1:]:
        assert block.ref_cnt == sum(r.block_ids.count(block.block_id) for r in live)
    for r in sched.waiting:
        assert r.block_ids == [] and r.num_computed_tokens == 0
    assert pool.num_free_blocks == sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0)


# ---- budget, ordering, chunking --------------------------------------------------------


def test_token_budget_and_max_num_seqs() -> None:
    sched = make_sched(budget=20, max_seqs=3)
    runner = FakeRunner(sched)
    for i in range(6):
        sched.add_request(make_req(f"r{i}", 9, max_tokens=5))
    so, _ = runner.step()
    # r0 (9) + r1 (9) + 2 tokens of r2; r3.. wait for a seat.
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in so.scheduled] == [
        ("r0", 0, 9),
        ("r1", 0, 9),
        ("r2", 0, 2),
    ]
    assert sched.num_running == 3 and sched.num_waiting == 3
    while sched.has_unfinished_requests():
        so, _ = runner.step()
        check_invariants(sched, so)
        assert len(so.scheduled) <= 3
    assert_all_blocks_free(sched)


def test_decode_first_then_waiting_fcfs() -> None:
    sched = make_sched(budget=16)
    runner = FakeRunner(sched)
    sched.add_request(make_req("a", 5, max_tokens=10))
    sched.add_request(make_req("b", 5, max_tokens=10))
    runner.step()  # both prefills
    sched.add_request(make_req("c", 40, max_tokens=2))
    sched.add_request(make_req("d", 3, max_tokens=2))
    so, _ = runner.step()
    assert [(s.request.request_id, s.num_new_tokens) for s in so.scheduled] == [
        ("a", 1),
        ("b", 1),
        ("c", 14),  # the rest of the budget; d must not overtake c
    ]
    assert runner.samples == [True, True, False]


def test_chunked_prefill_samples_only_at_the_end() -> None:
    sched = make_sched(budget=16)
    runner = FakeRunner(sched)
    req = make_req("long", 50, max_tokens=3)
    sched.add_request(req)
    chunks = []
    for _ in range(4):
        so, outs = runner.step()
        (sr,) = so.scheduled
        (samples,) = runner.samples
        chunks.append((sr.start, sr.num_new_tokens, samples))
        if not samples:
            assert outs == {} and req.num_output_tokens == 0
    assert chunks == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)]
    assert req.num_output_tokens == 1
    run_to_completion(runner)
    assert req.num_output_tokens == 3
    assert_all_blocks_free(sched)


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    sched = make_sched(budget=32, chunked=False, max_model_len=64)
    runner = FakeRunner(sched)
    sched.add_request(make_req("a", 10, max_tokens=3))
    sched.add_request(make_req("a2", 10, max_tokens=3))
    runner.step()
    sched.add_request(make_req("b", 31, max_tokens=2))  # 31 > 30 left after 2 decodes
    sched.add_request(make_req("c", 2, max_tokens=2))  # fits, but must not overtake b
    so, _ = runner.step()
    assert [s.request.request_id for s in so.scheduled] == ["a", "a2"]
    runner.step()  # a and a2 finish (3rd token)
    so, _ = runner.step()
    assert [(s.request.request_id, s.num_new_tokens) for s in so.scheduled] == [("b", 31)]
    run_to_completion(runner)
    assert_all_blocks_free(sched)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add_request(make_req("too_long", 40, max_tokens=2))


# ---- prefix caching --------------------------------------------------------------------


def test_prefix_cache_hit_for_shared_prefix() -> None:
    sched = make_sched()
    runner = FakeRunner(sched)
    shared = list(range(200, 213))  # 3 full blocks + 1
    a = make_req("a", shared + [1, 1, 1], max_tokens=2)
    sched.add_request(a)
    runner.step()
    b = make_req("b", shared + [9, 9], max_tokens=2)
    same = make_req("same", list(a.prompt_token_ids), max_tokens=2)
    sched.add_request(b)
    sched.add_request(same)
    so, outs = runner.step()
    plan = {s.request.request_id: (s.start, s.num_new_tokens) for s in so.scheduled}
    assert plan["b"] == (12, 3)
    # 16 prompt tokens = 4 full blocks, but the last token is always recomputed.
    assert plan["same"] == (12, 4)
    assert b.num_cached_tokens == 12 and same.num_cached_tokens == 12
    assert outputs_by_id(outs)["b"].num_cached_tokens == 12
    kv = sched.kv_cache_manager
    assert kv.prefix_cache_queries == 16 + 15 + 16 and kv.prefix_cache_hits == 24
    assert sched.make_stats().prefix_cache_hits == 24
    run_to_completion(runner)
    assert a.output_token_ids == same.output_token_ids  # same tokens, same samples
    assert_all_blocks_free(sched)


def test_no_hit_on_blocks_computed_in_the_same_step() -> None:
    sched = make_sched()
    runner = FakeRunner(sched)
    a = make_req("a", list(range(300, 320)), max_tokens=2)
    b = make_req("b", list(range(300, 320)), max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    runner.step()
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    run_to_completion(runner)
    assert a.output_token_ids == b.output_token_ids


def test_prefix_caching_disabled_and_prompt_logprobs_skip_the_cache() -> None:
    for caching, plp in ((False, None), (True, 1)):
        sched = make_sched(caching=caching)
        runner = FakeRunner(sched)
        sched.add_request(make_req("a", list(range(400, 420)), max_tokens=2))
        runner.step()
        b = make_req("b", list(range(400, 420)), max_tokens=2, prompt_logprobs=plp)
        sched.add_request(b)
        so, _ = runner.step()
        assert b.num_cached_tokens == 0 and so.scheduled[-1].num_new_tokens == 20


# ---- preemption ------------------------------------------------------------------------


def _solo_outputs(prompt: list[int], max_tokens: int) -> list[int]:
    sched = make_sched()
    runner = FakeRunner(sched)
    req = make_req("solo", prompt, max_tokens=max_tokens)
    sched.add_request(req)
    run_to_completion(runner)
    return req.output_token_ids


def test_preemption_by_recompute_resumes_and_finishes() -> None:
    # 7 usable blocks; each request needs 5 at its end, so the newer one is preempted.
    sched = make_sched(num_blocks=8)
    runner = FakeRunner(sched)
    a = make_req("a", 8, max_tokens=12)
    b = make_req("b", 8, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    preempted_seen = False
    got = {}
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        so, outs = runner.step()
        check_invariants(sched, so)
        if so.preempted_req_ids:
            assert so.preempted_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
            assert b.block_ids == [] and b.num_computed_tokens == 0
            assert sched.waiting[0] is b
            assert "b" not in {s.request.request_id for s in so.scheduled}
            preempted_seen = True
        for rid, o in outputs_by_id(outs).items():
            got.setdefault(rid, []).extend(o.new_token_ids)
    assert preempted_seen and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert sched.make_stats().num_preempted == b.num_preemptions
    for r in (a, b):
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert got[r.request_id] == r.output_token_ids
        assert r.output_token_ids == _solo_outputs(r.prompt_token_ids, 12)
    assert_all_blocks_free(sched)


def test_sliding_window_frees_blocks_so_nothing_is_preempted() -> None:
    """The preemption case above with a window of 4: each request holds at most 3 blocks
    at once (its window and the step's new token), so both run to the end together, with
    the same tokens and every block free after."""
    sched = make_sched(num_blocks=8, kv_window=4)
    runner = FakeRunner(sched, window=4)
    a = make_req("a", 8, max_tokens=12)
    b = make_req("b", 8, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        so, _ = runner.step()
        check_invariants(sched, so)
        assert not so.preempted_req_ids
        assert all(sum(x != NULL_BLOCK_ID for x in r.block_ids) <= 3 for r in sched.running)
    assert sched.make_stats().num_preempted == 0
    assert sched.kv_cache_manager.num_window_freed_blocks > 0
    for r in (a, b):
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert r.output_token_ids == _solo_outputs(r.prompt_token_ids, 12)
    assert_all_blocks_free(sched)


def test_admission_counts_a_sliding_group_by_its_window() -> None:
    """A sliding group never holds more than its window and a step's tokens, so admission
    counts that, not its whole table: a request whose two whole tables (full + sliding)
    would need 30 blocks of the 20 there are is admitted (its peak is 15 + 4) and runs to
    the end alone, unpreempted, with the tokens of a run without the window; one that
    needs more than the peak allows is still refused, naming its blocks."""
    windows = (4, None)
    sched = make_sched(budget=8, max_model_len=80, num_blocks=21, kv_windows=windows)
    assert sched.kv_cache_manager.num_usable_blocks == 20
    runner = FakeRunner(sched, windows=windows)
    req = make_req("long", 40, max_tokens=20)  # KV for 59 tokens: 15 blocks a table
    assert sched.kv_cache_manager.num_blocks_for(59) == 30
    assert sched.kv_cache_manager.peak_blocks_for(59, 8) == 15 + 4
    sched.add_request(req)
    got = run_to_completion(runner)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert [t for o in got["long"] for t in o.new_token_ids] == req.output_token_ids
    assert req.output_token_ids == _solo_outputs(req.prompt_token_ids, 20)
    assert sched.make_stats().num_preempted == 0
    assert_all_blocks_free(sched)
    with pytest.raises(ValueError, match=r"\(21 blocks\) but the cache holds only 20 blocks"):
        sched.add_request(make_req("longer", 40, max_tokens=26))  # 65 tokens: 17 + 4


def test_no_admission_in_a_step_that_preempted() -> None:
    # c (a chunked prefill) is preempted for a's decode; the budget left would let c
    # back in at once with a small chunk, which would only thrash.
    sched = make_sched(num_blocks=6, budget=4, caching=False)  # 5 usable blocks
    runner = FakeRunner(sched)
    a = make_req("a", 4, max_tokens=8)
    c = make_req("c", 20, max_tokens=1)
    sched.add_request(a)
    runner.step()
    sched.add_request(c)
    for _ in range(20):
        so, _ = runner.step()
        if so.preempted_req_ids:
            break
    assert so.preempted_req_ids == {"c"}
    assert [s.request.request_id for s in so.scheduled] == ["a"]
    assert sched.waiting[0] is c and sched.kv_cache_manager.num_free_blocks > 0
    run_to_completion(runner)
    assert a.num_output_tokens == 8 and c.num_output_tokens == 1
    assert_all_blocks_free(sched)


def test_one_huge_request_makes_progress_among_small_ones() -> None:
    # The huge request needs every usable block at its end: the others must yield.
    sched = make_sched(num_blocks=17, budget=32)
    runner = FakeRunner(sched)
    small = [make_req(f"s{i}", 6, max_tokens=20) for i in range(3)]
    for r in small:
        sched.add_request(r)
    runner.step()
    huge = make_req("huge", 40, max_tokens=25)  # 64 tokens of KV = 16 blocks
    sched.add_request(huge)
    got = run_to_completion(runner, max_steps=500)
    assert huge.num_output_tokens == 25 and all(r.num_output_tokens == 20 for r in small)
    assert sum(len(o.new_token_ids) for o in got["huge"]) == 25
    assert_all_blocks_free(sched)
    with pytest.raises(ValueError, match="KV cache"):
        sched.add_request(make_req("too_big", 40, max_tokens=26))


def test_self_preemption_of_the_only_growing_request() -> None:
    # a holds blocks; b's decode cannot grow while a holds them, b preempts itself
    # (it is the last running), and still finishes once a is done.
    sched = make_sched(num_blocks=5, budget=16)  # 4 usable blocks
    runner = FakeRunner(sched)
    a = make_req("a", 8, max_tokens=8)  # up to 15 tokens: 4 blocks
    b = make_req("b", 3, max_tokens=6)  # up to 8 tokens: 2 blocks
    sched.add_request(a)
    sched.add_request(b)
    run_to_completion(runner)
    assert a.num_output_tokens == 8 and b.num_output_tokens == 6
    assert b.num_preemptions >= 1
    assert_all_blocks_free(sched)


def test_prompt_logprobs_not_resent_after_preemption() -> None:
    sched = make_sched(num_blocks=8, budget=8)
    runner = FakeRunner(sched)
    runner.prompt_logprobs = True
    a = make_req("a", 8, max_tokens=12)
    b = make_req("b", 10, max_tokens=10, prompt_logprobs=1)
    sched.add_request(a)
    sched.add_request(b)
    got = run_to_completion(runner)
    assert b.num_preemptions >= 1
    positions = [int(-lp.logprobs[0]) for o in got["b"] for lp in (o.new_prompt_logprobs or [])]
    assert positions == list(range(1, 10))  # prompt tokens 1..P-1, each once, in order
    assert not any(o.new_prompt_logprobs for o in got["a"])


# ---- stop conditions -------------------------------------------------------------------


def _run_with_tokens(tokens: list[int], **kw) -> tuple[Request, list]:
    sched = make_sched(max_model_len=kw.pop("mml", 256))
    it = iter(tokens)
    runner = FakeRunner(sched, sample=lambda req: next(it))
    req = make_req("r", 4, **kw)
    sched.add_request(req)
    got = run_to_completion(runner)["r"]
    assert_all_blocks_free(sched)
    return req, got


def test_stop_on_eos() -> None:
    req, got = _run_with_tokens([5, 6, EOS, 7], max_tokens=10)
    assert req.output_token_ids == [5, 6, EOS]
    assert got[-1].finish_reason == FinishReason.STOP and got[-1].stop_reason is None
    assert [o.finished for o in got] == [False, False, True]


def test_stop_token_ids_set_stop_reason() -> None:
    req, got = _run_with_tokens([5, 33, 7], max_tokens=10, stop_token_ids=[33])
    assert req.output_token_ids == [5, 33]
    assert got[-1].finish_reason == FinishReason.STOP and got[-1].stop_reason == 33


def test_max_tokens_and_max_model_len_cap_length() -> None:
    req, got = _run_with_tokens([5] * 10, max_tokens=3)
    assert req.num_output_tokens == 3 and got[-1].finish_reason == FinishReason.LENGTH
    # 4-token prompt, max_model_len 7: three tokens, whatever max_tokens says.
    req, got = _run_with_tokens([5] * 10, max_tokens=None, mml=7)
    assert req.num_tokens == 7 and got[-1].finish_reason == FinishReason.LENGTH


def test_min_tokens_ignores_eos_and_stop_ids_until_reached() -> None:
    req, got = _run_with_tokens([EOS, 33, EOS, 5], max_tokens=10, min_tokens=3, stop_token_ids=[33])
    assert req.output_token_ids == [EOS, 33, EOS]
    assert got[-1].finish_reason == FinishReason.STOP and got[-1].stop_reason is None


def test_ignore_eos_runs_to_max_tokens_but_keeps_stop_ids() -> None:
    req, got = _run_with_tokens([EOS, EOS, 5, EOS], max_tokens=4, ignore_eos=True)
    assert req.output_token_ids == [EOS, EOS, 5, EOS]
    assert got[-1].finish_reason == FinishReason.LENGTH
    req, got = _run_with_tokens([EOS, 5], max_tokens=9, ignore_eos=True, stop_token_ids=[EOS])
    assert req.output_token_ids == [EOS]
    assert got[-1].stop_reason == EOS


def test_eos_on_the_last_allowed_token_is_a_stop() -> None:
    req, got = _run_with_tokens([5, EOS], max_tokens=2)
    assert got[-1].finish_reason == FinishReason.STOP


# ---- aborts, outputs, validation -------------------------------------------------------


def test_abort_frees_blocks_and_emits_no_output() -> None:
    sched = make_sched(budget=8)
    runner = FakeRunner(sched)
    run_req = make_req("run", 6, max_tokens=10, client=1)
    chunk_req = make_req("chunk", 20, max_tokens=10, client=1)
    wait_req = make_req("wait", 6, max_tokens=10)
    for r in (run_req, chunk_req, wait_req):
        sched.add_request(r)
    runner.step()  # run: 6 tokens, chunk: 2 tokens; wait gets nothing
    assert run_req.block_ids and chunk_req.block_ids and sched.num_waiting == 1
    sched.abort_requests(["run", "chunk", "wait", "unknown"])
    assert not sched.has_unfinished_requests() and sched.has_requests()
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in (run_req, chunk_req, wait_req))
    assert_all_blocks_free(sched)
    so = sched.schedule()
    assert so.is_empty and so.finished_req_ids == {"run", "chunk", "wait"}
    outs = sched.update_from_output(so, ModelRunnerOutput())
    assert outs[1].outputs == [] and outs[1].finished_requests == {"run", "chunk"}
    assert outs[0].finished_requests == {"wait"}
    assert not sched.has_requests()
    sched.abort_requests("run")  # already gone: ignored
    with pytest.raises(ValueError):
        sched.finish_requests("x", RequestStatus.RUNNING)


def test_outputs_grouped_by_client_and_finished_reported() -> None:
    sched = make_sched()
    runner = FakeRunner(sched)
    sched.add_request(make_req("a", 5, max_tokens=1, client=0))
    sched.add_request(make_req("b", 5, max_tokens=2, client=3))
    so, outs = runner.step()
    assert so.finished_req_ids == set()
    assert set(outs) == {0, 3}
    assert outs[0].finished_requests == {"a"} and outs[0].outputs[0].finished
    assert outs[3].finished_requests is None and len(outs[3].outputs[0].new_token_ids) == 1
    assert outs[3].scheduler_stats.num_running_reqs == 1
    so, outs = runner.step()
    assert so.finished_req_ids == {"a"}
    assert outs[3].finished_requests == {"b"}


def test_generation_tokens_total_counts_appended_tokens() -> None:
    # Cumulative over requests and preemptions (recompute re-prefills, never resamples).
    sched = make_sched(num_blocks=8)
    runner = FakeRunner(sched)
    a, b = make_req("a", 8, max_tokens=12), make_req("b", 8, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    assert sched.make_stats().num_generation_tokens_total == 0
    run_to_completion(runner)
    assert b.num_preemptions >= 1
    assert sched.make_stats().num_generation_tokens_total == 24
    # A stop in the middle of a multi-token step: the tokens after it are not appended,
    # so not counted; the step's outputs carry the new total.
    c = make_req("c", 4, max_tokens=10, stop_token_ids=[33])
    sched.add_request(c)
    so = sched.schedule()
    ro = ModelRunnerOutput()
    ro.sampled_token_ids["c"] = [5, 33, 7]
    outs = sched.update_from_output(so, ro)
    assert c.output_token_ids == [5, 33]
    assert outs[0].scheduler_stats.num_generation_tokens_total == 26


def test_dp_engine_republishes_its_token_total_rate_limited(monkeypatch) -> None:
    """A DP engine sends the coordinator its stats when (waiting, running) changes and,
    decoding steadily (same load), when its token total advanced and the last
    publication is 0.5 s old -- never every step, never without new tokens."""
    from tidal.engine_core import dp_proc

    clock = [100.0]
    monkeypatch.setattr(dp_proc, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    sched = make_sched()
    runner = FakeRunner(sched)
    proc = dp_proc.DPEngineCoreProc.__new__(dp_proc.DPEngineCoreProc)  # no processes
    proc.engine_core = SimpleNamespace(scheduler=sched)
    proc._last_published = None
    proc._tokens_published = (0, 0.0)
    sent: list = []
    proc._send_outputs = lambda outs, dest: sent.append((dest, outs.scheduler_stats))

    def step(dt: float = 0.125) -> None:
        clock[0] += dt
        runner.step()
        proc._publish_load_if_changed()

    sched.add_request(make_req("a", 4, max_tokens=50))
    proc._publish_load_if_changed()  # waiting 1
    step()  # running 1, first token
    assert [(d, s.num_running_reqs, s.num_generation_tokens_total) for d, s in sent] == [
        (dp_proc.TO_COORDINATOR, 0, 0),
        (dp_proc.TO_COORDINATOR, 1, 1),
    ]
    for _ in range(3):
        step()  # same load, new tokens, < 0.5 s
    assert len(sent) == 2
    step()  # 0.5 s since the last publication
    assert len(sent) == 3 and sent[-1][1].num_generation_tokens_total == 5
    clock[0] += 10.0
    proc._publish_load_if_changed()  # no new token: nothing to tell
    assert len(sent) == 3
    step(0.0)  # a token, at once after a long pause
    assert len(sent) == 4 and sent[-1][1].num_generation_tokens_total == 6


def test_finish_requests_for_stop_strings() -> None:
    sched = make_sched()
    runner = FakeRunner(sched)
    req = make_req("a", 5, max_tokens=10)
    sched.add_request(req)
    runner.step()
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert req.status == RequestStatus.FINISHED_STOPPED and not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)


def test_add_request_validation() -> None:
    sched = make_sched(max_model_len=16)
    sched.add_request(make_req("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_req("a", 3))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_req("e", []))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_req("long", 17))
    assert sched.get_num_unfinished_requests() == 1


# ---- randomized property test ----------------------------------------------------------


# One KV cache group, and a sliding group (window 4 or 9) beside a full one: every
# group's reads see their own writes, hits included, through preemptions and aborts.
@pytest.mark.parametrize("windows", [(None,), (4, None), (None, 9)], ids=["one", "sf", "fs"])
@pytest.mark.parametrize("seed", range(6))
def test_randomized_arrivals_aborts_and_preemptions(seed: int, windows) -> None:
    rng = random.Random(seed)
    chunked = seed % 3 != 2
    groups = len(windows)
    sched = make_sched(
        budget=rng.choice([8, 16, 64]) if chunked else 64,
        max_seqs=rng.choice([2, 4, 16]),
        max_model_len=64,
        chunked=chunked,
        # As many blocks for each group's table.
        num_blocks=(rng.choice([17, 24, 64]) - 1) * groups + 1,
        caching=seed % 2 == 0,
        kv_windows=windows,
    )
    runner = FakeRunner(sched, windows=windows)
    prefixes = [[rng.randrange(100, 150) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    reqs: dict[str, Request] = {}
    streamed: dict[str, list[int]] = {}
    aborted: set[str] = set()
    n = 0
    for step in range(400):
        if step < 300 and rng.random() < 0.3:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 24)] + [
                rng.randrange(100, 150) for _ in range(rng.randrange(0, 12))
            ]
            req = make_req(f"q{n}", prompt, max_tokens=rng.randrange(1, 30))
            n += 1
            sched.add_request(req)
            reqs[req.request_id] = req
        if rng.random() < 0.05 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            sched.abort_requests([rid])
            aborted.add(rid)
        if not sched.has_requests():
            continue
        was_running = {r.request_id for r in sched.running}
        so, outs = runner.step()
        check_invariants(sched, so)
        if so.preempted_req_ids:  # no admissions in a step that had to preempt
            assert {s.request.request_id for s in so.scheduled} <= was_running
        for rid, o in outputs_by_id(outs).items():
            assert rid not in aborted
            streamed.setdefault(rid, []).extend(o.new_token_ids)
    for rid, outs in run_to_completion(runner).items():
        streamed.setdefault(rid, []).extend(t for o in outs for t in o.new_token_ids)
    assert_all_blocks_free(sched)
    assert not sched.requests and not sched.running and not sched.waiting
    assert n > 50 and len(aborted) > 3
    for rid, req in reqs.items():
        if rid in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
            continue
        expected = min(req.sampling_params.max_tokens, 64 - req.num_prompt_tokens)
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert req.num_output_tokens == expected
        assert streamed[rid] == req.output_token_ids
