"""KV cache groups on a model with sliding and full layers (GPT-OSS): one KV byte budget,
this tree against another commit, in one run.

    python benchmarks/kv_groups.py --base 3d52df5           # 2 interleaved rounds
    python benchmarks/kv_groups.py                          # this tree only

A tiny GPT-OSS checkpoint (the registry's test config: alternating sliding_attention /
full_attention layers, window ``--window``) serves ``--requests`` requests of ``--prompt``
tokens and ``--max-tokens`` greedy outputs on one in-process ``EngineCore`` (CPU) whose KV
cache is ``--kv-bytes``. With KV cache groups (docs/architecture.md#kv-sliding-window) the
sliding layers' blocks behind the window go back to the pool, so the same bytes hold more
of the batch. Per side: the blocks and the tokens they hold with none freed, preemptions,
the most requests running at once, steps, wall seconds (median over rounds) and output
tok/s. On a tiny model the compute is small: the wall time follows the steps and the
prefills recomputed after preemptions. Both sides must produce the same tokens (checked).

``--base REV``: that commit's tree (``git archive``, serving.py's ``previous_commit``)
runs under this copy of the script, each side in its own process, the order alternating
per round. Prints one JSON document with the CPU model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent




def make_checkpoint(root: str, window: int, layers: int) -> str:
    from tidal.models.registry import entry_for_model_type
    from tidal.models.tiny import make_tiny_checkpoint

    entry = entry_for_model_type("gpt_oss")
    config = {**entry.test_config, "sliding_window": window}
    return make_tiny_checkpoint(
        os.path.join(root, "gpt_oss"), "gpt_oss", hidden_size=64, num_layers=layers,
        num_experts=8, top_k=2, vocab_size=512, max_position_embeddings=4096, **config,
    )  # fmt: skip


def measure(ckpt: str, args: argparse.Namespace) -> dict[str, Any]:
    """This tree's run of the workload: its counts, wall time and a digest of the tokens."""
    import torch

    from tidal.engine_core.core import EngineCore
    from tidal.executor.uniproc import UniProcExecutor
    from tidal.launch.engine_args import EngineArgs
    from tidal.protocol.messages import EngineCoreRequest
    from tidal.sampling_params import SamplingParams

    torch.manual_seed(0)
    config = EngineArgs(
        model=ckpt,
        device="cpu",
        dtype="float32",
        max_num_seqs=args.requests,
        max_model_len=args.prompt + args.max_tokens,
        max_num_batched_tokens=args.budget,
        kv_cache_memory_bytes=args.kv_bytes,
        enable_prefix_caching=False,  # distinct prompts: nothing to hit on either side
    ).create_engine_config()
    core = EngineCore(config, UniProcExecutor(config))
    try:
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
        for i in range(args.requests):
            prompt = [(i * 37 + j * 11) % 500 + 3 for j in range(args.prompt)]
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
        tokens: dict[str, list[int]] = {}
        steps = most_running = 0
        t0 = time.perf_counter()
        while core.scheduler.has_requests():
            outs, _ = core.step()
            steps += 1
            most_running = max(most_running, core.scheduler.num_running)
            for eco in outs.values():
                for o in eco.outputs:
                    tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        wall = time.perf_counter() - t0
        info = core.get_kv_cache_info()
        digest = hashlib.sha256(json.dumps(sorted(tokens.items())).encode()).hexdigest()[:16]
        assert all(len(t) == args.max_tokens for t in tokens.values()), "a request fell short"
        return {
            "num_blocks": info["num_blocks"],
            "tokens_without_freeing": info["tokens"],
            "kv_groups": info.get("kv_groups"),
            "preemptions": core.scheduler.num_preemptions,
            "most_running": most_running,
            "steps": steps,
            "wall_s": round(wall, 3),
            "output_tok_s": round(args.requests * args.max_tokens / wall, 1),
            "tokens_digest": digest,
        }
    finally:
        core.shutdown()


def _side(tree: Path, ckpt: str, argv: list[str]) -> dict[str, Any]:
    """``tree``'s run, this script with ``tree`` first on the path, in its own process."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(HERE / "kv_groups.py"), "--side", ckpt, *argv]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"side {tree} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    first = runs[0]
    return {
        **{k: first[k] for k in ("num_blocks", "tokens_without_freeing", "preemptions",
                                 "most_running", "steps", "tokens_digest")},
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
        "rounds_wall_s": [r["wall_s"] for r in runs],
        "kv_groups": first["kv_groups"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", help="git ref of the peer, measured in the same run")
    p.add_argument("--rounds", type=int, default=2, help="--base: alternating rounds per side")
    p.add_argument("--requests", type=int, default=8, help="requests, all sent at once")
    p.add_argument("--prompt", type=int, default=384, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy outputs per request")
    p.add_argument("--window", type=int, default=32, help="the sliding layers' window")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (alternating)")
    p.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    p.add_argument(
        "--kv-bytes", type=int, default=640 << 10,
        help="KV cache bytes (the default holds about a third of the batch, every block kept)",
    )  # fmt: skip
    p.add_argument("--side", help=argparse.SUPPRESS)  # internal: run this tree on this ckpt
    args = p.parse_args(argv)
    if min(args.rounds, args.requests, args.prompt, args.max_tokens, args.window) < 1:
        p.error("--rounds, --requests, --prompt, --max-tokens and --window must be >= 1")
    if args.side:
        print(json.dumps(measure(args.side, args)))
        return 0
    side_argv = [
        "--requests", str(args.requests), "--prompt", str(args.prompt),
        "--max-tokens", str(args.max_tokens), "--window", str(args.window),
        "--layers", str(args.layers), "--budget", str(args.budget),
        "--kv-bytes", str(args.kv_bytes),
    ]  # fmt: skip
    from tidal.kernels.select import cpu_description  # imported late, as the others

    doc: dict[str, Any] = {
        "benchmark": "kv_groups",
        "cpu": cpu_description()["model"],
        "model": f"tiny GPT-OSS, {args.layers} alternating layers, window {args.window}",
        "workload": {k: getattr(args, k) for k in ("requests", "prompt", "max_tokens", "budget")},
        "kv_bytes": args.kv_bytes,
    }
    with tempfile.TemporaryDirectory(prefix="tidal-kvg-") as root:
        ckpt = make_checkpoint(root, args.window, args.layers)
        if args.base is None:
            doc["head"] = _summary([_side(REPO, ckpt, side_argv)])
            print(json.dumps(doc, indent=1))
            return 0
        sys.path.insert(0, str(HERE))
        from serving import previous_commit  # a sibling module

        doc["base_rev"] = subprocess.run(
            ["git", "rev-parse", "--short", args.base], cwd=REPO, capture_output=True,
            text=True, check=True,
        ).stdout.strip()  # fmt: skip
        runs: dict[str, list[dict[str, Any]]] = {"head": [], "base": []}
        with previous_commit(args.base) as base_tree:
            trees = {"head": REPO, "base": base_tree}
            for r in range(args.rounds):
                for side in ("head", "base") if r % 2 == 0 else ("base", "head"):
                    print(f"[kv_groups] round {r} {side}", file=sys.stderr, flush=True)
                    runs[side].append(_side(trees[side], ckpt, side_argv))
    doc["head"], doc["base"] = _summary(runs["head"]), _summary(runs["base"])
    doc["same_tokens"] = doc["head"]["tokens_digest"] == doc["base"]["tokens_digest"]
    doc["head_over_base"] = {
        k: round(doc["head"][k] / doc["base"][k], 3) if doc["base"][k] else None
        for k in ("steps", "wall_s", "output_tok_s", "most_running")
    }
    print(json.dumps(doc, indent=1))
    return 0 if doc["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
