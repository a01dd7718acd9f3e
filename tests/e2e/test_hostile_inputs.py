"""No input takes a ``launch --dp 2 --ep`` deployment down (issue 9).

One server for the whole module: every hostile value a new user might send gets a 4xx with
a message (or a 200 where the value is legal), and afterwards every rank still serves.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.server_utils import RemoteServer

VOCAB = 512  # tests/conftest.py TINY_KWARGS
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(qwen3_ckpt: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(
        ["--model", qwen3_ckpt, "--dp", "2", "--ep", "--max-model-len", "256"]
        + ["--log-level", "warning"]
    )
    try:
        yield srv
    finally:
        srv.stop()
    assert srv.leftover_processes() == []


def _nested(depth: int) -> bytes:
    return b'{"prompt": "a", "user": ' + b"[" * depth + b"]" * depth + b"}"


C, CH = "/v1/completions", "/v1/chat/completions"
# (path, body: JSON-able or raw bytes, expected status, param the error names, fragment)
HOSTILE: list[tuple[str, Any, int, str | None, str]] = [
    # The values.
    (C, {"prompt": "a", "top_k": 2**63}, 400, "top_k", "64 bits"),
    (C, {"prompt": "a", "top_k": 2**64 + 1}, 400, "top_k", "64 bits"),
    (C, {"prompt": "a", "n": 1_000_000}, 400, "n", "--max-n"),
    (C, _nested(100_000), 400, None, "nested deeper"),
    (C, b'{"prompt": "caf\xe9"}', 400, None, "UTF-8"),
    (C, b'{"prompt": "a", "temperature": NaN}', 400, None, "NaN"),
    (CH, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "role"),
    (CH, {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template", "--trust-request-chat-template"),
    # Out of range before the issue, still refused.
    (C, {"prompt": "a", "top_k": VOCAB + 1}, 400, "top_k", "vocabulary"),
    (C, {"prompt": "a", "seed": 2**64}, 400, "seed", "64 bits"),
    (C, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    (C, {"prompt": "a", "max_tokens": 10_000}, 400, None, "context length"),
    (C, {"prompt": "a", "min_tokens": -1}, 400, "min_tokens", ">= 0"),
    (C, {"prompt": "a", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens", "max_tokens"),
    (C, {"prompt": "a", "logprobs": 21}, 400, "logprobs", "--max-logprobs"),
    (C, {"prompt": [5, VOCAB]}, 400, "prompt", "vocab size"),
    (C, {"prompt": [5, -1]}, 400, "prompt", "vocab size"),
    (C, {"prompt": "a", "logit_bias": {str(VOCAB + 7): 1.0}}, 400, "logit_bias", "not supported"),
    (C, {"prompt": "a", "stop_token_ids": [VOCAB]}, 400, "stop_token_ids", "vocab"),
    (C, {"prompt": "a", "stop_token_ids": [-1]}, 400, "stop_token_ids", ">= 0"),
    (C, {"prompt": "a", "frequency_penalty": 2.5}, 400, "frequency_penalty", "2.0"),
    (C, {"prompt": "a", "presence_penalty": -3}, 400, "presence_penalty", "-2.0"),
    (C, {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty", "> 0"),
    (C, {"prompt": "a", "temperature": -0.5}, 400, "temperature", ">= 0"),
    (C, {"prompt": "a", "top_p": 0}, 400, "top_p", "> 0"),
    (C, {"prompt": "a", "data_parallel_rank": 2}, 400, "data_parallel_rank", "[0, 2)"),
    # Legal edges are served.
    (C, {"prompt": "a", "max_tokens": 3, "top_k": -1, "temperature": 0.9}, 200, None, ""),
    (C, {"prompt": "a", "max_tokens": 3, "top_k": VOCAB, "temperature": 0.9}, 200, None, ""),
    (C, {"prompt": "a", "max_tokens": 3, "n": 2, "seed": 2**63 - 1, "temperature": 1.0}, 200, None, ""),
    (C, {"prompt": "a", "max_tokens": 3, "seed": -(2**63), "temperature": 1.0}, 200, None, ""),
    (CH, {"messages": [{"role": "developer", "content": "be brief"}, *CHAT], "max_tokens": 3}, 200, None, ""),
]  # fmt: skip


def _case_id(case: tuple) -> str:
    path, body, status, param, _ = case
    if isinstance(body, bytes):
        return f"{status}-raw-{body[:24].decode('ascii', 'replace')}"
    fields = ",".join(f"{k}={str(v)[:24]}" for k, v in body.items() if k not in ("prompt",))
    return f"{status}-{path.rsplit('/', 1)[-1]}-{fields or body.get('prompt')}"


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "fragment"), HOSTILE, ids=[_case_id(c) for c in HOSTILE]
)
def test_hostile_value(server, path, body, status, param, fragment):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        server.url + path,
        content=content,
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert r.status_code == status, r.text[:500]
    if status == 200:
        assert r.json()["choices"], r.text
        return
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error", err
    assert err["param"] == param, err


def test_64mb_body_refused_unread(server):
    """Refused on its Content-Length, before a byte of it is parsed (a 413, not a reset:
    the server drains what it did not read)."""
    body = b'{"prompt": "a", "max_tokens": 4, "x": "' + b"y" * (64 << 20) + b'"}'
    r = httpx.post(server.url + C, content=body, timeout=120)
    assert r.status_code == 413, r.text[:500]
    err = r.json()["error"]
    assert "--max-request-body-bytes" in err["message"] and err["code"] == "request_too_large"


def test_every_rank_still_serves(server):
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert len(server.engine_processes()) == 2
    texts = []
    for rank in (0, 1):
        body = {"prompt": "The tide comes in", "max_tokens": 6, "temperature": 0}
        r = httpx.post(
            server.url + "/v1/completions", json={**body, "data_parallel_rank": rank}, timeout=120
        )
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["finish_reason"] == "length"
        texts.append(choice["text"])
    assert texts[0] == texts[1]  # greedy: the same on every rank
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4})
    assert r.status_code == 200, r.text
