"""Triton block-FP8 (w8a8) kernels against their torch references (tidal/kernels/fp8_torch.py).

Run on CPU under the Triton interpreter (tests/kernels/conftest.py), which handles float8
tensors: loads decode e4m3 exactly and FP8 ``tl.dot`` works; its float32 -> e4m3 cast
does not round correctly, which the quantizer works around (``ROUND_IN_FP32``), so the
quantized bytes are compared exactly here."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels import fp8_torch as ft
from tidal.kernels.fp8_triton import (
    fp8_linear,
    fused_experts_fp8,
    per_token_group_quant_fp8,
    w8a8_block_fp8_gemm,
)
from tidal.kernels.moe_config import MoeKernelConfig, load_linear_configs, load_tuned_configs

FP8 = torch.float8_e4m3fn


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double().cpu()
    return float((got.double().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-6))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def fp8_weight(rows: int, cols: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [rows, cols] weight quantized in block x block blocks: q, row scales."""
    w = torch.randn(rows, cols) / cols**0.5
    q, s = ft.quantize_fp8_blocks(w, (block, block))
    return q, ft.row_scales(s, rows, cols, (block, block))


def fp8_experts(experts: int, hidden: int, inter: int, block: int):
    parts = [
        (*fp8_weight(2 * inter, hidden, block), *fp8_weight(hidden, inter, block))
        for _ in range(experts)
    ]
    return [torch.stack(p) for p in zip(*parts)]  # w13, s13, w2, s2


@pytest.mark.parametrize(
    "rows,cols,group,dtype",
    [
        (37, 200, 32, torch.float32),  # partial last group, many row blocks
        (5, 300, 128, torch.bfloat16),
        (1, 40, 32, torch.float16),
    ],
)
def test_quant_bytes_equal_reference(rows, cols, group, dtype, device):
    x = (torch.randn(rows, cols) * torch.logspace(-4, 2, cols)).to(dtype)
    x[0, :group] = 0.0  # an all-zero group: the floor keeps its scale finite
    x[-1, -3:] = -0.0
    q, s = per_token_group_quant_fp8(x.to(device), group)
    want_q, want_s = ft.per_token_group_quant_fp8_torch(x, group)
    assert q.dtype == FP8 and q.shape == x.shape
    assert s.shape == (rows, -(-cols // group)) and s.dtype == torch.float32
    assert same_bytes(q, want_q)
    assert torch.equal(s.cpu(), want_s)


def test_quant_rounds_to_nearest_even(device):
    """Scale 1 (the group's max is 448): every e4m3 value, every midpoint between two
    (a tie: to the even mantissa), and values just either side of a midpoint."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    mid = (grid[:-1] + grid[1:]) / 2
    eps = mid * 2.0**-12
    vals = torch.cat([grid, mid, mid - eps, mid + eps])
    is_mid = torch.cat([torch.zeros(127), torch.ones(126), torch.zeros(252)]).bool()
    pad = -(2 * vals.numel()) % 127
    body = torch.nn.functional.pad(torch.cat([vals, -vals]), (0, pad)).view(-1, 127)
    mids = torch.nn.functional.pad(torch.cat([is_mid, is_mid]), (0, pad)).view(-1, 127)
    x = torch.cat([torch.full((body.shape[0], 1), 448.0), body], dim=1)  # [R, 128]
    q, s = per_token_group_quant_fp8(x.to(device), 128)
    assert torch.all(s.cpu() == 1.0)
    assert same_bytes(q, x.to(FP8))  # torch's cast: round to nearest even
    tie_bytes = q.cpu()[:, 1:][mids].view(torch.uint8)
    assert tie_bytes.numel() == 252 and torch.all(tie_bytes % 2 == 0)


def test_quant_reference_is_within_half_a_step():
    """The reference means what it says: |x - q*s| <= half an e4m3 step of |x| / s."""
    x = torch.randn(8, 256) * 3
    q, s = ft.per_token_group_quant_fp8_torch(x, 64)
    back = ft.dequantize_fp8_rows(q, s, 64, torch.float32)
    full = s.repeat_interleave(64, 1)
    step = torch.exp2(torch.floor(torch.log2(x.abs() / full)).clamp(min=-6) - 3)
    assert torch.all((back - x).abs() <= step * full / 2 * (1 + 1e-6))
    assert torch.allclose(s * ft.FP8_MAX, x.view(8, 4, 64).abs().amax(-1), rtol=1e-6)


LINEAR_CASES = [
    # (M, N, K, group, config or None)
    (5, 45, 200, 32, None),
    (1, 33, 128, 64, MoeKernelConfig(16, 16, 32)),  # BLOCK_K < group: 2 tiles per scale
    (19, 40, 80, 32, MoeKernelConfig(16, 32, 64, group_size_m=2)),  # BLOCK_K > group: clamped
    (3, 20, 64, 32, MoeKernelConfig(16, 16, 16)),  # BLOCK_K 16: raised to FP8's 32
    # split-K: 7 groups in splits of 3, 3, 1 (the last split partial)
    (5, 45, 200, 32, MoeKernelConfig(16, 16, 32, split_k=3)),
    # more splits asked than groups: one a group, two 32-deep tiles each
    (2, 40, 256, 64, MoeKernelConfig(16, 32, 32, split_k=8)),
]


@pytest.mark.parametrize("m,n,k,group,config", LINEAR_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_gemm_matches_reference(m, n, k, group, config, bias, device):
    w, ws = fp8_weight(n, k, group)
    x = torch.randn(m, k)
    b = torch.randn(n) if bias else None
    xq, xs = ft.per_token_group_quant_fp8_torch(x, group)
    args = [t if t is None else t.to(device) for t in (xq, xs, w, ws)]
    got = w8a8_block_fp8_gemm(*args, group, torch.float32,
                              None if b is None else b.to(device), config)  # fmt: skip
    want = ft.w8a8_linear_torch(x, w, ws, group, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_close_to_the_unquantized_product(dtype, device):
    """The w8a8 linear against the reference and, loosely, against the float32 product of
    the dequantized weight (what w8a8 approximates: e4m3 has 3 mantissa bits)."""
    w, ws = fp8_weight(24, 96, 32)
    x = torch.randn(2, 3, 96).to(dtype)
    got = fp8_linear(x.to(device), w.to(device), ws.to(device), 32)
    assert got.shape == (2, 3, 24) and got.dtype == dtype
    want = ft.w8a8_linear_torch(x.view(6, 96), w, ws, 32).view(2, 3, 24)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    exact = x.float() @ ft.dequantize_fp8_rows(w, ws, 32, torch.float32).T
    assert 1e-4 < rel_err(got, exact) < 0.1


MOE_CASES = [
    # (T, H, I, E, top_k, group, BLOCK_SIZE_M)
    (9, 48, 40, 4, 2, 32, 16),  # H, I not multiples of the group
    (1, 32, 16, 6, 3, 32, 16),  # one decode token, I shorter than a group
    (21, 64, 32, 8, 2, 32, 32),  # grouped row blocks, empty experts
]


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,group,block_m", MOE_CASES)
def test_fused_experts_fp8_matches_reference(
    tokens, hidden, inter, experts, top_k, group, block_m, device
):
    w13, s13, w2, s2 = fp8_experts(experts, hidden, inter, group)
    x = torch.randn(tokens, hidden)
    tw = torch.softmax(torch.randn(tokens, top_k), dim=-1)
    ids = torch.argsort(torch.rand(tokens, experts), dim=1)[:, :top_k].contiguous()
    config = MoeKernelConfig(block_m, 32, 32, group_size_m=2)
    args = [t.to(device) for t in (x, w13, w2, s13, s2)]
    got = fused_experts_fp8(*args, group, tw.to(device), ids.to(device), config=config)
    want = ft.fused_experts_fp8_torch(x, w13, w2, s13, s2, group, tw, ids)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-4
    # against the unquantized MoE on the dequantized weights (w8a16 in float32)
    from tidal.moe.reference import fused_experts_reference

    exact = fused_experts_reference(
        x, ft.dequantize_fp8_rows(w13, s13, group, torch.float32),
        ft.dequantize_fp8_rows(w2, s2, group, torch.float32), tw, ids,
    )  # fmt: skip
    assert rel_err(got, exact) < 0.1


def test_fused_experts_fp8_expert_map_bf16_default_config(device):
    """An EP rank with 3 of 10 experts, bf16 activations, the default config."""
    w13, s13, w2, s2 = fp8_experts(3, 32, 32, 32)
    x = torch.randn(7, 32).bfloat16()
    tw = torch.softmax(torch.randn(7, 2), dim=-1)
    ids = torch.argsort(torch.rand(7, 10), dim=1)[:, :2].contiguous()
    ids[0] = torch.tensor([1, 2])  # no local expert: a zero row
    emap = torch.full((10,), -1, dtype=torch.int32)
    emap[torch.tensor([9, 0, 4])] = torch.arange(3, dtype=torch.int32)
    args = [t.to(device) for t in (x, w13, w2, s13, s2)]
    got = fused_experts_fp8(*args, 32, tw.to(device), ids.to(device), emap.to(device))
    want = ft.fused_experts_fp8_torch(x, w13, w2, s13, s2, 32, tw, ids, emap)
    assert got.dtype == torch.bfloat16
    assert torch.all(got[0].cpu() == 0)
    assert rel_err(got, want) < 3e-2
    empty = fused_experts_fp8(args[0][:0], *args[1:], 32, tw[:0].to(device), ids[:0].to(device))
    assert empty.shape == (0, 32)


def _bad_calls():
    w13, s13, w2, s2 = fp8_experts(2, 32, 16, 32)
    x, tw, ids = torch.randn(3, 32), torch.rand(3, 2), torch.tensor([[0, 1]] * 3)
    q, s = ft.per_token_group_quant_fp8_torch(x, 32)
    wq, ws = fp8_weight(8, 32, 32)
    return [
        (lambda: per_token_group_quant_fp8(x, 48), ValueError),  # group not a power of 2
        (lambda: per_token_group_quant_fp8(x, 16), ValueError),  # an 8-bit dot needs K >= 32
        (lambda: per_token_group_quant_fp8(x.double(), 32), TypeError),
        (lambda: per_token_group_quant_fp8(x[0], 32), ValueError),
        (lambda: w8a8_block_fp8_gemm(q.float(), s, wq, ws, 32, torch.float32), TypeError),
        (lambda: w8a8_block_fp8_gemm(q, s[:, :0], wq, ws, 32, torch.float32), ValueError),
        (lambda: w8a8_block_fp8_gemm(q, s, wq, ws, 16, torch.float32), ValueError),
        (lambda: w8a8_block_fp8_gemm(q, s, wq[:, :16], ws, 32, torch.float32), ValueError),
        (lambda: fused_experts_fp8(x, w13, w2, s13, s2[:, :, :0], 32, tw, ids), ValueError),
        (lambda: fused_experts_fp8(x, w13.float(), w2, s13, s2, 32, tw, ids), TypeError),
        (lambda: fused_experts_fp8(x, w13, w2, s13.repeat(1, 1, 2), s2, 32, tw, ids), ValueError),
        (lambda: fused_experts_fp8(x, w13, w2[:, :16], s13, s2, 32, tw, ids), ValueError),
        (lambda: fused_experts_fp8(x, w13, w2, s13, s2, 32, tw.double(), ids), TypeError),
        (
            lambda: fused_experts_fp8(
                x, w13, w2, s13, s2, 32, tw, ids, config=MoeKernelConfig(16, 32, 32, split_k=2)
            ),
            ValueError,
        ),
    ]


@pytest.mark.parametrize("case", range(14))
def test_fp8_wrappers_reject_bad_arguments(case):
    call, err = _bad_calls()[case]
    with pytest.raises(err):
        call()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_fp8_kernels_compiled_gpu(tokens):
    """Compiled, 128-wide groups, bf16: quantizer bytes, linear and fused MoE."""
    x = torch.randn(tokens, 512).bfloat16()
    q, s = per_token_group_quant_fp8(x.cuda(), 128)
    want_q, want_s = ft.per_token_group_quant_fp8_torch(x, 128)
    assert same_bytes(q, want_q) and torch.equal(s.cpu(), want_s)
    w, ws = fp8_weight(384, 512, 128)
    got = fp8_linear(x.cuda(), w.cuda(), ws.cuda(), 128)
    assert rel_err(got, ft.w8a8_linear_torch(x, w, ws, 128)) < 1e-2
    split = w8a8_block_fp8_gemm(q, s, w.cuda(), ws.cuda(), 128, torch.bfloat16, None,
                                MoeKernelConfig(16, 64, 128, split_k=4))  # fmt: skip
    assert rel_err(split, ft.w8a8_linear_torch(x, w, ws, 128)) < 1e-2
    w13, s13, w2, s2 = fp8_experts(16, 512, 256, 128)
    tw = torch.softmax(torch.randn(tokens, 4), dim=-1)
    ids = torch.argsort(torch.rand(tokens, 16), dim=1)[:, :4].contiguous()
    args = [t.cuda() for t in (x, w13, w2, s13, s2)]
    got = fused_experts_fp8(*args, 128, tw.cuda(), ids.cuda())
    want = ft.fused_experts_fp8_torch(x, w13, w2, s13, s2, 128, tw, ids)
    # bf16 intermediates, re-quantized: an e4m3 rounding that flips moves a value by up to
    # 1/16 of it (0.030 measured on an H200; the float32 reference has no such step)
    assert rel_err(got, want) < 5e-2


def test_fp8_linear_layer_takes_the_triton_path(device):
    """``Fp8Linear`` with its Triton path on (as on CUDA): the w8a8 result, the bias added."""
    from tidal.layers.quant import Fp8BlockMethod, Fp8Linear

    lin = Fp8Linear(48, 20, Fp8BlockMethod((32, 32)), bias_dtype=torch.float32, device=device)
    w, ws = fp8_weight(20, 48, 32)
    bias = torch.randn(20)
    lin.write_weights({"weight": w.to(device), "weight_scale": ws.to(device),
                       "bias": bias.to(device)})  # fmt: skip
    assert lin.triton == (device == "cuda")
    lin.triton = True
    x = torch.randn(3, 48, device=device)
    got = lin(x)
    want = ft.w8a8_linear_torch(x.cpu(), w, ws, 32, bias)
    assert rel_err(got, want) < 1e-5
    assert 1e-4 < rel_err(got, lin.reference(x, bias.to(device))) < 0.1  # w8a16: x as is


def test_fused_moe_layer_fp8_takes_the_triton_path(device):
    """``FusedMoE`` with FP8 experts on the triton backend: the w8a8 kernel, no host sync
    (so decode graphs may capture it), equal to its reference on the layer's routing."""
    from tidal.moe.layer import FusedMoE

    moe = FusedMoE(6, 2, 32, 16, True, backend="triton", dtype=torch.float32, device=device)
    moe.hold_fp8(32)
    w13, s13, w2, s2 = fp8_experts(6, 32, 16, 32)
    parts = {"gate": torch.randn(6, 32), "w13": w13, "w2": w2, "w13_scale": s13, "w2_scale": s2}
    moe.write_weights({name: value.to(device) for name, value in parts.items()})
    assert moe.experts_on_device
    x = torch.randn(5, 32, device=device)
    weights, ids = moe.route(x)
    got = moe(x)
    want = ft.fused_experts_fp8_torch(x.cpu(), w13, w2, s13, s2, 32, weights.cpu(), ids.cpu())
    assert rel_err(got, want) < 1e-4
    assert rel_err(got, moe.fp8_reference(x, weights, ids, None)) < 0.1


def test_gpu_proof_fp8_step_rehearsed(tmp_path):
    """benchmarks/gpu_proof.py's fp8 step with --smoke (toy shapes, this interpreter): the
    checks it makes on the GPU hold, and the linear's table it writes is found by the
    lookup under the name it reports."""
    if torch.cuda.is_available():
        pytest.skip("the rehearsal is the CPU's; the GPU runs the step itself")
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    spec = importlib.util.spec_from_file_location("gpu_proof", bench / "gpu_proof.py")
    assert spec is not None and spec.loader is not None
    proof = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(bench))
    try:
        spec.loader.exec_module(proof)
        result: dict = {}
        proof.fp8(result, True, tmp_path, 1)  # no compile processes
    finally:
        sys.path.remove(str(bench))
    assert "error" not in result, result
    assert [c["bytes_differing"] for c in result["quant"]] == [0, 0]
    assert all(c["rel_err_vs_w8a8_reference"] < 1e-5 for c in result["linear"] + result["moe"])
    assert all(0 < c["rel_err_vs_bf16"] < 0.2 for c in result["linear"] + result["moe"])
    # each table under a plain name mapped to the name it ships under, found by the lookup
    ((plain, ship),) = result["linear_config_files"].items()
    ((moe_plain, moe_ship),) = result["config_files"].items()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([plain, moe_plain])
    (tmp_path / plain).rename(tmp_path / ship)
    (tmp_path / moe_plain).rename(tmp_path / moe_ship)
    load_linear_configs.cache_clear()
    table = load_linear_configs(40, 96, "interpreter", "float8_e4m3fn", tmp_path)
    assert table is not None and sorted(table) == [1, 5]
    load_tuned_configs.cache_clear()
    moe_table = load_tuned_configs(8, 48, "interpreter", "float8_e4m3fn", tmp_path)
    assert moe_table is not None and sorted(moe_table) == [1, 5]
    # both linear candidates (one splitting k) gave the reference's result
    swept = [c for case in result["linear"] for c in case["sweep"]]
    assert {c["config"].get("SPLIT_K", 1) for c in swept} == {1, 2}
    assert all(c["rel_err"] < 1e-5 for c in swept)
