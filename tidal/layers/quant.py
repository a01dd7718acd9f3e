"""Quantized weights (docs/architecture.md#quantization): a ``QuantMethod`` per checkpoint
``quantization_config.quant_method``, looked up in ``QUANT_METHODS``.

A method says how a quantized Linear holds and applies its weight (``make_linear``) and
how MoE experts hold theirs (``FusedMoE.hold_fp8``); the loader
(``tidal/models/loader.py``'s ``quantize_model``) decides per module, from the tensors the checkpoint
stores, which modules it converts.

``Fp8BlockMethod`` (``fp8``: DeepSeek-V3/R1, Kimi-K2, the Qwen3 / GLM FP8 releases):
``float8_e4m3fn`` weights with ``bn x bk`` block scales (``weight_block_size``, 128x128)
or one per-tensor scale, held as FP8 plus row scales (``tidal/kernels/fp8_torch.py``: a
quarter of float32's bytes, plus 3%). Activations are not quantized (w8a16): each call
dequantizes the weight in the activation dtype and multiplies, the torch reference path.
A kernel that dequantizes in registers plugs in as an ``Fp8LinearKernel`` in
``FP8_LINEAR_KERNELS``: ``Fp8Linear.use_kernel(name)`` packs the weight once, and the
reference stays beside it for the tests.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tidal.distributed.tensor_parallel import TensorParallel
from tidal.kernels.fp8_torch import FP8_DTYPE, dequantize_fp8_rows, row_scales
from tidal.layers.linear import Linear

DEFAULT_BLOCK = (128, 128)


class QuantConfigError(ValueError):
    """A ``quantization_config`` Tidal cannot serve; the message names the field."""


class QuantMethod(ABC):
    """One checkpoint quantization scheme (``quantization_config.quant_method``)."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> QuantMethod:
        """From the checkpoint's ``quantization_config`` (``where``: the file, for errors)."""

    @property
    @abstractmethod
    def weight_dtype(self) -> torch.dtype:
        """How a converted weight is stored (and the checkpoint dtype that marks one)."""

    @abstractmethod
    def scale_names(self, weight_name: str) -> tuple[str, ...]:
        """The checkpoint names a quantized ``weight_name``'s scale may have, preferred
        first (block scales, then a per-tensor one)."""

    @abstractmethod
    def make_linear(self, lin: Linear, tp: TensorParallel | None) -> nn.Module:
        """The quantized replacement of ``lin`` (a ``Linear``; ``tp`` for a row-parallel
        one), its weight uninitialised for the loader."""

    @abstractmethod
    def hold_experts(self, moe: Any) -> None:
        """Make a ``FusedMoE``'s experts hold the quantized form (uninitialised)."""

    @abstractmethod
    def held_scales(self, scale: Tensor, rows: int, cols: int) -> Tensor:
        """A checkpoint scale of a ``[rows, cols]`` weight in the held form; ValueError
        saying the shape expected when it has the wrong one."""

    @abstractmethod
    def dequantize(self, weight: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
        """The held weight's values in ``dtype`` (``[..., N, K]``)."""


class Fp8LinearKernel(Protocol):
    """A fused FP8 linear (e.g. the C++ one): ``pack`` once, then called per forward."""

    def pack(self, weight: Tensor, scales: Tensor, block_k: int) -> Any: ...

    def __call__(self, x: Tensor, packed: Any, bias: Tensor | None) -> Tensor: ...


# name -> kernel; empty until a kernel module registers one (the torch reference is built in).
FP8_LINEAR_KERNELS: dict[str, Fp8LinearKernel] = {}


@dataclass(frozen=True)
class Fp8BlockMethod(QuantMethod):
    name: ClassVar[str] = "fp8"
    block: tuple[int, int] = DEFAULT_BLOCK  # (bn, bk); per-tensor checkpoints: the default

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> Fp8BlockMethod:
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantConfigError(f"quantization_config.fmt {fmt!r} in {where}: only 'e4m3'")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise QuantConfigError(
                f"quantization_config.activation_scheme {scheme!r} in {where}: only "
                "'dynamic' (static activation scales are not served)"
            )
        block = config.get("weight_block_size")
        if block is None:
            return cls()
        if (
            not isinstance(block, list | tuple)
            or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise QuantConfigError(
                f"quantization_config.weight_block_size {block!r} in {where}: two positive ints"
            )
        return cls((int(block[0]), int(block[1])))

    @property
    def weight_dtype(self) -> torch.dtype:
        return FP8_DTYPE

    def scale_names(self, weight_name: str) -> tuple[str, ...]:
        return (f"{weight_name}_scale_inv", f"{weight_name}_scale")

    def scale_cols(self, cols: int) -> int:
        return math.ceil(cols / self.block[1])

    def make_linear(self, lin: Linear, tp: TensorParallel | None) -> Fp8Linear:
        bias = lin.bias
        return Fp8Linear(
            lin.in_features, lin.out_features, self, tp=tp,
            bias_dtype=None if bias is None else bias.dtype, device=lin.weight.device,
        )  # fmt: skip

    def hold_experts(self, moe: Any) -> None:
        moe.hold_fp8(self.block[1])

    def held_scales(self, scale: Tensor, rows: int, cols: int) -> Tensor:
        return row_scales(scale, rows, cols, self.block)

    def dequantize(self, weight: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
        return dequantize_fp8_rows(weight, scales, self.block[1], dtype)


QUANT_METHODS: dict[str, type[QuantMethod]] = {Fp8BlockMethod.name: Fp8BlockMethod}


def quant_method_name(hf_config: Any) -> str | None:
    """The checkpoint's ``quantization_config.quant_method`` (None: not quantized)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = qc.get("quant_method")
    return None if method is None else str(method)


def quant_method_from_config(
    hf_config: Any, where: str, requested: str | None = None
) -> QuantMethod | None:
    """The ``QuantMethod`` that serves the checkpoint whose config is ``hf_config`` (read
    from ``where``); ``requested``: the ``--quantization`` flag (None: the checkpoint's).
    QuantConfigError naming the method and the file when none serves it."""
    found = quant_method_name(hf_config)
    if found is None:
        if requested is not None:
            raise QuantConfigError(
                f"quantization {requested!r}: {where} has no quantization_config (the "
                "checkpoint is not quantized; online quantization is not supported)"
            )
        return None
    if requested is not None and requested != found:
        raise QuantConfigError(
            f"quantization {requested!r} does not match {where}'s quant_method {found!r}"
        )
    cls = QUANT_METHODS.get(found)
    if cls is None:
        raise QuantConfigError(
            f"quantization_config.quant_method {found!r} in {where} is not supported "
            f"(supported: {', '.join(sorted(QUANT_METHODS))})"
        )
    qc = hf_config.quantization_config
    if not isinstance(qc, Mapping):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    return cls.from_config(qc, where)


class Fp8Linear(nn.Module):
    """``x @ W.T + b`` with ``W`` held as ``weight [out, in]`` float8 and ``weight_scale
    [out, ceil(in / bk)]`` float32 row scales (``Fp8BlockMethod``). With a ``tp`` of size
    > 1 it is row-parallel (like ``RowParallelLinear``: partial products summed, then the
    bias)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        method: Fp8BlockMethod,
        *,
        tp: TensorParallel | None = None,
        bias_dtype: torch.dtype | None = None,  # None: no bias
        device: Any = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method = method
        self.tp = tp or TensorParallel()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
            requires_grad=False,
        )
        self.weight_scale: Tensor  # [out, ceil(in / bk)] float32, filled by the loader
        self.register_buffer(
            "weight_scale",
            torch.empty(out_features, method.scale_cols(in_features), device=device),
        )
        self.bias = (
            None
            if bias_dtype is None
            else nn.Parameter(
                torch.empty(out_features, dtype=bias_dtype, device=device), requires_grad=False
            )
        )
        self.kernel: str | None = None  # a FP8_LINEAR_KERNELS name; None: the reference
        self._packed: Any = None

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        if self.tp.size == 1:
            return self._linear(x, self.bias)
        y = self.tp.all_reduce(self._linear(x, None))
        return y if self.bias is None else y + self.bias

    def _linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.kernel is not None:
            return FP8_LINEAR_KERNELS[self.kernel](x, self._packed, bias)
        return self.reference(x, bias)

    def reference(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """Dequantize in the activation dtype, then a plain GEMM (w8a16)."""
        w = self.method.dequantize(self.weight, self.weight_scale, x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    def use_kernel(self, name: str | None) -> None:
        """Serve by ``FP8_LINEAR_KERNELS[name]`` (packed now, from the loaded weight), or
        by the reference (None)."""
        if name is None:
            self.kernel, self._packed = None, None
            return
        kernel = FP8_LINEAR_KERNELS.get(name)
        if kernel is None:
            raise ValueError(
                f"no FP8 linear kernel {name!r}; registered: {sorted(FP8_LINEAR_KERNELS)}"
            )
        self._packed = kernel.pack(self.weight, self.weight_scale, self.method.block[1])
        self.kernel = name

    def weights_updated(self) -> None:
        """The loader wrote the weight: a kernel's pack follows it."""
        if self.kernel is not None:
            self.use_kernel(self.kernel)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            f"fp8 block={self.method.block}"
        )
