"""Structured outputs and the sampler's token masks (docs/architecture.md#structured-outputs).

- The sampler: the grammar bitmask, ``allowed_token_ids``, bad words and ``logit_bias``
  against slow references in plain torch / Python; unmasked rows keep their tokens.
- The grammar backend: the compile cache, a spec that does not compile, a matcher's
  advance, rollback and replay.
- The scheduler on a fake runner that samples what the bitmask allows: a request waits
  for its grammar (the others pass it), a failed compile or a refused token fails that
  request alone, a resumed request replays its outputs; the bitmask crosses the TP wire.
- The engine core on the tiny model: JSON-schema, regex and choice outputs are valid, and
  a request resumed mid-generation (as migration resumes it) ends with the same tokens.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future
from typing import Any

import jsonschema
import msgspec
import pytest
import torch

from tidal.config import CacheConfig, SchedulerConfig
from tidal.engine_core.core import EngineCore
from tidal.engine_core.request import Request
from tidal.engine_core.scheduler import Scheduler
from tidal.engine_core.structured import GrammarBackend, bitmask_words, check_spec
from tidal.executor.batch import ModelRunnerOutput
from tidal.executor.step_wire import StepDecoder, StepEncoder
from tidal.launch.engine_args import EngineArgs
from tidal.layers.sampler import (
    RowInfo,
    Sampler,
    SamplingMetadata,
    apply_token_bitmask,
    apply_token_bitmask_torch,
    banned_by_bad_words,
    process_logits,
)
from tidal.models.tiny import build_tokenizer
from tidal.protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from tidal.sampling_params import SamplingParams, StructuredOutputs

EOS = 2  # the tiny tokenizer's <|im_end|>, the tiny checkpoints' EOS
VOCAB = 512

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(VOCAB, 256)


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = GrammarBackend(tokenizer, VOCAB, [EOS])
    yield b
    b.shutdown()


def _allowed(mask: bytes, vocab: int = VOCAB) -> list[int]:
    """Slow reference decoding of one bitmask row: the allowed token ids."""
    words = [int.from_bytes(mask[4 * i : 4 * i + 4], "little") for i in range(len(mask) // 4)]
    return [t for t in range(vocab) if words[t // 32] >> (t % 32) & 1]


def _pack(allowed: set[int], vocab: int) -> bytes:
    words = [0] * bitmask_words(vocab)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


# ---- the sampler ---------------------------------------------------------------------------


@pytest.mark.parametrize("apply", [apply_token_bitmask, apply_token_bitmask_torch])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [[0, 2, 4], None], ids=["some-rows", "every-row"])
def test_token_bitmask_matches_a_python_reference(device, rows, apply):
    gen = torch.Generator().manual_seed(0)
    vocab, n = 100, 5  # not a multiple of 32: the last word's high bits are beyond the vocab
    logits = torch.randn(n, vocab, generator=gen)
    words = bitmask_words(vocab)
    g = n if rows is None else len(rows)
    bitmask = torch.randint(-(2**31), 2**31, (g, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)  # bit 31 (the sign) set in about half the words
    x = logits.clone().to(device)
    index = None if rows is None else torch.tensor(rows, device=device)
    apply(x, index, bitmask.to(device))
    expected = logits.clone()
    for j, r in enumerate(range(n) if rows is None else rows):
        for t in range(vocab):
            word = int(bitmask[j, t // 32]) & 0xFFFFFFFF
            if not word >> (t % 32) & 1:
                expected[r, t] = float("-inf")
    assert torch.equal(x.cpu(), expected)


def test_masks_and_bias_match_a_plain_torch_reference():
    gen = torch.Generator().manual_seed(1)
    vocab = 70
    logits = torch.randn(5, vocab, generator=gen)
    grammar = {3, 5, 8, 40, 69}
    rows = [
        RowInfo(SamplingParams(temperature=0.0), grammar_bitmask=_pack(grammar, vocab)),
        RowInfo(SamplingParams(temperature=0.0, allowed_token_ids=[1, 9, 33, 500])),
        RowInfo(
            SamplingParams(temperature=0.0, bad_words_token_ids=[[7], [10, 11], [12, 13]]),
            output_token_ids=[4, 10],
        ),
        RowInfo(SamplingParams(temperature=0.0, logit_bias={6: 100.0, 2: -50.5, 900: 3.0})),
        RowInfo(SamplingParams(temperature=0.0, allowed_token_ids=[69, 0], logit_bias={0: 1.0})),
    ]
    out = process_logits(logits, SamplingMetadata.build(rows, "cpu"))

    inf = float("-inf")
    ref = logits.clone()
    ref[0, [t for t in range(vocab) if t not in grammar]] = inf
    ref[1, [t for t in range(vocab) if t not in (1, 9, 33)]] = inf
    ref[2, 7] = inf  # a one-token word, always
    ref[2, 11] = inf  # the output ends with 10
    ref[3, 6] += 100.0
    ref[3, 2] += -50.5
    ref[4, [t for t in range(vocab) if t not in (0, 69)]] = inf
    ref[4, 0] += 1.0
    assert torch.equal(out, ref)
    tokens = Sampler()(logits, SamplingMetadata.build(rows, "cpu")).token_ids
    assert tokens.tolist() == ref.argmax(dim=-1).tolist()


def test_bad_words_ban_the_last_token_after_its_prefix():
    words = [[5], [1, 2, 3], [9, 9]]
    assert banned_by_bad_words(words, []) == [5]
    assert banned_by_bad_words(words, [7, 1]) == [5]
    assert banned_by_bad_words(words, [7, 1, 2]) == [5, 3]
    assert banned_by_bad_words(words, [9]) == [5, 9]
    assert banned_by_bad_words(words, [1, 2, 4]) == [5]


def test_unmasked_rows_keep_their_tokens_and_no_mask_keeps_the_fast_path():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 64, generator=gen)
    plain = [RowInfo(SamplingParams(temperature=0.0)) for _ in range(3)]
    meta = SamplingMetadata.build(plain, "cpu")
    assert meta.masks is None and meta.fast_greedy
    argmax = logits.argmax(dim=-1)
    masked = RowInfo(SamplingParams(temperature=0.0), grammar_bitmask=_pack({1}, 64))
    meta = SamplingMetadata.build([plain[0], masked, plain[2]], "cpu")
    assert not meta.fast_greedy
    tokens = Sampler()(logits, meta).token_ids
    assert tokens.tolist() == [int(argmax[0]), 1, int(argmax[2])]


def test_sampled_rows_draw_only_allowed_tokens():
    logits = torch.zeros(1, 64).expand(400, -1).contiguous()  # uniform: every token likely
    allowed = {3, 17, 40, 63}
    rows = [RowInfo(SamplingParams(temperature=1.0), grammar_bitmask=_pack(allowed, 64))] * 400
    torch.manual_seed(0)
    tokens = Sampler()(logits, SamplingMetadata.build(rows, "cpu")).token_ids
    assert set(tokens.tolist()) == allowed


# ---- the grammar backend -------------------------------------------------------------------


def test_compile_cache_shares_equal_specs(tokenizer):
    b = GrammarBackend(tokenizer, VOCAB, [EOS])
    try:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        f1 = b.compile(StructuredOutputs(json=schema))
        # The same schema written with its keys in another order is the same spec.
        f2 = b.compile(
            StructuredOutputs(json={"properties": {"a": {"type": "integer"}}, "type": "object"})
        )
        assert f1 is f2 and b.num_compiles == 1
        f3 = b.compile(StructuredOutputs(regex="[0-9]+"))
        assert f3 is not f1 and b.num_compiles == 2
        assert f1.result(timeout=120) is not None and f3.result(timeout=120) is not None
    finally:
        b.shutdown()


def test_compile_cache_evicts_the_least_recently_used(tokenizer):
    b = GrammarBackend(tokenizer, VOCAB, [EOS], cache_size=2)
    try:
        a, c, d = (StructuredOutputs(regex=r) for r in ("a+", "c+", "d+"))
        fa = b.compile(a)
        b.compile(c)
        assert b.compile(a) is fa  # a is now the most recent
        b.compile(d)  # evicts c
        assert b.compile(a) is fa and b.num_compiles == 3
        b.compile(c)
        assert b.num_compiles == 4  # compiled again
    finally:
        b.shutdown()


def test_a_spec_that_does_not_compile_is_an_error_naming_it(backend):
    with pytest.raises(ValueError, match=r"^guided_regex: the regex does not compile"):
        check_spec(StructuredOutputs(regex="a("), "guided_regex")
    with pytest.raises(ValueError, match=r"^response_format: the JSON schema does not compile"):
        check_spec(StructuredOutputs(json='{"type": "nope"}'), "response_format")
    g = backend.request_grammar(StructuredOutputs(grammar='rot ::= "a"'))
    assert g.wait_ready(120)
    assert g.ready and "root" in (g.error or "")


def test_matcher_advances_rolls_back_and_replays(backend, tokenizer):
    spec = StructuredOutputs(choice=["yes", "no"])
    g = backend.request_grammar(spec)
    assert g.wait_ready(120)
    assert g.error is None
    yes = tokenizer.encode("yes", add_special_tokens=False)
    no = tokenizer.encode("no", add_special_tokens=False)
    first = set(_allowed(backend.bitmasks([g])[0]))
    assert {yes[0], no[0]} <= first and EOS not in first
    assert not g.accept(EOS)  # refused, and the state is unchanged
    assert g.sync(yes) and g.accepted == yes
    assert _allowed(backend.bitmasks([g])[0]) == [EOS]  # complete: only the end
    g.rollback(len(yes))
    assert g.accepted == [] and set(_allowed(backend.bitmasks([g])[0])) == first
    assert g.sync(no) and g.accept(EOS) and g.is_terminated
    assert g.sync(yes + [EOS])  # back to the common prefix (none), then the new history
    assert not g.sync([no[0], 7, 7])  # refused: holds the longest accepted prefix
    assert g.accepted == [no[0]]


def test_a_grammar_after_a_marker_is_the_grammar_of_what_follows_it(backend, tokenizer):
    """``starts_after``: free up to the marker, then each mask is a fresh grammar's on
    the tokens after the marker (the reference); a rollback across the marker makes it
    dormant again, and a replay brings it back."""
    marker = tokenizer.encode("</think>", add_special_tokens=False)
    spec = StructuredOutputs(regex="[a-z]{2,4}")
    g = backend.request_grammar(msgspec.structs.replace(spec, starts_after=marker))
    assert g.wait_ready(120)
    free = [40, 300, 17, *marker[:-1], 99]  # the marker's start alone does not end it
    assert g.sync(free) and not g.active and not g.accepted
    assert set(_allowed(backend.bitmasks([g])[0])) == set(range(VOCAB))
    thought = [*free, *marker]
    answer = tokenizer.encode("ab", add_special_tokens=False)
    assert g.sync(thought + answer) and g.active and g.accepted == answer
    ref = backend.request_grammar(spec)
    assert ref.wait_ready(120)
    assert ref.sync(answer)
    assert backend.bitmasks([g]) == backend.bitmasks([ref])
    assert not g.accept(tokenizer.convert_tokens_to_ids("7"))  # a digit: refused
    assert g.sync(thought[:-1]) and not g.active  # the marker undone
    assert g.sync(thought) and g.active and g.accepted == []
    assert backend.bitmasks([g]) == backend.bitmasks([backend.request_grammar(spec)])
    with pytest.raises(ValueError, match="starts_after"):
        StructuredOutputs(regex="a", starts_after=[])


# ---- the scheduler -------------------------------------------------------------------------


class _HeldBackend(GrammarBackend):
    """Compiles only when ``release`` is set, so a test sees a request wait."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, VOCAB, [EOS])
        self.release = threading.Event()

    def compile(self, spec: StructuredOutputs) -> Future:
        inner = super().compile(spec)
        held: Future = Future()

        def wait() -> None:
            self.release.wait(120)
            try:
                held.set_result(inner.result())
            except Exception as e:  # noqa: BLE001 - handed on as the compile's error
                held.set_exception(e)

        threading.Thread(target=wait, daemon=True).start()
        return held


def _sched(grammars: GrammarBackend | None) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        128,
        grammars,
    )


def _step(sched: Scheduler, pick=min) -> tuple[list[EngineCoreOutput], set[str]]:
    """One step on a fake runner: a structured row takes ``pick`` of what its bitmask
    allows, any other row token 40. Returns the outputs and the ids that sampled."""
    so = sched.schedule()
    ro = ModelRunnerOutput()
    sampled = set()
    for sr in so.scheduled:
        if not sr.samples:
            continue
        rid = sr.request.request_id
        mask = so.grammar_bitmask.get(rid)
        ro.sampled_token_ids[rid] = [pick(_allowed(mask)) if mask is not None else 40]
        sampled.add(rid)
    outs = [o for c in sched.update_from_output(so, ro).values() for o in c.outputs]
    return outs, sampled


def _await_grammars(sched: Scheduler) -> None:
    """Until every waiting request's grammar has compiled (or failed)."""
    for r in sched.waiting:
        assert r.grammar is None or r.grammar.wait_ready(120), "a grammar did not compile in time"


def _drive(sched: Scheduler, pick=min, limit: int = 400) -> dict[str, EngineCoreOutput]:
    merged: dict[str, EngineCoreOutput] = {}
    for _ in range(limit):
        if not sched.has_requests():
            break
        _await_grammars(sched)
        outs, _ = _step(sched, pick)
        for o in outs:
            prev = merged.get(o.request_id)
            if prev is not None:
                o.new_token_ids = prev.new_token_ids + o.new_token_ids
            merged[o.request_id] = o
    assert not sched.has_requests()
    assert sched._num_structured == 0  # counted out, whichever way each left
    return merged


def _req(
    rid: str, spec: StructuredOutputs | None, prompt=(5, 6, 7), k: int = 0, **sp: Any
) -> Request:
    params = SamplingParams(structured_outputs=spec, max_tokens=sp.pop("max_tokens", 60), **sp)
    return Request(rid, list(prompt), params, eos_token_id=EOS, num_output_tokens=k)


def test_a_request_waits_for_its_grammar_and_the_others_pass_it(tokenizer):
    held = _HeldBackend(tokenizer)
    sched = _sched(held)
    try:
        sched.add_request(_req("s", StructuredOutputs(regex="ab[0-9]")))
        sched.add_request(_req("plain", None, max_tokens=3))
        plain: list[int] = []
        for _ in range(3):
            outs, sampled = _step(sched)
            assert sampled == {"plain"}  # a step never waits for the compile
            plain += [t for o in outs for t in o.new_token_ids]
        assert plain == [40, 40, 40] and "plain" not in sched.requests
        assert [r.request_id for r in sched.waiting] == ["s"]
        held.release.set()
        merged = _drive(sched)
    finally:
        held.shutdown()
    text = tokenizer.decode(merged["s"].new_token_ids, skip_special_tokens=True)
    assert re.fullmatch("ab[0-9]", text) and merged["s"].finish_reason == FinishReason.STOP
    assert sched._num_structured == 0  # every structured request left


def test_a_grammar_that_does_not_compile_fails_its_request_alone(backend):
    sched = _sched(backend)
    sched.add_request(_req("bad", StructuredOutputs(grammar='rot ::= "a"')))
    sched.add_request(_req("good", StructuredOutputs(choice=["yes", "no"])))
    merged = _drive(sched)
    assert merged["bad"].finish_reason == FinishReason.ERROR
    assert "structured_outputs" in str(merged["bad"].stop_reason)
    assert "root" in str(merged["bad"].stop_reason)
    assert merged["good"].finish_reason == FinishReason.STOP


def _word_tokenizer(vocab: int) -> Any:
    """A word-level vocabulary (``<pad> <s> </s> w3 w4 ...``) without a digit or a brace:
    no token can write ``[0-9]`` or JSON."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": EOS, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")


def test_a_grammar_the_vocabulary_cannot_write_fails_its_request_as_its_own_input():
    backend = GrammarBackend(_word_tokenizer(VOCAB), VOCAB, [EOS])
    try:
        sched = _sched(backend)
        sched.add_request(_req("digits", StructuredOutputs(regex="[0-9]{3}")))
        sched.add_request(_req("words", StructuredOutputs(choice=["w5w6", "w7"])))
        sched.add_request(_req("plain", None, max_tokens=3))
        merged = _drive(sched)
    finally:
        backend.shutdown()
    bad = merged["digits"]
    assert bad.finish_reason == FinishReason.ERROR and bad.new_token_ids == []
    assert "allows no token of the model's vocabulary" in str(bad.stop_reason)
    assert bad.invalid_request  # the API answers 400: the request's, not the engine's
    assert merged["words"].finish_reason == FinishReason.STOP
    assert merged["plain"].finish_reason == FinishReason.LENGTH


def test_without_a_backend_a_structured_request_is_refused():
    with pytest.raises(ValueError, match="^structured_outputs"):
        _sched(None).add_request(_req("s", StructuredOutputs(regex="a")))


def test_a_token_the_grammar_refuses_fails_that_request_alone(backend):
    sched = _sched(backend)
    sched.add_request(_req("s", StructuredOutputs(choice=["yes", "no"])))
    sched.add_request(_req("plain", None, max_tokens=4))
    _await_grammars(sched)
    so = sched.schedule()
    allowed = _allowed(so.grammar_bitmask["s"])
    refused = next(t for t in range(3, VOCAB) if t not in allowed)
    ro = ModelRunnerOutput(sampled_token_ids={"s": [refused], "plain": [40]})
    outs = {o.request_id: o for c in sched.update_from_output(so, ro).values() for o in c.outputs}
    assert outs["s"].finish_reason == FinishReason.ERROR
    assert "not allowed by its grammar" in str(outs["s"].stop_reason)
    assert "plain" in sched.requests  # the other request goes on


def test_a_resumed_request_replays_its_outputs_and_continues_the_same(backend, tokenizer):
    spec = StructuredOutputs(json={"type": "object", "properties": {"k": {"type": "string", "maxLength": 12}}, "required": ["k"], "additionalProperties": False})  # fmt: skip
    pick = max  # walks through the string's characters before its end
    whole = _sched(backend)
    whole.add_request(_req("r", spec))
    tokens = _drive(whole, pick)["r"].new_token_ids
    assert tokens[-1] == EOS and len(tokens) > 6
    json.loads(tokenizer.decode(tokens, skip_special_tokens=True))
    for k in (1, 5, len(tokens) - 2):
        moved = _sched(backend)
        moved.add_request(_req("r", spec, prompt=(5, 6, 7, *tokens[:k]), k=k))
        rest = _drive(moved, pick)["r"]
        assert rest.new_token_ids == tokens[k:] and rest.finish_reason == FinishReason.STOP


@pytest.mark.parametrize(
    ("extra", "end"), [({}, EOS), ({"stop_token_ids": [7]}, None), ({"ignore_eos": True}, EOS)]
)
def test_the_grammar_ends_on_the_requests_own_end_tokens(backend, tokenizer, extra, end):
    """Complete, the grammar allows exactly what ends the request (its EOS and stop ids;
    with ignore_eos and no stop ids, the model's EOS) and the request stops there."""
    sched = _sched(backend)
    sched.add_request(_req("r", StructuredOutputs(choice=["ok"]), **extra))
    ends: list[list[int]] = []

    def pick(allowed: list[int]) -> int:
        ends.append(allowed)
        return max(allowed)

    out = _drive(sched, pick)["r"]
    assert out.finish_reason == FinishReason.STOP
    assert ends[-1] == ([EOS, 7] if "stop_token_ids" in extra else [EOS])
    assert out.new_token_ids[-1] == (end if end is not None else 7)
    assert tokenizer.decode(out.new_token_ids[:-1]) == "ok"


def test_resumed_outputs_the_grammar_refuses_fail_the_request(backend):
    sched = _sched(backend)
    sched.add_request(_req("r", StructuredOutputs(choice=["yes"]), prompt=(5, 6, 7, 300), k=1))
    merged = _drive(sched)
    assert merged["r"].finish_reason == FinishReason.ERROR
    assert "do not match its grammar" in str(merged["r"].stop_reason)


def test_preempted_request_keeps_its_matcher_in_step(backend, tokenizer):
    spec = StructuredOutputs(regex="[a-z]{20}")
    sched = _sched(backend)
    sched.add_request(_req("r", spec))
    while len(sched.requests["r"].output_token_ids) < 5:
        _step(sched)
    req = sched.requests["r"]
    sched.abandon_step()  # as after a failed collective: preempted by recompute
    assert req in sched.waiting and req.grammar.accepted == req.output_token_ids
    rest = _drive(sched)["r"]
    text = tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
    assert re.fullmatch("[a-z]{20}", text) and rest.finish_reason == FinishReason.STOP


def test_a_request_is_masked_only_after_its_marker(backend, tokenizer):
    marker = tokenizer.encode("</think>", add_special_tokens=False)
    spec = StructuredOutputs(choice=["yes", "no"], starts_after=marker)
    sched = _sched(backend)
    sched.add_request(_req("r", spec))
    _await_grammars(sched)
    for token in [40, 41, *marker]:  # thinking: no mask, the runner writes what it likes
        so = sched.schedule()
        assert "r" not in so.grammar_bitmask
        ro = ModelRunnerOutput(sampled_token_ids={"r": [token]})
        sched.update_from_output(so, ro)
    out = _drive(sched)["r"]  # then only what the choice allows, to its end
    text = tokenizer.decode(out.new_token_ids[:-1], skip_special_tokens=True)
    assert text in ("yes", "no") and out.finish_reason == FinishReason.STOP


def test_the_bitmask_crosses_the_tp_wire(backend):
    sched = _sched(backend)
    sched.add_request(_req("s", StructuredOutputs(regex="[0-9]+")))
    sched.add_request(_req("plain", None))
    enc, dec = StepEncoder(), StepDecoder()
    _await_grammars(sched)
    so = sched.schedule()
    assert set(so.grammar_bitmask) == {"s"}
    step = msgspec.msgpack.decode(msgspec.msgpack.encode(enc.encode(so)), type=type(enc.encode(so)))
    assert dec.decode(step).grammar_bitmask == so.grammar_bitmask


# ---- the engine core on the tiny model -------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(qwen3_ckpt):
    args = EngineArgs(model=qwen3_ckpt, dtype="float32", device="cpu", max_model_len=256)
    core = EngineCore(args.create_engine_config())
    yield core
    core.shutdown()


def _run(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, EngineCoreOutput]:
    for r in requests:
        core.add_request(r)
    merged: dict[str, EngineCoreOutput] = {}
    ids = {r.request_id for r in requests}
    for _ in range(2000):
        if ids <= {r for r, o in merged.items() if o.finished}:
            return merged
        # A step while a grammar compiles schedules nothing; counted steps would run out on
        # a loaded machine before the compile ends.
        _await_grammars(core.scheduler)
        outputs, _ = core.step()
        for outs in outputs.values():
            for o in outs.outputs:
                prev = merged.get(o.request_id)
                if prev is not None:
                    o.new_token_ids = prev.new_token_ids + o.new_token_ids
                merged[o.request_id] = o
    raise AssertionError("requests did not finish")


def _ecr(rid: str, prompt: list[int], k: int = 0, **sp: Any) -> EngineCoreRequest:
    params = SamplingParams(**{"max_tokens": 200, **sp})
    return EngineCoreRequest(rid, prompt, params, eos_token_id=EOS, num_output_tokens=k)


def test_engine_outputs_follow_schema_regex_and_choice(engine, tokenizer):
    close = {tokenizer.convert_tokens_to_ids(t): 20.0 for t in ('"', "}")}
    reqs = [
        _ecr("json", [5, 6, 7], temperature=0.0, structured_outputs=StructuredOutputs(json=SCHEMA)),
        _ecr("json-seeded", [8, 9], temperature=1.0, seed=3, structured_outputs=StructuredOutputs(json=SCHEMA)),
        # A random model may write one key forever: the bias (applied with the mask) ends it.
        _ecr("obj", [10, 11], temperature=0.0, structured_outputs=StructuredOutputs(json_object=True), logit_bias=close),
        _ecr("regex", [12], temperature=0.7, seed=1, structured_outputs=StructuredOutputs(regex=r"[a-z]{2,5}-[0-9]{3}")),
        _ecr("choice", [13, 14], temperature=0.0, structured_outputs=StructuredOutputs(choice=["red", "green", "blue"])),
        _ecr("plain", [5, 6, 7], temperature=0.0, max_tokens=8),
    ]  # fmt: skip
    out = _run(engine, reqs)
    text = {r: tokenizer.decode(o.new_token_ids, skip_special_tokens=True) for r, o in out.items()}
    for rid in ("json", "json-seeded"):
        jsonschema.validate(json.loads(text[rid]), SCHEMA)
    assert isinstance(json.loads(text["obj"]), dict)
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", text["regex"])
    assert text["choice"] in ("red", "green", "blue")
    for rid in ("json", "json-seeded", "obj", "regex", "choice"):
        assert out[rid].finish_reason == FinishReason.STOP and out[rid].new_token_ids[-1] == EOS
    # Greedy without constraints: what it is alone, batched with the constrained rows.
    (alone,) = _run(engine, [_ecr("plain2", [5, 6, 7], temperature=0.0, max_tokens=8)]).values()
    assert out["plain"].new_token_ids == alone.new_token_ids


def test_engine_resumed_structured_request_ends_as_the_unmoved_one(engine, qwen3_ckpt, tokenizer):
    spec = StructuredOutputs(json=SCHEMA)
    prompt = [20, 21, 22]
    whole = _run(engine, [_ecr("w", prompt, temperature=0.0, structured_outputs=spec)])["w"]
    tokens = whole.new_token_ids
    assert len(tokens) > 8
    k = len(tokens) // 2
    moved = _run(
        engine,
        [_ecr("m", prompt + tokens[:k], k=k, temperature=0.0, structured_outputs=spec)],
    )["m"]
    assert moved.new_token_ids == tokens[k:]
    jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)


def test_engine_fails_a_spec_that_does_not_compile_alone(engine):
    """The frontend refuses it first; an engine handed one anyway fails that request."""
    bad = _ecr("bad", [5, 6], structured_outputs=StructuredOutputs(regex="a("))
    good = _ecr("good", [5, 6], temperature=0.0, max_tokens=4)
    out = _run(engine, [bad, good])
    assert out["bad"].finish_reason == FinishReason.ERROR and not out["bad"].new_token_ids
    assert "the regex does not compile" in str(out["bad"].stop_reason)
    assert out["good"].finish_reason == FinishReason.LENGTH


def test_engine_refuses_token_ids_beyond_the_vocabulary(engine):
    for params in (
        SamplingParams(allowed_token_ids=[VOCAB]),
        SamplingParams(logit_bias={VOCAB + 1: 1.0}),
        SamplingParams(bad_words_token_ids=[[3, VOCAB]]),
    ):
        with pytest.raises(ValueError, match="out of range for vocab size"):
            engine.add_request(EngineCoreRequest("bad", [5, 6], params, eos_token_id=EOS))
