"""Block pool and KV cache manager: ref counts, eviction order, prefix-cache hashing."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from tidal.engine_core.kv_cache import BlockPool, KVCacheManager, hash_block_tokens
from tidal.engine_core.request import Request
from tidal.executor.batch import NULL_BLOCK_ID
from tidal.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def _run_prefill(kv: KVCacheManager, req: Request) -> None:
    """Allocate and 'compute' the whole request, then register its full blocks."""
    hits, n_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n_hit, hits, n_hit)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)


def _ref_counts_consistent(kv: KVCacheManager, live: list[Request]) -> None:
    pool = kv.block_pool
    for block in pool.blocks[1:]:
        holders = sum(r.block_ids.count(block.block_id) for r in live)
        assert block.ref_cnt == holders, block
    assert set(pool.free_block_ids()) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
def test_hash_is_chained_and_stable_across_processes() -> None:
    h0 = hash_block_tokens(0, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(0, [1, 2, 3, 4])
    assert h0 != hash_block_tokens(1, [1, 2, 3, 4])  # same tokens, other prefix
    assert h0 != hash_block_tokens(0, [1, 2, 3, 5])
    code = (
        "from tidal.engine_core.kv_cache import hash_block_tokens as h;"
        "print(h(h(0, [1, 2, 3, 4]), [9, 8, 7, 6]))"
    )
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outs.add(int(res.stdout))
    assert outs == {hash_block_tokens(h0, [9, 8, 7, 6])}


def test_pool_never_hands_out_null_block_and_tracks_usage() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4 and pool.usage == 0.0
    got = pool.allocate(4)
    assert sorted(got) == [1, 2, 3, 4] and NULL_BLOCK_ID not in got
    assert pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.allocate(1)
    pool.free(got)
    assert pool.num_free_blocks == 4 and all(b.ref_cnt == 0 for b in pool.blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([got[0]])


def test_free_order_uncached_first_then_cached_tail_first() -> None:
    pool = BlockPool(6, enable_caching=True)
    a = pool.allocate(3)  # one request's table
    b = pool.allocate(2)
    pool.cache_block(a[0], 100)
    pool.cache_block(a[1], 101)
    pool.free(reversed(a))  # a[2] (uncached) -> head; a[1], a[0] -> tail in that order
    assert pool.free_block_ids() == [a[2], a[1], a[0]]
    pool.free(reversed(b))  # uncached: both to the head
    assert pool.free_block_ids()[2:] == [a[2], a[1], a[0]]
    assert set(pool.free_block_ids()[:2]) == set(b)
    # Allocation takes uncached blocks first and evicts a[1] before a[0].
    pool.allocate(4)
    assert pool.free_block_ids() == [a[0]]
    assert pool.get_cached_block(101) is None and pool.get_cached_block(100) == a[0]


def test_computed_blocks_need_full_blocks_and_leave_last_token() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    a = _req("a", list(range(10)))  # 2 full blocks + 2 tokens
    _run_prefill(kv, a)
    assert kv.block_pool.num_cached_blocks == 2
    # Same 8-token prefix, different tail: 2 blocks hit.
    b = _req("b", list(range(8)) + [77, 78, 79])
    hits, n = kv.get_computed_blocks(b)
    assert hits == a.block_ids[:2] and n == 8
    # The prompt is exactly the cached 8 tokens: only 1 block may be reused.
    c = _req("c", list(range(8)))
    hits, n = kv.get_computed_blocks(c)
    assert hits == a.block_ids[:1] and n == 4
    # A different first block: no hit even though the second block matches.
    d = _req("d", [99, 1, 2, 3] + list(range(4, 10)))
    assert kv.get_computed_blocks(d) == ([], 0)


def test_blocks_are_cached_only_once_computed() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    a = _req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 6  # a chunk of 6: one block full
    kv.cache_computed_blocks(a)
    b = _req("b", list(range(12)))
    assert kv.get_computed_blocks(b)[1] == 4
    a.num_computed_tokens = 12
    kv.cache_computed_blocks(a)
    assert kv.get_computed_blocks(b)[1] == 8  # 11 // 4 blocks at most


def test_allocate_failure_changes_nothing_and_hits_count_against_free() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)  # 5 usable
    a = _req("a", list(range(16)))
    _run_prefill(kv, a)  # 4 blocks, all cached
    kv.free(a)
    assert kv.num_free_blocks == 5
    # b hits 3 free cached blocks and needs 3 more: 6 > 5 free.
    b = _req("b", list(range(12)) + [50] * 9)
    hits, n = kv.get_computed_blocks(b)
    assert n == 12
    assert not kv.allocate_slots(b, b.num_tokens - n, hits, n)
    assert b.block_ids == [] and kv.num_free_blocks == 5
    assert all(kv.block_pool.blocks[h].ref_cnt == 0 for h in hits)
    # With 2 new blocks it fits, and allocation must not evict its own hits.
    assert kv.allocate_slots(b, 8, hits, n)
    assert b.block_ids[:3] == hits and len(b.block_ids) == 5
    assert kv.num_free_blocks == 0
    _ref_counts_consistent(kv, [b])


def test_shared_blocks_ref_counted_and_all_free_after() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = _req("a", list(range(13)))
    _run_prefill(kv, a)
    b = _req("b", list(range(13)))
    _run_prefill(kv, b)
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] != a.block_ids[3]
    assert [kv.block_pool.blocks[x].ref_cnt for x in a.block_ids] == [2, 2, 2, 1]
    _ref_counts_consistent(kv, [a, b])
    kv.free(a)
    _ref_counts_consistent(kv, [b])
    kv.free(b)
    assert kv.num_free_blocks == 15 and kv.usage == 0.0
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)
    assert b.block_ids == []


def test_lru_eviction_keeps_recently_used_prefixes() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=BS)  # 8 usable
    old = _req("old", [1] * 12)
    new = _req("new", [2] * 12)
    for r in (old, new):
        _run_prefill(kv, r)  # 3 blocks each, all cached
        kv.free(r)
    # Touching 'old' again (a hit) makes it most recently used.
    again = _req("again", [1] * 12 + [5])
    _run_prefill(kv, again)
    kv.free(again)
    assert kv.get_computed_blocks(_req("q1", [1] * 13))[1] == 12
    # 4 fresh blocks: the 2 never-cached ones (again's tail and a spare) go first, then
    # 'new' (least recently used), tail block first: 'new' keeps its first block only.
    big = _req("big", [9] * 15)
    assert kv.allocate_slots(big, 15)
    assert kv.get_computed_blocks(_req("q2", [1] * 13))[1] == 12
    assert kv.get_computed_blocks(_req("q3", [2] * 13))[1] == 4
    assert kv.block_pool.num_cached_blocks == 4


def test_reset_prefix_cache_and_disabled_caching() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = _req("a", list(range(9)))
    _run_prefill(kv, a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(_req("b", list(range(9)))) == ([], 0)
    kv.free(a)  # blocks still owned and freed normally
    assert kv.num_free_blocks == 15

    off = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    c = _req("c", list(range(9)))
    _run_prefill(off, c)
    assert off.block_pool.num_cached_blocks == 0
    assert off.get_computed_blocks(_req("d", list(range(9)))) == ([], 0)


def test_allocate_grows_table_incrementally() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = _req("a", list(range(5)))
    assert kv.allocate_slots(a, 3)
    assert len(a.block_ids) == 1
    a.num_computed_tokens = 3
    assert kv.allocate_slots(a, 1)  # 4 tokens: still one block
    assert len(a.block_ids) == 1
    a.num_computed_tokens = 4
    assert kv.allocate_slots(a, 1)  # 5 tokens: second block
    assert len(a.block_ids) == 2
    assert kv.num_free_blocks == 13


def _decode(kv: KVCacheManager, req: Request, token: int) -> None:
    """One decode step: allocate for the last sampled token, 'compute' it, sample one."""
    assert kv.allocate_slots(req, 1)
    req.num_computed_tokens += 1
    kv.cache_computed_blocks(req)
    req.append_output_token(token)


@pytest.mark.parametrize("window", [1, 4, 6, 9])
def test_window_frees_exactly_the_blocks_no_query_reads_again(window: int) -> None:
    """At every step: the positions the step's first query reads (> p - window) have their
    blocks, every block wholly before them is null and back in the pool."""
    kv = KVCacheManager(num_blocks=40, block_size=BS, windows=[window])
    req = _req("a", list(range(10, 21)))  # 11 tokens
    assert kv.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    req.append_output_token(7)
    for step in range(20):
        _decode(kv, req, 100 + step)
        p = req.num_computed_tokens - 1  # the position the step just computed
        first_read = max(0, p - window + 1)
        ids = req.block_ids
        for j, bid in enumerate(ids):
            behind = (j + 1) * BS <= first_read
            assert (bid == NULL_BLOCK_ID) == behind, (step, j, ids)
        _ref_counts_consistent(kv, [req])
        live = sum(b != NULL_BLOCK_ID for b in ids)
        assert kv.num_free_blocks == kv.num_usable_blocks - live
    assert kv.num_window_freed_blocks == sum(b == NULL_BLOCK_ID for b in req.block_ids) > 0
    kv.free(req)  # preemption or finish: the null entries are not freed again
    assert kv.num_free_blocks == kv.num_usable_blocks and req.block_ids == []
    _ref_counts_consistent(kv, [])


def test_window_none_keeps_every_block() -> None:
    kv = KVCacheManager(num_blocks=40, block_size=BS)
    req = _req("a", list(range(9)))
    _run_prefill(kv, req)
    req.append_output_token(1)
    for step in range(12):
        _decode(kv, req, step)
    assert NULL_BLOCK_ID not in req.block_ids and kv.num_window_freed_blocks == 0


def test_freed_window_blocks_hit_only_while_their_kv_is_intact() -> None:
    """A block freed behind the window keeps its hash (its KV is still that prefix's), so
    a later request sharing the prefix hits it; once another request's allocation evicts
    it, the lookup stops there. The null entries are never registered."""
    kv = KVCacheManager(num_blocks=12, block_size=BS, windows=[4])  # 11 usable
    prompt = list(range(50, 62))  # 3 full blocks
    a = _req("a", prompt)
    _run_prefill(kv, a)
    a.append_output_token(1)
    for step in range(6):
        _decode(kv, a, 2 + step)
    freed = a.block_ids.count(NULL_BLOCK_ID)
    assert freed >= 2 and kv.block_pool.blocks[NULL_BLOCK_ID].block_hash is None
    b = _req("b", prompt[:8] + [99, 98, 97])
    hits, n = kv.get_computed_blocks(b)
    # 8 tokens hit; a query at 8 reads keys > 4, so block 0 enters as a null entry (a hit
    # holds only the window, as the admission bound counts) and block 1 is the hit.
    assert n == 8 and len(hits) == 2 and hits[0] == NULL_BLOCK_ID != hits[1]
    assert kv.block_pool.blocks[hits[1]].ref_cnt == 0  # freed, still cached
    # Take every free block: the freed ones are evicted with their hashes.
    hog = _req("hog", [3] * (kv.num_free_blocks * BS))
    assert kv.allocate_slots(hog, hog.num_tokens)
    assert hits[1] in hog.block_ids
    assert kv.get_computed_blocks(b) == ([], 0)
    _ref_counts_consistent(kv, [a, hog])


# ---- KV cache groups (a sliding group beside a full-attention one) ----------------------


def _group(req: Request, g: int, groups: int = 2) -> list[int]:
    """Group ``g``'s table: ``block_ids`` interleaves the groups' tables."""
    return req.block_ids[g::groups]


def _counts_by_group(kv: KVCacheManager, live: list[Request]) -> list[int]:
    return [
        sum(b != NULL_BLOCK_ID for r in live for b in _group(r, g, kv.num_groups))
        for g in range(kv.num_groups)
    ]


@pytest.mark.parametrize("window", [1, 4, 9])
def test_groups_free_behind_the_window_only_in_the_sliding_group(window: int) -> None:
    """Group 0 slides, group 1 attends to everything: at every step group 0's table is
    null exactly behind the step's first read, group 1's is whole, both cover the same
    positions; every block freed is back in the one pool; finishing frees the rest."""
    kv = KVCacheManager(num_blocks=60, block_size=BS, windows=[window, None])
    assert kv.num_groups == 2
    req = _req("a", list(range(10, 21)))  # 11 tokens
    assert kv.allocate_slots(req, req.num_tokens)
    assert len(req.block_ids) == 2 * 3 and kv.blocks_by_group == [3, 3]
    req.num_computed_tokens = req.num_tokens
    req.append_output_token(7)
    for step in range(20):
        _decode(kv, req, 100 + step)
        p = req.num_computed_tokens - 1
        first_read = max(0, p - window + 1)
        sliding, full = _group(req, 0), _group(req, 1)
        assert len(sliding) == len(full) == -(-(p + 1) // BS)
        for j, bid in enumerate(sliding):
            assert (bid == NULL_BLOCK_ID) == ((j + 1) * BS <= first_read), (step, j, sliding)
        assert NULL_BLOCK_ID not in full
        _ref_counts_consistent(kv, [req])
        live = sum(b != NULL_BLOCK_ID for b in req.block_ids)
        assert kv.num_free_blocks == kv.num_usable_blocks - live
        assert kv.blocks_by_group == _counts_by_group(kv, [req])
    freed = kv.window_freed_by_group
    assert freed[0] == _group(req, 0).count(NULL_BLOCK_ID) > 0 and freed[1] == 0
    assert kv.num_window_freed_blocks == freed[0]
    kv.free(req)
    assert kv.num_free_blocks == kv.num_usable_blocks and req.block_ids == []
    assert kv.blocks_by_group == [0, 0]
    _ref_counts_consistent(kv, [])


@pytest.mark.parametrize("windows", [(None,), (3,), (1, None), (4, None), (None, 9), (5, 13)])
@pytest.mark.parametrize("seed", range(4))
def test_peak_blocks_bound_what_one_request_holds(windows, seed: int) -> None:
    """``peak_blocks_for`` (what admission and the cache's size allow a request) bounds
    the blocks a request holds at every step, whatever its chunk sizes up to the step
    bound, and for a prefix-cache hit too (a hit takes only a sliding group's window, one
    group or several); in 1-token steps a sliding group reaches it, so it is no looser
    than a block per group, and a full group holds exactly its whole table."""
    rng = random.Random(seed)
    step_max = rng.choice([1, 3, 8, 16])
    n = rng.randrange(30, 90)
    peak = KVCacheManager(num_blocks=2, block_size=BS, windows=windows).peak_blocks_for(
        n, step_max
    )
    tokens = list(range(100, 100 + n))
    for chunks in ("random", "ones", "hit"):
        kv = KVCacheManager(num_blocks=400, block_size=BS, windows=windows)
        if chunks == "hit":  # a first request caches the prefix the measured one hits
            _run_prefill(kv, _req("first", tokens))
        req = _req("a", tokens)
        hits, n_hit = kv.get_computed_blocks(req) if chunks == "hit" else ([], 0)
        assert chunks != "hit" or n_hit > 0
        most = 0
        while req.num_computed_tokens < n:
            left = n - req.num_computed_tokens - n_hit
            c = 1 if chunks == "ones" else rng.randint(1, min(step_max, left))
            assert kv.allocate_slots(req, c, hits, n_hit)
            req.num_computed_tokens += c + n_hit
            hits, n_hit = [], 0
            most = max(most, sum(b != NULL_BLOCK_ID for b in req.block_ids))
        assert most <= peak, (chunks, most, peak)
        if chunks == "ones" and step_max == 1:
            assert most >= peak - sum(w is not None for w in windows)
    whole = -(-n // BS)
    sliding = sum(w is not None for w in windows)
    assert peak >= whole * (len(windows) - sliding)
    assert (peak < whole * len(windows)) == (sliding > 0 and any(
        (min(step_max, n) + w - 3) // BS + 2 < whole for w in windows if w is not None
    ))


def test_groups_share_the_pool_so_freed_window_blocks_hold_more_context() -> None:
    """One pool serves both groups: a request past its window holds its full group's
    blocks plus only the window's, so a context that needs more blocks than the pool
    has for both whole tables still fits. Short of blocks, ``allocate_slots`` changes
    nothing but the window; preempting (``free``) returns every block of both groups."""
    kv = KVCacheManager(num_blocks=13, block_size=BS, windows=[4, None])  # 12 usable
    req = _req("a", list(range(30, 38)))  # 8 tokens: 2 blocks per group
    assert kv.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    req.append_output_token(1)
    tokens = 0
    while kv.allocate_slots(req, 1):
        req.num_computed_tokens += 1
        req.append_output_token(2)
        tokens = req.num_computed_tokens
    # 12 blocks would hold 6 blocks of both whole tables (24 tokens); freeing the
    # sliding group's lets the full one hold 10 (40 tokens) beside the window's block,
    # and the 41st token needs a block of each with one left.
    assert tokens == 40, tokens
    assert NULL_BLOCK_ID not in _group(req, 1) and len(_group(req, 1)) == 10
    assert kv.blocks_by_group == [1, 10] and kv.num_free_blocks == 1
    before = list(req.block_ids)
    assert not kv.allocate_slots(req, 1)  # short: the table is as it was
    assert req.block_ids == before
    _ref_counts_consistent(kv, [req])
    # Another request cannot come in; preempting the first returns all 12.
    other = _req("b", list(range(4)))
    assert not kv.allocate_slots(other, other.num_tokens) and other.block_ids == []
    kv.free(req)
    assert kv.num_free_blocks == kv.num_usable_blocks == 12 and kv.blocks_by_group == [0, 0]
    assert kv.allocate_slots(other, other.num_tokens) and kv.blocks_by_group == [1, 1]
    kv.free(other)
    _ref_counts_consistent(kv, [])


def test_group_hits_need_the_full_prefix_and_only_the_sliding_window() -> None:
    """A hit of k blocks takes the full group's blocks before k and the sliding group's
    from the window of a query at k * BS on (the earlier ones null); where the sliding
    group lost a block the window needs, the hit is shorter, whatever the full group
    holds. Each group's blocks are cached under their own key."""
    kv = KVCacheManager(num_blocks=41, block_size=BS, windows=[4, None])  # 40 usable
    prefix = list(range(100, 120))  # 5 blocks
    a = _req("a", prefix + [7])
    _run_prefill(kv, a)
    a.append_output_token(8)
    _decode(kv, a, 9)  # at p = 21: sliding blocks 0..3 freed (still cached), 4 and 5 held
    sliding_a, full_a = _group(a, 0), _group(a, 1)
    assert sliding_a[:4] == [NULL_BLOCK_ID] * 4 and NULL_BLOCK_ID not in full_a
    # 24 tokens: 5 blocks can hit; a query at 20 reads keys > 16, sliding block 4 on.
    b = _req("b", prefix + [1, 2, 3, 4])
    hits, n = kv.get_computed_blocks(b)
    assert n == 20
    assert _group_of(hits, 1) == full_a[:5]
    assert _group_of(hits, 0) == [NULL_BLOCK_ID] * 4 + [sliding_a[4]]
    assert kv.allocate_slots(b, b.num_tokens - n, hits, n)
    b.num_computed_tokens = b.num_tokens
    _ref_counts_consistent(kv, [a, b])
    assert kv.blocks_by_group == _counts_by_group(kv, [a, b])
    kv.free(b)
    # Evict the free (cached) blocks: sliding 0..3 lose their hashes; a holds the rest.
    assert kv.num_free_blocks % 2 == 0
    hog = _req("hog", [3] * (kv.num_free_blocks // 2 * BS))
    assert kv.allocate_slots(hog, hog.num_tokens) and kv.num_free_blocks == 0
    # 19 tokens: the full group could serve 4 blocks, but each k needs a sliding block
    # that is gone (k = 4 reads block 3 on, ..., k = 1 block 0): no hit.
    assert kv.get_computed_blocks(_req("c", prefix[:16] + [1, 2, 3])) == ([], 0)
    hits, n = kv.get_computed_blocks(_req("d", prefix + [5]))  # block 4 on: still held
    assert n == 20 and _group_of(hits, 0)[4] == sliding_a[4]
    kv.free(hog)
    kv.free(a)
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.blocks_by_group == [0, 0]
    _ref_counts_consistent(kv, [])


def _group_of(entries: list[int], g: int, groups: int = 2) -> list[int]:
    return entries[g::groups]


def test_one_group_is_the_single_table() -> None:
    """One group (every model without mixed layers): the same block ids as before groups
    existed, in the same order, and blocks_by_group counts them."""
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    req = _req("a", list(range(9)))
    assert kv.allocate_slots(req, req.num_tokens)
    assert req.block_ids == [1, 2, 3] and kv.blocks_by_group == [3]
    assert kv.num_blocks_for(9) == 3
    two = KVCacheManager(num_blocks=16, block_size=BS, windows=[4, None])
    assert two.num_blocks_for(9) == 6


def test_windows_are_checked() -> None:
    with pytest.raises(ValueError, match="windows"):
        KVCacheManager(num_blocks=16, block_size=BS, windows=[])
    with pytest.raises(ValueError, match="windows"):
        KVCacheManager(num_blocks=16, block_size=BS, windows=[0, None])
