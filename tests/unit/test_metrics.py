"""The metric table, the collectors built from it, and what the engine adds for them.

The real scrape of a served deployment, Prometheus and the OTLP receiver are in
tests/e2e/test_metrics_export.py; here each part alone: the table against the docs, the
per-engine counters fed from cumulative engine counts, a removed engine's series, the
scheduler's request phases and step sizes, and OpenTelemetry staying unimported.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_scheduler import FakeRunner, make_req, make_sched
from tidal.launch import metric_table
from tidal.launch.metric_table import METRICS, MetricKind, token_buckets
from tidal.launch.metrics import ServerMetrics
from tidal.protocol.messages import RequestTimings, SchedulerStats

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _value(m: ServerMetrics, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def test_docs_table_is_generated_from_the_metric_table():
    text = DOCS.read_text()
    assert metric_table.replace_in(text) == text, (
        "docs/operations.md is stale: python -m tidal.launch.metric_table --write "
        "docs/operations.md"
    )
    for m in METRICS:
        assert f"| `{m.name}` | {m.kind} |" in text


def test_vllm_series_keep_vllms_labels_and_buckets():
    assert token_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert token_buckets(1) == (1,)
    for m in METRICS:
        if m.name.startswith("vllm:"):
            assert m.vllm == m.name and m.labels[:2] == ("model_name", "engine"), m
        assert (m.buckets is not None) == (m.kind is MetricKind.HISTOGRAM), m
    ttft = metric_table.BY_NAME["vllm:time_to_first_token_seconds"]
    assert ttft.bucket_bounds(100)[0] == 0.001 and ttft.bucket_bounds(100)[-1] == 2560.0
    prompt = metric_table.BY_NAME["vllm:request_prompt_tokens"]
    assert prompt.bucket_bounds(100) == (1, 2, 5, 10, 20, 50, 100)


def test_engine_counters_add_the_growth_of_cumulative_counts():
    m = ServerMetrics(model_name="moe", max_model_len=64)
    e = {"model_name": "moe", "engine": "3"}
    m.record_scheduler_stats(3, SchedulerStats(prefix_cache_queries=10, prefix_cache_hits=4))
    # A new engine's series exist at 0 from its first report (as vLLM's do).
    assert _value(m, "vllm:num_preemptions_total", **e) == 0
    assert _value(m, "vllm:request_success_total", **e, finished_reason="error") == 0
    m.record_scheduler_stats(
        3,
        SchedulerStats(
            num_running_reqs=2,
            prefix_cache_queries=25,
            prefix_cache_hits=4,
            num_preempted=1,
            iteration_tokens=[8, 1],
            current_wave=5,
        ),
    )
    m.record_scheduler_stats(3, SchedulerStats(prefix_cache_queries=25, num_preempted=1))
    assert _value(m, "vllm:prefix_cache_queries_total", **e) == 25
    assert _value(m, "vllm:prefix_cache_hits_total", **e) == 4
    assert _value(m, "vllm:num_preemptions_total", **e) == 1
    assert _value(m, "vllm:iteration_tokens_total_count", **e) == 2
    assert _value(m, "vllm:iteration_tokens_total_sum", **e) == 9
    assert _value(m, "vllm:iteration_tokens_total_bucket", **e, le="8.0") == 2
    assert _value(m, "tidal:engine_current_wave", engine="3") == 0  # the latest report's


def test_request_series_are_labelled_by_the_engine_that_finished_it():
    m = ServerMetrics(model_name="moe", max_model_len=64)
    m.record_tokens(5, 0, engine=1)
    m.record_tokens(0, 3, engine=1)
    m.record_request_finished(5, 3, 0.2, 0.9, 0.35, "length", engine=1)
    m.record_inter_token(1, 0.05, 2)
    m.record_request_timings(1, RequestTimings(queued_s=0.1, prefill_s=0.2, decode_s=0.6))
    e = {"model_name": "moe", "engine": "1"}
    assert _value(m, "vllm:prompt_tokens_total", **e) == 5
    assert _value(m, "vllm:generation_tokens_total", **e) == 3
    assert _value(m, "vllm:request_success_total", **e, finished_reason="length") == 1
    assert _value(m, "vllm:inter_token_latency_seconds_count", **e) == 2
    assert _value(m, "vllm:request_time_per_output_token_seconds_sum", **e) == 0.35
    assert _value(m, "vllm:request_queue_time_seconds_sum", **e) == pytest.approx(0.1)
    assert _value(m, "vllm:request_inference_time_seconds_sum", **e) == pytest.approx(0.8)
    assert _value(m, "vllm:request_prompt_tokens_bucket", **e, le="5.0") == 1
    assert _value(m, "tidal:prompt_tokens_total") == 5  # Tidal's own, all engines


def test_a_removed_engine_loses_its_gauges_and_keeps_its_counters():
    m = ServerMetrics(model_name="moe")
    for engine in (0, 1):
        m.record_scheduler_stats(engine, SchedulerStats(num_running_reqs=1, num_preempted=2))
    m.forget_engine(1)
    m.record_scheduler_stats(1, SchedulerStats(num_running_reqs=7, num_preempted=9))  # late
    e0, e1 = {"model_name": "moe", "engine": "0"}, {"model_name": "moe", "engine": "1"}
    assert _value(m, "vllm:num_requests_running", **e0) == 1
    assert _value(m, "vllm:num_requests_running", **e1) is None
    assert _value(m, "tidal:num_requests_running", engine="1") is None
    assert _value(m, "vllm:num_preemptions_total", **e1) == 2


def test_expert_imbalance_and_kernel_paths():
    m = ServerMetrics()
    m.record_expert_load({0: [10, 30, 20, 20], 1: [0, 0, 0, 0]})
    assert _value(m, "tidal:expert_imbalance", layer="0") == 1.5
    assert _value(m, "tidal:expert_imbalance", layer="1") is None  # no load: no ratio
    assert _value(m, "tidal:ep_rank_imbalance") == 0  # an unlabelled gauge: 0 until load
    m.record_engine_expert_load({0: 0.0, 3: 0.0})
    assert _value(m, "tidal:expert_load_rank_tokens", engine="3") == 0
    assert _value(m, "tidal:ep_rank_imbalance") == 0  # no load: no ratio set
    m.record_engine_expert_load({0: 45.0, 3: 55.0})
    assert _value(m, "tidal:expert_load_rank_tokens", engine="0") == 45
    assert _value(m, "tidal:ep_rank_imbalance") == pytest.approx(1.1)
    m.forget_engine(3)  # a removed engine's rank series goes with it
    assert _value(m, "tidal:expert_load_rank_tokens", engine="3") is None
    m.record_cpu_kernels([{"ops": {"moe": {"decode": "cpp", "batch": "torch"}}}, None])
    m.record_cpu_kernels([{"ops": {"moe": {"decode": "cpp", "batch": "cpp"}}}])
    assert _value(m, "tidal:cpu_kernel_path", op="moe", phase="batch", path="cpp") == 1
    assert _value(m, "tidal:cpu_kernel_path", op="moe", phase="batch", path="torch") == 0


def test_the_scheduler_times_each_phase_on_its_own_clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    sched = make_sched(budget=8)
    runner = FakeRunner(sched)
    sched.add_request(make_req("a", 12, max_tokens=3))  # queued at 0
    stats_steps: list[int] = []
    finished = None
    for t in (1.0, 2.0, 5.0, 7.0):  # a 2-chunk prefill (8 + 4), then 2 decode steps
        now[0] = t
        _, outs = runner.step()
        for eco in outs.values():
            stats_steps += eco.scheduler_stats.iteration_tokens
            for o in eco.outputs:
                if o.finished:
                    finished = o
                else:
                    assert o.timings is None
    assert finished is not None and finished.timings == RequestTimings(
        queued_s=1.0, prefill_s=1.0, decode_s=5.0
    )
    # Each step's size once, in the outputs' stats; never in the stats the others read.
    assert stats_steps == [8, 4, 1, 1]
    sched.add_request(make_req("b", 4, max_tokens=1))
    sched.schedule()
    assert sched.make_stats().iteration_tokens == []
    assert sched.make_stats(take_steps=True).iteration_tokens == [4]


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
def test_the_server_imports_no_opentelemetry_without_the_flag():
    # FastAPI imports OpenTelemetry's API package itself; the SDK, the exporter and the
    # tracer are ours to import, and only with --otlp-traces-endpoint.
    code = (
        "import sys, tidal.launch.cli, tidal.launch.api_server, tidal.frontend.async_llm\n"
        "ours = ('opentelemetry.sdk', 'opentelemetry.exporter', 'tidal.frontend.tracing')\n"
        "print(sorted(m for m in sys.modules if m.startswith(ours)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_request_spans_and_the_operations_they_live_through():
    pytest.importorskip("opentelemetry.sdk", reason="pip install 'tidal[otel]'")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tidal.frontend.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    tracer = RequestTracer("http://unused", "moe", exporter=exporter)
    tracer.start("done", 4)
    tracer.event("done", "queued")
    tracer.finish("done", 2, "stop")
    tracer.start("moved", 7)
    tracer.event("moved", "migrated", {"from": 1, "to": 0})
    tracer.scale_operation(
        {"operation_id": "op-1", "result": "succeeded", "trigger": "api", "from_size": 2,
         "to_size": 1, "requests_migrated": 1}
    )  # fmt: skip
    tracer.finish("moved", 5, "error", error="engine failed it")
    tracer.event("moved", "late")  # after its end: nowhere
    tracer.start("open", 3)
    tracer.shutdown()  # ends what is open, as aborted, and sends everything
    spans = {s.attributes["gen_ai.request.id"]: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"done", "moved", "open"}
    done, moved, still_open = spans["done"], spans["moved"], spans["open"]
    assert [e.name for e in done.events] == ["queued"]
    assert dict(done.attributes) == {
        "gen_ai.request.id": "done",
        "gen_ai.request.model": "moe",
        "gen_ai.usage.input_tokens": 4,
        "gen_ai.usage.output_tokens": 2,
        "gen_ai.response.finish_reasons": ("stop",),
    }
    assert [e.name for e in moved.events] == ["migrated", "scale_operation"]
    assert dict(moved.events[1].attributes) == {
        "operation_id": "op-1", "result": "succeeded", "trigger": "api",
        "requests_migrated": 1, "from_size": 2, "to_size": 1,
    }  # fmt: skip
    assert moved.status.description == "engine failed it"
    assert still_open.attributes["gen_ai.response.finish_reasons"] == ("abort",)
