"""No input takes a ``launch --dp 2 --ep --enable-elastic-ep --host 127.0.0.1``
deployment down, and neither a web page nor the network reaches what it should not
(issues 9 and 23).

One server for the whole module, with no API key (the configuration a new user starts
with): every hostile value gets a 4xx with a message (or a 200 where the value is legal);
the requests a web page could send (huge stop lists, the largest fan-out, ``text/plain``
POSTs to every JSON route, a foreign ``Host``) are refused and nothing scales; every rank
still serves the same greedy text; and no process of the deployment listens outside
loopback, before, during or after a scale operation. The last test scales (2 -> 3 -> 2),
so it runs last.
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from tests.e2e.server_utils import RemoteServer
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(600)

VOCAB = 512  # tests/conftest.py TINY_KWARGS
CHAT = [{"role": "user", "content": "hello"}]
GREEDY = {"prompt": "The tide comes in", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def server(qwen3_ckpt: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(
        ["--model", qwen3_ckpt, "--dp", "2", "--ep", "--enable-elastic-ep", "--host", "127.0.0.1"]
        + ["--max-model-len", "256", "--log-level", "warning"],
        env={"TIDAL_API_KEY": None},
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
    (C, rb'{"prompt": "a\ud800b"}', 400, "prompt", "lone surrogate"),
    (C, rb'{"model": "\udfff", "prompt": "a"}', 400, "model", "lone surrogate"),
    (CH, rb'{"messages": [{"role": "user", "content": "\udc00"}]}', 400, "messages", "lone surrogate"),
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
    (C, {"prompt": "a", "logit_bias": {str(VOCAB + 7): 1.0}}, 400, "logit_bias", "vocab size"),
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


# ---- what a web page (or a careless client) could send: issue 23 --------------------------

SCALE = "/scale_elastic_ep"
JSON_ROUTES = {
    C: {"prompt": "a", "max_tokens": 2},
    CH: {"messages": CHAT, "max_tokens": 2},
    SCALE: {"new_data_parallel_size": 3},
}
# (body, param, fragment): refused on their size, before anything walks the body.
TOO_BIG: list[tuple[dict, str, str]] = [
    ({"prompt": "a", "stop_token_ids": [i % VOCAB for i in range(1_500_000)]}, "stop_token_ids", "--max-stop-token-ids"),
    ({"prompt": "a", "n": 16, "stop": [f"stop{i}" for i in range(100_000)]}, "stop", "--max-stop-strings"),
    ({"prompt": ["a"] * 256, "n": 128}, "n", "--max-choices-per-request"),
]  # fmt: skip


def _scaling(server: RemoteServer) -> tuple[int, int, list[int]]:
    """(scale operations so far, epoch, engine ids): what a scale would change."""
    stats = httpx.get(server.url + "/stats", timeout=60).json()
    return (
        len(stats["scaling"]["history"]),
        stats["epoch"],
        [r["engine_id"] for r in stats["ranks"]],
    )


@pytest.mark.parametrize(
    ("body", "param", "fragment"), TOO_BIG, ids=["stop_ids", "stops_n16", "fan_out"]
)
def test_oversized_requests_refused(server, body, param, fragment):
    content = json.dumps(body, separators=(",", ":")).encode()
    assert len(content) < 8 << 20  # under the body limit: refused for what it asks, not its size
    r = httpx.post(
        server.url + C, content=content, headers={"content-type": "application/json"}, timeout=120
    )
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err


def test_only_json_bodies_reach_the_json_routes_and_nothing_scales(server):
    before = _scaling(server)
    for path, body in JSON_ROUTES.items():
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"content-type": content_type} if content_type else {}
            r = httpx.post(
                server.url + path, content=json.dumps(body), headers=headers, timeout=120
            )
            assert r.status_code == 415, (path, content_type, r.text[:500])
            assert r.json()["error"]["code"] == "unsupported_media_type"
    assert httpx.get(server.url + "/is_scaling_elastic_ep", timeout=60).json() == {
        "is_scaling_elastic_ep": False
    }
    assert _scaling(server) == before


def test_a_foreign_host_header_is_refused_everywhere(server):
    """DNS rebinding: a page whose name resolves to 127.0.0.1 still sends its own name."""
    before = _scaling(server)
    evil = {"host": f"rebind.example:{server.port}"}
    for path in ("/health", "/stats", "/metrics", "/v1/models", "/dashboard"):
        r = httpx.get(server.url + path, headers=evil, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", (path, r.text)
    for path, body in JSON_ROUTES.items():
        r = httpx.post(server.url + path, json=body, headers=evil, timeout=120)
        assert r.status_code == 400 and "--allowed-hosts" in r.json()["error"]["message"], path
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "localhost"):
        r = httpx.get(server.url + "/v1/models", headers={"host": host}, timeout=60)
        assert r.status_code == 200, (host, r.text)
    assert _scaling(server) == before


def _greedy_on_every_rank(server: RemoteServer) -> list[str]:
    ranks = len(httpx.get(server.url + "/stats", timeout=60).json()["ranks"])
    texts = []
    for rank in range(ranks):
        body = {**GREEDY, "data_parallel_rank": rank}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["finish_reason"] == "length"
        texts.append(choice["text"])
    return texts


def test_every_rank_still_serves(server):
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert len(server.engine_processes()) == 2
    texts = _greedy_on_every_rank(server)
    assert len(texts) == 2 and texts[0] == texts[1]  # greedy: the same on every rank
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4})
    assert r.status_code == 200, r.text


# ---- listening sockets: none outside loopback (issue 23) -------------------------------------


def _listening(server: RemoteServer) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket listening and every UDP socket
    bound by the launcher and all its descendants."""
    found = []
    for proc in [psutil.Process(server.proc.pid), *server.descendants()]:
        try:
            name, conns = proc.name(), proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue  # exited meanwhile (a leaving engine)
        for c in conns:
            if c.laddr and (c.status == psutil.CONN_LISTEN or c.type == 2):  # 2: SOCK_DGRAM
                found.append((name, c.laddr.ip, c.laddr.port))
    return found


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def _assert_loopback_only(sockets: list[tuple[str, str, int]]) -> None:
    outside = [s for s in sockets if not _is_loopback(s[1])]
    assert outside == [], f"listening outside loopback: {outside}"


def test_no_socket_listens_outside_loopback_before_during_and_after_scaling(server):
    before = _listening(server)
    _assert_loopback_only(before)
    assert ("127.0.0.1", server.port) in {(ip, port) for _, ip, port in before}
    assert len({name for name, _, _ in before}) >= 3  # the frontend and both engines listen
    for size in (3, 2):
        result: dict[str, Any] = {}

        def scale(size: int = size, result: dict = result) -> None:
            body = {"new_data_parallel_size": size, "operation_id": f"sockets-{size}"}
            result["r"] = httpx.post(server.url + SCALE, json=body, timeout=300)

        t = threading.Thread(target=scale, daemon=True)
        t.start()
        during = 0
        while t.is_alive():
            # A cheap poll until the operation is seen running, then the (slower) snapshot:
            # a scale-down can be over in well under a second.
            scaling = httpx.get(server.url + "/is_scaling_elastic_ep", timeout=60).json()
            if scaling["is_scaling_elastic_ep"]:
                _assert_loopback_only(_listening(server))
                during += 1
            else:
                time.sleep(0.02)  # the poll's interval, not a wait for a condition
        t.join()
        assert result["r"].status_code == 200, result["r"].text
        assert during > 0, "no snapshot was taken while the operation ran"
        assert wait_until(lambda size=size: len(server.engine_processes()) == size, 120)
        _assert_loopback_only(_listening(server))
    texts = _greedy_on_every_rank(server)
    assert len(texts) == 2 and texts[0] == texts[1]
