"""MoE pieces: the torch fast path vs the reference oracle, the router and the FusedMoE
layer vs transformers' own Qwen3-MoE / Mixtral blocks on identical weights."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels.fused_moe_torch import fused_experts_torch
from tidal.moe.layer import EXPERT_BACKENDS, FusedMoE, build_expert_map, resolve_moe_backend
from tidal.moe.reference import fused_experts_reference
from tidal.moe.router import grouped_topk, softmax_topk

ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


def _problem(
    tokens: int,
    experts: int,
    top_k: int,
    hidden: int = 32,
    inter: int = 16,
    local: int | None = None,
):
    local = experts if local is None else local
    x = torch.randn(tokens, hidden)
    w13 = torch.randn(local, 2 * inter, hidden) * 0.2
    w2 = torch.randn(local, hidden, inter) * 0.2
    weights, ids = softmax_topk(torch.randn(tokens, experts), top_k, renormalize=True)
    return x, w13, w2, weights, ids


def _naive(x, w13, w2, weights, ids, expert_map=None, apply_router_weight=True):
    """Token-by-token definition, independent of both implementations under test."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) if expert_map is None else int(expert_map[ids[t, k]])
            if not 0 <= e < w13.shape[0]:
                continue
            h = w13[e] @ x[t]
            y = w2[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:])
            out[t] += y * (weights[t, k] if apply_router_weight else 1.0)
    return out


def test_reference_matches_token_by_token_definition():
    args = _problem(tokens=9, experts=6, top_k=3)
    emap = build_expert_map(6, [4, 0, 2])
    local_args = (args[0], args[1][:3], args[2][:3], args[3], args[4])
    torch.testing.assert_close(fused_experts_reference(*args), _naive(*args), atol=ATOL, rtol=0)
    torch.testing.assert_close(
        fused_experts_reference(*local_args, emap, False),
        _naive(*local_args, emap, False),
        atol=ATOL,
        rtol=0,
    )


@pytest.mark.parametrize("strategy", ["grouped_mm", "loop"])
@pytest.mark.parametrize(
    "tokens,experts,top_k,local",
    [(0, 8, 2, None), (1, 8, 2, None), (1, 16, 4, None), (7, 4, 1, None), (33, 8, 2, None), (64, 16, 4, None),
     (33, 8, 3, [6, 1, 3]), (20, 8, 2, [2]), (5, 8, 2, [7, 6, 5, 4, 3, 2, 1, 0])],
)  # fmt: skip
@pytest.mark.parametrize("apply_router_weight", [True, False])
def test_torch_path_matches_reference(strategy, tokens, experts, top_k, local, apply_router_weight):
    nloc = None if local is None else len(local)
    x, w13, w2, weights, ids = _problem(tokens, experts, top_k, local=nloc)
    emap = None if local is None else build_expert_map(experts, local)
    want = fused_experts_reference(x, w13, w2, weights, ids, emap, apply_router_weight)
    got = fused_experts_torch(
        x, w13, w2, weights, ids, emap, apply_router_weight, strategy=strategy
    )
    assert got.shape == (tokens, x.shape[1]) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_torch_path_ids_not_on_this_rank_contribute_zero():
    x, w13, w2, weights, _ = _problem(6, 8, 2, local=2)
    emap = build_expert_map(8, [3, 5])
    ids = torch.tensor([[0, 1]] * 6)  # no local expert at all
    for strategy in ("grouped_mm", "loop"):
        got = fused_experts_torch(x, w13, w2, weights, ids, emap, strategy=strategy)
        assert torch.count_nonzero(got) == 0


def test_torch_path_bf16_close_to_float32():
    x, w13, w2, weights, ids = _problem(24, 8, 2)
    want = fused_experts_reference(x, w13, w2, weights, ids)
    got = fused_experts_torch(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)


def _hf_config(arch: str, norm_topk_prob: bool = True):
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = {
        "hidden_size": 32,
        "num_experts_per_tok": 3,
        "hidden_act": "silu",
        "initializer_range": 0.2,
    }
    if arch == "qwen3":
        return Qwen3MoeConfig(
            num_experts=8, moe_intermediate_size=16, norm_topk_prob=norm_topk_prob, **common
        )
    return MixtralConfig(num_local_experts=8, intermediate_size=16, **common)


def _hf_block(arch: str, norm_topk_prob: bool = True):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = _hf_config(arch, norm_topk_prob)
    block = (Qwen3MoeSparseMoeBlock if arch == "qwen3" else MixtralSparseMoeBlock)(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    return block, cfg


@pytest.mark.parametrize("arch,norm", [("qwen3", True), ("qwen3", False), ("mixtral", True)])
def test_router_matches_transformers(arch, norm):
    block, cfg = _hf_block(arch, norm)
    x = torch.randn(40, cfg.hidden_size)
    with torch.no_grad():
        _, want_w, want_ids = block.gate(x)
        got_w, got_ids = softmax_topk(
            torch.nn.functional.linear(x, block.gate.weight), 3, renormalize=norm
        )
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w.float(), atol=1e-6, rtol=0)
    if norm:
        torch.testing.assert_close(got_w.sum(-1), torch.ones(40), atol=1e-6, rtol=0)


def _fused_from_hf(block, cfg, backend: str, norm: bool, local=None) -> FusedMoE:
    moe = FusedMoE(8, 3, cfg.hidden_size, 16, norm, local, backend)
    ids = moe.local_expert_ids
    with torch.no_grad():
        moe.gate.copy_(block.gate.weight)
        moe.w13.copy_(block.experts.gate_up_proj[ids])
        moe.w2.copy_(block.experts.down_proj[ids])
    return moe


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("arch,norm", [("qwen3", True), ("qwen3", False), ("mixtral", True)])
def test_fused_moe_matches_transformers_block(arch, norm, backend):
    block, cfg = _hf_block(arch, norm)
    moe = _fused_from_hf(block, cfg, backend, norm)
    x = torch.randn(2, 11, cfg.hidden_size)
    with torch.no_grad():
        want = block(x).reshape(22, -1)
        got = moe(x.reshape(22, -1))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_expert_subsets_sum_to_full_layer():
    """Two 'ranks' holding disjoint experts: their outputs add up to the full layer."""
    block, cfg = _hf_block("qwen3")
    full = _fused_from_hf(block, cfg, "torch", True)
    halves = [
        _fused_from_hf(block, cfg, "torch", True, ids) for ids in ([7, 0, 2, 5], [1, 3, 4, 6])
    ]
    x = torch.randn(17, cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(halves[0](x) + halves[1](x), full(x), atol=ATOL, rtol=0)


def test_expert_load_recording():
    block, cfg = _hf_block("mixtral")
    moe = _fused_from_hf(block, cfg, "torch", True)
    x = torch.randn(10, cfg.hidden_size)
    moe(x)
    assert moe.expert_load.sum() == 0  # off by default
    moe.record_expert_load = True
    moe(x)
    moe(x[:4])
    _, ids = softmax_topk(torch.nn.functional.linear(x, moe.gate), 3, True)
    want = torch.bincount(ids.reshape(-1), minlength=8) + torch.bincount(
        ids[:4].reshape(-1), minlength=8
    )
    assert torch.equal(moe.reset_expert_load(), want)
    assert moe.expert_load.sum() == 0


class _EchoDispatcher:
    """Stands in for an EP dispatcher: passes tokens through and records the calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def dispatch(self, hidden, topk_weights, topk_ids):
        self.calls.append("dispatch")
        return hidden, topk_weights, topk_ids, "handle"

    def combine(self, out, handle):
        self.calls.append(f"combine:{handle}")
        return out


def test_dispatcher_hook_wraps_experts():
    block, cfg = _hf_block("qwen3")
    moe = _fused_from_hf(block, cfg, "torch", True)
    x = torch.randn(5, cfg.hidden_size)
    want = moe(x)
    moe.dispatcher = _EchoDispatcher()
    torch.testing.assert_close(moe(x), want, atol=0, rtol=0)
    assert moe.dispatcher.calls == ["dispatch", "combine:handle"]


def test_backend_resolution():
    assert resolve_moe_backend("auto", "cpu") == "torch"
    assert resolve_moe_backend("auto", "cuda") == "triton"
    assert resolve_moe_backend("reference", "cpu") == "reference"
    assert set(EXPERT_BACKENDS) == {"torch", "reference", "triton"}
    with pytest.raises(ValueError, match="'nope'"):
        resolve_moe_backend("nope", "cpu")
    with pytest.raises(ValueError, match="duplicates"):
        build_expert_map(4, [1, 1])


def _grouped_topk_naive(logits, top_k, groups, topk_group, bias, scoring):
    """Per-token loops over the DeepSeek-V3 definition."""
    scores = logits.float().softmax(-1) if scoring == "softmax" else logits.float().sigmoid()
    choice = scores + (bias if bias is not None else 0)
    size = logits.shape[1] // groups
    ids = []
    for t in range(logits.shape[0]):
        g_scores = []
        for g in range(groups):
            vals = sorted(choice[t, g * size : (g + 1) * size].tolist(), reverse=True)
            g_scores.append(sum(vals[:2]) if bias is not None else vals[0])
        keep = sorted(range(groups), key=lambda g: -g_scores[g])[:topk_group]
        cands = [e for e in range(logits.shape[1]) if e // size in keep]
        ids.append(sorted(cands, key=lambda e: -choice[t, e].item())[:top_k])
    return torch.tensor(ids), scores


@pytest.mark.parametrize(
    "scoring,with_bias", [("softmax", False), ("sigmoid", True), ("sigmoid", False)]
)
def test_grouped_topk_matches_definition(scoring, with_bias):
    logits = torch.randn(12, 16)
    bias = torch.randn(16) * 0.1 if with_bias else None
    w, ids = grouped_topk(logits, 4, True, num_expert_group=4, topk_group=2,
                          scoring_func=scoring, e_score_correction_bias=bias)  # fmt: skip
    want_ids, scores = _grouped_topk_naive(logits, 4, 4, 2, bias, scoring)
    assert torch.equal(ids, want_ids)
    want_w = scores.gather(1, want_ids)
    torch.testing.assert_close(w, want_w / want_w.sum(-1, keepdim=True), atol=1e-6, rtol=0)


def test_grouped_topk_with_all_groups_is_plain_topk():
    logits = torch.randn(9, 8)
    w, ids = grouped_topk(logits, 2, False, num_expert_group=2, topk_group=2)
    want_w, want_ids = softmax_topk(logits, 2, False)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
