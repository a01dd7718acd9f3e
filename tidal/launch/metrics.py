"""Prometheus collectors for the API server, fed by ``AsyncLLM`` as a stat logger.

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
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 - re-exported
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tidal.frontend.scaling.scale_records import ScaleOutcome, ScalePhase, ScaleTrigger

if TYPE_CHECKING:
    from tidal.protocol.messages import SchedulerStats

_PREFIX = "tidal:"
# fmt: off
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0)
_LEN_BUCKETS = tuple(float(4**i) for i in range(11))  # 1 .. ~1M tokens
_SCALE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
                  300.0, 600.0, 1200.0)
# fmt: on
# Operation ids remembered so a record reported twice is counted once.
_SEEN_OPERATIONS = 1024
# Death records remembered likewise: more than fault_status() lists (the controller keeps
# the last 256), so every death it can list again is one already counted.
_SEEN_DEATHS = 1024


@dataclass
class _DeathCount:
    """What the counters already hold of one death record (its migrated requests grow
    after the death is first seen; its recovery comes later)."""

    migrated: int = 0
    recovered: bool = False


class ServerMetrics:
    """The stat-logger interface ``AsyncLLM`` calls, backed by prometheus collectors."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.request_success = Counter(
            _PREFIX + "request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.stream_backlog_aborts = Counter(
            _PREFIX + "stream_backlog_aborts",
            "Engine requests aborted because their client did not read its stream "
            "(--max-stream-backlog).",
            registry=r,
        )
        self.prompt_tokens = Counter(_PREFIX + "prompt_tokens", "Prefill tokens.", registry=r)
        self.generation_tokens = Counter(
            _PREFIX + "generation_tokens", "Generated tokens.", registry=r
        )
        self.running = _per_engine("num_requests_running", "Requests running on an engine.", r)
        self.waiting = _per_engine("num_requests_waiting", "Requests waiting on an engine.", r)
        self.kv_usage = _per_engine("kv_cache_usage_perc", "KV cache usage (0-1) per engine.", r)
        self.ttft = _hist("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS, r)
        self.tpot = _hist(
            "time_per_output_token_seconds",
            "Time per output token after the first.",
            _TPOT_BUCKETS,
            r,
        )
        self.e2e = _hist(
            "e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS, r
        )
        self.prompt_len = _hist(
            "request_prompt_tokens", "Prompt tokens per request.", _LEN_BUCKETS, r
        )
        self.generation_len = _hist(
            "request_generation_tokens", "Generated tokens per request.", _LEN_BUCKETS, r
        )

        self.tensor_parallel_size = Gauge(
            _PREFIX + "tensor_parallel_size", "Worker processes per DP rank.", registry=r
        )
        self.engine_workers = _per_engine(
            "engine_workers", "Live worker processes of an engine (its TP workers).", r
        )
        self.expert_load = Gauge(
            _PREFIX + "expert_load_tokens",
            "Tokens routed to each logical expert over the EPLB window (all ranks).",
            ["layer", "expert"],
            registry=r,
        )

        # Elastic EP (docs/architecture.md#elastic): one sample per finished operation.
        self.scale_operations = Counter(
            _PREFIX + "scale_operations",
            "Finished elastic EP operations by result (succeeded, rolled_back, failed) and "
            "trigger (api, recovery after a rank death, restore).",
            ["result", "trigger"],
            registry=r,
        )
        self.scale_duration = Histogram(
            _PREFIX + "scale_duration_seconds",
            "Elastic EP operation duration, request to result, by result.",
            ["result"],
            buckets=_SCALE_BUCKETS,
            registry=r,
        )
        self.scale_phase = Histogram(
            _PREFIX + "scale_phase_seconds",
            "Time elastic EP operations spent in each phase.",
            ["phase"],
            buckets=_SCALE_BUCKETS,
            registry=r,
        )
        self.scale_bytes_moved = Counter(
            _PREFIX + "scale_bytes_moved",
            "Expert weight bytes moved by successful elastic EP operations.",
            registry=r,
        )
        self.scale_experts_moved = Counter(
            _PREFIX + "scale_experts_moved",
            "Expert copies moved by successful elastic EP operations.",
            registry=r,
        )
        self.scale_requests_migrated = Counter(
            _PREFIX + "scale_requests_migrated",
            "Requests moved to another engine by elastic EP operations (any result).",
            registry=r,
        )
        self.scaling = Gauge(
            _PREFIX + "scale_in_progress",
            "1 while an elastic EP operation runs (or its outcome is unknown).",
            registry=r,
        )
        # Rank deaths (docs/architecture.md#faults), from AsyncLLM.fault_status() at each scrape.
        self.rank_deaths = Counter(
            _PREFIX + "rank_deaths", "Members of the served topology found dead.", registry=r
        )
        self.rank_recoveries = Counter(
            _PREFIX + "rank_recoveries",
            "Rank deaths recovered: an operation committed without the dead engine.",
            registry=r,
        )
        self.rank_recovery_seconds = Histogram(
            _PREFIX + "rank_recovery_seconds",
            "Time from a rank death to the commit of the operation that removed it.",
            buckets=_SCALE_BUCKETS,
            registry=r,
        )
        self.rank_death_requests_migrated = Counter(
            _PREFIX + "rank_death_requests_migrated",
            "Requests of dead engines resumed on another engine.",
            registry=r,
        )
        self.degraded = Gauge(
            _PREFIX + "deployment_degraded",
            "1 while the deployment serves below full health (a dead member, a failed "
            "group, a recovery running).",
            registry=r,
        )
        self.serving_engines = Gauge(
            _PREFIX + "serving_engines",
            "Live members of the served topology (0 when the engine client is dead).",
            registry=r,
        )
        # Totals /stats reports (the counters above are for prometheus).
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._lock = threading.Lock()
        self._retired: set[str] = set()  # engine ids removed; never reused (docs/architecture.md#elastic-identity)
        self._seen: OrderedDict[str, None] = OrderedDict()
        # Death records counted so far, by identity, the most recently listed last.
        self._deaths: OrderedDict[tuple[Any, ...], _DeathCount] = OrderedDict()

    def record_processes(self, tp_size: int, processes: dict[int, dict[str, Any]]) -> None:
        """TP size and each engine's worker count (``AsyncLLM.processes``), at a scrape."""
        self.tensor_parallel_size.set(tp_size)
        for engine, info in processes.items():
            if str(engine) not in self._retired:
                self.engine_workers.labels(engine=str(engine)).set(len(info["worker_pids"]))

    def record_expert_load(self, load: dict[int, list[int]]) -> None:
        for layer, counts in load.items():
            for expert, n in enumerate(counts):
                self.expert_load.labels(layer=str(layer), expert=str(expert)).set(n)

    # ---- stat-logger interface (called by AsyncLLM) ----------------------------------------

    def record_scheduler_stats(self, engine_id: int, stats: SchedulerStats) -> None:
        engine = str(engine_id)  # the sender's engine id
        if engine in self._retired:  # a late message from a removed engine
            return
        self.running.labels(engine=engine).set(stats.num_running_reqs)
        self.waiting.labels(engine=engine).set(stats.num_waiting_reqs)
        self.kv_usage.labels(engine=engine).set(stats.kv_cache_usage)

    def record_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
            self.prompt_tokens_total += prompt_tokens
        if generation_tokens:
            self.generation_tokens.inc(generation_tokens)
            self.generation_tokens_total += generation_tokens

    def record_request_finished(
        self,
        prompt_tokens: int,
        generation_tokens: int,
        ttft_s: float,
        e2e_s: float,
        tpot_s: float | None,
        finish_reason: str,
    ) -> None:
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.prompt_len.observe(prompt_tokens)
        self.generation_len.observe(generation_tokens)
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def forget_engine(self, engine_id: int) -> None:
        """Drop a removed engine's series (elastic scale-down, rank death) so dashboards
        don't show it stale; later stats from it are ignored (ids are never reused)."""
        self._retired.add(str(engine_id))
        for gauge in (self.running, self.waiting, self.kv_usage, self.engine_workers):
            try:
                gauge.remove(str(engine_id))
            except KeyError:
                pass

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


def _per_engine(name: str, doc: str, registry: CollectorRegistry) -> Gauge:
    return Gauge(_PREFIX + name, doc, ["engine"], registry=registry)


def _hist(
    name: str, doc: str, buckets: tuple[float, ...], registry: CollectorRegistry
) -> Histogram:
    return Histogram(_PREFIX + name, doc, buckets=buckets, registry=registry)
