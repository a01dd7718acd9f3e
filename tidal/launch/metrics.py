"""Prometheus collectors for the API server, fed by ``AsyncLLM`` as a stat logger. What
is exported, with vLLM's names where Tidal has the same concept, is the table in
``tidal/launch/metric_table.py`` (docs/operations.md#metrics).

Each ``ServerMetrics`` owns its own ``CollectorRegistry`` (not the process-global one),
so several apps in one process (tests, multiple servers) never collide on names. Per-engine
gauges are labelled ``engine`` with the engine id (docs/architecture.md#elastic-identity: stable across scaling,
never reused), not with a DP rank, which changes when the topology does.

Elastic EP operations (``record_scale_operation``, a scale listener of ``AsyncLLM``) count
by result, time each phase, and add up the bytes moved and requests migrated; an engine an
operation removed (or found dead) loses its per-engine series, and a late stats message
from it cannot bring them back. Operations count by ``trigger`` too (``ScaleTrigger``): "api"
(a caller), "recovery" (automatic, after a rank death), "restore" (back to the size before
it) or "rebuild" (fresh groups for the same engines).

Rank deaths (docs/architecture.md#faults) are read from ``AsyncLLM.fault_status()`` when ``/metrics``
is scraped (``record_faults``): each death, recovery and migrated request is counted
once however often it is scraped.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, assert_never

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 - re-exported
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from tidal.frontend.scaling.scale_records import ScaleOutcome, ScalePhase, ScaleTrigger
from tidal.launch.metric_table import BY_NAME, ENGINE_LABELS, METRICS, MetricKind, MetricSpec
from tidal.protocol.messages import FinishReason

if TYPE_CHECKING:
    from tidal.protocol.messages import RequestTimings, SchedulerStats

# No "<name>_created" series beside each counter and histogram (as vLLM): tools read
# rates, and each would be a gauge family that is in no table. Process-wide.
disable_created_metrics()

# Operation ids remembered so a record reported twice is counted once.
_SEEN_OPERATIONS = 1024
# Death records remembered likewise: more than fault_status() lists (the controller keeps
# the last 256), so every death it can list again is one already counted.
_SEEN_DEATHS = 1024
# Per-engine gauges an engine that leaves takes with it (counters and histograms stay:
# a series that stops growing is what rate() expects of a gone source).
_ENGINE_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "tidal:num_requests_running",
    "tidal:num_requests_waiting",
    "tidal:kv_cache_usage_perc",
    "tidal:engine_current_wave",
    "tidal:engine_workers",
    "tidal:expert_load_rank_tokens",
)


@dataclass
class _DeathCount:
    """What the counters already hold of one death record (its migrated requests grow
    after the death is first seen; its recovery comes later)."""

    migrated: int = 0
    recovered: bool = False


@dataclass
class _EngineCounts:
    """An engine's cumulative counters as last reported, so each report adds its growth."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preempted: int = 0


def _collector(spec: MetricSpec, registry: CollectorRegistry, max_model_len: int) -> Any:
    # Counters are declared without "_total": prometheus-client appends it.
    name = spec.name.removesuffix("_total") if spec.kind is MetricKind.COUNTER else spec.name
    labels = list(spec.labels)
    match spec.kind:
        case MetricKind.COUNTER:
            return Counter(name, spec.meaning, labels, registry=registry)
        case MetricKind.GAUGE:
            return Gauge(name, spec.meaning, labels, registry=registry)
        case MetricKind.HISTOGRAM:
            buckets = spec.bucket_bounds(max_model_len)
            return Histogram(name, spec.meaning, labels, buckets=buckets, registry=registry)
        case _:
            assert_never(spec.kind)


class ServerMetrics:
    """The stat-logger interface ``AsyncLLM`` calls, backed by prometheus collectors built
    from ``tidal.launch.metric_table.METRICS``. ``vllm:`` series are labelled with
    ``model_name`` and the engine id; ``max_model_len`` bounds their token buckets."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        model_name: str = "",
        max_model_len: int = 2048,
    ) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.series: dict[str, Any] = {m.name: _collector(m, r, max_model_len) for m in METRICS}
        c = self.series
        self.request_success = c["tidal:request_success"]
        self.stream_backlog_aborts = c["tidal:stream_backlog_aborts"]
        self.prompt_tokens = c["tidal:prompt_tokens"]
        self.generation_tokens = c["tidal:generation_tokens"]
        self.running = c["tidal:num_requests_running"]
        self.waiting = c["tidal:num_requests_waiting"]
        self.kv_usage = c["tidal:kv_cache_usage_perc"]
        self.ttft = c["tidal:time_to_first_token_seconds"]
        self.tpot = c["tidal:time_per_output_token_seconds"]
        self.e2e = c["tidal:e2e_request_latency_seconds"]
        self.prompt_len = c["tidal:request_prompt_tokens"]
        self.generation_len = c["tidal:request_generation_tokens"]
        self.tensor_parallel_size = c["tidal:tensor_parallel_size"]
        self.engine_workers = c["tidal:engine_workers"]
        self.expert_load = c["tidal:expert_load_tokens"]
        # Elastic EP (docs/architecture.md#elastic): one sample per finished operation.
        self.scale_operations = c["tidal:scale_operations"]
        self.scale_duration = c["tidal:scale_duration_seconds"]
        self.scale_phase = c["tidal:scale_phase_seconds"]
        self.scale_bytes_moved = c["tidal:scale_bytes_moved"]
        self.scale_experts_moved = c["tidal:scale_experts_moved"]
        self.scale_requests_migrated = c["tidal:scale_requests_migrated"]
        self.scaling = c["tidal:scale_in_progress"]
        # Rank deaths (docs/architecture.md#faults), from AsyncLLM.fault_status() at each scrape.
        self.rank_deaths = c["tidal:rank_deaths"]
        self.rank_recoveries = c["tidal:rank_recoveries"]
        self.rank_recovery_seconds = c["tidal:rank_recovery_seconds"]
        self.rank_death_requests_migrated = c["tidal:rank_death_requests_migrated"]
        self.degraded = c["tidal:deployment_degraded"]
        self.serving_engines = c["tidal:serving_engines"]
        # Totals /stats reports (the counters above are for prometheus).
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._lock = threading.Lock()
        self._retired: set[str] = (
            set()
        )  # engine ids removed; never reused (docs/architecture.md#elastic-identity)
        self._seen: OrderedDict[str, None] = OrderedDict()
        # Death records counted so far, by identity, the most recently listed last.
        self._deaths: OrderedDict[tuple[Any, ...], _DeathCount] = OrderedDict()
        self._engine_counts: dict[str, _EngineCounts] = {}
        self._children: dict[tuple[str, str], Any] = {}  # (vllm: name, engine) -> series

    def _v(self, name: str, engine: str) -> Any:
        """The ``vllm:`` series ``name`` of one engine. Kept: ``labels()`` costs several
        microseconds, and this runs for every output of every request."""
        child = self._children.get((name, engine))
        if child is None:
            child = self.series[name].labels(model_name=self.model_name, engine=engine)
            self._children[(name, engine)] = child
        return child

    def record_processes(self, tp_size: int, processes: dict[int, dict[str, Any]]) -> None:
        """TP size and each engine's worker count (``AsyncLLM.processes``), at a scrape."""
        self.tensor_parallel_size.set(tp_size)
        for engine, info in processes.items():
            if str(engine) not in self._retired:
                self.engine_workers.labels(engine=str(engine)).set(len(info["worker_pids"]))

    def record_expert_load(self, load: dict[int, list[int]]) -> None:
        imbalance = self.series["tidal:expert_imbalance"]
        for layer, counts in load.items():
            for expert, n in enumerate(counts):
                self.expert_load.labels(layer=str(layer), expert=str(expert)).set(n)
            total = sum(counts)
            if counts and total:
                imbalance.labels(layer=str(layer)).set(max(counts) * len(counts) / total)

    def record_engine_expert_load(self, tokens: dict[int, float]) -> None:
        """Engine id -> tokens its experts computed (``AsyncLLM.get_engine_expert_load``)
        and the busiest engine's share over the mean (no ratio without load)."""
        series = self.series["tidal:expert_load_rank_tokens"]
        for engine, n in tokens.items():
            if str(engine) not in self._retired:
                series.labels(engine=str(engine)).set(n)
        total = sum(tokens.values())
        if tokens and total:
            self.series["tidal:ep_rank_imbalance"].set(max(tokens.values()) * len(tokens) / total)

    def record_cpu_kernels(self, reports: list[dict[str, Any] | None]) -> None:
        """Each rank's CPU kernel choices (``get_cpu_kernels``); a path any rank serves
        an op with is 1, one no rank serves it with any more is 0."""
        paths = self.series["tidal:cpu_kernel_path"]
        serving: set[tuple[str, str, str]] = set()
        for report in reports:
            for op, choice in ((report or {}).get("ops") or {}).items():
                for phase in ("decode", "batch", "prefill"):  # select.CLASSES
                    if choice.get(phase):
                        serving.add((str(op), phase, str(choice[phase])))
        names = BY_NAME["tidal:cpu_kernel_path"].labels
        known = {tuple(labels[n] for n in names) for labels in _label_sets(paths)}
        for labels in known | serving:
            paths.labels(*labels).set(1 if labels in serving else 0)

    # ---- stat-logger interface (called by AsyncLLM) ----------------------------------------

    def record_scheduler_stats(self, engine_id: int, stats: SchedulerStats) -> None:
        engine = str(engine_id)  # the sender's engine id
        if engine in self._retired:  # a late message from a removed engine
            return
        self.running.labels(engine=engine).set(stats.num_running_reqs)
        self.waiting.labels(engine=engine).set(stats.num_waiting_reqs)
        self.kv_usage.labels(engine=engine).set(stats.kv_cache_usage)
        self.series["tidal:engine_current_wave"].labels(engine=engine).set(stats.current_wave)
        self._v("vllm:num_requests_running", engine).set(stats.num_running_reqs)
        self._v("vllm:num_requests_waiting", engine).set(stats.num_waiting_reqs)
        self._v("vllm:kv_cache_usage_perc", engine).set(stats.kv_cache_usage)
        last = self._engine_counts.get(engine)
        if last is None:  # a new engine: its series start at 0, as vLLM's do
            last = self._engine_counts[engine] = _EngineCounts()
            self._create_engine_series(engine)
        # The engine's counters are cumulative: add what grew since its last report.
        for name, field in (
            ("vllm:prefix_cache_queries", "prefix_cache_queries"),
            ("vllm:prefix_cache_hits", "prefix_cache_hits"),
            ("vllm:num_preemptions", "num_preempted"),
        ):
            now, before = getattr(stats, field), getattr(last, field)
            if now > before:
                self._v(name, engine).inc(now - before)
                setattr(last, field, now)
        if stats.iteration_tokens:
            steps = self._v("vllm:iteration_tokens_total", engine)
            for n in stats.iteration_tokens:
                steps.observe(n)

    def _create_engine_series(self, engine: str) -> None:
        for spec in METRICS:
            if spec.labels == ENGINE_LABELS and spec.kind is not MetricKind.GAUGE:
                self._v(spec.name, engine)
        for reason in FinishReason:
            self.series["vllm:request_success"].labels(
                model_name=self.model_name, engine=engine, finished_reason=str(reason)
            )

    def record_tokens(self, prompt_tokens: int, generation_tokens: int, engine: int = 0) -> None:
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
            self._v("vllm:prompt_tokens", str(engine)).inc(prompt_tokens)
            self.prompt_tokens_total += prompt_tokens
        if generation_tokens:
            self.generation_tokens.inc(generation_tokens)
            self._v("vllm:generation_tokens", str(engine)).inc(generation_tokens)
            self.generation_tokens_total += generation_tokens

    def record_request_finished(
        self,
        prompt_tokens: int,
        generation_tokens: int,
        ttft_s: float,
        e2e_s: float,
        tpot_s: float | None,
        finish_reason: str,
        engine: int = 0,
    ) -> None:
        """One finished request, seen by the frontend; ``engine``: the one that finished it."""
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.prompt_len.observe(prompt_tokens)
        self.generation_len.observe(generation_tokens)
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        e = str(engine)
        self.series["vllm:request_success"].labels(
            model_name=self.model_name, engine=e, finished_reason=finish_reason
        ).inc()
        self._v("vllm:request_prompt_tokens", e).observe(prompt_tokens)
        self._v("vllm:request_generation_tokens", e).observe(generation_tokens)
        self._v("vllm:time_to_first_token_seconds", e).observe(ttft_s)
        self._v("vllm:e2e_request_latency_seconds", e).observe(e2e_s)
        if tpot_s is not None:
            self._v("vllm:request_time_per_output_token_seconds", e).observe(tpot_s)

    def record_inter_token(self, engine: int, seconds_per_token: float, tokens: int) -> None:
        """A request's output after its first: the time since its previous output over
        the ``tokens`` it brought, once per token (as vLLM counts a step's tokens)."""
        hist = self._v("vllm:inter_token_latency_seconds", str(engine))
        for _ in range(tokens):
            hist.observe(seconds_per_token)

    def record_request_timings(self, engine: int, timings: RequestTimings) -> None:
        """An engine request's phases (``EngineCoreOutput.timings``), on that engine."""
        e = str(engine)
        self._v("vllm:request_queue_time_seconds", e).observe(timings.queued_s)
        self._v("vllm:request_prefill_time_seconds", e).observe(timings.prefill_s)
        self._v("vllm:request_decode_time_seconds", e).observe(timings.decode_s)
        self._v("vllm:request_inference_time_seconds", e).observe(
            timings.prefill_s + timings.decode_s
        )

    def forget_engine(self, engine_id: int) -> None:
        """Drop a removed engine's gauges (elastic scale-down, rank death) so dashboards
        don't show it stale; later stats from it are ignored (ids are never reused)."""
        engine = str(engine_id)
        self._retired.add(engine)
        for name in _ENGINE_GAUGES:
            self._children.pop((name, engine), None)
            gauge, names = self.series[name], BY_NAME[name].labels
            for labels in _label_sets(gauge):
                if labels.get("engine") == engine:
                    gauge.remove(*(labels[n] for n in names))

    # ---- scale listener (called by AsyncLLM with each finished operation's record) ---------

    def record_scale_operation(self, record: dict[str, Any]) -> None:
        """One finished elastic EP operation (``OperationRecord.to_dict()``). A record
        reported again (a FAILED operation whose outcome was learnt later) only updates
        which engines are gone."""
        result = str(record.get("result") or record.get("phase") or "unknown")
        op = str(record.get("operation_id"))
        with self._lock:
            first = op not in self._seen
            self._seen[op] = None
            while len(self._seen) > _SEEN_OPERATIONS:
                self._seen.popitem(last=False)
        if first:
            trigger = str(record.get("trigger") or ScaleTrigger.API)
            self.scale_operations.labels(result=result, trigger=trigger).inc()
            if record.get("duration_s") is not None:
                self.scale_duration.labels(result=result).observe(record["duration_s"])
            for phase, seconds in (record.get("phase_durations_s") or {}).items():
                if seconds is not None:
                    self.scale_phase.labels(phase=phase).observe(seconds)
            if result == ScalePhase.SUCCEEDED:
                self.scale_bytes_moved.inc(record.get("bytes_moved") or 0)
                self.scale_experts_moved.inc(record.get("experts_moved") or 0)
            self.scale_requests_migrated.inc(record.get("requests_migrated") or 0)
        for engine_id in _gone(record, result):
            self.forget_engine(engine_id)

    def set_scaling(self, is_scaling: bool) -> None:
        self.scaling.set(1 if is_scaling else 0)

    # ---- rank deaths (called at each /metrics scrape with AsyncLLM.fault_status()) ---------

    def record_faults(self, status: dict[str, Any]) -> None:
        """Bring the rank-death series up to ``status`` (``AsyncLLM.fault_status()``).
        Idempotent: the same status scraped twice adds nothing."""
        self.degraded.set(0 if status.get("degraded") is None else 1)
        self.serving_engines.set(status.get("serving_engines") or 0)
        with self._lock:
            for death in status.get("deaths") or ():
                key = _death_key(death)
                count = self._deaths.get(key)
                if count is None:
                    count = self._deaths[key] = _DeathCount()
                    self.rank_deaths.inc()
                self._deaths.move_to_end(key)
                self._count_death(death, count)
            while len(self._deaths) > _SEEN_DEATHS:
                self._deaths.popitem(last=False)

    def _count_death(self, death: dict[str, Any], count: _DeathCount) -> None:
        migrated = int(death.get("requests_migrated") or 0)
        if migrated > count.migrated:  # grows while its requests are resumed elsewhere
            self.rank_death_requests_migrated.inc(migrated - count.migrated)
            count.migrated = migrated
        if not count.recovered and death.get("recovered_by") is not None:
            count.recovered = True
            self.rank_recoveries.inc()
            if death.get("recovery_s") is not None:
                self.rank_recovery_seconds.observe(death["recovery_s"])

    def render(self) -> bytes:
        """The prometheus text exposition of every collector."""
        return generate_latest(self.registry)


def _gone(record: dict[str, Any], result: str) -> list[int]:
    """The engines an operation took out of the deployment: the leaving and dead ones if
    it committed, the joining ones (stopped) if it rolled back."""
    outcome = record.get("resolution") or result
    if outcome in (ScalePhase.SUCCEEDED, ScaleOutcome.COMMITTED):
        return [*record.get("leaving", ()), *record.get("dead", ())]
    if outcome == ScaleOutcome.ROLLED_BACK:
        return list(record.get("joining", ()))
    return []


def _death_key(death: dict[str, Any]) -> tuple[Any, ...]:
    # Engine ids are never reused (docs/architecture.md#elastic-identity), so an engine dies once; its epoch and
    # time make the key safe against a test double that reuses ids.
    return (death.get("engine_id"), death.get("epoch"), death.get("at"))


def _label_sets(collector: Any) -> list[dict[str, str]]:
    """The labels of each series ``collector`` (a gauge) holds now."""
    return [sample.labels for family in collector.collect() for sample in family.samples]
