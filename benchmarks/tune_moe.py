"""Grid-search block configs for the Triton fused-MoE kernel and write the JSON table.

    python benchmarks/tune_moe.py --num-experts 16 --hidden-size 2048 \
        --intermediate-size 768 --top-k 8 --dtype bfloat16 --batch-sizes 1 16 64 256 1024

For every batch size M it times each candidate config on the whole ``fused_experts``
call (align + two GEMMs + activation + sum), rejects configs whose output differs from
the reference, and prints one JSON line with the best config, its time and the time of
the default config (the peer). The table is merged into
``tidal/kernels/configs/E=..,N=..,device_name=..,dtype=...json`` (or ``--out-dir``).

``--dtype fp8`` tunes the block-FP8 (w8a8) kernel, ``tidal/kernels/fp8_triton.py``'s
``fused_experts_fp8``: bf16 activations, weights quantized in ``--block-k`` square blocks,
checked against ``fp8_torch.fused_experts_fp8_torch``; its table's dtype is
``float8_e4m3fn``.

Needs a CUDA GPU. ``--interpret-smoke`` instead runs a tiny search on CPU through the
Triton interpreter: a correctness check of this script, its timings mean nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# max |got - want| / max |want| a config may show against the reference.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2, "fp8": 5e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-experts", type=int, default=None, help="local experts E")
    p.add_argument("--hidden-size", type=int, default=None, help="H")
    p.add_argument("--intermediate-size", type=int, default=None, help="per-expert I (= N)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(TOLERANCE), default="bfloat16")
    p.add_argument(
        "--block-k",
        type=int,
        default=None,
        help="fp8: the weights' square block and activation group (default 128)",
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    p.add_argument("--search", choices=("small", "full"), default="small")
    p.add_argument("--iters", type=int, default=20, help="timed repetitions per config")
    p.add_argument("--out-dir", type=Path, default=None, help="default: tidal/kernels/configs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--interpret-smoke",
        action="store_true",
        help="CPU check under TRITON_INTERPRET=1: tiny shapes, two configs",
    )
    args = p.parse_args(argv)
    # Unset shapes: a small Qwen3-MoE-like layer on GPU, a toy one for the smoke run.
    shapes = (4, 32, 16, 2) if args.interpret_smoke else (8, 2048, 768, 2)
    for name, value in zip(("num_experts", "hidden_size", "intermediate_size", "top_k"), shapes):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.block_k is None:
        args.block_k = 32 if args.interpret_smoke else 128
    return args


def table_dtype(args: argparse.Namespace) -> str:
    """The dtype part of the table's file name: the weights' dtype."""
    return "float8_e4m3fn" if args.dtype == "fp8" else args.dtype


def candidate_configs(
    search: str, m: int, num_experts: int, top_k: int, max_block_k: int | None = None
) -> list[dict[str, int]]:
    """The grid, minus BLOCK_SIZE_M far above the rows an expert gets (pure padding) and,
    for FP8, BLOCK_SIZE_K above the weights' block (the kernel would clamp it: a repeat)."""
    if search == "full":
        grid = dict(m=[16, 32, 64, 128], n=[32, 64, 128, 256], k=[32, 64, 128, 256],
                    g=[1, 8, 16], w=[4, 8], s=[2, 3, 4, 5])  # fmt: skip
    else:
        grid = dict(m=[16, 32, 64, 128], n=[64, 128], k=[64, 128],
                    g=[1, 8], w=[4, 8], s=[3, 4])  # fmt: skip
    rows = max(1, -(-m * top_k // num_experts))
    max_block_m = max(16, 2 * (1 << (rows - 1).bit_length()))  # 2x next power of two
    return [
        dict(
            BLOCK_SIZE_M=bm,
            BLOCK_SIZE_N=bn,
            BLOCK_SIZE_K=bk,
            GROUP_SIZE_M=g,
            num_warps=w,
            num_stages=s,
        )  # fmt: skip
        for bm, bn, bk, g, w, s in itertools.product(*grid.values())
        if bm <= max_block_m and (max_block_k is None or bk <= max_block_k)
    ]


def smoke_configs() -> list[dict[str, int]]:
    return [
        dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1,
             num_warps=1, num_stages=1),
        dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=2,
             num_warps=1, num_stages=1),
    ]  # fmt: skip


def make_problem(args: argparse.Namespace, m: int, device: str) -> tuple:
    """(x, w13, w2, topk_weights, topk_ids); for fp8 (x, w13, w2, w13_scale, w2_scale,
    topk_weights, topk_ids) with FP8 weights and their row scales."""
    import torch

    fp8 = args.dtype == "fp8"
    dtype = torch.bfloat16 if fp8 else getattr(torch, args.dtype)
    e, h, i, k = args.num_experts, args.hidden_size, args.intermediate_size, args.top_k
    x = torch.randn(m, h, device=device).to(dtype)
    w13 = torch.randn(e, 2 * i, h, device=device) / h**0.5
    w2 = torch.randn(e, h, i, device=device) / i**0.5
    logits = torch.randn(m, e, device=device)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    routing = (weights.contiguous(), ids.contiguous())
    if not fp8:
        return (x, w13.to(dtype), w2.to(dtype), *routing)
    from tidal.kernels.fp8_torch import quantize_fp8_blocks, row_scales

    block = (args.block_k, args.block_k)
    parts: list[list] = [[], [], [], []]
    for ex in range(e):
        for j, w in enumerate((w13[ex], w2[ex])):
            q, s = quantize_fp8_blocks(w, block)
            parts[j].append(q)
            parts[2 + j].append(row_scales(s, *w.shape, block))
    return (x, *(torch.stack(p) for p in parts), *routing)


def reference(problem, args: argparse.Namespace | None = None) -> object:
    """fp32 oracle output of the problem (tidal.moe.reference when importable; for fp8
    the w8a8 reference, fp8_torch.fused_experts_fp8_torch)."""
    import torch
    import torch.nn.functional as F

    if args is not None and args.dtype == "fp8":
        from tidal.kernels.fp8_torch import fused_experts_fp8_torch

        x, w13, w2, s13, s2, weights, ids = problem
        return fused_experts_fp8_torch(x.float(), w13, w2, s13, s2, args.block_k, weights, ids)
    x, w13, w2, weights, ids = (t.float() if t.is_floating_point() else t for t in problem)
    try:
        from tidal.moe.reference import fused_experts_reference
    except ImportError:  # the kernels can be tuned without the rest of tidal
        inter = w2.shape[2]
        out = torch.zeros_like(x)
        for e in range(w13.shape[0]):
            tok, kk = torch.nonzero(ids == e, as_tuple=True)
            h = x[tok] @ w13[e].T
            y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].T
            out.index_add_(0, tok, y * weights[tok, kk, None])
        return out
    return fused_experts_reference(x, w13, w2, weights, ids)


def kernel_call(args: argparse.Namespace, problem) -> Callable[..., object]:
    """``call(config)``: the kernel being tuned on ``problem``."""
    if args.dtype == "fp8":
        from tidal.kernels.fp8_triton import fused_experts_fp8

        x, w13, w2, s13, s2, weights, ids = problem
        return lambda config: fused_experts_fp8(
            x, w13, w2, s13, s2, args.block_k, weights, ids, None, True, config
        )
    from tidal.kernels.fused_moe import fused_experts_with_config

    return lambda config: fused_experts_with_config(*problem, None, True, config)


def timer(device: str) -> Callable[..., float]:
    """Mean microseconds of fn over iters (CUDA events on GPU, wall clock otherwise)."""
    import torch

    def time_cuda(fn: Callable[[], object], iters: int, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / iters

    def time_wall(fn: Callable[[], object], iters: int) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e6 / iters

    return time_cuda if device == "cuda" else time_wall


def tune_one(args: argparse.Namespace, m: int, device: str, configs: list[dict[str, int]]):
    """(best config dict, best us, default-config us, rejected count) for batch m."""
    from tidal.kernels.fused_moe import is_interpreted
    from tidal.kernels.moe_config import MoeKernelConfig, default_config

    problem = make_problem(args, m, device)
    want = reference(problem, args)
    scale = float(want.abs().max().clamp_min(1e-6))
    measure = timer(device)
    call = kernel_call(args, problem)
    best, best_us, rejected = None, float("inf"), 0
    for raw in configs:
        config = MoeKernelConfig.from_json(raw)

        def run(config: MoeKernelConfig = config):
            return call(config)

        try:
            err = float((run().float() - want).abs().max()) / scale
        except Exception as exc:  # e.g. out of shared memory for this block shape
            print(f"skip {raw}: {type(exc).__name__}: {exc}", file=sys.stderr)
            rejected += 1
            continue
        if not err < TOLERANCE[args.dtype]:
            print(f"reject {raw}: rel err {err:.3g}", file=sys.stderr)
            rejected += 1
            continue
        us = measure(run, args.iters)
        if us < best_us:
            best, best_us = raw, us
    # The peer: what runs when no table matches (not the table being rewritten).
    fallback = default_config(m, args.num_experts, args.top_k, is_interpreted(), table_dtype(args))
    default_us = measure(lambda: call(fallback), args.iters)
    return best, best_us, default_us, rejected


def write_table(path: Path, found: dict[int, dict[str, int]]) -> None:
    from tidal.kernels.moe_config import MoeKernelConfig, dump_config_file, parse_config_file

    table = parse_config_file(path.read_text()) if path.is_file() else {}
    table.update({m: MoeKernelConfig.from_json(cfg) for m, cfg in found.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_config_file(table))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret_smoke:
        # Must precede the first import of triton: the mode is fixed at decoration time.
        os.environ["TRITON_INTERPRET"] = "1"
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import torch

    if args.interpret_smoke:
        device, device_name = "cpu", "interpreter"
        args.iters = 1
        batch_sizes = args.batch_sizes or [1, 8]
        if args.out_dir is None:
            with tempfile.TemporaryDirectory(prefix="tidal-tune-moe-") as tmp:
                args.out_dir = Path(tmp)
                return run_search(args, device, device_name, batch_sizes)
    elif not torch.cuda.is_available():
        print(
            "tune_moe.py needs a CUDA GPU (none found); use --interpret-smoke for a CPU "
            "correctness check of the script",
            file=sys.stderr,
        )
        return 1
    else:
        device, device_name = "cuda", torch.cuda.get_device_name()
        batch_sizes = args.batch_sizes or [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
        args.out_dir = args.out_dir or REPO_ROOT / "tidal" / "kernels" / "configs"
    return run_search(args, device, device_name, batch_sizes)


def run_search(
    args: argparse.Namespace, device: str, device_name: str, batch_sizes: list[int]
) -> int:
    import torch

    from tidal.kernels.moe_config import config_file_name, load_tuned_configs

    torch.manual_seed(args.seed)
    found: dict[int, dict[str, int]] = {}
    for m in batch_sizes:
        if args.interpret_smoke:
            configs = smoke_configs()
        else:
            max_k = args.block_k if args.dtype == "fp8" else None
            configs = candidate_configs(args.search, m, args.num_experts, args.top_k, max_k)
        best, best_us, default_us, rejected = tune_one(args, m, device, configs)
        if best is None:
            print(f"no config passed for M={m}", file=sys.stderr)
            return 1
        found[m] = best
        print(json.dumps({
            "bench": "tune_moe", "device": device_name, "dtype": args.dtype,
            "E": args.num_experts, "H": args.hidden_size, "N": args.intermediate_size,
            "top_k": args.top_k, "M": m, "config": best, "time_us": round(best_us, 2),
            "default_time_us": round(default_us, 2),
            "speedup_vs_default": round(default_us / best_us, 3),
            "tried": len(configs), "rejected": rejected,
        }), flush=True)  # fmt: skip
    path = args.out_dir / config_file_name(
        args.num_experts, args.intermediate_size, device_name, table_dtype(args)
    )
    write_table(path, found)
    load_tuned_configs.cache_clear()
    table = load_tuned_configs(
        args.num_experts, args.intermediate_size, device_name, table_dtype(args), args.out_dir
    )
    assert table is not None and all(table[m].to_json() == found[m] for m in found)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
