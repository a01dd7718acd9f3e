"""Tensor parallelism inside a rank (docs/architecture.md#tensor-parallel): what the step broadcast costs, what TP
does to throughput, and whether scale cycles of TP ranks leak.

1. ``broadcast`` (default): the shared-memory queue (``tidal/distributed/shm_queue.py``)
   against a ZMQ PUB/SUB broadcast of the same payloads, in the same run, to the same
   reader processes' count (``--readers``, the TP size). Payloads are real step inputs
   (``StepEncoder``): the first step of N requests (prompts whole) and a steady decode
   step (one new token each), N in 1, 32, 256. Per step the writer publishes and waits
   for every reader's acknowledgement (the engine waits for the step's output too);
   ``one_way_us`` is publish -> the last reader holding the bytes (CLOCK_MONOTONIC, the
   same clock in every process), ``round_trip_us`` adds the acks (a ZMQ PUSH, the same
   for both). ``gap_us`` is the engine's own time between steps: at 0 the readers are
   still spinning, at 1000 they sleep (futex wake for the queue; a blocking recv for
   ZMQ). One JSON line per (payload, gap) with both peers; medians and p90s. The queue's
   readers spin before sleeping only on hosts with spare cores (``default_spin_s``);
   ``TIDAL_BENCH_SPIN_US`` overrides that, to compare.
2. ``throughput`` (``--throughput``): offline greedy decode tok/s of the embedded default
   model at TP=1 and TP=2 on this machine (2 CPU cores in CI: no speed goal, the record).
3. ``cycles`` (``--cycles N``): ``--dp 2 -tp 2 --ep --enable-elastic-ep``, one warm-up
   cycle (it creates the scale driver and its threads), then N scale cycles 2 -> 3 -> 2
   with a request after each; prints the seconds per cycle and what is left: worker
   processes beyond the topology's, the frontend's threads and fds after the warm-up
   cycle and after the N, and after shutdown any process, /dev/shm segment or socket
   directory.

Usage: ``python benchmarks/tp.py [--throughput] [--cycles 10]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import msgspec
import zmq

from tidal.distributed.shm_queue import NAME_PREFIX, SHM_DIR, ShmQueueReader, ShmQueueWriter
from tidal.engine_core.request import Request
from tidal.executor.batch import ScheduledRequest, SchedulerOutput
from tidal.executor.step_wire import StepEncoder
from tidal.protocol.worker import ShmQueueHandle
from tidal.sampling_params import SamplingParams

SIZES = (1, 32, 256)
PROMPT_TOKENS = 128


def step_payloads(num_requests: int) -> dict[str, bytes]:
    """The msgpack of a first step (every prompt) and of a decode step (a token each)."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=256)
    reqs = []
    for i in range(num_requests):
        r = Request(f"cmpl-{i:08x}", [(i * 31 + k) % 4000 for k in range(PROMPT_TOKENS)], params)
        r.block_ids = list(range(1 + 9 * i, 1 + 9 * i + PROMPT_TOKENS // 16))
        reqs.append(r)
    enc = StepEncoder()
    first = SchedulerOutput([ScheduledRequest(r, 0, PROMPT_TOKENS) for r in reqs])
    prefill = msgspec.msgpack.encode(enc.encode(first))
    for r in reqs:
        r.num_computed_tokens = PROMPT_TOKENS
        r.append_output_token(11)
    decode = SchedulerOutput([ScheduledRequest(r, r.num_tokens - 1, 1) for r in reqs])
    return {"prefill": prefill, "decode": msgspec.msgpack.encode(enc.encode(decode))}


# ---------------------------------------------------------------- readers (subprocesses)


def reader_main(mode: str, address: str, ack_address: str, rank: int, handle_hex: str) -> None:
    ctx = zmq.Context()
    ack = ctx.socket(zmq.PUSH)
    ack.connect(ack_address)
    if mode == "shm":
        handle = msgspec.msgpack.decode(bytes.fromhex(handle_hex), type=ShmQueueHandle)
        spin = os.environ.get("TIDAL_BENCH_SPIN_US")
        kw = {} if spin is None else {"spin_s": float(spin) / 1e6}
        q = ShmQueueReader(handle, rank, ctx=ctx, **kw)

        def get() -> bytes:
            return q.get()
    else:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(address)
        get = sub.recv
    ack.send(b"hello")
    while True:
        data = get()
        t = time.perf_counter_ns()
        if data == b"stop":
            break
        ack.send(t.to_bytes(8, "little"))
    ack.close(linger=1000)
    os._exit(0)


def _spawn_readers(mode: str, n: int, address: str, ack: str, handle_hex: str) -> list:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return [
        subprocess.Popen(
            [sys.executable, __file__, "--reader", mode, address, ack, str(r), handle_hex],
            env=env,
        )
        for r in range(n)
    ]


class Peer:
    """One broadcast mechanism with its reader processes."""

    def __init__(self, mode: str, readers: int, tmp: str) -> None:
        self.mode = mode
        self.readers = readers
        self.ctx = zmq.Context()
        self.acks = self.ctx.socket(zmq.PULL)
        ack_address = f"ipc://{tmp}/{mode}-acks"
        self.acks.bind(ack_address)
        self.queue: ShmQueueWriter | None = None
        self.pub = None
        handle = ""
        address = f"ipc://{tmp}/{mode}-pub"
        if mode == "shm":
            self.queue = ShmQueueWriter(readers, ctx=self.ctx, overflow_address=address)
            handle = msgspec.msgpack.encode(self.queue.handle).hex()
        else:
            self.pub = self.ctx.socket(zmq.XPUB)
            self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self.pub.setsockopt(zmq.SNDHWM, 0)
            self.pub.bind(address)
        self.procs = _spawn_readers(mode, readers, address, ack_address, handle)
        for _ in range(readers):
            self.acks.recv()  # hello: the reader is up
        if self.queue is not None:
            self.queue.wait_for_readers(60)
            self.queue.unlink()
        else:
            for _ in range(readers):
                self.pub.recv()  # every subscription is in: nothing is missed

    def send(self, data: bytes) -> None:
        if self.queue is not None:
            self.queue.put(data)
        else:
            self.pub.send(data, copy=len(data) < 65536)

    def step(self, data: bytes) -> tuple[float, float]:
        """(one-way, round trip) in microseconds."""
        t0 = time.perf_counter_ns()
        self.send(data)
        last = 0
        for _ in range(self.readers):
            last = max(last, int.from_bytes(self.acks.recv(), "little"))
        t1 = time.perf_counter_ns()
        return (last - t0) / 1e3, (t1 - t0) / 1e3

    def close(self) -> None:
        self.send(b"stop")
        for p in self.procs:
            p.wait(30)
        if self.queue is not None:
            self.queue.close()
        if self.pub is not None:
            self.pub.close(linger=0)
        self.acks.close(linger=0)
        self.ctx.term()


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50": round(statistics.median(xs), 1), "p90": round(xs[int(0.9 * len(xs))], 1)}


def broadcast(readers: int, steps: int) -> None:
    with tempfile.TemporaryDirectory(prefix="tidal-bench-") as tmp:
        peers = {m: Peer(m, readers, tmp) for m in ("shm", "zmq")}
        try:
            for n in SIZES:
                for kind, data in step_payloads(n).items():
                    for gap_us in (0, 1000):
                        line = {"case": "broadcast", "requests": n, "step": kind,
                                "payload_bytes": len(data), "readers": readers,
                                "gap_us": gap_us, "steps": steps}  # fmt: skip
                        for mode, peer in peers.items():
                            for _ in range(20):  # warm-up
                                peer.step(data)
                            one, rtt = [], []
                            for _ in range(steps):
                                if gap_us:
                                    time.sleep(gap_us / 1e6)
                                a, b = peer.step(data)
                                one.append(a)
                                rtt.append(b)
                            line[f"{mode}_one_way_us"] = _stats(one)
                            line[f"{mode}_round_trip_us"] = _stats(rtt)
                        line["speedup_one_way_p50"] = round(
                            line["zmq_one_way_us"]["p50"] / line["shm_one_way_us"]["p50"], 2
                        )
                        print(json.dumps(line), flush=True)
        finally:
            for peer in peers.values():
                peer.close()


# ---------------------------------------------------------------- throughput


def throughput(model: str | None, num_prompts: int, max_tokens: int) -> None:
    from tidal import LLM

    prompts = [[(i * 13 + k) % 4000 + 10 for k in range(32)] for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(model, dtype="float32", tensor_parallel_size=tp, multiprocess=False)
        try:
            llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
            t0 = time.perf_counter()
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            dt = time.perf_counter() - t0
        finally:
            llm.shutdown()
        tokens = sum(len(o.outputs[0].token_ids) for o in res)
        outs[tp] = [o.outputs[0].token_ids for o in res]
        print(json.dumps({"case": "throughput", "tp": tp, "prompts": num_prompts,
                          "max_tokens": max_tokens, "tok_s": round(tokens / dt, 1),
                          "seconds": round(dt, 2), "cpus": len(os.sched_getaffinity(0))}),
              flush=True)  # fmt: skip
    print(json.dumps({"case": "throughput_parity", "tp2_equals_tp1": outs[1] == outs[2]}))


# ---------------------------------------------------------------- scale cycles


def cycles(model: str | None, n: int) -> None:
    import psutil

    from tidal.frontend.async_llm import AsyncLLM
    from tidal.frontend.processor import ProcessedPrompt
    from tidal.launch.engine_args import EngineArgs

    def segments() -> int:
        return sum(name.startswith(NAME_PREFIX) for name in os.listdir(SHM_DIR))

    def tp_dirs() -> int:
        return sum(name.startswith("tidal-tp-") for name in os.listdir(tempfile.gettempdir()))

    def workers() -> int:
        return sum(
            p.name().startswith("Worker_DP")
            for p in psutil.Process().children(recursive=True)
            if p.is_running()
        )

    async def one(llm: AsyncLLM, rid: str) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        async for _ in llm.generate(ProcessedPrompt(None, [5, 6, 7]), params, rid):
            pass

    async def main() -> None:
        args = EngineArgs(model=model, dtype="float32", data_parallel_size=2,
                          tensor_parallel_size=2, enable_expert_parallel=True,
                          enable_elastic_ep=True)  # fmt: skip
        seg0, dirs0 = segments(), tp_dirs()
        llm = AsyncLLM(args.create_engine_config())
        me = psutil.Process()
        try:
            await one(llm, "warm")

            async def cycle(c: int) -> float:
                t0 = time.perf_counter()
                for size in (3, 2):
                    code, rec = await llm.scale_elastic_ep(size)
                    assert rec["result"] == "succeeded", rec
                await one(llm, f"c{c}")
                return time.perf_counter() - t0

            await cycle(-1)  # warm-up: the scale driver's threads and sockets start here
            before = {"threads": me.num_threads(), "fds": me.num_fds()}
            times = [await cycle(c) for c in range(n)]
            after = {"threads": me.num_threads(), "fds": me.num_fds()}
            live = workers()
        finally:
            await llm.shutdown()
        await asyncio.sleep(2)
        print(json.dumps({
            "case": "scale_cycles", "cycles": n, "tp": 2, "cycle_s": _stats(times),
            "workers_alive_at_end": live, "workers_expected": 4,
            "frontend_before": before, "frontend_after": after,
            "shm_segments_left": segments() - seg0, "socket_dirs_left": tp_dirs() - dirs0,
            "worker_processes_left_after_shutdown": workers(),
        }), flush=True)  # fmt: skip

    asyncio.run(main())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--reader":
        mode, address, ack, rank = argv[1:5]
        reader_main(mode, address, ack, int(rank), argv[5] if len(argv) > 5 else "")
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--readers", type=int, default=2, help="TP workers reading each step")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--no-broadcast", action="store_true")
    p.add_argument("--throughput", action="store_true")
    p.add_argument("--model", default=None, help="for --throughput/--cycles (default: embedded)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cycles", type=int, default=0)
    args = p.parse_args(argv)
    if not args.no_broadcast:
        broadcast(args.readers, args.steps)
    if args.throughput:
        throughput(args.model, args.prompts, args.max_tokens)
    if args.cycles:
        cycles(args.model, args.cycles)


if __name__ == "__main__":
    main()
