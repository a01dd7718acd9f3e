"""Multi-head latent attention (tidal/layers/mla.py): the absorbed decode against the
decompressing reference, YaRN against transformers' own, and the cache spec's layouts."""

from __future__ import annotations

import random

import pytest
import torch

from tidal.distributed.tensor_parallel import TensorParallel
from tidal.layers.attention import AttentionMetadata
from tidal.layers.cache_spec import CacheLayout, KVCacheSpec
from tidal.layers.mla import MLASpec, MLAttention
from tidal.layers.rotary import Yarn

BS = 4


def _mla(q_lora_rank: int = 0) -> MLAttention:
    spec = MLASpec(
        q_lora_rank=q_lora_rank, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
        v_head_dim=10, rope_interleaved=True, softmax_scale=0.3, bias=False,
    )  # fmt: skip
    attn = MLAttention(32, 4, spec, TensorParallel())
    g = torch.Generator().manual_seed(0)
    for p in attn.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return attn


@pytest.mark.parametrize("lengths", [[1], [5, 17, 8], [16, 3, 33, 4]])
def test_absorbed_decode_equals_decompressing_reference(lengths):
    """Sequences of different lengths (padded, masked) in shuffled blocks."""
    attn = _mla()
    num_blocks = 40
    g = torch.Generator().manual_seed(len(lengths))
    cache = torch.randn(num_blocks * BS, attn.spec.latent_dim, generator=g)
    free = list(range(1, num_blocks))
    random.Random(1).shuffle(free)
    seqs = [(n - 1, 1, [free.pop() for _ in range(-(-n // BS))]) for n in lengths]
    meta = AttentionMetadata.build(seqs, BS, "cpu")
    q = torch.randn(len(lengths), 4, attn.spec.qk_head_dim, generator=g)
    got = attn._decode(q, cache, meta)
    want = attn.decode_reference(q, cache, meta)
    assert got.shape == want.shape == (len(lengths), 4, 10)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_yarn_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707,
        "beta_fast": 32, "beta_slow": 1,
    }  # fmt: skip
    cfg = DeepseekV3Config(rope_parameters=rope, max_position_embeddings=163840)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    params = Yarn(40.0, 4096, 32, 1, mscale=1.0, mscale_all_dim=0.707)
    got_freq, got_factor = params.inv_freq(10000.0, cfg.qk_rope_head_dim), params.scale()
    assert torch.equal(got_freq, want_freq.float())
    assert got_factor == pytest.approx(want_factor) and got_factor != 1.0


def test_cache_spec_layouts():
    kv = KVCacheSpec.kv(3, 2, 16)
    latent = KVCacheSpec.latent(3, 576)
    assert kv.layer_shape(10, 4) == (2, 10, 2, 4, 16)
    assert latent.layer_shape(10, 4) == (10, 4, 576) and latent.layout is CacheLayout.LATENT
    # DeepSeek-V3 in bf16 over 61 layers: (512 + 64) x 2 bytes x 61
    assert KVCacheSpec.latent(61, 512 + 64).bytes_per_token(torch.bfloat16) == 576 * 2 * 61
    assert kv.bytes_per_token(torch.float32) == 2 * 2 * 16 * 4 * 3
