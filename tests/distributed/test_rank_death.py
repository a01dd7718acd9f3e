"""A rank killed with SIGKILL under streaming load is an emergency scale-down
(DESIGN.md 6.5): the survivors abandon the step whose collective failed, the frontend's
recovery operation rebuilds the groups without the dead rank, its requests migrate as
resumed requests, and every stream completes with the tokens of an undisturbed run.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.distributed.test_elastic_scale import (  # noqa: F401 - fixture
    LONG,
    RICH,
    Load,
    _live,
    _llm,
    _run,
    reference,
)
from tests.waiting import wait_until_async

pytestmark = pytest.mark.timeout(600)


def _recoveries(llm) -> list[dict]:
    return [r for r in llm.scaling_history() if r["trigger"] == "recovery"]


@pytest.mark.parametrize(
    "options",
    [pytest.param({}, id="allgather"), pytest.param({"all2all_backend": "all2all"}, id="all2all")],
)
def test_kill_one_rank_of_three_under_streaming_load(qwen3_ckpt, reference, options):  # noqa: F811
    async def main() -> None:
        llm = _llm(qwen3_ckpt, 3, **options)
        try:
            load = Load(llm)
            assert await wait_until_async(lambda: len(load.results) >= 2)
            victim = llm.client.topology.engine_ids[1]  # a middle rank
            started = [asyncio.Event(), asyncio.Event()]
            pinned = [
                asyncio.create_task(_run(llm, f"pinned-{item}", item, ev.set, rank=1))
                for item, ev in zip((LONG, RICH), started)
            ]
            for ev in started:
                await asyncio.wait_for(ev.wait(), 120)
            os.kill(llm.client.manager.procs[victim].pid, signal.SIGKILL)
            assert await wait_until_async(
                lambda: any(r["result"] for r in _recoveries(llm)), timeout_s=120
            )
            (rec,) = _recoveries(llm)
            assert rec["result"] == "succeeded", rec
            assert rec["dead"] == [victim] and rec["to_size"] == 2
            ids, procs = _live(llm)
            assert victim not in ids and len(ids) == 2 and procs == sorted(ids)
            served = load.tokens
            assert await wait_until_async(lambda: load.tokens > served + 20)  # it serves
            assert await pinned[0] == reference[LONG]
            assert await pinned[1] == reference[RICH]
            for item, tokens in await load.finish():
                assert tokens == reference[item], f"workload item {item} changed"
            faults = llm.scale_driver.controller.faults()
            assert faults["rank_deaths"] == 1 and faults["recovered"] == 1
            (death,) = faults["deaths"]
            assert death["engine_id"] == victim and death["requests_migrated"] >= 2
            assert faults["degraded"] is None
            assert len(llm.client.request_book) == 0
        finally:
            await llm.shutdown()

    asyncio.run(main())
