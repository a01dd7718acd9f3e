"""The C++ fused MoE's down-pass layout, ``w2 [S, E, R, I_pad, 64]``, at each run length R
(``cpu_moe.down_run``), in one process, candidates interleaved round by round:

* ``run1``: R = 1, one block per expert and output column block (the layout before runs);
* ``default``: R = ``down_run(blocks)``, one thread's share of the down pass;
* ``all``: R = all blocks, each expert's down weights one stretch.

The kernel is the same for all three (it takes any R); each candidate has its own copies
of ``--layers`` layers' experts, called in turn with a fresh seeded routing per call (a
count coprime with the layers'), so the weights come from memory as at decode. bf16 on
the dot kernel where the CPU has AVX512-BF16 (else the shift kernel), FP8 (128x128 blocks)
on the FP8 dot kernel where it has AVX512-BF16 and VBMI (else the fp16 decode). Shapes:
the 64-expert checkpoint's layer (64 experts, H512, I256, top-8) and the big one's (32
experts, H1024, I512, top-4), at 1 and 32 tokens. Prints one JSON document: per case the
best and median us per layer of each candidate and ``run1_over_default`` (> 1: runs
faster) and ``all_over_default``.

    python benchmarks/expert_runs.py [--threads 2] [--rounds 9] [--layers 8] [--tokens 1,32]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch

from tidal.kernels.cpu_ext import bf16_dot_available, fp8_dot_available
from tidal.kernels.cpu_fp8 import fp8_fused_experts, pack_fp8_experts
from tidal.kernels.cpu_moe import DOWN_BLOCK, CpuPackedExperts, down_run, fused_experts_cpu
from tidal.kernels.select import cpu_description

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_kernels import BLOCK, T0, best_and_median, interleaved_us, quantize_experts  # noqa: E402 - a sibling module

SHAPES = {"moe64": (64, 512, 256, 8), "big": (32, 1024, 512, 4)}  # E, H, I, top-k


def _time(fns: dict[str, Callable[[], None]], rounds: int, layers: int) -> dict[str, object]:
    """Best and median us per layer of each candidate (3 calls a round), and the others'
    medians over the default's."""
    times = {k: [v / layers for v in vs] for k, vs in interleaved_us(fns, rounds, 3).items()}
    out = best_and_median(times)
    for other in ("run1", "all"):
        out[f"{other}_over_default"] = round(
            statistics.median(times[other]) / statistics.median(times["default"]), 3
        )
    return out


def _caller(
    layers: list,
    fp8: bool,
    x: torch.Tensor,  # [T, H] bf16
    tw: torch.Tensor,  # [T, top_k] float32
    routings: list[torch.Tensor],  # [T, top_k] int64 each
    fp8_dot: bool,
    dot: bool,
) -> Callable[[], None]:
    """One call over every layer's experts, each layer with the next routing (each
    candidate cycles through them all)."""
    ids = itertools.cycle(routings).__next__

    def run() -> None:
        for p in layers:
            if fp8:
                fp8_fused_experts(x, p, tw, ids(), None, True, T0, fp8_dot)
            else:
                fused_experts_cpu(x, p, tw, ids(), None, True, T0, dot)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", default="1,32")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    dot, fp8_dot = bf16_dot_available(), fp8_dot_available()
    doc: dict[str, object] = {
        "benchmark": "expert_runs",
        "cpu": cpu_description()["model"],
        "threads": a.threads,
        "bf16_dot": dot,
        "fp8_dot": fp8_dot,
    }
    for shape, (experts, hidden, inter, top_k) in SHAPES.items():
        blocks = -(-hidden // DOWN_BLOCK)
        runs = {"run1": 1, "default": down_run(blocks, a.threads), "all": blocks}
        doc[f"{shape}_runs"] = runs
        packs: dict[str, dict[str, list]] = {d: {k: [] for k in runs} for d in ("bf16", "fp8")}
        for _ in range(a.layers):
            w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02
            w2 = torch.randn(experts, hidden, inter, generator=g) * 0.02
            quantized = (*quantize_experts(w13), *quantize_experts(w2))
            for name, run in runs.items():  # each candidate its own copy
                packs["bf16"][name].append(CpuPackedExperts(w13.bfloat16(), w2.bfloat16(), run))
                packs["fp8"][name].append(pack_fp8_experts(*quantized, BLOCK, run=run))
        for tokens in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(tokens, hidden, generator=g).bfloat16()
            tw = torch.rand(tokens, top_k, generator=g)
            routings = [
                torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
                for _ in range(a.layers + 1)
            ]  # [tokens, top_k] int64 each
            for dtype, layers in packs.items():
                fns = {
                    name: _caller(layers[name], dtype == "fp8", x, tw, routings, fp8_dot, dot)
                    for name in runs
                }
                doc[f"{shape}_{dtype}_{tokens}tok"] = _time(fns, a.rounds, a.layers)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
