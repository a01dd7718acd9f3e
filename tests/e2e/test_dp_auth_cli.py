"""``launch`` with ranks on other hosts: the TCP control plane needs the shared secret.

The secret comes from ``--data-parallel-auth-key`` or ``TIDAL_DP_AUTH_KEY`` (read by the
CLI only). A headless rank without one is refused before it starts anything; a rank with
a different one exits with an error naming the flag, instead of hanging.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from tests.e2e.server_utils import PortConflict, is_alive, is_port_conflict, retry_port_conflicts

_DEADLINE_S = 300  # generous: only reached when the expected exit never comes


def _cmd(qwen3_ckpt: str, rpc: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tidal.launch.cli",
        "serve",
        "--model",
        qwen3_ckpt,
        "--dp",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc),
        *extra,
    ]


def _env(secret: str | None, tmpdir: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_DP_AUTH_KEY"}
    if secret is not None:
        env["TIDAL_DP_AUTH_KEY"] = secret
    if tmpdir is not None:
        # The launcher's private socket directory goes in a folder the test removes, so
        # whatever a launcher stopped mid-start might leave there goes with it.
        env["TMPDIR"] = tmpdir
    return env


def _popen(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen) -> str:
    """Stop a launcher and every process it started; its output."""
    try:
        family = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        family = []
    out = ""
    if proc.poll() is None:
        proc.terminate()
    if not proc.stdout.closed:  # else its output was read already
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=10)
    left = []
    for pid in family[1:]:
        try:
            left.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs([p for p in left if is_alive(p)], timeout=30)
    for p in alive:
        p.kill()
    assert not alive, f"left behind: {alive}"
    return out


def test_headless_rank_without_a_secret_is_refused(qwen3_ckpt):
    proc = _popen(_cmd(qwen3_ckpt, 1, "--headless", "--data-parallel-start-rank", "1"), _env(None))
    out, _ = proc.communicate(timeout=_DEADLINE_S)
    assert proc.returncode == 2  # an argparse error: nothing was started
    assert "--data-parallel-auth-key" in out and "TIDAL_DP_AUTH_KEY" in out


def test_headless_rank_with_a_wrong_secret_fails_fast(qwen3_ckpt, tmp_path):
    def attempt(rpc: int) -> tuple[int | None, str]:
        front = _popen(
            _cmd(qwen3_ckpt, rpc, "--port", "0"),
            _env("the-right-secret-0123456789", str(tmp_path)),
        )
        headless = None
        try:
            headless = _popen(
                _cmd(qwen3_ckpt, rpc, "--headless", "--data-parallel-start-rank", "1"),
                _env("a-wrong-secret-0123456789abc"),
            )
            try:
                out, _ = headless.communicate(timeout=_DEADLINE_S)
            except subprocess.TimeoutExpired:
                out = ""
            code = headless.returncode
        finally:
            if headless is not None:
                _stop(headless)
            front_out = _stop(front)
        if is_port_conflict(front_out):
            raise PortConflict(front_out)
        return code, out

    code, out = retry_port_conflicts(attempt)
    assert code == 1, out
    assert "refused the CURVE handshake" in out and "--data-parallel-auth-key" in out, out
