"""Pallas (Triton lowering) DSA indexer: causal scores read through the block table, then an exact top-k.

score[b, t, s] = key_scale[s] * sum_h w[b, t, h] * relu(q[b, t, h] . k[b, s]) for keys s <= position[b, t], -inf
beyond. Two score kernels, both reading each key tile once per program through the block table:
- `_rows_kernel` (decode, few queries per request): one program per (query row, key tile of `block_k`); the heads
  are the rows of one dot [H, D] x [D, block_k].
- `_tiles_kernel` (prefill): one program per (request, tile of `block_q` queries, key tile); a loop over heads of
  [block_q, D] x [D, block_k] dots accumulates the weighted ReLUs. Key tiles wholly after the tile's last query are
  skipped (written as -inf).
Scores only exist for one chunk of queries at a time (at most `score_bytes`; chunks run one after another under
`lax.map`), and the top-k of each chunk is taken on chip (`topk_pallas.top_k`) or in two levels of XLA sorts
(`topk.two_level`; `IndexerKernelConfig.topk`): the [T, S] score matrix of a long prefill never exists in memory, and
no sort runs over a whole long row.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import tiles, topk_pallas
from .topk import two_level


SELECTIONS = {  # IndexerKernelConfig.topk -> (scores [R, S] f32, k, interpret) -> [R, k] int32
    # one program per row finds the k-th score bitwise in registers (kernels/topk_pallas.py)
    "on_chip": topk_pallas.top_k,
    "two_level": lambda scores, k, interpret=False: two_level(scores, k),
}


@dataclass(frozen=True)
class IndexerKernelConfig:
    """Tile sizes and launch parameters of the indexer kernels (powers of two)."""

    block_k: int = 128  # keys per program (per loop step of the decode kernel)
    # decode: key tiles per program, its queries loaded once and the key gathers pipelined (a power of two); halved
    # while the grid would have fewer than `min_programs` programs (short contexts, small batches)
    tiles_per_program: int = 16
    min_programs: int = 512
    # decode: the dot as keys x heads ([block_k, D] x [D, H]): the sum over heads then stays within a thread and its
    # quad of lanes, instead of crossing warps through shared memory (heads x keys); 432 SASS instructions per tile
    # against 800 (benchmarks/triton_report.py --op indexer)
    keys_as_rows: bool = True
    block_q: int = 64  # queries per program in the prefill kernel
    rows_below: int = 16  # fewer queries than this per request: the per-row (decode) kernel
    score_bytes: int = 256 << 20  # bound on the scores of one query chunk
    num_warps: int = 4
    num_stages: int = 2
    # how the top-k is taken from the scores: on chip ("on_chip", `topk_pallas.top_k`: one program per row holds its
    # scores and finds the k-th bitwise; rows past 16K keys first select sub-blocks by their maxima; the key indices
    # in index order; 3-6x faster than "two_level" from 8K to 512K, benchmarks/indexer.py) or "two_level"
    # (`topk.two_level`, XLA sorts; score order)
    topk: str = "on_chip"

    def __post_init__(self):
        if self.topk not in SELECTIONS:
            raise ValueError(f"IndexerKernelConfig.topk must be one of {sorted(SELECTIONS)}, got {self.topk!r}")
        if self.tiles_per_program < 1 or self.tiles_per_program & (self.tiles_per_program - 1):
            raise ValueError(f"IndexerKernelConfig.tiles_per_program must be a power of two, got "
                             f"{self.tiles_per_program}")


def _key_tile(table_ref, keys_ref, scales_ref, b, j, *, layer_row0, block_size, block_k, pieces, dtype):
    """Key positions [block_k] of tile j of request b, the keys [block_k, D] as D-segments, their scales or None."""
    kpos = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    page = table_ref[b, kpos // block_size]
    rows = layer_row0 + page * block_size + kpos % block_size
    keys = [keys_ref[rows, pl.ds(start, size)].astype(dtype) for start, size in pieces]
    scales = None if scales_ref is None else scales_ref[rows, 0]
    return kpos, keys, scales


def _unpack_refs(refs, has_scales):
    """(q, w, positions, block table, keys, scales or None, out) refs of the indexer kernels."""
    if has_scales:
        return refs
    *inputs, out_ref = refs
    return (*inputs, None, out_ref)


def _rows_kernel(*refs, length, has_scales, block_k, tiles_per_program, keys_as_rows, **tile):
    """One (query row, run of `tiles_per_program` key tiles of `block_k`): the row's queries are loaded once and the
    tiles at or before its position walked in a loop (their key gathers pipelined across iterations); later tiles
    are -inf."""
    q_ref, w_ref, pos_ref, table_ref, keys_ref, scales_ref, out_ref = _unpack_refs(refs, has_scales)
    r, run = pl.program_id(0), pl.program_id(1)
    qpos = pos_ref[r]
    first = run * tiles_per_program

    def tile_score(i):
        """Scores [block_k] of the run's tile i, -inf past the row's position."""
        kpos, keys, scales = _key_tile(table_ref, keys_ref, scales_ref, r // length, first + i, block_k=block_k,
                                       dtype=q_ref.dtype, **tile)
        pairs = zip((q_ref[:, pl.ds(start, size)] for start, size in tile["pieces"]), keys)
        logits = sum(tiles.mm_nt(k, q) if keys_as_rows else tiles.mm_nt(q, k) for q, k in pairs)
        heads_axis = 1 if keys_as_rows else 0  # logits [block_k, H] or [H, block_k]
        w = jnp.expand_dims(w_ref[...], 1 - heads_axis)
        score = jnp.sum(jnp.maximum(logits, 0.0) * w, axis=heads_axis)
        if scales is not None:
            score = score * scales
        return jnp.where(kpos <= qpos, score, -jnp.inf)

    dead = jnp.full((block_k,), -jnp.inf, jnp.float32)
    if tiles_per_program == 1:  # one tile per program, no loop
        @pl.when(first * block_k <= qpos)
        def _():
            out_ref[...] = tile_score(0)

        @pl.when(first * block_k > qpos)
        def _():
            out_ref[...] = dead
        return

    live = jnp.clip(qpos // block_k - first + 1, 0, tiles_per_program)  # tiles holding a key at or before qpos

    def live_tile(i, carry):
        out_ref[pl.ds(pl.multiple_of(i * block_k, block_k), block_k)] = tile_score(i)
        return carry

    def dead_tile(i, carry):
        out_ref[pl.ds(pl.multiple_of(i * block_k, block_k), block_k)] = dead
        return carry

    jax.lax.fori_loop(0, live, live_tile, 0)
    jax.lax.fori_loop(live, tiles_per_program, dead_tile, 0)


def _tiles_kernel(*refs, has_scales, block_k, num_heads, **tile):
    q_ref, w_ref, pos_ref, table_ref, keys_ref, scales_ref, out_ref = _unpack_refs(refs, has_scales)
    b, j = pl.program_id(0), pl.program_id(2)
    qpos = pos_ref[...]  # [block_q]
    live = j * block_k <= jnp.max(qpos)

    @pl.when(live)
    def _():
        kpos, keys, scales = _key_tile(table_ref, keys_ref, scales_ref, b, j, block_k=block_k, dtype=q_ref.dtype,
                                       **tile)

        def head(h, acc):
            logits = sum(tiles.mm_nt(q_ref[:, h, pl.ds(start, size)], k)
                         for (start, size), k in zip(tile["pieces"], keys))  # [block_q, block_k]
            return acc + jnp.maximum(logits, 0.0) * w_ref[:, h][:, None]

        score = jax.lax.fori_loop(0, num_heads, head, jnp.zeros(out_ref.shape, jnp.float32))
        if scales is not None:
            score = score * scales[None, :]
        out_ref[...] = jnp.where(kpos[None, :] <= qpos[:, None], score, -jnp.inf)

    @pl.when(jnp.logical_not(live))
    def _():
        out_ref[...] = jnp.full(out_ref.shape, -jnp.inf, jnp.float32)


def _score_inputs(key_cache, key_scales, layer, block_tables, block_k):
    n_layers, n_blocks, block_size, width = key_cache.shape
    num_keys = tiles.round_up(block_tables.shape[1] * block_size, block_k)
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, num_keys // block_size - block_tables.shape[1])))
    rows = [tiles.cache_rows(key_cache)] + ([] if key_scales is None else [tiles.cache_rows(key_scales)])
    tile = dict(layer_row0=layer * n_blocks * block_size, block_size=block_size, pieces=tiles.segments(width))
    return num_keys, tables, rows, tile


def decode_tiles_per_program(config: IndexerKernelConfig, n_rows: int, n_tiles: int) -> int:
    """Key tiles per decode program: `config.tiles_per_program`, at most the tiles of a row (rounded up to a power
    of two), halved while n_rows x programs per row < `config.min_programs`."""
    per_program = min(config.tiles_per_program, tiles.pow2_at_least(n_tiles))
    while per_program > 1 and n_rows * -(-n_tiles // per_program) < config.min_programs:
        per_program //= 2
    return per_program


def row_scores(q, weights, query_positions, key_cache, layer, block_tables, key_scales=None,
               config: IndexerKernelConfig = IndexerKernelConfig(), interpret: bool = False) -> jax.Array:
    """q [B, T, H, D], weights [B, T, H] f32 (all scales folded in), query_positions [B, T] int (-1: none)
    -> scores [B * T, S] f32, S = max_blocks * block_size rounded up to `block_k` times the key tiles per program."""
    batch, length, heads, dim = q.shape
    block_k = config.block_k
    n_tiles = -(-block_tables.shape[1] * key_cache.shape[2] // block_k)
    per_program = decode_tiles_per_program(config, batch * length, n_tiles)
    num_keys, tables, rows, tile = _score_inputs(key_cache, key_scales, layer, block_tables, block_k * per_program)
    n_rows = batch * length
    kernel = functools.partial(_rows_kernel, length=length, has_scales=key_scales is not None, block_k=block_k,
                               tiles_per_program=per_program, keys_as_rows=config.keys_as_rows, **tile)
    return tiles.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((n_rows, num_keys), jnp.float32),
        grid=(n_rows, num_keys // (block_k * per_program)),
        in_specs=[pl.BlockSpec((None, heads, dim), lambda r, j: (r, 0, 0)),
                  pl.BlockSpec((None, heads), lambda r, j: (r, 0)),
                  pl.no_block_spec, pl.no_block_spec, pl.no_block_spec] + [pl.no_block_spec] * (len(rows) - 1),
        out_specs=pl.BlockSpec((None, block_k * per_program), lambda r, j: (r, j)),
        interpret=interpret, compiler_params=tiles.compiler_params(config.num_warps, config.num_stages),
        name="dsa_index_scores_decode",
    )(q.reshape(n_rows, heads, dim), weights.reshape(n_rows, heads).astype(jnp.float32),
      query_positions.reshape(n_rows).astype(jnp.int32), tables, *rows)


def tile_scores(q, weights, query_positions, key_cache, layer, block_tables, key_scales=None,
                config: IndexerKernelConfig = IndexerKernelConfig(), interpret: bool = False) -> jax.Array:
    """Same as `row_scores` with query tiles (T a multiple of block_q) -> scores [B, T, S] f32."""
    batch, length, heads, dim = q.shape
    block_k, block_q = config.block_k, config.block_q
    num_keys, tables, rows, tile = _score_inputs(key_cache, key_scales, layer, block_tables, block_k)
    kernel = functools.partial(_tiles_kernel, has_scales=key_scales is not None, block_k=block_k, num_heads=heads,
                               **tile)
    return tiles.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((batch, length, num_keys), jnp.float32),
        grid=(batch, length // block_q, num_keys // block_k),
        in_specs=[pl.BlockSpec((None, block_q, heads, dim), lambda b, i, j: (b, i, 0, 0)),
                  pl.BlockSpec((None, block_q, heads), lambda b, i, j: (b, i, 0)),
                  pl.BlockSpec((None, block_q), lambda b, i, j: (b, i)),
                  pl.no_block_spec, pl.no_block_spec] + [pl.no_block_spec] * (len(rows) - 1),
        out_specs=pl.BlockSpec((None, block_q, block_k), lambda b, i, j: (b, i, j)),
        interpret=interpret, compiler_params=tiles.compiler_params(config.num_warps, config.num_stages),
        name="dsa_index_scores_prefill",
    )(q, weights.astype(jnp.float32), query_positions.astype(jnp.int32), tables, *rows)


def indexer_topk(q, weights, query_positions, key_cache, layer, block_tables, topk: int, key_scales=None,
                 config: IndexerKernelConfig = IndexerKernelConfig(), interpret: bool = False) -> jax.Array:
    """Top-k keys per query -> indices [B, T, topk] int32 (key positions; -1 where fewer keys are allowed).

    q [B, T, H, D] (the cache's dtype, or e4m3 with `key_scales`), weights [B, T, H] f32 with the softmax scale
    (and FP8 query scales) folded in, key_cache [L, N, block, D], key_scales [L, N, block, 1] f32 or None.
    """
    batch, length, heads, dim = q.shape
    compute = jnp.bfloat16 if key_scales is not None else key_cache.dtype
    q = q.astype(compute)
    heads_p = tiles.pow2_at_least(heads, 16)
    if heads_p != heads:  # zero-weight padding heads add nothing
        q = jnp.pad(q, ((0, 0), (0, 0), (0, heads_p - heads), (0, 0)))
        weights = jnp.pad(weights, ((0, 0), (0, 0), (0, heads_p - heads)))
    kw = dict(key_cache=key_cache, layer=layer, block_tables=block_tables, key_scales=key_scales, config=config,
              interpret=interpret)
    num_keys = tiles.round_up(block_tables.shape[1] * key_cache.shape[2], config.block_k)
    select = SELECTIONS[config.topk]
    if length < config.rows_below:
        scores = row_scores(q, weights, query_positions, **kw)
        return select(scores, topk, interpret=interpret).reshape(batch, length, topk)
    block_q = min(config.block_q, tiles.pow2_at_least(length, 16))
    chunk = max(block_q, (config.score_bytes // (4 * batch * num_keys)) // block_q * block_q)
    chunk = min(chunk, tiles.round_up(length, block_q))
    padded = tiles.round_up(length, chunk)
    pad = ((0, 0), (0, padded - length))
    q = jnp.pad(q, pad + ((0, 0), (0, 0)))
    weights = jnp.pad(weights, pad + ((0, 0),))
    positions = jnp.pad(query_positions, pad, constant_values=-1)
    tile_cfg = dict(kw, config=dataclasses.replace(config, block_q=block_q))

    def one_chunk(args):
        q_c, w_c, pos_c = args
        scores = tile_scores(q_c, w_c, pos_c, **tile_cfg)
        return select(scores.reshape(-1, num_keys), topk, interpret=interpret).reshape(batch, chunk, topk)

    n_chunks = padded // chunk
    if n_chunks == 1:
        return one_chunk((q, weights, positions))[:, :length]

    def split(x):
        return jnp.moveaxis(x.reshape(batch, n_chunks, chunk, *x.shape[2:]), 1, 0)

    out = jax.lax.map(one_chunk, (split(q), split(weights), split(positions)))  # [n_chunks, B, chunk, topk]
    return jnp.moveaxis(out, 0, 1).reshape(batch, padded, topk)[:, :length]
