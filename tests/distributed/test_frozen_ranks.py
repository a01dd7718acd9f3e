"""Ranks that stop without dying (docs/architecture.md#faults), with real processes, under streaming load,
on a data-parallel deployment *without* ``--enable-elastic-ep`` (rank recovery is the
default):

- an engine frozen with SIGSTOP for good: its heartbeats stop, the frontend SIGKILLs it
  (the survivors blocked in a collective with it get out at once) and recovers as for a
  death; every stream completes with the tokens of an undisturbed run;
- an engine whose busy loop is stuck inside a step while its threads still beat (a
  test-only fault): the step-progress watchdog finds it;
- a request pinned (``data_parallel_rank``) to a dead rank gets ``RankUnavailableError``
  (HTTP 503), never a socket error;
- a request with ``prompt_logprobs`` whose rank dies mid-prefill returns every prompt
  position exactly once, equal to an undisturbed run;
- an offline engine with no peers that froze fails ``generate`` with a clear error
  instead of leaving it waiting forever.

Deadlines are generous and nothing is timed: the "within seconds" numbers are
``benchmarks/faults.py --matrix``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import threading

import psutil
import pytest

from tests.distributed.test_elastic_scale import (  # noqa: F401 - fixture
    LONG,
    RICH,
    Load,
    _run,
    reference,
)
from tests.distributed.test_rank_death import _pinned
from tests.waiting import wait_until, wait_until_async
from tidal import LLM
from tidal.frontend.async_client import AsyncMPClient
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.processor import ProcessedPrompt
from tidal.launch.engine_args import EngineArgs
from tidal.protocol.elastic import ScalePrepare
from tidal.protocol.errors import EngineDeadError, RankUnavailableError
from tidal.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)

FAULT_ENGINE = "io_fault_engine"  # this folder: the real engine + test-only faults
STALL_TIMEOUT_S = 5.0  # the watchdog's, for the stuck-loop test (a tiny model's step: ms)


def _llm(ckpt: str, size: int, *, entry_module: str | None = None, **kw) -> AsyncLLM:
    config = EngineArgs(
        model=ckpt,
        dtype="float32",
        data_parallel_size=size,
        enable_expert_parallel=True,
        **kw,
    ).create_engine_config()
    assert config.parallel.reconfigurable and not config.parallel.enable_elastic_ep
    client = AsyncMPClient(config, entry_module=entry_module)
    llm = AsyncLLM(config, client=client)
    llm.start()  # as the API server does: liveness from now on
    return llm


def _recoveries(llm: AsyncLLM) -> list[dict]:
    return [r for r in llm.scaling_history() if r["trigger"] == "recovery"]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def _recovered_without(
    llm: AsyncLLM,
    victim: int,
    load: Load,
    reference,  # noqa: F811
    pinned: list[asyncio.Task],
) -> dict:
    """The one recovery removed ``victim``; the deployment serves again; every stream
    (pinned to the victim's rank or not) equals the undisturbed run."""
    assert await wait_until_async(lambda: any(r["result"] for r in _recoveries(llm)), 180)
    (rec,) = _recoveries(llm)
    assert rec["result"] == "succeeded" and rec["dead"] == [victim], rec
    assert victim not in llm.client.topology.engine_ids and llm.client.topology.size == 2
    served = load.tokens
    assert await wait_until_async(lambda: load.tokens > served + 20)  # served again
    assert await pinned[0] == reference[LONG]
    assert await pinned[1] == reference[RICH]
    for item, tokens in await load.finish():
        assert tokens == reference[item], f"workload item {item} changed"
    (death,) = llm.fault_status()["deaths"]
    assert death["engine_id"] == victim and death["requests_migrated"] >= 2
    assert llm.fault_status()["degraded"] is None
    return death


def test_a_frozen_engine_is_killed_and_recovered_from(qwen3_ckpt, reference):  # noqa: F811
    async def main() -> None:
        llm = _llm(qwen3_ckpt, 3)
        frozen = None
        try:
            load = Load(llm, workers=4)
            assert await wait_until_async(lambda: len(load.results) >= 2)
            victim = llm.client.topology.engine_ids[1]
            pinned = await _pinned(llm, 1)
            frozen = llm.client.manager.procs[victim].pid
            os.kill(frozen, signal.SIGSTOP)  # for good: a process that never resumes
            death = await _recovered_without(llm, victim, load, reference, pinned)
            assert "heartbeat" in death["cause"], death
            assert _gone(frozen)  # SIGKILLed, not left frozen
            assert sorted(llm.client.manager.procs) == sorted(llm.client.topology.engine_ids)
        finally:
            if frozen is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(frozen, signal.SIGCONT)
            await llm.shutdown()

    asyncio.run(main())


def test_a_stuck_busy_loop_is_found_by_the_watchdog(qwen3_ckpt, reference):  # noqa: F811
    async def main() -> None:
        llm = _llm(qwen3_ckpt, 3, entry_module=FAULT_ENGINE, engine_stall_timeout=STALL_TIMEOUT_S)
        try:
            load = Load(llm, workers=4)
            assert await wait_until_async(lambda: len(load.results) >= 2)
            victim = llm.client.topology.engine_ids[1]
            pinned = await _pinned(llm, 1)
            pid = llm.client.manager.procs[victim].pid
            # Its busy loop sleeps inside an iteration for good; its threads keep beating,
            # and the other ranks wait for it in their collectives (not stuck themselves).
            stall = asyncio.create_task(llm.client.call_utility_async("stall", engine=victim))
            death = await _recovered_without(llm, victim, load, reference, pinned)
            assert "stuck" in death["cause"], death
            assert _gone(pid)
            with pytest.raises(EngineDeadError):  # its caller is told, not left waiting
                await asyncio.wait_for(stall, 60)
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_a_request_pinned_to_a_dead_rank_gets_rank_unavailable(qwen3_ckpt, reference):  # noqa: F811
    async def main() -> None:
        llm = _llm(qwen3_ckpt, 3)
        client = llm.client
        release = asyncio.Event()
        send = client.send_scale

        async def hold_the_recovery(engine_ids, message):  # the dead rank stays a member
            if isinstance(message, ScalePrepare) and message.dead:
                await release.wait()
            return await send(engine_ids, message)

        client.send_scale = hold_the_recovery
        try:
            assert await _run(llm, "warm", 0, rank=1) == reference[0]
            victim = client.topology.engine_ids[1]
            os.kill(client.manager.procs[victim].pid, signal.SIGKILL)
            assert await wait_until_async(lambda: victim in client.router.gone)
            assert client.topology.engine_ids[1] == victim  # not recovered yet
            with pytest.raises(RankUnavailableError, match="data_parallel_rank 1"):
                await _run(llm, "pinned-to-the-dead", 0, rank=1)
            # Unpinned requests, and requests pinned to live ranks, are taken (and served
            # once the recovery rebuilt the groups the dead rank broke).
            others = [
                asyncio.create_task(_run(llm, "anywhere", 1)),
                asyncio.create_task(_run(llm, "pinned-alive", 2, rank=2)),
            ]
            release.set()
            assert await asyncio.gather(*others) == reference[1:3]
            assert await wait_until_async(lambda: any(r["result"] for r in _recoveries(llm)))
            assert client.topology.size == 2
            assert await _run(llm, "after", 3, rank=1) == reference[3]  # rank 1: a live one
        finally:
            release.set()
            await llm.shutdown()

    asyncio.run(main())


def test_prompt_logprobs_of_a_request_moved_mid_prefill_are_complete(qwen3_ckpt):
    # Chunked prefill, 8 prompt tokens a step: a 400-token prompt takes 50 steps.
    prompt = [(7 * i) % 500 + 3 for i in range(400)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    with LLM(qwen3_ckpt, dtype="float32") as ref_llm:
        (want,) = ref_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)

    async def main() -> None:
        llm = _llm(qwen3_ckpt, 2, max_num_batched_tokens=8)
        try:
            victim = llm.client.topology.engine_ids[1]
            got = None
            tokens: list[int] = []
            positions = 0  # prompt logprob positions streamed before the kill
            gen = llm.generate(ProcessedPrompt(None, prompt), params, "p", data_parallel_rank=1)
            async for out in gen:
                if out.prompt_logprobs is not None and got is None:
                    positions = len(out.prompt_logprobs)
                    if positions < len(prompt):  # mid-prefill: some returned, not all
                        os.kill(llm.client.manager.procs[victim].pid, signal.SIGKILL)
                    got = out
                for c in out.outputs:
                    tokens += c.token_ids
            assert 1 < positions < len(prompt)
            assert llm.client.request_book.resumed_mid_prefill == 1, "killed after prefill"
            # DELTA outputs carry the prompt logprobs once, in full, as the engine sends
            # them in chunks; the frontend holds them until the request's first output:
            # what matters is the final list.
            assert tokens == want.outputs[0].token_ids
            lps = got.prompt_logprobs
            assert len(lps) == len(want.prompt_logprobs) == len(prompt)
            assert lps[0] is None and want.prompt_logprobs[0] is None
            for mine, theirs in zip(lps[1:], want.prompt_logprobs[1:]):
                assert mine.keys() == theirs.keys()
                for tok in mine:
                    assert math.isclose(mine[tok].logprob, theirs[tok].logprob, abs_tol=1e-4)
            assert await wait_until_async(lambda: any(r["result"] for r in _recoveries(llm)))
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_an_offline_engine_that_froze_fails_generate_instead_of_hanging(qwen3_ckpt):
    """One engine, nothing to recover with: a frozen one fails the client with a clear
    error (and is killed) instead of leaving ``generate`` waiting forever."""
    llm = LLM(qwen3_ckpt, dtype="float32", multiprocess=True)
    try:
        (engine,) = llm.client.manager.procs.values()
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        outcome: list[BaseException] = []

        def generate() -> None:
            try:
                llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
            except BaseException as e:  # noqa: BLE001 - what the caller sees
                outcome.append(e)

        thread = threading.Thread(target=generate)
        thread.start()
        assert wait_until(lambda: llm.output_processor.has_unfinished())
        os.kill(engine.pid, signal.SIGSTOP)
        thread.join(180)
        assert not thread.is_alive(), "generate hung on a frozen engine"
        (err,) = outcome
        assert isinstance(err, EngineDeadError) and "heartbeat" in str(err)
        assert wait_until(lambda: _gone(engine.pid))
    finally:
        llm.shutdown()
