"""A deployment's startup and what it exposes: every TCP socket of a ``-tp 2`` server (its
frontend, engine and TP workers) listens on loopback only, the rank's TCPStore included."""

from __future__ import annotations

import psutil
import pytest

from tests.e2e.server_utils import RemoteServer

pytestmark = pytest.mark.timeout(300)

_LOOPBACK = ("127.0.0.1", "::1")


def _listening(p: psutil.Process) -> list[tuple[str, int]]:
    try:
        conns = p.net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


def test_a_tp2_deployment_listens_on_loopback_only(qwen3_ckpt):
    srv = RemoteServer(
        ["--model", qwen3_ckpt, "--dtype", "float32", "--device", "cpu", "-tp", "2",
         "--host", "127.0.0.1", "--log-level", "warning"],
    )  # fmt: skip
    try:
        procs = [psutil.Process(srv.proc.pid), *srv.descendants()]
        names = sorted(p.name() for p in procs)
        assert {"EngineCore_DP0", "Worker_DP0_TP0", "Worker_DP0_TP1"} <= set(names), names
        sockets = {p.name(): _listening(p) for p in procs}
        # The engine hosts its TP group's store; the frontend serves HTTP: both listen.
        assert sockets["EngineCore_DP0"] and any(sockets.values()), sockets
        exposed = {n: s for n, s in sockets.items() if any(ip not in _LOOPBACK for ip, _ in s)}
        assert exposed == {}, f"listening beyond loopback: {exposed}"
    finally:
        srv.stop()
    assert srv.leftover_processes() == []
