"""What a served deployment exports, read by the tools that consume it.

One real ``launch --dp 2 --ep --enable-elastic-ep`` on the tiny model, on loopback, with
``--otlp-traces-endpoint`` pointing at a local OTLP/HTTP receiver and a real Prometheus
(Debian's ``prometheus``) scraping it every second from the start. Load: requests on both
ranks, then a scale-down 2 -> 1 while a request pinned to the leaving rank runs (it
migrates), then more requests. Then:

- a ``/metrics`` scrape, parsed by prometheus-client's text parser, has exactly the series
  of ``tidal/launch/metric_table.py``, each of its type, with values that match the load;
- every query of every panel of ``deploy/grafana/tidal.json``, run through Prometheus'
  HTTP API, returns data (skipped without a ``prometheus`` binary);
- the receiver got one span per request with its attributes and events, the migrated
  one with its migration and the scale operation it lived through (skipped without
  OpenTelemetry: ``pip install 'tidal[otel]'``).
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server_utils import RemoteServer, retry_port_conflicts
from tests.waiting import wait_until
from tidal.launch.metric_table import BY_NAME, METRICS

try:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
except ImportError:  # the otel extra is not installed
    trace_service_pb2 = None

PROMETHEUS = shutil.which("prometheus")
BOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tidal.json"
# Grafana's range macro, as Grafana would expand it at a 1 s scrape interval (4 scrapes
# or more), wide enough for the whole load.
RATE_INTERVAL = "60s"
PROMPTS = ["The tide comes in", "Experts route tokens", "A wave of requests", "Scale down"]
# Several KV blocks long: sent twice to one rank, the second finds its blocks cached.
LONG_PROMPT = " ".join(["the tide comes in and the tide goes out"] * 8)
MAX_TOKENS = 12
PINNED_TOKENS = 480  # long enough to be running when its rank leaves


# ---- an OTLP/HTTP receiver ----------------------------------------------------------------


@dataclass
class Receiver:
    server: ThreadingHTTPServer
    spans: list[Any] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/v1/traces"

    def received(self) -> list[Any]:
        with self.lock:
            return list(self.spans)


def start_receiver() -> Receiver:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            with receiver.lock:
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend(scope_spans.spans)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    receiver = Receiver(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    threading.Thread(target=receiver.server.serve_forever, daemon=True).start()
    return receiver


# ---- Prometheus ---------------------------------------------------------------------------


@dataclass
class Prometheus:
    proc: subprocess.Popen
    url: str
    data_dir: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.data_dir, ignore_errors=True)


def start_prometheus(target: str) -> Prometheus:
    data_dir = tempfile.mkdtemp(prefix="tidal-prometheus-")
    config = Path(data_dir) / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: tidal\n    static_configs: [{{targets: ['{target}']}}]\n"
    )

    def start(port: int) -> Prometheus:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={data_dir}/tsdb",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        prom = Prometheus(proc, f"http://127.0.0.1:{port}", data_dir)

        def ready() -> bool:
            if proc.poll() is not None:
                return True
            try:
                return httpx.get(prom.url + "/-/ready", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        if not wait_until(ready, 60) or proc.poll() is not None:
            out = proc.communicate(timeout=10)[0] if proc.poll() is not None else ""
            proc.kill()
            proc.wait(10)
            raise RuntimeError(f"prometheus did not start:\n{out}")
        return prom

    try:
        return retry_port_conflicts(start)
    except BaseException:
        shutil.rmtree(data_dir, ignore_errors=True)
        raise


# ---- the deployment and its load ----------------------------------------------------------


@dataclass
class Served:
    metrics: str  # a /metrics scrape after the load
    completions: list[dict[str, Any]]  # every response, the pinned one last
    scale_down: dict[str, Any]  # the operation's record
    scaled_ns: tuple[int, int]  # wall clock when it was asked for and when it answered
    prometheus: Prometheus | None
    receiver: Receiver | None


def _complete(url: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(
    url: str, prompt: str, max_tokens: int, started: threading.Event, **extra: Any
) -> dict[str, Any]:
    """A streamed completion, as the fields of a non-streamed one the tests read (id,
    model, usage); ``started`` is set at its first token."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    out: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            out.update(id=event["id"], model=event["model"])
            if event.get("usage"):
                out["usage"] = event["usage"]
            if any(c.get("text") for c in event.get("choices", ())):
                started.set()
    assert "usage" in out, out
    return out


def _run_load(url: str) -> tuple[list[dict[str, Any]], dict[str, Any], tuple[int, int]]:
    """Requests on both ranks, a scale-down with a migrating request, more requests."""
    done: list[dict[str, Any]] = []
    for rank in (0, 1):  # each rank serves some: its series carry its engine id
        done += [_complete(url, p, MAX_TOKENS, data_parallel_rank=rank) for p in PROMPTS[:2]]
    # The second finds the first's blocks in the prefix cache.
    done += [_complete(url, LONG_PROMPT, MAX_TOKENS, data_parallel_rank=0) for _ in range(2)]
    pinned: dict[str, Any] = {}
    started = threading.Event()

    def run_pinned() -> None:
        try:
            pinned["out"] = _stream(url, PROMPTS[3], PINNED_TOKENS, started, data_parallel_rank=1)
        except BaseException as e:  # noqa: BLE001 - reported below
            pinned["error"] = repr(e)
            started.set()

    thread = threading.Thread(target=run_pinned, daemon=True)
    thread.start()
    # It streams from the leaving rank before the operation starts: it must migrate.
    assert started.wait(120) and "error" not in pinned, pinned
    asked = time.time_ns()
    r = httpx.post(url + "/scale_elastic_ep", json={"new_data_parallel_size": 1}, timeout=300)
    answered = time.time_ns()
    assert r.status_code == 200, r.text
    record = r.json()
    thread.join(300)
    assert "out" in pinned, pinned
    done += [_complete(url, p, MAX_TOKENS) for p in PROMPTS[2:]]
    return [*done, pinned["out"]], record, (asked, answered)


@pytest.fixture(scope="module")
def served(qwen3_ckpt):
    receiver = start_receiver() if trace_service_pb2 is not None else None
    args = [
        "--model", qwen3_ckpt, "--dp", "2", "--ep", "--enable-elastic-ep",
        "--all2all-backend", "all2all", "--log-level", "warning",
    ]  # fmt: skip
    if receiver is not None:
        args += ["--otlp-traces-endpoint", receiver.url]
    srv = RemoteServer(args)
    prometheus = None
    try:
        if PROMETHEUS is not None:
            prometheus = start_prometheus(f"127.0.0.1:{srv.port}")
            # Scraping before the load: the rates have a sample from before it.
            assert wait_until(lambda: bool(prometheus.query("up == 1")), 60), "no scrape"
        completions, record, scaled_ns = _run_load(srv.url)
        metrics = httpx.get(srv.url + "/metrics", timeout=60).text
        if prometheus is not None:
            # Two more scrapes after the load: every rate has its growth.
            after = time.time()
            assert wait_until(
                lambda: any(
                    float(s["value"][0]) > after + 2 for s in prometheus.query("timestamp(up)")
                ),
                60,
            )
        yield Served(metrics, completions, record, scaled_ns, prometheus, receiver)
    finally:
        if prometheus is not None:
            prometheus.stop()
        srv.stop()  # flushes the spans still batched
        leftovers = srv.leftover_processes()
        if receiver is not None:
            receiver.server.shutdown()
            receiver.server.server_close()
    assert leftovers == []


# ---- the tests ----------------------------------------------------------------------------


def _samples(text: str) -> dict[str, list[Any]]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _total(samples: list[Any], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_scrape_matches_the_metric_table(served):
    families = {f.name: f.type for f in text_string_to_metric_families(served.metrics)}
    # prometheus-client's parser names a counter's family without "_total".
    assert families == {m.name: str(m.kind) for m in METRICS}
    assert set(families) == set(BY_NAME)

    samples = _samples(served.metrics)
    n = len(served.completions)
    generated = sum(c["usage"]["completion_tokens"] for c in served.completions)
    prompt = sum(c["usage"]["prompt_tokens"] for c in served.completions)
    assert _total(samples["vllm:request_success"], "vllm:request_success_total") == n
    assert (
        _total(
            samples["vllm:request_success"], "vllm:request_success_total", finished_reason="length"
        )
        == n
    )
    assert _total(samples["vllm:generation_tokens"], "vllm:generation_tokens_total") == generated
    assert _total(samples["vllm:prompt_tokens"], "vllm:prompt_tokens_total") == prompt
    # Both engines served: their series carry their ids and the served model's name.
    for engine in ("0", "1"):
        assert (
            _total(
                samples["vllm:e2e_request_latency_seconds"],
                "vllm:e2e_request_latency_seconds_count",
                engine=engine,
            )
            >= 2
        )
    model_names = {s.labels["model_name"] for s in samples["vllm:request_success"]}
    assert model_names == {served.completions[0]["model"]}
    # Engine 1 left: its gauges went with it; engine 0 still reports.
    running = {s.labels["engine"] for s in samples["vllm:num_requests_running"]}
    assert running == {"0"}
    # The engine's phases: one sample per engine request (the pinned one finished on
    # engine 0, after its migration), each phase of each request.
    for phase in ("queue", "prefill", "decode", "inference"):
        name = f"vllm:request_{phase}_time_seconds"
        assert _total(samples[name], name + "_count") == n, phase
    assert _total(samples["vllm:prefix_cache_queries"], "vllm:prefix_cache_queries_total") > 0
    assert _total(samples["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total") > 0
    assert _total(samples["vllm:iteration_tokens_total"], "vllm:iteration_tokens_total_count") > 0
    # The ITL histogram has a sample per token after each request's first.
    assert (
        _total(
            samples["vllm:inter_token_latency_seconds"], "vllm:inter_token_latency_seconds_count"
        )
        > 0
    )
    ops = samples["tidal:scale_operations"]
    assert _total(ops, "tidal:scale_operations_total", result="succeeded", trigger="api") == 1
    assert (
        _total(samples["tidal:scale_requests_migrated"], "tidal:scale_requests_migrated_total") >= 1
    )
    assert _total(samples["tidal:serving_engines"], "tidal:serving_engines") == 1


def _panel_queries() -> list[tuple[str, str]]:
    board = json.loads(BOARD.read_text())
    queries = []
    for panel in board["panels"]:
        for target in panel.get("targets", ()):
            queries.append((panel["title"], target["expr"]))
    return queries


def test_board_panels_through_prometheus(served):
    if served.prometheus is None:
        pytest.skip("no prometheus binary (apt-get install prometheus)")
    queries = _panel_queries()
    assert len(queries) >= 20
    empty = []
    for title, expr in queries:
        result = served.prometheus.query(expr.replace("$__rate_interval", RATE_INTERVAL))
        if not result:
            empty.append((title, expr))
    assert empty == [], f"panel queries without data: {empty}"


def _attributes(kv_list: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kv_list:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [v.string_value for v in value.array_value.values]
        else:
            out[kv.key] = getattr(value, kind)
    return out


def test_one_span_per_request(served):
    if served.receiver is None:
        pytest.skip("OpenTelemetry is not installed (pip install 'tidal[otel]')")
    ids = {c["id"]: c for c in served.completions}

    def spans_by_id() -> dict[str, Any]:
        return {
            _attributes(s.attributes).get("gen_ai.request.id"): s
            for s in served.receiver.received()
        }

    # The server stopped (the fixture's teardown flushes too), but the batch goes out
    # within a second of each request's end.
    assert wait_until(lambda: ids.keys() <= spans_by_id().keys(), 60), (
        sorted(ids),
        sorted(spans_by_id()),
    )
    spans = spans_by_id()
    for rid, completion in ids.items():
        span = spans[rid]
        attrs = _attributes(span.attributes)
        assert attrs["gen_ai.request.model"] == completion["model"]
        assert attrs["gen_ai.usage.input_tokens"] == completion["usage"]["prompt_tokens"]
        assert attrs["gen_ai.usage.output_tokens"] == completion["usage"]["completion_tokens"]
        assert attrs["gen_ai.response.finish_reasons"] == ["length"]
        events = [e.name for e in span.events]
        assert events[0] == "queued" and "first_token" in events, (rid, events)
        assert span.end_time_unix_nano > span.start_time_unix_nano
    pinned = spans[served.completions[-1]["id"]]
    events = {e.name: _attributes(e.attributes) for e in pinned.events}
    assert events["migrated"] == {"from": 1, "to": 0}, events
    asked, answered = served.scaled_ns
    if pinned.end_time_unix_nano > answered:
        # It was still running when the operation ended (on a fast device it may finish
        # on its new engine before: tests/unit/test_metrics.py covers the event alone).
        scale = events["scale_operation"]
        assert scale["operation_id"] == served.scale_down["operation_id"]
        assert (scale["result"], scale["from_size"], scale["to_size"]) == ("succeeded", 2, 1)
    # Requests that ended before the operation began did not live through it.
    for span in spans.values():
        if span.end_time_unix_nano < asked:
            assert "scale_operation" not in [e.name for e in span.events]
