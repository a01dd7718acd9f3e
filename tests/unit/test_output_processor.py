"""Frontend output processing: incremental detokenization, stop strings, n-way merge."""

from __future__ import annotations

import pytest

from tidal.frontend.detokenizer import IncrementalDetokenizer
from tidal.frontend.output_processor import OutputProcessor, child_request_id
from tidal.frontend.outputs import OutputKind
from tidal.protocol.messages import EngineCoreOutput, FinishReason, Logprobs
from tidal.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(qwen3_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_ckpt)


TEXT = "The tide comes in, the tide goes out. Über naïve café — 日本語!"


def test_incremental_equals_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    prompt = tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = []
    for t in ids:
        before = len(detok.output_text)
        assert detok.update([t]) is None
        pieces.append(detok.output_text[before:])
    assert "".join(pieces) == tokenizer.decode(ids) == detok.output_text
    # Multi-byte characters split across tokens never surface as U+FFFD.
    assert all("\ufffd" not in p for p in pieces)


class CountingTokenizer:
    """The test tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kw)


def _stream(detok, ids) -> list[str]:
    pieces = []
    for t in ids:
        before = len(detok.output_text)
        assert detok.update([t]) is None
        pieces.append(detok.output_text[before:])
    return pieces


def test_tokens_without_text_keep_decoding_linear(tokenizer):
    """A model that emits hundreds of skipped special tokens (EOS under ignore_eos), or
    bytes that never complete a character: the text is a full decode's, and each step
    decodes a bounded window, not everything since the last visible character."""
    invalid = next(i for i in range(512) if tokenizer.decode([i]) == "\ufffd")
    eos = tokenizer.eos_token_id
    assert tokenizer.decode([eos], skip_special_tokens=True) == ""
    for filler in (eos, invalid):
        ids = tokenizer.encode("The tide") + [filler] * 300 + tokenizer.encode(" goes out")
        counting = CountingTokenizer(tokenizer)
        detok = IncrementalDetokenizer(counting, tokenizer.encode("Say:"))
        pieces = _stream(detok, ids)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
        assert counting.decoded <= 40 * len(ids), (filler, counting.decoded)


def test_stop_string_truncates(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["goes"])
    stop = None
    for t in ids:
        stop = detok.update([t])
        if stop:
            break
    assert stop == "goes"
    assert detok.output_text == TEXT[: TEXT.index("goes")]


def test_stop_string_included_when_asked(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["goes"], include_stop_str_in_output=True)
    assert detok.update(tokenizer.encode(TEXT)) == "goes"
    assert detok.output_text == TEXT[: TEXT.index("goes") + len("goes")]


def test_stop_strings_wait_for_min_tokens(tokenizer):
    """As EOS and stop token ids: a stop string ends nothing before min_tokens, and one
    that appeared before then is not matched afterwards (vLLM's rule)."""
    ids = tokenizer.encode(TEXT)
    first = len(tokenizer.encode("The tide comes"))  # the first "tide" is inside these
    never = "Z" * 20  # a long stop string must not widen the window of a short one
    op = OutputProcessor(tokenizer)
    for rid, min_tokens, stop, want in [
        ("a", 0, "tide", "The "),
        ("b", first, "tide", "The tide comes in, the "),
        ("c", first, "h", "The tide comes in, t"),  # not the "h" of "The"
    ]:
        params = SamplingParams(max_tokens=len(ids), min_tokens=min_tokens, stop=[stop, never])
        op.add_request(rid, None, [1], params)
        r = op.process_outputs([_out(rid, ids)])
        (ro,) = r.request_outputs
        assert ro.outputs[0].text == want and ro.outputs[0].stop_reason == stop


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_text_is_left_out_unless_asked_for(tokenizer, include):
    """A request the engine ended on a stop token id (or EOS): the id is in the output's
    token ids, its text only with include_stop_str_in_output (vLLM's rule)."""
    ids = tokenizer.encode("The tide comes in")
    op = OutputProcessor(tokenizer)
    params = SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=include)
    op.add_request("s", None, [1], params)
    done = EngineCoreOutput("s", ids, finish_reason=FinishReason.STOP, stop_reason=ids[-1])
    (ro,) = op.process_outputs([done]).request_outputs
    want = tokenizer.decode(ids if include else ids[:-1])
    assert ro.outputs[0].text == want and ro.outputs[0].token_ids == ids
    assert ro.outputs[0].finish_reason == "stop" and ro.outputs[0].stop_reason == ids[-1]


def _out(rid, ids, finish=None, lps=None):
    return EngineCoreOutput(rid, ids, new_logprobs=lps, finish_reason=finish)


def test_n_children_merge_and_final_only(tokenizer):
    op = OutputProcessor(tokenizer)
    children = op.add_request("p", "x", [1, 2], SamplingParams(n=2, max_tokens=3))
    assert children == [child_request_id("p", 0, 2), child_request_id("p", 1, 2)] == ["0_p", "1_p"]
    a, b = tokenizer.encode("hello there"), tokenizer.encode("good bye")
    r = op.process_outputs([_out("0_p", a), _out("1_p", b[:1])])
    assert r.request_outputs == []  # FINAL_ONLY waits for every child
    r = op.process_outputs(
        [_out("1_p", b[1:], FinishReason.LENGTH), _out("0_p", [], FinishReason.STOP)]
    )
    (final,) = r.request_outputs
    assert final.finished and [c.index for c in final.outputs] == [0, 1]
    assert final.outputs[0].text == "hello there" and final.outputs[1].text == "good bye"
    assert final.outputs[1].finish_reason == "length"
    assert not op.has_unfinished()


def test_delta_stream_holds_back_possible_stop(tokenizer):
    op = OutputProcessor(tokenizer)
    op.add_request("s", None, [1], SamplingParams(stop=["tide goes"]), OutputKind.DELTA)
    ids = tokenizer.encode(TEXT)
    streamed, aborts, finished = "", [], False
    for t in ids:
        r = op.process_outputs([_out("s", [t])])
        aborts += r.reqs_to_abort
        for ro in r.request_outputs:
            streamed += ro.outputs[0].text
            finished = ro.finished
        if finished:
            break
    assert finished and aborts == ["s"]  # the engine must stop generating it
    assert streamed == TEXT[: TEXT.index("tide goes")]


def test_logprobs_converted(tokenizer):
    op = OutputProcessor(tokenizer)
    op.add_request("l", None, [1], SamplingParams(logprobs=1, max_tokens=1))
    lp = Logprobs(token_ids=[5, 7], logprobs=[-0.5, -0.1], rank=2)
    (ro,) = op.process_outputs([_out("l", [5], FinishReason.LENGTH, [lp])]).request_outputs
    (pos,) = ro.outputs[0].logprobs
    assert pos[5].logprob == -0.5 and pos[5].rank == 2 and pos[7].rank == 1
    assert ro.outputs[0].cumulative_logprob == -0.5


@pytest.mark.parametrize("kind", [OutputKind.FINAL_ONLY, OutputKind.DELTA])
def test_detokenize_false_gives_ids_only_and_never_decodes(tokenizer, monkeypatch, kind):
    """vLLM's ``detokenize=False``: token ids (and logprob values) as usual, empty text,
    no decoded tokens, and the tokenizer is never asked to decode."""
    op = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=3, logprobs=1, detokenize=False)
    op.add_request("d", None, [1, 2], params, kind)

    def no_decode(*args, **kwargs):
        raise AssertionError("decode called with detokenize=False")

    monkeypatch.setattr(tokenizer, "decode", no_decode)
    lp = Logprobs(token_ids=[5, 7], logprobs=[-0.5, -0.1], rank=2)
    outs = op.process_outputs([_out("d", [5, 9], lps=[lp, lp])]).request_outputs
    outs += op.process_outputs([_out("d", [11], FinishReason.LENGTH, [lp])]).request_outputs
    assert outs[-1].finished
    ids = [t for ro in outs for t in ro.outputs[0].token_ids]
    assert ids == [5, 9, 11] and all(ro.outputs[0].text == "" for ro in outs)
    positions = [p for ro in outs for p in ro.outputs[0].logprobs]
    assert len(positions) == 3 and all(p[5].decoded_token is None for p in positions)


def test_detokenize_false_refuses_stop_strings():
    with pytest.raises(ValueError, match="^stop strings .* need detokenize=True"):
        SamplingParams(stop=["\n"], detokenize=False)
    assert SamplingParams(stop_token_ids=[3], detokenize=False).stop_token_ids == [3]


def _error(rid, message, invalid=False):
    return EngineCoreOutput(
        rid, [], finish_reason=FinishReason.ERROR, stop_reason=message, invalid_request=invalid
    )


@pytest.mark.parametrize("invalid", [True, False])
def test_failed_child_fails_the_request_and_aborts_its_siblings(tokenizer, invalid):
    op = OutputProcessor(tokenizer)
    op.add_request("p", None, [1], SamplingParams(n=3, max_tokens=4), OutputKind.DELTA)
    op.add_request("q", None, [1], SamplingParams(max_tokens=4), OutputKind.DELTA)
    r = op.process_outputs([_out("0_p", [5]), _out("2_p", [6], FinishReason.LENGTH)])
    assert len(r.request_outputs) == 1 and not r.failed
    r = op.process_outputs(
        [_out("q", [7]), _error("1_p", "top_k must be ...", invalid), _out("0_p", [8])]
    )
    (err,) = r.failed
    assert (err.request_id, err.message, err.invalid) == ("p", "top_k must be ...", invalid)
    assert str(err) == "top_k must be ..."
    assert r.reqs_to_abort == ["0_p"]  # still running in the engine; 2_p already finished
    assert [ro.request_id for ro in r.request_outputs] == ["q"]  # "p" yields nothing more
    assert op.parent_of("0_p") is None and op.num_unfinished() == 1
    assert op.process_outputs([_out("0_p", [9], FinishReason.LENGTH)]).request_outputs == []


class RaisingTokenizer:
    """The test tokenizer, except that decoding token ``bad`` raises."""

    def __init__(self, tokenizer, bad: int) -> None:
        self.tokenizer, self.bad = tokenizer, bad

    def decode(self, ids, **kw):
        if self.bad in ids:
            raise RuntimeError(f"cannot decode {self.bad}")
        return self.tokenizer.decode(ids, **kw)


def test_an_output_that_cannot_be_processed_fails_its_request_alone(tokenizer):
    """The tokenizer raising on one request's token fails that request (its running
    children aborted in the engine); the other requests of the same batch of outputs
    are served as if nothing happened."""
    op = OutputProcessor(RaisingTokenizer(tokenizer, bad=9))
    op.add_request("p", None, [1], SamplingParams(n=2, max_tokens=4), OutputKind.DELTA)
    op.add_request("q", None, [1], SamplingParams(max_tokens=2), OutputKind.DELTA)
    hello = tokenizer.encode("hello")[0]
    r = op.process_outputs([_out("0_p", [9]), _out("q", [hello]), _out("1_p", [5])])
    (err,) = r.failed
    assert err.request_id == "p" and not err.invalid and "cannot decode 9" in err.message
    assert r.reqs_to_abort == ["1_p"]  # the sibling, still running in the engine
    assert [ro.request_id for ro in r.request_outputs] == ["q"]
    r = op.process_outputs([_out("q", [hello], FinishReason.LENGTH)])
    (ro,) = r.request_outputs
    assert ro.finished and not r.failed and op.num_unfinished() == 0


def test_request_ids_whose_engine_ids_collide_are_refused(tokenizer):
    """Child ids are "{i}_{parent}" (the parent's own id at n=1): a request whose engine
    ids are another's would have its outputs crossed with it, so it is refused and
    nothing of it is registered."""
    op = OutputProcessor(tokenizer)
    assert op.add_request("x", None, [1], SamplingParams(n=2)) == ["0_x", "1_x"]
    with pytest.raises(ValueError, match="'1_x' is in use by request 'x'"):
        op.add_request("1_x", None, [1], SamplingParams())
    assert op.add_request("0_w", None, [1], SamplingParams()) == ["0_w"]
    with pytest.raises(ValueError, match="'0_w' is in use by request '0_w'"):
        op.add_request("w", None, [1], SamplingParams(n=2))
    assert op.num_unfinished() == 2 and op.parent_of("1_w") is None


def test_finish_all_ends_every_request_with_abort_and_the_message(tokenizer):
    """The drain's timeout (docs/operations.md#lifecycle): each request gets a last output,
    finish reason ``abort`` and the message as stop reason, with the text it had; only
    children still running in the engine are returned to abort there."""
    op = OutputProcessor(tokenizer)
    a, b = tokenizer.encode("hello there"), tokenizer.encode("good bye")
    op.add_request("d", None, [1], SamplingParams(max_tokens=9), OutputKind.DELTA)
    op.add_request("p", None, [1], SamplingParams(n=2, max_tokens=9))  # FINAL_ONLY
    op.process_outputs([_out("d", a), _out("0_p", b), _out("1_p", a, FinishReason.LENGTH)])
    outputs, running = op.finish_all("shutting down")
    assert sorted(running) == ["0_p", "d"]  # 1_p had already finished
    by_id = {ro.request_id: ro for ro in outputs}
    assert by_id.keys() == {"d", "p"} and all(ro.finished for ro in outputs)
    (d,) = by_id["d"].outputs
    assert (d.text, d.finish_reason, d.stop_reason) == ("", "abort", "shutting down")
    p0, p1 = by_id["p"].outputs
    assert (p0.text, p0.finish_reason, p0.stop_reason) == ("good bye", "abort", "shutting down")
    assert (p1.text, p1.finish_reason) == ("hello there", "length")
    assert not op.has_unfinished()
