"""``launch --dp 2 --ep --enable-elastic-ep --data-parallel-backend ray`` on a multi-node Ray
cluster on this machine (``conftest.RayCluster``: one CPU per node, so each rank takes a
node of its own; docs/architecture.md#launchers).

One server, one cluster, in order:

1. The two launch ranks run on two nodes (``/stats`` ``ranks[].node`` = their Ray node ids,
   ``ranks[].pid`` their engine processes) and answer greedy requests exactly as one
   rank does (an in-process DP=1 engine on the same checkpoint).
2. 2 -> 3 with no free node: the placement group waits out its deadline, the operation
   rolls back naming the missing CPU, the deployment keeps serving at 2.
3. A node is added; under streaming load 2 -> 3 puts the new rank on it (through the
   rank started ahead there: ``--ray-warm-ranks 1``); no stream is lost or changed.
4. That node is removed under load: its rank dies, the deployment recovers without it
   (docs/architecture.md#faults), no stream is lost or changed, and new requests are served.
5. After shutdown every Ray resource is free, no actor or placement group is left, and no
   engine process runs.
"""

from __future__ import annotations

import signal

import httpx
import psutil
import pytest

from tests.e2e.server_utils import RemoteServer, StreamingLoad
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["The tide comes in", "Experts route tokens", "A ship sails at dawn"]
MAX_TOKENS = 24


def _complete(url: str, prompt: str, **extra) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _ranks(url: str) -> list[dict]:
    """``/stats`` ranks; none while they cannot be read (a recovery replaces them)."""
    return httpx.get(url + "/stats", timeout=60).json().get("ranks", [])


def _worker_nodes() -> set[str]:
    """Ray node ids of the live nodes with a CPU (the head has none)."""
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0}


def _ray_leftovers() -> dict[str, object]:
    """What of the deployment is left on the cluster: CPUs in use, live actors, groups."""
    import ray
    from ray.util.placement_group import placement_group_table

    groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
    actors = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
    used = ray.cluster_resources().get("CPU", 0.0) - ray.available_resources().get("CPU", 0.0)
    return {"cpus_in_use": used, "actors": len(actors), "groups": len(groups)}


@pytest.fixture(scope="module")
def dp1_reference(qwen3_ckpt) -> dict[str, str]:
    """Greedy text of each prompt from one in-process engine (DP=1)."""
    from tidal import LLM, SamplingParams

    llm = LLM(qwen3_ckpt, dtype="float32", multiprocess=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


def test_ray_deployment_places_scales_recovers_and_frees(ray_cluster, qwen3_ckpt, dp1_reference):
    srv = RemoteServer(
        [
            "--model",
            qwen3_ckpt,
            "--dp",
            "2",
            "--ep",
            "--enable-elastic-ep",
            "--data-parallel-backend",
            "ray",
            "--ray-address",
            ray_cluster.address,
            "--ray-placement-timeout-s",
            "5",
            "--ray-warm-ranks",
            "1",
            "--dtype",
            "float32",
            "--log-level",
            "warning",
        ]
    )
    pids: set[int] = set()
    load: StreamingLoad | None = None
    try:
        # 1. Two ranks on two nodes, numbered node by node; greedy output as DP=1's.
        ranks = _ranks(srv.url)
        assert [r["engine_id"] for r in ranks] == [0, 1]
        nodes = [r["node"] for r in ranks]
        assert len(set(nodes)) == 2 and set(nodes) <= _worker_nodes(), (nodes, _worker_nodes())
        for r in ranks:
            pids.add(r["pid"])
            assert psutil.Process(r["pid"]).name().startswith("EngineCore_DP"), r
        for prompt, want in dp1_reference.items():
            for rank in (0, 1):
                assert _complete(srv.url, prompt, data_parallel_rank=rank) == want, (prompt, rank)

        # 2. No free node: the scale-up rolls back naming the missing CPU; still serving.
        r = httpx.post(
            srv.url + "/scale_elastic_ep", json={"new_data_parallel_size": 3}, timeout=300
        )
        assert r.status_code == 500, r.text
        record = r.json()["operation"]
        assert record["result"] == "rolled_back", record
        assert "placement group" in record["cause"] and "CPU 1 (free 0" in record["cause"], record
        assert [x["engine_id"] for x in _ranks(srv.url)] == [0, 1]
        assert _complete(srv.url, PROMPTS[0]) == dp1_reference[PROMPTS[0]]

        # 3. A node joins; under load 2 -> 3 puts the new rank there; nothing lost.
        new_node = ray_cluster.add_node()
        # The rank started ahead takes the new node: its actor is up (3 actors live).
        assert wait_until(lambda: _ray_leftovers()["actors"] == 3, 120), _ray_leftovers()
        load = StreamingLoad(srv.url, PROMPTS, MAX_TOKENS)
        assert load.more(), load.errors
        r = httpx.post(
            srv.url + "/scale_elastic_ep", json={"new_data_parallel_size": 3}, timeout=300
        )
        assert r.status_code == 200, (r.text, srv.output[-4000:])
        assert (r.json()["result"], r.json()["joining"]) == ("succeeded", [3]), r.json()
        ranks = _ranks(srv.url)
        assert [x["engine_id"] for x in ranks] == [0, 1, 3]  # engine 2 was rolled back
        assert ranks[2]["node"] == new_node, (ranks, new_node)
        pids.add(ranks[2]["pid"])
        # Forked by that rank's warm launcher (imports done ahead), not a cold start.
        assert psutil.Process(ranks[2]["pid"]).parent().name() == "EngineZygote"
        assert load.more(), load.errors

        # 4. The new node is lost under load: its rank's death is recovered from, no
        # stream is lost, new requests are served.
        ray_cluster.remove_node(new_node)
        assert wait_until(lambda: [x["engine_id"] for x in _ranks(srv.url)] == [0, 1], 120), _ranks(
            srv.url
        )
        assert _complete(srv.url, PROMPTS[1]) == dp1_reference[PROMPTS[1]]
        assert load.more(), load.errors
        results = load.finish()
        assert load.errors == [], load.errors
        for i, out in results:
            assert (out.completion_tokens, out.finish_reason) == (MAX_TOKENS, "length"), out
            assert out.text == dp1_reference[PROMPTS[i]], (i, out, srv.output[-3000:])
    finally:
        if load is not None:
            load.stop.set()
        code = srv.stop()
    # Drained and stopped, then ended by the SIGTERM it was sent (uvicorn raises it again
    # after its graceful shutdown, as for the mp backend), not by an error.
    assert code in (0, -signal.SIGTERM), srv.output[-4000:]
    assert srv.leftover_processes() == []

    # 5. Nothing of the deployment is left on the cluster or the machine.
    empty = {"cpus_in_use": 0.0, "actors": 0, "groups": 0}
    assert wait_until(lambda: _ray_leftovers() == empty, 60), _ray_leftovers()
    assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 60), pids
