"""Tensor parallelism inside elastic EP ranks, end to end (``--dp 2 -tp 2 --ep
--enable-elastic-ep``: every rank an engine process and two worker processes, gloo):

- 2 -> 3 -> 2 -> 3 -> 2 under streaming load, EPLB re-placing experts meanwhile, the
  experts held only in a packed CPU layout (sends and moves rebuild them from it): every
  stream completes with the greedy and seeded tokens of an unscaled TP=1 DP=1 run, the leaving rank's streams migrate, the new
  topology's engines and exactly their workers are alive after each operation, and the
  cycles leak no process, /dev/shm segment or socket directory;
- kill -9 of one worker of a rank: that rank dies as a whole (its other worker and its
  engine exit), the recovery removes it, its requests migrate, none is lost or changed,
  and new requests are served;
- kill -9 of the frontend: its engines and their workers exit on their own and leave no
  /dev/shm segment.

``/stats`` shows each rank's TP size and its processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests.distributed.test_elastic_scale import (  # noqa: F401 - fixture
    LONG,
    RICH,
    Load,
    _llm,
    _run,
    reference,
)
from tests.distributed.test_rank_death import _no_children_left, _pinned, _records
from tests.distributed.test_shm_queue import leftover_segments
from tests.waiting import wait_until, wait_until_async
from tidal.kernels.cpu_ext import kernel_available
from tidal.kernels.onednn import onednn_available

pytestmark = pytest.mark.timeout(900)
TP = 2
# The CPU path the scaling test forces: one that packs the weights (their only copy).
PACKED = "native" if kernel_available() else "onednn" if onednn_available() else "auto"


def _segments() -> set[str]:
    return leftover_segments()


def _workers() -> dict[int, str]:
    """This test's worker processes (descendants named Worker_DP*): pid -> name."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            name = p.name()
        except psutil.NoSuchProcess:
            continue
        if name.startswith("Worker_DP"):
            out[p.pid] = name
    return out


def _check_processes(llm) -> None:
    """Exactly the topology's engines run, each with its TP workers, and /stats says so."""
    ids = list(llm.client.topology.engine_ids)
    manager = llm.client.manager
    assert sorted(manager.procs) == sorted(ids)
    pids = {pid for e in ids for pid in manager.worker_pids[e]}
    assert all(len(manager.worker_pids[e]) == TP for e in ids)
    assert wait_until(lambda: set(_workers()) == pids, 60), (_workers(), pids)


async def _check_stats(llm) -> None:
    stats = await llm.get_stats()
    assert stats["tensor_parallel_size"] == TP
    for rank in stats["ranks"]:
        assert rank["tensor_parallel_size"] == TP and len(rank["worker_pids"]) == TP
        assert rank["pid"] == llm.client.manager.procs[rank["engine_id"]].pid


async def _check_packed(llm) -> None:
    """Every rank's experts and router are held in ``PACKED``'s layout."""
    if PACKED == "auto":
        return
    ranks = (await llm.get_stats())["cpu_kernels"]
    assert len(ranks) == len(llm.client.topology.engine_ids)
    for rank in ranks:
        ops = [c for k, c in rank["ops"].items() if k.startswith(("moe[", "router["))]
        assert ops and all(c["layout"] == PACKED for c in ops), rank["ops"]


def test_tp2_ranks_scale_2_3_2_twice_under_streaming_load(qwen3_ckpt, reference):  # noqa: F811
    before = _segments()

    async def main() -> None:
        # EPLB re-places the layers over the workers every 48 steps meanwhile, with two
        # redundant copies (a worker holds at most one copy of an expert).
        # A packed CPU path holds the experts' only copy: every send, EPLB
        # move and install below goes through rebuilds of the worker's shard and re-packs.
        llm = _llm(
            qwen3_ckpt, 2, tensor_parallel_size=TP, enable_eplb=True, num_redundant_experts=2,
            eplb_interval=48, eplb_window=48, cpu_kernels=PACKED,
        )  # fmt: skip
        try:
            _check_processes(llm)
            await _check_stats(llm)
            await _check_packed(llm)
            load = Load(llm, workers=4)
            assert await wait_until_async(lambda: len(load.results) >= 2)
            migrated = 0
            for size in (3, 2, 3, 2):
                served = load.tokens
                pinned = await _pinned(llm, 2) if size == 2 else None  # on the leaving rank
                code, rec = await llm.scale_elastic_ep(size)
                assert (code, rec["result"]) == (200, "succeeded"), rec
                assert rec["bytes_moved"] == rec["min_bytes"] == rec["bytes_received"], rec
                migrated += rec["requests_migrated"]
                _check_processes(llm)
                assert await wait_until_async(lambda served=served: load.tokens > served + 20)
                if pinned is not None:
                    assert await pinned[0] == reference[LONG]
                    assert await pinned[1] == reference[RICH]
            await _check_stats(llm)
            await _check_packed(llm)
            infos = await llm.client.call_utility_all_async("get_eplb_info")
            assert any(i["num_rebalances"] for i in infos)  # experts moved between workers
            results = await load.finish()
            assert results
            for item, tokens in results:
                assert tokens == reference[item], f"workload item {item} changed"
            assert migrated >= 2
            assert _segments() <= before  # each rank's ring was unlinked once attached
        finally:
            await llm.shutdown()

    asyncio.run(main())
    assert wait_until(_no_children_left)
    assert _segments() <= before  # none new (a start removes dead engines' leftovers)


def test_kill_one_worker_of_a_tp_rank_is_that_ranks_death(qwen3_ckpt, reference):  # noqa: F811
    async def main() -> None:
        llm = _llm(qwen3_ckpt, 2, tensor_parallel_size=TP, all2all_backend="all2all")
        try:
            load = Load(llm, workers=4)
            assert await wait_until_async(lambda: len(load.results) >= 2)
            pinned = await _pinned(llm, 1)
            victim_engine = llm.client.topology.engine_ids[1]
            engine_pid = llm.client.manager.procs[victim_engine].pid
            worker, sibling = llm.client.manager.worker_pids[victim_engine]
            os.kill(sibling, signal.SIGKILL)
            assert await wait_until_async(
                lambda: any(r["result"] for r in _records(llm, "recovery"))
            )
            (rec,) = _records(llm, "recovery")
            assert rec["result"] == "succeeded" and rec["dead"] == [victim_engine], rec
            # The whole rank went: its engine and its other worker too.
            assert wait_until(lambda: not any(psutil.pid_exists(p) for p in (engine_pid, worker)))
            served = load.tokens
            assert await wait_until_async(lambda: load.tokens > served + 20)  # serves
            assert await pinned[0] == reference[LONG]
            assert await pinned[1] == reference[RICH]
            for item, tokens in await load.finish():
                assert tokens == reference[item], f"workload item {item} changed"
            assert await _run(llm, "after", 0) == reference[0]  # new requests are served
            faults = llm.fault_status()
            assert faults["rank_deaths"] == 1 and faults["recovered"] == 1
            (death,) = faults["deaths"]
            assert death["engine_id"] == victim_engine and death["requests_migrated"] >= 2
            assert len(llm.client.request_book) == 0
            _check_processes(llm)
        finally:
            await llm.shutdown()

    asyncio.run(main())
    assert wait_until(_no_children_left)


_FRONTEND = """
import sys, time
from tidal import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2, multiprocess=True)
out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
pids = [p.pid for p in llm.client.manager.procs.values()]
pids += [w for ws in llm.client.manager.worker_pids.values() for w in ws]
print(" ".join(map(str, pids)), flush=True)
time.sleep(600)
"""


def test_kill_the_frontend_and_nothing_is_left(qwen3_ckpt):
    before = _segments()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _FRONTEND, qwen3_ckpt], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1 + TP
        assert all(psutil.pid_exists(p) for p in pids)
    finally:
        proc.kill()
        proc.wait(30)
    assert wait_until(lambda: not any(_alive(p) for p in pids), 120), [p for p in pids if _alive(p)]
    assert _segments() <= before  # none new (a start removes dead engines' leftovers)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
