"""vLLM's request surface beyond sampling, against the fake engine of ``test_api_server``:
``prompt_logprobs``, ``truncate_prompt_tokens``, ``return_tokens_as_token_ids``, usage
details and streaming usage, grammar compiles off the event loop, ``/tokenize`` and
``/detokenize``, and ``/v1/responses`` (docs/operations.md#api-surface)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import pytest

from tests.unit.test_api_server import (
    CHAT,
    MAX_MODEL_LEN,
    SERVED,
    VOCAB,
    FakeAsyncLLM,
    FakeTokenizer,
    assert_error,
    client_for,
    expected_text,
    ok_completion,
    run,
    sse_events,
    token_id,
)
from tests.waiting import wait_until_async
from tidal.frontend.outputs import CompletionOutput, Logprob, OutputKind, RequestOutput
from tidal.launch import openai_models as P
from tidal.launch import serving
from tidal.launch.responses import ResponsesRequest
from tidal.sampling_params import StructuredOutputs

# ---- prompt_logprobs -----------------------------------------------------------------------


@run
async def test_prompt_logprobs_are_vllms_shape_and_null_when_not_asked():
    async with client_for() as c:
        body = {"prompt": "tok5 tok6 tok7", "max_tokens": 2}
        r = await c.post("/v1/completions", json=body)
        (choice,) = r.json()["choices"]
        assert "prompt_logprobs" in choice and choice["prompt_logprobs"] is None
        assert c.engine.calls[-1]["params"].prompt_logprobs is None

        r = await c.post("/v1/completions", json={**body, "prompt_logprobs": 0})
        (choice,) = r.json()["choices"]
        assert c.engine.calls[-1]["params"].prompt_logprobs == 0
        # One entry per prompt token, the first null, each keyed by token id.
        assert choice["prompt_logprobs"] == [None] + [
            {str(t): {"logprob": -1.0, "rank": 1, "decoded_token": f" tok{t}"}} for t in (6, 7)
        ]
        assert choice["text"] == expected_text(2)

        chat = {"messages": CHAT, "max_tokens": 2}
        out = (await c.post("/v1/chat/completions", json=chat)).json()
        assert "prompt_logprobs" in out and out["prompt_logprobs"] is None
        out = (await c.post("/v1/chat/completions", json={**chat, "prompt_logprobs": 1})).json()
        ids = c.engine.calls[-1]["prompt"].prompt_token_ids
        assert len(out["prompt_logprobs"]) == len(ids) and out["prompt_logprobs"][0] is None
        assert [list(e) for e in out["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]


@run
async def test_prompt_logprobs_stream_with_the_first_chunk_of_each_choice():
    async with client_for() as c:
        body = {"prompt": "tok5 tok6", "max_tokens": 3, "n": 2, "stream": True}
        events = sse_events(
            (await c.post("/v1/completions", json={**body, "prompt_logprobs": 0})).text
        )
        for i in range(2):
            mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
            assert mine[0]["prompt_logprobs"] == [
                None,
                {"6": {"logprob": -1.0, "rank": 1, "decoded_token": " tok6"}},
            ]
            assert all(ch["prompt_logprobs"] is None for ch in mine[1:])


@run
async def test_chat_streams_prompt_logprobs_once_with_the_first_output():
    async with client_for() as c:
        body = {"messages": CHAT, "max_tokens": 3, "stream": True}
        plain = sse_events((await c.post("/v1/chat/completions", json=body)).text)
        assert not any("prompt_logprobs" in e for e in plain)  # not asked: no key at all
        r = await c.post("/v1/chat/completions", json={**body, "prompt_logprobs": 0})
        events = sse_events(r.text)
        ids = c.engine.calls[-1]["prompt"].prompt_token_ids
        [(at, lps)] = [
            (k, e["prompt_logprobs"]) for k, e in enumerate(events) if "prompt_logprobs" in e
        ]
        assert at == 1 and events[at]["choices"][0]["delta"]["content"]  # the role chunk is 0
        assert len(lps) == len(ids) and lps[0] is None
        assert [list(e) for e in lps[1:]] == [[str(t)] for t in ids[1:]]
        unstreamed = (
            await c.post(
                "/v1/chat/completions", json={**body, "stream": False, "prompt_logprobs": 0}
            )
        ).json()
        assert unstreamed["prompt_logprobs"] == lps


@run
async def test_return_token_ids_on_chat_streamed_and_not():
    async with client_for() as c:
        body = {"messages": CHAT, "max_tokens": 2, "return_token_ids": True, "n": 2}
        out = (await c.post("/v1/chat/completions", json=body)).json()
        ids = c.engine.calls[-1]["prompt"].prompt_token_ids
        assert out["prompt_token_ids"] == ids
        assert [ch["token_ids"] for ch in out["choices"]] == [
            [token_id(i, k) for k in range(2)] for i in range(2)
        ]
        events = sse_events(
            (await c.post("/v1/chat/completions", json={**body, "stream": True})).text
        )
        # Each choice's role chunk has the prompt's ids; each output chunk its delta's.
        roles = [e for e in events if e["choices"][0]["delta"].get("role")]
        assert [e["prompt_token_ids"] for e in roles] == [ids, ids]
        for i in range(2):
            mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i][1:]
            assert [t for ch in mine for t in ch["token_ids"]] == [token_id(i, k) for k in range(2)]
        assert not any("prompt_token_ids" in e for e in events if e not in roles)
        # Not asked: null in the response, absent from chunks.
        out = (
            await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        ).json()
        assert out["prompt_token_ids"] is None and out["choices"][0]["token_ids"] is None
        events = sse_events(
            (
                await c.post(
                    "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "stream": True}
                )
            ).text
        )
        assert not any("prompt_token_ids" in e or "token_ids" in e["choices"][0] for e in events)


@run
async def test_echo_with_prompt_logprobs_asks_the_engine_for_the_larger_top_k():
    async with client_for() as c:
        body = {"prompt": [1, 2], "max_tokens": 1, "echo": True, "logprobs": 1}
        r = await c.post("/v1/completions", json={**body, "prompt_logprobs": 3})
        assert r.status_code == 200, r.text
        assert c.engine.calls[-1]["params"].prompt_logprobs == 3
        (choice,) = r.json()["choices"]
        assert choice["logprobs"]["top_logprobs"][0] is None
        assert len(choice["prompt_logprobs"]) == 2


# ---- truncate_prompt_tokens ----------------------------------------------------------------


@run
async def test_truncate_prompt_tokens_keeps_the_last_tokens():
    async with client_for() as c:
        ids = list(range(1, 9))
        r = await c.post(
            "/v1/completions",
            json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 3, "echo": True},
        )
        assert r.status_code == 200, r.text
        assert c.engine.calls[-1]["prompt"].prompt_token_ids == [6, 7, 8]
        assert r.json()["choices"][0]["text"].startswith(" tok6 tok7 tok8")
        assert r.json()["usage"]["prompt_tokens"] == 3
        body = {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 3}
        await c.post("/v1/completions", json={**body, "truncation_side": "right"})
        assert c.engine.calls[-1]["prompt"].prompt_token_ids == [1, 2, 3]
        # Shorter than the limit: untouched; -1 is the context length.
        await c.post("/v1/completions", json={**body, "truncate_prompt_tokens": 10})
        assert c.engine.calls[-1]["prompt"].prompt_token_ids == ids
        long = " ".join(["w"] * (MAX_MODEL_LEN + 10))
        r = await c.post(
            "/v1/completions",
            json={"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": MAX_MODEL_LEN - 1},
        )
        assert r.status_code == 200, r.text
        assert len(c.engine.calls[-1]["prompt"].prompt_token_ids) == MAX_MODEL_LEN - 1
        chat = {"messages": CHAT, "max_tokens": 1, "truncate_prompt_tokens": 2}
        assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200
        assert len(c.engine.calls[-1]["prompt"].prompt_token_ids) == 2


@run
async def test_truncate_prompt_tokens_out_of_bounds_is_a_400_naming_it():
    async with client_for() as c:
        for bad in (0, -2, MAX_MODEL_LEN + 1):
            body = {"prompt": "a b", "truncate_prompt_tokens": bad}
            r = await c.post("/v1/completions", json=body)
            assert (
                "truncate_prompt_tokens"
                in assert_error(r, 400, "truncate_prompt_tokens")["message"]
            )
        r = await c.post("/v1/completions", json={"prompt": "a", "truncation_side": "middle"})
        assert_error(r, 400, "truncation_side")
        assert c.engine.calls == []
        await ok_completion(c)


# ---- logprob tokens as ids -----------------------------------------------------------------


def test_top_logprobs_of_tokens_with_equal_text_keep_every_entry_as_token_ids():
    step = {5: Logprob(-0.5, 1, "a"), 6: Logprob(-1.5, 2, "a"), 7: Logprob(-2.5, 3, "b")}
    by_text = P.completion_logprobs([5], [step], 3, tokenizer=None)
    assert by_text.top_logprobs == [{"a": -0.5, "b": -2.5}]  # OpenAI's text keys collide
    by_id = P.completion_logprobs([5], [step], 3, tokenizer=None, as_ids=True)
    assert by_id.tokens == ["token_id:5"] and by_id.text_offset == [0]
    assert by_id.top_logprobs == [{"token_id:5": -0.5, "token_id:6": -1.5, "token_id:7": -2.5}]
    # The chosen token's entry comes first, even where it is not the likeliest (echo).
    steps = [{5: Logprob(-3.0, 4, "c"), 6: Logprob(-0.1, 1, "d")}]
    assert list(P.completion_logprobs([5], steps, 1, tokenizer=None).top_logprobs[0]) == ["c", "d"]
    chat = P.chat_logprobs([5], [step], 3, tokenizer=None, as_ids=True)
    (entry,) = chat.content or []
    assert entry.token == "token_id:5"
    assert [t.token for t in entry.top_logprobs] == ["token_id:5", "token_id:6", "token_id:7"]


@run
async def test_return_tokens_as_token_ids_over_http():
    async with client_for() as c:
        body = {"prompt": "p", "max_tokens": 2, "logprobs": 2, "return_tokens_as_token_ids": True}
        lp = (await c.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
        assert lp["tokens"] == ["token_id:10", "token_id:11"]
        assert lp["text_offset"] == [0, len(" tok10")]  # offsets still count the text
        chat = {
            "messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": 2,
            "return_tokens_as_token_ids": True,
        }  # fmt: skip
        content = (await c.post("/v1/chat/completions", json=chat)).json()["choices"][0]
        assert content["logprobs"]["content"][0]["token"] == "token_id:10"


# ---- usage ---------------------------------------------------------------------------------


class CachingEngine(FakeAsyncLLM):
    """Reports the first two prompt tokens as found in the prefix cache."""

    def _ro(self, rid, prompt, outs, done, params):
        out = super()._ro(rid, prompt, outs, done, params)
        out.num_cached_tokens = 2
        return out


@run
async def test_usage_reports_cached_prompt_tokens():
    async with client_for(CachingEngine()) as c:
        r = await c.post("/v1/completions", json={"prompt": ["a b c", "d e"], "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
        r = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
        body = {"messages": CHAT, "max_tokens": 2, "stream": True}
        body["stream_options"] = {"include_usage": True}
        events = sse_events((await c.post("/v1/chat/completions", json=body)).text)
        assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


@run
async def test_continuous_usage_only_with_include_usage():
    async with client_for() as c:
        for path, base in (
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": CHAT}),
        ):
            body = {**base, "max_tokens": 3, "stream": True}
            body["stream_options"] = {"include_usage": False, "continuous_usage_stats": True}
            events = sse_events((await c.post(path, json=body)).text)
            assert events and all(e["usage"] is None for e in events)
            body["stream_options"]["include_usage"] = True
            events = sse_events((await c.post(path, json=body)).text)
            assert all(e["usage"] is not None for e in events)
            assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3


# ---- grammar compiles ----------------------------------------------------------------------


@run
async def test_a_grammar_compile_does_not_hold_up_other_requests(monkeypatch):
    """The compile runs on a thread: a plain request is served while one is held."""
    entered, release = threading.Event(), threading.Event()
    real = serving.check_spec

    def held_check(spec, field):
        entered.set()
        release.wait(120)
        real(spec, field)

    monkeypatch.setattr(serving, "check_spec", held_check)
    try:
        async with client_for() as c:
            body = {"prompt": "a", "max_tokens": 2, "guided_regex": "tok[0-9]+"}
            structured = asyncio.ensure_future(c.post("/v1/completions", json=body))
            assert await wait_until_async(entered.is_set)
            await ok_completion(c)  # served while the compile is held
            assert not structured.done() and len(c.engine.calls) == 1
            release.set()
            r = await structured
            assert r.status_code == 200, r.text
            assert c.engine.calls[-1]["params"].structured_outputs.regex == "tok[0-9]+"
    finally:
        release.set()


@run
async def test_requests_with_the_same_spec_at_once_share_one_compile(monkeypatch):
    entered, release = threading.Event(), threading.Event()
    checks: list[str] = []
    real = serving.check_spec

    def held_check(spec, field):
        checks.append(field)
        entered.set()
        release.wait(120)
        real(spec, field)

    # Every request has reached check_grammar once it asked for its spec (no await between).
    asked = []
    spec_of = P.CompletionRequest.structured_spec

    def counted(self):
        asked.append(1)
        return spec_of(self)

    monkeypatch.setattr(serving, "check_spec", held_check)
    monkeypatch.setattr(P.CompletionRequest, "structured_spec", counted)
    try:
        async with client_for() as c:
            bodies = [{"prompt": "a", "max_tokens": 1, "guided_regex": "x+"}] * 3
            bodies.append({"prompt": "a", "max_tokens": 1, "guided_regex": "("})  # fails
            bodies.append({"prompt": "a", "max_tokens": 1, "guided_regex": "("})
            sent = [asyncio.ensure_future(c.post("/v1/completions", json=b)) for b in bodies]
            assert await wait_until_async(lambda: len(asked) == 5 and len(checks) == 2)
            release.set()
            codes = [(await r).status_code for r in sent]
            assert codes == [200, 200, 200, 400, 400]
            assert checks == ["guided_regex", "guided_regex"]  # one per distinct spec
            # Done: the next one checks again (a lookup in check_spec's memo).
            await c.post("/v1/completions", json=bodies[0])
            assert len(checks) == 3 and c.engine.calls[-1]["params"].structured_outputs
    finally:
        release.set()


@run
async def test_a_grammar_that_does_not_compile_is_still_a_400_naming_its_field():
    async with client_for() as c:
        r = await c.post("/v1/completions", json={"prompt": "a", "guided_regex": "a("})
        assert "guided_regex" in assert_error(r, 400, "guided_regex")["message"]
        assert c.engine.calls == []
        await ok_completion(c)


# ---- /tokenize and /detokenize -------------------------------------------------------------


class BosTokenizer(FakeTokenizer):
    """The fake's words, with BOS (id 1) first where special tokens are added."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + super().encode(text)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"<{i}>" for i in ids]


def _bos_engine() -> FakeAsyncLLM:
    engine = FakeAsyncLLM()
    engine.tokenizer = BosTokenizer()
    engine.input_processor.tokenizer = engine.tokenizer
    return engine


@run
async def test_tokenize_prompt_and_messages_then_detokenize():
    async with client_for(_bos_engine()) as c:
        r = await c.post("/tokenize", json={"prompt": "tok5 tok6", "model": SERVED})
        assert r.json() == {
            "count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": [1, 5, 6], "token_strs": None,
        }  # fmt: skip
        body = {"prompt": "tok5 tok6", "add_special_tokens": False, "return_token_strs": True}
        r = await c.post("/tokenize", json=body)
        assert r.json()["tokens"] == [5, 6] and r.json()["token_strs"] == ["<5>", "<6>"]

        # Messages: the prompt /v1/chat/completions would run, without special tokens.
        await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        chat_ids = c.engine.calls[-1]["prompt"].prompt_token_ids
        r = await c.post("/tokenize", json={"messages": CHAT})
        assert r.json()["tokens"] == chat_ids and chat_ids[0] != 1
        r = await c.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True})
        assert r.json()["tokens"] == [1, *chat_ids]
        r = await c.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False})
        assert r.json()["count"] == len(chat_ids) - 1  # no "<assistant>"

        r = await c.post("/detokenize", json={"tokens": [5, 6]})
        assert r.json() == {"prompt": " tok5 tok6"}
        assert c.engine.calls and len(c.engine.calls) == 1  # neither route generates


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/detokenize", {"tokens": [5, VOCAB]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
        ("/detokenize", {}, "tokens"),
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, None),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ],
)
@run
async def test_tokenize_routes_refuse_bad_input_and_keep_serving(path, body, param):
    async with client_for() as c:
        r = await c.post(path, json=body)
        assert_error(r, 404 if param == "model" else 400, param)
        assert (await c.post("/detokenize", json={"tokens": [7]})).json() == {"prompt": " tok7"}


# ---- /v1/responses -------------------------------------------------------------------------


def _sse_typed(body: str) -> list[dict]:
    """Responses events: ``event: <type>`` then ``data: <json>`` whose type matches."""
    events = []
    for block in body.split("\n\n")[:-1]:
        head, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


@run
async def test_responses_text_in_and_out():
    async with client_for() as c:
        body = {
            "model": SERVED,
            "input": "hello",
            "instructions": "be brief",
            "max_output_tokens": 3,
        }
        r = await c.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        # The prompt is the chat template's, instructions first as the system message.
        call = c.engine.calls[-1]
        assert call["prompt"].prompt == "<system> be brief <user> hello <assistant>"
        assert call["params"].max_tokens == 3
        assert out["object"] == "response" and out["id"].startswith("resp")
        assert out["status"] == "incomplete"  # the token limit cut it
        assert out["incomplete_details"] == {"reason": "max_output_tokens"}
        (msg,) = out["output"]
        assert msg["type"] == "message" and msg["role"] == "assistant"
        assert msg["status"] == "incomplete"
        assert msg["content"] == [
            {"type": "output_text", "text": expected_text(3), "annotations": [], "logprobs": []}
        ]
        n_prompt = len(call["prompt"].prompt_token_ids)
        assert out["usage"] == {
            "input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_prompt + 3,
        }  # fmt: skip
        assert out["instructions"] == "be brief" and out["max_output_tokens"] == 3

        # A message list with text parts; a stop string ends it: completed.
        body = {
            "input": [
                {"role": "user", "content": "one"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "two"}]},
                {"role": "user", "content": [{"type": "input_text", "text": "three"}]},
            ],
            "max_output_tokens": 5, "stop": "tok11", "temperature": 0.5, "top_p": 0.9,
        }  # fmt: skip
        out = (await c.post("/v1/responses", json=body)).json()
        call = c.engine.calls[-1]
        assert call["prompt"].prompt == "<user> one <assistant> two <user> three <assistant>"
        assert call["params"].temperature == 0.5 and call["params"].top_p == 0.9
        assert out["status"] == "completed" and out["incomplete_details"] is None
        assert out["output"][0]["content"][0]["text"] == " tok10 "


@run
async def test_responses_stream_event_sequence():
    async with client_for() as c:
        body = {"input": "hi", "max_output_tokens": 3, "stream": True}
        r = await c.post("/v1/responses", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse_typed(r.text)
        kinds = [e["type"] for e in events]
        assert kinds == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added", *["response.output_text.delta"] * 3,
            "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.incomplete",
        ]  # fmt: skip
        created, final = events[0]["response"], events[-1]["response"]
        assert created["status"] == "in_progress" and created["output"] == []
        assert created["id"] == final["id"]
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        assert "".join(deltas) == expected_text(3)
        item_id = events[2]["item"]["id"]
        assert all(e["item_id"] == item_id for e in events[3:-2])
        assert events[-4]["text"] == expected_text(3)
        assert final["output"][0]["content"][0]["text"] == expected_text(3)
        assert final["usage"]["output_tokens"] == 3

        body["stop"] = "tok11"
        events = _sse_typed((await c.post("/v1/responses", json=body)).text)
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["status"] == "completed"


@run
async def test_responses_text_format_is_a_structured_output():
    async with client_for() as c:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
        r = await c.post("/v1/responses", json={"input": "hi", "text": {"format": fmt}})
        assert r.status_code == 200, r.text
        spec = c.engine.calls[-1]["params"].structured_outputs
        assert json.loads(spec.json) == schema
        assert r.json()["text"]["format"]["schema"] == schema
        fmt = {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}
        r = await c.post("/v1/responses", json={"input": "hi", "text": {"format": fmt}})
        assert assert_error(r, 400, "text")["message"].startswith("text.format:")
        r = await c.post(
            "/v1/responses", json={"input": "hi", "text": {"format": {"type": "json_object"}}}
        )
        assert c.engine.calls[-1]["params"].structured_outputs.json_object


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "a", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "a", "tools": [{"type": "function", "name": "f"}]}, "tool_choice"),  # no parser
        ({"input": "a", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        (
            {
                "input": "a",
                "tool_choice": {"type": "function", "name": "g"},
                "tools": [{"type": "function", "name": "f"}],
            },
            "tool_choice",
        ),
        (
            {
                "input": "a",
                "tool_choice": "required",
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}],
            },
            "tools",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
        ({"input": "a", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "a", "background": True}, "background"),
        ({"input": "a", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "a", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"input": 5}, "input"),
        ({}, "input"),
        ({"input": "a", "model": "other"}, "model"),
    ],
)
@run
async def test_responses_refuse_what_they_cannot_serve(body, param):
    async with client_for() as c:
        r = await c.post("/v1/responses", json=body)
        assert_error(r, 404 if param == "model" else 400, param)
        assert c.engine.calls == []
        assert (
            await c.post("/v1/responses", json={"input": "a", "max_output_tokens": 1})
        ).status_code == 200


@run
async def test_return_token_ids_on_completions():
    async with client_for() as c:
        body = {"prompt": [5, 6, 7], "max_tokens": 2, "return_token_ids": True}
        (choice,) = (await c.post("/v1/completions", json=body)).json()["choices"]
        assert choice["prompt_token_ids"] == [5, 6, 7] and choice["token_ids"] == [10, 11]
        events = sse_events((await c.post("/v1/completions", json={**body, "stream": True})).text)
        assert [e["choices"][0]["prompt_token_ids"] for e in events] == [[5, 6, 7], None]
        assert [e["choices"][0]["token_ids"] for e in events] == [[10], [11]]
        (choice,) = (await c.post("/v1/completions", json={"prompt": "a"})).json()["choices"]
        assert choice["prompt_token_ids"] is None and choice["token_ids"] is None


def test_responses_request_becomes_a_chat_completion():
    req = ResponsesRequest.model_validate(
        {"input": [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}],
         "instructions": "i", "max_output_tokens": 7, "seed": 3, "tool_choice": "auto",
         "tools": [], "store": True, "text": {"format": {"type": "text"}}}
    )  # fmt: skip
    chat = req.to_chat()
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "i"), ("developer", "d"), ("user", "u"),
    ]  # fmt: skip
    assert chat.requested_max_tokens == 7 and chat.seed == 3
    assert chat.response_format is None and chat.structured_spec() is None
    fmt = {"type": "json_schema", "name": "n", "schema": {"type": "object"}}
    chat = ResponsesRequest.model_validate({"input": "x", "text": {"format": fmt}}).to_chat()
    assert chat.structured_spec() == (
        "response_format",
        StructuredOutputs(json='{"type": "object"}'),
    )
    with pytest.raises(ValueError, match="^text: format.schema is required"):
        ResponsesRequest.model_validate(
            {"input": "x", "text": {"format": {"type": "json_schema"}}}
        ).to_chat()


@run
async def test_the_api_key_protects_the_new_routes():
    async with client_for(api_key="sekret") as c:
        bodies = {"/tokenize": {"prompt": "a"}, "/detokenize": {"tokens": [5]},
                  "/v1/responses": {"input": "a", "max_output_tokens": 1}}  # fmt: skip
        for path, body in bodies.items():
            assert_error(await c.post(path, json=body), 401)
            ok = await c.post(path, json=body, headers={"Authorization": "Bearer sekret"})
            assert ok.status_code == 200, (path, ok.text)
        assert len(c.engine.calls) == 1


# ---- /v1/responses: function calls and reasoning ------------------------------------------


class ScriptedEngine(FakeAsyncLLM):
    """Writes ``script``, one piece per token, then stops; served with the hermes tool
    parser and deepseek_r1's reasoning split (every reply starts thinking)."""

    def __init__(self, script: list[str]) -> None:
        super().__init__()
        self.script = script
        parsers = dataclasses.replace(
            self.config.frontend, tool_call_parser="hermes", reasoning_parser="deepseek_r1"
        )
        self.config = dataclasses.replace(self.config, frontend=parsers)

    async def _outputs(self, prompt, params, request_id, kind):
        pieces = self.script[: params.max_tokens]
        cut = "length" if len(pieces) < len(self.script) else "stop"
        # One token per piece; "</think>" is the tokenizer's token for it (as the special
        # token of a real reasoning model), the others any ids.
        marker = self.tokenizer.encode("</think>")
        ids = [marker[0] if p == "</think>" else 10 + k for k, p in enumerate(pieces)]
        for k, piece in enumerate(pieces):
            await asyncio.sleep(0)
            done = k == len(pieces) - 1
            if kind is OutputKind.DELTA:
                outs = [CompletionOutput(0, piece, [ids[k]], None, None, cut if done else None)]
            elif done:
                outs = [CompletionOutput(0, "".join(pieces), ids, None, None, cut)]
            else:
                continue
            yield RequestOutput(request_id, prompt.prompt, prompt.prompt_token_ids, outs, done)


CALL_PIECES = ['<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
               "</tool_call>", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>']  # fmt: skip
SCRIPT = ["I should", " call it.", "</think>", "Sure.", *CALL_PIECES]
FLAT_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
    {"type": "function", "name": "add", "description": "adds", "strict": False},
]


def _items(output: list[dict]) -> list[tuple]:
    """The items without their generated ids."""
    out = []
    for item in output:
        match item["type"]:
            case "reasoning":
                out.append(("reasoning", [c["text"] for c in item["content"]], item["status"]))
            case "message":
                out.append(("message", [c["text"] for c in item["content"]], item["status"]))
            case "function_call":
                assert item["call_id"].startswith("call_") and item["id"].startswith("fc")
                out.append(("call", item["name"], item["arguments"], item["status"]))
    return out


@run
async def test_responses_reasoning_text_and_function_calls_streamed_and_not():
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    expected = [
        ("reasoning", ["I should call it."], "completed"),
        ("message", ["Sure."], "completed"),
        ("call", "get_weather", '{"city": "Paris"}', "completed"),
        ("call", "add", '{"a": 1}', "completed"),
    ]
    body = {"input": "weather?", "tools": FLAT_TOOLS, "max_output_tokens": 50}
    async with client_for(ScriptedEngine(SCRIPT)) as c:
        r = await c.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        Response.model_validate(out)  # the SDK's own type takes it
        assert _items(out["output"]) == expected and out["status"] == "completed"
        # The thinking's two tokens (not its end marker) are its reasoning tokens.
        assert out["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
        assert out["usage"]["output_tokens"] == len(SCRIPT)
        assert out["tools"] == [{"description": None, "strict": None, **FLAT_TOOLS[0]},
                                {"parameters": None, **FLAT_TOOLS[1]}]  # fmt: skip
        # The template saw the tools in chat's shape.
        assert c.engine.calls[-1]["params"].structured_outputs is None

        events = _sse_typed((await c.post("/v1/responses", json={**body, "stream": True})).text)
        adapter = TypeAdapter(ResponseStreamEvent)
        for e in events:
            adapter.validate_python(e)
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.completed"
        assert _items(final["output"]) == expected
        assert final["usage"] == out["usage"]
        # Each item: added, its deltas, done; one open at a time, indices in order.
        added = [(e["output_index"], e["item"]["type"]) for e in events
                 if e["type"] == "response.output_item.added"]  # fmt: skip
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert added == [
            (0, "reasoning"),
            (1, "message"),
            (2, "function_call"),
            (3, "function_call"),
        ]
        assert done == final["output"]
        args = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                and e["output_index"] == 2]  # fmt: skip
        assert "".join(args) == '{"city": "Paris"}'
        thinking = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
        assert "".join(thinking) == "I should call it."

        # Cut by the token limit inside a call: that call, and the response, are incomplete.
        cut = {**body, "max_output_tokens": 5}
        out = (await c.post("/v1/responses", json=cut)).json()
        assert out["status"] == "incomplete" and out["output"][-1]["status"] == "incomplete"
        events = _sse_typed((await c.post("/v1/responses", json={**cut, "stream": True})).text)
        assert _items(events[-1]["response"]["output"]) == _items(out["output"])


@run
async def test_responses_forced_calls_take_the_grammar_path():
    async with client_for(ScriptedEngine(['{"city": ', '"Rome"}'])) as c:
        body = {"input": "w?", "tools": FLAT_TOOLS, "parallel_tool_calls": False,
                "tool_choice": {"type": "function", "name": "get_weather"}}  # fmt: skip
        out = (await c.post("/v1/responses", json=body)).json()
        spec = c.engine.calls[-1]["params"].structured_outputs
        assert spec is not None and json.loads(spec.json) == {"type": "object"}
        assert out["tool_choice"] == body["tool_choice"] and out["parallel_tool_calls"] is False


def test_responses_input_items_become_chat_history():
    req = ResponsesRequest.model_validate({
        "input": [
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "P"}'},
            {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "1"}]},
            {"type": "function_call", "call_id": "call_3", "name": "add", "arguments": "{}"},
        ],
        "tools": FLAT_TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
    })  # fmt: skip
    chat = req.to_chat()
    msgs = [m.to_template_dict() for m in chat.messages]
    assert [(m["role"], m["content"]) for m in msgs] == [
        ("user", "weather?"), ("assistant", "Sure."), ("tool", "18C"), ("tool", "1"),
        ("assistant", ""),
    ]  # fmt: skip
    calls = [[(t["id"], t["function"]["name"], t["function"]["arguments"])
              for t in m.get("tool_calls", [])] for m in msgs]  # fmt: skip
    assert calls == [[], [("call_1", "get_weather", {"city": "P"}), ("call_2", "add", {"a": 1})],
                     [], [], [("call_3", "add", {})]]  # fmt: skip
    assert [m.get("tool_call_id") for m in msgs] == [None, None, "call_1", "call_2", None]
    assert [t.function.name for t in chat.tools or []] == ["get_weather", "add"]
    assert chat.tools[0].function.parameters == {"type": "object"}  # type: ignore[index]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    named = ResponsesRequest.model_validate(
        {"input": "x", "tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "add"}}
    ).to_chat()
    assert isinstance(named.tool_choice, P.NamedToolChoice)
    assert named.tool_choice.function.name == "add"
