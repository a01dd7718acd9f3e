"""A request the frontend would have refused fails alone: an error output for it, the other
requests unchanged, the rank (and every other rank) still serving.

Two layers of defence are exercised:
- validation when the engine admits a request (``EngineCore.add_request``; over the wire
  the proc answers with an error output instead of raising);
- isolation while stepping: a request that slipped past validation (injected straight into
  the scheduler here) and makes input preparation or sampling raise is failed alone. Under
  expert parallelism the rank still takes part in every forward's collectives.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
import torch

from tidal.config import EngineConfig
from tidal.distributed.ports import get_open_port
from tidal.engine_core.core import EngineCore
from tidal.engine_core.request import Request
from tidal.frontend.loop_client import LoopThreadClient
from tidal.launch.engine_args import EngineArgs
from tidal.protocol.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    engine_identity,
)
from tidal.sampling_params import SamplingParams

MAX_TOKENS = 6
VOCAB = 512  # tests/conftest.py TINY_KWARGS


def _config(path: str, **kw: Any) -> EngineConfig:
    args = {"model": path, "dtype": "float32", "device": "cpu", "max_model_len": 128, **kw}
    return EngineArgs(**args).create_engine_config()


def _params(**bad: Any) -> SamplingParams:
    """Greedy params with ``bad`` values set after construction, as a buggy or hostile
    peer would send them (construction itself would refuse them)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    for name, value in bad.items():
        setattr(params, name, value)
    return params


def _prompts(n: int, salt: int = 0) -> list[list[int]]:
    return [[7 + (13 * i + 5 * j + salt) % 400 for j in range(3 + i % 5)] for i in range(n)]


# Requests the frontend refuses; built directly, as a buggy or hostile peer would send them.
BAD_REQUESTS = {
    "top_k_2_63": lambda: EngineCoreRequest("bad", [5, 6], _params(top_k=2**63)),
    "top_k_over_vocab": lambda: EngineCoreRequest("bad", [5, 6], _params(top_k=VOCAB + 1)),
    "token_id_vocab": lambda: EngineCoreRequest("bad", [5, VOCAB], _params()),
    "token_id_negative": lambda: EngineCoreRequest("bad", [5, -1], _params()),
    "nan_temperature": lambda: EngineCoreRequest("bad", [5, 6], _params(temperature=math.nan)),
    "inf_top_p": lambda: EngineCoreRequest("bad", [5, 6], _params(top_p=math.inf)),
    "seed_2_64": lambda: EngineCoreRequest("bad", [5, 6], _params(temperature=1.0, seed=2**64 - 1)),
    "stop_token_2_63": lambda: EngineCoreRequest("bad", [5, 6], _params(stop_token_ids=[2**63])),
    "prompt_too_long": lambda: EngineCoreRequest("bad", [5] * 128, _params()),
    "empty_prompt": lambda: EngineCoreRequest("bad", [], _params()),
}


# --------------------------------------------------------------- in-process EngineCore


@pytest.fixture(scope="module")
def core(qwen3_ckpt):
    c = EngineCore(_config(qwen3_ckpt))
    yield c
    c.shutdown()


def _run(core: Any, until: set[str]) -> dict[str, EngineCoreOutput]:
    """Step until every id in ``until`` finished; the merged output per request."""
    merged: dict[str, EngineCoreOutput] = {}
    while not until <= {r for r, o in merged.items() if o.finished}:
        outputs, _ = core.step()
        for outs in outputs.values():
            for o in outs.outputs:
                prev = merged.get(o.request_id)
                if prev is not None:
                    o.new_token_ids = prev.new_token_ids + o.new_token_ids
                merged[o.request_id] = o
    return merged


def _add_good(core: Any, prompts: list[list[int]], prefix: str = "g") -> set[str]:
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{prefix}{i}", p, _params()))
    return {f"{prefix}{i}" for i in range(len(prompts))}


@pytest.fixture(scope="module")
def reference(core) -> dict[str, list[int]]:
    ids = _add_good(core, _prompts(4))
    return {r: o.new_token_ids for r, o in _run(core, ids).items()}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_engine_refuses_invalid_request(core, case):
    with pytest.raises(ValueError) as e:
        core.add_request(BAD_REQUESTS[case]())
    assert str(e.value)
    assert not core.has_unfinished_requests()


def _inject(core: Any, rid: str, prompt: list[int], **bad: Any) -> None:
    """Put a request straight into the scheduler, past the engine's validation, with
    attributes set after construction (so no params type's own checks stop them)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for name, value in bad.items():
        setattr(params, name, value)
    core.scheduler.add_request(Request(rid, prompt, params, max_model_len=128))


@pytest.mark.parametrize(
    "prompt,bad,stage",
    [
        ([5, 6, 7], {"temperature": 1.0, "top_k": 2**63}, "sampling"),
        ([5, VOCAB + 3, 7], {}, "preparing"),
        ([5, 6, 2**63], {}, "preparing"),
    ],
)
def test_step_fails_the_bad_request_alone(core, reference, prompt, bad, stage):
    good = _add_good(core, _prompts(4))
    _inject(core, "bad", prompt, **bad)
    # A seeded sampled request shares the batch: the retry must not change its draws.
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=MAX_TOKENS)
    core.add_request(EngineCoreRequest("seeded", [9, 8, 7], seeded))
    got = _run(core, good | {"bad", "seeded"})
    assert got["bad"].finish_reason == FinishReason.ERROR
    assert stage in got["bad"].stop_reason and got["bad"].new_token_ids == []
    assert not got["bad"].invalid_request  # failed while running: a 500 for HTTP clients
    assert {r: got[r].new_token_ids for r in good} == reference
    assert not core.has_unfinished_requests()
    # The engine keeps serving, and the seeded request drew what it draws alone.
    core.add_request(EngineCoreRequest("seeded-alone", [9, 8, 7], seeded))
    alone = _run(core, {"seeded-alone"})["seeded-alone"]
    assert got["seeded"].new_token_ids == alone.new_token_ids
    assert {r: o.new_token_ids for r, o in _run(core, _add_good(core, _prompts(4))).items()} == (
        reference
    )


def test_failed_request_leaves_no_poisoned_prefix_cache(core):
    """A request that failed preparation had no KV written in that step: none of its
    blocks may enter the prefix cache, or a later request with the same prefix would
    read garbage."""
    prompt = [7 + (5 * j) % 400 for j in range(40)]  # two full blocks of 16
    core.add_request(EngineCoreRequest("clean", prompt, _params()))
    want = _run(core, {"clean"})["clean"].new_token_ids
    assert core.reset_prefix_cache()
    _inject(core, "bad", [*prompt, VOCAB + 1])
    assert _run(core, {"bad"})["bad"].finish_reason == FinishReason.ERROR
    core.add_request(EngineCoreRequest("again", prompt, _params()))
    again = _run(core, {"again"})["again"]
    assert again.num_cached_tokens == 0 and again.new_token_ids == want


# --------------------------------------------- expert parallel ranks in lockstep (gloo)


def _lockstep(core: Any, until: set[str]) -> dict[str, EngineCoreOutput]:
    """Step every rank together (dummy forwards when idle) until no rank has work."""
    dp_group = core.executor.worker.dp_group
    merged: dict[str, EngineCoreOutput] = {}
    while True:
        outputs, executed = core.step()
        for outs in outputs.values():
            for o in outs.outputs:
                prev = merged.get(o.request_id)
                if prev is not None:
                    o.new_token_ids = prev.new_token_ids + o.new_token_ids
                merged[o.request_id] = o
        if not executed:
            core.execute_dummy_batch()
        flag = torch.tensor([int(core.has_unfinished_requests())], dtype=torch.int64)
        if not dp_group.all_reduce(flag).item():
            assert until <= set(merged)
            return merged


def _ep_rank(rank: int, world: int, path: str, port: int) -> dict:
    cfg = _config(
        path,
        data_parallel_size=world,
        data_parallel_rank=rank,
        data_parallel_master_port=port,
        enable_expert_parallel=True,
    )
    core = EngineCore(cfg)
    try:
        # Round 1: rank 1's whole batch fails to prepare; it must still do the forward.
        if rank == 1:
            _inject(core, "bad-prep", [5, VOCAB + 1, 7])
            first = _lockstep(core, {"bad-prep"})
        else:
            first = _lockstep(core, _add_good(core, _prompts(4), "r0-"))
        # Round 2: a request failing in sampling next to good ones, on every rank.
        good = _add_good(core, _prompts(3, salt=rank), f"r{rank}-b")
        _inject(core, "bad-sample", [5, 6, 7], temperature=1.0, top_k=2**63)
        second = _lockstep(core, good | {"bad-sample"})
    finally:
        core.shutdown()
    return {
        "first": {r: (o.finish_reason, o.new_token_ids) for r, o in first.items()},
        "second": {r: (o.finish_reason, o.new_token_ids) for r, o in second.items()},
    }


def test_ep_ranks_stay_matched_when_a_request_fails(run_ranks, qwen3_ckpt, core):
    results = run_ranks(_ep_rank, 2, qwen3_ckpt, get_open_port(), timeout_s=240)
    assert results[1]["first"] == {"bad-prep": (FinishReason.ERROR, [])}
    for res in results:
        assert res["second"]["bad-sample"] == (FinishReason.ERROR, [])
    # Good outputs equal a single-process engine's on the same prompts.
    ref = {
        "r0-": _add_good(core, _prompts(4), "r0-"),
        "r0-b": _add_good(core, _prompts(3, salt=0), "r0-b"),
        "r1-b": _add_good(core, _prompts(3, salt=1), "r1-b"),
    }
    want = _run(core, set().union(*ref.values()))
    for res in results:
        for rid, (reason, tokens) in {**res["first"], **res["second"]}.items():
            if rid.startswith("bad"):
                continue
            assert reason == FinishReason.LENGTH and tokens == want[rid].new_token_ids, rid


# ------------------------------------- DP=2 EP engine processes behind the MP client


def _collect(client: Any, until: set[str]) -> dict[str, EngineCoreOutput]:
    merged: dict[str, EngineCoreOutput] = {}
    while not until <= {r for r, o in merged.items() if o.finished}:
        for o in client.get_output().outputs:
            prev = merged.get(o.request_id)
            if prev is not None:
                o.new_token_ids = prev.new_token_ids + o.new_token_ids
            merged[o.request_id] = o
    return merged


def test_dp_ep_engine_answers_bad_requests_and_keeps_serving(qwen3_ckpt, core):
    # No rank recovery, so no request book: the raw ADD below bypasses the client, and a
    # book would drop the answer to a request the client never sent (as it should).
    config = _config(
        qwen3_ckpt, data_parallel_size=2, enable_expert_parallel=True, rank_recovery=False
    )
    client = LoopThreadClient(config)
    try:
        # A request the wire cannot carry fails in the caller, before any wake-up: the
        # other ranks must not start a wave and wait for a rank that never got it.
        with pytest.raises(ValueError, match="cannot be sent"):
            client.add_request(EngineCoreRequest("huge", [5, 6], _params(top_k=2**64 + 1)))
        assert "huge" not in client.dp.rank_of
        assert [load.inflight for load in client.dp.balancer.loads()] == [0, 0]
        assert not client.dp.wave.running  # so the next request sends the wake-up
        good: dict[str, list[int]] = {}
        bad: set[str] = set()
        prompts = _prompts(6)
        for rank in (0, 1):
            for case, make in sorted(BAD_REQUESTS.items()):
                req = make()
                req.request_id, req.data_parallel_rank = f"{case}@{rank}", rank
                client.add_request(req)
                bad.add(req.request_id)
            for i, p in enumerate(prompts):
                rid = f"g{i}@{rank}"
                client.add_request(EngineCoreRequest(rid, p, _params(), data_parallel_rank=rank))
                good[rid] = p
            # An ADD that does not even decode (a list where the prompt should be).
            raw = msgspec.msgpack.encode([f"garbled@{rank}", "not a prompt", []])
            ident = engine_identity(rank)
            frames = [ident, EngineCoreRequestType.ADD.value, raw]
            # On the client's loop thread, where its sockets live.
            client.call_on_loop(lambda f=frames: client.client.input_socket.send_multipart(f))
            bad.add(f"garbled@{rank}")
        got = _collect(client, bad | set(good))
        for rid in bad:
            assert got[rid].finish_reason == FinishReason.ERROR, rid
            assert got[rid].stop_reason and not got[rid].new_token_ids, rid
            assert got[rid].invalid_request, rid  # refused at admission: a 400
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"ref{i}", p, _params()))
        want = _run(core, {f"ref{i}" for i in range(len(prompts))})
        for rid in good:
            i = int(rid[1 : rid.index("@")])
            assert got[rid].new_token_ids == want[f"ref{i}"].new_token_ids, rid
        # Every rank still serves.
        for rank in (0, 1):
            client.add_request(
                EngineCoreRequest(f"after@{rank}", prompts[0], _params(), data_parallel_rank=rank)
            )
        after = _collect(client, {"after@0", "after@1"})
        assert after["after@0"].new_token_ids == after["after@1"].new_token_ids
        assert after["after@0"].new_token_ids == want["ref0"].new_token_ids
    finally:
        client.shutdown()
