"""benchmarks/host_overhead.py in process on the tiny checkpoint: the null model stands in
for the real one and steady decode keeps every request running (what the CI run relies on)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "host_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_host_overhead", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_host_overhead"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("async_scheduling", "sizes"), [(False, [1, 3]), (True, [3])])
def test_measures_steady_decode_against_the_null_model(
    bench, qwen3_ckpt, async_scheduling, sizes
):
    out = bench.measure(
        qwen3_ckpt, sizes, steps=2, repeats=2, random=True, profile=0,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    assert set(out) == {str(n) for n in sizes}
    for n, row in out.items():
        assert len(row["windows_us"]) == 2 and all(w > 0 for w in row["windows_us"])
        assert row["us_per_request_step"] == pytest.approx(row["us_per_step"] / int(n), abs=0.1)


def test_bad_sizes_are_refused_by_flag(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--sizes", "0"])
    assert "--sizes" in capsys.readouterr().err
