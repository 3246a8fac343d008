"""Host-side cache bookkeeping: BlockPool, SlotPool, BlockTable, blocks_for_budget, PrefixCache."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest

from dayzero.serving.block_pool import (BlockPool, BlockPoolError, BlockTable, OutOfBlocks, OutOfSlots,
                                        SlotPool, blocks_for_budget)
from dayzero.serving.prefix_cache import PrefixCache, PrefixCacheError


def _pool_state(pool: BlockPool):
    return list(pool._free), [pool.refcount(b) for b in range(pool.num_blocks)]


# ---------------------------------------------------------------------------------------------
# BlockPool
# ---------------------------------------------------------------------------------------------
def test_pool_allocate_refcount_free():
    pool = BlockPool(10, block_size=64)
    assert pool.num_free == 9 and pool.num_used == 0 and pool.num_usable == 9
    a = pool.allocate(3)
    assert a == [1, 2, 3]  # fresh pool: lowest ids first, never the scratch block 0
    assert 0 not in a and len(set(a)) == 3
    assert pool.num_free == 6 and pool.num_used == 3
    assert all(pool.refcount(b) == 1 for b in a) and pool.refcount(0) == 0
    pool.incref([a[0], a[0], a[1]])
    assert [pool.refcount(b) for b in a] == [3, 2, 1]
    assert pool.decref([a[2]]) == [a[2]]
    assert pool.is_free(a[2]) and pool.num_free == 7
    assert pool.decref([a[0], a[1]]) == []
    assert pool.decref([a[0], a[0], a[1]]) == [a[0], a[1]]  # repeated ids in one call count twice
    assert pool.num_free == 9 and pool.num_used == 0
    assert pool.check_invariants()
    rest = pool.allocate(9)
    assert sorted(rest) == list(range(1, 10))
    assert pool.allocate(0) == []
    pool.decref(rest)
    assert pool.check_invariants() and pool.num_free == 9


def test_pool_misuse_raises_and_leaves_state_unchanged():
    pool = BlockPool(8, reserved=2)
    a = pool.allocate(2)
    assert min(a) >= 2
    before = _pool_state(pool)
    with pytest.raises(BlockPoolError):
        pool.decref([a[0], a[0]])  # one reference held, two dropped: nothing changes
    with pytest.raises(BlockPoolError):
        pool.decref([a[1], 7])  # 7 is free: double free; a[1] must not be decremented either
    with pytest.raises(BlockPoolError):
        pool.incref([a[0], 5])  # 5 is free
    with pytest.raises(BlockPoolError):
        pool.incref([1])  # reserved
    with pytest.raises(BlockPoolError):
        pool.decref([0])
    with pytest.raises(BlockPoolError):
        pool.refcount(8)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert _pool_state(pool) == before
    assert pool.check_invariants()
    pool.decref(a)
    with pytest.raises(BlockPoolError):
        pool.decref([a[0]])
    with pytest.raises(ValueError):
        BlockPool(1, reserved=1)


def test_out_of_blocks_allocates_nothing():
    pool = BlockPool(6)
    a = pool.allocate(3)
    before = _pool_state(pool)
    with pytest.raises(OutOfBlocks) as ei:
        pool.allocate(3)
    assert ei.value.requested == 3 and ei.value.free == 2
    assert "requested 3" in str(ei.value) and "2 free" in str(ei.value)
    assert _pool_state(pool) == before
    assert pool.num_free == 2 and pool.num_used == 3
    b = pool.allocate(2)
    assert set(a).isdisjoint(b) and pool.num_free == 0
    assert pool.check_invariants()


def test_check_invariants_detects_corruption():
    pool = BlockPool(5)
    pool.allocate(1)
    pool._free.append(pool._free[-1])  # duplicate on the free list
    with pytest.raises(AssertionError, match="duplicates"):
        pool.check_invariants()
    pool = BlockPool(5)
    b = pool.allocate(1)[0]
    pool._ref[b] = 0  # leaked: refcount 0 but not free
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool = BlockPool(5)
    pool._free.append(0)  # scratch block on the free list
    with pytest.raises(AssertionError):
        pool.check_invariants()


# ---------------------------------------------------------------------------------------------
# SlotPool, BlockTable, blocks_for_budget
# ---------------------------------------------------------------------------------------------
def test_slot_pool():
    slots = SlotPool(4)
    got = [slots.allocate() for _ in range(3)]
    assert sorted(got) == [1, 2, 3] and slots.num_free == 0 and slots.num_used == 3
    with pytest.raises(OutOfSlots):
        slots.allocate()
    slots.free(got[1])
    assert slots.num_free == 1 and not slots.is_allocated(got[1])
    with pytest.raises(BlockPoolError, match="double free"):
        slots.free(got[1])
    with pytest.raises(BlockPoolError):
        slots.free(0)  # scratch slot
    with pytest.raises(BlockPoolError):
        slots.free(4)
    assert slots.allocate() == got[1]
    assert slots.check_invariants()
    for s in got:
        slots.free(s)
    assert slots.num_free == 3 and slots.check_invariants()


def test_block_table():
    t = BlockTable(block_size=64)
    assert t.blocks_needed(0) == 0 and t.blocks_needed(1) == 1
    assert t.blocks_needed(64) == 1 and t.blocks_needed(65) == 2 and t.blocks_needed(128) == 2
    t.append_blocks([5, 9])
    assert t.capacity == 128 and t.blocks_needed(100) == 0 and t.blocks_needed(129) == 1
    t.add_tokens(100)
    assert t.num_tokens == 100 and t.num_full_blocks == 1
    with pytest.raises(ValueError):
        t.add_tokens(29)  # 129 > capacity 128
    arr = t.as_array(4)
    assert arr.dtype == np.int32 and arr.shape == (4,)
    assert arr.tolist() == [5, 9, 0, 0]
    with pytest.raises(ValueError):
        t.as_array(1)
    assert t.clear() == [5, 9] and t.num_blocks == 0 and t.num_tokens == 0


def test_blocks_for_budget():
    assert blocks_for_budget(1000, 100) == 10
    assert blocks_for_budget(1099, 100) == 10
    assert blocks_for_budget(150, 100) == 2  # at least 2
    assert blocks_for_budget(0, 100) == 2
    assert blocks_for_budget(80 << 30, 64 * 61 * 576 * 2) == (80 << 30) // (64 * 61 * 576 * 2)
    with pytest.raises(ValueError):
        blocks_for_budget(1000, 0)


# ---------------------------------------------------------------------------------------------
# PrefixCache
# ---------------------------------------------------------------------------------------------
BS = 4


def _seq(*blocks, tail=()):
    """Tokens: block k of the sequence is [b*10, b*10+1, ...] for the given block labels b, then `tail`."""
    out = []
    for b in blocks:
        out += [b * 10 + j for j in range(BS)]
    return out + list(tail)


def _run_request(cache: PrefixCache, tokens, snapshots=None, require_snapshot=False):
    """Admit, 'compute' and finish a request; returns (match, insert result, table ids before release)."""
    pool = cache.pool
    m = cache.match(tokens, require_snapshot=require_snapshot)
    table = BlockTable(pool.block_size, cache.acquire(m), m.num_tokens)
    new, _ = cache.allocate(table.blocks_needed(len(tokens)))
    table.append_blocks(new)
    table.num_tokens = len(tokens)
    ids = list(table.block_ids)
    r = cache.insert(tokens, ids, snapshots)
    cache.release(table.clear())
    return m, r, ids


def test_prefix_shared_across_requests():
    pool = BlockPool(32, block_size=BS)
    cache = PrefixCache(pool)
    a = _seq(1, 2, 3, tail=[7, 7])  # 3 full blocks + partial
    m, r, ids_a = _run_request(cache, a)
    assert m.num_tokens == 0 and not m
    assert r.num_inserted == 3 and r.cached_block_ids == ids_a[:3] and r.duplicates == []
    assert len(cache) == 3
    assert not cache.is_cached(ids_a[3])  # the partial block is not cached ...
    assert pool.is_free(ids_a[3])  # ... and went back to the pool with the request
    assert all(pool.refcount(b) == 1 for b in ids_a[:3])  # cache's own reference keeps them

    b = _seq(1, 2, 4, tail=[1])
    m = cache.match(b)
    assert m.block_ids == tuple(ids_a[:2]) and m.num_tokens == 2 * BS and m.num_blocks == 2
    assert [n.block_id for n in m.nodes] == ids_a[:2] and m.nodes[1].parent is m.nodes[0]
    got = cache.acquire(m)
    assert got == ids_a[:2] and all(pool.refcount(x) == 2 for x in got)
    assert m.nodes[0].num_users == 1
    cache.release(got)
    assert all(pool.refcount(x) == 1 for x in got)
    # Different first block: nothing matches even though later blocks equal.
    assert cache.match(_seq(9, 2, 3, tail=[0])).num_tokens == 0
    # numpy input works the same
    assert cache.match(np.asarray(b, dtype=np.int64)).block_ids == tuple(ids_a[:2])
    assert cache.check_invariants()


def test_partial_block_prefix_does_not_match():
    pool = BlockPool(16, block_size=BS)
    cache = PrefixCache(pool)
    _, _, ids = _run_request(cache, _seq(1, 2, tail=[5]))
    # Shares the first block and 3 of 4 tokens of the second: only the first block matches.
    q = _seq(1) + [20, 21, 22, 99, 5, 5]
    assert cache.match(q).block_ids == (ids[0],)
    # Shares only part of the first block: no match.
    assert cache.match([10, 11, 12, 99, 1, 2, 3]).num_tokens == 0
    # A sequence shorter than one block never matches.
    assert cache.match([10, 11]).num_tokens == 0
    # Inserting tokens that end in a partial block caches only full blocks.
    assert len(cache) == 2


def test_entire_prompt_never_matched():
    pool = BlockPool(16, block_size=BS)
    cache = PrefixCache(pool)
    toks = _seq(1, 2, 3)
    _, r, ids = _run_request(cache, toks + [0])
    assert r.num_inserted == 3
    # The prompt is exactly the 3 cached blocks: only 2 may match (at least 1 token left to compute).
    m = cache.match(toks)
    assert m.num_tokens == 2 * BS and m.num_tokens < len(toks)
    # One extra token: all 3 match.
    assert cache.match(toks + [0]).num_tokens == 3 * BS
    # max_match_tokens limits further (rounded down to full blocks); larger values never exceed len-1.
    assert cache.match(toks + [0], max_match_tokens=2 * BS + 1).num_tokens == 2 * BS
    assert cache.match(toks, max_match_tokens=100).num_tokens == 2 * BS
    assert cache.match(toks + [0], max_match_tokens=0).num_tokens == 0
    assert cache.match(toks[:BS]).num_tokens == 0
    assert cache.match([]).num_tokens == 0


def test_require_snapshot_cuts_back():
    pool = BlockPool(16, block_size=BS)
    cache = PrefixCache(pool)
    toks = _seq(1, 2, 3, 4, tail=[0])
    _, r, ids = _run_request(cache, toks, snapshots={0: 100, 2: 102})
    assert r.unused_snapshots == []
    m = cache.match(toks)
    assert m.num_blocks == 4 and m.snapshot is None  # last matched block has no snapshot
    m = cache.match(toks, require_snapshot=True)
    assert m.block_ids == tuple(ids[:3]) and m.snapshot == 102 and m.num_tokens == 3 * BS
    m = cache.match(_seq(1, 2, tail=[0]), require_snapshot=True)
    assert m.block_ids == (ids[0],) and m.snapshot == 100
    m = cache.match(_seq(1, 2, tail=[0]))
    assert m.num_blocks == 2 and m.snapshot is None
    # No snapshot anywhere on the path: empty match.
    _run_request(cache, _seq(5, 6, tail=[0]))
    m = cache.match(_seq(5, 6, tail=[0]), require_snapshot=True)
    assert m.num_tokens == 0 and m.snapshot is None and m.block_ids == ()
    # A later insert can attach a snapshot to an existing node; a second one for it comes back unused.
    r = cache.insert(_seq(5, 6), cache.match(_seq(5, 6, tail=[0])).block_ids, {1: 200})
    assert r.unused_snapshots == [] and cache.match(_seq(5, 6, tail=[0]), require_snapshot=True).snapshot == 200
    r = cache.insert(_seq(5, 6), cache.match(_seq(5, 6, tail=[0])).block_ids, {1: 201, 5: 205})
    assert sorted(r.unused_snapshots) == [201, 205]
    assert cache.snapshots() == {100, 102, 200}
    assert cache.check_invariants()


def test_lru_eviction_order_and_in_use_never_evicted():
    pool = BlockPool(16, block_size=BS)
    cache = PrefixCache(pool)
    _, _, a = _run_request(cache, _seq(1, 2, tail=[0]), snapshots={0: 10, 1: 11})  # chain a0 -> a1
    _, _, b = _run_request(cache, _seq(3, tail=[0]), snapshots={0: 30})
    _, _, c = _run_request(cache, _seq(4, tail=[0]), snapshots={0: 40})
    # Touch a (oldest insert) so b becomes least recently used, then c, then a.
    cache.acquire(cache.match(_seq(1, 2, tail=[0])))
    cache.release(a[:2])
    assert cache.num_evictable() == 4
    free0 = pool.num_free
    assert cache.evict(1) == [30]  # b is LRU
    assert pool.num_free == free0 + 1 and pool.is_free(b[0]) and not cache.is_cached(b[0])
    assert cache.evict(1) == [40]  # then c
    assert cache.evict(1) == [11]  # then a's leaf ...
    assert cache.is_cached(a[0]) and not cache.is_cached(a[1])
    assert cache.evict(5) == [10]  # ... which made its parent a leaf; nothing else is left
    assert len(cache) == 0 and pool.num_free == pool.num_usable
    assert cache.stats.evicted_blocks == 4
    assert cache.check_invariants()

    # In-use blocks are never evicted: a request holding the chain's first block pins it, not the leaf.
    _, _, a = _run_request(cache, _seq(1, 2, 3, tail=[0]), snapshots={2: 12})
    m = cache.match(_seq(1, tail=[0]))
    held = cache.acquire(m)
    assert held == [a[0]]
    snaps = cache.evict_all()
    assert snaps == [12]
    assert cache.is_cached(a[0]) and pool.refcount(a[0]) == 2 and len(cache) == 1
    assert cache.num_evictable() == 0 and cache.evict(3) == []
    assert cache.is_cached(a[0])
    cache.release(held)
    assert pool.refcount(a[0]) == 1 and cache.num_evictable() == 1
    cache.evict_all()
    assert len(cache) == 0 and pool.num_free == pool.num_usable
    assert cache.check_invariants()


def test_eviction_prefers_old_leaf_over_recent_branch():
    pool = BlockPool(16, block_size=BS)
    cache = PrefixCache(pool)
    _, _, x = _run_request(cache, _seq(1, 2, tail=[0]))   # shared root block 1, leaf 2
    _, _, y = _run_request(cache, _seq(1, 3, tail=[0]))   # leaf 3 under the same root (more recent)
    assert y[0] == x[0]
    assert cache.evict(1) == [] and not cache.is_cached(x[1]) and cache.is_cached(y[1])
    assert cache.evict(1) == [] and not cache.is_cached(y[1]) and cache.is_cached(x[0])
    assert cache.evict(1) == [] and len(cache) == 0


def test_snapshot_handles_returned_on_eviction():
    pool = BlockPool(32, block_size=BS)
    cache = PrefixCache(pool)
    _run_request(cache, _seq(1, 2, 3, tail=[0]), snapshots={0: 1, 1: 2, 2: 3})
    _run_request(cache, _seq(1, 2, 4, tail=[0]), snapshots={2: 4})
    _run_request(cache, _seq(5, tail=[0]))
    assert cache.snapshots() == {1, 2, 3, 4}
    returned = cache.evict_all()
    assert sorted(returned) == [1, 2, 3, 4]  # each exactly once; nodes without snapshots give nothing
    assert cache.snapshots() == set() and len(cache) == 0


def test_duplicate_blocks_reported_and_released():
    pool = BlockPool(16, block_size=BS)
    cache = PrefixCache(pool)
    toks = _seq(1, 2, tail=[0])
    # Two requests compute the same prompt concurrently (neither could hit the other).
    ta = pool.allocate(3)
    tb = pool.allocate(3)
    ra = cache.insert(toks, ta, {1: 50})
    assert ra.num_inserted == 2 and ra.duplicates == []
    rb = cache.insert(toks, tb, {0: 60, 1: 61})
    assert rb.num_inserted == 0
    assert rb.duplicates == tb[:2] and rb.duplicate_indices == [0, 1]
    assert rb.cached_block_ids == ta[:2]
    assert rb.unused_snapshots == [61]  # node 1 already has snapshot 50; node 0 adopts 60
    assert cache.snapshots() == {50, 60}
    assert [pool.refcount(b) for b in tb] == [1, 1, 1]  # cache took no reference to duplicates
    assert [pool.refcount(b) for b in ta[:2]] == [2, 2]
    # Swapping a duplicate for the cached block frees it immediately.
    pool.incref([rb.cached_block_ids[0]])
    assert cache.release([tb[0]]) == [tb[0]]
    tb[0] = rb.cached_block_ids[0]
    cache.release(ta)
    assert set(cache.release(tb)) == {tb[1], tb[2]}
    assert all(pool.refcount(b) == 1 for b in ta[:2]) and pool.is_free(ta[2])
    # Re-inserting the same blocks (progressive insert) is a no-op, re-passing an owned snapshot too.
    held = cache.acquire(cache.match(toks))
    r = cache.insert(toks, held, {1: 50})
    assert r.num_inserted == 0 and r.duplicates == [] and r.unused_snapshots == []
    cache.release(held)
    assert cache.check_invariants()


def test_insert_errors_leave_cache_unchanged():
    pool = BlockPool(16, block_size=BS)
    cache = PrefixCache(pool)
    _, _, ids = _run_request(cache, _seq(1, 2, tail=[0]), snapshots={0: 7})
    state = (_pool_state(pool), cache.cached_blocks(), cache.snapshots(), cache.stats.inserted_blocks)
    blk = pool.allocate(2)
    state = (_pool_state(pool),) + state[1:]
    with pytest.raises(PrefixCacheError):  # a cached block cannot hold a second prefix
        cache.insert(_seq(8, 9), [blk[0], ids[0]])
    with pytest.raises(PrefixCacheError):  # the same block twice
        cache.insert(_seq(8, 9), [blk[0], blk[0]])
    with pytest.raises(PrefixCacheError):  # a free block (not held by the caller)
        cache.insert(_seq(8, 9), [blk[0], 15])
    with pytest.raises(PrefixCacheError):  # a snapshot the cache already owns, for another block
        cache.insert(_seq(8, 9), blk, {1: 7})
    assert (_pool_state(pool), cache.cached_blocks(), cache.snapshots(),
            cache.stats.inserted_blocks) == state
    pool.decref(blk)
    assert cache.check_invariants()


def test_stale_match_and_allocate_with_eviction():
    pool = BlockPool(6, block_size=BS)  # 5 usable
    cache = PrefixCache(pool)
    _run_request(cache, _seq(1, 2, tail=[0]), snapshots={1: 21})
    _run_request(cache, _seq(3, 4, tail=[0]), snapshots={0: 30})
    assert len(cache) == 4 and pool.num_free == 1
    m = cache.match(_seq(1, 2, tail=[0]))
    cache.evict_all()
    with pytest.raises(PrefixCacheError, match="stale"):
        cache.acquire(m)
    assert pool.num_free == 5

    _run_request(cache, _seq(1, 2, tail=[0]), snapshots={1: 21})
    _run_request(cache, _seq(3, 4, tail=[0]), snapshots={0: 30})
    held = cache.acquire(cache.match(_seq(3, 4, tail=[0])))  # pins the 3-4 chain
    # 1 free + 2 evictable (the 1-2 chain) = 3; asking 4 fails without touching anything.
    assert cache.num_evictable() == 2
    before = (_pool_state(pool), cache.cached_blocks())
    with pytest.raises(OutOfBlocks) as ei:
        cache.allocate(4)
    assert ei.value.requested == 4 and ei.value.free == 3
    assert (_pool_state(pool), cache.cached_blocks()) == before
    got, snaps = cache.allocate(3)
    assert len(got) == 3 and snaps == [21] and len(cache) == 2
    assert set(got).isdisjoint(held)
    pool.decref(got)
    cache.release(held)
    assert cache.check_invariants()


def test_stats_hit_rate():
    pool = BlockPool(16, block_size=BS)
    cache = PrefixCache(pool)
    _run_request(cache, _seq(1, 2, tail=[0, 0]))  # 10 tokens, 0 hits
    _run_request(cache, _seq(1, 2, tail=[0, 0]))  # 10 tokens, 8 hits
    assert cache.stats.queries == 20 and cache.stats.hits == 8 and cache.stats.lookups == 2
    assert cache.stats.hit_rate == pytest.approx(0.4)
    cache.match(_seq(1, 2, tail=[0]))  # a match alone is not counted
    assert cache.stats.queries == 20


def test_default_block_size_64_and_deep_chain():
    pool = BlockPool(40)
    assert pool.block_size == 64
    cache = PrefixCache(pool, block_size=64)
    with pytest.raises(ValueError):
        PrefixCache(pool, block_size=16)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 50000, 64 * 5 + 10).tolist()
    m, r, ids = _run_request(cache, toks)
    assert r.num_inserted == 5
    m = cache.match(toks[: 64 * 3 + 1])
    assert m.num_tokens == 192 and m.block_ids == tuple(ids[:3])
    assert cache.match(toks[:63] + [toks[63] + 1] + toks[64:]).num_tokens == 0

    # A chain deeper than Python's recursion limit (block size 1, 3000 blocks).
    pool = BlockPool(3100, block_size=1)
    cache = PrefixCache(pool)
    toks = list(range(3001))
    _, r, _ = _run_request(cache, toks)
    assert r.num_inserted == 3001 - 0 and len(cache) == 3001
    assert cache.match(toks + [1]).num_tokens == 3001
    assert cache.num_evictable() == 3001 and cache.check_invariants()
    cache.evict_all()
    assert len(cache) == 0 and pool.num_free == pool.num_usable


# ---------------------------------------------------------------------------------------------
# Randomized stress: requests with shared prefixes, progressive inserts, duplicates, preemption,
# cancellation and eviction, against a shadow model of references, block contents and snapshots.
# ---------------------------------------------------------------------------------------------
class _Req:
    def __init__(self, tokens, table):
        self.tokens = tokens
        self.table = table
        self.pending = {}  # block index -> snapshot handle not yet given to the cache


@pytest.mark.parametrize("seed,bs,num_blocks", [(0, 4, 48), (1, 4, 200), (2, 2, 64), (3, 64, 40)])
def test_randomized_stress(seed, bs, num_blocks):
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    pool = BlockPool(num_blocks, block_size=bs)
    cache = PrefixCache(pool)
    vocab = 3  # tiny vocabulary: random suffixes collide too, so the tree branches at many depths
    prefixes = [rng.integers(0, vocab, int(rng.integers(1, 4)) * bs + int(rng.integers(0, bs))).tolist()
                for _ in range(5)]
    content: dict[int, tuple] = {}  # block -> the token prefix whose KV it holds (up to its end)
    cache_snaps: set[int] = set()   # handles the cache owns (shadow)
    freed_snaps: set[int] = set()
    next_snap = [0]
    reqs: dict[int, _Req] = {}
    counters = Counter()

    def free_snaps(hs):
        hs = set(hs)
        assert hs.isdisjoint(freed_snaps), "a snapshot handle came back twice"
        freed_snaps.update(hs)

    def new_snap():
        next_snap[0] += 1
        return next_snap[0]

    def take_evicted(handles):
        hs = set(handles)
        assert len(hs) == len(handles) and hs <= cache_snaps
        cache_snaps.difference_update(hs)
        free_snaps(hs)
        counters["evicted_snaps"] += len(hs)

    def alloc(n):
        cached_before = cache.cached_blocks()
        got, ev = cache.allocate(n)
        take_evicted(ev)
        for b in cached_before - cache.cached_blocks():  # evicted blocks were free, not in use
            assert b in got or pool.is_free(b)
            content.pop(b, None)
        for b in got:
            assert pool.refcount(b) == 1 and not cache.is_cached(b)
            content[b] = ()
        return got

    def write(req, start, end):
        """'Compute' tokens [start, end): the blocks written are exclusively the request's."""
        t = req.table
        for i in range(start // bs, (end - 1) // bs + 1 if end > start else 0):
            b = t.block_ids[i]
            assert pool.refcount(b) == 1 and not cache.is_cached(b), "writing into a shared block"
            content[b] = tuple(req.tokens[: min(end, (i + 1) * bs)])
            if min(end, (i + 1) * bs) == (i + 1) * bs and rng.random() < 0.6:
                req.pending[i] = new_snap()
        t.num_tokens = end

    def drop(rid):
        req = reqs.pop(rid)
        free_snaps(req.pending.values())
        for b in cache.release(req.table.clear()):
            content.pop(b, None)

    def insert(req):
        r = cache.insert(req.tokens[: req.table.num_tokens], req.table.block_ids, req.pending)
        for i, b in enumerate(r.cached_block_ids):
            assert content[b] == tuple(req.tokens[: (i + 1) * bs])
        unused = set(r.unused_snapshots)
        assert unused <= set(req.pending.values())
        cache_snaps.update(set(req.pending.values()) - unused)
        free_snaps(unused)
        req.pending = {}
        counters["dups"] += len(r.duplicates)
        for i, d in zip(r.duplicate_indices, r.duplicates):
            assert req.table.block_ids[i] == d and content[d] == content[r.cached_block_ids[i]]
            if rng.random() < 0.5:  # swap to the cached copy, freeing ours
                pool.incref([r.cached_block_ids[i]])
                req.table.block_ids[i] = r.cached_block_ids[i]
                assert cache.release([d]) == [d]
                content.pop(d)

    def check():
        assert cache.check_invariants()
        expected = Counter()
        for req in reqs.values():
            expected.update(req.table.block_ids)
        expected.update(cache.cached_blocks())
        for b in range(pool.reserved, pool.num_blocks):
            assert pool.refcount(b) == expected[b], f"block {b}"
        assert cache.snapshots() == cache_snaps
        assert cache_snaps.isdisjoint(freed_snaps)

    for step in range(2000):
        op = rng.random()
        if op < 0.30 or not reqs:  # admit a new request
            k = int(rng.integers(len(prefixes)))
            prompt = prefixes[k] + rng.integers(0, vocab, int(rng.integers(1, 3 * bs))).tolist()
            hybrid = bool(rng.random() < 0.5)
            m = cache.match(prompt, require_snapshot=hybrid)
            assert m.num_tokens % bs == 0 and m.num_tokens < len(prompt)
            assert m.num_tokens == m.num_blocks * bs
            if hybrid and m:
                assert m.snapshot is not None and m.snapshot in cache_snaps
            for i, b in enumerate(m.block_ids):
                assert content[b] == tuple(prompt[: (i + 1) * bs]), "cache returned a block of other tokens"
            table = BlockTable(bs, cache.acquire(m), m.num_tokens)
            counters["hit_blocks"] += m.num_blocks
            req = _Req(prompt, table)
            try:
                table.append_blocks(alloc(table.blocks_needed(len(prompt))))
            except OutOfBlocks:
                counters["oob"] += 1
                cache.release(table.clear())
                continue
            rid = step
            reqs[rid] = req
            write(req, m.num_tokens, len(prompt))
        elif op < 0.60:  # decode a few tokens
            rid = list(reqs)[int(rng.integers(len(reqs)))]
            req = reqs[rid]
            n = int(rng.integers(1, bs + 1))
            start = len(req.tokens)
            try:
                req.table.append_blocks(alloc(req.table.blocks_needed(start + n)))
            except OutOfBlocks:
                counters["preempted"] += 1
                drop(rid)
                continue
            req.tokens += rng.integers(0, vocab, n).tolist()
            write(req, start, start + n)
        elif op < 0.70:  # progressive insert
            insert(reqs[list(reqs)[int(rng.integers(len(reqs)))]])
            counters["progressive"] += 1
        elif op < 0.85:  # finish: insert, then release
            rid = list(reqs)[int(rng.integers(len(reqs)))]
            insert(reqs[rid])
            drop(rid)
            counters["finished"] += 1
        elif op < 0.95:  # cancel
            drop(list(reqs)[int(rng.integers(len(reqs)))])
            counters["cancelled"] += 1
        else:  # explicit eviction
            cached_before = cache.cached_blocks()
            take_evicted(cache.evict(int(rng.integers(1, 8))))
            for b in cached_before - cache.cached_blocks():
                assert pool.is_free(b), "evicted a block that is still in use"
                content.pop(b)
        check()

    # Coverage of the interesting paths (the test would be vacuous without them).
    assert counters["hit_blocks"] > 50 and cache.stats.hits > 0
    assert cache.stats.evicted_blocks > 10 and counters["evicted_snaps"] > 0
    assert counters["finished"] > 100 and counters["cancelled"] > 50
    if bs < 64:
        assert counters["dups"] > 0

    for rid in list(reqs):
        drop(rid)
    check()
    take_evicted(cache.evict_all())
    check()
    assert len(cache) == 0 and cache_snaps == set()
    assert pool.num_free == pool.num_usable and pool.num_used == 0
    assert all(pool.refcount(b) == 0 for b in range(pool.num_blocks))
    assert freed_snaps == set(range(1, next_snap[0] + 1))  # every snapshot handle came back exactly once
    assert time.perf_counter() - t0 < 15
