"""What one layer's paged KV cache holds per token, declared by the model
(``model.kv_cache_spec()``) so the runner sizes and allocates the cache without knowing
the attention (docs/architecture.md#kv-cache-layouts).

Two layouts: ``KV`` (``tidal/layers/attention.py``: K and V of each KV head,
``[2, num_blocks, heads, block_size, head_dim]``) and ``LATENT`` (multi-head latent
attention, ``tidal/layers/mla.py``: one compressed vector per token shared by every head,
``[num_blocks, block_size, width]``). Either way a token at position p of a sequence lives
in block ``block_ids[p // block_size]`` at offset ``p % block_size``, so the block manager,
prefix caching and chunked prefill are the same for both.

Layers with different windows form KV cache groups (``group_windows``), each with its own
block table per request; a block id is then a page of every cache tensor, tensor i
holding the i-th layer of each group (``layer_pages``; docs/architecture.md#kv-sliding-window).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

import torch


def peak_table_blocks(
    windows: Sequence[int | None], num_tokens: int, block_size: int, max_step_tokens: int
) -> int:
    """The most blocks one sequence holds at once, over every group, while its KV grows to
    ``num_tokens`` tokens in steps of at most ``max_step_tokens`` new ones: what admission
    and the cache's size must allow for it. A full-attention group's table keeps every
    block. A sliding group frees, before each step's blocks are allocated, the blocks its
    first query reads no more (``KVCacheManager``): after a step from p computed tokens
    to p + c it holds ``ceil((p + c) / bs) - floor((p - W + 1) / bs)`` blocks, at most
    ``floor((c + W - 3) / bs) + 2`` for any p."""
    whole = -(-num_tokens // block_size)
    step = max(1, min(max_step_tokens, num_tokens))
    return sum(
        whole if w is None else min(whole, (step + w - 3) // block_size + 2) for w in windows
    )


class CacheLayout(enum.Enum):
    KV = "kv"  # K and V per KV head
    LATENT = "latent"  # one latent vector per token (MLA)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    layout: CacheLayout
    num_kv_heads: int  # this worker's KV heads (KV); 1 (LATENT)
    head_dim: int  # values per head and token: Dh (KV); the latent width (LATENT)
    # Each layer's window (keys > p - W) or None (it attends to every key); empty: no
    # layer slides. Layers with one window form a KV cache group, with its own block
    # table per request (docs/architecture.md#kv-sliding-window).
    layer_windows: tuple[int | None, ...] = ()

    @classmethod
    def kv(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        layer_windows: tuple[int | None, ...] = (),
    ) -> KVCacheSpec:
        if layer_windows and len(layer_windows) != num_layers:
            raise ValueError(f"{len(layer_windows)} layer windows for {num_layers} layers")
        if all(w is None for w in layer_windows):
            layer_windows = ()
        return cls(num_layers, CacheLayout.KV, num_kv_heads, head_dim, layer_windows)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """The KV cache groups, in the order their first layers come: each one's window
        (None: full attention). One group unless layers differ."""
        return tuple(dict.fromkeys(self.layer_windows or (None,)))

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def peak_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """``peak_table_blocks`` for this model's groups."""
        return peak_table_blocks(self.group_windows, num_tokens, block_size, max_step_tokens)

    def layer_pages(self) -> list[int]:
        """Each layer's cache tensor: the i-th layer of every group shares tensor i (a
        block id is a page of each tensor, and a block belongs to one group at a time:
        tidal/engine_core/kv_cache.py). One group: layer i, tensor i."""
        if not self.layer_windows:
            return list(range(self.num_layers))
        seen: dict[int | None, int] = {}
        pages = []
        for w in self.layer_windows:
            pages.append(seen.get(w, 0))
            seen[w] = pages[-1] + 1
        return pages

    def layer_groups(self) -> list[int]:
        """Each layer's KV cache group (an index into ``group_windows``)."""
        index = {w: g for g, w in enumerate(self.group_windows)}
        return [index[w] for w in self.layer_windows] or [0] * self.num_layers

    @property
    def num_pages(self) -> int:
        """Cache tensors: the layers of the largest group."""
        return max(self.layer_pages()) + 1

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
        return self._bytes_per_layer_token(dtype) * self.num_layers

    def bytes_per_block(self, dtype: torch.dtype, block_size: int) -> int:
        """Cache bytes of one block id: a page of every cache tensor (one group:
        ``bytes_per_token x block_size``)."""
        return self._bytes_per_layer_token(dtype) * self.num_pages * block_size

    def _bytes_per_layer_token(self, dtype: torch.dtype) -> int:
        return self.values_per_token() * torch.empty((), dtype=dtype).element_size()
