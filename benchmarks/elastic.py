"""Elastic EP: scaling live under a steady streaming load vs stop-and-relaunch, in one run.

    python benchmarks/elastic.py                        # 2->3, 3->2, 2->4, 4->2, 32 streams
    python benchmarks/elastic.py --sequence 3,2 --streams 16
    python benchmarks/elastic.py --quick                # a short smoke run (8 streams, 3,2)
    python benchmarks/elastic.py --backend ray          # the same on Ray, beside mp's

The default model (the embedded tiny Qwen3-MoE that ``launch`` serves without ``--model``,
float32) is served by an in-process ``AsyncLLM`` starting at DP=EP=2 with elastic EP.
``--streams`` clients each stream requests back to back (random token-id prompt of 8-40
tokens, greedy, ``ignore_eos``, ``--max-tokens`` each), recording when each output chunk
arrives (``time.monotonic``, the clock of the scale records). After a warm-up a baseline
window without scaling is measured, then each size of ``--sequence`` is one
``AsyncLLM.scale_elastic_ep`` call, ``--settle-s`` apart.

Gaps: a request's events are its submission and the arrival of each of its chunks; a gap
is the time between two consecutive events of one request (the first one is its TTFT), so
a stream's gaps cover the whole time it waits, across request boundaries.

Per operation (``system: tidal``):

- ``total_s`` and ``phases_s`` from the operation's record; ``prepare_s`` is everything
  before the commit (planned + starting_engines + preparing);
- ``commit_pause_s``: the longest gap of any stream that overlaps the record's COMMITTING
  window (all engines PREPARED -> all COMMITTED, as the frontend saw it), beside
  ``baseline_p99_gap_s`` (p99 of all gaps in the baseline window);
- ``max_gap_during_op_s`` / ``p99_gap_during_op_s``: over the gaps overlapping the whole
  operation (a scale-down's migrated requests wait in PREPARING);
- ``requests_migrated`` (read from ``scaling_history()`` once the load has finished;
  ``requests_migrated_at_return``: in the record ``scale_elastic_ep`` returned),
  ``experts_moved``, ``bytes_moved`` vs ``min_bytes`` (the plan's);
- ``errors`` (requests that raised) and ``lost`` (requests overlapping the operation that
  did not end with exactly ``--max-tokens`` tokens), ``tok_per_s_during_op``.

The peer (``system: relaunch``), measured in the same run: what a user does today without
elastic EP. The same load runs against a deployment of the same model with expert
parallelism (``enable_elastic_ep=False``); for each size of the sequence the deployment is
stopped (``AsyncLLM.shutdown``: requests in flight are lost) and started again at the new
size while the clients keep trying (an attempt with no deployment is refused; each client
retries every ``--retry-s``). ``downtime_s`` runs from the stop until the first token of
the new deployment (``stop_s`` + ``start_s`` + ``first_token_s``); ``max_stream_pause_s``:
per stream, its last token before the stop to its first token after (the peer of the
commit pause); ``lost``: the requests in flight at the stop; ``refused_attempts``. The
relaunch is in-process (the engines are new processes, but the frontend's interpreter and
imports are kept and the model files are in the page cache), so it is the peer at its
fastest; a real server restart takes longer.

``--backend ray`` (``pip install 'tidal[ray]'``) runs the same load and sequence twice in
one run: with the default ``mp`` launcher (rows ``system: tidal``), then with the Ray
launcher (``system: tidal-ray``; docs/architecture.md#launchers): a Ray cluster started here (one node, one
logical CPU per rank it may hold) unless ``--ray-address`` names one, and
``--ray-warm-ranks`` ranks started ahead (default 1). The ``table`` then has ``ray_*``
columns beside the mp ones for each operation.

Prints one JSON document: machine, model, baseline, one row per operation and system, a
``table`` of the key numbers and ``targets`` (scale-up total < 5 s, commit pause < 1 s,
0 errors, 0 lost). Progress goes to stderr. Every engine process is stopped at the end,
also on Ctrl-C, SIGTERM or an error; ``leftover_processes`` counts what was still alive.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Targets of the issue on a 2-core machine with the default model.
TARGET_SCALE_UP_TOTAL_S = 5.0
TARGET_COMMIT_PAUSE_S = 1.0
# Prompt lengths Load draws, [low, high): 8 to 40 tokens of random ids.
PROMPT_TOKENS_RANGE = (8, 41)


# ------------------------------------------------------------------ records (pure)


@dataclass
class Req:
    """One request of one stream: when it was submitted, when each chunk arrived."""

    stream: int
    deployment: int
    submitted: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    done: float | None = None
    ok: bool = False  # finished normally
    error: str | None = None  # raised (tidal), or lost at a stop (relaunch)
    killed: bool = False  # in flight when its deployment was stopped

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def end(self) -> float:
        if self.done is not None:
            return self.done
        return self.chunks[-1][0] if self.chunks else self.submitted

    def gaps(self) -> list[tuple[float, float]]:
        """(start, end) between consecutive events: submission, then each chunk."""
        events = [self.submitted] + [t for t, _ in self.chunks]
        return list(zip(events, events[1:]))

    def complete(self, max_tokens: int) -> bool:
        return self.ok and self.error is None and self.tokens == max_tokens


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in [0, 100]); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def overlaps(a: float, b: float, t0: float, t1: float) -> bool:
    """Whether the interval (a, b) meets [t0, t1]."""
    return a <= t1 and b >= t0


def gaps_overlapping(reqs: Iterable[Req], t0: float, t1: float) -> list[float]:
    return [b - a for r in reqs for a, b in r.gaps() if overlaps(a, b, t0, t1)]


def gaps_ending_in(reqs: Iterable[Req], t0: float, t1: float) -> list[float]:
    return [b - a for r in reqs for a, b in r.gaps() if t0 <= b <= t1]


def tokens_in(reqs: Iterable[Req], t0: float, t1: float) -> int:
    return sum(n for r in reqs for t, n in r.chunks if t0 <= t <= t1)


def gap_summary(gaps: list[float]) -> dict[str, float | int | None]:
    return {
        "n": len(gaps),
        "p50_s": _r(percentile(gaps, 50)),
        "p99_s": _r(percentile(gaps, 99)),
        "max_s": _r(max(gaps) if gaps else None),
    }


def stream_pauses(reqs: list[Req], t_stop: float, deployment: int) -> list[float]:
    """Relaunch: per stream, from its last token before the stop to its first token from
    the new ``deployment`` (the pause that client saw)."""
    before: dict[int, float] = {}
    after: dict[int, float] = {}
    for r in reqs:
        for t, _ in r.chunks:
            if t <= t_stop:
                before[r.stream] = max(before.get(r.stream, t), t)
            if r.deployment == deployment:
                after[r.stream] = min(after.get(r.stream, t), t)
    return [after[w] - before[w] for w in sorted(before) if w in after]


def phase_windows(record: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Each phase's [start, end] on the record's clock: the phases are contiguous from
    ``started_at`` (each ends when the next begins), in the order of
    ``phase_durations_s``."""
    t = float(record["started_at"])
    out: dict[str, tuple[float, float]] = {}
    for name, d in record["phase_durations_s"].items():
        out[name] = (t, t + d)
        t += d
    return out


def tidal_row(
    record: dict[str, Any],
    reqs: list[Req],
    max_tokens: int,
    baseline_p99: float | None,
    baseline_tps: float | None,
    call_s: float,
) -> dict[str, Any]:
    """The row of one scale operation, from its record and the streams' requests."""
    t0 = float(record["started_at"])
    t1 = float(record["finished_at"] if record["finished_at"] is not None else t0)
    phases = phase_windows(record)
    durations = record["phase_durations_s"]
    prepare = sum(durations.get(p, 0.0) for p in ("planned", "starting_engines", "preparing"))
    commit = phases.get("committing")
    pause = gaps_overlapping(reqs, *commit) if commit else []
    during = gaps_overlapping(reqs, t0, t1)
    touched = [r for r in reqs if overlaps(r.submitted, r.end, t0, t1)]
    errors = sum(1 for r in touched if r.error is not None)
    lost = sum(1 for r in touched if not r.complete(max_tokens))
    tps = tokens_in(reqs, t0, t1) / (t1 - t0) if t1 > t0 else None
    bytes_moved, min_bytes = record["bytes_moved"], record["min_bytes"]
    return {
        "system": "tidal",
        "op": f"{record['from_size']}->{record['to_size']}",
        "result": record["result"],
        "cause": record["cause"],
        "total_s": _r(record["duration_s"]),
        "call_s": _r(call_s),
        "prepare_s": _r(prepare),
        "commit_s": _r(durations.get("committing")),
        "phases_s": {k: _r(v) for k, v in durations.items()},
        "commit_pause_s": _r(max(pause) if pause else None),
        "baseline_p99_gap_s": _r(baseline_p99),
        "max_gap_during_op_s": _r(max(during) if during else None),
        "p99_gap_during_op_s": _r(percentile(during, 99)),
        "requests_migrated": record["requests_migrated"],
        "requests_migrated_at_return": record.get("requests_migrated_at_return"),
        "experts_moved": record["experts_moved"],
        "bytes_moved": bytes_moved,
        "min_bytes": min_bytes,
        "bytes_vs_min": _r(bytes_moved / min_bytes) if min_bytes else None,
        "p2p_bytes": record["p2p_bytes"],
        "disk_bytes": record["disk_bytes"],
        "requests_during_op": len(touched),
        "errors": errors,
        "lost": lost,
        "tok_per_s_during_op": _r(tps, 1),
        "tok_per_s_baseline": _r(baseline_tps, 1),
        "warnings": record["warnings"],
    }


def targets(rows: list[dict[str, Any]], run_errors: int, run_lost: int) -> dict[str, Any]:
    """Pass/fail of the issue's targets over the tidal rows (and the whole tidal run)."""
    tidal = [r for r in rows if r["system"] == "tidal"]
    ups = [r for r in tidal if _sizes(r["op"])[1] > _sizes(r["op"])[0]]
    up_totals = [r["total_s"] for r in ups]
    pauses = [r["commit_pause_s"] for r in tidal]
    ok_ops = all(r["result"] == "succeeded" for r in tidal)

    def worst(xs: list[Any]) -> float | None:
        return None if not xs or any(x is None for x in xs) else max(xs)

    up_worst, pause_worst = worst(up_totals), worst(pauses)
    return {
        "scale_up_total_lt_5s": {
            "worst_s": up_worst,
            "pass": bool(ups) and up_worst is not None and up_worst < TARGET_SCALE_UP_TOTAL_S,
        },
        "commit_pause_lt_1s": {
            "worst_s": pause_worst,
            "pass": bool(tidal) and pause_worst is not None and pause_worst < TARGET_COMMIT_PAUSE_S,
        },
        "zero_errors": {"errors": run_errors, "pass": run_errors == 0 and ok_ops},
        "zero_lost": {"lost": run_lost, "pass": run_lost == 0 and ok_ops},
        "all_operations_succeeded": ok_ops,
    }


def _sizes(op: str) -> tuple[int, int]:
    a, b = op.split("->")
    return int(a), int(b)


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


# ------------------------------------------------------------------ load


class Load:
    """``streams`` clients, each streaming requests back to back into ``self.llm`` until
    stopped. ``self.llm = None`` means no deployment: an attempt is refused, and retried
    after ``retry_s``. ``kill_in_flight()`` ends the requests in flight (a stopped
    server drops its connections)."""

    def __init__(
        self, llm: Any, streams: int, max_tokens: int, seed: int = 0, retry_s: float = 0.1
    ) -> None:
        from tidal.frontend.processor import ProcessedPrompt
        from tidal.sampling_params import SamplingParams

        self._prompt_cls = ProcessedPrompt
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.llm = llm
        self.deployment = 0
        self.max_tokens = max_tokens
        self.retry_s = retry_s
        self.reqs: list[Req] = []
        self.refused: list[tuple[float, int]] = []  # (when, stream)
        self.stop = asyncio.Event()
        self.progress = asyncio.Event()  # set at every chunk
        self._rngs = [random.Random(seed * 100_003 + w) for w in range(streams)]
        self._in_flight: dict[int, tuple[asyncio.Task, Req]] = {}
        self.tasks = [asyncio.create_task(self._worker(w)) for w in range(streams)]

    def _prompt(self, w: int) -> Any:
        rng = self._rngs[w]
        return self._prompt_cls(
            None,
            [rng.randrange(10, 4000) for _ in range(rng.randrange(*PROMPT_TOKENS_RANGE))],
        )

    async def _one(self, llm: Any, req: Req, prompt: Any, rid: str) -> None:
        try:
            async for out in llm.generate(prompt, self.params, rid):
                req.chunks.append((time.monotonic(), len(out.outputs[0].token_ids)))
                self.progress.set()
            req.ok = True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - counted, the stream goes on
            req.error = f"{type(e).__name__}: {e}"
        finally:
            req.done = time.monotonic()

    async def _worker(self, w: int) -> None:
        n = 0
        while not self.stop.is_set():
            llm = self.llm
            if llm is None:
                self.refused.append((time.monotonic(), w))
                await asyncio.sleep(self.retry_s)
                continue
            req = Req(w, self.deployment, time.monotonic())
            self.reqs.append(req)
            rid = f"s{w}-d{self.deployment}-{n}"
            n += 1
            task = asyncio.create_task(self._one(llm, req, self._prompt(w), rid))
            self._in_flight[w] = (task, req)
            try:
                await asyncio.wait({task})
            finally:
                self._in_flight.pop(w, None)
                if not task.done():  # the worker itself is cancelled
                    task.cancel()
            if task.cancelled():
                req.killed, req.error = True, "in flight when the deployment stopped"
                req.done = req.done or time.monotonic()

    def kill_in_flight(self) -> int:
        """Cancel every request in flight; returns how many."""
        items = list(self._in_flight.values())
        for task, _ in items:
            task.cancel()
        return len(items)

    def tokens(self) -> int:
        return sum(r.tokens for r in self.reqs)

    def completed(self) -> int:
        return sum(1 for r in self.reqs if r.ok)

    async def wait(self, pred: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > deadline:
                raise TimeoutError("the load made no progress in time")
            self.progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.progress.wait(), 0.5)

    async def finish(self) -> None:
        """Stop after the requests in flight (each ends within ``max_tokens`` steps)."""
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


# ------------------------------------------------------------------ runs


def log(msg: str) -> None:
    print(f"[elastic {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_llm(
    model: str | None,
    dtype: str,
    size: int,
    elastic: bool,
    *,
    restore: bool = False,
    ray: dict[str, Any] | None = None,
    tp: int = 1,
) -> Any:
    """``ray``: run the ranks on Ray (``EngineArgs`` fields: ``ray_address``, ...); ``tp``:
    each rank's tensor-parallel workers."""
    from tidal.frontend.async_llm import AsyncLLM
    from tidal.launch.engine_args import EngineArgs

    backend = {"data_parallel_backend": "ray", **ray} if ray is not None else {}
    args = EngineArgs(
        model=model,
        dtype=dtype,
        data_parallel_size=size,
        enable_expert_parallel=True,
        enable_elastic_ep=elastic,
        elastic_restore=restore,
        tensor_parallel_size=tp,
        **backend,
    )
    return AsyncLLM(args.create_engine_config())


async def run_tidal(
    opts: argparse.Namespace, sequence: list[int], ray: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The elastic deployment under load through ``sequence`` (on Ray with ``ray``)."""
    t_start = time.monotonic()
    llm = await asyncio.to_thread(make_llm, opts.model, opts.dtype, opts.start_size, True, ray=ray)
    load: Load | None = None
    try:
        startup_s = time.monotonic() - t_start
        log(f"tidal: DP={opts.start_size} up in {startup_s:.1f}s; warming up")
        load = Load(llm, opts.streams, opts.max_tokens, seed=opts.seed)
        await load.wait(lambda: len({r.stream for r in load.reqs if r.ok}) >= opts.streams, 300)
        await asyncio.sleep(opts.warmup_s)
        b0 = time.monotonic()
        await asyncio.sleep(opts.baseline_s)
        b1 = time.monotonic()
        ops: list[tuple[dict[str, Any], float]] = []
        for size in sequence:
            await asyncio.sleep(opts.settle_s)
            log(f"tidal: scale {llm.client.topology.size} -> {size}")
            c0 = time.monotonic()
            code, rec = await llm.scale_elastic_ep(size)
            call_s = time.monotonic() - c0
            log(
                f"tidal: {rec['from_size']}->{rec['to_size']} {rec['result']} in "
                f"{rec['duration_s']:.2f}s {rec['phase_durations_s']}"
            )
            ops.append((rec, call_s))
            if code != 200 or rec["result"] != "succeeded":
                log(f"tidal: operation did not succeed ({code}): {rec['cause']}")
                break
        await asyncio.sleep(opts.settle_s)
        await load.finish()
        # The records as the driver keeps them now: a migration reported after the
        # operation returned is counted there.
        history = {h["operation_id"]: h for h in llm.scaling_history()}
        for i, (rec, call_s) in enumerate(ops):
            later = dict(history.get(rec["operation_id"], rec))
            later["requests_migrated_at_return"] = rec["requests_migrated"]
            ops[i] = (later, call_s)
    finally:
        if load is not None:
            await load.cancel()
        await llm.shutdown()
    reqs = load.reqs
    base_gaps = gaps_ending_in(reqs, b0, b1)
    base_p99 = percentile(base_gaps, 99)
    base_tps = tokens_in(reqs, b0, b1) / (b1 - b0)
    rows = [
        tidal_row(rec, reqs, opts.max_tokens, base_p99, base_tps, call_s) for rec, call_s in ops
    ]
    if ray is not None:
        for row in rows:
            row["system"] = "tidal-ray"
    errors = sum(1 for r in reqs if r.error is not None)
    lost = sum(1 for r in reqs if not r.complete(opts.max_tokens))
    return {
        "startup_s": _r(startup_s),
        "baseline": {
            "window_s": _r(b1 - b0),
            "gap": gap_summary(base_gaps),
            "tok_per_s": _r(base_tps, 1),
        },
        "rows": rows,
        "requests": len(reqs),
        "requests_completed": sum(1 for r in reqs if r.complete(opts.max_tokens)),
        "errors": errors,
        "lost": lost,
        "error_samples": sorted({r.error for r in reqs if r.error})[:5],
    }


async def run_relaunch(opts: argparse.Namespace, sequence: list[int]) -> dict[str, Any]:
    t_start = time.monotonic()
    size = opts.start_size
    llm = await asyncio.to_thread(make_llm, opts.model, opts.dtype, size, False)
    load: Load | None = None
    rows: list[dict[str, Any]] = []
    try:
        log(f"relaunch: DP={size} up in {time.monotonic() - t_start:.1f}s; warming up")
        load = Load(llm, opts.streams, opts.max_tokens, seed=opts.seed + 1, retry_s=opts.retry_s)
        await load.wait(lambda: load.completed() >= opts.streams, 300)
        await asyncio.sleep(opts.warmup_s)
        for new in sequence:
            await asyncio.sleep(opts.settle_s)
            log(f"relaunch: stop DP={size}, start DP={new}")
            refused0 = len(load.refused)
            t_stop = time.monotonic()
            load.llm = None
            in_flight = load.kill_in_flight()
            old, llm = llm, None
            await old.shutdown()
            t_stopped = time.monotonic()
            load.deployment += 1
            dep = load.deployment
            llm = await asyncio.to_thread(make_llm, opts.model, opts.dtype, new, False)
            t_up = time.monotonic()
            load.llm = llm

            def first_token(dep: int = dep) -> float | None:
                ts = [r.chunks[0][0] for r in load.reqs if r.deployment == dep and r.chunks]
                return min(ts) if ts else None

            await load.wait(lambda: first_token() is not None, 300)
            t_first = first_token()
            refused = load.refused[refused0:]
            killed = [r for r in load.reqs if r.deployment == dep - 1 and r.killed]
            rows.append(
                {
                    "system": "relaunch",
                    "op": f"{size}->{new}",
                    "downtime_s": _r(t_first - t_stop),
                    "stop_s": _r(t_stopped - t_stop),
                    "start_s": _r(t_up - t_stopped),
                    "first_token_s": _r(t_first - t_up),
                    "in_flight_at_stop": in_flight,
                    "lost": len(killed),
                    "refused_attempts": len(refused),
                    "clients_refused": len({w for _, w in refused}),
                    "errors": len(killed) + len(refused),
                    "_t_stop": t_stop,
                    "_dep": dep,
                }
            )
            log(
                f"relaunch: {size}->{new} down {t_first - t_stop:.2f}s "
                f"(stop {t_stopped - t_stop:.2f}s, start {t_up - t_stopped:.2f}s), "
                f"{len(killed)} lost"
            )
            size = new
        await asyncio.sleep(opts.settle_s)
        await load.finish()
        for row in rows:  # once every stream has its first token from the new deployment
            pauses = stream_pauses(load.reqs, row.pop("_t_stop"), row.pop("_dep"))
            row["max_stream_pause_s"] = _r(max(pauses) if pauses else None)
            row["p50_stream_pause_s"] = _r(percentile(pauses, 50))
    finally:
        if load is not None:
            await load.cancel()
        if llm is not None:
            await llm.shutdown()
    return {"rows": rows}


async def run_all(opts: argparse.Namespace) -> dict[str, Any]:
    sequence = [int(s) for s in opts.sequence.split(",") if s.strip()]
    t0 = time.monotonic()
    tidal = await run_tidal(opts, sequence)
    on_ray = await run_on_ray(opts, sequence) if opts.backend == "ray" else None
    peer = await run_relaunch(opts, sequence) if not opts.no_peer else {"rows": []}
    rows = tidal["rows"] + (on_ray["rows"] if on_ray else []) + peer["rows"]
    table = [
        {
            "op": r["op"],
            "tidal_total_s": r["total_s"],
            "tidal_prepare_s": r["prepare_s"],
            "tidal_commit_s": r["commit_s"],
            "tidal_commit_pause_s": r["commit_pause_s"],
            "baseline_p99_gap_s": r["baseline_p99_gap_s"],
            "tidal_max_gap_s": r["max_gap_during_op_s"],
            "tidal_migrated": r["requests_migrated"],
            "tidal_bytes_vs_min": r["bytes_vs_min"],
            "tidal_errors": r["errors"],
            "tidal_lost": r["lost"],
            "relaunch_downtime_s": p.get("downtime_s"),
            "relaunch_max_stream_pause_s": p.get("max_stream_pause_s"),
            "relaunch_lost": p.get("lost"),
            "relaunch_refused_attempts": p.get("refused_attempts"),
        }
        for r, p in zip(tidal["rows"], peer["rows"] + [{}] * len(tidal["rows"]))
    ]
    if on_ray is not None:
        for t, r in zip(table, on_ray["rows"]):
            if r["op"] == t["op"]:
                t.update(
                    ray_total_s=r["total_s"],
                    ray_prepare_s=r["prepare_s"],
                    ray_commit_s=r["commit_s"],
                    ray_commit_pause_s=r["commit_pause_s"],
                    ray_errors=r["errors"],
                    ray_lost=r["lost"],
                )
    return {
        "benchmark": "elastic",
        "machine": machine_info(),
        "model": model_info(opts),
        "load": {
            **load_info(opts),
            "start_size": opts.start_size,
            "sequence": sequence,
            "settle_s": opts.settle_s,
            "drain_timeout_s": 0.0,
            "relaunch_retry_s": opts.retry_s,
            "relaunch_engine": "same model and EP, enable_elastic_ep=False",
        },
        "tidal": {k: v for k, v in tidal.items() if k != "rows"},
        **(
            {"tidal_ray": {k: v for k, v in on_ray.items() if k != "rows"}}
            if on_ray is not None
            else {}
        ),
        "rows": rows,
        "table": table,
        "targets": targets(tidal["rows"], tidal["errors"], tidal["lost"]),
        "elapsed_s": _r(time.monotonic() - t0, 1),
    }


async def run_on_ray(opts: argparse.Namespace, sequence: list[int]) -> dict[str, Any]:
    """``run_tidal`` with the Ray launcher. Without ``--ray-address``, a one-node Ray is
    started here with a logical CPU for every rank the sequence and the warm ranks need,
    and stopped after."""
    import ray

    own = not opts.ray_address
    temp_dir = tempfile.mkdtemp(prefix="tidal-bench-ray-")  # its session files, removed after
    if own:
        os.environ["RAY_TMPDIR"] = temp_dir  # also its address file (Ray writes, not makes, ray/)
        os.makedirs(os.path.join(temp_dir, "ray"))
        cpus = max([opts.start_size, *sequence]) + opts.ray_warm_ranks
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
    try:
        cfg = {"ray_address": opts.ray_address, "ray_warm_ranks": opts.ray_warm_ranks}
        result = await run_tidal(opts, sequence, ray=cfg)
        result["ray"] = {
            "cluster": opts.ray_address or "local, started by the benchmark",
            "warm_ranks": opts.ray_warm_ranks,
            "version": ray.__version__,
        }
        return result
    finally:
        if own:
            ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def machine_info() -> dict[str, Any]:
    """Where a benchmark ran (every benchmark JSON carries it)."""
    import torch

    from tidal.kernels.select import cpu_description

    return {
        "cpu": cpu_description()["model"],
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def model_info(opts: argparse.Namespace) -> dict[str, Any]:
    """``--model`` (or the embedded default, with the arguments it is built from)."""
    from tidal.models.tiny import DEFAULT_MODEL_ARGS, default_model_path

    return {
        "path": opts.model or default_model_path(),
        "default": opts.model is None,
        "args": DEFAULT_MODEL_ARGS if opts.model is None else None,
        "dtype": opts.dtype,
    }


def reap_children(timeout_s: float = 5.0) -> int:
    """Stop whatever this process started that is still alive (an engine left by an
    interrupted shutdown); multiprocessing's resource tracker exits with us. Returns how
    many there were."""
    import psutil

    me = psutil.Process()
    left = []
    for p in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "resource_tracker" not in " ".join(p.cmdline()):
                left.append(p)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(left, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout_s)
    return len(left)


def load_info(opts: argparse.Namespace) -> dict[str, Any]:
    """What ``Load`` generates, for a benchmark's JSON (shared with ``faults.py``)."""
    low, high = PROMPT_TOKENS_RANGE
    return {
        "streams": opts.streams,
        "max_tokens": opts.max_tokens,
        "prompt_tokens": f"{low}-{high - 1} random ids",
        "sampling": "greedy, ignore_eos",
        "warmup_s": opts.warmup_s,
        "baseline_s": opts.baseline_s,
    }


def add_load_args(p: argparse.ArgumentParser, baseline_s: float, settle_s: float) -> None:
    """The model and load options this benchmark shares with ``faults.py``."""
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded one)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--baseline-s", type=float, default=baseline_s)
    p.add_argument("--settle-s", type=float, default=settle_s)
    p.add_argument("--retry-s", type=float, default=0.1, help="peer: client retry interval")
    p.add_argument("--seed", type=int, default=0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_load_args(p, baseline_s=10.0, settle_s=3.0)
    p.add_argument("--start-size", type=int, default=2)
    p.add_argument("--sequence", default="3,2,4,2", help="sizes to scale to, in order")
    p.add_argument("--no-peer", action="store_true", help="skip the stop-and-relaunch peer")
    p.add_argument(
        "--backend",
        choices=("mp", "ray"),
        default="mp",
        help="ray: also run it with the Ray launcher, beside mp (pip install 'tidal[ray]')",
    )
    p.add_argument("--ray-address", default=None, help="Ray cluster (default: one started here)")
    p.add_argument("--ray-warm-ranks", type=int, default=1, help="Ray: ranks started ahead")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 streams, 3,2, short windows")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.streams, opts.max_tokens, opts.sequence = 8, 16, "3,2"
        opts.warmup_s, opts.baseline_s, opts.settle_s = 0.5, 2.0, 1.0
    return opts


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_benchmark(
    run: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]],
    opts: argparse.Namespace,
    log: Callable[[str], None],
    indent: int | None = 1,
) -> None:
    """Run ``run(opts)`` and print its JSON document (``indent``: None for one line),
    stopping every process it left (also on Ctrl-C, SIGTERM or an error);
    ``leftover_processes`` counts them."""
    signal.signal(signal.SIGTERM, _sigterm)
    # Ctrl-C even where SIGINT was inherited ignored (a background job of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    doc: dict[str, Any] | None = None
    try:
        doc = asyncio.run(run(opts))
    finally:
        leftover = reap_children()
        if leftover:
            log(f"stopped {leftover} leftover process(es)")
    doc["leftover_processes"] = leftover
    print(json.dumps(doc, indent=indent), flush=True)


def main(argv: list[str] | None = None) -> None:
    run_benchmark(run_all, parse_args(argv), log)


if __name__ == "__main__":
    main()
