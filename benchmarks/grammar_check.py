"""What the server's structured-output compile check costs, and what it costs the others.

For ``--schemas`` distinct heavy JSON schemas (a hundred bounded numbers each), prints
one JSON line per case:

- ``compile``: ``check_spec`` per schema, uncached and cached (ms);
- ``event_loop``: the longest stall a 1 ms ticker sees on the event loop while requests
  bringing those schemas are checked, and how long all checks took, for the server's
  path (``OpenAIServing.check_grammar``: on a thread, one check per spec in flight) and
  its peer, the same check run on the loop (how the server ran it before).

Usage: ``python benchmarks/grammar_check.py [--schemas 8] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tidal.engine_core import structured
from tidal.launch import openai_models as P
from tidal.launch.serving import OpenAIServing


def heavy_schema(i: int) -> dict[str, Any]:
    """A schema xgrammar takes a tenth of a second or more over (number ranges are its
    costly part); ``i`` makes it distinct."""
    return {
        "type": "object",
        "properties": {
            f"p{i}_{k}": {"type": "number", "minimum": -1.5 * k, "maximum": 10.25 ** (k % 12 + 1)}
            for k in range(100)
        },
    }


def request(schema: dict[str, Any]) -> P.CompletionRequest:
    return P.CompletionRequest.model_validate({"prompt": "x", "guided_json": schema})


def forget() -> None:
    """Empty ``check_spec``'s memo, so the next check compiles."""
    with structured._checked_lock:
        structured._checked_keys.clear()


async def on_loop(req: P.CompletionRequest) -> None:
    """The peer: the check as the server ran it before, on the event loop."""
    spec = req.structured_spec()
    if spec is not None:
        structured.check_spec(spec[1], spec[0])


async def stall_while(checks: list[Awaitable[None]]) -> tuple[float, float]:
    """(longest loop stall in ms, wall ms) while ``checks`` run concurrently."""
    stop, worst = False, 0.0

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst = max(worst, (now - last) * 1e3 - 1.0)
            last = now

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    await asyncio.gather(*checks)
    wall = (time.perf_counter() - start) * 1e3
    stop = True
    await tick
    return worst, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemas", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    reqs = [request(heavy_schema(i)) for i in range(args.schemas)]
    machine = platform.processor() or platform.machine()

    # xgrammar's import and first use are not a compile's cost.
    structured.check_spec(structured.StructuredOutputs(json='{"type": "object"}'))
    uncached, cached = [], []
    for req in reqs:
        spec = req.structured_spec()
        assert spec is not None
        forget()
        t = time.perf_counter()
        structured.check_spec(spec[1], spec[0])
        uncached.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        structured.check_spec(spec[1], spec[0])
        cached.append((time.perf_counter() - t) * 1e3)
    print(json.dumps({
        "case": "compile", "machine": machine, "schemas": args.schemas,
        "uncached_ms_median": round(statistics.median(uncached), 1),
        "uncached_ms_max": round(max(uncached), 1),
        "cached_ms_median": round(statistics.median(cached), 4),
    }))  # fmt: skip

    # check_grammar needs none of the server's engine state: a bare instance serves.
    server = object.__new__(OpenAIServing)
    server._grammar_checks = {}
    paths: dict[str, Callable[[P.CompletionRequest], Awaitable[None]]] = {
        "thread": server.check_grammar,
        "on_loop": on_loop,
    }
    for r in range(args.rounds):
        for name, check in paths.items():  # interleaved, so a noisy machine hits both
            forget()
            worst, wall = asyncio.run(stall_while([check(q) for q in reqs]))
            print(json.dumps({
                "case": "event_loop", "path": name, "round": r, "schemas": args.schemas,
                "max_stall_ms": round(worst, 2), "wall_ms": round(wall, 1),
            }))  # fmt: skip


if __name__ == "__main__":
    main()
