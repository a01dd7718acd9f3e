"""What the worker call path costs (docs/architecture.md#worker-rpc): ``Executor.call`` (name
resolution, the declared reduction) against calling the worker's method directly, and
next to what a step costs anyway, on the tiny test checkpoint (CPU).

1. In-process (``UniProcExecutor``): ns per call of ``call("worker.waiting_on_peers")``
   and of the method itself (``Worker.waiting_on_peers``); their difference is the path's
   own cost. For scale, ms per ``runner.execute_dummy_batch`` (the smallest forward).
2. TP=2 (``MultiprocExecutor``, ``--tp``): us per round trip of a call that does nothing
   on the workers (``runner.get_expert_load``, every worker answers), and per dummy
   forward: the wire, not the lookup, is what a call costs there.

Medians of ``--repeats`` timings of ``--number`` calls each; one JSON line per part.
Usage: ``python benchmarks/worker_rpc.py [--tp] [--repeats 7] [--number 20000]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any


def _config(path: str, tp: int) -> Any:
    from tidal.launch.engine_args import EngineArgs

    return EngineArgs(
        model=path, dtype="float32", device="cpu", tensor_parallel_size=tp,
        num_gpu_blocks_override=32, block_size=4, max_model_len=64,
    ).create_engine_config()  # fmt: skip


def _ns_per_call(fn: Callable[[], object], number: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter_ns() - t) / number)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", action="store_true", help="also measure TP=2 worker processes")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--number", type=int, default=20000)
    args = ap.parse_args()

    from tidal.executor.uniproc import UniProcExecutor
    from tidal.models.tiny import make_tiny_checkpoint
    from tidal.utils.cpu_threads import usable_cores

    with tempfile.TemporaryDirectory() as root:
        ckpt = make_tiny_checkpoint(root + "/qwen3_moe", "qwen3_moe")
        ex = UniProcExecutor(_config(ckpt, 1))
        try:
            ex.call("worker.initialize_kv_cache", 32)
            w = ex.worker
            via_call = _ns_per_call(
                lambda: ex.call("worker.waiting_on_peers"), args.number, args.repeats
            )
            direct = _ns_per_call(w.waiting_on_peers, args.number, args.repeats)
            step = _ns_per_call(lambda: ex.call("runner.execute_dummy_batch"), 50, args.repeats)
        finally:
            ex.shutdown()
        print(json.dumps({
            "part": "in-process", "cores": usable_cores(),
            "call_ns": round(via_call), "direct_ns": round(direct),
            "overhead_ns": round(via_call - direct), "dummy_forward_ms": round(step / 1e6, 3),
        }), flush=True)  # fmt: skip
        if not args.tp:
            return
        from tidal.executor.multiproc import MultiprocExecutor

        mp = MultiprocExecutor(_config(ckpt, 2))
        try:
            mp.call("worker.initialize_kv_cache", 32)
            n = max(1, args.number // 20)
            trip = _ns_per_call(lambda: mp.call("runner.get_expert_load"), n, args.repeats)
            step = _ns_per_call(lambda: mp.call("runner.execute_dummy_batch"), 50, args.repeats)
        finally:
            mp.shutdown()
        print(json.dumps({
            "part": "tp=2", "round_trip_us": round(trip / 1e3, 1),
            "dummy_forward_ms": round(step / 1e6, 3),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
