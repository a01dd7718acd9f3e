"""Decode step against its floor, eager and with decode graphs, in one prepared run.

On the generated 4-layer, 128-expert Qwen3-MoE of ``gpu_proof.py`` (bf16, one CUDA rank,
the model runner driven directly: no scheduler, no IPC), for B = 1, 4, 32, 256 requests
decoding after a 32-token prompt:

* the floor F(B) = bytes a step must read / this run's copy bandwidth (read + write of one
  large device copy): every non-expert weight (the embedding's B rows only), the experts
  the step's routing touched (counted from the recorded expert load) and the K/V of every
  real row's context;
* the steady decode step S(B), median of 3 repeats of ``--steps`` steps: eager
  (``GraphMiss.ENFORCE_EAGER`` set on the same runner), replayed graphs, and replayed
  graphs with async scheduling (``execute_model_async``: each step launched with its
  placeholder ids, the previous step's tokens still on the device, before the previous
  step's tokens are resolved, as ``EngineCore`` does);
* the graph hit rate over the graph runs, capture time of every size, the graphs' memory
  pool (estimated before capture, as the KV budget takes it, and measured after), and
  greedy tokens of 8 prompts x 128 tokens, graphs and graphs + async against eager
  (bf16), token for token;
* transformers' decode step at B = 1 and 32 (``generate``'s time per new token; skip with
  ``--no-hf-peer``).

    python benchmarks/gpu_engine.py --out graphs.json          # on the GPU (< 10 min)
    SMOKE=1 python benchmarks/gpu_engine.py --out graphs.json  # CPU rehearsal, emulated graphs

Prints one JSON line per measurement and writes the whole result to ``--out``; a failure is
recorded in the file (``ok: false``, the error and traceback), never raised.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # gpu_proof's model and guard
sys.path.insert(0, str(HERE.parent))

from gpu_proof import ENGINE_MODEL, SMOKE_ENGINE_MODEL, _guarded, _hf_throughput  # noqa: E402

PROMPT_LEN = 32
BLOCK = 16


class _Req:
    """What the runner reads of a request (the scheduler's ``Request`` has more)."""

    def __init__(self, rid: str, prompt: list[int], blocks: list[int]) -> None:
        from tidal.sampling_params import SamplingParams

        self.request_id = rid
        self.prompt_token_ids = prompt
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt)
        self.block_ids = blocks
        self.sampling_params = SamplingParams(temperature=0.0, max_tokens=1 << 20)
        self.eos_token_id = 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class Driver:
    """Requests on a runner: each its own blocks, prefilled in one step, then decoded."""

    def __init__(self, runner: Any, vocab: int, max_tokens: int) -> None:
        self.runner, self.vocab, self.per_req = runner, vocab, -(-max_tokens // BLOCK)
        self.serial = 0
        self.pending: Any = None  # async: the launched step's PendingRunnerOutput

    def start(self, num: int, seed: int) -> list[_Req]:
        import torch

        gen = torch.Generator().manual_seed(seed)
        reqs = []
        for i in range(num):
            blocks = list(range(1 + i * self.per_req, 1 + (i + 1) * self.per_req))
            prompt = torch.randint(10, self.vocab - 10, (PROMPT_LEN,), generator=gen).tolist()
            self.serial += 1
            reqs.append(_Req(f"r{self.serial}", prompt, blocks))
        self.step(reqs, prefill=True)
        return reqs

    def step(self, reqs: list[_Req], prefill: bool = False) -> None:
        from tidal.executor.batch import ScheduledRequest, SchedulerOutput

        sched = [
            ScheduledRequest(r, 0, r.num_tokens) if prefill else
            ScheduledRequest(r, r.num_tokens - 1, 1)
            for r in reqs
        ]  # fmt: skip
        out = self.runner.execute_model(
            SchedulerOutput(sched, sum(s.num_new_tokens for s in sched))
        )
        self._take(reqs, out)

    def _take(self, reqs: list[_Req], out: Any) -> None:
        if out.failed:
            raise RuntimeError(f"requests failed: {out.failed}")
        for r in reqs:
            tok = out.sampled_token_ids[r.request_id][0]
            r.all_token_ids.append(tok)
            r.output_token_ids.append(tok)

    def step_async(self, reqs: list[_Req]) -> None:
        """A decode step as async scheduling runs it: launch it, then resolve the step
        launched before. While one is pending, each request's next token is a placeholder
        (at position ``num_tokens``: the pending token, still on the device)."""
        from tidal.executor.batch import ScheduledRequest, SchedulerOutput

        if self.pending is None:
            sched = [ScheduledRequest(r, r.num_tokens - 1, 1) for r in reqs]
        else:
            sched = [ScheduledRequest(r, r.num_tokens, 1, placeholder=True) for r in reqs]
        launched = self.runner.execute_model_async(SchedulerOutput(sched, len(sched)))
        self.drain(reqs)
        self.pending = launched

    def drain(self, reqs: list[_Req]) -> None:
        """Resolve the pending step's tokens (the end of an async run)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._take(reqs, pending.resolve())

    def finish(self, reqs: list[_Req]) -> None:
        self.runner.input_batch.drop({r.request_id for r in reqs})


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def copy_gbps(device: str, smoke: bool) -> float:
    """Read + write GB/s of one large device copy."""
    import torch

    n = (1 << 24) if smoke else (1 << 30)
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    _sync(device)
    s = (time.perf_counter() - t0) / 5
    del a, b
    return 2 * 2 * n / s / 1e9


def step_bytes(runner: Any, driver: Driver, reqs: list[_Req]) -> dict[str, int]:
    """What one decode step of ``reqs`` must read: weights (experts: those its routing
    touches, from the recorded load of one step) and every row's K/V."""
    import torch

    model = runner.model
    moe = model.moe_layers()
    # The state dict holds every weight as the checkpoint has it, packed or not.
    moe_ids = {id(m) for m in moe}
    expert_keys = {
        f"{name}.{part}"
        for name, m in model.named_modules()
        if id(m) in moe_ids
        for part in ("w13", "w2")
    }
    dense = sum(
        t.numel() * t.element_size()
        for name, t in model.state_dict().items()
        if name not in expert_keys and not name.startswith("embed_tokens")
    )
    emb = model.embed_tokens.weight
    dense += len(reqs) * emb.shape[1] * emb.element_size()
    loads = [torch.zeros(m.num_experts, dtype=torch.int64, device=emb.device) for m in moe]
    for m, load in zip(moe, loads):
        m.bind_expert_load(load)
    driver.step(reqs)
    for m in moe:
        m.record_expert_load = False
    w = moe[0].read_weights(["w13", "w2"])
    per_expert = (w["w13"][0].numel() + w["w2"][0].numel()) * w["w13"].element_size()
    experts = sum(int((load > 0).sum()) for load in loads) * per_expert
    kv_per_token = model.kv_cache_spec().bytes_per_token(runner.config.kv_cache_torch_dtype)
    kv = sum(r.num_tokens - 1 for r in reqs) * kv_per_token  # keys the last step read
    return {"weights": dense, "experts": experts, "kv": kv, "total": dense + experts + kv}


def timed_steps(
    driver: Driver, reqs: list[_Req], steps: int, device: str, is_async: bool = False
) -> float:
    """Milliseconds per decode step over ``steps`` steps (after one); ``is_async``: as
    async scheduling runs them, the last one resolved in the time."""
    step = driver.step_async if is_async else driver.step
    step(reqs)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(reqs)
    driver.drain(reqs)
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def greedy(
    driver: Driver, prompts: int, new: int, seed: int, is_async: bool = False
) -> list[list[int]]:
    reqs = driver.start(prompts, seed)
    for _ in range(new - 1):
        (driver.step_async if is_async else driver.step)(reqs)
    driver.drain(reqs)
    driver.finish(reqs)
    return [r.output_token_ids for r in reqs]


def run(result: dict[str, Any], smoke: bool, workdir: Path, hf_peer: bool, steps: int) -> None:
    import torch

    from tidal.executor.graphs import GraphMiss, GraphStats
    from tidal.executor.model_runner import ModelRunner
    from tidal.launch.engine_args import EngineArgs
    from tidal.models.tiny import make_tiny_checkpoint

    device = "cpu" if smoke else "cuda"
    spec = SMOKE_ENGINE_MODEL if smoke else ENGINE_MODEL
    sizes = (1, 4) if smoke else (1, 4, 32, 256)
    new = 4 if smoke else 128
    steps = 1 if smoke else steps
    path = str(workdir / "qwen3-moe")
    make_tiny_checkpoint(path, init_device=device, **spec)
    result["model"] = spec
    result["device"] = "cpu (smoke)" if smoke else torch.cuda.get_device_name(0)
    result["copy_gbps_read_plus_write"] = bw = round(copy_gbps(device, smoke), 1)
    # A request's blocks hold its prompt, the floor's step and 3 repeats of the 3 modes
    # (async: one more step each, its last one's token).
    max_tokens = PROMPT_LEN + max(new, 9 * (steps + 2) + 2)
    max_model_len = -(-max_tokens // BLOCK) * BLOCK
    args = EngineArgs(
        model=path, device=device, dtype="float32" if smoke else "bfloat16",
        max_num_seqs=max(sizes), max_model_len=max_model_len,
        graph_backend="emulated" if smoke else "cuda", cpu_kernels="native",
    )  # fmt: skip
    runner = ModelRunner(args.create_engine_config(), torch.device(device))
    t0 = time.perf_counter()
    runner.load_model()
    result["load_s"] = round(time.perf_counter() - t0, 1)
    driver = Driver(runner, spec["vocab_size"], max_model_len)
    # What the KV budget leaves for the graphs' pool (0 on CPU), then the pool measured.
    pool_estimate = runner._graph_pool_estimate()  # noqa: SLF001 - the budget's own number
    runner.initialize_kv_cache(1 + max(sizes, default=1) * driver.per_req)
    graphs = runner.graphs
    result["graphs"] = {
        "backend": graphs.backend.name if graphs.backend else None,
        "sizes": list(graphs.sizes), "captured": len(graphs.captured),
        "capture_failed": sorted(graphs.failed), "capture_s": round(graphs.capture_s, 2),
        "pool_bytes_estimated": pool_estimate, "pool_bytes": graphs.pool_bytes,
    }  # fmt: skip
    print(json.dumps({"capture": result["graphs"]}), flush=True)

    def eager(on: bool) -> None:
        graphs.off = GraphMiss.ENFORCE_EAGER if on else None

    rows = []
    graph_stats = GraphStats()
    for b in sizes:
        reqs = driver.start(b, seed=b)
        need = step_bytes(runner, driver, reqs)
        floor_ms = need["total"] / (bw * 1e9) * 1e3
        times: dict[str, list[float]] = {"eager": [], "graphs": [], "graphs_async": []}
        for _ in range(3):  # alternating, so drift hits every mode alike
            for mode in times:
                eager(mode == "eager")
                graphs.stats = GraphStats()
                is_async = mode == "graphs_async"
                times[mode].append(timed_steps(driver, reqs, steps, device, is_async))
                if mode != "eager":
                    for k, v in graphs.stats.misses.items():
                        graph_stats.misses[k] = graph_stats.misses.get(k, 0) + v
                    graph_stats.hits += graphs.stats.hits
        eager(False)
        driver.finish(reqs)
        row = {
            "B": b, "bytes": need, "F_ms": round(floor_ms, 4),
            "S_eager_ms": round(statistics.median(times["eager"]), 3),
            "S_graphs_ms": round(statistics.median(times["graphs"]), 3),
            "S_graphs_async_ms": round(statistics.median(times["graphs_async"]), 3),
            "repeats": times,
        }  # fmt: skip
        row["eager_over_floor"] = round(row["S_eager_ms"] / floor_ms, 2)
        row["graphs_over_floor"] = round(row["S_graphs_ms"] / floor_ms, 2)
        row["graphs_async_over_floor"] = round(row["S_graphs_async_ms"] / floor_ms, 2)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "repeats"}), flush=True)
    result["steps"] = rows
    total = graph_stats.hits + sum(graph_stats.misses.values())
    result["graph_hit_rate"] = round(graph_stats.hits / total, 4) if total else None
    result["graph_misses"] = {k.value: v for k, v in graph_stats.misses.items()}

    prompts = 2 if smoke else 8
    eager(True)
    want = greedy(driver, prompts, new, seed=1000)
    eager(False)
    for name, is_async in (("graphs", False), ("graphs_async", True)):
        got = greedy(driver, prompts, new, seed=1000, is_async=is_async)
        result[f"greedy_{name}_vs_eager"] = {
            "prompts": prompts, "tokens": new,
            "dtype": str(runner.model.embed_tokens.weight.dtype),
            "identical": sum(g == w for g, w in zip(got, want)),
            "first_mismatch": next(
                ({"prompt": i, name: g, "eager": w} for i, (g, w) in enumerate(zip(got, want))
                 if g != w), None,
            ),
        }  # fmt: skip
        print(json.dumps({f"greedy_{name}": result[f"greedy_{name}_vs_eager"]["identical"]}))
    runner.free_kv_cache()
    if hf_peer and not smoke:
        del runner
        torch.cuda.empty_cache()
        hf: dict[str, Any] = {}
        for b in (1, 32):
            try:
                tok_s = _hf_throughput(path, b, PROMPT_LEN, 64, device)
                hf[f"B{b}_step_ms"] = round(b / tok_s * 1e3, 3)
            except Exception as e:  # noqa: BLE001 - the peer is a reference, not the proof
                hf[f"B{b}"] = f"{type(e).__name__}: {e}"
        result["transformers"] = hf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="CPU rehearsal (also SMOKE=1)")
    p.add_argument("--steps", type=int, default=20, help="decode steps per timed repeat")
    p.add_argument("--no-hf-peer", action="store_true", help="skip transformers' step")
    args = p.parse_args(argv)
    smoke = args.smoke or os.environ.get("SMOKE") == "1"
    with tempfile.TemporaryDirectory(prefix="tidal-gpu-engine-") as tmp:
        return _guarded(
            "graphs", lambda r: run(r, smoke, Path(tmp), not args.no_hf_peer, args.steps), args.out
        )


if __name__ == "__main__":
    sys.exit(main())
