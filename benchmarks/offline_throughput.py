"""Offline throughput: ``LLM.generate`` vs transformers' batched ``generate``, same run.

Default: the embedded model (Qwen3-MoE, hidden 256, 4 layers, 16 experts top-4, vocab
4096), float32, greedy, two cases: ``batch`` (32 requests of 32 prompt + 64 output
tokens) and ``single_stream`` (one request). Engines: tidal in-process, tidal
multiprocess (engine core in its own process) and transformers.

The machine this runs on is usually shared and noisy, so every engine is built once and
the engines take turns, ``--repeats`` rounds (default 5): a burst of load from another
process then hits all of them alike. Each case prints one JSON line per engine with the
median and best round (tok/s) and, for the engines in this process, the process CPU
time per round; then a summary line with tidal's ratios to transformers (median and
best).

``--threads`` sets torch's threads for transformers and for the in-process engine (after
it is built: the engine pins ``cores // ranks`` threads itself, which the multiprocess
engine keeps).

    python benchmarks/offline_throughput.py [--repeats 5] [--threads 2] [--skip-hf]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def tidal_runner(
    model: str, prompts: list[list[int]], out_len: int, multiprocess: bool, threads: int
) -> tuple[Callable[[], int], Callable[[], None], float]:
    """(run once -> output tokens, shutdown, seconds to ready)."""
    from tidal import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype="float32", multiprocess=multiprocess)
    ready_s = time.perf_counter() - t0
    if not multiprocess:
        torch.set_num_threads(threads)  # the engine in this process pinned its own count
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)

    def run() -> int:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return run, llm.shutdown, ready_s


def hf_runner(
    model: str, prompts: list[list[int]], out_len: int
) -> tuple[Callable[[], int], Callable[[], None], float]:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ready_s = time.perf_counter() - t0
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        m.generate(
            ids[:1], attention_mask=mask[:1], max_new_tokens=4, do_sample=False, pad_token_id=0
        )

    def run() -> int:
        with torch.inference_mode():
            out = m.generate(ids, attention_mask=mask, **kw)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    return run, lambda: None, ready_s


def bench_case(args: argparse.Namespace, model: str, name: str, prompts: list[list[int]]) -> None:
    engines: dict[str, tuple[Callable[[], int], Callable[[], None], float]] = {}
    try:
        engines["tidal-inproc"] = tidal_runner(model, prompts, args.output_len, False, args.threads)
        if not args.skip_mp:
            engines["tidal-mp"] = tidal_runner(model, prompts, args.output_len, True, args.threads)
        if not args.skip_hf:
            engines["transformers"] = hf_runner(model, prompts, args.output_len)
        rounds: dict[str, list[tuple[float, float, int]]] = {e: [] for e in engines}
        for _ in range(args.repeats):
            for engine, (run, _, _) in engines.items():
                torch.set_num_threads(args.threads)
                w0, c0 = time.perf_counter(), time.process_time()
                tokens = run()
                rounds[engine].append((time.perf_counter() - w0, time.process_time() - c0, tokens))
    finally:
        for _, shutdown, _ in engines.values():
            shutdown()
    medians: dict[str, tuple[float, float]] = {}
    for engine, rs in rounds.items():
        tok_s = [tokens / wall for wall, _, tokens in rs]
        medians[engine] = (statistics.median(tok_s), max(tok_s))
        row = {
            "case": name, "engine": engine, "requests": len(prompts), "threads": args.threads,
            "output_tokens": rs[0][2], "rounds": len(rs),
            "tok_per_s_median": round(medians[engine][0], 1),
            "tok_per_s_best": round(medians[engine][1], 1),
            "ready_s": round(engines[engine][2], 3),
        }  # fmt: skip
        if engine != "tidal-mp":  # its engine's CPU time is in another process
            row["cpu_s_median"] = round(statistics.median(cpu for _, cpu, _ in rs), 3)
        print(json.dumps(row), flush=True)
    if "transformers" in medians:
        hf_med, hf_best = medians["transformers"]
        summary = {"case": name, "summary": True}
        for engine in medians:
            if engine != "transformers":
                summary[f"{engine}_vs_hf_median"] = round(medians[engine][0] / hf_med, 2)
                summary[f"{engine}_vs_hf_best"] = round(medians[engine][1] / hf_best, 2)
        print(json.dumps(summary), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: embedded model)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", default="batch,single_stream")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-mp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    from tidal.models.tiny import default_model_path

    model = args.model or default_model_path()
    vocab = AutoConfig.from_pretrained(model).vocab_size
    sizes = {"batch": args.num_requests, "single_stream": 1}
    for name in args.cases.split(","):
        bench_case(args, model, name, _prompts(sizes[name], args.prompt_len, vocab))


if __name__ == "__main__":
    main()
