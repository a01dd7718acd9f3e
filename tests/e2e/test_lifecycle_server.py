"""A real ``launch`` process drained by SIGTERM (docs/operations.md#lifecycle): readiness,
admission during the drain (503 + Retry-After, liveness still 200), every started stream
finishing (or ending with finish reason ``abort`` at ``--shutdown-timeout``), exit code 0
and nothing left behind (processes, /dev/shm, temporary files)."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

from tests.e2e.server_utils import (
    PortConflict,
    RemoteServer,
    is_alive,
    is_port_conflict,
    retry_port_conflicts,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STREAMS = 16
# 16 reading threads of one loaded test process may fall far behind the server: a stream
# is not to be dropped for its backlog here (tests/e2e/test_slow_clients_server.py is).
_LOADED_CLIENTS = ["--max-stream-backlog", "1000000", "--log-level", "info"]


@dataclass
class _Stream:
    started: threading.Event = field(default_factory=threading.Event)
    tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | None = None
    done: bool = False  # [DONE] received
    error: str | None = None


def _stream(url: str, prompt: str, max_tokens: int, out: _Stream) -> None:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        with (
            httpx.Client(base_url=url, timeout=600) as client,
            client.stream("POST", "/v1/completions", json=body) as r,
        ):
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.read().decode()}"
                return
            for line in r.iter_lines():
                if not line:
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    out.done = True
                    return
                event = json.loads(data)
                if "error" in event:
                    out.error = str(event)
                    return
                for choice in event["choices"]:
                    out.started.set()
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                    out.stop_reason = choice.get("stop_reason") or out.stop_reason
                if event.get("usage"):
                    out.tokens = event["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - reported by the test
        out.error = f"{type(e).__name__}: {e}"


def _start_streams(url: str, max_tokens: int) -> tuple[list[_Stream], list[threading.Thread]]:
    streams = [_Stream() for _ in range(STREAMS)]
    threads = [
        threading.Thread(target=_stream, args=(url, f"stream {i} says", max_tokens, s))
        for i, s in enumerate(streams)
    ]
    for t in threads:
        t.start()
    return streams, threads


def _ready(srv: RemoteServer) -> bool:
    try:
        return httpx.get(f"{srv.url}/ready", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _health(srv: RemoteServer) -> httpx.Response | None:
    try:
        return httpx.get(f"{srv.url}/health", timeout=10)
    except httpx.HTTPError:
        return None


def _kv_line(output: str) -> tuple[int, int, int]:
    m = re.search(r"KV cache per rank: (\d+) blocks, (\d+) tokens, (\d+) bytes", output)
    assert m is not None, output
    blocks, tokens, size = map(int, m.groups())
    return blocks, tokens, size


def _own_shm(pids: set[int]) -> list[str]:
    # The TP ring names carry their engine's pid (docs/protocols/shm-ring.md#shm-lifetime).
    return [p for p in glob.glob("/dev/shm/tidal-*") if any(f"-{pid}-" in p for pid in pids)]


def _drain(srv: RemoteServer, max_tokens: int, tmp: str) -> list[_Stream]:
    """SIGTERM under STREAMS streams; checks admission while draining and what is left."""
    assert wait_until(lambda: _ready(srv), 300), srv.output
    pids = {p.pid for p in srv.descendants()} | {srv.proc.pid}
    streams, threads = _start_streams(srv.url, max_tokens)
    assert wait_until(lambda: all(s.started.is_set() or s.error for s in streams), 300)
    assert [s.error for s in streams if s.error] == []
    srv.proc.send_signal(signal.SIGTERM)

    def draining() -> bool:
        h = _health(srv)
        return h is not None and h.status_code == 200 and h.json()["status"] == "draining"

    assert wait_until(draining, 60), srv.output
    # The drain runs: liveness holds, readiness is off, new requests are refused.
    assert not all(s.done for s in streams), "the streams ended before the drain was seen"
    refused = httpx.post(
        f"{srv.url}/v1/completions", json={"prompt": "late", "max_tokens": 4}, timeout=30
    )
    assert refused.status_code == 503, refused.text
    assert int(refused.headers["Retry-After"]) > 0
    assert refused.json()["error"]["code"] == "server_draining"
    ready = httpx.get(f"{srv.url}/ready", timeout=10)
    assert (ready.status_code, ready.json()["status"]) == (503, "draining")
    for t in threads:
        t.join(600)
        assert not t.is_alive(), "a stream hangs"
    code = srv.proc.wait(300)
    srv.stop()
    assert code == 0, srv.output
    assert srv.leftover_processes() == []
    assert glob.glob(f"{tmp}/tidal-*") == []
    assert _own_shm(pids) == []
    assert [s.error for s in streams if s.error] == []
    assert all(s.done for s in streams)
    return streams


def test_sigterm_lets_every_started_stream_finish(qwen3_long_ckpt, tmp_path):
    tmp = str(tmp_path)
    srv = RemoteServer(
        ["--model", qwen3_long_ckpt, "--shutdown-timeout", "600", *_LOADED_CLIENTS],
        env={"TMPDIR": tmp, "VLLM_CPU_KVCACHE_SPACE": None},  # the default budget
    )
    try:
        streams = _drain(srv, max_tokens=1000, tmp=tmp)
    finally:
        srv.stop()
    assert [(s.finish_reason, s.tokens) for s in streams] == [("length", 1000)] * STREAMS
    # The sizing line (docs/operations.md#kv-sizing): the default budget, 512 MiB.
    blocks, tokens, size = _kv_line(srv.output)
    assert tokens == (blocks - 1) * 16 and 2**29 - size < size // blocks, (blocks, size)


def test_shutdown_timeout_aborts_what_still_runs(qwen3_long_ckpt, tmp_path):
    tmp = str(tmp_path)
    srv = RemoteServer(
        # Two TP workers: their step ring in /dev/shm must go too.
        # 5 s: the test's checks of admission while draining (a /health poll, a refused
        # POST, /ready) must land in it, under 16 streams on a loaded machine.
        ["--model", qwen3_long_ckpt, "--shutdown-timeout", "5", "-tp", "2", *_LOADED_CLIENTS],
        # vLLM's variable, in GiB: a quarter of the default budget.
        env={"TMPDIR": tmp, "VLLM_CPU_KVCACHE_SPACE": "0.25"},
    )
    try:
        # Far more tokens than 5 s allow: every stream is cut by the timeout.
        streams = _drain(srv, max_tokens=100_000, tmp=tmp)
    finally:
        srv.stop()
    blocks, _, size = _kv_line(srv.output)
    assert 2**28 - size < size // blocks, (blocks, size)
    for s in streams:
        assert s.finish_reason == "abort" and 0 < s.tokens < 100_000, s
        assert "--shutdown-timeout=5s" in (s.stop_reason or ""), s


def _launcher(
    ckpt: str, *extra: str, sigint_ignored: bool = False, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """A dp 2 launcher (``extra``: more flags, ``env``: more variables);
    ``sigint_ignored``: started as a non-interactive shell starts its background jobs
    (``launch ... &``, the README's first command), SIGINT ignored."""
    cmd = [sys.executable, "-m", "tidal.launch.cli", "serve", "--port", "0"]
    return subprocess.Popen(
        [*cmd, "--model", ckpt, "--dp", "2", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_ignore_sigint if sigint_ignored else None,
        env={**os.environ, **(env or {})},
    )


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _end(proc: subprocess.Popen, timeout_s: float = 120) -> str:
    """The rest of ``proc``'s output once it exits; killed (its group) if it does not."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)


def test_sigint_at_the_serving_line_stops_a_launcher_started_with_sigint_ignored(qwen3_ckpt):
    # The stop is sent the moment the server says it serves: the line comes once the
    # server's own handlers are in place, so the signal drains it (it was lost when the
    # line came first, and the server served on).
    proc = _launcher(qwen3_ckpt, sigint_ignored=True)
    seen: list[psutil.Process] = []
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "serving on" in line:
                seen = psutil.Process(proc.pid).children(recursive=True)
                proc.send_signal(signal.SIGINT)
                break
    finally:
        out = "".join(lines) + _end(proc)
    assert proc.returncode == 0 and seen, out
    assert wait_until(lambda: not any(is_alive(p) for p in seen), 10), seen


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_stop_while_the_engines_start_ends_the_start(qwen3_ckpt, sig):
    proc = _launcher(qwen3_ckpt)
    seen: list[psutil.Process] = []
    try:
        launcher = psutil.Process(proc.pid)

        def ranks_started() -> bool:
            seen[:] = launcher.children(recursive=True)
            return any(p.name().startswith("EngineCore") for p in seen if is_alive(p))

        assert wait_until(ranks_started, 120)
        proc.send_signal(sig)
    finally:
        out = _end(proc)
    assert proc.returncode == 0, out
    assert "serving on" not in out, out  # the signal came before the server served
    # Everything the start had started is stopped, by the launcher (not by its children
    # noticing later that their parent went away).
    assert wait_until(lambda: not any(is_alive(p) for p in seen), 5), seen


def _in_its_rendezvous(p: psutil.Process) -> bool:
    """``p`` hosts its group's store and is connected to it: in the group rendezvous."""
    try:
        conns = p.net_connections(kind="tcp")
    except psutil.Error:
        return False
    listening = {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}
    return any(c.raddr and c.raddr.port in listening for c in conns)


def test_a_rank_waiting_for_peers_that_never_come_stops_at_once(qwen3_ckpt, tmp_path):
    # Two ranks, one of them on a host that never starts: rank 0 waits in its group
    # rendezvous, in C, where Python's signal handlers do not run. The launcher's stop
    # must end it at once, not after the launcher's 10 s grace and a SIGKILL.
    def attempt(rpc: int) -> tuple[subprocess.Popen, str]:
        proc = _launcher(
            qwen3_ckpt, "--data-parallel-size-local", "1",
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc),
            env={"TMPDIR": str(tmp_path), "TIDAL_DP_AUTH_KEY": "x" * 32},
        )  # fmt: skip
        seen: list[psutil.Process] = []
        try:
            launcher = psutil.Process(proc.pid)

            def waiting() -> bool:
                seen[:] = launcher.children(recursive=True)
                ranks = [p for p in seen if p.name().startswith("EngineCore")]
                return proc.poll() is not None or any(_in_its_rendezvous(p) for p in ranks)

            assert wait_until(waiting, 120)
            proc.send_signal(signal.SIGTERM)
        finally:
            out = _end(proc)
        if is_port_conflict(out):
            raise PortConflict(out)
        assert proc.returncode == 0, out
        assert "did not exit within" not in out, out  # not killed: it left on the signal
        assert "stopped by a signal during its start" in out, out
        assert wait_until(lambda: not any(is_alive(p) for p in seen), 5), seen
        return proc, out

    retry_port_conflicts(attempt)


def _complete(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# Level 2 over two TP workers: each frees its own share of the rank's cache and its
# weights, and reloads its shard at wake-up.
@pytest.mark.parametrize(("level", "tp"), [(1, 1), (2, 2)])
def test_sleep_frees_the_kv_cache_and_wake_up_serves_the_same_tokens(qwen3_ckpt, level, tp):
    kv_bytes = 256 * 2**20
    srv = RemoteServer(
        # Enough sequences that the block cap (max_num_seqs full-length sequences) is not
        # what sizes the tiny model's cache: the budget is.
        [
            "--model",
            qwen3_ckpt,
            "--kv-cache-memory-bytes",
            str(kv_bytes),
            "--max-num-seqs",
            "4096",
            "--tensor-parallel-size",
            str(tp),
            "--log-level",
            "info",
        ]
    )
    try:
        assert wait_until(lambda: _ready(srv), 300), srv.output
        prompts = [f"sleepy prompt {i}" for i in range(3)]
        before = [_complete(srv.url, p) for p in prompts]
        engines = srv.descendants()  # the engine and its TP workers
        assert len(srv.engine_processes()) == 1 and len(engines) >= tp

        def rss() -> int:
            return sum(p.memory_info().rss for p in engines)

        bad = httpx.post(f"{srv.url}/sleep", params={"level": 3}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "level", bad.text
        awake_rss = rss()
        r = httpx.post(f"{srv.url}/sleep", params={"level": level}, timeout=120)
        assert r.status_code == 200, r.text
        freed = r.json()["freed_bytes"]
        # The whole cache the start line reported (about the budget) is freed; level 2
        # the weights too (measured by each worker).
        blocks, _, size = _kv_line(srv.output)
        # --kv-cache-memory-bytes is per worker.
        assert tp * kv_bytes - size < size // blocks, (freed, size)
        assert freed == size if level == 1 else freed > size, (freed, size)
        # The engine's resident memory drops by about the cache (other pages may move).
        assert wait_until(lambda: awake_rss - rss() >= 0.8 * freed, 60), (awake_rss, rss())
        assert httpx.get(f"{srv.url}/is_sleeping", timeout=30).json() == {"is_sleeping": True}
        refused = httpx.post(
            f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30
        )
        assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
        assert refused.json()["error"]["code"] == "engine_sleeping"
        ready = httpx.get(f"{srv.url}/ready", timeout=30)
        assert (ready.status_code, ready.json()["status"]) == (503, "sleeping")
        assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200

        r = httpx.post(f"{srv.url}/wake_up", timeout=120)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{srv.url}/is_sleeping", timeout=30).json() == {"is_sleeping": False}
        assert rss() - (awake_rss - freed) >= 0.8 * freed  # the cache is back
        assert _ready(srv)
        assert [_complete(srv.url, p) for p in prompts] == before
    finally:
        code = srv.stop()
    assert code == 0
    assert srv.leftover_processes() == []
