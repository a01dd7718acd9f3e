"""KV cache blocks: a reference-counted pool with LRU eviction, and the per-request
manager the scheduler drives (block tables, prefix caching by chained block hashes).

Pure Python, no torch: the model runner only reads ``request.block_ids``.

Null block. Block ``NULL_BLOCK_ID`` (0) is reserved and never handed to a request, so
``num_blocks`` blocks give ``num_blocks - 1`` usable ones. The runner may aim the KV
writes of padding or dummy tokens at it (their contents are never read) and may pad
block tables with it.

Prefix caching.
- Every full block of ``request.all_token_ids`` has a chained hash
  ``h_i = H(h_{i-1}, tokens of block i)`` with ``h_{-1} = 0`` and ``H`` = BLAKE2b-128
  over the parent hash (16 bytes LE) and the token ids (int64 LE). A hash therefore
  names the whole prefix up to the end of its block. It is stable across processes and
  runs (unlike ``hash(str)``), and 128 bits make an accidental collision negligible.
  Hashes are appended lazily to ``request.block_hashes``; tokens are append-only, so
  they never go stale.
- A block is registered in the hash map only *after the step that computed it*
  (``cache_computed_blocks``, called by the scheduler from ``update_from_output``), not
  when it is allocated. So a request can only hit a block whose KV has been written,
  whatever order the attention layer stores and reads KV inside one forward. The cost:
  two requests with a common prefix scheduled in the same step both compute it.
- Only full blocks are shared, and never the last prompt token: the model must run at
  least one token to produce the logits the next token is sampled from.

Eviction. Free blocks sit in one queue in eviction order (head = evicted first).
A freed block with a hash goes to the tail (kept as long as possible); a freed block
without one goes to the head (nothing is lost by reusing it). A request frees its blocks
last-first, so its tail, the part least likely to be shared, is evicted before its head.
A cache hit on a free block takes it out of the queue; freeing it again puts it at the
tail, which makes the order least-recently-used.

Sliding window. A query at position p of a layer with window W reads keys > p - W, so
once a request's next query is past a block's last token by the window, no layer of that
window reads the block again: ``allocate_slots`` frees it (leading blocks first, before the
step's new ones are taken) and its table entry becomes ``NULL_BLOCK_ID``, so positions keep
their index. A freed block is freed like a finished request's: with its hash it stays a
prefix-cache entry until evicted (its KV is still that prefix's), and reused by another
request it loses the hash, so it is no hit. The runner may keep the old id in its row: the
attention masks those positions (docs/architecture.md#kv-sliding-window).

KV cache groups. The model's layers form groups by attention kind (``windows``: one entry
per group, its window W or None for full attention). Each group has its own table per
request; they are kept interleaved in ``request.block_ids``: logical block j of group g is
entry ``j * num_groups + g`` (one group: the plain table). Every group takes its blocks
from the one pool (a block id is a page of every cache tensor; the runner binds each
tensor to one layer of each group), so the blocks a sliding group frees serve any group,
and the memory splits between groups as their requests need it. Nothing that moves or
frees a request (preemption, finish, the step wire, the runner's persistent batch) needs
to know the groups: they see one list.

Prefix caching with groups. Each group caches its own blocks, under its own key for a
prefix hash (the hash XOR the group's salt, ``group_salt``: group 0's is 0, so one group
is as above). A hit of
k blocks (its first query at p = k * block_size) needs, in a full-attention group, every
block before k, and in a sliding group only those a query at p reads: from logical block
``(p - W + 1) // block_size`` on; the ones before enter the table as null entries, as if
freed behind the window. The lookup takes the longest k every group can serve.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tidal.engine_core.request import Request
from tidal.executor.batch import NULL_BLOCK_ID
from tidal.layers.cache_spec import peak_table_blocks

_ROOT_HASH = 0
# Group g > 0's salt is the hash of one token -g - 1: no real token is negative.
_GROUP_TOKEN = -1


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: stable, 128-bit."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash.to_bytes(16, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def group_salt(group: int) -> int:
    """What a KV cache group's prefix-cache keys XOR into the block hash (group 0: 0, so
    its keys are the hashes). A 128-bit salt: two keys meet as rarely as two hashes."""
    return 0 if group == 0 else hash_block_tokens(_ROOT_HASH, [_GROUP_TOKEN - group])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set while the block is in the prefix cache

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Blocks with reference counts, a free queue in eviction order and a hash map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block id -> None; insertion order is eviction order (OrderedDict: O(1) removal).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(NULL_BLOCK_ID + 1, num_blocks)  # the null block (0) is never handed out
        )
        self._cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (head first); for tests and debugging."""
        return list(self._free)

    def get_cached_block(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the queue (null
        entries, a sliding group's blocks behind its window, are skipped)."""
        for bid in block_ids:
            if bid == NULL_BLOCK_ID:
                continue
            block = self.blocks[bid]
            if block.ref_cnt == 0:
                del self._free[bid]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` blocks from the head of the free queue, evicting their hashes."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            block = self.blocks[bid]
            self._evict(block)
            block.ref_cnt = 1
            out.append(bid)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; ``block_ids`` in eviction order (first = evicted first)."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {bid}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[bid] = None
                if block.block_hash is None:
                    self._free.move_to_end(bid, last=False)

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a computed full block; False when that content is cached already."""
        if not self.enable_caching or block_hash in self._cached:
            return False
        block = self.blocks[block_id]
        assert block.block_hash is None and block.ref_cnt > 0, block
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every hash. Blocks in use stay valid for their owners, just unshared."""
        for bid in self._cached.values():
            self.blocks[bid].block_hash = None
        self._cached.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block.block_id:
                del self._cached[block.block_hash]
            block.block_hash = None


class KVCacheManager:
    """Block tables of requests over one ``BlockPool`` (block 0 reserved, see module doc)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        """``windows``: the model's KV cache groups (``KVCacheSpec.group_windows``), each
        group's window or None (full attention)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must be >= 1 or None, one per group, got {windows}")
        self.block_size = block_size
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        # (group, window) of each sliding group
        self._sliding = [(g, w) for g, w in enumerate(self.windows) if w is not None]
        self._salts = [group_salt(g) for g in range(self.num_groups)]  # prefix-cache keys
        # request id -> per group: leading logical blocks freed behind its window (now null).
        self._num_freed_blocks: dict[str, list[int]] = {}
        self.window_freed_by_group = [0] * self.num_groups  # cumulative
        # Table entries (not null) each group holds now, over every request.
        self.blocks_by_group = [0] * self.num_groups
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.prefix_cache_queries = 0  # tokens looked up (cumulative)
        self.prefix_cache_hits = 0  # of which found in the cache (cumulative)

    @property
    def num_window_freed_blocks(self) -> int:
        """Blocks freed behind a window, every group (cumulative)."""
        return sum(self.window_freed_by_group)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        """Entries of a table (every group's) that holds ``num_tokens``, none freed."""
        return cdiv(num_tokens, self.block_size) * self.num_groups

    def peak_blocks_for(self, num_tokens: int, max_step_tokens: int) -> int:
        """Most blocks a request holds at once while it grows to ``num_tokens`` in steps
        of at most ``max_step_tokens`` (``peak_table_blocks``: a sliding group's freed
        blocks are not held)."""
        return peak_table_blocks(self.windows, num_tokens, self.block_size, max_step_tokens)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of ``request.all_token_ids``: (block ids, number of tokens).

        Full blocks only, and never every token: the last one is always left to compute.
        Takes no references; pass the result to ``allocate_slots`` in the same schedule.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._ensure_block_hashes(request, max_blocks)
        if self.num_groups > 1 or self._sliding:  # a hit holds only a sliding group's window
            return self._computed_blocks_by_group(request, max_blocks)
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            bid = self.block_pool.get_cached_block(block_hash)
            if bid is None:
                break
            hits.append(bid)
        return hits, len(hits) * self.block_size

    def _computed_blocks_by_group(
        self, request: Request, max_blocks: int
    ) -> tuple[list[int], int]:
        """``get_computed_blocks`` with KV cache groups: the longest k blocks every group
        serves (module doc), as interleaved table entries (null where a sliding group
        needs none)."""
        pool, bs, groups, salts = self.block_pool, self.block_size, self.num_groups, self._salts
        hashes = request.block_hashes
        # (group, logical block) -> its cached block or None, looked up once.
        found: dict[tuple[int, int], int | None] = {}

        def cached(g: int, j: int) -> int | None:
            if (g, j) not in found:
                found[g, j] = pool.get_cached_block(hashes[j] ^ salts[g])
            return found[g, j]

        reach = max_blocks  # the full-attention groups' longest prefix
        for g, window in enumerate(self.windows):
            if window is None:
                reach = next((j for j in range(reach) if cached(g, j) is None), reach)
        # The longest k whose window every sliding group still has (most often the first).
        for k in range(reach, 0, -1):
            # Each group's first block a query at k * bs reads (a full group's: 0).
            firsts = [0 if w is None else max(0, (k * bs - w + 1) // bs) for w in self.windows]
            if all(cached(g, j) is not None for g, _ in self._sliding for j in range(firsts[g], k)):
                hits: list[int] = []
                for j in range(k):
                    for g in range(groups):
                        bid = NULL_BLOCK_ID if j < firsts[g] else cached(g, j)
                        assert bid is not None
                        hits.append(bid)
                return hits, k * bs
        return [], 0

    def record_prefix_cache_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted by the scheduler once a lookup is used, not on every retried lookup."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> bool:
        """Grow ``request.block_ids`` to hold ``num_computed_tokens + num_new_computed_tokens
        + num_new_tokens`` tokens, prepending cache hits ``new_computed_blocks`` (which cover
        ``num_new_computed_tokens``). False when blocks are short, with nothing changed but
        the blocks behind the sliding window freed (see the module doc)."""
        self._free_behind_window(request)
        if not new_computed_blocks:  # every running request's step: no hits to take
            assert num_new_computed_tokens == 0
            need = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(
                request.block_ids
            )
            if need <= 0:
                return True
            if need > self.block_pool.num_free_blocks:
                return False
            request.block_ids.extend(self.block_pool.allocate(need))
            self._count_new(len(request.block_ids) - need, need)
            return True
        hits = list(new_computed_blocks)
        assert len(hits) == self.num_blocks_for(num_new_computed_tokens)
        assert num_new_computed_tokens % self.block_size == 0
        assert not hits or not request.block_ids, "cache hits only for a request with no blocks"
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = max(0, self.num_blocks_for(total) - len(request.block_ids) - len(hits))
        # Hits on free blocks leave the free queue, so they compete with the new blocks.
        num_free_hits = sum(
            1 for b in hits if b != NULL_BLOCK_ID and self.block_pool.blocks[b].ref_cnt == 0
        )
        if num_new_blocks + num_free_hits > self.block_pool.num_free_blocks:
            return False
        # Touch hits before allocating so the allocation cannot evict them.
        self.block_pool.touch(hits)
        first = len(request.block_ids)
        request.block_ids.extend(hits)
        request.block_ids.extend(self.block_pool.allocate(num_new_blocks))
        if NULL_BLOCK_ID in hits:  # a sliding group's blocks before its window: none held
            for g in range(self.num_groups):
                self.blocks_by_group[g] -= hits[g :: self.num_groups].count(NULL_BLOCK_ID)
        self._count_new(first, len(hits) + num_new_blocks)
        return True

    def _count_new(self, first: int, n: int) -> None:
        """Entries ``first .. first + n - 1`` were appended: count each to its group."""
        groups = self.num_groups
        for g in range(groups):
            self.blocks_by_group[g] += len(range(first + (g - first) % groups, first + n, groups))

    def cache_computed_blocks(self, request: Request) -> None:
        """Offer the request's fully computed blocks (each group's) to the prefix cache.

        Call after the step that computed them (see the module doc for why).
        """
        if not self.enable_prefix_caching:
            return
        groups = self.num_groups
        ids = request.block_ids
        num_full = min(request.num_computed_tokens // self.block_size, len(ids) // groups)
        start = request.num_cached_blocks
        if num_full <= start:
            return
        self._ensure_block_hashes(request, num_full)
        pool = self.block_pool
        for i in range(start, num_full):
            for g in range(groups):
                bid = ids[i * groups + g]
                if bid == NULL_BLOCK_ID:  # freed behind the window before it was offered
                    continue
                if pool.blocks[bid].block_hash is None:  # not a hit nor registered
                    pool.cache_block(bid, request.block_hashes[i] ^ self._salts[g])
        request.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (every group's), last block first, and clear its
        block table."""
        ids = request.block_ids
        groups = self.num_groups
        for g in range(groups):
            self.blocks_by_group[g] -= sum(1 for b in ids[g::groups] if b != NULL_BLOCK_ID)
        self.block_pool.free(b for b in reversed(ids) if b != NULL_BLOCK_ID)
        request.block_ids = []
        request.num_cached_blocks = 0
        self._num_freed_blocks.pop(request.request_id, None)

    def _free_behind_window(self, request: Request) -> None:
        """Free each sliding group's leading blocks no layer of it reads again. This step's
        first query is at ``num_computed_tokens`` = p and reads keys > p - window, so
        logical block j is done when ``(j + 1) * block_size <= p - window + 1``."""
        ids = request.block_ids
        if not self._sliding or not ids:
            return
        groups = self.num_groups
        p = request.num_computed_tokens
        freed: list[int] | None = None
        for g, window in self._sliding:
            done = min((p - window + 1) // self.block_size, len(ids) // groups)
            if freed is None:
                freed = self._num_freed_blocks.setdefault(request.request_id, [0] * groups)
            start = freed[g]
            if done <= start:
                continue
            # Last first, as a finished request's: the oldest block is kept longest. A hit
            # may have entered some as null already (module doc).
            entries = [
                i
                for i in range((done - 1) * groups + g, start * groups + g - 1, -groups)
                if ids[i] != NULL_BLOCK_ID
            ]
            self.block_pool.free(ids[i] for i in entries)
            for i in entries:
                ids[i] = NULL_BLOCK_ID
            freed[g] = done
            self.window_freed_by_group[g] += len(entries)
            self.blocks_by_group[g] -= len(entries)

    def reset_prefix_cache(self) -> bool:
        self.block_pool.reset_prefix_cache()
        return True

    def _ensure_block_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[i - 1] if i else _ROOT_HASH
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
