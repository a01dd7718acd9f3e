"""The Triton paged prefill attention (tidal/kernels/paged_prefill.py) against the
per-query oracle (a query at position p of a chunk is a decode over the first p + 1
keys: ``decode_attention_reference``) and against the torch prefill path it replaces on
CUDA, on tiny odd shapes (the interpreter runs them on CPU)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.kernels.test_kernel_paged_attention import assert_backends_agree, backend_pair
from tidal.kernels.paged_prefill import PrefillBlocks, paged_prefill_attention
from tidal.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    decode_attention_reference,
    kv_cache_shape,
)

BS = 5  # odd block size: chunks and keys cross block edges at odd positions
DH = 24  # not a power of two: the head dim is masked
TOL = {torch.float32: (2e-6, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
FILL = 7.0  # what the rows outside the chunks hold before and after


def _case(seqs, heads, kv_heads, dtype, cache_dtype=None, num_blocks=24, seed=0):
    """``seqs``: (start, new tokens) per sequence in row order; one new token is a decode
    row, which the kernel must leave alone. Returns q, the cache, each chunk's
    (first row, start, length, blocks) and the device tensors describing the chunks."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(kv_cache_shape(num_blocks, BS, kv_heads, DH), generator=g)
    cache = cache.to(cache_dtype or dtype)
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    chunks, row = [], 0
    for start, n in seqs:
        blocks = [free.pop() for _ in range(-(-(start + n) // BS))]
        if n > 1:
            chunks.append((row, start, n, blocks))
        row += n
    q = torch.randn(row, heads, DH, generator=g).to(dtype)
    width = max(len(c[3]) for c in chunks)
    table = torch.tensor([c[3] + [0] * (width - len(c[3])) for c in chunks])
    rows, starts, lens = (torch.tensor([c[i] for c in chunks]) for i in (0, 1, 2))
    return q, cache, chunks, (rows, lens, starts, table)


def _oracle(q, cache, chunks, window=None, sinks=None):
    """[rows of the chunks], their expected outputs: each query a decode over keys <= p."""
    rows, seqs = [], []
    for first, start, n, blocks in chunks:
        rows += range(first, first + n)
        seqs += [(start + i + 1, blocks) for i in range(n)]
    want = decode_attention_reference(q[rows].float(), cache.float(), seqs, window, sinks)
    return rows, want


def _run(q, cache, tensors, device, **kw):
    out = torch.full((q.shape[0], q.shape[1], DH), FILL, dtype=q.dtype)
    rows, lens, starts, table = (t.to(device) for t in tensors)
    got = paged_prefill_attention(
        q.to(device), cache[0].to(device), cache[1].to(device), rows, lens, starts, table,
        DH**-0.5, out=out.to(device), **kw,
    )  # fmt: skip
    return got.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_chunks_in_one_launch_match_oracle(heads, kv_heads, dtype, device):
    """A decode row first (tiles before the first chunk), chunks from 0 and from mid-way
    (mid-block and block-aligned), crossing block edges, small chunks packed back to
    back, decode rows between: every chunk row equals the oracle, the decode rows stay
    unwritten."""
    seqs = [(9, 1), (0, 7), (3, 9), (11, 1), (10, 2), (0, 3), (4, 2), (6, 1), (2, 13)]
    q, cache, chunks, tensors = _case(seqs, heads, kv_heads, dtype)
    got = _run(q, cache, tensors, device)
    rows, want = _oracle(q, cache, chunks)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got[rows].float(), want, atol=atol, rtol=rtol)
    others = sorted(set(range(q.shape[0])) - set(rows))
    assert others and bool((got[others] == FILL).all())


@pytest.mark.parametrize("window,with_sinks", [(4, False), (None, True), (6, True)])
def test_window_and_sinks_match_oracle(window, with_sinks, device):
    """GPT-OSS's switches, with a group of 3 (not a power of two): a query sees its last
    ``window`` keys (the first key tile starts mid-way for later tiles), one sink logit
    per query head in the denominator."""
    seqs = [(0, 13), (2, 1), (8, 11), (1, 4)]
    q, cache, chunks, tensors = _case(seqs, 6, 2, torch.float32, seed=1)
    sinks = torch.randn(6) if with_sinks else None
    got = _run(
        q, cache, tensors, device, sliding_window=window,
        sinks=None if sinks is None else sinks.to(device),
    )  # fmt: skip
    rows, want = _oracle(q, cache, chunks, window, sinks)
    torch.testing.assert_close(got[rows], want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)]
)
def test_bf16_and_a_cache_of_another_dtype(dtype, cache_dtype, device):
    seqs = [(0, 6), (7, 5)]
    q, cache, chunks, tensors = _case(seqs, 4, 1, dtype, cache_dtype=cache_dtype, seed=2)
    got = _run(q, cache, tensors, device)
    assert got.dtype == dtype
    rows, want = _oracle(q, cache, chunks)
    atol, rtol = (2e-2, 2e-2) if dtype == torch.bfloat16 else (2e-6, 1e-5)
    torch.testing.assert_close(got[rows].float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("blocks", [PrefillBlocks(32, 32), PrefillBlocks(16, 32, num_warps=2)])
def test_other_tile_sizes_match_oracle(blocks, device):
    """The tile sizes a benchmark sweeps: other tokens per program and keys per step
    (and a group of 16 that fills a 16-row tile: one token a program)."""
    seqs = [(0, 7), (4, 1), (3, 12)]
    for heads, kv_heads in ((4, 2), (16, 1)):
        q, cache, chunks, tensors = _case(seqs, heads, kv_heads, torch.float32, seed=6)
        got = _run(q, cache, tensors, device, blocks=blocks)
        rows, want = _oracle(q, cache, chunks)
        torch.testing.assert_close(got[rows], want, atol=2e-6, rtol=1e-5)


def test_checks_name_the_bad_argument(device):
    q, cache, _, tensors = _case([(0, 3), (2, 4)], 4, 2, torch.float32)
    q, cache = q.to(device), cache.to(device)
    rows, lens, starts, table = (t.to(device) for t in tensors)

    def call(**kw):
        args: dict[str, Any] = {
            "q": q,
            "k_cache": cache[0],
            "v_cache": cache[1],
            "chunk_rows": rows,
        }
        args |= {"chunk_lens": lens, "chunk_starts": starts, "block_table": table, "scale": 1.0}
        return paged_prefill_attention(**(args | kw))

    with pytest.raises(ValueError, match="multiple of the KV heads"):
        call(q=q[:, :3])
    with pytest.raises(ValueError, match="chunk_lens must be"):
        call(chunk_lens=lens[:1])
    with pytest.raises(ValueError, match="chunk_starts must be"):
        call(chunk_starts=starts.float())
    with pytest.raises(ValueError, match="block_table must be"):
        call(block_table=table[:1])
    with pytest.raises(TypeError, match="v_cache"):
        call(v_cache=cache[1].half())
    with pytest.raises(ValueError, match="sinks must be"):
        call(sinks=q[0, 0])
    with pytest.raises(ValueError, match="sliding_window"):
        call(sliding_window=0)
    with pytest.raises(ValueError, match="out must be"):
        call(out=q[:, :, :-1])
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        PrefillBlocks(16, 24)
    with pytest.raises(ValueError, match="num_warps"):
        PrefillBlocks(16, 16, num_warps=3)


@pytest.mark.parametrize(
    "heads,kv_heads,window,sinks", [(8, 2, None, False), (4, 4, None, False), (6, 2, 6, True)]
)
def test_layer_triton_prefill_equals_torch_prefill(heads, kv_heads, window, sinks, device):
    """The layer as a model calls it, one step of decode rows among prefill chunks (from 0,
    and continuing cached prefixes mid-block): the Triton backend (one prefill launch)
    against the torch reference backend (SDPA per chunk with its mask), cache writes
    included."""
    num_blocks = 24
    layers = backend_pair(heads, kv_heads, window, sinks, device, num_blocks)
    seqs = [(0, 8, [1, 2]), (6, 1, [3, 4]), (4, 7, [5, 6, 7]), (0, 2, [8]), (12, 3, [9, 10, 11])]
    g = torch.Generator().manual_seed(4)
    rows = sum(s[1] for s in seqs)
    q = torch.randn(rows, heads, DH, generator=g).to(device)
    k, v = (torch.randn(rows, kv_heads, DH, generator=g).to(device) for _ in range(2))
    meta = AttentionMetadata.build(seqs, BS, device)
    got = layers[AttentionBackend.TRITON](q, k, v, meta)
    # The torch path's per-chunk tensors (built on first read) were never built.
    assert all("mask" not in vars(c) and "kv_blocks" not in vars(c) for c in meta.prefills)
    want = layers[AttentionBackend.TORCH](q, k, v, AttentionMetadata.build(seqs, BS, device))
    assert_backends_agree(layers, got, want)


def test_prefill_table_from_build_and_build_arrays(device):
    """The chunks' device table (built on first read) names each chunk's rows, start and
    blocks, the same from the persistent batch's array build as from ``build``."""
    import numpy as np

    seqs = [(0, 8, [1, 2]), (6, 1, [3, 4]), (4, 7, [5, 6, 7])]
    meta = AttentionMetadata.build(seqs, BS, device)
    table = np.array([[1, 2, 0], [3, 4, 0], [5, 6, 7]])
    arrays = AttentionMetadata.build_arrays(
        np.array([0, 6, 4]), np.array([8, 1, 7]), table, np.array([2, 2, 3]), BS, device
    )
    for m in (meta, arrays):
        t = m.prefill_table
        assert t.rows.tolist() == [0, 9] and t.lens.tolist() == [8, 7]
        assert t.starts.tolist() == [0, 4]
        assert t.block_table.tolist() == [[1, 2, 0], [5, 6, 7]]
        assert m.prefill_table is t  # memoised: one copy per step
