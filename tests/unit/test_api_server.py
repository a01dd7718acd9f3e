"""The OpenAI-compatible API server against a fake engine (no processes, no model).

``FakeAsyncLLM`` implements the ``AsyncLLM`` interface the server uses: it generates
deterministic tokens (child ``c`` of a request emits ids ``10 + (10*c + k) % 90``, text
`` tok<id>``), applies stop strings, honours ``OutputKind``, reports stats to its loggers
and records every call and abort. Most tests drive the app in-process through
``httpx.ASGITransport``; disconnect and lifespan tests run a real uvicorn on port 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, Request

from tests.waiting import wait_until_async
from tidal.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tidal.dp_coordinator.state import CoordinatorState
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.outputs import CompletionOutput, Logprob, OutputKind, RequestOutput
from tidal.frontend.processor import InputProcessor, ProcessedPrompt
from tidal.launch.api_server import bind_socket, build_app, make_server
from tidal.launch.engine_args import EngineArgs
from tidal.launch.errors import classify_error
from tidal.protocol.errors import EngineDeadError, RequestFailedError
from tidal.protocol.messages import (
    STATS_DECODER,
    DPCoordinatorStats,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
    encode,
)
from tidal.protocol.topology import Topology
from tidal.sampling_params import SamplingParams

MAX_MODEL_LEN = 64
VOCAB = 1000
MODEL_PATH = "/models/fake-moe"
SERVED = "fake-moe"


class FakeTokenizer:
    """Whitespace words; ``tok<N>`` is id N, other words hash into [100, 1000)."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self._id(w) for w in text.split()]

    @staticmethod
    def _id(word: str) -> int:
        m = re.fullmatch(r"tok(\d+)", word)
        if m and int(m.group(1)) < VOCAB:
            return int(m.group(1))
        return 100 + sum(word.encode()) % (VOCAB - 100)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" tok{i}" for i in ids)

    def apply_chat_template(
        self,
        messages: list[dict],
        tokenize: bool,
        add_generation_prompt: bool,
        chat_template: Any,
        **kw: Any,
    ) -> str:
        if any(m["role"] not in ("system", "user", "assistant") for m in messages):
            raise RuntimeError("template: unknown role")  # like a template's raise_exception
        text = " ".join(f"<{m['role']}> {m['content']}" for m in messages)
        return text + (" <assistant>" if add_generation_prompt else "")


def token_id(child: int, k: int) -> int:
    return 10 + (10 * child + k) % 90


class FakeAsyncLLM:
    def __init__(self, max_model_len: int = MAX_MODEL_LEN, sampling_defaults: tuple = ()) -> None:
        hf = SimpleNamespace(vocab_size=VOCAB, eos_token_id=0)
        model = ModelConfig(
            MODEL_PATH, MODEL_PATH, "float32", max_model_len, 0, "FakeMoe", hf,
            sampling_defaults=sampling_defaults,
        )  # fmt: skip
        self.config = EngineConfig(model, CacheConfig(), SchedulerConfig(), ParallelConfig())
        self.tokenizer = FakeTokenizer()
        self.input_processor = InputProcessor(model, self.tokenizer)
        self.served_model_name = SERVED
        self.calls: list[dict] = []
        self.aborted: list[str] = []
        self.loggers: list[Any] = []
        self.dead = False
        self.hang_after: int | None = None  # tokens, then wait forever (until cancelled)
        self.die_after: int | None = None  # tokens, then raise EngineDeadError
        self.fail_after: int | None = None  # tokens, then raise self.failure
        self.failure: BaseException = RequestFailedError("?", "the engine failed it")
        self.fail_suffix: str | None = None  # requests whose id ends so fail at once
        self.shutdown_called = False
        self.scale_listeners: list[Any] = []
        self.history: list[dict] = []  # elastic EP operation records, oldest first
        self.scaling = False

    @property
    def is_dead(self) -> bool:
        return self.dead

    def add_stat_logger(self, logger: Any) -> None:
        self.loggers.append(logger)

    # Elastic EP: off here (ParallelConfig's default); tests/unit/test_scale_api.py has an
    # engine that scales.
    def add_scale_listener(self, callback: Any) -> None:
        self.scale_listeners.append(callback)

    def is_scaling_elastic_ep(self) -> bool:
        return self.scaling

    def scaling_history(self) -> list[dict]:
        return list(self.history)

    async def scale_elastic_ep(
        self, new_data_parallel_size: int, drain_timeout: float = 0.0, operation_id: Any = None
    ) -> tuple[int, dict]:
        raise ValueError("elastic EP is not enabled (--enable-elastic-ep)")

    async def get_stats(self) -> dict:
        return {
            "data_parallel_size": 1,
            "wave": 3,
            "engines_running": False,
            "ranks": [{"rank": 0}],
        }

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def shutdown(self) -> None:
        self.shutdown_called = True

    async def generate(
        self,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        request_id: str,
        *,
        output_kind: OutputKind = OutputKind.DELTA,
        data_parallel_rank: int | None = None,
    ):
        if self.dead:
            raise EngineDeadError("dead")
        self.input_processor.check(prompt, params)
        call = dict(prompt=prompt, params=params, request_id=request_id, kind=output_kind)
        self.calls.append({**call, "data_parallel_rank": data_parallel_rank})
        for lg in self.loggers:
            lg.record_scheduler_stats(0, SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25))
        finished = False
        try:
            async for out in self._outputs(prompt, params, request_id, output_kind):
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.aborted.append(request_id)

    async def _outputs(self, prompt, params, request_id, kind):
        children = [_Child(i) for i in range(params.n)]
        for k in range(params.max_tokens):
            if self.fail_suffix is not None and request_id.endswith(self.fail_suffix):
                raise self.failure
            if k == self.hang_after:
                await asyncio.Event().wait()
            if k == self.die_after:
                self.dead = True
                raise EngineDeadError("engine died mid-request")
            if k == self.fail_after:
                raise self.failure  # as AsyncLLM.generate does for an engine's error output
            deltas = [c.step(k, params) for c in children if c.finish is None]
            await asyncio.sleep(0)
            if not deltas:
                break
            done = all(c.finish is not None for c in children)
            first = k == 0
            if kind is OutputKind.DELTA:
                yield self._ro(request_id, prompt, deltas, done, params if first else None)
            elif kind is OutputKind.CUMULATIVE or done:
                full = [c.full() for c in children]
                yield self._ro(request_id, prompt, full, done, params)
            if done:
                self._finished(prompt, children)
                return

    def _ro(self, rid, prompt, outs, done, params):
        plp = None
        if params is not None and params.prompt_logprobs is not None:
            plp = [None] + [{t: Logprob(-1.0, 1, f" tok{t}")} for t in prompt.prompt_token_ids[1:]]
        return RequestOutput(
            rid, prompt.prompt, prompt.prompt_token_ids, outs, done, prompt_logprobs=plp
        )

    def _finished(self, prompt, children):
        gen = sum(len(c.ids) for c in children)
        for lg in self.loggers:
            lg.record_tokens(len(prompt.prompt_token_ids), gen)
            lg.record_request_finished(
                len(prompt.prompt_token_ids), gen, 0.01, 0.05, 0.002, children[0].finish
            )


class _Child:
    def __init__(self, index: int) -> None:
        self.index, self.ids, self.text, self.lps = index, [], "", []
        self.finish, self.stop_reason = None, None

    def step(self, k: int, params: SamplingParams) -> CompletionOutput:
        tok, before = token_id(self.index, k), len(self.text)
        self.ids.append(tok)
        self.text += f" tok{tok}"
        lp = None
        if params.logprobs is not None:
            # The chosen token first (rank 1), then the top-k by rank, deduplicated.
            step = {tok: Logprob(-0.5, 1, f" tok{tok}")}
            for j in range(2, params.logprobs + 1):
                step[500 + j] = Logprob(-0.5 - j, j, f" tok{500 + j}")
            self.lps.append(step)
            lp = [step]
        for s in params.stop:
            at = self.text.find(s)
            if at >= 0:
                self.text = self.text[: at + (len(s) if params.include_stop_str_in_output else 0)]
                self.finish, self.stop_reason = "stop", s
        if self.finish is None and len(self.ids) == params.max_tokens:
            self.finish = "length"
        new_text = self.text[before:]
        return CompletionOutput(
            self.index, new_text, [tok], None, lp, self.finish, self.stop_reason
        )

    def full(self) -> CompletionOutput:
        lps = self.lps if self.lps else None
        return CompletionOutput(
            self.index, self.text, list(self.ids), None, lps, self.finish, self.stop_reason
        )


def expected_text(n_tokens: int, child: int = 0) -> str:
    return "".join(f" tok{token_id(child, k)}" for k in range(n_tokens))


# ---- harness -------------------------------------------------------------------------------


def run(coro_fn):
    """Run an async test body against a fresh fake engine and app."""

    @functools.wraps(coro_fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(coro_fn(*args, **kwargs))

    return wrapper


@contextlib.asynccontextmanager
async def client_for(engine: FakeAsyncLLM | None = None, **app_kwargs):
    engine = engine or FakeAsyncLLM()
    app = build_app(engine, served_model_name=SERVED, **app_kwargs)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        client.engine = engine  # type: ignore[attr-defined]
        client.app = app  # type: ignore[attr-defined]
        yield client


def sse_events(body: str) -> list[Any]:
    """Parse an SSE body: every event is one ``data: ...`` line followed by a blank line."""
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    blocks = body.split("\n\n")
    assert blocks[-1] == ""
    events = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return events[:-1]


def assert_error(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


async def ok_completion(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected_text(2)


# ---- informational routes ------------------------------------------------------------------


@run
async def test_models_health_version_ping_stats():
    async with client_for() as c:
        models = (await c.get("/v1/models")).json()
        assert models["object"] == "list"
        (card,) = models["data"]
        assert card["id"] == SERVED and card["root"] == MODEL_PATH
        assert card["max_model_len"] == MAX_MODEL_LEN and card["object"] == "model"
        assert (await c.get(f"/v1/models/{SERVED}")).json()["id"] == SERVED
        assert_error(await c.get("/v1/models/other"), 404)
        assert (await c.get("/health")).json() == {"status": "ok"}
        assert (await c.get("/ping")).json() == {"status": "ok"}
        import tidal

        assert (await c.get("/version")).json() == {"version": tidal.__version__}
        stats = (await c.get("/stats")).json()
        assert stats == {
            **await c.engine.get_stats(),
            "scaling": {"is_scaling": False, "history": []},
            "faults": None,  # this fake has no fault_status (AsyncLLM's: test_scale_api)
            "tokens": {"prompt_total": 0, "generation_total": 0},
        }
        page = await c.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'fetch("/stats"' in page.text and "http" not in page.text.split("<script>")[1]
        # Rank deaths: the degraded banner, the death markers and recovery outlines.
        assert 'id="degraded"' in page.text and "s.faults" in page.text
        assert '"rank-death"' in page.text and "TRIGGER_OUTLINES" in page.text
        assert_error(await c.get("/no/such/route"), 404)
        wrong_method = assert_error(await c.get("/v1/completions"), 405)
        assert wrong_method["type"] == "invalid_request_error"  # the client's fault


# ---- completions ---------------------------------------------------------------------------


@run
async def test_completion_basic_usage_and_params():
    async with client_for() as c:
        body = {
            "model": SERVED,
            "prompt": "hello big world",
            "max_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 7,
            "top_k": 3,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [3, 4],
            "skip_special_tokens": False,
            "data_parallel_rank": 0,
            "unknown_future_field": 1,
        }
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "text_completion" and out["model"] == SERVED
        assert re.fullmatch(r"cmpl-[0-9a-f]{32}", out["id"]) and isinstance(out["created"], int)
        (choice,) = out["choices"]
        assert choice["index"] == 0 and choice["text"] == expected_text(5)
        assert choice["finish_reason"] == "length" and choice["logprobs"] is None
        assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}}
        (call,) = c.engine.calls
        p = call["params"]
        assert (p.temperature, p.top_p, p.seed, p.top_k, p.min_p) == (0.5, 0.9, 7, 3, 0.1)
        assert (p.repetition_penalty, p.min_tokens, p.ignore_eos) == (1.1, 2, True)
        assert p.stop_token_ids == [3, 4] and p.skip_special_tokens is False
        assert call["data_parallel_rank"] == 0 and call["request_id"] == out["id"]
        assert call["kind"] is OutputKind.FINAL_ONLY


@run
async def test_completion_model_path_and_default_max_tokens():
    async with client_for() as c:
        r = await c.post("/v1/completions", json={"model": MODEL_PATH, "prompt": "a b c d"})
        assert r.status_code == 200, r.text
        # No max_tokens: OpenAI's completions default of 16.
        assert c.engine.calls[0]["params"].max_tokens == 16
        assert r.json()["usage"]["completion_tokens"] == 16


@run
async def test_completion_n_and_batches_of_prompts():
    async with client_for() as c:
        r = await c.post(
            "/v1/completions", json={"prompt": ["one", "two three"], "n": 2, "max_tokens": 3}
        )
        out = r.json()
        assert [ch["index"] for ch in out["choices"]] == [0, 1, 2, 3]
        assert [ch["text"] for ch in out["choices"]] == [expected_text(3, i % 2) for i in range(4)]
        assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15, "prompt_tokens_details": {"cached_tokens": 0}}
        ids = [call["request_id"] for call in c.engine.calls]
        assert ids == [f"{out['id']}-0", f"{out['id']}-1"]
        # Token-id prompt, and a batch of token-id prompts.
        r = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1})
        assert c.engine.calls[-1]["prompt"].prompt_token_ids == [5, 6, 7]
        assert r.json()["usage"]["prompt_tokens"] == 3
        r = await c.post("/v1/completions", json={"prompt": [[5], [6, 7]], "max_tokens": 1})
        assert [call["prompt"].prompt_token_ids for call in c.engine.calls[-2:]] == [[5], [6, 7]]
        assert len(r.json()["choices"]) == 2


@run
async def test_completion_stream_chunks_done_and_usage():
    async with client_for() as c:
        body = {"prompt": "x y", "max_tokens": 4, "n": 2, "stream": True}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert all(e["object"] == "text_completion" and len(e["choices"]) == 1 for e in events)
        assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("cmpl-")
        for i in range(2):
            mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
            assert "".join(ch["text"] for ch in mine) == expected_text(4, i)
            assert [ch["finish_reason"] for ch in mine] == [None] * 3 + ["length"]
        assert all(e["usage"] is None for e in events)
        assert c.engine.calls[0]["kind"] is OutputKind.DELTA

        body = {**body, "n": 1, "stream_options": {"include_usage": True}}
        events = sse_events((await c.post("/v1/completions", json=body)).text)
        assert events[-1]["choices"] == []
        assert events[-1]["usage"] == {
            "prompt_tokens": 2,
            "completion_tokens": 4,
            "total_tokens": 6,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert all(e["usage"] is None for e in events[:-1])

        body["stream_options"]["continuous_usage_stats"] = True
        events = sse_events((await c.post("/v1/completions", json=body)).text)
        assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 3, 4, 4]


@run
async def test_unset_sampling_fields_take_the_checkpoints_recommendation():
    """As vLLM's --generation-config auto: what generation_config.json recommends fills
    the fields a request leaves unset (its max_new_tokens caps an unset max_tokens); a
    field the request sets, even to the usual default, wins."""
    defaults = (("max_tokens", 5), ("temperature", 0.6), ("top_k", 20), ("top_p", 0.95))
    async with client_for(FakeAsyncLLM(sampling_defaults=defaults)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": CHAT})
        assert r.status_code == 200, r.text
        p = c.engine.calls[-1]["params"]
        assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 20, 0.95, 5)
        assert (p.min_p, p.repetition_penalty) == (0.0, 1.0)  # not recommended: as before
        body = {"messages": CHAT, "temperature": 1.0, "top_k": -1, "max_tokens": 7}
        r = await c.post("/v1/chat/completions", json=body)
        p = c.engine.calls[-1]["params"]
        assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (1.0, 0, 0.95, 7)
        r = await c.post("/v1/completions", json={"prompt": "a"})  # OpenAI's 16 stays
        assert c.engine.calls[-1]["params"].max_tokens == 16
    async with client_for() as c:  # no recommendation: the usual defaults
        r = await c.post("/v1/chat/completions", json={"messages": CHAT})
        p = c.engine.calls[-1]["params"]
        assert (p.temperature, p.top_k, p.top_p) == (1.0, 0, 1.0)
        assert p.max_tokens == MAX_MODEL_LEN - len(c.engine.calls[-1]["prompt"].prompt_token_ids)


@run
async def test_values_of_unsupported_fields_that_ask_for_nothing_are_served():
    """What OpenAI clients send by default for features this server lacks (no tools, a
    tool_choice of "none", a text response format) is served as if absent."""
    async with client_for() as c:
        body = {
            "messages": CHAT, "max_tokens": 2, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "prompt_logprobs": None,
        }  # fmt: skip
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text


@run
async def test_completion_logprobs_shape():
    async with client_for() as c:
        r = await c.post("/v1/completions", json={"prompt": "p q", "max_tokens": 3, "logprobs": 2})
        (choice,) = r.json()["choices"]
        lp = choice["logprobs"]
        toks = [f" tok{token_id(0, k)}" for k in range(3)]
        assert lp["tokens"] == toks
        assert lp["token_logprobs"] == [-0.5] * 3
        assert lp["text_offset"] == [0, len(toks[0]), len(toks[0]) + len(toks[1])]
        assert lp["top_logprobs"] == [{t: -0.5, " tok502": -2.5} for t in toks]
        # Streaming: offsets continue across chunks.
        body = {"prompt": "p q", "max_tokens": 3, "logprobs": 1, "stream": True}
        events = sse_events((await c.post("/v1/completions", json=body)).text)
        offs = [e["choices"][0]["logprobs"]["text_offset"] for e in events]
        assert offs == [[0], [len(toks[0])], [len(toks[0]) + len(toks[1])]]
        assert all(len(e["choices"][0]["logprobs"]["top_logprobs"][0]) == 1 for e in events)


@run
async def test_completion_echo():
    async with client_for() as c:
        r = await c.post(
            "/v1/completions", json={"prompt": "tok1 tok2", "max_tokens": 2, "echo": True}
        )
        assert r.json()["choices"][0]["text"] == "tok1 tok2" + expected_text(2)
        body = {"prompt": [1, 2], "max_tokens": 2, "echo": True, "logprobs": 1}
        r = await c.post("/v1/completions", json=body)
        lp = r.json()["choices"][0]["logprobs"]
        assert c.engine.calls[-1]["params"].prompt_logprobs == 1
        assert lp["tokens"][:2] == [" tok1", " tok2"] and lp["token_logprobs"][:3] == [
            None,
            -1.0,
            -0.5,
        ]
        assert lp["top_logprobs"][0] is None
        events = sse_events((await c.post("/v1/completions", json={**body, "stream": True})).text)
        assert events[0]["choices"][0]["text"] == " tok1 tok2" + expected_text(1)
        assert events[1]["choices"][0]["text"] == expected_text(2)[len(expected_text(1)) :]


@run
async def test_stop_strings_pass_through():
    async with client_for() as c:
        stop = f" tok{token_id(0, 2)}"
        r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 8, "stop": stop})
        (choice,) = r.json()["choices"]
        assert c.engine.calls[-1]["params"].stop == [stop]
        assert choice["text"] == expected_text(2)
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
        body = {
            "prompt": "a",
            "max_tokens": 8,
            "stop": ["zzz", stop],
            "include_stop_str_in_output": True,
        }
        r = await c.post("/v1/completions", json=body)
        assert c.engine.calls[-1]["params"].stop == ["zzz", stop]
        assert r.json()["choices"][0]["text"] == expected_text(3)


# ---- chat ----------------------------------------------------------------------------------


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@run
async def test_chat_basic_and_template():
    async with client_for() as c:
        body = {"model": SERVED, "messages": CHAT, "max_tokens": 3, "seed": 1}
        r = await c.post("/v1/chat/completions", json=body)
        out = r.json()
        assert out["object"] == "chat.completion" and re.fullmatch(
            r"chatcmpl-[0-9a-f]{32}", out["id"]
        )
        (choice,) = out["choices"]
        assert choice["message"] == {"role": "assistant", "content": expected_text(3)}
        assert choice["finish_reason"] == "length"
        prompt = c.engine.calls[-1]["prompt"]
        assert prompt.prompt == "<system> be brief <user> hello <assistant>"
        assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}
        assert c.engine.calls[-1]["params"].seed == 1
        # max_completion_tokens wins over max_tokens; content parts are joined by newlines.
        parts = [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}],
            }
        ]
        body = {
            "messages": parts,
            "max_tokens": 9,
            "max_completion_tokens": 2,
            "add_generation_prompt": False,
        }
        r = await c.post("/v1/chat/completions", json=body)
        assert r.json()["usage"]["completion_tokens"] == 2
        assert c.engine.calls[-1]["prompt"].prompt == "<user> a \nb"


@run
async def test_chat_stream_roles_content_done_usage():
    async with client_for() as c:
        body = {
            "messages": CHAT,
            "max_tokens": 3,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = sse_events((await c.post("/v1/chat/completions", json=body)).text)
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        assert [e["choices"][0]["delta"] for e in events[:2]] == [
            {"role": "assistant", "content": ""}
        ] * 2
        for i in range(2):
            mine = [e["choices"][0] for e in events[2:-1] if e["choices"][0]["index"] == i]
            assert "".join(ch["delta"]["content"] for ch in mine) == expected_text(3, i)
            assert mine[-1]["finish_reason"] == "length"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6


@run
async def test_chat_logprobs_shape():
    async with client_for() as c:
        body = {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 3}
        (choice,) = (await c.post("/v1/chat/completions", json=body)).json()["choices"]
        content = choice["logprobs"]["content"]
        assert [e["token"] for e in content] == [f" tok{token_id(0, k)}" for k in range(2)]
        for e in content:
            assert e["logprob"] == -0.5 and e["bytes"] == list(e["token"].encode())
            assert [t["logprob"] for t in e["top_logprobs"]] == [-0.5, -2.5, -3.5]
            assert e["top_logprobs"][0]["token"] == e["token"]
        no_lp = (
            await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        ).json()
        assert no_lp["choices"][0]["logprobs"] is None
        body["stream"] = True
        events = sse_events((await c.post("/v1/chat/completions", json=body)).text)
        assert [len(e["choices"][0]["logprobs"]["content"]) for e in events[1:]] == [1, 1]


# ---- errors --------------------------------------------------------------------------------


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/v1/completions", {"prompt": "w " * MAX_MODEL_LEN}, 400, None),
    ("/v1/completions", {"prompt": "a b", "max_tokens": MAX_MODEL_LEN - 1}, 400, None),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": 123}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [VOCAB + 5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "data_parallel_rank": -1}, 400, "data_parallel_rank"),
    ("/v1/completions", {"prompt": "a", "stream": True, "max_tokens": 999}, 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
@run
async def test_bad_input_then_recovery(path, body, status, param):
    async with client_for() as c:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await c.post(path, content=content, headers={"content-type": "application/json"})
        err = assert_error(r, status, param)
        assert err["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
        assert c.engine.calls == []  # rejected before reaching the engine
        await ok_completion(c)


@run
async def test_api_key_protects_every_route():
    async with client_for(api_key="sekret") as c:
        for method, path in [
            ("GET", "/health"),
            ("GET", "/metrics"),
            ("GET", "/v1/models"),
            ("GET", "/stats"),
            ("GET", "/is_scaling_elastic_ep"),
            ("POST", "/is_scaling_elastic_ep"),
        ]:
            assert_error(await c.request(method, path), 401)
            assert_error(
                await c.request(method, path, headers={"Authorization": "Bearer nope"}), 401
            )
            good = await c.request(method, path, headers={"Authorization": "Bearer sekret"})
            assert good.status_code == 200, path
        r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert assert_error(r, 401)["type"] == "authentication_error"
        assert c.engine.calls == []
        c.headers["Authorization"] = "Bearer sekret"
        await ok_completion(c)


@run
async def test_extra_routers_are_served_and_protected():
    router = APIRouter()

    @router.get("/custom_admin")
    async def custom(request: Request) -> dict:
        return {"dead": request.app.state.engine.dead}

    async with client_for(api_key="k", routers=[router]) as c:
        assert_error(await c.get("/custom_admin"), 401)
        r = await c.get("/custom_admin", headers={"Authorization": "Bearer k"})
        assert r.json() == {"dead": False}


@run
async def test_dead_engine_gives_503():
    engine = FakeAsyncLLM()
    async with client_for(engine) as c:
        engine.die_after = 2
        r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 4})
        assert assert_error(r, 503)["type"] == "service_unavailable_error"
        assert_error(await c.get("/health"), 503)
        assert_error(await c.post("/v1/chat/completions", json={"messages": CHAT}), 503)
        engine.dead, engine.die_after = False, 1
        events = sse_events(
            (await c.post("/v1/completions", json={"prompt": "a", "stream": True})).text
        )
        assert events[0]["choices"][0]["text"] == expected_text(1)
        assert events[-1]["error"]["type"] == "service_unavailable_error"
        engine.dead, engine.die_after = False, None
        await ok_completion(c)


# ---- requests the engine refuses or fails -------------------------------------------------

REFUSED = "top_k must be -1 or 0 (disabled) or in [1, 1000] (the vocabulary), got 5000"
FAILED = "the engine failed sampling for this request: RuntimeError: boom"
# invalid, HTTP status, error type, param, code
ENGINE_ERRORS = [
    (True, 400, "invalid_request_error", "top_k", None),
    (False, 500, "server_error", None, "request_failed"),
]


@pytest.mark.parametrize(("invalid", "status", "kind", "param", "code"), ENGINE_ERRORS)
@run
async def test_engine_request_error_is_an_http_error(invalid, status, kind, param, code):
    engine = FakeAsyncLLM()
    msg = REFUSED if invalid else FAILED
    engine.failure = RequestFailedError("r", msg, invalid=invalid)
    want = {"message": msg, "type": kind, "param": param, "code": code}
    async with client_for(engine) as c:
        for path, body in [
            ("/v1/completions", {"prompt": "a", "max_tokens": 4}),
            ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 4, "n": 2}),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4}),
        ]:
            engine.fail_after = 0
            r = await c.post(path, json=body)
            assert assert_error(r, status, param) == want, path
            # Streaming: the status line is sent; the error is an event, then [DONE].
            engine.fail_after = 2
            events = sse_events((await c.post(path, json={**body, "stream": True})).text)
            assert events[-1] == {"error": want}, path
            finishes = [ch["finish_reason"] for e in events[:-1] for ch in e["choices"]]
            assert finishes and set(finishes) == {None}, path  # never a finish_reason "error"
        engine.fail_after = None
        await ok_completion(c)


@run
async def test_a_failed_prompt_of_a_batch_aborts_the_others():
    """A non-streamed batch whose one prompt fails answers the error, and the engine
    requests of its other prompts are aborted, not left generating for nobody."""
    engine = FakeAsyncLLM()
    engine.hang_after, engine.fail_suffix = 1, "-1"
    async with client_for(engine) as c:
        r = await c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 4})
        assert_error(r, 500, None)
        rid = engine.calls[0]["request_id"].rsplit("-", 1)[0]
        siblings = {f"{rid}-0", f"{rid}-2"}
        assert await wait_until_async(lambda: siblings <= set(engine.aborted), timeout_s=30)
        engine.hang_after = engine.fail_suffix = None
        await ok_completion(c)


class ErrorEngineClient:
    """An engine client for a real ``AsyncLLM``: the engine answers child ``0_*`` of a
    request with one token and every other (child) request with an error output, as
    ``EngineCoreProc`` does (``invalid``: refused at admission)."""

    dead_reason = None

    def __init__(self, message: str, invalid: bool) -> None:
        self.message, self.invalid = message, invalid
        self.topology = Topology.initial(1)  # AsyncLLM.fault_status (/metrics) reads it
        self.outputs: asyncio.Queue[EngineCoreOutputs] = asyncio.Queue()
        self.aborted: list[str] = []

    def add_request(self, req: EngineCoreRequest) -> None:
        rid = req.request_id
        if rid.startswith("0_"):
            out = EngineCoreOutput(rid, [5])
        else:
            out = EngineCoreOutput(
                rid,
                [],
                finish_reason=FinishReason.ERROR,
                stop_reason=self.message,
                invalid_request=self.invalid,
            )
        self.outputs.put_nowait(EngineCoreOutputs(outputs=[out]))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self.outputs.get()


@pytest.mark.parametrize(("invalid", "status", "kind", "param", "code"), ENGINE_ERRORS)
def test_async_llm_raises_for_an_engine_error_output(
    qwen3_ckpt, invalid, status, kind, param, code
):
    msg = REFUSED if invalid else FAILED
    want = {"message": msg, "type": kind, "param": param, "code": code}
    config = EngineArgs(model=qwen3_ckpt, device="cpu").create_engine_config()

    async def body() -> None:
        client = ErrorEngineClient(msg, invalid)
        engine = AsyncLLM(config, client=client)
        with pytest.raises(RequestFailedError) as e:
            async for _ in engine.generate(ProcessedPrompt(None, [5, 6]), SamplingParams(n=3)):
                pass
        assert (str(e.value), e.value.invalid) == (msg, invalid)
        rid = e.value.request_id
        assert client.aborted == [f"0_{rid}", f"2_{rid}"]  # child 1 failed: its siblings go
        app = build_app(engine, served_model_name=SERVED, shutdown_engine=False)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"prompt": [5, 6]})
            assert assert_error(r, status, param) == want
            r = await c.post("/v1/completions", json={"prompt": [5, 6], "n": 2, "stream": True})
            assert sse_events(r.text)[-1] == {"error": want}
            text = (await c.get("/metrics")).text
            assert 'tidal:request_success_total{finished_reason="error"} 2.0' in text
        assert not engine.output_processor.has_unfinished()
        if engine._handler is not None:
            engine._handler.cancel()

    asyncio.run(body())


class StatsEngineClient:
    """An engine client for a real ``AsyncLLM``'s ``/stats``: engines ``0..n-1`` and, with
    ``coordinator``, the DP coordinator's stats (over the wire, as ``get_dp_stats_async``)."""

    dead_reason = None

    def __init__(self, n: int, coordinator: CoordinatorState | None) -> None:
        self.topology = Topology.initial(n)
        self.coordinator = coordinator

    async def get_dp_stats_async(self, timeout_s: float = 2.0) -> DPCoordinatorStats:
        assert self.coordinator is not None
        return STATS_DECODER.decode(encode(self.coordinator.full_stats(2.0)))

    async def call_utility_all_async(self, method: str, *args: object) -> list:
        # /stats on CPU: no engine measured anything here, nor allocated a cache
        assert method in ("get_cpu_kernels", "get_kv_cache_info", "get_graph_stats")
        return [None] * len(self.topology.engine_ids)


@pytest.mark.parametrize("dp", [False, True], ids=["one-engine", "dp-coordinator"])
def test_stats_rows_carry_per_rank_generation_tokens(qwen3_ckpt, dp):
    """Each engine's cumulative ``num_generation_tokens_total`` becomes its ``/stats`` row's
    ``generation_tokens_total`` (the dashboard's per-rank tokens/s), with or without DP."""
    config = EngineArgs(model=qwen3_ckpt, device="cpu").create_engine_config()
    reports = [
        SchedulerStats(num_running_reqs=2, num_requests_total=3, num_generation_tokens_total=40),
        SchedulerStats(num_running_reqs=1, num_requests_total=1, num_generation_tokens_total=7),
    ][: 2 if dp else 1]
    coordinator = CoordinatorState(len(reports)) if dp else None

    async def body() -> None:
        engine = AsyncLLM(config, client=StatsEngineClient(len(reports), coordinator))
        for e, s in enumerate(reports):
            out = EngineCoreOutputs(engine_id=e, scheduler_stats=s)
            if coordinator is not None:
                coordinator.handle(out, 1.0)
            else:
                engine._handle(out)  # as its output handler does
        app = build_app(engine, served_model_name=SERVED, shutdown_engine=False)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            stats = (await c.get("/stats")).json()
            # AsyncLLM.fault_status without elastic EP: nothing died, every engine serves.
            assert (await c.get("/health")).json() == {"status": "ok"}
        ranks = stats["ranks"]
        assert stats["faults"]["degraded"] is None and stats["faults"]["deaths"] == []
        assert stats["faults"]["serving_engines"] == len(reports)
        got = [(r["engine_id"], r["requests_total"], r["generation_tokens_total"]) for r in ranks]
        assert got == [(0, 3, 40), (1, 1, 7)][: len(reports)]

    asyncio.run(body())


# ---- metrics -------------------------------------------------------------------------------


@run
async def test_metrics_after_requests():
    async with client_for() as c:
        await ok_completion(c)
        await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 8, "stop": " tok11"})
        text = (await c.get("/metrics")).text
        assert 'tidal:request_success_total{finished_reason="length"} 1.0' in text
        assert 'tidal:request_success_total{finished_reason="stop"} 1.0' in text
        assert 'tidal:num_requests_running{engine="0"} 1.0' in text
        assert 'tidal:num_requests_waiting{engine="0"} 0.0' in text
        assert 'tidal:kv_cache_usage_perc{engine="0"} 0.25' in text
        assert "tidal:prompt_tokens_total 3.0" in text  # "hi there" + "a"
        assert "tidal:generation_tokens_total 4.0" in text  # 2 + 2 (stopped)
        for name in (
            "time_to_first_token_seconds",
            "time_per_output_token_seconds",
            "e2e_request_latency_seconds",
        ):
            assert f"tidal:{name}_count 2.0" in text
        assert 'vllm:num_requests_running{engine="0",model_name="fake-moe"} 1.0' in text
        # A removed engine's gauges disappear (elastic scale-down); its counters stay, as
        # a gone source's do for rate().
        c.app.state.metrics.forget_engine(0)
        text = (await c.get("/metrics")).text
        assert engine_gauges(text, "0") == [] and "tidal:request_success_total" in text
        assert 'vllm:request_success_total{engine="0",finished_reason="stop"' in text


_ENGINE_GAUGES = tuple(
    f"{prefix}:{name}{{"
    for prefix in ("tidal", "vllm")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
)


def engine_gauges(text: str, engine: str) -> list[str]:
    """The per-engine gauge samples of ``engine`` in a /metrics text (a removed engine has
    none; its counters stay)."""
    return [
        line
        for line in text.splitlines()
        if line.startswith(_ENGINE_GAUGES) and f'engine="{engine}"' in line
    ]


# ---- real uvicorn: disconnects, lifespan, benchmark ------------------------------------------


@contextlib.asynccontextmanager
async def live_server(engine: FakeAsyncLLM, **app_kwargs: Any):
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = build_app(engine, served_model_name=SERVED, **app_kwargs)
    server = make_server(app, log_level="warning")
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await wait_for(lambda: server.started or task.done())
        assert server.started, "server failed to start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)
        sock.close()


async def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@run
async def test_client_disconnect_aborts_and_lifespan_shuts_engine_down():
    engine = FakeAsyncLLM()
    engine.hang_after = 1
    async with live_server(engine) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
        body = {"prompt": "a", "max_tokens": 10, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            first = await r.aiter_lines().__anext__()
            assert json.loads(first[len("data: ") :])["choices"][0]["text"] == expected_text(1)
        await wait_for(lambda: engine.aborted == [engine.calls[0]["request_id"]])

        req = asyncio.ensure_future(c.post("/v1/chat/completions", json={"messages": CHAT}))
        await wait_for(lambda: len(engine.calls) == 2)
        req.cancel()  # closes the connection
        await wait_for(lambda: engine.aborted[-1:] == [engine.calls[1]["request_id"]])

        engine.hang_after = None
        r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == expected_text(2)
        assert not engine.shutdown_called
    assert engine.shutdown_called
    assert len(engine.aborted) == 2


def _load_benchmark():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = mod
    spec.loader.exec_module(mod)
    return mod


@run
async def test_serving_benchmark_load_generator():
    bench = _load_benchmark()
    engine = FakeAsyncLLM()
    async with live_server(engine) as url:
        summary = await bench.run_benchmark(
            url, num_requests=6, concurrency=3, prompt_len=5, max_tokens=4, warmup=1
        )
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["output_tokens"] == 24
    assert len(engine.calls) == 7  # + warmup
    assert all(len(call["prompt"].prompt_token_ids) == 5 for call in engine.calls)
    assert all(call["params"].ignore_eos for call in engine.calls)
    assert summary["req_per_s"] > 0 and summary["ttft_ms"]["p50"] is not None
    assert (
        summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
        and summary["tpot_ms"]["p90"] is not None
    )
    assert bench._percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_engine_dead_error_is_a_503():
    alive = SimpleNamespace(is_dead=False)  # the engine died in this request only
    err = classify_error(EngineDeadError("gone"), alive)
    assert (err.status, err.code) == (503, "engine_dead")
    assert classify_error(RuntimeError("x"), alive).status == 500


def test_serving_ratios_say_when_inter_token_latencies_compare():
    """aiperf's inter-token latency is (latency - TTFT) / (tokens - 1): a server that
    sends most of an answer in one chunk shows a small one. The ratios carry the request
    latency, and say whether both streamed about a token a chunk."""
    bench = _load_benchmark()

    def side(tpc: float, latency: float) -> dict:
        return {
            "output_tok_per_s": 100.0,
            "ttft_ms": {"avg": 50.0, "p50": 40.0},
            "tpot_ms": {"avg": 10.0, "p50": 10.0},
            "request_latency_ms": {"avg": latency, "p50": latency},
            "tokens_per_chunk": tpc,
        }

    out = bench._ratios(side(1.2, 500.0), side(40.0, 1000.0))
    assert out["request_latency_avg"] == 0.5 and out["tpot_comparable"] is False
    assert bench._ratios(side(1.2, 500.0), side(1.0, 1000.0))["tpot_comparable"] is True


def test_serving_benchmark_serves_both_sides_in_the_checkpoints_dtype(tmp_path, monkeypatch):
    """vLLM-CPU's ``auto`` serves a float32 checkpoint in bf16: the benchmark names one
    dtype to both servers, by default the one the checkpoint's config.json names."""
    bench = _load_benchmark()
    assert bench.checkpoint_dtype(str(tmp_path)) == "float32"  # no config.json
    assert bench.checkpoint_dtype("acme/tiny-moe") is None  # a hub id: each server's default
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert bench.checkpoint_dtype(str(tmp_path)) == "bfloat16"
    (tmp_path / "config.json").write_text('{"dtype": "float16"}')
    assert bench.checkpoint_dtype(str(tmp_path)) == "float16"
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    assert bench.checkpoint_dtype(str(tmp_path)) == "float32"
    started: list[list[str]] = []
    monkeypatch.setattr(
        bench, "launched_server", lambda cmd, *a, **k: started.append(cmd) or contextlib.nullcontext()
    )
    for vllm in ("/venv/bin/python", None):  # vLLM, then Tidal (this tree) as the peer
        args = SimpleNamespace(
            vllm_python=vllm, dtype="bfloat16", launch_timeout=1.0, peer_ref=".",
            launch_args="", peer_launch_args=None, api_key=None,
        )  # fmt: skip
        with bench.peer_server(args, str(tmp_path)) as (_info, launch):
            with launch():
                pass
        cmd = started[-1]
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16", cmd
