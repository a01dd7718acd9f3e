"""Interleaved decode rounds of one loaded ``tidal.LLM`` on two or more sides: the shared
body of ``fused_norm.py`` and ``cpu_decode.py``.

A side is a context manager factory that puts the engine in that side's state for one
``generate`` call (patched ops, a switch). Cases: a single stream (1 x
``opts.single_tokens``) and a batch (``opts.batch`` x ``opts.batch_tokens``), greedy,
``opts.prompt_len``-token prompts. Each case runs once per side to warm up, then
``opts.rounds`` rounds, the sides' order alternating round by round so load from other
processes hits them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any

Side = Callable[[], contextlib.AbstractContextManager[Any]]


def add_arguments(ap: argparse.ArgumentParser, batch_tokens: int, prompt_len: int) -> None:
    """The flags both benchmarks take: the model, its dtype, the rounds, the cases."""
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--single-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32, help="streams of the batch case (0: none)")
    ap.add_argument("--batch-tokens", type=int, default=batch_tokens)
    ap.add_argument("--prompt-len", type=int, default=prompt_len)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def cases(opts: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """case -> (streams, new tokens); ``--batch 0``: the single stream only."""
    out = {"single": (1, opts.single_tokens)}
    if opts.batch > 0:
        out["batch"] = (opts.batch, opts.batch_tokens)
    return out


def header(llm: Any, opts: argparse.Namespace) -> dict[str, Any]:
    """What every result names: the CPU, threads, model, dtype and the kernel choices."""
    import torch

    from tidal.kernels.select import cpu_description

    return {
        "cpu": cpu_description()["model"],
        "threads": torch.get_num_threads(),
        "model": opts.model,
        "dtype": opts.dtype,
        "cpu_kernels": llm.cpu_kernels(),
    }


def interleaved_rounds(
    llm: Any,
    opts: argparse.Namespace,
    sides: dict[str, Side],
    after_round: Callable[[], None] | None = None,  # e.g. a bandwidth probe
) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, list[list[int]]]]]:
    """(ms per generated token [case][side] per round, the last round's tokens
    [case][side] per stream). The time per generated position includes the prefill:
    decode steps dominate it."""
    from tidal import SamplingParams

    vocab = 1000
    runs = cases(opts)
    times: dict[str, dict[str, list[float]]] = {c: {s: [] for s in sides} for c in runs}
    outputs: dict[str, dict[str, list[list[int]]]] = {c: {} for c in runs}

    def run(case: str, side: str) -> None:
        streams, tokens = runs[case]
        prompts = [
            {"prompt_token_ids": [(7 * i + 13 * j) % vocab + 3 for j in range(opts.prompt_len)]}
            for i in range(streams)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        with sides[side]():
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
        times[case][side].append(dt * 1e3 / tokens)
        outputs[case][side] = [list(o.outputs[0].token_ids) for o in outs]

    names = list(sides)
    for case in runs:  # warm every side
        for side in names:
            run(case, side)
    for case in runs:
        times[case] = {s: [] for s in names}
    for r in range(opts.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for case in runs:
            for side in order:
                run(case, side)
        if after_round is not None:
            after_round()
        print(f"round {r + 1}/{opts.rounds} done", file=sys.stderr)
    return times, outputs
