"""Slow and hostile clients against the real server (``launch`` in a subprocess, one
engine): a stream its client never reads is aborted in the engine at
``--max-stream-backlog`` and its connection dropped while other requests are served;
past ``--max-connections`` a connection is answered 503 and closed, and ``/health`` and
requests work again once a slot frees. (tests/unit/test_slow_clients.py covers the
header and body timeouts on a real socket with a fake engine.)"""

from __future__ import annotations

import json
import resource
import socket

import httpx
import psutil
import pytest

from tests.e2e.server_utils import RemoteServer, is_alive
from tests.sockets import raw_connection, read_to_eof
from tests.waiting import wait_until

_ABORTED = "did not read its stream"


@pytest.fixture(scope="module")
def server(qwen3_long_ckpt):
    srv = RemoteServer(
        ["--model", qwen3_long_ckpt, "--log-level", "warning"]
        + ["--max-connections", "3", "--max-stream-backlog", "4"]
        # Long enough that the connections held idle below are not closed meanwhile.
        + ["--http-header-timeout", "120"],
        env={"TIDAL_API_KEY": None},
    )
    yield srv
    srv.stop()
    assert srv.leftover_processes() == []


def _metrics(server: RemoteServer) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=60).text


def _finished(server: RemoteServer) -> float:
    text = _metrics(server)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tidal:request_success_total")
    )


def _served(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4


def test_stream_nobody_reads_is_aborted_and_the_server_keeps_serving(server):
    finished = _finished(server)
    # The echoed prompt with its top logprobs makes a first chunk far larger than the
    # socket buffers, so the server blocks writing it and the outputs after it pile up.
    body = {
        "prompt": [100 + i % 300 for i in range(300)],
        # Minutes of decoding: the abort must come first, however fast the engine runs
        # (200 tokens could finish before the frontend saw the backlog).
        "max_tokens": 20000,
        "echo": True,
        "logprobs": 20,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    raw = json.dumps(body).encode()
    s = raw_connection(server.port, rcvbuf=4096, timeout_s=120)
    try:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        # Aborted, or (without the bound) buffered on the server until it finishes.
        assert wait_until(lambda: _ABORTED in server.output or _finished(server) > finished)
        assert _ABORTED in server.output, server.output
        data = read_to_eof(s)  # what the kernel held, then the end: no more is sent
    finally:
        s.close()
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    assert b"[DONE]" not in data
    assert _finished(server) == finished  # aborted, not run to its end
    assert "tidal:stream_backlog_aborts_total 1.0" in _metrics(server)
    _served(server)


def _accepted(server: RemoteServer) -> int:
    """Connections the server process holds on its port (accepted, not yet closed)."""
    conns = psutil.Process(server.proc.pid).net_connections(kind="tcp")
    return sum(
        1 for c in conns if c.laddr and c.laddr.port == server.port and c.status == "ESTABLISHED"
    )


def test_connections_past_the_cap_get_503_and_slots_free_again(server):
    held: list[socket.socket] = []
    try:
        for _ in range(3):  # idle connections, up to the cap
            held.append(raw_connection(server.port, timeout_s=120))
            assert wait_until(lambda: _accepted(server) == len(held))
        for _ in range(2):  # each one past it is refused before it sends a byte
            extra = raw_connection(server.port, timeout_s=120)
            try:
                refused = read_to_eof(extra)
            finally:
                extra.close()
            assert refused.startswith(b"HTTP/1.1 503"), refused
            assert b"--max-connections" in refused
        held.pop().close()
        assert wait_until(lambda: _accepted(server) == len(held))
        _served(server)
    finally:
        for s in held:
            s.close()


def _health_ok(server: RemoteServer) -> bool:
    try:
        return httpx.get(f"{server.url}/health", timeout=60).status_code == 200
    except httpx.HTTPError:
        return False


def _dp_size(server: RemoteServer) -> int:
    return httpx.get(f"{server.url}/stats", timeout=60).json()["data_parallel_size"]


# The launcher's open-file limit in the flood test: small, so a flood can reach it.
_FD_LIMIT = 512


def test_recovery_spawns_an_engine_while_a_flood_holds_every_connection(qwen3_ckpt):
    # The launcher inherits this process's limit; lowered only while it starts.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_FD_LIMIT, hard))
    try:
        srv = RemoteServer(
            ["--model", qwen3_ckpt, "--dp", "2", "--enable-elastic-ep", "--elastic-restore"]
            # The held connections must stay open while the rank is replaced.
            + ["--http-header-timeout", "600", "--log-level", "warning"],
            env={"TIDAL_API_KEY": None},
        )
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    flood: list[socket.socket] = []
    family = [psutil.Process(srv.proc.pid), *srv.children]
    try:
        # More idle connections than the launcher has descriptors: the default cap
        # (half of them) refuses the rest, so the launcher keeps descriptors to spare.
        for _ in range(_FD_LIMIT + 100):
            flood.append(raw_connection(srv.port, timeout_s=120))
        assert wait_until(lambda: _accepted(srv) == _FD_LIMIT // 2)
        (victim,) = [p for p in srv.engine_processes() if p.name().endswith("DP1")]
        victim.kill()

        def replaced() -> bool:
            engines = [p for p in srv.engine_processes() if p.pid != victim.pid]
            return len(engines) == 2

        assert wait_until(replaced, 180), srv.output
        family += srv.descendants()
        assert "Too many open files" not in srv.output, srv.output
        for s in flood:
            s.close()
        flood.clear()
        assert wait_until(lambda: _health_ok(srv))
        # Its restore (the scale-up back to two ranks) may still be finishing.
        assert wait_until(lambda: _dp_size(srv) == 2), srv.output
        _served(srv)
    finally:
        for s in flood:
            s.close()
        srv.stop()
    _, alive = psutil.wait_procs([p for p in family if is_alive(p)], timeout=30)
    assert alive == []
