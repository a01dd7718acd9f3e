"""The Triton paged decode attention (tidal/kernels/paged_attention.py) against the
per-sequence oracle and the torch path it replaces on CUDA, on tiny odd shapes (the
interpreter runs them on CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from tidal.distributed.tensor_parallel import TensorParallel
from tidal.kernels.paged_attention import paged_decode_attention, write_kv_cache
from tidal.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    PagedAttention,
    decode_attention_reference,
    kv_cache_shape,
)
from tidal.layers.mla import MLASpec, MLAttention

BS = 5  # odd block size: keys cross block edges at odd positions
DH = 24  # not a power of two: the head dim is masked


def backend_pair(
    heads: int, kv_heads: int, window: int | None, sinks: bool, device: str, num_blocks: int
) -> dict[AttentionBackend, PagedAttention]:
    """The same layer on the torch (reference) and the Triton backend, over equal random
    caches of ``num_blocks`` blocks and equal sinks."""
    layers = {}
    for backend in (AttentionBackend.TORCH, AttentionBackend.TRITON):
        attn = PagedAttention(
            heads, kv_heads, DH, device=device, sliding_window=window, sinks=sinks
        )
        attn.backend = backend
        if attn.sinks is not None:
            attn.sinks.data.copy_(torch.linspace(-1.0, 1.0, heads))
        g = torch.Generator().manual_seed(3)
        attn.kv_cache = torch.randn(kv_cache_shape(num_blocks, BS, kv_heads, DH), generator=g)
        attn.kv_cache = attn.kv_cache.to(device)
        layers[backend] = attn
    return layers


def assert_backends_agree(
    layers: dict[AttentionBackend, PagedAttention], got: torch.Tensor, want: torch.Tensor
) -> None:
    """The Triton layer's output and cache writes equal the torch layer's."""
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(
        layers[AttentionBackend.TRITON].kv_cache, layers[AttentionBackend.TORCH].kv_cache
    )
# (atol, rtol) against the float64 oracle: float32 end to end; float16 rounds q, K, V and
# the probabilities before the second dot.
TOL = {torch.float32: (2e-6, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def _case(lengths, heads, kv_heads, dtype, num_blocks=24, cache_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(kv_cache_shape(num_blocks, BS, kv_heads, DH), generator=g)
    cache = cache.to(cache_dtype or dtype)
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    width = max(1, -(-max(lengths) // BS))
    blocks = [[free.pop() for _ in range(-(-n // BS))] for n in lengths]
    table = torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.int64)
    q = torch.randn(len(lengths), heads, DH, generator=g).to(dtype)
    return q, cache, table, torch.tensor(lengths, dtype=torch.int64), blocks


def _oracle(q, cache, lengths, blocks, window=None, sinks=None):
    live = [i for i, n in enumerate(lengths) if n]
    seqs = [(lengths[i], blocks[i]) for i in live]
    want = decode_attention_reference(q[live].float(), cache.float(), seqs, window, sinks)
    return live, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (5, 1)])
def test_matches_oracle_with_padding_rows(heads, kv_heads, dtype, device):
    """Lengths at, before and past block edges, and two padding rows (length 0) that must
    stay unwritten and put no NaN anywhere."""
    lengths = [1, BS, BS + 1, 0, 2 * BS + 3, 0]
    q, cache, table, lens, blocks = _case(lengths, heads, kv_heads, dtype)
    out = torch.full((len(lengths), heads, DH), 7.0, dtype=dtype)
    got = paged_decode_attention(
        q.to(device), cache[0].to(device), cache[1].to(device), table.to(device),
        lens.to(device), DH**-0.5, out=out.to(device),
    ).cpu()  # fmt: skip
    live, want = _oracle(q, cache, lengths, blocks)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got[live].float(), want, atol=atol, rtol=rtol)
    assert torch.equal(got[[3, 5]], out[[3, 5]])  # padding rows untouched
    assert not got.isnan().any()


@pytest.mark.parametrize("window,with_sinks", [(4, False), (None, True), (7, True)])
def test_window_and_sinks_match_oracle(window, with_sinks, device):
    """GPT-OSS's switches: the last ``window`` keys only (the first tile starts mid-way),
    one sink logit per query head in the denominator."""
    lengths = [1, 3, 2 * BS + 2, 17]
    q, cache, table, lens, blocks = _case(lengths, 4, 2, torch.float32, seed=1)
    sinks = torch.randn(4) if with_sinks else None
    got = paged_decode_attention(
        q.to(device), cache[0].to(device), cache[1].to(device), table.to(device),
        lens.to(device), DH**-0.5, window, None if sinks is None else sinks.to(device),
    ).cpu()  # fmt: skip
    _, want = _oracle(q, cache, lengths, blocks, window, sinks)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("window,with_sinks", [(None, False), (6, True)])
def test_split_keys_combine_to_the_oracle(splits, window, with_sinks, device):
    """Flash-decoding: each row's keys in ``splits`` shares (some empty for short rows),
    combined by their maxima and denominators, the sink once; padding rows untouched."""
    lengths = [1, 5, 0, 2 * BS + 3, 40]
    q, cache, table, lens, blocks = _case(lengths, 6, 2, torch.float32, num_blocks=24, seed=5)
    sinks = torch.randn(6) if with_sinks else None
    out = torch.full((len(lengths), 6, DH), 7.0)
    got = paged_decode_attention(
        q.to(device), cache[0].to(device), cache[1].to(device), table.to(device),
        lens.to(device), DH**-0.5, window, None if sinks is None else sinks.to(device),
        out=out.to(device), num_splits=splits,
    ).cpu()  # fmt: skip
    live, want = _oracle(q, cache, lengths, blocks, window, sinks)
    torch.testing.assert_close(got[live], want, atol=2e-6, rtol=1e-5)
    assert torch.equal(got[2], out[2])


@pytest.mark.parametrize(
    "dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]
)
def test_bf16_and_a_cache_of_another_dtype(dtype, cache_dtype, device):
    lengths = [2, 9, 13]
    q, cache, table, lens, blocks = _case(lengths, 4, 2, dtype, cache_dtype=cache_dtype, seed=2)
    got = paged_decode_attention(
        q.to(device), cache[0].to(device), cache[1].to(device), table.to(device),
        lens.to(device).to(torch.int32), DH**-0.5,
    ).cpu()  # fmt: skip
    assert got.dtype == dtype
    _, want = _oracle(q, cache, lengths, blocks)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_checks_name_the_bad_argument(device):
    q, cache, table, lens, _ = _case([3, 4], 4, 2, torch.float32)
    q, cache, table, lens = q.to(device), cache.to(device), table.to(device), lens.to(device)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        paged_decode_attention(q[:, :3], cache[0], cache[1], table, lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens must be"):
        paged_decode_attention(q, cache[0], cache[1], table, lens[:1], 1.0)
    with pytest.raises(ValueError, match="block_table must be"):
        paged_decode_attention(q, cache[0], cache[1], table.float(), lens, 1.0)
    with pytest.raises(TypeError, match="v_cache"):
        paged_decode_attention(q, cache[0], cache[1].half(), table, lens, 1.0)
    with pytest.raises(ValueError, match="sinks must be"):
        paged_decode_attention(q, cache[0], cache[1], table, lens, 1.0, sinks=q[0, 0])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_equals_index_copy(cache_dtype, device):
    """K and V of strided rows (slices of one qkv tensor) into their slots, cast to the
    cache's dtype; a negative slot (an inert padding row) writes nothing."""
    t, hkv, num_blocks = 6, 2, 7
    qkv = torch.randn(t, 3 * hkv, DH)
    k, v = qkv[:, hkv : 2 * hkv], qkv[:, 2 * hkv :]
    slots = torch.tensor([3, 17, -1, 4, 30, -1])  # block 0, 3, -, 0, 6; two padding rows
    cache = torch.randn(kv_cache_shape(num_blocks, BS, hkv, DH)).to(cache_dtype)
    want = cache.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[0, slot // BS, :, slot % BS] = k[i].to(cache_dtype)
            want[1, slot // BS, :, slot % BS] = v[i].to(cache_dtype)
    got = cache.to(device)
    write_kv_cache(got[0], got[1], slots.to(device), k.to(device), v.to(device))
    if cache_dtype == torch.bfloat16 and device == "cpu":
        # The interpreter casts float32 to bf16 by truncation (GPUs round to nearest).
        torch.testing.assert_close(got, want, atol=0.0, rtol=2**-7)
    else:
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("window,sinks", [(None, False), (6, True)])
def test_layer_triton_backend_equals_torch_backend(window, sinks, device):
    """The layer as a model calls it, one mixed step (decode rows among a prefill
    continuing a cached prefix): the Triton backend against the torch reference backend,
    cache writes included."""
    heads, kv_heads, num_blocks = 6, 2, 24
    layers = backend_pair(heads, kv_heads, window, sinks, device, num_blocks)
    seqs = [(0, 1, [1]), (6, 1, [2, 3]), (4, 3, [4, 5]), (12, 1, [6, 7, 8])]
    meta = AttentionMetadata.build(seqs, BS, device)
    g = torch.Generator().manual_seed(4)
    rows = sum(s[1] for s in seqs)
    q = torch.randn(rows, heads, DH, generator=g).to(device)
    k, v = (torch.randn(rows, kv_heads, DH, generator=g).to(device) for _ in range(2))
    want = layers[AttentionBackend.TORCH](q, k, v, meta)
    got = layers[AttentionBackend.TRITON](q, k, v, meta)
    assert_backends_agree(layers, got, want)


def test_mla_triton_decode_equals_decompressing_reference(device):
    """MLA's absorbed decode through the same kernel: one KV head whose key is the latent
    and whose value is its first r values, every query head in the group."""
    spec = MLASpec(
        q_lora_rank=0, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
        v_head_dim=10, rope_interleaved=True, softmax_scale=0.3, bias=False,
    )  # fmt: skip
    attn = MLAttention(32, 4, spec, TensorParallel(), device=device)
    attn.triton_decode = True
    g = torch.Generator().manual_seed(0)
    for p in attn.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
    lengths = [1, 2 * BS + 1, 7]
    free = list(range(1, 16))
    random.Random(1).shuffle(free)
    seqs = [(n - 1, 1, [free.pop() for _ in range(-(-n // BS))]) for n in lengths]
    meta = AttentionMetadata.build(seqs, BS, device)
    cache = torch.randn(16 * BS, spec.latent_dim, generator=g).to(device)
    q = torch.randn(len(lengths), 4, spec.qk_head_dim, generator=g).to(device)
    got = attn._decode(q, cache, meta)
    want = attn.decode_reference(q, cache, meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_auto_splits_follow_shapes_only(monkeypatch):
    """About two programs per multiprocessor, at least 256 keys a split, a power of two
    up to 16; one off CUDA."""
    from tidal.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "_multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert paged_attention._auto_splits(cuda, 4, 4096) == 16  # batch 1, 4 KV heads
    assert paged_attention._auto_splits(cuda, 32, 4096) == 8
    assert paged_attention._auto_splits(cuda, 4, 512) == 2  # short table: 256 keys a split
    assert paged_attention._auto_splits(cuda, 1024, 4096) == 1  # a full grid already
    assert paged_attention._auto_splits(torch.device("cpu"), 4, 4096) == 1


def test_backend_follows_the_device():
    """CUDA layers take the Triton kernels (triton is installed here), CPU layers the C++
    kernel (with its measured torch fallback), any other device the torch path."""
    from tidal.kernels.triton_device import triton_serves
    from tidal.layers.attention import default_backend

    assert default_backend("cuda") is AttentionBackend.TRITON and triton_serves("cuda:1")
    assert default_backend("cpu") is AttentionBackend.NATIVE and not triton_serves("cpu")
    assert default_backend("meta") is AttentionBackend.TORCH
