"""``launch --dp 2`` end to end: balancing, /stats, and ranks joined headless over TCP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.e2e.server_utils import (
    PortConflict,
    RemoteServer,
    is_alive,
    is_port_conflict,
    retry_port_conflicts,
)
from tidal.utils.cpu_threads import SPIN_COUNT


def _complete(url: str, prompt: str, **kw) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _serve_and_check(url: str, dp: int, ranks_per_host: int | None = None) -> None:
    single = _complete(url, "The tide comes in")["choices"][0]["text"]
    # Explicit rank: the same greedy text from every rank.
    for rank in range(dp):
        got = _complete(url, "The tide comes in", data_parallel_rank=rank)["choices"][0]["text"]
        assert got == single
    for i in range(6):
        _complete(url, f"prompt number {i}")
    stats = httpx.get(url + "/stats", timeout=60).json()
    assert stats["data_parallel_size"] == dp
    assert [r["rank"] for r in stats["ranks"]] == list(range(dp))
    # The launch topology: epoch 0, engine ids 0..dp-1 in rank order (docs/architecture.md#elastic-identity).
    assert stats["epoch"] == 0
    assert [r["engine_id"] for r in stats["ranks"]] == list(range(dp))
    # Where each rank runs (docs/architecture.md#launchers): with the mp launcher, its host's name (the
    # headless host here is this machine too) and its engine process.
    assert [r["node"] for r in stats["ranks"]] == [socket.gethostname()] * dp
    assert all(psutil.pid_exists(r["pid"]) for r in stats["ranks"])
    totals = [r["requests_total"] for r in stats["ranks"]]
    assert sum(totals) >= dp + 7 and all(t >= 1 for t in totals), totals
    assert stats["wave"] >= 0 and isinstance(stats["engines_running"], bool)
    # Each rank's KV cache: K and V per head (docs/architecture.md#kv-cache-layouts).
    assert len(stats["kv_cache"]) == dp
    for kv in stats["kv_cache"]:
        assert kv["layout"] == "kv" and kv["num_blocks"] > 1
        elem = kv["bytes_per_token"] // (kv["num_layers"] * kv["values_per_token_per_layer"])
        assert elem in (2, 4)  # bytes of the model dtype
    # Each rank's measured CPU path per op, with the timings it was chosen by.
    assert len(stats["cpu_kernels"]) == dp
    for rank in stats["cpu_kernels"]:
        # Each rank takes its share of its host's cores (a headless host: its own ranks').
        share = len(os.sched_getaffinity(0)) // (ranks_per_host or dp)
        assert rank["threads"] == max(1, share)
        # --cpu-affinity auto: several ranks on a host with a core each are pinned to
        # their own group of cores (tidal/distributed/core_slots.py).
        assert rank["pinned"] == (share >= 1 and (ranks_per_host or dp) >= 2)
        assert len(rank["cores"]) == (share if rank["pinned"] else len(os.sched_getaffinity(0)))
        moe = next(v for k, v in rank["ops"].items() if k.startswith("moe["))
        assert moe["decode"] and moe["batch"] and moe["source"] in ("measured", "cached")
        assert moe["decode"] in moe["timings_ms"]["decode"]
    pinned = [set(r["cores"]) for r in stats["cpu_kernels"] if r["pinned"]]
    if ranks_per_host is None:  # one host: its ranks' groups are disjoint
        assert sum(map(len, pinned)) == len(set().union(*pinned))
    metrics = httpx.get(url + "/metrics", timeout=60).text
    assert 'engine="1"' in metrics  # labelled by engine id (docs/architecture.md#elastic-identity)


def test_launch_dp2(qwen3_ckpt):
    srv = RemoteServer(["--model", qwen3_ckpt, "--dp", "2", "--log-level", "warning"])
    try:
        engines = srv.engine_processes()
        assert len(engines) == 2
        if not any(v in os.environ for v in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
            # Ranks beside a frontend spin briefly, then sleep (tidal/utils/cpu_threads.py).
            assert all(p.environ().get("GOMP_SPINCOUNT") == str(SPIN_COUNT) for p in engines)
        _serve_and_check(srv.url, 2)
    finally:
        srv.stop()
    assert srv.leftover_processes() == []


def _serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tidal.launch.cli", "serve", *args]


def _stop_group(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM a launcher started with ``start_new_session``; SIGKILL its whole process group
    if it hangs; then wait until every process of the group is gone."""
    try:
        members = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        members = []
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    procs = []
    for pid in members[1:]:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + timeout_s
    while any(is_alive(p) for p in procs):
        if time.monotonic() > deadline:
            for p in procs:
                if is_alive(p):
                    p.kill()
            raise AssertionError("processes left behind by a launcher")
        time.sleep(0.2)


def _start_headless(common: list[str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        _serve_cmd(*common, "--headless", "--data-parallel-start-rank", "1", *extra),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _headless_common(qwen3_ckpt: str, rpc: int) -> list[str]:
    return [
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
        # The TCP control plane is authenticated: every host gets the same secret.
        "--data-parallel-auth-key",
        "e2e-test-secret-0123456789",
    ]


def test_headless_rank_joins_over_tcp(qwen3_ckpt):
    def start(rpc: int) -> tuple[subprocess.Popen, RemoteServer]:
        common = _headless_common(qwen3_ckpt, rpc)
        headless = _start_headless(common)
        try:
            return headless, RemoteServer([*common, "--log-level", "warning"])
        except BaseException:
            _stop_group(headless)
            raise

    # The RPC port must be known to both launchers before the frontend binds it.
    headless, srv = retry_port_conflicts(start)
    try:
        try:
            assert len(srv.engine_processes()) == 1  # rank 1 lives in the headless launcher
            _serve_and_check(srv.url, 2, ranks_per_host=1)
        finally:
            srv.stop()
        assert srv.leftover_processes() == []
    finally:
        _stop_group(headless)


def test_mismatched_rank_fails_fast(qwen3_ckpt):
    """A headless rank started with different parallel flags is refused with a clear error."""

    def attempt(rpc: int) -> tuple[int, str]:
        common = _headless_common(qwen3_ckpt, rpc)
        headless = _start_headless(common, "--all2all-backend", "all2all")
        front = None
        try:
            front = subprocess.Popen(
                _serve_cmd(*common, "--port", "0"),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            out, _ = front.communicate(timeout=240)
        finally:
            for p in (front, headless):
                if p is not None:
                    _stop_group(p)
        if is_port_conflict(out):
            raise PortConflict(out)
        return front.returncode, out

    code, out = retry_port_conflicts(attempt)
    assert code != 0
    assert "config mismatch" in out


def test_launch_dp2_ep_exposes_expert_load(qwen3_ckpt):
    srv = RemoteServer(
        [
            "--model",
            qwen3_ckpt,
            "--dp",
            "2",
            "--ep",
            "--all2all-backend",
            "all2all",
            "--log-level",
            "warning",
        ]
    )
    try:
        _serve_and_check(srv.url, 2)
        stats = httpx.get(srv.url + "/stats", timeout=60).json()
        load = stats["expert_load"]
        assert sorted(load) == ["0", "1"]  # the tiny model's two MoE layers
        assert all(len(c) == 8 for c in load.values()) and sum(load["0"]) > 0
        # Per engine: its experts' tokens; every routed token is computed on one engine.
        by_engine = stats["expert_load_by_engine"]
        assert sorted(by_engine) == ["0", "1"] and all(n > 0 for n in by_engine.values())
        assert sum(by_engine.values()) == pytest.approx(sum(map(sum, load.values())), abs=0.5)
        metrics = httpx.get(srv.url + "/metrics", timeout=60).text
        assert 'tidal:expert_load_tokens{expert="0",layer="0"}' in metrics
        assert 'tidal:expert_load_rank_tokens{engine="1"}' in metrics
    finally:
        srv.stop()
    assert srv.leftover_processes() == []
