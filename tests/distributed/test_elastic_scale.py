"""Elastic EP end to end through ``AsyncLLM.scale_elastic_ep`` (real engine processes on
gloo, docs/architecture.md#elastic):

- 2 -> 3 -> 2 -> 4 -> 1 -> 2 under continuous streaming load, with both CPU dispatchers
  (and with EPLB + redundant experts): every stream completes, greedy *and seeded* outputs
  equal an unscaled DP=1 run token for token (no error, gap or duplicate), the removed
  engines' requests migrate, and exactly the new topology's engines are alive after
  each operation;
- rollback: a joiner killed during prepare, a joiner that dies before its handshake, an
  expert transfer that times out -- the caller gets the cause, the deployment serves at
  the old size, and the next operation works;
- 10 cycles 2 <-> 3 leak nothing: processes, threads, open fds and listening ports of the
  frontend and the surviving engine are exactly what they were, frontend RSS bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable

import psutil
import pytest

from tests.waiting import wait_until_async
from tidal import LLM
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.processor import ProcessedPrompt
from tidal.frontend.scaling.scale_records import ScaleTimeouts
from tidal.launch.engine_args import EngineArgs
from tidal.protocol.elastic import ScalePrepare
from tidal.sampling_params import SamplingParams
from tidal.utils.forkserver import ForkedProcess

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 32
PROMPTS = [[1, 2, 3, 4], [7, 9, 11], [100, 3, 5, 8, 13], [42], [250, 251, 17, 3, 3, 90]]
# Greedy and seeded sampling (a pure function of seed and output position, docs/architecture.md#elastic-migration).
WORKLOAD = [
    (p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS
] + [
    (p, SamplingParams(temperature=1.0, top_p=0.9, seed=1000 + i, max_tokens=MAX_TOKENS))
    for i, p in enumerate(PROMPTS)
]
# Pinned to the rank that leaves next, so every scale-down has streams to migrate: a long
# greedy one, and n=2 seeded siblings with penalties, logprobs and min_tokens, whose state
# (output count, penalty history, sampler position) must carry over to the survivor.
LONG = len(WORKLOAD)
WORKLOAD.append(([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)))
RICH = len(WORKLOAD)
WORKLOAD.append(
    (
        [9, 10, 11],
        SamplingParams(
            n=2,
            temperature=0.8,
            seed=7,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
            logprobs=2,
            min_tokens=120,
            max_tokens=140,
        ),
    )
)


def _llm(ckpt: str, size: int, **kw) -> AsyncLLM:
    timeouts = kw.pop("scale_timeouts", None)
    args = EngineArgs(
        model=ckpt,
        dtype="float32",
        data_parallel_size=size,
        enable_expert_parallel=True,
        enable_elastic_ep=True,
        **kw,
    )
    return AsyncLLM(args.create_engine_config(), scale_timeouts=timeouts)


def _tokens(outputs) -> list[int] | list[list[int]]:
    """One completion: its tokens; n > 1: each sibling's, by index."""
    by_index = [c.token_ids for c in sorted(outputs, key=lambda c: c.index)]
    return by_index[0] if len(by_index) == 1 else by_index


@pytest.fixture(scope="module")
def reference(qwen3_ckpt) -> list:
    """Every workload item on one unscaled engine (DP=1, no elastic machinery), and the
    n=2 item's logprobs."""
    llm = LLM(qwen3_ckpt, dtype="float32")
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p, _ in WORKLOAD],
            [params for _, params in WORKLOAD],
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    return [_tokens(o.outputs) for o in outs]


async def _run(
    llm: AsyncLLM,
    rid: str,
    item: int,
    on_token: Callable[[], None] = lambda: None,
    rank: int | None = None,
) -> list[int]:
    prompt, params = WORKLOAD[item]
    tokens: list[list[int]] = [[] for _ in range(params.n)]
    gen = llm.generate(ProcessedPrompt(None, prompt), params, rid, data_parallel_rank=rank)
    async for out in gen:
        for c in out.outputs:
            tokens[c.index] += c.token_ids
            if params.logprobs is not None:  # one entry per new token, chosen one included
                assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        on_token()
    return tokens[0] if params.n == 1 else tokens


class Load:
    """``workers`` clients, each streaming workload items back to back until stopped."""

    def __init__(self, llm: AsyncLLM, workers: int = 6) -> None:
        self.llm = llm
        self.stop = asyncio.Event()
        self.results: list[tuple[int, list[int]]] = []
        self.tokens = 0
        self.tasks = [asyncio.create_task(self._worker(w, workers)) for w in range(workers)]

    def _tick(self) -> None:
        self.tokens += 1

    async def _worker(self, w: int, workers: int) -> None:
        n = 0
        while not self.stop.is_set():
            item = (w + n * workers) % LONG
            self.results.append((item, await _run(self.llm, f"w{w}-{n}", item, self._tick)))
            n += 1

    async def finish(self) -> list[tuple[int, list[int]]]:
        self.stop.set()
        await asyncio.gather(*self.tasks)  # any stream's error fails the test here
        return self.results


def _live(llm: AsyncLLM) -> tuple[list[int], list[int]]:
    return list(llm.client.topology.engine_ids), sorted(llm.client.manager.procs)


SEQUENCE = [3, 2, 4, 1, 2]


@pytest.mark.parametrize(
    ("options", "sequence"),
    [
        pytest.param({}, SEQUENCE, id="allgather"),
        pytest.param({"all2all_backend": "all2all"}, SEQUENCE, id="all2all"),
        # Two redundant copies: a rank holds at most one copy of an expert, so 2 is the
        # smallest size; EPLB re-places the layers every 48 steps meanwhile.
        pytest.param(
            {
                "enable_eplb": True,
                "num_redundant_experts": 2,
                "eplb_interval": 48,
                "eplb_window": 48,
            },
            [3, 2, 4, 2],
            id="eplb-redundant",
        ),
    ],
)
def test_scale_sequence_under_streaming_load(qwen3_ckpt, reference, options, sequence):
    async def main() -> None:
        llm = _llm(qwen3_ckpt, 2, **options)
        try:
            load = Load(llm)
            assert await wait_until_async(lambda: len(load.results) >= 2)
            records = []
            for step, size in enumerate(sequence):
                served = load.tokens
                pinned = None
                current = llm.client.topology.size
                if size < current:  # streams on the highest rank, which leaves
                    started = [asyncio.Event(), asyncio.Event()]
                    pinned = [
                        asyncio.create_task(
                            _run(llm, f"{item}-{step}", item, ev.set, rank=current - 1)
                        )
                        for item, ev in zip((LONG, RICH), started)
                    ]
                    for ev in started:
                        await asyncio.wait_for(ev.wait(), 120)
                code, rec = await llm.scale_elastic_ep(size)
                assert (code, rec["result"]) == (200, "succeeded"), rec
                records.append(rec)
                ids, procs = _live(llm)
                assert len(ids) == size and procs == sorted(ids)  # nothing else alive
                for e in rec["joining"]:  # forked by the warm launcher, no cold imports
                    assert isinstance(llm.client.manager.procs[e], ForkedProcess)
                assert await wait_until_async(
                    lambda served=served: load.tokens > served + 20
                )  # it serves
                if pinned is not None:
                    assert await pinned[0] == reference[LONG]
                    assert await pinned[1] == reference[RICH]  # both siblings
                    assert rec["requests_migrated"] >= 1
            results = await load.finish()
            assert results, "no stream completed"
            for item, tokens in results:
                assert tokens == reference[item], f"workload item {item} changed"
            assert {r["from_size"] for r in records} >= {2}
            epochs = [r["to_epoch"] for r in records]
            assert epochs == list(range(1, len(sequence) + 1))
            downs = [r for r in records if r["to_size"] < r["from_size"]]
            assert sum(r["requests_migrated"] for r in downs) > 0  # streams moved, unharmed
            for r in records:
                # The plan moves the minimum, and the engines staged exactly that.
                assert r["bytes_moved"] == r["min_bytes"] == r["bytes_received"], r
            assert len(llm.client.request_book) == 0  # every request left the book
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_rollbacks_leave_the_old_size_serving_and_the_next_operation_works(qwen3_ckpt, reference):
    timeouts = ScaleTimeouts(transfer_s=1e-3, prepare_s=120.0)  # every transfer times out

    async def main() -> None:
        llm = _llm(qwen3_ckpt, 2, scale_timeouts=timeouts)
        try:
            load = Load(llm, workers=3)
            assert await wait_until_async(lambda: len(load.results) >= 1)

            # 1. An expert transfer that times out.
            code, rec = await llm.scale_elastic_ep(3)
            assert (code, rec["result"]) == (200, "rolled_back"), rec
            assert "timed out" in rec["cause"], rec["cause"]
            assert await wait_until_async(
                lambda: _live(llm) == ([0, 1], [0, 1])
            )  # the joiner is reaped
            llm.scale_driver.controller.timeouts = ScaleTimeouts()

            # 2. A joiner killed during prepare: after its handshake, before its PREPARE.
            client = llm.client
            send = client.send_scale

            async def kill_joiner_first(engine_ids, message):
                if isinstance(message, ScalePrepare):
                    for e in message.joining:
                        os.kill(client.manager.procs[e].pid, signal.SIGKILL)
                return await send(engine_ids, message)

            client.send_scale = kill_joiner_first
            code, rec = await llm.scale_elastic_ep(3)
            client.send_scale = send
            assert (code, rec["result"]) == (200, "rolled_back"), rec
            joiner = rec["joining"][0]
            assert f"engine {joiner}" in rec["cause"], rec["cause"]
            assert await wait_until_async(lambda: _live(llm) == ([0, 1], [0, 1]))

            # 3. A joiner that dies before its handshake.
            spawn = client.manager.spawn

            def spawn_and_kill(engine_ids, topology):
                spawn(engine_ids, topology)
                for e in engine_ids:
                    os.kill(client.manager.procs[e].pid, signal.SIGKILL)

            client.manager.spawn = spawn_and_kill
            code, rec = await llm.scale_elastic_ep(3)
            client.manager.spawn = spawn
            assert (code, rec["result"]) == (200, "rolled_back"), rec
            assert await wait_until_async(lambda: _live(llm) == ([0, 1], [0, 1]))

            # The next operation works; engine ids are never reused.
            served = load.tokens
            code, rec = await llm.scale_elastic_ep(3)
            assert (code, rec["result"]) == (200, "succeeded"), rec
            assert rec["joining"][0] > joiner
            ids, procs = _live(llm)
            assert len(ids) == 3 and procs == sorted(ids)
            assert await wait_until_async(lambda: load.tokens > served + 20)
            for item, tokens in await load.finish():
                assert tokens == reference[item]
            results = [r["result"] for r in llm.scaling_history()]
            assert results == ["rolled_back"] * 3 + ["succeeded"]
        finally:
            await llm.shutdown()

    asyncio.run(main())


def _pool_threads() -> int:
    """Threads of asyncio's default executor (``to_thread``): created on demand up to its
    fixed ``max_workers`` and reused, so their number is bounded, not exact."""
    return sum(t.name.startswith("asyncio_") for t in threading.enumerate())


def _usage(pid: int) -> dict[str, object]:
    p = psutil.Process(pid)
    pool = _pool_threads() if pid == os.getpid() else 0
    return {
        "children": sorted(c.pid for c in p.children(recursive=True)),
        "threads": p.num_threads() - pool,
        "fds": p.num_fds(),
        "listening": sorted(
            (c.laddr.ip, c.laddr.port) for c in p.net_connections("inet") if c.status == "LISTEN"
        ),
    }


async def _steady_usage(*pids: int) -> list[dict[str, object]]:
    """Each process's ``_usage`` once two reads 0.2 s apart agree (up to 30 s): peers close
    their ends of an operation's connections, and its threads end, on their own schedule;
    a leak stays in both reads."""
    deadline = asyncio.get_running_loop().time() + 30
    last = [_usage(p) for p in pids]
    while True:
        await asyncio.sleep(0.2)  # the sampling interval
        now = [_usage(p) for p in pids]
        if now == last or asyncio.get_running_loop().time() > deadline:
            return now
        last = now


CYCLES = 5  # after the warm one


def test_six_cycles_leak_nothing(qwen3_ckpt):
    async def main() -> None:
        llm = _llm(qwen3_ckpt, 2)
        me = os.getpid()
        try:
            assert [await _run(llm, "warm", 0)]

            async def cycle() -> None:
                for size in (3, 2):
                    code, rec = await llm.scale_elastic_ep(size)
                    assert (code, rec["result"]) == (200, "succeeded"), rec
                await _run(llm, f"c{len(llm.scaling_history())}", 1)

            await cycle()  # warm: the first operation creates the driver and its threads
            survivor = llm.client.manager.procs[0].pid
            front, engine = await _steady_usage(me, survivor)
            engines = _live(llm)[0]
            rss = psutil.Process(me).memory_info().rss
            # Counted exactly: a thread, descriptor or port left per cycle shows after one.
            for _ in range(CYCLES):
                await cycle()
            after_front, after_engine = await _steady_usage(me, survivor)
            # Same number of processes (the engines' pids change: new joiners each cycle).
            assert len(after_front["children"]) == len(front["children"])
            for key in ("threads", "fds"):
                assert after_front[key] == front[key], (key, front[key], after_front[key])
                assert after_engine[key] == engine[key], (key, engine[key], after_engine[key])
            # The frontend hosts one TCPStore, the served epoch's (a fresh port per epoch).
            assert len(after_front["listening"]) == len(front["listening"]) == 1
            # The engine's gloo groups listen for their peers: new groups, new ports, as many.
            assert len(after_engine["listening"]) == len(engine["listening"])
            assert _pool_threads() <= min(32, (os.cpu_count() or 1) + 4)  # asyncio's bound
            assert len(_live(llm)[0]) == len(engines) == 2
            grown = psutil.Process(me).memory_info().rss - rss
            assert grown < 64 * 2**20, (
                f"frontend RSS grew {grown / 2**20:.0f} MiB in {CYCLES} cycles"
            )
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_a_client_started_after_another_on_the_same_event_loop_serves(qwen3_ckpt, reference):
    """The relaunch peer of benchmarks/elastic.py: shut a deployment down and start the
    next on the same loop. The first client's sockets must leave the loop's selector, or
    the second's reader (same fd numbers) never wakes."""

    async def main() -> None:
        for round_ in range(2):
            llm = _llm(qwen3_ckpt, 2)
            try:
                runs = [_run(llm, f"r{round_}-{i}", i) for i in range(2)]
                got = await asyncio.wait_for(asyncio.gather(*runs), 60)
                assert got == reference[:2]
            finally:
                await llm.shutdown()

    asyncio.run(main())


def test_latent_cache_model_migrates_on_scale_down(tiny_ckpt):
    """DeepSeek-V3 (MLA: a latent KV cache; shared experts, which never move): 2 -> 1 with
    a long greedy stream pinned on the leaving rank, then 1 -> 2. The migrated stream
    recomputes its prompt and output into the survivor's latent cache and ends as an
    unscaled engine's does."""
    ckpt = tiny_ckpt("deepseek_v3")
    prompt, params = WORKLOAD[LONG]
    ref = LLM(ckpt, dtype="float32")
    try:
        (out,) = ref.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        want = out.outputs[0].token_ids
    finally:
        ref.shutdown()

    async def main() -> None:
        llm = _llm(ckpt, 2)
        try:
            started = asyncio.Event()
            pinned = asyncio.create_task(_run(llm, "long", LONG, started.set, rank=1))
            await asyncio.wait_for(started.wait(), 120)
            code, rec = await llm.scale_elastic_ep(1)
            assert (code, rec["result"]) == (200, "succeeded"), rec
            assert rec["requests_migrated"] >= 1
            assert await pinned == want
            code, rec = await llm.scale_elastic_ep(2)
            assert (code, rec["result"]) == (200, "succeeded"), rec
            assert await _run(llm, "after", LONG, rank=1) == want  # the joiner serves it
        finally:
            await llm.shutdown()

    asyncio.run(main())
