"""``launch --dp 2`` end to end: balancing, /stats, and ranks joined headless over TCP."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import psutil

from tests.e2e.server_utils import RemoteServer, free_port


def _complete(url: str, prompt: str, **kw) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _serve_and_check(url: str, dp: int) -> None:
    single = _complete(url, "The tide comes in")["choices"][0]["text"]
    # Explicit rank: the same greedy text from every rank.
    for rank in range(dp):
        got = _complete(url, "The tide comes in", data_parallel_rank=rank)["choices"][0]["text"]
        assert got == single
    for i in range(6):
        _complete(url, f"prompt number {i}")
    stats = httpx.get(url + "/stats", timeout=10).json()
    assert stats["data_parallel_size"] == dp
    assert [r["rank"] for r in stats["ranks"]] == list(range(dp))
    totals = [r["requests_total"] for r in stats["ranks"]]
    assert sum(totals) >= dp + 7 and all(t >= 1 for t in totals), totals
    assert stats["wave"] >= 0 and isinstance(stats["engines_running"], bool)
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert 'dp_rank="1"' in metrics


def test_launch_dp2(qwen3_ckpt):
    srv = RemoteServer(["--model", qwen3_ckpt, "--dp", "2", "--log-level", "warning"])
    try:
        assert len(srv.engine_processes()) == 2
        _serve_and_check(srv.url, 2)
    finally:
        srv.stop()
    assert srv.leftover_processes() == []


def test_headless_rank_joins_over_tcp(qwen3_ckpt):
    rpc = free_port()
    common = [
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
    ]
    headless = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tidal.launch.cli",
            "serve",
            *common,
            "--headless",
            "--data-parallel-start-rank",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        srv = RemoteServer([*common, "--log-level", "warning"])
        try:
            assert len(srv.engine_processes()) == 1  # rank 1 lives in the headless launcher
            _serve_and_check(srv.url, 2)
        finally:
            srv.stop()
        assert srv.leftover_processes() == []
    finally:
        children = psutil.Process(headless.pid).children(recursive=True)
        headless.terminate()
        headless.wait(30)
        deadline = time.monotonic() + 10
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children):
            assert time.monotonic() < deadline, "headless ranks left behind"
            time.sleep(0.2)


def test_mismatched_rank_fails_fast(qwen3_ckpt):
    """A headless rank started with different parallel flags is refused with a clear error."""
    rpc = free_port()
    common = [
        "--model",
        qwen3_ckpt,
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc),
        "--data-parallel-size-local",
        "1",
    ]
    headless = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tidal.launch.cli",
            "serve",
            *common,
            "--dp",
            "2",
            "--headless",
            "--data-parallel-start-rank",
            "1",
            "--all2all-backend",
            "all2all",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    port = free_port()
    front = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tidal.launch.cli",
            "serve",
            *common,
            "--dp",
            "2",
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = front.communicate(timeout=120)
        assert front.returncode != 0
        assert "parallel config" in out
    finally:
        for p in (front, headless):
            if p.poll() is None:
                p.kill()
            p.wait(30)


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
        stats = httpx.get(srv.url + "/stats", timeout=10).json()
        load = stats["expert_load"]
        assert sorted(load) == ["0", "1"]  # the tiny model's two MoE layers
        assert all(len(c) == 8 for c in load.values()) and sum(load["0"]) > 0
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'tidal:expert_load_tokens{expert="0",layer="0"}' in metrics
    finally:
        srv.stop()
    assert srv.leftover_processes() == []
