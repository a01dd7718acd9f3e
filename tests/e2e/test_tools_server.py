"""Tool calling, reasoning and ``--chat-template`` through ``launch --dp 2`` and the real
``openai`` client (docs/operations.md#tool-calling-and-reasoning). One server for all.

The tiny model is random: forced calls (``required``, a named function) are what their
grammar makes of noise, so what is checked is that their arguments validate; the ``auto``
parser is fed a call forced by a regex; the template leaves ``<think>`` open, so the
random output is all thinking (and a grammar waits for its end) unless
``enable_thinking`` is false.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.e2e.server_utils import RemoteServer

pytestmark = pytest.mark.slow

MODEL_NAME = "tiny-tools"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": s}}
    for n, s in SCHEMAS.items()
]
# A Qwen3-style template (shortened: the tiny model's context is 512 tokens): the tools'
# names in a system block, calls as <tool_call> JSON, and the
# assistant's turn opened inside <think> unless enable_thinking is false.
TEMPLATE = """\
{%- if tools %}<|im_start|>system
<tools>{% for t in tools %} {{ t.function.name }}{% endfor %}</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def server(qwen3_ckpt, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "qwen3_like.jinja"
    template.write_text(TEMPLATE)
    # --cpu-kernels torch: no timed kernel trials at start (seconds, run again at every
    # start on a loaded machine); this module tests the API, not the kernels' choice.
    srv = RemoteServer(
        ["--model", qwen3_ckpt, "--served-model-name", MODEL_NAME, "--dtype", "float32",
         "--dp", "2", "--chat-template", str(template), "--tool-call-parser", "hermes",
         "--reasoning-parser", "qwen3", "--cpu-kernels", "torch", "--log-level", "warning"]
    )  # fmt: skip
    yield srv
    srv.stop()
    assert srv.leftover_processes() == []


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _calls(message) -> list[tuple[str, dict]]:
    out = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


# The template's thinking block closed: a grammar would otherwise wait for </think>.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _both(client, **kw):
    """The reply unstreamed, and streamed as the SDK assembles it (same seed)."""
    args = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 120, "seed": 7, **kw}
    args["extra_body"] = {**NO_THINKING, **args.get("extra_body", {})}
    plain = client.chat.completions.create(**args).choices[0]
    with client.chat.completions.stream(**args) as stream:
        streamed = stream.get_final_completion().choices[0]
    return plain, streamed


@pytest.mark.parametrize(
    ("choice", "parallel", "names"),
    [
        ("required", False, None),
        ("required", True, None),
        ({"type": "function", "function": {"name": "add"}}, True, ["add"]),
    ],
)
def test_forced_tool_calls_validate_streamed_and_not(client, choice, parallel, names):
    plain, streamed = _both(
        client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, temperature=1.0
    )
    for c in (plain, streamed):
        assert c.finish_reason == "tool_calls", c
        calls = _calls(c.message)
        assert calls and (names is None or [n for n, _ in calls] == names)
        assert parallel or len(calls) == 1
        assert c.message.content is None
    assert _calls(streamed.message) == _calls(plain.message)


def test_auto_calls_are_parsed_streamed_and_not(client):
    call = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "unit": "c"\}\}</tool_call>'
    plain, streamed = _both(
        client, tools=TOOLS, temperature=1.0, extra_body={"guided_regex": r"Sure\. " + call}
    )
    for c in (plain, streamed):
        assert c.finish_reason == "tool_calls" and c.message.content == "Sure. "
        [(name, args)] = _calls(c.message)
        assert name == "get_weather" and args["unit"] == "c"
    assert _calls(streamed.message) == _calls(plain.message)
    assert streamed.message.tool_calls[0].function.arguments == (
        plain.message.tool_calls[0].function.arguments
    )
    # The raw chunks, as vLLM sends them: the content, then the call named (arguments
    # ""), then its arguments in pieces as they are generated.
    chunks = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, tools=TOOLS, max_tokens=120, seed=7, temperature=1.0,
        stream=True, extra_body={"guided_regex": r"Sure\. " + call, **NO_THINKING},
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Sure. "
    head, *rest = [t for d in deltas for t in d.tool_calls or []]
    assert (head.index, head.type, head.function.name) == (0, "function", "get_weather")
    assert head.id.startswith("call_") and head.function.arguments == ""
    assert all(t.index == 0 and t.id is None and t.function.name is None for t in rest)
    fragments = [t.function.arguments for t in rest]
    assert len(fragments) > 2
    assert "".join(fragments) == plain.message.tool_calls[0].function.arguments
    # Not a call (the JSON is bad): the text stays content, as written.
    bad = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, tools=TOOLS, max_tokens=60,
        extra_body={"guided_regex": r"<tool_call>\{oops[a-z]{2}\}</tool_call>", **NO_THINKING},
    ).choices[0]  # fmt: skip
    assert bad.finish_reason == "stop" and not bad.message.tool_calls
    assert bad.message.content.startswith("<tool_call>{oops")


def test_reasoning_content_from_the_open_think_block(client):
    args = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 12, "temperature": 0}
    thinking = client.chat.completions.create(**args).choices[0].message
    reasoning = getattr(thinking, "reasoning_content", None)
    assert reasoning and thinking.content is None  # never closed: all thinking
    stream = client.chat.completions.create(**args, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert not any(d.content for d in deltas)
    # enable_thinking false: the template closes the block, the output is the answer.
    answer = (
        client.chat.completions.create(
            **args, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        .choices[0]
        .message
    )
    assert answer.content and getattr(answer, "reasoning_content", None) is None


def test_a_grammar_applies_after_the_thinking(client):
    """As vLLM: the thinking is free, the constraint starts at </think>. The random
    model never closes the block, so the constrained reply is all (unconstrained)
    thinking, cut by max_tokens; without the thinking it is a choice at once."""
    args = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 12, "temperature": 0}
    choice = {"guided_choice": ["yes", "no"]}
    thinking = client.chat.completions.create(**args, extra_body=choice).choices[0]
    assert thinking.finish_reason == "length" and thinking.message.content is None
    assert getattr(thinking.message, "reasoning_content", None)
    answer = client.chat.completions.create(**args, extra_body={**choice, **NO_THINKING})
    assert answer.choices[0].message.content in ("yes", "no")
    assert answer.choices[0].finish_reason == "stop"


def test_tools_and_history_reach_the_template(client):
    def prompt_tokens(**kw) -> int:
        r = client.chat.completions.create(model=MODEL_NAME, max_tokens=1, **kw)
        return r.usage.prompt_tokens

    bare = prompt_tokens(messages=CHAT)
    with_tools = prompt_tokens(messages=CHAT, tools=TOOLS, tool_choice="none")
    history = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]  # fmt: skip
    with_history = prompt_tokens(messages=history, tools=TOOLS, tool_choice="none")
    assert bare < with_tools < with_history


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"extra_body": {"tools": {"type": "function"}}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_and_serving_goes_on(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, **kw)
    assert e.value.body["param"] == param, e.value.body
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2)
    assert r.choices[0].finish_reason == "length"


# ---- /v1/responses: the same tools through client.responses -----------------------------

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def _response_calls(response) -> list[tuple[str, dict]]:
    out = []
    for item in response.output:
        if item.type == "function_call":
            assert item.call_id.startswith("call_") and item.status == "completed"
            args = json.loads(item.arguments)
            jsonschema.validate(args, SCHEMAS[item.name])
            out.append((item.name, args))
    return out


@pytest.mark.parametrize(
    ("choice", "names"),
    [("required", None), ({"type": "function", "name": "add"}, ["add"])],
)
def test_responses_function_calls_streamed_and_not(client, choice, names):
    args = {"model": MODEL_NAME, "input": CHAT, "tools": FLAT_TOOLS, "tool_choice": choice,
            "parallel_tool_calls": False, "max_output_tokens": 120, "temperature": 1.0,
            "extra_body": {**NO_THINKING, "seed": 7}}  # fmt: skip
    plain = client.responses.create(**args)
    with client.responses.stream(**args) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    for r in (plain, streamed):
        assert r.status == "completed"
        calls = _response_calls(r)
        assert len(calls) == 1 and (names is None or [n for n, _ in calls] == names)
    assert _response_calls(streamed) == _response_calls(plain)  # same seed
    assert "response.function_call_arguments.delta" in kinds
    # The calls' results go back in the next turn's input; the reply is generated.
    history = [*CHAT, *[item.model_dump(exclude_none=True) for item in plain.output]]
    history += [
        {"type": "function_call_output", "call_id": item.call_id, "output": "18 degrees"}
        for item in plain.output
        if item.type == "function_call"
    ]
    follow = client.responses.create(
        model=MODEL_NAME, input=history, tools=FLAT_TOOLS, tool_choice="none",
        max_output_tokens=3, extra_body=NO_THINKING,
    )  # fmt: skip
    assert follow.output_text and follow.usage.input_tokens > plain.usage.input_tokens
    assert follow.usage.output_tokens_details.reasoning_tokens == 0  # no thinking


def test_responses_reasoning_item_from_the_open_think_block(client):
    r = client.responses.create(model=MODEL_NAME, input=CHAT, max_output_tokens=12)
    (item,) = r.output  # never closed: all thinking
    assert item.type == "reasoning" and item.content[0].text and r.output_text == ""
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 12
    chat = (
        client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0
        )
        .choices[0]
        .message
    )
    greedy = client.responses.create(
        model=MODEL_NAME, input=CHAT, max_output_tokens=12, temperature=0
    )
    assert greedy.output[0].content[0].text == getattr(chat, "reasoning_content", None)
