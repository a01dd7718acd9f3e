"""Data parallelism: DP=1 vs DP=2 throughput, and load balance per policy, in one run.

For each arrival pattern (uniform, bursty, skewed long/short) and each deployment
(DP=1; DP=2 with the vLLM-style ``4*waiting + running`` score; DP=2 with Tidal's policy)
it prints one JSON line: output tokens/s, the imbalance of requests served per rank
(max/mean) and of running requests per rank over time (mean over samples of max/mean,
sampled from the coordinator's published load while the ranks were busy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass

from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.processor import ProcessedPrompt
from tidal.launch.engine_args import EngineArgs
from tidal.sampling_params import SamplingParams


@dataclass
class Arrival:
    at_s: float
    prompt: list[int]
    max_tokens: int


def workload(kind: str, n: int, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)

    def prompt() -> list[int]:
        return [rng.randrange(10, 4000) for _ in range(rng.randrange(8, 40))]

    if kind == "uniform":
        return [Arrival(i * 0.03, prompt(), 32) for i in range(n)]
    if kind == "bursty":
        return [Arrival((i // 16) * 1.0, prompt(), 32) for i in range(n)]
    if kind == "skewed":  # one long request in five
        return [Arrival(i * 0.03, prompt(), 160 if i % 5 == 0 else 8) for i in range(n)]
    raise ValueError(kind)


async def run_case(model: str | None, dp: int, policy: str, arrivals: list[Arrival]) -> dict:
    config = EngineArgs(
        model=model, dtype="float32", data_parallel_size=dp, dp_lb_policy=policy
    ).create_engine_config()
    engine = AsyncLLM(config)
    samples: list[list[int]] = []
    served = [0] * dp

    async def one(a: Arrival, i: int) -> int:
        await asyncio.sleep(max(0.0, a.at_s - (time.perf_counter() - t0)))
        params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
        n = 0
        async for out in engine.generate(ProcessedPrompt(None, a.prompt), params, f"r{i}"):
            n += len(out.outputs[0].token_ids)
        return n

    async def sampler() -> None:
        while True:
            if dp > 1:
                st = await engine.get_stats()
                running = [r["running"] for r in st["ranks"]]
                if sum(running) > 0:
                    samples.append(running)
            await asyncio.sleep(0.05)

    try:
        # Warm up every rank once so start-up costs are not measured.
        warm = SamplingParams(max_tokens=2)
        for r in range(dp):
            async for _ in engine.generate(
                ProcessedPrompt(None, [11, 12]), warm, f"w{r}", data_parallel_rank=r
            ):
                pass
        before = await _served(engine, dp)
        task = asyncio.create_task(sampler())
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(a, i) for i, a in enumerate(arrivals))))
        elapsed = time.perf_counter() - t0
        task.cancel()
        after = await _served(engine, dp)
        served = [b - a for a, b in zip(before, after)]
    finally:
        await engine.shutdown()
    running_imb = [max(s) / (sum(s) / len(s)) for s in samples] if samples else [1.0]
    return {
        "output_tok_per_s": round(tokens / elapsed, 1),
        "elapsed_s": round(elapsed, 2),
        "served_per_rank": served,
        "served_imbalance": round(max(served) / (sum(served) / dp), 3) if sum(served) else None,
        "running_imbalance_mean": round(sum(running_imb) / len(running_imb), 3),
        "running_samples": len(samples),
    }


async def _served(engine: AsyncLLM, dp: int) -> list[int]:
    return [r["requests_total"] for r in (await engine.get_stats())["ranks"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--workloads", default="uniform,bursty,skewed")
    args = ap.parse_args()
    for kind in args.workloads.split(","):
        arrivals = workload(kind, args.num_requests)
        for dp, policy in ((1, "tidal"), (2, "vllm"), (2, "tidal")):
            r = asyncio.run(run_case(args.model, dp, policy, arrivals))
            print(
                json.dumps({"workload": kind, "dp": dp, "policy": policy if dp > 1 else None, **r}),
                flush=True,
            )


if __name__ == "__main__":
    main()
