"""The bf16 linear on AMX tiles against the other bf16 linear candidates, in one process,
candidates interleaved round by round (a burst of load from another process hits all
alike):

* ``amx``: the C++ linear's AMX kernel (``native:amx``, ``csrc/amx.h``);
* ``dot``: the C++ linear's AVX512-BF16 dot kernel (``native:dot-t0``; the shift kernel,
  ``native:t0``, where the CPU has no AVX512-BF16);
* ``onednn``: oneDNN's prepacked bf16 linear (``onednn.packed_linear``), where this torch
  has it;
* ``torch``: ``F.linear`` on the input-major weight ``Linear`` holds.

Shapes ``N x K`` (out x in): the default (1024-wide) model's q/k/v and o projections and
its dense MLP's down projection, and a bigger model's square and narrow projections;
rows 1, 8, 32, 256, 1024. Each call takes the next of its own candidate's weight copies,
enough of them to stream ``--stream-mib`` (past the L3: the weights come from memory, as
a model's do at decode). The ``amx`` variant runs the dot kernel up to 6 rows (where both
are bound by the weights' bytes), so at 1 row it measures that kernel a second time. Prints one JSON document:
per shape and row count the best and median us per call of each candidate, and
``over_amx`` (each candidate's time / amx's, best and median: > 1, AMX faster).

    python benchmarks/amx_linear.py [--threads 1] [--rounds 7] [--rows 1,8,32,256,1024]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tidal.kernels.cpu_ext import amx_available, bf16_dot_available
from tidal.kernels.cpu_linear import linear_cpu, pack_linear_weight
from tidal.kernels.onednn import onednn_available, pack_weight, packed_linear
from tidal.kernels.select import cpu_description
from tidal.layers.linear import empty_weight

T0 = 1  # the prefetch hint (cpu_ext.PREFETCH_HINTS["t0"])
# (N, K): the 1024-wide model's qkv, o_proj and MLP down; a 2048-wide model's square and
# narrow (K 2048 -> 768, 768 -> 2048) projections
SHAPES = [(1536, 1024), (1024, 1024), (1024, 2048), (2048, 2048), (768, 2048), (2048, 768)]
BF16 = torch.bfloat16


def _time(fns: dict[str, Callable[[], object]], rounds: int, budget_s: float) -> dict[str, object]:
    """Best and median us per call of each, interleaved round by round; each runs about
    ``budget_s`` of calls a round (at least one)."""
    calls: dict[str, int] = {}
    for name, f in fns.items():  # warm, and size each one's calls from its second call
        f()
        t = time.perf_counter()
        f()
        calls[name] = max(1, int(budget_s / max(time.perf_counter() - t, 1e-6)))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t = time.perf_counter()
            for _ in range(calls[name]):
                f()
            times[name].append((time.perf_counter() - t) / calls[name] * 1e6)
    out: dict[str, object] = {
        k: {"best_us": round(min(v), 1), "median_us": round(statistics.median(v), 1)}
        for k, v in times.items()
    }
    if "amx" in times:
        out["over_amx"] = {
            k: {
                "best": round(min(v) / min(times["amx"]), 3),
                "median": round(statistics.median(v) / statistics.median(times["amx"]), 3),
            }
            for k, v in times.items()
            if k != "amx"
        }
    return out


def _case(
    n: int, k: int, rows_list: list[int], a: argparse.Namespace, g: torch.Generator
) -> dict[str, object]:
    # Every candidate streams its own copies (clones of one weight: the caches go by
    # address): sharing them, the second to run in a round found the first's in L3.
    copies = max(1, (a.stream_mib << 20) // (n * k * 2))
    w = (torch.randn(n, k, generator=g) * 0.02).to(BF16)
    amx = [pack_linear_weight(w) for _ in range(copies)]
    dot = [pack_linear_weight(w) for _ in range(copies)]
    major = []  # Linear's input-major storage: F.linear's operand as the layer holds it
    for _ in range(copies):
        m = empty_weight(n, k, True, dtype=BF16)
        m.copy_(w)
        major.append(m)
    dnn = [pack_weight(w) for _ in range(copies)] if onednn_available(BF16) else []
    out: dict[str, object] = {"weight_copies": copies}
    for rows in rows_list:
        x = torch.randn(rows, k, generator=g).to(BF16)
        fns = _candidates(x, n, amx, dot, dnn, major)
        out[f"{rows}rows"] = _time(fns, a.rounds, a.budget_ms / 1e3)
    return out


def _candidates(
    x: torch.Tensor, n: int, amx: list[torch.Tensor], dot: list[torch.Tensor],
    dnn: list[torch.Tensor], major: list[torch.Tensor],
) -> dict[str, Callable[[], object]]:  # fmt: skip
    """Each candidate on ``x`` [T, K] bf16, taking the next weight copy a call."""

    def each(
        packs: list[torch.Tensor], call: Callable[[torch.Tensor], object]
    ) -> Callable[[], object]:
        turn = itertools.cycle(packs)
        return lambda: call(next(turn))

    has_dot = bf16_dot_available()
    fns: dict[str, Callable[[], object]] = {}
    if amx_available():
        fns["amx"] = each(amx, lambda p: linear_cpu(x, p, n, amx=True))
    fns["dot"] = each(dot, lambda p: linear_cpu(x, p, n, None, T0, has_dot))
    if dnn:
        fns["onednn"] = each(dnn, lambda p: packed_linear(x, p))
    fns["torch"] = each(major, lambda w: F.linear(x, w))
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", default="1,8,32,256,1024")
    ap.add_argument("--budget-ms", type=float, default=20.0, help="each candidate's time a round")
    ap.add_argument(
        "--stream-mib", type=int, default=640,
        help="MiB of weight copies each candidate cycles over (past the L3: 480 MiB here)",
    )  # fmt: skip
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK,...")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows_list = [int(r) for r in a.rows.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    g = torch.Generator().manual_seed(0)
    doc: dict[str, object] = {
        "benchmark": "amx_linear",
        "cpu": cpu_description()["model"],
        "threads": a.threads,
        "amx_available": amx_available(),
        "bf16_dot_available": bf16_dot_available(),
        "onednn_bf16": onednn_available(BF16),
    }
    with torch.inference_mode():
        for n, k in shapes:
            doc[f"linear_{n}x{k}"] = _case(n, k, rows_list, a, g)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
