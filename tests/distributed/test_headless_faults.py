"""Liveness of headless ranks (DESIGN.md 6.5), with real processes over loopback TCP:

- a headless rank killed with SIGKILL under streaming load: the frontend sees its
  heartbeats stop (no process sentinel across hosts), the recovery operation removes it,
  its requests migrate, and every stream completes with the tokens of an undisturbed run;
- the frontend of a headless rank killed with SIGKILL: the rank hears no heartbeat and
  exits by itself, releasing its ports.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.distributed.headless import start_with_headless, stop_processes
from tests.distributed.test_elastic_scale import (  # noqa: F401 - fixture
    LONG,
    RICH,
    Load,
    _run,
    reference,
)
from tests.waiting import wait_until, wait_until_async
from tidal.distributed.ports import get_open_port
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.proc_manager import spawn_headless_engines
from tidal.launch.engine_args import EngineArgs
from tidal.protocol.messages import FRONTEND_TIMEOUT_S

pytestmark = pytest.mark.timeout(600)

SECRET = "headless-faults-secret-0123456789"


def _config(path: str, rpc: int, size: int, local: int):
    return EngineArgs(
        model=path,
        dtype="float32",
        data_parallel_size=size,
        data_parallel_size_local=local,
        data_parallel_address="127.0.0.1",
        data_parallel_rpc_port=rpc,
        data_parallel_auth_key=SECRET,
        enable_expert_parallel=True,
        enable_elastic_ep=True,
    ).create_engine_config()


def _deployment(path: str, size: int, local: int):
    return start_with_headless(lambda rpc: _config(path, rpc, size, local), AsyncLLM, local)


def test_killed_headless_rank_is_found_by_heartbeat_and_recovered(qwen3_ckpt, reference):  # noqa: F811
    async def main() -> None:
        llm, headless = _deployment(qwen3_ckpt, 3, 2)
        try:
            remote = llm.client.topology.engine_ids[2]
            assert remote not in llm.client.manager.procs  # no sentinel for it here
            load = Load(llm, workers=4)
            assert await wait_until_async(lambda: len(load.results) >= 2)
            started = [asyncio.Event(), asyncio.Event()]
            pinned = [
                asyncio.create_task(_run(llm, f"pinned-{item}", item, ev.set, rank=2))
                for item, ev in zip((LONG, RICH), started)
            ]
            for ev in started:
                await asyncio.wait_for(ev.wait(), 120)
            (proc,) = headless
            os.kill(proc.pid, signal.SIGKILL)
            controller = llm.scale_driver.controller
            assert await wait_until_async(
                lambda: any(d["recovered_at"] for d in controller.faults()["deaths"]),
                timeout_s=120,
            )
            (death,) = controller.faults()["deaths"]
            assert death["engine_id"] == remote and "heartbeat" in death["cause"]
            assert death["requests_migrated"] >= 2
            assert llm.client.topology.engine_ids == [0, 1]
            served = load.tokens
            assert await wait_until_async(lambda: load.tokens > served + 20)
            assert await pinned[0] == reference[LONG]
            assert await pinned[1] == reference[RICH]
            for item, tokens in await load.finish():
                assert tokens == reference[item], f"workload item {item} changed"
        finally:
            await llm.shutdown()
            stop_processes(headless)

    asyncio.run(main())


_FRONTEND = textwrap.dedent(
    """
    import asyncio, sys
    from tidal.frontend.async_llm import AsyncLLM
    from tidal.frontend.processor import ProcessedPrompt
    from tidal.launch.engine_args import EngineArgs
    from tidal.sampling_params import SamplingParams

    path, rpc, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    config = EngineArgs(
        model=path, dtype="float32", data_parallel_size=2, data_parallel_size_local=1,
        data_parallel_address="127.0.0.1", data_parallel_rpc_port=rpc,
        data_parallel_auth_key=secret, enable_expert_parallel=True, enable_elastic_ep=True,
    ).create_engine_config()

    async def main():
        llm = AsyncLLM(config)
        llm.start()  # as the API server does at startup: heartbeats from now on
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for rank in (0, 1):
            async for _ in llm.generate(ProcessedPrompt(None, [5, 6, 7]), params, f"r{rank}",
                                        data_parallel_rank=rank):
                pass
        print("served", flush=True)
        await asyncio.Event().wait()  # until killed

    asyncio.run(main())
    """
)


def test_headless_rank_exits_when_its_frontend_is_killed(qwen3_ckpt):
    rpc = get_open_port()
    config = _config(qwen3_ckpt, rpc, 2, 1)
    headless = spawn_headless_engines(
        config.with_parallel(data_parallel_start_rank=1), f"tcp://127.0.0.1:{rpc}"
    )
    front = subprocess.Popen(
        [sys.executable, "-c", _FRONTEND, qwen3_ckpt, str(rpc), SECRET],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert front.stdout.readline().strip() == "served"  # heartbeats are flowing
        (proc,) = headless
        engine = psutil.Process(proc.pid)
        ports = {c.laddr.port for c in engine.net_connections("inet") if c.status == "LISTEN"}
        frontend_children = psutil.Process(front.pid).children(recursive=True)
        front.kill()
        front.wait(30)
        # No sentinel, no parent to lose: only the missing heartbeats tell the rank.
        assert wait_until(lambda: not proc.is_alive(), timeout_s=FRONTEND_TIMEOUT_S + 60)
        proc.join(10)
        assert wait_until(
            lambda: (
                not any(
                    p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in frontend_children
                )
            )
        )
        listening = {c.laddr.port for c in psutil.net_connections("inet") if c.status == "LISTEN"}
        assert not ports & listening
    finally:
        if front.poll() is None:
            front.kill()
            front.wait(30)
        stop_processes(headless)
