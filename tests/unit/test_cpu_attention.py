"""The C++ decode attention (``tidal/kernels/csrc/attention_cpu.cpp``) against the float64
per-sequence oracle, and its input checks (the rotary: ``test_cpu_norm_rope.py``). The
attention layer's own tests (``test_perf_paths.py``) run both decode paths."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels.cpu_attention import (
    decode_attention_cpu,
    write_kv_cpu,
    write_kv_cpu_ok,
)
from tidal.kernels.cpu_ext import kernel_available, kernel_status
from tidal.layers.attention import decode_attention_reference

pytestmark = pytest.mark.skipif(not kernel_available(), reason=kernel_status())


def _cache(num_blocks=32, kv_heads=2, block_size=4, head_dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, kv_heads, block_size, head_dim, generator=g)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(8, 2, 32), (4, 4, 16), (16, 1, 24), (16, 4, 64), (6, 2, 64)]
)
def test_decode_attention_matches_oracle(threads, heads, kv_heads, head_dim):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = _cache(kv_heads=kv_heads, head_dim=head_dim)
        lengths = [1, 4, 5, 17, 20, 9]  # up to all 5 blocks of 4
        perm = torch.randperm(32, generator=torch.Generator().manual_seed(1)).tolist()
        tables = [perm[i * 5 : i * 5 + 5] for i in range(len(lengths))]  # 5 blocks each
        q = torch.randn(len(lengths), heads + 3, head_dim)[:, :heads]  # strided rows
        got = decode_attention_cpu(
            q, cache, torch.tensor(tables), torch.tensor(lengths), head_dim**-0.5
        )
        want = decode_attention_reference(q, cache, list(zip(lengths, tables)))
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("window", [None, 1, 3, 6, 16])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 32), (6, 2, 64), (4, 4, 16)])
def test_decode_attention_with_window_and_sinks_matches_oracle(
    window, with_sinks, heads, kv_heads, head_dim
):
    """GPT-OSS's layers: only the last ``window`` keys (lengths below, at and past it,
    windows inside one block and across several), and a sink logit per query head."""
    cache = _cache(kv_heads=kv_heads, head_dim=head_dim, seed=3)
    lengths = [1, 3, 4, 6, 7, 17, 20]
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(2)).tolist()
    tables = [perm[i * 4 : i * 4 + 5] for i in range(len(lengths))]  # blocks may repeat
    g = torch.Generator().manual_seed(4)
    q = torch.randn(len(lengths), heads, head_dim, generator=g)
    sinks = torch.randn(heads, generator=g) * 2 if with_sinks else None
    got = decode_attention_cpu(
        q, cache, torch.tensor(tables), torch.tensor(lengths), head_dim**-0.5, window, sinks
    )
    want = decode_attention_reference(q, cache, list(zip(lengths, tables)), window, sinks)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_decode_attention_refuses_bad_window_and_sinks():
    cache = _cache()
    q, table, lens = torch.randn(1, 4, 32), torch.tensor([[0]]), torch.tensor([1])
    with pytest.raises(ValueError, match="sliding_window"):
        decode_attention_cpu(q, cache, table, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="sinks"):
        decode_attention_cpu(q, cache, table, lens, 1.0, None, torch.zeros(3))


def test_decode_attention_refuses_bad_tables():
    cache, q = _cache(), torch.randn(1, 4, 32)
    with pytest.raises(RuntimeError, match="length"):  # 9 keys need 3 blocks of 4
        decode_attention_cpu(q, cache, torch.tensor([[1, 2]]), torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="block id"):
        decode_attention_cpu(q, cache, torch.tensor([[1, 99]]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        decode_attention_cpu(
            torch.randn(1, 3, 32), cache, torch.tensor([[1]]), torch.tensor([1]), 1.0
        )
    with pytest.raises(RuntimeError, match="float32"):
        decode_attention_cpu(q.double(), cache, torch.tensor([[1]]), torch.tensor([1]), 1.0)


@pytest.mark.parametrize(
    "tokens,kv_heads,head_dim", [(1, 2, 64), (37, 4, 64), (5, 3, 24), (0, 2, 8)]
)
def test_write_kv_equals_index_copy(tokens, kv_heads, head_dim):
    """The C++ cache write puts each token's K and V heads at its slot (block, offset) of
    the cache, exactly, from the strided k and v views the layer passes (slices of the
    q/k/v projection)."""
    cache = torch.randn(2, 16, kv_heads, 4, head_dim)
    want = cache.clone()
    qkv = torch.randn(tokens, 3 + 2 * kv_heads, head_dim)
    k, v = qkv[:, 3 : 3 + kv_heads], qkv[:, 3 + kv_heads :]
    slots = torch.randperm(16 * 4)[:tokens]  # distinct slots, any order
    for t, slot in enumerate(slots.tolist()):  # the definition, token by token
        want[0, slot // 4, :, slot % 4] = k[t]
        want[1, slot // 4, :, slot % 4] = v[t]
    assert write_kv_cpu_ok(cache, k, v)
    write_kv_cpu(cache, slots, k, v)
    assert torch.equal(cache, want)


def test_write_kv_refuses_slots_outside_the_cache():
    cache = torch.zeros(2, 4, 1, 2, 8)  # 4 blocks of 2: slots 0..7
    k = torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        write_kv_cpu(cache, torch.tensor([8]), k, k)
    with pytest.raises(RuntimeError, match="outside the cache"):
        write_kv_cpu(cache, torch.tensor([-1]), k, k)
    with pytest.raises(RuntimeError, match="int64"):
        write_kv_cpu(cache, torch.tensor([0, 1]), k, k)
    with pytest.raises(RuntimeError, match="Hkv"):
        write_kv_cpu(cache, torch.tensor([0]), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    assert torch.count_nonzero(cache) == 0  # nothing written by a refused call
