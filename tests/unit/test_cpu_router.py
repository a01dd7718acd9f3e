"""The C++ MoE router (``tidal/kernels/csrc/router_cpu.cpp``) against ``softmax_topk`` on
torch's logits: expert counts that do not fill its 64-wide blocks, widths that do not fill
its vectors, 1-3 threads, ties, renormalised or not; its pack and its input checks."""

from __future__ import annotations

import pytest
import torch

from tests.cpu_kernels import keep_torch_threads, needs_kernel  # noqa: F401 - autouse fixture
from tidal.kernels.cpu_linear import BLOCK
from tidal.kernels.cpu_router import CpuPackedGate, softmax_topk_cpu
from tidal.moe.router import softmax_topk


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    "tokens,hidden,experts,top_k",
    [(1, 256, 16, 4), (32, 1024, 32, 4), (7, 100, 70, 3), (13, 64, 128, 8), (300, 48, 8, 8),
     (0, 64, 8, 2), (5, 20, 3, 1)],
)  # fmt: skip
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_matches_softmax_topk(threads, tokens, hidden, experts, top_k, renormalize):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(tokens * 1000 + experts)
    x = torch.randn(tokens, hidden, generator=g)
    gate = torch.randn(experts, hidden, generator=g) / hidden**0.5
    want_w, want_i = softmax_topk(x @ gate.T, top_k, renormalize)
    got_w, got_i = softmax_topk_cpu(x, CpuPackedGate(gate), top_k, renormalize)
    assert got_i.dtype == torch.int64 and got_w.dtype == torch.float32
    assert got_i.shape == got_w.shape == (tokens, top_k)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_router_ties_go_to_the_lower_expert_and_rows_sum_to_one():
    x = torch.ones(2, 16)
    gate = torch.zeros(6, 16)
    gate[1] = gate[4] = 0.5  # experts 1 and 4 tie for the lead, the rest tie behind them
    weights, ids = softmax_topk_cpu(x, CpuPackedGate(gate), 3, True)
    assert ids.tolist() == [[1, 4, 0], [1, 4, 0]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    assert weights[0, 0] == weights[0, 1] > weights[0, 2]


def test_packed_gate_layout():
    gate = torch.randn(70, 24)
    p = CpuPackedGate(gate)
    assert p.weight.shape == (2, 24, BLOCK) and p.num_experts == 70
    assert torch.equal(p.weight[0, :, 5], gate[5])
    assert torch.equal(p.weight[1, :, 69 - BLOCK], gate[69])
    assert torch.count_nonzero(p.weight[1, :, 70 - BLOCK :]) == 0  # experts past E


@needs_kernel
def test_router_rejects_bad_inputs_with_errors():
    x, gate = torch.randn(4, 32), CpuPackedGate(torch.randn(8, 32))
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk_cpu(x, gate, 9, True)
    with pytest.raises(RuntimeError, match="gate_p"):
        softmax_topk_cpu(torch.randn(4, 16), gate, 2, True)
    with pytest.raises(RuntimeError, match="float32"):
        softmax_topk_cpu(x.double(), gate, 2, True)
    with pytest.raises(ValueError, match="float32"):
        CpuPackedGate(torch.randn(8, 32).half())
