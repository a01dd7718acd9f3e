"""FP8 checkpoints on CPU: a tiny DeepSeek-V3 FP8 checkpoint
(``make_tiny_fp8_checkpoint``, FP8 weights held) served on each FP8 path against its
peer, the same checkpoint dequantized to bfloat16 (``dequantize_checkpoint``) served as an
ordinary one on its measured (best) bf16 paths:

* ``fp8_native``: the FP8 linears and experts on the C++ kernels (FP8 decoded in
  registers, the measured prefetch hint per shape class);
* ``fp8_torch``: the same on the torch reference (dequantize per call);
* ``bf16_dequantized``: the peer.

Every other op of the FP8 models (norms, attention, the bf16 router and projections) runs
on the path the measured choice picked (one kernel cache, so all three agree). All in
bfloat16 activations, in one process, forwards taking turns call by call (a burst of load
from another process then hits all alike).

Prints one JSON line per (case, variant): median and best ms per forward; one line per
variant with the bytes its weights take (parameters, buffers and the kernels' packs); a
summary line with the CPU model, what the measured choice picked for the FP8 ops, the
bytes and the median and best times relative to the peer (``*_peer_over_fp8_native``
> 1: the FP8 kernels are faster), and the largest |logit| difference of each FP8 path from the peer.

    python benchmarks/fp8.py [--threads 2] [--repeats 20] [--hidden 256] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch

from tidal.kernels.select import CLASSES, Candidate, Choice, cpu_description
from tidal.launch.engine_args import EngineArgs
from tidal.layers.attention import AttentionMetadata
from tidal.models.loader import load_model
from tidal.models.registry import entry_for_model_type
from tidal.models.tiny import dequantize_checkpoint, make_tiny_fp8_checkpoint

BLOCK = 16  # KV block size of the benchmark's cache


# Where a module keeps a packed path's weights (then their only copy).
_PACKS = ("_packed", "_fp8_held", "_held", "_held_experts", "_held_gate")


def _tensors(obj: object, depth: int = 3):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v, depth)
    elif depth > 0 and hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            yield from _tensors(v, depth - 1)


def _bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    for m in model.modules():
        for name in _PACKS:
            tensors += list(_tensors(m.__dict__.get(name)))
    # by identity: a pack and a parameter never share storage (oneDNN's packs have none)
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _force_fp8(model: Any, path: str) -> dict[str, str]:
    """Serve every FP8 op of ``model`` by ``path`` (native: the fastest hint its trial
    measured per shape class); returns what the measured choice had picked."""
    picked: dict[str, str] = {}
    choices = model.cpu_paths.choices
    m: Any
    for m in model.modules():
        ops = m.cpu_ops() if hasattr(m, "cpu_ops") else {}
        for op, spec in ops.items():
            if not spec.key.op.startswith("fp8_"):
                continue
            was = choices[spec.key.name]
            picked[spec.key.name] = "/".join(c.name for c in was.by_class().values())
            best = {}
            for cls in CLASSES:
                timed = {n: t for n, t in was.timings_ms.get(cls, {}).items() if n.startswith(path)}
                default = "native:t0" if path == "native" else path
                best[cls] = Candidate.parse(min(timed, key=lambda n: timed[n], default=default))
            m.set_cpu_path(op, Choice(**best, layout=path, source="forced"))
            m.pack_weights()
    return picked


class _Runner:
    """Prefill and decode forwards over a fresh paged cache per call."""

    def __init__(self, model, rows: int, length: int) -> None:
        spec = model.kv_cache_spec()
        blocks = rows * (length // BLOCK + 2) + 1
        shape = spec.layer_shape(blocks, BLOCK)
        model.bind_kv_cache(
            [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(spec.num_layers)]
        )
        self.model = model
        self.tables = [
            list(range(1 + r * (length // BLOCK + 2), 1 + (r + 1) * (length // BLOCK + 2)))
            for r in range(rows)
        ]

    def forward(self, starts: list[int], tokens: list[list[int]]) -> torch.Tensor:
        seqs = [(s, len(t), table) for s, t, table in zip(starts, tokens, self.tables)]
        meta = AttentionMetadata.build(seqs, BLOCK, "cpu")
        ids = torch.tensor([t for row in tokens for t in row])
        pos = torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, tokens)])
        return self.model.compute_logits(self.model(ids, pos, meta))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--moe-intermediate", type=int, default=192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="tidal-fp8-bench-") as root:
        fp8 = make_tiny_fp8_checkpoint(
            f"{root}/fp8", "deepseek_v3", hidden_size=args.hidden,
            moe_intermediate_size=args.moe_intermediate, num_layers=args.layers,
            num_experts=args.experts, **entry_for_model_type("deepseek_v3").test_config,
        )  # fmt: skip
        peer = dequantize_checkpoint(fp8, f"{root}/bf16", dtype="bfloat16")
        cache = f"{root}/kernel-cache"  # one cache: the three models share their choices

        def load(path: str) -> Any:
            return load_model(
                EngineArgs(
                    model=path, device="cpu", dtype="bfloat16", kernel_cache_dir=cache
                ).create_engine_config()
            )

        models = {"fp8_native": load(fp8), "fp8_torch": load(fp8), "bf16_dequantized": load(peer)}
    picked = _force_fp8(models["fp8_native"], "native")
    _force_fp8(models["fp8_torch"], "torch")
    sizes = {name: _bytes(m) for name, m in models.items()}
    for name, size in sizes.items():
        print(json.dumps({"variant": name, "weight_bytes": size}))
    g = torch.Generator().manual_seed(0)
    cases = {  # name -> (rows, starts, tokens per row)
        "decode_1x1": (1, [63], 1),
        "decode_8x1": (8, [63] * 8, 1),
        "prefill_1x64": (1, [0], 64),
    }
    peer = "bf16_dequantized"
    summary: dict[str, object] = {
        "cpu": cpu_description()["model"],
        "threads": args.threads,
        "measured_choice_fp8": picked,
        "bytes_fp8_native_over_peer": round(sizes["fp8_native"] / sizes[peer], 3),
    }
    diff = {"fp8_native": 0.0, "fp8_torch": 0.0}
    for case, (rows, starts, length) in cases.items():
        tokens = [torch.randint(3, 512, (length,), generator=g).tolist() for _ in range(rows)]
        runners = {name: _Runner(m, rows, 64) for name, m in models.items()}
        times: dict[str, list[float]] = {name: [] for name in models}
        outs: dict[str, torch.Tensor] = {}
        for _ in range(args.repeats):
            for name, runner in runners.items():  # take turns, call by call
                t = time.perf_counter()
                outs[name] = runner.forward(starts, tokens)
                times[name].append((time.perf_counter() - t) * 1e3)
        for name in diff:
            diff[name] = max(diff[name], (outs[name] - outs[peer]).abs().max().item())
        for name, ts in times.items():
            print(
                json.dumps(
                    {
                        "case": case,
                        "variant": name,
                        "median_ms": round(statistics.median(ts), 3),
                        "best_ms": round(min(ts), 3),
                    }
                )
            )
        # median and best: on a shared machine the median is mostly other processes' time
        for stat, fn in (("median", statistics.median), ("best", min)):
            t = {name: fn(ts) for name, ts in times.items()}
            summary[f"{case}_{stat}_peer_over_fp8_native"] = round(t[peer] / t["fp8_native"], 3)
            summary[f"{case}_{stat}_fp8_torch_over_fp8_native"] = round(
                t["fp8_torch"] / t["fp8_native"], 3
            )
    summary["max_abs_logit_diff_from_peer"] = diff
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
