# pyright: reportArgumentType=false, reportCallIssue=false
# (triton.jit signatures type launch constants as tl.constexpr and omit num_warps/num_stages)
"""Chunked-prefill attention over a paged KV cache in one Triton launch (GPU; CPU tests
run it under ``TRITON_INTERPRET=1``).

The queries of every prefill chunk of a step, in one launch: chunk ``c`` is the rows
``rows[c] .. rows[c] + lens[c] - 1`` of the flattened batch, at positions
``starts[c] .. starts[c] + lens[c] - 1`` (``starts[c]`` tokens were cached before it),
and its own new K/V are already in the cache (the layer writes them first, as for a
decode). A query at position ``p`` attends causally to keys ``0 .. p`` of its sequence
(the last ``sliding_window`` of them with a window), read through the chunk's block
table row, so a chunk starting at 0, one continuing a cached prefix and one starting
mid-block are the same case.

A program owns ``BLOCK_Q`` consecutive query tokens of one chunk and one KV head: the
``G`` query heads of that KV head for those tokens form one ``[BLOCK_M, Dk]`` tile
(``BLOCK_M = BLOCK_Q * G`` rounded up, row ``r`` = token ``r // G``, head ``r % G``),
so K and V are read once per tile for the whole group (GQA without repeating K). Keys
are walked in tiles of ``BLOCK_N`` positions from the window's start to the tile's last
query, each position's block looked up in the block table; online softmax in float32.

The grid must not depend on the chunks' lengths (that would need them on the host, or
a sync): it is ``T // BLOCK_Q + C`` tiles for ``T`` rows and ``C`` chunks. Chunk ``c``
owns the tiles from ``rows[c] // BLOCK_Q + c`` on, which is at least
``ceil(lens[c] / BLOCK_Q)`` of them when the chunks are in row order without overlap;
a program finds its chunk by counting the chunks whose first tile is at or before it,
and the tiles past a chunk's end return at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from tidal.kernels.paged_attention import _INDEX_DTYPES, attend_key_tile, check_paged_call


@dataclass(frozen=True)
class PrefillBlocks:
    """A launch's tile sizes: ``block_m`` rows (query tokens x heads of one group) and
    ``block_n`` keys a step, both powers of two >= 16; ``num_warps`` None: from the tile."""

    block_m: int
    block_n: int
    num_warps: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")


# Rows (query token x head) of one program's tile, at least: a [BLOCK_M, Dk] tile of
# queries and its float32 accumulator stay in registers. A group larger than this
# widens the tile to the group (one token a program). Untuned: no GPU was lent yet
# (benchmarks/gpu_kernels.py sweeps others).
GPU_BLOCKS = PrefillBlocks(block_m=64, block_n=64)
# The interpreter's cost is per element: the smallest tiles tl.dot takes.
INTERPRETED_BLOCKS = PrefillBlocks(block_m=16, block_n=16)


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [T, Hq, Dk]
    k_ptr,  # [NB, Hkv, bs, Dk] (strided view of the cache)
    v_ptr,  # [NB, Hkv, bs, Dv]
    out_ptr,  # [T, Hq, Dv]
    rows_ptr,  # [C] first row of each chunk in q, increasing
    lens_ptr,  # [C] its new tokens
    starts_ptr,  # [C] keys cached before it: its first query's position
    table_ptr,  # [C, W] block ids
    sinks_ptr,  # [Hq] float logits (read only with HAS_SINKS)
    scale,
    window,  # keys a query sees (the last ``window`` up to itself); 0 = all
    block_size,
    num_chunks,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_ot,
    stride_oh,
    stride_rows,
    stride_lens,
    stride_starts,
    stride_tc,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # tile rows, >= BLOCK_Q * GROUP
    BLOCK_C: tl.constexpr,  # chunks, rounded up to a power of two
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # upcast tiles before tl.dot (bf16 under the interpreter)
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    # This program's chunk: the last one whose first tile is at or before this tile.
    cs = tl.arange(0, BLOCK_C)
    firsts = tl.load(rows_ptr + cs * stride_rows, mask=cs < num_chunks, other=1 << 30)
    first_tiles = firsts.to(tl.int32) // BLOCK_Q + cs  # [BLOCK_C] increasing
    c = tl.sum((first_tiles <= tile).to(tl.int32), axis=0) - 1  # pyright: ignore[reportOperatorIssue]
    if c < 0:  # rows before the first chunk (decode rows, say)
        return
    row0 = tl.load(rows_ptr + c * stride_rows).to(tl.int64)
    q_len = tl.load(lens_ptr + c * stride_lens).to(tl.int64)
    start = tl.load(starts_ptr + c * stride_starts).to(tl.int64)
    m0 = (tile - (row0 // BLOCK_Q + c)).to(tl.int64) * BLOCK_Q  # first token of this tile
    if m0 >= q_len:  # a spare tile past the chunk's end
        return

    r = tl.arange(0, BLOCK_M)
    tok = m0 + r // GROUP  # [BLOCK_M] token within the chunk
    row_ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
    heads = kv_head * GROUP + r % GROUP  # [BLOCK_M] query head of each row
    # Rows past the chunk take its last position: every row then sees at least one key
    # (its own), so no row divides by zero; they are not stored.
    q_pos = start + tl.minimum(tok, q_len - 1)  # [BLOCK_M]
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + (row0 + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + dk[None, :],
        mask=row_ok[:, None] & (dk[None, :] < DK),
        other=0.0,
    )  # [BLOCK_M, BLOCK_DK]
    if DOT_FP32:
        q = q.to(tl.float32)

    # The keys any row of the tile sees: from the window's start for its first token to
    # its last token (causal).
    last = tl.minimum(start + m0 + BLOCK_Q, start + q_len)  # exclusive
    first = tl.where(window > 0, tl.maximum(start + m0 - window + 1, 0), 0)

    # Online softmax state per row. A sink is one more logit with no value: it starts
    # the running max and adds exp(sink - max) to the denominator. The finite start
    # (not -inf) keeps exp(m_old - m_new) defined while every key so far was masked.
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + heads).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    n = tl.arange(0, BLOCK_N)
    for t0 in range((first // BLOCK_N) * BLOCK_N, last, BLOCK_N):
        pos = t0 + n  # [BLOCK_N] key positions
        key_ok = (pos >= first) & (pos < last)
        seen = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])  # causal
        seen = seen & ((window == 0) | (pos[None, :] > q_pos[:, None] - window))
        m_i, l_i, acc = attend_key_tile(
            q, m_i, l_i, acc, pos, key_ok, seen, table_ptr + c * stride_tc,
            k_ptr, v_ptr, kv_head, block_size, scale,
            stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
            DK, DV, BLOCK_DK, BLOCK_DV, DOT_FP32, DOT_PRECISION,
        )  # fmt: skip

    out = acc / l_i[:, None]
    dst = out_ptr + (row0 + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + dv[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))


def prefill_tiles(num_rows: int, num_chunks: int, group: int, block_m: int) -> tuple[int, int, int]:
    """(tile rows, query tokens a program takes, programs per KV head) for ``num_rows``
    rows holding ``num_chunks`` chunks: the tile widens to the group when the group is
    larger (one token a program). From shapes only."""
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    return block_m, block_q, num_rows // block_q + num_chunks


def paged_prefill_attention(
    q: Tensor,  # [T, Hq, Dk] the step's flattened queries; last dim contiguous
    k_cache: Tensor,  # [NB, Hkv, bs, Dk] view of the cache's keys; last dim contiguous
    v_cache: Tensor,  # [NB, Hkv, bs, Dv] view of its values; last dim contiguous
    chunk_rows: Tensor,  # [C] int32/int64 first row of each chunk in q
    chunk_lens: Tensor,  # [C] int32/int64 new tokens of each chunk, >= 1
    chunk_starts: Tensor,  # [C] int32/int64 tokens cached before each chunk
    block_table: Tensor,  # [C, W] int32/int64 block ids; entries past a chunk's end not read
    scale: float,
    sliding_window: int | None = None,  # a query at p sees keys > p - sliding_window
    sinks: Tensor | None = None,  # [Hq] one logit per query head in the denominator
    out: Tensor | None = None,  # [T, Hq, Dv] q's dtype, last dim contiguous
    blocks: PrefillBlocks | None = None,  # tile sizes (benchmarks' sweep); None: defaults
) -> Tensor:  # [T, Hq, Dv] q's dtype: float32 scores, softmax and sums
    """Causal attention of every prefill chunk's queries over its sequence's cached keys,
    in one launch. Chunk ``c``'s query ``i`` is row ``chunk_rows[c] + i`` of ``q``, at
    position ``chunk_starts[c] + i``; it attends to the keys at positions ``0 .. that``
    (the last ``sliding_window`` of them with a window), key ``p`` read from block
    ``block_table[c, p // bs]``, offset ``p % bs``; so the chunk's own K/V must be in the
    cache already. Query head ``h`` reads KV head ``h // (Hq // Hkv)``. q in
    float32/float16/bfloat16; the cache in any of the three (cast to q's dtype as it is
    read). float32 runs its dots in IEEE float32 (no TF32). Only the chunks' rows of
    ``out`` are written (decode rows between them keep what they held).

    The chunks must be in row order and must not overlap (``chunk_rows[c + 1] >=
    chunk_rows[c] + chunk_lens[c]``), and every row they name must be within q: not
    checked, since it would need their values on the host. One launch of grid
    ``[T // BLOCK_Q + C, Hkv]`` (``prefill_tiles``): from shapes only, no host sync."""
    num_chunks = chunk_rows.shape[0] if chunk_rows.dim() == 1 else -1
    for name, t in {"chunk_rows": chunk_rows, "chunk_lens": chunk_lens}.items():
        if t.shape != (num_chunks,) or t.dtype not in _INDEX_DTYPES:
            raise ValueError(
                f"{name} must be [C] int32/int64 like chunk_rows, got {tuple(t.shape)} {t.dtype}"
            )
    if chunk_starts.shape != (num_chunks,) or chunk_starts.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"chunk_starts must be [{num_chunks}] int32/int64, got "
            f"{tuple(chunk_starts.shape)} {chunk_starts.dtype}"
        )
    index = {"chunk_rows": chunk_rows, "chunk_lens": chunk_lens, "chunk_starts": chunk_starts}
    call = check_paged_call(
        "paged prefill attention", q, k_cache, v_cache, block_table, num_chunks, sinks,
        sliding_window, out, index, rows_name="T",
    )  # fmt: skip
    num_rows, hq, hkv, bs, dk, dv = call.rows, call.hq, call.hkv, call.bs, call.dk, call.dv
    out, interpreted = call.out, call.interpreted
    if num_chunks == 0 or num_rows == 0:
        return out
    group = hq // hkv
    if blocks is None:
        blocks = INTERPRETED_BLOCKS if interpreted else GPU_BLOCKS
    block_m, block_q, tiles = prefill_tiles(num_rows, num_chunks, group, blocks.block_m)
    num_warps = blocks.num_warps or (8 if block_m * max(dk, dv) > 64 * 128 else 4)
    same = k_cache.dtype == q.dtype
    dot_fp32 = not same or (interpreted and q.dtype == torch.bfloat16)
    _paged_prefill_kernel[(tiles, hkv)](
        q, k_cache, v_cache, out, chunk_rows, chunk_lens, chunk_starts, block_table,
        sinks if sinks is not None else q,  # not read without sinks
        scale, sliding_window or 0, bs, num_chunks,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        chunk_rows.stride(0), chunk_lens.stride(0), chunk_starts.stride(0),
        block_table.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_C=triton.next_power_of_2(num_chunks),
        DK=dk, DV=dv,
        BLOCK_DK=max(16, triton.next_power_of_2(dk)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        BLOCK_N=blocks.block_n,
        HAS_SINKS=sinks is not None,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or dot_fp32 else None,
        num_warps=num_warps,
    )  # fmt: skip
    return out
