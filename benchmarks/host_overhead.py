"""Host cost of one engine step against a null model: what the engine spends around the forward.

    python benchmarks/host_overhead.py                       # this tree
    python benchmarks/host_overhead.py --base HEAD~3         # and another commit, same run
    python benchmarks/host_overhead.py --profile 256         # cProfile's top items at 256

One ``EngineCore`` step (``scheduler.schedule`` + the runner's input preparation and
attention metadata + sampling metadata and the sampler + ``update_from_output`` and the
outputs) with the model swapped for a null one after loading: its forward returns a fixed
hidden state and its logits are fixed, so everything but the compute runs through the
real code. Steady decode at 1, 32 and 256 running requests (16-token prompts, greedy,
``ignore_eos``); per size the median over ``--repeats`` timed windows of ``--steps`` steps:
host us per step and per request per step (the issue's target: <= 10 us per request per
step). With ``--random`` half of the requests sample (temperature, top-k, top-p, one in
eight seeded) instead of greedy.

``--async``: also this tree with ``--async-scheduling`` (docs/architecture.md#async-scheduling),
the row ``head_async``. Against the null model nothing overlaps (the CPU "forward" is
synchronous): the row is the async path's own host cost, not its overlap with a device.

``--base REV``: that commit's tree (``git archive``, serving.py's ``previous_commit``) runs
under this copy of the script (the null model reaches only interfaces both sides have),
each side in its own process, the order rotating per round, so a burst of load hits all.
Prints one JSON document with the CPU model, the sides and the ratios to base.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SIZES = (1, 32, 256)
PROMPT_LEN = 16


class NullModel:
    """Stands in for the model after the runner built it: no compute, fixed outputs.

    The forward returns a preallocated hidden state ([T, H], sliced) and the logits put
    the same token on top of every row, so steady decode keeps the batch unchanged."""

    def __init__(self, model: Any, vocab_size: int, max_tokens: int) -> None:
        import torch

        self._model = model  # what the runner may still ask of it (cache spec, layers)
        hidden = int(model.spec.hidden_size)
        self._hidden = torch.zeros(max_tokens, hidden)  # [T_max, H] float32
        self._logits = torch.zeros(max_tokens, vocab_size)  # [N_max, V] float32
        self._logits[:, 7] = 1.0  # greedy picks token 7 everywhere

    def __call__(self, input_ids: Any, positions: Any, attn: Any) -> Any:
        return self._hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: Any) -> Any:
        return self._logits[: hidden.shape[0]]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _engine(ckpt: str, num_seqs: int, max_len: int, async_scheduling: bool) -> Any:
    import torch

    from tidal.engine_core.core import EngineCore
    from tidal.executor.uniproc import UniProcExecutor
    from tidal.launch.engine_args import EngineArgs

    config = EngineArgs(
        model=ckpt,
        device="cpu",
        max_num_seqs=num_seqs,
        max_model_len=max_len,
        max_num_batched_tokens=max(2048, num_seqs * PROMPT_LEN),
        num_gpu_blocks_override=num_seqs * -(-max_len // 16) + 1,
        # Only when on: a base tree from before the option has no such field.
        **({"async_scheduling": True} if async_scheduling else {}),
    ).create_engine_config()
    executor = UniProcExecutor(config)
    core = EngineCore(config, executor)
    # The host work is one thread of Python; torch's pool, busy-waiting on a loaded machine,
    # would make the sampler's small argmax the noisiest item of the step.
    torch.set_num_threads(1)
    runner = executor.worker.model_runner
    null = NullModel(runner.model, runner.vocab_size, config.scheduler.max_num_batched_tokens)
    runner.model = cast(Any, null)  # duck-typed: the runner only calls it and compute_logits
    return core


def _params(i: int, max_tokens: int, random: bool) -> Any:
    from tidal.sampling_params import SamplingParams

    if random and i % 2:
        seed = i if i % 8 == 1 else None
        return SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9, seed=seed
        )
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def measure(
    ckpt: str,
    sizes: list[int],
    steps: int,
    repeats: int,
    random: bool,
    profile: int,
    async_scheduling: bool = False,
) -> dict:
    """This tree's numbers: per size, host us per step (median window) and per request."""
    from tidal.protocol.messages import EngineCoreRequest

    total_steps = 8 + steps * repeats
    out: dict[str, Any] = {}
    for n in sizes:
        core = _engine(ckpt, n, PROMPT_LEN + total_steps + 8, async_scheduling)
        try:
            for i in range(n):
                prompt = [(i * 31 + j) % 500 + 1 for j in range(PROMPT_LEN)]
                core.add_request(
                    EngineCoreRequest(f"r{i}", prompt, _params(i, total_steps + 4, random))
                )
            for _ in range(8):  # prefill, then a few decode steps to settle
                core.step()
            assert core.scheduler.num_running == n, (core.scheduler.num_running, n)
            windows = []
            prof = cProfile.Profile() if profile == n else None
            for _ in range(repeats):
                if prof is not None:
                    prof.enable()
                t0 = time.perf_counter()
                for _ in range(steps):
                    core.step()
                windows.append((time.perf_counter() - t0) / steps)
                if prof is not None:
                    prof.disable()
            assert core.scheduler.num_running == n  # every step decoded the whole batch
            per_step = statistics.median(windows) * 1e6
            row: dict[str, Any] = {
                "us_per_step": round(per_step, 1),
                "us_per_request_step": round(per_step / n, 2),
                "windows_us": [round(w * 1e6, 1) for w in windows],
            }
            if prof is not None:  # to stderr: the JSON stays one small document
                stats = pstats.Stats(prof, stream=sys.stderr)
                stats.sort_stats("tottime").print_stats(25)
                stats.sort_stats("cumulative").print_stats(30)
            out[str(n)] = row
        finally:
            core.shutdown()
    return out


def _side(tree: Path, ckpt: str, args: argparse.Namespace, async_scheduling: bool) -> dict:
    """Run ``tree``'s copy of this script (``--side``) with ``tree`` first on the path."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [
        sys.executable, str(HERE / "host_overhead.py"), "--side", ckpt,
        "--sizes", args.sizes, "--steps", str(args.steps), "--repeats", str(args.repeats),
    ] + (["--random"] if args.random else []) + (["--async"] if async_scheduling else [])  # fmt: skip
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"side {tree} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", help="git ref of the previous design, measured in the same run")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="running requests per case")
    p.add_argument("--steps", type=int, default=50, help="steps per timed window")
    p.add_argument("--repeats", type=int, default=3, help="timed windows per size (median)")
    p.add_argument("--rounds", type=int, default=2, help="--base: alternating rounds per side")
    p.add_argument("--random", action="store_true", help="half the requests sample (not greedy)")
    p.add_argument("--profile", type=int, default=0, help="cProfile the case of this many requests")
    p.add_argument(
        "--async", dest="async_scheduling", action="store_true",
        help="also measure this tree with --async-scheduling (row head_async)",
    )  # fmt: skip
    p.add_argument("--side", help=argparse.SUPPRESS)  # internal: measure this tree on this ckpt
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        p.error("--sizes: positive integers, comma separated")
    if args.steps < 1 or args.repeats < 1 or args.rounds < 1:
        p.error("--steps, --repeats and --rounds must be >= 1")
    if args.side:
        doc = measure(args.side, sizes, args.steps, args.repeats, args.random, 0,
                      args.async_scheduling)  # fmt: skip
        print(json.dumps(doc))
        return 0

    from tidal.kernels.select import cpu_description
    from tidal.models.tiny import make_tiny_checkpoint

    doc: dict[str, Any] = {
        "benchmark": "host_overhead",
        "machine": {"cpu": cpu_description(), "load_avg_start": os.getloadavg()},
        "model": "null (tiny qwen3_moe config, forward and logits fixed)",
        "steps": args.steps,
        "repeats": args.repeats,
        "sampling": "half random" if args.random else "greedy",
    }
    with tempfile.TemporaryDirectory(prefix="tidal-host-") as root:
        ckpt = make_tiny_checkpoint(root + "/qwen3_moe", "qwen3_moe", hidden_size=64, num_layers=2,
                                    num_experts=8, top_k=2, vocab_size=512,
                                    max_position_embeddings=4096)  # fmt: skip
        if args.base is None:
            doc["head"] = measure(ckpt, sizes, args.steps, args.repeats, args.random, args.profile)
            if args.async_scheduling:
                doc["head_async"] = measure(
                    ckpt, sizes, args.steps, args.repeats, args.random, args.profile, True
                )
            print(json.dumps(doc, indent=1))
            return 0
        sys.path.insert(0, str(HERE))
        from serving import previous_commit  # a sibling module

        base_rev = subprocess.run(
            ["git", "rev-parse", "--short", args.base], cwd=REPO, capture_output=True, text=True,
            check=True,
        ).stdout.strip()  # fmt: skip
        doc["base_rev"] = base_rev
        sides = ["head", "base"] + (["head_async"] if args.async_scheduling else [])
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        with previous_commit(args.base) as base_tree:
            trees = {"head": REPO, "head_async": REPO, "base": base_tree}
            for r in range(args.rounds):
                for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                    print(f"[host_overhead] round {r} {side}", file=sys.stderr, flush=True)
                    runs[side].append(_side(trees[side], ckpt, args, side == "head_async"))
    for side, results in runs.items():
        doc[side] = {
            str(n): {
                "us_per_step": statistics.median(res[str(n)]["us_per_step"] for res in results),
                "us_per_request_step": statistics.median(
                    res[str(n)]["us_per_request_step"] for res in results
                ),
                "rounds_us_per_step": [res[str(n)]["us_per_step"] for res in results],
            }
            for n in sizes
        }
    for side in sides[:1] + sides[2:]:
        doc[f"{side}_over_base"] = {
            str(n): round(doc[side][str(n)]["us_per_step"] / doc["base"][str(n)]["us_per_step"], 3)
            for n in sizes
        }
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
