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

from . import topk_pallas


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


def _digit_histogram(keys: jax.Array, prefix: jax.Array, known: jax.Array, shift: int, bits: int, method: str,
                     interpret: bool) -> jax.Array:
    """Counts [R, 2^bits] int32 of digit ((key >> shift) & (2^bits - 1)) among each row's keys [R, S] uint32 whose
    bits under `known` [R] equal `prefix` [R] (the digits found so far).

    "scatter": one scatter-add (atomics; slow where most of a row's keys share a digit, as the top digits of scores
    of one magnitude do); "count": a compare against every digit value summed over the row (one reduction that XLA
    fuses without materializing [R, S, size]: no atomics; its work grows with `size`, so it suits small digits);
    "pallas": `topk_pallas.digit_counts` (one kernel over row segments, the counts as a product of one-hot tiles;
    digits of at most 8 bits)."""
    size = 1 << bits
    if method == "pallas":
        return topk_pallas.digit_counts(keys, prefix, known, shift, bits, interpret=interpret)
    digit = ((keys >> shift) & jnp.uint32(size - 1)).astype(jnp.int32)
    active = (keys & known[:, None]) == prefix[:, None]
    if method == "scatter":
        row = jnp.arange(digit.shape[0])[:, None]
        return jnp.zeros((digit.shape[0], size), jnp.int32).at[row, digit].add(active.astype(jnp.int32))
    hits = (digit[:, :, None] == jnp.arange(size, dtype=digit.dtype)) & active[:, :, None]
    return jnp.sum(hits, axis=1, dtype=jnp.int32)


def _compact(keys: jax.Array, threshold: jax.Array, need: jax.Array, k: int) -> jax.Array:
    """keys [R, S] uint32, each row's k-th key `threshold` [R] and how many of its ties to take `need` [R] -> [R, k]
    int32: the indices of the keys above it and of the first `need` keys equal to it, ascending, -1 after them. One
    cumulative count over the row places them, one scatter stores them."""
    rows, num_keys = keys.shape
    greater, equal = keys > threshold[:, None], keys == threshold[:, None]
    counts = jnp.cumsum(jnp.stack([greater, equal]).astype(jnp.int32), axis=-1)
    greater_before, equal_before = counts[0] - greater, counts[1] - equal
    take = greater | (equal & (equal_before < need[:, None]))
    slot = greater_before + jnp.minimum(equal_before, need[:, None])
    index = jnp.broadcast_to(jnp.arange(num_keys, dtype=jnp.int32), keys.shape)
    row = jnp.arange(rows)[:, None]
    return jnp.full((rows, k), -1, jnp.int32).at[row, jnp.where(take, slot, k)].set(index, mode="drop")


HISTOGRAMS = ("scatter", "count", "pallas")


def radix_select(scores: jax.Array, k: int, digit_bits: tuple[int, ...] = (11, 11, 10),
                 histogram: str = "scatter", interpret: bool = False) -> jax.Array:
    """`one_level`'s selection for scores [R, S] float32 (-inf = not allowed) without a sort -> [R, k] int32, the same
    key indices in ascending index order, -1 after them where fewer than k keys are allowed.

    The k-th largest score is found digit by digit of its order-preserving 32-bit key (`digit_bits`, most significant
    first): per digit, one histogram of the keys that match the digits found so far, whose counts from the top give
    the next digit. Keys above it are taken, and of the keys equal to it the lowest indices (`lax.top_k`'s tie
    order). Passes over the row: one per digit plus one, instead of a sort's dozens of kernels
    (benchmarks/NOTES_dsa.md). `histogram` says how each digit's counts are taken (`_digit_histogram`); with
    "pallas" the compaction is a Pallas kernel too (`topk_pallas.compact`; `interpret` runs both in interpret mode)."""
    assert sum(digit_bits) == 32, digit_bits
    if histogram not in HISTOGRAMS:
        raise ValueError(f"radix_select: histogram must be one of {HISTOGRAMS}, got {histogram!r}")
    if histogram == "pallas" and max(digit_bits) > 8:
        raise ValueError(f"radix_select: Pallas digit counts take digits of at most 8 bits, got {digit_bits}")
    rows, num_keys = scores.shape
    width = max(num_keys, k)
    if histogram == "pallas":  # whole segments of the Pallas passes
        width = -(-width // topk_pallas.SEGMENT) * topk_pallas.SEGMENT
    if width != num_keys:
        scores = jnp.pad(scores, ((0, 0), (0, width - num_keys)), constant_values=-jnp.inf)
    keys = _orderable(jnp.where(scores == 0, 0.0, scores))  # -0.0 and 0.0 are one score (a tie), not two
    prefix = jnp.zeros((rows,), jnp.uint32)  # the digits of the k-th key found so far
    known = jnp.zeros((rows,), jnp.uint32)  # their bits
    need = jnp.full((rows,), k, jnp.int32)  # how many of the keys matching `prefix` are still to take
    shift = 32
    for bits in digit_bits:
        shift -= bits
        size = 1 << bits
        hist = _digit_histogram(keys, prefix, known, shift, bits, histogram, interpret)
        at_least = jnp.cumsum(hist[:, ::-1], axis=1)[:, ::-1]  # keys with this digit or a higher one
        chosen = jnp.sum(at_least >= need[:, None], axis=1) - 1  # the highest digit with enough keys at or above it
        above = jnp.take_along_axis(jnp.pad(at_least, ((0, 0), (0, 1))), (chosen + 1)[:, None], axis=1)[:, 0]
        need = need - above
        prefix = prefix | (chosen.astype(jnp.uint32) << shift)
        known = known | jnp.uint32((size - 1) << shift)
    # a k-th score of -inf: no -inf key is returned
    need = jnp.where(prefix != _orderable(jnp.float32(-jnp.inf)), need, 0)
    if histogram == "pallas":
        return topk_pallas.compact(keys, prefix, need, k, interpret=interpret)
    return _compact(keys, prefix, need, k)
