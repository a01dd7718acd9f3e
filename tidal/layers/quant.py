"""Quantized weights (docs/architecture.md#quantization): a ``QuantMethod`` per checkpoint
``quantization_config.quant_method``, looked up in ``QUANT_METHODS``.

A method says how a quantized Linear holds and applies its weight (``make_linear``) and
how MoE experts hold theirs (``FusedMoE.hold_fp8``); the loader
(``tidal/models/loader.py``'s ``quantize_model``) decides per module, from the tensors the checkpoint
stores, which modules it converts.

``Fp8BlockMethod`` (``fp8``: DeepSeek-V3/R1, Kimi-K2, the Qwen3 / GLM FP8 releases):
``float8_e4m3fn`` weights with ``bn x bk`` block scales (``weight_block_size``, 128x128)
or one per-tensor scale, held as FP8 plus row scales (``tidal/kernels/fp8_torch.py``: a
quarter of float32's bytes, plus 3%). On CUDA the Triton w8a8 kernels serve
(``tidal/kernels/fp8_triton.py``: activations quantized per token and k-block at run
time, as DeepSeek-V3 runs). On CPU activations are not quantized (w8a16) and the path
is measured at load like every weight op (``tidal/kernels/select.py``, op
``fp8_linear``): ``native``, the C++ kernel decoding FP8 in registers
(``FP8_LINEAR_KERNELS``, an ``Fp8LinearKernel``), whose pack is then the weight's only
copy; or ``torch``, the reference: dequantize the weight in the activation dtype per call,
then multiply. The tests compare each path with its reference.
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
from tidal.kernels.cpu_fp8 import Fp8CpuLinear
from tidal.kernels.fp8_torch import FP8_DTYPE, dequantize_fp8_rows, row_scales, w8a8_group_ok
from tidal.kernels.held_params import HeldParamsModule
from tidal.kernels.select import Candidate, Choice, OpKey, OpSpec, default_choice, weight_candidates
from tidal.layers.linear import Linear, linear_trial

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
    def held_bytes(self, rows: int, cols: int) -> int:
        """Bytes of a converted ``[rows, cols]`` weight as held, its scales included (what
        an expert transfer moves)."""

    @abstractmethod
    def held_scales(self, scale: Tensor, rows: int, cols: int) -> Tensor:
        """A checkpoint scale of a ``[rows, cols]`` weight in the held form; ValueError
        saying the shape expected when it has the wrong one."""

    @abstractmethod
    def dequantize(self, weight: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
        """The held weight's values in ``dtype`` (``[..., N, K]``)."""

    @abstractmethod
    def check_split(self, dim: int, start: int, size: int) -> None:
        """ValueError saying why a tensor-parallel worker cannot hold the block ``[start,
        start + size)`` of a weight's dim ``dim`` (0: output rows, 1: input columns)."""

    @abstractmethod
    def shard_scales(self, scales: Tensor, dim: int, start: int, size: int) -> Tensor:
        """The held scales (``held_scales``) of a whole weight cut to the block of
        ``check_split``: a tensor-parallel worker's."""


class Fp8LinearKernel(Protocol):
    """A fused FP8 linear (e.g. the C++ one): ``pack`` once (then the weight's only copy:
    ``unpack`` rebuilds the weight and its row scales, exact), then called per forward
    with the measured variant (``select.Candidate.variant``)."""

    def pack(self, weight: Tensor, scales: Tensor, block_k: int) -> Any: ...

    def unpack(self, packed: Any) -> tuple[Tensor, Tensor]: ...

    def __call__(self, x: Tensor, packed: Any, bias: Tensor | None, variant: str) -> Tensor: ...


# CPU path name (select.py's ``Candidate.path``) -> kernel; "torch" is the reference, built in.
FP8_LINEAR_KERNELS: dict[str, Fp8LinearKernel] = {"native": Fp8CpuLinear()}


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
            bias_dtype=None if bias is None else bias.dtype, act_dtype=lin.weight.dtype,
            device=lin.weight.device,
        )  # fmt: skip

    def hold_experts(self, moe: Any) -> None:
        moe.hold_fp8(self.block[1])

    def held_bytes(self, rows: int, cols: int) -> int:
        # one byte a weight; a float32 scale per output row and k block (``held_scales``)
        return rows * cols + 4 * rows * self.scale_cols(cols)

    def held_scales(self, scale: Tensor, rows: int, cols: int) -> Tensor:
        return row_scales(scale, rows, cols, self.block)

    def dequantize(self, weight: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
        return dequantize_fp8_rows(weight, scales, self.block[1], dtype)

    # Tensor parallelism: the held scales are per output row, so a split of the rows takes
    # its rows' scales wherever it falls; a split of the input columns must start on a
    # block edge (its k chunks are then the checkpoint's, the last one possibly short).

    def check_split(self, dim: int, start: int, size: int) -> None:
        bk = self.block[1]
        if dim == 1 and start % bk:
            raise ValueError(
                f"input columns [{start}, {start + size}) start inside a {bk}-wide scale "
                f"block (weight_block_size {list(self.block)}): each worker's share of the "
                f"input dimension must be a multiple of {bk}"
            )

    def shard_scales(self, scales: Tensor, dim: int, start: int, size: int) -> Tensor:
        self.check_split(dim, start, size)
        if dim == 0:
            return scales.narrow(0, start, size)
        bk = self.block[1]
        return scales.narrow(1, start // bk, math.ceil(size / bk))


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


class Fp8Linear(HeldParamsModule):
    """``x @ W.T + b`` with ``W`` held as ``weight [out, in]`` float8 and ``weight_scale
    [out, ceil(in / bk)]`` float32 row scales (``Fp8BlockMethod``). With a ``tp`` of size
    > 1 it is row-parallel (like ``RowParallelLinear``: partial products summed, then the
    bias).

    On CUDA (``triton``) the Triton w8a8 linear serves (``fp8_triton.fp8_linear``; a
    checkpoint whose k-block it cannot take, not a power of two >= 32, runs the
    reference). On CPU the path is measured at load (``tidal/kernels/select.py``, op
    ``fp8_linear``):
    ``native`` (the C++ kernel, ``FP8_LINEAR_KERNELS``) packs the weight and its scales
    into its layout, then the only copy (``weight``/``weight_scale`` are then read and
    written through ``read_weights``/``write_weights``, ``HeldParamsModule``); ``torch`` is
    the reference, dequantizing per call."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        method: Fp8BlockMethod,
        *,
        tp: TensorParallel | None = None,
        bias_dtype: torch.dtype | None = None,  # None: no bias
        act_dtype: torch.dtype = torch.float32,  # the model's: the trials' activations
        device: Any = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method = method
        self.tp = tp or TensorParallel()
        self.act_dtype = act_dtype
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
            requires_grad=False,
        )
        # [out, ceil(in / bk)] float32, filled by the loader; a parameter so that a packed
        # path releases it with the weight (HeldParamsModule)
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, method.scale_cols(in_features), device=device),
            requires_grad=False,
        )
        self.bias = (
            None
            if bias_dtype is None
            else nn.Parameter(
                torch.empty(out_features, dtype=bias_dtype, device=device), requires_grad=False
            )
        )
        self.on_cpu = torch.device(device or "cpu").type == "cpu"
        # The Triton w8a8 path (tests set it on CPU under the Triton interpreter).
        self.triton = torch.device(device or "cpu").type == "cuda" and w8a8_group_ok(
            method.block[1]
        )
        self.cpu_choice: Choice | None = None  # None: the default, decided at first use
        self._packed: Any = None  # the chosen kernel's pack: then the only copy

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        if self.tp.size == 1:
            return self._linear(x, self.bias)
        y = self.tp.all_reduce(self._linear(x, None))
        return y if self.bias is None else y + self.bias

    def _linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.triton:
            # Lazy: triton is an extra (``tidal[triton]``), never imported on CPU-only installs.
            # Nothing packs the weight on this path: the parameters are the weight.
            from tidal.kernels.fp8_triton import fp8_linear

            return fp8_linear(x, self.weight, self.weight_scale, self.method.block[1], bias)
        kernel = self._kernel()
        if kernel is None:
            return self.reference(x, bias)
        if self._packed is None:
            self.pack_weights()
        variant = self._choice().for_rows(x.numel() // max(1, x.shape[-1])).variant
        return kernel(x, self._packed, bias, variant)

    def reference(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """Dequantize in the activation dtype, then a plain GEMM (w8a16; the w8a8 Triton
        path's own reference is ``fp8_torch.w8a8_linear_torch``)."""
        scales = self._weight("weight_scale")
        w = self.method.dequantize(self._weight("weight"), scales, x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    # ---- the CPU path (select.py) and the one copy of the weight ---------------------

    def _choice(self) -> Choice:
        if self.cpu_choice is None:
            self.cpu_choice = default_choice(self._candidates(), True)
        return self.cpu_choice

    def _candidates(self) -> list[Candidate]:
        return weight_candidates(FP8_DTYPE, self.act_dtype, self.method.block[1])

    def _kernel(self) -> Fp8LinearKernel | None:
        return FP8_LINEAR_KERNELS.get(self._choice().layout or "") if self.on_cpu else None

    def pack_weights(self) -> None:
        """Put the weight in the chosen path's layout now (the loader, at start-up)."""
        kernel = self._kernel()
        if (kernel is None) == (self._packed is None):
            return
        weight, scales = self._weight("weight").detach(), self._weight("weight_scale").detach()
        if kernel is None:
            self._packed = None
            self.restore_param("weight", weight)
            self.restore_param("weight_scale", scales)
            return
        packed = self._packed = kernel.pack(weight, scales, self.method.block[1])
        del weight, scales  # the pack is the only copy from here
        self.release_param("weight", lambda: kernel.unpack(packed)[0])
        self.release_param("weight_scale", lambda: kernel.unpack(packed)[1])

    def _repack(self, values: dict[str, Tensor]) -> None:
        self._restore_group(("weight", "weight_scale"), values)
        self._packed = None
        self.pack_weights()

    def cpu_ops(self) -> dict[str, OpSpec]:
        if not self.on_cpu:
            return {}
        key = OpKey(
            "fp8_linear",
            (self.in_features, self.out_features, int(self.bias is not None), self.method.block[1]),
        )
        nbytes = self.in_features * self.out_features  # one byte a weight
        return {"linear": OpSpec(key, tuple(self._candidates()), True, nbytes)}

    def cpu_trial(self, op: str, candidate: Candidate, instances: int) -> Any:
        def stand_in() -> Fp8Linear:
            lin = Fp8Linear(
                self.in_features, self.out_features, self.method,
                bias_dtype=None if self.bias is None else self.bias.dtype,
                act_dtype=self.act_dtype,
            )  # fmt: skip
            lin.weight.data.view(torch.uint8).fill_(0x38)  # 1.0 in e4m3
            lin.weight_scale.data.fill_(0.01)
            return lin

        return linear_trial(stand_in, op, candidate, instances, self.act_dtype)

    def set_cpu_path(self, op: str, choice: Choice) -> None:
        self.cpu_choice = choice
        if self._packed is not None:
            self.pack_weights()  # loaded already: move the weight to the new layout

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            f"fp8 block={self.method.block}"
        )
