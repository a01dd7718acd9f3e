"""The C++ kernels' spin pool (``tidal/kernels/csrc/pool.h``) against torch's OpenMP pool
(the previous design) in engine processes beside their frontend, as ``launch`` runs them.

One ``LLM(multiprocess=True)`` per spin window (``--spins``; 0 is OpenMP), all loaded at
once, each engine spawned with ``TIDAL_CPU_SPIN_US`` set to its window (and the short
OpenMP spin every engine process gets, ``tidal/utils/cpu_threads.py``), and with
``--long-openmp`` one more on OpenMP with the runtime's default spin (``omp-long``: threads
that never sleep within a step, the bound a pool can reach, which starves a frontend
between steps). Rounds alternate
the engines' order; each round runs a single stream and a batch on every engine. Outputs
are checked equal across engines (the pool changes which thread runs a task, not the sums).

    python benchmarks/cpu_pool.py --model ~/.cache/tidal-peers/big-qwen3-moe-fp8 \\
        [--spins 0,200,2000] [--rounds 5] [--single-tokens 128] [--batch 32 --batch-tokens 64]

Prints one JSON document: the CPU, per case and window the ms per generated token per
round (prefill included), the medians, and each window's median over OpenMP's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_ab import add_arguments, cases  # noqa: E402 - a sibling module

LONG = "omp-long"  # OpenMP, its default spin (libgomp's 300,000)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_arguments(ap, batch_tokens=64, prompt_len=32)
    ap.add_argument("--spins", default="0,200", help="windows in microseconds; 0: OpenMP")
    ap.add_argument("--long-openmp", action="store_true", help="also OpenMP's default spin")
    opts = ap.parse_args()
    spins: list[int | str] = [int(s) for s in opts.spins.split(",")]
    if 0 not in spins:
        spins.insert(0, 0)
    if opts.long_openmp:
        spins.append(LONG)

    from tidal import LLM, SamplingParams
    from tidal.kernels.select import cpu_description
    from tidal.utils.cpu_threads import SPIN_COUNT, SPIN_POOL_ENV

    with contextlib.ExitStack() as stack:
        llms: dict[int | str, Any] = {}
        saved = {k: os.environ.get(k) for k in (SPIN_POOL_ENV, "GOMP_SPINCOUNT")}
        try:
            for spin in spins:  # read by each engine process at its spawn
                os.environ[SPIN_POOL_ENV] = "0" if spin == LONG else str(spin)
                if spin == LONG:  # an operator's setting wins over the engine's short spin
                    os.environ["GOMP_SPINCOUNT"] = "300000"
                llms[spin] = stack.enter_context(
                    LLM(
                        opts.model, dtype=opts.dtype, multiprocess=True, enable_prefix_caching=False
                    )
                )
                os.environ.pop("GOMP_SPINCOUNT", None)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

        runs = cases(opts)
        times: dict[str, dict[int | str, list[float]]] = {c: {s: [] for s in spins} for c in runs}
        outputs: dict[str, dict[int | str, list[list[int]]]] = {c: {} for c in runs}

        def run(case: str, spin: int | str, record: bool) -> None:
            streams, tokens = runs[case]
            prompts = [
                {"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 3 for j in range(opts.prompt_len)]}
                for i in range(streams)
            ]
            params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
            t = time.perf_counter()
            outs = llms[spin].generate(prompts, params, use_tqdm=False)
            if record:
                times[case][spin].append((time.perf_counter() - t) * 1e3 / tokens)
            outputs[case][spin] = [list(o.outputs[0].token_ids) for o in outs]

        for case in runs:  # warm every engine
            for spin in spins:
                run(case, spin, record=False)
        for r in range(opts.rounds):
            order = spins if r % 2 == 0 else spins[::-1]
            for case in runs:
                for spin in order:
                    run(case, spin, record=True)
            print(f"round {r + 1}/{opts.rounds} done", file=sys.stderr)

    result: dict[str, Any] = {
        "cpu": cpu_description()["model"],
        "model": opts.model,
        "dtype": opts.dtype,
        "spins_us": spins,
        "gomp_spincount": {"engines": SPIN_COUNT, LONG: 300000},
        "cases": {},
    }
    for case, (streams, tokens) in runs.items():
        med = {s: statistics.median(times[case][s]) for s in spins}
        result["cases"][case] = {
            "streams": streams,
            "tokens": tokens,
            "ms_per_token": {str(s): [round(x, 3) for x in times[case][s]] for s in spins},
            "median_ms": {str(s): round(med[s], 3) for s in spins},
            "ratio_over_openmp": {str(s): round(med[s] / med[0], 3) for s in spins if s},
            "same_tokens": all(outputs[case][s] == outputs[case][0] for s in spins),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
