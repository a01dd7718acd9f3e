"""Expert-parallel MoE layer cost per dispatcher: dispatch + experts + combine.

    python benchmarks/ep.py                     # EP=2, T in 1 32 256, both gloo backends
    python benchmarks/ep.py --ep 3 --tokens 8 64 --iters 50

Starts ``--ep`` processes (spawn) joined by a gloo ``StatelessGroup`` on 127.0.0.1, each
holding ``E / ep`` experts of the default model's MoE shape (hidden 256, 16 experts, top-4,
moe_intermediate 128, float32, CPU torch experts). Every rank routes ``T`` tokens of its
own (random router) per step. For each (backend, T) rank 0 prints one JSON line:

- ``layer_ms_p50`` / ``layer_ms_p90``: the slowest rank's time per layer (per step, the max
  over ranks, then the percentile over steps); ``dispatch_ms``/``experts_ms``/``combine_ms``
  split the p50 step.
- ``bytes_per_token``: bytes sent + received between ranks (self excluded, routing
  metadata included) per dispatched token, averaged over all ranks.
- ``peer_no_ep_ms``: the peer, measured in the same run: one process computing all
  experts for the same T tokens (no dispatch).
- ``max_abs_err``: combined output vs that single-process result.

Timings on a shared 2-core CPU with gloo are dominated by the collectives' fixed costs; the
numbers compare the backends against each other, not against GPU kernels.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue as queue_mod
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tidal.distributed.groups import StatelessGroup  # noqa: E402
from tidal.distributed.ports import get_open_port  # noqa: E402
from tidal.kernels.fused_moe_torch import fused_experts_torch  # noqa: E402
from tidal.moe.dispatch import get_dispatcher  # noqa: E402
from tidal.moe.placement import ExpertPlacement  # noqa: E402

SHAPE = {"hidden": 256, "experts": 16, "top_k": 4, "inter": 128}  # the default model's MoE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--backends", nargs="+", default=["allgather_reducescatter", "all2all"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--placement", default="linear", choices=["linear", "round_robin"])
    return p.parse_args(argv)


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    E, H, inter = SHAPE["experts"], SHAPE["hidden"], SHAPE["inter"]
    return torch.randn(E, 2 * inter, H, generator=g) * 0.05, torch.randn(
        E, H, inter, generator=g
    ) * 0.05


def _tokens(rank: int, T: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    hidden = torch.randn(T, SHAPE["hidden"], generator=g)
    logits = torch.randn(T, SHAPE["experts"], generator=g)
    w, ids = torch.topk(torch.softmax(logits, dim=1), SHAPE["top_k"], dim=1)
    return hidden, (w / w.sum(1, keepdim=True)).float(), ids


def _time_layer(group, dispatcher, w13, w2, T: int, step: int) -> tuple[list[float], torch.Tensor]:
    hidden, w, ids = _tokens(group.rank, T, step)
    sizes = [T] * group.world_size
    t0 = time.perf_counter()
    res = dispatcher.dispatch(hidden, w, ids, sizes)
    t1 = time.perf_counter()
    out = fused_experts_torch(
        res.hidden, w13, w2, res.topk_weights, res.topk_ids, dispatcher.expert_map, True
    )
    t2 = time.perf_counter()
    y = dispatcher.combine(out, res.handle)
    t3 = time.perf_counter()
    return [t1 - t0, t2 - t1, t3 - t2, t3 - t0], y


def _peer(w13_all, w2_all, rank: int, T: int, iters: int) -> tuple[float, torch.Tensor]:
    times, ref = [], None
    for step in range(iters):
        hidden, w, ids = _tokens(rank, T, step)
        t0 = time.perf_counter()
        ref = fused_experts_torch(hidden, w13_all, w2_all, w, ids, None, True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, ref


def _worker(rank: int, ep: int, port: int, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    group = StatelessGroup.create(
        host="127.0.0.1", port=port, rank=rank, world_size=ep, prefix="bench"
    )
    w13_all, w2_all = _weights()
    placement = ExpertPlacement.build(args.placement, SHAPE["experts"], ep)
    local = placement.local_expert_ids(rank)
    w13, w2 = w13_all[local].contiguous(), w2_all[local].contiguous()
    for backend in args.backends:
        for T in args.tokens:
            d = get_dispatcher(backend, group, placement)
            for step in range(args.warmup):
                _time_layer(group, d, w13, w2, T, step)
            d.stats.reset()
            rows = []
            for step in range(args.iters):
                times, y = _time_layer(group, d, w13, w2, T, step)
                rows.append(times)
            per_step = group.all_reduce(
                torch.tensor(rows, dtype=torch.float64), torch.distributed.ReduceOp.MAX
            )
            moved = group.all_reduce(
                torch.tensor([d.stats.bytes_moved, d.stats.tokens], dtype=torch.float64)
            )
            peer_ms, ref = _peer(w13_all, w2_all, rank, T, args.iters)  # last step's tokens
            err = group.all_reduce(
                torch.tensor([(y - ref).abs().max().item() if T else 0.0]),
                torch.distributed.ReduceOp.MAX,
            )
            if rank == 0:
                queue.put(_row(backend, ep, T, per_step, moved, peer_ms, float(err), args))
    group.barrier()
    group.destroy()
    queue.put(None)


def _row(backend, ep, T, per_step, moved, peer_ms, err, args) -> dict:
    layer = per_step[:, 3]
    p50 = int(torch.argsort(layer)[len(layer) // 2])
    ms = (per_step[p50] * 1e3).tolist()
    return {
        "bench": "ep_moe_layer",
        "backend": backend,
        "ep": ep,
        "tokens_per_rank": T,
        "shape": SHAPE,
        "placement": args.placement,
        "layer_ms_p50": round(ms[3], 3),
        "layer_ms_p90": round(float(torch.quantile(layer, 0.9)) * 1e3, 3),
        "dispatch_ms": round(ms[0], 3),
        "experts_ms": round(ms[1], 3),
        "combine_ms": round(ms[2], 3),
        "bytes_per_token": round(float(moved[0] / moved[1]), 1) if moved[1] else 0.0,
        "peer_no_ep_ms": round(peer_ms, 3),
        "max_abs_err": err,
        "iters": args.iters,
        "device": "cpu-gloo",
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = get_open_port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.ep, port, args, queue)) for r in range(args.ep)
    ]
    for p in procs:
        p.start()
    try:
        finished = 0
        while finished < args.ep:
            try:
                item = queue.get(timeout=1)
            except queue_mod.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise SystemExit(f"a benchmark rank failed (exit codes {failed})") from None
                continue
            if item is None:
                finished += 1
            else:
                print(json.dumps(item), flush=True)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


if __name__ == "__main__":
    main()
