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

On CPU the path that serves the forward is measured at load (``tidal/kernels/select.py``:
the C++ linear with each prefetch hint -- for bf16 weights the shift and the AVX512-BF16
dot kernels, and the AMX one --, oneDNN prepacked, or ``F.linear`` on ``weight``), for
float32 and bf16;
a packed path then holds the only copy of the weight (``tidal/kernels/cpu_paths.py``),
read and written through ``read_weights``/``write_weights`` (``HeldParamsModule``).

Tensor parallelism (``tidal/distributed/tensor_parallel.py``): a column-parallel layer is a plain
``Linear`` over its block of rows (the loader fills it with its shard);
``RowParallelLinear`` sums its partial product over the TP group before its bias, and
``Embedding`` with a ``TensorParallel`` is vocab-parallel. Every worker's layers hold
only their shard, so the CPU path trials run on the shard's shape and the packed layout
holds the shard (``in_features``/``out_features`` are the local ones).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tidal.distributed.tensor_parallel import TensorParallel
from tidal.kernels.cpu_ext import amx_fits
from tidal.kernels.cpu_paths import PACKED_PATHS, HeldLinear
from tidal.kernels.held_params import HeldParamsModule
from tidal.kernels.select import Candidate, Choice, OpKey, OpSpec, default_choice
from tidal.kernels.select import weight_candidates as cpu_candidates


class Linear(HeldParamsModule):
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
        self.in_features, self.out_features = in_features, out_features
        self.params_dtype = self.weight.dtype
        self.on_cpu = torch.device(device or "cpu").type == "cpu"
        # The measured path (select.py's Choice; None: the default, decided at first use)
        # and, for a packed path, the weight in its layout: then the only copy.
        self.cpu_choice: Choice | None = None
        self._held: HeldLinear | None = None

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        return self._linear(x, self.bias)

    def _linear(self, x: Tensor, bias: Tensor | None) -> Tensor:  # [..., in] -> [..., out]
        # the packed paths read activations of the weight's dtype (float32 or bf16)
        held = self._held_weight() if self.on_cpu and x.dtype == self.params_dtype else None
        if held is None:
            return F.linear(x, self._weight("weight"), bias)
        rows = x.reshape(-1, self.in_features)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        variant = self._choice().for_rows(rows.shape[0]).variant
        return held(rows, bias, variant).reshape(*x.shape[:-1], self.out_features)

    # ---- the CPU path (select.py) and the one copy of the weight ---------------------

    def _choice(self) -> Choice:
        if self.cpu_choice is None:
            self.cpu_choice = default_choice(self._cpu_candidates(), True)
        return self.cpu_choice

    def _held_weight(self) -> HeldLinear | None:
        if self._held is None and self._choice().layout in PACKED_PATHS:
            self.pack_weights()
        return self._held

    def pack_weights(self) -> None:
        """Put the weight in the chosen path's layout now (the loader, at start-up)."""
        if not self.on_cpu:
            return
        layout = self._choice().layout
        held = None if self._held is None else self._held.path
        if held == (layout if layout in PACKED_PATHS else None):
            return
        weight = self._weight("weight").detach()  # the parameter, or rebuilt from the old pack
        if layout in PACKED_PATHS:
            self._held = HeldLinear(layout, weight)
            self.release_param("weight", self._held.unpack)
        else:
            self._held = None
            self.restore_param("weight", weight)

    def _repack(self, values: dict[str, Tensor]) -> None:
        self._restore_group(("weight",), values)
        self._held = None
        self.pack_weights()

    def cpu_ops(self) -> dict[str, OpSpec]:
        if not self.on_cpu:
            return {}
        key = OpKey("linear", (self.in_features, self.out_features, int(self.bias is not None)))
        nbytes = self.in_features * self.out_features * self.params_dtype.itemsize
        return {"linear": OpSpec(key, tuple(self._cpu_candidates()), True, nbytes)}

    def _cpu_candidates(self) -> list[Candidate]:  # bf16 with whole tile steps: also AMX
        fits = amx_fits(self.params_dtype, self.in_features)
        return cpu_candidates(self.params_dtype, amx_fits=fits)

    def cpu_trial(self, op: str, candidate: Candidate, instances: int) -> Any:
        def stand_in() -> Linear:
            lin = Linear(
                self.in_features, self.out_features, self.bias is not None, dtype=self.params_dtype
            )
            lin.weight.data.fill_(0.01)
            return lin

        return linear_trial(stand_in, op, candidate, instances, self.params_dtype)

    def set_cpu_path(self, op: str, choice: Choice) -> None:
        self.cpu_choice = choice
        if self._held is not None and self._held.path != choice.layout:
            self.pack_weights()  # loaded already: move the weight to the new layout

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def linear_trial(
    stand_in: Callable[[], Any], op: str, candidate: Candidate, instances: int, dtype: Any
) -> Any:
    """A linear-like layer's ``cpu_trial`` (``tidal/kernels/select.py``): ``instances``
    stand-ins from ``stand_in()`` (weights set; a bias is zeroed here), each packed on
    ``candidate``'s path, called in turn on rows of 0.5 in ``dtype``."""
    stand_ins = []
    for _ in range(instances):
        lin = stand_in()
        if lin.bias is not None:
            lin.bias.data.zero_()
        lin.set_cpu_path(op, Choice.fixed(candidate, candidate.path))
        lin.pack_weights()
        stand_ins.append(lin)
    turn = itertools.cycle(stand_ins)

    def for_rows(rows: int) -> Any:
        x = torch.full((rows, stand_ins[0].in_features), 0.5, dtype=dtype)
        return lambda: next(turn)(x)

    return for_rows


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
