"""GPT-OSS's experts on the C++ fused MoE (``cpu_moe.ExpertExtras``: per-expert biases on
both projections and the clamped SwiGLU) against their reference ``biased_experts``:
float32 to float32 rounding, bf16 (shift, dot and AMX kernels) to bf16's; with and without
an expert map; and a biased layer's measured choice between the two paths."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.cpu_kernels import keep_torch_threads, needs_kernel  # noqa: F401 - autouse fixture
from tidal.kernels import select
from tidal.kernels.cpu_ext import amx_available, bf16_dot_available
from tidal.kernels.cpu_moe import CpuPackedExperts, ExpertExtras, fused_experts_cpu
from tidal.kernels.select import Candidate, choose_paths
from tidal.moe.layer import FusedMoE, build_expert_map
from tidal.moe.reference import ClampedSwiGLU, biased_experts
from tidal.moe.router import Routing, softmax_topk

pytestmark = needs_kernel
BF16 = torch.bfloat16
EXPERTS, TOP_K = 8, 2
CLAMP = (1.702, 0.5)  # GPT-OSS's alpha; a limit these activations reach, so the clamps act
LOCAL = [5, 0, 3]  # an EP rank's slots, out of order


def _problem(rows: int, hidden: int, inter: int, local: list[int] | None, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    n = EXPERTS if local is None else len(local)
    x = torch.randn(rows, hidden, generator=g)
    w13 = torch.randn(n, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(n, hidden, inter, generator=g) / inter**0.5
    b13, b2 = (
        torch.randn(n, 2 * inter, generator=g) * 0.3,
        torch.randn(n, hidden, generator=g) * 0.3,
    )
    weights, ids = softmax_topk(torch.randn(rows, EXPERTS, generator=g), TOP_K, True)
    emap = None if local is None else build_expert_map(EXPERTS, local)
    return x, w13, w2, b13, b2, weights, ids, emap


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("local", [None, LOCAL])
@pytest.mark.parametrize("clamp", [None, CLAMP])
def test_float32_kernel_equals_biased_experts(rows, local, clamp):
    """72 wide, 40 deep: neither fills the kernel's blocks, so the biases' padding counts."""
    x, w13, w2, b13, b2, weights, ids, emap = _problem(rows, 72, 40, local, rows)
    act = None if clamp is None else ClampedSwiGLU(*clamp)
    want = biased_experts(x, w13, w2, b13, b2, weights, ids, emap, act)
    extras = ExpertExtras(b13, b2, clamp)
    got = fused_experts_cpu(x, CpuPackedExperts(w13, w2), weights, ids, emap, extras=extras)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # the bias parts alone (a layer may have either): each one's share is its own
    only_down = fused_experts_cpu(
        x, CpuPackedExperts(w13, w2), weights, ids, emap, extras=ExpertExtras(None, b2, clamp)
    )
    want = biased_experts(x, w13, w2, torch.zeros_like(b13), b2, weights, ids, emap, act)
    torch.testing.assert_close(only_down, want, atol=2e-5, rtol=1e-5)


# (dot, amx): the shift kernel everywhere, the dot and AMX ones where the CPU has them
KERNELS = [
    pytest.param(False, False, id="shift"),
    pytest.param(True, False, id="dot", marks=pytest.mark.skipif(
        not bf16_dot_available(), reason="this CPU has no AVX512-BF16")),
    pytest.param(False, True, id="amx", marks=pytest.mark.skipif(
        not amx_available(), reason="this CPU has no AMX-BF16")),
]  # fmt: skip


@pytest.mark.parametrize("dot,amx", KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("local", [None, LOCAL])
def test_bf16_kernels_equal_biased_experts_on_the_upcast_weights(dot, amx, rows, local):
    """bf16 weights and biases against ``biased_experts`` in float32 on the same values:
    the shift kernel to float32 rounding; the dot and AMX kernels round the activations
    (hidden and intermediate) to bf16, relative 2^-8 each."""
    x, w13, w2, b13, b2, weights, ids, emap = _problem(rows, 64, 40, local, 10 + rows)
    w13, w2, b13, b2 = (t.to(BF16) for t in (w13, w2, b13, b2))
    rounded = dot or amx
    xin = x.to(BF16).float() if rounded else x
    want = biased_experts(
        xin, w13.float(), w2.float(), b13.float(), b2.float(), weights, ids, emap,
        ClampedSwiGLU(*CLAMP),
    )  # fmt: skip
    packed = CpuPackedExperts(w13, w2)
    extras = ExpertExtras(b13, b2, CLAMP)
    got = fused_experts_cpu(x, packed, weights, ids, emap, dot=dot, amx=amx, extras=extras)
    scale = want.abs().max().item()
    if rounded:
        torch.testing.assert_close(got, want, atol=1e-2 * scale, rtol=0)
    else:
        torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5)
    # bf16 hidden in, bf16 out: one more rounding of the sums
    got16 = fused_experts_cpu(x.to(BF16), packed, weights, ids, emap, dot=dot, amx=amx,
                              extras=extras)  # fmt: skip
    assert got16.dtype == BF16
    want16 = biased_experts(
        x.to(BF16).float(), w13.float(), w2.float(), b13.float(), b2.float(), weights, ids, emap,
        ClampedSwiGLU(*CLAMP),
    )  # fmt: skip
    torch.testing.assert_close(got16.float(), want16, atol=2e-2 * scale, rtol=0)


def test_kernel_rejects_biases_that_do_not_fit():
    x, w13, w2, b13, b2, weights, ids, _ = _problem(3, 64, 40, None, 0)
    packed = CpuPackedExperts(w13, w2)
    bad = [
        (ExpertExtras(b13[:, :-2], b2), ValueError, "b13 must be"),  # another intermediate size
        (ExpertExtras(b13, b2[:, :-1]), ValueError, "b2 must be"),
        (ExpertExtras(b13[:4], b2), ValueError, "b13 must be"),  # not one row per expert
        (ExpertExtras(b13, b2.to(BF16)), RuntimeError, "one dtype"),
        (ExpertExtras(b13.to(torch.float16), None), RuntimeError, "float32 or bf16"),
    ]
    for extras, error, match in bad:
        with pytest.raises(error, match=match):
            fused_experts_cpu(x, packed, weights, ids, extras=extras)


def _biased_layer(local: list[int] | None = None) -> FusedMoE:
    moe = FusedMoE(
        EXPERTS, TOP_K, 64, 40, True, local, routing=Routing(TOP_K, True, router_bias=True),
        expert_bias=True, activation=ClampedSwiGLU(*CLAMP),
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    for t in (moe.gate, moe.gate_bias, moe.w13, moe.w2, moe.w13_bias, moe.w2_bias):
        assert t is not None
        t.data.copy_(torch.randn(t.shape, generator=g) * 0.3)
    return moe


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("slow", ["native", "torch"])
def test_the_biased_layers_choice_follows_the_measurement(slow, tmp_path, monkeypatch):
    """A biased layer's experts are their own op (``biased_moe``) with the C++ kernels and
    ``biased_experts`` as candidates (no onednn: it has no biases). Whichever path the
    fake clock makes slow is not chosen, and the layer computes by the chosen one what
    ``biased_experts`` does."""
    monkeypatch.setattr(select, "oversubscribed", lambda *a, **k: None)
    clock = _Clock()
    moe = _biased_layer(LOCAL)
    cands = moe.cpu_ops()["experts"].candidates
    assert {c.path for c in cands} == {"native", "torch"}
    trial = moe.cpu_trial

    def charged(op: str, candidate: Candidate, instances: int) -> Any:
        real = trial(op, candidate, instances)
        slowed = op == "experts" and candidate.path == slow

        def for_rows(rows: int) -> Any:
            run = real(rows)

            def timed() -> object:
                out = run()  # the real path runs
                clock.now += 50e-3 if slowed else 1e-3
                return out

            return timed

        return for_rows

    monkeypatch.setattr(moe, "cpu_trial", charged)
    want = moe.read_weights(["w13", "w2"])
    report = choose_paths([moe], cache_dir=str(tmp_path), batch_rows=8, clock=clock)
    choice = report.choices[f"biased_moe[{len(LOCAL)}x64x40x{TOP_K}x{EXPERTS}]"]
    assert slow not in (choice.decode.path, choice.batch.path)
    assert moe.cpu_choice["experts"] == choice
    x = torch.randn(9, 64)
    weights, ids = moe.route(x)
    assert moe.w13_bias is not None and moe.w2_bias is not None
    ref = biased_experts(
        x, want["w13"], want["w2"], moe.w13_bias, moe.w2_bias, weights, ids, moe.expert_map,
        moe.activation,
    )  # fmt: skip
    torch.testing.assert_close(moe.forward_experts(x, weights, ids), ref, atol=2e-5, rtol=1e-5)
    # the held pack is the native path's only copy; the biases stay the layer's buffers
    assert moe.is_released("w13") == (choice.layout == "native")
