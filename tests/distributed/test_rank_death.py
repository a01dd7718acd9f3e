"""A rank killed with SIGKILL under streaming load is an emergency scale-down
(docs/architecture.md#faults): the survivors abandon the step whose collective failed, the frontend's
recovery operation rebuilds the groups without the dead rank, its requests migrate as
resumed requests, and every stream completes with the tokens of an undisturbed run.
With ``elastic_restore`` a scale-up then brings the deployment back to its size. A rank
dying in the middle of a scale operation rolls that back first. Where nothing can serve
(every rank dead), every request fails with a clear error instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading

import psutil
import pytest

from tests.distributed.test_elastic_scale import (  # noqa: F401 - fixture
    LONG,
    RICH,
    WORKLOAD,
    Load,
    _live,
    _llm,
    _run,
    _tokens,
    reference,
)
from tests.waiting import wait_until, wait_until_async
from tidal import LLM
from tidal.protocol.elastic import ScaleCommit, ScalePrepare
from tidal.protocol.errors import EngineDeadError

pytestmark = pytest.mark.timeout(600)


def _records(llm, trigger: str) -> list[dict]:
    return [r for r in llm.scaling_history() if r["trigger"] == trigger]


def _kill(llm, engine_id: int) -> None:
    os.kill(llm.client.manager.procs[engine_id].pid, signal.SIGKILL)


async def _pinned(llm, rank: int) -> list[asyncio.Task]:
    """The long greedy stream and the n=2 seeded one on ``rank``, once both streamed."""
    started = [asyncio.Event(), asyncio.Event()]
    tasks = [
        asyncio.create_task(_run(llm, f"pinned-{item}", item, ev.set, rank=rank))
        for item, ev in zip((LONG, RICH), started)
    ]
    for ev in started:
        await asyncio.wait_for(ev.wait(), 120)
    return tasks


@contextlib.contextmanager
def _on_send(llm, hook):
    """Call ``hook(message, engine_ids)`` before each SCALE message the frontend sends."""
    client = llm.client
    send = client.send_scale

    async def hooked(engine_ids, message):
        hook(message, engine_ids)
        return await send(engine_ids, message)

    client.send_scale = hooked
    try:
        yield
    finally:
        client.send_scale = send


def _streaming(client) -> bool:
    """Some outputs are in (read from another thread: a changing book is retried)."""
    book = client.request_book
    try:
        return any(book.outputs(r) for r in list(book.ownership.requests()))
    except (RuntimeError, KeyError):
        return False


def _no_children_left() -> bool:
    procs = [p for p in psutil.Process().children(recursive=True) if p.is_running()]
    return all(
        p.status() == psutil.STATUS_ZOMBIE or "resource_tracker" in " ".join(p.cmdline())
        for p in procs
    )


@pytest.mark.parametrize(
    ("options", "restore"),
    [
        # The allgather dispatcher runs with the restore after it (the same checks up to
        # the recovery, then the scale-up back): a third case without it only cost CI time.
        pytest.param({"all2all_backend": "all2all"}, False, id="all2all"),
        pytest.param({}, True, id="allgather-restore"),
    ],
)
def test_kill_one_rank_of_three_under_streaming_load(qwen3_ckpt, reference, options, restore):  # noqa: F811
    async def main() -> None:
        llm = _llm(qwen3_ckpt, 3, elastic_restore=restore, **options)
        try:
            load = Load(llm)
            assert await wait_until_async(lambda: len(load.results) >= 2)
            victim = llm.client.topology.engine_ids[1]  # a middle rank
            pinned = await _pinned(llm, 1)
            _kill(llm, victim)
            assert await wait_until_async(
                lambda: any(r["result"] for r in _records(llm, "recovery"))
            )
            (rec,) = _records(llm, "recovery")
            assert rec["result"] == "succeeded", rec
            assert rec["dead"] == [victim] and rec["to_size"] == 2
            served = load.tokens
            assert await wait_until_async(lambda: load.tokens > served + 20)  # it serves
            if restore:  # back to 3 by the normal scale-up path: a new engine joins
                assert await wait_until_async(
                    lambda: any(r["result"] for r in _records(llm, "restore"))
                )
                (back,) = _records(llm, "restore")
                assert back["result"] == "succeeded" and back["to_size"] == 3, back
                assert len(back["joining"]) == 1 and victim not in back["joining"]
            ids, procs = _live(llm)
            assert victim not in ids and len(ids) == (3 if restore else 2)
            assert procs == sorted(ids)  # nothing else alive
            assert await pinned[0] == reference[LONG]
            assert await pinned[1] == reference[RICH]
            for item, tokens in await load.finish():
                assert tokens == reference[item], f"workload item {item} changed"
            faults = llm.fault_status()
            assert faults["rank_deaths"] == 1 and faults["recovered"] == 1
            (death,) = faults["deaths"]
            assert death["engine_id"] == victim and death["requests_migrated"] >= 2
            assert faults["degraded"] is None and faults["serving_engines"] == len(ids)
            assert len(llm.client.request_book) == 0
        finally:
            await llm.shutdown()
        assert wait_until(_no_children_left)

    asyncio.run(main())


def test_rank_dying_during_a_scale_up_rolls_it_back_then_recovers(qwen3_ckpt, reference):  # noqa: F811
    async def main() -> None:
        llm = _llm(qwen3_ckpt, 2)
        try:
            load = Load(llm, workers=4)
            assert await wait_until_async(lambda: len(load.results) >= 2)

            def kill_survivor(message, engine_ids) -> None:
                if isinstance(message, ScalePrepare) and not message.dead:
                    _kill(llm, 1)  # a survivor of the scale-up, mid-operation

            with _on_send(llm, kill_survivor):
                code, rec = await llm.scale_elastic_ep(3)
            assert (code, rec["result"]) == (200, "rolled_back"), rec
            assert "engine 1" in rec["cause"], rec["cause"]
            assert await wait_until_async(
                lambda: any(r["result"] for r in _records(llm, "recovery"))
            )
            (recovery,) = _records(llm, "recovery")
            assert recovery["result"] == "succeeded" and recovery["dead"] == [1], recovery
            assert _live(llm) == ([0], [0])
            served = load.tokens
            assert await wait_until_async(lambda: load.tokens > served + 20)
            for item, tokens in await load.finish():
                assert tokens == reference[item], f"workload item {item} changed"
            # And the deployment grows again by a plain scale call.
            code, rec = await llm.scale_elastic_ep(2)
            assert (code, rec["result"]) == (200, "succeeded"), rec
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_staying_rank_dying_during_a_scale_down_moves_its_streams_to_the_draining_one(
    qwen3_ckpt,
    reference,  # noqa: F811
):
    """2 -> 1: engine 1 leaves (drains, excluded from routing), engine 0 stays and is
    killed with streams in flight, as the PREPARE goes out. The scale-down rolls back, so
    engine 1 serves again; engine 0's streams move there only once it does, and complete
    unchanged (moved before, each failed: "every DP rank is draining"). Then the
    recovery removes engine 0. (The same death during COMMITTING: the unit tests.)"""

    async def main() -> None:
        llm = _llm(qwen3_ckpt, 2)
        try:
            pinned = await _pinned(llm, 0)  # streaming on the rank that stays

            def kill_staying(message, engine_ids) -> None:
                if isinstance(message, ScalePrepare) and message.operation_id == "down":
                    _kill(llm, 0)  # the scale-down's message only, not the recovery's

            with _on_send(llm, kill_staying):
                code, rec = await llm.scale_elastic_ep(1, 30.0, "down")
            assert (code, rec["result"]) == (200, "rolled_back"), rec
            assert rec["leaving"] == [1] and "engine" in rec["cause"], rec
            assert await pinned[0] == reference[LONG]
            assert await pinned[1] == reference[RICH]
            assert await wait_until_async(
                lambda: any(r["result"] for r in _records(llm, "recovery"))
            )
            (recovery,) = _records(llm, "recovery")
            assert recovery["result"] == "succeeded" and recovery["dead"] == [0], recovery
            assert _live(llm) == ([1], [1])
            (death,) = llm.fault_status()["deaths"]
            assert death["engine_id"] == 0 and death["requests_migrated"] >= 2  # they moved
            assert await _run(llm, "after", 0) == reference[0]  # engine 1 serves
            assert len(llm.client.request_book) == 0
        finally:
            await llm.shutdown()
        assert wait_until(_no_children_left)

    asyncio.run(main())


def test_joiner_dying_after_prepared_is_a_death_of_the_new_epoch(qwen3_ckpt, reference):  # noqa: F811
    """The survivors decide the commit alone (their all-reduce); a joiner killed once it
    reported PREPARED fails their first collective on the new group. The commit stands,
    the broken survivors wait, and the recovery removes the joiner (engine state race 4)."""

    async def main() -> None:
        llm = _llm(qwen3_ckpt, 2)
        try:
            load = Load(llm, workers=4)
            assert await wait_until_async(lambda: len(load.results) >= 2)

            def kill_joiner(message, engine_ids) -> None:
                if isinstance(message, ScaleCommit):
                    for e in set(engine_ids) - {0, 1}:
                        _kill(llm, e)

            with _on_send(llm, kill_joiner):
                code, rec = await llm.scale_elastic_ep(3)
            (joiner,) = rec["joining"]
            # Committed (the survivors' consensus) or, had the death reached them before
            # the flag, rolled back: either way no engine is left stuck.
            assert rec["result"] in ("succeeded", "rolled_back"), rec
            if rec["result"] == "succeeded":
                assert await wait_until_async(
                    lambda: any(r["result"] for r in _records(llm, "recovery"))
                )
                (recovery,) = _records(llm, "recovery")
                assert recovery["result"] == "succeeded" and recovery["dead"] == [joiner]
            assert await wait_until_async(lambda: _live(llm) == ([0, 1], [0, 1]))
            served = load.tokens
            assert await wait_until_async(lambda: load.tokens > served + 20)
            for item, tokens in await load.finish():
                assert tokens == reference[item], f"workload item {item} changed"
            assert llm.fault_status()["degraded"] is None
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_every_rank_dead_fails_every_request_with_a_clear_error(qwen3_ckpt):
    async def main() -> None:
        llm = _llm(qwen3_ckpt, 2)
        try:
            load = Load(llm, workers=4)
            assert await wait_until_async(lambda: len(load.results) >= 1)
            for e in list(llm.client.topology.engine_ids):
                _kill(llm, e)
            with pytest.raises(EngineDeadError, match="engine"):
                await load.finish()  # the first stream's error; no stream hangs
            assert await wait_until_async(lambda: all(t.done() for t in load.tasks))
            assert llm.is_dead and "engine" in llm.dead_reason
            assert llm.fault_status()["serving_engines"] == 0
            with pytest.raises(EngineDeadError):
                await _run(llm, "after", 0)
        finally:
            await llm.shutdown()
        assert wait_until(_no_children_left)

    asyncio.run(main())


@pytest.mark.parametrize("recovery", [True, False], ids=["recovers", "no-rank-recovery"])
def test_offline_llm_fails_over_as_the_server_does(qwen3_ckpt, reference, recovery):  # noqa: F811
    """The offline ``LLM`` (DP=2, real processes) runs the server's engine client: a rank
    SIGKILLed mid-``generate`` is recovered from as in
    ``test_kill_one_rank_of_three_under_streaming_load`` -- every output equals the
    undisturbed run's -- and, with ``rank_recovery=False``, fails ``generate`` with
    ``EngineDeadError`` as it fails the server's streams."""
    llm = LLM(
        qwen3_ckpt,
        dtype="float32",
        data_parallel_size=2,
        enable_expert_parallel=True,
        rank_recovery=recovery,
    )
    try:
        client = llm.client
        victim = client.topology.engine_ids[1]
        pid = client.manager.procs[victim].pid

        def kill_once_streaming() -> None:  # mid-generate: some outputs are in
            if recovery:  # only then is there a request book to watch
                assert wait_until(lambda: _streaming(client), 120)
            else:
                assert wait_until(lambda: client.dp.wave.running, 120)
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_streaming)
        killer.start()
        prompts = [{"prompt_token_ids": p} for p, _ in WORKLOAD]
        params = [sp for _, sp in WORKLOAD]
        if not recovery:
            with pytest.raises(EngineDeadError, match="engine"):
                llm.generate(prompts, params, use_tqdm=False)
            killer.join(60)
            assert client.dead_reason is not None
            with pytest.raises(EngineDeadError):
                llm.generate(prompts[:1], params[:1], use_tqdm=False)
            return
        outs = llm.generate(prompts, params, use_tqdm=False)
        killer.join(60)
        for i, out in enumerate(outs):
            assert _tokens(out.outputs) == reference[i], f"workload item {i} changed"
        faults = client.fault_status()
        assert faults["rank_deaths"] == 1 and faults["recovered"] == 1, faults
        (death,) = faults["deaths"]
        assert death["engine_id"] == victim and death["requests_migrated"] >= 1
        assert client.topology.engine_ids == [0] and len(client.request_book) == 0
        again = llm.generate(prompts[:1], params[:1], use_tqdm=False)
        assert again[0].outputs[0].token_ids == reference[0]
    finally:
        llm.shutdown()
    assert wait_until(_no_children_left)
