"""benchmarks/gpu_engine.py rehearsed on the CPU through gpu_proof.sh (SMOKE=1: the tiny
model, the emulating graph backend): the decode-graph run the GPU machine gets in one
call must not rot where CI has no GPU."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_run_measures_floor_steps_and_greedy_equality(tmp_path):
    env = {**os.environ, "SMOKE": "1", "STEPS": "graphs", "OUT": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_proof.sh")],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    merged = json.loads(next(tmp_path.glob("gpu-*.json")).read_text())
    got = merged["graphs"]
    assert got["ok"], got
    assert got["graphs"]["backend"] == "emulated" and got["graphs"]["capture_failed"] == []
    assert [row["B"] for row in got["steps"]] == [1, 4]
    for row in got["steps"]:
        assert row["F_ms"] > 0 and row["S_eager_ms"] > 0 and row["S_graphs_ms"] > 0
        assert row["S_graphs_async_ms"] > 0
        assert row["bytes"]["experts"] > 0 and row["bytes"]["kv"] > 0
    assert got["graph_hit_rate"] == 1.0  # steady decode, async too: every step replayed
    for mode in ("graphs", "graphs_async"):
        greedy = got[f"greedy_{mode}_vs_eager"]
        assert greedy["identical"] == greedy["prompts"], greedy
