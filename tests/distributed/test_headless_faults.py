"""Liveness of headless ranks (docs/architecture.md#faults), with real processes over loopback TCP:

- a headless rank killed with SIGKILL under streaming load: the frontend sees its
  heartbeats stop (no process sentinel across hosts), the recovery operation removes it,
  its requests migrate, and every stream completes with the tokens of an undisturbed run;
- a headless rank frozen with SIGSTOP (a paused VM): nothing here can kill it, and its
  peers wait for it in their collectives -- the recovery's PREPARE aborts those, so they
  get out at once instead of at gloo's collective timeout (300 s);
- a whole host lost (a ``launch --headless`` launcher and its two ranks, SIGKILL), with
  and without ``--enable-elastic-ep``: both ranks are removed by one recovery operation,
  no request is lost;
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
from typing import Any

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
from tests.distributed.test_rank_death import _no_children_left, _pinned
from tests.waiting import wait_until, wait_until_async
from tidal.distributed.ports import get_open_port
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.launchers.mp import spawn_headless_engines
from tidal.launch.engine_args import EngineArgs

pytestmark = pytest.mark.timeout(600)

SECRET = "headless-faults-secret-0123456789"
# --frontend-timeout of the headless ranks the tests wait to see leave (its default is 10 s).
FRONTEND_TIMEOUT = 4.0


def _config(path: str, rpc: int, size: int, local: int, **extra: Any):
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
        **extra,
    ).create_engine_config()


def _deployment(path: str, size: int, local: int, **extra: Any):
    return start_with_headless(
        lambda rpc: _config(path, rpc, size, local, **extra), _started, local
    )


def _started(config) -> AsyncLLM:
    llm = AsyncLLM(config)
    llm.start()  # as the API server does at startup: liveness from now on
    return llm


def _recoveries(llm: AsyncLLM) -> list[dict]:
    return [r for r in llm.scaling_history() if r["trigger"] == "recovery"]


async def _complete(
    llm: AsyncLLM,
    load: Load,
    pinned: list[asyncio.Task],
    reference,  # noqa: F811
) -> None:
    """Served again, and every stream equals the undisturbed run (nothing lost)."""
    served = load.tokens
    assert await wait_until_async(lambda: load.tokens > served + 20)
    assert await pinned[0] == reference[LONG]
    assert await pinned[1] == reference[RICH]
    for item, tokens in await load.finish():
        assert tokens == reference[item], f"workload item {item} changed"


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


def test_frozen_headless_rank_is_recovered_and_its_peers_get_out_of_their_collectives(
    qwen3_ckpt,
    reference,  # noqa: F811
):
    async def main() -> None:
        llm, headless = _deployment(qwen3_ckpt, 3, 2, frontend_timeout=FRONTEND_TIMEOUT)
        (proc,) = headless
        try:
            remote = llm.client.topology.engine_ids[2]
            load = Load(llm, workers=4)
            assert await wait_until_async(lambda: len(load.results) >= 2)
            pinned = await _pinned(llm, 2)
            os.kill(proc.pid, signal.SIGSTOP)  # a paused VM: its sockets stay open
            # Far below gloo's 300 s collective timeout that would otherwise hold the
            # survivors: the recovery's PREPARE aborts their collectives.
            assert await wait_until_async(
                lambda: any(r["result"] for r in _recoveries(llm)), timeout_s=120
            )
            (rec,) = _recoveries(llm)
            assert rec["result"] == "succeeded" and rec["dead"] == [remote], rec
            assert "heartbeat" in llm.fault_status()["deaths"][0]["cause"]
            await _complete(llm, load, pinned, reference)
            os.kill(proc.pid, signal.SIGCONT)
            # Resumed, it is a former member: nobody beats for it, and it leaves.
            assert await wait_until_async(
                lambda: not proc.is_alive(), timeout_s=FRONTEND_TIMEOUT + 60
            )
        finally:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
            await llm.shutdown()
            stop_processes(headless)

    asyncio.run(main())


def _host(path: str, rpc: int, elastic: bool) -> subprocess.Popen:
    """``launch --headless`` on "another host": ranks 1 and 2 of DP=3."""
    flags = [
        "--model", path, "--dtype", "float32", "--dp", "3",
        "--data-parallel-size-local", "2", "--data-parallel-start-rank", "1",
        "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc),
        "--ep", "--headless",
    ] + (["--enable-elastic-ep"] if elastic else [])  # fmt: skip
    env = {**os.environ, "TIDAL_DP_AUTH_KEY": SECRET}
    return subprocess.Popen([sys.executable, "-m", "tidal.launch.spawn", *flags], env=env)


@pytest.mark.parametrize("elastic", [True, False], ids=["elastic", "default"])
def test_a_lost_host_is_recovered_by_one_operation(qwen3_ckpt, reference, elastic):  # noqa: F811
    async def main() -> None:
        rpc = get_open_port()
        host = _host(qwen3_ckpt, rpc, elastic)
        llm = None
        try:
            config = EngineArgs(
                model=qwen3_ckpt,
                dtype="float32",
                data_parallel_size=3,
                data_parallel_size_local=1,
                data_parallel_address="127.0.0.1",
                data_parallel_rpc_port=rpc,
                data_parallel_auth_key=SECRET,
                enable_expert_parallel=True,
                enable_elastic_ep=elastic,
            ).create_engine_config()
            llm = _started(config)
            assert llm.client.topology.engine_ids == [0, 1, 2]
            load = Load(llm, workers=4)
            assert await wait_until_async(lambda: len(load.results) >= 2)
            pinned = await _pinned(llm, 2)
            # The host goes: its launcher and both its ranks at once.
            ranks = psutil.Process(host.pid).children(recursive=True)
            assert len(ranks) == 2
            for p in [psutil.Process(host.pid), *ranks]:
                p.kill()
            assert await wait_until_async(
                lambda: any(r["result"] for r in _recoveries(llm)), timeout_s=120
            )
            await _complete(llm, load, pinned, reference)
            (rec,) = _recoveries(llm)  # one operation for both ranks
            assert rec["result"] == "succeeded" and rec["dead"] == [1, 2], rec
            assert llm.client.topology.engine_ids == [0]
            assert llm.fault_status()["rank_deaths"] == 2
            assert llm.fault_status()["degraded"] is None
            host.wait(30)
        finally:
            if llm is not None:
                await llm.shutdown()
            if host.poll() is None:
                host.kill()
                host.wait(30)
        assert wait_until(_no_children_left)

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
    config = _config(qwen3_ckpt, rpc, 2, 1, frontend_timeout=FRONTEND_TIMEOUT)
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
        assert wait_until(lambda: not proc.is_alive(), timeout_s=FRONTEND_TIMEOUT + 60)
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
