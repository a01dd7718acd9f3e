"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged latent cache
(docs/architecture.md#kv-cache-layouts).

Each token is compressed to ``c = RMSNorm(x @ W_kva[:r])`` (``kv_lora_rank`` r values)
plus one rotary key ``k_pe`` (``qk_rope_head_dim`` values) shared by every head; only
their concatenation is cached, ``[num_blocks, block_size, r + rope]`` per layer, instead
of K and V per head. ``kv_b_proj`` ``[H, nope + v, r]`` maps a latent to a head's
``k_nope`` (``W_uk``) and ``v`` (``W_uv``). Queries come from ``q_proj`` or, with
``q_lora_rank``, ``q_b_proj(RMSNorm(q_a_proj(x)))``.

Batches follow ``AttentionMetadata`` (``tidal/layers/attention.py``): the new latents are
written through ``slot_mapping`` first. A prefill chunk decompresses the latents it
reads (its own, causally, when it starts at 0; else its gathered blocks, with
``chunk.mask``: chunked prefill, prefix-cache hits) into per-head K/V, the form
transformers computes, and runs SDPA with ``k = [k_nope, k_pe]``, ``q = [q_nope, q_pe]``.
Decode rows (``decode_block_table``) use the absorbed form instead, which never
decompresses a key: ``q_nope @ W_uk`` is a query in latent space, so scores are
``[q_nope W_uk, q_pe] . [c, k_pe]`` and the output ``(probs @ c) @ W_uv.T``: two
batched GEMMs per step over the padded, masked latents every head shares -- per key
``r + rope`` values read instead of ``H x (nope + v)`` computed. ``decode_reference`` is the decompressing
form, the tests' oracle for it. The cache is in ``--kv-cache-dtype`` (the model's by
default): latents are cast into it on write, and only the rows a step gathers are cast
back to the model's dtype.

Tensor parallelism: each worker owns ``num_heads / tp`` heads (its rows of
``q_b_proj``/``q_proj`` and ``kv_b_proj``, its columns of ``o_proj``); the latent
projections are replicated, so every worker caches the whole latent (the latent is the
same for every head, there is nothing to split).

Rotary: DeepSeek's checkpoints rotate interleaved pairs ``(x0, x1), (x2, x3), ...``
(``rope_interleave``); de-interleaving q_pe and k_pe alike before the usual rotate-half
rotation gives the same dot products. YaRN (``tidal/layers/rotary.py``'s ``Yarn``) as transformers computes it:
scaled frequencies, cos/sin times the attention factor, and the softmax scale times
``mscale(factor, mscale_all_dim)**2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tidal.distributed.tensor_parallel import TensorParallel
from tidal.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    default_backend,
    triton_attention,
)
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


class MLAttention(nn.Module):
    """One layer's MLA over its latent cache (see the module docstring). ``q_proj`` is
    the checkpoint's ``q_b_proj`` when queries are compressed (``q_lora_rank``)."""

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
        # [Hq * (nope + v), r], the checkpoint's layout. A plain parameter, not a Linear:
        # the decode path reads it per head (W_uk, W_uv), so no CPU path may pack it.
        self.kv_b_proj = nn.Parameter(
            torch.empty(hq * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank, **kw),
            requires_grad=False,
        )
        self.o_proj = RowParallelLinear(num_heads * s.v_head_dim, hidden_size, s.bias, tp=tp, **kw)
        self.kv_cache: Tensor | None = None  # [NB, bs, latent_dim], set by bind_cache
        # The absorbed decode on the Triton paged kernel (CUDA), else in torch.
        self.triton_decode = default_backend(device or "cpu") is AttentionBackend.TRITON

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
                keys = keys.to(x.dtype)  # --kv-cache-dtype may differ: the gathered rows only
                out[r] = self._attend(q[r], keys, chunk.mask, causal=False)
        return self.o_proj(out.reshape(T, -1))

    def _expand(self, latents: Tensor) -> tuple[Tensor, Tensor]:
        """[..., K, latent_dim] -> k [..., Hq, K, qk], v [..., Hq, K, v]."""
        s, hq = self.spec, self.num_heads
        kv = F.linear(latents[..., : s.kv_lora_rank], self.kv_b_proj)
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
        """[D, Hq, qk] one query per sequence -> [D, Hq, v], absorbed: attended in latent
        space, by the Triton paged kernel on CUDA (``triton_decode``), else by torch:
        every sequence's latents gathered into one padded batch (masked where shorter)."""
        s, hq = self.spec, self.num_heads
        w = self.kv_b_proj.view(hq, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        w_uk, w_uv = w[:, : s.qk_nope_head_dim], w[:, s.qk_nope_head_dim :]  # [Hq, nope|v, r]
        # [Hq, D, nope] @ [Hq, nope, r]: each head's query in latent space
        q_lat = torch.bmm(q[..., : s.qk_nope_head_dim].transpose(0, 1), w_uk)
        q_full = torch.cat((q_lat.transpose(0, 1), q[..., s.qk_nope_head_dim :]), dim=-1)
        if self.triton_decode:
            out_lat = self._decode_triton(q_full, by_token, meta)  # [D, Hq, r]
        else:
            out_lat = self._decode_torch(q_full, by_token, meta)
        # [Hq, D, r] @ [Hq, r, v]
        return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _decode_torch(
        self, q_full: Tensor, by_token: Tensor, meta: AttentionMetadata
    ) -> Tensor:  # [D, Hq, r + rope] -> [D, Hq, r]
        s = self.spec
        latents = _gather_decode_latents(by_token, meta).to(q_full.dtype)  # [D, K, r + rope]
        # Every head reads the same latents: one [Hq, K] score matrix per sequence, with no
        # copy of the keys per head (SDPA's GQA would expand them).
        scores = torch.bmm(q_full, latents.transpose(1, 2)) * s.softmax_scale  # [D, Hq, K]
        if meta.decode_mask is not None:  # [D, 1, 1, K]: padding keys
            scores.masked_fill_(~meta.decode_mask[:, 0], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.bmm(probs, latents[..., : s.kv_lora_rank])  # [D, Hq, r]

    def _decode_triton(
        self, q_full: Tensor, by_token: Tensor, meta: AttentionMetadata
    ) -> Tensor:  # [D, Hq, r + rope] -> [D, Hq, r]
        """The latent cache as one KV head: the key is the whole latent, the value its
        first ``r`` values; every query head is in that head's group."""
        assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
        keys = by_token.view(-1, 1, meta.block_size, self.spec.latent_dim)  # [NB, 1, bs, L]
        return triton_attention().paged_decode_attention(
            q_full, keys, keys[..., : self.spec.kv_lora_rank], meta.decode_block_table,
            meta.decode_seq_lens, self.spec.softmax_scale,
        )  # fmt: skip

    def decode_reference(self, q: Tensor, by_token: Tensor, meta: AttentionMetadata) -> Tensor:
        """The decode rows as prefill computes them: every key decompressed to per-head
        K/V, then SDPA; [D, Hq, qk] -> [D, Hq, v]. The oracle of ``_decode``."""
        latents = _gather_decode_latents(by_token, meta).to(q.dtype)
        k, v = self._expand(latents)  # [D, Hq, K, *]
        mask = meta.decode_mask  # [D, 1, 1, K] or None
        out = F.scaled_dot_product_attention(
            q[:, :, None], k, v, attn_mask=mask, scale=self.spec.softmax_scale
        )  # [D, Hq, 1, v]
        return out[:, :, 0]


def _gather_decode_latents(by_token: Tensor, meta: AttentionMetadata) -> Tensor:
    """[NB * bs, r + rope] cache rows -> [D, max_blocks * bs, r + rope]: each decode
    sequence's blocks in order (padding blocks are masked by ``meta.decode_mask``)."""
    table = meta.decode_block_table
    assert table is not None
    bs = meta.block_size
    slots = table[:, :, None] * bs + torch.arange(bs, device=table.device)  # [D, B, bs]
    return by_token.index_select(0, slots.reshape(-1)).view(table.shape[0], -1, by_token.shape[1])
