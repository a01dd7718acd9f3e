"""Paged attention in torch over a flattened batch (no padding between sequences).

Contract with the model runner:

* ``kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)`` is the shape of one
  layer's cache tensor, ``[2 (K, V), num_blocks, num_kv_heads, block_size, head_dim]``,
  in the cache dtype (``--kv-cache-dtype``; the model's by default, and it may differ:
  new K/V are cast into it, the decode and prefill reads upcast only what they gather,
  never the whole cache). The worker allocates one per layer and hands the list to
  ``model.bind_kv_cache``. Token at position p of a sequence lives in cache slot
  ``block_ids[p // block_size] * block_size + p % block_size``: block
  ``block_ids[p // block_size]``, offset ``p % block_size``, for every KV head.
  Heads are outside the offset so that gathering a sequence's blocks head by head
  yields K/V already in SDPA's ``[heads, keys, head_dim]`` order (no strided read).
* ``AttentionMetadata.build(seqs, block_size, device)`` once per step, with
  ``seqs[i] = (start, num_new_tokens, block_ids)`` in batch order: sequence i's new
  tokens are the next ``num_new_tokens`` rows of the flattened batch, at positions
  ``start .. start + num_new_tokens - 1``; K/V of positions ``< start`` is already in the
  cache (an earlier chunk, an earlier step, or a shared prefix block). ``block_ids`` must
  cover all positions ``< start + num_new_tokens``.

Each layer first writes the new K/V into the cache through ``slot_mapping``, then:

* decode sequences (one new token) are attended together. Their K blocks are gathered
  (one ``index_select``, every head) into one padded ``[D * Hkv, keys, Dh]`` batch;
  the query heads of each KV head form a ``[G, Dh]`` matrix (GQA without copying K per
  query head); scores are one ``baddbmm`` (plus the padding bias, -inf) and a
  ``softmax``. V is never gathered: ``probs @ V`` is an ``embedding_bag`` (weighted sum
  of rows) that reads each sequence's V rows straight from the paged cache, one bag per
  (sequence, query head). At 32 sequences this is ~1.3x faster than gathering K and V
  and ``bmm`` (and ~1.6x faster than ``scaled_dot_product_attention``, whose CPU flash
  kernel runs a few tiny GEMMs per (sequence, head)): the gathered copy of V, written
  then read once, was half of the step's KV memory traffic.
  ``decode_attention_reference`` is the per-sequence oracle the tests compare against.
  On CPU with the C++ extension built (float32, bfloat16 or float16 queries and cache),
  the decode group instead goes to one C++ op (``tidal/kernels/cpu_attention.py``) that
  reads K and V straight from the cache in its own dtype, float32 softmax and sums; the
  torch path above is its fallback, tested against the same oracle. When the cache's
  dtype is not the queries', the torch path gathers V too and upcasts what it gathered
  (``embedding_bag`` needs one dtype). On CUDA the decode group is one Triton launch
  (``tidal/kernels/paged_attention.py``: windows and sinks too, no host sync, a grid
  from the batch size alone, so a CUDA graph can hold it). Which of the three serves is
  the layer's ``backend`` (``AttentionBackend``, ``DECODE_BACKENDS``), set from its
  device; the torch path is the reference of the other two;
* each prefill chunk runs its own SDPA: causal on its fresh K/V when it starts at 0,
  else on its gathered cached blocks with an explicit mask (query i at position
  ``start + i`` sees keys ``<= start + i``). That is the reference; on the Triton
  backend every chunk of the step is one launch instead
  (``tidal/kernels/paged_prefill.py``) reading all its keys, its own new ones too,
  from the cache through ``AttentionMetadata.prefill_table`` (built on first read):
  no per-chunk gather, mask or launch, and no host sync. A chunk's gather blocks and
  mask (``PrefillChunk.kv_blocks``, ``mask``) are built on first read too, so that
  backend never builds or copies them.

Two switches per layer (GPT-OSS): ``sliding_window`` W (a query at position p sees keys
``> p - W``, as transformers' sliding mask) and ``sinks`` (one learned logit per query
head in the softmax denominator, no value: the weights over the keys sum to less than
1). The C++ decode kernel (CPU) and the Triton decode and prefill kernels compute both;
a CPU prefill chunk with either runs the torch path (an explicit mask). A model whose every layer slides
frees the blocks behind the window; one that mixes sliding and full layers (GPT-OSS) has
a KV cache group per kind, each with its own block table and metadata
(``AttentionMetadata.groups``), and only the sliding group's blocks are freed
(docs/architecture.md#kv-sliding-window). Blocks still in a table before the window
are masked.

All index tensors are built once per step (per KV cache group), not per layer: in
``build``, or (those that depend on the cache's shape) by the first layer, memoised on
the metadata for the rest;
the Triton backend needs none of the latter in a decode step.
"""

from __future__ import annotations

import enum
import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tidal.kernels.cpu_attention import (
    decode_attention_cpu,
    decode_attention_cpu_ok,
    decode_attention_cpu_supports,
    write_kv_cpu,
    write_kv_cpu_ok,
)
from tidal.kernels.select import Candidate, Choice, OpKey, OpSpec, kernel_candidates
from tidal.kernels.triton_device import triton_serves

# The decode attention trial (select.py): sequences of this many tokens, in blocks of this
# size (the default ``--block-size``), and at most this many cached tokens over all of a
# trial's sequences (the prefill class's 256 rows take 64 each: a cache of tens of MB).
TRIAL_CONTEXT = 256
TRIAL_BLOCK_SIZE = 16
TRIAL_CACHE_TOKENS = 16384


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (2, num_blocks, num_kv_heads, block_size, head_dim)


@dataclass
class PrefillChunk:
    """One sequence with more than one new token."""

    rows: slice  # its rows in the flattened batch
    start: int  # tokens already in the cache
    block_ids: list[int]  # the blocks covering positions < start + n (host)
    block_size: int
    device: Any  # where the torch path's tensors below go

    # The torch paths' tensors, built on first read: the Triton path reads block_ids
    # through the step's prefill table instead, and a chunk's mask is [n, keys] (megabytes
    # for a long prompt's last chunk) that CUDA would otherwise copy every step.
    @functools.cached_property
    def kv_blocks(self) -> Tensor | None:  # [num_blocks] int64; None when start == 0
        if self.start == 0:
            return None
        return torch.tensor(self.block_ids, dtype=torch.int64).to(self.device)

    @functools.cached_property
    def mask(self) -> Tensor | None:  # [n, num_blocks * bs] bool, True = attend; or None
        if self.start == 0:  # its own K/V only: causal
            return None
        width = len(self.block_ids) * self.block_size
        q_pos = torch.arange(self.start, self.start + self.rows.stop - self.rows.start)
        return (torch.arange(width)[None, :] <= q_pos[:, None]).to(self.device)


@dataclass
class PrefillTable:
    """A step's prefill chunks as device tensors (``paged_prefill_attention``'s
    arguments): views of one int32 tensor, copied once."""

    rows: Tensor  # [C] int32 first row of each chunk in the flattened batch
    lens: Tensor  # [C] int32 its new tokens
    starts: Tensor  # [C] int32 tokens cached before it
    block_table: Tensor  # [C, W] int32 its blocks, padded with block 0

    @classmethod
    def build(cls, chunks: Sequence[PrefillChunk], device: Any) -> PrefillTable:
        width = max((len(c.block_ids) for c in chunks), default=0)
        packed = np.zeros((len(chunks), 3 + width), dtype=np.int32)
        for i, c in enumerate(chunks):
            packed[i, :3] = (c.rows.start, c.rows.stop - c.rows.start, c.start)
            packed[i, 3 : 3 + len(c.block_ids)] = c.block_ids
        t = torch.from_numpy(packed).to(device)
        return cls(t[:, 0], t[:, 1], t[:, 2], t[:, 3:])


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
    decode_seq_lens: Tensor | None = None  # [D] int64 keys of each decode sequence
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Per layer geometry: row indices into the cache and the decode bias, built by the
    # first layer that needs them (see ``cache_rows``).
    _rows: dict[tuple, CacheRows] = field(default_factory=dict, repr=False)
    _decode_mask: Tensor | None = field(default=None, repr=False)
    _mask_pending: bool = field(default=False, repr=False)  # padded: built on first read
    _prefill_table: PrefillTable | None = field(default=None, repr=False)
    # A model with KV cache groups (docs/architecture.md#kv-sliding-window): each group's
    # metadata, its own slots and block tables (this one is group 0's); a layer of group g
    # reads groups[g]. Empty: one group, this.
    groups: tuple[AttentionMetadata, ...] = field(default=(), repr=False)

    @staticmethod
    def grouped(metas: Sequence[AttentionMetadata]) -> AttentionMetadata:
        """One step's metadata for a model with KV cache groups: group 0's, carrying every
        group's in ``groups`` (one group: that one, ``groups`` left empty)."""
        if len(metas) > 1:
            metas[0].groups = tuple(metas)
        return metas[0]

    @property
    def decode_mask(self) -> Tensor | None:
        """[D, 1, 1, max_blocks * block_size] bool, True = a key of the sequence; None when
        no decode row is padded. Built on first read: the native decode kernels read
        ``decode_seq_lens`` instead, and a mask per step costs a single request's decode
        more host time than its attention."""
        if self._mask_pending:
            lens, table = self.decode_seq_lens, self.decode_block_table
            assert lens is not None and table is not None
            keys = torch.arange(table.shape[1] * self.block_size, device=lens.device)
            self._decode_mask = (keys[None, :] < lens[:, None])[:, None, None, :]
            self._mask_pending = False
        return self._decode_mask

    @decode_mask.setter
    def decode_mask(self, mask: Tensor | None) -> None:
        self._decode_mask, self._mask_pending = mask, False

    @property
    def prefill_table(self) -> PrefillTable:
        """The prefill chunks as the Triton prefill kernel reads them, built on first read
        (the torch and CPU paths never do): one host-to-device copy for the step."""
        if self._prefill_table is None:
            self._prefill_table = PrefillTable.build(self.prefills, self.slot_mapping.device)
        return self._prefill_table

    def cache_rows(
        self, num_blocks: int, num_kv_heads: int, num_heads: int, dtype: torch.dtype
    ) -> CacheRows:
        key = (num_blocks, num_kv_heads, num_heads, dtype)
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = CacheRows.build(self, *key)
        return rows

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

    @classmethod
    def build_arrays(
        cls,
        starts: np.ndarray,  # [S] int64
        num_new: np.ndarray,  # [S] int64
        block_table: np.ndarray,  # [S, W] int, row i: sequence i's blocks (then anything)
        num_blocks: np.ndarray,  # [S] int64 valid entries of each row
        block_size: int,
        device: Any,
    ) -> AttentionMetadata:
        """``build`` by array operations on a block table the caller keeps (the persistent
        batch, tidal/executor/input_batch.py): no Python step per token or per decode
        sequence (prefill chunks, few, are still built one by one). Equal to ``build``
        on the same sequences, tensor for tensor (tests/unit/test_input_batch.py)."""
        bs = block_size
        ends = starts + num_new
        needed = (ends + (bs - 1)) // bs  # [S]
        num_seqs = len(starts)
        if num_seqs and (num_new.min() < 1 or starts.min() < 0):
            i = int(np.flatnonzero((num_new < 1) | (starts < 0))[0])
            raise ValueError(f"sequence {i}: bad (start={starts[i]}, num_new_tokens={num_new[i]})")
        if (num_blocks < needed).any():
            i = int(np.flatnonzero(num_blocks < needed)[0])
            raise ValueError(
                f"sequence {i}: {ends[i]} tokens need {needed[i]} blocks of {bs}, "
                f"got {num_blocks[i]}"
            )
        if num_seqs and num_new.max() == 1:
            return cls._decodes_only(starts, ends, needed, block_table, bs, device)
        first_row = np.cumsum(num_new) - num_new  # [S] flattened row of each first token
        total = int(num_new.sum())
        seq = np.repeat(np.arange(num_seqs), num_new)  # [T] sequence of each token
        pos = np.arange(total) - first_row[seq] + starts[seq]  # [T]
        slots = block_table[seq, pos // bs].astype(np.int64) * bs + pos % bs  # [T]
        meta = cls(
            num_tokens=total,
            block_size=bs,
            slot_mapping=torch.from_numpy(slots).to(device),
            query_lens=num_new.tolist(),
            seq_lens=ends.tolist(),
        )
        dec = np.flatnonzero(num_new == 1)
        for i in np.flatnonzero(num_new != 1).tolist():
            n_blocks = int(needed[i])
            meta.prefills.append(
                _prefill_chunk(
                    int(first_row[i]), int(starts[i]), int(num_new[i]),
                    block_table[i, :n_blocks].tolist(), bs, device,
                )
            )  # fmt: skip
        if dec.size:
            rows = first_row[dec]
            num = len(dec)
            if rows[-1] - rows[0] == num - 1:
                meta.decode_rows = slice(int(rows[0]), int(rows[0]) + num)
            else:
                meta.decode_rows = torch.from_numpy(rows).to(device)
            dec_needed = needed[dec]
            max_blocks = int(dec_needed.max())
            cols = np.arange(max_blocks)
            table = np.where(
                cols[None, :] < dec_needed[:, None], block_table[dec, :max_blocks], 0
            ).astype(np.int64)  # [D, max_blocks], padded with block 0
            meta.decode_block_table = torch.from_numpy(table).to(device)
            lens = ends[dec].astype(np.int64)
            meta.decode_seq_lens = torch.from_numpy(lens).to(device)
            meta._mask_pending = bool((lens != max_blocks * bs).any())
        return meta

    @classmethod
    def _decodes_only(
        cls,
        starts: np.ndarray,  # [D] int64
        ends: np.ndarray,  # [D] int64, starts + 1
        needed: np.ndarray,  # [D] int64 blocks each sequence reads
        block_table: np.ndarray,  # [D, W] int
        bs: int,
        device: Any,
    ) -> AttentionMetadata:
        """``build_arrays`` when every sequence has one new token (most steps): token i
        is sequence i, so no repeat, cumsum or gather by sequence; fewer array operations
        matter here, where one request's step costs tens of microseconds of them."""
        num = len(starts)
        max_blocks = int(needed.max())
        table = block_table[:, :max_blocks]
        block = table[np.arange(num), starts // bs].astype(np.int64)  # [D]
        lens_list = ends.tolist()
        meta = cls(
            num_tokens=num,
            block_size=bs,
            slot_mapping=torch.from_numpy(block * bs + starts % bs).to(device),
            query_lens=[1] * num,
            seq_lens=lens_list,
            decode_rows=slice(0, num),
        )
        width, shortest = max_blocks * bs, min(lens_list)
        if shortest <= width - bs:  # a row reads fewer blocks than the widest
            table = np.where(np.arange(max_blocks)[None, :] < needed[:, None], table, 0)
        meta.decode_block_table = torch.from_numpy(table.astype(np.int64)).to(device)
        meta.decode_seq_lens = torch.from_numpy(ends).to(device)
        meta._mask_pending = shortest != width
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
        self.decode_seq_lens = torch.tensor(lens, dtype=torch.int64).to(device)
        self._mask_pending = any(n != max_blocks * self.block_size for n in lens)


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
    return PrefillChunk(slice(row, row + num_new), start, list(block_ids), block_size, device)


@dataclass
class DecodeRows:
    """What the decode path reads, for one layer geometry (see the module docstring)."""

    k_blocks: Tensor  # [D * Hkv * max_blocks] int64 K rows of the by-block view, [D, Hkv, B]
    v_tokens: Tensor  # [D * Hkv * G * keys] int64 V rows of the by-token V view, per bag
    bags: Tensor  # [D * Hkv * G] int64 first entry of each bag in v_tokens (equal lengths)
    bias: Tensor  # [D * Hkv, 1, keys] 0 where a key is attended, -inf on padding


@dataclass
class CacheRows:
    """Row indices for one layer geometry, shared by every layer of a step.

    A layer's cache ``[2, NB, Hkv, bs, Dh]`` is viewed two ways: ``[2 * NB * Hkv * bs, Dh]``
    (one row per token and head: writes, V reads) and ``[2 * NB * Hkv, bs * Dh]`` (one
    row per block and head: gathers). V rows follow all K rows in both."""

    write_k: Tensor  # [T * Hkv] int64 row of each new token's K, per head
    write_v: Tensor  # [T * Hkv] int64 same for V
    decode: DecodeRows | None
    prefill_gather: list[Tensor | None]  # per prefill chunk: [2 * Hkv * blocks] or None

    @classmethod
    def build(
        cls,
        meta: AttentionMetadata,
        num_blocks: int,
        num_kv_heads: int,
        num_heads: int,
        dtype: torch.dtype,
    ) -> CacheRows:
        bs, hkv = meta.block_size, num_kv_heads
        slots = meta.slot_mapping
        heads = torch.arange(hkv, device=slots.device)
        block, offset = slots // bs, slots % bs
        write_k = ((block * hkv * bs + offset)[:, None] + heads[None, :] * bs).reshape(-1)
        decode = None
        table = meta.decode_block_table
        # The C++ decode path (CPU) and the Triton one (CUDA) read the block table
        # themselves; the torch path's rows are then built only if a layer takes it
        # (``TorchDecode``).
        native = table is not None and decode_attention_cpu_supports(
            dtype, table.device, num_heads // hkv
        )
        if table is not None and table.device.type == "cpu" and not native:
            decode = _decode_rows(meta, heads, num_heads // hkv, dtype)
        prefill = [
            None if c.kv_blocks is None else _kv_block_rows(c.kv_blocks[None], heads, num_blocks)
            for c in meta.prefills
        ]
        return cls(write_k, write_k + num_blocks * hkv * bs, decode, prefill)


def _kv_block_rows(
    table: Tensor,  # [S, B] int64 block ids
    heads: Tensor,  # [Hkv] int64
    num_blocks: int,
) -> Tensor:  # [2 * S * Hkv * B]: K rows in [S, Hkv, B] order, then the V rows
    k_rows = (table[:, None, :] * heads.numel() + heads[None, :, None]).reshape(-1)
    return torch.cat((k_rows, k_rows + num_blocks * heads.numel()))


def _decode_rows(
    meta: AttentionMetadata, heads: Tensor, group: int, dtype: torch.dtype
) -> DecodeRows:
    table = meta.decode_block_table  # [D, B]
    assert table is not None  # a decode step
    (num, num_blocks), bs, hkv = table.shape, meta.block_size, heads.numel()
    keys = num_blocks * bs
    k_blocks = (table[:, None, :] * hkv + heads[None, :, None]).reshape(-1)
    # V row of key t of (sequence d, head h): (table[d, t // bs] * Hkv + h) * bs + t % bs;
    # the G query heads of a KV head each get their own bag of the same rows.
    t = torch.arange(keys, device=table.device)
    v_rows = (table[:, None, t // bs] * hkv + heads[None, :, None]) * bs + t % bs  # [D, Hkv, keys]
    v_tokens = v_rows[:, :, None, :].expand(num, hkv, group, keys).reshape(-1)
    bags = torch.arange(0, v_tokens.numel(), keys, device=table.device)
    bias = torch.zeros((num, 1, keys), dtype=dtype, device=table.device)
    if meta.decode_mask is not None:
        bias.masked_fill_(~meta.decode_mask[:, 0], float("-inf"))
    return DecodeRows(k_blocks, v_tokens, bags, bias.repeat_interleave(hkv, dim=0))


def decode_attention_reference(
    q: Tensor,  # [D, Hq, Dh] one query token per sequence
    cache: Tensor,  # [2, NB, Hkv, bs, Dh] one layer's cache
    seqs: Sequence[tuple[int, Sequence[int]]],  # (tokens in the cache, block ids) per row
    sliding_window: int | None = None,
    sinks: Tensor | None = None,  # [Hq]
) -> Tensor:  # [D, Hq, Dh]
    """Oracle for the decode path: one sequence at a time, keys read token by token in
    float64, plain softmax; query head h uses KV head h // (Hq // Hkv). A window keeps
    the last ``sliding_window`` keys; a sink adds ``exp(sinks[h])`` to the denominator."""
    _, _, hkv, bs, dh = cache.shape
    group = q.shape[1] // hkv
    out = torch.empty_like(q)
    for i, (length, blocks) in enumerate(seqs):
        first = 0 if sliding_window is None else max(0, length - sliding_window)
        pos = range(first, length)
        k = torch.stack([cache[0, blocks[p // bs], :, p % bs] for p in pos]).double()
        v = torch.stack([cache[1, blocks[p // bs], :, p % bs] for p in pos]).double()
        for h in range(q.shape[1]):
            scores = k[:, h // group] @ q[i, h].double() / dh**0.5  # [keys]
            sink = None if sinks is None else float(sinks[h])
            top = scores.max().item() if sink is None else max(scores.max().item(), sink)
            weights = (scores - top).exp()
            denom = weights.sum() + (0.0 if sink is None else math.exp(sink - top))
            out[i, h] = ((weights / denom) @ v[:, h // group]).to(q.dtype)
    return out


class PagedAttention(nn.Module):
    """Writes the new K/V into this layer's cache, then attends (see module docstring)."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, *, dtype: Any = None,
        device: Any = None, sliding_window: int | None = None, sinks: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        # [Hq] one logit per query head (filled by the loader), or None
        self.sinks: Tensor | None = (
            nn.Parameter(torch.zeros(num_heads, dtype=dtype, device=device), requires_grad=False)
            if sinks
            else None
        )
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.kv_cache: Tensor | None = None  # set by bind_kv_cache
        # The queries' dtype (the model's) and device, for the CPU path choice (select.py).
        # The trial's cache is in it too: the choice is made at load, before
        # --kv-cache-dtype's cache exists (the kernels serve every pairing).
        self.dtype = dtype or torch.get_default_dtype()
        self.on_cpu = torch.device(device or "cpu").type == "cpu"
        self.cpu_choice: Choice | None = None  # measured at load; None: the C++ kernels
        self.backend = default_backend(device or "cpu")  # how the decode group is attended

    def native(self, rows: int) -> bool:
        """Whether a step with ``rows`` decode rows (or new tokens, for the cache writes)
        takes the C++ kernels (where they take its tensors)."""
        choice = self.cpu_choice
        return choice is None or choice.for_rows(rows).path == "native"

    def cpu_ops(self) -> dict[str, OpSpec]:
        if not self.on_cpu:
            return {}
        # A window or sinks change little of the work: the same trial decides for them.
        key = OpKey("attention", (self.num_heads, self.num_kv_heads, self.head_dim))
        return {"decode": OpSpec(key, tuple(kernel_candidates(self.dtype)), False)}

    def cpu_trial(self, op: str, candidate: Candidate, instances: int) -> Any:
        """Sequences of ``TRIAL_CONTEXT`` tokens (fewer where ``TRIAL_CACHE_TOKENS`` bounds
        them) each decoding one more."""
        dtype = self.dtype
        attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, dtype=dtype)
        attn.set_cpu_path(op, Choice.fixed(candidate, None))
        bs = TRIAL_BLOCK_SIZE
        caches: dict[int, Tensor] = {}

        def for_rows(rows: int) -> Any:
            context = max(bs, min(TRIAL_CONTEXT, TRIAL_CACHE_TOKENS // rows))
            per_seq = -(-context // bs)
            shape = kv_cache_shape(rows * per_seq + 1, bs, self.num_kv_heads, self.head_dim)
            caches.clear()  # one size at a time
            attn.kv_cache = caches[rows] = torch.full(shape, 0.01, dtype=dtype)
            seqs = [
                (context - 1, 1, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)))
                for i in range(rows)
            ]
            meta = AttentionMetadata.build(seqs, bs, "cpu")
            q = torch.full((rows, self.num_heads, self.head_dim), 0.1, dtype=dtype)
            kv = torch.full((rows, self.num_kv_heads, self.head_dim), 0.1, dtype=dtype)
            return lambda: attn(q, kv, kv, meta)

        return for_rows

    def set_cpu_path(self, op: str, choice: Choice) -> None:
        self.cpu_choice = choice

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
        if self.backend is AttentionBackend.TRITON:  # one launch, cast in it; no index rows
            triton_attention().write_kv_cache(cache[0], cache[1], meta.slot_mapping, k, v)
        elif self.native(q.shape[0]) and write_kv_cpu_ok(cache, k, v):
            write_kv_cpu(cache, meta.slot_mapping, k, v)  # cast in C++
        else:
            rows = self.cache_rows(meta, cache, q.dtype)
            by_token = cache.view(-1, self.head_dim)  # [2 * NB * Hkv * bs, Dh]
            by_token.index_copy_(0, rows.write_k, k.reshape(-1, self.head_dim).to(cache.dtype))
            by_token.index_copy_(0, rows.write_v, v.reshape(-1, self.head_dim).to(cache.dtype))
        dec = meta.decode_rows
        if not meta.prefills and isinstance(dec, slice) and dec.stop - dec.start == q.shape[0]:
            return self._decode(q, cache, meta)  # pure decode step: no output assembly
        out = torch.empty_like(q)
        if dec is not None:
            out[dec] = self._decode(q[dec], cache, meta)
        if meta.prefills and self.backend is AttentionBackend.TRITON:
            # Every chunk in one launch, from the cache (this step's K/V are in it).
            table = meta.prefill_table
            triton_prefill_attention().paged_prefill_attention(
                q, cache[0], cache[1], table.rows, table.lens, table.starts, table.block_table,
                self.scale, self.sliding_window, self.sinks, out=out,
            )  # fmt: skip
        elif meta.prefills:
            rows = self.cache_rows(meta, cache, q.dtype)
            for chunk, gather in zip(meta.prefills, rows.prefill_gather):
                r = chunk.rows
                out[r] = self._prefill(q[r], k[r], v[r], cache, chunk, gather)
        return out

    def cache_rows(self, meta: AttentionMetadata, cache: Tensor, dtype: torch.dtype) -> CacheRows:
        """This layer geometry's index rows of the step (memoised on ``meta``). The decode
        bias is in the queries' dtype (the scores'), not the cache's."""
        return meta.cache_rows(cache.shape[1], self.num_kv_heads, self.num_heads, dtype)

    def _gather(self, cache: Tensor, rows: Tensor, num: int, dtype: torch.dtype) -> Tensor:
        """K and V of ``num`` sequences' blocks, every head, in ``dtype`` (the queries'; only
        the gathered copy is cast): [2, num, Hkv, keys, Dh]."""
        by_block = cache.view(-1, cache.shape[3] * self.head_dim)  # [2 * NB * Hkv, bs * Dh]
        kv = by_block.index_select(0, rows).view(2, num, self.num_kv_heads, -1, self.head_dim)
        return kv.to(dtype)

    def _decode(self, q: Tensor, cache: Tensor, meta: AttentionMetadata) -> Tensor:
        """The decode group ``[D, Hq, Dh]``, on this layer's backend (``DECODE_BACKENDS``)."""
        return DECODE_BACKENDS[self.backend].decode(self, q, cache, meta)

    def _decode_torch(
        self, q: Tensor, cache: Tensor, rows: DecodeRows, seq_lens: Tensor | None = None
    ) -> Tensor:
        num, hkv, dh = q.shape[0], self.num_kv_heads, self.head_dim
        by_block = cache.view(-1, cache.shape[3] * dh)  # [2 * NB * Hkv, bs * Dh], K rows first
        k = by_block.index_select(0, rows.k_blocks).view(num * hkv, -1, dh)  # [D * Hkv, keys, Dh]
        k = k.to(q.dtype)  # a cache of another dtype: the gathered keys only
        # The query heads of one KV head are adjacent: one [G, Dh] matrix per (seq, KV head).
        qg = q.reshape(num * hkv, -1, dh)  # [D * Hkv, G, Dh]
        bias = rows.bias
        if self.sliding_window is not None:
            assert seq_lens is not None
            keys = bias.shape[-1]
            first = (seq_lens - self.sliding_window).repeat_interleave(hkv)  # [D * Hkv]
            early = torch.arange(keys, device=q.device)[None, :] < first[:, None]
            bias = bias.masked_fill(early[:, None, :], float("-inf"))
        scores = torch.baddbmm(bias, qg, k.transpose(1, 2), alpha=self.scale)
        if self.sinks is not None:  # one more logit per query head, dropped after
            sink = self.sinks.to(scores.dtype).view(1, hkv, -1, 1).expand(num, -1, -1, -1)
            scores = torch.cat((scores, sink.reshape(num * hkv, -1, 1)), dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)  # [D * Hkv, G, keys]; padding keys get 0
        if cache.dtype != q.dtype:  # embedding_bag takes one dtype: gather V, upcast it
            v_rows = rows.k_blocks + cache.shape[1] * hkv  # V's block rows follow K's
            v = by_block.index_select(0, v_rows).view(num * hkv, -1, dh).to(q.dtype)
            return torch.bmm(probs, v).view(num, self.num_heads, dh)
        v_by_token = cache[1].view(-1, dh)  # [NB * Hkv * bs, Dh]
        out = F.embedding_bag(
            rows.v_tokens,
            v_by_token,
            rows.bags,
            mode="sum",
            per_sample_weights=probs.reshape(-1),
        )  # [D * Hkv * G, Dh]: each bag sums its V rows weighted by its probabilities
        return out.view(num, self.num_heads, dh)

    def _prefill(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: Tensor,
        chunk: PrefillChunk,
        gather: Tensor | None,
    ) -> Tensor:  # [n, Hq, Dh]
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, Dh]
        gqa = self.num_heads != self.num_kv_heads
        if self.sliding_window is not None or self.sinks is not None:
            return self._prefill_masked(qt, k, v, cache, chunk, gather, gqa)
        if gather is None:  # nothing cached before: attend to the fresh K/V
            out = F.scaled_dot_product_attention(
                qt, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                is_causal=True, enable_gqa=gqa,
            )  # fmt: skip
        else:
            kv = self._gather(cache, gather, 1, q.dtype)  # [2, 1, Hkv, keys, Dh]
            out = F.scaled_dot_product_attention(
                qt, kv[0], kv[1], attn_mask=chunk.mask, enable_gqa=gqa
            )
        return out.squeeze(0).transpose(0, 1)

    def _prefill_masked(
        self,
        qt: Tensor,  # [1, Hq, n, Dh]
        k: Tensor,  # [n, Hkv, Dh] this chunk's
        v: Tensor,
        cache: Tensor,
        chunk: PrefillChunk,
        gather: Tensor | None,
        gqa: bool,
    ) -> Tensor:  # [n, Hq, Dh]
        """A prefill chunk under a sliding window and/or sinks: an explicit mask over the
        keys; a sink is one more key, zero K and V, whose logit the mask carries."""
        n = qt.shape[2]
        q_pos = torch.arange(chunk.start, chunk.start + n, device=qt.device)[:, None]
        if gather is None:  # the chunk's own K/V, keys at positions 0 .. n - 1
            keys, vals = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        else:
            kv = self._gather(cache, gather, 1, qt.dtype)  # [2, 1, Hkv, keys, Dh]
            keys, vals = kv[0], kv[1]
        k_pos = torch.arange(keys.shape[2], device=qt.device)[None, :]
        allowed = k_pos <= q_pos  # [n, keys]
        if self.sliding_window is not None:
            allowed &= k_pos > q_pos - self.sliding_window
        if self.sinks is None:
            out = F.scaled_dot_product_attention(qt, keys, vals, attn_mask=allowed, enable_gqa=gqa)
            return out.squeeze(0).transpose(0, 1)
        bias = torch.zeros(allowed.shape, dtype=qt.dtype, device=qt.device)
        bias = bias.masked_fill(~allowed, float("-inf"))[None, None].expand(
            1, self.num_heads, -1, -1
        )
        sink = self.sinks.to(qt.dtype).view(1, -1, 1, 1).expand(1, -1, n, 1)
        mask = torch.cat((bias, sink), dim=-1)  # [1, Hq, n, keys + 1]
        zero = keys.new_zeros((1, self.num_kv_heads, 1, self.head_dim))
        out = F.scaled_dot_product_attention(
            qt, torch.cat((keys, zero), dim=2), torch.cat((vals, zero), dim=2),
            attn_mask=mask, enable_gqa=gqa,
        )  # fmt: skip
        return out.squeeze(0).transpose(0, 1)


class AttentionBackend(enum.Enum):
    """Who attends a layer's decode group (``DECODE_BACKENDS``)."""

    TORCH = "torch"  # the reference: gather K, baddbmm, softmax, embedding_bag
    NATIVE = "native"  # CPU: the C++ kernel where the measured choice and its tensors allow
    TRITON = "triton"  # CUDA: one Triton launch (tidal/kernels/paged_attention.py)


def default_backend(device: Any) -> AttentionBackend:
    """Triton on CUDA (when triton is installed: it is an optional extra), the C++ kernel
    on CPU, the torch path elsewhere."""
    if triton_serves(device):
        return AttentionBackend.TRITON
    return AttentionBackend.NATIVE if torch.device(device).type == "cpu" else AttentionBackend.TORCH


class DecodeBackend(ABC):
    """One way to attend the decode group of a step: ``q [D, Hq, Dh]`` one query token per
    sequence, over ``meta``'s decode block table and lengths, after this step's K/V were
    written. Returns ``[D, Hq, Dh]`` in q's dtype. ``TorchDecode`` is the reference the
    others are tested against (and ``decode_attention_reference`` the oracle of all).
    A backend that needs the step's index rows asks ``layer.cache_rows`` (memoised)."""

    @abstractmethod
    def decode(
        self,
        layer: PagedAttention,
        q: Tensor,  # [D, Hq, Dh]
        cache: Tensor,  # [2, NB, Hkv, bs, Dh]
        meta: AttentionMetadata,
    ) -> Tensor: ...  # [D, Hq, Dh]


class TorchDecode(DecodeBackend):
    def decode(
        self, layer: PagedAttention, q: Tensor, cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        rows = layer.cache_rows(meta, cache, q.dtype)
        if rows.decode is None:  # built lazily: CacheRows.build expected a kernel
            heads = torch.arange(layer.num_kv_heads, device=q.device)
            group = layer.num_heads // layer.num_kv_heads
            rows.decode = _decode_rows(meta, heads, group, q.dtype)
        return layer._decode_torch(q, cache, rows.decode, meta.decode_seq_lens)


class NativeDecode(DecodeBackend):
    """The C++ kernel (CPU; windows and sinks included) unless the measured choice is the
    torch path or it does not take these tensors."""

    def decode(
        self, layer: PagedAttention, q: Tensor, cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        if layer.native(q.shape[0]) and decode_attention_cpu_ok(q, cache, layer.num_kv_heads):
            assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
            return decode_attention_cpu(
                q, cache, meta.decode_block_table, meta.decode_seq_lens, layer.scale,
                layer.sliding_window, layer.sinks,
            )  # fmt: skip
        return DECODE_BACKENDS[AttentionBackend.TORCH].decode(layer, q, cache, meta)


class TritonDecode(DecodeBackend):
    """The Triton kernel: windows and sinks included, the cache read in its own dtype.
    With it the layer also writes the cache in one Triton launch (``write_kv_cache``), so
    a decode step builds no index rows at all."""

    def decode(
        self, layer: PagedAttention, q: Tensor, cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
        return triton_attention().paged_decode_attention(
            q, cache[0], cache[1], meta.decode_block_table, meta.decode_seq_lens, layer.scale,
            layer.sliding_window, layer.sinks,
        )  # fmt: skip


@functools.cache
def triton_attention() -> ModuleType:
    """``tidal.kernels.paged_attention``, imported on first use: triton is optional, and
    importing it decides its mode for the process (the kernel tests switch it to the
    interpreter first)."""
    from tidal.kernels import paged_attention

    return paged_attention


@functools.cache
def triton_prefill_attention() -> ModuleType:
    """``tidal.kernels.paged_prefill``, imported on first use (as ``triton_attention``)."""
    from tidal.kernels import paged_prefill

    return paged_prefill


DECODE_BACKENDS: dict[AttentionBackend, DecodeBackend] = {
    AttentionBackend.TORCH: TorchDecode(),
    AttentionBackend.NATIVE: NativeDecode(),
    AttentionBackend.TRITON: TritonDecode(),
}
