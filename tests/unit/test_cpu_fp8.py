"""The C++ FP8 linear and fused MoE (``tidal/kernels/cpu_fp8.py``, ``csrc/fp8_cpu.cpp``,
``csrc/moe_cpu.cpp``) against dequantize-then-matmul: block scales (DeepSeek-V3's 128x128 and smaller, to cross chunk
and block edges on tiny shapes) and a per-tensor scale, every e4m3 value including the
subnormals, odd shapes, float32 and bf16 activations; the pack gives the FP8 bytes back.
The dot kernel (e4m3 -> bf16 by table lookup, vdpbf16ps; where the CPU has AVX512-BF16 and
VBMI) and the AMX kernel (that decode, the products on AMX tiles; where the CPU also has
AMX) against the same reference on bf16 activations and each other, and where the measured
choice offers them."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.cpu_kernels import keep_torch_threads, needs_kernel  # noqa: F401 - fixture
from tidal.kernels.cpu_ext import AMX_VARIANT, DOT_PREFIX, fp8_amx_available, fp8_dot_available
from tidal.kernels.cpu_fp8 import (
    FP8_DTYPE,
    Fp8CpuLinear,
    fp8_fused_experts,
    fp8_linear,
    pack_fp8_experts,
    pack_fp8_linear,
    row_scales,
)
from tidal.kernels.select import weight_candidates
from tidal.moe.reference import fused_experts_reference

pytestmark = needs_kernel
needs_fp8_dot = pytest.mark.skipif(
    not fp8_dot_available(), reason="the FP8 dot kernel needs AVX512-BF16 and AVX512-VBMI"
)

needs_fp8_amx = pytest.mark.skipif(
    not fp8_amx_available(), reason="the FP8 AMX kernel needs AVX512-BF16, VBMI and AMX-BF16"
)


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: scale = amax / 448, q = w / scale in FP8 (the checkpoints' recipe)."""
    bn, bk = block
    n, k = w.shape
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w
    blocks = padded.view(rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).view(rows * bn, cols * bk)[:n, :k]
    return q.to(FP8_DTYPE).contiguous(), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    full = row_scales(scale, n, k, block).repeat_interleave(block[1], dim=1)[:, :k]
    return q.float() * full


@pytest.mark.parametrize(
    "n,k,rows,block",
    [(70, 33, 1, (16, 8)), (130, 300, 5, (128, 128)), (64, 64, 7, (32, 16)), (5, 9, 3, (4, 4))],
)
def test_fp8_linear_matches_dequantize_then_matmul(n, k, rows, block):
    g = torch.Generator().manual_seed(n * k)
    q, scale = _quantize(torch.randn(n, k, generator=g), block)
    packed = pack_fp8_linear(q, scale, block)
    w = _dequantize(q, scale, block)
    x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    want = x @ w.T + bias
    got = fp8_linear(x, packed, bias)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)
    got16 = fp8_linear(x.bfloat16(), packed)
    want16 = x.bfloat16().float() @ w.T
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), want16, atol=1e-5, rtol=2**-7)
    back, back_scales = packed.unpack()
    assert back.dtype == FP8_DTYPE and torch.equal(back.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(back_scales, row_scales(scale, n, k, block))


def test_every_e4m3_value_decodes_exactly_with_a_per_tensor_scale():
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]  # e4m3fn's NaN codes aside
    q = finite.view(FP8_DTYPE).reshape(-1, 1).contiguous()  # [254, 1]: one value per row
    scale = torch.tensor(0.75)
    packed = pack_fp8_linear(q, scale)
    got = fp8_linear(torch.ones(1, 1), packed)[0]
    assert torch.equal(got, q.float()[:, 0] * 0.75)  # subnormals, zero, +-448 included


def test_fp8_rejects_bad_inputs_with_errors():
    q, scale = _quantize(torch.randn(40, 24), (16, 16))
    with pytest.raises(ValueError, match="expected"):
        pack_fp8_linear(q, scale[:, :1], (16, 16))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        pack_fp8_linear(q.float(), scale, (16, 16))
    packed = pack_fp8_linear(q, scale, (16, 16))
    with pytest.raises(ValueError, match="does not match"):
        fp8_linear(torch.randn(3, 16), packed)
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        fp8_linear(torch.randn(3, 24).double(), packed)
    with pytest.raises(RuntimeError, match="bias"):
        fp8_linear(torch.randn(3, 24), packed, torch.randn(39))


def test_pluggable_kernel_takes_row_scales_and_leading_dims():
    q, scale = _quantize(torch.randn(48, 40), (16, 16))
    kernel = Fp8CpuLinear()
    packed = kernel.pack(q, row_scales(scale, 48, 40, (16, 16)), 16)
    x = torch.randn(2, 3, 40)
    want = x @ _dequantize(q, scale, (16, 16)).T
    torch.testing.assert_close(kernel(x, packed, None, "nta"), want, atol=1e-4, rtol=0)


def _fp8_experts(
    g: torch.Generator, num: int, hidden: int, inter: int, block: tuple[int, int]
) -> tuple[Any, tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """``num`` random experts quantized in ``block``s: their C++ pack; the FP8 weights
    and block scales (w13, s13, w2, s2); and the dequantized w13 [E, 2I, H] and w2
    [E, H, I] (float32)."""
    pairs = [
        _quantize(torch.randn(2 * inter, hidden, generator=g) * 0.3, block) for _ in range(num)
    ]
    downs = [_quantize(torch.randn(hidden, inter, generator=g) * 0.3, block) for _ in range(num)]
    w13, s13 = torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    w2, s2 = torch.stack([q for q, _ in downs]), torch.stack([s for _, s in downs])
    packed = pack_fp8_experts(w13, s13, w2, s2, block)
    d13 = torch.stack([_dequantize(q, s, block) for q, s in pairs])
    d2 = torch.stack([_dequantize(q, s, block) for q, s in downs])
    return packed, (w13, s13, w2, s2), d13, d2


@pytest.mark.parametrize(
    "num,hidden,inter,rows,block",
    [(4, 40, 50, 1, (16, 16)), (6, 64, 32, 7, (32, 16)), (8, 33, 17, 13, (128, 128))],
)
def test_fp8_fused_moe_matches_the_reference_on_dequantized_experts(
    num, hidden, inter, rows, block
):
    g = torch.Generator().manual_seed(num)
    packed, (w13, s13, w2, s2), d13, d2 = _fp8_experts(g, num, hidden, inter, block)
    x = torch.randn(rows, hidden, generator=g)
    ids = torch.stack([torch.randperm(num, generator=g)[:2] for _ in range(rows)])
    weights = torch.rand(rows, 2, generator=g)
    want = fused_experts_reference(x, d13, d2, weights, ids)
    got = fp8_fused_experts(x, packed, weights, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)
    got16 = fp8_fused_experts(x.bfloat16(), packed, weights, ids)
    want16 = fused_experts_reference(x.bfloat16().float(), d13, d2, weights, ids)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), want16, atol=1e-2 * want16.abs().max().item(), rtol=0)
    # The pack gives the checkpoint layout back exactly (it is the experts' only copy).
    r13 = torch.stack([row_scales(s, 2 * inter, hidden, block) for s in s13])
    r2 = torch.stack([row_scales(s, hidden, inter, block) for s in s2])
    slots = [num - 1, 0]
    for got_part, want_part in zip(packed.unpack(slots), (w13, w2, r13, r2)):
        assert got_part.dtype == want_part.dtype
        assert torch.equal(got_part.view(torch.uint8), want_part[slots].view(torch.uint8))
    with pytest.raises(ValueError, match="not match"):
        pack_fp8_experts(w13, s13, w2[:, :, :-1], s2, block)


@needs_fp8_dot
@pytest.mark.parametrize(
    "n,k,rows,block",
    [(70, 33, 1, (16, 8)), (130, 300, 7, (128, 128)), (64, 64, 2, (32, 16)), (5, 9, 3, (4, 4))],
)
def test_fp8_dot_linear_matches_dequantize_then_matmul(n, k, rows, block):
    # odd K (33, 9: the last k pair half zero), chunk edges inside a pair row, 1..7 rows
    g = torch.Generator().manual_seed(n + k)
    q, scale = _quantize(torch.randn(n, k, generator=g), block)
    packed = pack_fp8_linear(q, scale, block)
    x, bias = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, generator=g)
    want = x.float() @ _dequantize(q, scale, block).T + bias  # float32 on the same values
    got = fp8_linear(x, packed, bias, 1, True)
    assert got.dtype == torch.bfloat16
    # exact products, float32 sums: only the bf16 output's rounding (and summation order)
    torch.testing.assert_close(got.float(), want, atol=1e-5 * want.abs().max().item(), rtol=2**-8)
    via_kernel = Fp8CpuLinear()(x, packed, bias, DOT_PREFIX + "t0")
    assert torch.equal(via_kernel, got)


@pytest.mark.parametrize(
    "kernel", [pytest.param("dot", marks=needs_fp8_dot), pytest.param("amx", marks=needs_fp8_amx)]
)
def test_the_bf16_decodes_take_every_e4m3_value_exactly(kernel):
    """The dot and AMX kernels' table decode: every finite code, subnormals and +-448."""
    flags = (kernel == "dot", kernel == "amx")
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    q = finite.view(FP8_DTYPE).reshape(-1, 1).contiguous()  # [254, 1]
    packed = pack_fp8_linear(q, torch.tensor(0.75))
    got = fp8_linear(torch.ones(1, 1), packed, None, 1, *flags)  # float32 out: exact
    assert torch.equal(got[0], q.float()[:, 0] * 0.75)
    nan = torch.tensor([[0x7F], [0xFF]], dtype=torch.uint8).view(FP8_DTYPE)
    out = fp8_linear(torch.ones(1, 1), pack_fp8_linear(nan, torch.tensor(1.0)), None, 1, *flags)
    assert out.isnan().all()  # e4m3fn's NaN stays NaN, as the dequantize reference has it


@needs_fp8_dot
def test_fp8_dot_rejects_an_odd_block_k():
    q, scale = _quantize(torch.randn(8, 10), (4, 5))
    packed = pack_fp8_linear(q, scale, (4, 5))
    with pytest.raises(RuntimeError, match="even block_k"):
        fp8_linear(torch.randn(1, 10).bfloat16(), packed, None, 1, True)


@needs_fp8_dot
@pytest.mark.parametrize(
    "num,hidden,inter,rows,block", [(4, 41, 50, 1, (16, 16)), (8, 64, 96, 13, (128, 128))]
)
def test_fp8_dot_fused_moe_matches_the_reference(num, hidden, inter, rows, block):
    g = torch.Generator().manual_seed(hidden)
    packed, _, d13, d2 = _fp8_experts(g, num, hidden, inter, block)
    x = torch.randn(rows, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(num, generator=g)[:2] for _ in range(rows)])
    weights = torch.rand(rows, 2, generator=g)
    want = fused_experts_reference(x.float(), d13, d2, weights, ids)
    got = fp8_fused_experts(x, packed, weights, ids, None, True, 1, True)
    assert got.dtype == torch.bfloat16
    # the intermediate activations are rounded to bf16 (as the kernel's down pass reads them)
    torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(), rtol=0)
    # and it is the dot kernel that ran: the fp16 decode on the same bf16 input differs
    fp16 = fp8_fused_experts(x, packed, weights, ids, None, True, 1, False)
    assert not torch.equal(got, fp16)


def test_the_fp8_dot_kernel_is_a_candidate_for_bf16_activations_only():
    dots = lambda cands: [c for c in cands if c.variant.startswith(DOT_PREFIX)]  # noqa: E731
    assert dots(weight_candidates(FP8_DTYPE, torch.float32, 128)) == []
    assert dots(weight_candidates(FP8_DTYPE, torch.bfloat16, 127)) == []
    offered = dots(weight_candidates(FP8_DTYPE, torch.bfloat16, 128))
    assert (len(offered) > 0) == fp8_dot_available()


@needs_fp8_amx
@pytest.mark.parametrize(
    "n,k,rows,block",
    [
        (70, 33, 1, (16, 8)),  # odd K, chunks of 4 pairs: every tile step short
        (130, 300, 6, (128, 128)),  # 2 full chunks of 4 steps, then 44 k: a step of 6 pairs
        (64, 64, 2, (32, 16)),
        (5, 9, 3, (4, 4)),
        (96, 1000, 5, (128, 128)),
        (64, 96, 4, (64, 96)),  # one chunk of 3 whole steps
        (64, 100, 3, (32, 48)),  # chunks of a whole step and a short one, then 4 k
    ],
)
def test_fp8_amx_linear_matches_dequantize_then_matmul_and_the_dot_kernel(n, k, rows, block):
    g = torch.Generator().manual_seed(3 * n + k)
    q, scale = _quantize(torch.randn(n, k, generator=g), block)
    packed = pack_fp8_linear(q, scale, block)
    x, bias = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, generator=g)
    want = x.float() @ _dequantize(q, scale, block).T + bias
    got = fp8_linear(x.float(), packed, bias, 1, False, True)  # float32 out: no output rounding
    # the same bf16 operands and exact products as the dot kernel; only the sums' order
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
    dot = fp8_linear(x.float(), packed, bias, 1, True)
    torch.testing.assert_close(got, dot, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
    via_kernel = Fp8CpuLinear()(x, packed, bias, AMX_VARIANT)
    assert via_kernel.dtype == torch.bfloat16
    assert torch.equal(via_kernel, fp8_linear(x, packed, bias, 1, False, True))


@needs_fp8_amx
def test_fp8_amx_rejects_an_odd_block_k_and_both_flags():
    q, scale = _quantize(torch.randn(8, 10), (4, 5))
    packed = pack_fp8_linear(q, scale, (4, 5))
    with pytest.raises(RuntimeError, match="even block_k"):
        fp8_linear(torch.randn(1, 10).bfloat16(), packed, None, 1, False, True)
    q, scale = _quantize(torch.randn(8, 10), (4, 2))
    with pytest.raises(RuntimeError, match="two choices"):
        fp8_linear(torch.randn(1, 10), pack_fp8_linear(q, scale, (4, 2)), None, 1, True, True)


@needs_fp8_amx
@pytest.mark.parametrize(
    "num,hidden,inter,rows,block", [(4, 41, 50, 1, (16, 16)), (8, 64, 96, 13, (128, 128))]
)
def test_fp8_amx_fused_moe_matches_the_reference_and_the_dot_kernel(
    num, hidden, inter, rows, block
):
    g = torch.Generator().manual_seed(hidden + 1)
    packed, _, d13, d2 = _fp8_experts(g, num, hidden, inter, block)
    x = torch.randn(rows, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(num, generator=g)[:2] for _ in range(rows)])
    weights = torch.rand(rows, 2, generator=g)
    want = fused_experts_reference(x.float(), d13, d2, weights, ids)
    got = fp8_fused_experts(x.float(), packed, weights, ids, None, True, 1, False, True)
    torch.testing.assert_close(got, want, atol=1e-2 * want.abs().max().item(), rtol=0)
    dot = fp8_fused_experts(x.float(), packed, weights, ids, None, True, 1, True)
    # the same bf16 intermediate up to the sums' order: a rare rounding of it moves a value
    torch.testing.assert_close(got, dot, atol=1e-2 * want.abs().max().item(), rtol=0)
    fp16 = fp8_fused_experts(x.float(), packed, weights, ids, None, True, 1, False)
    assert not torch.equal(got, fp16)  # bf16 activations: not the fp16 decode


def test_the_fp8_amx_kernel_is_a_candidate_where_the_dot_kernel_is_and_amx_runs():
    amx = lambda cands: [c for c in cands if c.variant == AMX_VARIANT]  # noqa: E731
    assert amx(weight_candidates(FP8_DTYPE, torch.float32, 128)) == []
    assert amx(weight_candidates(FP8_DTYPE, torch.bfloat16, 127)) == []
    offered = amx(weight_candidates(FP8_DTYPE, torch.bfloat16, 128))
    assert len(offered) == int(fp8_amx_available() and fp8_dot_available())
