# pyright: reportArgumentType=false, reportCallIssue=false
# (triton.jit signatures type launch constants as tl.constexpr and omit num_warps/num_stages)
"""Sort (token, k) slots by expert and pad every expert's run to the GEMM block size.

Slot ``s = t * top_k + k`` is routed to bucket ``local_id(s)`` in ``[0, E)``, or to the
extra "remote" bucket ``E`` when its expert is not on this rank (local id -1, or an id
out of range). Buckets are laid out in order 0..E, each padded to a multiple of
``block_size`` with the sentinel ``T * top_k``; inside a bucket slots keep their
original order (a stable sort), so the result is deterministic. Remote blocks get
expert id -1: the GEMMs write zero rows for them, so every slot of the output is
defined and the top-k sum needs no mask.

Three launches, all sized by the host-side upper bound (no device sync):
count (per chunk, per bucket) -> scan (one program: bucket offsets, expert ids of
blocks, total) -> scatter (per chunk, stable ranks within a chunk). When every slot fits
one tile (a decode step: a few tokens times top_k), one program does all of it, the
padding fill and the zeroing included: one launch instead of five. On an H200, for one
token of Qwen3-30B-A3B's layer (E=128, top-8, bf16), the whole fused-MoE call took 31.9
instead of 40.3 us of device time (CUDA-graph replay) and 0.18 instead of 0.26 ms eager,
in one run of ``benchmarks/gpu_proof.sh`` (benchmarks/results/gpu-NVIDIA_H200.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Register budget (elements) of the [SUB, BLOCK_E] one-hot tile of count/scatter and of
# the [chunks, BLOCK_E] tile of the single-program scan: bounds SUB and the chunk count.
_TILE_ELEMENTS = 8192
_MAX_CHUNKS = 64
# The one-program path: at most this many (slot, bucket) pairs in its one-hot tile.
_SMALL_TILE_ELEMENTS = 16384


@triton.jit
def _slot_bucket(
    topk_ids_ptr,
    expert_map_ptr,
    idx,
    valid,
    num_experts,
    map_size,
    HAS_MAP: tl.constexpr,
):
    """Bucket of each slot: its local expert, ``num_experts`` if remote, -1 if invalid."""
    ids = tl.load(topk_ids_ptr + idx, mask=valid, other=-1).to(tl.int64)
    if HAS_MAP:
        in_map = valid & (ids >= 0) & (ids < map_size)
        ids = tl.load(expert_map_ptr + ids, mask=in_map, other=-1).to(tl.int64)
    local = (ids >= 0) & (ids < num_experts)
    bucket = tl.where(local, ids, num_experts)
    return tl.where(valid, bucket, -1)


@triton.jit
def _store_block_experts(
    expert_ids_ptr,  # [num_blocks] int32 out
    bucket_start,  # [BLOCK_E] first padded position of each bucket
    padded,  # [BLOCK_E] padded size of each bucket
    buckets,  # [BLOCK_E] arange
    num_experts,
    num_blocks,
    block_size,
    BLOCK_B: tl.constexpr,
):
    """Expert id of every block: -1 for the remote bucket and past the end."""
    # Block b belongs to the bucket e with start_e <= b < end_e; counting the buckets
    # that end at or before b gives exactly e (empty buckets end where they start).
    bucket_end = (bucket_start + padded) // block_size
    real_bucket = buckets <= num_experts
    for b0 in range(0, num_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        ended = (bucket_end[None, :] <= blocks[:, None]) & real_bucket[None, :]
        owner = tl.sum(ended.to(tl.int32), axis=1)
        expert = tl.where(owner < num_experts, owner, -1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < num_blocks)


@triton.jit
def _align_count_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    counts_ptr,  # [num_chunks, BLOCK_E] int32 out
    numel,
    num_experts,
    map_size,
    chunk_size,
    HAS_MAP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SUB: tl.constexpr,
):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * chunk_size
    buckets = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    for off in range(0, chunk_size, SUB):
        idx = start + off + tl.arange(0, SUB)
        bucket = _slot_bucket(
            topk_ids_ptr, expert_map_ptr, idx, idx < numel, num_experts, map_size, HAS_MAP
        )
        one_hot = (bucket[:, None] == buckets[None, :]).to(tl.int32)
        total += tl.sum(one_hot, axis=0)
    tl.store(counts_ptr + pid * BLOCK_E + buckets, total)


@triton.jit
def _align_scan_kernel(
    counts_ptr,  # [num_chunks, BLOCK_E] int32
    offsets_ptr,  # [num_chunks, BLOCK_E] int32 out: first position of (chunk, bucket)
    expert_ids_ptr,  # [num_blocks] int32 out
    num_post_padded_ptr,  # [1] int32 out
    num_chunks,
    num_experts,
    num_blocks,
    block_size,
    BLOCK_E: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    chunks = tl.arange(0, BLOCK_C)
    buckets = tl.arange(0, BLOCK_E)
    tile = chunks[:, None] * BLOCK_E + buckets[None, :]
    chunk_mask = chunks[:, None] < num_chunks
    counts = tl.load(counts_ptr + tile, mask=chunk_mask, other=0)
    totals = tl.sum(counts, axis=0)
    padded = (totals + block_size - 1) // block_size * block_size
    bucket_start = tl.cumsum(padded, axis=0) - padded
    chunk_start = tl.cumsum(counts, axis=0) - counts
    tl.store(offsets_ptr + tile, bucket_start[None, :] + chunk_start, mask=chunk_mask)
    tl.store(num_post_padded_ptr, tl.sum(padded, axis=0))

    _store_block_experts(expert_ids_ptr, bucket_start, padded, buckets, num_experts, num_blocks,
                         block_size, BLOCK_B)  # fmt: skip


@triton.jit
def _align_scatter_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    offsets_ptr,  # [num_chunks, BLOCK_E] int32
    sorted_ids_ptr,  # [num_blocks * block_size] int32 out (pre-filled with the sentinel)
    numel,
    num_experts,
    map_size,
    chunk_size,
    HAS_MAP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SUB: tl.constexpr,
):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * chunk_size
    buckets = tl.arange(0, BLOCK_E)
    next_pos = tl.load(offsets_ptr + pid * BLOCK_E + buckets)
    for off in range(0, chunk_size, SUB):
        idx = start + off + tl.arange(0, SUB)
        valid = idx < numel
        bucket = _slot_bucket(
            topk_ids_ptr, expert_map_ptr, idx, valid, num_experts, map_size, HAS_MAP
        )
        one_hot = (bucket[:, None] == buckets[None, :]).to(tl.int32)
        # Exclusive rank among earlier slots of the same bucket keeps the sort stable.
        rank = tl.cumsum(one_hot, axis=0) - one_hot
        pos = tl.sum(one_hot * (rank + next_pos[None, :]), axis=1)
        tl.store(sorted_ids_ptr + pos, idx.to(tl.int32), mask=valid)
        next_pos += tl.sum(one_hot, axis=0)


@triton.jit
def _align_small_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    sorted_ids_ptr,  # [padded_len] int32 out: padding written here too
    expert_ids_ptr,  # [num_blocks] int32 out
    num_post_padded_ptr,  # [1] int32 out
    numel,
    num_experts,
    map_size,
    block_size,
    num_blocks,
    padded_len,
    HAS_MAP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= numel: every slot in one tile
    BLOCK_F: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    idx = tl.arange(0, BLOCK_S)
    valid = idx < numel
    bucket = _slot_bucket(topk_ids_ptr, expert_map_ptr, idx, valid, num_experts, map_size, HAS_MAP)
    buckets = tl.arange(0, BLOCK_E)
    one_hot = (bucket[:, None] == buckets[None, :]).to(tl.int32)  # [S, E]
    counts = tl.sum(one_hot, axis=0)
    padded = (counts + block_size - 1) // block_size * block_size
    bucket_start = tl.cumsum(padded, axis=0) - padded
    tl.store(num_post_padded_ptr, tl.sum(padded, axis=0))
    _store_block_experts(expert_ids_ptr, bucket_start, padded, buckets, num_experts, num_blocks,
                         block_size, BLOCK_B)  # fmt: skip
    for f0 in range(0, padded_len, BLOCK_F):
        pos = f0 + tl.arange(0, BLOCK_F)
        tl.store(sorted_ids_ptr + pos, tl.zeros([BLOCK_F], dtype=tl.int32) + numel,
                 mask=pos < padded_len)  # fmt: skip
    # The slots overwrite their padding entries: the barrier (bar.sync, which also makes
    # the block's global writes visible to the block) orders the two writes.
    tl.debug_barrier()
    rank = tl.cumsum(one_hot, axis=0) - one_hot  # stable: earlier slots first
    pos = tl.sum(one_hot * (rank + bucket_start[None, :]), axis=1)
    tl.store(sorted_ids_ptr + pos, idx.to(tl.int32), mask=valid)


def max_padded_slots(numel: int, num_experts: int, block_size: int) -> int:
    """Upper bound of ``num_tokens_post_padded``, rounded up to whole blocks.

    At most ``min(numel, E + 1)`` buckets are non-empty and each wastes < block_size.
    """
    bound = numel + min(numel, num_experts + 1) * (block_size - 1)
    return triton.cdiv(bound, block_size) * block_size


def _check_align_args(
    topk_ids: Tensor, block_size: int, num_experts: int, expert_map: Tensor | None
) -> None:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, top_k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_ids.is_contiguous():
        raise ValueError("topk_ids must be contiguous")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if topk_ids.numel() >= 2**31 - 1:
        raise ValueError("too many (token, k) slots for int32 sorted ids")
    if expert_map is not None:
        if expert_map.dim() != 1 or expert_map.dtype not in (torch.int32, torch.int64):
            raise TypeError("expert_map must be a 1-D int32/int64 tensor")
        if expert_map.device != topk_ids.device or not expert_map.is_contiguous():
            raise ValueError("expert_map must be contiguous and on the device of topk_ids")


def moe_align_block_size(
    topk_ids: Tensor,  # [T, top_k] int32/int64: local ids (-1 = remote), or global with expert_map
    block_size: int,
    num_experts: int,  # local experts E
    expert_map: Tensor | None = None,  # [E_global] int32: global id -> local slot or -1
) -> tuple[Tensor, Tensor, Tensor]:
    """Group slots by expert, padded per expert to ``block_size``.

    Returns ``sorted_token_ids`` [P] int32 (slot ids ``t*top_k+k``, padding = ``T*top_k``),
    ``expert_ids`` [P / block_size] int32 (local expert per block, -1 for remote blocks
    and for blocks past the end), ``num_tokens_post_padded`` [1] int32. P is the static
    bound ``max_padded_slots``; only the first ``num_tokens_post_padded`` entries count.
    With ``expert_map`` the ids are global and are mapped in the kernel.
    """
    _check_align_args(topk_ids, block_size, num_experts, expert_map)
    device = topk_ids.device
    numel = topk_ids.numel()
    padded = max_padded_slots(numel, num_experts, block_size)
    num_blocks = padded // block_size
    block_e = triton.next_power_of_2(num_experts + 1)
    has_map = expert_map is not None
    map_arg = expert_map if has_map else topk_ids  # never read when HAS_MAP is False
    map_size = expert_map.numel() if has_map else 0
    block_s = max(16, triton.next_power_of_2(numel))
    if 0 < numel and block_s * block_e <= _SMALL_TILE_ELEMENTS:
        sorted_ids = torch.empty((padded,), dtype=torch.int32, device=device)
        expert_ids = torch.empty((num_blocks,), dtype=torch.int32, device=device)
        num_post_padded = torch.empty((1,), dtype=torch.int32, device=device)
        _align_small_kernel[(1,)](
            topk_ids, map_arg, sorted_ids, expert_ids, num_post_padded, numel, num_experts,
            map_size, block_size, num_blocks, padded, HAS_MAP=has_map, BLOCK_E=block_e,
            BLOCK_S=block_s, BLOCK_F=256, BLOCK_B=max(1, min(64, 4096 // block_e)),
            num_warps=8,
        )  # fmt: skip
        return sorted_ids, expert_ids, num_post_padded
    sorted_ids = torch.full((padded,), numel, dtype=torch.int32, device=device)
    expert_ids = torch.empty((num_blocks,), dtype=torch.int32, device=device)
    num_post_padded = torch.zeros((1,), dtype=torch.int32, device=device)
    if numel == 0:
        return sorted_ids, expert_ids, num_post_padded

    sub = max(8, min(64, _TILE_ELEMENTS // block_e))
    max_chunks = max(1, min(_MAX_CHUNKS, _TILE_ELEMENTS // block_e))
    chunk = triton.cdiv(triton.cdiv(numel, max_chunks), sub) * sub  # a multiple of sub
    num_chunks = triton.cdiv(numel, chunk)
    counts = torch.empty((num_chunks, block_e), dtype=torch.int32, device=device)
    offsets = torch.empty_like(counts)

    _align_count_kernel[(num_chunks,)](
        topk_ids, map_arg, counts, numel, num_experts, map_size, chunk,
        HAS_MAP=has_map, BLOCK_E=block_e, SUB=sub,
    )  # fmt: skip
    _align_scan_kernel[(1,)](
        counts, offsets, expert_ids, num_post_padded, num_chunks, num_experts, num_blocks,
        block_size, BLOCK_E=block_e, BLOCK_C=max(2, triton.next_power_of_2(num_chunks)),
        BLOCK_B=64,
    )  # fmt: skip
    _align_scatter_kernel[(num_chunks,)](
        topk_ids, map_arg, offsets, sorted_ids, numel, num_experts, map_size, chunk,
        HAS_MAP=has_map, BLOCK_E=block_e, SUB=sub,
    )  # fmt: skip
    return sorted_ids, expert_ids, num_post_padded


def moe_align_block_size_reference(
    topk_ids: Tensor,
    block_size: int,
    num_experts: int,
    expert_map: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Plain torch version of ``moe_align_block_size`` (same outputs, bit for bit)."""
    numel = topk_ids.numel()
    ids = topk_ids.reshape(-1).long().cpu()
    if expert_map is not None:
        emap = expert_map.long().cpu()
        in_map = (ids >= 0) & (ids < emap.numel())
        ids = torch.where(in_map, emap[ids.clamp(0, max(emap.numel() - 1, 0))], -1)
    buckets = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    padded = max_padded_slots(numel, num_experts, block_size)
    sorted_ids = torch.full((padded,), numel, dtype=torch.int32)
    expert_ids = torch.full((padded // block_size,), -1, dtype=torch.int32)
    pos = 0
    for bucket in range(num_experts + 1):
        slots = torch.nonzero(buckets == bucket).flatten()  # ascending: a stable order
        sorted_ids[pos : pos + slots.numel()] = slots.to(torch.int32)
        size = -(-slots.numel() // block_size) * block_size
        if bucket < num_experts:
            expert_ids[pos // block_size : (pos + size) // block_size] = bucket
        pos += size
    device = topk_ids.device
    num_post_padded = torch.tensor([pos], dtype=torch.int32, device=device)
    return sorted_ids.to(device), expert_ids.to(device), num_post_padded
