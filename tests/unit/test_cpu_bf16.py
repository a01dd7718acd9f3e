"""bf16 weights on the C++ CPU kernels (``tidal/kernels/csrc``): the pack holds the bf16
checkpoint once (``unpack`` gives it back bit for bit), and the shift kernel (float32
activations, float32 accumulation) and the AVX512-BF16 dot kernel (activations rounded to
bf16) of the linear, the router and the fused MoE agree with a float32 matmul of the same
bf16 weights; the measured choice offers them for bf16 and follows the timings; a tiny
bf16 Qwen3-MoE decodes greedily on them as on torch's bf16 path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.cpu_kernels import keep_torch_threads, needs_kernel  # noqa: F401 - fixture
from tidal.kernels import select
from tidal.kernels.cpu_ext import amx_available, bf16_dot_available
from tidal.kernels.cpu_linear import BLOCK, linear_cpu, pack_linear_weight, unpack_linear_weight
from tidal.kernels.cpu_moe import CpuPackedExperts, fused_experts_cpu
from tidal.kernels.cpu_router import CpuPackedGate, softmax_topk_cpu
from tidal.kernels.onednn import onednn_available
from tidal.kernels.select import (
    Candidate,
    Choice,
    choose_paths,
    weight_candidates,
)
from tidal.layers.linear import Linear
from tidal.moe.layer import FusedMoE
from tidal.moe.reference import fused_experts_reference
from tidal.moe.router import softmax_topk

pytestmark = needs_kernel
BF16 = torch.bfloat16
# The kernels to test: the shift one everywhere, the dot one where the CPU has AVX512-BF16.
DOTS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not bf16_dot_available(), reason="this CPU has no AVX512-BF16"))]  # fmt: skip
# (N, K, rows): N past a block and not a multiple of 64, K odd, 1..7 rows
SHAPES = [(70, 33, 1), (64, 16, 2), (130, 47, 3), (5, 9, 6), (200, 96, 7)]


def _bf16(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


def _tight(got: torch.Tensor, want: torch.Tensor, dot: bool) -> None:
    """float32 accumulation of exact products: float32 rounding apart (the dot kernel also
    rounded the activations to bf16 -- the reference did too, ``_act``)."""
    torch.testing.assert_close(got, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=0)


def _act(x: torch.Tensor, dot: bool) -> torch.Tensor:  # what the kernel multiplies
    return x.to(BF16).float() if dot else x.float()


# ---- linear ----------------------------------------------------------------------------


@pytest.mark.parametrize("dot", DOTS)
@pytest.mark.parametrize("n,k,rows", SHAPES)
def test_linear_bf16_matches_float32_matmul_of_the_bf16_weights(n, k, rows, dot):
    w, b = _bf16(n, k), _bf16(n, seed=1)
    packed = pack_linear_weight(w)
    assert packed.dtype == BF16 and packed.shape == (-(-n // BLOCK), -(-k // 2), BLOCK, 2)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2))
    # float32 activations: a float32 output, the products exact
    got = linear_cpu(x, packed, n, b, 1, dot)
    assert got.dtype == torch.float32
    _tight(got, _act(x, dot) @ w.float().T + b.float(), dot)
    # bf16 activations (a bf16 model): a bf16 output, the float32 sum rounded once
    xb = x.to(BF16)
    got = linear_cpu(xb, packed, n, None, 0, dot)
    assert got.dtype == BF16
    torch.testing.assert_close(got, (xb.float() @ w.float().T).to(BF16), atol=0, rtol=2**-7)
    # against torch's own bf16 linear (the reference path): bf16 rounding apart
    torch.testing.assert_close(got, F.linear(xb, w), atol=0.05, rtol=2**-6)


@pytest.mark.parametrize("n,k", [(70, 33), (64, 16), (5, 9), (128, 2)])
def test_bf16_pack_layout_and_exact_unpack(n, k):
    w = _bf16(n, k)
    packed = pack_linear_weight(w)
    # block j, pair p, column c, half h = w[64j + c, 2p + h]; zero past N and K
    last = k - 1
    assert torch.equal(packed[0, 0, 3, 1], w[3, 1])
    assert torch.equal(packed[0, last // 2, 0, last % 2], w[0, last])
    assert torch.equal(packed[(n - 1) // BLOCK, :, (n - 1) % BLOCK, :].reshape(-1)[:k], w[n - 1])
    assert torch.count_nonzero(packed[-1, :, n - (packed.shape[0] - 1) * BLOCK :]) == 0
    if k % 2:
        assert torch.count_nonzero(packed[:, -1, :, 1]) == 0
    back = unpack_linear_weight(packed, n, k)
    assert back.dtype == BF16 and torch.equal(back, w)
    assert back.t().is_contiguous()  # the input-major storage Linear keeps


def test_bf16_kernels_reject_bad_inputs_with_errors():
    packed = pack_linear_weight(_bf16(40, 24))
    with pytest.raises(ValueError, match="does not match"):
        linear_cpu(torch.randn(3, 26), packed, 40)
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        linear_cpu(torch.randn(3, 24).half(), packed, 40)
    with pytest.raises(RuntimeError, match="dot kernel takes bf16"):
        linear_cpu(torch.randn(3, 24), pack_linear_weight(torch.randn(40, 24)), 40, None, 0, True)
    with pytest.raises(RuntimeError, match="float32 weights take float32 x"):
        linear_cpu(torch.randn(3, 24).to(BF16), pack_linear_weight(torch.randn(40, 24)), 40)
    with pytest.raises(RuntimeError, match="bf16 pack"):
        torch.ops.tidal_cpu.linear(torch.randn(3, 24), packed[:, :, :32].contiguous(), None, 40)


# ---- router ----------------------------------------------------------------------------


@pytest.mark.parametrize("dot", DOTS)
@pytest.mark.parametrize("experts,width,rows", [(8, 33, 1), (70, 64, 5), (128, 15, 13)])
def test_router_bf16_matches_softmax_topk_of_float32_logits(experts, width, rows, dot):
    gate = CpuPackedGate(_bf16(experts, width))
    assert torch.equal(gate.unpack(), _bf16(experts, width))
    x = _bf16(rows, width, seed=3)
    weights, ids = softmax_topk_cpu(x, gate, 4, True, 1, dot)
    want_w, want_ids = softmax_topk(x.float() @ _bf16(experts, width).float().T, 4, True)
    assert weights.dtype == torch.float32 and torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)


# ---- fused MoE ---------------------------------------------------------------------------


def _experts(num: int, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _bf16(num, 2 * inter, hidden, scale=0.3, seed=4), _bf16(
        num, hidden, inter, scale=0.3, seed=5
    )


@pytest.mark.parametrize("dot", DOTS)
@pytest.mark.parametrize("num,hidden,inter,rows", [(4, 40, 50, 1), (6, 33, 32, 7), (8, 64, 17, 13)])
def test_fused_moe_bf16_matches_the_reference_on_upcast_weights(num, hidden, inter, rows, dot):
    w13, w2 = _experts(num, hidden, inter)
    packed = CpuPackedExperts(w13, w2)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(rows, hidden, generator=g)
    ids = torch.stack([torch.randperm(num, generator=g)[:2] for _ in range(rows)])
    weights = torch.rand(rows, 2, generator=g)
    got = fused_experts_cpu(x, packed, weights, ids, None, True, 0, dot)
    want = fused_experts_reference(_act(x, dot), w13.float(), w2.float(), weights, ids)
    assert got.dtype == torch.float32
    if dot:  # the intermediate activations are rounded to bf16 too: relative 2^-8 each
        torch.testing.assert_close(got, want, atol=1e-2 * want.abs().max().item(), rtol=0)
    else:
        _tight(got, want, dot)
    got16 = fused_experts_cpu(x.to(BF16), packed, weights, ids, None, True, 1, dot)
    assert got16.dtype == BF16
    want16 = fused_experts_reference(x.to(BF16).float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got16.float(), want16, atol=2e-2 * want16.abs().max().item(), rtol=0)


needs_amx = pytest.mark.skipif(not amx_available(), reason="this CPU has no AMX-BF16")


@needs_amx
@pytest.mark.parametrize(
    "num,hidden,inter,rows",
    # one row; odd intermediate (padded to 32); 3 experts x ~27 rows: two 16-row tiles each
    [(4, 64, 50, 1), (6, 32, 17, 7), (3, 96, 40, 40)],
)
def test_fused_moe_amx_matches_the_reference_on_upcast_weights(num, hidden, inter, rows):
    """The AMX kernel against a float32 loop over the same bf16 weights, with activations
    and intermediates rounded to bf16 as the kernel reads them (as the dot kernel does)."""
    w13, w2 = _experts(num, hidden, inter)
    packed = CpuPackedExperts(w13, w2)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, hidden, generator=g)
    ids = torch.stack([torch.randperm(num, generator=g)[:2] for _ in range(rows)])
    weights = torch.rand(rows, 2, generator=g)
    want = fused_experts_reference(_act(x, True), w13.float(), w2.float(), weights, ids)
    for xin in (x, x.to(BF16)):  # float32 hidden is rounded on the way in; bf16 read as is
        got = fused_experts_cpu(xin, packed, weights, ids, None, True, 0, amx=True)
        assert got.dtype == xin.dtype
        torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=0)
    if bf16_dot_available():  # the same products and roundings: the dot kernel's result
        dot = fused_experts_cpu(x, packed, weights, ids, None, True, 0, dot=True)
        amx = fused_experts_cpu(x, packed, weights, ids, None, True, 0, amx=True)
        torch.testing.assert_close(amx, dot, atol=2e-3 * dot.abs().max().item(), rtol=0)
    # an expert map that keeps two of the experts: the others' rows contribute nothing
    emap = torch.tensor([0, -1, 1, *([-1] * (num - 3))][:num], dtype=torch.int32)
    local = CpuPackedExperts(w13[[0, 2]], w2[[0, 2]])
    got = fused_experts_cpu(x, local, weights, ids, emap, True, 0, amx=True)
    keep = (ids == 0) | (ids == 2)
    want = fused_experts_reference(_act(x, True), w13.float(), w2.float(), weights * keep, ids)
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0)


def test_fused_moe_amx_refuses_what_it_cannot_take():
    w13, w2 = _experts(2, 33, 8)  # 33 wide: not whole 32-k tile steps
    x, ids, weights = torch.randn(1, 33), torch.tensor([[0, 1]]), torch.ones(1, 2)
    with pytest.raises(ValueError, match="hidden size divisible by 32"):
        fused_experts_cpu(x, CpuPackedExperts(w13, w2), weights, ids, amx=True)
    assert "native:amx" not in [c.name for c in weight_candidates(BF16, amx_fits=False)]
    assert "native:amx" not in [c.name for c in weight_candidates(torch.float32, amx_fits=True)]
    names = [c.name for c in weight_candidates(BF16, amx_fits=True)]
    assert ("native:amx" in names) == amx_available() and names[-1] == "torch"


# (N, K): N past a block and not a multiple of 64, one column; K whole 32-k tile steps,
# 288 past one k chunk of a panel (256) with a short last one
AMX_SHAPES = [(70, 288), (1, 96), (200, 32)]


@needs_amx
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", AMX_SHAPES)
def test_linear_amx_matches_float32_matmul_of_the_bf16_operands(n, k, bias):
    """The AMX linear at 1 row, 3 (the dot kernel's rows), 17 (a 16-row group and one),
    64 and 300 (two panels of rows, the second 44): float32 accumulation of the bf16 products, as a float32 matmul of the same
    bf16 operands; float32 activations are rounded to bf16 on the way in."""
    w = _bf16(n, k)
    b = _bf16(n, seed=1) if bias else None
    bf = None if b is None else b.float()
    packed = pack_linear_weight(w)
    for rows in (1, 3, 17, 64, 300):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want = x.to(BF16).float() @ w.float().T + (0 if bf is None else bf)
        got = linear_cpu(x, packed, n, bf, amx=True)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        _tight(got, want, True)
        xb = x.to(BF16)
        got = linear_cpu(xb, packed, n, b, amx=True)  # a bf16 model: the sum rounded once
        assert got.dtype == BF16
        torch.testing.assert_close(got, want.to(BF16), atol=0, rtol=2**-7)
        torch.testing.assert_close(got, F.linear(xb, w, b), atol=0.05, rtol=2**-6)
    # rows of a wider tensor (a strided view): the tiles read them where they lie
    wide = torch.randn(17, k + 32, generator=torch.Generator().manual_seed(3)).to(BF16)
    view = wide[:, 32:]
    want = (view.float() @ w.float().T).to(BF16)
    torch.testing.assert_close(linear_cpu(view, packed, n, amx=True), want, atol=0, rtol=2**-7)


def test_linear_amx_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="in_features divisible by 32"):
        linear_cpu(torch.randn(2, 33).to(BF16), pack_linear_weight(_bf16(8, 33)), 8, amx=True)
    with pytest.raises(ValueError, match="divisible by 32"):  # float32 weights: no AMX kernel
        linear_cpu(torch.randn(2, 32), pack_linear_weight(torch.randn(8, 32)), 8, amx=True)
    with pytest.raises(RuntimeError, match="AMX kernel takes bf16 weights"):
        torch.ops.tidal_cpu.linear(
            torch.randn(2, 32).to(BF16), pack_linear_weight(_bf16(8, 32)), None, 8, 0, True, True
        )
    # offered only for bf16 weights of whole tile steps, on a CPU with AMX
    def offered(lin: Linear) -> list[str]:
        return [c.name for c in lin.cpu_ops()["linear"].candidates]

    assert "native:amx" not in offered(Linear(33, 8, dtype=BF16))
    assert "native:amx" not in offered(Linear(32, 8))
    names = offered(Linear(32, 8, dtype=BF16))
    assert ("native:amx" in names) == amx_available() and names[-1] == "torch"


@needs_amx
def test_linear_amx_serves_a_layer_and_round_trips_its_weights():
    """A Linear on the AMX variant holds the one bf16 pack: read_weights gives the
    checkpoint back bit for bit, write_weights lands in the pack, the forward uses it."""
    amx = Candidate("native", "amx")
    lin = Linear(64, 70, True, dtype=BF16)
    for p in (lin.weight, lin.bias):
        assert p is not None
        p.data.copy_(torch.randn(p.shape) * 0.3)
    w, b = lin.weight.detach().clone(), lin.bias
    lin.set_cpu_path("linear", Choice.fixed(amx, "native"))
    lin.pack_weights()
    assert lin.is_released("weight") and torch.equal(lin.read_weights()["weight"], w)
    x = torch.randn(2, 9, 64).to(BF16)  # [..., K]: the leading dims are flattened to rows
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=0.05, rtol=2**-6)
    lin.write_weights({"weight": -w})
    assert torch.equal(lin.read_weights()["weight"], -w)
    torch.testing.assert_close(lin(x), F.linear(x, -w, b), atol=0.05, rtol=2**-6)


def test_bf16_experts_unpack_exactly_per_slot():
    w13, w2 = _experts(5, 33, 21)
    packed = CpuPackedExperts(w13, w2)
    assert packed.w13.dtype == BF16 and packed.w13.shape == (5, 1, 17, 64, 2)
    assert packed.w2.shape == (1, 5, 1, 16, 64, 2)  # one output column block: one run of one
    a, b = packed.unpack()
    assert a.dtype == BF16 and torch.equal(a, w13) and torch.equal(b, w2)
    a, b = packed.unpack([4, 1])
    assert torch.equal(a, w13[[4, 1]]) and torch.equal(b, w2[[4, 1]])
    assert packed.unpack([])[0].shape == (0, 42, 33)


# ---- layers and the measured choice -----------------------------------------------------


def test_bf16_candidates():
    names = [c.name for c in weight_candidates(BF16)]
    assert names[:2] == ["native:nta", "native:t0"] and names[-1] == "torch"
    assert ("native:dot-t0" in names) == bf16_dot_available()
    assert ("onednn" in names) == onednn_available(BF16)
    assert [c.name for c in weight_candidates(torch.float16)] == ["torch"]
    assert select.fingerprint(2, BF16)["dtype"] == "bfloat16"  # never float32's timings


@pytest.mark.parametrize("cand", weight_candidates(BF16), ids=lambda c: c.name)
def test_bf16_layers_serve_on_each_path_and_unpack_the_checkpoint(cand):
    torch.manual_seed(0)
    lin = Linear(33, 70, True, dtype=BF16)
    moe = FusedMoE(8, 2, 40, 24, True, dtype=BF16)
    for p in (lin.weight, lin.bias, moe.gate, moe.w13, moe.w2):
        assert p is not None
        p.data.copy_(torch.randn(p.shape) * 0.3)
    w, b = lin.weight.detach().clone(), lin.bias
    w13, w2, gate = (t.detach().clone() for t in (moe.w13, moe.w2, moe.gate))
    for m, ops in ((lin, ("linear",)), (moe, ("experts", "router"))):
        for op in ops:
            m.set_cpu_path(op, Choice.fixed(cand, cand.path))
        m.pack_weights()
    held = lin._held is not None
    assert held == (cand.path != "torch") and torch.equal(lin.read_weights()["weight"], w)
    got = moe.read_weights()
    assert torch.equal(got["w13"], w13) and torch.equal(got["w2"], w2)
    assert torch.equal(got["gate"], gate)
    x = torch.randn(5, 33).to(BF16)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=0.05, rtol=2**-6)
    h = torch.randn(5, 40).to(BF16)
    tw, ti = moe.route(h)
    want_w, want_ids = softmax_topk(h.float() @ gate.float().T, 2, True)
    assert torch.equal(ti, want_ids)
    torch.testing.assert_close(tw, want_w, atol=2e-2, rtol=0)  # torch: bf16 logits
    got = moe.forward_experts(h, want_w, want_ids)
    want = fused_experts_reference(h.float(), w13.float(), w2.float(), want_w, want_ids)
    assert got.dtype == BF16
    torch.testing.assert_close(got.float(), want, atol=3e-2 * want.abs().max().item(), rtol=0)
    # A write lands in whichever layout holds the weight, and the forward computes with it.
    lin.write_weights({"weight": -w})
    torch.testing.assert_close(lin(x), F.linear(x, -w, b), atol=0.05, rtol=2**-6)
    moe.write_weights({"w2": -w2})  # the experts' output negated; w13 rebuilt from the pack
    got = moe.forward_experts(h, want_w, want_ids)
    torch.testing.assert_close(got.float(), -want, atol=3e-2 * want.abs().max().item(), rtol=0)
    assert lin.is_released("weight") == moe.is_released("w13") == (cand.path != "torch")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("slow", weight_candidates(BF16, amx_fits=True), ids=lambda c: c.name)
def test_bf16_choice_follows_the_measurement(slow, tmp_path, monkeypatch):
    """Each bf16 path made the slow one (the fake clock charges it 50x): never chosen; the
    others' fastest serves, and the layer computes by it."""
    monkeypatch.setattr(select, "oversubscribed", lambda *a, **k: None)
    clock = _Clock()
    cands = weight_candidates(BF16, amx_fits=True)  # 32 inputs: the AMX kernel's too
    cost = {c: (50e-3 if c == slow else 1e-3 + 1e-4 * i) for i, c in enumerate(cands)}
    lin = Linear(32, 48, dtype=BF16)
    lin.weight.data.copy_(torch.randn(48, 32))
    trial = lin.cpu_trial

    def charged(op: str, candidate: Candidate, instances: int) -> Any:
        real = trial(op, candidate, instances)

        def for_rows(rows: int) -> Any:
            run = real(rows)

            def timed() -> object:
                out = run()  # the real kernel runs: a path that fails is left out
                clock.now += cost[candidate]
                return out

            return timed

        return for_rows

    monkeypatch.setattr(lin, "cpu_trial", charged)
    report = choose_paths([lin], cache_dir=str(tmp_path), batch_rows=8, dtype=BF16, clock=clock)
    choice = report.choices["linear[32x48x0]"]
    assert report.fingerprint["dtype"] == "bfloat16"
    fastest = min((c for c in cands if c != slow), key=cost.__getitem__)
    assert slow not in (choice.decode, choice.batch)
    assert choice.decode == choice.batch == fastest
    assert lin.cpu_choice == choice
    x = torch.randn(3, 32).to(BF16)
    want = F.linear(x, lin.read_weights()["weight"])
    torch.testing.assert_close(lin(x), want, atol=0.05, rtol=2**-6)


# ---- model level -------------------------------------------------------------------------


def test_tiny_bf16_qwen3_moe_decodes_greedily_as_on_torch(qwen3_ckpt):
    """A bf16 model on the C++ kernels (the shift one, and the dot one where the CPU has
    it) against torch's bf16 path: the same greedy tokens. (The kernels keep float32 where
    torch rounds to bf16 -- the MoE's intermediate sums, the router's logits -- so a near
    tie could go either way; these prompts have none.)"""
    from tests.unit.test_models import PagedRunner, _prompts
    from tidal.launch.engine_args import EngineArgs
    from tidal.models.loader import load_model

    config = EngineArgs(
        model=qwen3_ckpt, dtype="bfloat16", device="cpu", cpu_kernels="torch"
    ).create_engine_config()
    ref, fast = load_model(config), load_model(config)
    prompts = _prompts(fast.spec.vocab_size, [5, 9, 12], seed=3)

    def greedy(model: Any) -> list[list[int]]:
        runner, tokens = PagedRunner(model, seed=1), []
        with torch.inference_mode():
            for i, prompt in enumerate(prompts):
                logits = runner.step([(str(i), 0, prompt)])[-1]
                out, pos = [], len(prompt)
                for _ in range(6):
                    out.append(int(logits.argmax()))
                    logits = runner.step([(str(i), pos, out[-1:])])[-1]
                    pos += 1
                tokens.append(out)
        return tokens

    want = greedy(ref)
    kernels = [Candidate("native", "t0")]
    if bf16_dot_available():
        kernels.append(Candidate("native", "dot-t0"))
    for cand in kernels:  # one pack serves both: a variant is a call argument
        served = 0
        for module in fast.modules():
            if isinstance(module, (Linear, FusedMoE)):
                for op, spec in module.cpu_ops().items():
                    if cand in spec.candidates:
                        module.set_cpu_path(op, Choice.fixed(cand, cand.path))
                        served += 1
                module.pack_weights()
        assert served >= 9  # 2 layers x (qkv, o, router, experts) and the lm_head
        assert greedy(fast) == want, cand.name
