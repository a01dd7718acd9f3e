"""The decoder shared by the supported MoE architectures (Qwen3-MoE, Mixtral, Qwen2-MoE,
OLMoE, GLM-4.5, GPT-OSS, DeepSeek-V2/V3).

All are pre-norm decoders with GQA attention (or, DeepSeek, multi-head latent attention:
``tidal/layers/mla.py``), RoPE, RMSNorm and a top-k MoE block; they
differ only in the numbers and switches of ``DecoderSpec`` (biases, q/k norms per head or
over the whole width, partial rotary or YaRN, the routing rule, shared experts, dense
layers, sliding-window layers, attention sinks, expert biases and activation) and
in checkpoint names (``CheckpointNames``). An architecture is one module declaring these
and a ``ModelEntry`` (docs/architecture.md#models).

Runner-facing API (every architecture class)::

    model.forward(input_ids [T] int64, positions [T] int64, attn: AttentionMetadata)
        -> [T, H] hidden states, final norm applied
    model.compute_logits(hidden [N, H]) -> [N, V] float32
    model.kv_cache_spec() -> KVCacheSpec  # per-token layout (tidal/layers/cache_spec.py)
    model.bind_kv_cache(caches)   # one tensor per layer, shape spec.layer_shape(...)
    model.moe_layers() -> list[FusedMoE]  # for EP / EPLB setup

Loader-facing API: ``model.weight_targets()`` maps each checkpoint tensor name to the
parameter view it fills (or None: a known tensor this rank does not hold; or a ``Shard``:
the view takes a block of the checkpoint tensor, tensor parallelism);
``model.optional_weight_names()`` lists the names that may be absent,
``model.ignores_weight(name)`` those the loader skips.

Tensor parallelism (``tp``, ``tidal/distributed/tensor_parallel.py``): QKV and gate/up are
column-parallel, O and down row-parallel, the embedding and lm_head vocab-parallel; each
worker attends with its own heads (and caches their KV; a q/k norm over the whole width
sums its squares over the workers); MoE experts split their intermediate dimension over
the workers unless ``expert_parallel`` (then they are whole and the workers split the
tokens). Shared experts are a dense MLP beside the routed ones: every rank computes them
(split like a dense MLP under TP), and EPLB and expert transfers never see them.
``check_tensor_parallel`` names what does not divide.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, assert_never

import torch
from torch import Tensor, nn

from tidal.distributed.tensor_parallel import TensorParallel
from tidal.kernels.fused_moe_torch import empty_k_major_experts
from tidal.kernels.triton_device import triton_serves
from tidal.layers.attention import AttentionMetadata, PagedAttention
from tidal.layers.cache_spec import KVCacheSpec
from tidal.layers.linear import Embedding, Linear, RowParallelLinear
from tidal.layers.mla import MLASpec, MLAttention
from tidal.layers.norm import QKNorm, RMSNorm, rms_norm_sharded
from tidal.layers.quant import QuantMethod
from tidal.layers.rotary import (
    RotaryEmbedding,
    Yarn,
    apply_norm_rotary,
    apply_partial_rotary,
    rope_theta_from_config,
    rotary_dim_from_config,
    triton_norm_rope,
    yarn_from_config,
)
from tidal.models.cpu_decode import DecodePlans
from tidal.moe.layer import FusedMoE
from tidal.moe.reference import ClampedSwiGLU
from tidal.moe.router import Routing


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: QKNorm
    num_experts: int
    moe_intermediate_size: int
    routing: Routing
    dense_intermediate_size: int
    moe_layer_mask: tuple[bool, ...]  # per layer: MoE block (True) or dense MLP
    tie_word_embeddings: bool
    rotary_dim: int  # the rotated dims of each head (< head_dim: partial rotary)
    qkv_clip: float | None = None  # clamp q, k, v to [-clip, clip] (after a full-width q/k norm)
    shared_expert_intermediate_size: int = 0  # 0: no shared experts
    shared_expert_gate: bool = False  # sigmoid(x @ gate.T) scales the shared output
    rope_yarn: Yarn | None = None  # YaRN frequencies and cos/sin scale (GPT-OSS, DeepSeek)
    # Per layer: its sliding window (keys > p - W), None for full attention; () = none.
    layer_windows: tuple[int | None, ...] = ()
    attention_sinks: bool = False  # a learned softmax-denominator logit per head
    expert_bias: bool = False  # biases on the routed experts' projections
    expert_activation: ClampedSwiGLU | None = None  # None: silu(gate) * up
    # Multi-head latent attention (DeepSeek) instead of GQA: its dims; the latent cache.
    mla: MLASpec | None = None

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def top_k(self) -> int:
        return self.routing.top_k


@dataclass(frozen=True)
class CheckpointNames:
    """Per-architecture names of the MoE tensors in a Hugging Face checkpoint."""

    moe_module: str  # "mlp" (Qwen3-MoE) | "block_sparse_moe" (Mixtral)
    expert_gate: str  # per-expert projection names: gate, up, down
    expert_up: str
    expert_down: str
    # The shared experts' MLP under the MoE module ("shared_expert" Qwen2-MoE,
    # "shared_experts" GLM-4.5; its gate_proj/up_proj/down_proj) and their gate's linear.
    shared_expert: str = ""
    shared_expert_gate: str = ""
    router: str = "gate"  # the router's linear under the MoE module ("router" GPT-OSS)


@dataclass(frozen=True)
class ModelEntry:
    """What the registry (``tidal/models/registry.py``) knows of an architecture: its model
    class, transformers' config and model classes by name (imported lazily; the tiny
    checkpoints and the parity tests' reference), and how the tiny-checkpoint factory
    (``tidal/models/tiny.py``) fills that config."""

    architecture: str  # config.json ``architectures``
    model_type: str  # config.json ``model_type``: the tiny factory's ``arch``
    model: type[MoECausalLM]
    hf_config_class: str  # a class of ``transformers``
    hf_model_class: str
    # (num_experts, moe_intermediate_size, intermediate_size, norm_topk_prob) -> the
    # architecture's config kwargs for them
    tiny_config: Callable[[int, int, int, bool], dict[str, Any]]
    # Config kwargs the tests' tiny checkpoints add, so each switch of the architecture
    # runs (e.g. shared experts, group-limited routing); the factory leaves them out.
    test_config: dict[str, Any] = field(default_factory=dict)
    # Called on the seeded transformers model before saving, to give random values to
    # what transformers initialises to constants (e.g. a correction bias).
    tiny_init: Callable[[Any, torch.Generator], None] | None = None


@dataclass(frozen=True)
class Shard:
    """A loader target that takes a block of its checkpoint tensor: ``dest`` is filled
    with ``tensor.narrow(dim, start, dest.shape[dim])``."""

    dest: Tensor
    dim: int
    start: int


def check_tensor_parallel(spec: DecoderSpec, tp_size: int, expert_parallel: bool) -> None:
    """ValueError naming what ``tp_size`` workers cannot split evenly."""
    tp = TensorParallel(0, tp_size)
    tp.split(spec.num_heads, "num_attention_heads")
    tp.split(spec.num_kv_heads, "num_key_value_heads")
    if not all(spec.moe_layer_mask):
        tp.split(spec.dense_intermediate_size, "intermediate_size")
    if any(spec.moe_layer_mask) and not expert_parallel:
        tp.split(spec.moe_intermediate_size, "moe_intermediate_size")
    if any(spec.moe_layer_mask) and spec.shared_expert_intermediate_size:
        tp.split(spec.shared_expert_intermediate_size, "shared_expert_intermediate_size")


def check_common_config(hf_config: Any, sliding_windows: bool = False) -> None:
    """Reject config features this runtime does not implement, naming them
    (``sliding_windows``: the architecture reads its windows itself)."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r} is not supported (only 'silu')")
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", None) is False:
        window = None  # Qwen2-MoE: the window is off (transformers v5 then writes 0)
    if not sliding_windows and window is not None and window < hf_config.max_position_embeddings:
        raise NotImplementedError(f"sliding_window attention ({window}) is not supported")


def base_spec_kwargs(hf_config: Any, sliding_windows: bool = False) -> dict[str, Any]:
    """The DecoderSpec fields every supported architecture reads the same way."""
    check_common_config(hf_config, sliding_windows)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return {
        "vocab_size": hf_config.vocab_size,
        "hidden_size": hf_config.hidden_size,
        "num_layers": hf_config.num_hidden_layers,
        "num_heads": heads,
        "num_kv_heads": getattr(hf_config, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "rms_norm_eps": hf_config.rms_norm_eps,
        "rope_theta": rope_theta_from_config(hf_config),
        "rotary_dim": rotary_dim_from_config(hf_config, head_dim),
        "rope_yarn": _plain_yarn(hf_config),
        "max_position": hf_config.max_position_embeddings,
        "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
    }


def _plain_yarn(hf_config: Any) -> Yarn | None:
    """The config's YaRN for a GQA decoder: mscale with mscale_all_dim also scales the
    softmax, which only MLA (``deepseek_v2.py``) applies."""
    yarn = yarn_from_config(hf_config)
    if yarn is not None and yarn.attention_factor is None and yarn.mscale and yarn.mscale_all_dim:
        raise NotImplementedError("yarn with mscale / mscale_all_dim is not supported")
    return yarn


def sparse_step_layer_mask(hf_config: Any, num_experts: int) -> tuple[bool, ...]:
    """Qwen-MoE's MoE layers: every ``decoder_sparse_step``-th one, less ``mlp_only_layers``."""
    mlp_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return tuple(
        i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
        for i in range(hf_config.num_hidden_layers)
    )


class Attention(nn.Module):
    def __init__(
        self, spec: DecoderSpec, tp: TensorParallel, window: int | None = None, **kw: Any
    ) -> None:
        super().__init__()
        dh = spec.head_dim
        # This worker's heads (all of them at TP size 1).
        hq = tp.split(spec.num_heads, "num_attention_heads")
        hkv = tp.split(spec.num_kv_heads, "num_key_value_heads")
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, dh
        self.tp = tp
        self.split = (hq * dh, hkv * dh, hkv * dh)  # q | k | v rows of qkv_proj
        self.qkv_proj = Linear(spec.hidden_size, sum(self.split), spec.qkv_bias, **kw)
        self.o_proj = RowParallelLinear(
            spec.num_heads * dh, spec.hidden_size, spec.o_bias, tp=tp, **kw
        )
        self.qk_norm = spec.qk_norm
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        match spec.qk_norm:
            case QKNorm.NONE:
                pass
            case QKNorm.PER_HEAD:
                self.q_norm = RMSNorm(dh, spec.rms_norm_eps, **kw)
                self.k_norm = RMSNorm(dh, spec.rms_norm_eps, **kw)
            case QKNorm.FULL_WIDTH:  # this worker's block of the width
                self.q_norm = RMSNorm(hq * dh, spec.rms_norm_eps, **kw)
                self.k_norm = RMSNorm(hkv * dh, spec.rms_norm_eps, **kw)
            case _:
                assert_never(spec.qk_norm)
        self.width = (spec.num_heads * dh, spec.num_kv_heads * dh)  # q, k of all workers
        self.qkv_clip = spec.qkv_clip
        self.attn = PagedAttention(
            hq, hkv, dh, sliding_window=window, sinks=spec.attention_sinks, **kw
        )
        # CUDA: Q/K norm and rotary in one Triton launch (tidal/kernels/norm_rope.py).
        self.triton_norm_rope = triton_serves(kw.get("device") or "cpu")

    def bind_cache(self, cache: Tensor) -> None:
        self.attn.kv_cache = cache

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        num_tokens = x.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) Dh]
        if self.qk_norm is QKNorm.FULL_WIDTH:
            qkv = self._full_width_norm(qkv)
        if self.qkv_clip is not None:
            qkv = qkv.clamp(-self.qkv_clip, self.qkv_clip)
        qkv = qkv.view(num_tokens, hq + 2 * hkv, self.head_dim)
        # q and k heads are adjacent: norm and rotate them together, one op each.
        qk, v = qkv[:, : hq + hkv], qkv[:, hq + hkv :]
        if self.triton_norm_rope:  # CUDA: the per-head norm (if any) and rotary, one launch
            weights = None
            if self.qk_norm is QKNorm.PER_HEAD:
                assert self.q_norm is not None and self.k_norm is not None
                weights = (self.q_norm.weight, self.k_norm.weight)
            eps = 0.0 if self.q_norm is None else self.q_norm.eps
            qk = triton_norm_rope()(qk, cos, sin, weights, hq, eps)
            out = self.attn(qk[:, :hq], qk[:, hq:], v, meta)  # [T, Hq, Dh]
            return self.o_proj(out.reshape(num_tokens, -1))
        if self.qk_norm is QKNorm.PER_HEAD:  # CPU: one C++ pass where the norms take it
            assert self.q_norm is not None and self.k_norm is not None
            weights = (self.q_norm.weight, self.k_norm.weight)
            native = self.q_norm.native(num_tokens * (hq + hkv))
            qk = apply_norm_rotary(
                qk, cos, sin, weights, (hq, hkv), self.q_norm.eps, native, self.q_norm.triton
            )
        else:
            qk = apply_partial_rotary(qk, cos, sin)
        out = self.attn(qk[:, :hq], qk[:, hq:], v, meta)  # [T, Hq, Dh]
        return self.o_proj(out.reshape(num_tokens, -1))

    def _full_width_norm(self, qkv: Tensor) -> Tensor:  # [T, (Hq + 2 Hkv) Dh], new
        assert self.q_norm is not None and self.k_norm is not None
        q, k, v = qkv.split(self.split, dim=1)
        if self.tp.size == 1:
            q, k = self.q_norm(q), self.k_norm(k)
        else:  # the RMS of the whole q (k) row: squares summed over the workers
            eps = self.q_norm.eps
            q = rms_norm_sharded(q, self.q_norm.weight, eps, self.width[0], self.tp.all_reduce)
            k = rms_norm_sharded(k, self.k_norm.weight, eps, self.width[1], self.tp.all_reduce)
        return torch.cat((q, k, v), dim=1)


class DenseMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel,
        what: str = "intermediate_size",  # the config field, named when TP does not divide
        **kw: Any,
    ) -> None:
        super().__init__()
        self.inter = tp.split(intermediate_size, what)  # this worker's
        self.gate_up = Linear(hidden_size, 2 * self.inter, **kw)
        self.down = RowParallelLinear(intermediate_size, hidden_size, tp=tp, **kw)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up(x)
        return self.down(
            torch.nn.functional.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :]
        )


class SharedExperts(nn.Module):
    """The experts every token goes through beside its routed ones: a dense MLP (TP-split
    like one), optionally scaled by ``sigmoid(x @ gate.T)`` (Qwen2-MoE). Replicated on
    every rank; not a ``FusedMoE``, so EP placement, EPLB and expert transfers never move
    it."""

    def __init__(self, spec: DecoderSpec, tp: TensorParallel, **kw: Any) -> None:
        super().__init__()
        self.mlp = DenseMLP(
            spec.hidden_size, spec.shared_expert_intermediate_size, tp,
            "shared_expert_intermediate_size", **kw,
        )  # fmt: skip
        # [1, H], whole on every worker: its output scales whole rows.
        self.gate = Linear(spec.hidden_size, 1, **kw) if spec.shared_expert_gate else None

    def forward(self, x: Tensor) -> Tensor:  # [T, H] -> [T, H]
        out = self.mlp(x)
        if self.gate is not None:
            out = torch.sigmoid(self.gate(x)) * out
        return out


class DecoderLayer(nn.Module):
    def __init__(
        self,
        spec: DecoderSpec,
        layer_idx: int,
        moe_backend: str,
        local_expert_ids: Sequence[int] | None,
        tp: TensorParallel,
        expert_parallel: bool,
        **kw: Any,
    ) -> None:
        super().__init__()
        self.self_attn: Attention | MLAttention = (
            Attention(spec, tp, spec.window(layer_idx), **kw)
            if spec.mla is None
            else MLAttention(spec.hidden_size, spec.num_heads, spec.mla, tp, **kw)
        )
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.is_moe = spec.moe_layer_mask[layer_idx]
        if self.is_moe:
            inter = spec.moe_intermediate_size
            if not expert_parallel:  # else whole experts, and the workers split the tokens
                inter = tp.split(inter, "moe_intermediate_size")
            routing = spec.routing
            moe = FusedMoE(
                spec.num_experts, routing.top_k, spec.hidden_size, inter,
                routing.renormalize, local_expert_ids, moe_backend, tp=tp, routing=routing,
                expert_bias=spec.expert_bias, activation=spec.expert_activation, **kw,
            )  # fmt: skip
            if moe.backend == "torch":
                set_k_major_moe_weights(moe)
            self.mlp: FusedMoE | DenseMLP = moe
        else:
            self.mlp = DenseMLP(spec.hidden_size, spec.dense_intermediate_size, tp, **kw)
        self.shared_experts = (
            SharedExperts(spec, tp, **kw)
            if self.is_moe and spec.shared_expert_intermediate_size
            else None
        )

    def forward(
        self,
        x: Tensor,  # [T, H] the residual stream
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
        delta: Tensor | None = None,  # [T, H] the previous layer's MLP output, not yet added
    ) -> tuple[Tensor, Tensor]:  # (residual, this layer's MLP output), both [T, H]
        """The layer's input is ``x + delta``; its output ``residual + mlp_out``, left
        unsummed so that the next norm (the next layer's input norm, the final norm) adds
        it in the same C++ pass (``RMSNorm.add_norm``)."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_norm(x, delta)
        x, h = self.post_attention_layernorm.add_norm(x, self.self_attn(h, cos, sin, meta))
        if self.shared_experts is None:
            return x, self.mlp(h)
        return x, self.mlp(h) + self.shared_experts(h)


def set_k_major_moe_weights(moe: FusedMoE) -> None:
    """Give the CPU MoE block's weights input-major storage (same shapes), before the
    loader writes them (the values are uninitialised, so none is copied): the router and
    expert GEMMs of the torch paths then read plain row-major matrices, which MKL runs
    fastest (see ``tidal/layers/linear.py``). The loader and expert moves write into these
    very tensors, so there is no second copy to keep in sync."""
    moe.w13.data, moe.w2.data = empty_k_major_experts(moe.w13, moe.w2)
    moe.gate.data = moe.gate.data.t().contiguous().t()


class MoECausalLM(nn.Module):
    """Base of the architecture classes; subclasses set ``names`` and ``spec_from_config``."""

    names: ClassVar[CheckpointNames]

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        raise NotImplementedError

    def __init__(
        self,
        hf_config: Any,
        *,
        dtype: torch.dtype = torch.float32,
        device: Any = "cpu",
        moe_backend: str = "torch",
        local_expert_ids: Sequence[int] | None = None,
        tp: TensorParallel | None = None,
        expert_parallel: bool = False,
    ) -> None:
        """``tp``: this worker's place in its rank's TP group (None: TP size 1);
        ``expert_parallel``: the MoE layers hold whole experts (a subset, EP) rather than
        every expert's TP slice."""
        super().__init__()
        self.config = hf_config
        self.spec = spec = self.spec_from_config(hf_config)
        self.tp = tp = tp or TensorParallel()
        # The CPU paths chosen for its ops (tidal/kernels/select.py's SelectionReport), set
        # by the loader on CPU; the log and /stats show it.
        self.cpu_paths: Any = None
        # The checkpoint's quantization (tidal/layers/quant.py), set by the loader's
        # quantize_model; None: every weight in ``dtype``.
        self.quant: QuantMethod | None = None
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, tp=tp, **kw)
        self.rotary = RotaryEmbedding(
            spec.rotary_dim, spec.max_position, spec.rope_theta, yarn=spec.rope_yarn, **kw
        )
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, moe_backend, local_expert_ids, tp, expert_parallel, **kw)
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        if spec.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:  # vocab-parallel like the embedding: the same padded block of rows
            self.lm_head = Linear(spec.hidden_size, self.embed_tokens.weight.shape[0], **kw)
            self.lm_head.weight.data[self.embed_tokens.valid :].zero_()
        self._kv_groups = self.kv_cache_spec().layer_groups()  # each layer's KV cache group
        # Pure decode steps on CPU as flat C++ kernel calls (tidal/models/cpu_decode.py).
        self.decode_plans = DecodePlans()

    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionMetadata) -> Tensor:
        """input_ids/positions [T] int64 -> hidden states [T, H] (final norm applied)."""
        # A pure decode step on CPU: the same kernel calls as below, without the modules.
        hidden = self.decode_plans.forward(self, input_ids, positions, attn)
        if hidden is not None:
            return hidden
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        delta: Tensor | None = None  # each layer's MLP output, added by the next norm
        if attn.groups:  # KV cache groups: each layer reads its group's tables
            for layer, group in zip(self.layers, self._kv_groups):
                x, delta = layer(x, cos, sin, attn.groups[group], delta)
        else:
            for layer in self.layers:
                x, delta = layer(x, cos, sin, attn, delta)
        if delta is None:  # no layers
            return self.norm(x)
        return self.norm.add_norm(x, delta)[1]

    @torch.no_grad()
    def compute_logits(self, hidden: Tensor) -> Tensor | None:  # [N, H] -> [N, V] float32
        """With TP a collective (every worker calls it): the driver gets the logits, the
        other workers None."""
        if isinstance(self.lm_head, Linear):
            logits = self.lm_head(hidden)  # its measured CPU path (select.py)
        else:  # tied to the embedding
            logits = torch.nn.functional.linear(hidden, self.lm_head.weight)
        if self.tp.size > 1:
            logits = self.tp.gather_cols(logits)  # [N, N_tp * ceil(V / N_tp)] on the driver
            if logits is None:
                return None
            logits = logits[:, : self.spec.vocab_size]
        return logits if logits.dtype == torch.float32 else logits.float()

    def kv_cache_spec(self) -> KVCacheSpec:
        """What this worker caches per token and layer (docs/architecture.md#kv-cache-layouts)."""
        attn = self.decoder_layers[0].self_attn
        if isinstance(attn, MLAttention):
            return KVCacheSpec.latent(self.spec.num_layers, attn.spec.latent_dim)
        windows = tuple(self.spec.window(i) for i in range(self.spec.num_layers))
        return KVCacheSpec.kv(self.spec.num_layers, attn.num_kv_heads, self.spec.head_dim, windows)

    def bind_kv_cache(self, caches: Sequence[Tensor]) -> None:
        if len(caches) != self.spec.num_layers:
            raise ValueError(f"expected {self.spec.num_layers} KV caches, got {len(caches)}")
        for layer, cache in zip(self.decoder_layers, caches):
            layer.self_attn.bind_cache(cache)
        self.decode_plans.clear()  # they read the caches they were built on

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """``layers``, typed (an ``nn.ModuleList`` yields plain modules)."""
        return typing.cast(list[DecoderLayer], list(self.layers))

    def moe_layers(self) -> list[FusedMoE]:
        return [layer.mlp for layer in self.decoder_layers if isinstance(layer.mlp, FusedMoE)]

    def moe_layer_ids(self) -> list[int]:
        """Decoder-layer indices of ``moe_layers()`` (the keys of per-layer expert data)."""
        return [i for i, layer in enumerate(self.layers) if layer.is_moe]

    def _shard(self, dest: Tensor, dim: int, block: int) -> Tensor | Shard:
        """``dest`` filled with this worker's ``block``-th block of its tensor along
        ``dim`` (blocks of ``dest``'s size); ``dest`` itself at TP size 1."""
        if self.tp.size == 1:
            return dest
        return Shard(dest, dim, block * dest.shape[dim])

    def weight_targets(self) -> dict[str, Tensor | Shard | None]:
        """Checkpoint name -> destination view (None: known but not held by this rank; a
        ``Shard``: this worker's block of the tensor)."""
        emb = self.embed_tokens
        vocab_rows = emb.weight.data[: emb.valid]
        embed = vocab_rows if self.tp.size == 1 else Shard(vocab_rows, 0, emb.start)
        targets: dict[str, Tensor | Shard | None] = {
            "model.embed_tokens.weight": embed,
            "model.norm.weight": self.norm.weight.data,
        }
        if self.spec.tie_word_embeddings:
            targets["lm_head.weight"] = None  # optional: some exporters write the tied copy
        else:
            head = self.lm_head.weight.data[: emb.valid]
            targets["lm_head.weight"] = head if self.tp.size == 1 else Shard(head, 0, emb.start)
        for i, layer in enumerate(self.decoder_layers):
            targets.update(self._layer_targets(f"model.layers.{i}", layer))
        return targets

    def optional_weight_names(self) -> set[str]:
        """Known checkpoint names that may be absent."""
        return {"lm_head.weight"} if self.spec.tie_word_embeddings else set()

    def expand_tensor(
        self, name: str, get: Callable[[], Tensor], shape: tuple[int, ...]
    ) -> list[tuple[str, Callable[[], Tensor]]] | None:
        """A stored tensor in a layout of this architecture's own, as (name in
        ``weight_targets``, lazy tensor) pairs; None: the loader's generic layouts."""
        return None

    def ignores_weight(self, name: str) -> bool:
        """Whether the loader skips ``name`` (a tensor of the checkpoint that this runtime
        does not serve) rather than calling it unexpected."""
        return False

    def _layer_targets(self, prefix: str, layer: DecoderLayer) -> dict[str, Tensor | Shard | None]:
        t: dict[str, Tensor | Shard | None] = {
            f"{prefix}.input_layernorm.weight": layer.input_layernorm.weight.data,
            f"{prefix}.post_attention_layernorm.weight": layer.post_attention_layernorm.weight.data,
        }
        attn = layer.self_attn
        if isinstance(attn, MLAttention):
            t.update(self._mla_targets(f"{prefix}.self_attn", attn))
        else:
            t.update(self._attention_targets(f"{prefix}.self_attn", attn))
        if isinstance(layer.mlp, FusedMoE):
            moe_prefix = f"{prefix}.{self.names.moe_module}"
            t.update(self._moe_targets(moe_prefix, layer.mlp))
            shared = layer.shared_experts
            if shared is not None:
                n = self.names
                t.update(self._mlp_targets(f"{moe_prefix}.{n.shared_expert}", shared.mlp))
                if shared.gate is not None:
                    t[f"{moe_prefix}.{n.shared_expert_gate}.weight"] = shared.gate.weight.data
        elif isinstance(layer.mlp, DenseMLP):
            t.update(self._mlp_targets(f"{prefix}.mlp", layer.mlp))
        return t

    def _attention_targets(self, prefix: str, attn: Attention) -> dict[str, Tensor | Shard | None]:
        rank = self.tp.rank
        t: dict[str, Tensor | Shard | None] = {}
        for kind in ("weight", "bias"):
            fused = getattr(attn.qkv_proj, kind)
            if fused is not None:
                for name, part in zip(
                    ("q_proj", "k_proj", "v_proj"), fused.data.split(attn.split, dim=0)
                ):
                    t[f"{prefix}.{name}.{kind}"] = self._shard(part, 0, rank)
            o_param = getattr(attn.o_proj, kind)
            if o_param is not None:  # the bias is whole: added after the sum
                o = o_param.data
                t[f"{prefix}.o_proj.{kind}"] = self._shard(o, 1, rank) if o.dim() == 2 else o
        sinks = attn.attn.sinks
        if sinks is not None:  # this worker's heads
            t[f"{prefix}.sinks"] = self._shard(sinks.data, 0, rank)
        if attn.q_norm is not None and attn.k_norm is not None:
            # Per head: one whole [Dh] weight; over the width: this worker's block of it.
            whole = attn.qk_norm is QKNorm.PER_HEAD
            for name, norm in (("q_norm", attn.q_norm), ("k_norm", attn.k_norm)):
                w = norm.weight.data
                t[f"{prefix}.{name}.weight"] = w if whole else self._shard(w, 0, rank)
        return t

    def _mla_targets(self, prefix: str, attn: MLAttention) -> dict[str, Tensor | Shard | None]:
        """The latent projections and norms whole (replicated); the per-head rows of the
        query and ``kv_b_proj``, and the per-head columns of ``o_proj``, this worker's."""
        rank = self.tp.rank
        q_name = "q_b_proj" if attn.q_a_proj is not None else "q_proj"
        t: dict[str, Tensor | Shard | None] = {
            f"{prefix}.{q_name}.weight": self._shard(attn.q_proj.weight.data, 0, rank),
            f"{prefix}.kv_b_proj.weight": self._shard(attn.kv_b_proj.data, 0, rank),
            f"{prefix}.o_proj.weight": self._shard(attn.o_proj.weight.data, 1, rank),
            f"{prefix}.kv_a_layernorm.weight": attn.kv_a_layernorm.weight.data,
        }
        whole: list[tuple[str, Linear]] = [("kv_a_proj_with_mqa", attn.kv_a_proj)]
        if attn.q_a_proj is not None:
            assert attn.q_a_layernorm is not None
            whole.append(("q_a_proj", attn.q_a_proj))
            t[f"{prefix}.q_a_layernorm.weight"] = attn.q_a_layernorm.weight.data
        for name, lin in whole:
            t[f"{prefix}.{name}.weight"] = lin.weight.data
            if lin.bias is not None:
                t[f"{prefix}.{name}.bias"] = lin.bias.data
        if attn.o_proj.bias is not None:  # whole: added after the sum
            t[f"{prefix}.o_proj.bias"] = attn.o_proj.bias.data
        return t

    def _mlp_targets(self, prefix: str, mlp: DenseMLP) -> dict[str, Tensor | Shard | None]:
        rank = self.tp.rank
        gate, up = mlp.gate_up.weight.data.split(mlp.inter, dim=0)
        return {
            f"{prefix}.gate_proj.weight": self._shard(gate, 0, rank),
            f"{prefix}.up_proj.weight": self._shard(up, 0, rank),
            f"{prefix}.down_proj.weight": self._shard(mlp.down.weight.data, 1, rank),
        }

    def _moe_targets(self, prefix: str, moe: FusedMoE) -> dict[str, Tensor | Shard | None]:
        n = self.names
        t: dict[str, Tensor | Shard | None] = {f"{prefix}.{n.router}.weight": moe.gate.data}
        if moe.score_bias is not None:
            t[f"{prefix}.{n.router}.e_score_correction_bias"] = moe.score_bias
        if moe.gate_bias is not None:
            t[f"{prefix}.{n.router}.bias"] = moe.gate_bias
        slot_of = {e: s for s, e in enumerate(moe.local_expert_ids)}
        inter = moe.w2.shape[2]
        # Whole experts (EP, or TP size 1): block 0 of a tensor that is one block.
        block = self.tp.rank if inter < self.spec.moe_intermediate_size else 0
        for e in range(moe.num_experts):
            s = slot_of.get(e)
            base = f"{prefix}.experts.{e}"
            kinds = ("weight", "bias") if moe.expert_bias else ("weight",)
            if s is None:
                for name in (n.expert_gate, n.expert_up, n.expert_down):
                    for kind in kinds:
                        t[f"{base}.{name}.{kind}"] = None
                continue
            t[f"{base}.{n.expert_gate}.weight"] = self._shard(moe.w13.data[s, :inter], 0, block)
            t[f"{base}.{n.expert_up}.weight"] = self._shard(moe.w13.data[s, inter:], 0, block)
            t[f"{base}.{n.expert_down}.weight"] = self._shard(moe.w2.data[s], 1, block)
            if moe.w13_bias is not None and moe.w2_bias is not None:
                b13 = moe.w13_bias[s]
                t[f"{base}.{n.expert_gate}.bias"] = self._shard(b13[:inter], 0, block)
                t[f"{base}.{n.expert_up}.bias"] = self._shard(b13[inter:], 0, block)
                # Split experts' outputs are summed over the workers: one adds the bias.
                t[f"{base}.{n.expert_down}.bias"] = moe.w2_bias[s] if block == 0 else None
        return t
