"""Slow and hostile HTTP clients against a real uvicorn on a real socket (fake engine):
a stream nobody reads is aborted at ``max_stream_backlog`` outputs, connections past
``max_connections`` are refused with 503 until a slot frees, and a connection that sends
no headers, or trickles them or its body, is closed after its timeout. The ``launch``
flags that set these are checked too (a bad value is a CLI error naming the flag)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.sockets import raw_connection, read_to_eof
from tests.unit.test_api_server import FakeAsyncLLM, expected_text, run, sse_events, wait_for
from tidal.frontend.outputs import CompletionOutput, RequestOutput
from tidal.launch import spawn
from tidal.launch.api_server import bind_socket, build_app, make_server
from tidal.launch.cli import main
from tidal.launch.connections import ServerLimits

# Far more than a socket's buffers hold: a client that does not read fills them long
# before the last output.
BIG = " " + "x" * 16383
TOTAL = 2000


class Firehose(FakeAsyncLLM):
    """For the prompt "flood": outputs of 16 KiB each (``TOTAL`` of them), as fast as
    the server takes them; other prompts as ``FakeAsyncLLM``."""

    def __init__(self) -> None:
        super().__init__()
        self.produced = 0
        self.completed = False

    async def _outputs(self, prompt, params, request_id, kind):
        if prompt.prompt != "flood":
            async for out in super()._outputs(prompt, params, request_id, kind):
                yield out
            return
        for k in range(TOTAL):
            await asyncio.sleep(0)
            self.produced += 1
            done = k == TOTAL - 1
            out = CompletionOutput(0, BIG, [10], None, None, "length" if done else None, None)
            yield RequestOutput(request_id, prompt.prompt, prompt.prompt_token_ids, [out], done)
        self.completed = True


@contextlib.asynccontextmanager
async def guarded_server(
    engine: FakeAsyncLLM, limits: ServerLimits
) -> AsyncIterator[tuple[str, int, object]]:
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = build_app(engine, limits=limits)
    server = make_server(app, log_level="warning", limits=limits)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await wait_for(lambda: server.started or task.done())
        assert server.started, "server failed to start"
        yield f"http://127.0.0.1:{port}", port, server
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)
        sock.close()


def post(path: str, body: dict, content_length: int | None = None) -> bytes:
    raw = json.dumps(body).encode()
    length = len(raw) if content_length is None else content_length
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    )
    return head.encode() + raw


async def ok_request(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        assert (await c.get("/health")).status_code == 200
        r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected_text(2)


@pytest.mark.slow  # starts a server: the fast tier stays under 2 minutes
@run
async def test_stream_nobody_reads_is_aborted_at_the_backlog_and_others_are_served(caplog):
    engine = Firehose()
    limits = ServerLimits(max_stream_backlog=8)
    caplog.set_level(logging.WARNING, logger="tidal.launch.serving")
    async with guarded_server(engine, limits) as (url, port, _):
        s = raw_connection(port, rcvbuf=4096)
        try:
            body = {"prompt": "flood", "max_tokens": 8, "stream": True}
            s.sendall(post("/v1/completions", body))
            # The client reads nothing: the request either ends aborted or runs to its end.
            await wait_for(lambda: engine.aborted or engine.completed)
            (rid,) = [c["request_id"] for c in engine.calls]
            assert engine.aborted == [rid], "a stream nobody reads was buffered to its end"
            assert engine.produced < TOTAL
            assert any(
                "did not read its stream" in r.getMessage() and rid in r.getMessage()
                for r in caplog.records
            ), caplog.text
            # Its connection is dropped: what was already in the socket, then the end.
            data = await asyncio.to_thread(read_to_eof, s)
            assert data.startswith(b"HTTP/1.1 200")
            assert b"[DONE]" not in data
        finally:
            s.close()
        await ok_request(url)
        assert engine.aborted == [rid]
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            metrics = (await c.get("/metrics")).text
        assert "tidal:stream_backlog_aborts_total 1.0" in metrics


@pytest.mark.slow  # starts a server: the fast tier stays under 2 minutes
@run
async def test_a_read_batch_stream_is_not_taken_for_a_client_that_does_not_read():
    # Each step of a batch of prompts brings one output per prompt at once: the bound
    # counts per engine request, not per stream.
    engine = FakeAsyncLLM()
    limits = ServerLimits(max_stream_backlog=2)
    async with guarded_server(engine, limits) as (url, _, _):
        body = {"prompt": ["a"] * 8, "max_tokens": 6, "stream": True}
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            r = await c.post("/v1/completions", json=body)
        events = sse_events(r.text)
        assert all("error" not in e for e in events), events
        texts = {}
        for e in events:
            for ch in e["choices"]:
                texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
        assert texts == {i: expected_text(6) for i in range(8)}
        assert engine.aborted == []


async def _idle_connections(port: int, n: int, server) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        socks.append(raw_connection(port))
        await wait_for(lambda: len(server.server_state.connections) == len(socks))
    return socks


@pytest.mark.slow  # starts a server: the fast tier stays under 2 minutes
@run
async def test_connections_past_the_cap_get_503_until_a_slot_frees():
    engine = FakeAsyncLLM()
    limits = ServerLimits(max_connections=3)
    async with guarded_server(engine, limits) as (url, port, server):
        held = await _idle_connections(port, 3, server)
        try:
            # At the cap: a new connection is answered and closed before it sends a byte.
            for _ in range(2):
                extra = raw_connection(port)
                try:
                    data = await asyncio.to_thread(read_to_eof, extra)
                finally:
                    extra.close()
                assert data.startswith(b"HTTP/1.1 503"), data
                assert b"--max-connections" in data
            await wait_for(lambda: len(server.server_state.connections) == 3)
            held.pop().close()
            await wait_for(lambda: len(server.server_state.connections) == 2)
            await ok_request(url)
            assert len(engine.calls) == 1
        finally:
            for s in held:
                s.close()


@pytest.mark.slow  # starts a server: the fast tier stays under 2 minutes
@run
async def test_idle_and_trickling_headers_are_closed_after_the_header_timeout():
    limits = ServerLimits(header_timeout_s=2.0)
    async with guarded_server(FakeAsyncLLM(), limits) as (url, port, server):
        idle = raw_connection(port)
        trickle = raw_connection(port)
        try:
            trickle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            for s in (idle, trickle):
                data = await asyncio.to_thread(read_to_eof, s)
                assert data.startswith(b"HTTP/1.1 408"), data
        finally:
            idle.close()
            trickle.close()
        await wait_for(lambda: len(server.server_state.connections) == 0)
        # A request that sends its headers in time is served (and its connection kept
        # past the header timeout while it waits for the next request: keep-alive).
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            for _ in range(2):
                assert (await c.get("/health")).status_code == 200


@pytest.mark.slow  # starts a server: the fast tier stays under 2 minutes
@run
async def test_a_trickling_body_gets_408_and_its_connection_is_closed():
    engine = FakeAsyncLLM()
    limits = ServerLimits(body_timeout_s=2.0)
    async with guarded_server(engine, limits) as (url, port, _):
        s = raw_connection(port)
        try:
            request = post("/v1/completions", {"prompt": "a", "max_tokens": 2})
            s.sendall(request[:-5])  # the body's last bytes never come
            data = await asyncio.to_thread(read_to_eof, s)
        finally:
            s.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), data
        assert b"connection: close" in head.lower()
        error = json.loads(body)["error"]
        assert "--http-body-timeout" in error["message"]
        assert error["type"] == "invalid_request_error" and error["code"] == "request_timeout"
        assert engine.calls == []
        await ok_request(url)


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--max-connections", "0"),
        ("--max-connections", "100000000"),  # past the open-file limit
        ("--max-stream-backlog", "0"),
        ("--http-header-timeout", "0"),
        ("--http-body-timeout", "-1"),
        ("--http-body-timeout", "nan"),
    ],
)
def test_bad_limit_flags_are_cli_errors_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", flag, value])
    assert exc.value.code == 2
    assert f"{flag}:" in capsys.readouterr().err


def test_limit_flags_are_documented(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--max-connections",
        "--http-header-timeout",
        "--http-body-timeout",
        "--max-stream-backlog",
    ):
        assert flag in out


def test_default_connection_cap_leaves_descriptors_for_engines_and_recovery(monkeypatch):
    monkeypatch.setattr(spawn.resource, "getrlimit", lambda _: (256, 4096))
    parser = spawn.make_parser()
    assert spawn._server_limits(parser, parser.parse_args([])).max_connections == 128
    with pytest.raises(SystemExit):  # a cap that could take every descriptor
        spawn._server_limits(parser, parser.parse_args(["--max-connections", "256"]))
