"""Pallas (Triton lowering) passes of the radix select (`topk.radix_select(..., histogram="pallas")`): the digit
counts of one pass, and the final compaction, each one kernel over row segments with no atomics.

Keys are the scores' order-preserving 32-bit patterns (`topk._orderable`), uint32 [R, S] with S a multiple of
`SEGMENT`, as the plain-jnp forms beside them in `topk` (`_digit_histogram`, `_compact`: the references) take them;
the kernels see their bits as int32.
- `digit_counts`: for one digit (`bits` <= 8 at `shift`), each row's count of every digit value among the keys whose
  higher digits equal the row's `prefix`. A program counts one segment: the digit's high and low halves as one-hot
  [256, 16] tiles per step of a loop over the segment, whose products hi^T lo on the tensor cores sum to the
  segment's 16 x 16 histogram (0/1 in bf16, exact in the float32 accumulator); XLA sums the segments.
- `compact`: the selected keys' indices in index order, given the k-th key, how many of its ties to take, and each
  segment's counts of keys above it and equal to it before the segment (an XLA cumsum over segments). A program
  takes one segment as [16, 128]: the running counts within it come from products with triangular 0/1 matrices,
  and the taken indices are stored at their slots (a masked scatter into the row's k outputs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import tiles

SEGMENT = 2048  # keys per program (16 x 128 in `compact`)
_CHUNK = 256  # keys per step of `digit_counts`' loop
_ROWS, _COLS = 16, 128
_MIN = -(1 << 31)


def _tn(a, b):
    """a [K, M]^T @ b [K, N] -> [M, N] float32."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _digit_counts_kernel(keys_ref, prefix_ref, known_ref, out_ref, *, shift, bits):
    r = pl.program_id(0)
    prefix, known = prefix_ref[r], known_ref[r]
    lo_bits = min(bits, 4)
    values = jax.lax.broadcasted_iota(jnp.int32, (1, 16), 1)

    def chunk(c, counts):
        keys = keys_ref[pl.ds(pl.multiple_of(c * _CHUNK, _CHUNK), _CHUNK)]  # [_CHUNK] int32 bits
        active = (keys & known) == prefix

        def count(counts):
            digit = jax.lax.shift_right_logical(keys, jnp.int32(shift)) & ((1 << bits) - 1)
            hi = jnp.where(active[:, None] & ((digit >> lo_bits)[:, None] == values), 1.0, 0.0).astype(jnp.bfloat16)
            lo = jnp.where((digit & ((1 << lo_bits) - 1))[:, None] == values, 1.0, 0.0).astype(jnp.bfloat16)
            return counts + _tn(hi, lo)  # [16 high values, 16 low values]

        # the later digits' passes find most chunks without a key under the prefix: those skip the counting
        return jax.lax.cond(jnp.sum(active.astype(jnp.int32)) > 0, count, lambda counts: counts, counts)

    counts = jax.lax.fori_loop(0, SEGMENT // _CHUNK, chunk, jnp.zeros((16, 16), jnp.float32))
    out_ref[...] = counts.astype(jnp.int32)


def _bits(a: jax.Array) -> jax.Array:
    """uint32 -> the same bits as int32 (what the kernels compute on)."""
    return jax.lax.bitcast_convert_type(a, jnp.int32)


def digit_counts(keys: jax.Array, prefix: jax.Array, known: jax.Array, shift: int, bits: int,
                 interpret: bool = False) -> jax.Array:
    """keys [R, S] uint32 (S a multiple of SEGMENT), prefix / known [R] uint32 -> counts [R, 2^bits] int32 of digit
    value ((key >> shift) & (2^bits - 1)) among keys with (key & known) == prefix."""
    assert 1 <= bits <= 8, bits
    rows, n = keys.shape
    n_seg = n // SEGMENT
    partial = pl.pallas_call(
        functools.partial(_digit_counts_kernel, shift=shift, bits=bits),
        out_shape=jax.ShapeDtypeStruct((rows, n_seg, 16, 16), jnp.int32),
        grid=(rows, n_seg),
        in_specs=[pl.BlockSpec((None, SEGMENT), lambda r, j: (r, j)), pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.BlockSpec((None, None, 16, 16), lambda r, j: (r, j, 0, 0)),
        interpret=interpret, compiler_params=tiles.compiler_params(4, 1), name="radix_digit_counts",
    )(_bits(keys), _bits(prefix), _bits(known))
    lo_bits = min(bits, 4)
    counts = jnp.sum(partial, axis=1)[:, :1 << (bits - lo_bits), :1 << lo_bits]
    return counts.reshape(rows, 1 << bits)


def _compact_kernel(keys_ref, threshold_ref, need_ref, greater_ref, equal_ref, init_ref, out_ref, *, k, n_out):
    del init_ref  # the -1-filled outputs, aliased to out_ref
    r, j = pl.program_id(0), pl.program_id(1)
    keys = keys_ref[...] ^ _MIN  # [16, 128]: unsigned order as signed order
    threshold = threshold_ref[r] ^ _MIN
    need = need_ref[r]
    greater = keys > threshold
    equal = keys == threshold
    row = jax.lax.broadcasted_iota(jnp.int32, (_COLS, _COLS), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (_COLS, _COLS), 1)
    before_in_row = jnp.where(row < col, 1.0, 0.0).astype(jnp.bfloat16)  # [128, 128] strictly upper
    all_ones = jnp.ones((_COLS, _COLS), jnp.bfloat16)
    rows_before = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (_ROWS, _ROWS), 0)
                            > jax.lax.broadcasted_iota(jnp.int32, (_ROWS, _ROWS), 1), 1.0, 0.0).astype(jnp.bfloat16)

    def exclusive_count(mask):
        """[16, 128] 0/1 -> how many set entries come before each entry in row-major order (float32, exact)."""
        x = jnp.where(mask, 1.0, 0.0).astype(jnp.bfloat16)
        within = tiles.mm(x, before_in_row)  # earlier in the same row of 128
        row_totals = tiles.mm(x, all_ones).astype(jnp.bfloat16)  # each row's total, in every column
        return within + tiles.mm(rows_before, row_totals)  # plus the earlier rows' totals

    greater_before = greater_ref[r, j] + exclusive_count(greater).astype(jnp.int32)
    equal_before = equal_ref[r, j] + exclusive_count(equal).astype(jnp.int32)
    take = greater | (equal & (equal_before < need))
    slot = greater_before + jnp.minimum(equal_before, need)
    lane = jax.lax.broadcasted_iota(jnp.int32, (_ROWS, _COLS), 0) * _COLS + jax.lax.broadcasted_iota(
        jnp.int32, (_ROWS, _COLS), 1)
    # entries not taken address a spare slot of their own past the outputs (stores under a mask may still read and
    # write back their address, as interpret mode does): no two lanes share an address
    target = jnp.where(take, r * k + slot, n_out + lane)
    pltriton.store(out_ref.at[target], j * SEGMENT + lane, mask=take)


def compact(keys: jax.Array, threshold: jax.Array, need: jax.Array, k: int, interpret: bool = False) -> jax.Array:
    """keys [R, S] uint32 (S a multiple of SEGMENT), threshold [R] uint32 (each row's k-th key), need [R] int32 (how
    many keys equal to it to take, the lowest indices first) -> [R, k] int32: the indices of the keys above the
    threshold and of those ties, ascending, -1 after them."""
    rows, n = keys.shape
    n_seg = n // SEGMENT
    per_segment = keys.reshape(rows, n_seg, SEGMENT)
    t = threshold[:, None, None]
    counts = jnp.stack([jnp.sum(per_segment > t, axis=-1, dtype=jnp.int32),
                        jnp.sum(per_segment == t, axis=-1, dtype=jnp.int32)])  # [2, R, n_seg]
    before = jnp.cumsum(counts, axis=-1) - counts
    out = pl.pallas_call(
        functools.partial(_compact_kernel, k=k, n_out=rows * k),
        out_shape=jax.ShapeDtypeStruct((rows * k + SEGMENT,), jnp.int32),  # the outputs, then spare slots
        grid=(rows, n_seg),
        in_specs=[pl.BlockSpec((None, _ROWS, _COLS), lambda r, j: (r, j, 0))] + [pl.no_block_spec] * 5,
        out_specs=pl.no_block_spec, input_output_aliases={5: 0},
        interpret=interpret, compiler_params=tiles.compiler_params(4, 1), name="radix_compact",
    )(_bits(keys).reshape(rows, n // _COLS, _COLS), _bits(threshold), need.astype(jnp.int32), before[0], before[1],
      jnp.full((rows * k + SEGMENT,), -1, jnp.int32))
    return out[:rows * k].reshape(rows, k)
