"""Prefix cache: a radix tree of full KV blocks, keyed by their token ids (vLLM / SGLang style).

Each node is one full block of `block_size` tokens. Its key is the tuple of those token ids, its parent
is the node of the previous block, so the path from the root spells a prefix of a sequence; the node
holds the physical block id whose KV (MLA latents, DSA indexer keys) was computed for exactly that
prefix, the last-access tick (a counter, not wall time) and an opaque `snapshot` handle: for hybrid
models, the engine's id of a KDA state snapshot taken at the end of the block.

Reference counting (see `block_pool`): the cache owns one reference to every block it holds, and a
request owns one reference per block of its table. So `pool.refcount(node.block_id) - 1` is the number
of requests using the node, and a node can be evicted only when that is 0 (refcount exactly 1).

Typical engine flow for one request:

    m = cache.match(prompt, require_snapshot=is_hybrid)       # never the whole prompt
    table = BlockTable(bs, cache.acquire(m), m.num_tokens)    # request now holds refs to the hits
    new, evicted_snaps = cache.allocate(table.blocks_needed(len(prompt)))   # evicts LRU if needed
    ... restore KDA state from m.snapshot, prefill prompt[m.num_tokens:], decode ...
    r = cache.insert(tokens_with_kv, table.block_ids, {i: snap})   # cache takes its own refs
    engine frees r.unused_snapshots; cache.release(table.clear())   # the request's refs

Snapshot ownership: every handle passed to `insert` is either adopted (stored in a node; from then on
the cache reports it back exactly once, from `evict`) or returned in `InsertResult.unused_snapshots`
for the engine to free. A handle already stored in the same node may be passed again (progressive
inserts) and is then neither.

Eviction scans the current leaves (kept in a set, so this is O(#leaves), not O(#nodes)), heapifies the
evictable ones by (last access, creation order) and pops; evicting a leaf whose parent becomes an
evictable leaf pushes the parent. Every touch (acquire, insert) stamps the whole path with one tick,
so a parent is never older than its children and leaf-only LRU evicts in true LRU order. This is
O(L + k log L) per call for L leaves and k evictions: fine for the thousands-to-tens-of-thousands of
blocks of one device; all traversals are iterative (a 128k-token prompt is a 2000-deep chain).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from dayzero.model.errors import DayzeroError

from .block_pool import BlockPool, OutOfBlocks

__all__ = ["PrefixCacheError", "Node", "Match", "InsertResult", "CacheStats", "PrefixCache"]


class PrefixCacheError(DayzeroError, ValueError):
    """Misuse of the prefix cache (a stale match, a block or snapshot cached twice); state is unchanged."""


class Node:
    """One cached full block. `key` is its tokens, `parent`/`children` the tree, `block_id` the physical
    block, `snapshot` the KDA snapshot handle at the end of the block (or None), `last_access` the tick
    of the last acquire/insert that touched it, `depth` the number of blocks from the root to it, itself
    included (block index + 1); `num_users` the requests holding its block."""

    __slots__ = ("key", "parent", "children", "block_id", "snapshot", "last_access", "depth", "seq",
                 "attached", "_pool")

    def __init__(self, key, parent, block_id, snapshot, last_access, depth, seq, pool):
        self.key: tuple[int, ...] | None = key
        self.parent: Node | None = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.block_id: int = block_id
        self.snapshot: int | None = snapshot
        self.last_access: int = last_access
        self.depth: int = depth
        self.seq: int = seq
        self.attached: bool = True
        self._pool: BlockPool | None = pool

    @property
    def num_users(self) -> int:
        """Requests currently holding this block (its pool refcount minus the cache's own reference)."""
        if self._pool is None or not self.attached:
            return 0
        return self._pool.refcount(self.block_id) - 1

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (f"Node(block={self.block_id}, depth={self.depth}, snapshot={self.snapshot}, "
                f"last_access={self.last_access}, children={len(self.children)})")


@dataclass(frozen=True)
class Match:
    """Result of `PrefixCache.match`: the longest usable chain of cached full blocks.

    `block_ids[i]` holds tokens `[i*bs, (i+1)*bs)`; `num_tokens == len(block_ids) * bs`; `snapshot` is
    the snapshot handle of the last matched block (None when nothing matched or it has none);
    `num_query_tokens` is the length of the queried sequence (for hit-rate stats).
    """

    block_ids: tuple[int, ...]
    num_tokens: int
    snapshot: int | None
    nodes: tuple[Node, ...]
    num_query_tokens: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def __bool__(self) -> bool:
        return bool(self.block_ids)


@dataclass(frozen=True)
class InsertResult:
    """Result of `PrefixCache.insert`.

    - `num_inserted`: blocks newly cached (the cache took one reference to each).
    - `cached_block_ids`: for each full block `i` considered, the block id the cache now holds for
      tokens `[i*bs, (i+1)*bs)` (the caller's own id, or the existing node's).
    - `duplicates`: the caller's block ids whose tokens were already cached under a *different* physical
      block. The cache took no reference to them; they stay owned by the request only and go back to
      the pool when the request releases them. (To free them early, the engine may swap
      `cached_block_ids[i]` into its table: `pool.incref([cached])`, then `release([dup])`.)
    - `duplicate_indices`: the block indices `i` of those duplicates.
    - `unused_snapshots`: snapshot handles passed in that the cache did not adopt (their block was not
      inserted, or the node already has a different snapshot); the engine frees them.
    """

    num_inserted: int
    cached_block_ids: list[int]
    duplicates: list[int]
    duplicate_indices: list[int]
    unused_snapshots: list[int]


@dataclass
class CacheStats:
    """Counters in tokens (queries, hits) and blocks. Queries and hits are counted by `acquire`, i.e. per
    admitted request, so a `match` that the scheduler throws away (and retries later) counts once."""

    queries: int = 0          # tokens of acquired sequences
    hits: int = 0             # of which served from the cache
    lookups: int = 0          # acquire calls
    inserted_blocks: int = 0
    duplicate_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.queries = self.hits = self.lookups = 0
        self.inserted_blocks = self.duplicate_blocks = self.evicted_blocks = 0


def _as_token_list(token_ids: Sequence[int]) -> list[int]:
    if isinstance(token_ids, np.ndarray):
        return token_ids.reshape(-1).tolist()
    return [int(t) for t in token_ids]


class PrefixCache:
    """Radix tree of full blocks over a `BlockPool`. `block_size` defaults to (and must equal) the pool's."""

    def __init__(self, pool: BlockPool, block_size: int | None = None):
        if block_size is not None and int(block_size) != pool.block_size:
            raise ValueError(f"block_size={block_size} differs from the pool's block_size={pool.block_size}")
        self.pool = pool
        self.block_size = pool.block_size
        self._seq = 0
        self._clock = 0
        self.root = Node(None, None, -1, None, 0, 0, self._next_seq(), None)
        self._by_block: dict[int, Node] = {}
        self._by_snapshot: dict[int, Node] = {}
        self._leaves: set[Node] = set()
        self.stats = CacheStats()

    # -- small helpers ------------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def __len__(self) -> int:
        """Number of cached blocks (nodes)."""
        return len(self._by_block)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_block)

    def is_cached(self, block: int) -> bool:
        return int(block) in self._by_block

    def cached_blocks(self) -> set[int]:
        return set(self._by_block)

    def snapshots(self) -> set[int]:
        """Snapshot handles the cache currently owns."""
        return set(self._by_snapshot)

    # -- lookup -------------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], *, max_match_tokens: int | None = None,
              require_snapshot: bool = False) -> Match:
        """Longest chain of cached full blocks that is a prefix of `token_ids`.

        At most `min(len(token_ids) - 1, max_match_tokens)` tokens are matched (rounded down to full
        blocks): the whole sequence is never matched, so at least one token is left to compute the
        logits from. With `require_snapshot`, the match is cut back to the deepest matched node that
        has a snapshot (a hybrid model must restore the KDA state exactly there); no such node means
        an empty match. Does not change the tree, LRU order or stats (`acquire` does).
        """
        toks = _as_token_list(token_ids)
        limit = len(toks) - 1
        if max_match_tokens is not None:
            limit = min(limit, int(max_match_tokens))
        nblocks = max(0, limit) // self.block_size
        bs = self.block_size
        nodes: list[Node] = []
        node = self.root
        for i in range(nblocks):
            child = node.children.get(tuple(toks[i * bs:(i + 1) * bs]))
            if child is None:
                break
            nodes.append(child)
            node = child
        if require_snapshot:
            while nodes and nodes[-1].snapshot is None:
                nodes.pop()
        return Match(block_ids=tuple(n.block_id for n in nodes), num_tokens=len(nodes) * bs,
                     snapshot=nodes[-1].snapshot if nodes else None, nodes=tuple(nodes),
                     num_query_tokens=len(toks))

    def acquire(self, match: Match) -> list[int]:
        """Take one reference (for the request) to each matched block and mark the path as used now.

        Returns the matched block ids as a new list (the start of the request's block table). Raises
        `PrefixCacheError` if a matched node was evicted since `match` (match again then).
        """
        for n in match.nodes:
            if not n.attached:
                raise PrefixCacheError(f"stale match: block {n.block_id} at depth {n.depth} was evicted")
        self.pool.incref(match.block_ids)
        tick = self._tick()
        for n in match.nodes:
            n.last_access = tick
        self.stats.lookups += 1
        self.stats.queries += match.num_query_tokens
        self.stats.hits += match.num_tokens
        return list(match.block_ids)

    def release(self, block_ids: Sequence[int]) -> list[int]:
        """Drop the request's reference to each block (`pool.decref`); returns the blocks that became free.
        Cached blocks never become free here (the cache keeps its reference) — they become evictable."""
        return self.pool.decref(block_ids)

    # -- insertion ----------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int],
               snapshots: Mapping[int, int] | None = None) -> InsertResult:
        """Cache the full blocks of a request: block `i` (`block_ids[i]`) covers tokens `[i*bs, i*bs+bs)`.

        `token_ids` are the tokens whose KV is already in the blocks; only the first
        `min(len(token_ids) // bs, len(block_ids))` blocks are considered (a partial last block is
        never cached). Existing nodes are shared; new ones take one cache reference to the caller's
        block (which the caller must hold). `snapshots` maps block index `i` to the handle of the KDA
        state snapshot at the end of block `i`. Every node on the path is marked as used now.
        See `InsertResult` for duplicates and snapshot ownership. Validates everything before changing
        anything: on `PrefixCacheError` / `BlockPoolError` the cache and the pool are unchanged.
        """
        toks = _as_token_list(token_ids)
        ids = [int(b) for b in block_ids]
        bs = self.block_size
        nfull = min(len(toks) // bs, len(ids))
        snaps = {int(k): int(v) for k, v in (snapshots or {}).items()}
        keys = [tuple(toks[i * bs:(i + 1) * bs]) for i in range(nfull)]

        # Validation pass (no mutation).
        node: Node | None = self.root
        new_ids: set[int] = set()
        path: list[Node | None] = []
        for i in range(nfull):
            b = ids[i]
            child = node.children.get(keys[i]) if node is not None else None
            path.append(child)
            if child is not None:
                if child.block_id != b and b in self._by_block:
                    raise PrefixCacheError(
                        f"block {b} (index {i}) is already cached for other tokens (depth "
                        f"{self._by_block[b].depth}); a block can hold only one prefix")
                node = child
                continue
            node = None
            if b in self._by_block:
                raise PrefixCacheError(f"block {b} (index {i}) is already cached for other tokens")
            if b in new_ids:
                raise PrefixCacheError(f"block {b} appears twice in block_ids")
            if b < self.pool.reserved or self.pool.refcount(b) < 1:
                raise PrefixCacheError(f"block {b} (index {i}) is not held by the caller (free or reserved)")
            new_ids.add(b)
        for i, h in snaps.items():
            owner = self._by_snapshot.get(h)
            if owner is not None and not (0 <= i < nfull and path[i] is owner):
                raise PrefixCacheError(f"snapshot {h} (index {i}) is already owned by the cache for another block")
        if len(set(snaps.values())) != len(snaps):
            raise PrefixCacheError("the same snapshot handle is given for two blocks")

        # Mutation pass.
        tick = self._tick()
        node = self.root
        inserted = 0
        cached_ids: list[int] = []
        dups: list[int] = []
        dup_idx: list[int] = []
        unused: list[int] = [h for i, h in snaps.items() if not (0 <= i < nfull)]
        for i in range(nfull):
            b = ids[i]
            child = node.children.get(keys[i])
            if child is None:
                self.pool.incref([b])
                child = Node(keys[i], node, b, None, tick, node.depth + 1, self._next_seq(), self.pool)
                node.children[keys[i]] = child
                self._by_block[b] = child
                self._leaves.discard(node)
                self._leaves.add(child)
                inserted += 1
            elif child.block_id != b:
                dups.append(b)
                dup_idx.append(i)
            h = snaps.get(i)
            if h is not None:
                if child.snapshot is None:
                    child.snapshot = h
                    self._by_snapshot[h] = child
                elif child.snapshot != h:
                    unused.append(h)
            child.last_access = tick
            cached_ids.append(child.block_id)
            node = child
        self.stats.inserted_blocks += inserted
        self.stats.duplicate_blocks += len(dups)
        return InsertResult(num_inserted=inserted, cached_block_ids=cached_ids, duplicates=dups,
                            duplicate_indices=dup_idx, unused_snapshots=unused)

    # -- eviction -----------------------------------------------------------------------------
    def _evictable_leaf(self, node: Node) -> bool:
        return not node.children and self.pool.refcount(node.block_id) == 1

    def evict(self, num_blocks_needed: int) -> list[int]:
        """Evict up to `num_blocks_needed` blocks, least recently used leaves first, freeing them to the pool.

        Only leaves whose block refcount is exactly 1 (held by the cache alone) are evicted; evicting a
        leaf can make its parent an evictable leaf. Returns the snapshot handles of the evicted nodes
        (ownership passes to the caller, who frees them). Fewer blocks are evicted when fewer are
        evictable; compare `pool.num_free` or `stats.evicted_blocks` to see how many.
        """
        n = int(num_blocks_needed)
        if n <= 0:
            return []
        heap = [(x.last_access, x.seq, x) for x in self._leaves if self._evictable_leaf(x)]
        heapq.heapify(heap)
        snaps: list[int] = []
        evicted = 0
        while heap and evicted < n:
            _, _, x = heapq.heappop(heap)
            parent = x.parent
            self._remove_leaf(x)
            evicted += 1
            if x.snapshot is not None:
                snaps.append(x.snapshot)
            if parent is not self.root and self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.seq, parent))
        self.stats.evicted_blocks += evicted
        return snaps

    def evict_all(self) -> list[int]:
        """Evict every evictable block; returns their snapshot handles."""
        return self.evict(len(self._by_block))

    def _remove_leaf(self, x: Node) -> None:
        parent = x.parent
        del parent.children[x.key]
        del self._by_block[x.block_id]
        if x.snapshot is not None:
            del self._by_snapshot[x.snapshot]
        self._leaves.discard(x)
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)
        x.attached = False
        x.parent = None
        self.pool.decref([x.block_id])

    def num_evictable(self) -> int:
        """Blocks that `evict` could free now: nodes held only by the cache whose descendants all are too."""
        order: list[Node] = []
        stack = list(self.root.children.values())
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        ok: dict[Node, bool] = {}
        count = 0
        for x in reversed(order):  # children before parents
            e = self.pool.refcount(x.block_id) == 1 and all(ok[c] for c in x.children.values())
            ok[x] = e
            count += e
        return count

    def allocate(self, n: int) -> tuple[list[int], list[int]]:
        """Allocate `n` blocks from the pool, evicting LRU cached blocks first if too few are free.

        Returns `(block_ids, evicted_snapshot_handles)`. Raises `OutOfBlocks` (its `free` counting free
        plus evictable blocks) without evicting or allocating anything when even eviction cannot help.
        """
        n = int(n)
        free = self.pool.num_free
        snaps: list[int] = []
        if n > free:
            evictable = self.num_evictable()
            if n > free + evictable:
                raise OutOfBlocks(n, free + evictable)
            snaps = self.evict(n - free)
        return self.pool.allocate(n), snaps

    # -- checks -------------------------------------------------------------------------------
    def iter_nodes(self):
        """All nodes, parents before children (iterative DFS)."""
        stack = list(self.root.children.values())
        while stack:
            x = stack.pop()
            yield x
            stack.extend(x.children.values())

    def check_invariants(self) -> bool:
        """Check the pool's invariants and the tree's; raise AssertionError on the first violation."""
        self.pool.check_invariants()
        count = 0
        seen_snaps = 0
        for x in self.iter_nodes():
            count += 1
            p = x.parent
            if not x.attached or p is None or p.children.get(x.key) is not x:
                raise AssertionError(f"{x} is not linked to its parent")
            if len(x.key) != self.block_size:
                raise AssertionError(f"{x} key has {len(x.key)} tokens, not {self.block_size}")
            if x.depth != p.depth + 1:
                raise AssertionError(f"{x} depth inconsistent with parent")
            if self._by_block.get(x.block_id) is not x:
                raise AssertionError(f"block index does not point at {x}")
            if x.block_id < self.pool.reserved or self.pool.refcount(x.block_id) < 1:
                raise AssertionError(f"{x} holds a reserved or free block")
            if (x in self._leaves) != (not x.children):
                raise AssertionError(f"{x} leaf set membership wrong")
            if p is not self.root and p.last_access < x.last_access:
                raise AssertionError(f"{x} was touched after its parent")
            if x.snapshot is not None:
                seen_snaps += 1
                if self._by_snapshot.get(x.snapshot) is not x:
                    raise AssertionError(f"snapshot index does not point at {x}")
        if count != len(self._by_block):
            raise AssertionError(f"{count} nodes reachable but {len(self._by_block)} indexed")
        if seen_snaps != len(self._by_snapshot):
            raise AssertionError("snapshot index has entries for unreachable nodes")
        if len(self._leaves) > count or self.root in self._leaves:
            raise AssertionError("leaf set has stale entries")
        return True

    def __repr__(self) -> str:
        return (f"PrefixCache(block_size={self.block_size}, cached={len(self)}, "
                f"hit_rate={self.stats.hit_rate:.3f})")
