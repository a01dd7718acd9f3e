"""``MultiprocExecutor`` on its own (TP=2, one rank, real worker processes): the workers
name themselves, a frozen worker (SIGSTOP) is the rank's death like a dead one, and
/dev/shm too small fails the start with the bytes it needs -- nothing left behind either
way (processes, segment, socket directory). On CPU the workers start with the engine
processes' OpenMP policy and their share of the cores, and serve by TP rank 0's CPU path
choices, measured on the shard's shapes. A start removes what
engines killed during theirs left (ring names, socket directories), never a live
engine's; heartbeats asking the executor during its shutdown neither fail nor crash it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import psutil
import pytest

from tests.distributed.test_shm_queue import leftover_segments
from tests.waiting import wait_until
from tidal.distributed import shm_queue


def _config(path: str, **kw):
    from tidal.launch.engine_args import EngineArgs

    return EngineArgs(
        model=path, dtype="float32", device="cpu", tensor_parallel_size=2,
        num_gpu_blocks_override=32, block_size=4, max_model_len=64, **kw,
    ).create_engine_config()  # fmt: skip


def _socket_dirs() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("tidal-tp-")}


def _segments() -> set[str]:
    return leftover_segments()


def test_a_stopped_worker_is_the_ranks_death(qwen3_ckpt, monkeypatch):
    from tidal.executor import multiproc
    from tidal.executor.multiproc import MultiprocExecutor, WorkerDied

    monkeypatch.setattr(multiproc, "FREEZE_TIMEOUT_S", 1.0)  # the monitor runs here

    dirs, segs = _socket_dirs(), _segments()
    ex = MultiprocExecutor(_config(qwen3_ckpt))
    try:
        pids = ex.worker_pids()
        names = [psutil.Process(p).name() for p in pids]
        assert names == ["Worker_DP0_TP0", "Worker_DP0_TP1"]
        assert ex.call("runner.determine_num_blocks") == 32
        assert _segments() == segs  # unlinked by its creator as soon as the workers had it
        failed = threading.Event()
        reasons: list[str] = []

        def on_failure(why: str) -> None:
            reasons.append(why)
            failed.set()

        ex.register_failure_callback(on_failure)
        os.kill(pids[1], signal.SIGSTOP)
        assert failed.wait(120)
        assert "worker 1" in reasons[0] and "stopped" in reasons[0]
        assert wait_until(lambda: not any(psutil.pid_exists(p) and _running(p) for p in pids))
        with pytest.raises(WorkerDied, match="stopped"):
            ex.call("runner.determine_num_blocks")
    finally:
        ex.shutdown()
    # None new (a start also removes what dead engines left, not ours to count).
    assert _socket_dirs() <= dirs and _segments() <= segs


def test_workers_yield_their_cores_and_serve_by_rank_zeros_choice(
    qwen3_ckpt, tmp_path, monkeypatch
):
    from transformers import AutoConfig

    from tidal.executor.multiproc import MultiprocExecutor
    from tidal.executor.rpc import Reduce
    from tidal.utils import cpu_threads

    for var in cpu_threads.ENGINE_VARS:
        monkeypatch.delenv(var, raising=False)  # the engine's defaults, not an operator's
    ex = MultiprocExecutor(_config(qwen3_ckpt, kernel_cache_dir=str(tmp_path)))
    try:
        envs = [psutil.Process(p).environ() for p in ex.worker_pids()]
        reports = ex.call("worker.get_cpu_kernels", reduce=Reduce.EACH)
    finally:
        ex.shutdown()
    share = str(cpu_threads.threads_per_rank(cpu_threads.usable_cores(), 2))
    for env in envs:
        assert env.get("GOMP_SPINCOUNT") == str(cpu_threads.SPIN_COUNT)
        assert env.get("KMP_BLOCKTIME") == "0"
        assert env.get("OMP_NUM_THREADS") == share
    lead, peer = reports
    assert lead["spin_pool_us"] == peer["spin_pool_us"] == cpu_threads.POOL_SPIN_US  # own pool
    assert lead["chosen_by"] is None and peer["chosen_by"] == "TP rank 0"
    assert lead["cache_file"] and peer["cache_file"] is None  # only the driver measures
    pick = ("decode", "batch", "layout")
    assert {k: [c[f] for f in pick] for k, c in lead["ops"].items()} == {
        k: [c[f] for f in pick] for k, c in peer["ops"].items()
    }
    hf = AutoConfig.from_pretrained(qwen3_ckpt)
    dh = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    o_proj = f"linear[{hf.num_attention_heads * dh // 2}x{hf.hidden_size}x0]"  # row shard
    experts = f"moe[{hf.num_experts}x{hf.hidden_size}x{hf.moe_intermediate_size // 2}x"
    assert o_proj in lead["ops"], sorted(lead["ops"])
    assert any(k.startswith(experts) for k in lead["ops"]), sorted(lead["ops"])


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_dev_shm_too_small_fails_the_start_naming_the_bytes(qwen3_ckpt, monkeypatch):
    from tidal.executor.multiproc import MultiprocExecutor

    class Tiny:
        f_bavail, f_frsize = 1, 4096

    real = os.statvfs
    monkeypatch.setattr(
        shm_queue.os, "statvfs", lambda p: Tiny() if p == shm_queue.SHM_DIR else real(p)
    )
    dirs = _socket_dirs()
    children = set(psutil.Process().children())
    need = shm_queue.segment_bytes(2, shm_queue.DEFAULT_NUM_CHUNKS, shm_queue.DEFAULT_CHUNK_BYTES)
    with pytest.raises(shm_queue.ShmTooSmall, match=f"needs {need} bytes"):
        MultiprocExecutor(_config(qwen3_ckpt))
    assert _socket_dirs() <= dirs
    assert set(psutil.Process().children()) == children  # no worker was started


def test_heartbeats_asking_during_shutdown_neither_fail_nor_crash(qwen3_ckpt):
    """The engine's output thread asks ``worker.waiting_on_peers`` for every heartbeat, also while
    the busy loop shuts the executor down and after: each answer is False, never an error
    (which would end the output thread and report the engine dead) nor a crash (a send
    into the unmapped ring)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.distributed.heartbeat_shutdown_child", qwen3_ckpt],
        capture_output=True, text=True, env=env, cwd=root, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["started"] and report["asked_after"], report
    assert report["errors"] == [] and not report["waiting"], report


def test_a_start_removes_what_dead_engines_left_and_nothing_of_live_ones(qwen3_ckpt):
    """An engine killed during its TP startup leaves its ring's name in /dev/shm and its
    socket directory, both named with its pid: the next start removes those, and leaves
    a live owner's alone."""
    from tidal.executor.multiproc import SOCKET_DIR_PREFIX, MultiprocExecutor

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(60)
    dead, live = gone.pid, os.getpid()  # the test process owns the live ones
    tmp = tempfile.gettempdir()
    paths = {
        (owner, kind): os.path.join(where, f"{prefix}{owner}-{os.urandom(4).hex()}")
        for owner in (dead, live)
        for kind, where, prefix in (
            ("segment", shm_queue.SHM_DIR, shm_queue.NAME_PREFIX),
            ("dir", tmp, SOCKET_DIR_PREFIX),
        )
    }
    try:
        for (_, kind), path in paths.items():
            if kind == "dir":
                os.mkdir(path)
                path = os.path.join(path, "replies")
            with open(path, "wb") as f:
                f.write(b"left behind")
        ex = MultiprocExecutor(_config(qwen3_ckpt))
        ex.shutdown()
        left = {key for key, path in paths.items() if os.path.exists(path)}
        assert left == {(live, "segment"), (live, "dir")}
    finally:
        for (_, kind), path in paths.items():
            if kind == "dir":
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
