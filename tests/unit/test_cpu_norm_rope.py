"""The fused C++ passes of ``tidal/kernels/csrc/norm_cpu.cpp``, each bit for bit the ops it
replaces, in float32, bfloat16 and float16: the rotary embedding (torch's expression in
the row's dtype), the per-head Q/K norm with its two weights then the rotary
(``rms_norm_heads`` then the rotary), and the residual add before a norm (``x + delta``
then ``rms_norm_cpu``); the layers' entry points, a whole model on the fused paths
against the unfused ones, and the input checks."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels.cpu_ext import kernel_available, kernel_status
from tidal.kernels.cpu_norm import add_rms_norm_cpu, norm_rope_cpu, rms_norm_cpu
from tidal.layers.norm import RMSNorm, rms_norm_heads
from tidal.layers.rotary import (
    RotaryEmbedding,
    apply_norm_rotary,
    apply_partial_rotary,
    apply_rotary_torch,
)

needs_kernel = pytest.mark.skipif(not kernel_available(), reason=kernel_status())
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rotary_torch(x, cos, sin):  # apply_partial_rotary's torch ops, the reference
    rot = cos.shape[-1]
    out = x.clone()
    out[..., :rot] = apply_rotary_torch(x[..., :rot], cos, sin)
    return out


def _qk_and_tables(tokens, heads, head_dim, rotary_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, heads + 2, head_dim, generator=g) * 3).to(dtype)
    rope = RotaryEmbedding(rotary_dim, 4096, 1_000_000.0, dtype=dtype)
    cos, sin = rope.cos_sin(torch.randint(0, 4096, (tokens,), generator=g))
    return qkv[:, :heads], cos, sin, g  # the q|k heads: a strided view, as the model's


# (tokens, heads, head_dim, rotary_dim): full and partial rotary, halves of 16-lane
# multiples, with a tail, and below 16 lanes.
SHAPES = [(1, 6, 64, 64), (33, 20, 128, 128), (5, 3, 2, 2), (0, 4, 8, 8), (4, 5, 128, 64),
          (3, 4, 48, 16), (2, 3, 80, 80), (7, 2, 40, 24)]  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim,rotary_dim", SHAPES)
def test_rotary_is_bit_identical_to_torch(tokens, heads, head_dim, rotary_dim, dtype):
    x, cos, sin, _ = _qk_and_tables(tokens, heads, head_dim, rotary_dim, dtype, head_dim)
    got = norm_rope_cpu(x, cos, sin)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, _rotary_torch(x, cos, sin))
    assert torch.equal(apply_partial_rotary(x, cos, sin), got)  # the layer's entry point


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim,rotary_dim", SHAPES)
def test_norm_rope_is_bit_identical_to_norm_then_rotary(tokens, heads, head_dim, rotary_dim, dtype):
    x, cos, sin, g = _qk_and_tables(tokens, heads, head_dim, rotary_dim, dtype, heads)
    wq, wk = ((torch.randn(head_dim, generator=g) * 0.5 + 1).to(dtype) for _ in range(2))
    weights = (wq, wk)
    hq = heads * 2 // 3
    groups = (hq, heads - hq)
    # Today's unfused path: the C++ norm of every head, each group's weight multiplied in
    # x's dtype, then the torch rotary.
    want = _rotary_torch(rms_norm_heads(x, weights, groups, 1e-6), cos, sin)
    got = norm_rope_cpu(x, cos, sin, weights, hq, 1e-6)
    assert torch.equal(got, want)
    assert torch.equal(apply_norm_rotary(x, cos, sin, weights, groups, 1e-6), want)
    # The torch fallback (the norms' measured choice says torch) stays transformers' formula.
    slow = apply_norm_rotary(x, cos, sin, weights, groups, 1e-6, native=False)
    ref = _rotary_torch(rms_norm_heads(x, weights, groups, 1e-6, native=False), cos, sin)
    assert torch.equal(slow, ref)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1024), (32, 1024), (3, 100), (7, 16), (0, 64), (5, 6, 24)])
def test_add_rms_norm_is_bit_identical_to_add_then_norm(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x, delta = ((torch.randn(*shape, generator=g) * 3).to(dtype) for _ in range(2))
    w = torch.randn(shape[-1], generator=g).to(dtype)
    total, normed = add_rms_norm_cpu(x, delta, w, 1e-6)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, rms_norm_cpu(x + delta, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", [True, False])
def test_add_norm_layer_on_both_paths(kernel, dtype, monkeypatch):
    """``RMSNorm.add_norm`` is ``(x + delta, norm(x + delta))`` on the C++ pass and on the
    torch path the norm's choice falls back to."""
    if kernel and not kernel_available():
        pytest.skip(kernel_status())
    if not kernel:
        monkeypatch.setattr("tidal.layers.norm.rms_norm_cpu_ok", lambda *a: False)
    norm = RMSNorm(48, 1e-6, dtype=dtype)
    norm.weight.data.copy_(torch.randn(48))
    x, delta = torch.randn(5, 48).to(dtype), torch.randn(5, 48).to(dtype)
    total, normed = norm.add_norm(x, delta)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, norm(x + delta))


@needs_kernel
def test_fused_passes_refuse_bad_inputs_naming_them():
    x = torch.randn(3, 2, 8)
    cos = torch.randn(3, 1, 8)
    w = torch.randn(8)
    with pytest.raises(RuntimeError, match="cos/signed_sin must be"):
        norm_rope_cpu(x, cos, cos.bfloat16())
    with pytest.raises(RuntimeError, match="rotary dims"):
        norm_rope_cpu(x, cos[..., :3], cos[..., :3])
    with pytest.raises(RuntimeError, match="rotary dims"):
        norm_rope_cpu(x[..., :4], cos, cos)  # R > Dh
    with pytest.raises(RuntimeError, match="norm weights must be"):
        norm_rope_cpu(x, cos, cos, (w, torch.randn(7)), 1, 1e-6)
    with pytest.raises(RuntimeError, match="split"):
        norm_rope_cpu(x, cos, cos, (w, w), 3, 1e-6)
    with pytest.raises(RuntimeError, match="both norm weights"):
        torch.ops.tidal_cpu.norm_rope(x, cos, cos, w, None, 1, 1e-6)
    with pytest.raises(RuntimeError, match="x must be"):
        norm_rope_cpu(x.double(), cos, cos)
    with pytest.raises(RuntimeError, match="delta must be"):
        add_rms_norm_cpu(x, x[:2], w, 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        add_rms_norm_cpu(x, x, torch.randn(7), 1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_on_the_fused_passes_equals_the_unfused_ops(qwen3_ckpt, dtype, monkeypatch):
    """A tiny Qwen3-MoE (per-head Q/K norm) with its norms on the C++ kernel: prefill and
    decode logits on the fused passes (residual add + norm across the layers, Q/K norm +
    rotary) are bit for bit those of the separate ops."""
    from tests.unit.test_models import PagedRunner, _prompts
    from tidal.launch.engine_args import EngineArgs
    from tidal.models.loader import load_model

    config = EngineArgs(
        model=qwen3_ckpt, dtype=dtype, device="cpu", cpu_kernels="torch"
    ).create_engine_config()
    model = load_model(config)
    model.decode_plans.enabled = False  # the modules' passes (the plan: its own test)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.cpu_choice = None  # the C++ kernel, which the fused passes follow
    prompt = _prompts(model.spec.vocab_size, [9], seed=5)[0]

    def logits() -> torch.Tensor:
        runner = PagedRunner(model, seed=2)
        with torch.inference_mode():
            first = runner.step([("a", 0, prompt)])
            nxt = runner.step([("a", len(prompt), [int(first[-1].argmax())])])
        return torch.cat([first, nxt])

    fused = logits()

    def add_norm(self, x, delta):  # the two ops the fused pass replaces
        x = x + delta
        return x, self(x)

    def norm_rotary(x, cos, sin, weights, groups, eps, native=True, triton=False):
        return _rotary_torch(rms_norm_heads(x, weights, groups, eps, native, triton), cos, sin)

    monkeypatch.setattr(RMSNorm, "add_norm", add_norm)
    monkeypatch.setattr("tidal.models.common.apply_norm_rotary", norm_rotary)
    assert torch.equal(fused, logits())


def test_partial_rotary_matches_transformers():
    """GLM-4.5's partial rotary: the first rotary_dim dims of each head turn (transformers'
    formula on them), the rest pass through."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    head_dim, rotary_dim = 16, 8
    rope = RotaryEmbedding(rotary_dim, 64, 10000.0)
    pos = torch.tensor([0, 5, 17, 63])
    q = torch.randn(4, 3, head_dim)
    cos, sin = rope.cos_sin(pos)
    got = apply_partial_rotary(q, cos, sin)
    half = rotary_dim // 2
    signed = rope.signed_sin_table[pos]
    hf_cos = rope.cos_table[pos][None]  # [1, T, rd]
    hf_sin = torch.cat([-signed[:, :half], signed[:, half:]], -1)[None]
    hf_q = q.transpose(0, 1)[None]  # [1, H, T, Dh]
    want, _ = apply_rotary_pos_emb(hf_q, hf_q, hf_cos, hf_sin)
    torch.testing.assert_close(got, want[0].transpose(0, 1), atol=1e-6, rtol=0)
    assert torch.equal(got[..., rotary_dim:], q[..., rotary_dim:])
