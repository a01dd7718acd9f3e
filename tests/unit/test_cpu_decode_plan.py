"""The CPU decode plan (``tidal/models/cpu_decode.py``): a pure decode step as flat C++
kernel calls gives bit for bit the module path's logits on every architecture, in float32
and bf16, with the kernels forced native or torch; a layer whose every piece is direct runs
as one ``decode_layer`` call, bit for bit the pieces' calls; it serves only pure decode
steps; it is rebuilt when what it read changes (a new KV cache, another expert path,
expert moves)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_models import PagedRunner, _prompts
from tidal.kernels.cpu_ext import kernel_available, kernel_status, native_args
from tidal.kernels.select import Candidate, Choice
from tidal.launch.engine_args import EngineArgs
from tidal.models.cpu_decode import (
    DecodePlan,
    DecodePlans,
    Fusion,
    Verify,
    _Attention,
    _FusedStack,
    _Moe,
)
from tidal.models.loader import load_model
from tidal.models.registry import model_types

pytestmark = pytest.mark.skipif(not kernel_available(), reason=kernel_status())


def _load(path: str, dtype: str, kernels: str = "native"):
    config = EngineArgs(
        model=path, dtype=dtype, device="cpu", cpu_kernels=kernels
    ).create_engine_config()
    return load_model(config)


def _runs(monkeypatch) -> list[int]:
    """Counts the steps that run on a plan (rows of each)."""
    runs: list[int] = []
    real = DecodePlans.for_step

    def for_step(self, model, attn, rows):
        plan = real(self, model, attn, rows)
        if plan is not None:  # the step runs on it
            runs.append(rows)
        return plan

    monkeypatch.setattr(DecodePlans, "for_step", for_step)
    return runs


def _checks(monkeypatch) -> list[int]:
    """Counts the plans' staleness checks (``DecodePlan.fresh``)."""
    checks: list[int] = []
    real = DecodePlan.fresh
    monkeypatch.setattr(DecodePlan, "fresh", lambda self: checks.append(1) or real(self))
    return checks


def _decode_logits(
    model, prompts: list[list[int]], steps: int, seed: int = 3, between=None
) -> torch.Tensor:
    """Prefill ``prompts`` in one step, then ``steps`` pure decode steps of all of them
    (greedy): the decode steps' logits, [steps * len(prompts), V]. ``between(i)`` runs
    after decode step i."""
    runner = PagedRunner(model, seed=seed)  # binds fresh KV caches
    items = [(str(i), 0, p) for i, p in enumerate(prompts)]
    out = []
    with torch.inference_mode():
        logits = runner.step(items)
        ends = torch.cumsum(torch.tensor([len(p) for p in prompts]), 0) - 1
        nxt = logits[ends].argmax(-1).tolist()
        pos = [len(p) for p in prompts]
        for _ in range(steps):
            logits = runner.step([(str(i), pos[i], [nxt[i]]) for i in range(len(prompts))])
            out.append(logits)
            nxt = logits.argmax(-1).tolist()
            pos = [p + 1 for p in pos]
            if between is not None:
                between(len(out) - 1)
    return torch.cat(out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "model_type",
    # Qwen3-MoE (every piece direct) in the fast tier; every architecture in the full suite
    [t if t == "qwen3_moe" else pytest.param(t, marks=pytest.mark.slow) for t in model_types()],
)
def test_plan_equals_the_module_path(tiny_ckpt, model_type, dtype, monkeypatch):
    """Every architecture: 3 decode steps of 2 sequences through the plan, bit for bit the
    module path's logits; the plan served exactly those steps, its norms always direct."""
    model = _load(tiny_ckpt(model_type), dtype)
    prompts = _prompts(model.spec.vocab_size, [7, 12], seed=11)
    runs = _runs(monkeypatch)
    planned = _decode_logits(model, prompts, 3)
    assert runs == [2, 2, 2]  # the decode steps, not the prefill
    plan = model.decode_plans._plans[2]
    assert plan.direct >= 2 * len(model.layers)
    model.decode_plans.enabled = False
    assert torch.equal(planned, _decode_logits(model, prompts, 3))
    assert runs == [2, 2, 2]


def test_qwen3_plan_is_all_direct_and_torch_paths_call_modules(qwen3_ckpt, monkeypatch):
    """Qwen3-MoE on the native kernels: every piece of every layer is a direct call; with
    the torch paths forced, none is, and the logits still equal the module path's."""
    model = _load(qwen3_ckpt, "bfloat16")
    prompts = _prompts(model.spec.vocab_size, [5], seed=2)
    _decode_logits(model, prompts, 1)
    plan = model.decode_plans._plans[1]
    assert plan.direct == 5 * len(model.layers)
    assert plan.fused == len(model.layers)  # every layer one decode_layer call
    assert all(isinstance(lay.attention, _Attention) for lay in plan.layers)
    assert all(isinstance(lay.mlp, _Moe) and lay.mlp.experts is not None for lay in plan.layers)

    model = _load(qwen3_ckpt, "bfloat16", kernels="torch")
    runs = _runs(monkeypatch)
    planned = _decode_logits(model, prompts, 2)
    assert runs == [1, 1]
    assert model.decode_plans._plans[1].direct == 0
    assert model.decode_plans._plans[1].fused == 0
    model.decode_plans.enabled = False
    assert torch.equal(planned, _decode_logits(model, prompts, 2))


def _fused_against_pieces(
    model, prompts: list[list[int]], steps: int, halves: int = 0
) -> dict[str, int]:
    """The plan with every layer in one call (where every layer is whole), then with each
    layer as one call, then piece by piece: every layer was one call (``halves`` of them
    only their attention half), and the logits are bit for bit the same at each level.
    Returns the first layer's ints by name."""
    plans = model.decode_plans
    rows = len(prompts)
    assert plans.fusion is Fusion.STACK  # the default
    calls = []
    real = _FusedStack.__call__
    _FusedStack.__call__ = lambda self, *a: calls.append(1) or real(self, *a)
    try:
        stacked = _decode_logits(model, prompts, steps)
    finally:
        _FusedStack.__call__ = real
    assert len(calls) == (steps if halves == 0 else 0)  # the model in one call a step
    plan = plans._plans[rows]
    assert plan.fused == len(model.layers) - halves
    assert plan.fused_attention == halves
    assert (plan.stack is not None) == (halves == 0)
    ints = dict(
        zip(torch.ops.tidal_cpu.decode_layer_layout.default()[1], plan.layers[0].fused.ints)
    )
    plans.fusion = Fusion.LAYERS
    assert not plans._plans  # built the other way: dropped
    layers = _decode_logits(model, prompts, steps)
    plan = plans._plans[rows]
    assert plan.stack is None and plan.fused == len(model.layers) - halves
    plans.fusion = Fusion.PIECES
    pieces = _decode_logits(model, prompts, steps)
    assert plans._plans[rows].fused == plans._plans[rows].fused_attention == 0
    assert torch.equal(stacked, layers) and torch.equal(layers, pieces)
    plans.fusion = Fusion.STACK
    return ints


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["", "dot-t0", "amx", "t0", "nta"])
def test_a_layer_in_one_call_equals_its_pieces(qwen3_ckpt, dtype, variant):
    """``decode_layer`` on each kernel variant the measured choice may pick (forced on every
    projection, router and experts): bit for bit the plan's piece-by-piece calls."""
    from tidal.kernels.cpu_ext import amx_available, bf16_dot_available
    from tidal.layers.linear import Linear
    from tidal.moe.layer import FusedMoE

    if variant == "amx" and not (dtype == "bfloat16" and amx_available()):
        pytest.skip("the AMX kernels take bf16 on a CPU with AMX")
    if variant.startswith("dot") and not (dtype == "bfloat16" and bf16_dot_available()):
        pytest.skip("the dot kernels take bf16 on a CPU with AVX512-BF16")
    model = _load(qwen3_ckpt, dtype)
    if variant:
        forced = Choice.fixed(Candidate("native", variant), "native")
        router = Choice.fixed(Candidate("native", variant.removeprefix("amx")), "native")
        for mod in model.modules():
            if isinstance(mod, Linear) and mod is not model.lm_head:
                mod.set_cpu_path("linear", forced)
            elif isinstance(mod, FusedMoE):
                mod.set_cpu_path("experts", forced)
                mod.set_cpu_path("router", router)  # the router has no AMX kernel
    ints = _fused_against_pieces(model, _prompts(model.spec.vocab_size, [6, 11, 4], seed=5), 3)
    if variant:  # the forced kernels are the ones the one call ran
        args = native_args(variant)
        for name in ("qkv", "o", "moe"):
            assert (ints[f"{name}_dot"], ints[f"{name}_amx"]) == (args.dot, args.amx)
            assert ints[f"{name}_prefetch"] == args.prefetch


def test_fp8_layers_in_one_call_equal_their_pieces(qwen3_ckpt, tmp_path):
    """An FP8 checkpoint's layers as one call each (FP8 projections with their scales, FP8
    experts): bit for bit the pieces."""
    from tidal.models.tiny import make_tiny_fp8_checkpoint

    path = make_tiny_fp8_checkpoint(str(tmp_path / "fp8"), source=qwen3_ckpt, block=(32, 16))
    model = _load(path, "bfloat16")
    _fused_against_pieces(model, _prompts(model.spec.vocab_size, [9, 5], seed=8), 3)


@pytest.mark.parametrize(
    ("model_type", "dtype"),
    [
        ("qwen2_moe", "float32"),  # shared experts: the attention half
        ("qwen2_moe", "bfloat16"),
        pytest.param("glm4_moe", "bfloat16", marks=pytest.mark.slow),  # a dense first layer
        pytest.param("gpt_oss", "float32", marks=pytest.mark.slow),  # sinks, windows, biases
        pytest.param("mixtral", "bfloat16", marks=pytest.mark.slow),  # whole layers
    ],
)
def test_attention_halves_in_one_call_equal_their_pieces(tiny_ckpt, model_type, dtype):
    """A layer whose MLP is not all C++ (shared experts, biased experts, a dense MLP) runs
    its attention half as one call, then its MLP: bit for bit the pieces."""
    model = _load(tiny_ckpt(model_type), dtype)
    prompts = _prompts(model.spec.vocab_size, [7, 4], seed=10)
    halves = 0 if model_type == "mixtral" else len(model.layers)
    _fused_against_pieces(model, prompts, 3, halves)


def test_decode_layer_rejects_a_malformed_call():
    """The op checks its lists against its layout and names a missing tensor."""
    ops = torch.ops.tidal_cpu
    slots, ints, floats = ops.decode_layer_layout.default()
    x = torch.zeros(1, 64)
    idx = torch.zeros(1, dtype=torch.long)
    cache = torch.zeros(2, 1, 1, 16, 64)
    args = (x, None, x, x, idx, idx.view(1, 1), idx + 1, cache)
    with pytest.raises(RuntimeError, match="decode_layer_layout"):
        ops.decode_layer.default(
            *args, [None] * (len(slots) - 1), [0] * len(ints), [0.0] * len(floats)
        )
    with pytest.raises(RuntimeError, match="'in_norm' of layer 0 is missing"):
        ops.decode_layer.default(*args, [None] * len(slots), [0] * len(ints), [0.0] * len(floats))


def test_decode_model_rejects_a_malformed_call():
    """The model op checks its ids, its tables and that its lists hold one layout per cache,
    and names the layer whose tensor is missing or which is not whole (routed MoE only)."""
    ops = torch.ops.tidal_cpu
    slots, ints, floats = ops.decode_layer_layout.default()
    ids = torch.zeros(1, dtype=torch.long)
    embed, table, norm = torch.zeros(8, 64), torch.zeros(4, 64), torch.ones(64)
    caches = [torch.zeros(2, 1, 1, 16, 64) for _ in range(2)]
    one = ([None] * len(slots), [0] * len(ints), [0.0] * len(floats))
    whole = [0] * len(ints)
    whole[list(ints).index("experts")] = 4
    two = (one[0] * 2, whole * 2, one[2] * 2)

    def call(ids, embed, lists):
        head = (ids, ids, embed, table, table, norm, 1e-6, ids, ids.view(1, 1), ids + 1, caches)
        return ops.decode_model.default(*head, *lists)

    with pytest.raises(RuntimeError, match="decode_model: .*decode_layer_layout"):
        call(ids, embed, one)  # one layer's lists, two caches
    with pytest.raises(RuntimeError, match="decode_model: ids and positions must be"):
        call(ids.view(1, 1), embed, two)
    with pytest.raises(RuntimeError, match="decode_model: embed must be"):
        call(ids, embed.view(-1), two)
    with pytest.raises(RuntimeError, match="decode_model: layer 0 is not a whole layer"):
        call(ids, embed, (one[0] * 2, one[1] * 2, one[2] * 2))
    with pytest.raises(RuntimeError, match="decode_model: tensor 'in_norm' of layer 0"):
        call(ids, embed, two)


def test_mixed_steps_take_the_module_path(qwen3_ckpt, monkeypatch):
    """A step with a prefill chunk beside decode rows is not a pure decode step."""
    model = _load(qwen3_ckpt, "float32")
    runs = _runs(monkeypatch)
    a, b = _prompts(model.spec.vocab_size, [6, 9], seed=4)
    runner = PagedRunner(model)
    with torch.inference_mode():
        first = runner.step([("a", 0, a)])
        runner.step([("a", len(a), [int(first[-1].argmax())]), ("b", 0, b)])
    assert runs == []


def test_a_padded_step_takes_the_module_path(qwen3_ckpt, monkeypatch):
    """A step whose MoE context marks padding rows (a decode graph's) is not a plan's."""
    from tidal.moe.layer import MoEForwardContext

    model = _load(qwen3_ckpt, "float32")
    prompts = _prompts(model.spec.vocab_size, [5], seed=3)
    _decode_logits(model, prompts, 1)
    assert model.decode_plans._plans[1].padded() is False
    ctx = MoEForwardContext()
    ctx.padding = torch.zeros(1, dtype=torch.bool)
    for moe in model.moe_layers():
        moe.forward_context = ctx
    runs = _runs(monkeypatch)
    _decode_logits(model, prompts, 2)
    assert runs == [] and model.decode_plans._plans[1].padded()


def test_a_stale_plan_is_rebuilt(qwen3_ckpt, monkeypatch):
    """What the plan read changes under it: a new KV cache (a runner binds its own), the
    experts' path switched to torch, then back to native (a re-pack, new tensors). Each
    time the next step builds a new plan, drops the old ones, and matches the module path."""
    model = _load(qwen3_ckpt, "bfloat16")
    prompts = _prompts(model.spec.vocab_size, [8, 3, 5], seed=9)
    plans = model.decode_plans
    _decode_logits(model, prompts, 1)
    first = plans._plans[3]
    _decode_logits(model, prompts, 1)  # new caches
    second = plans._plans[3]
    assert second is not first and not first.fresh() and second.fresh()

    moe = model.moe_layers()[0]
    native = moe.cpu_choice["experts"]
    moe.set_cpu_path("experts", Choice.fixed(Candidate("torch"), None))
    assert not second.fresh()
    planned = _decode_logits(model, prompts, 2)
    third = plans._plans[3]
    assert third.layers[0].mlp.experts is None  # that layer's experts: the module's call
    assert isinstance(third.layers[1].mlp, _Moe) and third.layers[1].mlp.experts is not None
    plans.enabled = False
    assert torch.equal(planned, _decode_logits(model, prompts, 2))
    plans.enabled = True

    moe.set_cpu_path("experts", native)  # packed again: new tensors
    assert not third.fresh()
    planned = _decode_logits(model, prompts, 2)
    assert list(plans._plans) == [3] and plans._plans[3].layers[0].mlp.experts is not None
    plans.enabled = False
    assert torch.equal(planned, _decode_logits(model, prompts, 2))


def test_a_new_plan_drops_stale_plans_of_other_sizes(qwen3_ckpt):
    """A plan for another row count, built after a change, first drops the stale ones:
    none keeps the old caches or weights alive."""
    model = _load(qwen3_ckpt, "float32")
    plans = model.decode_plans
    _decode_logits(model, _prompts(model.spec.vocab_size, [4, 4], seed=1), 1)
    assert list(plans._plans) == [2]
    _decode_logits(model, _prompts(model.spec.vocab_size, [4], seed=1), 1)  # new caches
    assert list(plans._plans) == [1]


@pytest.mark.parametrize("block", [(32, 16), None])
def test_fp8_checkpoints_take_the_fp8_kernels_directly(qwen3_ckpt, tmp_path, block, monkeypatch):
    """An FP8 Qwen3-MoE (block scales, or one scale per tensor): its QKV / O linears and
    experts are the C++ FP8 kernels' direct calls, and the logits equal the module path's."""
    from tidal.models.cpu_decode import _NativeFp8Linear
    from tidal.models.tiny import make_tiny_fp8_checkpoint

    path = make_tiny_fp8_checkpoint(str(tmp_path / "fp8"), source=qwen3_ckpt, block=block)
    model = _load(path, "bfloat16")
    prompts = _prompts(model.spec.vocab_size, [6, 10], seed=3)
    runs = _runs(monkeypatch)
    planned = _decode_logits(model, prompts, 3)
    assert runs == [2, 2, 2]
    plan = model.decode_plans._plans[2]
    assert plan.fused == len(model.layers)  # with the FP8 projections and experts
    for lay in plan.layers:
        assert isinstance(lay.attention, _Attention)
        assert isinstance(lay.attention.qkv, _NativeFp8Linear)
        assert isinstance(lay.attention.o, _NativeFp8Linear)
        assert isinstance(lay.mlp, _Moe) and lay.mlp.experts is not None
        assert lay.mlp.experts.fp8  # with the pack's scales
    model.decode_plans.enabled = False
    assert torch.equal(planned, _decode_logits(model, prompts, 3))


@pytest.mark.parametrize("variant", ["dot-t0", "amx"])
def test_each_fp8_kernel_on_the_plan_equals_the_module_path(qwen3_ckpt, tmp_path, variant):
    """The FP8 dot and AMX kernels, each forced on every FP8 linear and the experts: the
    plan calls that kernel, and its logits equal the module path's."""
    from tidal.kernels.cpu_ext import fp8_amx_available, fp8_dot_available
    from tidal.layers.quant import Fp8Linear
    from tidal.models.cpu_decode import _NativeFp8Linear
    from tidal.models.tiny import make_tiny_fp8_checkpoint
    from tidal.moe.layer import FusedMoE

    if not (fp8_amx_available() if variant == "amx" else fp8_dot_available()):
        pytest.skip(f"this CPU does not run the FP8 {variant} kernel")
    path = make_tiny_fp8_checkpoint(str(tmp_path / "fp8"), source=qwen3_ckpt, block=(32, 32))
    model = _load(path, "bfloat16")
    forced = Choice.fixed(Candidate("native", variant), "native")
    for mod in model.modules():
        if isinstance(mod, Fp8Linear):
            mod.set_cpu_path("linear", forced)
        elif isinstance(mod, FusedMoE) and mod.fp8_block_k is not None:
            mod.set_cpu_path("experts", forced)
    prompts = _prompts(model.spec.vocab_size, [6, 10], seed=4)
    planned = _decode_logits(model, prompts, 3)
    amx = variant == "amx"
    for lay in model.decode_plans._plans[2].layers:
        assert isinstance(lay.attention, _Attention)
        assert isinstance(lay.attention.qkv, _NativeFp8Linear) and lay.attention.qkv.amx == amx
        assert isinstance(lay.mlp, _Moe) and lay.mlp.experts is not None
        assert lay.mlp.experts.fp8 and lay.mlp.experts.amx == amx
    model.decode_plans.enabled = False
    assert torch.equal(planned, _decode_logits(model, prompts, 3))


def test_deepseek_fp8_on_the_plan_equals_the_module_path(deepseek_fp8_ckpt, monkeypatch):
    """DeepSeek-V3's FP8 release layout: MLA attention and the dense first layer call their
    modules, the norms and FP8 experts are direct; the logits equal the module path's."""
    model = _load(deepseek_fp8_ckpt, "bfloat16")
    prompts = _prompts(model.spec.vocab_size, [9], seed=6)
    runs = _runs(monkeypatch)
    planned = _decode_logits(model, prompts, 2)
    assert runs == [1, 1]
    plan = model.decode_plans._plans[1]
    assert any(isinstance(lay.mlp, _Moe) and lay.mlp.experts is not None for lay in plan.layers)
    model.decode_plans.enabled = False
    assert torch.equal(planned, _decode_logits(model, prompts, 2))


def test_a_plan_pins_no_old_cache_or_weights(qwen3_ckpt):
    """A new KV cache and a re-pack of the experts free the old tensors at once, before
    any decode step: the plan holds them weakly (the model's memory budget counts on it)."""
    import gc
    import weakref

    model = _load(qwen3_ckpt, "bfloat16")
    _decode_logits(model, _prompts(model.spec.vocab_size, [5], seed=7), 1)
    assert model.decode_plans._plans
    attn = model.layers[0].self_attn.attn
    moe = model.moe_layers()[0]
    old_cache = weakref.ref(attn.kv_cache)
    old_pack = weakref.ref(moe._held_experts.packed.w13)
    native = moe.cpu_choice["experts"]
    moe.set_cpu_path("experts", Choice.fixed(Candidate("torch"), None))
    moe.set_cpu_path("experts", native)  # packed again: new tensors
    gc.collect()
    assert old_pack() is None and model.decode_plans._plans  # the stale plan is still there
    attn.kv_cache = torch.zeros(0)  # a cache unbound behind the plan's back
    gc.collect()
    assert old_cache() is None
    spec = model.kv_cache_spec()
    model.bind_kv_cache([torch.zeros(0) for _ in range(spec.num_layers)])  # as sleep does
    assert not model.decode_plans._plans


def test_a_pack_let_go_in_place_takes_the_module_path(qwen3_ckpt, monkeypatch):
    """A holder that swaps its pack for another in place (the same holder: the staleness
    check passes) leaves the plan's weak reference dead: that step's plan runs nothing,
    the plans are dropped and the module path serves the step; the next step builds a new
    plan. Every logit equals the module path's."""
    from tidal.kernels.cpu_moe import CpuPackedExperts

    model = _load(qwen3_ckpt, "bfloat16")
    prompts = _prompts(model.spec.vocab_size, [5, 7], seed=13)
    held = model.moe_layers()[0]._held_experts
    served: list[bool] = []
    real = _FusedStack.__call__

    def call(self, *args):
        out = real(self, *args)
        served.append(out is not None)
        return out

    monkeypatch.setattr(_FusedStack, "__call__", call)
    # the plans themselves, not their ids: a freed plan's id can be reused by the next one
    plans_after: list[object] = []

    def swap(step: int) -> None:
        if step == 0:
            held.packed = CpuPackedExperts(held.unpack_w13(), held.unpack_w2())
        plans_after.append(model.decode_plans._plans.get(2))

    planned = _decode_logits(model, prompts, 3, between=swap)
    assert served == [True, False, True]
    # dropped at step 1 (none after it), built anew at step 2
    assert plans_after[1] is None
    assert plans_after[2] is not None and plans_after[2] is not plans_after[0]
    model.decode_plans.enabled = False
    assert torch.equal(planned, _decode_logits(model, prompts, 3))


def test_on_change_a_whole_model_plan_is_checked_after_a_change_only(qwen3_ckpt, monkeypatch):
    """``Verify.ON_CHANGE`` (what a worker sets): a whole-model plan that passed its check
    serves on unchecked; after a reported change (``changing``) the next step checks it,
    and rebuilds it where the change touched what it read; a plan that is not the whole
    model is checked every step; while a change is under way every step checks. The
    logits equal the module path's under the same changes."""
    model = _load(qwen3_ckpt, "bfloat16")
    plans = model.decode_plans
    plans.verify = Verify.ON_CHANGE
    prompts = _prompts(model.spec.vocab_size, [5, 7], seed=14)
    moe = model.moe_layers()[0]
    native = moe.cpu_choice["experts"]
    torch_path = Choice.fixed(Candidate("torch"), None)
    checks = _checks(monkeypatch)
    per_step: list[int] = []
    under_way = plans.changing()

    def between(step: int) -> None:
        per_step.append(len(checks))
        checks.clear()
        if step == 1:
            with plans.changing():  # the experts on torch: no whole-model plan
                moe.set_cpu_path("experts", torch_path)
        elif step == 3:
            with plans.changing():
                moe.set_cpu_path("experts", native)  # packed again
        elif step == 5:
            under_way.__enter__()
        elif step == 7:
            under_way.__exit__(None, None, None)

    planned = _decode_logits(model, prompts, 10, between=between)
    # built, trusted | stale, on torch (checked each step) | stale, native | under way x2,
    # then once after it
    assert per_step == [0, 0, 1, 1, 1, 0, 1, 1, 1, 0]
    assert plans._plans[2].stack is not None

    def same_changes(step: int) -> None:
        if step in (1, 3):
            moe.set_cpu_path("experts", torch_path if step == 1 else native)

    plans.enabled = False
    assert torch.equal(planned, _decode_logits(model, prompts, 10, between=same_changes))


def test_an_engine_checks_its_whole_model_plan_after_changes_only(qwen3_ckpt, monkeypatch):
    """In an engine (the in-process ``LLM``) the runner's model verifies on change: a
    greedy decode checks its plan at most once (after the prefill), and its tokens equal
    those of the same engine checking every step."""
    from tidal import LLM, SamplingParams

    checks = _checks(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 14, 3, 8]}
    with LLM(qwen3_ckpt, dtype="bfloat16", multiprocess=False) as llm:
        plans = llm.client.engine.executor.worker.model_runner.model.decode_plans
        assert plans.verify is Verify.ON_CHANGE
        on_change = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert len(checks) <= 1 and plans._plans[1].stack is not None
        checks.clear()
        plans.verify = Verify.EVERY_STEP
        every = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert len(checks) >= 10
    assert list(on_change) == list(every) and len(every) == 12


def test_every_step_checks_by_default(qwen3_ckpt, monkeypatch):
    """Without an owner that reports changes (a model used directly), each step checks
    its plan, whole-model or not."""
    model = _load(qwen3_ckpt, "bfloat16")
    assert model.decode_plans.verify is Verify.EVERY_STEP
    checks = _checks(monkeypatch)
    _decode_logits(model, _prompts(model.spec.vocab_size, [6], seed=2), 4)
    assert len(checks) == 3 and model.decode_plans._plans[1].stack is not None


def test_expert_load_is_recorded_alike(qwen3_ckpt):
    """EPLB's load counts (``record_expert_load``) on the plan equal the module path's."""
    model = _load(qwen3_ckpt, "float32")
    prompts = _prompts(model.spec.vocab_size, [6, 4], seed=12)
    counts = []
    for enabled in (True, False):
        model.decode_plans.enabled = enabled
        for moe in model.moe_layers():
            moe.record_expert_load = True
            moe.expert_load.zero_()
        _decode_logits(model, prompts, 3)
        counts.append(torch.stack([moe.expert_load.clone() for moe in model.moe_layers()]))
    assert counts[0].sum() > 0 and torch.equal(counts[0], counts[1])
