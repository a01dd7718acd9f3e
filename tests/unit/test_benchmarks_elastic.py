"""benchmarks/elastic.py without processes: gaps per request, the commit pause taken from
the record's COMMITTING window, lost/error counts, the targets, and the load generator
(refusals without a deployment, requests killed at a stop) against a fake engine."""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib
import sys
from types import SimpleNamespace

import pytest

BENCH_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "elastic.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_elastic", BENCH_PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_elastic"] = mod  # dataclasses resolve annotations via the module
    spec.loader.exec_module(mod)
    return mod


def _req(bench, submitted, times, ok=True, error=None, n=1):
    r = bench.Req(0, 0, submitted, [(t, n) for t in times])
    r.ok, r.error, r.done = ok, error, times[-1] if times else submitted
    return r


def _record(**kw):
    rec = {
        "from_size": 2,
        "to_size": 3,
        "result": "succeeded",
        "cause": None,
        "started_at": 10.0,
        "finished_at": 14.0,
        "duration_s": 4.0,
        "phase_durations_s": {
            "planned": 0.0,
            "starting_engines": 2.5,
            "preparing": 1.0,
            "committing": 0.4,
            "finishing": 0.1,
        },
        "requests_migrated": 0,
        "experts_moved": 5,
        "bytes_moved": 500,
        "min_bytes": 500,
        "p2p_bytes": 500,
        "disk_bytes": 0,
        "warnings": [],
    }
    rec.update(kw)
    return rec


def test_gaps_start_at_submission_and_percentiles(bench):
    r = _req(bench, 1.0, [1.5, 1.6, 2.0])
    assert r.gaps() == [(1.0, 1.5), (1.5, 1.6), (1.6, 2.0)]
    assert r.tokens == 3 and r.complete(3) and not r.complete(4)
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bench.percentile([], 99) is None
    assert bench.gaps_ending_in([r], 1.55, 2.0) == pytest.approx([0.1, 0.4])
    assert bench.tokens_in([r], 1.5, 1.6) == 2


def test_phase_windows_are_contiguous_from_started_at(bench):
    w = bench.phase_windows(_record())
    assert w["starting_engines"] == (10.0, 12.5)
    assert w["committing"] == pytest.approx((13.5, 13.9))
    assert w["finishing"] == pytest.approx((13.9, 14.0))


def test_commit_pause_is_the_longest_gap_overlapping_the_commit(bench):
    reqs = [
        # A 0.9 s gap across the commit window [13.5, 13.9].
        _req(bench, 12.0, [12.1, 13.2, 14.1, 14.2]),
        # A longer gap during prepare only: the op's max gap, not the commit pause.
        _req(bench, 11.0, [11.1, 12.6, 12.7]),
        # Lost: raised mid-operation with 2 of 4 tokens.
        _req(bench, 13.0, [13.1, 13.2], ok=False, error="EngineDeadError: x"),
        # Before the operation: not counted in its row.
        _req(bench, 1.0, [1.1, 1.2], ok=False, error="boom"),
    ]
    row = bench.tidal_row(_record(), reqs, 4, baseline_p99=0.05, baseline_tps=100.0, call_s=4.1)
    assert row["op"] == "2->3" and row["total_s"] == 4.0
    assert row["prepare_s"] == 3.5 and row["commit_s"] == 0.4
    assert row["commit_pause_s"] == 0.9
    assert row["max_gap_during_op_s"] == 1.5
    assert (row["errors"], row["lost"], row["requests_during_op"]) == (1, 2, 3)
    assert row["bytes_vs_min"] == 1.0
    assert row["tok_per_s_during_op"] == pytest.approx(7 / 4.0, abs=0.1)


def test_targets(bench):
    def row(op, total, pause, result="succeeded"):
        return {
            "system": "tidal",
            "op": op,
            "total_s": total,
            "commit_pause_s": pause,
            "result": result,
        }

    good = [row("2->3", 4.0, 0.3), row("3->2", 9.0, 0.5)]  # a slow scale-down is fine
    t = bench.targets(good + [{"system": "relaunch", "op": "2->3"}], 0, 0)
    assert all(v["pass"] for k, v in t.items() if isinstance(v, dict))
    t = bench.targets([row("2->3", 6.0, 1.2)], 1, 2)
    assert not any(v["pass"] for k, v in t.items() if isinstance(v, dict))
    assert t["scale_up_total_lt_5s"]["worst_s"] == 6.0
    failed = bench.targets([row("2->3", 1.0, 0.1, result="rolled_back")], 0, 0)
    assert not failed["zero_lost"]["pass"] and not failed["all_operations_succeeded"]


class FakeLLM:
    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, prompt, params, request_id):
        self.calls += 1
        for _ in range(params.max_tokens):
            await asyncio.sleep(0.002)
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7])])


def test_load_refuses_without_a_deployment_and_counts_killed_requests(bench):
    async def main():
        load = bench.Load(FakeLLM(), streams=3, max_tokens=4, retry_s=0.01)
        await load.wait(lambda: load.completed() >= 3, 10)
        load.llm = None
        assert load.kill_in_flight() == 3
        # Every client is refused (each retries until a deployment is back).
        await load.wait(lambda: len({w for _, w in load.refused}) == 3, 10)
        load.deployment += 1
        load.llm = FakeLLM()
        await load.wait(lambda: any(r.deployment == 1 and r.ok for r in load.reqs), 10)
        await load.finish()
        return load

    load = asyncio.run(main())
    killed = [r for r in load.reqs if r.killed]
    assert len(killed) == 3 and all(r.deployment == 0 and not r.complete(4) for r in killed)
    done = [r for r in load.reqs if not r.killed]
    assert done and all(r.complete(4) for r in done)
    assert {r.stream for r in load.reqs} == {0, 1, 2}


def test_relaunch_stream_pause_runs_from_the_last_token_before_the_stop(bench):
    old = bench.Req(0, 0, 0.0, [(0.5, 1), (1.0, 1)])
    killed = bench.Req(1, 0, 0.0, [(0.9, 1)])
    new0 = bench.Req(0, 1, 3.0, [(4.0, 1), (4.1, 1)])
    new1 = bench.Req(1, 1, 3.0, [(4.5, 1)])
    late = bench.Req(2, 1, 3.0, [(4.2, 1)])  # no token before the stop: no pause counted
    pauses = bench.stream_pauses([old, killed, new0, new1, late], 2.0, 1)
    assert pauses == pytest.approx([3.0, 3.6])
