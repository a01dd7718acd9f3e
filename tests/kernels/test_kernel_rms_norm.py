"""The Triton RMSNorm (tidal/kernels/rms_norm.py) against transformers' formula
(``_rms_norm_hf``: Qwen3RMSNorm's float32 statistics and roundings; importing
transformers' model classes here would cost seconds) through the kernel and the layer
paths it serves on CUDA, under the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels.rms_norm import rms_norm_triton
from tidal.layers.norm import RMSNorm, _rms_norm_hf, rms_norm_heads

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ulp(dtype: torch.dtype) -> tuple[float, float]:
    """The sum of squares is added in another order than torch's, which may move the
    statistic by an ulp: a 16-bit output then by a step of each of its two roundings."""
    eps = torch.finfo(dtype).eps
    return eps, 2 * eps if dtype != torch.float32 else 4 * eps  # atol, rtol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (2, 3, 40), (2, 2, 2, 24), (33,)])
def test_matches_transformers_formula(shape, dtype, device):
    x = (torch.randn(shape) * 3).to(dtype)
    weight = (torch.randn(shape[-1]) * 0.5 + 1).to(dtype)
    got = rms_norm_triton(x.to(device), weight.to(device), 1e-6).cpu()
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(
        got, _rms_norm_hf(x, weight, 1e-6), atol=_ulp(dtype)[0], rtol=_ulp(dtype)[1]
    )
    # 16-bit: the normalised row is rounded before the weight, as transformers does, not
    # the product once (which differs from it on these rows).
    if dtype != torch.float32:
        xf = x.float()
        once = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
        assert not torch.equal(got, once.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_and_qk_heads_on_triton_equal_their_reference(dtype, device):
    """``RMSNorm`` with its ``triton`` switch, and the Q/K norm over the q|k heads of a
    wider qkv row read in place (strided rows and heads), against transformers' formula."""
    t, hq, hkv, dh = 5, 4, 2, 24
    norm = RMSNorm(dh, 1e-5, dtype=dtype, device=device)
    norm.weight.data.copy_(torch.randn(dh) * 0.5 + 1)
    norm.triton = True
    x = torch.randn(t, dh).to(dtype)
    torch.testing.assert_close(
        norm(x.to(device)).cpu(),
        _rms_norm_hf(x, norm.weight.cpu(), 1e-5),
        atol=_ulp(dtype)[0],
        rtol=_ulp(dtype)[1],
    )
    qkv = torch.randn(t, hq + 2 * hkv, dh).to(dtype)
    weights = (torch.randn(dh).to(dtype), torch.randn(dh).to(dtype))
    got = rms_norm_heads(
        qkv.to(device)[:, : hq + hkv], tuple(w.to(device) for w in weights), (hq, hkv), 1e-5,
        native=False, triton=True,
    ).cpu()  # fmt: skip
    want = torch.cat(
        [
            _rms_norm_hf(qkv[:, :hq], weights[0], 1e-5),
            _rms_norm_hf(qkv[:, hq : hq + hkv], weights[1], 1e-5),
        ],
        dim=1,
    )
    torch.testing.assert_close(got, want, atol=_ulp(dtype)[0], rtol=_ulp(dtype)[1])


def test_checks_name_the_bad_argument(device):
    x = torch.randn(3, 8, device=device)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_triton(x, torch.ones(8, dtype=torch.float16, device=device), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm_triton(x.t(), None, 1e-6)
    with pytest.raises(TypeError, match="x must be"):
        rms_norm_triton(x.to(torch.int32), None, 1e-6)
