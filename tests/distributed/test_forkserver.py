"""The warm launcher (tidal/utils/forkserver.py) with real processes: children start from
the zygote, report their exit codes (signals included), each has its own process group,
its sentinel marks its exit, and a gone zygote fails a spawn at once. Faults: a spawn that
times out leaves no child (refused past its deadline, or killed by its cancel); the
children of a killed zygote live on and can still be signalled; a frozen zygote stops
answering its pings."""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import wait

import msgspec
import psutil
import pytest

from tests.waiting import wait_until
from tidal.utils.forkserver import EXIT_CODE_UNKNOWN, ForkServer

MODULE = "tests.distributed.forkserver_child"


@pytest.fixture
def server():
    s = ForkServer(MODULE, "TestZygote")
    yield s
    s.close()
    assert s._popen.poll() is not None  # the zygote is gone


def _spawn(server: ForkServer, path: str, seconds: float, code: int, timeout_s: float = 10.0):
    return server.spawn("child", msgspec.msgpack.encode([path, seconds, code]), timeout_s)


def _children(server: ForkServer) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.pid).children() if p.status() != "zombie"]


def _answered(server: ForkServer) -> bool:
    """Ping and wait for the pong (every request sent before it was handled)."""
    server.ping()
    return wait_until(lambda: not server.unresponsive(0.0), 60)


def _info(path: str) -> list[int]:
    assert wait_until(lambda: os.path.exists(path), 60), "the child never ran"
    with open(path) as f:
        return [int(x) for x in f.read().split()]


def test_children_run_report_exit_codes_and_their_sentinels_fire(server, tmp_path):
    procs = [_spawn(server, str(tmp_path / f"c{i}"), 0.0, i) for i in range(3)]
    for i, p in enumerate(procs):
        pid, ppid, pgid = _info(str(tmp_path / f"c{i}"))
        assert pid == p.pid and ppid == server.pid and pgid == pid  # own process group
        assert wait([p.sentinel], 60) == [p.sentinel]
        p.join(60)
        assert p.exitcode == i and not p.is_alive()
        p.close()


def test_a_killed_child_reports_the_signal_and_others_are_untouched(server, tmp_path):
    long = _spawn(server, str(tmp_path / "long"), 600.0, 0)
    other = _spawn(server, str(tmp_path / "other"), 600.0, 0)
    _info(str(tmp_path / "long"))
    _info(str(tmp_path / "other"))
    long.kill()
    long.join(60)
    assert long.exitcode == -signal.SIGKILL
    assert other.is_alive()
    other.terminate()
    other.join(60)
    assert other.exitcode == -signal.SIGTERM
    for p in (long, other):
        p.close()


def test_a_gone_zygote_fails_the_next_spawn_at_once(tmp_path):
    s = ForkServer(MODULE, "TestZygote")
    try:
        p = _spawn(s, str(tmp_path / "a"), 0.0, 0)  # proves it was up
        p.join(60)
        p.close()
        os.kill(s.pid, signal.SIGKILL)
        assert wait_until(lambda: not s.alive, 60)
        with pytest.raises(RuntimeError, match="fork server"):
            _spawn(s, str(tmp_path / "b"), 0.0, 0)
    finally:
        s.close()


def test_a_spawn_that_times_out_in_a_frozen_zygote_is_refused_when_it_wakes(server, tmp_path):
    assert server.wait_ready(60)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            _spawn(server, str(tmp_path / "late"), 600.0, 0, timeout_s=0.3)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert _answered(server)  # it read the spawn, past its deadline: no fork
    assert _children(server) == [] and not (tmp_path / "late").exists()
    p = _spawn(server, str(tmp_path / "next"), 0.0, 0)  # and it still serves
    p.join(60)
    assert p.exitcode == 0
    p.close()


def test_a_fork_that_lands_after_its_timeout_is_cancelled(monkeypatch, tmp_path):
    monkeypatch.setenv("FORKSERVER_CHILD_SLOW_FORK_S", "1.5")
    s = ForkServer(MODULE, "TestZygote")
    try:
        assert s.wait_ready(60)
        with pytest.raises(RuntimeError, match="did not start"):
            _spawn(s, str(tmp_path / "slow"), 600.0, 0, timeout_s=0.3)
        assert _answered(s)
        assert _children(s) == []  # forked after the timeout, then killed by the cancel
    finally:
        s.close()


def test_children_of_a_killed_zygote_live_on_and_can_be_stopped(tmp_path):
    s = ForkServer(MODULE, "TestZygote")
    try:
        p = _spawn(s, str(tmp_path / "orphan"), 600.0, 0)
        pid, _, _ = _info(str(tmp_path / "orphan"))
        os.kill(s.pid, signal.SIGKILL)
        assert wait_until(lambda: not s.alive, 60)
        assert p.is_alive() and psutil.pid_exists(pid)  # its launcher is not the zygote
        p.kill()  # by its pidfd: exactly that process
        p.join(60)
        assert not p.is_alive() and p.exitcode == EXIT_CODE_UNKNOWN  # nobody reaped it for us
        assert wait([p.sentinel], 60) == [p.sentinel]
        p.close()
    finally:
        s.close()


def test_a_frozen_zygote_stops_answering_its_pings(server):
    assert server.wait_ready(60)
    assert _answered(server)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        server.ping()
        assert wait_until(lambda: server.unresponsive(0.3), 60)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert _answered(server)


def test_wait_ready_waits_for_a_zygote_still_importing(tmp_path):
    s = ForkServer(MODULE, "TestZygote", env={"FORKSERVER_CHILD_IMPORT_S": "1.5"})
    try:
        assert not s.ready  # its "imports" take 1.5 s
        assert s.wait_ready(120)
        proc = _spawn(s, str(tmp_path / "child"), 0.0, 7)
        proc.join(30)
        assert proc.exitcode == 7
    finally:
        s.close()


def test_wait_ready_gives_up_at_once_when_the_zygote_dies_first():
    s = ForkServer(MODULE, "TestZygote", env={"FORKSERVER_CHILD_DIE_BEFORE_READY": "3"})
    try:
        waited = time.monotonic()
        assert not s.wait_ready(120)
        # Its death ended the wait, not the timeout (which would fail the test's own).
        assert time.monotonic() - waited < 60
        assert s._popen.wait(30) == 3
    finally:
        s.close()
