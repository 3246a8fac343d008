"""Pallas (Triton lowering) writes into the paged cache, in place (the cache operand is aliased to the output).

`write_decode`: one token per request, one program per request. `write_prefill`: many tokens per request, one
program per (request, tile of `block_t` tokens), each storing its tile's rows with one scattered store per feature
segment. A token's row is found through the block table; invalid tokens go to row 0 of the layer's scratch block 0,
as the reference does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import projection, tiles


def _token_rows(pos, ok, table_ref, b, layer_row0, block_size):
    """Cache rows of tokens at positions `pos` (scalar or vector) of request b; invalid ones -> the scratch row."""
    safe = jnp.where(ok, pos, 0)
    page = table_ref[b, safe // block_size]
    return jnp.where(ok, layer_row0 + page * block_size + safe % block_size, layer_row0)


def _decode_kernel(*refs, layer_row0, block_size, pieces, norm, partials):
    """`partials`: the values come as a `projection.Partials` layout (its sums and squares refs), finished as
    loaded."""
    n_values = 1 if partials is None else 1 + partials[2]
    (pos_ref, ok_ref, table_ref), refs = refs[:3], refs[3:]
    value_refs, refs = refs[:n_values], refs[n_values:]
    weight_ref, (_cache_ref, out_ref) = (None, refs) if norm is None else (refs[0], refs[1:])
    b = pl.program_id(0)
    ok = ok_ref[b] != 0
    row = _token_rows(pos_ref[b], ok, table_ref, b, layer_row0, block_size)
    if partials is None:
        values = [value_refs[0][b, pl.ds(start, size)] for start, size in pieces]
    else:
        load = projection.partials_loader(value_refs, b, partials)
        values = [load(pl.ds(start, size)) for start, size in pieces]
    if norm is not None:  # `paged.LeadingNorm` over the pieces before `width`
        width, eps = norm
        lead = [i for i, (start, _) in enumerate(pieces) if start < width]
        ms = sum(jnp.sum(values[i].astype(jnp.float32) ** 2) for i in lead) / width
        inv = jax.lax.rsqrt(ms + eps)
        for i in lead:
            start, size = pieces[i]
            normed = (values[i].astype(jnp.float32) * inv).astype(values[i].dtype)
            weight = weight_ref[pl.ds(start, size)].astype(jnp.float32)
            values[i] = (weight * normed.astype(jnp.float32)).astype(values[i].dtype)
    for (start, size), value in zip(pieces, values):
        out_ref[row, pl.ds(start, size)] = value.astype(out_ref.dtype)


def _prefill_kernel(pos_ref, ok_ref, table_ref, val_ref, _cache_ref, out_ref, *, layer_row0, block_size, block_t,
                    pieces):
    b, i = pl.program_id(0), pl.program_id(1)
    tokens = pl.ds(i * block_t, block_t)
    rows = _token_rows(pos_ref[b, tokens], ok_ref[b, tokens] != 0, table_ref, b, layer_row0, block_size)
    for start, size in pieces:
        out_ref[rows, pl.ds(start, size)] = val_ref[b, tokens, pl.ds(start, size)].astype(out_ref.dtype)


def write(cache: jax.Array, layer: int, block_tables: jax.Array, positions: jax.Array, valid: jax.Array,
          values: jax.Array | projection.Partials, *, block_t: int = 64, num_warps: int = 4, interpret: bool = False,
          norm=None) -> jax.Array:
    """Same contract as `paged.write_reference`: cache [L, N, block, D], block_tables [B, NB] int32, positions/valid
    [B, T], values [B, T, D] -> the cache with the tokens stored (in place when the cache buffer is donated).
    `norm` (a `paged.LeadingNorm`, one token per request only): the rows' leading features normalized first. One
    token per request may also come as a projection's `projection.Partials` over the B rows (sums [S, B, D]),
    finished as the kernel loads them (`projection.finished`'s arithmetic)."""
    n_layers, n_blocks, block_size, width = cache.shape
    batch, length = positions.shape
    rows = tiles.cache_rows(cache)
    pieces = tiles.segments(width) if norm is None else \
        tiles.segments(norm.width) + tiles.segments(width - norm.width, norm.width)
    common = dict(layer_row0=layer * n_blocks * block_size, block_size=block_size, pieces=pieces)
    positions = positions.astype(jnp.int32)
    valid = valid.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    if norm is not None and length != 1:
        raise ValueError("paged write: a leading norm is for one token per request (the decode kernel)")
    partials = None
    if isinstance(values, projection.Partials):
        if length != 1 or values.sums.shape[1:] != (batch, width):
            raise ValueError(f"paged write: partial sums {list(values.sums.shape)} are for one token of each of "
                             f"{batch} requests, [S, {batch}, {width}]")
        value_args, partials = projection.partials_operands(values)
    elif length == 1:
        value_args = [values[:, 0]]
    if length == 1:
        kernel = functools.partial(_decode_kernel, norm=None if norm is None else (norm.width, float(norm.eps)),
                                   partials=partials, **common)
        grid = (batch,)
        args = (positions[:, 0], valid[:, 0], block_tables, *value_args)
        if norm is not None:
            args += (norm.weight,)
    else:
        block_t = min(block_t, tiles.pow2_at_least(length))
        padded = tiles.round_up(length, block_t)
        pad = ((0, 0), (0, padded - length))
        kernel = functools.partial(_prefill_kernel, block_t=block_t, **common)
        grid = (batch, padded // block_t)
        args = (jnp.pad(positions, pad), jnp.pad(valid, pad), block_tables, jnp.pad(values, pad + ((0, 0),)))
    out = tiles.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype), grid=grid,
        input_output_aliases={len(args): 0}, interpret=interpret, compiler_params=tiles.compiler_params(num_warps, 1),
        name="paged_write_decode" if length == 1 else "paged_write_prefill",
    )(*args, rows)
    return out.reshape(cache.shape)
