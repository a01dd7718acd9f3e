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
import os
import statistics
import sys
from collections.abc import Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_ab import add_arguments, cases, header, interleaved_rounds  # noqa: E402 - a sibling module


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
    add_arguments(ap, batch_tokens=32, prompt_len=16)
    opts = ap.parse_args()

    from tidal import LLM

    with LLM(opts.model, dtype=opts.dtype, multiprocess=False, enable_prefix_caching=False) as llm:
        result = measure(llm, opts)
    print(json.dumps(result, indent=1, default=str))


def measure(llm: Any, opts: argparse.Namespace) -> dict[str, Any]:
    if opts.threads:  # after the load: the in-process worker sets its own count
        torch.set_num_threads(opts.threads)
    sides = {"fused": contextlib.nullcontext, "unfused": unfused}
    times, outputs = interleaved_rounds(llm, opts, sides)
    result: dict[str, Any] = {
        **header(llm, opts),
        "cases": {},
    }
    for case, (streams, tokens) in cases(opts).items():
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
