"""The decoder shared by the supported MoE architectures (Qwen3-MoE, Mixtral).

Both are pre-norm decoders with GQA attention, RoPE, RMSNorm and a softmax top-k MoE
block; they differ only in the numbers and switches of ``DecoderSpec`` (q/k norms,
renormalised top-k, dense layers) and in checkpoint names (``CheckpointNames``).

Runner-facing API (every architecture class)::

    model.forward(input_ids [T] int64, positions [T] int64, attn: AttentionMetadata)
        -> [T, H] hidden states, final norm applied
    model.compute_logits(hidden [N, H]) -> [N, V] float32
    model.kv_cache_spec() -> (num_layers, num_kv_heads, head_dim)
    model.bind_kv_cache(caches)   # one tensor per layer, shape kv_cache_shape(...)
    model.moe_layers() -> list[FusedMoE]  # for EP / EPLB setup

Loader-facing API: ``model.weight_targets()`` maps each checkpoint tensor name to the
parameter view it fills (or None: a known tensor this rank does not hold; or a ``Shard``:
the view takes a block of the checkpoint tensor, tensor parallelism);
``model.optional_weight_names()`` lists the names that may be absent.

Tensor parallelism (``tp``, ``tidal/distributed/tensor_parallel.py``): QKV and gate/up are
column-parallel, O and down row-parallel, the embedding and lm_head vocab-parallel; each
worker attends with its own heads (and caches their KV); MoE experts split their
intermediate dimension over the workers unless ``expert_parallel`` (then they are whole
and the workers split the tokens). ``check_tensor_parallel`` names what does not divide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from tidal.distributed.tensor_parallel import TensorParallel
from tidal.kernels.fused_moe_torch import empty_k_major_experts
from tidal.layers.attention import AttentionMetadata, PagedAttention
from tidal.layers.linear import Embedding, Linear, RowParallelLinear
from tidal.layers.norm import RMSNorm, rms_norm_heads
from tidal.layers.rotary import RotaryEmbedding, apply_rotary, rope_theta_from_config
from tidal.moe.layer import FusedMoE


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
    attention_bias: bool
    qk_norm: bool
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    renormalize: bool
    dense_intermediate_size: int
    moe_layer_mask: tuple[bool, ...]  # per layer: MoE block (True) or dense MLP
    tie_word_embeddings: bool


@dataclass(frozen=True)
class CheckpointNames:
    """Per-architecture names of the MoE tensors in a Hugging Face checkpoint."""

    moe_module: str  # "mlp" (Qwen3-MoE) | "block_sparse_moe" (Mixtral)
    expert_gate: str  # per-expert projection names: gate, up, down
    expert_up: str
    expert_down: str


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


def check_common_config(hf_config: Any) -> None:
    """Reject config features this runtime does not implement, naming them."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r} is not supported (only 'silu')")
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and window < hf_config.max_position_embeddings:
        raise NotImplementedError(f"sliding_window attention ({window}) is not supported")


def base_spec_kwargs(hf_config: Any) -> dict[str, Any]:
    """The DecoderSpec fields every supported architecture reads the same way."""
    check_common_config(hf_config)
    heads = hf_config.num_attention_heads
    return {
        "vocab_size": hf_config.vocab_size,
        "hidden_size": hf_config.hidden_size,
        "num_layers": hf_config.num_hidden_layers,
        "num_heads": heads,
        "num_kv_heads": getattr(hf_config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        "rms_norm_eps": hf_config.rms_norm_eps,
        "rope_theta": rope_theta_from_config(hf_config),
        "max_position": hf_config.max_position_embeddings,
        "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
    }


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: TensorParallel, **kw: Any) -> None:
        super().__init__()
        dh = spec.head_dim
        # This worker's heads (all of them at TP size 1).
        hq = tp.split(spec.num_heads, "num_attention_heads")
        hkv = tp.split(spec.num_kv_heads, "num_key_value_heads")
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, dh
        self.tp = tp
        self.split = (hq * dh, hkv * dh, hkv * dh)  # q | k | v rows of qkv_proj
        self.qkv_proj = Linear(spec.hidden_size, sum(self.split), spec.attention_bias, **kw)
        self.o_proj = RowParallelLinear(
            spec.num_heads * dh, spec.hidden_size, spec.attention_bias, tp=tp, **kw
        )
        self.q_norm = RMSNorm(dh, spec.rms_norm_eps, **kw) if spec.qk_norm else None
        self.k_norm = RMSNorm(dh, spec.rms_norm_eps, **kw) if spec.qk_norm else None
        self.attn = PagedAttention(hq, hkv, dh, **kw)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        num_tokens = x.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(num_tokens, hq + 2 * hkv, self.head_dim)
        # q and k heads are adjacent: norm and rotate them together, one op each.
        qk, v = qkv[:, : hq + hkv], qkv[:, hq + hkv :]
        if self.q_norm is not None:
            weights = (self.q_norm.weight, self.k_norm.weight)
            native = self.q_norm.native(num_tokens * (hq + hkv))
            qk = rms_norm_heads(qk, weights, (hq, hkv), self.q_norm.eps, native)
        qk = apply_rotary(qk, cos, sin)
        out = self.attn(qk[:, :hq], qk[:, hq:], v, meta)  # [T, Hq, Dh]
        return self.o_proj(out.reshape(num_tokens, -1))


class DenseMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, tp: TensorParallel, **kw: Any
    ) -> None:
        super().__init__()
        self.inter = tp.split(intermediate_size, "intermediate_size")  # this worker's
        self.gate_up = Linear(hidden_size, 2 * self.inter, **kw)
        self.down = RowParallelLinear(intermediate_size, hidden_size, tp=tp, **kw)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up(x)
        return self.down(
            torch.nn.functional.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :]
        )


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
        self.self_attn = Attention(spec, tp, **kw)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.is_moe = spec.moe_layer_mask[layer_idx]
        if self.is_moe:
            inter = spec.moe_intermediate_size
            if not expert_parallel:  # else whole experts, and the workers split the tokens
                inter = tp.split(inter, "moe_intermediate_size")
            self.mlp: nn.Module = FusedMoE(
                spec.num_experts, spec.top_k, spec.hidden_size, inter,
                spec.renormalize, local_expert_ids, moe_backend, tp=tp, **kw,
            )  # fmt: skip
            if self.mlp.backend == "torch":
                set_k_major_moe_weights(self.mlp)
        else:
            self.mlp = DenseMLP(spec.hidden_size, spec.dense_intermediate_size, tp, **kw)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, tp=tp, **kw)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position, spec.rope_theta, **kw)
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

    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionMetadata) -> Tensor:
        """input_ids/positions [T] int64 -> hidden states [T, H] (final norm applied)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)

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

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(layers, KV heads of this worker, head dim)."""
        attn = self.layers[0].self_attn
        return self.spec.num_layers, attn.num_kv_heads, self.spec.head_dim

    def bind_kv_cache(self, caches: Sequence[Tensor]) -> None:
        if len(caches) != self.spec.num_layers:
            raise ValueError(f"expected {self.spec.num_layers} KV caches, got {len(caches)}")
        for layer, cache in zip(self.layers, caches):
            layer.self_attn.attn.kv_cache = cache

    def moe_layers(self) -> list[FusedMoE]:
        return [layer.mlp for layer in self.layers if layer.is_moe]

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
        for i, layer in enumerate(self.layers):
            targets.update(self._layer_targets(f"model.layers.{i}", layer))
        return targets

    def optional_weight_names(self) -> set[str]:
        """Known checkpoint names that may be absent."""
        return {"lm_head.weight"} if self.spec.tie_word_embeddings else set()

    def _layer_targets(self, prefix: str, layer: DecoderLayer) -> dict[str, Tensor | Shard | None]:
        rank = self.tp.rank
        t: dict[str, Tensor | Shard | None] = {
            f"{prefix}.input_layernorm.weight": layer.input_layernorm.weight.data,
            f"{prefix}.post_attention_layernorm.weight": layer.post_attention_layernorm.weight.data,
        }
        attn = layer.self_attn
        for kind in ("weight", "bias"):
            fused = getattr(attn.qkv_proj, kind)
            if fused is None:
                continue
            for name, part in zip(
                ("q_proj", "k_proj", "v_proj"), fused.data.split(attn.split, dim=0)
            ):
                t[f"{prefix}.self_attn.{name}.{kind}"] = self._shard(part, 0, rank)
            o = getattr(attn.o_proj, kind).data  # the bias is whole: added after the sum
            t[f"{prefix}.self_attn.o_proj.{kind}"] = self._shard(o, 1, rank) if o.dim() == 2 else o
        if attn.q_norm is not None:
            t[f"{prefix}.self_attn.q_norm.weight"] = attn.q_norm.weight.data
            t[f"{prefix}.self_attn.k_norm.weight"] = attn.k_norm.weight.data
        if layer.is_moe:
            t.update(self._moe_targets(f"{prefix}.{self.names.moe_module}", layer.mlp))
        else:
            mlp = layer.mlp
            gate, up = mlp.gate_up.weight.data.split(mlp.inter, dim=0)
            t[f"{prefix}.mlp.gate_proj.weight"] = self._shard(gate, 0, rank)
            t[f"{prefix}.mlp.up_proj.weight"] = self._shard(up, 0, rank)
            t[f"{prefix}.mlp.down_proj.weight"] = self._shard(mlp.down.weight.data, 1, rank)
        return t

    def _moe_targets(self, prefix: str, moe: FusedMoE) -> dict[str, Tensor | Shard | None]:
        n = self.names
        t: dict[str, Tensor | Shard | None] = {f"{prefix}.gate.weight": moe.gate.data}
        slot_of = {e: s for s, e in enumerate(moe.local_expert_ids)}
        inter = moe.w2.shape[2]
        # Whole experts (EP, or TP size 1): block 0 of a tensor that is one block.
        block = self.tp.rank if inter < self.spec.moe_intermediate_size else 0
        for e in range(moe.num_experts):
            s = slot_of.get(e)
            base = f"{prefix}.experts.{e}"
            if s is None:
                for name in (n.expert_gate, n.expert_up, n.expert_down):
                    t[f"{base}.{name}.weight"] = None
                continue
            t[f"{base}.{n.expert_gate}.weight"] = self._shard(moe.w13.data[s, :inter], 0, block)
            t[f"{base}.{n.expert_up}.weight"] = self._shard(moe.w13.data[s, inter:], 0, block)
            t[f"{base}.{n.expert_down}.weight"] = self._shard(moe.w2.data[s], 1, block)
        return t
