"""The warm launcher (tidal/utils/forkserver.py) with real processes: children start from
the zygote, report their exit codes (signals included), each has its own process group,
its sentinel marks its exit, and a gone zygote fails a spawn at once."""

from __future__ import annotations

import os
import signal
from multiprocessing.connection import wait

import msgspec
import pytest

from tests.waiting import wait_until
from tidal.utils.forkserver import ForkServer

MODULE = "tests.distributed.forkserver_child"


@pytest.fixture
def server():
    s = ForkServer(MODULE, "TestZygote")
    yield s
    s.close()
    assert s._popen.poll() is not None  # the zygote is gone


def _spawn(server: ForkServer, path: str, seconds: float, code: int):
    return server.spawn("child", msgspec.msgpack.encode([path, seconds, code]))


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
