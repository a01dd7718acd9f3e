"""benchmarks/faults.py without processes: the pause each stream saw across the kill,
the first token of a request submitted after it, the requests in flight and lost, and
the targets."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH_DIR))  # faults.py imports its sibling elastic.py
    try:
        spec = importlib.util.spec_from_file_location("bench_faults", BENCH_DIR / "faults.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_faults"] = mod
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH_DIR))
    return mod


def _req(bench, stream, submitted, times, ok=True, error=None, deployment=0):
    r = bench.Req(stream, deployment, submitted, [(t, 1) for t in times])
    r.ok, r.error = ok, error
    r.done = times[-1] if times else submitted
    return r


def test_stream_pauses_span_request_boundaries(bench):
    reqs = [
        _req(bench, 0, 0.0, [1.0, 2.0]),  # stream 0: last token before the kill at 2.0
        _req(bench, 0, 2.0, [3.5, 3.6]),  # ... first after at 3.5
        _req(bench, 1, 0.0, [1.5, 4.0]),  # stream 1: one request across the kill
        _req(bench, 2, 2.6, [2.9]),  # no token before the kill: no pause
    ]
    assert bench.stream_pauses(reqs, 2.5) == [1.5, 2.5]


def test_in_flight_at_the_kill(bench):
    reqs = [
        _req(bench, 0, 1.0, [1.2, 3.0]),
        _req(bench, 1, 2.6, [2.8], deployment=1),
        _req(bench, 3, 2.0, [], ok=False, error="EngineDeadError: x"),
    ]
    hit = bench.in_flight_at(reqs, 2.5)
    assert [r.stream for r in hit] == [0]  # stream 3 ended (failed) at its submission


def test_probe_retries_until_a_first_token(bench):
    class Refusing:
        def generate(self, *a):
            raise RuntimeError("engine dead")

    class Serving:
        async def generate(self, *a):
            yield "token"

    async def main():
        llms = [None, Refusing(), Serving()]
        t0 = bench.time.monotonic()
        t = await bench.probe(lambda: llms.pop(0) if len(llms) > 1 else llms[0], 0.001)
        assert t >= t0 and llms and isinstance(llms[0], Serving)

    bench.asyncio.run(main())


def test_fault_row_counts_lost_and_targets(bench):
    reqs = [
        _req(bench, 0, 0.0, [1.0, 3.0]),  # 2 tokens: complete with max_tokens=2
        _req(bench, 1, 0.0, [1.0], ok=False, error="EngineDeadError: gone"),
        _req(bench, 2, 2.5, [2.6, 2.7]),
    ]
    reqs[1].done = 2.2  # failed after the kill
    row = bench.fault_row("restart", reqs, 2.0, 2, 2.6, {"detect_s": 0.1})
    assert row["in_flight_at_kill"] == 2 and row["lost"] == 1 and row["errors"] == 1
    assert row["new_requests_served_s"] == 0.6 and row["detect_s"] == 0.1
    assert row["max_stream_pause_s"] == 2.0  # stream 0: 1.0 -> 3.0
    t = bench.targets(row)
    assert t["new_requests_served_s"]["ok"] and not t["lost"]["ok"]
    ok = bench.targets({**row, "lost": 0, "errors": 0, "new_requests_served_s": 0.3})
    assert all(v["ok"] for v in ok.values())
    assert not bench.targets({**row, "new_requests_served_s": None})["new_requests_served_s"]["ok"]


def test_matrix_options(bench):
    opts = bench.parse_args(["--matrix"])
    assert opts.matrix and opts.targets == list(bench.TARGETS) and opts.faults == list(bench.FAULTS)
    cells = bench.matrix_cells(opts)
    # 7 process kinds x 3 faults, less a Ray node frozen for 5 s (Ray declares it dead).
    assert len(cells) == 20 and ("ray-node", "stop5") not in cells
    assert ("tp-worker", "stop5") in cells and ("ray-node", "stop") in cells
    assert (opts.streams, opts.warmup_s, opts.baseline_s) == (16, 1.0, 1.0)  # 20 deployments
    argv = ["--matrix", "--targets", "zygote", "--faults", "stop5", "--streams", "4"]
    opts = bench.parse_args(argv)
    assert (opts.targets, opts.faults, opts.streams) == (["zygote"], ["stop5"], 4)
    with pytest.raises(SystemExit):
        bench.parse_args(["--matrix", "--targets", "engine,frontend"])
    assert bench.parse_args([]).streams == 32  # the single-kill run keeps its load


def test_until_waits_for_a_condition_or_gives_up(bench):
    async def main():
        flips = iter([False, False, True])
        assert await bench._until(lambda: next(flips), 60)
        assert not await bench._until(lambda: False, 0.01)

    bench.asyncio.run(main())
