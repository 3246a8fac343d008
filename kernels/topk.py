"""Exact top-k over long score rows without a sort over a whole row of a long context, in two levels (`two_level`,
XLA sorts; `topk_pallas` selects on chip, the indexer's default, and falls back to this past its program size).

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
