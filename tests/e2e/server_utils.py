"""Start a real ``launch`` server in a subprocess and stop it without leaving anything behind.

No port is picked for the server: it binds port 0 and the URL is read from the line it
prints once it is ready (``tidal: serving on http://host:port``), so no other process can
take the port between a pick and the bind. Ports that must be known before any process
binds them (``--data-parallel-rpc-port``, shared by a frontend and its headless ranks) come
from ``free_port`` and the caller retries with a new one on a conflict
(``retry_port_conflicts``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import httpx
import psutil

T = TypeVar("T")

_SERVING = re.compile(r"tidal: serving on (http://\S+)")


def free_port() -> int:
    """A port that was free a moment ago: another process may take it before it is bound,
    so whoever binds it must go through ``retry_port_conflicts``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
