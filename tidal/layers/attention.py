"""Paged attention in torch over a flattened batch (no padding between sequences).

Contract with the model runner:

* ``kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)`` is the shape of one
  layer's cache tensor, ``[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``,
  in the model dtype. The worker allocates one per layer and hands the list to
  ``model.bind_kv_cache``. Token at position p of a sequence lives in cache slot
  ``block_ids[p // block_size] * block_size + p % block_size``.
* ``AttentionMetadata.build(seqs, block_size, device)`` once per step, with
  ``seqs[i] = (start, num_new_tokens, block_ids)`` in batch order: sequence i's new
  tokens are the next ``num_new_tokens`` rows of the flattened batch, at positions
  ``start .. start + num_new_tokens - 1``; K/V of positions ``< start`` is already in the
  cache (an earlier chunk, an earlier step, or a shared prefix block). ``block_ids`` must
  cover all positions ``< start + num_new_tokens``.

Each layer first writes the new K/V into the cache through ``slot_mapping``, then:

* decode sequences (one new token) are attended together: their blocks are gathered
  into one padded ``[D, max_blocks * block_size]`` K/V batch and one masked
  ``scaled_dot_product_attention`` runs, with the query heads grouped per KV head (GQA
  without copying K/V per query head);
* each prefill chunk runs its own SDPA: causal on its fresh K/V when it starts at 0,
  else on its gathered cached blocks with an explicit mask (query i at position
  ``start + i`` sees keys ``<= start + i``).

All index tensors are built in ``build``, once per step, not per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


@dataclass
class PrefillChunk:
    """One sequence with more than one new token."""

    rows: slice  # its rows in the flattened batch
    start: int  # tokens already in the cache
    # When start > 0: the blocks covering positions < start + n, and the mask over them.
    kv_blocks: Tensor | None = None  # [num_blocks] int64
    mask: Tensor | None = None  # [n, num_blocks * block_size] bool, True = attend


@dataclass
class AttentionMetadata:
    num_tokens: int
    block_size: int
    slot_mapping: Tensor  # [T] int64 cache slot of each new token
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # tokens in the cache after this step, per sequence
    # Decode group: sequences with exactly one new token.
    decode_rows: slice | Tensor | None = None  # their rows (a slice when contiguous)
    decode_block_table: Tensor | None = None  # [D, max_blocks] int64, padded with block 0
    decode_mask: Tensor | None = None  # [D, 1, 1, max_blocks * block_size] bool; None = no padding
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_block_table is None else self.decode_block_table.shape[0]

    @classmethod
    def build(
        cls, seqs: Sequence[tuple[int, int, Sequence[int]]], block_size: int, device: Any
    ) -> AttentionMetadata:
        """seqs[i] = (start, num_new_tokens, block_ids) for the i-th sequence of the batch, in
        batch order; its new tokens occupy the next num_new_tokens rows of the flattened
        batch; positions are start..start+num_new_tokens-1; KV for positions < start is
        already in the cache."""
        slots: list[int] = []
        dec_rows: list[int] = []
        dec_blocks: list[Sequence[int]] = []
        dec_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        row = 0
        for i, (start, num_new, block_ids) in enumerate(seqs):
            end = start + num_new
            needed = -(-end // block_size)
            if num_new < 1 or start < 0:
                raise ValueError(f"sequence {i}: bad (start={start}, num_new_tokens={num_new})")
            if len(block_ids) < needed:
                raise ValueError(
                    f"sequence {i}: {end} tokens need {needed} blocks of {block_size}, "
                    f"got {len(block_ids)}"
                )
            _append_slots(slots, block_ids, start, end, block_size)
            if num_new == 1:
                dec_rows.append(row)
                dec_blocks.append(block_ids[:needed])
                dec_lens.append(end)
            else:
                prefills.append(
                    _prefill_chunk(row, start, num_new, block_ids[:needed], block_size, device)
                )
            row += num_new
        meta = cls(
            num_tokens=row,
            block_size=block_size,
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
            query_lens=[s[1] for s in seqs],
            seq_lens=[s[0] + s[1] for s in seqs],
            prefills=prefills,
        )
        if dec_rows:
            meta._set_decodes(dec_rows, dec_blocks, dec_lens, device)
        return meta

    def _set_decodes(
        self, rows: list[int], blocks: list[Sequence[int]], lens: list[int], device: Any
    ) -> None:
        num = len(rows)
        contiguous = rows[-1] - rows[0] == num - 1
        self.decode_rows = (
            slice(rows[0], rows[0] + num) if contiguous else torch.tensor(rows, device=device)
        )
        max_blocks = max(len(b) for b in blocks)
        table = [list(b) + [0] * (max_blocks - len(b)) for b in blocks]
        self.decode_block_table = torch.tensor(table, dtype=torch.int64).to(device)
        width = max_blocks * self.block_size
        if any(n != width for n in lens):
            lens_t = torch.tensor(lens, dtype=torch.int64)
            mask = torch.arange(width)[None, :] < lens_t[:, None]  # [D, width]
            self.decode_mask = mask[:, None, None, :].to(device)


def _append_slots(
    slots: list[int], block_ids: Sequence[int], start: int, end: int, block_size: int
) -> None:
    pos = start
    while pos < end:  # one range per block touched, not one Python step per token
        block, offset = divmod(pos, block_size)
        stop = min(end, (block + 1) * block_size)
        base = block_ids[block] * block_size
        slots.extend(range(base + offset, base + offset + stop - pos))
        pos = stop


def _prefill_chunk(
    row: int, start: int, num_new: int, block_ids: Sequence[int], block_size: int, device: Any
) -> PrefillChunk:
    chunk = PrefillChunk(rows=slice(row, row + num_new), start=start)
    if start > 0:
        width = len(block_ids) * block_size
        q_pos = torch.arange(start, start + num_new)
        chunk.mask = (torch.arange(width)[None, :] <= q_pos[:, None]).to(device)
        chunk.kv_blocks = torch.tensor(list(block_ids), dtype=torch.int64).to(device)
    return chunk


class PagedAttention(nn.Module):
    """Writes the new K/V into this layer's cache, then attends (see module docstring)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_cache: Tensor | None = None  # set by bind_kv_cache

    def forward(
        self,
        q: Tensor,  # [T, Hq, Dh]
        k: Tensor,  # [T, Hkv, Dh]
        v: Tensor,  # [T, Hkv, Dh]
        meta: AttentionMetadata,
    ) -> Tensor:  # [T, Hq, Dh]
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("KV cache not bound: call model.bind_kv_cache(caches) first")
        flat = cache.view(2, -1, self.num_kv_heads, self.head_dim)  # [2, slots, Hkv, Dh]
        flat[0].index_copy_(0, meta.slot_mapping, k)
        flat[1].index_copy_(0, meta.slot_mapping, v)
        rows = meta.decode_rows
        if not meta.prefills and isinstance(rows, slice) and rows.stop - rows.start == q.shape[0]:
            return self._decode(q, cache, meta)  # pure decode step: no output assembly
        out = torch.empty_like(q)
        if rows is not None:
            out[rows] = self._decode(q[rows], cache, meta)
        for chunk in meta.prefills:
            out[chunk.rows] = self._prefill(
                q[chunk.rows], k[chunk.rows], v[chunk.rows], cache, chunk
            )
        return out

    def _decode(self, q: Tensor, cache: Tensor, meta: AttentionMetadata) -> Tensor:  # [D, Hq, Dh]
        table = meta.decode_block_table  # [D, B]
        num, num_blocks = table.shape
        hkv, dh = self.num_kv_heads, self.head_dim
        kv = cache.index_select(1, table.reshape(-1)).view(
            2, num, num_blocks * meta.block_size, hkv, dh
        )
        # Query heads of one KV head take the "query length" dim: [D, Hkv, G, Dh].
        qg = q.reshape(num, hkv, self.num_heads // hkv, dh)
        out = F.scaled_dot_product_attention(
            qg, kv[0].transpose(1, 2), kv[1].transpose(1, 2), attn_mask=meta.decode_mask
        )
        return out.reshape(num, self.num_heads, dh)

    def _prefill(
        self, q: Tensor, k: Tensor, v: Tensor, cache: Tensor, chunk: PrefillChunk
    ) -> Tensor:  # [n, Hq, Dh]
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, Dh]
        gqa = self.num_heads != self.num_kv_heads
        if chunk.kv_blocks is None:  # nothing cached before: attend to the fresh K/V
            out = F.scaled_dot_product_attention(
                qt, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                is_causal=True, enable_gqa=gqa,
            )  # fmt: skip
        else:
            kv = cache.index_select(1, chunk.kv_blocks).view(
                2, 1, -1, self.num_kv_heads, self.head_dim
            )
            out = F.scaled_dot_product_attention(
                qt,
                kv[0].transpose(1, 2),
                kv[1].transpose(1, 2),
                attn_mask=chunk.mask,
                enable_gqa=gqa,
            )
        return out.squeeze(0).transpose(0, 1)
