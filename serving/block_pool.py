"""Host-side bookkeeping for the paged caches: physical KV blocks, KDA state slots, per-request block tables.

Pure Python + numpy; the device arrays these ids index live in the engine. See DESIGN.md, "Caches".

- `BlockPool`: reference-counted physical blocks of `block_size` tokens (MLA latents + DSA indexer keys).
  Ids `0..reserved-1` (block 0 by default) are never handed out: the engine uses block 0 as the
  scratch/null block that padding rows of a block table point at.
- `SlotPool`: KDA state slots (conv + recurrent state), one per running request; slot 0 is scratch.
- `BlockTable`: one request's list of block ids and the number of tokens stored in them.
- `blocks_for_budget`: how many blocks fit in a memory budget.

Ownership rule: every holder of a block id owns exactly one reference to it. A request owns one
reference per entry of its block table (from `allocate` or, for cache hits, `PrefixCache.acquire`);
the prefix cache owns one more reference for each block it caches, so a cached block outlives the
request that wrote it and goes back to the free list only when the cache evicts it.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import numpy as np

from dayzero.model.errors import DayzeroError

__all__ = [
    "BlockPoolError",
    "OutOfBlocks",
    "OutOfSlots",
    "BlockPool",
    "SlotPool",
    "BlockTable",
    "blocks_for_budget",
    "cdiv",
]


class BlockPoolError(DayzeroError, ValueError):
    """Misuse of a pool: an id out of range or reserved, a double free, a reference count going below zero.

    These are engine bugs, not capacity problems; the pool's state is unchanged when one is raised.
    """


class OutOfBlocks(DayzeroError):
    """Not enough free blocks. `requested` blocks were asked for, `free` were available; nothing was allocated."""

    def __init__(self, requested: int, free: int):
        self.requested = requested
        self.free = free
        super().__init__(f"out of KV cache blocks: requested {requested}, {free} free")


class OutOfSlots(DayzeroError):
    """No free KDA state slot; `num_slots` is the pool's size (including reserved slots)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        super().__init__(f"out of KDA state slots: all {num_slots} slots in use (reserved included)")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def blocks_for_budget(bytes_budget: int, bytes_per_block: int) -> int:
    """Number of blocks that fit in `bytes_budget` bytes, at least 2 (the scratch block plus one usable)."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    return max(2, int(bytes_budget) // int(bytes_per_block))


class BlockPool:
    """Reference-counted physical KV-cache blocks with ids `0..num_blocks-1`.

    The first `reserved` ids are never allocated (their refcount stays 0 and they are not on the free
    list). `allocate(n)` hands out `n` blocks with refcount 1; `incref`/`decref` add and drop
    references; a block returns to the free list when its count reaches 0. Freed blocks are reused
    LIFO; a fresh pool hands out the lowest ids first.

    Every mutating method validates its whole argument before changing anything, so a raised error
    (`OutOfBlocks`, `BlockPoolError`) leaves the pool unchanged.
    """

    def __init__(self, num_blocks: int, block_size: int = 64, reserved: int = 1):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if reserved < 0 or num_blocks <= reserved:
            raise ValueError(f"need num_blocks > reserved >= 0, got num_blocks={num_blocks}, reserved={reserved}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.reserved = int(reserved)
        self._ref = [0] * self.num_blocks
        # Stack: pop() from the end; reversed so that a fresh pool hands out low ids first.
        self._free = list(range(self.num_blocks - 1, self.reserved - 1, -1))

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        """Blocks that can ever be allocated (`num_blocks - reserved`)."""
        return self.num_blocks - self.reserved

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Allocated blocks (refcount > 0); reserved blocks are counted in neither `num_free` nor `num_used`."""
        return self.num_usable - len(self._free)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._ref[block]

    def is_free(self, block: int) -> bool:
        self._check_id(block)
        return block >= self.reserved and self._ref[block] == 0

    # -- mutation ------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (refcount 1 each). Raises `OutOfBlocks` and allocates nothing if fewer are free."""
        n = int(n)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        if n == 0:
            return []
        ids = self._free[-n:][::-1]
        del self._free[-n:]
        for b in ids:
            self._ref[b] = 1
        return ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference per occurrence in `block_ids`; every block must already be allocated."""
        counts = Counter(int(b) for b in block_ids)
        for b in counts:
            self._check_usable(b)
            if self._ref[b] == 0:
                raise BlockPoolError(f"incref of free block {b}")
        for b, c in counts.items():
            self._ref[b] += c

    def decref(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference per occurrence in `block_ids`; returns the blocks that became free (in order)."""
        ids = [int(b) for b in block_ids]
        counts = Counter(ids)
        for b, c in counts.items():
            self._check_usable(b)
            if self._ref[b] < c:
                raise BlockPoolError(
                    f"decref of block {b} by {c} but its refcount is {self._ref[b]} (double free?)")
        freed = []
        for b in ids:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                freed.append(b)
        self._free.extend(reversed(freed))  # the first freed is reused first
        return freed

    def free(self, block_ids: Iterable[int]) -> list[int]:
        """Alias of `decref` (drop the caller's reference)."""
        return self.decref(block_ids)

    # -- checks --------------------------------------------------------------------------------
    def check_invariants(self) -> bool:
        """Raise AssertionError describing the first broken invariant; return True when all hold.

        Free list has no duplicates and no reserved ids; free blocks have refcount 0; every usable
        block is either free or has refcount > 0; reserved blocks have refcount 0; counts add up.
        """
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            dup = [b for b, c in Counter(self._free).items() if c > 1]
            raise AssertionError(f"free list has duplicates: {dup[:10]}")
        for b in range(self.reserved):
            if b in free_set:
                raise AssertionError(f"reserved block {b} is on the free list")
            if self._ref[b] != 0:
                raise AssertionError(f"reserved block {b} has refcount {self._ref[b]}")
        for b in range(self.reserved, self.num_blocks):
            r = self._ref[b]
            if r < 0:
                raise AssertionError(f"block {b} has negative refcount {r}")
            if (b in free_set) != (r == 0):
                raise AssertionError(f"block {b}: refcount {r} but on free list: {b in free_set}")
        if self.num_free + self.num_used != self.num_usable:
            raise AssertionError("num_free + num_used != num_usable")
        return True

    # -- helpers -------------------------------------------------------------------------------
    def _check_id(self, b: int) -> None:
        if not (0 <= b < self.num_blocks):
            raise BlockPoolError(f"block id {b} out of range [0, {self.num_blocks})")

    def _check_usable(self, b: int) -> None:
        self._check_id(b)
        if b < self.reserved:
            raise BlockPoolError(f"block {b} is reserved (scratch) and is never allocated or freed")

    def __repr__(self) -> str:
        return (f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"reserved={self.reserved}, free={self.num_free}, used={self.num_used})")


class SlotPool:
    """KDA state slots `0..num_slots-1`, one per running request; the first `reserved` (slot 0) are scratch.

    `allocate()` takes a slot (LIFO reuse; a fresh pool hands out 1, 2, ...) and raises `OutOfSlots`
    when none is free; `free(slot)` returns it, raising `BlockPoolError` on a double free or a reserved/out-of-range slot.
    """

    def __init__(self, num_slots: int, reserved: int = 1):
        if reserved < 0 or num_slots <= reserved:
            raise ValueError(f"need num_slots > reserved >= 0, got num_slots={num_slots}, reserved={reserved}")
        self.num_slots = int(num_slots)
        self.reserved = int(reserved)
        self._free = list(range(self.num_slots - 1, self.reserved - 1, -1))
        self._in_use = [False] * self.num_slots

    @property
    def num_usable(self) -> int:
        return self.num_slots - self.reserved

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    def is_allocated(self, slot: int) -> bool:
        self._check(slot)
        return self._in_use[slot]

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlots(self.num_slots)
        s = self._free.pop()
        self._in_use[s] = True
        return s

    def free(self, slot: int) -> None:
        slot = int(slot)
        self._check(slot)
        if slot < self.reserved:
            raise BlockPoolError(f"slot {slot} is reserved (scratch) and is never freed")
        if not self._in_use[slot]:
            raise BlockPoolError(f"double free of KDA state slot {slot}")
        self._in_use[slot] = False
        self._free.append(slot)

    def check_invariants(self) -> bool:
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError("slot free list has duplicates")
        for s in range(self.num_slots):
            if s < self.reserved:
                if s in free_set or self._in_use[s]:
                    raise AssertionError(f"reserved slot {s} is free or in use")
            elif (s in free_set) == self._in_use[s]:
                raise AssertionError(f"slot {s}: in_use={self._in_use[s]}, on free list={s in free_set}")
        return True

    def _check(self, slot: int) -> None:
        if not (0 <= slot < self.num_slots):
            raise BlockPoolError(f"slot {slot} out of range [0, {self.num_slots})")

    def __repr__(self) -> str:
        return f"SlotPool(num_slots={self.num_slots}, reserved={self.reserved}, free={self.num_free})"


class BlockTable:
    """One request's blocks: `block_ids[i]` holds tokens `[i*block_size, (i+1)*block_size)`.

    `num_tokens` is how many tokens have been written (always <= `capacity`). The table only
    records ids; the references they stand for are owned by the request and dropped by the engine
    (`BlockPool.decref` / `PrefixCache.release`) when the request ends.
    """

    def __init__(self, block_size: int = 64, block_ids: Iterable[int] = (), num_tokens: int = 0):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = int(block_size)
        self.block_ids: list[int] = [int(b) for b in block_ids]
        self._num_tokens = 0
        self.num_tokens = num_tokens

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @num_tokens.setter
    def num_tokens(self, n: int) -> None:
        n = int(n)
        if n < 0 or n > self.capacity:
            raise ValueError(f"num_tokens={n} outside [0, capacity={self.capacity}]")
        self._num_tokens = n

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def capacity(self) -> int:
        """Tokens the table's blocks can hold."""
        return len(self.block_ids) * self.block_size

    @property
    def num_full_blocks(self) -> int:
        return self._num_tokens // self.block_size

    def blocks_needed(self, num_tokens_total: int) -> int:
        """Additional blocks to append so the table holds `num_tokens_total` tokens in all:
        `max(0, ceil(num_tokens_total / block_size) - num_blocks)` (for an empty table, the plain ceil)."""
        return max(0, cdiv(int(num_tokens_total), self.block_size) - len(self.block_ids))

    def append_blocks(self, ids: Iterable[int]) -> None:
        self.block_ids.extend(int(b) for b in ids)

    def add_tokens(self, n: int) -> None:
        """Record `n` more written tokens (must fit in the blocks already appended)."""
        self.num_tokens = self._num_tokens + int(n)

    def clear(self) -> list[int]:
        """Empty the table and return its block ids (for the caller to release)."""
        ids, self.block_ids, self._num_tokens = self.block_ids, [], 0
        return ids

    def as_array(self, max_blocks: int) -> np.ndarray:
        """int32 `[max_blocks]`: the block ids, then 0 (the scratch block) as padding."""
        if len(self.block_ids) > max_blocks:
            raise ValueError(f"block table has {len(self.block_ids)} blocks, more than max_blocks={max_blocks}")
        out = np.zeros((max_blocks,), dtype=np.int32)
        out[: len(self.block_ids)] = self.block_ids
        return out

    def __len__(self) -> int:
        return len(self.block_ids)

    def __repr__(self) -> str:
        return f"BlockTable(block_size={self.block_size}, num_tokens={self._num_tokens}, block_ids={self.block_ids})"
