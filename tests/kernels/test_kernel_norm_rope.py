"""The Triton Q/K norm + rotary (tidal/kernels/norm_rope.py) against the layer path it
replaces on CUDA (``rms_norm_heads`` then ``apply_partial_rotary``'s torch expression),
under the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels.norm_rope import norm_rope
from tidal.layers.norm import rms_norm_heads
from tidal.layers.rotary import RotaryEmbedding, apply_partial_rotary

# The sum of squares' order differs from torch's (an ulp of the statistic); a 16-bit row is
# rounded five times (norm, weight, two products, sum), and the interpreter rounds float32
# to bf16 by truncation: up to four bf16 steps of the operands (~2-4) after the sum.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (6.3e-2, 3.2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim,norm", [(24, True), (16, True), (24, False)])
def test_matches_norm_then_rotary(rotary_dim, norm, dtype, device, monkeypatch):
    """q|k heads sliced from a wider qkv (strided rows), per-head norm with a q and a k
    weight, full and partial rotary; against the torch layer path."""
    # The torch path: no C++ kernels (they would serve float32 CPU rows).
    monkeypatch.setattr("tidal.layers.rotary._cpu_pass", lambda x, cos: False)
    t, hq, hkv, dh = 5, 4, 2, 24
    g = torch.Generator().manual_seed(rotary_dim)
    qkv = (torch.randn(t, hq + 2 * hkv, dh, generator=g) * 2).to(dtype)
    qk = qkv[:, : hq + hkv]
    weights = tuple((torch.randn(dh, generator=g) * 0.3 + 1).to(dtype) for _ in range(2))
    rope = RotaryEmbedding(rotary_dim, 64, 10000.0, dtype=dtype)
    cos, sin = rope.cos_sin(torch.tensor([0, 3, 7, 20, 63]))
    want = rms_norm_heads(qk, weights, (hq, hkv), 1e-6, native=False) if norm else qk
    want = apply_partial_rotary(want, cos, sin)
    got = norm_rope(
        qk.to(device), cos.to(device), sin.to(device),
        tuple(w.to(device) for w in weights) if norm else None, hq, 1e-6,
    ).cpu()  # fmt: skip
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_checks_name_the_bad_argument(device):
    x = torch.randn(3, 2, 8, device=device)
    cos = torch.randn(3, 1, 8, device=device)
    with pytest.raises(ValueError, match="signed_sin must be"):
        norm_rope(x, cos, cos[:2], None, 1, 1e-6)
    with pytest.raises(ValueError, match="rotary dims must be even"):
        norm_rope(x, cos[..., :3], cos[..., :3], None, 1, 1e-6)
    with pytest.raises(ValueError, match="norm weights must be"):
        norm_rope(x, cos, cos, (x[0, 0], x[0, 0, :4]), 1, 1e-6)
    with pytest.raises(ValueError, match="split must be"):
        norm_rope(x, cos, cos, None, 3, 1e-6)
