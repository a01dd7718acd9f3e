"""topk_softmax (Triton) vs the torch reference and tidal.moe.router.softmax_topk."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels.topk_softmax import topk_softmax, topk_softmax_reference
from tidal.moe.layer import FusedMoE
from tidal.moe.router import Routing, Scoring


@pytest.mark.parametrize(
    "tokens,experts,top_k",
    [(1, 4, 1), (1, 4, 2), (7, 8, 2), (37, 60, 8), (70, 128, 8), (5, 3, 3)],
)
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_float32_matches_reference(tokens, experts, top_k, renormalize, device):
    logits = torch.randn(tokens, experts)
    weights, ids = topk_softmax(logits.to(device), top_k, renormalize)
    want_w, want_ids = topk_softmax_reference(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (tokens, top_k)
    assert torch.equal(ids.cpu(), want_ids)  # fp32 random logits: no ties
    torch.testing.assert_close(weights.cpu(), want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_topk_softmax_half_logits_with_ties(dtype, device):
    """Logits on a coarse grid tie often: the picks must still be a valid top-k."""
    logits = ((torch.randn(33, 64) * 2).round() / 2).to(dtype)
    weights, ids = topk_softmax(logits.to(device), 6, False)
    weights, ids = weights.cpu(), ids.cpu()
    probs = torch.softmax(logits.float(), dim=-1)
    want_w, _ = topk_softmax_reference(logits, 6, False)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs.gather(1, ids), weights, rtol=1e-5, atol=1e-6)
    assert all(len(set(row.tolist())) == 6 for row in ids)
    # Ties resolve to the lower expert id: equal weights come with increasing ids.
    same = weights[:, 1:] == weights[:, :-1]
    assert same.any()
    assert (ids[:, 1:][same] > ids[:, :-1][same]).all()


def test_topk_softmax_matches_router(device):
    router = pytest.importorskip("tidal.moe.router")
    logits = torch.randn(16, 12)
    for renormalize in (True, False):
        got = topk_softmax(logits.to(device), 4, renormalize)
        want = router.softmax_topk(logits, 4, renormalize)
        assert torch.equal(got[1].cpu(), want[1])
        torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-5, atol=1e-6)


def test_topk_softmax_extreme_logits(device):
    logits = torch.tensor([[1000.0, -1000.0, 0.0, 999.0], [-50.0, -50.0, -50.0, -49.0]])
    weights, ids = topk_softmax(logits.to(device), 2, True)
    assert ids.cpu().tolist() == [[0, 3], [3, 0]]
    assert torch.isfinite(weights).all()
    torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(2))


def test_topk_softmax_zero_tokens(device):
    weights, ids = topk_softmax(torch.randn(0, 8, device=device), 2, True)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize(
    "logits,top_k,err",
    [
        (torch.randn(8), 1, ValueError),
        (torch.randn(4, 8).double(), 1, TypeError),
        (torch.randn(4, 8), 0, ValueError),
        (torch.randn(4, 8), 9, ValueError),
        (torch.randn(8, 4).t(), 1, ValueError),
    ],
)
def test_topk_softmax_rejects_bad_arguments(logits, top_k, err):
    with pytest.raises(err):
        topk_softmax(logits, top_k, True)


@pytest.mark.parametrize(
    "routing",
    [Routing(3, True), Routing(3, False), Routing(2, True, router_bias=True)],
    ids=["renormalize", "raw", "router_bias"],
)
def test_fused_moe_triton_router_equals_route(routing, device):
    """``FusedMoE.route`` with its Triton router (the CUDA path; GPT-OSS's biased logits
    too) against the torch ``route`` it replaces, on the same layer."""
    moe = FusedMoE(10, routing.top_k, 16, 8, routing.renormalize, routing=routing, device=device)
    g = torch.Generator().manual_seed(0)
    moe.gate.data.copy_(torch.randn(10, 16, generator=g))
    if moe.gate_bias is not None:
        moe.gate_bias.copy_(torch.randn(10, generator=g))
    hidden = torch.randn(7, 16, generator=g).to(device)
    moe.triton_router = False
    want_w, want_ids = moe.route(hidden)
    moe.triton_router = True
    got_w, got_ids = moe.route(hidden)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_triton_router_serves_only_softmax_rules():
    assert Routing(2, True, router_bias=True).softmax_of_logits
    assert not Routing(2, True, scoring=Scoring.SIGMOID).softmax_of_logits
    assert not Routing(2, True, num_groups=4, topk_group=2).softmax_of_logits
    assert not Routing(2, True, correction_bias=True).softmax_of_logits
    # On CPU the layer keeps the measured CPU paths.
    assert not FusedMoE(4, 2, 8, 4, True, device="cpu").triton_router
