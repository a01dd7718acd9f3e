"""The C++ RMSNorm (``tidal/kernels/csrc/norm_cpu.cpp``) against transformers' float32
formula and ``F.rms_norm``, and the model's norm layers on both paths."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels.cpu_ext import kernel_available, kernel_status
from tidal.kernels.cpu_norm import rms_norm_cpu, rms_norm_cpu_ok
from tidal.layers.norm import RMSNorm, rms_norm_heads

needs_kernel = pytest.mark.skipif(not kernel_available(), reason=kernel_status())


def _hf(x, weight, eps):  # transformers' Qwen3RMSNorm in float32
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else weight * y


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "shape", [(1, 1024), (32, 1024), (3, 100), (7, 16), (5, 1), (32, 6, 64), (0, 64), (300, 256)]
)
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_transformers_formula(threads, shape, with_weight):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(sum(shape))
        x = torch.randn(*shape, generator=g) * 3
        w = torch.randn(shape[-1], generator=g) if with_weight else None
        got = rms_norm_cpu(x, w, 1e-6)
        assert got.shape == x.shape and got.dtype == torch.float32
        # The sum of squares is added in another order than torch's: an ulp or two.
        torch.testing.assert_close(got, _hf(x, w, 1e-6), atol=1e-6, rtol=1e-6)
    finally:
        torch.set_num_threads(old)


@needs_kernel
def test_rms_norm_strided_input_and_bad_inputs():
    x = torch.randn(8, 64)[:, ::2]  # not contiguous
    w = torch.randn(32)
    torch.testing.assert_close(rms_norm_cpu(x, w, 1e-5), _hf(x, w, 1e-5), atol=1e-6, rtol=1e-6)
    assert not rms_norm_cpu_ok(x.double()) and rms_norm_cpu_ok(x)
    with pytest.raises(RuntimeError, match="float32"):
        rms_norm_cpu(x.double(), None, 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        rms_norm_cpu(x, torch.randn(31), 1e-5)


@pytest.mark.parametrize("kernel", [True, False])
def test_norm_layers_on_both_paths(kernel, monkeypatch):
    """``RMSNorm`` and ``rms_norm_heads`` give transformers' result on the C++ path and on
    the ``F.rms_norm`` path it falls back to."""
    if kernel and not kernel_available():
        pytest.skip(kernel_status())
    if not kernel:
        monkeypatch.setattr("tidal.layers.norm.rms_norm_cpu_ok", lambda *a: False)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data.copy_(torch.randn(48))
    x = torch.randn(5, 48)
    torch.testing.assert_close(norm(x), _hf(x, norm.weight, 1e-6), atol=1e-6, rtol=1e-6)
    qk = torch.randn(5, 6, 16)
    wq, wk = torch.randn(16), torch.randn(16)
    want = torch.cat([_hf(qk[:, :4], wq, 1e-6), _hf(qk[:, 4:], wk, 1e-6)], 1)
    got = rms_norm_heads(qk, (wq, wk), (4, 2), 1e-6)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_sharded_norm_over_blocks_equals_the_whole_row(workers):
    """OLMoE's q/k norm under TP: each worker normalises its block of the row by the whole
    row's RMS (the sums of squares summed over the workers, here by hand)."""
    from tidal.layers.norm import rms_norm_sharded

    x, weight = torch.randn(5, 64), torch.randn(64)
    blocks, wblocks = x.chunk(workers, dim=1), weight.chunk(workers)
    total = sum(b.pow(2).sum(-1, keepdim=True) for b in blocks)
    got = torch.cat(
        [rms_norm_sharded(b, w, 1e-5, 64, lambda _: total) for b, w in zip(blocks, wblocks)],
        dim=1,
    )
    torch.testing.assert_close(got, _hf(x, weight, 1e-5), atol=1e-6, rtol=1e-5)
