"""Pallas (Triton lowering) sparse MLA attention in absorbed form over the paged latent cache.

Each query token attends to its own selected tokens (DSA top-k indices, or every causal token when `indices` is
None: dense MLA). Per program: one query token, `block_h` heads, a range of its selected tokens walked `block_k` at a
time: their cache rows are found through the block table and gathered ([block_k, R + E], the 576-wide latent as a
512 and a 64 segment), logits = q_latent . latent + q_rope . k_rope (W_UK already folded into q_latent), online
softmax in float32, and acc += p . latent (the caller applies W_UV).

- Prefill (`splits == 1`): one program per (token, head block); it normalizes and writes the output. Compute-bound:
  the gathered latents are shared by `block_h` heads.
- Decode (one token per request): the selected tokens are split over `splits` programs per (request, head block)
  so enough programs stream the cache at once (memory-bound); each writes an unnormalized partial (acc, max, sum)
  and `combine` merges them.
- Decode, `decode_variant="fused"` (see benchmarks/NOTES_dsa.md): the cache row of every selected token is resolved
  once in XLA (no block-table load inside the token loop); the grid is (head block, split, request) with the head
  block fastest, so the head blocks that gather the same rows run side by side and all but the first read them
  from L2; each program writes its split's normalized output in the cache dtype plus a float32 log-sum-exp (half
  the partial bytes of f32 acc/max/sum), merged by `combine_normalized`. Meant for block_h 64 (two head halves of
  DeepSeek-V3.2's 128) and many splits at small batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import tiles


@dataclass(frozen=True)
class SparseMLAConfig:
    """Tile sizes and launch parameters (powers of two)."""

    # Defaults: the fastest tunings measured on the H200 (2026-12-01, RESULTS.md). Prefill: 64 heads x 16 keys at
    # 128 heads (sparse_attention.py: 240 ms at 32K against 406 for 32 x 32); 32 keys for head blocks under 64 (the
    # medium hybrid's 16-head dense MLA: serving.py's TTFT at 32K was 2.86 s in the run with 16 keys, 1.85 s in the
    # earlier runs with 32). Decode:
    # "fused", 64 heads x 32 keys (B1 40 us, B16 157 us against 79 / 307 for heads_split 32 x 32). float32 caches
    # run 32 heads x 16 keys (shared memory).
    block_h: int = 64  # heads per program
    block_k: int | None = None  # selected tokens per online-softmax step (prefill); None: 16 at 64 heads, else 32
    decode_block_k: int = 32  # the same for one token per request (decode)
    decode_programs: int = 264  # decode: split the selected tokens until about this many programs run ...
    min_split_tokens: int = 128  # ... while each split keeps at least this many (its partial costs H x R floats)
    # ... but head blocks under 32 split a row into at least this many splits of at least 32 keys: the medium
    # hybrid's 16-head dense MLA at short contexts (4-block tables) ran 2 splits of 4 chunks, 11 us per layer, against
    # 8 of one chunk, 5 us (decode_profile.py on the H200, fifteenth session)
    small_head_min_splits: int = 8
    num_warps: int = 8
    # decode programs of fewer than 32 heads (one tensor-parallel rank's 16 of V3.2's 128; the medium hybrid's dense
    # MLA): 4 warps (H200, 16 heads: batch 16 42-48 us against 51-56 at 8 warps, batch 64 88-101 against 153-172)
    small_decode_warps: int = 4
    num_stages: int = 2
    decode_variant: str = "fused"  # decode: "fused" or "heads_split" (grid request, head block, split)
    # dense decode deals the live key chunks out evenly over the splits (`split_chunks`) instead of static ranges.
    # H200 (benchmarks/mla_decode_splits.py's cases, 16 heads, one request in a 33K-token table: 256 splits): the
    # fused decode kernel 4.65 us against 11.04 at position 150, 4.97 against 11.19 at 2000, 19.0 against 20.8 at
    # 30000 (empty splits also skipped, not kept: 0.3 us less there, ~1.2 us more in the combine's mask of their
    # rows); the 16-head GPU tests pass with it. In the model's narrow tables no difference was measured.
    dense_even_splits: bool = True

    def __post_init__(self):
        if self.decode_variant not in ("heads_split", "fused"):
            raise ValueError(f"decode_variant must be 'heads_split' or 'fused', got {self.decode_variant!r}")


def _online_softmax_step(carry, queries, lat, rope, ok, scale):
    """One online-softmax step over `block_k` gathered keys: carry (m [H], l [H], accs: pieces of [H, R]) float32,
    queries the q_latent + q_rope pieces [H, .], lat / rope the keys' pieces [block_k, .], ok [block_k] bool."""
    m, l, accs = carry
    logits = sum(tiles.mm_nt(q, k) for q, k in zip(queries, lat + rope)) * scale  # [heads, block_k]
    logits = jnp.where(ok[None, :], logits, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(logits - m_safe[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    p = p.astype(lat[0].dtype)
    return m_new, l, tuple(acc * alpha[:, None] + tiles.mm(p, v) for acc, v in zip(accs, lat))


def split_chunks(split, splits: int, chunks_per_split: int, live):
    """(first, last) key chunks of program `split` of `splits`. `live` None: the static range of `chunks_per_split`
    chunks; else (dense attention, `live` the number of chunks holding keys at or before the query) the live chunks
    dealt out evenly, ceil(live / splits) each, so a short context in a wide block table runs on several programs
    of one chunk each instead of a few programs walking their whole static range."""
    if live is None:
        first = split * chunks_per_split
        return first, first + chunks_per_split
    per = (live + splits - 1) // splits  # <= chunks_per_split: live <= splits * chunks_per_split
    first = split * per
    return first, jnp.maximum(first, jnp.minimum(first + per, live))


def _split_range(split, splits, chunks_per_split, qpos, block_k, dense, even):
    """This program's (first, last) key chunks: a selection's static range; dense attention's stops at the chunks
    holding keys at or before `qpos` (with `even`, those dealt out evenly: `split_chunks`)."""
    if not dense:
        return split_chunks(split, splits, chunks_per_split, None)
    live = jnp.maximum(qpos + block_k, 0) // block_k
    if even:
        return split_chunks(split, splits, chunks_per_split, live)
    first, last = split_chunks(split, splits, chunks_per_split, None)
    return first, jnp.maximum(first, jnp.minimum(last, live))


def _attend_split(step, first, last, heads, rank_pieces):
    """`step` over key chunks [first, last) from an empty online-softmax state -> (m [heads], l [heads], one acc
    [heads, size] per rank piece) float32."""
    init = (jnp.full((heads,), -jnp.inf, jnp.float32), jnp.zeros((heads,), jnp.float32),
            tuple(jnp.zeros((heads, size), jnp.float32) for _, size in rank_pieces))
    return jax.lax.fori_loop(first, last, step, init)


def _store_normalized(o_ref, accs, l, rank_pieces):
    """o_ref[:, piece] = acc / l per rank piece (zeros for heads that saw no key), in o_ref's dtype."""
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    for (start, size), acc in zip(rank_pieces, accs):
        o_ref[:, pl.ds(start, size)] = (acc * inv[:, None]).astype(o_ref.dtype)


def _kernel(*refs, length, block_k, splits, chunks_per_split, even, dense, scale, rank_pieces, rope_pieces,
            layer_row0, block_size, partial):
    if dense:
        ql_ref, qr_ref, pos_ref, table_ref, lat_ref, *outs = refs
        idx_ref = None
    else:
        ql_ref, qr_ref, pos_ref, idx_ref, table_ref, lat_ref, *outs = refs
    r, split = pl.program_id(0), pl.program_id(2)
    b = r // length
    qpos = pos_ref[r]
    q_lat = [ql_ref[:, pl.ds(start, size)] for start, size in rank_pieces]
    q_rope = [qr_ref[:, pl.ds(start, size)] for start, size in rope_pieces]
    rank = sum(size for _, size in rank_pieces)
    heads = ql_ref.shape[0]

    def step(c, carry):
        if dense:
            idx = c * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        else:
            idx = idx_ref[r, pl.ds(c * block_k, block_k)]
        ok = (idx >= 0) & (idx <= qpos)
        safe = jnp.where(ok, idx, 0)
        rows = layer_row0 + table_ref[b, safe // block_size] * block_size + safe % block_size
        lat = [jnp.where(ok[:, None], lat_ref[rows, pl.ds(start, size)], 0) for start, size in rank_pieces]
        rope = [lat_ref[rows, pl.ds(rank + start, size)] for start, size in rope_pieces]
        return _online_softmax_step(carry, q_lat + q_rope, lat, rope, ok, scale)

    first, last = _split_range(split, splits, chunks_per_split, qpos, block_k, dense, even)
    m, l, accs = _attend_split(step, first, last, heads, rank_pieces)
    if partial:
        acc_ref, m_ref, l_ref = outs
        for (start, size), acc in zip(rank_pieces, accs):
            acc_ref[:, pl.ds(start, size)] = acc
        m_ref[...] = m
        l_ref[...] = l
    else:
        (o_ref,) = outs
        _store_normalized(o_ref, accs, l, rank_pieces)


def _fused_decode_kernel(ql_ref, qr_ref, pos_ref, rows_ref, lat_ref, o_ref, lse_ref, *, block_k, splits,
                         chunks_per_split, even, dense, scale, rank_pieces, rope_pieces, layer_row0):
    """One (head block, split, request) program: rows_ref holds each selected token's row in its layer's part of the
    cache (-1 = skip); the layer's first row `layer_row0` is added here."""
    split, r = pl.program_id(1), pl.program_id(2)
    q_lat = [ql_ref[:, pl.ds(start, size)] for start, size in rank_pieces]
    q_rope = [qr_ref[:, pl.ds(start, size)] for start, size in rope_pieces]
    rank = sum(size for _, size in rank_pieces)
    heads = ql_ref.shape[0]

    def step(c, carry):
        rows = rows_ref[r, pl.ds(c * block_k, block_k)]
        ok = rows >= 0
        safe = jnp.where(ok, rows + layer_row0, layer_row0)
        lat = [jnp.where(ok[:, None], lat_ref[safe, pl.ds(start, size)], 0) for start, size in rank_pieces]
        rope = [lat_ref[safe, pl.ds(rank + start, size)] for start, size in rope_pieces]
        return _online_softmax_step(carry, q_lat + q_rope, lat, rope, ok, scale)

    first, last = _split_range(split, splits, chunks_per_split, pos_ref[r], block_k, dense, even)
    m, l, accs = _attend_split(step, first, last, heads, rank_pieces)
    _store_normalized(o_ref, accs, l, rank_pieces)
    seen = l > 0
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def combine_normalized(out: jax.Array, lse: jax.Array, dtype) -> jax.Array:
    """Per-split normalized outputs out [R, splits, H, D] and log-sum-exps lse [R, splits, H] (-inf: the split saw
    no key) -> [R, H, D] in `dtype` (zeros where no split saw a key)."""
    top = jnp.max(lse, axis=1, keepdims=True)
    w = jnp.exp(lse - jnp.where(top == -jnp.inf, 0.0, top))  # 0 for empty splits, 1 for the largest
    total = jnp.sum(w, axis=1)
    merged = jnp.einsum("rsh,rshd->rhd", w, out.astype(jnp.float32))
    return jnp.where(total[..., None] > 0, merged / jnp.where(total > 0, total, 1.0)[..., None], 0.0).astype(dtype)


def _cache_rows_of(block_tables, query_positions, indices, num_keys, padded, block_size):
    """-> [B * T, padded] int32 row of each selected causal key within one layer's part of the cache (-1: none or
    padding), in selection order. Without DSA `indices` this depends on nothing layer-specific, so XLA computes it
    once for all the MLA layers of a step (common subexpressions); the kernel adds the layer's first row."""
    batch, length = query_positions.shape
    pos = query_positions.reshape(batch, length, 1).astype(jnp.int32)
    if indices is None:
        idx = jnp.broadcast_to(jnp.arange(num_keys, dtype=jnp.int32), (batch, length, num_keys))
    else:
        idx = indices.astype(jnp.int32)
    ok = (idx >= 0) & (idx <= pos)
    safe = jnp.where(ok, idx, 0)
    pages = jnp.take_along_axis(block_tables.astype(jnp.int32), (safe // block_size).reshape(batch, -1), axis=1)
    rows = jnp.where(ok, pages.reshape(safe.shape) * block_size + safe % block_size, -1)
    return jnp.pad(rows.reshape(batch * length, -1), ((0, 0), (0, padded - num_keys)), constant_values=-1)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["out", "lse"], meta_fields=["heads", "dtype"])
@dataclass(frozen=True)
class SplitLatents:
    """Split decode attention before its merge: out [M, S, Hp, R] (each split's normalized output; cache dtype or
    float32), lse [M, S, Hp] float32 (its log-sum-exp; -inf where the split saw no key); the first `heads` of the
    Hp (padded) heads are real. `merged()` -> [M, heads, R] in `dtype`."""

    out: jax.Array
    lse: jax.Array
    heads: int
    dtype: str

    def merged(self) -> jax.Array:
        return combine_normalized(self.out[:, :, :self.heads], self.lse[:, :, :self.heads], self.dtype)


def combine(acc: jax.Array, m: jax.Array, l: jax.Array, dtype) -> jax.Array:
    """Partials acc [R, splits, H, D], m/l [R, splits, H] float32 -> normalized [R, H, D] in `dtype`."""
    m_max = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - jnp.where(m_max == -jnp.inf, 0.0, m_max))  # 0 for empty splits
    total = jnp.sum(w * l, axis=1)
    out = jnp.sum(w[..., None] * acc, axis=1)
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0).astype(dtype)


def decode_splits(programs: int, keys: int, block_h: int, config: SparseMLAConfig) -> int:
    """Splits of each decode row's `keys` (its block table's keys, or its selection's) over `programs` (request,
    head block) programs: a power of two, up to about `decode_programs` programs in all, each split keeping at
    least `min_split_tokens` keys; head blocks under 32 take at least `small_head_min_splits` of at least 32 keys."""
    wanted = -(-config.decode_programs // programs)
    most = max(1, keys // config.min_split_tokens)
    splits = max(1, min(tiles.pow2_at_least(wanted), 1 << (most.bit_length() - 1)))
    if block_h < 32:
        floor = min(config.small_head_min_splits, max(1, keys // 32))
        splits = max(splits, 1 << (floor.bit_length() - 1))
    return splits


def sparse_mla(q_latent: jax.Array, q_rope: jax.Array, cache: jax.Array, layer: int, block_tables: jax.Array,
               query_positions: jax.Array, indices: jax.Array | None, scale: float,
               config: SparseMLAConfig = SparseMLAConfig(), interpret: bool = False,
               merge: bool = True) -> jax.Array | SplitLatents:
    """q_latent [B, T, H, R], q_rope [B, T, H, E], cache [L, N, block, R + E] read at `layer` through block_tables
    [B, max_blocks], query_positions [B, T] int (-1: a padding token), indices [B, T, K] int32 key positions (-1 =
    none) or None (every key at or before the query position) -> latent outputs [B, T, H, R] in q_latent.dtype.
    One token per request (T == 1) takes the split decode path; there `merge` False returns the "fused" variant's
    splits unmerged (`SplitLatents` over the B rows, for a consumer that merges them: `mla_absorb.up_project`)."""
    batch, length, heads, rank = q_latent.shape
    rope_dim = q_rope.shape[-1]
    n_layers, n_blocks, block_size, width = cache.shape
    n_rows = batch * length
    block_h = min(config.block_h, tiles.pow2_at_least(heads, 16))
    block_k = config.decode_block_k if length == 1 else config.block_k or (16 if block_h >= 64 else 32)
    if jnp.dtype(cache.dtype).itemsize >= 4:  # float32 tiles: half as many fit in shared memory
        block_h, block_k = min(block_h, 32), min(block_k, 16)
    heads_p = tiles.round_up(heads, block_h)
    num_keys = block_tables.shape[1] * block_size if indices is None else indices.shape[-1]
    n_chunks = -(-num_keys // block_k)
    splits = decode_splits(n_rows * (heads_p // block_h), n_chunks * block_k, block_h, config) if length == 1 else 1
    n_chunks = tiles.round_up(n_chunks, splits)
    out_dtype = q_latent.dtype
    fused = length == 1 and config.decode_variant == "fused"
    q_latent = jnp.pad(q_latent.reshape(n_rows, heads, rank).astype(cache.dtype),
                       ((0, 0), (0, heads_p - heads), (0, 0)))
    q_rope = jnp.pad(q_rope.reshape(n_rows, heads, rope_dim).astype(cache.dtype),
                     ((0, 0), (0, heads_p - heads), (0, 0)))
    if fused:
        out = _fused_decode(q_latent, q_rope, cache, layer, block_tables, query_positions, indices, scale, config,
                            interpret, heads=heads, block_h=block_h, block_k=block_k, n_chunks=n_chunks, splits=splits,
                            num_keys=num_keys, out_dtype=out_dtype)
        return out.merged().reshape(batch, length, heads, rank) if merge else out
    if not merge:
        raise ValueError("sparse_mla: merge=False is for the fused decode variant (one token per request)")
    tables = block_tables.astype(jnp.int32)
    args = [q_latent, q_rope, query_positions.reshape(n_rows).astype(jnp.int32)]
    if indices is not None:
        idx = indices.reshape(n_rows, -1).astype(jnp.int32)
        args.append(jnp.pad(idx, ((0, 0), (0, n_chunks * block_k - idx.shape[1])), constant_values=-1))
    args += [tables, tiles.cache_rows(cache)]
    kernel = functools.partial(
        _kernel, length=length, block_k=block_k, splits=splits, chunks_per_split=n_chunks // splits,
        even=config.dense_even_splits, dense=indices is None,
        scale=scale, rank_pieces=tiles.segments(rank), rope_pieces=tiles.segments(rope_dim),
        layer_row0=layer * n_blocks * block_size, block_size=block_size, partial=splits > 1)
    grid = (n_rows, heads_p // block_h, splits)
    in_specs = [pl.BlockSpec((None, block_h, rank), lambda r, h, s: (r, h, 0)),
                pl.BlockSpec((None, block_h, rope_dim), lambda r, h, s: (r, h, 0))]
    in_specs += [pl.no_block_spec] * (len(args) - 2)
    if splits > 1:
        out_shape = (jax.ShapeDtypeStruct((n_rows, splits, heads_p, rank), jnp.float32),
                     jax.ShapeDtypeStruct((n_rows, splits, heads_p), jnp.float32),
                     jax.ShapeDtypeStruct((n_rows, splits, heads_p), jnp.float32))
        out_specs = (pl.BlockSpec((None, None, block_h, rank), lambda r, h, s: (r, s, h, 0)),
                     pl.BlockSpec((None, None, block_h), lambda r, h, s: (r, s, h)),
                     pl.BlockSpec((None, None, block_h), lambda r, h, s: (r, s, h)))
    else:
        out_shape = jax.ShapeDtypeStruct((n_rows, heads_p, rank), out_dtype)
        out_specs = pl.BlockSpec((None, block_h, rank), lambda r, h, s: (r, h, 0))
    out = tiles.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs, interpret=interpret,
        compiler_params=tiles.compiler_params(config.num_warps, config.num_stages),
        name="sparse_mla_decode" if splits > 1 else "sparse_mla_prefill",
    )(*args)
    if splits > 1:
        out = combine(*out, out_dtype)
    return out[:, :heads].reshape(batch, length, heads, rank)


@functools.partial(jax.jit, static_argnames=("layer", "scale", "config", "interpret", "heads", "block_h", "block_k",
                                             "n_chunks", "splits", "num_keys", "out_dtype"))
def _fused_decode(q_latent, q_rope, cache, layer, block_tables, query_positions, indices, scale, config, interpret,
                  *, heads, block_h, block_k, n_chunks, splits, num_keys, out_dtype):
    """The "fused" decode variant on head-padded q_latent [R, Hp, rank], q_rope [R, Hp, E] -> its splits'
    `SplitLatents` (merged: [R, heads, rank] in out_dtype). Jitted, so eager calls of the same shapes (a test's
    decode step, layer after layer) trace and compile the kernel once."""
    n_rows, heads_p, rank = q_latent.shape
    rope_dim = q_rope.shape[-1]
    _, n_blocks, block_size, _ = cache.shape
    rows = _cache_rows_of(block_tables, query_positions, indices, num_keys, n_chunks * block_k, block_size)
    kernel = functools.partial(
        _fused_decode_kernel, block_k=block_k, splits=splits, chunks_per_split=n_chunks // splits,
        even=config.dense_even_splits, dense=indices is None,
        scale=scale, rank_pieces=tiles.segments(rank), rope_pieces=tiles.segments(rope_dim),
        layer_row0=layer * n_blocks * block_size)
    part_dtype = cache.dtype if jnp.dtype(cache.dtype).itemsize < 4 else jnp.float32
    grid = (heads_p // block_h, splits, n_rows)  # head blocks sharing a split's rows are adjacent programs
    in_specs = [pl.BlockSpec((None, block_h, rank), lambda h, s, r: (r, h, 0)),
                pl.BlockSpec((None, block_h, rope_dim), lambda h, s, r: (r, h, 0))]
    in_specs += [pl.no_block_spec] * 3
    out_shape = (jax.ShapeDtypeStruct((n_rows, splits, heads_p, rank), part_dtype),
                 jax.ShapeDtypeStruct((n_rows, splits, heads_p), jnp.float32))
    out_specs = (pl.BlockSpec((None, None, block_h, rank), lambda h, s, r: (r, s, h, 0)),
                 pl.BlockSpec((None, None, block_h), lambda h, s, r: (r, s, h)))
    warps = config.num_warps if block_h >= 32 else config.small_decode_warps
    out, lse = tiles.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs, interpret=interpret,
        compiler_params=tiles.compiler_params(warps, config.num_stages), name="sparse_mla_decode_fused",
    )(q_latent, q_rope, query_positions.reshape(n_rows).astype(jnp.int32), rows, tiles.cache_rows(cache))
    return SplitLatents(out, lse, heads, jnp.dtype(out_dtype).name)
