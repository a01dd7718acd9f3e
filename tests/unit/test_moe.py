"""MoE pieces: the torch fast path vs the reference oracle, the router and the FusedMoE
layer vs transformers' own Qwen3-MoE / Mixtral blocks on identical weights."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels.fused_moe_torch import fused_experts_torch
from tidal.moe.layer import EXPERT_BACKENDS, FusedMoE, build_expert_map, resolve_moe_backend
from tidal.moe.reference import fused_experts_reference, route_reference
from tidal.moe.router import Routing, Scoring, grouped_topk, route, softmax_topk

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
    gate = moe.read_weights(["gate"])["gate"]
    _, ids = softmax_topk(torch.nn.functional.linear(x, gate), 3, True)
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


# Each rule the architectures use: plain softmax (Qwen/Mixtral/OLMoE), and the rest through
# grouped_topk: GLM-4.5's (sigmoid, bias, groups, scaling), sigmoid without a bias,
# softmax with groups (DeepSeek-V2).
RULES = [
    pytest.param(Routing(4, False), id="softmax"),
    pytest.param(Routing(4, True), id="softmax-renorm"),
    pytest.param(
        Routing(4, True, Scoring.SIGMOID, num_groups=4, topk_group=2, correction_bias=True,
                scaling_factor=2.5),
        id="sigmoid-bias-groups-scaled",
    ),  # fmt: skip
    pytest.param(Routing(4, True, Scoring.SIGMOID, correction_bias=True), id="sigmoid-bias"),
    pytest.param(Routing(3, False, Scoring.SIGMOID, num_groups=2, topk_group=1), id="sigmoid"),
    pytest.param(Routing(4, True, num_groups=4, topk_group=2), id="softmax-groups"),
]


@pytest.mark.parametrize("routing", RULES)
def test_route_matches_reference(routing):
    logits = torch.randn(12, 16)
    bias = torch.randn(16) * 0.1 if routing.correction_bias else None
    got_w, got_ids = route(logits, routing, bias)
    want_w, want_ids = route_reference(logits, routing, bias)
    # The same experts; the order inside a token's k may differ (topk of a masked row).
    order = got_ids.argsort(-1)
    want_order = want_ids.argsort(-1)
    assert torch.equal(got_ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(
        got_w.gather(1, order), want_w.gather(1, want_order), atol=1e-6, rtol=1e-6
    )
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64


@pytest.mark.parametrize("routing", RULES)
def test_route_takes_no_tokens(routing):
    """An EP worker's share of a batch may be empty (a dummy step, few rows over TP)."""
    bias = torch.zeros(16) if routing.correction_bias else None
    w, ids = route(torch.randn(0, 16), routing, bias)
    assert w.shape == ids.shape == (0, routing.top_k)


def test_route_checks_its_bias():
    with pytest.raises(ValueError, match="correction bias"):
        route(torch.randn(2, 8), Routing(2, True, Scoring.SIGMOID, correction_bias=True))
    with pytest.raises(ValueError, match="correction bias"):
        route(torch.randn(2, 8), Routing(2, True), torch.zeros(8))


def test_bias_steers_the_choice_but_not_the_weights():
    logits = torch.zeros(1, 8)
    logits[0, 0] = 1.0  # the best score
    bias = torch.zeros(8)
    bias[5] = bias[6] = 1.0  # ... but 5 and 6 are chosen
    w, ids = route(logits, Routing(2, False, Scoring.SIGMOID, correction_bias=True), bias)
    assert sorted(ids[0].tolist()) == [5, 6]
    torch.testing.assert_close(w, torch.full((1, 2), 0.5))  # sigmoid(0), unbiased


def test_glm_router_matches_transformers():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = Glm4MoeConfig(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    router = Glm4MoeTopkRouter(cfg).eval()
    with torch.no_grad():
        router.weight.normal_(0.0, 0.3)
        router.e_score_correction_bias.normal_(0.0, 0.1)
    x = torch.randn(40, 32)
    with torch.no_grad():
        logits, want_w, want_ids = router(x)
    routing = Routing(4, True, Scoring.SIGMOID, 4, 2, True, 2.5)
    got_w, got_ids = route(logits, routing, router.e_score_correction_bias)
    order, want_order = got_ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(got_ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(got_w.gather(1, order), want_w.gather(1, want_order))


@pytest.mark.parametrize("mode", ["native", "onednn", "torch", "auto"])
def test_layer_routes_another_rule_on_every_cpu_path(mode):
    """The C++ router computes softmax top-k only: a layer with another rule never takes
    it (its router op is another key, without the native candidate); the paths it does
    take (oneDNN's logits, torch) route as ``route`` on the layer's logits."""
    from tidal.kernels.select import choose_paths

    routing = Routing(4, True, Scoring.SIGMOID, 4, 2, True, 2.5)
    moe = FusedMoE(16, 4, 32, 8, True, routing=routing)
    moe.gate.data.copy_(torch.randn(16, 32) * 0.3)
    moe.score_bias.copy_(torch.randn(16) * 0.1)
    moe.w13.data.normal_()
    moe.w2.data.normal_()
    ops = moe.cpu_ops()
    assert ops["router"].key.op == "router_logits"
    assert all(c.path != "native" for c in ops["router"].candidates)
    choose_paths([moe], mode=mode, cache_dir=None, batch_rows=4)
    assert moe.cpu_choice["router"].layout != "native"
    x = torch.randn(20, 32)
    got_w, got_ids = moe.route(x)
    logits = torch.nn.functional.linear(x, moe.read_weights(["gate"])["gate"])
    want_w, want_ids = route(logits, routing, moe.score_bias)
    assert torch.equal(got_ids.sort(-1).values, want_ids.sort(-1).values)
    torch.testing.assert_close(got_w.sort(-1).values, want_w.sort(-1).values)


def test_grouped_topk_with_all_groups_is_plain_topk():
    logits = torch.randn(9, 8)
    w, ids = grouped_topk(logits, 2, False, num_expert_group=2, topk_group=2)
    want_w, want_ids = softmax_topk(logits, 2, False)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)


def _gpt_oss_block(experts: int = 8, top_k: int = 2, hidden: int = 32, inter: int = 16):
    """transformers' GPT-OSS MLP (router + experts) with every weight and bias random,
    and the limit low enough that the clamps act."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
        num_experts_per_tok=top_k, swiglu_limit=0.5,
    )  # fmt: skip
    block = GptOssMLP(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return cfg, block


def _gpt_oss_layer(block, cfg, local: list[int] | None = None, mode: str | None = None) -> FusedMoE:
    """Our layer with the block's weights: gate/up de-interleaved, transposed to [2I, H]."""
    from tidal.kernels.select import choose_paths
    from tidal.moe.reference import ClampedSwiGLU

    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    routing = Routing(k, True, router_bias=True)
    moe = FusedMoE(
        e, k, cfg.hidden_size, cfg.intermediate_size, True, local, routing=routing,
        expert_bias=True, activation=ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit),
    )  # fmt: skip
    if mode is not None:
        choose_paths([moe], mode=mode, cache_dir=None, batch_rows=4)
    ex = block.experts
    ids = moe.local_expert_ids
    gu, gub = ex.gate_up_proj.data[ids], ex.gate_up_proj_bias.data[ids]  # [n, H, 2I], [n, 2I]
    with torch.no_grad():
        moe.gate.data.copy_(block.router.weight)
        moe.gate_bias.copy_(block.router.bias)
        moe.w13.data.copy_(torch.cat((gu[..., 0::2], gu[..., 1::2]), dim=2).transpose(1, 2))
        moe.w2.data.copy_(ex.down_proj.data[ids].transpose(1, 2))
        moe.w13_bias.copy_(torch.cat((gub[:, 0::2], gub[:, 1::2]), dim=1))
        moe.w2_bias.copy_(ex.down_proj_bias.data[ids])
    return moe


@pytest.mark.parametrize("mode", ["native", "onednn", "torch", "auto"])
def test_gpt_oss_layer_matches_transformers_block(mode):
    """Router bias, softmax over the top-k logits, expert biases and the clamped SwiGLU:
    the layer equals transformers' GPT-OSS MLP on every CPU path. The experts' choice is
    the C++ kernel or ``biased_experts`` (onednn adds no biases: its mode gets the
    reference); the C++ router is never chosen (it has no bias)."""
    from tidal.kernels.cpu_ext import kernel_available

    cfg, block = _gpt_oss_block()
    moe = _gpt_oss_layer(block, cfg, mode=mode)
    paths = {c.path for c in moe.cpu_ops()["experts"].candidates}
    assert paths == ({"native", "torch"} if kernel_available() else {"torch"})
    expected = {"native": "native" if kernel_available() else "torch", "onednn": "torch"}
    if mode in expected:
        assert moe.cpu_choice["experts"].layout == expected[mode]
    assert moe.cpu_choice["router"].layout != "native"
    x = torch.randn(24, cfg.hidden_size)
    with torch.no_grad():
        want, _ = block(x[None])
    torch.testing.assert_close(moe(x), want[0], atol=ATOL, rtol=1e-5)


def test_gpt_oss_expert_subsets_sum_to_full_layer():
    """EP: each rank's slots carry their own experts' biases (an expert on no rank would
    drop its bias; one on two would add it twice)."""
    cfg, block = _gpt_oss_block()
    full = _gpt_oss_layer(block, cfg)
    parts = [_gpt_oss_layer(block, cfg, local) for local in ([5, 0, 3], [1, 7, 2, 6, 4])]
    x = torch.randn(16, cfg.hidden_size)
    torch.testing.assert_close(sum(p(x) for p in parts), full(x), atol=ATOL, rtol=1e-5)


def test_biased_experts_never_reach_a_backend_kernel(monkeypatch):
    """The triton backend's kernel (or any) has no biases: a biased layer never calls it,
    and computes what the torch backend's layer does."""
    cfg, block = _gpt_oss_block()
    want = _gpt_oss_layer(block, cfg)
    monkeypatch.setitem(EXPERT_BACKENDS, "triton", lambda *a, **k: pytest.fail("kernel called"))
    got = _gpt_oss_layer(block, cfg)
    got.backend, got.experts_fn = "triton", EXPERT_BACKENDS["triton"]
    x = torch.randn(10, cfg.hidden_size)
    torch.testing.assert_close(got(x), want(x))


@pytest.mark.parametrize("mode", ["native", "torch"])
def test_expert_transfer_carries_the_biases(mode):
    """An elastic install (``expert_weights`` of the holders, ``set_local_experts`` +
    ``set_expert_weights`` on the new owner) moves each expert's biases with it: a layer
    of experts {1, 3} that takes them from two holders computes what the full layer's
    share of them does; the clamp (alpha, limit) is the layer's, not the expert's. On
    the C++ path the pack is rebuilt and the kernel reads the moved biases."""
    cfg, block = _gpt_oss_block()
    full = _gpt_oss_layer(block, cfg, mode=mode)
    low = _gpt_oss_layer(block, cfg, [0, 1, 2, 3], mode=mode)
    high = _gpt_oss_layer(block, cfg, [3, 5], mode=mode)
    specs = full.expert_part_specs()
    assert [s for s, _ in specs[2:]] == [(2 * cfg.intermediate_size,), (cfg.hidden_size,)]
    moved = [low.expert_weights([1]), high.expert_weights([0])]  # experts 1 and 3
    assert [tuple(t.shape[1:]) for t in moved[0]] == [s for s, _ in specs]
    from tidal.kernels.cpu_ext import kernel_available

    x = torch.randn(10, cfg.hidden_size)
    new = _gpt_oss_layer(block, cfg, [6, 7], mode=mode)
    new(x)  # packed now (the C++ path): the install must re-pack
    new.set_local_experts([1, 3])
    new.set_expert_weights([torch.cat(ts) for ts in zip(*moved)])
    want = _gpt_oss_layer(block, cfg, [1, 3], mode="torch")
    assert torch.equal(new.w13_bias, want.w13_bias) and torch.equal(new.w2_bias, want.w2_bias)
    torch.testing.assert_close(new(x), want(x))
    assert new.is_released("w13") == (mode == "native" and kernel_available())
