"""silu_and_mul and moe_sum (Triton) vs torch."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels.activation import silu_and_mul, silu_and_mul_reference
from tidal.kernels.moe_sum import moe_sum, moe_sum_reference

# One rounding of the output in its own dtype (plus sigmoid implementation differences).
TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 16), (7, 40), (3, 1100)])
def test_silu_and_mul(rows, inter, dtype, device):
    x = (torch.randn(rows, 2 * inter) * 3).to(dtype)
    got = silu_and_mul(x.to(device))
    assert got.shape == (rows, inter) and got.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.cpu(), silu_and_mul_reference(x), atol=atol, rtol=rtol)


def test_silu_and_mul_into_out_and_row_stride(device):
    base = torch.randn(4, 80, device=device)
    x = base[:, :64]  # row stride 80, unit column stride
    out = torch.empty(4, 32, device=device)
    assert silu_and_mul(x, out=out) is out
    torch.testing.assert_close(out.cpu(), silu_and_mul_reference(x.cpu()), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 1, 16), (5, 3, 48), (2, 8, 1500)])
def test_moe_sum(tokens, top_k, hidden, dtype, device):
    x = torch.randn(tokens, top_k, hidden).to(dtype)
    got = moe_sum(x.to(device))
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.cpu(), moe_sum_reference(x), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "fn,x,err",
    [
        (silu_and_mul, torch.randn(4, 7), ValueError),  # odd width
        (silu_and_mul, torch.randn(4, 8).double(), TypeError),
        (silu_and_mul, torch.randn(8, 4).t(), ValueError),
        (moe_sum, torch.randn(4, 8), ValueError),
        (moe_sum, torch.randn(2, 4, 8).int(), TypeError),
        (moe_sum, torch.randn(4, 2, 8).transpose(0, 1), ValueError),
    ],
)
def test_elementwise_reject_bad_arguments(fn, x, err):
    with pytest.raises(err):
        fn(x)
