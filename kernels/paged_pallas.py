"""Pallas (Triton lowering) writes into the paged cache, in place (the cache operand is aliased to the output).

`write_decode`: one token per request, one program per request. `write_prefill`: many tokens per request, one
program per (request, tile of `block_t` tokens), each storing its tile's rows with one scattered store per feature
segment. A token's row is found through the block table; invalid tokens go to row 0 of the layer's scratch block 0,
as the reference does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import projection, tiles


def _token_rows(pos, ok, table_ref, b, layer_row0, block_size):
    """Cache rows of tokens at positions `pos` (scalar or vector) of request b; invalid ones -> the scratch row."""
    safe = jnp.where(ok, pos, 0)
    page = table_ref[b, safe // block_size]
    return jnp.where(ok, layer_row0 + page * block_size + safe % block_size, layer_row0)


@dataclass(frozen=True)
class DecodeWrite:
    """The static layout of a one-token-per-request write (`decode_write`): the layer's first cache row, the block
    size, the feature pieces, the leading norm's (width, eps) or None, and the values' `projection.Partials`
    layout or None. Its operands (`decode_write`) are (positions [B], valid [B], block_tables, the values' arrays,
    the norm's weight where there is a norm)."""

    layer_row0: int
    block_size: int
    pieces: tuple[tuple[int, int], ...]
    norm: tuple[int, float] | None
    partials: tuple | None

    @property
    def n_operands(self) -> int:
        return 3 + projection.operand_count(self.partials) + (self.norm is not None)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["block_tables", "positions", "valid", "values", "norm"], meta_fields=["layer"])
@dataclass(frozen=True)
class DecodeRows:
    """One token per request for `layer`'s rows of a paged cache, to be written by a kernel that runs anyway
    (`kernels.mla_absorb.absorb_queries(latent_write=)`) instead of `write`'s own: block_tables [B, NB], positions
    / valid [B] or [B, 1], values [B, D], [B, 1, D] or a `projection.Partials` (sums [S, B, D]), norm a
    `paged.LeadingNorm` or None."""

    layer: int
    block_tables: jax.Array
    positions: jax.Array
    valid: jax.Array
    values: jax.Array | projection.Partials
    norm: object = None

    def operands(self, cache: jax.Array) -> tuple[list[jax.Array], DecodeWrite]:
        """`decode_write`'s operands and layout for these rows of `cache`."""
        return decode_write(cache, self.layer, self.block_tables, self.positions, self.valid, self.values,
                            self.norm)


def store_decode_row(b, refs, spec: DecodeWrite, out_ref) -> None:
    """In a kernel: stores request b's token (finished and normalised as `spec` says) into the cache rows `out_ref`
    [L * N * block, D]; refs: `decode_write`'s operands. Used by this module's decode kernel and by kernels that do
    the write beside their own work (`kernels.mla_absorb.absorb_queries(latent_write=)`)."""
    n_values = projection.operand_count(spec.partials)
    (pos_ref, ok_ref, table_ref), refs = refs[:3], refs[3:]
    value_refs, refs = refs[:n_values], refs[n_values:]
    weight_ref = refs[0] if spec.norm is not None else None
    ok = ok_ref[b] != 0
    row = _token_rows(pos_ref[b], ok, table_ref, b, spec.layer_row0, spec.block_size)
    load = projection.partials_loader(value_refs, b, spec.partials)
    values = [load(pl.ds(start, size)) for start, size in spec.pieces]
    if spec.norm is not None:  # `paged.LeadingNorm` over the pieces before `width`
        width, eps = spec.norm
        lead = [i for i, (start, _) in enumerate(spec.pieces) if start < width]
        # the weights before the rms reduction: loaded after it, their read waits for its barriers
        weights = [weight_ref[pl.ds(*spec.pieces[i])] for i in lead]
        ms = sum(jnp.sum(values[i].astype(jnp.float32) ** 2) for i in lead) / width
        inv = jax.lax.rsqrt(ms + eps)
        for i, weight in zip(lead, weights):
            normed = (values[i].astype(jnp.float32) * inv).astype(values[i].dtype)
            values[i] = (weight.astype(jnp.float32) * normed.astype(jnp.float32)).astype(values[i].dtype)
    for (start, size), value in zip(spec.pieces, values):
        out_ref[row, pl.ds(start, size)] = value.astype(out_ref.dtype)


def _decode_kernel(*refs, spec: DecodeWrite):
    """One program per request: `store_decode_row`; refs: the write's operands, then the cache rows (aliased with
    the output, not read) and the output."""
    store_decode_row(pl.program_id(0), refs[:spec.n_operands], spec, refs[-1])


def decode_write(cache: jax.Array, layer: int, block_tables: jax.Array, positions: jax.Array, valid: jax.Array,
                 values: jax.Array | projection.Partials, norm=None) -> tuple[list[jax.Array], DecodeWrite]:
    """The operands and static layout of writing one token per request: positions / valid [B] (or [B, 1]), values
    [B, D] (or [B, 1, D]) or a `projection.Partials` with sums [S, B, D], `norm` a `paged.LeadingNorm` or None."""
    n_layers, n_blocks, block_size, width = cache.shape
    batch = positions.shape[0]
    pieces = tiles.segments(width) if norm is None else \
        tiles.segments(norm.width) + tiles.segments(width - norm.width, norm.width)
    partials = None
    if isinstance(values, projection.Partials):
        if positions.size != batch or values.sums.shape[1:] != (batch, width):
            raise ValueError(f"paged write: partial sums {list(values.sums.shape)} are for one token of each of "
                             f"{batch} requests, [S, {batch}, {width}]")
        value_args, partials = projection.partials_operands(values)
    else:
        value_args = [values.reshape(batch, width)]
    operands = [positions.reshape(batch).astype(jnp.int32), valid.reshape(batch).astype(jnp.int32),
                block_tables.astype(jnp.int32), *value_args]
    if norm is not None:
        operands.append(norm.weight)
    spec = DecodeWrite(layer * n_blocks * block_size, block_size, pieces,
                       None if norm is None else (norm.width, float(norm.eps)), partials)
    return operands, spec


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
    batch, length = positions.shape
    rows = tiles.cache_rows(cache)
    if norm is not None and length != 1:
        raise ValueError("paged write: a leading norm is for one token per request (the decode kernel)")
    if length == 1 or isinstance(values, projection.Partials):  # (partial sums of several tokens: refused there)
        args, spec = decode_write(cache, layer, block_tables, positions, valid, values, norm)
        kernel, kernel_args, grid = _decode_kernel, dict(spec=spec), (batch,)
    else:
        n_layers, n_blocks, block_size, width = cache.shape
        block_t = min(block_t, tiles.pow2_at_least(length))
        padded = tiles.round_up(length, block_t)
        pad = ((0, 0), (0, padded - length))
        kernel, kernel_args = _prefill_kernel, dict(block_t=block_t, layer_row0=layer * n_blocks * block_size,
                                                    block_size=block_size, pieces=tiles.segments(width))
        grid = (batch, padded // block_t)
        args = (jnp.pad(positions.astype(jnp.int32), pad), jnp.pad(valid.astype(jnp.int32), pad),
                block_tables.astype(jnp.int32), jnp.pad(values, pad + ((0, 0),)))
    out = tiles.launch(kernel, kernel_args, (*args, rows), out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
                       grid=grid, num_warps=num_warps, num_stages=1, interpret=interpret, aliases={len(args): 0},
                       name="paged_write_decode" if length == 1 else "paged_write_prefill")
    return out.reshape(cache.shape)
