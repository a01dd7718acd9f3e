"""FP8 checkpoints on CPU: the model serving a tiny DeepSeek-V3 FP8 checkpoint
(``make_tiny_fp8_checkpoint``; FP8 weights held, dequantized per call: the w8a16 torch
reference) against its peer, the same checkpoint dequantized to bfloat16
(``dequantize_checkpoint``) and served as an ordinary one. Both in bfloat16 activations,
in one process, forwards taking turns call by call (a burst of load from another
process then hits both alike).

Prints one JSON line per (case, variant): median and best ms per forward; one line per
variant with the bytes its weights take (parameters and buffers); a summary line with
the FP8 model's bytes and time relative to the peer, and the largest |logit| difference
between the two (0: the FP8 path adds no error of its own to bfloat16's).

    python benchmarks/fp8.py [--threads 2] [--repeats 20] [--hidden 256] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from tidal.launch.engine_args import EngineArgs
from tidal.layers.attention import AttentionMetadata
from tidal.models.loader import load_model
from tidal.models.registry import entry_for_model_type
from tidal.models.tiny import dequantize_checkpoint, make_tiny_fp8_checkpoint

BLOCK = 16  # KV block size of the benchmark's cache


def _bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.nbytes for t in {id(t): t for t in tensors}.values())


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
        models = {
            name: load_model(
                EngineArgs(model=path, device="cpu", dtype="bfloat16").create_engine_config()
            )
            for name, path in (("fp8", fp8), ("bf16_dequantized", peer))
        }
    sizes = {name: _bytes(m) for name, m in models.items()}
    for name, size in sizes.items():
        print(json.dumps({"variant": name, "weight_bytes": size}))
    g = torch.Generator().manual_seed(0)
    cases = {  # name -> (rows, starts, tokens per row)
        "prefill_1x64": (1, [0], 64),
        "decode_8x1": (8, [63] * 8, 1),
    }
    summary: dict[str, object] = {"bytes_fp8_over_peer": sizes["fp8"] / sizes["bf16_dequantized"]}
    diff = 0.0
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
        diff = max(diff, (outs["fp8"] - outs["bf16_dequantized"]).abs().max().item())
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
        summary[f"{case}_fp8_over_peer"] = round(
            statistics.median(times["fp8"]) / statistics.median(times["bf16_dequantized"]), 3
        )
    summary["max_abs_logit_diff"] = diff
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
