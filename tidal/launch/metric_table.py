"""Every series ``/metrics`` exports, in one table: name, type, labels, meaning, and the
vLLM V1 series it matches, with a histogram's buckets (docs/operations.md#metrics).

``ServerMetrics`` builds its collectors from it, the docs table is generated from it
(``python -m tidal.launch.metric_table --write docs/operations.md``), and a test checks a
real scrape against it. ``vllm:`` series keep vLLM's names, types, labels and buckets so
boards, alerts and gateways written for vLLM read them; ``tidal:`` series are Tidal's own.
"""

from __future__ import annotations

import enum
import re
import sys
from dataclasses import dataclass
from pathlib import Path


class MetricKind(enum.StrEnum):
    """The Prometheus type (a counter is exported with the ``_total`` suffix)."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


# Bucket boundaries as vLLM V1 declares them.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Tidal's own (kept as they were).
_TIDAL_TTFT = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
_TIDAL_TPOT = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5)
_TIDAL_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
              120.0, 240.0)
_TIDAL_LEN = tuple(float(4**i) for i in range(11))  # 1 .. ~1M tokens
SCALE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
                 300.0, 600.0, 1200.0)
# fmt: on


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len``: vLLM's token-count buckets."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(out)
            out.append(float(value))
        exponent += 1


# A histogram over tokens per request: bucketed by ``token_buckets(max_model_len)``.
TOKEN_BUCKETS = "1-2-5 up to max_model_len"

ENGINE_LABELS = ("model_name", "engine")  # vLLM's labels: the served model and the engine id


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as exported, without a counter's "_total"
    kind: MetricKind
    labels: tuple[str, ...]
    meaning: str
    vllm: str | None = None  # the vLLM V1 series with the same meaning
    buckets: tuple[float, ...] | str | None = None  # a histogram's, or TOKEN_BUCKETS

    def bucket_bounds(self, max_model_len: int) -> tuple[float, ...]:
        if self.buckets == TOKEN_BUCKETS:
            return token_buckets(max_model_len)
        assert isinstance(self.buckets, tuple), self.name
        return self.buckets


def _v(name: str, kind: MetricKind, meaning: str, labels=ENGINE_LABELS, buckets=None) -> MetricSpec:
    return MetricSpec(name, kind, labels, meaning, name, buckets)


C, G, H = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM
_FINISHED = (*ENGINE_LABELS, "finished_reason")

METRICS: tuple[MetricSpec, ...] = (
    # ---- vLLM's names: per engine, labelled by the served model and the engine id --------
    _v("vllm:num_requests_running", G, "Requests in the engine's running batch."),
    _v("vllm:num_requests_waiting", G, "Requests queued on the engine (new and preempted)."),
    _v("vllm:kv_cache_usage_perc", G, "Fraction of the engine's KV cache blocks in use (0-1)."),
    _v("vllm:prefix_cache_queries", C, "Prompt tokens looked up in the prefix cache."),
    _v("vllm:prefix_cache_hits", C, "Prompt tokens found in the prefix cache."),
    _v("vllm:num_preemptions", C, "Requests preempted (by recompute) for lack of KV blocks."),
    _v("vllm:prompt_tokens", C, "Prompt tokens of finished requests."),
    _v("vllm:generation_tokens", C, "Tokens generated."),
    _v(
        "vllm:request_success",
        C,
        "Finished requests by finish reason (stop, length, abort, error).",
        labels=_FINISHED,
    ),
    _v(
        "vllm:request_prompt_tokens",
        H,
        "Prompt tokens per finished request.",
        buckets=TOKEN_BUCKETS,
    ),
    _v(
        "vllm:request_generation_tokens",
        H,
        "Generated tokens per finished request.",
        buckets=TOKEN_BUCKETS,
    ),
    _v(
        "vllm:iteration_tokens_total",
        H,
        "Tokens scheduled per engine step.",
        buckets=ITERATION_BUCKETS,
    ),
    _v(
        "vllm:time_to_first_token_seconds",
        H,
        "Arrival at the server to first token.",
        buckets=TTFT_BUCKETS,
    ),
    _v(
        "vllm:inter_token_latency_seconds",
        H,
        "Time between a request's successive outputs, per token.",
        buckets=ITL_BUCKETS,
    ),
    _v(
        "vllm:request_time_per_output_token_seconds",
        H,
        "A request's mean time per output token after its first.",
        buckets=ITL_BUCKETS,
    ),
    _v(
        "vllm:e2e_request_latency_seconds",
        H,
        "Arrival at the server to the last token.",
        buckets=REQUEST_TIME_BUCKETS,
    ),
    _v(
        "vllm:request_queue_time_seconds",
        H,
        "Time queued on the engine before it was first scheduled.",
        buckets=REQUEST_TIME_BUCKETS,
    ),
    _v(
        "vllm:request_inference_time_seconds",
        H,
        "First scheduled to finished, on the engine (prefill + decode).",
        buckets=REQUEST_TIME_BUCKETS,
    ),
    _v(
        "vllm:request_prefill_time_seconds",
        H,
        "First scheduled to first token, on the engine.",
        buckets=REQUEST_TIME_BUCKETS,
    ),
    _v(
        "vllm:request_decode_time_seconds",
        H,
        "First token to finished, on the engine.",
        buckets=REQUEST_TIME_BUCKETS,
    ),
    # ---- Tidal's own ---------------------------------------------------------------------
    MetricSpec(
        "tidal:request_success",
        C,
        ("finished_reason",),
        "Finished requests by finish reason, all engines.",
        "vllm:request_success",
    ),
    MetricSpec(
        "tidal:stream_backlog_aborts",
        C,
        (),
        "Requests aborted because their client did not read its stream (--max-stream-backlog).",
    ),
    MetricSpec("tidal:prompt_tokens", C, (), "Prompt tokens, all engines.", "vllm:prompt_tokens"),
    MetricSpec(
        "tidal:generation_tokens", C, (), "Generated tokens, all engines.", "vllm:generation_tokens"
    ),
    MetricSpec(
        "tidal:num_requests_running",
        G,
        ("engine",),
        "Requests running on an engine.",
        "vllm:num_requests_running",
    ),
    MetricSpec(
        "tidal:num_requests_waiting",
        G,
        ("engine",),
        "Requests waiting on an engine.",
        "vllm:num_requests_waiting",
    ),
    MetricSpec(
        "tidal:kv_cache_usage_perc",
        G,
        ("engine",),
        "KV cache usage (0-1) per engine.",
        "vllm:kv_cache_usage_perc",
    ),
    MetricSpec(
        "tidal:engine_current_wave",
        G,
        ("engine",),
        "The DP wave an engine is in (docs/architecture.md#dp-waves).",
    ),
    MetricSpec(
        "tidal:time_to_first_token_seconds",
        H,
        (),
        "Time to first token, all engines.",
        "vllm:time_to_first_token_seconds",
        _TIDAL_TTFT,
    ),
    MetricSpec(
        "tidal:time_per_output_token_seconds",
        H,
        (),
        "Mean time per output token after the first, per request.",
        "vllm:request_time_per_output_token_seconds",
        _TIDAL_TPOT,
    ),
    MetricSpec(
        "tidal:e2e_request_latency_seconds",
        H,
        (),
        "End-to-end request latency.",
        "vllm:e2e_request_latency_seconds",
        _TIDAL_E2E,
    ),
    MetricSpec(
        "tidal:request_prompt_tokens",
        H,
        (),
        "Prompt tokens per request.",
        "vllm:request_prompt_tokens",
        _TIDAL_LEN,
    ),
    MetricSpec(
        "tidal:request_generation_tokens",
        H,
        (),
        "Generated tokens per request.",
        "vllm:request_generation_tokens",
        _TIDAL_LEN,
    ),
    MetricSpec("tidal:tensor_parallel_size", G, (), "Worker processes per DP rank."),
    MetricSpec(
        "tidal:engine_workers",
        G,
        ("engine",),
        "Live worker processes of an engine (its TP workers).",
    ),
    MetricSpec(
        "tidal:expert_load_tokens",
        G,
        ("layer", "expert"),
        "Tokens routed to each logical expert over the EPLB window (all ranks).",
    ),
    MetricSpec(
        "tidal:expert_imbalance",
        G,
        ("layer",),
        "Busiest logical expert's load over the mean (1 = balanced), per MoE layer.",
    ),
    MetricSpec(
        "tidal:expert_load_rank_tokens",
        G,
        ("engine",),
        "Tokens routed to the experts an engine's EP ranks hold over the EPLB window, "
        "summed over MoE layers (replicas share their expert's tokens evenly).",
    ),
    MetricSpec(
        "tidal:ep_rank_imbalance",
        G,
        (),
        "Busiest engine's expert_load_rank_tokens over the mean (1 = balanced).",
    ),
    MetricSpec(
        "tidal:cpu_kernel_path",
        G,
        ("op", "phase", "path"),
        "1 for the CPU kernel path serving an op at a shape class (decode, batch or prefill).",
    ),
    MetricSpec(
        "tidal:scale_operations",
        C,
        ("result", "trigger"),
        "Finished elastic EP operations by result and trigger (api, recovery, restore, rebuild).",
    ),
    MetricSpec(
        "tidal:scale_duration_seconds",
        H,
        ("result",),
        "Elastic EP operation duration, request to result.",
        None,
        SCALE_BUCKETS,
    ),
    MetricSpec(
        "tidal:scale_phase_seconds",
        H,
        ("phase",),
        "Time elastic EP operations spent in each phase.",
        None,
        SCALE_BUCKETS,
    ),
    MetricSpec(
        "tidal:scale_bytes_moved",
        C,
        (),
        "Expert weight bytes moved by successful elastic EP operations.",
    ),
    MetricSpec(
        "tidal:scale_experts_moved",
        C,
        (),
        "Expert copies moved by successful elastic EP operations.",
    ),
    MetricSpec(
        "tidal:scale_requests_migrated",
        C,
        (),
        "Requests moved to another engine by elastic EP operations.",
    ),
    MetricSpec(
        "tidal:scale_in_progress",
        G,
        (),
        "1 while an elastic EP operation runs (or its outcome is unknown).",
    ),
    MetricSpec("tidal:rank_deaths", C, (), "Members of the served topology found dead."),
    MetricSpec(
        "tidal:rank_recoveries",
        C,
        (),
        "Rank deaths recovered: an operation committed without the dead engine.",
    ),
    MetricSpec(
        "tidal:rank_recovery_seconds",
        H,
        (),
        "Rank death to the commit of the operation that removed it.",
        None,
        SCALE_BUCKETS,
    ),
    MetricSpec(
        "tidal:rank_death_requests_migrated",
        C,
        (),
        "Requests of dead engines resumed on another engine.",
    ),
    MetricSpec(
        "tidal:deployment_degraded", G, (), "1 while the deployment serves below full health."
    ),
    MetricSpec(
        "tidal:serving_engines",
        G,
        (),
        "Live members of the served topology (the EP size; 0 when the engine client is dead).",
    ),
)

BY_NAME = {m.name: m for m in METRICS}
assert len(BY_NAME) == len(METRICS), "a metric is listed twice"


# ---- the docs table --------------------------------------------------------------------

BEGIN = "<!-- metric-table: generated by python -m tidal.launch.metric_table -->"
END = "<!-- metric-table: end -->"


def markdown() -> str:
    rows = ["| Name | Type | Labels | Meaning | vLLM equivalent |", "|---|---|---|---|---|"]
    for m in METRICS:
        labels = ", ".join(f"`{label}`" for label in m.labels) or "-"
        if m.vllm == m.name:
            vllm = "same"
        else:
            vllm = f"`{m.vllm}`" if m.vllm else "-"
        meaning = m.meaning
        if m.kind is MetricKind.HISTOGRAM and m.buckets == TOKEN_BUCKETS:
            meaning += " Buckets 1, 2, 5, 10, ... up to `--max-model-len`."
        rows.append(f"| `{m.name}` | {m.kind} | {labels} | {meaning} | {vllm} |")
    return "\n".join(rows)


def replace_in(text: str) -> str:
    """``text`` with the part between BEGIN and END replaced by ``markdown()``."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError("the metric table markers are missing")
    return pattern.sub(lambda _: f"{BEGIN}\n{markdown()}\n{END}", text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        path = Path(sys.argv[2])
        path.write_text(replace_in(path.read_text()))
    else:
        print(markdown())
