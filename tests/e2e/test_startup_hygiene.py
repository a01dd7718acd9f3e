"""A deployment's startup and what it exposes: every TCP socket of a ``-tp 2`` server (its
frontend, engine and TP workers) listens on loopback only, the rank's TCPStore included;
an engine that cannot load its checkpoint (a truncated safetensors file) fails ``launch``
within a deadline, naming the file, with nothing left behind (processes, /dev/shm
segments, socket directories), alone, with TP workers and beside another rank (``--dp
2``)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import psutil
import pytest

from tests.e2e.server_utils import RemoteServer, is_alive
from tests.waiting import wait_until
from tidal.distributed.shm_queue import NAME_PREFIX, SHM_DIR

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


# ---- an engine that fails during its start ---------------------------------------------


@pytest.fixture(scope="module")
def truncated_ckpt(qwen3_ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The path of the safetensors file of a copy of the tiny checkpoint, cut in half (its
    header intact)."""
    path = str(tmp_path_factory.mktemp("truncated") / "ckpt")
    shutil.copytree(qwen3_ckpt, path)
    weights = os.path.join(path, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    return weights


def _orphaned_segments(before: set[str]) -> set[str]:
    """Segments made since ``before`` whose creator is gone (a live one is another run's,
    still starting: its creator unlinks it)."""
    out = set()
    for name in set(os.listdir(SHM_DIR)) - before:
        if name.startswith(NAME_PREFIX):
            pid = int(name[len(NAME_PREFIX) :].split("-", 1)[0])
            if not psutil.pid_exists(pid):
                out.add(name)
    return out


def _tidal_processes_of(session: int) -> list[psutil.Process]:
    """Processes still in the launcher's session (its engines and workers, any
    coordinator): it was started in a session of its own."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == session and is_alive(p):
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


@pytest.fixture
def private_tmp() -> Iterator[str]:
    """A TMPDIR of the test's own, where only its launch's directories can appear (short:
    ipc:// paths in it must fit a socket address)."""
    path = tempfile.mkdtemp(prefix="tidal-test-tmp-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    "extra", [[], ["-tp", "2"], ["--data-parallel-size", "2"]], ids=["dp1", "tp2", "dp2"]
)
def test_an_engine_failing_its_start_fails_launch_leaving_nothing(
    truncated_ckpt, private_tmp, extra
):
    env = {**os.environ, "TMPDIR": private_tmp}
    segments = set(os.listdir(SHM_DIR))
    cmd = [
        sys.executable, "-m", "tidal.launch.cli", "serve", "--port", "0", "--host", "127.0.0.1",
        "--model", os.path.dirname(truncated_ckpt), "--dtype", "float32", "--device", "cpu",
        "--log-level", "warning", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        # Generous: a hang (the failure this guards against) never ends by itself.
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(30)
    assert proc.returncode != 0, err
    assert truncated_ckpt in err and "truncated" in err, err
    assert wait_until(lambda: not _tidal_processes_of(proc.pid), 60), _tidal_processes_of(proc.pid)
    assert glob.glob(os.path.join(private_tmp, "tidal-*")) == []
    assert _orphaned_segments(segments) == set()
