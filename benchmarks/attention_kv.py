"""Decode attention on CPU per KV cache dtype (``--kv-cache-dtype``) and path: one decode
step of ``PagedAttention`` (the new K/V written into the cache, then every sequence's
query attending its paged keys) at the attention shapes of ``cpu_speed.py``'s 256-wide
(4 query heads, 2 KV heads) and 1024-wide (16, 4) checkpoints, head_dim 64, block 16.

Cases: a float32 model on a float32 cache (the baseline), on a bfloat16 cache (half the
cache bytes: the kernel widens it in registers) and a bfloat16 model on its bfloat16
cache; each on the C++ kernel (``native``) and the torch path (``torch``, the reference).
All cases take turns call by call, round by round (a burst of load from another process
hits them alike); each is timed by its best round's median. Prints one JSON line per
(shape, sequences, context, case) with microseconds per step and the cache's bytes, then
a summary line: each case's speed against the float32 cache on the same path, and native
against torch.

``--cold``: before each timed call, a 256 MiB read evicts the caches (a serving decode
step's KV is cold: the MoE weights streamed through since the last layer), so the
kernel's reads come from memory rather than the L3 cache.

    python benchmarks/attention_kv.py [--threads 2] [--seqs 1 32] [--context 96 1024] [--cold]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from tidal.kernels.cpu_ext import kernel_available, kernel_status
from tidal.kernels.select import Candidate, Choice, cpu_description
from tidal.layers.attention import AttentionMetadata, PagedAttention, kv_cache_shape

SHAPES = {"256": (4, 2, 64), "1024": (16, 4, 64)}  # (Hq, Hkv, head_dim)
BLOCK = 16
# (name, query / model dtype, cache dtype)
CASES = [
    ("f32_cache_f32", torch.float32, torch.float32),
    ("f32_cache_bf16", torch.float32, torch.bfloat16),
    ("bf16_cache_bf16", torch.bfloat16, torch.bfloat16),
]


def make_step(
    shape: tuple[int, int, int], seqs: int, context: int, dtype, cache_dtype, path: str
) -> tuple[Callable[[], torch.Tensor], int]:
    """A decode step of ``seqs`` sequences at ``context`` keys each (the new token
    included), their blocks scattered over the cache; and the cache's bytes."""
    hq, hkv, dh = shape
    attn = PagedAttention(hq, hkv, dh, dtype=dtype)
    cand = Candidate(path)
    attn.set_cpu_path("decode", Choice.fixed(cand, None))
    per_seq = -(-context // BLOCK)
    num_blocks = seqs * per_seq + 1
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(kv_cache_shape(num_blocks, BLOCK, hkv, dh), generator=g).to(cache_dtype)
    attn.kv_cache = cache
    order = torch.randperm(num_blocks - 1, generator=g).add(1).tolist()
    batch = [(context - 1, 1, order[i * per_seq : (i + 1) * per_seq]) for i in range(seqs)]
    meta = AttentionMetadata.build(batch, BLOCK, "cpu")
    q = torch.randn(seqs, hq, dh, generator=g).to(dtype)
    kv = torch.randn(seqs, hkv, dh, generator=g).to(dtype)
    return (lambda: attn(q, kv, kv, meta)), cache.numel() * cache.element_size()


def measure(
    steps: dict[str, Callable[[], torch.Tensor]],
    rounds: int,
    calls: int,
    evict: Callable[[], object] | None = None,
) -> dict:
    """Microseconds per call: per round, each case's median of ``calls`` calls, the cases
    taking turns call by call; the best round's median per case. ``evict``: run before
    each timed call, untimed."""
    for fn in steps.values():  # warm-up: first touches, thread wake-ups, rows memoised
        for _ in range(3):
            fn()
    best = {name: float("inf") for name in steps}
    for _ in range(rounds):
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(calls):
            for name, fn in steps.items():
                if evict is not None:
                    evict()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            best[name] = min(best[name], statistics.median(ts) * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[96, 1024])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--cold", action="store_true", help="evict the caches before each call")
    opts = ap.parse_args()
    torch.set_num_threads(opts.threads)
    paths = ["native", "torch"] if kernel_available() else ["torch"]
    header = {
        "cpu": cpu_description()["model"],
        "threads": opts.threads,
        "torch": torch.__version__,
        "native": kernel_available() or kernel_status(),
        "cold": opts.cold,
    }
    flush = torch.ones(64 * 1024 * 1024) if opts.cold else None  # 256 MiB float32
    evict = flush.sum if flush is not None else None
    print(json.dumps({"config": header}), flush=True)
    summary: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for shape_name in opts.shapes:
            for seqs in opts.seqs:
                for context in opts.context:
                    steps, nbytes = {}, {}
                    for name, dtype, cache_dtype in CASES:
                        for path in paths:
                            key = f"{name}:{path}"
                            steps[key], nbytes[key] = make_step(
                                SHAPES[shape_name], seqs, context, dtype, cache_dtype, path
                            )
                    us = measure(steps, opts.rounds, opts.calls, evict)
                    where = f"H{shape_name} seqs={seqs} ctx={context}"
                    for key, value in us.items():
                        print(json.dumps({
                            "shape": shape_name, "seqs": seqs, "context": context,
                            "case": key, "us": round(value, 1), "cache_bytes": nbytes[key],
                        }), flush=True)  # fmt: skip
                    ratios = summary.setdefault(where, {})
                    for name, _, _ in CASES:
                        for path in paths:
                            base = us[f"f32_cache_f32:{path}"]
                            ratios[f"{name}:{path} speed vs f32 cache"] = round(
                                base / us[f"{name}:{path}"], 2
                            )
                        if "native" in paths:
                            ratios[f"{name} native vs torch"] = round(
                                us[f"{name}:torch"] / us[f"{name}:native"], 2
                            )
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
