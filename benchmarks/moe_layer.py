"""MoE layer on CPU: our FusedMoE (torch path) vs the reference loop vs transformers'
Qwen3-MoE sparse block, on identical weights, at the default model's MoE shape.

Ours runs as the model builds it (``tidal_torch``: K-major expert and router weights,
``strategy="auto"``), with the checkpoint's row-major layout (``tidal_torch_rowmajor``),
and with each expert strategy pinned (``tidal_torch_bmm`` / ``_grouped_mm`` / ``_loop``).
transformers runs twice: ``transformers_grouped_mm`` (the experts implementation its
full model picks by default in v5) and ``transformers_eager`` (its per-expert loop, what
a standalone block runs). Implementations take turns call by call (a burst of load from
another process then hits all alike). Prints one JSON line per (tokens, implementation):
median and best microseconds per call; then a summary line with ``tidal_torch``'s
speedup (median) over each other implementation. ``--clock auto`` (default) times with
the process's CPU time at one thread (other processes' load on a shared machine then
inflates the numbers less) and with wall time at more threads (idle OpenMP workers spin,
which CPU time would count).

    python benchmarks/moe_layer.py [--threads 2] [--tokens 1 32 256]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from tidal.kernels.fused_moe_torch import fused_experts_torch
from tidal.models.common import set_k_major_moe_weights
from tidal.models.tiny import DEFAULT_MODEL_ARGS
from tidal.moe.layer import FusedMoE


def _hf_block(
    hidden: int, experts: int, top_k: int, inter: int, norm: bool, experts_impl: str = "eager"
) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=inter, norm_topk_prob=norm,
    )  # fmt: skip
    cfg._experts_implementation = experts_impl
    torch.manual_seed(0)  # same weights for every variant
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.1)
    return block


def _ours(
    block: torch.nn.Module,
    backend: str,
    hidden: int,
    experts: int,
    top_k: int,
    inter: int,
    norm: bool,
    k_major: bool = False,
    strategy: str | None = None,
) -> FusedMoE:
    moe = FusedMoE(experts, top_k, hidden, inter, norm, backend=backend)
    with torch.no_grad():
        moe.gate.copy_(block.gate.weight)
        moe.w13.copy_(block.experts.gate_up_proj)
        moe.w2.copy_(block.experts.down_proj)
    if k_major:
        set_k_major_moe_weights(moe)  # what the model does for the torch backend
    if strategy is not None:
        moe.experts_fn = functools.partial(fused_experts_torch, strategy=strategy)
    return moe


def _time_all(
    fns: dict[str, Callable[[], object]], clock: Callable[[], float], min_seconds: float
) -> dict[str, list[float]]:
    """Microseconds per call of each fn; the fns take turns, in a shuffled order."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    start = clock()
    rounds = 0
    while rounds < 20 or (clock() - start < min_seconds * len(fns) and rounds < 2000):
        random.shuffle(order)
        for name in order:
            t0 = clock()
            fns[name]()
            samples[name].append((clock() - t0) * 1e6)
        rounds += 1
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto")
    ap.add_argument("--min-seconds", type=float, default=1.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.clock == "auto":
        args.clock = "cpu" if args.threads == 1 else "wall"
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    shape = {
        "hidden": DEFAULT_MODEL_ARGS["hidden_size"],
        "experts": DEFAULT_MODEL_ARGS["num_experts"],
        "top_k": DEFAULT_MODEL_ARGS["top_k"],
        "inter": DEFAULT_MODEL_ARGS["moe_intermediate_size"],
        "norm": DEFAULT_MODEL_ARGS["norm_topk_prob"],
    }
    block = _hf_block(**shape)
    impls = {
        "tidal_torch": _ours(block, "torch", **shape, k_major=True),
        "tidal_torch_rowmajor": _ours(block, "torch", **shape),
        **{
            f"tidal_torch_{strategy}": _ours(
                block, "torch", **shape, k_major=True, strategy=strategy
            )
            for strategy in ("bmm", "grouped_mm", "loop")
        },
        "tidal_reference": _ours(block, "reference", **shape),
        "transformers_grouped_mm": _hf_block(**shape, experts_impl="grouped_mm"),
        "transformers_eager": block,
    }
    for tokens in args.tokens:
        x = torch.randn(tokens, shape["hidden"])
        with torch.inference_mode():
            want = block(x.unsqueeze(0)).squeeze(0)
            fns, errs = {}, {}
            for name, mod in impls.items():
                hf = name.startswith("transformers")
                fn = (lambda m=mod, x=x: m(x.unsqueeze(0))) if hf else (lambda m=mod, x=x: m(x))
                errs[name] = (fn().reshape(want.shape) - want).abs().max().item()
                fns[name] = fn
            all_samples = _time_all(fns, clock, args.min_seconds)
            medians = {}
            for name, samples in all_samples.items():
                medians[name] = statistics.median(samples)
                print(json.dumps({
                    "bench": "moe_layer", "impl": name, "tokens": tokens, **shape, "dtype": "float32",
                    "threads": args.threads, "clock": args.clock, "median_us": round(medians[name], 1),
                    "best_us": round(min(samples), 1), "calls": len(samples),
                    "max_abs_err_vs_hf": errs[name],
                }))  # fmt: skip
        print(json.dumps({
            "bench": "moe_layer", "summary": True, "tokens": tokens, "threads": args.threads,
            **{
                f"speedup_vs_{name}": round(med / medians["tidal_torch"], 2)
                for name, med in medians.items()
                if name != "tidal_torch"
            },
        }))  # fmt: skip


if __name__ == "__main__":
    main()
