"""Triton fused_experts vs a local loop reference and vs tidal.moe.reference (the oracle)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tidal.kernels.fused_moe import fused_experts, fused_experts_with_config, is_interpreted
from tidal.kernels.moe_config import MoeKernelConfig

# max |got - want| / max |want|: fp32 accumulates identically up to summation order;
# halves store the [T*K, 2I] / [T*K, I] / [T*K, H] intermediates in their own dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def loop_reference(
    hidden, w13, w2, topk_weights, topk_ids, expert_map=None, apply_router_weight=True
):
    """One (token, k) at a time, in float64: the plainest reading of the contract."""
    inter = w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        x = hidden[t].double().cpu()
        for k in range(topk_ids.shape[1]):
            gid = int(topk_ids[t, k])
            e = gid if expert_map is None else int(expert_map[gid])
            if not 0 <= e < w13.shape[0]:
                continue  # expert on another rank
            h = w13[e].double().cpu() @ x
            y = w2[e].double().cpu() @ (F.silu(h[:inter]) * h[inter:])
            out[t] += float(topk_weights[t, k]) * y if apply_router_weight else y
    return out


def make_problem(tokens, hidden, inter, experts, top_k, dtype, experts_global=None):
    """Random MoE weights and routing; ids are global when experts_global is given."""
    e_route = experts_global or experts
    x = torch.randn(tokens, hidden).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype)
    weights = torch.softmax(torch.randn(tokens, top_k), dim=-1)
    ids = torch.argsort(torch.rand(tokens, e_route), dim=1)[:, :top_k].contiguous()  # distinct
    return x, w13, w2, weights, ids


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double().cpu()
    return float((got.double().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-6))


def to(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


CASES = [
    # (T, H, I, E, top_k, BLOCK_SIZE_M, GROUP_SIZE_M)
    (1, 32, 16, 4, 2, 16, 1),  # single decode token
    (3, 16, 32, 4, 1, 16, 1),  # T < BLOCK_M, top-1
    (20, 64, 32, 8, 2, 16, 4),  # experts with no tokens likely; grouped pid order
    (33, 48, 40, 6, 3, 32, 2),  # H, I not multiples of the K/N blocks
    (17, 32, 24, 16, 4, 64, 8),  # most experts empty, big BLOCK_M
]


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,block_m,group_m", CASES)
def test_fused_experts_float32(tokens, hidden, inter, experts, top_k, block_m, group_m, device):
    x, w13, w2, tw, ids = make_problem(tokens, hidden, inter, experts, top_k, torch.float32)
    config = MoeKernelConfig(block_m, 32, 32, group_size_m=group_m)
    got = fused_experts_with_config(*to(device, x, w13, w2, tw, ids), None, True, config)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert rel_err(got, loop_reference(x, w13, w2, tw, ids)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,block_m,group_m", CASES[1:4])
def test_fused_experts_float16(tokens, hidden, inter, experts, top_k, block_m, group_m, device):
    x, w13, w2, tw, ids = make_problem(tokens, hidden, inter, experts, top_k, torch.float16)
    config = MoeKernelConfig(block_m, 32, 32, group_size_m=group_m)
    got = fused_experts_with_config(*to(device, x, w13, w2, tw, ids), None, True, config)
    assert got.dtype == torch.float16
    assert rel_err(got, loop_reference(x, w13, w2, tw, ids)) < TOLERANCE[torch.float16]


def test_fused_experts_grouped_order_partial_last_group(device):
    """Every token on both experts: 6 live row-blocks of 8, GROUP_SIZE_M=5, so the last
    (partial) group holds live blocks and each of its (m, n) tiles must still be visited."""
    x, w13, w2, tw, ids = make_problem(40, 32, 32, 2, 2, torch.float32)
    config = MoeKernelConfig(16, 32, 32, group_size_m=5)
    got = fused_experts_with_config(*to(device, x, w13, w2, tw, ids), None, True, config)
    assert rel_err(got, loop_reference(x, w13, w2, tw, ids)) < TOLERANCE[torch.float32]


def test_fused_experts_bfloat16_interpreter_upcast(device):
    """bf16 through the interpreter's fp32 dot path (natively on a GPU)."""
    x, w13, w2, tw, ids = make_problem(9, 32, 32, 4, 2, torch.bfloat16)
    got = fused_experts_with_config(
        *to(device, x, w13, w2, tw, ids), None, True, MoeKernelConfig(16, 32, 32)
    )
    assert got.dtype == torch.bfloat16
    assert rel_err(got, loop_reference(x, w13, w2, tw, ids)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("apply_router_weight", [True, False])
def test_fused_experts_expert_map(apply_router_weight, device):
    """EP rank owning 4 of 12 experts: other experts contribute exactly nothing."""
    x, w13, w2, tw, ids = make_problem(11, 32, 16, 4, 3, torch.float32, experts_global=12)
    expert_map = torch.full((12,), -1, dtype=torch.int32)
    expert_map[torch.tensor([10, 3, 6, 0])] = torch.arange(4, dtype=torch.int32)
    ids[0] = torch.tensor([1, 2, 4])  # a token with no local expert at all
    got = fused_experts_with_config(
        *to(device, x, w13, w2, tw, ids, expert_map),
        apply_router_weight,
        MoeKernelConfig(16, 32, 32),
    )
    want = loop_reference(x, w13, w2, tw, ids, expert_map, apply_router_weight)
    assert torch.all(got[0].cpu() == 0)
    assert rel_err(got, want) < TOLERANCE[torch.float32]


def test_fused_experts_no_local_expert(device):
    x, w13, w2, tw, ids = make_problem(4, 16, 16, 2, 2, torch.float32, experts_global=6)
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1], dtype=torch.int32)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    got = fused_experts(*to(device, x, w13, w2, tw, ids, expert_map))
    assert torch.equal(got.cpu(), torch.zeros_like(x))


def test_fused_experts_default_config_matches_oracle(device):
    """The public entry point (default/tuned config) vs tidal.moe.reference."""
    reference = pytest.importorskip("tidal.moe.reference")
    x, w13, w2, tw, ids = make_problem(24, 64, 32, 8, 2, torch.float32, experts_global=16)
    expert_map = torch.full((16,), -1, dtype=torch.int32)
    expert_map[8:] = torch.arange(8, dtype=torch.int32)
    args = (x, w13, w2, tw, ids, expert_map)
    got = fused_experts(*to(device, *args))
    want = reference.fused_experts_reference(*args)
    assert rel_err(got, want) < TOLERANCE[torch.float32]
    assert rel_err(got, loop_reference(*args)) < TOLERANCE[torch.float32]
    unweighted = fused_experts(*to(device, *args), apply_router_weight=False)
    want_unweighted = reference.fused_experts_reference(*args, apply_router_weight=False)
    assert rel_err(unweighted, want_unweighted) < TOLERANCE[torch.float32]


def test_fused_experts_float16_matches_oracle(device):
    reference = pytest.importorskip("tidal.moe.reference")
    args = make_problem(10, 32, 32, 4, 2, torch.float16)
    got = fused_experts(*to(device, *args))
    want = reference.fused_experts_reference(*args)
    assert rel_err(got, want) < TOLERANCE[torch.float16]


def test_fused_experts_zero_tokens(device):
    x, w13, w2, tw, ids = make_problem(0, 16, 16, 2, 2, torch.float32)
    got = fused_experts(*to(device, x, w13, w2, tw, ids))
    assert got.shape == (0, 16)


def _bad_args():
    x, w13, w2, tw, ids = make_problem(4, 16, 16, 2, 2, torch.float32)
    return [
        ((x[0], w13, w2, tw, ids), ValueError),  # hidden not 2-D
        ((x, w13[:, :31], w2, tw, ids), ValueError),  # odd 2I
        ((x, w13, w2[:, :, :8], tw, ids), ValueError),  # I mismatch
        ((x.half(), w13, w2, tw, ids), TypeError),  # dtype mismatch
        ((x.double(), w13.double(), w2.double(), tw, ids), TypeError),  # unsupported dtype
        ((x, w13, w2, tw.half(), ids), TypeError),  # weights not fp32
        ((x, w13, w2, tw, ids.float()), TypeError),
        ((x, w13, w2, tw[:3], ids[:3]), ValueError),  # wrong T
        ((x, w13, w2, tw, ids[:, :1]), ValueError),  # K mismatch
        ((x.t().contiguous().t(), w13, w2, tw, ids), ValueError),  # not contiguous
    ]


@pytest.mark.parametrize("case", range(10))
def test_fused_experts_rejects_bad_arguments(case):
    args, err = _bad_args()[case]
    with pytest.raises(err):
        fused_experts(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_fused_experts_bfloat16_native_gpu(tokens):
    assert not is_interpreted()
    x, w13, w2, tw, ids = make_problem(tokens, 256, 128, 16, 4, torch.bfloat16, 32)
    expert_map = torch.full((32,), -1, dtype=torch.int32)
    expert_map[torch.randperm(32)[:16]] = torch.arange(16, dtype=torch.int32)
    args = to("cuda", x, w13, w2, tw, ids, expert_map)
    got = fused_experts(*args)
    want = loop_reference(x, w13, w2, tw, ids, expert_map)
    assert got.is_cuda and got.dtype == torch.bfloat16
    assert rel_err(got, want) < TOLERANCE[torch.bfloat16]


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the compiled kernels itself")
def test_kernels_compile_for_sm90_without_gpu():
    """The interpreter never runs Triton's compiler: compile once for a real target."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("aot_compile_check.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 18
