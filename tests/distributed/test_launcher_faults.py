"""The processes around the engines, killed (docs/architecture.md#faults), with real processes:

- the warm launcher (``EngineZygote``) killed after a scale-up: the engine it forked keeps
  serving (it watches the frontend, not its parent), the deployment's private ipc
  directory stays, ``/stats`` answers, a new zygote is running within seconds, and the next
  scale-up works (forked by it);
- the deployment shut down while a scale-up starts its engine: that engine is stopped
  too, and nothing is left running;
- the offline ``LLM`` survives a rank death as the server does (with elastic EP, and with
  rank recovery alone).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import psutil
import pytest

from tests.distributed.test_elastic_scale import (  # noqa: F401 - fixture
    LONG,
    WORKLOAD,
    Load,
    _live,
    _llm,
    _run,
    _tokens,
    reference,
)
from tests.distributed.test_rank_death import _no_children_left, _streaming
from tests.waiting import wait_until, wait_until_async
from tidal import LLM
from tidal.frontend.launchers import mp as mp_launcher
from tidal.frontend.launchers import proc_manager
from tidal.protocol.errors import EngineDeadError
from tidal.utils.forkserver import ForkedProcess

pytestmark = pytest.mark.timeout(600)


def test_a_killed_zygote_is_replaced_and_its_engines_keep_serving(
    qwen3_ckpt,
    reference,  # noqa: F811
):
    async def main() -> None:
        llm = _llm(qwen3_ckpt, 2)
        manager = llm.client.manager
        try:
            load = Load(llm, workers=3)
            assert await wait_until_async(lambda: len(load.results) >= 1)
            assert await wait_until_async(lambda: manager.zygote.ready)
            code, rec = await llm.scale_elastic_ep(3)
            assert (code, rec["result"]) == (200, "succeeded"), rec
            (forked,) = rec["joining"]
            assert isinstance(manager.procs[forked], ForkedProcess)
            long = asyncio.create_task(_run(llm, "on-the-forked", LONG, rank=2))
            old = manager.zygote
            os.kill(old.pid, signal.SIGKILL)
            # Within seconds in practice; the deadline is generous (loaded CI).
            assert await wait_until_async(
                lambda: manager.zygote is not old and manager.zygote.ready
            )
            assert manager.zygote_restarts == 1
            assert manager.procs[forked].is_alive() and os.path.isdir(llm.client.ipc_dir)
            stats = await llm.get_stats()  # the coordinator's sockets are where they were
            assert [r["engine_id"] for r in stats["ranks"]] == [0, 1, forked]
            assert await long == reference[LONG]  # served by the orphaned fork throughout
            code, rec = await llm.scale_elastic_ep(4)
            assert (code, rec["result"]) == (200, "succeeded"), rec
            (second,) = rec["joining"]
            assert isinstance(manager.procs[second], ForkedProcess)  # the new zygote's
            for item, tokens in await load.finish():
                assert tokens == reference[item], f"workload item {item} changed"
            ids, procs = _live(llm)
            assert ids == procs == [0, 1, forked, second]
        finally:
            await llm.shutdown()
        assert wait_until(_no_children_left)

    asyncio.run(main())


def test_an_engine_started_while_the_deployment_shuts_down_is_stopped(qwen3_ckpt, monkeypatch):
    """The joiner's process is created after shutdown took its list of engines."""
    managers: list[proc_manager.EngineProcManager] = []
    started: list[int] = []
    spawn_engine = mp_launcher.spawn_engine

    def late_spawn(*args, **kwargs):
        # Held until the manager is shutting down: its list of engines is taken.
        assert wait_until(lambda: managers[0]._shutting_down, 60)
        proc = spawn_engine(*args, **kwargs)
        started.append(proc.pid)
        return proc

    monkeypatch.setattr(mp_launcher, "spawn_engine", late_spawn)

    async def main() -> None:
        llm = _llm(qwen3_ckpt, 2)
        managers.append(llm.client.manager)
        assert await wait_until_async(lambda: llm.client.manager.zygote.ready)
        scale = asyncio.create_task(llm.scale_elastic_ep(3))
        assert await wait_until_async(lambda: llm.is_scaling_elastic_ep())
        await llm.shutdown()
        with pytest.raises(EngineDeadError):
            await scale

    asyncio.run(main())
    assert wait_until(_no_children_left)
    # Forked (the zygote was still up) or not, nothing it started runs on.
    for pid in started:
        assert wait_until(lambda pid=pid: not _running(pid))


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("elastic", [True, False], ids=["elastic", "recovery-only"])
def test_the_offline_llm_survives_a_rank_death(qwen3_ckpt, reference, elastic):  # noqa: F811
    llm = LLM(
        qwen3_ckpt,
        dtype="float32",
        data_parallel_size=3,
        enable_expert_parallel=True,
        enable_elastic_ep=elastic,
    )
    try:
        client = llm.client
        victim = client.topology.engine_ids[1]
        pid = client.manager.procs[victim].pid

        def kill_once_streaming() -> None:  # mid-generate: some outputs are in
            assert wait_until(lambda: _streaming(client), 120)
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_streaming)
        killer.start()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p, _ in WORKLOAD],
            [params for _, params in WORKLOAD],
            use_tqdm=False,
        )
        killer.join(60)
        for i, out in enumerate(outs):
            assert _tokens(out.outputs) == reference[i], f"workload item {i} changed"
        faults = client.fault_status()
        assert faults["rank_deaths"] == 1 and faults["recovered"] == 1, faults
        assert victim not in client.topology.engine_ids and client.topology.size == 2
        again = llm.generate([{"prompt_token_ids": WORKLOAD[0][0]}], WORKLOAD[0][1], use_tqdm=False)
        assert again[0].outputs[0].token_ids == reference[0]
    finally:
        llm.shutdown()
    assert wait_until(_no_children_left)
