"""The DP coordinator killed with SIGKILL under streaming load (docs/architecture.md#faults): the
frontend sees it gone and starts a new one on the same addresses; meanwhile requests keep
being served (wake-ups go straight to the engines), the new one rebuilds its table from
the engines' next stats, and every stream completes with the tokens of an undisturbed run.
"""

from __future__ import annotations

import asyncio
import os
import signal

import psutil
import pytest

from tests.distributed.test_elastic_scale import Load, _llm, reference  # noqa: F401
from tests.waiting import wait_until_async

pytestmark = pytest.mark.timeout(600)


def test_killed_coordinator_is_restarted_and_serving_goes_on(qwen3_ckpt, reference):  # noqa: F811
    async def main() -> None:
        llm = _llm(qwen3_ckpt, 2)
        try:
            coordinator = llm.client.coordinator
            load = Load(llm, workers=4)
            assert await wait_until_async(lambda: len(load.results) >= 2)
            old = coordinator.proc.pid
            os.kill(old, signal.SIGKILL)
            completed = len(load.results)
            # Served while it is down or coming back: streams keep completing.
            assert await wait_until_async(lambda: len(load.results) >= completed + 4)
            assert await wait_until_async(lambda: coordinator.restarts == 1)
            assert coordinator.is_alive() and coordinator.proc.pid != old
            assert not psutil.pid_exists(old) or psutil.Process(old).status() == "zombie"

            async def rebuilt() -> bool:
                try:
                    stats = await llm.client.get_dp_stats_async(timeout_s=5.0)
                except TimeoutError:
                    return False  # the new coordinator's sockets still connecting
                return stats.num_engines == 2 and all(r.requests_total > 0 for r in stats.ranks)

            deadline = asyncio.get_running_loop().time() + 120
            while not await rebuilt():  # the new table fills from the engines' stats
                assert asyncio.get_running_loop().time() < deadline, "table not rebuilt"
                await asyncio.sleep(0.2)
            served = len(load.results)
            assert await wait_until_async(lambda: len(load.results) >= served + 4)
            for item, tokens in await load.finish():
                assert tokens == reference[item], f"workload item {item} changed"
            assert llm.fault_status()["coordinator_restarts"] == 1
            assert llm.dead_reason is None
        finally:
            await llm.shutdown()

    asyncio.run(main())
