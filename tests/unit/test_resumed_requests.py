"""Resumed requests (``EngineCoreRequest.num_output_tokens``) and seeded sampling as a pure
function of (seed, output position), docs/architecture.md#elastic-migration: a request resumed after ``j`` outputs,
or preempted and recomputed, or batched with any others, samples exactly what it would
have. Scheduler rules on a fake runner, then the real ``EngineCore`` on the tiny model."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tidal.config import CacheConfig, SchedulerConfig
from tidal.elastic.migration import AlreadyFinished, ResumedRequest, resume_request
from tidal.engine_core.core import EngineCore
from tidal.engine_core.request import Request
from tidal.engine_core.scheduler import Scheduler
from tidal.executor.batch import ModelRunnerOutput
from tidal.launch.engine_args import EngineArgs
from tidal.protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from tidal.sampling_params import SamplingParams

EOS = 2

# ------------------------------------------------------------------ scheduler rules


def _sched() -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        64,
    )


def _drive(sched: Scheduler, token: int) -> list[EngineCoreOutput]:
    """Step until nothing is left; every sampled token is ``token``."""
    outs: list[EngineCoreOutput] = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        ro = ModelRunnerOutput()
        for sr in so.scheduled:
            if sr.samples:
                ro.sampled_token_ids[sr.request.request_id] = [token]
        for client_outs in sched.update_from_output(so, ro).values():
            outs.extend(client_outs.outputs)
    return outs


def _resumed(k: int, prompt=(5, 6, 7), outputs=(30, 31, 32, 33), **sp: Any) -> Request:
    ids = [*prompt, *outputs[:k]]
    return Request("r", ids, SamplingParams(**sp), eos_token_id=EOS, num_output_tokens=k)


def test_request_splits_carried_outputs_off_the_prompt():
    req = Request("r", [5, 6, 7, 30, 31], SamplingParams(), max_model_len=10, num_output_tokens=2)
    assert req.prompt_token_ids == [5, 6, 7] and req.num_prompt_tokens == 3
    assert req.output_token_ids == [30, 31] and req.num_output_tokens == 2
    assert req.all_token_ids == [5, 6, 7, 30, 31] and req.num_tokens == 5
    assert req.max_tokens == 7  # the model-length cap counts from the original prompt
    for bad in (-1, 5, 6):
        with pytest.raises(ValueError, match="num_output_tokens"):
            Request("r", [5, 6, 7, 30, 31], SamplingParams(), num_output_tokens=bad)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_max_tokens_counts_carried_outputs(k):
    sched = _sched()
    sched.add_request(_resumed(k, max_tokens=5))
    outs = _drive(sched, 40)
    new = [t for o in outs for t in o.new_token_ids]
    assert new == [40] * (5 - k)  # only the new tokens are reported
    assert outs[-1].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize(("k", "num_new"), [(0, 4), (2, 2), (3, 1)])
def test_min_tokens_counts_carried_outputs(k, num_new):
    sched = _sched()
    sched.add_request(_resumed(k, min_tokens=4, max_tokens=10))
    outs = _drive(sched, EOS)  # a runner that always samples EOS
    assert [t for o in outs for t in o.new_token_ids] == [EOS] * num_new
    assert outs[-1].finish_reason == FinishReason.STOP


def test_carried_outputs_are_not_checked_for_stops():
    sched = _sched()
    sched.add_request(_resumed(2, outputs=(30, EOS), max_tokens=4, stop_token_ids=[30]))
    outs = _drive(sched, 40)
    assert [t for o in outs for t in o.new_token_ids] == [40, 40]
    assert outs[-1].finish_reason == FinishReason.LENGTH


# ------------------------------------------------------------------ engine core


def _config(path: str, **kw: Any):
    args = {"model": path, "dtype": "float32", "device": "cpu", "max_model_len": 128, **kw}
    return EngineArgs(**args).create_engine_config()


@pytest.fixture(scope="module")
def engine(qwen3_ckpt):
    core = EngineCore(_config(qwen3_ckpt))
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def fresh_engine(qwen3_ckpt):
    core = EngineCore(_config(qwen3_ckpt))
    yield core
    core.shutdown()


def _run(core: EngineCore, requests: list[EngineCoreRequest], watch: str | None = None):
    """Add ``requests``, step until all finish; the merged output per request id and
    whether request ``watch`` was ever preempted."""
    for r in requests:
        core.add_request(r)
    merged: dict[str, EngineCoreOutput] = {}
    preempted = False
    ids = {r.request_id for r in requests}
    while not ids <= {r for r, o in merged.items() if o.finished}:
        outputs, _ = core.step()
        for outs in outputs.values():
            for o in outs.outputs:
                prev = merged.get(o.request_id)
                if prev is not None:
                    o.new_token_ids = prev.new_token_ids + o.new_token_ids
                    o.new_logprobs = (prev.new_logprobs or []) + (o.new_logprobs or [])
                merged[o.request_id] = o
        live = core.scheduler.requests.get(watch)
        preempted |= live is not None and live.num_preemptions > 0
    return merged, preempted


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [7 + (13 * salt + 5 * j) % 400 for j in range(n)]


SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20)


def test_seeded_tokens_same_alone_batched_and_preempted(engine, qwen3_ckpt):
    prompt = _prompt(9)
    alone, _ = _run(engine, [EngineCoreRequest("s", prompt, SEEDED)])
    expected = alone["s"].new_token_ids
    assert len(expected) == 20

    others = [
        SamplingParams(temperature=1.0, max_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.7, seed=99, max_tokens=20, frequency_penalty=0.5),
        SamplingParams(temperature=1.0, max_tokens=20, top_k=5),
    ]

    def batch() -> list[EngineCoreRequest]:
        reqs = [EngineCoreRequest(f"o{i}", _prompt(5 + i, i), p) for i, p in enumerate(others)]
        return [*reqs, EngineCoreRequest("s", prompt, SEEDED)]  # last: the first victim

    batched, _ = _run(engine, batch())
    assert batched["s"].new_token_ids == expected

    # 29 tokens need 8 blocks of 4; 20 usable blocks cannot hold five such requests.
    small = EngineCore(
        _config(qwen3_ckpt, block_size=4, num_gpu_blocks_override=21, max_model_len=64)
    )
    try:
        preempted_run, preempted = _run(small, batch(), watch="s")
        assert preempted and small.scheduler.num_preemptions > 0
    finally:
        small.shutdown()
    assert preempted_run["s"].new_token_ids == expected


RESUME_PARAMS = {
    "seeded": SamplingParams(
        temperature=1.0,
        seed=77,
        frequency_penalty=0.7,
        presence_penalty=0.4,
        repetition_penalty=1.1,
        min_tokens=6,
        max_tokens=16,
        logprobs=2,
    ),
    "greedy": SamplingParams(
        temperature=0.0, frequency_penalty=0.9, presence_penalty=0.5, min_tokens=6, max_tokens=16
    ),
}


@pytest.mark.parametrize("stop", ["eos", "length"])
@pytest.mark.parametrize("case", sorted(RESUME_PARAMS))
def test_resumed_request_continues_exactly(engine, fresh_engine, case, stop):
    params = RESUME_PARAMS[case]
    prompt = _prompt(8, 3)
    # EOS: a token the unconstrained run samples after min_tokens, so that a stop on EOS
    # (after min_tokens only) is likely part of what must carry over.
    probe, _ = _run(engine, [EngineCoreRequest(f"{case}-probe", prompt, params)])
    eos = probe[f"{case}-probe"].new_token_ids[10] if stop == "eos" else None
    original = EngineCoreRequest(f"{case}-orig", prompt, params, eos_token_id=eos)
    ref = _run(engine, [original])[0][original.request_id]
    tokens = ref.new_token_ids
    assert len(tokens) >= params.min_tokens
    if stop == "length":
        assert len(tokens) == params.max_tokens and ref.finish_reason == FinishReason.LENGTH

    resumed = []
    for j in sorted({j for j in (1, 5, 6, 7, len(tokens) - 1) if 0 < j < len(tokens)}):
        r = resume_request(original, tokens[:j])
        assert isinstance(r, ResumedRequest)
        wire = r.to_engine_request(current_wave=0)
        assert wire.num_output_tokens == j and wire.sampling_params == params
        resumed.append(msgspec.structs.replace(wire, request_id=f"{case}-{stop}-{j}"))
    got, _ = _run(fresh_engine, resumed)  # all at once: batch-independence too
    for wire in resumed:
        j = wire.num_output_tokens
        out = got[wire.request_id]
        assert out.new_token_ids == tokens[j:], j
        assert out.finish_reason == ref.finish_reason, j
        if params.logprobs is not None:
            assert len(out.new_logprobs) == len(tokens) - j
            for a, b in zip(out.new_logprobs, ref.new_logprobs[j:]):
                assert a.token_ids == b.token_ids
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.parametrize(
    ("k", "max_tokens", "match"),
    [
        (-1, 8, "num_output_tokens"),
        (4, 8, "num_output_tokens"),
        (5, 8, "num_output_tokens"),
        (3, 3, "max_tokens"),
    ],
)
def test_engine_refuses_out_of_range_num_output_tokens(engine, k, max_tokens, match):
    req = EngineCoreRequest(
        "bad", [5, 6, 7, 8], SamplingParams(max_tokens=max_tokens), num_output_tokens=k
    )
    with pytest.raises(ValueError, match=match):
        engine.add_request(req)
    assert "bad" not in engine.scheduler.requests
    ok = EngineCoreRequest("ok", [5, 6, 7, 8], SamplingParams(max_tokens=4), num_output_tokens=3)
    out, _ = _run(engine, [ok])
    assert len(out["ok"].new_token_ids) == 1 and out["ok"].finish_reason == FinishReason.LENGTH


def test_resume_at_the_context_limit_and_a_stop_at_max_tokens_finish_like_the_scheduler():
    """The lost last token was both EOS and the max_tokens-th: STOP (the scheduler checks
    stops first); prompt + outputs at max_model_len: LENGTH, not a prompt the engine
    would refuse."""
    req = EngineCoreRequest("r", [5, 6, 7], SamplingParams(max_tokens=3), eos_token_id=2)
    done = resume_request(req, [9, 9, 2])
    assert isinstance(done, AlreadyFinished) and done.reason is FinishReason.STOP
    long = EngineCoreRequest("l", [5, 6, 7], SamplingParams(max_tokens=100), eos_token_id=2)
    capped = resume_request(long, [9, 9, 9], max_model_len=6)
    assert isinstance(capped, AlreadyFinished) and capped.reason is FinishReason.LENGTH
    assert isinstance(resume_request(long, [9, 9], max_model_len=6), ResumedRequest)
