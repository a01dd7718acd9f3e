"""The real server (``launch`` in a subprocess) driven by the real ``openai`` client."""

from __future__ import annotations

import glob
import json
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.server_utils import RemoteServer, is_alive
from tidal import LLM, SamplingParams

MODEL_NAME = "tiny-moe"
PROMPTS = ["The tide comes in", "Mixture of experts", "Hello world, this is a longer prompt"]


@pytest.fixture(scope="module")
def server(qwen3_ckpt):
    srv = RemoteServer(
        [
            "--model",
            qwen3_ckpt,
            "--served-model-name",
            MODEL_NAME,
            "--dtype",
            "float32",
            "--log-level",
            "warning",
        ]
    )
    yield srv
    srv.stop()
    assert srv.leftover_processes() == []


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, dtype="float32", multiprocess=False)
    yield llm
    llm.shutdown()


def _metric(server, name: str, default: float | None = None) -> float:
    """The sum of a metric's samples; ``default`` when it has none (a labelled counter
    never incremented), else that is an error."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    vals = [
        float(m)
        for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    ]
    if not vals and default is not None:
        return default
    assert vals, f"{name} not in /metrics"
    return sum(vals)


def test_completion_greedy_equals_offline(client, offline):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = offline.generate(PROMPTS, params, use_tqdm=False)
    for prompt, exp in zip(PROMPTS, expected):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == exp.outputs[0].text
        assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert r.usage.completion_tokens == len(exp.outputs[0].token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]


def test_chat_stream_and_non_stream(client, offline):
    messages = [{"role": "user", "content": "Tell me about tides"}]
    exp = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0
    )
    assert r.choices[0].message.content == exp.outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == exp.outputs[0].text


def test_n_and_seed(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # each choice its own draw
    assert a.usage.completion_tokens == 24


def test_stop_string(client):
    full = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0
    )
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop string from {text!r}"
    r = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_logprobs(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        # Keys are token strings, so byte-fallback tokens that decode alike may collide.
        assert tok_lp <= 0 and 1 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) <= tok_lp + 1e-5
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)


def test_models_route(client, qwen3_ckpt):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


BAD_REQUESTS = [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x " * 5000, "max_tokens": 4}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "temperature": -1}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 0}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "top_p": 2}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "data_parallel_rank": 5}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [99999999]}, 400),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": "not a list"}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD_REQUESTS)
def test_bad_input_then_good(server, path, body, status):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"]
    ok = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": "still alive", "max_tokens": 2},
        timeout=30,
    )
    assert ok.status_code == 200


def test_malformed_json(server):
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["message"]


# Far more tokens than a test waits for (the context of ``qwen3_long_ckpt`` is 131072):
# a request for this many, with ignore_eos, is still running when the test acts on it.
LONG_MAX_TOKENS = 130_000


def _events(lines: Iterator[str]) -> Iterator[dict | str]:
    """The server-sent events of a stream: decoded JSON, or the string ``[DONE]``."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


def _start_long_stream(events: Iterator[dict | str]) -> dict:
    """The first event of a ``LONG_MAX_TOKENS`` stream: one token, request still running."""
    first = next(events)
    assert isinstance(first, dict) and "error" not in first, first
    (choice,) = first["choices"]
    assert choice["finish_reason"] is None
    return first


def _long_stream(server: RemoteServer):
    body = {
        "prompt": "x",
        "max_tokens": LONG_MAX_TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    return httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120)


def _wait_until(cond, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}"
        time.sleep(0.2)


def test_disconnect_aborts_and_frees_blocks(qwen3_long_ckpt):
    srv = RemoteServer(["--model", qwen3_long_ckpt, "--log-level", "warning"])
    try:
        with _long_stream(srv) as r:
            assert r.status_code == 200
            events = _events(r.iter_lines())  # referenced: dropping it closes the stream
            _start_long_stream(events)
            # A step's stats reach /metrics before its tokens reach the stream, and the
            # request cannot have finished: it must show as running, holding KV blocks.
            assert _metric(srv, "tidal:num_requests_running") == 1
            assert _metric(srv, "tidal:kv_cache_usage_perc") > 0
            events.close()
        # Connection closed mid-stream: the request must be aborted and its blocks freed.
        _wait_until(
            lambda: (
                _metric(srv, "tidal:num_requests_running") == 0
                and _metric(srv, "tidal:kv_cache_usage_perc") == 0
            ),
            "no request running and every KV block free",
        )
        # Aborted, not finished: no request completed (it would need minutes).
        assert _metric(srv, "tidal:request_success_total", default=0.0) == 0
    finally:
        srv.stop()
    assert srv.leftover_processes() == []


def test_engine_death_fails_fast(qwen3_long_ckpt):
    srv = RemoteServer(["--model", qwen3_long_ckpt, "--log-level", "warning"])
    try:
        (engine,) = srv.engine_processes()
        # The read timeout is the deadline: a stream the server never ends fails the test.
        with _long_stream(srv) as r:
            assert r.status_code == 200
            events = _events(r.iter_lines())
            _start_long_stream(events)
            engine.kill()  # SIGKILL while the request is running (it needs minutes)
            rest = list(events)
        assert rest and rest[-1] == "[DONE]", rest[-3:]
        errors = [e["error"] for e in rest if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1, rest[-3:]
        assert errors[0]["code"] == "engine_dead" and "engine is dead" in errors[0]["message"]
        finishes = [c["finish_reason"] for e in rest[:-1] if "choices" in e for c in e["choices"]]
        assert not any(finishes), finishes  # the request never completed
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 503
        after = httpx.post(
            srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30
        )
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"
    finally:
        srv.stop()
    assert srv.leftover_processes() == []


def test_sigterm_leaves_nothing(qwen3_ckpt, tmp_path):
    # A private TMPDIR: only this server's files can appear there (not a concurrent run's).
    tmp = str(tmp_path)
    srv = RemoteServer(["--model", qwen3_ckpt, "--log-level", "warning"], env={"TMPDIR": tmp})
    assert srv.engine_processes(), "expected an engine process"
    assert glob.glob(f"{tmp}/tidal-*"), "expected the server's IPC directory in its TMPDIR"
    code = srv.stop()
    assert code in (0, -15, 143), code
    assert srv.leftover_processes() == []
    assert glob.glob(f"{tmp}/tidal-*") == []


def test_engines_exit_when_launcher_is_killed(qwen3_ckpt):
    srv = RemoteServer(["--model", qwen3_ckpt, "--log-level", "warning"])
    engines = srv.engine_processes()
    assert engines
    srv.proc.kill()  # SIGKILL: no chance to clean up
    srv.proc.wait(30)
    try:
        _wait_until(
            lambda: not any(is_alive(p) for p in engines), "the engines exit after the launcher"
        )
    finally:
        for p in engines:  # only if the test failed: none of them may outlive it
            if is_alive(p):
                p.kill()
        srv.stop()
