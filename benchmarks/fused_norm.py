"""Decode with the decoder layer's fused C++ passes against the separate ops they replace,
in one process, interleaved: the residual add before each norm (``RMSNorm.add_norm``) and
the per-head Q/K norm + rotary (``apply_norm_rotary``), with the rotary of 16-bit rows,
which before these passes ran as torch ops.

The peer ("unfused") patches the model back to the previous calls, op for op: ``x +
delta`` then the norm, ``rms_norm_heads`` then the rotary, the C++ rotary for float32 rows
only. Both sides share one loaded ``tidal.LLM`` (in-process engine, no prefix caching),
and its kernel choices; rounds alternate which side goes first, so load from other
processes hits both alike. Outputs are checked equal (the passes are bit for bit the ops).

    python benchmarks/fused_norm.py --model ~/.cache/tidal-peers/moe64-qwen3-moe-bfloat16 \
        --dtype bfloat16 [--rounds 5] [--threads 1] [--single-tokens 128] [--batch 32 --batch-tokens 32]

Prints one JSON document: the CPU, the model, per case (single stream, batch) each side's
ms per decode step per round, the medians and the ratio fused / unfused.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from tidal.kernels.select import cpu_description


@contextlib.contextmanager
def unfused() -> Iterator[None]:
    """The previous code paths: separate add and norm; norm, weights, then the rotary as
    torch ops for 16-bit rows (the C++ rotary took float32 only)."""
    import tidal.layers.rotary as rotary
    import tidal.models.common as common
    from tidal.kernels.cpu_norm import norm_rope_cpu_ok
    from tidal.layers.norm import RMSNorm, rms_norm_heads

    def add_norm(self: Any, x: Any, delta: Any) -> Any:
        x = x + delta
        return x, self(x)

    def norm_rotary(x, cos, sin, weights, groups, eps, native=True, triton=False):
        normed = rms_norm_heads(x, weights, groups, eps, native, triton)
        return rotary.apply_partial_rotary(normed, cos, sin)

    saved = (RMSNorm.add_norm, common.apply_norm_rotary, rotary._cpu_pass)
    RMSNorm.add_norm = add_norm
    common.apply_norm_rotary = norm_rotary
    rotary._cpu_pass = lambda x, cos: x.dtype == torch.float32 and norm_rope_cpu_ok(x)
    try:
        yield
    finally:
        RMSNorm.add_norm, common.apply_norm_rotary, rotary._cpu_pass = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--single-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batch-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    opts = ap.parse_args()

    from tidal import LLM

    with LLM(opts.model, dtype=opts.dtype, multiprocess=False, enable_prefix_caching=False) as llm:
        result = measure(llm, opts)
    print(json.dumps(result, indent=1, default=str))


def measure(llm: Any, opts: argparse.Namespace) -> dict[str, Any]:
    from tidal import SamplingParams

    if opts.threads:  # after the load: the in-process worker sets its own count
        torch.set_num_threads(opts.threads)
    vocab = 1000
    cases = {
        "single": (1, opts.single_tokens),
        "batch": (opts.batch, opts.batch_tokens),
    }
    times: dict[str, dict[str, list[float]]] = {c: {"fused": [], "unfused": []} for c in cases}
    outputs: dict[str, dict[str, list[list[int]]]] = {c: {} for c in cases}

    def run(case: str, side: str) -> None:
        streams, tokens = cases[case]
        prompts = [
            {"prompt_token_ids": [(7 * i + 13 * j) % vocab + 3 for j in range(opts.prompt_len)]}
            for i in range(streams)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        ctx = unfused() if side == "unfused" else contextlib.nullcontext()
        with ctx:
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
        # Decode steps dominate: the time per generated position (prefill included).
        times[case][side].append(dt * 1e3 / tokens)
        outputs[case][side] = [list(o.outputs[0].token_ids) for o in outs]

    for case in cases:  # warm both sides
        run(case, "fused")
        run(case, "unfused")
    for case in cases:
        times[case] = {"fused": [], "unfused": []}
    for r in range(opts.rounds):
        order = ("fused", "unfused") if r % 2 == 0 else ("unfused", "fused")
        for case in cases:
            for side in order:
                run(case, side)
        print(f"round {r + 1}/{opts.rounds} done", file=sys.stderr)
    result: dict[str, Any] = {
        "cpu": cpu_description()["model"],
        "threads": torch.get_num_threads(),
        "model": opts.model,
        "dtype": opts.dtype,
        "cpu_kernels": llm.cpu_kernels(),
        "cases": {},
    }
    for case, (streams, tokens) in cases.items():
        f, u = statistics.median(times[case]["fused"]), statistics.median(times[case]["unfused"])
        result["cases"][case] = {
            "streams": streams,
            "tokens": tokens,
            "ms_per_step": times[case],
            "median_ms": {"fused": round(f, 3), "unfused": round(u, 3)},
            "ratio_fused_over_unfused": round(f / u, 3),
            "same_tokens": outputs[case]["fused"] == outputs[case]["unfused"],
        }
    return result


if __name__ == "__main__":
    main()
