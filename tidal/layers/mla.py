"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged latent cache
(docs/architecture.md#kv-cache-layouts).

Each token is compressed to ``c = RMSNorm(x @ W_kva[:r])`` (``kv_lora_rank`` r values)
plus one rotary key ``k_pe`` (``qk_rope_head_dim`` values) shared by every head; only
their concatenation is cached, ``[num_blocks, block_size, r + rope]`` per layer, instead
of K and V per head. Attention decompresses the cached latents of the keys it reads with
``kv_b_proj`` into per-head ``k_nope`` and ``v`` (the non-absorbed form: the one
transformers computes, so float32 parity is exact up to summation order), then runs
SDPA with ``k = [k_nope, k_pe]``, ``q = [q_nope, q_pe]``. Queries come from
``q_proj`` or, with ``q_lora_rank``, ``q_b_proj(RMSNorm(q_a_proj(x)))``.

Batches follow ``AttentionMetadata`` (``tidal/layers/attention.py``): the new latents are
written through ``slot_mapping`` first; decode rows read their sequences' blocks through
``decode_block_table`` (one padded, masked SDPA); a prefill chunk starting at 0 attends
causally to its own latents, a later chunk (chunked prefill, prefix-cache hit) to its
gathered blocks with ``chunk.mask``.

Tensor parallelism: each worker owns ``num_heads / tp`` heads (its rows of
``q_b_proj``/``q_proj`` and ``kv_b_proj``, its columns of ``o_proj``); the latent
projections are replicated, so every worker caches the whole latent (the latent is the
same for every head, there is nothing to split).

Rotary: DeepSeek's checkpoints rotate interleaved pairs ``(x0, x1), (x2, x3), ...``
(``rope_interleave``); de-interleaving q_pe and k_pe alike before the usual rotate-half
rotation gives the same dot products. YaRN (``yarn_rope``) as transformers computes it:
scaled frequencies, cos/sin times the attention factor, and the softmax scale times
``mscale(factor, mscale_all_dim)**2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tidal.distributed.tensor_parallel import TensorParallel
from tidal.layers.attention import AttentionMetadata
from tidal.layers.linear import Linear, RowParallelLinear
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import apply_rotary

# transformers' DeepSeek builds the q_a / kv_a norms with RMSNorm's default epsilon, not
# the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLASpec:
    q_lora_rank: int  # 0: no query compression (q_proj)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool  # rotate pairs (x0, x1), ... (DeepSeek) rather than halves
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale ** 2
    bias: bool  # attention_bias: on q_a_proj, kv_a_proj_with_mqa and o_proj

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cached values per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnParams:
    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # None: from factor, mscale, mscale_all_dim
    truncate: bool = True


def yarn_rope(dim: int, theta: float, p: YarnParams) -> tuple[Tensor, float]:
    """(inv_freq [dim / 2] float32, cos/sin factor), transformers' YaRN formulas."""
    factor = p.factor
    attention_factor = p.attention_factor
    if attention_factor is None:
        if p.mscale and p.mscale_all_dim:
            attention_factor = yarn_mscale(factor, p.mscale) / yarn_mscale(factor, p.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(p.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(p.beta_fast), correction_dim(p.beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # per frequency: 1 keeps it, 0 divides it by the factor
    interpolated, kept = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + kept * extrapolation
    return inv_freq, float(attention_factor)


class ScaledRotary(nn.Module):
    """``RotaryEmbedding``'s tables (``tidal/layers/rotary.py``, same ``cos_sin``) for given
    inverse frequencies, cos and sin multiplied by ``attention_factor`` (YaRN)."""

    def __init__(
        self, inv_freq: Tensor, max_position: int, attention_factor: float = 1.0, *,
        dtype: Any = None, device: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        pos = torch.arange(max_position, dtype=torch.int64)
        freqs = pos[:, None].float() * inv_freq.float()  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        dtype = dtype or torch.get_default_dtype()
        half = inv_freq.numel()
        cos = (emb.cos() * attention_factor).to(dtype)
        sin = (emb.sin() * attention_factor).to(dtype)
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.register_buffer("cos_table", cos.to(device), persistent=False)
        self.register_buffer("signed_sin_table", signed_sin.to(device), persistent=False)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:  # [T] -> 2 x [T, 1, D]
        return self.cos_table[positions].unsqueeze(1), self.signed_sin_table[positions].unsqueeze(1)


class MLAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        spec: MLASpec,
        tp: TensorParallel,
        *,
        dtype: Any = None,
        device: Any = None,
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.spec = s = spec
        self.num_heads = hq = tp.split(num_heads, "num_attention_heads")  # this worker's
        self.tp = tp
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        if s.q_lora_rank:
            self.q_a_proj = Linear(hidden_size, s.q_lora_rank, s.bias, **kw)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_proj = Linear(s.q_lora_rank, hq * s.qk_head_dim, **kw)  # q_b_proj
        else:
            self.q_proj = Linear(hidden_size, hq * s.qk_head_dim, **kw)
        self.kv_a_proj = Linear(hidden_size, s.latent_dim, s.bias, **kw)  # replicated
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, LATENT_NORM_EPS, **kw)
        self.kv_b_proj = Linear(s.kv_lora_rank, hq * (s.qk_nope_head_dim + s.v_head_dim), **kw)
        self.o_proj = RowParallelLinear(num_heads * s.v_head_dim, hidden_size, s.bias, tp=tp, **kw)
        self.kv_cache: Tensor | None = None  # [NB, bs, latent_dim], set by bind_cache

    def bind_cache(self, cache: Tensor) -> None:
        self.kv_cache = cache

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # [T, h, rope], new
        if self.spec.rope_interleaved:  # pairs (x0, x1), ...: evens then odds
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        else:
            x = x.contiguous()
        return apply_rotary(x, cos, sin)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("KV cache not bound: call model.bind_kv_cache(caches) first")
        s, hq, T = self.spec, self.num_heads, x.shape[0]
        if self.q_a_proj is not None:
            assert self.q_a_layernorm is not None
            q = self.q_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(T, hq, s.qk_head_dim)
        q_pe = self._rope(q[..., s.qk_nope_head_dim :], cos, sin)
        q = torch.cat((q[..., : s.qk_nope_head_dim], q_pe), dim=-1)  # [T, Hq, qk]
        kv = self.kv_a_proj(x)  # [T, r + rope]
        c = self.kv_a_layernorm(kv[:, : s.kv_lora_rank].contiguous())
        k_pe = self._rope(kv[:, None, s.kv_lora_rank :], cos, sin)[:, 0]
        latent = torch.cat((c, k_pe), dim=-1)  # [T, latent_dim]
        by_token = cache.view(-1, s.latent_dim)  # [NB * bs, latent_dim]
        by_token.index_copy_(0, meta.slot_mapping, latent.to(cache.dtype))
        out = q.new_empty(T, hq, s.v_head_dim)
        dec = meta.decode_rows
        if dec is not None:
            out[dec] = self._decode(q[dec], by_token, meta)
        for chunk in meta.prefills:
            r = chunk.rows
            if chunk.kv_blocks is None:  # its own latents only: causal
                out[r] = self._attend(q[r], latent[r], None, causal=True)
            else:
                bs = meta.block_size
                slots = chunk.kv_blocks[:, None] * bs + torch.arange(bs, device=x.device)
                keys = by_token.index_select(0, slots.reshape(-1))  # [B * bs, latent_dim]
                out[r] = self._attend(q[r], keys, chunk.mask, causal=False)
        return self.o_proj(out.reshape(T, -1))

    def _expand(self, latents: Tensor) -> tuple[Tensor, Tensor]:
        """[..., K, latent_dim] -> k [..., Hq, K, qk], v [..., Hq, K, v]."""
        s, hq = self.spec, self.num_heads
        kv = self.kv_b_proj(latents[..., : s.kv_lora_rank])
        kv = kv.view(*latents.shape[:-1], hq, s.qk_nope_head_dim + s.v_head_dim)
        k_nope, v = kv.split((s.qk_nope_head_dim, s.v_head_dim), dim=-1)
        k_pe = latents[..., None, s.kv_lora_rank :].expand(*k_nope.shape[:-1], s.qk_rope_head_dim)
        k = torch.cat((k_nope, k_pe), dim=-1)  # [..., K, Hq, qk]
        return k.transpose(-3, -2), v.transpose(-3, -2)

    def _attend(
        self, q: Tensor, latents: Tensor, mask: Tensor | None, causal: bool
    ) -> Tensor:  # q [n, Hq, qk], latents [K, latent_dim] -> [n, Hq, v]
        k, v = self._expand(latents)  # [Hq, K, *]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k, v, attn_mask=mask, is_causal=causal,
            scale=self.spec.softmax_scale,
        )  # fmt: skip
        return out.transpose(0, 1)

    def _decode(self, q: Tensor, by_token: Tensor, meta: AttentionMetadata) -> Tensor:
        """[D, Hq, qk] one query per sequence -> [D, Hq, v], every sequence's blocks
        gathered into one padded batch (masked where shorter)."""
        table = meta.decode_block_table
        assert table is not None
        bs = meta.block_size
        slots = table[:, :, None] * bs + torch.arange(bs, device=q.device)  # [D, B, bs]
        width = by_token.shape[1]
        latents = by_token.index_select(0, slots.reshape(-1)).view(q.shape[0], -1, width)
        k, v = self._expand(latents)  # [D, Hq, K, *]
        mask = meta.decode_mask  # [D, 1, 1, K] or None
        out = F.scaled_dot_product_attention(
            q[:, :, None], k, v, attn_mask=mask, scale=self.spec.softmax_scale
        )  # [D, Hq, 1, v]
        return out[:, :, 0]
