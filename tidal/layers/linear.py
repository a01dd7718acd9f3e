"""Inference-only Linear and Embedding with uninitialised storage.

Weights are created with ``torch.empty`` on the target device and dtype, and the loader
fills them, so building a model costs no random initialisation. Several checkpoint
tensors may fill row ranges of one weight (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up``)
so a layer does one matmul instead of three.

``Linear.weight`` has the checkpoint's shape ``[out, in]`` but, on CPU by default,
input-major storage: it is the transpose view of a contiguous ``[in, out]`` buffer
(``k_major``). Then ``x @ weight.T`` is a plain row-major GEMM, which MKL runs faster than
the transposed-operand form for decode-sized batches (measured on the default model's
shapes: about 1.5-2x for one row, 10-25% for 32 rows). The loader copies into views of
``weight`` as usual, so nothing else sees the layout.

On CPU in float32 the forward uses a packed copy of the weight instead: the C++ linear's
(``tidal/kernels/cpu_linear.py``; at 1-32 rows 10-60% faster than oneDNN, within 5% of
it at 128-1024) where ``pip install`` built it, else a oneDNN-prepacked one (2.5-3x MKL's
GFLOP/s at decode shapes, ``tidal/kernels/onednn.py``). ``weight`` stays the source of
truth, and the loader's ``weights_updated`` drops the copies.

Tensor parallelism (``tidal/distributed/tensor_parallel.py``): a column-parallel layer is a plain
``Linear`` over its block of rows (the loader fills it with its shard);
``RowParallelLinear`` sums its partial product over the TP group before its bias, and
``Embedding`` with a ``TensorParallel`` is vocab-parallel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tidal.distributed.tensor_parallel import TensorParallel
from tidal.kernels.cpu_ext import kernel_available
from tidal.kernels.cpu_linear import linear_cpu, linear_cpu_ok, pack_linear_weight
from tidal.kernels.onednn import onednn_available, pack_weight, packed_linear, prefers_packed


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        dtype: Any = None,
        device: Any = None,
        k_major: bool | None = None,  # None: on CPU only (where it was measured)
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        if k_major is None:
            k_major = torch.device(device or "cpu").type == "cpu"
        self.weight = nn.Parameter(
            empty_weight(out_features, in_features, k_major, **kw), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, **kw), requires_grad=False) if bias else None
        )
        # CPU float32: a oneDNN-prepacked copy of the weight (tidal/kernels/onednn.py),
        # made at the first forward and dropped when the loader writes the weight.
        self.use_onednn = torch.device(device or "cpu").type == "cpu"
        self._packed: Tensor | None = None  # oneDNN's copy of the weight
        self._cpp_packed: Tensor | None = None  # the C++ linear's (tidal/kernels/cpu_linear.py)

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        return self._linear(x, self.bias)

    def _linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        out_f, in_f = self.weight.shape
        if self.use_onednn and linear_cpu_ok(x):  # the C++ linear, when pip install built it
            rows = x.reshape(-1, in_f)
            if rows.stride(1) != 1:
                rows = rows.contiguous()
            y = linear_cpu(rows, self._cpp_weight(), out_f, bias)
            return y.reshape(*x.shape[:-1], out_f)
        if (
            self.use_onednn
            and x.dtype == torch.float32
            and prefers_packed(x.numel() // in_f, self.weight)
            and onednn_available(self.weight.dtype)
        ):
            packed = self._packed
            if packed is None:
                packed = self._packed = pack_weight(self.weight)
            y = packed_linear(x.reshape(-1, in_f).contiguous(), packed, bias)
            return y.reshape(*x.shape[:-1], out_f)
        return F.linear(x, self.weight, bias)

    def pack_weights(self) -> None:
        """Build the C++ linear's packed copy now rather than at the next forward (the
        loader, at start-up). oneDNN's copy stays lazy: whether it is used depends on the
        row count."""
        if self.use_onednn and self.weight.dtype == torch.float32 and kernel_available():
            self._cpp_weight()

    def _cpp_weight(self) -> Tensor:
        packed = self._cpp_packed
        if packed is None:
            packed = self._cpp_packed = pack_linear_weight(self.weight)
        return packed

    def weights_updated(self) -> None:
        """The weight was written (the loader): drop the packed copies."""
        self._packed = None
        self._cpp_packed = None

    def extra_repr(self) -> str:
        out_f, in_f = self.weight.shape
        return f"in={in_f}, out={out_f}, bias={self.bias is not None}"


def empty_weight(
    rows: int, cols: int, k_major: bool, *, dtype: Any = None, device: Any = None
) -> Tensor:  # [rows, cols], uninitialised; column-major storage when k_major
    if k_major:
        return torch.empty(cols, rows, dtype=dtype, device=device).t()
    return torch.empty(rows, cols, dtype=dtype, device=device)


class RowParallelLinear(Linear):
    """``x @ W.T + b`` where this worker holds input columns ``in_features / N`` of ``W``
    (its block, the loader's shard) and ``x`` is its block of the input (the previous
    column-parallel layer's output): the partial products are summed over the TP group,
    then the bias (held whole) is added once. At TP size 1 exactly ``Linear``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        tp: TensorParallel,
        dtype: Any = None,
        device: Any = None,
    ) -> None:
        local_in = tp.split(in_features, f"row-parallel input of {in_features} features")
        super().__init__(local_in, out_features, bias, dtype=dtype, device=device)
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:  # [..., in / N] -> [..., out]
        if self.tp.size == 1:
            return self._linear(x, self.bias)
        y = self.tp.all_reduce(self._linear(x, None))
        return y if self.bias is None else y + self.bias


class Embedding(nn.Module):
    """A lookup table; with a ``TensorParallel`` of size N, vocab-parallel: this worker
    holds rows ``[start, start + valid)`` of the vocabulary in a padded block of
    ``ceil(V / N)`` rows (``TensorParallel.vocab_shard``), looks up the ids it holds,
    zeroes the others and sums over the group."""

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        *,
        tp: TensorParallel | None = None,
        dtype: Any = None,
        device: Any = None,
    ) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.num_embeddings = num_embeddings
        self.start, self.valid, rows = self.tp.vocab_shard(num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(rows, dim, dtype=dtype, device=device), requires_grad=False
        )
        if rows > self.valid:  # the padded rows: zero logits, never looked up
            self.weight.data[self.valid :].zero_()

    def forward(self, ids: Tensor) -> Tensor:  # [T] int64 -> [T, dim]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.valid)
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        out.masked_fill_(~mine.unsqueeze(1), 0)
        return self.tp.all_reduce(out)
