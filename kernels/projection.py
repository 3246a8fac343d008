"""Decode-sized linear projections in Pallas (Triton): a few rows times several weights in one kernel, with the
input RMSNorm computed as each block loads and an optional residual added before the store.

At decode a layer's projections read megabytes of weights for 1-16 rows. XLA runs each as a split-K GEMM or a gemv
(the KDA layer's q|k|v product at ~2 TB/s on the H200, its f_a|g_a|b product behind a copy of their weights made
every step), plus the input norm's two kernels and the concatenations of the outputs. `project` reads each weight
byte once, in one launch: one program per column block of one weight (and K slice), its part of K in pipelined
steps, writing into the group's output at the weight's columns.

- x [M, K] with M a power of two up to `MAX_ROWS` (the engine's decode buckets); rows are loaded as a 16-row block
  (M < 16: row indices clamped to M - 1, so the spare rows repeat the last row and store its same values);
- `norm_weight` [K]: x is normalised as the model's `norms.RMSNorm` does, to its rounding: the kernel multiplies
  each block by the weight (rounded to x's dtype) as it loads, sums the rows' squares on the way and scales the
  float32 sums by 1 / rms at the end, where the norm rounds x / rms before the weight (a second rounding of the
  inputs, not of the sums);
- `groups`: tuples of weights [K, N_i] (Dense kernels, x's dtype); each group comes out as one array [M, sum N_i],
  its weights' products side by side, float32 sums rounded to x's dtype;
- `residual` [M, N] (one group of one weight): added to the rounded product, rounded again (the layer's `x + h`).

x and `residual` may also be float32 rows for 16-bit weights (the residual stream as the MXFP4 decode kernels leave
it, their sums added into the residual: `model.moe.RESIDUAL_IN_SUMS`): each value is then rounded to the weights'
dtype as it loads, so the results are those of the rounded rows.

Where the column blocks alone are too few programs to stream the weights, K is split (`ProjectionTiles`): each
program then writes a float32 partial sum (with the norm, the first program of each slice also the rows' squares
over it) and XLA adds them up, scales, rounds and adds the residual (`finished`). With `project(finish=False)` the
sums come back as they are (`Partials`), for a consumer kernel that adds up the columns it reads itself (the KDA
decode step with `model.kda.PROJECTION_PARTIALS`; off: no gain measured).

One-row calls (batch-1 decode) run on the CUDA cores instead (`ProjectionTiles.cuda_cores`, the default tiles
with `ONE_ROW_ON_CUDA_CORES`): no 16-row MMA tile padded around one token; each program loads its whole K slice
first, multiplies elementwise in float32 and sums over K once (`_vector_products`), with the same roundings.

With `weight_rows` the weights come stored [N_i, K] (torch's Linear layout: `model.linear.WEIGHT_ROWS`). A one-row
call's default tiles (`WEIGHT_ROWS_TILES`) then give each program whole weight rows (`block_n` output columns, every
K contiguous) and do not split K, so each program finishes its outputs itself; calls of more rows run the MMA path
over the blocks transposed.

x may also come as `HeadScaled` (the KDA decode step split over value blocks: float32 values and per-head sums of
squares): each loaded block is then scaled by its head's 1 / rms and rounded to the weights' dtype before the dot,
the gated RMSNorm's last step done where o_proj reads its input.

`reference` is the same in plain XLA; `choose` picks between them (dispatch name "projection").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import dispatch, tiles as tiling

# Whether CUDA runs the kernel by default: tests/gpu/test_projection_gpu.py passes on the H200 (2026-12-02), and the
# medium hybrid's batch-1 decode took 1.270 ms of kernels per token with it against 1.356 without
# (benchmarks/decode_profile.py, twelfth session).
GPU_VERIFIED = True
MAX_ROWS = 16
BLOCK_ROWS = 16  # rows per dot (Triton's smallest M)
# `choose` takes the kernel for calls of at most this many rows. (benchmarks/projection.py's XLA figures before
# 2026-12-04 computed only part of the layer, XLA dropping the products its chain did not read: its "XLA is faster
# at 16 rows" did not stand; RESULTS.md's correction line.) In the model the kernel also saves XLA's finishing
# reductions and the f_a|g_a|b weight concatenation it makes every step: batch-16 decode 2.830 ms of kernels per
# token with the kernel and `decode_layer.LOW_RANK_UPS_MIN_ROWS` = 16 against 2.882 with neither (2.854 the kernel
# alone; decode_profile.py, 2026-12-04, twentieth session).
CHOOSE_MAX_ROWS = 16


@dataclass(frozen=True)
class ProjectionTiles:
    """block_n: output columns per program (at most: the largest power of two dividing a weight's width); step_k: K
    per pipelined step. K is split in up to `k_slices` slices (powers of two dividing its steps) until there are
    `min_programs` programs; with K split, the kernel writes float32 partial sums and XLA adds them up, scales by
    the norm's 1 / rms, rounds and adds the residual."""

    block_n: int = 128
    step_k: int = 64
    num_warps: int = 2
    num_stages: int = 3
    min_programs: int = 1024
    k_slices: int = 8
    cuda_cores: bool = False  # one-row calls multiply on the CUDA cores (`_vector_products`); more rows ignore it


# `project`'s tiles when the call names none: calls of several weights (a layer's input projections) and calls of
# one weight (o_proj) apart, so each can be tuned (benchmarks/projection.py takes a pair, decode_profile.py
# --projection-tiles sets either; read when `project` is called, outside its jitted kernel call, so a change takes
# effect at the caller's next trace).
# o_proj (2048 -> 2048) in 64-column blocks: 32 x 8 = 256 programs where 128-column blocks made 128, fewer than the
# H200's SMs; on the H200 (twenty-first session) 5.29 -> 4.45 us per call at 16 rows (projection.py), the batch-16
# decode's o_proj calls 0.0868 -> 0.0735 ms per token, batch 1 unchanged (0.060).
TILES = ProjectionTiles()
ONE_WEIGHT_TILES = ProjectionTiles(block_n=64)
# One-row calls on the CUDA cores instead of the MMA (`ONE_ROW_ON_CUDA_CORES`): a 16-row MMA tile pads one token
# fifteen times over, while the bytes are the same. Each program issues all of its K slice's loads first
# (`_vector_products`), multiplies them elementwise into a float32 tile and sums over K once at the end. Why:
# benchmarks/read_floor.py on an H100 (fifty-seventh session) streams 26.4 / 8.4 MB in one dependent kernel in
# 10.3 / 4.5 us (XLA's row reduction), where the KDA layer's input projections / o_proj took 12.9 / 5.3 us. Measured
# (decode_profile.py --experts mxfp4 --batches 1, H100, five pairs, each on one machine): 0.814 / 0.815 / 0.818 /
# 0.809 / 0.817 ms per token pipelined with the MMA tiles against 0.792 / 0.796 / 0.797 / 0.791 / 0.797 on the CUDA
# cores (the projections 277 -> 254 us per token; the KDA step and the MoE front, which read twice the partial
# slices, +9 us). serving.py's batch-1 ITL spreads too wide to show it (RESULTS.md). Of the tiles tried, 64 columns
# x 16 K slices at 4 warps (below) was best: 8 slices 0.816, 32 columns 0.855, 128 columns 0.808, 2 warps 0.798;
# o_proj apart (ONE_ROW_ONE_WEIGHT_TILES) at 32 columns x 8 slices 0.801, K steps of 32 0.797.
# tests/gpu/test_projection_gpu.py -k "cuda_cores or one_token" passes on the H100.
ONE_ROW_ON_CUDA_CORES = True
ONE_ROW_TILES = ProjectionTiles(block_n=64, step_k=64, num_warps=4, num_stages=1, min_programs=1024, k_slices=16,
                                cuda_cores=True)
ONE_ROW_ONE_WEIGHT_TILES = ONE_ROW_TILES  # one-row calls of one weight (o_proj), tunable apart
# One-row calls of weights stored [N, K] (`project(weight_rows=True)`, torch's Linear layout): `block_n` whole
# weight rows (output columns) per program, read as K steps of `step_k` contiguous elements, K never split, so
# each program finishes its outputs (norm scale, rounding, residual) and no partial sums go to the next kernel.
# Why: benchmarks/gemv_layout.py on an H100 (fifty-eighth session), GPU time per link of a dependent chain with
# one XLA glue kernel each: a Pallas gemv of whole 4 KB rows streamed the KDA input projections' 26.3 MB in 11.5 us
# against 13.2 for `project` over the [K, N] weights (the model's groups, one-row CUDA-core tiles), 8.4 MB in 5.7
# against 6.4, 14.9 MB in 7.9 against 8.9; this path (with the norm, the rounding and the model's groups) in 12.5,
# 6.0 and 8.2. The model stores its weights so (`model.linear.WEIGHT_ROWS`, on: measured in the model there).
# Tiles: 4 rows in K steps of 512 at 4 warps. In that chain 2 rows had looked as good (12.53 us for 26.3 MB, 4 rows
# 12.59), but in the model, where the layer input comes as float32 sums and every program reads all of it and the
# norm weight beside its rows, 4 rows halve that side traffic: decode_profile.py --experts mxfp4 --batches 1 on one
# H100 (sixtieth session), GPU kernels 0.783-0.785 ms per token against 0.795 x2 with 2 rows and 0.815-0.818 with
# 8; 4 rows with K steps of 256 / 1024 or 8 warps 0.786-0.790. o_proj (one weight) 4 rows too (8: 0.797).
WEIGHT_ROWS_TILES = ProjectionTiles(block_n=4, step_k=512, num_warps=4, num_stages=1, min_programs=1, k_slices=1,
                                    cuda_cores=True)
WEIGHT_ROWS_ONE_WEIGHT_TILES = WEIGHT_ROWS_TILES  # one-weight calls (o_proj), tunable apart


def default_tiles(weights: int, rows: int, weight_rows: bool = False) -> ProjectionTiles:
    """The tiles `project` takes for a call of this many weights and rows when it is given none (`weight_rows`:
    weights stored [N, K])."""
    if rows == 1 and weight_rows:
        return WEIGHT_ROWS_ONE_WEIGHT_TILES if weights == 1 else WEIGHT_ROWS_TILES
    if rows == 1 and ONE_ROW_ON_CUDA_CORES:
        return ONE_ROW_ONE_WEIGHT_TILES if weights == 1 else ONE_ROW_TILES
    return ONE_WEIGHT_TILES if weights == 1 else TILES


@functools.partial(jax.tree_util.register_dataclass, data_fields=["sums", "squares"],
                   meta_fields=["k_dim", "eps", "dtype"])
@dataclass(frozen=True)
class Partials:
    """One group's output of `project(finish=False)` with K split in S slices, before the slices are added up:
    sums [S, M, N] float32 (x times the norm weight, or x, times W over each slice); squares [S, M] float32 (the
    rows' sums of squares over each slice: the norm's statistics) or None without a norm. The group's output is
    `finished(self)`: round(sum over S of sums * rsqrt(sum over S of squares / k_dim + eps)) in `dtype`."""

    sums: jax.Array
    squares: jax.Array | None
    k_dim: int
    eps: float
    dtype: str

    @property
    def slices(self) -> int:
        return self.sums.shape[0]


Projected = jax.Array | Partials  # what a group of `project` comes back as


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "squares"],
                   meta_fields=["head_dim", "eps", "dtype"])
@dataclass(frozen=True)
class HeadScaled:
    """Rows still to be scaled per head: values [M, K] float32; squares [M, G * P] float32, P partial sums of squares
    for each of the G = K / head_dim heads (head g's at columns g * P ..). `finished(self)` is round(values *
    rsqrt(sum of the head's P squares / head_dim + eps)) in `dtype`: an RMSNorm over each head whose weight (and
    gate) the values already carry."""

    values: jax.Array
    squares: jax.Array
    head_dim: int
    eps: float
    dtype: str

    @property
    def parts(self) -> int:
        return self.squares.shape[1] * self.head_dim // self.values.shape[1]

    def scales(self) -> jax.Array:
        """[M, K] float32: each column's head's 1 / rms."""
        rows, k_dim = self.values.shape
        heads = k_dim // self.head_dim
        ms = jnp.sum(self.squares.reshape(rows, heads, self.parts), axis=-1) / self.head_dim
        return jnp.repeat(jax.lax.rsqrt(ms + self.eps), self.head_dim, axis=1)


def finished(out: Projected | HeadScaled, residual: jax.Array | None = None) -> jax.Array:
    """A group's output as `project` returns it by default: `Partials` added up over their slices, scaled by the
    norm's 1 / rms, rounded to their dtype (plus `residual`, rounded again); `HeadScaled` rows scaled and rounded;
    an array as it is (plus `residual`)."""
    if isinstance(out, HeadScaled):
        out = (out.values * out.scales()).astype(out.dtype)
    elif isinstance(out, Partials):
        total = jnp.sum(out.sums, axis=0)
        if out.squares is not None:
            total = total * jax.lax.rsqrt(jnp.sum(out.squares, axis=0) / out.k_dim + out.eps)[:, None]
        out = total.astype(out.dtype)
    return out if residual is None else residual.astype(out.dtype) + out


def partials_operands(parts: Partials) -> tuple[list[jax.Array], tuple[int, float, bool, str]]:
    """A `Partials`' kernel operands (its sums, then its squares where it has them) and the static layout
    `partials_loader` reads them with."""
    squares = [] if parts.squares is None else [parts.squares]
    return [parts.sums, *squares], (parts.k_dim, parts.eps, bool(squares), parts.dtype)


def operand_count(layout: tuple[int, float, bool, str] | None) -> int:
    """How many kernel operands one projection output takes: 1 for a plain array (`layout` None), else the sums and,
    where the `partials_operands` layout has them, the squares."""
    return 1 if layout is None else 1 + layout[2]


def partials_loader(refs, rows, layout: tuple[int, float, bool, str] | None):
    """In a consumer kernel: a function (columns -> those columns of rows `rows`, finished as `finished` does: the
    float32 sums over the slices, times the norm's 1 / rms where there are squares, rounded to the Partials' dtype)
    for a `Partials` handed over unfinished (refs: `partials_operands`' operands, layout its layout), or, with
    `layout` None, for a finished output (refs: the array [M, N]; the columns as they are). `rows`: a row (an int or
    a scalar), a `pl.ds` of rows or an int32 vector of rows; the rows' squares are loaded once, here."""
    fetch = partials_fetcher(refs, rows, layout)
    return lambda cols: fetch(cols)()


def partials_fetcher(refs, rows, layout: tuple[int, float, bool, str] | None):
    """`partials_loader` in two phases: `fetch(cols)` issues the loads of those columns' slices and returns a function
    that finishes them (the slices' sum, the norm's scale, the rounding; a finished output's values as loaded). A
    kernel can so issue all its loads before any finishing arithmetic, whose sums across the program's threads would
    hold each later load behind their barriers (one round trip to memory after another)."""
    if layout is None:
        def fetch_finished(cols):
            values = refs[0][rows, cols]
            return lambda: values
        return fetch_finished
    k_dim, eps, has_squares, dtype = layout
    n_slices = refs[0].shape[0]
    row_vector = bool(getattr(rows, "ndim", 0))
    several = row_vector or isinstance(rows, pl.Slice)  # rows' scales then broadcast over the columns

    def loaded(ref, *index):  # the slices' values: one [S, ...] block, or S blocks for a row vector
        if row_vector:  # Triton's lowering cannot broadcast a row vector between two slices of a load
            return [ref[(s, rows) + index] for s in range(n_slices)]
        return ref[(pl.ds(0, n_slices), rows) + index]

    def added(parts):
        return functools.reduce(jnp.add, parts) if row_vector else jnp.sum(parts, axis=0)

    squares = loaded(refs[1]) if has_squares else None

    def fetch(cols):
        parts = loaded(refs[0], cols)

        def finish():
            total = added(parts)
            if squares is None:
                return total.astype(dtype)
            scale = jax.lax.rsqrt(added(squares) / k_dim + eps)
            return (total * (scale[..., None] if several else scale)).astype(dtype)

        return finish

    return fetch


@dataclass(frozen=True)
class _Block:
    """Programs [start, start + count) run weight `weight` of group `group`, `width` columns each, written at
    column `column` + (program - start) * width of the group's output."""

    weight: int
    group: int
    column: int
    width: int
    start: int
    count: int



def _plan(widths: list[tuple[int, int, int]], k_steps: int, tiles: ProjectionTiles) -> tuple[tuple[_Block, ...], int]:
    """(program blocks, K slices) for weights given as (group, column in the group, N) over `k_steps` K steps."""
    blocks, start = [], 0
    for i, (group, column, n) in enumerate(widths):
        size = tiling.pow2_divisor(n, tiles.block_n)
        blocks.append(_Block(i, group, column, size, start, n // size))
        start += n // size
    slices = 1
    while slices * 2 <= tiles.k_slices and k_steps % (slices * 2) == 0 and start * slices < tiles.min_programs:
        slices *= 2
    return tuple(blocks), slices


def _slicing(rows: int, k_dim: int, head_dim: int | None, groups, tiles: ProjectionTiles, weight_rows: bool):
    """A call's layout: (its weights as (group, column in the group, N), the K step, the program blocks, the K
    slices) for x [rows, k_dim] (`HeadScaled` rows of heads of `head_dim`: a K step lies within one head)."""
    widths = [(g, sum(out_width(w, weight_rows) for w in group[:i]), out_width(w, weight_rows))
              for g, group in enumerate(groups) for i, w in enumerate(group)]
    sk = tiling.pow2_divisor(head_dim or k_dim, tiles.step_k)
    return (widths, sk, *_plan(widths, k_dim // sk, tiles))


def _row_shape(x: jax.Array | HeadScaled) -> tuple[int, int, int | None]:
    """(M, K, head_dim) of x [M, K], or of `HeadScaled` rows (head_dim None for plain rows)."""
    if isinstance(x, HeadScaled):
        return (*x.values.shape, x.head_dim)
    return (*x.shape, None)


def _call_tiles(x: jax.Array | HeadScaled, groups, weight_rows: bool) -> ProjectionTiles:
    """`default_tiles` for a call of x [M, K] (or `HeadScaled` rows) and these groups of weights."""
    return default_tiles(sum(len(group) for group in groups), _row_shape(x)[0], weight_rows)


def splits_k(x: jax.Array | HeadScaled, groups: tuple[tuple[jax.Array, ...], ...], *,
             tiles: ProjectionTiles | None = None, weight_rows: bool = False) -> bool:
    """Whether the kernel's `project(x, groups, tiles=, weight_rows=)` splits K: with `finish=False` its groups come
    back as `Partials`, and a residual is added after the kernel (by XLA) instead of in it. Shapes only."""
    return _slicing(*_row_shape(x), groups, tiles or _call_tiles(x, groups, weight_rows), weight_rows)[3] > 1


def supported(rows: int, k_dim: int, widths: tuple[int, ...]) -> bool:
    """Whether the kernel takes x [rows, k_dim] times weights of these widths: rows a power of two up to
    `MAX_ROWS`, K and every width multiples of 16 (Triton dot blocks)."""
    return (0 < rows <= MAX_ROWS and rows & (rows - 1) == 0 and k_dim % 16 == 0 and bool(widths)
            and all(n % 16 == 0 for n in widths))


def out_width(w: jax.Array, weight_rows: bool) -> int:
    """A weight's output columns: N of [K, N], or of [N, K] with `weight_rows`."""
    return w.shape[0] if weight_rows else w.shape[1]


def _weight_block(w_ref, k0, sk, n0, width, weight_rows: bool):
    """A program's block of weight w at K rows k0.. and output columns n0.., as stored: [sk, width] of [K, N], or
    [width, sk] of [N, K] with `weight_rows`."""
    return w_ref[pl.ds(n0, width), pl.ds(k0, sk)] if weight_rows else w_ref[pl.ds(k0, sk), pl.ds(n0, width)]


def _check(x, groups, norm_weight, residual, weight_rows: bool = False):
    if isinstance(x, HeadScaled):
        if x.values.ndim != 2 or x.values.shape[1] % x.head_dim or x.squares.shape[0] != x.values.shape[0] \
                or (x.squares.shape[1] * x.head_dim) % x.values.shape[1]:
            raise ValueError(f"projection: head-scaled rows {x.values.shape} with squares {x.squares.shape} do not "
                             f"split into heads of {x.head_dim}")
        if norm_weight is not None:
            raise ValueError("projection: head-scaled rows take no norm weight")
        x = jax.ShapeDtypeStruct(x.values.shape, x.dtype)
    if x.ndim != 2:
        raise ValueError(f"projection: x must be [rows, K], got {x.shape}")
    rows, k_dim = x.shape
    if not groups or not all(groups):
        raise ValueError("projection: needs at least one group of at least one weight")
    dtype = groups[0][0].dtype
    if x.dtype != dtype and x.dtype != jnp.float32:
        raise ValueError(f"projection: x is {x.dtype}; takes the weights' {dtype}, or float32 rows (rounded to it)")
    for g, group in enumerate(groups):
        for i, w in enumerate(group):
            if w.ndim != 2 or w.shape[1 if weight_rows else 0] != k_dim or w.dtype != dtype:
                need = f"[N, {k_dim}] (weight rows)" if weight_rows else f"[{k_dim}, N]"
                raise ValueError(f"projection: group {g} weight {i} is {w.dtype}{list(w.shape)}; x {x.dtype}"
                                 f"{list(x.shape)} needs {dtype}{need} (the first weight's dtype)")
    if norm_weight is not None and norm_weight.shape != (k_dim,):
        raise ValueError(f"projection: norm weight {norm_weight.shape} for {k_dim} features")
    if residual is not None:
        if len(groups) != 1 or len(groups[0]) != 1:
            raise ValueError("projection: a residual needs exactly one group of one weight")
        out = (rows, out_width(groups[0][0], weight_rows))
        if residual.shape != out:
            raise ValueError(f"projection: residual {residual.shape} for output {out}")
        if residual.dtype not in (dtype, jnp.float32):
            raise ValueError(f"projection: residual {residual.dtype}; takes {dtype} or float32 (rounded to it)")


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight * (x / rms(x)) over the last axis as `model.norms.RMSNorm` computes it: statistics in float32, rounded
    to x's dtype before and after the weight (the XLA form of the kernels' input norms)."""
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return (weight * normed).astype(x.dtype)


def reference(x: jax.Array, groups: tuple[tuple[jax.Array, ...], ...], *, norm_weight: jax.Array | None = None,
              eps: float = 1e-6, residual: jax.Array | None = None, finish: bool = True,
              weight_rows: bool = False) -> tuple[jax.Array, ...]:
    """The XLA form of `project`: the norm, one product per weight, each group's outputs concatenated (finished
    arrays whatever `finish` says: a consumer of `project(finish=False)` takes those too)."""
    _check(x, groups, norm_weight, residual, weight_rows)
    if isinstance(x, HeadScaled):
        x = finished(x)
    x = x.astype(groups[0][0].dtype)  # float32 rows: rounded as the kernel loads them
    h = x if norm_weight is None else rms_norm(x, norm_weight, eps)
    dot = (lambda w: jax.lax.dot_general(h, w, (((1,), (1,)), ((), ())))) if weight_rows else (lambda w: jnp.dot(h, w))
    outs = tuple(jnp.concatenate([dot(w) for w in group], axis=-1) if len(group) > 1 else dot(group[0])
                 for group in groups)
    if residual is not None:
        outs = (residual.astype(outs[0].dtype) + outs[0],)
    return outs


def _vector_products(x_ref, heads_ref, norm_ref, w_ref, *, k_starts, sk, n0, width, dtype, head_scaled,
                     weight_rows=False):
    """One row's products on the CUDA cores: ([width] float32 sums of x's row 0 (rounded to `dtype` as the MMA path
    rounds it: normed, or head-scaled) times w [K, N] at columns n0.., over the K steps starting at `k_starts`; the
    row's float32 sum of squares over them, 0.0 without a norm). Every load (each step's weight block, x, the norm
    weight or the heads' squares) is issued before any arithmetic, so the program's whole slice is in flight at
    once; the products add up elementwise in a [sk, width] tile, and the only sums across threads (over K, and the
    squares) come at the end, after the loads. `weight_rows`: w is [N, K], its blocks [width, sk] (each output's K
    contiguous), the tile [width, sk]."""
    blocks = [_weight_block(w_ref, k0, sk, n0, width, weight_rows) for k0 in k_starts]
    k_axis = 1 if weight_rows else 0  # the blocks' K axis: the products sum over it
    xs = [x_ref[0, pl.ds(k0, sk)] for k0 in k_starts]
    if head_scaled:
        head_dim, parts, head_eps = head_scaled
        heads = [heads_ref[0, pl.ds(pl.multiple_of(k0 // head_dim * parts, parts), parts)] for k0 in k_starts]
    norms = [norm_ref[pl.ds(k0, sk)] for k0 in k_starts] if norm_ref is not None else None
    tile, squares = jnp.zeros(blocks[0].shape, jnp.float32), jnp.zeros((sk,), jnp.float32)
    for i, (block, xv) in enumerate(zip(blocks, xs)):
        if head_scaled:  # float32 values times their head's 1 / rms (a step lies within one head)
            xv = xv * jax.lax.rsqrt(jnp.sum(heads[i]) / head_dim + head_eps)
        else:
            xv = xv.astype(dtype).astype(jnp.float32)  # float32 rows of 16-bit weights: rounded as they load
            if norms is not None:
                squares = squares + xv * xv
                xv = norms[i].astype(jnp.float32) * xv
        xv = xv.astype(dtype).astype(jnp.float32)
        tile = tile + block.astype(jnp.float32) * jnp.expand_dims(xv, 1 - k_axis)
    return jnp.sum(tile, axis=k_axis), (jnp.sum(squares) if norms is not None else 0.0)


def _kernel(*refs, n_weights, n_groups, blocks, rows, k_dim, sk, steps, has_norm, has_residual, eps, head_scaled,
            vector=False, weight_rows=False):
    x_ref, refs = refs[0], refs[1:]
    heads_ref, refs = (refs[0], refs[1:]) if head_scaled else (None, refs)  # [M, G * P] the heads' squares
    norm_ref = refs[0] if has_norm else None
    res_ref = refs[has_norm] if has_residual else None
    w_refs = refs[has_norm + has_residual:has_norm + has_residual + n_weights]
    out_refs = refs[-n_groups:]
    dtype = w_refs[0].dtype
    pid, part = pl.program_id(0), pl.program_id(1)  # column block, K slice
    partial = len(out_refs[0].shape) == 3  # [slices, M, N] float32 partial sums
    squares_ref = refs[-n_groups - 1] if partial and has_norm else None  # [slices, M] the rows' partial squares
    if rows == BLOCK_ROWS:
        row_index = pl.ds(0, BLOCK_ROWS)
    else:  # spare rows repeat the last one: the same loads, the same values stored twice
        row_index = jnp.minimum(jax.lax.broadcasted_iota(jnp.int32, (BLOCK_ROWS,), 0), rows - 1)

    def x_block(k0):
        block = x_ref[row_index, pl.ds(k0, sk)]
        # float32 rows of 16-bit weights: rounded as they load (not HeadScaled values, which are float32 by design)
        return block.astype(dtype) if head_scaled is None and x_ref.dtype != dtype else block

    if head_scaled:  # float32 values times their head's 1 / rms (a block lies within one head), rounded
        head_dim, parts, head_eps = head_scaled

        def load(k0):
            squares = heads_ref[row_index, pl.ds(pl.multiple_of(k0 // head_dim * parts, parts), parts)]
            scale = jax.lax.rsqrt(jnp.sum(squares, axis=1) / head_dim + head_eps)
            return (x_block(k0) * scale[:, None]).astype(dtype), 0.0
    elif has_norm:  # x * weight per block; the rows' mean squares summed on the way, the 1 / rms applied at the end
        def load(k0):
            xb = x_block(k0).astype(jnp.float32)
            return (norm_ref[pl.ds(k0, sk)].astype(jnp.float32)[None, :] * xb).astype(dtype), jnp.sum(xb * xb, 1)
    else:
        load = lambda k0: (x_block(k0), 0.0)

    def products(block: _Block, n0):
        """This program's float32 sums [R, width], the rows' squares [R] (zeros without a norm) and the R rows
        they are stored at: the 16-row MMA block, or one row on the CUDA cores (`_vector_products`)."""
        w_ref = w_refs[block.weight]
        if vector:
            k_starts = [pl.multiple_of((part * steps + i) * sk, sk) for i in range(steps)]
            acc, squares = _vector_products(x_ref, heads_ref, norm_ref, w_ref, k_starts=k_starts, sk=sk, n0=n0,
                                            width=block.width, dtype=dtype, head_scaled=head_scaled,
                                            weight_rows=weight_rows)
            return acc[None, :], jnp.full((1,), squares, jnp.float32), pl.ds(0, 1)

        def step(i, carry):
            acc, squares = carry
            k0 = pl.multiple_of((part * steps + i) * sk, sk)
            xb, xx = load(k0)
            w_block = _weight_block(w_ref, k0, sk, n0, block.width, weight_rows)
            return acc + tiling.mm(xb, w_block.T if weight_rows else w_block), squares + xx

        zeros = jnp.zeros((BLOCK_ROWS, block.width), jnp.float32), jnp.zeros((BLOCK_ROWS,), jnp.float32)
        return *jax.lax.fori_loop(0, steps, step, zeros), row_index

    def run(block: _Block):
        n0 = pl.multiple_of((pid - block.start) * block.width, block.width)
        acc, squares, rows_at = products(block, n0)
        column = pl.multiple_of(block.column + n0, block.width)
        if partial:  # the slice's sums (and, from its first program, the slice's squares) for XLA to add up
            out_refs[block.group][part, rows_at, pl.ds(column, block.width)] = acc
            if has_norm:
                @pl.when(pid == 0)
                def _():
                    squares_ref[part, rows_at] = squares
            return
        if has_norm:
            acc = acc * jax.lax.rsqrt(squares / k_dim + eps)[:, None]
        out = acc.astype(dtype)
        if has_residual:
            out = (res_ref[rows_at, pl.ds(n0, block.width)].astype(dtype).astype(jnp.float32)
                   + out.astype(jnp.float32)).astype(dtype)
        out_refs[block.group][rows_at, pl.ds(column, block.width)] = out

    for block in blocks:
        pl.when((pid >= block.start) & (pid < block.start + block.count))(functools.partial(run, block))


def project(x: jax.Array | HeadScaled, groups: tuple[tuple[jax.Array, ...], ...], *,
            norm_weight: jax.Array | None = None, eps: float = 1e-6, residual: jax.Array | None = None,
            tiles: ProjectionTiles | None = None, interpret: bool = False,
            finish: bool = True, weight_rows: bool = False) -> tuple[Projected, ...]:
    """x [M, K] (or `HeadScaled` rows) -> one array [M, sum of the group's N] of the weights' dtype per group (see
    the module docstring). Needs `supported(M, K, widths)`. `finish` False (no residual): where K is split, each
    group comes back as its `Partials` (`finished` makes the array of them). Without `tiles`, `default_tiles` picks
    them here, outside the jitted kernel call, so a change of the module's tiles or switches takes effect at the next
    trace of the caller (inside the jit they would stay as its cache first saw them). `weight_rows`: every weight
    stored [N_i, K] instead of [K, N_i]."""
    tiles = tiles or _call_tiles(x, groups, weight_rows)
    return _project(x, groups, norm_weight=norm_weight, eps=eps, residual=residual, tiles=tiles,
                    interpret=interpret, finish=finish, weight_rows=weight_rows)


@functools.partial(jax.jit, static_argnames=("eps", "tiles", "interpret", "finish", "weight_rows"))
def _project(x: jax.Array | HeadScaled, groups: tuple[tuple[jax.Array, ...], ...], *, norm_weight: jax.Array | None,
             eps: float, residual: jax.Array | None, tiles: ProjectionTiles, interpret: bool,
             finish: bool, weight_rows: bool = False) -> tuple[Projected, ...]:
    """`project` with its tiles chosen."""
    _check(x, groups, norm_weight, residual, weight_rows)
    if residual is not None and not finish:
        raise ValueError("projection: a residual is added by finished; project(finish=False) takes none")
    rows, k_dim, head_dim = _row_shape(x)
    head_scaled = None
    if isinstance(x, HeadScaled):
        head_scaled = (x.head_dim, x.parts, float(x.eps))
        x, head_squares = x.values, x.squares
    dtype = groups[0][0].dtype
    widths, sk, blocks, slices = _slicing(rows, k_dim, head_dim, groups, tiles, weight_rows)
    if not supported(rows, k_dim, tuple(n for _, _, n in widths)):
        raise ValueError(f"projection kernel: {rows} rows x {k_dim} features into widths "
                         f"{[n for _, _, n in widths]} not supported (rows a power of two <= {MAX_ROWS}, "
                         "K and widths multiples of 16)")
    vector = tiles.cuda_cores and rows == 1
    residual_in_kernel = residual is not None and slices == 1  # else XLA adds it after the partial sums
    kernel = functools.partial(_kernel, n_weights=len(widths), n_groups=len(groups), blocks=blocks, rows=rows,
                               k_dim=k_dim, sk=sk, steps=k_dim // sk // slices, has_norm=norm_weight is not None,
                               has_residual=residual_in_kernel, eps=float(eps), head_scaled=head_scaled,
                               vector=vector, weight_rows=weight_rows)
    operands = [x, *([] if head_scaled is None else [head_squares]),
                *([norm_weight] if norm_weight is not None else []), *([residual] if residual_in_kernel else []),
                *(w for group in groups for w in group)]
    widths_out = [sum(n for group, _, n in widths if group == g) for g in range(len(groups))]
    out_shape = [jax.ShapeDtypeStruct((rows, n), dtype) if slices == 1 else
                 jax.ShapeDtypeStruct((slices, rows, n), jnp.float32) for n in widths_out]
    partial_squares = slices > 1 and norm_weight is not None
    if partial_squares:
        out_shape = [jax.ShapeDtypeStruct((slices, rows), jnp.float32)] + out_shape
    outs = tiling.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(sum(b.count for b in blocks), slices),
        compiler_params=tiling.compiler_params(tiles.num_warps, tiles.num_stages),
        interpret=interpret,
        name="decode_projection" if len(widths) > 1 else "decode_projection_one_weight",
    )(*operands)
    if slices == 1:
        return tuple(outs)
    squares = None
    if partial_squares:
        squares, *outs = outs
    parts = tuple(Partials(o, squares, k_dim, float(eps), jnp.dtype(dtype).name) for o in outs)
    if not finish:
        return parts
    return (finished(parts[0], residual),) if residual is not None else tuple(map(finished, parts))


def by_kind(kind: str):
    """The `project`-signature callable for a `choose` result: `reference`, or the kernel (interpret mode for
    "interpret")."""
    return reference if kind == "reference" else functools.partial(project, interpret=kind == "interpret")


def choose(rows: int, k_dim: int, widths: tuple[int, ...], impl: str | None = None) -> str:
    """"pallas" / "interpret" where dispatch picks the kernel and it takes these shapes (at most `CHOOSE_MAX_ROWS`
    rows unless `impl` forces it), else "reference"."""
    kind = dispatch.choose("projection", ("reference", "pallas"), impl, gpu_verified=GPU_VERIFIED)
    if kind == "reference" or not supported(rows, k_dim, widths):
        return "reference"
    return kind if impl is not None or rows <= CHOOSE_MAX_ROWS else "reference"
