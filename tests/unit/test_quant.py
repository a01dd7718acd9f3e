"""FP8 block-quantized checkpoints (docs/architecture.md#quantization): the quantizer and
held form against plain math, the loader's choices and errors, the reference FP8 paths
against the dequantized checkpoint (Tidal and transformers' model of it), and expert
moves carrying the scales.

One tiny DeepSeek-V3 FP8 checkpoint (hidden 256: two 128-wide blocks; expert
intermediate 192: a full and a partial block; one attention projection left bf16 and
listed in ``modules_to_not_convert``) serves the module."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit.test_models import PagedRunner, _hf_logits, _hf_model, _prompts
from tidal.distributed.tensor_parallel import TensorParallel
from tidal.kernels.cpu_ext import kernel_available, kernel_status
from tidal.kernels.fp8_torch import (
    FP8_DTYPE,
    dequantize_fp8_blocks,
    dequantize_fp8_rows,
    fp8_values,
    quantize_fp8_blocks,
    row_scales,
)
from tidal.kernels.select import Candidate, Choice, choose_paths
from tidal.launch.engine_args import EngineArgs
from tidal.layers.quant import FP8_LINEAR_KERNELS, Fp8BlockMethod, Fp8Linear
from tidal.models.loader import (
    CheckpointError,
    checkpoint_index,
    load_expert_weights,
    load_model,
    load_weights,
    quantize_model,
)
from tidal.models.registry import get_model_class
from tidal.models.tiny import dequantize_checkpoint, make_tiny_fp8_checkpoint
from tidal.moe.eplb import TransferPlan, move_expert_weights
from tidal.moe.layer import FP8_EXPERT_KERNELS, FusedMoE
from tidal.moe.reference import fused_experts_reference


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fp8_ckpt(deepseek_fp8_ckpt) -> str:
    return deepseek_fp8_ckpt


@pytest.fixture(scope="module")
def deq_ckpt(fp8_ckpt, tmp_path_factory) -> str:
    return dequantize_checkpoint(fp8_ckpt, str(tmp_path_factory.mktemp("deq") / "ds3"))


def _load(path: str, **kwargs):
    return load_model(EngineArgs(model=path, device="cpu", **kwargs).create_engine_config())


@pytest.fixture(scope="module")
def fp8_model(fp8_ckpt):
    return _load(fp8_ckpt, cpu_kernels="torch")  # dtype auto: bfloat16; the FP8 reference


@pytest.fixture(scope="module")
def fp8_native(fp8_ckpt):
    """The checkpoint on the C++ FP8 kernels (linears and experts), float32 activations."""
    if not kernel_available():
        pytest.skip(f"the C++ kernels are not built: {kernel_status()}")
    return _load(fp8_ckpt, dtype="float32", cpu_kernels="native")


# ---------------------------------------------------------------- quantizer, held form


def test_block_quantizer_round_trips_within_fp8_precision():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_fp8_blocks(w, (128, 128))
    assert q.dtype == FP8_DTYPE and scale.shape == (2, 3)  # partial last row and column
    for i in range(2):  # each block's largest value lands on FP8's largest
        for j in range(3):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert scale[i, j].item() == pytest.approx(block.abs().max().item() / 448.0)
    back = dequantize_fp8_blocks(q, scale, (128, 128))
    # e4m3 keeps 3 mantissa bits: relative error <= 1/16 of each block's scale step
    err = (back - w).abs() / scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[
        :, :300
    ]
    assert err.max().item() <= 448.0 / 16 + 1e-3
    assert torch.allclose(back, w, atol=0.1, rtol=0.07)


def test_fp8_values_equal_torchs_conversion_for_every_finite_byte():
    q = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    want = q.float()
    finite = ~want.isnan()
    got = fp8_values(q)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float()[finite], want[finite])
    assert torch.signbit(got[0x80]) and got[0x80] == 0  # -0.0 keeps its sign


def test_row_scales_expand_blocks_and_per_tensor_values():
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    rows = row_scales(scale, 130, 200, (128, 128))  # rows 128.. are the partial block
    assert rows.shape == (130, 2)
    assert rows[0].tolist() == [1.0, 2.0] and rows[127].tolist() == [1.0, 2.0]
    assert rows[128].tolist() == [3.0, 4.0] and rows[129].tolist() == [3.0, 4.0]
    assert (row_scales(torch.tensor(0.5), 3, 300, (128, 128)) == 0.5).all()
    with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
        row_scales(torch.ones(1, 2), 130, 200, (128, 128))


def test_held_bytes_are_the_held_weight_and_scales():
    method = Fp8BlockMethod((128, 128))
    w = torch.zeros(130, 200, dtype=torch.float8_e4m3fn)
    held = method.held_scales(torch.ones(2, 2), 130, 200)
    assert method.held_bytes(130, 200) == w.nbytes + held.nbytes == 130 * 200 + 4 * 130 * 2


def test_fp8_linear_reference_equals_dequantized_matmul_and_kernel_hook():
    torch.manual_seed(0)
    method = Fp8BlockMethod((128, 128))
    w = torch.randn(192, 256)
    q, scale = quantize_fp8_blocks(w, method.block)
    lin = Fp8Linear(256, 192, method, bias_dtype=torch.float32)
    lin.weight.data.copy_(q)
    lin.weight_scale.copy_(row_scales(scale, 192, 256, method.block))
    assert lin.bias is not None
    lin.bias.data.copy_(torch.randn(192))
    x = torch.randn(5, 256)
    want = x @ dequantize_fp8_blocks(q, scale, method.block).T + lin.bias
    assert torch.allclose(lin(x), want, atol=1e-5)
    assert lin(x.bfloat16()).dtype == torch.bfloat16  # w8a16: the activation's dtype

    if not kernel_available():
        return
    # The C++ kernel (FP8_LINEAR_KERNELS["native"]): its pack is the only copy, the weight
    # and scales read back exactly, and what write_weights writes is packed again.
    q8, scales = q.clone(), lin.read_weights(["weight_scale"])["weight_scale"]
    lin.set_cpu_path("linear", _forced("native"))
    lin.pack_weights()
    assert lin.is_released("weight") and lin.is_released("weight_scale")
    assert torch.allclose(lin(x), want, atol=1e-5)
    with pytest.raises(AttributeError, match=r"read_weights\(\['weight_scale'\]\)"):
        lin.weight_scale  # noqa: B018 - the read is the test
    got = lin.read_weights()
    assert torch.equal(got["weight"].view(torch.uint8), q8.view(torch.uint8))
    assert torch.equal(got["weight_scale"], scales)
    lin.write_weights({"weight_scale": 2 * scales})  # the weight: rebuilt from the pack
    torch.testing.assert_close(lin(x) - lin.bias, 2 * (want - lin.bias), atol=1e-4, rtol=0)
    negated = (q8.view(torch.uint8) ^ 0x80).view(FP8_DTYPE)  # e4m3's sign bit flipped
    lin.write_weights({"weight": negated})
    assert lin.is_released("weight") and "weight" not in lin._parameters  # packed again
    torch.testing.assert_close(lin(x) - lin.bias, -2 * (want - lin.bias), atol=1e-4, rtol=0)
    lin.set_cpu_path("linear", _forced("torch"))  # back to the parameters, exact
    assert not lin.is_released("weight")
    assert torch.equal(lin.weight_scale, 2 * scales)
    assert torch.equal(lin.weight.view(torch.uint8), negated.view(torch.uint8))


def _forced(path: str, variant: str = "") -> Choice:
    if path == "native" and not variant:
        variant = "t0"
    c = Candidate(path, variant)
    return Choice.fixed(c, path, "forced")


# ---------------------------------------------------------------- loading


def test_fp8_weights_stay_fp8_and_unconverted_modules_keep_the_dtype(fp8_ckpt, fp8_model):
    m = fp8_model
    assert m.quant is not None and m.embed_tokens.weight.dtype == torch.bfloat16
    attn0, attn1 = m.layers[0].self_attn, m.layers[1].self_attn
    assert isinstance(attn1.o_proj, Fp8Linear) and isinstance(attn1.q_proj, Fp8Linear)
    assert not isinstance(attn0.o_proj, Fp8Linear)  # listed in modules_to_not_convert
    assert attn0.o_proj.weight.dtype == torch.bfloat16
    assert attn1.kv_b_proj.dtype == torch.bfloat16  # read per head: dequantized at load
    moe = m.layers[1].mlp
    assert isinstance(moe, FusedMoE) and moe.gate.dtype == torch.bfloat16  # the router
    assert moe.w13.dtype == moe.w2.dtype == FP8_DTYPE
    assert moe.w13_scale is not None and moe.w13_scale.shape == (8, 384, 2)
    assert moe.w2_scale is not None and moe.w2_scale.shape == (8, 256, 2)  # 192: 2 blocks
    # The held expert is the checkpoint's bytes, its scales the checkpoint's blocks.
    state = load_file(os.path.join(fp8_ckpt, "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    up = moe.w13.data[3, 192:]
    assert torch.equal(up.view(torch.uint8), state[name].view(torch.uint8))
    want = row_scales(state[f"{name}_scale_inv"], 192, 256, (128, 128))
    assert torch.equal(moe.w13_scale[3, 192:], want)
    # FP8 weights take a quarter of float32's bytes (plus the row scales).
    fp8_bytes = sum(p.nbytes for p in m.parameters() if p.dtype == FP8_DTYPE)
    fp8_elems = sum(p.numel() for p in m.parameters() if p.dtype == FP8_DTYPE)
    assert fp8_bytes * 4 == fp8_elems * torch.float32.itemsize


def _rewrite(src: str, dst, edit) -> str:
    import shutil

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})
    return str(dst)


W = "model.layers.1.self_attn.q_b_proj.weight"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.pop(f"{W}_scale_inv"), f"'{W}' in model.safetensors is .*no scale for it"),
        (
            lambda s: s.__setitem__(f"{W}_scale_inv", torch.ones(3, 3)),
            rf"'{W}_scale_inv' in model.safetensors \(of '{W}'\): scale shape \(3, 3\), "
            r"expected \(1, 1\)",
        ),
        (
            lambda s: s.__setitem__(W, s[W].float().to(torch.float8_e5m2)),
            rf"'{W}' in model.safetensors has scale '{W}_scale_inv' but dtype "
            r"torch.float8_e5m2, not torch.float8_e4m3fn",
        ),
        (  # one part of a fused module quantized, another not
            lambda s: s.__setitem__(
                "model.layers.1.mlp.shared_experts.up_proj.weight",
                torch.zeros(192, 256, dtype=torch.bfloat16),
            ),
            r"'model.layers.1.mlp.shared_experts.gate_proj.weight' in model.safetensors is "
            r"torch.float8_e4m3fn but 'model.layers.1.mlp.shared_experts.up_proj.weight' "
            r"\(BF16 in model.safetensors\), which one module holds with it, is not quantized",
        ),
    ],
    ids=["missing-scale", "scale-shape", "dtype", "mixed-module"],
)
def test_load_errors_name_the_tensor_and_file(fp8_ckpt, tmp_path, edit, match):
    bad = _rewrite(fp8_ckpt, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=match):
        _load(bad)


def test_unsupported_quant_method_is_named_with_the_file(fp8_ckpt, tmp_path):
    import shutil

    bad = tmp_path / "awq"
    shutil.copytree(fp8_ckpt, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization: .*quant_method 'awq' in .*config\.json"):
        EngineArgs(model=str(bad), device="cpu").create_engine_config()
    with pytest.raises(ValueError, match="fp8.*does not match.*'awq'"):
        EngineArgs(model=str(bad), quantization="fp8").create_engine_config()


def test_quantization_flag_and_dtype_resolution(fp8_ckpt, deq_ckpt):
    cfg = EngineArgs(model=fp8_ckpt, device="cpu").create_engine_config()
    assert (cfg.model.quantization, cfg.model.dtype) == ("fp8", "bfloat16")
    cfg = EngineArgs(model=fp8_ckpt, quantization="fp8", dtype="float32").create_engine_config()
    assert (cfg.model.quantization, cfg.model.dtype) == ("fp8", "float32")
    with pytest.raises(ValueError, match="quantization: .*no quantization_config"):
        EngineArgs(model=deq_ckpt, quantization="fp8").create_engine_config()


def test_per_tensor_scales(qwen3_ckpt, tmp_path):
    """Qwen3-MoE (fused q|k|v, gate|up) with one scale per tensor."""
    path = make_tiny_fp8_checkpoint(str(tmp_path / "pt"), source=qwen3_ckpt, block=None)
    state = load_file(os.path.join(path, "model.safetensors"))
    assert state["model.layers.0.self_attn.q_proj.weight_scale"].shape == ()
    ours = _load(path, dtype="float32")
    deq = _load(dequantize_checkpoint(path, str(tmp_path / "deq")))
    (prompt,) = _prompts(512, [11], seed=2)
    got = PagedRunner(ours).step([("a", 0, prompt)])
    want = PagedRunner(deq).step([("a", 0, prompt)])
    assert (got - want).abs().max().item() < 1e-4


# ---------------------------------------------------------------- parity


def _tp_worker(path: str, rank: int, size: int, quantized: bool):
    """TP worker ``rank`` of ``size``'s model of ``path``, float32, weights loaded (no
    process group: built and filled as ``load_model`` does, without the shared trials)."""
    mc = EngineArgs(model=path, device="cpu", dtype="float32").create_engine_config().model
    model = get_model_class(mc.architecture)(
        mc.hf_config, dtype=torch.float32, device="cpu", moe_backend="torch",
        tp=TensorParallel(rank, size),
    )  # fmt: skip
    if quantized:
        quantize_model(model, Fp8BlockMethod.from_config(mc.hf_config.quantization_config, path),
                       checkpoint_index(path))  # fmt: skip
    load_weights(model, path)
    return model


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp_workers_fp8_block_dequantizes_to_its_block_of_the_weights(qwen3_ckpt, tmp_path, rank):
    """Each of 2 workers' FP8 weights and scales (q|k|v and gate|up rows split inside a
    32-row scale block: the held scales are per row; o_proj and down_proj input columns
    split on 16-wide blocks) equal, dequantized, that worker's block of the dequantized
    checkpoint as the unquantized TP path splits it."""
    fp8 = make_tiny_fp8_checkpoint(str(tmp_path / "fp8"), source=qwen3_ckpt, block=(32, 16))
    deq = dequantize_checkpoint(fp8, str(tmp_path / "deq"), "float32")
    got, want = _tp_worker(fp8, rank, 2, True), _tp_worker(deq, rank, 2, False)
    method = Fp8BlockMethod((32, 16))
    linears = [(n, m) for n, m in got.named_modules() if isinstance(m, Fp8Linear)]
    assert {n.rsplit(".", 1)[-1] for n, _ in linears} == {"qkv_proj", "o_proj"}
    for name, module in linears:
        w = module.read_weights(["weight", "weight_scale"])
        held = method.dequantize(w["weight"], w["weight_scale"], torch.float32)
        assert torch.equal(held, want.get_submodule(name).read_weights(["weight"])["weight"]), name
    for moe, plain in zip(got.moe_layers(), want.moe_layers()):
        w = moe.read_weights(["w13", "w2", "w13_scale", "w2_scale"])
        p = plain.read_weights(["w13", "w2"])
        assert torch.equal(method.dequantize(w["w13"], w["w13_scale"], torch.float32), p["w13"])
        assert torch.equal(method.dequantize(w["w2"], w["w2_scale"], torch.float32), p["w2"])


def test_a_tp_split_inside_a_scale_block_is_refused_naming_the_flag(fp8_ckpt):
    """The dense layer's intermediate 320 (and the experts' 192) over 2 workers:
    down_proj's input columns split at 160 (96), inside a 128-wide block; every worker
    refuses (rank 0's own block starts at 0)."""
    mc = EngineArgs(model=fp8_ckpt, device="cpu").create_engine_config().model
    method = Fp8BlockMethod.from_config(mc.hf_config.quantization_config, fp8_ckpt)
    for rank in (0, 1):
        model = get_model_class(mc.architecture)(
            mc.hf_config, dtype=torch.bfloat16, device="cpu", moe_backend="torch",
            tp=TensorParallel(rank, 2),
        )  # fmt: skip
        with pytest.raises(
            CheckpointError,
            match=r"--tensor-parallel-size 2: tensor 'model.layers.0.mlp.down_proj.weight' "
            r"\[256, 320\] in model.safetensors cannot be split: input columns \[160, 320\) "
            r"start inside a 128-wide scale block",
        ):
            quantize_model(model, method, checkpoint_index(fp8_ckpt))


def _teacher_forced(model, prompts):  # [sum(len), V] log-probabilities
    return torch.cat(
        [PagedRunner(model).step([("a", 0, p)]).float().log_softmax(-1) for p in prompts]
    )


def test_fp8_parity_with_transformers_on_the_dequantized_checkpoint(fp8_ckpt, deq_ckpt, fp8_model):
    """Reference: transformers' DeepSeek-V3 on the FP8 checkpoint dequantized to float32.
    Tidal on that folder is exact (the float32 guarantee); Tidal serving the FP8 folder in
    float32 holds the same values, so it is too; in bfloat16 it is exactly the dequantized
    model run in bfloat16 on the same (torch) path (the FP8 path adds no error of its own),
    which is close."""
    prompts = _prompts(512, [16, 16, 16, 16], seed=3)
    hf = _hf_model(deq_ckpt)
    with torch.no_grad():
        ref = torch.cat([_hf_logits(hf, p).log_softmax(-1) for p in prompts])
    top = ref.argmax(-1, keepdim=True)
    for model in (_load(deq_ckpt), _load(fp8_ckpt, dtype="float32", cpu_kernels="torch")):
        got = _teacher_forced(model, prompts)
        assert (got - ref).abs().max().item() < 1e-4
    got = _teacher_forced(fp8_model, prompts)
    deq16 = _load(deq_ckpt, dtype="bfloat16", cpu_kernels="torch")
    assert torch.equal(got, _teacher_forced(deq16, prompts))
    agree = (got.argmax(-1, keepdim=True) == top).float().mean().item()
    diff = (got.gather(1, top) - ref.gather(1, top)).abs().squeeze(1)  # at the reference's pick
    assert agree >= 0.85, agree
    assert diff.quantile(0.9).item() < 0.2, diff


# ---------------------------------------------------------------- expert moves


def test_expert_reads_and_moves_carry_the_scales_exactly(fp8_ckpt, fp8_model):
    moe = fp8_model.layers[1].mlp
    parts = moe.expert_weights([2, 5])
    assert [p.dtype for p in parts] == [FP8_DTYPE, FP8_DTYPE, torch.float32, torch.float32]
    assert [tuple(p.shape[1:]) for p in parts] == [s for s, _ in moe.expert_part_specs()]
    # The disk fallback of a transfer reads the same bytes and scales.
    disk = load_expert_weights(fp8_model, fp8_ckpt, {1: [2, 5]})
    for i, e in enumerate((2, 5)):
        for held, read in zip(parts, disk[1, e]):
            assert torch.equal(held[i].view(torch.uint8), read.view(torch.uint8))
    # A local EPLB move (a one-rank swap of slots 2 and 5) moves weights with scales.
    names = moe.expert_part_names()
    before = list(moe.read_weights(names).values())
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(0))
    weights = torch.tensor([[0.7, 0.3]] * 6)
    out = moe.forward_experts(x, weights, torch.tensor([[2, 5]] * 6))
    swap = TransferPlan((), (), ((2, 5), (5, 2)))
    move_expert_weights(moe, swap, None)
    try:
        for b, a in zip(before, moe.read_weights(names).values()):
            assert torch.equal(a[5].view(torch.uint8), b[2].view(torch.uint8))
            assert torch.equal(a[2].view(torch.uint8), b[5].view(torch.uint8))
        # expert 2's weights now sit in slot 5 (the map is the identity here)
        got = moe.forward_experts(x, weights, torch.tensor([[5, 2]] * 6))
        assert torch.allclose(got, out, atol=1e-5)
    finally:
        move_expert_weights(moe, swap, None)  # back: the module's other tests share it
    for b, a in zip(before, moe.read_weights(names).values()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_native_fp8_experts_hold_one_copy_and_move_exactly(fp8_model, fp8_native):
    """The C++ FP8 experts' pack is the only copy of the experts and their scales: reads
    rebuild them exactly, an EPLB move (a write) is packed again, and the kernel then
    serves the moved experts like the reference."""
    ref, moe = fp8_model.layers[1].mlp, fp8_native.layers[1].mlp
    assert all(moe.is_released(n) for n in ("w13", "w2", "w13_scale", "w2_scale"))
    assert not any(p.dtype == FP8_DTYPE for p in fp8_native.parameters())  # held packed only
    for a, b in zip(moe.expert_weights([2, 5]), ref.expert_weights([2, 5])):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    weights, ids = (
        torch.tensor([[0.6, 0.4]] * 5),
        torch.tensor([[1, 6], [0, 2], [3, 4], [6, 1], [7, 5]]),
    )
    want = ref.fp8_reference(x, weights, ids, None)
    torch.testing.assert_close(moe.forward_experts(x, weights, ids), want, atol=1e-5, rtol=0)
    swap = TransferPlan((), (), ((1, 6), (6, 1)))
    move_expert_weights(moe, swap, None)  # a write: packed again
    try:
        assert moe.is_released("w13") and "w13" not in moe._parameters  # one copy
        swapped = torch.where(ids == 1, 6, torch.where(ids == 6, 1, ids))
        got = moe.forward_experts(x, weights, swapped)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    finally:
        move_expert_weights(moe, swap, None)
    for a, b in zip(moe.expert_weights(list(range(8))), ref.expert_weights(list(range(8)))):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_native_fp8_parity_with_the_reference(fp8_ckpt, fp8_native, qwen3_ckpt, tmp_path):
    """The C++ FP8 path against the torch reference on the same checkpoint, float32
    activations: logits close and the greedy tokens equal (DeepSeek-V3, 128x128 blocks;
    Qwen3-MoE, fused q|k|v and gate|up, per-tensor scales)."""
    prompts = _prompts(512, [12, 9], seed=5)
    ref = _load(fp8_ckpt, dtype="float32", cpu_kernels="torch")
    assert isinstance(fp8_native.layers[1].self_attn.q_proj, Fp8Linear)
    assert fp8_native.layers[1].self_attn.q_proj.is_released("weight")
    got, want = _teacher_forced(fp8_native, prompts), _teacher_forced(ref, prompts)
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    path = make_tiny_fp8_checkpoint(str(tmp_path / "pt"), source=qwen3_ckpt, block=None)
    native = _load(path, dtype="float32", cpu_kernels="native")
    torch_ = _load(path, dtype="float32", cpu_kernels="torch")
    got, want = _teacher_forced(native, prompts), _teacher_forced(torch_, prompts)
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("slow", ["native", "torch"])
def test_the_measured_fp8_path_follows_the_timings(slow, tmp_path, monkeypatch):
    """The FP8 linear and experts join the measured choice (op keys fp8_linear / fp8_moe):
    whichever path the clock makes slow is not chosen, and the module serves by the one
    chosen (the kernel's pack, or the reference's parameters)."""
    if not kernel_available():
        pytest.skip(f"the C++ kernels are not built: {kernel_status()}")
    now = [0.0]
    cost = {"native": 1e-4, "torch": 1e-4}
    cost[slow] = 1e-2

    def timed(fn, path):
        def run(*args, **kwargs):
            now[0] += cost[path]
            return fn(*args, **kwargs)

        return run

    class Timed:  # the C++ kernels, charged their fake cost on the fake clock
        def __init__(self, kernel):
            self.kernel = kernel

        def __getattr__(self, name):
            return getattr(self.kernel, name)

        def __call__(self, *args):
            return timed(self.kernel, "native")(*args)

    monkeypatch.setitem(FP8_LINEAR_KERNELS, "native", Timed(FP8_LINEAR_KERNELS["native"]))
    monkeypatch.setitem(FP8_EXPERT_KERNELS, "native", Timed(FP8_EXPERT_KERNELS["native"]))
    monkeypatch.setattr(Fp8Linear, "reference", timed(Fp8Linear.reference, "torch"))
    monkeypatch.setattr(FusedMoE, "fp8_reference", timed(FusedMoE.fp8_reference, "torch"))
    method = Fp8BlockMethod((32, 32))
    lin = Fp8Linear(64, 48, method)
    moe = FusedMoE(4, 2, 64, 48, True)
    moe.hold_fp8(32)

    # The fake costs on top of real time scaled down 100x: the ops not faked (the
    # router) still time above zero, the faked ones by their fake cost alone.
    def clock() -> float:
        return now[0] + time.perf_counter() * 1e-2

    report = choose_paths([lin, moe], cache_dir=str(tmp_path), batch_rows=8, clock=clock)
    fast = "torch" if slow == "native" else "native"
    for name in ("fp8_linear[64x48x0x32]", "fp8_moe[4x64x48x2x4x32]"):
        choice = report.choices[name]
        assert choice.layout == choice.decode.path == choice.batch.path == fast, choice
    lin.pack_weights()
    moe.pack_weights()
    assert lin.is_released("weight") == moe.is_released("w13") == (fast == "native")


def test_fp8_experts_dequantized_a_chunk_at_a_time_add_up(fp8_model, monkeypatch):
    from tidal.moe import layer

    moe = fp8_model.layers[1].mlp
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(2))
    weights = torch.tensor([[0.6, 0.4]] * 7)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 0], [3, 2], [5, 4]])
    whole = moe.forward_experts(x, weights, ids)  # all 8 experts in one chunk
    monkeypatch.setattr(layer, "_FP8_DEQUANT_BYTES", 1)  # one expert per chunk
    assert torch.allclose(moe.forward_experts(x, weights, ids), whole, atol=1e-5)
    ref = fused_experts_reference(
        x, *(dequantize_fp8_rows(w, s, 128, torch.float32) for w, s in (
            (moe.w13.data, moe.w13_scale), (moe.w2.data, moe.w2_scale)
        )), weights, ids, None, True,
    )  # fmt: skip
    assert torch.allclose(whole, ref, atol=1e-5)
