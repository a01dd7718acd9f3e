"""Offline throughput: ``LLM.generate`` vs transformers' batched ``generate``, same run.

Prints one JSON line per case. Default: the embedded model (Qwen3-MoE, hidden 256,
4 layers, 16 experts top-4, vocab 4096), 32 requests of 32 prompt + 64 output tokens,
float32, greedy, and a single-stream decode case.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def bench_tidal(model: str, prompts: list[list[int]], out_len: int, multiprocess: bool) -> dict:
    from tidal import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype="float32", multiprocess=multiprocess)
    ready_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    try:
        llm.generate(
            [{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False
        )
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "tok_per_s": tokens / elapsed,
        "ready_s": ready_s,
    }


def bench_hf(model: str, prompts: list[list[int]], out_len: int) -> dict:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        m.generate(
            ids[:1],
            attention_mask=torch.ones_like(ids[:1]),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
        )
        t0 = time.perf_counter()
        out = m.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        elapsed = time.perf_counter() - t0
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"elapsed_s": elapsed, "output_tokens": tokens, "tok_per_s": tokens / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint folder (default: embedded model)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tidal.models.tiny import default_model_path

    model = args.model or default_model_path()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    cases = [("batch", args.num_requests), ("single_stream", 1)]
    for name, n in cases:
        prompts = _prompts(n, args.prompt_len, vocab)
        for mp in (False, True):
            r = bench_tidal(model, prompts, args.output_len, mp)
            engine = "tidal-mp" if mp else "tidal-inproc"
            print(
                json.dumps({"case": name, "engine": engine, "requests": n, **_round(r)}), flush=True
            )
        if not args.skip_hf:
            r = bench_hf(model, prompts, args.output_len)
            print(
                json.dumps({"case": name, "engine": "transformers", "requests": n, **_round(r)}),
                flush=True,
            )


def _round(d: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}


if __name__ == "__main__":
    main()
