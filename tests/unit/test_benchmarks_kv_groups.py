"""benchmarks/kv_groups.py in process on the tiny GPT-OSS checkpoint: the workload runs to
the end and its counts come from the engine (what a CI run of the script relies on)."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "kv_groups.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kv_groups", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_kv_groups"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_runs_the_workload_and_reports_the_groups(bench, tiny_ckpt):
    # 3 requests of 40 + 4 tokens (3 blocks of 16 per group) in 12 blocks of one layer
    # (256 bytes a token): not all at once.
    args = argparse.Namespace(requests=3, prompt=40, max_tokens=4, budget=32, kv_bytes=12 * 16 * 256)
    out = bench.measure(tiny_ckpt("gpt_oss"), args)
    assert out["num_blocks"] == 12 and out["tokens_without_freeing"] == 11 // 2 * 16
    sliding, full = out["kv_groups"]
    assert sliding["window_freed_blocks"] > 0 and full["window_freed_blocks"] == 0
    assert sliding["blocks"] == full["blocks"] == 0  # every request finished
    assert 1 <= out["most_running"] <= 3 and out["steps"] > 4 and out["output_tok_s"] > 0


def test_bad_counts_are_refused_by_flag(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--requests", "0"])
    assert "--requests" in capsys.readouterr().err
