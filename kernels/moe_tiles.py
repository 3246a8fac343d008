"""Token-expert pairs grouped into row tiles that each belong to one expert (the schedule of the grouped matmuls).

Pairs are sorted by expert and each expert's rows are padded to a multiple of `block_m`, so a tile of `block_m`
rows never mixes experts and needs no row masks. The number of tiles is bounded statically by
ceil((P + min(E, P) * (block_m - 1)) / block_m) for P = tokens * top_k pairs; tiles past the used ones are marked
-1 and the kernels skip them, so empty experts cost nothing and a decode step touches only the chosen experts.
A single token's pairs (a batch-1 decode step) name distinct experts: each gets its own tile, in top-k order, with
no sort or scatter (the static bound is then exactly k tiles). Up to `COMPARE_MAX_PAIRS` pairs (decode batches) the
schedule comes from comparisons instead of a sort and scatters: a pair's rank among its expert's pairs is the count
of earlier pairs with the same expert, and a row's token is found by matching it against every pair's row, each a
single broadcast-and-reduce that XLA fuses into one kernel (the sort-based form is ~9 kernels per MoE layer, which
are a large part of a decode step's kernel count). Both forms give the same schedule.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


# Layer calls of at most this many token-expert pairs build their schedule by comparisons (`_compare_schedule`):
# at 1024 pairs the largest comparison is rows x pairs ~ 2M (medium hybrid), one small fusion.
COMPARE_MAX_PAIRS = 1024
# Rows per tile of decode-sized calls (`moe_dense.choose_tiles`), and of the schedule `kernels.router` makes.
DECODE_BLOCK_M = 16


class Schedule(NamedTuple):
    """row_of_pair [T, k] int32: the padded row of each (token, choice); token_of_row [R] int32: the token a row
    reads (T, one past the last token, for padding rows); tile_expert [R / block_m] int32 (or longer: entries past
    R / block_m are never read): each tile's expert or -1;
    group_sizes [E] int32: pairs per expert; pair_rows [R] int32 or None: `pair_of_row`, where the schedule made it
    alongside (the compare schedule: no scatter after it).
    pair_weights [M, S] float32 or None: the routing weights as the schedule's maker had them (the router kernel's
    padded output, `kernels.router.select_and_schedule(padded=True)`): then pair_rows numbers pair (t, slot)
    t * S + slot (padding rows M * S), and token_of_row and pair_rows may run on past R (never read there).
    turns [C] int32 or None: zeros made ahead for the grouped kernels' turn counters (`moe_mxfp4_gemv.turn_count`),
    so no zero fill runs between the schedule's maker and those kernels."""

    row_of_pair: jax.Array
    token_of_row: jax.Array
    tile_expert: jax.Array
    group_sizes: jax.Array
    pair_rows: jax.Array | None = None
    pair_weights: jax.Array | None = None
    turns: jax.Array | None = None

    def real_rows(self) -> jax.Array:
        """[R] bool: the rows that hold a pair (the rest are padding)."""
        return self.token_of_row < self.row_of_pair.shape[0]

    def pair_of_row(self) -> jax.Array:
        """[R] int32: the pair each row holds, as an index into row_of_pair's flat order; P for padding rows."""
        if self.pair_rows is not None:
            return self.pair_rows
        rows = self.row_of_pair.reshape(-1)
        return jnp.full(self.token_of_row.shape, rows.shape[0], jnp.int32).at[rows].set(
            jnp.arange(rows.shape[0], dtype=jnp.int32))


def max_tiles(n_pairs: int, n_experts: int, block_m: int) -> int:
    """Static upper bound on the tiles any routing of `n_pairs` pairs over `n_experts` experts needs."""
    return -(-(n_pairs + min(n_experts, n_pairs) * (block_m - 1)) // block_m)


def schedule(topk_ids: jax.Array, n_experts: int, block_m: int) -> Schedule:
    """topk_ids [T, k] int -> Schedule (see the class)."""
    n_tokens, top_k = topk_ids.shape
    if n_tokens == 1:
        return _single_token_schedule(topk_ids, n_experts, block_m)
    if n_tokens * top_k <= COMPARE_MAX_PAIRS:
        return _compare_schedule(topk_ids, n_experts, block_m)
    return _sorted_schedule(topk_ids, n_experts, block_m)


def _sorted_schedule(topk_ids: jax.Array, n_experts: int, block_m: int) -> Schedule:
    """`schedule` by a stable sort of the pairs by expert and scatters back."""
    n_tokens, top_k = topk_ids.shape
    n_pairs = n_tokens * top_k
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    tiles = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    first_row = (tile_end - tiles) * block_m
    offsets = jnp.cumsum(sizes) - sizes
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    rows_sorted = first_row[expert] + jnp.arange(n_pairs, dtype=jnp.int32) - offsets[expert]
    row_of_pair = jnp.zeros((n_pairs,), jnp.int32).at[order].set(rows_sorted)
    n_tiles = max_tiles(n_pairs, n_experts, block_m)
    token_of_row = jnp.full((n_tiles * block_m,), n_tokens, jnp.int32).at[row_of_pair].set(
        jnp.arange(n_pairs, dtype=jnp.int32) // top_k)
    return Schedule(row_of_pair.reshape(n_tokens, top_k), token_of_row, _tile_expert(tile_end, n_tiles), sizes)


def _compare_schedule(topk_ids: jax.Array, n_experts: int, block_m: int) -> Schedule:
    """`schedule` by comparisons (O(pairs x (pairs + rows)) work, no sort or scatter): the same Schedule, from three
    broadcast-and-reduce passes (each one fusion on a GPU, where the bincount / cumsum form took six):
    1. a pair's rank among its expert's pairs: the earlier pairs of the same expert;
    2. the tiles of lower-numbered experts, which come first: a tile opens at each pair of rank 0, block_m, ...;
    3. each row's (pair, expert), packed in one int32 by matching the row against every pair's row (a row holds at
       most one pair; no match: a padding row): the row's token and its pair (`Schedule.pair_rows`, which a scatter
       makes for the other schedules). A tile's expert is that of its first row, which is always a pair."""
    n_tokens, top_k = topk_ids.shape
    n_pairs = n_tokens * top_k
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    pair = jnp.arange(n_pairs, dtype=jnp.int32)
    same_before = (flat[None, :] == flat[:, None]) & (pair[None, :] < pair[:, None])  # [P, P]: q before p, same expert
    rank = jnp.sum(same_before, axis=1, dtype=jnp.int32)
    opens_tile = rank % block_m == 0
    tiles_before = jnp.sum((flat[None, :] < flat[:, None]) & opens_tile[None, :], axis=1, dtype=jnp.int32)
    row_of_pair = tiles_before * block_m + rank
    n_tiles = max_tiles(n_pairs, n_experts, block_m)
    row = jnp.arange(n_tiles * block_m, dtype=jnp.int32)
    radix = n_experts + 1
    code = pair * radix + flat + 1  # [P] each pair and its expert, never 0 (< 2^31: P <= COMPARE_MAX_PAIRS)
    packed = jnp.sum(jnp.where(row[:, None] == row_of_pair[None, :], code[None, :], 0), axis=1, dtype=jnp.int32)
    pair_rows = jnp.where(packed > 0, (packed - 1) // radix, n_pairs)
    token_of_row = jnp.where(packed > 0, pair_rows // top_k, n_tokens)
    tile_expert = jnp.where(packed[::block_m] > 0, (packed[::block_m] - 1) % radix, -1)
    experts = jnp.arange(n_experts, dtype=jnp.int32)
    sizes = jnp.sum(flat[None, :] == experts[:, None], axis=1, dtype=jnp.int32)  # [E] (unused by dense experts)
    return Schedule(row_of_pair.reshape(n_tokens, top_k), token_of_row, tile_expert, sizes, pair_rows)


def _tile_expert(tile_end: jax.Array, n_tiles: int) -> jax.Array:
    """tile_end [E] (each expert's tiles end before this tile, cumulative) -> each of the n_tiles tiles' expert, -1
    past the used ones (one fused compare-sum)."""
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    expert = jnp.sum(tile_end[None, :] <= t[:, None], axis=1, dtype=jnp.int32)
    return jnp.where(t < tile_end[-1], expert, -1)


def _single_token_schedule(topk_ids: jax.Array, n_experts: int, block_m: int) -> Schedule:
    """One token's k pairs (distinct experts, as top-k picks them) -> tile j holds pair j in its first row; only
    tile_expert depends on the routing."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    first_rows = np.arange(top_k, dtype=np.int32) * block_m
    token_of_row = np.ones(top_k * block_m, np.int32)  # 1 = one past the only token: the padding rows
    token_of_row[first_rows] = 0
    return Schedule(jnp.asarray(first_rows.reshape(1, top_k)), jnp.asarray(token_of_row), flat,
                    jnp.bincount(flat, length=n_experts).astype(jnp.int32))


def take_or_zero(values: jax.Array, index: jax.Array) -> jax.Array:
    """values [N, ...], index [R] in [0, N] -> [R, ...]: values[index], zeros where index is N (padding rows)."""
    return jnp.concatenate([values, jnp.zeros((1,) + values.shape[1:], values.dtype)])[index]


def row_weights(sched: Schedule, topk_weights: jax.Array) -> jax.Array:
    """[R] float32: each padded row's routing weight (topk_weights [T, k] at the pair the row holds), 0 for padding
    rows. One compare-and-sum pass (no scatter)."""
    rows = jnp.arange(sched.token_of_row.shape[0], dtype=jnp.int32)
    match = rows[:, None] == sched.row_of_pair.reshape(1, -1)
    return jnp.sum(jnp.where(match, topk_weights.reshape(1, -1).astype(jnp.float32), 0.0), axis=1)


def weighted_sum(picked: jax.Array, topk_weights: jax.Array) -> jax.Array:
    """picked [T, k, D] per-pair expert outputs -> [T, D] float32: weighted by the routing weights, summed."""
    return jnp.sum(picked.astype(jnp.float32) * topk_weights.astype(jnp.float32)[..., None], axis=1)  # no dot: no TF32


def combine(rows: jax.Array, sched: Schedule, topk_weights: jax.Array) -> jax.Array:
    """rows [R, D] expert outputs -> [T, D] float32: each token's outputs weighted by its routing weights, summed."""
    return weighted_sum(rows[sched.row_of_pair], topk_weights)
