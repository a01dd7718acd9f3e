"""Start a real ``launch`` server in a subprocess and stop it without leaving anything behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(
        self, args: list[str], *, startup_timeout_s: float = 180.0, env: dict | None = None
    ):
        self.port = free_port()
        cmd = [sys.executable, "-m", "tidal.launch.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_ready(startup_timeout_s)
        self.children = self.descendants()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{out}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError("server did not become healthy")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def engine_processes(self) -> list[psutil.Process]:
        return [p for p in self.descendants() if p.name().startswith("EngineCore")]

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM the launcher; returns its exit code. Kills the group if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()
        return self.proc.returncode

    def leftover_processes(self, timeout_s: float = 10.0) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout_s
        alive = self.children
        while time.monotonic() < deadline:
            alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                return []
            time.sleep(0.2)
        return alive
