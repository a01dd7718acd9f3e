"""Tok/s of every architecture Tidal serves, against transformers and vLLM-CPU, in one run.

    python benchmarks/models.py [--models qwen3_moe,gpt_oss] [--hidden 256 --layers 4
        --experts 16 --top-k 4] [--reps 3] [--vllm-python ~/.cache/tidal-peers/vllm/bin/python
        [--vllm-eager]]

For each registry architecture (``tidal/models/registry.py``; ``--models`` picks some) a
seeded random checkpoint is built with transformers' own config and model classes
(``make_tiny_checkpoint`` at the given sizes, with the entry's ``test_config``: the
architecture's switches on), float32. Two cases, each a greedy ``generate`` of seeded
prompts of ``--prompt-len`` tokens, EOS masked (``min_tokens``) so every row runs to the
end:

- ``single``: 1 prompt x 64 new tokens (``--single-tokens``);
- ``batch``: 16 prompts x 32 new tokens (``--batch-rows``, ``--batch-tokens``).

Engines, each in its own fresh process, one after the other per architecture:
``transformers`` (``AutoModelForCausalLM.generate``, the whole batch as one tensor),
``tidal`` (``LLM.generate``, the measured CPU paths) and, with ``--vllm-python``,
``vllm`` (vLLM-CPU in its own venv with ``peers/env_vllm.sh``; compiled unless
``--vllm-eager``). An architecture vLLM-CPU does not run is recorded with its error.
Each engine warms up once, then runs the two cases ``--reps`` times, alternating; tok/s
is generated tokens over the median wall time. Tidal's and vLLM's outputs are compared
with transformers' (float32 greedy: Tidal's must be identical).

Prints one JSON line per (architecture, engine) and a summary line: the CPU model, the
sizes, and per architecture Tidal's tok/s over each peer's.

This module imports neither tidal nor transformers at the top: the vLLM venv runs its
``--engine-run vllm`` mode.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from agreement import EngineFailed, spawn_engine, vllm_env  # noqa: E402 - a sibling module

CASES = ("single", "batch")


# ------------------------------------------------------------------ one engine


def _prompts(vocab: int, rows: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(rows)]


def _measure(
    generate: Callable[[list[list[int]], int], list[list[int]]], job: dict[str, Any]
) -> dict[str, Any]:
    """Warm up, then the cases ``reps`` times in turn: medians, tok/s and the outputs."""
    cases = {name: (job[name]["prompts"], job[name]["new_tokens"]) for name in CASES}
    generate(cases["single"][0], 4)
    generate(cases["batch"][0][:4], 4)
    times: dict[str, list[float]] = {name: [] for name in CASES}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(job["reps"]):
        for name, (prompts, n) in cases.items():
            t0 = time.perf_counter()
            outs = generate(prompts, n)
            times[name].append(time.perf_counter() - t0)
            assert all(len(o) == n for o in outs), [len(o) for o in outs]
            outputs[name] = outs
    res: dict[str, Any] = {}
    for name, (prompts, n) in cases.items():
        med = statistics.median(times[name])
        res[name] = {
            "rows": len(prompts), "new_tokens": n, "times_s": [round(t, 4) for t in times[name]],
            "median_s": round(med, 4), "tok_per_s": round(len(prompts) * n / med, 1),
        }  # fmt: skip
    res["outputs"] = outputs
    return res


def run_transformers(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(job["threads"])
    model: Any = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        ids = torch.tensor(prompts)  # equal lengths: no padding
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        return out[:, ids.shape[1] :].tolist()

    return _measure(generate, job)


def run_tidal(job: dict[str, Any]) -> dict[str, Any]:
    from tidal import LLM, SamplingParams

    llm = LLM(job["model"], dtype="float32")
    try:

        def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
            params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, detokenize=False)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        return _measure(generate, job)
    finally:
        llm.shutdown()


def run_vllm(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams  # pyright: ignore[reportMissingImports] - its own venv

    llm = LLM(
        model=job["model"], dtype="float32", max_model_len=512, seed=0,
        skip_tokenizer_init=True, enforce_eager=job["vllm_eager"],
    )  # fmt: skip

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(
            temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return _measure(generate, job)


ENGINES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "transformers": run_transformers,
    "tidal": run_tidal,
    "vllm": run_vllm,
}


def engine_run(opts: argparse.Namespace) -> None:
    """One engine in this process (``--engine-run``): reads the job, writes the result."""
    job = json.loads(Path(opts.job).read_text())
    t0 = time.perf_counter()
    res = ENGINES[opts.engine_run](job)
    res["elapsed_s"] = round(time.perf_counter() - t0, 2)
    Path(opts.out).write_text(json.dumps(res))


# ------------------------------------------------------------------ one run


def _same(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, str]:
    """Rows equal to transformers' per case, as ``equal/rows``."""
    out = {}
    for name in CASES:
        a, b = got["outputs"][name], ref["outputs"][name]
        out[name] = f"{sum(x == y for x, y in zip(a, b))}/{len(b)}"
    return out


def _cause(stderr: str) -> str:
    """The first exception a failed engine's stderr reports outside a warning (the root
    cause: vLLM's later ones say that a worker died), else its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        m = re.search(r"\b\w*(Error|Exception): .*", ln)
        if m and " WARNING " not in ln and not re.search("stack trace|root cause", ln):
            return m.group(0)[:400]
    return (lines or [""])[-1][:400]


def build(model_type: str, root: Path, opts: argparse.Namespace) -> str:
    from tidal.models.registry import entry_for_model_type
    from tidal.models.tiny import make_tiny_checkpoint

    entry = entry_for_model_type(model_type)
    return make_tiny_checkpoint(
        str(root / model_type), model_type, hidden_size=opts.hidden, num_layers=opts.layers,
        num_experts=opts.experts, top_k=opts.top_k, vocab_size=opts.vocab,
        max_position_embeddings=512, **entry.test_config,
    )  # fmt: skip


def bench_model(
    model_type: str, root: Path, opts: argparse.Namespace, env: dict[str, str] | None
) -> dict[str, Any]:
    path = build(model_type, root, opts)
    job = {
        "model": path, "reps": opts.reps, "threads": opts.threads,
        "vllm_eager": opts.vllm_eager,
        "single": {
            "prompts": _prompts(opts.vocab, 1, opts.prompt_len, 0),
            "new_tokens": opts.single_tokens,
        },
        "batch": {
            "prompts": _prompts(opts.vocab, opts.batch_rows, opts.prompt_len, 1),
            "new_tokens": opts.batch_tokens,
        },
    }  # fmt: skip
    engines = ["transformers", "tidal", *(["vllm"] if opts.vllm_python else [])]
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix=f"models-{model_type}-") as tmp:
        for engine in engines:
            python = opts.vllm_python if engine == "vllm" else sys.executable
            try:
                runs[engine] = spawn_engine(
                    python, engine, job, Path(tmp), env if engine == "vllm" else None,
                    script=Path(__file__).resolve(),
                )  # fmt: skip
            except EngineFailed as e:  # an architecture (or shape) the peer does not run
                runs[engine] = {"error": _cause(e.stderr)}
    ref = runs["transformers"]
    for engine, res in runs.items():
        line: dict[str, Any] = {"model": model_type, "engine": engine}
        if "error" in res:
            line["error"] = res["error"]
        else:
            line.update({name: res[name] for name in CASES}, elapsed_s=res["elapsed_s"])
            if engine != "transformers" and "error" not in ref:
                line["equal_to_transformers"] = _same(res, ref)
        print(json.dumps(line), flush=True)
    ratios: dict[str, Any] = {}
    tidal = runs.get("tidal", {})
    for peer in engines[:1] + engines[2:]:
        other = runs.get(peer, {})
        if "error" in tidal or "error" in other:
            ratios[f"tidal_over_{peer}"] = None
            continue
        ratios[f"tidal_over_{peer}"] = {
            name: round(tidal[name]["tok_per_s"] / other[name]["tok_per_s"], 2) for name in CASES
        }
    return ratios


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--models", default=None, help="comma-separated model_types (default: all)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--single-tokens", type=int, default=64)
    p.add_argument("--batch-rows", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="transformers' torch threads")
    p.add_argument("--vllm-python", default=None, help="python of a vLLM-CPU 0.32 venv")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile")
    p.add_argument("--peers", default=str(Path.home() / ".cache" / "tidal-peers"))
    p.add_argument("--engine-run", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.engine_run:
        return engine_run(opts)
    from tidal.kernels.select import cpu_description
    from tidal.models.registry import model_types

    known = model_types()
    chosen = known if opts.models is None else opts.models.split(",")
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        p.error(f"--models: unknown {unknown}; known: {', '.join(known)}")
    env = vllm_env(Path(opts.peers)) if opts.vllm_python else None
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tidal-models-bench-") as root:
        for model_type in chosen:
            summary[model_type] = bench_model(model_type, Path(root), opts, env)
    sizes = {k: getattr(opts, k) for k in ("hidden", "layers", "experts", "top_k", "vocab")}
    print(json.dumps({
        "summary": summary, "cpu_model": cpu_description()["model"], "sizes": sizes,
        "cases": {"single": [1, opts.single_tokens], "batch": [opts.batch_rows, opts.batch_tokens]},
        "prompt_len": opts.prompt_len, "reps": opts.reps, "vllm_eager": opts.vllm_eager,
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
