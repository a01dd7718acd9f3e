"""The C++ linear (``tidal/kernels/csrc/linear_cpu.cpp``) against ``F.linear``: row counts
around its 6-row groups, widths that do not fill its 64-column blocks or its vectors,
bias, strided rows, 1-3 threads; its pack and its input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.cpu_kernels import keep_torch_threads, needs_kernel  # noqa: F401 - autouse fixture
from tidal.kernels.cpu_ext import PREFETCH_HINTS, NativeArgs, native_args
from tidal.kernels.cpu_linear import BLOCK, linear_cpu, pack_linear_weight


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 33, 130])
@pytest.mark.parametrize("in_f,out_f", [(256, 512), (24, 40), (100, 64), (17, 129), (1024, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(threads, rows, in_f, out_f, bias):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(rows * 7 + in_f)
    w = torch.randn(out_f, in_f, generator=g) / in_f**0.5
    b = torch.randn(out_f, generator=g) if bias else None
    x = torch.randn(rows, in_f, generator=g)
    got = linear_cpu(x, pack_linear_weight(w), out_f, b)
    assert got.shape == (rows, out_f) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), atol=3e-5, rtol=1e-5)


@needs_kernel
def test_linear_takes_strided_rows():
    w = torch.randn(40, 24)
    x = torch.randn(9, 50)[:, 1:25]  # row stride 50
    torch.testing.assert_close(linear_cpu(x, pack_linear_weight(w), 40), x @ w.T)


def test_pack_layout():
    w = torch.randn(70, 24)
    p = pack_linear_weight(w)
    assert p.shape == (2, 24, BLOCK)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 69 - BLOCK], w[69])
    assert torch.count_nonzero(p[1, :, 70 - BLOCK :]) == 0  # outputs past N


@needs_kernel
def test_linear_rejects_bad_inputs_with_errors():
    w = pack_linear_weight(torch.randn(40, 24))
    with pytest.raises(ValueError, match="does not match"):
        linear_cpu(torch.randn(3, 16), w, 40)
    with pytest.raises(RuntimeError, match="out_features"):
        linear_cpu(torch.randn(3, 24), w, 65)
    with pytest.raises(RuntimeError, match="bias"):
        linear_cpu(torch.randn(3, 24), w, 40, torch.randn(39))
    with pytest.raises(RuntimeError, match="float32"):
        linear_cpu(torch.randn(3, 24).double(), w, 40)
    with pytest.raises(RuntimeError, match="contiguous"):
        linear_cpu(torch.randn(24, 3).T, w, 40)  # columns strided
    with pytest.raises(ValueError, match="float32 or bf16"):
        pack_linear_weight(torch.randn(4, 4).half())


@pytest.mark.parametrize(
    ("variant", "empty", "want"),
    [
        ("nta", 0, NativeArgs(PREFETCH_HINTS["nta"], False, False)),
        ("t0", 0, NativeArgs(PREFETCH_HINTS["t0"], False, False)),
        ("dot-t0", 0, NativeArgs(PREFETCH_HINTS["t0"], True, False)),
        ("dot-nta", 1, NativeArgs(PREFETCH_HINTS["nta"], True, False)),
        ("amx", 0, NativeArgs(0, False, True)),
        ("", 0, NativeArgs(0, False, False)),
        ("", PREFETCH_HINTS["t0"], NativeArgs(PREFETCH_HINTS["t0"], False, False)),
    ],
)
def test_a_variant_name_is_the_ops_arguments(variant, empty, want):
    """Every native variant a trial can choose maps to the C++ ops' (prefetch, dot, amx);
    no variant takes the caller's default hint (FP8's is t0)."""
    assert native_args(variant, empty) == want
