"""Structured outputs and the sampler-level fields through the real server and the real
``openai`` client (docs/architecture.md#structured-outputs), and offline through ``LLM``.

The tiny model is random, so every constrained output is whatever its grammar forces out
of noise: what is checked is that it parses and validates, matches, or is a choice.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.server_utils import RemoteServer
from tidal import LLM, SamplingParams
from tidal.sampling_params import StructuredOutputs

MODEL_NAME = "tiny-moe"
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=150)


@pytest.fixture(scope="module")
def server(qwen3_ckpt):
    srv = RemoteServer(
        ["--model", qwen3_ckpt, "--served-model-name", MODEL_NAME, "--dtype", "float32",
         "--log-level", "warning"]
    )  # fmt: skip
    yield srv
    srv.stop()
    assert srv.leftover_processes() == []


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client, **kw) -> str:
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=200, **kw)
    (choice,) = r.choices
    assert choice.finish_reason == "stop", choice
    return choice.message.content


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_output_validates(client, temperature):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    text = _chat(client, response_format=fmt, temperature=temperature, seed=5)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_sdk_parse_with_a_pydantic_model(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(
        model=MODEL_NAME, messages=CHAT, response_format=Person, max_tokens=200, temperature=0
    )
    (choice,) = r.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_streamed_equals_unstreamed(client):
    fmt = {"type": "json_object"}
    # A random model may write one key forever; a bias toward closing quotes/braces ends it.
    bias = {str(t): 20 for t in _offline_ids('"}')}
    text = _chat(client, response_format=fmt, temperature=0, logit_bias=bias)
    assert isinstance(json.loads(text), dict)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=200, response_format=fmt, temperature=0,
        logit_bias=bias, stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": r"[a-z]{3}-[0-9]{2,4}"}, lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", t)),
        ({"guided_choice": ["alpha", "beta", "gamma delta"]}, lambda t: t in ("alpha", "beta", "gamma delta")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"regex": "(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9] | "y"'}, lambda t: re.fullmatch(r"x[0-9]{2}|y", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ],
)  # fmt: skip
def test_completions_with_vllm_fields(client, extra, check):
    r = client.completions.create(
        model=MODEL_NAME, prompt="The answer is", max_tokens=200, temperature=0.8, seed=11,
        extra_body=extra,
    )  # fmt: skip
    (choice,) = r.choices
    assert choice.finish_reason == "stop" and check(choice.text), choice.text


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "response_format"),
        ({"extra_body": {"guided_regex": "a("}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= "}}, "guided_grammar"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"extra_body": {"allowed_token_ids": [99999]}}, "allowed_token_ids"),
    ],
)  # fmt: skip
def test_bad_values_are_400s_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, **kw)
    assert e.value.body["param"] == param, e.value.body
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2)
    assert r.choices[0].finish_reason == "length"  # and it serves on


_TOKENIZER = None


def _offline_ids(text: str) -> list[int]:
    """The tiny tokenizer's id of each character of ``text`` (each is one token)."""
    from tidal.models.tiny import build_tokenizer

    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = build_tokenizer(512, 256)
    return [_TOKENIZER.convert_tokens_to_ids(c) for c in text]


def test_logit_bias_and_allowed_token_ids(client):
    (x,) = _offline_ids("x")
    r = client.completions.create(
        model=MODEL_NAME, prompt="hello", max_tokens=6, temperature=0, logit_bias={str(x): 100}
    )
    assert r.choices[0].text == "x" * 6
    allowed = _offline_ids("ab")
    r = client.completions.create(
        model=MODEL_NAME, prompt="hello", max_tokens=8, temperature=1.0, seed=3,
        extra_body={"allowed_token_ids": allowed},
    )  # fmt: skip
    assert set(r.choices[0].text) <= {"a", "b"} and len(r.choices[0].text) == 8


# ---- offline -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(qwen3_ckpt):
    engine = LLM(qwen3_ckpt, dtype="float32", multiprocess=False)
    yield engine
    engine.shutdown()


def test_offline_structured_outputs_and_unchanged_greedy(llm):
    prompts = ["hello world", "the cat sat"]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    json_params = SamplingParams(
        temperature=0.0, max_tokens=200, structured_outputs=StructuredOutputs(json=SCHEMA)
    )
    mixed = llm.generate(prompts * 2, [plain, plain, json_params, json_params], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone  # greedy unchanged
    for o in mixed[2:]:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    # A dict in the Python API, and the pydantic model's schema.
    (out,) = llm.generate(
        ["hi"],
        SamplingParams(
            temperature=0.0, max_tokens=200,
            structured_outputs={"json": Person.model_json_schema()},
        ),
        use_tqdm=False,
    )  # fmt: skip
    Person.model_validate_json(out.outputs[0].text)


def test_offline_bad_words_are_never_completed(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    (base,) = llm.generate(["hello world"], params, use_tqdm=False)
    ids = base.outputs[0].token_ids
    word = tok.decode(ids[2:4])  # a word the greedy output spells
    spellings = llm.input_processor.bad_words_token_ids([word])
    starts = [i for w in spellings for i in range(len(ids)) if ids[i : i + len(w)] == w]
    assert starts, (word, spellings, ids)
    banned = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, bad_words=[word])
    (out,) = llm.generate(["hello world"], banned, use_tqdm=False)
    got = out.outputs[0].token_ids
    for w in spellings:  # never completed, in any spelling
        assert all(got[i : i + len(w)] != w for i in range(len(got))), (w, got)
    assert got[: min(starts)] == ids[: min(starts)]  # unchanged up to the first ban
