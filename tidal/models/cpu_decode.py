"""A pure decode step on CPU as a flat sequence of C++ kernel calls (docs/architecture.md#cpu-decode-plan).

Why: at batch 1 the 64-expert bf16 checkpoint's decode step spent about a third of its
time in Python between the kernels -- module calls, the per-call checks of which path
serves (``*_ok``, the measured choice for the row count), views and wrappers -- about
250 us a layer around 400 us of kernels. A ``DecodePlan`` settles all of that once per
model state and row count, then calls the ops (``torch.ops.tidal_cpu.<op>.default``)
directly with their arguments bound. Where one piece of a layer takes another path (MLA
attention, a dense MLP, shared or biased experts, a torch-chosen op), that piece calls
its module as the ordinary forward does; the rest stays direct.

Equality: every direct call is the very kernel call the module path makes, with the
same arguments, in the same order, so the step's output is bit for bit the module
path's (``tests/unit/test_cpu_decode_plan.py`` compares them, step by step). A layer whose
pieces are direct runs them as one ``decode_layer`` call (``_FusedLayer``), the same
kernels again, from C++; a model whose layers all are runs as one ``decode_model`` call
(``_FusedStack``: the embedding lookup, the layers, the final norm).

Staleness: a plan records what it read (held weights, measured choices, the KV cache,
the expert map, the dispatcher, the submodules), weakly where it can, and is rebuilt when
any of it is no longer what the layer holds (an expert move re-packs, a new KV cache is
bound, EP starts); checked on every step (~19 us for 8 layers in a tight loop, 55-90 us
in a real step, whose weights leave the interpreter's data cold), or, in an engine, after
a reported change only (``Verify.ON_CHANGE``). It pins no packed
weights, no embedding and no cache: the calls hold those weakly or read them from their
layers at each call (only norm weights, biases and sinks, small, are bound).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
import typing
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from tidal.kernels.cpu_attention import KERNEL_DTYPES as ATTENTION_DTYPES
from tidal.kernels.cpu_attention import decode_attention_cpu_supports
from tidal.kernels.cpu_ext import kernel_available, native_args
from tidal.kernels.cpu_fp8 import (
    FP8_EMPTY_PREFETCH,
    Fp8CpuExperts,
    Fp8CpuLinear,
    PackedFp8Experts,
    PackedFp8Linear,
)
from tidal.kernels.cpu_moe import CpuPackedExperts
from tidal.kernels.cpu_paths import HeldExperts, HeldGate, HeldLinear
from tidal.kernels.cpu_router import CpuPackedGate
from tidal.layers.attention import AttentionBackend, AttentionMetadata, PagedAttention
from tidal.layers.linear import Linear, RowParallelLinear
from tidal.layers.mla import MLAttention
from tidal.layers.norm import QKNorm, RMSNorm
from tidal.layers.quant import Fp8Linear
from tidal.moe.layer import FusedMoE

if TYPE_CHECKING:
    from tidal.models.common import DecoderLayer, MoECausalLM

_OPS = torch.ops.tidal_cpu
_FP8_ACT_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ FP8 kernels read


# ---- linears ------------------------------------------------------------------------


@dataclass(frozen=True)
class _NativeLinear:
    """A held linear's C++ call, ``x [T, K] -> [T, N]`` (``HeldLinear``'s native call). Like
    every direct call here it reads its weights from the layer at each call."""

    lin: Linear
    bias: Tensor | None
    prefetch: int
    dot: bool
    amx: bool

    def __call__(self, x: Tensor) -> Tensor:
        held = typing.cast(HeldLinear, self.lin._held)
        return _OPS.linear.default(
            x, held.packed, self.bias, held.out_features, self.prefetch, self.dot, self.amx
        )

    def weights(self) -> tuple[Tensor, None]:
        """The pack and no scales, as ``decode_layer`` takes a projection."""
        return typing.cast(HeldLinear, self.lin._held).packed, None

    def layout(self) -> tuple[int, int, int, bool, bool]:
        """out_features, block_k (none), prefetch, dot, amx."""
        out = typing.cast(HeldLinear, self.lin._held).out_features
        return out, 0, self.prefetch, self.dot, self.amx


@dataclass(frozen=True)
class _NativeFp8Linear:
    """An FP8 linear's C++ call, ``x [T, K] -> [T, N]`` (``Fp8CpuLinear``'s call)."""

    lin: Fp8Linear
    bias: Tensor | None
    prefetch: int
    dot: bool
    amx: bool

    def __call__(self, x: Tensor) -> Tensor:
        p = typing.cast(PackedFp8Linear, self.lin._packed)
        return _OPS.fp8_linear.default(
            x, p.w, p.scales, self.bias, p.out_features, p.block_k, self.prefetch, self.dot,
            self.amx,
        )  # fmt: skip

    def weights(self) -> tuple[Tensor, Tensor]:
        """The FP8 pack and its scales, as ``decode_layer`` takes a projection."""
        p = typing.cast(PackedFp8Linear, self.lin._packed)
        return p.w, p.scales

    def layout(self) -> tuple[int, int, int, bool, bool]:
        """out_features, block_k, prefetch, dot, amx."""
        p = typing.cast(PackedFp8Linear, self.lin._packed)
        return p.out_features, p.block_k, self.prefetch, self.dot, self.amx


def _linear_call(lin: Any, rows: int, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    """The direct call of ``lin`` for ``rows``-row steps of ``dtype`` activations, or the
    module itself (another path)."""
    if isinstance(lin, Fp8Linear):
        return _fp8_linear_call(lin, rows, dtype)
    if type(lin) not in (Linear, RowParallelLinear) or lin.params_dtype != dtype:
        return lin
    held = lin._held_weight() if lin.on_cpu else None
    cand = lin._choice().for_rows(rows)
    if not isinstance(held, HeldLinear) or held.path != "native" or cand.path != "native":
        return lin
    return _NativeLinear(lin, lin.bias, *native_args(cand.variant))


def _fp8_linear_call(lin: Fp8Linear, rows: int, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    if lin.tp.size != 1 or lin.triton or not lin.on_cpu or dtype not in _FP8_ACT_DTYPES:
        return lin
    if not isinstance(lin._kernel(), Fp8CpuLinear):
        return lin  # the reference
    if lin._packed is None:
        lin.pack_weights()
    if not isinstance(lin._packed, PackedFp8Linear):
        return lin
    variant = lin._choice().for_rows(rows).variant
    return _NativeFp8Linear(lin, lin.bias, *native_args(variant, FP8_EMPTY_PREFETCH))


def _norm_native(norm: RMSNorm, rows: int, dtype: torch.dtype) -> bool:
    """Whether ``norm``'s forward / ``add_norm`` take the C++ kernel for these steps."""
    return norm.weight.dtype == dtype and norm.kernel_serves(rows)


# ---- attention ----------------------------------------------------------------------


@dataclass
class _Attention:
    """A GQA attention block's direct calls (``Attention.forward`` on the CPU kernels)."""

    qkv: Callable[[Tensor], Tensor]
    o: Callable[[Tensor], Tensor]
    heads: tuple[int, int, int]  # Hq, Hkv, Dh
    norm: tuple[Tensor, Tensor, float] | None  # q_norm's, k_norm's weight, eps; None: none
    attn: PagedAttention
    window: int
    sinks: Tensor | None  # [Hq] float32

    def __call__(self, h: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        num = h.shape[0]
        hq, hkv, dh = self.heads
        qkv = self.qkv(h).view(num, hq + 2 * hkv, dh)  # [T, Hq + 2 Hkv, Dh]
        if self.norm is None:
            qk = _OPS.norm_rope.default(qkv[:, : hq + hkv], cos, sin, None, None, 0, 0.0)
        else:
            wq, wk, eps = self.norm
            qk = _OPS.norm_rope.default(qkv[:, : hq + hkv], cos, sin, wq, wk, hq, eps)
        attn = self.attn
        cache = attn.kv_cache
        _OPS.write_kv.default(cache, meta.slot_mapping, qk[:, hq:], qkv[:, hq + hkv :])
        out = _OPS.decode_attention.default(
            qk[:, :hq], cache, meta.decode_block_table, meta.decode_seq_lens,
            attn.scale, self.window, self.sinks,
        )  # fmt: skip  # [T, Hq, Dh]
        return self.o(out.view(num, hq * dh))


def _attention_call(layer: DecoderLayer, rows: int, dtype: torch.dtype) -> Callable[..., Tensor]:
    a = layer.self_attn
    if isinstance(a, MLAttention) or a.triton_norm_rope or a.qkv_clip is not None:
        return a
    pa = a.attn
    cache = pa.kv_cache
    if (
        pa.backend is not AttentionBackend.NATIVE
        or not pa.native(rows)
        or cache is None
        or not cache.is_contiguous()
        or cache.dtype not in ATTENTION_DTYPES
        or not decode_attention_cpu_supports(dtype, cache.device, a.num_heads // a.num_kv_heads)
        or (pa.sinks is not None and pa.sinks.dtype != torch.float32)
    ):
        return a
    norm = None
    if a.qk_norm is QKNorm.PER_HEAD:
        qn, kn = a.q_norm, a.k_norm
        assert qn is not None and kn is not None
        if not _norm_native(qn, rows * (a.num_heads + a.num_kv_heads), dtype):
            return a
        norm = (qn.weight, kn.weight, qn.eps)
    elif a.qk_norm is not QKNorm.NONE:
        return a
    return _Attention(
        _linear_call(a.qkv_proj, rows, dtype), _linear_call(a.o_proj, rows, dtype),
        (a.num_heads, a.num_kv_heads, a.head_dim), norm, pa, pa.sliding_window or 0, pa.sinks,
    )  # fmt: skip


# ---- MoE ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _NativeExperts:
    """A layer's C++ experts call (``_experts``' native call): float32 / bf16 packs, or
    FP8 ones with their scales (``fp8``)."""

    moe: FusedMoE
    fp8: bool
    prefetch: int
    dot: bool
    amx: bool

    def __call__(
        self, h: Tensor, weights: Tensor, ids: Tensor, expert_map: Tensor | None
    ) -> Tensor:
        w13, w2, s13, s2 = self.weights()
        return _OPS.fused_moe.default(
            h, w13, w2, weights, ids, expert_map, True, self.prefetch, self.dot, s13, s2,
            self.block_k(), amx=self.amx,
        )  # fmt: skip

    def weights(self) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """w13, w2 and (FP8) their scales, as ``fused_moe`` and ``decode_layer`` take them."""
        if self.fp8:
            f = typing.cast(PackedFp8Experts, self.moe._fp8_held)
            return f.w13, f.w2, f.s13, f.s2
        p = typing.cast(CpuPackedExperts, typing.cast(HeldExperts, self.moe._held_experts).packed)
        return p.w13, p.w2, None, None

    def block_k(self) -> int:
        """The FP8 scales' k chunk; 0 without scales."""
        return typing.cast(PackedFp8Experts, self.moe._fp8_held).block_k if self.fp8 else 0


@dataclass
class _Moe:
    """A MoE block's calls at TP size 1 without a dispatcher: the C++ router where it
    serves (else ``route``), the C++ experts where they serve (else ``_experts``: biased,
    onednn or torch experts, the FP8 reference)."""

    moe: FusedMoE
    router: tuple[int, int, bool, int, bool] | None  # E, K, renormalize, prefetch, dot
    experts: _NativeExperts | None

    def __call__(self, h: Tensor) -> Tensor:
        moe = self.moe
        if self.router is None:
            weights, ids = moe.route(h)
        else:
            gate = typing.cast(CpuPackedGate, typing.cast(HeldGate, moe._held_gate).packed)
            weights, ids = _OPS.softmax_topk.default(h, gate.weight, *self.router)
        if moe.record_expert_load:
            moe._record_load(ids)
        if self.experts is None:
            return moe._experts(h, weights, ids, moe._map_arg)
        return self.experts(h, weights, ids, moe._map_arg)


def _moe_call(moe: FusedMoE, rows: int, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    if moe.dispatcher is not None or moe.tp.size != 1 or not moe.on_cpu:
        return moe  # EP: the dispatcher and its collectives, as ever
    if moe.params_dtype != dtype:
        return moe
    router = None
    gate = moe._held("router")
    cand = moe._choice("router").for_rows(rows)
    if (
        isinstance(gate, HeldGate)
        and isinstance(gate.packed, CpuPackedGate)
        and moe.routing.plain_softmax
        and cand.path == "native"
    ):
        hint, dot, _ = native_args(cand.variant)
        router = (gate.packed.num_experts, moe.top_k, moe.renormalize, hint, dot)
    return _Moe(moe, router, _experts_call(moe, rows, dtype))


def _experts_call(moe: FusedMoE, rows: int, dtype: torch.dtype) -> _NativeExperts | None:
    """The experts' C++ call as ``_experts`` makes it, or None: ``_experts`` serves."""
    cand = moe._choice("experts").for_rows(rows)
    if moe.fp8_block_k is not None:  # FP8_EXPERT_KERNELS' C++ kernel (_fp8_experts)
        if moe._fp8_triton or dtype not in _FP8_ACT_DTYPES:
            return None
        if not isinstance(moe._fp8_kernel(), Fp8CpuExperts):
            return None  # the reference
        if moe._fp8_held is None:
            moe._pack("experts")
        if not isinstance(moe._fp8_held, PackedFp8Experts):
            return None
        return _NativeExperts(moe, True, *native_args(cand.variant, FP8_EMPTY_PREFETCH))
    if moe.custom_experts:
        return None
    held = moe._held("experts")
    if (
        not isinstance(held, HeldExperts)
        or not isinstance(held.packed, CpuPackedExperts)
        or held.dtype != dtype
        or cand.path != "native"
    ):
        return None
    return _NativeExperts(moe, False, *native_args(cand.variant))


# ---- a layer in one call ------------------------------------------------------------


@functools.cache
def _layout() -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Where each name sits in ``decode_layer``'s tensors, ints and floats (declared once,
    in ``csrc/decode_cpu.cpp``)."""
    tensors, ints, floats = _OPS.decode_layer_layout.default()
    return (
        {n: i for i, n in enumerate(tensors)},
        {n: i for i, n in enumerate(ints)},
        {n: i for i, n in enumerate(floats)},
    )


_DirectLinear = _NativeLinear | _NativeFp8Linear


# (slot in a call's tensors list, a weak reference to the pack tensor that goes there)
_Packs = tuple[tuple[int, "weakref.ref[Tensor]"], ...]


def _with_packs(static: list[Tensor | None], packs: _Packs) -> list[Tensor | None] | None:
    """``static`` with each pack dereferenced into its slot; None when one is gone."""
    t = static.copy()
    for i, ref in packs:
        t[i] = ref()
        if t[i] is None:
            return None
    return t


class _FusedLayer:
    """A layer's pieces as one ``decode_layer`` call: the same kernels with the same
    arguments in the same order, so bit for bit the pieces' calls, without Python between
    them. Whole where every piece is direct -- two C++ norms, GQA attention on native
    projections, the C++ router and experts, no shared experts (``experts`` set); else,
    where the norms and the attention are direct, the attention half (``experts`` None): the call
    returns the MLP's input and the plan calls the MLP. The packs (weights, scales, gate,
    expert map) are held by weak reference and dereferenced at each call (``tensors``)."""

    def __init__(
        self,
        in_norm: tuple[Tensor, float],
        post_norm: tuple[Tensor, float],
        attention: _Attention,
        qkv: _DirectLinear,
        o: _DirectLinear,
        moe: _Moe | None,
    ) -> None:
        slot, num, real = _layout()
        self.attn = attention.attn
        self.qkv, self.o = qkv, o
        tensors: list[Tensor | None] = [None] * len(slot)
        tensors[slot["in_norm"]], tensors[slot["post_norm"]] = in_norm[0], post_norm[0]
        if attention.norm is not None:
            tensors[slot["q_norm"]], tensors[slot["k_norm"]] = attention.norm[:2]
        tensors[slot["sinks"]] = attention.sinks
        tensors[slot["qkv_bias"]], tensors[slot["o_bias"]] = qkv.bias, o.bias
        self.tensors_static = tensors  # norms, sinks, biases: small, bound
        ints = [0] * len(num)
        hq, hkv, dh = attention.heads
        values: dict[str, int | bool] = dict(hq=hq, hkv=hkv, dh=dh, window=attention.window)
        for name, lin in (("qkv", qkv), ("o", o)):
            for key, v in zip(("out", "block_k", "prefetch", "dot", "amx"), lin.layout()):
                values[f"{name}_{key}"] = v
        self.experts: _NativeExperts | None = None
        if moe is not None:  # values.experts stays 0 without: the attention half only
            assert moe.router is not None and moe.experts is not None
            experts = self.experts = moe.experts
            experts_num, top_k, renormalize, router_prefetch, router_dot = moe.router
            values.update(
                experts=experts_num, top_k=top_k, renormalize=renormalize,
                router_prefetch=router_prefetch, router_dot=router_dot,
                moe_prefetch=experts.prefetch, moe_dot=experts.dot, moe_amx=experts.amx,
                moe_block_k=experts.block_k(),
            )  # fmt: skip
        for name, v in values.items():
            ints[num[name]] = int(v)
        self.ints = ints
        floats = [0.0] * len(real)
        floats[real["in_eps"]], floats[real["post_eps"]] = in_norm[1], post_norm[1]
        floats[real["qk_eps"]] = attention.norm[2] if attention.norm is not None else 0.0
        floats[real["scale"]] = attention.attn.scale
        self.floats = floats
        # The packs (weights, scales, gate, expert map) by weak reference: the plan pins
        # none of them, and one dereference a slot costs less than asking each holder.
        packs: list[tuple[str, Tensor | None]] = [
            *zip(("qkv_w", "qkv_scales"), qkv.weights()),
            *zip(("o_w", "o_scales"), o.weights()),
        ]
        if self.experts is not None:
            moe_layer = self.experts.moe
            gate = typing.cast(CpuPackedGate, typing.cast(HeldGate, moe_layer._held_gate).packed)
            packs += [("gate", gate.weight), ("expert_map", moe_layer._map_arg)]
            packs += zip(("w13", "w2", "s13", "s2"), self.experts.weights())
        self.packs = tuple((slot[n], weakref.ref(t)) for n, t in packs if t is not None)

    def tensors(self) -> list[Tensor | None] | None:
        """The call's tensors list; None when a pack it read is gone (its holder let go
        of it without being replaced: the plan is stale)."""
        return _with_packs(self.tensors_static, self.packs)

    def __call__(
        self,
        x: Tensor,
        delta: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
        tensors: list[Tensor | None],  # self.tensors()
    ) -> tuple[Tensor, Tensor]:
        """[T, H], [T, H] -> (residual [T, H], the MLP's output [T, H]; the attention half:
        the MLP's input)."""
        return _OPS.decode_layer.default(
            x, delta, cos, sin, meta.slot_mapping, meta.decode_block_table, meta.decode_seq_lens,
            self.attn.kv_cache, tensors, self.ints, self.floats,
        )  # fmt: skip


class _FusedStack:
    """A pure decode step's whole model as one ``decode_model`` call: the embedding
    lookup, every layer (each whole: ``_FusedLayer`` with experts) as its ``decode_layer``
    call, then the final norm, from C++; bit for bit the module path's lookups, those
    calls and its final norm, without a dispatch and the plan's Python between layers.
    Serves a step whose layers share one KV cache group and record no expert load."""

    def __init__(self, model: MoECausalLM, layers: list[_FusedLayer]) -> None:
        self.attns = [lay.attn for lay in layers]
        self.moes = [typing.cast(_NativeExperts, lay.experts).moe for lay in layers]
        width = len(layers[0].tensors_static)
        self.tensors_static = [t for lay in layers for t in lay.tensors_static]
        self.packs = tuple(
            (n * width + i, ref) for n, lay in enumerate(layers) for i, ref in lay.packs
        )
        self.ints = [v for lay in layers for v in lay.ints]
        self.floats = [v for lay in layers for v in lay.floats]
        rotary = model.rotary
        # The embedding and the rotary tables by weak reference (the embedding is large),
        # the final norm's weight bound (small, as the layers' norms).
        self.tables = (
            weakref.ref(model.embed_tokens.weight),
            weakref.ref(rotary.cos_table),
            weakref.ref(rotary.signed_sin_table),
        )
        self.norm = (model.norm.weight, model.norm.eps)

    def serves(self, attn: AttentionMetadata) -> bool:
        return not attn.groups and not any(m.record_expert_load for m in self.moes)

    def __call__(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata
    ) -> Tensor | None:
        """[T] int64, [T] int64 -> the final hidden states [T, H]; None when a pack or
        table it read is gone (``_FusedLayer.tensors``)."""
        embed, cos, sin = (ref() for ref in self.tables)
        if embed is None or cos is None or sin is None:
            return None
        t = _with_packs(self.tensors_static, self.packs)
        if t is None:
            return None
        return _OPS.decode_model.default(
            input_ids, positions, embed, cos, sin, *self.norm, meta.slot_mapping,
            meta.decode_block_table, meta.decode_seq_lens, [a.kv_cache for a in self.attns], t,
            self.ints, self.floats,
        )  # fmt: skip


def _fused_call(lay: _Layer) -> _FusedLayer | None:
    """The layer as one ``decode_layer`` call: whole where every piece of it is direct, its
    attention half where the norms and the attention are; else None."""
    a, m = lay.attention, lay.mlp
    if (
        lay.in_norm is None
        or lay.post_norm is None
        or not isinstance(a, _Attention)
        or not isinstance(a.qkv, _DirectLinear)
        or not isinstance(a.o, _DirectLinear)
    ):
        return None
    moe = None  # the attention half, unless the MLP is all C++ too
    if (
        isinstance(m, _Moe)
        and lay.shared is None
        and m.router is not None
        and m.experts is not None
    ):
        moe = m
    return _FusedLayer(lay.in_norm, lay.post_norm, a, a.qkv, a.o, moe)


# ---- staleness ----------------------------------------------------------------------

# (the dict an attribute lives in, its name, what it held at build: a weak reference
# where the object takes one, else the object -- None, a flag, a dict)
_Watch = tuple[dict[str, Any], str, Any, bool]


def _watch(obj: Any, *names: str) -> list[_Watch]:
    """``obj``'s attributes ``names`` as watch entries: a parameter, buffer or submodule of
    a module is watched in its own dict, anything else in ``__dict__`` (a dict lookup per
    step, not ``Module.__getattr__``)."""
    if obj is None:
        return []
    out = []
    for name in names:
        d = obj.__dict__
        for kind in ("_parameters", "_buffers", "_modules"):
            table = d.get(kind)
            if table is not None and name in table:
                d = table
                break
        value = d.get(name)
        try:
            out.append((d, name, weakref.ref(value), True))
        except TypeError:  # None, a bool, a dict: held as is (they pin nothing large)
            out.append((d, name, value, False))
    return out


def _layer_watch(layer: DecoderLayer) -> list[_Watch]:
    """What a layer's plan depends on: it is stale once any of these attributes holds
    another object (an expert move re-packs, a new KV cache is bound, EP starts, a path
    changes, a submodule is replaced)."""
    a, mlp = layer.self_attn, layer.mlp
    out = _watch(layer, "self_attn", "mlp", "shared_experts")
    out += _watch(layer, "input_layernorm", "post_attention_layernorm")
    out += _watch(a, "qkv_proj", "o_proj", "attn", "q_norm", "k_norm")
    for norm in (layer.input_layernorm, layer.post_attention_layernorm, getattr(a, "q_norm", None)):
        out += _watch(norm, "weight", "cpu_choice")
    for lin in (getattr(a, "qkv_proj", None), getattr(a, "o_proj", None)):
        out += _watch(lin, "weight", "bias", "_held", "_packed", "cpu_choice")
    out += _watch(getattr(a, "k_norm", None), "weight")
    out += _watch(getattr(a, "attn", None), "kv_cache", "cpu_choice", "sinks")
    if isinstance(mlp, FusedMoE):
        out += _watch(mlp, "_held_gate", "_held_experts", "_map_arg", "dispatcher", "_fp8_held")
        out += _watch(mlp, "cpu_choice")
        out += [(mlp.cpu_choice, op, mlp.cpu_choice.get(op), False) for op in ("router", "experts")]
    return out


def _model_watch(model: MoECausalLM) -> list[_Watch]:
    """What the model-level calls read: the embedding, the rotary tables, the final norm."""
    out = _watch(model, "embed_tokens", "rotary", "norm")
    out += _watch(model.embed_tokens, "weight")
    out += _watch(model.rotary, "cos_table", "signed_sin_table")
    return out + _watch(model.norm, "weight", "cpu_choice")


# ---- the plan -----------------------------------------------------------------------


@enum.unique
class Fusion(enum.Enum):
    """How many of a plan's kernel calls become one. Each level is bit for bit the one
    below (the tests compare them); the default is the most joined."""

    PIECES = "pieces"  # each piece (norm, attention, router, experts) its own call
    LAYERS = "layers"  # each all-direct layer one decode_layer call (_FusedLayer)
    STACK = "stack"  # and an all-whole model one decode_model call (_FusedStack)


@dataclass
class _Layer:
    group: int  # the layer's KV cache group (AttentionMetadata.groups)
    in_norm: tuple[Tensor, float] | None  # weight, eps on the C++ kernel; None: the module's
    post_norm: tuple[Tensor, float] | None
    attention: Callable[..., Tensor]
    mlp: Callable[[Tensor], Tensor]
    shared: Callable[[Tensor], Tensor] | None
    fused: _FusedLayer | None = None  # the whole layer as one call, where it can be


class DecodePlan:
    """Every layer's calls for steps of one row count (built by ``build``)."""

    def __init__(
        self,
        model: MoECausalLM,
        layers: list[_Layer],
        watched: list[_Watch],
        stack: bool,
    ) -> None:
        modules = model.decoder_layers
        self.layers = layers
        self.modules = modules  # the decoder layers, for the pieces that call them
        self.watched = watched
        # The MoE layers' one shared forward context lives on each of them: the first's.
        self.moe = next((m.mlp for m in modules if isinstance(m.mlp, FusedMoE)), None)
        # How many pieces (two norms, attention, router, experts a layer) take the direct
        # C++ call; the rest call their modules.
        self.direct = sum(
            (lay.in_norm is not None) + (lay.post_norm is not None)
            + isinstance(lay.attention, _Attention)
            + (isinstance(lay.mlp, _Moe) and lay.mlp.router is not None)
            + (isinstance(lay.mlp, _Moe) and lay.mlp.experts is not None)
            for lay in layers
        )  # fmt: skip
        # Layers as one call: whole, or their attention half
        self.fused = sum(lay.fused is not None and lay.fused.experts is not None for lay in layers)
        self.fused_attention = sum(
            lay.fused is not None and lay.fused.experts is None for lay in layers
        )
        # Every layer whole (and the final norm C++): the model as one call, where the
        # step allows (_FusedStack).
        whole = [lay.fused for lay in layers if lay.fused is not None and lay.fused.experts]
        stacked = stack and len(whole) == len(layers) > 0
        self.stack = _FusedStack(model, whole) if stacked else None

    @classmethod
    def build(cls, model: MoECausalLM, rows: int, fusion: Fusion = Fusion.STACK) -> DecodePlan:
        """``fusion``: how many kernel calls become one (``Fusion``)."""
        dtype = model.embed_tokens.weight.dtype
        modules = model.decoder_layers
        layers = []
        for layer, group in zip(modules, model._kv_groups):
            norms = [
                (norm.weight, norm.eps) if _norm_native(norm, rows, dtype) else None
                for norm in (layer.input_layernorm, layer.post_attention_layernorm)
            ]
            mlp = layer.mlp
            moe = _moe_call(mlp, rows, dtype) if isinstance(mlp, FusedMoE) else mlp
            attention = _attention_call(layer, rows, dtype)
            lay = _Layer(group, norms[0], norms[1], attention, moe, layer.shared_experts)
            lay.fused = None if fusion is Fusion.PIECES else _fused_call(lay)
            layers.append(lay)
        watched = _model_watch(model) + [w for layer in modules for w in _layer_watch(layer)]
        stack = fusion is Fusion.STACK and _norm_native(model.norm, rows, dtype)
        return cls(model, layers, watched, stack)

    def fresh(self) -> bool:
        """Whether every object the plan read is still the one its layer holds."""
        for d, name, held, weak in self.watched:
            if weak:
                obj = held()
                if obj is None or d.get(name) is not obj:  # dead: it cannot be the one held
                    return False
            elif d.get(name) is not held:
                return False
        return True

    def padded(self) -> bool:
        """Whether the step pads its rows (a graph's or DP's padding): not a plan's step."""
        ctx = self.moe.forward_context if self.moe is not None else None
        return ctx is not None and ctx.padding is not None

    def forward(
        self, model: MoECausalLM, input_ids: Tensor, positions: Tensor, attn: AttentionMetadata
    ) -> Tensor | None:
        """``MoECausalLM.forward`` on a pure decode step through the layers' calls (the
        model in one call is ``stack_for``'s): [T] int64 ids and positions -> the final
        hidden states [T, H]; None, having run nothing, when a pack the plan read is gone
        (stale: the caller takes the module path)."""
        x = model.embed_tokens(input_ids)
        cos, sin = model.rotary.cos_sin(positions)
        ran = self.run(x, cos, sin, attn)
        return None if ran is None else model.norm.add_norm(*ran)[1]

    def stack_for(self, attn: AttentionMetadata) -> _FusedStack | None:
        """The model in one call (``_FusedStack``) where it serves this step, else None."""
        return self.stack if self.stack is not None and self.stack.serves(attn) else None

    def run(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionMetadata
    ) -> tuple[Tensor, Tensor] | None:
        """The decoder layers, call by call: ``(residual, last MLP output)``, as the
        layer loop of ``MoECausalLM.forward`` leaves them; None, having run nothing, when
        a pack the plan read is gone."""
        # Every fused layer's tensors before any layer runs: a stale plan runs nothing.
        calls = []
        for lay in self.layers:
            tensors = lay.fused.tensors() if lay.fused is not None else None
            if lay.fused is not None and tensors is None:
                return None
            calls.append(tensors)
        delta: Tensor | None = None
        for lay, layer, tensors in zip(self.layers, self.modules, calls):
            meta = attn.groups[lay.group] if attn.groups else attn
            fused = lay.fused
            experts = fused.experts if fused is not None else None
            if (
                fused is not None
                and tensors is not None
                and (delta is None or delta.dtype == x.dtype)  # add_rms_norm's condition
                and (experts is None or not experts.moe.record_expert_load)  # needs the ids
            ):
                x, out = fused(x, delta, cos, sin, meta, tensors)
                if experts is not None:  # the whole layer: out is its MLP's output
                    delta = out
                    continue
                h = out  # the attention half: out is the MLP's input
            else:
                norm = lay.in_norm
                if delta is None:
                    h = (
                        layer.input_layernorm(x)
                        if norm is None
                        else _OPS.rms_norm.default(x, *norm)
                    )
                else:
                    x, h = _add_norm(layer.input_layernorm, norm, x, delta)
                out = lay.attention(h, cos, sin, meta)
                x, h = _add_norm(layer.post_attention_layernorm, lay.post_norm, x, out)
            delta = lay.mlp(h) if lay.shared is None else lay.mlp(h) + lay.shared(h)
        assert delta is not None
        return x, delta


def _add_norm(
    module: RMSNorm, norm: tuple[Tensor, float] | None, x: Tensor, delta: Tensor
) -> tuple[Tensor, Tensor]:
    """``RMSNorm.add_norm``: the C++ pass where the plan took it and the dtypes agree (as
    that method asks), else the method."""
    if norm is None or delta.dtype != x.dtype:
        return module.add_norm(x, delta)
    return _OPS.add_rms_norm.default(x, delta, *norm)


@enum.unique
class Verify(enum.Enum):
    """When a plan's staleness check (``DecodePlan.fresh``) runs."""

    # Before every step (the default): nothing tells the plans what changes.
    EVERY_STEP = "every_step"
    # A whole-model plan (``DecodePlan.stack``) that passed the check serves on unchecked
    # until a change is reported (``DecodePlans.changing`` / ``changed``). For an owner
    # that reports every change: the worker wraps each call but a step in ``changing``,
    # and every forward but a whole-model call reports one itself (a module's forward may
    # pack or choose lazily). The model call runs no module code, so it changes nothing.
    ON_CHANGE = "on_change"


class DecodePlans:
    """A model's plans by row count. ``enabled`` False: every step takes the module path
    (the reference; tests and ``benchmarks/cpu_decode.py`` compare the two)."""

    def __init__(self) -> None:
        self.enabled = True
        self.verify = Verify.EVERY_STEP
        self._fusion = Fusion.STACK
        self._plans: dict[int, DecodePlan] = {}
        # Changes reported so far, and those under way (``changing``): another thread (an
        # elastic helper's worker call) may report one while a step runs.
        self._lock = threading.Lock()
        self._changes = 0
        self._in_flight = 0
        self._trusted: tuple[DecodePlan, int] | None = None  # (plan, _changes when checked)

    @property
    def fusion(self) -> Fusion:
        """How plans join kernel calls (``DecodePlan.build``); setting it drops the plans
        built another way."""
        return self._fusion

    @fusion.setter
    def fusion(self, value: Fusion) -> None:
        if value is not self._fusion:
            self.clear()
        self._fusion = value

    def clear(self) -> None:
        self._plans.clear()
        self._trusted = None

    def changed(self) -> None:
        """Something a plan may have read changed: the next step checks its plan."""
        with self._lock:
            self._changes += 1

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Around a call that may change what plans read: steps check their plans while it
        runs and after it."""
        with self._lock:
            self._changes += 1
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._changes += 1
                self._in_flight -= 1

    def forward(
        self, model: MoECausalLM, input_ids: Tensor, positions: Tensor, attn: AttentionMetadata
    ) -> Tensor | None:
        """``MoECausalLM.forward`` on this step's plan: the final hidden states [T, H]; None:
        the step takes the module path (no plan serves it, or its plan was stale and ran
        nothing: the plans are dropped)."""
        plan = self.for_step(model, attn, input_ids.shape[0])
        if plan is None:
            self.changed()  # the module path: its modules may pack or choose lazily
            return None
        stack = plan.stack_for(attn)
        if stack is not None:
            hidden = stack(input_ids, positions, attn)
        else:
            hidden = plan.forward(model, input_ids, positions, attn)
        if hidden is None:  # stale: it ran nothing, the module path runs
            self.clear()
        if hidden is None or stack is None:  # module code ran, or will
            self.changed()
        return hidden

    def for_step(self, model: MoECausalLM, attn: AttentionMetadata, rows: int) -> DecodePlan | None:
        """The plan of this step, or None: it takes the module path."""
        if not self.enabled or not _step_eligible(attn, rows):
            return None
        plan = self._plans.get(rows)
        trusted = self._trusted
        if (
            plan is not None
            and trusted is not None
            and trusted[0] is plan
            and trusted[1] == self._changes
            and not self._in_flight
        ):
            # Unchanged since its check, the model's eligibility included.
            return None if plan.padded() else plan
        if not _model_eligible(model):
            return None
        seen = self._changes  # before the check: a change during it withholds the trust
        if plan is None or not plan.fresh():
            # Something changed since (a plan is stale): drop every plan and build anew.
            if plan is not None or any(not p.fresh() for p in self._plans.values()):
                self.clear()
            plan = self._plans[rows] = DecodePlan.build(model, rows, self._fusion)
        if self.verify is Verify.ON_CHANGE and plan.stack is not None:
            with self._lock:
                if self._changes == seen and not self._in_flight:
                    self._trusted = (plan, seen)
        return None if plan.padded() else plan


def _model_eligible(model: MoECausalLM) -> bool:
    """Whether the model may take plans: on CPU at TP size 1 with the C++ kernels loaded."""
    return (
        model.tp.size == 1
        and len(model.layers) > 0
        and model.embed_tokens.weight.device.type == "cpu"
        and kernel_available()
    )


def _step_eligible(attn: AttentionMetadata, rows: int) -> bool:
    """Whether the step may take a plan: a pure decode step (every row a sequence's one
    decode token). (The plan itself says whether the step pads its rows:
    ``DecodePlan.padded``.)"""
    if attn.prefills:
        return False
    for meta in attn.groups or (attn,):
        dec = meta.decode_rows
        if (
            meta.prefills
            or not isinstance(dec, slice)
            or dec.stop - dec.start != rows
            or meta.decode_block_table is None
            or meta.decode_seq_lens is None
        ):
            return False
    return True
