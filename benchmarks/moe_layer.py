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

``--dtype bfloat16`` times instead every path that can hold the weights of a layer's ops
(``tidal/kernels/select.py``'s candidates: the C++ kernels per prefetch hint -- for bf16
the shift kernel and, where the CPU has AVX512-BF16, the ``dot-`` kernel; for the experts
the ``amx`` kernel where it has AMX --, oneDNN
prepacked, torch) in bf16 against the same paths in float32, on the same shapes: the
experts, the router and a linear of the default model, of the 64-expert top-8 shape and of
the 1024-wide one, at each ``--tokens``, all candidates of one op taking turns. Each runs
on the trial stand-ins the load-time choice measures (``cpu_trial``: weights rotated over a
pool larger than the caches), so one row reads its weights from memory; ``decode_GBps``
is those bytes over the fastest call, beside a ``torch`` copy's bandwidth measured in the
same run. Prints the CPU's model and flags first.

    python benchmarks/moe_layer.py --dtype bfloat16 [--tokens 1 32] [--pool-mib 256] [--shapes big]

``--biased`` times GPT-OSS's experts (per-expert biases, clamped SwiGLU) instead: the
experts op's own candidates (the C++ kernels with those extras, ``biased_experts`` as
``torch``), in ``--dtype`` alone (float32 is then a dtype like bf16), at the shapes given
(``gpt_oss_20b``: GPT-OSS-20B's layer, 2880 wide, 32 experts top-4, 1.6 GB in bf16).

    python benchmarks/moe_layer.py --biased --dtype bfloat16 --shapes gpt_oss_20b --tokens 1 16 128
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from tidal.kernels.cpu_ext import amx_fits
from tidal.kernels.fused_moe_torch import empty_k_major_experts, fused_experts_torch
from tidal.kernels.select import (
    Candidate,
    Choice,
    cpu_description,
    weight_candidates,
)
from tidal.layers.linear import Linear
from tidal.models.common import set_k_major_moe_weights
from tidal.models.tiny import DEFAULT_MODEL_ARGS
from tidal.moe.layer import FusedMoE
from tidal.moe.reference import ClampedSwiGLU

# (hidden, experts, top_k, intermediate) of the held-path comparison: the default model,
# the 64-expert top-8 checkpoint and the 1024-wide one (benchmarks/cpu_speed.py's moe64, big)
PATH_SHAPES = {
    "default": (256, 16, 4, 128),
    "moe64": (512, 64, 8, 256),
    "big": (1024, 32, 4, 512),
    "gpt_oss_20b": (2880, 32, 4, 2880),
}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


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


def _copy_gbps(nbytes: int) -> float:
    """torch's copy of ``nbytes`` (read + write), GB/s of the fastest of a few."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def _op_bytes(op: str, shape: tuple[int, int, int, int], rows: int, itemsize: int) -> int:
    """The weight bytes one call of ``op`` reads at ``rows`` rows (1 row: its top-k experts)."""
    hidden, experts, top_k, inter = shape
    if op == "experts":
        return min(experts, top_k * rows) * 3 * hidden * inter * itemsize
    if op == "router":
        return experts * hidden * itemsize
    return hidden * hidden * itemsize  # the linear: hidden x hidden


def _moe(shape: tuple[int, int, int, int], dtype: torch.dtype, biased: bool) -> FusedMoE:
    """A layer of ``shape``; ``biased``: GPT-OSS's experts (biases, clamped SwiGLU)."""
    hidden, experts, top_k, inter = shape
    extras: dict = {}
    if biased:
        extras = {"expert_bias": True, "activation": ClampedSwiGLU(1.702, 7.0)}
    return FusedMoE(experts, top_k, hidden, inter, True, dtype=dtype, **extras)


def _experts_stand_ins(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    cand: Candidate,
    instances: int,
    biased: bool = False,
) -> Callable[[int], Callable[[], object]]:
    """``instances`` MoE layers on ``cand``'s path; call j of the thunk runs the next layer
    with the next experts in turn (every expert of every layer read once per cycle, so the
    weights come from memory, not from the caches a fixed top-k would stay in)."""
    hidden, experts, top_k, inter = shape
    layers = []
    for _ in range(instances):
        moe = _moe(shape, dtype, biased)
        moe.set_cpu_path("experts", Choice.fixed(cand, cand.path))
        moe.w13.data, moe.w2.data = empty_k_major_experts(moe.w13, moe.w2)
        moe.w13.data.fill_(0.01)
        moe.w2.data.fill_(0.01)
        if moe.w13_bias is not None and moe.w2_bias is not None:
            moe.w13_bias.fill_(0.01)
            moe.w2_bias.fill_(0.01)
        moe._pack("experts")
        layers.append(moe)

    def for_rows(rows: int) -> Callable[[], object]:
        x = torch.full((rows, hidden), 0.5, dtype=dtype)
        weights = torch.full((rows, top_k), 1.0 / top_k)
        turn = itertools.count()

        def run() -> object:
            j = next(turn)
            first = (j * top_k * rows) % experts
            ids = (torch.arange(rows * top_k) + first).remainder(experts).view(rows, top_k)
            return layers[j % len(layers)].forward_experts(x, weights, ids)

        return run

    return for_rows


def held_paths(args: argparse.Namespace, dtype: torch.dtype) -> None:
    cpu = cpu_description()
    flags = set(cpu["flags"].split())
    print(json.dumps({
        "bench": "moe_layer_paths", "cpu": cpu["model"], "threads": args.threads,
        "flags": {f: f in flags for f in CPU_FLAGS},
        "memcpy_GBps": round(_copy_gbps(args.pool_mib << 20), 1),
    }))  # fmt: skip
    dtypes = [torch.float32] if dtype == torch.float32 else [torch.float32, dtype]
    if args.biased:
        dtypes = [dtype]
    for tag in args.shapes:
        shape = PATH_SHAPES[tag]
        hidden, experts, top_k, inter = shape
        for op in ("experts",) if args.biased else ("experts", "router", "linear"):
            thunks: dict[str, Callable[[int], Callable[[], object]]] = {}
            nbytes: dict[str, int] = {}
            for dt in dtypes:
                if op == "linear":
                    module: FusedMoE | Linear = Linear(hidden, hidden, dtype=dt)
                    name = "linear"
                else:
                    module = FusedMoE(experts, top_k, hidden, inter, True, dtype=dt)
                    name = op
                per = _op_bytes(op, (hidden, experts, experts, inter), 1, dt.itemsize)
                instances = max(1, min(16, (args.pool_mib << 20) // per))
                if op == "experts" and args.biased:  # the biased layer's own op
                    cands = list(_moe(shape, dt, True).cpu_ops()["experts"].candidates)
                elif op == "experts":
                    cands = weight_candidates(dt, amx_fits=amx_fits(dt, hidden))
                elif op == "linear":  # the layer's own: bf16 adds the AMX kernel where it fits
                    cands = list(module.cpu_ops()["linear"].candidates)
                else:
                    cands = weight_candidates(dt)
                for cand in cands:
                    key = f"{str(dt).removeprefix('torch.')}/{cand.name}"
                    if op == "experts":
                        thunks[key] = _experts_stand_ins(shape, dt, cand, instances, args.biased)
                    else:
                        thunks[key] = module.cpu_trial(name, cand, instances)
                    nbytes[key] = dt.itemsize
            for rows in args.tokens:
                with torch.inference_mode():
                    fns = {k: make(rows) for k, make in thunks.items()}
                    samples = _time_all(fns, time.perf_counter, args.min_seconds / len(fns))
                for key, got in samples.items():
                    best_s = min(got) / 1e6
                    read = _op_bytes(op, shape, rows, nbytes[key])
                    print(json.dumps({
                        "bench": "moe_layer_paths", "shape": tag, "op": op, "path": key,
                        "tokens": rows, "hidden": hidden, "experts": experts, "top_k": top_k,
                        "inter": inter, "median_us": round(statistics.median(got), 1),
                        "best_us": round(min(got), 1), "calls": len(got),
                        "decode_GBps": round(read / best_s / 1e9, 1) if rows == 1 else None,
                    }))  # fmt: skip
            del thunks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto")
    ap.add_argument("--min-seconds", type=float, default=1.0)
    ap.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32",
        help="bfloat16: the held paths in bf16 against float32 (see the module's doc)",
    )  # fmt: skip
    ap.add_argument("--pool-mib", type=int, default=256, help="held paths: weights rotated per path")
    ap.add_argument(
        "--biased", action="store_true",
        help="GPT-OSS's experts (biases, clamped SwiGLU) on their paths, in --dtype alone",
    )  # fmt: skip
    ap.add_argument(
        "--shapes", nargs="+", choices=list(PATH_SHAPES), default=["default", "moe64", "big"],
        help="held paths: the shapes to time",
    )  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.dtype != "float32" or args.biased:
        held_paths(args, getattr(torch, args.dtype))
        return
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
