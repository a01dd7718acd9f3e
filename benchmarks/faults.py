"""Rank death under load: Tidal's emergency scale-down vs a restart, in one run.

    python benchmarks/faults.py                  # kill -9 one rank of DP=3 under 32 streams
    python benchmarks/faults.py --restore        # ... then scale back to 3 (--elastic-restore)
    python benchmarks/faults.py --quick          # a short smoke run (8 streams)

The default model (the embedded tiny Qwen3-MoE, float32) is served by an in-process
``AsyncLLM`` at DP=EP=``--size`` with elastic EP. ``--streams`` clients stream requests
back to back (random 8-40 token prompts, greedy, ``ignore_eos``, ``--max-tokens`` each;
the load generator of ``benchmarks/elastic.py``). After a warm-up and a baseline window,
the engine at rank ``--victim-rank`` gets SIGKILL. Nothing else is done by hand: the
frontend sees the process exit, its recovery operation rebuilds the groups without the
dead rank (its requests migrate as resumed requests), and with ``--restore`` a scale-up
brings the deployment back to ``--size``.

Measured (``system: tidal``), on the clock of the scale records (``time.monotonic``):

- ``detect_s``: kill -> the death recorded by the frontend;
- ``recovered_s``: kill -> the recovery operation's commit (groups rebuilt);
- ``new_requests_served_s``: a probe request (4 greedy tokens) is submitted the moment
  after the kill, and again every ``--retry-s`` while it is refused or fails: kill -> its
  first token ("time until new requests are served again");
- ``max_stream_pause_s`` / ``p50_stream_pause_s``: per stream, its last token before the
  kill to its first token after (every stream is affected: the survivors' groups broke
  with the dead rank), beside ``baseline_gap`` (token gaps before the kill);
- ``requests_migrated`` (the dead rank's, resumed elsewhere), ``lost`` (requests in flight
  at the kill that did not end with exactly ``--max-tokens`` tokens), ``errors``;
- ``restore_s`` (with ``--restore``): the restore operation's duration.

The peer (``system: restart``): the same load against the same model and EP without
elastic EP -- what a deployment does today (vLLM has no automatic recovery; SGLang's
elastic EP loses the dead ranks' requests). The same rank is killed; the client fails
every request (``EngineDeadError``); a supervisor that polls ``is_dead`` every
``--retry-s`` stops the deployment and starts it again at the same size while the
clients keep retrying. ``new_requests_served_s``: the same probe, which the new
deployment answers; ``lost``: the requests in flight at the kill; ``errors`` counts every
request that failed (attempts against the dead deployment included). The restart is in-process
(interpreter, imports and page cache kept), so it is the peer at its fastest.

Prints one JSON document (machine, model, load, one row per system, ``targets``: new
requests served < 5 s after the kill, 0 lost). Every engine process is stopped at the
end, also on Ctrl-C, SIGTERM or an error; ``leftover_processes`` counts what was alive.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from elastic import (  # noqa: E402 - the sibling benchmark's load generator and helpers
    Load,
    Req,
    _r,
    add_load_args,
    gap_summary,
    gaps_ending_in,
    load_info,
    machine_info,
    make_llm,
    model_info,
    percentile,
    run_benchmark,
)

TARGET_NEW_REQUESTS_SERVED_S = 5.0


def log(msg: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ measures (pure)


def stream_pauses(reqs: list[Req], t: float) -> list[float]:
    """Per stream that had a token before ``t``: its last token before ``t`` to its first
    token after (the pause its client saw, across request boundaries and failures)."""
    before: dict[int, float] = {}
    after: dict[int, float] = {}
    for r in reqs:
        for c, _ in r.chunks:
            if c <= t:
                before[r.stream] = max(before.get(r.stream, c), c)
            else:
                after[r.stream] = min(after.get(r.stream, c), c)
    return [after[w] - before[w] for w in sorted(before) if w in after]


def in_flight_at(reqs: list[Req], t: float) -> list[Req]:
    return [r for r in reqs if r.submitted <= t and (r.done is None or r.done > t)]


def fault_row(
    system: str,
    reqs: list[Req],
    t_kill: float,
    max_tokens: int,
    t_new: float | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    hit = in_flight_at(reqs, t_kill)
    pauses = stream_pauses(reqs, t_kill)
    return {
        "system": system,
        "new_requests_served_s": _r(None if t_new is None else t_new - t_kill),
        "max_stream_pause_s": _r(max(pauses) if pauses else None),
        "p50_stream_pause_s": _r(percentile(pauses, 50)),
        "in_flight_at_kill": len(hit),
        "lost": sum(1 for r in hit if not r.complete(max_tokens)),
        "errors": sum(1 for r in reqs if r.error is not None),
        **extra,
    }


def targets(tidal: dict[str, Any]) -> dict[str, Any]:
    served = tidal["new_requests_served_s"]
    return {
        "new_requests_served_s": {
            "value": served,
            "target": f"< {TARGET_NEW_REQUESTS_SERVED_S}",
            "ok": served is not None and served < TARGET_NEW_REQUESTS_SERVED_S,
        },
        "lost": {"value": tidal["lost"], "target": "0", "ok": tidal["lost"] == 0},
        "errors": {"value": tidal["errors"], "target": "0", "ok": tidal["errors"] == 0},
    }


# ------------------------------------------------------------------ runs


async def _warm(load: Load, opts: argparse.Namespace) -> tuple[float, float]:
    await load.wait(lambda: load.completed() >= opts.streams, 300)
    await asyncio.sleep(opts.warmup_s)
    b0 = time.monotonic()
    await asyncio.sleep(opts.baseline_s)
    return b0, time.monotonic()


async def probe(get_llm: Callable[[], Any], retry_s: float) -> float:
    """Submit one short request now; while it is refused or fails, again every
    ``retry_s``. Returns when its first token arrived."""
    from tidal.frontend.processor import ProcessedPrompt
    from tidal.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    attempt = 0
    while True:
        llm = get_llm()
        if llm is not None:
            attempt += 1
            try:
                gen = llm.generate(ProcessedPrompt(None, [5, 6, 7]), params, f"probe-{attempt}")
                async for _ in gen:
                    t = time.monotonic()
                    await gen.aclose()
                    return t
            except Exception:  # noqa: BLE001, S110 - refused or failed: try again
                pass
        await asyncio.sleep(retry_s)


def _kill(llm: Any, rank: int) -> tuple[int, float]:
    engine = llm.client.topology.engine_ids[rank]
    os.kill(llm.client.manager.procs[engine].pid, signal.SIGKILL)
    return engine, time.monotonic()


async def run_tidal(opts: argparse.Namespace) -> dict[str, Any]:
    llm = await asyncio.to_thread(
        make_llm, opts.model, opts.dtype, opts.size, True, restore=opts.restore
    )
    load: Load | None = None
    try:
        load = Load(llm, opts.streams, opts.max_tokens, seed=opts.seed)
        b0, b1 = await _warm(load, opts)
        victim, t_kill = _kill(llm, opts.victim_rank)
        probing = asyncio.create_task(probe(lambda: llm, opts.retry_s))
        log(f"tidal: killed engine {victim} (rank {opts.victim_rank} of {opts.size})")
        controller = llm.scale_driver.controller

        def recovered() -> bool:
            return any(d["recovered_at"] for d in controller.faults()["deaths"])

        await load.wait(recovered, 120)
        t_new = await asyncio.wait_for(probing, 120)
        if opts.restore:
            await load.wait(lambda: llm.client.topology.size == opts.size, 300)
        await asyncio.sleep(opts.settle_s)
        await load.finish()
        faults = controller.faults()
        history = llm.scaling_history()
    finally:
        if load is not None:
            await load.cancel()
        await llm.shutdown()
    (death,) = faults["deaths"]
    recovery = next(h for h in history if h["operation_id"] == death["recovered_by"])
    restore = [h for h in history if h["trigger"] == "restore"]
    reqs = load.reqs
    log(f"tidal: recovered in {death['recovered_at'] - t_kill:.2f}s")
    extra = {
        "detect_s": _r(death["at"] - t_kill),
        "recovered_s": _r(death["recovered_at"] - t_kill),
        "recovery_operation_s": _r(recovery["duration_s"]),
        "recovery_phases_s": {k: _r(v) for k, v in recovery["phase_durations_s"].items()},
        "requests_migrated": death["requests_migrated"],
        "restore_s": _r(restore[-1]["duration_s"]) if restore else None,
        "restore_result": restore[-1]["result"] if restore else None,
        "baseline_gap": gap_summary(gaps_ending_in(reqs, b0, b1)),
        "requests": len(reqs),
    }
    return fault_row("tidal", reqs, t_kill, opts.max_tokens, t_new, extra)


async def run_restart(opts: argparse.Namespace) -> dict[str, Any]:
    llm = await asyncio.to_thread(make_llm, opts.model, opts.dtype, opts.size, False)
    load: Load | None = None
    try:
        load = Load(llm, opts.streams, opts.max_tokens, seed=opts.seed + 1, retry_s=opts.retry_s)
        await _warm(load, opts)
        victim, t_kill = _kill(llm, opts.victim_rank)
        probing = asyncio.create_task(probe(lambda: load.llm, opts.retry_s))
        log(f"restart: killed engine {victim}")
        while not llm.is_dead:  # the supervisor's poll
            await asyncio.sleep(opts.retry_s)
        t_detect = time.monotonic()
        load.llm = None
        old, llm = llm, None
        await old.shutdown()
        t_stopped = time.monotonic()
        load.deployment += 1
        llm = await asyncio.to_thread(make_llm, opts.model, opts.dtype, opts.size, False)
        t_up = time.monotonic()
        load.llm = llm
        t_new = await asyncio.wait_for(probing, 300)
        await asyncio.sleep(opts.settle_s)
        await load.finish()
    finally:
        if load is not None:
            await load.cancel()
        if llm is not None:
            await llm.shutdown()
    reqs = load.reqs
    extra = {
        "detect_s": _r(t_detect - t_kill),
        "stop_s": _r(t_stopped - t_detect),
        "start_s": _r(t_up - t_stopped),
        "requests_migrated": 0,
        "refused_attempts": len(load.refused),
        "requests": len(reqs),
    }
    log(f"restart: new requests served {t_new - t_kill:.2f}s after the kill")
    return fault_row("restart", reqs, t_kill, opts.max_tokens, t_new, extra)


async def run_all(opts: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    tidal = await run_tidal(opts)
    peer = await run_restart(opts) if not opts.no_peer else None
    return {
        "benchmark": "faults",
        "machine": machine_info(),
        "model": model_info(opts),
        "load": {
            **load_info(opts),
            "size": opts.size,
            "victim_rank": opts.victim_rank,
            "restore": opts.restore,
        },
        "rows": [tidal] + ([peer] if peer is not None else []),
        "targets": targets(tidal),
        "elapsed_s": _r(time.monotonic() - t0, 1),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_load_args(p, baseline_s=5.0, settle_s=2.0)
    p.add_argument("--size", type=int, default=3, help="DP = EP size at launch")
    p.add_argument("--victim-rank", type=int, default=1, help="rank that gets SIGKILL")
    p.add_argument("--restore", action="store_true", help="scale back to --size afterwards")
    p.add_argument("--no-peer", action="store_true", help="skip the restart peer")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 streams, short windows")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.streams, opts.max_tokens = 8, 16
        opts.warmup_s, opts.baseline_s, opts.settle_s = 0.5, 1.0, 0.5
    if not 0 <= opts.victim_rank < opts.size or opts.size < 2:
        p.error(f"--victim-rank must be a rank of --size (>= 2): got {opts.victim_rank}")
    return opts


def main(argv: list[str] | None = None) -> None:
    run_benchmark(run_all, parse_args(argv), log)


if __name__ == "__main__":
    main()
