"""benchmarks/cpu_decode.py in process on the tiny checkpoint: the four sides run (every
layer as one call, each layer as one call, the plan piece by piece, the module path), their
tokens are compared, and the single stream's bandwidth fraction is reported per side."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

import pytest

from tidal.kernels.cpu_ext import kernel_available, kernel_status
from tidal.models.cpu_decode import Fusion

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_decode.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_cpu_decode", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_cpu_decode"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not kernel_available(), reason=kernel_status())
def test_measures_the_plan_against_the_module_path(bench, qwen3_ckpt):
    from tidal import LLM

    opts = argparse.Namespace(
        model=qwen3_ckpt, dtype="float32", rounds=2, single_tokens=5, batch=3, batch_tokens=4,
        prompt_len=6, threads=0, sum_mib=4,
    )  # fmt: skip
    with LLM(qwen3_ckpt, dtype="float32", multiprocess=False, enable_prefix_caching=False) as llm:
        out = bench.measure(llm, opts)
        plans = bench._model(llm).decode_plans
        assert plans.enabled and plans.fusion is Fusion.STACK  # restored after the sides
    assert len(out["read_bandwidth_gb_s"]) == 2 and out["decode_bytes_per_token"] > 0
    for case, streams in (("single", 1), ("batch", 3)):
        row = out["cases"][case]
        assert row["streams"] == streams and row["same_tokens"] is True
        assert all(len(row["ms_per_token"][side]) == 2 for side in bench.SIDES)
        assert row["ratio_plan_over_modules"] > 0 and row["ratio_layers_over_plan"] > 0
        assert row["ratio_stack_over_layers"] > 0
    assert set(out["cases"]["single"]["fraction_of_bandwidth"]) == set(bench.SIDES)
    assert set(bench.SIDES) == {"stack", "layers", "plan", "modules"}
