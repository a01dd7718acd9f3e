"""benchmarks/soak.py without a server: the slope of a process's samples and which
processes the summary keeps."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_soak", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_soak"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_slope_per_minute(bench):
    # 2 units a second is 120 a minute, whatever the offset.
    assert bench.slope_per_min([(t, 5 + 2 * t) for t in range(10)]) == pytest.approx(120.0)
    assert bench.slope_per_min([(t, 7.0) for t in range(10)]) == pytest.approx(0.0)
    assert bench.slope_per_min([(0, 1.0), (1, 2.0)]) is None  # too few points
    assert bench.slope_per_min([(3, 1.0), (3, 2.0), (3, 4.0)]) is None  # one instant


def test_summary_keeps_long_lived_processes_after_warmup(bench):
    long = bench.ProcSeries("server")
    short = bench.ProcSeries("EngineCore_DP1")
    for t in range(0, 100, 5):
        long.points_rss.append((t, 100 * 2**20 + t * 2**20))  # 1 MiB a second
        long.points_fds.append((t, 40.0 if t < 20 else 50.0))  # warm-up opens 10
    for t in range(60, 75, 5):  # a replacement engine, alive 15 s of a 100 s run
        short.points_rss.append((t, 1.0))
        short.points_fds.append((t, 1.0))
    rows = bench.summarize_procs({(1, 0.0): long, (2, 0.0): short}, t_warm=20, duration_s=100)
    assert [r["name"] for r in rows] == ["server"]
    (row,) = rows
    assert row["rss_mib_first"] == 120.0 and row["rss_mib_per_min"] == pytest.approx(60.0)
    assert (row["fds_first"], row["fds_last"], row["fds_per_min"]) == (50, 50, 0.0)
