"""Decode on CPU with the decode plan (``tidal/models/cpu_decode.py``: a pure decode step
as flat C++ kernel calls) against the module path it replaces, in one process,
interleaved, with the machine's read bandwidth measured between them.

Both sides share one loaded ``tidal.LLM`` (in-process engine, no prefix caching) and its
kernel choices; only ``model.decode_plans.enabled`` differs. Rounds alternate which side
goes first, and each round also times a 1 GiB ``sum`` (the read bandwidth), so a side's
single-stream time is set against the bandwidth of its own minutes. Outputs are checked
equal (the plan is bit for bit the module path).

    python benchmarks/cpu_decode.py --model ~/.cache/tidal-peers/moe64-qwen3-moe-bfloat16 \
        --dtype bfloat16 [--rounds 5] [--threads 0] [--single-tokens 128] [--batch 32 --batch-tokens 64]

Prints one JSON document: the CPU, per case (single stream, batch) each side's ms per
generated token per round (prefill included), the medians and the ratio plan / modules;
for the single stream the weight bytes a token reads (attention, router, its top-k
experts, lm_head) and each side's fraction of the measured bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from tidal.kernels.select import cpu_description

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_speed import active_bytes_per_token  # noqa: E402 - a sibling module

SIDES = ("plan", "modules")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--single-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batch-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--sum-mib", type=int, default=1024, help="the bandwidth probe's tensor")
    opts = ap.parse_args()

    from tidal import LLM

    with LLM(opts.model, dtype=opts.dtype, multiprocess=False, enable_prefix_caching=False) as llm:
        result = measure(llm, opts)
    print(json.dumps(result, indent=1, default=str))


def _model(llm: Any) -> Any:
    """The in-process engine's model (``multiprocess=False``)."""
    return llm.client.engine.executor.worker.model_runner.model


def _sum_gb_s(mib: int) -> float:
    """Read bandwidth: the best of 5 sums of a float32 tensor of ``mib`` MiB (1 GiB: well
    past any cache)."""
    buf = torch.ones(mib * 256 * 1024)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def measure(llm: Any, opts: argparse.Namespace) -> dict[str, Any]:
    from tidal import SamplingParams

    if opts.threads:  # after the load: the in-process worker sets its own count
        torch.set_num_threads(opts.threads)
    plans = _model(llm).decode_plans
    vocab = 1000
    cases = {"single": (1, opts.single_tokens), "batch": (opts.batch, opts.batch_tokens)}
    times: dict[str, dict[str, list[float]]] = {c: {s: [] for s in SIDES} for c in cases}
    outputs: dict[str, dict[str, list[list[int]]]] = {c: {} for c in cases}
    bandwidth: list[float] = []

    def run(case: str, side: str) -> None:
        streams, tokens = cases[case]
        prompts = [
            {"prompt_token_ids": [(7 * i + 13 * j) % vocab + 3 for j in range(opts.prompt_len)]}
            for i in range(streams)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        plans.enabled = side == "plan"
        try:
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
        finally:
            plans.enabled = True
        times[case][side].append(dt * 1e3 / tokens)
        outputs[case][side] = [list(o.outputs[0].token_ids) for o in outs]

    for case in cases:  # warm both sides
        for side in SIDES:
            run(case, side)
    times = {c: {s: [] for s in SIDES} for c in cases}
    for r in range(opts.rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for case in cases:
            for side in order:
                run(case, side)
        bandwidth.append(_sum_gb_s(opts.sum_mib))
        print(f"round {r + 1}/{opts.rounds} done", file=sys.stderr)
    config = json.loads(open(os.path.join(opts.model, "config.json")).read())
    per_token = active_bytes_per_token(
        config, torch.tensor([], dtype=getattr(torch, opts.dtype)).element_size()
    )
    gb_s = statistics.median(bandwidth)
    result: dict[str, Any] = {
        "cpu": cpu_description()["model"],
        "threads": torch.get_num_threads(),
        "model": opts.model,
        "dtype": opts.dtype,
        "cpu_kernels": llm.cpu_kernels(),
        "read_bandwidth_gb_s": [round(b, 1) for b in bandwidth],
        "decode_bytes_per_token": per_token,
        "cases": {},
    }
    for case, (streams, tokens) in cases.items():
        med = {s: statistics.median(times[case][s]) for s in SIDES}
        row: dict[str, Any] = {
            "streams": streams,
            "tokens": tokens,
            "ms_per_token": {s: [round(x, 3) for x in times[case][s]] for s in SIDES},
            "median_ms": {s: round(med[s], 3) for s in SIDES},
            "ratio_plan_over_modules": round(med["plan"] / med["modules"], 3),
            "same_tokens": outputs[case]["plan"] == outputs[case]["modules"],
        }
        if streams == 1:  # the bytes a token reads over its time, against the sum's rate
            row["fraction_of_bandwidth"] = {
                s: round(per_token / (med[s] / 1e3) / (gb_s * 1e9), 3) for s in SIDES
            }
        result["cases"][case] = row
    return result


if __name__ == "__main__":
    main()
