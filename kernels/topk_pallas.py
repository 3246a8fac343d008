"""Exact top-k of long score rows on chip (Pallas, Triton lowering): one program per row finds the k-th largest
score by a bitwise search over its order-preserving 32-bit key and writes the chosen key indices in index order.

`select(scores, k)`: a row of at most `max_keys` scores is one pass (`_select_kernel` over the row). A longer row is
cut into sub-blocks of b scores, as in `topk.two_level` but without its sorts: XLA reduces them to their maxima, one
pass selects the k sub-blocks with the highest maxima, XLA gathers their k * b scores in index order, and those are
selected the same way (one pass, or sub-blocks again). Exact: a top-k score lies in a sub-block whose maximum is >= it
>= the k-th largest score >= the k-th largest maximum. Each pass takes the ties at its k-th key lowest index first,
and so does the whole: the chosen sub-blocks whose maximum is that tie are the lowest of them, each holds one, and
they are at least as many as the ties still needed, so no needed tie lies in a sub-block left out. The result is
`lax.top_k`'s set of indices, ties included.

In a program the row's keys stay in registers: the k-th key is built bit by bit from the top, each step one count of
the keys at or above a candidate (a sum, no histogram or atomics), stopping once exactly k keys are at or above the
bits found (~log2(n) steps for distinct scores instead of 32). The keys above it and the first ties are then
compacted: running counts along rows of 128 and over the row totals, and a masked scatter to their slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import tiles, topk

NONE = -(1 << 31)  # the key of -inf, padding and sub-blocks not chosen: never selected
MAX_KEYS = 16384  # keys one program holds (16 per thread at 32 warps: no spills on sm_90)


def signed_keys(scores: jax.Array) -> jax.Array:
    """float32 -> int32 of the same (signed) order; -0.0 as 0.0 (one score, a tie); -inf -> NONE."""
    scores = jnp.where(scores == 0, 0.0, scores)
    bits = jax.lax.bitcast_convert_type(scores, jnp.int32)
    keys = bits ^ (jax.lax.shift_right_arithmetic(bits, 31) & 0x7FFFFFFF)
    return jnp.where(scores == -jnp.inf, NONE, keys)


def _kth_key(keys: jax.Array, k: int) -> jax.Array:
    """keys [n] int32 (n >= k) -> t with at least k keys >= t and at most k keys > t: the k best are the keys > t and,
    to make k, the first keys equal to t. Built from the top bit down as the largest t with at least k keys >= t (the
    k-th largest key), stopping once exactly k keys are >= the bits found so far (~log2(n) steps for distinct scores
    instead of 32). The search runs over the unsigned image u = t ^ NONE, whose order is the keys' order."""
    def more(state):
        i, _, at_least = state
        return (i < 32) & (at_least != k)

    def bit(state):
        i, u, at_least = state
        candidate = u | jax.lax.shift_left(jnp.int32(1), 31 - i)
        count = jnp.sum((keys >= (candidate ^ NONE)).astype(jnp.int32))
        enough = count >= k
        return i + 1, jnp.where(enough, candidate, u), jnp.where(enough, count, at_least)

    _, u, _ = jax.lax.while_loop(more, bit, (jnp.int32(0), jnp.int32(0), jnp.int32(keys.shape[0])))
    return u ^ NONE


def _exclusive_count(mask: jax.Array) -> jax.Array:
    """mask [n] bool -> int32 [n]: how many set entries come before each one. Counted as [n / 128, 128]: along rows
    of 128, then over the row totals (two short scans: a long 1-D scan's cross-thread step is serial in Triton)."""
    n = mask.shape[0]
    cols = min(n, 128)
    x = mask.astype(jnp.int32).reshape(n // cols, cols)
    totals = jnp.sum(x, axis=1)
    return (jnp.cumsum(x, axis=1) - x + (jnp.cumsum(totals) - totals)[:, None]).reshape(n)


def _select_kernel(values_ref, _, out_ref, *, k, n, num_keys):
    """One row's values [n] (the first `num_keys` real) -> its k best positions, ascending, stored at out[r * k:]
    (-1 prefilled: the outputs are aliased to the second input)."""
    r = pl.program_id(0)
    lane = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
    keys = jnp.where(lane < num_keys, signed_keys(values_ref[...]), NONE)
    kth = _kth_key(keys, k)
    greater = keys > kth
    ties = (keys == kth) & (kth != NONE)  # a k-th key of NONE: fewer than k allowed, all of them are `greater`
    need = k - jnp.sum(greater.astype(jnp.int32))
    take = greater | (ties & (_exclusive_count(ties) < need))
    # lanes not taken address a spare slot of their own past the outputs (stores under a mask may still read and
    # write back their address, as interpret mode does): no two lanes share an address
    target = jnp.where(take, r * k + _exclusive_count(take), pl.num_programs(0) * k + lane)
    pltriton.store(out_ref.at[target], lane, mask=take)


def _warps(n: int) -> int:
    """16 keys per thread up to 32 warps (sm_90: 62 registers at 16K keys, against 98 at 16 warps and 197 at 8)."""
    return min(32, max(4, n // 512))


def _select_pass(values: jax.Array, k: int, num_keys: int, interpret: bool) -> jax.Array:
    """values [R, num_keys] float32 -> [R, k] int32: one `_select_kernel` program per row; the k best positions,
    ascending, -1 after them."""
    rows = values.shape[0]
    n = tiles.pow2_at_least(max(num_keys, k))
    values = jnp.pad(values, ((0, 0), (0, n - num_keys)), constant_values=-jnp.inf)
    fill = jnp.full((rows * k + n,), -1, jnp.int32)  # the outputs, then spare slots
    out = tiles.pallas_call(
        functools.partial(_select_kernel, k=k, n=n, num_keys=num_keys),
        out_shape=jax.ShapeDtypeStruct(fill.shape, jnp.int32), grid=(rows,),
        in_specs=[pl.BlockSpec((None, n), lambda r: (r, 0)), pl.no_block_spec], out_specs=pl.no_block_spec,
        input_output_aliases={1: 0}, interpret=interpret, compiler_params=tiles.compiler_params(_warps(n), 1),
        name="topk_select",
    )(values, fill)
    return out[:rows * k].reshape(rows, k)


def fits(num_keys: int, k: int, max_keys: int = MAX_KEYS) -> bool:
    """Whether `select` takes rows of `num_keys` scores: in one program, or through passes that each leave fewer."""
    return max(num_keys, k) <= max_keys or 2 * k <= max_keys


def select(scores: jax.Array, k: int, max_keys: int = MAX_KEYS, interpret: bool = False) -> jax.Array:
    """scores [R, S] float32 (-inf = not allowed) -> [R, k] int32: the indices of the k best, ascending, -1 after
    them where fewer than k are allowed. `max_keys` (a power of two) bounds a program's keys; rows must `fits`: a
    row of more than `max_keys` scores has its sub-blocks of b (the least power of two leaving at most `max_keys`
    maxima) selected by their maxima, then the k * b scores of the chosen ones (< S where 2k <= max_keys) are
    selected the same way."""
    rows, num_keys = scores.shape
    if max(num_keys, k) <= max_keys:
        return _select_pass(scores, k, num_keys, interpret)
    if not fits(num_keys, k, max_keys):
        raise ValueError(f"topk_pallas.select: k={k} over rows of {num_keys} scores needs 2k <= max_keys={max_keys} "
                         f"(check `fits` first)")
    b = tiles.pow2_at_least(-(-num_keys // max_keys), 2)
    n_blocks = -(-num_keys // b)
    padded = jnp.pad(scores, ((0, 0), (0, n_blocks * b - num_keys)), constant_values=-jnp.inf)
    padded = padded.reshape(rows, n_blocks, b)
    blocks = _select_pass(jnp.max(padded, axis=-1), k, n_blocks, interpret)  # ascending, -1 after
    candidates = jnp.take_along_axis(padded, jnp.maximum(blocks, 0)[..., None], axis=1)  # [R, k, b]
    candidates = jnp.where(blocks[..., None] >= 0, candidates, -jnp.inf).reshape(rows, k * b)
    picked = select(candidates, k, max_keys, interpret)  # ascending positions among the candidates
    index = jnp.take_along_axis(blocks, jnp.maximum(picked, 0) // b, axis=1) * b + picked % b
    return jnp.where(picked >= 0, index, -1)


def top_k(scores: jax.Array, k: int, interpret: bool = False) -> jax.Array:
    """`select` for scores [R, S] where its programs hold the rows (the k best key indices, ascending, -1 after
    them); `topk.two_level` (value order) beyond."""
    if fits(scores.shape[-1], k):
        return select(scores, k, interpret=interpret)
    return topk.two_level(scores, k)
