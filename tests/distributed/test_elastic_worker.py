"""The worker side of elastic EP on real processes (gloo, 127.0.0.1): standby groups on a
store the test hosts (as the frontend does), expert transfers peer to peer and from disk,
the swap and the install; afterwards every rank's EP forward equals a single-process run
of the full model (the reference of tests/distributed/test_ep_model.py).

- 2 -> 3: engines 0 and 1 serve EP=2 and keep serving (forwards on the old groups) while
  their helper threads join the standby groups and transfer; engine 2 starts as a joiner
  (non-expert weights only) and gets its experts from them.
- 2 -> 1: the leaving engine sends its experts to the survivor, one of them is read from
  disk instead (a spec without a source); the survivor then serves alone.
- a rendezvous with a member that never comes fails within its timeout and leaves no group.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
from torch.distributed import TCPStore

from tests.distributed.test_ep_model import (
    ATOL,
    DUMMY,
    NUM_BLOCKS,
    _capture_logits,
    _config,
    _requests,
    _sched,
    _script,
    _single,
)

EPOCH = 1
TIMEOUT_S = 60.0
NUM_EXPERTS = 8


def _store() -> TCPStore:
    """The standby store, hosted here as the frontend hosts it (port 0: any free port)."""
    return TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip


def _reference(cfg):
    from tidal.executor.model_runner import ModelRunner

    ref = ModelRunner(_single(cfg), torch.device("cpu"))
    ref.load_model()
    ref.initialize_kv_cache(NUM_BLOCKS)
    return ref


def _check_weights(worker, ref, layout: list[list[int]], rank: int) -> None:
    """Every MoE layer holds exactly its row of ``layout``, with the checkpoint's weights,
    and its dispatcher / EPLB placement is the layout's."""
    runner = worker.model_runner
    for moe, full in zip(runner.model.moe_layers(), ref.model.moe_layers()):
        assert moe.local_expert_ids == layout[rank]
        got, want = moe.read_weights(["w13", "w2"]), full.read_weights(["w13", "w2"])
        assert got["w13"].shape[0] == len(layout[rank])
        for slot, e in enumerate(layout[rank]):
            assert torch.equal(got["w13"][slot], want["w13"][e]), (slot, e)
            assert torch.equal(got["w2"][slot], want["w2"][e]), (slot, e)
        assert moe.dispatcher.placement.ep_size == len(layout)
        assert moe.dispatcher.placement.local_expert_ids(rank) == layout[rank]
    assert runner.placement.local_expert_ids(rank) == layout[rank]
    assert all(p == runner.placement for p in runner.eplb.placements)


def _forward_matches_reference(worker, ref, rank: int, world: int) -> list[list[int]]:
    """The EP forward script of test_ep_model on the (new) groups; logits and greedy tokens
    equal the reference's. Returns the outputs."""
    cfg = worker.config
    runner = worker.model_runner
    ep_logits, ref_logits = _capture_logits(runner), _capture_logits(ref)
    reqs = _requests(rank, cfg.model.hf_config.vocab_size)
    for step in _script(rank, world):
        if step is DUMMY:
            worker.model_runner.execute_dummy_batch()
            continue
        sched = _sched(step, reqs)
        got, want = worker.model_runner.execute_model(sched), ref.execute_model(sched)
        assert got.sampled_token_ids == want.sampled_token_ids, (got, want)
        for sr in sched.scheduled:
            sr.request.num_computed_tokens += sr.num_new_tokens
            for tok in got.sampled_token_ids.get(sr.request.request_id, []):
                sr.request.append_output_token(tok)
    assert len(ep_logits) == len(ref_logits) > 0
    for g, w in zip(ep_logits, ref_logits):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=1e-5)
    assert runner.moe_context.num_tokens_across_dp is not None
    assert len(runner.moe_context.num_tokens_across_dp) == world
    return [r.output_token_ids for r in reqs]


class _Helper(threading.Thread):
    """Runs one call on a helper thread (like the engine's ElasticShell); ``result()``."""

    def __init__(self, fn, *args) -> None:
        super().__init__(daemon=True)
        self.fn, self.args = fn, args
        self.value = self.error = None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self.error = e

    def result(self, timeout: float = TIMEOUT_S):
        self.join(timeout)
        assert not self.is_alive(), f"{self.fn.__name__} still running after {timeout} s"
        if self.error is not None:
            raise self.error
        return self.value


def _serve_while(worker, helper: _Helper, min_steps: int = 2) -> int:
    """A survivor's busy loop during prepare: dummy EP forwards on the current groups
    until the helper is done (at least ``min_steps``; both survivors must run the same
    count, so they agree on it over the current DP group each step)."""
    steps = 0
    while True:
        worker.model_runner.execute_dummy_batch()
        steps += 1
        busy = int(helper.is_alive() or steps < min_steps)
        if not worker.all_reduce_dp([busy], op="max")[0]:
            return steps


# ---------------------------------------------------------------------- 2 -> 3


def _scale_up_rank(rank: int, world: int, port: int, path: str, store_addr: str, plan: dict):
    from tidal.executor.worker import Worker

    engine_id, new_topology = rank, plan["topology"]
    layout, specs = new_topology.placement, plan["specs"]
    joiner = rank == 2
    if joiner:
        cfg = _config(path, 2, 3, port, all2all_backend="all2all")
        worker = Worker(cfg, dist_timeout_s=TIMEOUT_S)
        worker.elastic.init_joiner(new_topology, engine_id)
        # A joiner allocates its KV cache before it has any group.
        worker.initialize_kv_cache(min(NUM_BLOCKS, worker.model_runner.determine_num_blocks()))
        moe = worker.model_runner.model.moe_layers()[0]
        assert moe.local_expert_ids == layout[2]
        assert not moe.read_weights(["w13"])["w13"].any()
    else:
        cfg = _config(path, rank, 2, port, all2all_backend="all2all")
        worker = Worker(cfg, dist_timeout_s=TIMEOUT_S)
        worker.init_distributed()
        worker.load_model()
        worker.initialize_kv_cache(NUM_BLOCKS)
    ref = _reference(cfg)
    old = (worker.dp_group, worker.ep_group)
    sends = [s for s in specs if s.src_engine_id == engine_id]
    receives = [s for s in specs if s.dst_engine_id == engine_id]

    join = _Helper(
        worker.elastic.join_standby, EPOCH, store_addr, [0, 1, 2], [0, 1, 2], engine_id, TIMEOUT_S
    )
    join.start()
    served = 0 if joiner else _serve_while(worker, join)
    join.result()
    worker.elastic.pack_expert_sends(EPOCH, sends)  # busy-loop thread
    transfer = _Helper(
        worker.elastic.transfer_experts, EPOCH, sends, receives, engine_id, TIMEOUT_S
    )
    transfer.start()
    served += 0 if joiner else _serve_while(worker, transfer)
    nbytes = transfer.result()

    # Commit at one step: new members post the barrier, survivors swap then post it.
    if joiner:
        wave_step = worker.elastic.standby_barrier(EPOCH, 0, 0)
        worker.elastic.swap_groups(EPOCH)
    else:
        worker.elastic.swap_groups(EPOCH)
        wave_step = worker.elastic.standby_barrier(EPOCH, 3 + rank, 10 * (rank + 1))
    worker.elastic.install_experts(EPOCH, layout, rank)
    worker.elastic.destroy_retired_groups()
    if not joiner:
        assert all(g.is_destroyed for g in old)
    assert worker.dp_group.world_size == worker.ep_group.world_size == 3
    assert worker.dp_group.rank == rank
    _check_weights(worker, ref, layout, rank)
    outputs = _forward_matches_reference(worker, ref, rank, 3)
    groups = (worker.dp_group, worker.ep_group)
    worker.shutdown()
    assert all(g.is_destroyed for g in groups)
    assert worker.elastic.standby_epochs() == []
    return {"bytes": nbytes, "wave_step": wave_step, "served": served, "outputs": outputs}


def test_scale_up_2_to_3_joiner_gets_experts_from_peers(run_ranks_on_ports, qwen3_ckpt):
    from tidal.elastic.plan import expert_nbytes, plan_scale
    from tidal.protocol.topology import Topology

    hf = _hf_config(qwen3_ckpt)  # every layer is MoE; float32 weights
    per_expert = expert_nbytes(hf.hidden_size, hf.moe_intermediate_size, hf.num_hidden_layers, 4)
    plan = plan_scale(Topology.initial(2), 3, NUM_EXPERTS, bytes_per_expert=per_expert)
    specs = plan.transfer_specs()
    assert specs and all(s.src_engine_id is not None for s in specs)
    store = _store()
    addr = f"127.0.0.1:{store.port}"
    args = {"topology": plan.new_topology, "specs": specs}
    results = run_ranks_on_ports(_scale_up_rank, 3, qwen3_ckpt, addr, args, timeout_s=180)
    for engine, res in enumerate(results):
        received = [s for s in specs if s.dst_engine_id == engine]
        assert res["bytes"] == sum(s.nbytes for s in received)
        assert res["wave_step"] == (4, 20)  # MAX over the new members
        assert all(len(out) >= 3 for out in res["outputs"])
    assert results[0]["served"] >= 4 and results[0]["served"] == results[1]["served"]
    assert results[2]["bytes"] > 0


def _hf_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


# ---------------------------------------------------------------------- 2 -> 1


def _scale_down_rank(rank: int, world: int, port: int, path: str, store_addr: str, plan: dict):
    from tidal.executor.worker import Worker

    engine_id, layout, specs = rank, plan["layout"], plan["specs"]
    cfg = _config(path, rank, 2, port, all2all_backend="allgather_reducescatter")
    worker = Worker(cfg, dist_timeout_s=TIMEOUT_S)
    worker.init_distributed()
    worker.load_model()
    worker.initialize_kv_cache(NUM_BLOCKS)
    old = (worker.dp_group, worker.ep_group)
    sends = [s for s in specs if s.src_engine_id == engine_id]
    receives = [s for s in specs if s.dst_engine_id == engine_id]
    members = [0]  # engine 1 leaves: a participant only (the transfer group)

    join = _Helper(
        worker.elastic.join_standby, EPOCH, store_addr, members, [0, 1], engine_id, TIMEOUT_S
    )
    join.start()
    _serve_while(worker, join)
    join.result()
    worker.elastic.pack_expert_sends(EPOCH, sends)
    transfer = _Helper(
        worker.elastic.transfer_experts, EPOCH, sends, receives, engine_id, TIMEOUT_S
    )
    transfer.start()
    _serve_while(worker, transfer)
    nbytes = transfer.result()
    # The commit step: both still agree on it over the old DP group.
    worker.all_reduce_dp([1])
    if rank == 1:
        worker.elastic.leave_groups()  # the transfer group goes with the current ones
        assert worker.elastic.standby_epochs() == []
        worker.elastic.destroy_standby(EPOCH)
        worker.elastic.discard_staged(EPOCH)
        assert all(g.is_destroyed for g in old)
        assert worker.dp_group is None and worker.model_runner.ep_group is None
        assert worker.elastic.standby_epochs() == []
        worker.shutdown()
        return {"bytes": nbytes}
    worker.elastic.swap_groups(EPOCH)
    assert worker.elastic.standby_barrier(EPOCH, 7, 9) == (7, 9)
    worker.elastic.install_experts(EPOCH, layout, 0)
    worker.elastic.destroy_retired_groups()
    assert all(g.is_destroyed for g in old)
    ref = _reference(cfg)
    _check_weights(worker, ref, layout, 0)
    outputs = _forward_matches_reference(worker, ref, 0, 1)
    worker.shutdown()
    return {"bytes": nbytes, "outputs": outputs}


def test_scale_down_2_to_1_leaving_engine_sends_its_experts(run_ranks_on_ports, qwen3_ckpt):
    import msgspec

    from tidal.elastic.plan import plan_scale
    from tidal.protocol.topology import Topology

    plan = plan_scale(Topology.initial(2), 1, NUM_EXPERTS, bytes_per_expert=1)
    specs = plan.transfer_specs()
    assert sorted(s.expert for s in specs) == [4, 5, 6, 7]  # engine 1's experts
    assert all(s.src_engine_id == 1 and s.dst_engine_id == 0 for s in specs)
    # One of them comes from disk (no live source) instead.
    specs[1] = msgspec.structs.replace(specs[1], src_engine_id=None, src_slot=-1)
    store = _store()
    args = {"layout": plan.new_topology.placement, "specs": specs}
    addr = f"127.0.0.1:{store.port}"
    results = run_ranks_on_ports(_scale_down_rank, 2, qwen3_ckpt, addr, args, timeout_s=180)
    assert plan.new_topology.placement == [list(range(NUM_EXPERTS))]
    assert results[1]["bytes"] == 0  # the leaving engine receives nothing
    assert results[0]["bytes"] > 0
    assert all(len(out) >= 3 for out in results[0]["outputs"])


# ---------------------------------------------------------------------- failure


def test_join_standby_without_a_member_times_out_and_leaves_nothing(qwen3_ckpt):
    from tidal.executor.worker import Worker

    store = _store()
    cfg = _config(qwen3_ckpt, 0, 2, store.port)
    worker = Worker(cfg, dist_timeout_s=TIMEOUT_S)
    addr = f"127.0.0.1:{store.port}"
    # Our deadline, naming the engine that never came (not gloo's, minutes later).
    with pytest.raises(TimeoutError, match=r"standby rendezvous of epoch \d+ timed out .*\[1\]"):
        worker.elastic.join_standby(EPOCH, addr, [0, 1], [0, 1], 0, 3.0)
    assert worker.elastic.standby_epochs() == []
    with pytest.raises(RuntimeError, match="no standby DP group"):
        worker.elastic.swap_groups(EPOCH)
    with pytest.raises(RuntimeError, match="no DP group"):
        worker.elastic.standby_barrier(EPOCH, 0, 0)
    # Cleanup calls are idempotent and need no peer.
    worker.elastic.destroy_standby(EPOCH)
    worker.elastic.discard_staged(EPOCH)
    worker.elastic.destroy_retired_groups()
    worker.shutdown()
