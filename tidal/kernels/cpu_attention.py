"""Decode attention over the paged KV cache on CPU, in C++ (``csrc/attention_cpu.cpp``):
the checked wrappers (the rotary embedding is ``cpu_norm.norm_rope_cpu``). Attention and
the cache writes take float32, bfloat16 and float16 queries and caches, in any pairing
(``--kv-cache-dtype`` need not be the model's): the cache is read in its own dtype, math
is float32.

Why: the torch decode path (K gather, baddbmm, softmax, embedding_bag, and their index
tensors) is many small ops a layer; at decode sizes on 2 cores they were ~10% of the
big model's batch step and ~30% of the tiny model's. The C++ version reads each
sequence's K and V rows once, straight from the cache: 334 -> 301 us a layer on the
1024-wide model and 144 -> 91 on the 256-wide one (32 sequences, 2 cores). The torch path
stays as the fallback, and ``decode_attention_reference`` is what the tests hold it to.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.kernels.cpu_ext import kernel_available

MAX_GROUP = 16  # query heads per KV head the C++ decode attention takes
# What the C++ decode attention and cache writes read and write (queries, K/V, cache).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def decode_attention_cpu_supports(dtype: torch.dtype, device: torch.device, group: int) -> bool:
    """Whether the C++ decode attention serves queries of this dtype, this device and
    number of query heads per KV head (the extension loaded). The metadata asks it before
    any tensor exists, to skip the torch path's index rows."""
    return (
        dtype in KERNEL_DTYPES
        and device.type == "cpu"
        and group <= MAX_GROUP
        and kernel_available()
    )


def decode_attention_cpu_ok(q: Tensor, cache: Tensor, num_kv_heads: int) -> bool:
    """Whether ``decode_attention_cpu`` takes these very tensors: as above, plus a
    contiguous cache of a kernel dtype and q's last dimension contiguous."""
    return (
        decode_attention_cpu_supports(q.dtype, q.device, q.shape[1] // num_kv_heads)
        and cache.dtype in KERNEL_DTYPES
        and cache.is_contiguous()
        and q.stride(2) == 1
    )


def decode_attention_cpu(
    q: Tensor,  # [D, Hq, Dh] one query token per sequence (rows may be strided)
    cache: Tensor,  # [2, NB, Hkv, bs, Dh] one layer's cache, contiguous, any KERNEL_DTYPES
    block_table: Tensor,  # [D, B] int64 block ids (padding past each length is not read)
    seq_lens: Tensor,  # [D] int64 keys per sequence, this step's token included
    scale: float,
    sliding_window: int | None = None,  # attend only the last sliding_window keys
    sinks: Tensor | None = None,  # [Hq] one logit per query head in the denominator, no value
) -> Tensor:  # [D, Hq, Dh] in q's dtype (float32 softmax and sums)
    """Each row's query over its cached keys (``decode_attention_reference``'s rule,
    window and sinks included)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    sk = None if sinks is None else sinks.to(torch.float32)
    return torch.ops.tidal_cpu.decode_attention(
        q, cache, block_table, seq_lens, scale, sliding_window or 0, sk
    )


def write_kv_cpu_ok(cache: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether ``write_kv_cpu`` takes these tensors: kernel dtypes on CPU (k and v of one,
    the cache of any), a contiguous cache, k and v [T, Hkv, Dh] with their last dimension
    contiguous, the extension loaded."""
    return (
        cache.dtype in KERNEL_DTYPES
        and k.dtype == v.dtype
        and k.dtype in KERNEL_DTYPES
        and cache.device.type == "cpu"
        and cache.is_contiguous()
        and k.dim() == v.dim() == 3
        and k.stride(2) == v.stride(2) == 1
        and kernel_available()
    )


def write_kv_cpu(
    cache: Tensor,  # [2, NB, Hkv, bs, Dh] one layer's cache, contiguous; written in place
    slots: Tensor,  # [T] int64 cache slot (block * bs + offset) of each token
    k: Tensor,  # [T, Hkv, Dh] (rows may be strided), cast to the cache's dtype
    v: Tensor,  # [T, Hkv, Dh]
) -> None:
    """Each token's K and V heads into its slot of the cache (``index_copy_`` into the
    ``CacheRows.write_k`` / ``write_v`` rows, the reference), with the scattered
    destinations' cache misses overlapped; one call for both."""
    torch.ops.tidal_cpu.write_kv(cache, slots, k, v)
