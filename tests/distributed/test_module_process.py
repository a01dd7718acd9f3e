"""``ModuleProcess``: a child that runs a module, not the caller's ``__main__``, with the
process interface the engine manager relies on. Real processes; each one is stopped."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from multiprocessing.connection import wait

import msgspec
import psutil
import pytest

from tests.waiting import wait_until
from tidal.utils import procs
from tidal.utils.procs import ModuleProcess

pytestmark = pytest.mark.timeout(120)
DEADLINE_S = 60.0


@pytest.fixture(params=["pidfd", "pipe"])
def sentinel_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "pidfd" and not procs._pidfd_supported():
        pytest.skip("no pidfd_open on this system")
    if request.param == "pipe":
        monkeypatch.setattr(procs, "_pidfd_supported", lambda: False)
    return request.param


@pytest.fixture
def started() -> Iterator[list[ModuleProcess]]:
    children: list[ModuleProcess] = []
    yield children
    for p in children:
        p.kill()
        p.join(DEADLINE_S)
        p.close()


def _start(
    started: list[ModuleProcess],
    name: str,
    exit_code: int | None,
    env: dict[str, str] | None = None,
) -> tuple[ModuleProcess, dict]:
    r, w = os.pipe()
    launch = {"report_fd": w, "exit_code": exit_code, "x": [1.5, "é"], "env_keys": list(env or {})}
    try:
        p = ModuleProcess(
            "module_process_child", name, msgspec.msgpack.encode(launch), pass_fds=[w], env=env
        )
    finally:
        os.close(w)
    started.append(p)
    with os.fdopen(r, "rb") as f:
        report = msgspec.msgpack.decode(f.read())  # EOF once the child closed its end
    return p, report


def test_child_runs_the_module_not_our_main(
    started: list[ModuleProcess], sentinel_kind: str
) -> None:
    p, report = _start(started, "TidalTestChild", exit_code=None)
    assert report["name"] == "TidalTestChild" and report["argv"] == ["TidalTestChild"]
    assert report["launch"]["x"] == [1.5, "é"]
    assert report["main"] == "module_process_child"  # found through our sys.path
    assert report["main_files"] == [
        os.path.join(os.path.dirname(__file__), "module_process_child.py")
    ]
    assert report["pgid"] == p.pid  # its own process group: a terminal's Ctrl-C is ours alone
    assert psutil.Process(p.pid).name() == "TidalTestChild"
    assert p.is_alive() and p.exitcode is None
    assert wait([p.sentinel], timeout=0) == []
    p.join(0)  # returns at its timeout without raising, like Process.join
    assert p.is_alive()

    p.terminate()
    assert wait([p.sentinel], timeout=DEADLINE_S) == [p.sentinel]
    p.join(DEADLINE_S)
    assert not p.is_alive() and p.exitcode == -signal.SIGTERM
    p.close()
    p.close()  # idempotent
    p.terminate()  # a no-op once reaped
    with pytest.raises(ProcessLookupError):
        os.kill(p.pid, 0)


def test_child_gets_the_added_environment(started: list[ModuleProcess]) -> None:
    """What an engine's OpenMP runtime must find at start (tidal/utils/cpu_threads.py) is
    in the child's environment from its first instruction, beside the inherited one."""
    env = {"GOMP_SPINCOUNT": "1000", "TIDAL_TEST_MARK": "x"}
    _, report = _start(started, "TidalTestEnv", exit_code=0, env=env)
    assert report["env"] == env
    assert "PATH" in os.environ  # inherited too: the child found python's modules


def test_exit_code_and_kill(started: list[ModuleProcess], sentinel_kind: str) -> None:
    p, _ = _start(started, "TidalTestExit", exit_code=3)
    assert wait([p.sentinel], timeout=DEADLINE_S) == [p.sentinel]
    p.join(DEADLINE_S)
    assert p.exitcode == 3

    q, _ = _start(started, "TidalTestKill", exit_code=None)
    q.kill()
    q.join(DEADLINE_S)
    assert q.exitcode == -signal.SIGKILL


def test_a_process_watch_sees_a_launcher_that_is_not_the_parent_exit(
    started: list[ModuleProcess], sentinel_kind: str
) -> None:
    """A warm launcher's fork watches the frontend that asked for it, not its parent."""
    p, _ = _start(started, "Watched", exit_code=None)  # stands for the frontend
    watch = procs.ProcessWatch(p.pid)
    mine = procs.ProcessWatch()  # our parent (pytest's runner): alive
    try:
        assert not watch.gone() and not mine.gone()
        assert (watch.fileno is not None) == (sentinel_kind == "pidfd")
        p.kill()
        p.join(DEADLINE_S)
        assert wait_until(watch.gone, DEADLINE_S) and watch.gone()  # and it stays gone
        assert not mine.gone()
    finally:
        watch.close()
        mine.close()
