"""Decode on CPU with the decode plan (``tidal/models/cpu_decode.py``: a pure decode step
as flat C++ kernel calls) against the module path it replaces, in one process,
interleaved, with the machine's read bandwidth measured between them. Four sides, one per
``Fusion`` level and the module path: "stack" (the whole model, its layers all whole, as
one ``decode_model`` call, the default), "layers" (each all-direct layer as one
``decode_layer`` call), "plan" (the plan piece by piece) and "modules" (the module path).

The sides share one loaded ``tidal.LLM`` (in-process engine, no prefix caching) and its
kernel choices; only ``model.decode_plans.enabled`` and ``.fusion`` differ. Rounds alternate
the sides' order, and each round also times a 1 GiB ``sum`` (the read bandwidth), so a
side's single-stream time is set against the bandwidth of its own minutes. Outputs are
checked equal (every side is bit for bit the module path).

    python benchmarks/cpu_decode.py --model ~/.cache/tidal-peers/moe64-qwen3-moe-bfloat16 \
        --dtype bfloat16 [--rounds 5] [--threads 0] [--single-tokens 128] [--batch 32 --batch-tokens 64]

Prints one JSON document: the CPU, per case (single stream, batch) each side's ms per
generated token per round (prefill included), the medians, the ratios plan / modules,
layers / plan and stack / layers;
for the single stream the weight bytes a token reads (attention, router, its top-k
experts, lm_head) and each side's fraction of the measured bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from tidal.models.cpu_decode import Fusion

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_speed import active_bytes_per_token  # noqa: E402 - a sibling module
from decode_ab import Side, add_arguments, cases, header, interleaved_rounds  # noqa: E402 - a sibling module

# "stack": the whole model one decode_model call (the default); "layers": each all-direct
# layer one decode_layer call; "plan": the plan piece by piece; "modules": the module path.
SIDES = ("stack", "layers", "plan", "modules")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_arguments(ap, batch_tokens=64, prompt_len=32)
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
    if opts.threads:  # after the load: the in-process worker sets its own count
        torch.set_num_threads(opts.threads)
    plans = _model(llm).decode_plans

    @contextlib.contextmanager
    def side(enabled: bool, fusion: Fusion = Fusion.STACK) -> Iterator[None]:
        plans.enabled, plans.fusion = enabled, fusion
        try:
            yield
        finally:
            plans.enabled, plans.fusion = True, Fusion.STACK

    bandwidth: list[float] = []
    sides: dict[str, Side] = {
        "stack": lambda: side(True),
        "layers": lambda: side(True, Fusion.LAYERS),
        "plan": lambda: side(True, Fusion.PIECES),
        "modules": lambda: side(False),
    }
    times, outputs = interleaved_rounds(
        llm, opts, sides, lambda: bandwidth.append(_sum_gb_s(opts.sum_mib))
    )
    config = json.loads(open(os.path.join(opts.model, "config.json")).read())
    per_token = active_bytes_per_token(
        config, torch.tensor([], dtype=getattr(torch, opts.dtype)).element_size()
    )
    gb_s = statistics.median(bandwidth)
    result: dict[str, Any] = {
        **header(llm, opts),
        "read_bandwidth_gb_s": [round(b, 1) for b in bandwidth],
        "decode_bytes_per_token": per_token,
        "cases": {},
    }
    for case, (streams, tokens) in cases(opts).items():
        med = {s: statistics.median(times[case][s]) for s in SIDES}
        row: dict[str, Any] = {
            "streams": streams,
            "tokens": tokens,
            "ms_per_token": {s: [round(x, 3) for x in times[case][s]] for s in SIDES},
            "median_ms": {s: round(med[s], 3) for s in SIDES},
            "ratio_plan_over_modules": round(med["plan"] / med["modules"], 3),
            "ratio_layers_over_plan": round(med["layers"] / med["plan"], 3),
            "ratio_stack_over_layers": round(med["stack"] / med["layers"], 3),
            "same_tokens": all(outputs[case][s] == outputs[case]["modules"] for s in SIDES),
        }
        if streams == 1:  # the bytes a token reads over its time, against the sum's rate
            row["fraction_of_bandwidth"] = {
                s: round(per_token / (med[s] / 1e3) / (gb_s * 1e9), 3) for s in SIDES
            }
        result["cases"][case] = row
    return result


if __name__ == "__main__":
    main()
