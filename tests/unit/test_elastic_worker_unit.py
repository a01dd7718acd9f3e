"""The worker side of elastic EP in one process (tidal/executor/elastic.py): the loader's
expert options, a joiner's startup, the launch placement taken from the topology, and a
transfer between two workers on threads over real gloo groups (an expert held in only
some layers of the sender, the others from disk), barrier, swap and install."""

from __future__ import annotations

import datetime
import glob
import json
import logging
import os
import shutil
import threading

import pytest
import torch
from torch.distributed import TCPStore

from tests.waiting import wait_until
from tidal.distributed.ports import get_open_port
from tidal.executor.worker import Worker
from tidal.launch.engine_args import EngineArgs
from tidal.layers.linear import Linear
from tidal.models.loader import load_expert_weights, load_model
from tidal.protocol.elastic import ExpertTransferSpec
from tidal.protocol.topology import Topology

EPOCH = 1
TIMEOUT_S = 30.0


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(path: str, **kw):
    args = {
        "model": path,
        "dtype": "float32",
        "device": "cpu",
        "moe_backend": "torch",
        "block_size": 4,
        "num_gpu_blocks_override": 64,
        "max_model_len": 128,
        **kw,
    }
    return EngineArgs(**args).create_engine_config()


def _full(path: str):
    return load_model(_config(path))


def _store() -> TCPStore:
    return TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip


def _in_threads(*calls):
    """Run each ``(fn, *args)`` on its own thread at once; their results, in order."""
    results: list = [None] * len(calls)
    errors: list = []

    def run(i, fn, *args):
        try:
            results[i] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, *c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return results


# ---------------------------------------------------------------------- loader


@pytest.mark.parametrize("ckpt", ["qwen3_ckpt", "mixtral_ckpt"])
def test_load_without_experts_and_load_expert_weights(request, ckpt):
    path = request.getfixturevalue(ckpt)
    full = _full(path)
    skip = load_model(_config(path), local_expert_ids=[5, 2], load_experts=False)
    for name, t in skip.state_dict().items():
        if name.endswith((".w13", ".w2")):
            assert t.shape[0] == 2 and not t.any(), name  # allocated, not read
        elif not name.endswith(("expert_map", "expert_load")):
            assert torch.equal(t, full.state_dict()[name]), name
    # The loader packs what it read for a packed path (then the only copy), never the
    # unread experts (their slots stay plain parameters until written).
    for m in full.moe_layers():
        assert (m._held_experts is not None) == (m.cpu_choice["experts"].layout != "torch")
    assert all(m._held_experts is None and not m.is_released("w13") for m in skip.moe_layers())
    for m in skip.modules():
        if isinstance(m, Linear):
            assert (m._held is not None) == (m.cpu_choice.layout != "torch")
    got = load_expert_weights(skip, path, {0: [5, 2], 1: [7]})
    assert sorted(got) == [(0, 2), (0, 5), (1, 7)]
    for (layer, e), (w13, w2) in got.items():
        want13, want2 = full.layers[layer].mlp.expert_weights([e])  # copies: slot e holds e
        assert torch.equal(w13, want13[0]) and torch.equal(w2, want2[0])
        assert w13.is_contiguous() and w2.is_contiguous()
    assert load_expert_weights(skip, path, {0: []}) == {}


def test_load_expert_weights_reads_the_expert_biases(tiny_ckpt):
    """GPT-OSS: an expert read from disk for a transfer brings its biases from the fused,
    interleaved ``gate_up_proj_bias`` / ``down_proj_bias``, as the loader put them."""
    path = tiny_ckpt("gpt_oss")
    full = _full(path)
    skip = load_model(_config(path), local_expert_ids=[5, 2], load_experts=False)
    assert all(not m.w13_bias.any() and not m.w2_bias.any() for m in skip.moe_layers())
    got = load_expert_weights(skip, path, {0: [5], 1: [2, 7]})
    assert sorted(got) == [(0, 5), (1, 2), (1, 7)]
    for (layer, e), (w13, w2, b13, b2) in got.items():
        moe = full.layers[layer].mlp
        held = moe.read_weights(["w13", "w2"])  # packed where the C++ path serves
        assert torch.equal(w13, held["w13"][e]) and torch.equal(w2, held["w2"][e])
        assert torch.equal(b13, moe.w13_bias[e]) and torch.equal(b2, moe.w2_bias[e])


def test_load_expert_weights_from_fused_checkpoint(qwen3_ckpt, tmp_path):
    """transformers v5's fused 3-D expert tensors are split per expert on the way in."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst = tmp_path / "fused"
    shutil.copytree(qwen3_ckpt, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    state = {}
    for f in glob.glob(os.path.join(qwen3_ckpt, "*.safetensors")):
        with safe_open(f, framework="pt") as st:
            state.update({k: st.get_tensor(k) for k in st.keys()})
    cfg = json.loads((dst / "config.json").read_text())
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts"
        E = sum(1 for k in state if k.startswith(f"{p}.") and k.endswith(".gate_proj.weight"))
        gate = [state.pop(f"{p}.{e}.gate_proj.weight") for e in range(E)]
        up = [state.pop(f"{p}.{e}.up_proj.weight") for e in range(E)]
        down = [state.pop(f"{p}.{e}.down_proj.weight") for e in range(E)]
        state[f"{p}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up)])
        state[f"{p}.down_proj"] = torch.stack(down)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    full = _full(qwen3_ckpt)
    got = load_expert_weights(full, str(dst), {1: [3, 6]})
    for (layer, e), (w13, w2) in got.items():
        want13, want2 = full.layers[layer].mlp.expert_weights([e])  # copies: slot e holds e
        assert torch.equal(w13, want13[0]) and torch.equal(w2, want2[0])


# ---------------------------------------------------------------------- startup


def test_joiner_loads_without_experts_and_sizes_its_kv_cache(qwen3_ckpt):
    cfg = _config(qwen3_ckpt, data_parallel_size=3, data_parallel_rank=2,
                  enable_expert_parallel=True)  # fmt: skip
    worker = Worker(cfg)
    layout = [[0, 1, 2], [3, 4, 5], [6, 7, 0]]
    worker.elastic.init_joiner(Topology(1, [0, 1, 5], placement=layout), 5)
    assert worker.dp_group is None and worker.ep_group is None
    runner = worker.model_runner
    for moe in runner.model.moe_layers():
        assert moe.local_expert_ids == [6, 7, 0] and not moe.w13.any() and not moe.w2.any()
        assert moe.dispatcher is None
    assert runner.placement.local_expert_ids(2) == [6, 7, 0]
    full = _full(qwen3_ckpt)
    assert torch.equal(runner.model.embed_tokens.weight, full.embed_tokens.weight)
    n = worker.model_runner.determine_num_blocks()
    worker.initialize_kv_cache(n)
    assert len(runner.kv_caches) == runner.model.spec.num_layers
    with pytest.raises(KeyError):
        Worker(cfg).elastic.init_joiner(Topology(1, [0, 1, 5], placement=layout), 9)
    with pytest.raises(ValueError, match="placement"):
        Worker(cfg).elastic.init_joiner(Topology(1, [0, 1, 5]), 5)
    worker.shutdown()


def test_launch_placement_comes_from_the_topology(qwen3_ckpt):
    """EP=1 group whose topology places the experts in reverse: slot s holds 7 - s."""
    port = get_open_port()
    cfg = _config(qwen3_ckpt, enable_expert_parallel=True, enable_elastic_ep=True,
                  data_parallel_master_port=port)  # fmt: skip
    layout = [list(range(7, -1, -1))]
    worker = Worker(cfg, dist_timeout_s=TIMEOUT_S)
    worker.init_distributed(Topology.initial(1, placement=layout), 0)
    worker.load_model()
    full = _full(qwen3_ckpt)
    for moe, ref in zip(worker.model_runner.model.moe_layers(), full.moe_layers()):
        assert moe.local_expert_ids == layout[0]
        assert moe.dispatcher.placement.physical_to_logical == tuple(layout[0])
        got, want = moe.read_weights(["w13"])["w13"], ref.read_weights(["w13"])["w13"]
        for slot, e in enumerate(layout[0]):
            assert torch.equal(got[slot], want[e])
    assert worker.all_reduce_dp([3, 4], op="max") == [3, 4]
    worker.shutdown()


def test_all_reduce_dp_and_threads_without_groups(qwen3_ckpt):
    worker = Worker(_config(qwen3_ckpt))
    assert worker.all_reduce_dp([1, 2]) == [1, 2]
    assert worker.all_reduce_dp([1, 2], op="max") == [1, 2]
    with pytest.raises(ValueError, match="op"):
        worker.all_reduce_dp([1], op="min")
    worker.set_num_threads(1)
    assert torch.get_num_threads() == 1
    with pytest.raises(ValueError):
        worker.set_num_threads(0)
    # Every cleanup is idempotent and needs no peer.
    for _ in range(2):
        worker.elastic.destroy_standby(EPOCH)
        worker.elastic.discard_staged(EPOCH)
        worker.elastic.destroy_retired_groups()
        worker.elastic.leave_groups()
    worker.shutdown()


# ---------------------------------------------------------------------- transfer


def _check_experts(worker, full, ids: list[int]) -> None:
    for moe, ref in zip(worker.model_runner.model.moe_layers(), full.moe_layers()):
        assert moe.local_expert_ids == ids
        assert moe.expert_map.tolist() == [ids.index(e) if e in ids else -1 for e in range(8)]
        got, want = moe.read_weights(["w13", "w2"]), ref.read_weights(["w13", "w2"])
        for slot, e in enumerate(ids):
            assert torch.equal(got["w13"][slot], want["w13"][e]), (slot, e)
            assert torch.equal(got["w2"][slot], want["w2"][e]), (slot, e)


def test_transfer_partial_layers_disk_fallback_swap_and_install(qwen3_ckpt, caplog):
    """Engine 0 serves experts 0..3, but "EPLB" moved expert 0 out of layer 1 (4 is there
    instead); joiner engine 1 takes [0, 5, 6, 7]: expert 0 comes over the network for
    layer 0 and from disk for layer 1, expert 5 is a disk spec, 6 and 7 are in no spec
    (install reads them from disk, with a warning)."""
    full = _full(qwen3_ckpt)
    sender = Worker(_config(qwen3_ckpt), dist_timeout_s=TIMEOUT_S)
    sender.load_model([0, 1, 2, 3])
    moved = sender.model_runner.model.moe_layers()[1]
    moved.set_local_experts([4, 1, 2, 3])
    moved.set_expert_weights(full.layers[1].mlp.expert_weights([4, 1, 2, 3]))
    layout = [[1, 2, 3, 4], [0, 5, 6, 7]]
    joiner = Worker(_config(qwen3_ckpt), dist_timeout_s=TIMEOUT_S)
    joiner.elastic.init_joiner(Topology(EPOCH, [0, 1], placement=layout), 1)
    specs = [
        ExpertTransferSpec(5, 1, 1),  # from disk
        ExpertTransferSpec(0, 1, 0, src_engine_id=0, src_slot=0),
    ]
    store = _store()
    addr = f"127.0.0.1:{store.port}"
    _in_threads(
        (sender.elastic.join_standby, EPOCH, addr, [0, 1], [0, 1], 0, TIMEOUT_S),
        (joiner.elastic.join_standby, EPOCH, addr, [0, 1], [0, 1], 1, TIMEOUT_S),
    )
    assert sender.elastic.standby_epochs() == joiner.elastic.standby_epochs() == [EPOCH]
    sends, receives = specs[1:], specs
    sender.elastic.pack_expert_sends(EPOCH, sends)
    # The snapshot is a copy: a later write to the slot does not change what is sent.
    layer0 = sender.model_runner.model.moe_layers()[0]
    saved = layer0.read_weights(["w13"])["w13"]
    zeroed = saved.clone()
    zeroed[0] = 0
    layer0.write_weights({"w13": zeroed})
    sent, got = _in_threads(
        (sender.elastic.transfer_experts, EPOCH, sends, [], 0, TIMEOUT_S),
        (joiner.elastic.transfer_experts, EPOCH, [], receives, 1, TIMEOUT_S),
    )
    layer0.write_weights({"w13": saved})
    expert = sum(t.numel() for t in full.layers[0].mlp.expert_weights([0]))
    assert sent == 0 and got == 4 * expert * 4  # 2 experts x 2 layers, float32
    staged = joiner.elastic._staged[EPOCH]
    assert sorted(staged) == [(0, 0), (0, 5), (1, 0), (1, 5)]
    for (lid, e), (w13, w2) in staged.items():
        want13, want2 = full.layers[lid].mlp.expert_weights([e])
        assert torch.equal(w13, want13[0]), (lid, e)
        assert torch.equal(w2, want2[0]), (lid, e)

    # Barrier on the standby group (both members), then swap, then on the current one.
    assert _in_threads(
        (sender.elastic.standby_barrier, EPOCH, 2, 5), (joiner.elastic.standby_barrier, EPOCH, 3, 1)
    ) == [(3, 5), (3, 5)]
    for w in (sender, joiner):
        w.elastic.swap_groups(EPOCH)
        assert w.elastic.standby_epochs() == [] and w.dp_group.world_size == 2
    assert _in_threads(
        (sender.elastic.standby_barrier, EPOCH, 1, 1), (joiner.elastic.standby_barrier, EPOCH, 0, 4)
    ) == [(1, 4), (1, 4)]
    with caplog.at_level(logging.WARNING, logger="tidal.executor.elastic"):
        joiner.elastic.install_experts(EPOCH, layout, 1)
        sender.elastic.install_experts(EPOCH, layout, 0)
    assert "read from disk" in caplog.text
    _check_experts(joiner, full, layout[1])
    _check_experts(sender, full, layout[0])
    assert joiner.elastic._staged == {} and sender.elastic._packed == {}
    for w in (sender, joiner):
        groups = (w.dp_group,)
        w.elastic.destroy_retired_groups()
        w.shutdown()
        assert all(g.is_destroyed for g in groups)


# The helper's own rendezvous deadline in the cancellation test: far beyond how long the
# test waits for the helper, so only a cancellation that works can end its wait in time.
NEVER_S = 3600.0


def test_destroy_standby_cancels_a_pending_rendezvous(qwen3_ckpt):
    """The busy loop rolls back while the helper waits for a member that never comes:
    the wait ends because of the cancellation (not its own deadline, an hour away), the
    helper fails saying so, and no group of the attempt survives."""
    worker = Worker(_config(qwen3_ckpt), dist_timeout_s=TIMEOUT_S)
    store = _store()
    errors: list = []

    def join() -> None:
        try:
            worker.elastic.join_standby(
                EPOCH, f"127.0.0.1:{store.port}", [0, 1], [0, 1], 0, NEVER_S
            )
        except Exception as e:  # noqa: BLE001 - checked below
            errors.append(e)

    keys = store.num_keys()
    t = threading.Thread(target=join, daemon=True)
    t.start()
    # It wrote to the store: connected, announced, and now waiting for engine 1.
    assert wait_until(lambda: store.num_keys() > keys, TIMEOUT_S)
    worker.elastic.destroy_standby(EPOCH)
    t.join(TIMEOUT_S)
    assert not t.is_alive(), "the helper still waits for its peer: cancellation did not work"
    assert len(errors) == 1 and "were destroyed" in str(errors[0]), errors
    assert worker.elastic.standby_epochs() == []
    worker.shutdown()
