"""What structured output costs: chat completions' output tok/s with a JSON schema
(``response_format`` ``json_schema``, a realistic object) against the same requests
unconstrained, on one server, at each ``--concurrency``.

Every request is a non-streaming ``/v1/chat/completions`` with ``max_tokens`` tokens and
``ignore_eos`` (a constrained reply still ends where its JSON does; the random tiny model
seldom gets there before ``max_tokens``, so both sides generate about the same tokens).
Rounds are interleaved: each round runs, at each concurrency, both kinds back to back,
the first of the pair alternating between rounds (at concurrency 1 request by request,
each request a run), so drift in the machine's load falls on both. Each kind is warmed up first (the schema compiled, the kernels loaded). Prints
one JSON line per concurrency: the median tok/s of each kind over the rounds, their
ratio (``structured_over_plain``; the issue's target is >= 0.9), the share of finished
structured replies that validate, the CPU model and the load average.

On a loaded machine the ratio of two throughputs is noisy, so each line also carries
where a structured step's extra time goes, measured in this process on the engine's
own code (``grammar_step_ms``): the scheduler's bitmask fill for that many requests
(``GrammarBackend.bitmasks``), their matchers' advance by one token each
(``RequestGrammar.accept``), and the sampler's mask build and apply on ``[B, V]``
float32 logits (``MaskMetadata.build``, ``apply_masks``), each the median ms per step
over a 64-token JSON walk, on torch's threads and on one (``grammar_step_ms_1_thread``:
on a machine whose cores are busy, a parallel op waits for its slowest thread);
``grammar_share`` is their sum over the step time that the plain tok/s implies
(``B / tok_s``).

    python benchmarks/structured_cost.py                       # the embedded tiny model
    python benchmarks/structured_cost.py --concurrency 1,32 --rounds 5 --launch-args "--dp 2"
    python benchmarks/structured_cost.py --url http://127.0.0.1:8000    # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import HOST, _machine, launched_server, tidal_command  # noqa: E402 - a sibling

# An order record as an agent would ask for one: nested objects, an array, enums, bounded
# numbers, required fields.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "unit_price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
            "minItems": 1,
        },
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "notes": {"type": "string"},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA, "strict": True}}


def body(i: int, structured: bool, max_tokens: int, model: str | None) -> dict[str, Any]:
    msg = f"Write order #{i} of customer {i % 7} as JSON."
    b: dict[str, Any] = {
        "messages": [{"role": "user", "content": msg}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": i,
        "ignore_eos": True,
    }
    if structured:
        b["response_format"] = FORMAT
    if model:
        b["model"] = model
    return b


async def one(client: httpx.AsyncClient, url: str, b: dict[str, Any]) -> tuple[int, bool | None]:
    """(output tokens, whether the reply validates: None when it was cut or not asked)."""
    r = await client.post(f"{url}/v1/chat/completions", json=b)
    r.raise_for_status()
    out = r.json()
    (choice,) = out["choices"]
    valid = None
    if "response_format" in b and choice["finish_reason"] == "stop":
        try:
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
    return out["usage"]["completion_tokens"], valid


async def load(
    url: str, n: int, concurrency: int, structured: bool, args: argparse.Namespace
) -> dict[str, Any]:
    """``n`` requests, at most ``concurrency`` at a time: output tok/s and validity."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def bounded(i: int) -> tuple[int, bool | None]:
            async with sem:
                return await one(client, url, body(i, structured, args.max_tokens, args.model))

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(n)))
        wall = time.perf_counter() - start
    tokens = sum(t for t, _ in results)
    checked = [v for _, v in results if v is not None]
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "valid": checked.count(True),
        "checked": len(checked),
    }


def grammar_step_ms(model: str, batch: int, steps: int = 64) -> dict[str, float]:
    """The engine's per-step grammar work for ``batch`` requests of SCHEMA (ms, medians)."""
    import random

    from transformers import AutoTokenizer

    from tidal.engine_core.structured import GrammarBackend
    from tidal.layers.sampler import MaskMetadata, RowInfo, apply_masks
    from tidal.sampling_params import SamplingParams, StructuredOutputs

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    eos = tokenizer.eos_token_id
    backend = GrammarBackend(tokenizer, vocab, [eos])
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    backend.compile(spec).result()  # compile time is grammar_check.py's
    grammars = [backend.request_grammar(spec) for _ in range(batch)]
    rng = random.Random(0)
    bits = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    times: dict[str, list[float]] = {"fill": [], "accept": [], "mask": []}
    params = SamplingParams()
    for _ in range(steps):
        t0 = time.perf_counter()
        masks = backend.bitmasks(grammars)  # [words] int32 bytes each
        t1 = time.perf_counter()
        rows = [RowInfo(params=params, grammar_bitmask=m) for m in masks if isinstance(m, bytes)]
        logits = torch.randn(len(rows), vocab)  # [B, V] float32
        t2 = time.perf_counter()
        apply_masks(logits, MaskMetadata.build(rows, "cpu"))
        t3 = time.perf_counter()
        picks = []
        for m in masks:  # a random allowed token, not the end (the walk goes on)
            row = torch.frombuffer(bytearray(m), dtype=torch.uint8)
            allowed = ((row[:, None] & bits) != 0).flatten()[:vocab].nonzero().flatten().tolist()
            picks.append(rng.choice([t for t in allowed if t != eos] or allowed))
        t4 = time.perf_counter()
        for g, tok in zip(grammars, picks):
            g.accept(tok)
        t5 = time.perf_counter()
        times["fill"].append(t1 - t0)
        times["mask"].append(t3 - t2)
        times["accept"].append(t5 - t4)
        if any(g.is_terminated for g in grammars):
            break
    backend.shutdown()
    return {k: round(1e3 * statistics.median(v), 4) for k, v in times.items()}


def measure(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    for structured in (False, True):  # warm-up: kernels, the schema's compile
        asyncio.run(load(url, 2, 2, structured, args))
    runs: dict[tuple[int, bool], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for c in args.concurrency:
            n = max(args.min_requests, 2 * c)
            order = (False, True) if r % 2 == 0 else (True, False)
            # One at a time, the kinds alternate request by request (a run of one):
            # the load's drift within a round falls on both.
            pairs = [(1, 1)] * n if c == 1 else [(n, c)]
            for size, conc in pairs:
                for structured in order:
                    runs.setdefault((c, structured), []).append(
                        asyncio.run(load(url, size, conc, structured, args))
                    )
    lines = []
    for c in args.concurrency:
        plain = statistics.median(x["tok_s"] for x in runs[(c, False)])
        constrained = statistics.median(x["tok_s"] for x in runs[(c, True)])
        valid = sum(x["valid"] for x in runs[(c, True)])
        checked = sum(x["checked"] for x in runs[(c, True)])
        lines.append({
            "concurrency": c,
            "requests_per_run": max(args.min_requests, 2 * c),
            "rounds": args.rounds,
            "plain_tok_s": round(plain, 1),
            "structured_tok_s": round(constrained, 1),
            "structured_over_plain": round(constrained / plain, 3),
            "plain_tok_s_runs": [round(x["tok_s"], 1) for x in runs[(c, False)]],
            "structured_tok_s_runs": [round(x["tok_s"], 1) for x in runs[(c, True)]],
            "finished_structured_valid": f"{valid}/{checked}",
        })  # fmt: skip
        step = grammar_step_ms(args.model or _default_model(), c)
        lines[-1]["grammar_step_ms"] = step
        lines[-1]["grammar_share"] = round(sum(step.values()) / (1e3 * c / plain), 4)
        # The sampler's mask ops run on torch's threads: on a machine whose cores are
        # busy a parallel op waits for its slowest thread, so one thread is shown too.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        lines[-1]["grammar_step_ms_1_thread"] = grammar_step_ms(args.model or _default_model(), c)
        torch.set_num_threads(threads)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: launch one)")
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded one)")
    p.add_argument("--launch-args", default="", help="more flags for the launched server")
    p.add_argument("--concurrency", default="1,32", help="comma-separated (default 1,32)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--min-requests", type=int, default=4, help="per run (else 2x concurrency)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--launch-timeout", type=float, default=300.0)
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    case = {k: getattr(args, k) for k in ("concurrency", "rounds", "max_tokens", "launch_args")}
    if args.url is not None:
        lines = measure(args.url, args)
    else:
        model = args.model or _default_model()
        cmd = tidal_command(model, shlex.split(args.launch_args), None)
        with launched_server(cmd, HOST, None, args.launch_timeout) as url:
            lines = measure(url, args)
    for line in lines:
        print(json.dumps({"case": case, **line, "machine": _machine()}), flush=True)
    return 0


def _default_model() -> str:
    from tidal.models.tiny import default_model_path

    return default_model_path()


if __name__ == "__main__":
    sys.exit(main())
