"""benchmarks/gpu_proof.sh rehearsed on the CPU (SMOKE=1: toy shapes, the Triton
interpreter): the script the GPU machine runs in one call must not rot where CI has no GPU.
Its parts, its merge, the names of what it leaves in $OUT (the device tool returns plain
names only) and a step that fails being recorded rather than ending the run."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_proof.sh"
PLAIN_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _run(out: pathlib.Path, steps: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SMOKE": "1", "STEPS": steps, "OUT": str(out)}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
def test_smoke_run_writes_parts_merge_and_a_config(tmp_path):
    configs = set((ROOT / "tidal" / "kernels" / "configs").iterdir())
    proc = _run(tmp_path, "facts moe")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert all(PLAIN_NAME.match(n) for n in names), names
    merged = json.loads(next(tmp_path.glob("gpu-*.json")).read_text())
    assert merged["facts"]["ok"] and merged["moe"]["ok"], merged
    # Steps not asked for are recorded as not run, not silently absent.
    assert merged["engine"] == {"step": "engine", "ok": False, "error": "not run (time box or crash)"}
    cases = merged["moe"]["cases"]
    assert [c["T"] for c in cases] == [1, 8]
    for case in cases:  # the interpreter's kernel and the torch path agree with the reference
        assert case["triton_default"]["rel_err"] < 1e-4
        assert case["torch_auto"]["rel_err"] < 1e-4
    table = json.loads((tmp_path / "tuned_moe_config.json").read_text())
    assert sorted(table) == ["1", "8"]
    # A rehearsal never drops its toy table among the shipped ones.
    assert set((ROOT / "tidal" / "kernels" / "configs").iterdir()) == configs


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
def test_a_failing_step_is_recorded_and_the_merge_still_runs(tmp_path):
    bad = [sys.executable, str(ROOT / "benchmarks" / "gpu_proof.py"), "facts", "--out",
           str(tmp_path / "facts.json")]  # fmt: skip
    # The CUDA facts on a machine without CUDA: the step records the error and exits 0.
    proc = subprocess.run(bad, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts["ok"] is False and facts["error"] and "traceback" in facts
