"""The C++ FP8 kernels against the bf16 ones at decode sizes, in one process, candidates
interleaved round by round (a burst of load from another process hits all alike):

* ``fp8_fp16``: FP8 weights, the fp16 decode (``native:<hint>``);
* ``fp8_dot``: FP8 weights, the FP8 dot kernel (``native:dot-<hint>``: e4m3 -> bf16 by
  table lookup, ``vdpbf16ps``), where the CPU has AVX512-BF16 and VBMI;
* ``fp8_amx``: FP8 weights, the FP8 AMX kernel (``native:amx``: that decode, the products
  on AMX tiles), where the CPU also has AMX;
* ``bf16_dot``: the peer, the same weights in bf16 on the bf16 dot kernel (the shift
  kernel where the CPU has no AVX512-BF16).

Cases: the linear (``--linear`` N = K) at ``--linear-rows`` rows (a decode, a few rows,
a batch), over copies of its weights taken in turn (each kernel its own), enough that each reads
``--stream-mb`` MB of them between two reads of one copy (so they come from memory, as a
model's do; ``--stream-mb 0``: one copy, read from cache), and the fused MoE at the
64-expert checkpoint's layer shape (64 experts, H512, I256, top-8) at 1 and 32 tokens,
over ``--layers`` layers' experts taken in turn (so the weights stream from memory, as at
decode). Activations bf16, 128x128 block scales. Prints
one JSON document: per case and kernel the best and median us per call,
``bf16_over_fp8_dot`` and ``bf16_over_fp8_amx`` (> 1: FP8 faster) and
``fp8_dot_over_fp8_amx`` (> 1: the tiles faster).

    python benchmarks/fp8_kernels.py [--threads 1] [--rounds 15] [--layers 8] \
        [--linear-rows 1,4,32] [--stream-mb 96]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time
from collections.abc import Callable

import torch

from tidal.kernels.cpu_ext import bf16_dot_available, fp8_amx_available, fp8_dot_available
from tidal.kernels.cpu_fp8 import fp8_fused_experts, fp8_linear, pack_fp8_experts, pack_fp8_linear
from tidal.kernels.cpu_linear import linear_cpu, pack_linear_weight
from tidal.kernels.cpu_moe import CpuPackedExperts, fused_experts_cpu
from tidal.kernels.fp8_torch import quantize_fp8_blocks
from tidal.kernels.select import cpu_description

BLOCK = (128, 128)
# The FP8 kernels by name: the ops' (dot, amx) flags.
FP8_KERNELS = {"fp8_fp16": (False, False), "fp8_dot": (True, False), "fp8_amx": (False, True)}
T0 = 1  # the prefetch hint (cpu_ext.PREFETCH_HINTS["t0"])


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [E, N, K] -> q, s
    pairs = [quantize_fp8_blocks(w[e], BLOCK) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def interleaved_us(
    fns: dict[str, Callable[[], object]], rounds: int, calls: int
) -> dict[str, list[float]]:
    """Each function's us per call, one entry a round, the functions taking turns within a
    round (a burst of load from another process hits all alike); one warm call each first."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm
    for _ in range(rounds):
        for name, f in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                f()
            times[name].append((time.perf_counter() - t) / calls * 1e6)
    return times


def best_and_median(times: dict[str, list[float]]) -> dict[str, object]:
    return {
        k: {"best_us": round(min(v), 1), "median_us": round(statistics.median(v), 1)}
        for k, v in times.items()
    }


def _time(fns: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, object]:
    """Best and median us per call of each, interleaved round by round."""
    times = interleaved_us(fns, rounds, calls)
    out = best_and_median(times)
    for slow, fast in (("bf16_dot", "fp8_dot"), ("bf16_dot", "fp8_amx"), ("fp8_dot", "fp8_amx")):
        if slow in times and fast in times:
            out[f"{'bf16' if slow == 'bf16_dot' else slow}_over_{fast}"] = {
                "best": round(min(times[slow]) / min(times[fast]), 3),
                "median": round(statistics.median(times[slow]) / statistics.median(times[fast]), 3),
            }  # fmt: skip
    return out


def _moe_case(
    tokens: int, fp8s: dict[str, list], peers: list, rounds: int, g: torch.Generator
) -> dict[str, object]:
    """One MoE layer's experts at ``tokens`` tokens, each call over every layer's weights:
    us per layer. Each layer's call takes the next of ``layers + 1`` seeded routings (a
    count coprime with the layers'), so a layer meets other experts from one call to the
    next and they come from memory, as at decode: with one routing a token's 8 experts of
    8 layers (25 MB) stayed in L3. Each kernel reads its own copy of the layers
    (``fp8s[kernel]``): a kernel timed right after another on the same bytes found them
    in L3 (an identical kernel ran 17-25% faster second)."""
    layers = len(peers)
    hidden, top_k, experts = peers[0].shapes[0][2], 8, fp8s["fp8_fp16"][0].num_experts
    xs = torch.randn(tokens, hidden, generator=g).bfloat16()
    tw = torch.rand(tokens, top_k, generator=g)
    routings = [
        torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
        for _ in range(layers + 1)
    ]  # [tokens, top_k] int64 each
    peer_dot = bf16_dot_available()

    def fp8(kernel: str) -> Callable[[], None]:
        ids = itertools.cycle(routings).__next__  # one cycle a kernel: each meets them all
        dot, amx = FP8_KERNELS[kernel]

        def run() -> None:
            for p in fp8s[kernel]:
                fp8_fused_experts(xs, p, tw, ids(), None, True, T0, dot, amx)

        return run

    peer_ids = itertools.cycle(routings).__next__

    def peer() -> None:
        for p in peers:
            fused_experts_cpu(xs, p, tw, peer_ids(), None, True, T0, peer_dot)

    # fp8_fp16 and the peer first, then the kernels the CPU has (the order timed so far)
    fns: dict[str, Callable[[], object]] = {"fp8_fp16": fp8("fp8_fp16"), "bf16_dot": peer}
    fns.update({k: fp8(k) for k in fp8s if k not in fns})
    out = _time(fns, rounds, 4)
    for name in fns:  # per layer
        out[name] = {k: round(v / layers, 1) for k, v in out[name].items()}  # type: ignore[union-attr]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--linear", type=int, default=2048)
    ap.add_argument("--linear-rows", default="1,4,32", help="the linear's row counts")
    ap.add_argument("--stream-mb", type=int, default=96, help="MB of FP8 linear weights in turn")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    peer_dot, fp8_dot = bf16_dot_available(), fp8_dot_available()
    doc: dict[str, object] = {
        "benchmark": "fp8_kernels",
        "cpu": cpu_description()["model"],
        "threads": a.threads,
        "fp8_dot_available": fp8_dot,
        "bf16_dot_available": peer_dot,
        "fp8_amx_available": fp8_amx_available(),
    }
    n = a.linear
    w = torch.randn(1, n, n, generator=g) * 0.02
    q, s = quantize_experts(w)
    copies = max(1, -(-a.stream_mb * 10**6 // (n * n)))  # FP8: one byte a weight
    kernels = ["fp8_fp16"] + ["fp8_dot"] * fp8_dot + ["fp8_amx"] * fp8_amx_available()
    # each kernel its own copies, taken in turn (see _moe_case: no kernel reads another's)
    fp8_next = {
        k: itertools.cycle([pack_fp8_linear(q[0], s[0], BLOCK) for _ in range(copies)]).__next__
        for k in kernels
    }
    bf16_next = itertools.cycle([pack_linear_weight(w[0].bfloat16()) for _ in range(copies)])
    doc["linear_copies"] = copies

    for rows in (int(r) for r in a.linear_rows.split(",")):
        x = torch.randn(rows, n, generator=g).bfloat16()

        def fp8(k: str, x: torch.Tensor = x) -> object:
            return fp8_linear(x, fp8_next[k](), None, T0, *FP8_KERNELS[k])

        fns: dict[str, Callable[[], object]] = {
            "fp8_fp16": functools.partial(fp8, "fp8_fp16"),
            "bf16_dot": lambda x=x: linear_cpu(x, next(bf16_next), n, None, T0, peer_dot),
        }
        fns.update({k: functools.partial(fp8, k) for k in kernels if k not in fns})
        doc[f"linear_{n}x{n}_{rows}row{'s' if rows > 1 else ''}"] = _time(
            fns, a.rounds, max(copies, 20 // rows)
        )

    experts, hidden, inter = 64, 512, 256
    fp8s: dict[str, list] = {k: [] for k in kernels}
    peers = []
    for _ in range(a.layers):
        w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02
        w2 = torch.randn(experts, hidden, inter, generator=g) * 0.02
        quantized = (*quantize_experts(w13), *quantize_experts(w2))
        for k in kernels:
            fp8s[k].append(pack_fp8_experts(*quantized, BLOCK))
        peers.append(CpuPackedExperts(w13.bfloat16(), w2.bfloat16()))
    for tokens in (1, 32):
        doc[f"moe64_layer_{tokens}tok"] = _moe_case(tokens, fp8s, peers, a.rounds, g)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
