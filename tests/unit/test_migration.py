"""Request migration helpers: the resumed request and the ownership table (pure)."""

from __future__ import annotations

import msgspec
import pytest

from tidal.elastic.migration import (
    AlreadyFinished,
    OwnershipTable,
    ResumedRequest,
    resume_request,
)
from tidal.protocol.messages import EngineCoreRequest, FinishReason
from tidal.sampling_params import SamplingParams

EOS = 2


def req(**params) -> EngineCoreRequest:
    params.setdefault("max_tokens", 10)
    return EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=[5, 6, 7],
        sampling_params=SamplingParams(**params),
        eos_token_id=EOS,
        arrival_time=12.5,
        client_index=3,
        current_wave=1,
        data_parallel_rank=1,
    )


def test_resumed_request_fields():
    r = resume_request(req(min_tokens=5, prompt_logprobs=2, logprobs=1), [9, 10, 11])
    assert isinstance(r, ResumedRequest)
    assert r.request_id == "r1" and r.prompt_token_ids == [5, 6, 7, 9, 10, 11]
    assert r.num_output_tokens == 3 and r.num_prompt_tokens == 3
    assert r.sampling_params.prompt_logprobs is None  # already returned
    assert r.sampling_params.logprobs == 1 and r.sampling_params.max_tokens == 10
    wire = r.to_engine_request(current_wave=4)
    assert wire.request_id == "r1" and wire.prompt_token_ids == [5, 6, 7, 9, 10, 11]
    # The original budgets: the engine counts the carried-over outputs itself.
    assert wire.num_output_tokens == 3
    assert wire.sampling_params == msgspec.structs.replace(
        r.original.sampling_params, prompt_logprobs=None
    )
    assert wire.current_wave == 4 and wire.arrival_time == 12.5 and wire.client_index == 3
    assert wire.data_parallel_rank is None  # the pinned rank may be the one that left
    assert wire.eos_token_id == EOS
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=EngineCoreRequest)
    assert back == wire
    assert r.to_engine_request(current_wave=4, arrival_time=99.0).arrival_time == 99.0


@pytest.mark.parametrize(
    "params",
    [
        {"min_tokens": 2, "max_tokens": None},
        {"temperature": 1.0, "seed": 3, "frequency_penalty": 0.5, "presence_penalty": 0.5},
        {"temperature": 0.0, "repetition_penalty": 1.2, "min_tokens": 9},
    ],
)
def test_wire_carries_the_original_params_and_the_output_count(params):
    r = resume_request(req(**params), [9, 10, 11, 12])
    wire = r.to_engine_request(current_wave=0)
    assert wire.sampling_params == r.original.sampling_params
    assert wire.num_output_tokens == 4 and wire.prompt_token_ids == [5, 6, 7, 9, 10, 11, 12]


def test_nothing_streamed_yet():
    r = resume_request(req(), [])
    assert isinstance(r, ResumedRequest) and r.num_output_tokens == 0
    wire = r.to_engine_request(current_wave=0)
    assert wire.prompt_token_ids == [5, 6, 7] and wire.num_output_tokens == 0


@pytest.mark.parametrize(
    ("params", "outputs", "finished"),
    [
        ({"max_tokens": 3}, [9, 9, 9], FinishReason.LENGTH),
        ({}, [9, EOS], FinishReason.STOP),
        ({"stop_token_ids": [4]}, [9, 4], FinishReason.STOP),
        ({"ignore_eos": True}, [9, EOS], None),
        ({"min_tokens": 3}, [9, EOS], None),  # EOS is masked before min_tokens
        ({}, [EOS, 9], None),
    ],
)
def test_outputs_that_already_finish_the_request(params, outputs, finished):
    r = resume_request(req(**params), outputs)
    if finished is None:
        assert isinstance(r, ResumedRequest)
    else:
        assert r == AlreadyFinished("r1", finished)


def test_n_greater_than_one_is_migrated_per_child():
    with pytest.raises(ValueError, match="child"):
        resume_request(req(n=2), [1])


def _greedy_engine(request: EngineCoreRequest) -> list[int]:
    """A deterministic engine with the real engine's budget rule: the last
    ``num_output_tokens`` prompt tokens count as outputs. The next token is a function of
    the output position (like greedy decoding of a fixed model); stops on EOS after
    min_tokens, or at max_tokens. Returns the new tokens only."""
    p, k = request.sampling_params, request.num_output_tokens
    ctx, out = list(request.prompt_token_ids), []
    while p.max_tokens is None or k + len(out) < p.max_tokens:
        pos = k + len(out)
        tok = EOS if pos == 7 else 100 + pos
        if tok == EOS and pos < p.min_tokens:
            tok = 50  # EOS masked
        out.append(tok)
        ctx.append(tok)
        if tok == EOS:
            break
    return out


@pytest.mark.parametrize(("min_tokens", "max_tokens"), [(0, 10), (9, 12), (0, 5), (3, None)])
def test_a_moved_greedy_request_continues_exactly(min_tokens, max_tokens):
    original = req(temperature=0.0, min_tokens=min_tokens, max_tokens=max_tokens)
    unmoved = _greedy_engine(original)
    for k in range(len(unmoved)):
        r = resume_request(original, unmoved[:k])
        assert isinstance(r, ResumedRequest)
        rest = _greedy_engine(r.to_engine_request(current_wave=0))
        assert unmoved[:k] + rest == unmoved, k


# ----------------------------------------------------------------------------- ownership


def test_outputs_only_from_the_owner():
    t = OwnershipTable(epoch=2)
    a = t.assign("r", 0)
    assert (a.engine_id, a.epoch, a.generation) == (0, 2, 0) and "r" in t and len(t) == 1
    assert t.accept(0, "r", 2) and t.num_accepted("r") == 2
    assert not t.accept(1, "r", 1) and t.dropped_outputs == 1
    assert not t.accept(0, "unknown", 1) and t.dropped_outputs == 2
    with pytest.raises(ValueError, match="already"):
        t.assign("r", 1)


def test_a_moved_stream_has_no_gap_and_no_duplicate():
    t = OwnershipTable()
    t.assign("r", 0)
    stream: list[int] = []
    a_outputs = [100, 101, 102, 103, 104]  # engine 0's tokens at positions 0..4
    for tok in a_outputs[:3]:  # the frontend read three...
        if t.accept(0, "r", 1):
            stream.append(tok)
    resumed = resume_request(req(max_tokens=8), stream)
    assert isinstance(resumed, ResumedRequest)
    t.migrate("r", 1, resumed.num_output_tokens)  # ...then moved it
    for _ in a_outputs[3:]:  # engine 0's outputs still in flight: dropped
        assert not t.accept(0, "r", 1)
    for pos in range(resumed.num_output_tokens, 8):  # engine 1 continues at position 3
        assert t.accept(1, "r", 1)
        stream.append(100 + pos)
    assert stream == [100 + p for p in range(8)]
    assert t.owner("r").generation == 1 and t.owner("r").engine_id == 1  # type: ignore[union-attr]
    t.finish("r")
    assert "r" not in t and t.owner("r") is None


def test_the_resumed_count_must_match_what_was_accepted():
    t = OwnershipTable()
    t.assign("r", 0)
    t.accept(0, "r", 3)
    with pytest.raises(ValueError, match="3 were accepted"):
        t.migrate("r", 1, 2)
    with pytest.raises(KeyError):
        t.migrate("nope", 1)


def test_moving_back_needs_the_former_owner_to_have_stopped():
    t = OwnershipTable()
    t.assign("r", 0)
    t.migrate("r", 1)  # engine 0 may still send outputs of its assignment
    assert not t.can_move_to("r", 0) and not t.can_move_to("r", 1)
    with pytest.raises(ValueError, match="may still send"):
        t.migrate("r", 0)
    t.stopped(0, "r")  # its abort acknowledgement: its stream has nothing more for "r"
    t.migrate("r", 0)
    assert t.owner("r").engine_id == 0  # type: ignore[union-attr]
    t.migrate("r", 2, old_owner_stopped=True)  # a hand-back report is the same proof
    assert t.can_move_to("r", 0)


def test_owned_by_and_epochs():
    t = OwnershipTable()
    for i, e in enumerate([0, 1, 0]):
        t.assign(f"r{i}", e)
    assert t.owned_by(0) == ["r0", "r2"] and list(t.requests()) == ["r0", "r1", "r2"]
    assert t.set_epoch(3) and t.assign("r9", 1).epoch == 3
    assert not t.set_epoch(2) and t.stale_epochs == 1 and t.epoch == 3
    t.stopped(5, "unknown")  # harmless
