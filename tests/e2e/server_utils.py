"""Start a real ``launch`` server in a subprocess and stop it without leaving anything behind.

No port is picked for the server: it binds port 0 and the URL is read from the line it
prints once it is ready (``tidal: serving on http://host:port``), so no other process can
take the port between a pick and the bind. Ports that must be known before any process
binds them (``--data-parallel-rpc-port``, shared by a frontend and its headless ranks) come
from ``free_port`` and the caller retries with a new one on a conflict
(``retry_port_conflicts``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import httpx
import psutil

from tests.waiting import wait_until
from tidal.distributed.ports import get_open_port

T = TypeVar("T")

_SERVING = re.compile(r"tidal: serving on (http://\S+)")


def free_port() -> int:
    """A port that was free a moment ago: another process may take it before it is bound,
    so whoever binds it must go through ``retry_port_conflicts``."""
    return get_open_port()


def is_port_conflict(text: str) -> bool:
    text = text.lower()
    return "address already in use" in text or "eaddrinuse" in text


class PortConflict(RuntimeError):
    """The port picked for a process was taken before that process could bind it."""


def retry_port_conflicts(start: Callable[[int], T], attempts: int = 3) -> T:
    """``start(port)`` with a fresh ``free_port()``; again with another port when it raises
    an error saying the address is in use (``start`` cleans up what it started)."""
    for attempt in range(attempts):
        try:
            return start(free_port())
        except Exception as e:  # noqa: BLE001 - re-raised unless it is a port conflict
            if attempt + 1 == attempts or not is_port_conflict(str(e)):
                raise
    raise AssertionError("unreachable")


def is_alive(p: psutil.Process) -> bool:
    """Running and not a zombie (a process that exits meanwhile is not alive)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class RemoteServer:
    def __init__(
        self,
        args: list[str],
        *,
        startup_timeout_s: float = 300.0,
        env: dict | None = None,
        headers: dict[str, str] | None = None,
    ):
        """``headers`` go with the readiness probe (an API key's Authorization)."""
        self.headers = headers or {}
        cmd = [sys.executable, "-m", "tidal.launch.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # An ``env`` value of None removes the variable.
            env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None},
            start_new_session=True,
        )
        self._lines: list[str] = []
        self._serving = threading.Event()  # set on the "serving on" line or at EOF
        self.url = ""
        # Always drained, so a chatty server never blocks on a full pipe.
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.port = int(self.url.rsplit(":", 1)[1])
        self.children = self.descendants()

    def _read_output(self) -> None:
        with self.proc.stdout as out:
            for line in out:
                self._lines.append(line)
                m = _SERVING.search(line)
                if m and not self.url:
                    host_port = m.group(1).removeprefix("http://")
                    host, port = host_port.rsplit(":", 1)
                    if host in ("0.0.0.0", "::", "[::]"):
                        host = "127.0.0.1"
                    self.url = f"http://{host}:{port}"
                    self._serving.set()
        self._serving.set()

    @property
    def output(self) -> str:
        """Everything the launcher (and its engines) printed so far."""
        return "".join(self._lines)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._serving.wait(0.5):
            if self.proc.poll() is not None:
                self._reader.join(10)
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not start in {timeout_s} s:\n{self.output}")
        if not self.url:
            self.proc.wait(10)
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output}")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._reader.join(10)
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output}")
            try:
                health = httpx.get(f"{self.url}/health", headers=self.headers, timeout=10)
                if health.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server did not become healthy in {timeout_s} s:\n{self.output}")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def engine_processes(self) -> list[psutil.Process]:
        return [p for p in self.descendants() if p.name().startswith("EngineCore")]

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM the launcher; returns its exit code. Kills the group if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # EOF once every process holding the pipe is gone (the reader then closes it).
        self._reader.join(10)
        return self.proc.returncode

    def leftover_processes(self, timeout_s: float = 30.0) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout_s
        alive = self.children
        while time.monotonic() < deadline:
            alive = [p for p in alive if is_alive(p)]
            if not alive:
                return []
            time.sleep(0.2)
        return alive


# ---- streaming load ----------------------------------------------------------------------


@dataclass
class Streamed:
    text: str
    completion_tokens: int
    finish_reason: str | None


def stream_completion(
    client: httpx.Client,
    prompt: str,
    max_tokens: int,
    on_chunk: Callable[[], None] = lambda: None,
    **extra: object,
) -> Streamed:
    """One streamed greedy completion (``ignore_eos``: exactly ``max_tokens`` tokens), read
    to ``[DONE]``; fails on any other status, an error event, a stream that ends early or
    one without its usage chunk."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    parts: list[str] = []
    usage = finish = None
    done = False
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise AssertionError(f"HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            assert "error" not in event, event
            for choice in event["choices"]:
                parts.append(choice["text"])
                finish = choice.get("finish_reason") or finish
                on_chunk()
            if event.get("usage"):
                usage = event["usage"]
    assert done, f"stream of {prompt!r} ended without [DONE]"
    assert usage is not None, "no usage chunk"
    return Streamed("".join(parts), usage["completion_tokens"], finish)


class StreamingLoad:
    """One client per prompt, each streaming its prompt back to back until ``finish``; any
    failure is kept (with the prompt) for the test to report. ``served()`` counts the
    chunks received, ``done()`` the streams completed. ``timeout_s``: each client's HTTP
    timeout; ``finish`` gives a client a minute more than that to end its stream."""

    def __init__(
        self,
        url: str,
        prompts: Sequence[str],
        max_tokens: int,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 180.0,
    ) -> None:
        self.url = url
        self.prompts = list(prompts)
        self.max_tokens = max_tokens
        self.headers = dict(headers or {})
        self.timeout_s = timeout_s
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.results: list[tuple[int, Streamed]] = []
        self.errors: list[str] = []
        self.chunks = 0
        self.threads = [
            threading.Thread(target=self._worker, args=(i,), daemon=True)
            for i in range(len(self.prompts))
        ]
        for t in self.threads:
            t.start()

    def _tick(self) -> None:
        with self.lock:
            self.chunks += 1

    def _worker(self, i: int) -> None:
        with httpx.Client(
            base_url=self.url, headers=self.headers, timeout=self.timeout_s
        ) as client:
            while not self.stop.is_set():
                try:
                    out = stream_completion(
                        client, self.prompts[i], self.max_tokens, on_chunk=self._tick
                    )
                except BaseException as e:  # noqa: BLE001 - reported by the test
                    with self.lock:
                        self.errors.append(f"prompt {i}: {type(e).__name__}: {e}")
                    return
                with self.lock:
                    self.results.append((i, out))

    def served(self) -> int:
        with self.lock:
            return self.chunks

    def done(self) -> int:
        with self.lock:
            return len(self.results)

    def more(self, n: int = 3, timeout_s: float = 180.0) -> bool:
        """Wait until ``n`` more streams complete (or one fails)."""
        start = self.done()
        return wait_until(lambda: self.done() >= start + n or bool(self.errors), timeout_s)

    def finish(self) -> list[tuple[int, Streamed]]:
        self.stop.set()
        for t in self.threads:
            t.join(self.timeout_s + 60)
            assert not t.is_alive(), "a streaming client hangs"
        return self.results
