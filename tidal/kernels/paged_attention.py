# pyright: reportArgumentType=false, reportCallIssue=false
# (triton.jit signatures type launch constants as tl.constexpr and omit num_warps/num_stages)
"""Decode attention over a paged KV cache in one Triton launch (GPU; CPU tests run it
under ``TRITON_INTERPRET=1``).

One query token per sequence. A program owns one (sequence, KV head): the ``G`` query
heads of that KV head form one ``[G, Dk]`` tile (GQA without repeating K; a large group,
MLA's, is split into tiles of ``MAX_BLOCK_G`` heads, one program each), and the
keys are walked in tiles of ``BLOCK_N`` positions, each position's block looked up in
the block table, with an online softmax in float32. So K and V are read once per KV
head, straight from the cache, in the cache's dtype.

Why a kernel: the torch decode path is ~10 launches a layer (index rows, gather,
``baddbmm``, softmax, ``embedding_bag``) whose index tensors and padded width depend on
the batch's longest sequence; this is one launch whose grid is the (padded) batch size
times the KV heads, reads the lengths on the device and never syncs with the host: the
same launch serves every step of one batch size, so a CUDA graph can capture it.

The same kernel serves MLA's absorbed decode (``tidal/layers/mla.py``): its latent cache
``[NB, bs, r + rope]`` is one KV head whose key is the whole latent and whose value is
its first ``r`` values (``Dv < Dk``), and every query head is in the group.

Rows with length 0 (padding rows of a captured batch) return before touching anything:
their output rows are not written.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
# Query heads one program attends at most: a [MAX_BLOCK_G, Dk] tile of queries and
# float32 accumulators must stay in registers (MLA's 16-128 heads of 576 values do not).
MAX_BLOCK_G = 16
# Programs over one row's keys at most, and the keys a split should get at least (below
# that the partial sums' round trip costs more than the parallelism gains).
MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _auto_splits(device: torch.device, programs: int, max_keys: int) -> int:
    """Splits per row so that about two programs run per multiprocessor, each over at
    least ``MIN_KEYS_PER_SPLIT`` of the ``max_keys`` the block table can address (a
    power of two up to ``MAX_SPLITS``; one off CUDA). From shapes only: one per graph."""
    if device.type != "cuda":
        return 1
    want = min(2 * _multiprocessors(device) // max(programs, 1), max_keys // MIN_KEYS_PER_SPLIT)
    splits = 1
    while splits * 2 <= min(want, MAX_SPLITS):
        splits *= 2
    return splits


@triton.jit
def attend_key_tile(
    q,  # [M, BLOCK_DK] query rows of one KV head (fp32 when DOT_FP32)
    m_i,  # [M] float32 running max
    l_i,  # [M] float32 running denominator
    acc,  # [M, BLOCK_DV] float32 running weighted sum of V
    pos,  # [BLOCK_N] key positions of this tile
    key_ok,  # [BLOCK_N] keys that exist (within the row's first and last)
    seen,  # [M, BLOCK_N] or [1, BLOCK_N]: keys each query row attends
    table_row_ptr,  # the sequence's block-table row
    k_ptr, v_ptr, kv_head, block_size, scale,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One tile of keys of an online softmax (the decode and the prefill kernels' loop
    body): each key's block looked up in the table, K and V read from the cache in its
    dtype, scores in float32; returns the updated (m_i, l_i, acc)."""
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    block = tl.load(table_row_ptr + pos // block_size, mask=key_ok, other=0).to(tl.int64)
    offset = pos % block_size
    k = tl.load(
        k_ptr + block[None, :] * stride_kb + kv_head * stride_kh
        + offset[None, :] * stride_kt + dk[:, None],
        mask=key_ok[None, :] & (dk[:, None] < DK),
        other=0.0,
    )  # [BLOCK_DK, BLOCK_N]  # fmt: skip
    if DOT_FP32:
        k = k.to(tl.float32)
    else:
        k = k.to(q.dtype)
    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [M, BLOCK_N] fp32
    scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])  # masked keys: exp(-inf) = 0
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(
        v_ptr + block[:, None] * stride_vb + kv_head * stride_vh
        + offset[:, None] * stride_vt + dv[None, :],
        mask=key_ok[:, None] & (dv[None, :] < DV),
        other=0.0,
    )  # [BLOCK_N, BLOCK_DV]  # fmt: skip
    if DOT_FP32:
        v = v.to(tl.float32)
        p_dot = p
    else:
        v = v.to(q.dtype)
        p_dot = p.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [D, Hq, Dk]
    k_ptr,  # [NB, Hkv, bs, Dk] (strided view of the cache)
    v_ptr,  # [NB, Hkv, bs, Dv]
    out_ptr,  # [D, Hq, Dv]; with NUM_SPLITS > 1 the splits' [D, Hq, S, Dv] float32 sums
    stats_ptr,  # [D, Hq, S, 2] float32 (running max, denominator) of each split
    table_ptr,  # [D, W] block ids
    lens_ptr,  # [D] keys per sequence; 0 = padding row
    sinks_ptr,  # [Hq] float logits (read only with HAS_SINKS and one split)
    scale,
    window,  # keys a query sees (the last ``window``); 0 = all
    block_size,
    stride_qd,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_od,
    stride_oh,
    stride_td,
    GROUP: tl.constexpr,  # query heads per KV head
    G_TILES: tl.constexpr,  # programs per KV head, BLOCK_G query heads each
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # upcast tiles before tl.dot (bf16 under the interpreter)
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # programs over one row's keys (program axis 2)
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64) // G_TILES
    tile = tl.program_id(1) % G_TILES
    length = tl.load(lens_ptr + seq).to(tl.int64)
    if length == 0:
        return
    first = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    last = length
    if NUM_SPLITS > 1:  # this program's share: equal runs of whole key tiles
        split = tl.program_id(2).to(tl.int64)
        chunk = tl.cdiv(tl.cdiv(length - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
        first = first + split * chunk
        last = tl.minimum(first + chunk, length)  # first >= last: an empty share

    g = tile * BLOCK_G + tl.arange(0, BLOCK_G)  # this tile's heads within the group
    g_mask = g < GROUP
    heads = kv_head * GROUP + g  # [BLOCK_G] query heads of this KV head
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + seq * stride_qd + heads[:, None] * stride_qh + dk[None, :],
        mask=g_mask[:, None] & (dk[None, :] < DK),
        other=0.0,
    )  # [BLOCK_G, BLOCK_DK]
    if DOT_FP32:
        q = q.to(tl.float32)

    # Online softmax state per query head. A sink is one more logit with no value: it
    # starts the running max and contributes exp(sink - max) to the denominator. The
    # finite start (not -inf) keeps exp(m_old - m_new) defined while every key so far
    # was masked.
    if HAS_SINKS and NUM_SPLITS == 1:  # split: the sink joins in _combine_splits_kernel
        m_i = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_G], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)

    n = tl.arange(0, BLOCK_N)
    tile_start = (first // BLOCK_N) * BLOCK_N
    for t0 in range(tile_start, last, BLOCK_N):
        pos = t0 + n  # [BLOCK_N] key positions
        key_mask = (pos >= first) & (pos < last)
        m_i, l_i, acc = attend_key_tile(
            q, m_i, l_i, acc, pos, key_mask, key_mask[None, :], table_ptr + seq * stride_td,
            k_ptr, v_ptr, kv_head, block_size, scale,
            stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
            DK, DV, BLOCK_DK, BLOCK_DV, DOT_FP32, DOT_PRECISION,
        )  # fmt: skip

    out_mask = g_mask[:, None] & (dv[None, :] < DV)
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        dst = out_ptr + seq * stride_od + heads[:, None] * stride_oh + dv[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # unnormalised: _combine_splits_kernel rescales the splits to one maximum
        # The parts buffer is contiguous: stride_od // stride_oh is Hq, so this is the
        # (row, head) pair's index, then its split's.
        part = (seq * stride_od // stride_oh + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(out_ptr + part[:, None] * DV + dv[None, :], acc, mask=out_mask)
        tl.store(stats_ptr + part * 2, m_i, mask=g_mask)
        tl.store(stats_ptr + part * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _combine_splits_kernel(
    parts_ptr,  # [D, Hq, S, Dv] float32 unnormalised sums
    stats_ptr,  # [D, Hq, S, 2] float32 (max, denominator)
    lens_ptr,  # [D]
    sinks_ptr,  # [Hq] (read only with HAS_SINKS)
    out_ptr,  # [D, Hq, Dv]
    num_heads,
    stride_od,
    stride_oh,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    if tl.load(lens_ptr + seq) == 0:
        return
    row = seq * num_heads + head
    s = tl.arange(0, NUM_SPLITS)
    dv = tl.arange(0, BLOCK_DV)
    maxes = tl.load(stats_ptr + (row * NUM_SPLITS + s) * 2)  # [S]; empty shares: -1e30 ...
    denoms = tl.load(stats_ptr + (row * NUM_SPLITS + s) * 2 + 1)  # ... and 0
    sink = -1.0e30  # none: exp(sink - top) adds 0
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
    top = tl.maximum(tl.max(maxes, axis=0), sink)
    w = tl.exp(maxes - top)  # [S]
    denom = tl.sum(denoms * w, axis=0) + tl.exp(sink - top)
    parts = tl.load(
        parts_ptr + (row * NUM_SPLITS + s)[:, None] * DV + dv[None, :],
        mask=dv[None, :] < DV,
        other=0.0,
    )  # [S, BLOCK_DV]
    weighted = tl.sum(parts * w[:, None], axis=0)  # [BLOCK_DV]
    out = weighted / denom  # pyright: ignore[reportOperatorIssue]  (tl.sum's stub is loose)
    dst = out_ptr + seq * stride_od + head * stride_oh + dv
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


def _interpreted() -> bool:
    """Whether the kernel was built for the Triton interpreter (CPU tensors)."""
    return not isinstance(_paged_decode_kernel, JITFunction)


@dataclass(frozen=True)
class PagedCall:
    """The shapes of one checked paged-attention call, and its output."""

    rows: int  # query rows (D decode rows, T prefill rows)
    hq: int
    hkv: int
    bs: int
    dk: int
    dv: int
    out: Tensor  # [rows, Hq, Dv] q's dtype
    interpreted: bool  # the kernels were built for the Triton interpreter


def check_paged_call(
    what: str,  # the kernel, for the device error
    q: Tensor,  # [rows, Hq, Dk]
    k_cache: Tensor,  # [NB, Hkv, bs, Dk]
    v_cache: Tensor,  # [NB, Hkv, bs, Dv]
    block_table: Tensor,  # [table_rows, W]
    table_rows: int,
    sinks: Tensor | None,
    sliding_window: int | None,
    out: Tensor | None,
    index: dict[str, Tensor],  # the call's other index tensors, by argument name
    rows_name: str = "D",
) -> PagedCall:
    """The argument checks the decode and prefill wrappers share: shapes and dtypes of q,
    the caches, the block table, sinks and ``out`` (allocated when None), strides, one
    device for all, and a device the kernels run on. Index tensors' own shapes are the
    caller's to check (before this call)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"expected q [{rows_name}, Hq, Dk], k_cache [NB, Hkv, bs, Dk], v_cache "
            f"[NB, Hkv, bs, Dv]; got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
            f"{tuple(v_cache.shape)}"
        )
    rows, hq, dk = q.shape
    _, hkv, bs, kdim = k_cache.shape
    dv = v_cache.shape[3]
    if kdim != dk or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            f"k_cache must be [NB, Hkv, bs, {dk}] and v_cache share its first three dims; got "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of the KV heads ({hkv})")
    if q.dtype not in FLOAT_DTYPES or k_cache.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"q and the cache must be float32/float16/bfloat16: {q.dtype}, {k_cache.dtype}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"k_cache is {k_cache.dtype}, v_cache {v_cache.dtype}")
    if (
        block_table.dim() != 2
        or block_table.shape[0] != table_rows
        or block_table.dtype not in _INDEX_DTYPES
    ):
        raise ValueError(
            f"block_table must be [{table_rows}, W] int32/int64, got "
            f"{tuple(block_table.shape)} {block_table.dtype}"
        )
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks must be [{hq}], got {tuple(sinks.shape)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache must be contiguous along their last dim")
    if block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous along its last dim")
    if out is None:
        out = torch.empty((rows, hq, dv), dtype=q.dtype, device=q.device)
    elif out.shape != (rows, hq, dv) or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be [{rows}, {hq}, {dv}] {q.dtype}, last dim contiguous")
    named = {"k_cache": k_cache, "v_cache": v_cache, "block_table": block_table} | index
    named["out"] = out
    if sinks is not None:
        named["sinks"] = sinks
    for name, tensor in named.items():
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, q on {q.device}")
    interpreted = _interpreted()
    if q.device.type != "cuda" and not interpreted:
        raise RuntimeError(
            f"the Triton {what} needs CUDA tensors (or TRITON_INTERPRET=1 set before triton "
            "is imported); on CPU use tidal.layers.attention's torch or C++ paths"
        )
    return PagedCall(rows, hq, hkv, bs, dk, dv, out, interpreted)


def paged_decode_attention(
    q: Tensor,  # [D, Hq, Dk] one query token per row; last dim contiguous
    k_cache: Tensor,  # [NB, Hkv, bs, Dk] view of the cache's keys; last dim contiguous
    v_cache: Tensor,  # [NB, Hkv, bs, Dv] view of its values; last dim contiguous
    block_table: Tensor,  # [D, W] int32/int64 block ids; entries past a length not read
    seq_lens: Tensor,  # [D] int32/int64 keys per row (this step's included); 0 = padding
    scale: float,
    sliding_window: int | None = None,  # a row sees its last this-many keys
    sinks: Tensor | None = None,  # [Hq] one logit per query head in the denominator
    out: Tensor | None = None,  # [D, Hq, Dv] q's dtype, last dim contiguous
    num_splits: int | None = None,  # programs per row over its keys; None: from the shapes
) -> Tensor:  # [D, Hq, Dv] q's dtype: float32 scores, softmax and sums
    """Attention of each row's query over its first ``seq_lens[i]`` cached keys (the last
    ``sliding_window`` of them with a window), the keys at positions ``p`` read from block
    ``block_table[i, p // bs]``, offset ``p % bs``; query head ``h`` reads KV head
    ``h // (Hq // Hkv)``. q in float32/float16/bfloat16; the cache in any of the three
    (cast to q's dtype as it is read). float32 runs its dots in IEEE float32 (no TF32).
    Rows of length 0 are not written (``out`` keeps what it held there).

    One launch of grid ``[D, Hkv * ceil(G / MAX_BLOCK_G), splits]``, plus one combining
    the splits when there are several (flash-decoding: a few long rows would otherwise
    leave most of the GPU idle). The number of splits depends only on shapes (the rows,
    heads, the block table's width, the device), the lengths are read on the device: nothing
    depends on the host between steps of one batch size (CUDA-graph capturable)."""
    num = q.shape[0] if q.dim() == 3 else -1
    if seq_lens.shape != (num,) or seq_lens.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"seq_lens must be [{num}] int32/int64, got {tuple(seq_lens.shape)} {seq_lens.dtype}"
        )
    call = check_paged_call(
        "paged attention", q, k_cache, v_cache, block_table, num, sinks, sliding_window, out,
        {"seq_lens": seq_lens},
    )  # fmt: skip
    hq, hkv, bs, dk, dv = call.hq, call.hkv, call.bs, call.dk, call.dv
    out, interpreted = call.out, call.interpreted
    if num == 0:
        return out
    group = hq // hkv
    # tl.dot wants every dim >= 16 on GPUs: smaller groups are padded with masked heads.
    block_g = MAX_BLOCK_G
    g_tiles = triton.cdiv(group, block_g)
    block_n = 16 if interpreted else 32
    if num_splits is None:
        num_splits = _auto_splits(q.device, num * hkv * g_tiles, block_table.shape[1] * bs)
    elif not 1 <= num_splits <= MAX_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(
            f"num_splits must be a power of two in [1, {MAX_SPLITS}], got {num_splits}"
        )
    same = k_cache.dtype == q.dtype
    dot_fp32 = not same or (interpreted and q.dtype == torch.bfloat16)
    if num_splits == 1:
        dest, stats = out, out  # stats not written with one split
    else:  # float32 partial sums and (max, denominator) per split, combined after
        dest = torch.empty((num, hq, num_splits, dv), dtype=torch.float32, device=q.device)
        stats = torch.empty((num, hq, num_splits, 2), dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(num, hkv * g_tiles, num_splits)](
        q, k_cache, v_cache, dest, stats, block_table, seq_lens,
        sinks if sinks is not None else q,  # not read without sinks
        scale, sliding_window or 0, bs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        dest.stride(0), dest.stride(1), block_table.stride(0),
        GROUP=group, G_TILES=g_tiles, DK=dk, DV=dv, BLOCK_G=block_g,
        BLOCK_DK=max(16, triton.next_power_of_2(dk)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        BLOCK_N=block_n,
        HAS_SINKS=sinks is not None,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or dot_fp32 else None,
        NUM_SPLITS=num_splits,
        # MLA's 576-wide latent tiles need more threads for their registers.
        num_warps=8 if dk > 256 else 4,
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(num, hq)](
            dest, stats, seq_lens, sinks if sinks is not None else q, out, hq,
            out.stride(0), out.stride(1),
            DV=dv, BLOCK_DV=triton.next_power_of_2(dv), NUM_SPLITS=num_splits,
            HAS_SINKS=sinks is not None,
        )  # fmt: skip
    return out


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, Hkv, Dh]
    v_ptr,  # [T, Hkv, Dh]
    k_cache_ptr,  # [NB, Hkv, bs, Dh]
    v_cache_ptr,  # [NB, Hkv, bs, Dh]
    slots_ptr,  # [T] cache slot of each token; < 0 = write nothing
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_vcb,
    stride_vch,
    stride_vct,
    DH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    d = tl.arange(0, BLOCK_D)
    mask = d < DH
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    dst_k = k_cache_ptr + block * stride_cb + head * stride_ch + offset * stride_ct + d
    dst_v = v_cache_ptr + block * stride_vcb + head * stride_vch + offset * stride_vct + d
    tl.store(dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k_cache: Tensor,  # [NB, Hkv, bs, Dh] written in place; last dim contiguous
    v_cache: Tensor,  # [NB, Hkv, bs, Dh] written in place; last dim contiguous
    slot_mapping: Tensor,  # [T] int32/int64 slot (block * bs + offset) per token; < 0: none
    k: Tensor,  # [T, Hkv, Dh] float32/float16/bfloat16, last dim contiguous (rows may be strided)
    v: Tensor,  # [T, Hkv, Dh] k's dtype
) -> None:
    """Each token's K and V, every KV head, into its cache slot, cast to the cache's dtype,
    in one launch of grid ``[T, Hkv]`` (the torch path: two ``index_copy_`` over per-head
    row indices built each step). A negative slot writes nothing (an inert padding row)."""
    if k.dim() != 3 or v.shape != k.shape or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"expected k, v [T, Hkv, Dh] and k_cache, v_cache [NB, Hkv, bs, Dh] alike; got "
            f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    num, hkv, dh = k.shape
    if k_cache.shape[1] != hkv or k_cache.shape[3] != dh:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} does not hold [T, {hkv}, {dh}] rows")
    if slot_mapping.shape != (num,) or slot_mapping.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"slot_mapping must be [{num}] int32/int64, got {tuple(slot_mapping.shape)} "
            f"{slot_mapping.dtype}"
        )
    if k.dtype not in FLOAT_DTYPES or v.dtype != k.dtype or k_cache.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"k, v (one dtype) and the cache must be float32/float16/bfloat16: {k.dtype}, "
            f"{v.dtype}, {k_cache.dtype}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"k_cache is {k_cache.dtype}, v_cache {v_cache.dtype}")
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k, v and the caches must be contiguous along their last dim")
    for name, tensor in {"v": v, "k_cache": k_cache, "v_cache": v_cache}.items():
        if tensor.device != k.device:
            raise ValueError(f"{name} is on {tensor.device}, k on {k.device}")
    if slot_mapping.device != k.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, k on {k.device}")
    if k.device.type != "cuda" and not _interpreted():
        raise RuntimeError(
            "the Triton cache write needs CUDA tensors (or TRITON_INTERPRET=1 set before "
            "triton is imported)"
        )
    if num == 0:
        return
    _write_kv_kernel[(num, hkv)](
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[2],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        DH=dh, BLOCK_D=triton.next_power_of_2(dh),
    )  # fmt: skip
