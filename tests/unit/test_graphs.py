"""Decode graphs (tidal/executor/graphs.py, docs/architecture.md#cuda-graphs) on CPU: the
size ladder and decisions; the emulating backend's static-buffer check; inert padding
(no real row's output or KV changes, no expert load); no host sync and the same ops in
every step of a size (a ``TorchDispatchMode`` over the tiny model's captured step); and
greedy tokens of the emulated graphs equal to the eager path's through the offline LLM."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tidal import LLM, SamplingParams
from tidal.executor.batch import NULL_BLOCK_ID, ScheduledRequest, SchedulerOutput
from tidal.executor.graphs import (
    ALLOCATOR_SEGMENT,
    DecodeStep,
    EmulatedGraphBackend,
    GraphDecision,
    GraphMiss,
    GraphStats,
    StaticDecodeInputs,
    capture_sizes,
    decide,
    graph_pool_estimate,
    graphs_off,
    pad_to,
    pool_segment_bytes,
)
from tidal.launch.engine_args import EngineArgs
from tidal.layers.attention import AttentionMetadata

# ---- sizes and decisions ---------------------------------------------------------------


def test_ladder_pads_every_batch_up_to_max_num_seqs():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    big = capture_sizes(300)
    assert big[:5] == (1, 2, 4, 8, 16) and big[-4:] == (256, 272, 288, 300)
    assert all(b - a <= 16 for a, b in zip(big, big[1:]))
    for n in range(1, 301):
        size = pad_to(big, n)
        assert size is not None and size >= n and size - n < max(8, n // 8 + 8)
    assert pad_to(big, 301) is None
    with pytest.raises(ValueError, match="at least one row"):
        pad_to(big, 0)


SIZES = capture_sizes(32)


@pytest.mark.parametrize(
    ("decodes", "prefills", "off", "failed", "want"),
    [
        (3, 0, None, set(), GraphDecision(4, None)),
        (32, 0, None, set(), GraphDecision(32, None)),
        (33, 0, None, set(), GraphDecision(None, GraphMiss.ABOVE_LADDER)),
        (0, 2, None, set(), GraphDecision(None, GraphMiss.PREFILL)),
        (5, 1, None, set(), GraphDecision(None, GraphMiss.MIXED)),
        (3, 0, None, {4}, GraphDecision(None, GraphMiss.CAPTURE_FAILED)),
        (5, 0, None, {4}, GraphDecision(8, None)),
        (3, 0, GraphMiss.ENFORCE_EAGER, set(), GraphDecision(None, GraphMiss.ENFORCE_EAGER)),
        (3, 0, GraphMiss.EXPERT_PARALLEL, set(), GraphDecision(None, GraphMiss.EXPERT_PARALLEL)),
    ],
)
def test_decision_table(decodes, prefills, off, failed, want):
    assert decide(SIZES, decodes, prefills, off=off, failed=failed) == want


@pytest.mark.parametrize(
    ("changes", "want"),
    [
        ({}, None),
        ({"enforce_eager": True}, GraphMiss.ENFORCE_EAGER),
        ({"backend": None}, GraphMiss.NO_BACKEND),
        ({"expert_parallel": True}, GraphMiss.EXPERT_PARALLEL),
        # TP: NCCL's collectives are stream kernels a CUDA graph records; gloo's are not.
        ({"tensor_parallel": "nccl"}, None),
        ({"tensor_parallel": "gloo"}, GraphMiss.TENSOR_PARALLEL),
        ({"tensor_parallel": "gloo", "backend": "emulated"}, GraphMiss.TENSOR_PARALLEL),
        ({"tensor_parallel": "nccl", "expert_parallel": True}, GraphMiss.EXPERT_PARALLEL),
        ({"tensor_parallel": "nccl", "enforce_eager": True}, GraphMiss.ENFORCE_EAGER),
        ({"experts_on_device": False}, GraphMiss.EXPERTS_SYNC),
        # The emulating backend replays the eager step, host reads and all.
        ({"backend": "emulated", "experts_on_device": False}, None),
    ],
)
def test_why_an_engine_replays_nothing(changes, want):
    engine = {"enforce_eager": False, "backend": "cuda", "expert_parallel": False,
              "tensor_parallel": None, "experts_on_device": True}  # fmt: skip
    assert graphs_off(**(engine | changes)) == want


def test_cuda_graphs_on_a_cpu_engine_are_refused_naming_the_option(qwen3_ckpt):
    with pytest.raises(ValueError, match="^graph_backend 'cuda' needs --device cuda"):
        EngineArgs(model=qwen3_ckpt, device="cpu", graph_backend="cuda").create_engine_config()


def test_stats_count_hits_padding_and_misses_by_reason():
    stats = GraphStats()
    stats.record(GraphDecision(8, None), 5)
    stats.record(GraphDecision(None, GraphMiss.MIXED), 2)
    stats.record(GraphDecision(None, GraphMiss.MIXED), 1)
    assert stats.to_dict() == {
        "hits": 1, "misses": {"mixed": 2}, "real_rows": 5, "padded_rows": 8
    }  # fmt: skip


def test_graph_pool_estimate_is_the_largest_step_and_the_kept_outputs_in_segments():
    mib = 1 << 20
    # The largest size's peak, plus the outputs of sizes 1, 2 and 4 ([size, H], 1 KiB rows).
    assert graph_pool_estimate(5 * mib, (1, 2, 4, 8), 1024) == 6 * mib
    assert graph_pool_estimate(4 * mib, (8,), 1024) == 4 * mib
    assert graph_pool_estimate(0, (1,), 4096) == 0
    assert graph_pool_estimate(1, (2, 1), 0) == ALLOCATOR_SEGMENT
    with pytest.raises(ValueError, match=">= 0"):
        graph_pool_estimate(-1, (1,), 8)
    segments = [
        {"total_size": 2 * mib, "segment_pool_id": (0, 0)},  # the default pool
        {"total_size": 20 * mib, "segment_pool_id": [1, 3]},
        {"total_size": 2 * mib, "segment_pool_id": (1, 3)},
        {"total_size": 2 * mib, "segment_pool_id": (1, 4)},
    ]
    assert pool_segment_bytes(segments, (1, 3)) == 22 * mib


def test_emulated_backend_refuses_a_moved_buffer():
    held = {"x": torch.zeros(4)}
    backend = EmulatedGraphBackend()
    backend.capture(4, lambda: held["x"] + 1, lambda: [held["x"]])
    held["x"].fill_(2)  # new contents at the same address: fine
    assert backend.replay(4).tolist() == [3.0] * 4
    held["x"] = torch.zeros(4)  # a new tensor: a CUDA graph would read the old memory
    with pytest.raises(RuntimeError, match="moved since capture"):
        backend.replay(4)


def test_static_inputs_match_the_eager_metadata_and_pad_inertly():
    bs, max_blocks = 4, 5
    static = StaticDecodeInputs(8, max_blocks, bs, torch.device("cpu"))
    starts = np.array([0, 5, 13], dtype=np.int64)
    table = np.array([[7, 9, 9, 9], [2, 3, 9, 9], [4, 6, 8, 1]], dtype=np.int32)
    ids = np.array([11, 12, 13], dtype=np.int64)
    static.fill(DecodeStep(ids, starts, table, [], [], []), 4)
    want = AttentionMetadata.build(
        [(int(s), 1, row[: int(s) // bs + 1].tolist()) for s, row in zip(starts, table)],
        bs, "cpu",
    )  # fmt: skip
    slots = static.part("slots", 4)
    assert slots[:3].tolist() == want.slot_mapping.tolist()
    assert want.decode_seq_lens is not None and want.decode_block_table is not None
    assert static.part("lens", 4)[:3].tolist() == want.decode_seq_lens.tolist()
    got_table = static.table(4)
    assert got_table[:3, :4].tolist() == want.decode_block_table.tolist()
    assert got_table[:3, 4:].eq(0).all()  # past a row's last block: block 0, masked
    # The padding row: token 0 at position 0, into the null block, length 1, no expert.
    assert static.part("ids", 4)[3] == 0 and static.part("positions", 4)[3] == 0
    assert slots[3] == NULL_BLOCK_ID * bs and static.part("lens", 4)[3] == 1
    assert static.part("real", 4).tolist() == [1, 1, 1, 0]
    assert got_table[3].eq(NULL_BLOCK_ID).all()


def test_placeholders_are_gathered_from_the_previous_ids_and_host_copies_alternate():
    """Async scheduling: a placeholder row's id is the previous step's sampled id, found by
    request id (a request missing there failed: id 0); the next fill writes the other host
    copy, so the inputs of a step whose transfer may still be queued stay intact."""
    static = StaticDecodeInputs(4, 2, 4, torch.device("cpu"))
    starts = np.array([3, 1, 2], dtype=np.int64)
    table = np.array([[5], [6], [7]], dtype=np.int32)
    step = DecodeStep(np.array([0, 21, 0]), starts, table, [], [], [], [(0, "a"), (2, "gone")])
    last = (torch.tensor([70, 71, 72]), {"b": 0, "a": 2})  # [N] the previous step's ids
    static.fill(step, 4, last)
    assert static.part("src", 4).tolist() == [2, -1, -1, -1]
    assert static.input_ids(4).tolist() == [72, 21, 0, 0]
    first = static.hosts[0].clone()
    # The next step: no placeholder (a synchronous step, or none left), ids on the host.
    static.fill(DecodeStep(np.array([31, 32]), starts[:2] - 1, table[:2], [], [], []), 2)
    assert static.input_ids(2).tolist() == [31, 32] and static.part("src", 2).tolist() == [-1, -1]
    assert torch.equal(static.hosts[0], first)  # the step before's host copy, untouched
    assert static.part("ids", 2, static.host_nps[1]).tolist() == [31, 32]
    static.fill(step, 4, last)  # back to the first copy
    assert static.part("ids", 2, static.host_nps[0]).tolist() == [0, 21]
    with pytest.raises(ValueError, match="5 sampled ids exceed 4 rows"):
        static.fill(step, 4, (torch.arange(5), {"a": 0}))


# ---- the tiny model's runner ---------------------------------------------------------------


class _Req:
    def __init__(self, rid: str, prompt: list[int], blocks: list[int]) -> None:
        self.request_id = rid
        self.prompt_token_ids = prompt
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt)
        self.block_ids = blocks
        self.sampling_params = SamplingParams(temperature=0.0, max_tokens=64)
        self.eos_token_id = 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


BLOCKS_PER_REQ = 4  # 64 tokens of block size 16


def _make_runner(ckpt: str) -> Any:
    from tidal.executor.model_runner import ModelRunner

    args = EngineArgs(
        model=ckpt, device="cpu", dtype="float32", graph_backend="emulated",
        max_num_seqs=8, max_model_len=64, cpu_kernels="native",
    )  # fmt: skip
    r = ModelRunner(args.create_engine_config(), torch.device("cpu"))
    r.load_model()
    r.initialize_kv_cache(1 + 8 * BLOCKS_PER_REQ)
    assert r.graphs.captured == [8, 4, 2, 1]  # largest first
    return r


@pytest.fixture(scope="module")
def runner(qwen3_ckpt: str) -> Iterator[Any]:
    r = _make_runner(qwen3_ckpt)
    yield r
    r.free_kv_cache()


def _prefilled(runner: Any, num: int, seed: int) -> list[_Req]:
    """``num`` requests with random prompts, prefilled by an eager step; each has its own
    blocks (never block 0)."""
    rng = random.Random(seed)
    reqs = []
    for i in range(num):
        blocks = list(range(1 + i * BLOCKS_PER_REQ, 1 + (i + 1) * BLOCKS_PER_REQ))
        prompt = [rng.randrange(2, 500) for _ in range(rng.randrange(2, 30))]
        reqs.append(_Req(f"s{seed}-{i}", prompt, blocks))
    _run(runner, [ScheduledRequest(r, 0, r.num_tokens) for r in reqs])
    return reqs


def _run(runner: Any, scheduled: list[ScheduledRequest]) -> None:
    out = runner.execute_model(SchedulerOutput(scheduled, sum(s.num_new_tokens for s in scheduled)))
    assert not out.failed
    for sr in scheduled:
        for tok in out.sampled_token_ids.get(sr.request.request_id, []):
            sr.request.all_token_ids.append(tok)
            sr.request.output_token_ids.append(tok)


def _decodes(reqs: list[_Req]) -> list[ScheduledRequest]:
    return [ScheduledRequest(r, r.num_tokens - 1, 1) for r in reqs]


@torch.inference_mode()
def test_padding_rows_change_no_real_row_kv_or_expert_load(runner):
    reqs = _prefilled(runner, 3, seed=1)
    scheduled = _decodes(reqs)
    inputs = runner.input_batch.prepare(scheduled)
    eager = runner._forward(inputs.input_ids, inputs.positions, inputs.attn)  # [3, H]
    moe = runner.model.moe_layers()
    loads = [torch.zeros(m.num_experts, dtype=torch.int64) for m in moe]
    for m, load in zip(moe, loads):
        m.bind_expert_load(load)
    try:
        for size in (4, 8):  # one and five padding rows
            before = [c.clone() for c in runner.kv_caches]
            for load in loads:
                load.zero_()
            step = runner.input_batch.prepare_decode(scheduled)
            hidden = runner.graphs.replay(step, size)
            assert hidden.shape[0] == size
            torch.testing.assert_close(hidden[:3], eager)
            real_slots = {r.block_ids[p // 16] * 16 + p % 16 for r, p in
                          ((r, r.num_tokens - 1) for r in reqs)}  # fmt: skip
            for old, new in zip(before, runner.kv_caches):
                changed = (old != new).any(dim=-1)  # [2, NB, Hkv, bs]
                where = changed.nonzero().tolist()
                slots = {blk * 16 + off for _, blk, _, off in where}
                # Padding writes only the null block; real rows only their new slots.
                assert slots <= real_slots | set(range(NULL_BLOCK_ID * 16, NULL_BLOCK_ID * 16 + 16))
            for m, load in zip(moe, loads):
                assert int(load.sum()) == 3 * m.top_k  # the padding rows reached no expert
    finally:
        for m in moe:
            m.record_expert_load = False
    _run(runner, scheduled)  # the runner path itself: a replayed step samples the real rows


@torch.inference_mode()
def test_the_measured_padding_step_runs_on_the_null_block_alone(runner):
    """What CUDA measures before sizing the cache (``_graph_pool_estimate``): the largest
    size's step of padding rows, on a cache of one block; the real cache is bound again."""
    caches = [c.clone() for c in runner.kv_caches]
    hidden = runner.on_null_block(lambda: runner.graphs.padding_step(runner._padded_forward)())
    assert hidden.shape == (8, runner.model.spec.hidden_size) and hidden.isfinite().all()
    assert all(torch.equal(a, b) for a, b in zip(caches, runner.kv_caches))  # not written
    reqs = _prefilled(runner, 2, seed=5)  # the bound cache steps as before
    step = runner.input_batch.prepare_decode(_decodes(reqs))
    inputs = runner.input_batch.prepare(_decodes(reqs))
    eager = runner._forward(inputs.input_ids, inputs.positions, inputs.attn)  # [2, H]
    torch.testing.assert_close(runner.graphs.replay(step, 2)[:2], eager)
    runner.input_batch.drop({r.request_id for r in reqs})


@torch.inference_mode()
def test_a_rebuilt_tp_group_is_captured_again_before_the_next_decode(runner):
    """A CUDA graph holds the TP group's communicator: once the group is replaced (a
    rebuild after a peer rank's death), the next step captures every size again, once."""
    old_static, old_group = runner.graphs.static, runner.tp.group
    runner.tp.group = object()  # what the worker's rebuild does: a new group object
    reqs: list[_Req] = []
    try:
        reqs = _prefilled(runner, 2, seed=6)
        assert runner.graphs.static is not old_static and runner.graphs.captured == [8, 4, 2, 1]
        static, hits = runner.graphs.static, runner.graphs.stats.hits
        _run(runner, _decodes(reqs))  # the same group: replayed, no capture
        assert runner.graphs.static is static and runner.graphs.stats.hits == hits + 1
    finally:
        runner.tp.group = old_group
        runner.input_batch.drop({r.request_id for r in reqs})
        runner.capture_graphs()


def test_tp_workers_agree_on_the_sizes_whose_capture_failed(runner):
    """A size that failed on one TP worker runs eagerly on all (their collectives match)."""
    graphs, saved = runner.graphs, set(runner.graphs.failed)
    peer = torch.tensor([0, 1, 0, 0], dtype=torch.int32)  # the other worker: size 2 failed
    try:
        graphs.failed = {4}
        graphs.agree_failed(lambda mine: mine.add_(peer))
        assert graphs.failed == {2, 4}
        assert graphs.decide(2, 0).miss is GraphMiss.CAPTURE_FAILED
    finally:
        graphs.failed = saved


# MLA's latent cache; a sliding window, sinks and biased clamped experts.
@pytest.mark.parametrize("model_type", ["deepseek_v3", "gpt_oss"])
@torch.inference_mode()
def test_other_attention_and_experts_replay_the_eager_step(tiny_ckpt, model_type):
    runner = _make_runner(tiny_ckpt(model_type))
    scheduled = _decodes(_prefilled(runner, 3, seed=4))
    inputs = runner.input_batch.prepare(scheduled)
    eager = runner._forward(inputs.input_ids, inputs.positions, inputs.attn)  # [3, H]
    hidden = runner.graphs.replay(runner.input_batch.prepare_decode(scheduled), 8)
    torch.testing.assert_close(hidden[:3], eager)
    runner.free_kv_cache()


SYNC_OPS = {
    "aten._local_scalar_dense",  # .item(), .tolist(), int(t), if t: ...
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.bincount",  # its length is the largest value's
    "aten.equal",
    "aten.is_nonzero",
}
# repeat_interleave by a tensor of counts, without output_size: its length is their sum
DATA_SHAPED = {"aten.repeat_interleave.Tensor", "aten.repeat_interleave.self_Tensor"}


class OpTrace(TorchDispatchMode):
    """Every op of a region with its tensor arguments' shapes and dtypes, and the ops
    that need the host to read device data (a sync; in a CUDA graph, an error)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[Any, ...]]] = []
        self.syncs: list[str] = []
        self._tolist: Any = None

    def __enter__(self) -> OpTrace:
        # A CPU tensor's tolist reads memory without an op: watched by hand.
        self._tolist = original = torch.Tensor.tolist

        def tolist(t: torch.Tensor) -> Any:
            self.syncs.append("Tensor.tolist")
            return original(t)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        shapes = tuple(
            (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None
            for a in (*args, *kwargs.values())
        )
        self.ops.append((name, shapes))
        bool_index = name == "aten.index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for a in args if isinstance(a, (list, tuple)) for i in a
        )  # fmt: skip
        shaped = str(func) in DATA_SHAPED and kwargs.get("output_size") is None
        if name in SYNC_OPS or bool_index or shaped:
            self.syncs.append(name)
        return func(*args, **kwargs)


def _placeholder_decodes(reqs: list[_Req]) -> tuple[list[ScheduledRequest], Any]:
    """``_decodes(reqs)`` as async scheduling launches it: every other row a placeholder
    whose token is not on the host yet but in the previous step's sampled ids (returned
    with each request's index there, in another order, with an id of another request)."""
    scheduled = [
        ScheduledRequest(r, r.num_tokens - 1, 1, placeholder=i % 2 == 0) for i, r in enumerate(reqs)
    ]
    held = [sr.request for sr in scheduled if sr.placeholder][::-1]
    tokens = torch.tensor([7, *(r.all_token_ids[-1] for r in held)])  # [N] int64
    return scheduled, (tokens, {r.request_id: i + 1 for i, r in enumerate(held)})


@torch.inference_mode()
def test_captured_step_has_no_host_sync_and_the_same_ops_every_time(runner):
    """Two steps of size 8, the second with placeholder rows (async scheduling): no host
    sync filling the inputs (the previous ids copied on the device) nor in the step, the
    same ops in both, and the placeholders' output that of their known ids."""
    graphs = runner.graphs
    traces = []
    for seed, num, is_async in ((2, 3, False), (3, 7, True)):  # different rows and counts
        reqs = _prefilled(runner, num, seed=seed)
        scheduled, last = _placeholder_decodes(reqs) if is_async else (_decodes(reqs), None)
        step = runner.input_batch.prepare_decode(scheduled)
        assert len(step.placeholders) == (4 if is_async else 0)
        with OpTrace() as fill:
            graphs.static.fill(step, 8, last)
        with OpTrace() as trace:
            hidden = graphs.backend.replay(8).clone()  # [8, H]
        for t in (fill, trace):
            assert t.syncs == [], f"host syncs in the decode step: {t.syncs}"
        traces.append(trace.ops)
        if is_async:
            known = graphs.replay(runner.input_batch.prepare_decode(_decodes(reqs)), 8)
            assert torch.equal(hidden[:num], known[:num])
        runner.input_batch.drop({r.request_id for r in reqs})
    assert traces[0] == traces[1]
    assert len(traces[0]) > 20  # the whole forward was traced


# ---- the engine ------------------------------------------------------------------------------


def test_emulated_graphs_give_the_eager_greedy_tokens(qwen3_ckpt):
    """Prompts of different lengths finish at different steps: decode batches of 5 down to
    1 rows, padded to 8, 4, 2 and 1; the stats count the replays and the eager steps. With
    async scheduling too: the decode steps replay with placeholder rows, mixed with the
    known ids of a request whose penalty makes it wait for its tokens (every other step)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randrange(1, 20))] for _ in range(5)]
    params = [
        SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(4)
    ] + [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)]
    got = {}
    # auto on CPU: no graphs, the eager synchronous reference
    for backend, is_async in (("auto", False), ("emulated", False), ("emulated", True)):
        llm = LLM(qwen3_ckpt, dtype="float32", multiprocess=False, graph_backend=backend,
                  max_num_seqs=8, cpu_kernels="native", async_scheduling=is_async)  # fmt: skip
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            got[backend, is_async] = [o.outputs[0].token_ids for o in outs]
            stats = llm._call_all("get_graph_stats")[0]
        finally:
            llm.shutdown()
        if backend == "auto":
            assert stats["hits"] == 0 and set(stats["misses"]) == {"no_backend"}
        else:
            assert stats["hits"] >= 12 and stats["padded_rows"] > stats["real_rows"]
            assert set(stats["misses"]) <= {"mixed", "prefill"}
    assert got["emulated", False] == got["auto", False]
    assert got["emulated", True] == got["auto", False]
