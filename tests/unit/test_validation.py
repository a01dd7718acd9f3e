"""Input validation at every entry point (issue 9).

- The one table of ``SamplingParams`` field bounds: legal, illegal and overflowing values
  for every field, refused at construction and again when an engine decodes a forged frame.
- ``InputProcessor.check``: what the model and the deployment allow.
- The HTTP server against a fake engine: hostile bodies (size, depth, encoding, NaN, int64)
  and fields get an OpenAI error and the server keeps serving; tokenization runs off the
  event loop; the dashboard works with an API key that never goes in a URL; request chat
  templates are refused without the flag and sandboxed with it.
- ``LLM``, ``AsyncLLM`` and HTTP refuse the same inputs with the same message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import threading
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import psutil
import pytest

from tests.unit.test_api_server import (
    CHAT,
    VOCAB,
    FakeAsyncLLM,
    FakeTokenizer,
    assert_error,
    client_for,
    live_server,
    ok_completion,
    run,
    sse_events,
    wait_for,
)
from tidal.config import (
    CacheConfig,
    EngineConfig,
    FrontendConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.processor import InputProcessor, ProcessedPrompt
from tidal.frontend.template_sandbox import SandboxUnavailable, TemplateSandbox
from tidal.launch.api_server import build_app
from tidal.launch.args import build_engine_config
from tidal.launch.engine_args import EngineArgs
from tidal.launch.errors import APIError
from tidal.launch.http_limits import MAX_JSON_DEPTH, decode_json_body
from tidal.launch.llm import LLM
from tidal.launch.spawn import make_parser
from tidal.models.tiny import CHAT_TEMPLATE
from tidal.protocol.errors import RequestFailedError
from tidal.protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from tidal.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    SamplingParams,
    StructuredOutputs,
    wrap_int64,
)

BIG = [2**63, 2**64 + 1, -(2**63) - 1]  # just past int64, past uint64, just below int64
NOT_FINITE = [math.nan, math.inf, -math.inf, 10**400]

# field -> (legal values, illegal values). Every field of SamplingParams must be here, so a
# new field cannot arrive without its bounds being tested.
FIELD_CASES: dict[str, tuple[list[Any], list[Any]]] = {
    "n": ([1, 2, 128, INT64_MAX], [0, -1, 1.5, "2", True, None, *BIG]),
    "temperature": ([0, 0.0, 0.7, 2, 1e6], [-0.1, "1", True, None, *NOT_FINITE]),
    "top_p": ([1e-9, 0.5, 1, 1.0], [0, 0.0, -0.5, 1.01, "x", *NOT_FINITE]),
    "top_k": ([-1, 0, 1, 50, INT64_MAX], [-2, 2.0, "5", False, *BIG]),
    "min_p": ([0, 0.5, 1.0], [-0.01, 1.01, *NOT_FINITE]),
    "repetition_penalty": ([0.01, 1, 1.5], [0, -1.0, *NOT_FINITE]),
    "frequency_penalty": ([-2, 0, 2.0], [-2.01, 2.5, *NOT_FINITE]),
    "presence_penalty": ([-2.0, 0.5, 2], [-3, 2.01, *NOT_FINITE]),
    "seed": ([None, 0, -1, INT64_MIN, INT64_MAX], [1.0, "7", True, *BIG]),
    "max_tokens": ([None, 1, 4096, INT64_MAX], [0, -5, 2.5, *BIG]),
    "min_tokens": ([0, 3], [-1, 0.5, *BIG]),
    "stop": (["x", ("a", "b"), [], None], [[""], [5], 5, [None]]),
    "stop_token_ids": ([[], [0, 7], (3,), None], [[-1], ["1"], 5, [True], [2**63], [2**64 + 1]]),
    "ignore_eos": ([True, False], [1, "yes", None]),
    "logprobs": ([None, 0, 20], [-1, 1.0, *BIG]),
    "prompt_logprobs": ([None, 0, 5], [-1, "1", *BIG]),
    "include_stop_str_in_output": ([True, False], [0, None]),
    "skip_special_tokens": ([True, False], [1, "true"]),
    "detokenize": ([True, False], [0, "no", None]),
    "logit_bias": (
        [None, {}, {0: 100}, {5: -100.0, 7: 0.5}],
        [{-1: 1.0}, {5: 100.5}, {5: -101}, {5: math.nan}, {"5": 1.0}, {5: "x"}, [1], {2**63: 1.0}],
    ),
    "allowed_token_ids": ([None, [0], (3, 7)], [[], [-1], ["1"], 5, [True], [2**63]]),
    "bad_words": ([[], ["x"], ("a", "b"), None], [[""], [5], 5, [None]]),
    "bad_words_token_ids": ([[], [[1]], [[1, 2], [3]]], [[[]], [[-1]], [5], [["1"]], [[2**63]]]),
    "structured_outputs": (
        [None, StructuredOutputs(regex="a+"), {"choice": ["a", "b"]}, {"json": {"type": "object"}}],
        ["x", 5, {}, {"regex": "a", "choice": ["b"]}, {"regex": ""}, {"choice": []}],
    ),
}


def test_every_field_has_cases():
    assert set(FIELD_CASES) == set(SamplingParams.__struct_fields__)


LEGAL = [(f, v) for f, (ok, _) in FIELD_CASES.items() for v in ok]
ILLEGAL = [(f, v) for f, (_, bad) in FIELD_CASES.items() for v in bad]


@pytest.mark.parametrize(("field", "value"), LEGAL, ids=[f"{f}={v!r}" for f, v in LEGAL])
def test_legal_value_accepted_and_crosses_the_wire(field, value):
    p = SamplingParams(**{field: value})
    # Stored as the wire type wants it, so the engine decodes what the frontend built.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert wire == p


@pytest.mark.parametrize(("field", "value"), ILLEGAL, ids=[f"{f}={v!r}" for f, v in ILLEGAL])
def test_illegal_value_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(("field", "value"), ILLEGAL, ids=[f"{f}={v!r}" for f, v in ILLEGAL])
def test_engine_decoder_refuses_forged_params(field, value):
    """A peer that skips the checks (attributes set after construction) still cannot get
    the value past the engine's decoder: the same table, enforced by msgspec."""
    forged = SamplingParams()
    setattr(forged, field, value)
    req = EngineCoreRequest("r", [1, 2], forged)
    try:
        frame = msgspec.msgpack.encode(req)
    except (OverflowError, TypeError):
        return  # not even encodable (2**64 + 1, a tuple of...): cannot reach an engine
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(frame, type=EngineCoreRequest)


def test_python_conveniences_and_cross_field_rule():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    p = SamplingParams(temperature=1, stop_token_ids=(3,))
    assert type(p.temperature) is float and p.stop_token_ids == [3]
    with pytest.raises(ValueError, match=r"^min_tokens\b"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match=r"^stop\b"):  # stop strings are matched in text
        SamplingParams(stop=["x"], detokenize=False)
    SamplingParams(min_tokens=5, max_tokens=None)


def test_child_seeds_wrap_within_int64():
    assert wrap_int64(INT64_MAX + 1) == INT64_MIN and wrap_int64(-1) == -1
    proc = _processor()
    reqs = proc.make_requests(
        ["a", "b", "c"], ProcessedPrompt(None, [1, 2]), SamplingParams(n=3, seed=INT64_MAX - 1)
    )
    assert [r.sampling_params.seed for r in reqs] == [INT64_MAX - 1, INT64_MAX, INT64_MIN]
    for r in reqs:  # every child crosses the wire
        msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=EngineCoreRequest)
        assert r.sampling_params.n == 1


# ---- InputProcessor.check: the model and the deployment ----------------------------------


def _processor(limits: FrontendConfig | None = None, max_model_len: int = 64) -> InputProcessor:
    hf = SimpleNamespace(vocab_size=VOCAB, eos_token_id=0)
    model = ModelConfig("/m", "/m", "float32", max_model_len, 0, "FakeMoe", hf)
    return InputProcessor(model, FakeTokenizer(), limits)


MODEL_CASES = [
    # (params, prompt ids, field the error names)
    ({"top_k": VOCAB + 1}, [1], "top_k"),
    ({"n": 5}, [1], "n"),
    ({"logprobs": 6}, [1], "logprobs"),
    ({"prompt_logprobs": 6}, [1], "prompt_logprobs"),
    ({"stop_token_ids": [VOCAB]}, [1], "stop_token_ids"),
    ({"allowed_token_ids": [1, VOCAB]}, [1], "allowed_token_ids"),
    ({"logit_bias": {VOCAB: 1.0}}, [1], "logit_bias"),
    ({"bad_words_token_ids": [[1, VOCAB]]}, [1], "bad_words_token_ids"),
    ({"structured_outputs": {"regex": "("}}, [1], "structured_outputs"),
    ({}, [VOCAB], "prompt"),
    ({}, [-1], "prompt"),
    ({}, [1.0], "prompt"),
    ({}, [True], "prompt"),
    ({}, [], "prompt"),
    ({"max_tokens": 60}, [1] * 10, "This model's maximum context length"),
]


@pytest.mark.parametrize(("params", "ids", "name"), MODEL_CASES)
def test_model_dependent_checks(params, ids, name):
    proc = _processor(FrontendConfig(max_n=4, max_logprobs=5))
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        proc.check(ProcessedPrompt(None, ids), SamplingParams(**params))


def test_model_dependent_limits_are_inclusive():
    proc = _processor(FrontendConfig(max_n=4, max_logprobs=5))
    params = SamplingParams(
        top_k=VOCAB, n=4, logprobs=5, prompt_logprobs=5, stop_token_ids=[VOCAB - 1]
    )
    proc.check(ProcessedPrompt(None, [0, VOCAB - 1]), params)


def test_prompt_token_ids_are_plain_ints():
    proc = _processor()
    assert proc.tokenize({"prompt_token_ids": (3, 4)}).prompt_token_ids == [3, 4]
    for bad in ([1, "2"], [1, 2.5], "12", 7):
        with pytest.raises(ValueError, match="prompt"):
            proc.tokenize({"prompt_token_ids": bad})


def test_chat_roles_and_reserved_template_kwargs():
    proc = _processor()
    proc.check_chat(
        [{"role": r, "content": "x"} for r in ("system", "user", "assistant", "tool")]
        + [{"role": "developer", "content": "x"}, {"role": "function", "content": "x"}],
        {"enable_thinking": False},
    )
    with pytest.raises(ValueError, match=r"^messages\[1\]\.role must be one of"):
        proc.check_chat([{"role": "user", "content": "a"}, {"role": "hacker", "content": "b"}])
    with pytest.raises(ValueError, match=r"^messages\b"):
        proc.check_chat([])
    with pytest.raises(ValueError, match=r"^chat_template_kwargs may not set chat_template"):
        proc.check_chat(CHAT, {"chat_template": "{{ 1 }}"})
    with pytest.raises(ValueError, match=r"^messages\[0\]\.role"):
        proc.apply_chat_template([{"role": "robot", "content": "x"}])


# ---- the JSON body as a whole -------------------------------------------------------------


def _nested(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize(
    ("body", "fragment", "param"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper", None),
        (json.dumps({"user": _nested(MAX_JSON_DEPTH + 1)}).encode(), "nested deeper", "user"),
        (b'{"prompt": "a", "temperature": NaN}', "NaN is not a valid JSON number", None),
        (b'{"prompt": "a", "top_p": -Infinity}', "-Infinity is not a valid", None),
        (b'{"prompt": "a", "temperature": 1e400}', "temperature: number is too large", "temperature"),
        (b'{"prompt": [1, 9223372036854775808]}', "prompt.1: 9223372036854775808 is out of range", "prompt"),
        (b'{"messages": [{"role": "user", "seed": -9223372036854775809}]}', "messages.0.seed", "messages"),
        (b"18446744073709551617", "body: 18446744073709551617 is out of range", None),
        (b'{"prompt": "\xff\xfe"}', "not valid UTF-8", None),
        (b'{"prompt": "a",', "malformed JSON", None),
        (b"1" * 5000, "malformed JSON", None),  # past Python's int-from-string digit limit
        # Lone surrogates: valid JSON escapes, not text (nothing could tokenize or echo them).
        (rb'{"prompt": "a\ud800b"}', "prompt: string holds a lone surrogate (U+D800 at index 1)", "prompt"),
        (rb'{"messages": [{"role": "user", "content": "\udfff"}]}', "messages.0.content: string", "messages"),
        (rb'{"logit_bias": {"\ud800": 1}}', "logit_bias.\\ud800: key holds a lone surrogate", "logit_bias"),
        (rb'{"\udc00x": 1}', "\\udc00x: key holds", "\\udc00x"),
        (rb'"\ud83d"', "body: string holds a lone surrogate (U+D83D", None),
    ],
)  # fmt: skip
def test_decode_json_body_refuses(body, fragment, param):
    with pytest.raises(APIError) as e:
        decode_json_body(body)
    assert e.value.status == 400 and fragment in e.value.message and e.value.param == param


def test_decode_json_body_accepts_the_edges():
    ok = {"a": _nested(MAX_JSON_DEPTH - 1), "i": [INT64_MIN, INT64_MAX], "f": 1.5e308, "b": True}
    assert decode_json_body(json.dumps(ok).encode()) == ok
    # A surrogate pair is one code point (an emoji), and non-ASCII text is text.
    assert decode_json_body(rb'{"\ud83c\udf0a": "caf\u00e9 \ud83d\ude00"}') == {"🌊": "café 😀"}


# ---- HTTP against a fake engine -------------------------------------------------------------

HOSTILE = [
    # (path, body, status, param, message fragment)
    ("/v1/completions", {"prompt": "a", "top_k": 2**63}, 400, "top_k", "64 bits"),
    ("/v1/completions", {"prompt": "a", "top_k": 2**64 + 1}, 400, "top_k", "64 bits"),
    ("/v1/completions", {"prompt": "a", "top_k": VOCAB + 1}, 400, "top_k", "vocabulary"),
    ("/v1/completions", {"prompt": "a", "n": 1_000_000}, 400, "n", "--max-n"),
    ("/v1/completions", {"prompt": "a", "seed": 2**63}, 400, "seed", "64 bits"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2**64 + 1}, 400, "max_tokens", "64 bits"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1000}, 400, None, "context length"),
    ("/v1/completions", {"prompt": "a", "min_tokens": -1}, 400, "min_tokens", ">= 0"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs", "--max-logprobs"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature", ">= 0"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 9}, 400, "presence_penalty", "2.0"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty", "> 0"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [VOCAB]}, 400, "stop_token_ids", "vocab"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [-3]}, 400, "stop_token_ids", ">= 0"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"99999": 5}}, 400, "logit_bias", "vocab size"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 100.5}}, 400, "logit_bias", "<= 100"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias", "not a token id"),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": [VOCAB]}, 400, "allowed_token_ids", "vocab size"),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": []}, 400, "allowed_token_ids", "empty"),
    ("/v1/completions", {"prompt": "a", "bad_words": [""]}, 400, "bad_words", "empty"),
    ("/v1/completions", {"prompt": "a", "guided_json": {"type": "nope"}}, 400, "guided_json", "does not compile"),
    ("/v1/completions", {"prompt": "a", "guided_json": "{not json"}, 400, "guided_json", "not valid JSON"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a("}, 400, "guided_regex", "does not compile"),
    ("/v1/completions", {"prompt": "a", "guided_grammar": 'rot ::= "a"'}, 400, "guided_grammar", "root"),
    ("/v1/completions", {"prompt": "a", "guided_choice": []}, 400, "guided_choice", "non-empty"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"regex": "(", "choice": None}}, 400, "structured_outputs", "does not compile"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs", "exactly one"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a", "guided_choice": ["b"]}, 400, "guided_choice", "only one of"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format", "schema is required"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, 400, "response_format", "does not compile"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, 400, "response_format", "json_schema"),
    ("/v1/completions", {"prompt": [5, VOCAB]}, 400, "prompt", "vocab size"),
    ("/v1/completions", {"prompt": ["a"] * 257}, 400, "prompt", "--max-prompts-per-request"),
    ("/v1/completions", {"prompt": "a", "data_parallel_rank": 2**64}, 400, "data_parallel_rank", "64 bits"),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, None, "NaN"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None, "nested deeper"),
    ("/v1/completions", b'{"prompt": "\xc3\x28"}', 400, None, "UTF-8"),
    ("/v1/chat/completions", {"messages": [{"role": "hacker", "content": "x"}]}, 400, "messages", "role"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 1 }}"}, 400, "chat_template", "--trust-request-chat-template"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs", "tokenize"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "logprobs", "--max-logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 129}, 400, "n", "--max-n"),
    # Request limits: checked on the raw body before anything walks it (issue 23).
    ("/v1/completions", {"prompt": "a", "stop": ["x"] * 65}, 400, "stop", "--max-stop-strings"),
    ("/v1/completions", {"prompt": "a", "stop": "x" * 1025}, 400, "stop", "--max-stop-string-length"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["y" * 2000]}, 400, "stop", "--max-stop-string-length"),
    ("/v1/completions", {"prompt": "a", "stop": ["z"] * 100_000, "n": 16}, 400, "stop", "--max-stop-strings"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": list(range(100_000))}, 400, "stop_token_ids", "--max-stop-token-ids"),
    ("/v1/chat/completions", {"messages": CHAT, "stop_token_ids": list(range(1025))}, 400, "stop_token_ids", "--max-stop-token-ids"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [1] * 1_000_000}, 400, "stop_token_ids", "--max-stop-token-ids"),
    ("/v1/completions", {"prompt": ["a"] * 9, "n": 128}, 400, "n", "--max-choices-per-request"),
    ("/v1/completions", {"prompt": [[5, 6]] * 256, "n": 128}, 400, "n", "--max-choices-per-request"),
    ("/v1/completions", {"prompt": ["a"] * 256, "n": 5}, 400, "n", "--max-choices-per-request"),
    # Known to OpenAI or vLLM, not implemented: refused by name, never silently ignored.
    ("/v1/completions", {"prompt": "a", "use_beam_search": True}, 400, "use_beam_search", "not supported"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": -1}, 400, "prompt_logprobs", ">= 0"),
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "-1 or in [1, "),
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 10**6}, 400, "truncate_prompt_tokens", "context"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream is true"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions", "not supported"),
    ("/v1/completions", {"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "not supported"),
    # Tool calling (docs/operations.md#tool-calling-and-reasoning).
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", "--tool-call-parser"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice", "needs a non-empty tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", "'g' is not one of"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "tool_choice": "required"}, 400, "tools", "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "response_format": {"type": "json_object"}}, 400, "tool_choice", "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "retrieval"}]}, 400, "tools", "tools.0.type"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": {"type": "function"}}, 400, "tools", "list"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "sometimes"}, 400, "tool_choice", "tool_choice"),
]  # fmt: skip


@run
async def test_repeated_stop_ids_reach_the_engine_once():
    """Repeats are counted against the limit as sent, then dropped (in order)."""
    async with client_for() as c:
        body = {"prompt": "hi there", "max_tokens": 2, "stop_token_ids": [7, 5] * 512}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert c.engine.calls[-1]["params"].stop_token_ids == [7, 5]


@run
async def test_largest_fan_out_within_the_limit_is_served():
    async with client_for(_engine(max_n=4, max_choices_per_request=8)) as c:
        body = {"prompt": ["a", "b"], "n": 4, "max_tokens": 1}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 8
        r = await c.post("/v1/completions", json={**body, "prompt": ["a", "b", "c"]})
        assert "3 prompts x n=4 = 12 choices" in assert_error(r, 400, "n")["message"]


@pytest.mark.parametrize(("path", "body", "status", "param", "fragment"), HOSTILE)
@run
async def test_hostile_request_refused_then_serving(path, body, status, param, fragment):
    async with client_for() as c:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await c.post(path, content=content, headers={"content-type": "application/json"})
        err = assert_error(r, status, param)
        assert fragment in err["message"] and err["type"] == "invalid_request_error"
        assert c.engine.calls == []
        await ok_completion(c)


def _engine(**limits: Any) -> FakeAsyncLLM:
    engine = FakeAsyncLLM()
    engine.config = dataclasses.replace(engine.config, frontend=FrontendConfig(**limits))
    return engine


@run
async def test_body_size_limit_content_length_and_chunked():
    async with client_for(_engine(max_request_body_bytes=2048)) as c:
        big = json.dumps({"prompt": "a " * 2000, "max_tokens": 1}).encode()
        r = await c.post("/v1/completions", content=big)
        err = assert_error(r, 413)
        assert err["code"] == "request_too_large" and "--max-request-body-bytes" in err["message"]

        async def chunks():  # no Content-Length: counted as it streams
            for _ in range(100):
                yield b" " * 1024

        json_type = {"content-type": "application/json"}
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert_error(await c.post(path, content=chunks(), headers=json_type), 413)
        assert c.engine.calls == []
        await ok_completion(c)  # a body under the limit is served


@run
async def test_64mb_body_is_refused_over_real_http():
    """uvicorn drains what the app did not read, so the client reads the 413 (no reset)."""
    async with live_server(FakeAsyncLLM()) as url, httpx.AsyncClient(base_url=url) as c:
        r = await c.post("/v1/completions", content=b"x" * (64 << 20), timeout=120)
        assert assert_error(r, 413)["code"] == "request_too_large"
        r = await c.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 2})
        assert r.status_code == 200, r.text


class BlockingTokenizer(FakeTokenizer):
    """Blocks ``encode`` of a text containing BLOCK until released (to prove the event
    loop is not the thread doing it)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "BLOCK" in text:
            self.entered.set()
            assert self.release.wait(120), "never released"
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@run
async def test_tokenization_and_templates_run_off_the_event_loop(path):
    engine = FakeAsyncLLM()
    tok = BlockingTokenizer()
    engine.tokenizer = engine.input_processor.tokenizer = tok
    async with client_for(engine) as c:
        body = (
            {"prompt": "BLOCK me", "max_tokens": 2}
            if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "BLOCK me"}], "max_tokens": 2}
        )
        slow = asyncio.ensure_future(c.post(path, json=body))
        await asyncio.to_thread(tok.entered.wait, 120)
        # The slow request is stuck in its tokenizer; another one streams start to end.
        stream = await c.post(
            "/v1/completions", json={"prompt": "quick", "max_tokens": 3, "stream": True}
        )
        assert len(sse_events(stream.text)) == 3 and not slow.done()
        tok.release.set()
        r = await slow
        assert r.status_code == 200, r.text


@run
async def test_dashboard_with_api_key_never_in_the_url():
    async with client_for(api_key="sekret") as c:
        page = await c.get("/dashboard")  # the static page is public: it holds no data
        assert page.status_code == 200 and page.headers["cache-control"] == "no-store"
        script = page.text.split("<script>")[1]
        assert "location" not in script and "?key" not in script  # never read from the URL
        assert "sessionStorage" in script and 'Authorization: "Bearer "' in script
        assert 'fetch("/stats", { headers: headers()' in script
        assert_error(await c.get("/stats"), 401)  # the data still needs the key
        assert_error(await c.post("/dashboard"), 401)  # only GET/HEAD of the page is public
        ok = await c.get("/stats", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
@run
async def test_request_chat_template_sandboxed_when_allowed(qwen3_ckpt):
    engine = _engine(trust_request_chat_template=True)
    model = dataclasses.replace(engine.config.model, tokenizer=qwen3_ckpt)
    engine.config = dataclasses.replace(engine.config, model=model)
    async with client_for(engine) as c:
        sandbox = c.app.state.serving.template_sandbox
        sandbox.timeout_s = 60.0  # no deadline a loaded machine could miss for real templates
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        r = await c.post("/v1/chat/completions", json={**body, "chat_template": CHAT_TEMPLATE})
        assert r.status_code == 200, r.text
        assert engine.calls[-1]["prompt"].prompt == "<|im_start|>user\nhi<|im_end|>\n" + (
            "<|im_start|>assistant\n"
        )
        worker = sandbox.pid
        # A template that would run for ever is cut off; its worker is killed and replaced.
        sandbox.timeout_s = 2.0
        spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        r = await c.post("/v1/chat/completions", json={**body, "chat_template": spin})
        assert "took longer than" in assert_error(r, 400, "chat_template")["message"]
        assert sandbox.workers_killed == 1
        await wait_for(lambda: not _alive(worker))
        sandbox.timeout_s = 60.0
        r = await c.post("/v1/chat/completions", json={**body, "chat_template": "{{ boom( }}"})
        assert "TemplateSyntaxError" in assert_error(r, 400, "chat_template")["message"]
        r = await c.post("/v1/chat/completions", json={**body, "chat_template": CHAT_TEMPLATE})
        assert r.status_code == 200, r.text
        await ok_completion(c)
        worker = sandbox.pid
        assert _alive(worker)
    # The app's lifespan is not run by ASGITransport: close as the server's shutdown does.
    await sandbox.close()
    assert not _alive(worker)


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
@run
async def test_sandbox_that_cannot_start_is_a_server_error():
    sandbox = TemplateSandbox("/nonexistent/tokenizer", max_chars=100)
    with pytest.raises(SandboxUnavailable, match="did not start: cannot load the tokenizer"):
        await sandbox.render(CHAT, chat_template="{{ 1 }}", add_generation_prompt=True, kwargs={})
    await sandbox.close()
    assert sandbox.pid is None


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
@run
async def test_sandbox_imports_nothing_from_the_working_directory(
    qwen3_ckpt, tmp_path, monkeypatch
):
    """A module in the server's working directory (``msgspec.py``, which the worker
    imports first) is not what the worker imports, even where PYTHONPATH names the
    directory implicitly (an empty or relative entry)."""
    marker = tmp_path / "shadow-imported"
    (tmp_path / "msgspec.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise ImportError('shadowed')\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([".", os.environ.get("PYTHONPATH", ""), ""]))
    sandbox = TemplateSandbox(qwen3_ckpt, max_chars=10_000, timeout_s=60.0)
    try:
        text, ids = await sandbox.render(
            CHAT, chat_template=CHAT_TEMPLATE, add_generation_prompt=False, kwargs={}
        )
    finally:
        await sandbox.close()
    assert text.startswith("<|im_start|>system\n") and ids
    assert not marker.exists()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- LLM, AsyncLLM and HTTP refuse the same inputs ------------------------------------------

SAME_ERRORS = [
    # (params, prompt token ids, the field the message starts with)
    ({"top_k": 513}, [5, 6], "top_k"),
    ({"n": 1_000_000}, [5, 6], "n"),
    ({"logprobs": 21}, [5, 6], "logprobs"),
    ({"stop_token_ids": [512]}, [5, 6], "stop_token_ids"),
    ({}, [5, 512], "prompt"),
    ({"max_tokens": 1000}, [5, 6], "This model's maximum context length"),
    # The request limits (FrontendConfig.check_sizes), at their defaults.
    ({"stop": [f"s{i}" for i in range(65)]}, [5, 6], "stop"),
    ({"stop": ["x" * 1025]}, [5, 6], "stop"),
    ({"stop_token_ids": list(range(1025))}, [5, 6], "stop_token_ids"),
]


class _NoEngine:
    """An engine client that must never be reached: every case is refused before."""

    dead_reason = None

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the engine client was used ({name})")


@pytest.fixture(scope="module")
def offline(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, multiprocess=False, max_model_len=128, dtype="float32", device="cpu")
    yield llm
    llm.shutdown()


@pytest.mark.parametrize(("params", "ids", "field"), SAME_ERRORS)
def test_llm_asyncllm_and_http_refuse_alike(offline, params, ids, field):
    sp = SamplingParams(**params)
    with pytest.raises(ValueError, match=rf"^{field}\b") as from_llm:
        offline.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)

    engine = AsyncLLM(offline.config, client=_NoEngine())

    async def via_async_llm() -> str:
        with pytest.raises(ValueError) as e:
            async for _ in engine.generate(ProcessedPrompt(None, ids), sp):
                pass
        return str(e.value)

    async def via_http() -> dict:
        app = build_app(engine, shutdown_engine=False)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"prompt": ids, **params})
        return assert_error(r, 400)

    assert asyncio.run(via_async_llm()) == str(from_llm.value)
    assert asyncio.run(via_http())["message"] == str(from_llm.value)


def test_the_engine_rechecks_sizes_and_keeps_stop_ids_as_a_set(offline):
    """What skipped the frontend's checks is refused by its length before any per-item
    check; the engine's request keeps its stop ids as a set, and stops on them."""
    engine = offline.client.engine
    many_ids = SamplingParams(stop_token_ids=list(range(100_000)))
    many_stops = SamplingParams(stop=[f"s{i}" for i in range(100)])
    for params, field in ((many_ids, "stop_token_ids"), (many_stops, "stop")):
        with pytest.raises(ValueError, match=rf"^{field}: at most"):
            engine.make_request(EngineCoreRequest("big", [5, 6], params))
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[3, 4, 3])
    req = engine.make_request(EngineCoreRequest("ok", [5, 6], params))
    assert req.stop_token_ids == frozenset({3, 4}) and params.stop_token_ids == [3, 4]
    # Greedy: stop on whatever the model says second.
    (free,) = offline.generate(
        {"prompt_token_ids": [5, 6]}, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False
    )
    stop_at = free.outputs[0].token_ids[1]
    params = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[stop_at] * 3 + [511])
    (out,) = offline.generate({"prompt_token_ids": [5, 6]}, params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_at
    assert c.token_ids == free.outputs[0].token_ids[: c.token_ids.index(stop_at) + 1]


def test_llm_refuses_table_and_chat_errors_then_serves(offline):
    with pytest.raises(ValueError, match=r"^top_k must be <= 9223372036854775807"):
        offline.generate("hi", SamplingParams(top_k=2**63))
    with pytest.raises(ValueError, match=r"^messages\[0\]\.role must be one of"):
        offline.chat([{"role": "robot", "content": "hi"}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt token ids must be integers"):
        offline.generate({"prompt_token_ids": [1, 2.5]}, use_tqdm=False)
    # The offline engine is untouched by all of it.
    params = SamplingParams(temperature=0.0, max_tokens=3, seed=INT64_MAX, n=2)
    (out,) = offline.generate("The tide", params, use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]


def test_llm_interrupted_between_two_children_leaves_nothing(offline, monkeypatch):
    """Ctrl-C while ``generate`` sends an n=2 request's children (after the first): the
    request is aborted, the engine holds nothing, and the next ``generate`` serves."""
    add_request = offline.client.add_request
    sent: list[str] = []

    def interrupted(req: Any) -> None:
        if req.request_id.startswith("1_"):
            raise KeyboardInterrupt
        sent.append(req.request_id)
        add_request(req)

    monkeypatch.setattr(offline.client, "add_request", interrupted)
    params = SamplingParams(temperature=0.0, max_tokens=3, n=2)
    with pytest.raises(KeyboardInterrupt):
        offline.generate(["The tide", "comes in"], params, use_tqdm=False)
    monkeypatch.undo()
    assert len(sent) == 1 and offline.output_processor.num_unfinished() == 0
    assert not offline.client.engine.has_unfinished_requests()
    (out,) = offline.generate("The tide", params, use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]


def test_llm_raises_when_the_engine_fails_a_request(offline, monkeypatch):
    """An engine error output (here: child 1 of an n=2 request, failed while running)
    raises RequestFailedError with the engine's message; the sibling is aborted and the
    engine goes on serving."""
    message = "the engine failed sampling for this request: RuntimeError: boom"
    get_output = offline.client.get_output
    aborted: list[str] = []

    def failing_output() -> Any:
        outs = get_output()
        for i, o in enumerate(outs.outputs):
            if o.request_id.startswith("1_"):
                outs.outputs[i] = EngineCoreOutput(
                    o.request_id, [], finish_reason=FinishReason.ERROR, stop_reason=message
                )
                offline.client.abort_requests([o.request_id])  # the engine finished it
        return outs

    abort_requests = offline.client.abort_requests
    monkeypatch.setattr(offline.client, "get_output", failing_output)
    monkeypatch.setattr(
        offline.client, "abort_requests", lambda ids: (aborted.extend(ids), abort_requests(ids))
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, n=2)
    with pytest.raises(RequestFailedError, match=r"^the engine failed sampling") as e:
        offline.generate("The tide", params, use_tqdm=False)
    assert not e.value.invalid and f"0_{e.value.request_id}" in aborted
    monkeypatch.undo()
    assert not offline.client.engine.has_unfinished_requests()
    (out,) = offline.generate("The tide", params, use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]


def test_frontend_limits_are_flags(qwen3_ckpt, capsys):
    parser = make_parser()
    sys_args = ["--model", qwen3_ckpt, "--max-n", "8", "--max-request-body-bytes", "4096"] + [
        "--max-logprobs",
        "3",
        "--max-prompts-per-request",
        "2",
        "--trust-request-chat-template",
    ]
    ns = parser.parse_args(
        [*sys_args, "--max-choices-per-request", "9", "--max-stop-strings", "4"]
        + ["--max-stop-string-length", "5", "--max-stop-token-ids", "6"]
    )
    cfg = build_engine_config(parser, ns)
    assert cfg.frontend == FrontendConfig(
        max_n=8,
        max_prompts_per_request=2,
        max_logprobs=3,
        max_request_body_bytes=4096,
        trust_request_chat_template=True,
        max_choices_per_request=9,
        max_stop_strings=4,
        max_stop_string_length=5,
        max_stop_token_ids=6,
    )
    assert EngineArgs(model=qwen3_ckpt).create_engine_config().frontend == FrontendConfig()
    with pytest.raises(SystemExit):
        build_engine_config(parser, parser.parse_args(["--model", qwen3_ckpt, "--max-n", "0"]))
    assert "--max-n: max_n must be an integer >= 1, got 0" in capsys.readouterr().err


def test_default_frontend_config_is_what_a_bare_engine_config_gets():
    model = ModelConfig("/m", "/m", "float32", 8, 0, "X", SimpleNamespace(vocab_size=4))
    cfg = EngineConfig(model, CacheConfig(), SchedulerConfig(), ParallelConfig())
    assert cfg.frontend == FrontendConfig()
    assert cfg.frontend.max_n == 128 and cfg.frontend.max_logprobs == 20
    assert not cfg.frontend.trust_request_chat_template
