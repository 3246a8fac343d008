"""Exact top-k over long score rows without a sort over a whole row of a long context: in two levels (`two_level`),
or by the k-th score's digits (`radix_select`, no sort at all).

Rows are cut into sub-blocks of `b` scores. Level 1 keeps the k sub-blocks with the highest maxima; level 2 takes the
top k of their k * b scores. This is exact: a top-k score s lies in a sub-block whose maximum is >= s >= the k-th
largest score >= the k-th largest sub-block maximum, so its sub-block survives level 1. Ties break towards the lower
key index at both levels (`lax.top_k` is stable and the surviving sub-blocks are re-sorted by index), which is
`lax.top_k`'s own order on the whole row: results equal the one-level top-k exactly, ties included.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def one_level(scores: jax.Array, k: int) -> jax.Array:
    """scores [R, S] float32 (-inf = not allowed) -> key indices [R, k] int32 of the k best, -1 where fewer exist."""
    if scores.shape[-1] < k:
        scores = jnp.pad(scores, ((0, 0), (0, k - scores.shape[-1])), constant_values=-jnp.inf)
    values, idx = jax.lax.top_k(scores, k)
    return jnp.where(values == -jnp.inf, -1, idx).astype(jnp.int32)


def sub_block_size(num_keys: int, k: int) -> int:
    """Power of two near sqrt(S / k) in [2, 64], balancing level 1 (S / b maxima) against level 2 (k * b scores)."""
    return int(min(64, max(2, 2 ** round(math.log2(math.sqrt(num_keys / k))))))


def two_level(scores: jax.Array, k: int, direct_below: int = 4) -> jax.Array:
    """`one_level`'s result for scores [R, S]; rows of at most `direct_below` * k keys take one level."""
    rows, num_keys = scores.shape
    if num_keys <= direct_below * k:
        return one_level(scores, k)
    b = sub_block_size(num_keys, k)
    padded = -(-num_keys // b) * b
    scores = jnp.pad(scores, ((0, 0), (0, padded - num_keys)), constant_values=-jnp.inf).reshape(rows, -1, b)
    _, blocks = jax.lax.top_k(jnp.max(scores, axis=-1), k)  # [R, k]
    blocks = jnp.sort(blocks, axis=-1)
    candidates = jnp.take_along_axis(scores, blocks[..., None], axis=1).reshape(rows, k * b)
    values, pos = jax.lax.top_k(candidates, k)
    idx = jnp.take_along_axis(blocks, pos // b, axis=1) * b + pos % b
    return jnp.where(values == -jnp.inf, -1, idx).astype(jnp.int32)


def _orderable(scores: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (negative floats have their bits flipped, others their sign bit set)."""
    bits = jax.lax.bitcast_convert_type(scores, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _digit_histogram(digit: jax.Array, active: jax.Array, size: int, method: str) -> jax.Array:
    """Counts [R, size] int32 of each digit value among the active keys of each row (digit, active: [R, S]).

    "scatter": one scatter-add (atomics; slow where most of a row's keys share a digit, as the top digits of scores
    of one magnitude do); "count": a compare against every digit value summed over the row (one reduction that XLA
    fuses without materializing [R, S, size]: no atomics; its work grows with `size`, so it suits small digits);
    "count_rows": the same counts as `size` sibling row reductions."""
    if method == "scatter":
        row = jnp.arange(digit.shape[0])[:, None]
        return jnp.zeros((digit.shape[0], size), jnp.int32).at[row, digit].add(active)
    if method == "count_rows":  # one row reduction per digit value: XLA fuses the siblings into one kernel
        live = active > 0
        return jnp.stack([jnp.sum(live & (digit == value), axis=1, dtype=jnp.int32) for value in range(size)], axis=1)
    hits = (digit[:, :, None] == jnp.arange(size, dtype=digit.dtype)) & (active[:, :, None] > 0)
    return jnp.sum(hits, axis=1, dtype=jnp.int32)


def radix_select(scores: jax.Array, k: int, digit_bits: tuple[int, ...] = (11, 11, 10),
                 histogram: str = "scatter") -> jax.Array:
    """`one_level`'s selection for scores [R, S] float32 (-inf = not allowed) without a sort -> [R, k] int32, the same
    key indices in ascending index order, -1 after them where fewer than k keys are allowed.

    The k-th largest score is found digit by digit of its order-preserving 32-bit key (`digit_bits`, most significant
    first): per digit, one histogram of the keys that match the digits found so far (a scatter-add), whose counts from
    the top give the next digit. Keys above it are taken, and of the keys equal to it the lowest indices
    (`lax.top_k`'s tie order); one cumulative count over the row places them. Passes over the row: one per digit
    plus one, each a reduction or a scatter, instead of a sort's dozens of kernels (benchmarks/NOTES_dsa.md).
    `histogram` says how each digit's counts are taken (`_digit_histogram`)."""
    assert sum(digit_bits) == 32, digit_bits
    if histogram not in ("scatter", "count", "count_rows"):
        raise ValueError(f"radix_select: histogram must be 'scatter', 'count' or 'count_rows', got {histogram!r}")
    rows, num_keys = scores.shape
    if num_keys < k:
        scores = jnp.pad(scores, ((0, 0), (0, k - num_keys)), constant_values=-jnp.inf)
        num_keys = k
    keys = _orderable(jnp.where(scores == 0, 0.0, scores))  # -0.0 and 0.0 are one score (a tie), not two
    row = jnp.arange(rows)[:, None]
    prefix = jnp.zeros((rows,), jnp.uint32)  # the digits of the k-th key found so far
    known = jnp.zeros((rows,), jnp.uint32)  # their bits
    need = jnp.full((rows,), k, jnp.int32)  # how many of the keys matching `prefix` are still to take
    shift = 32
    for bits in digit_bits:
        shift -= bits
        size = 1 << bits
        digit = ((keys >> shift) & jnp.uint32(size - 1)).astype(jnp.int32)
        active = ((keys & known[:, None]) == prefix[:, None]).astype(jnp.int32)
        hist = _digit_histogram(digit, active, size, histogram)
        at_least = jnp.cumsum(hist[:, ::-1], axis=1)[:, ::-1]  # keys with this digit or a higher one
        chosen = jnp.sum(at_least >= need[:, None], axis=1) - 1  # the highest digit with enough keys at or above it
        above = jnp.take_along_axis(jnp.pad(at_least, ((0, 0), (0, 1))), (chosen + 1)[:, None], axis=1)[:, 0]
        need = need - above
        prefix = prefix | (chosen.astype(jnp.uint32) << shift)
        known = known | jnp.uint32((size - 1) << shift)
    greater, equal = keys > prefix[:, None], keys == prefix[:, None]
    counts = jnp.cumsum(jnp.stack([greater, equal]).astype(jnp.int32), axis=-1)
    greater_before, equal_before = counts[0] - greater, counts[1] - equal
    ties_allowed = prefix != _orderable(jnp.float32(-jnp.inf))  # a k-th score of -inf: no -inf key is returned
    take = greater | (equal & (equal_before < need[:, None]) & ties_allowed[:, None])
    slot = greater_before + jnp.where(ties_allowed[:, None], jnp.minimum(equal_before, need[:, None]), 0)
    index = jnp.broadcast_to(jnp.arange(num_keys, dtype=jnp.int32), keys.shape)
    return jnp.full((rows, k), -1, jnp.int32).at[row, jnp.where(take, slot, k)].set(index, mode="drop")
