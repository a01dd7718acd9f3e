"""What one layer's paged KV cache holds per token, declared by the model
(``model.kv_cache_spec()``) so the runner sizes and allocates the cache without knowing
the attention (docs/architecture.md#kv-cache-layouts).

Two layouts: ``KV`` (``tidal/layers/attention.py``: K and V of each KV head,
``[2, num_blocks, heads, block_size, head_dim]``) and ``LATENT`` (multi-head latent
attention, ``tidal/layers/mla.py``: one compressed vector per token shared by every head,
``[num_blocks, block_size, width]``). Either way a token at position p of a sequence lives
in block ``block_ids[p // block_size]`` at offset ``p % block_size``, so the block manager,
prefix caching and chunked prefill are the same for both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import assert_never

import torch


class CacheLayout(enum.Enum):
    KV = "kv"  # K and V per KV head
    LATENT = "latent"  # one latent vector per token (MLA)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    layout: CacheLayout
    num_kv_heads: int  # this worker's KV heads (KV); 1 (LATENT)
    head_dim: int  # values per head and token: Dh (KV); the latent width (LATENT)
    # The window every layer attends within (keys > p - W), when each layer has one: the
    # largest. A token that far behind is read by no layer, so the block manager frees
    # its block (docs/architecture.md#kv-sliding-window). None: some layer reads them all.
    window: int | None = None

    @classmethod
    def kv(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, window: int | None = None
    ) -> KVCacheSpec:
        return cls(num_layers, CacheLayout.KV, num_kv_heads, head_dim, window)

    @classmethod
    def latent(cls, num_layers: int, width: int) -> KVCacheSpec:
        return cls(num_layers, CacheLayout.LATENT, 1, width)

    def layer_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The shape of one layer's cache tensor."""
        match self.layout:
            case CacheLayout.KV:
                return (2, num_blocks, self.num_kv_heads, block_size, self.head_dim)
            case CacheLayout.LATENT:
                return (num_blocks, block_size, self.head_dim)
            case _:
                assert_never(self.layout)

    def values_per_token(self) -> int:
        """Cached values of one token in one layer."""
        match self.layout:
            case CacheLayout.KV:
                return 2 * self.num_kv_heads * self.head_dim
            case CacheLayout.LATENT:
                return self.head_dim
            case _:
                assert_never(self.layout)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes of one token over every layer (of this worker)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return self.values_per_token() * elem * self.num_layers
