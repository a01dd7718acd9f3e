"""The live size is the topology's (docs/architecture.md#elastic-identity).

- ``enable_elastic_ep`` at DP=1: the DP machinery (coordinator process, wave loop, DP
  client, a one-rank process group) runs with a single engine, and it serves exactly what
  the plain engine and transformers produce.
- The startup handshake hands each engine the topology; an engine whose id is not in it
  refuses to start with an error naming the flags (and says so to the frontend).
"""

from __future__ import annotations

import os
import threading

import msgspec
import pytest
import zmq

from tests.e2e.test_offline_parity import _hf_greedy, _prompts
from tests.waiting import wait_until
from tidal import LLM, SamplingParams
from tidal.dp_coordinator.handle import fetch_stats
from tidal.engine_core.proc import EngineCoreProc
from tidal.launch.engine_args import EngineArgs
from tidal.protocol.errors import EngineStartupError
from tidal.protocol.messages import EngineAddresses, EngineHello, EngineReady, encode
from tidal.protocol.topology import Topology

MAX_TOKENS = 12


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    # min_tokens masks EOS exactly like transformers' min_new_tokens does.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts_and_expected(qwen3_ckpt):
    from transformers import AutoConfig

    prompts = _prompts(AutoConfig.from_pretrained(qwen3_ckpt).vocab_size)
    hf = _hf_greedy(qwen3_ckpt, prompts, MAX_TOKENS)
    plain = LLM(qwen3_ckpt, dtype="float32", multiprocess=True)  # DP=1, no flag: no DP machinery
    try:
        assert plain.client.coordinator is None and plain.client.dp is None
        assert _greedy(plain, prompts) == hf
    finally:
        plain.shutdown()
    return prompts, hf


@pytest.mark.parametrize("ep", [pytest.param(False, id="dp1"), pytest.param(True, id="dp1-ep1")])
def test_elastic_ep_at_dp1_runs_waves_and_serves_the_same(qwen3_ckpt, prompts_and_expected, ep):
    prompts, expected = prompts_and_expected
    llm = LLM(qwen3_ckpt, dtype="float32", enable_elastic_ep=True, enable_expert_parallel=ep)
    client = llm.client
    try:
        # The DP machinery runs: a coordinator process, the DP client state, and the one
        # engine is a DP rank of a one-engine topology.
        assert client.coordinator is not None and client.coordinator.proc.is_alive()
        assert client.dp is not None
        assert client.topology == Topology.initial(1, store_address=client.topology.store_address)
        assert client.topology.store_address  # its one-rank groups have a TCPStore
        state = client.call_utility_on(0, "dp_state")
        assert (state["rank"], state["engine_id"], state["epoch"], state["dp_size"]) == (
            0,
            0,
            0,
            1,
        )

        assert _greedy(llm, prompts) == expected

        # A wave ran and ended: the engine stepped dummy batches until its all-reduce (over
        # its one-rank DP group) found it idle, and the coordinator recorded the end.
        def wave_done() -> bool:
            st = fetch_stats(client.coordinator.addresses.stats, timeout_s=10)
            return st.waves_completed >= 1 and not st.running

        assert wait_until(wave_done, timeout_s=60.0), fetch_stats(
            client.coordinator.addresses.stats
        )
        stats = fetch_stats(client.coordinator.addresses.stats, timeout_s=10)
        assert stats.num_engines == 1 and stats.epoch == 0
        assert [r.engine_id for r in stats.ranks] == [0]
        assert stats.ranks[0].requests_total == len(prompts)
        state = client.call_utility_on(0, "dp_state")
        assert state["wave"] >= 1 and not state["running"]
        assert state["dummy_batches"] >= 1
        # And it keeps serving in the next wave.
        assert _greedy(llm, prompts[:2]) == expected[:2]
    finally:
        llm.shutdown()


def test_engine_outside_the_topology_fails_fast(qwen3_ckpt, tmp_path):
    """A frontend whose topology does not hold the engine's id (a wrong
    --data-parallel-start-rank on a host): the engine refuses at the handshake, before it
    loads anything, names the flags, and reports the error in READY."""
    config = EngineArgs(
        model=qwen3_ckpt, dtype="float32", data_parallel_size=2, enable_elastic_ep=True
    ).create_engine_config()
    address = f"ipc://{tmp_path}/handshake"
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    front.bind(address)
    errors: list[BaseException] = []

    def engine() -> None:
        try:
            EngineCoreProc(config.with_parallel(data_parallel_rank=1), 5, address)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    try:
        assert front.poll(30_000), "no HELLO"
        ident, payload = front.recv_multipart()
        hello = msgspec.msgpack.decode(payload, type=EngineHello)
        assert hello.engine_id == 5 and hello.pid == os.getpid()
        topology = Topology.initial(2)
        front.send_multipart(
            [
                ident,
                encode(
                    EngineAddresses(
                        "ipc://in", "ipc://out", None, None, config.config_hash(), topology
                    )
                ),
            ]
        )
        assert front.poll(30_000), "no READY(error)"
        _, payload = front.recv_multipart()
        ready = msgspec.msgpack.decode(payload, type=EngineReady)
        thread.join(30)
        assert not thread.is_alive()
    finally:
        front.close(0)
        ctx.destroy(linger=0)
    assert ready.engine_id == 5 and ready.num_blocks == 0
    assert "engine 5 is not in the deployment" in ready.error
    assert "engines [0, 1]" in ready.error and "--data-parallel-start-rank" in ready.error
    assert len(errors) == 1 and isinstance(errors[0], EngineStartupError)
    assert str(errors[0]) == ready.error
