"""Pallas (Triton) kernels on either side of absorbed MLA attention at decode, reading kv_b_proj's kernel in place.

Absorbed MLA folds W_UK (kv_b_proj's nope columns) into the queries before attention and applies W_UV (its value
columns) after it. In XLA each side is a head-batched product behind copies: the strided W_UK slice made every step
(2 MB per layer for 16 heads, 16 MB for DeepSeek-V3.2's 128), the query's nope / rope slices, and after the split
decode attention its merge (a max, an einsum, a convert) before the W_UV product. Here each side is one launch:

- `absorb_queries`: q [M, H * (nope + rope)] (the query projection's output as it comes) and the kernel w_kv
  [R, H * (nope + v)] -> q_latent [M, H, R] = per head q_nope . W_UK^T, and q_rope [M, H, E] copied out of q.
  Grid (head, block of R, block of 16 rows); each program reads its [block_r, nope] piece of W_UK once. With
  `latent_write` it also writes the step's latent cache rows, as the paged write's decode kernel would
  (`kernels.paged_pallas.store_decode_row`), program p of a row block writing its row p while its W_UK loads are in
  flight, so that write needs no launch of its own (`model.mla.LATENT_WRITE_IN_ABSORB`).
- `up_project`: the decode attention's per-split outputs (`SplitLatents`, from `sparse_mla(merge=False)`), or
  latents already merged, and w_kv -> o [M, H * v]: the splits merged with their log-sum-exp weights (rounded to
  the output dtype, as `sparse_mla.combine_normalized` does), times W_UV. Grid (head, block of v columns, row):
  a vector-matrix product without tensor cores; each program walks R in steps, loading all splits of the step
  as one [S, step] block (a first form merged them split by split inside the step: 64 dependent loads per
  program, 29 us per layer on the H200) and multiplying the merged row into its [step, block_v] weights.

`absorb_queries` takes rows in blocks of 16 (Triton's smallest dot M); spare rows repeat the last real row (the
same values stored twice), as `kernels.projection` does. `absorb_reference` / `up_project_reference` are the same
in plain XLA; `choose` picks (dispatch name "mla_absorb").
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import dispatch, paged_pallas, projection, tiles as tiling
from .sparse_mla import SplitLatents

# Whether CUDA runs the kernels by default: tests/gpu/test_mla_absorb_gpu.py passes on the H200 (2026-12-03), and
# the medium hybrid's batch-1 decode took 1.020 ms of kernels per token with them against 1.049 without
# (benchmarks/decode_profile.py, nineteenth session; up_project 5.3 us per layer against XLA's ~7.3 us of merge and
# W_UV products).
GPU_VERIFIED = True
BLOCK_ROWS = 16
# The model runs `up_project` for decode steps of at most this many rows and XLA's merge and einsum above: one
# program per row re-reads W_UV, so at 16 rows the kernel took 18.7 us per layer against XLA's ~10 (same run).
UP_PROJECT_MAX_ROWS = 2
# `up_project` programs of at most this many R steps issue all their steps' loads before any arithmetic (the medium
# hybrid's 16 heads at one row: 2 steps); longer walks keep a loop (DeepSeek's 128 heads: 16 steps of [32, 128]).
UP_HOIST_STEPS = 2


@dataclass(frozen=True)
class AbsorbTiles:
    """block_r: latent columns per `absorb_queries` program. `up_project` takes v blocks of the largest power of two
    (>= 16) that still gives about `min_programs` programs per row, and R steps of up to `step_elements` weights."""

    block_r: int = 64
    min_programs: int = 128
    step_elements: int = 4096
    num_warps: int = 4
    num_stages: int = 2
    cuda_cores: bool = False  # one-row `absorb_queries` calls multiply without the MMA; more rows ignore it


# One-row `absorb_queries` calls on the CUDA cores (`default_tiles`; off until measured on a GPU): the MMA pads the
# row to 16, while each program's [block_r, nope] piece of W_UK is read once either way. Why try it: the one-row
# projections gained that way (`projection.ONE_ROW_ON_CUDA_CORES`, fifty-seventh session), and the absorb kernel
# takes ~5 us per MLA layer on the H100 for 2 MB of W_UK, about twice one kernel's read floor at that size
# (benchmarks/read_floor.py). A/B: decode_profile.py --set kernels.mla_absorb.ONE_ROW_ON_CUDA_CORES=true.
ONE_ROW_ON_CUDA_CORES = False


def default_tiles(rows: int) -> AbsorbTiles:
    """The tiles the model passes `absorb_queries` for `rows` query rows (read outside the kernel's jit, so a
    change of the switch takes effect at the caller's next trace)."""
    return AbsorbTiles(cuda_cores=rows == 1 and ONE_ROW_ON_CUDA_CORES)


def _dims(w_kv: jax.Array, heads: int, nope: int, v_dim: int) -> int:
    """Checks w_kv [R, heads * (nope + v_dim)] -> R."""
    if w_kv.ndim != 2 or w_kv.shape[1] != heads * (nope + v_dim):
        raise ValueError(f"mla_absorb: kv_b_proj kernel {list(w_kv.shape)} is not [R, {heads} heads x "
                         f"({nope} nope + {v_dim} v)]")
    return w_kv.shape[0]


def supported(rank: int, nope: int, rope: int, v_dim: int, tiles: AbsorbTiles = AbsorbTiles()) -> bool:
    """Whether the kernels take these head sizes: nope, v_dim and the R step powers of two >= 16 (Triton dots),
    R a multiple of the step, rope a power of two (a copy)."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0
    step = tiling.pow2_divisor(rank, tiles.block_r)
    return pow2(nope) and nope >= 16 and pow2(v_dim) and v_dim >= 16 and step >= 16 and pow2(rope)


def choose(rank: int, nope: int, rope: int, v_dim: int, impl: str | None = None) -> str:
    """"pallas" / "interpret" where dispatch picks the kernels and they take these sizes, else "reference"."""
    kind = dispatch.choose("mla_absorb", ("reference", "pallas"), impl, gpu_verified=GPU_VERIFIED)
    return kind if kind != "reference" and supported(rank, nope, rope, v_dim) else "reference"


def _row_index(rows: int):
    """This program's 16 row indices (spare ones clamped to the last real row)."""
    first = pl.program_id(2) * BLOCK_ROWS
    return jnp.minimum(first + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_ROWS,), 0), rows - 1)


def absorb_reference(q: jax.Array, w_kv: jax.Array, *, heads: int, nope: int, rope: int,
                     v_dim: int) -> tuple[jax.Array, jax.Array]:
    """XLA form of `absorb_queries`."""
    rank = _dims(w_kv, heads, nope, v_dim)
    q = projection.finished(q)  # (a Partials' sums added up)
    q = q.reshape(q.shape[0], heads, nope + rope)
    w = w_kv.reshape(rank, heads, nope + v_dim)[..., :nope].astype(q.dtype)
    return jnp.einsum("mhn,rhn->mhr", q[..., :nope], w), q[..., nope:]


def _absorb_kernel(*refs, rows, nope, rope, v_dim, rank, block_r, partials, write, vector=False):
    """`partials`: q comes as a `projection.Partials` layout (its sums and squares refs first), finished as loaded.
    `write`: a `paged_pallas.DecodeWrite` whose operands come after w_kv (then the cache, aliased, not read), the
    cache rows' output after q_rope's. `vector` (one row): the products on the CUDA cores, W_UK's rows times the
    query elementwise in float32 and summed over nope, instead of the 16-row MMA."""
    n_q = projection.operand_count(partials)
    q_refs, (w_ref, *refs) = refs[:n_q], refs[n_q:]
    if write is not None:
        write_refs, refs = refs[:write.n_operands], refs[write.n_operands + 1:]
    ql_ref, qr_ref, *cache_out = refs
    h, j = pl.program_id(0), pl.program_id(1)
    index = _row_index(rows)
    # one row: loaded by its scalar index and broadcast to the dot's 16 rows after, so that the loads (a Partials'
    # slices among them) share no row-index layout conversion, whose barriers would hold each load until the one
    # before it has arrived
    load_index = 0 if rows == 1 else index
    if rows % BLOCK_ROWS == 0:  # whole blocks of rows: a slice, loaded as one block with the Partials' slices
        load_index = pl.ds(pl.multiple_of(pl.program_id(2) * BLOCK_ROWS, BLOCK_ROWS), BLOCK_ROWS)
    q_fetch = projection.partials_fetcher(q_refs, load_index, partials)
    q_at = lambda cols: q_fetch(cols)()
    q_start = pl.multiple_of(h * (nope + rope), math.gcd(nope + rope, nope))
    # the query's loads, then W_UK's, then the query finished: its sums would otherwise hold W_UK's loads behind
    # their barriers
    q_nope = q_fetch(pl.ds(q_start, nope))
    r0 = pl.multiple_of(j * block_r, block_r)
    w = w_ref[pl.ds(r0, block_r), pl.ds(pl.multiple_of(h * (nope + v_dim), math.gcd(nope + v_dim, nope)), nope)]
    q_nope = q_nope()
    if rows == 1 and not vector:
        q_nope = jnp.broadcast_to(q_nope[None, :], (BLOCK_ROWS, nope))
    if write is not None:  # the block's row p by its program p (`writes_latents`), while W_UK's loads are in flight
        p = h * pl.num_programs(1) + j
        row = pl.program_id(2) * BLOCK_ROWS + p

        @pl.when((p < BLOCK_ROWS) & (row < rows))
        def _():
            paged_pallas.store_decode_row(row, write_refs, write, cache_out[0])

    columns = pl.ds(pl.multiple_of(h * rank + r0, block_r), block_r)
    if vector:  # [block_r, nope] weights times the row, summed over nope (bf16 products exact in float32)
        products = w.astype(q_nope.dtype).astype(jnp.float32) * q_nope.astype(jnp.float32)[None, :]
        ql_ref[0, columns] = jnp.sum(products, axis=1).astype(ql_ref.dtype)
    else:
        ql_ref[index, columns] = tiling.mm_nt(q_nope, w.astype(q_nope.dtype)).astype(ql_ref.dtype)

    @pl.when(j == 0)
    def _():
        qr_ref[load_index, pl.ds(pl.multiple_of(h * rope, rope), rope)] = q_at(pl.ds(q_start + nope, rope))


def writes_latents(heads: int, rank: int, rows: int, tiles: AbsorbTiles = AbsorbTiles()) -> bool:
    """Whether `absorb_queries(latent_write=)` takes `rows` rows: each block of 16 rows needs a program per row
    among its heads x (rank / block_r) programs."""
    return heads * (rank // tiling.pow2_divisor(rank, tiles.block_r)) >= min(rows, BLOCK_ROWS)


@functools.partial(jax.jit, static_argnames=("heads", "nope", "rope", "v_dim", "tiles", "interpret"))
def absorb_queries(q: jax.Array | projection.Partials, w_kv: jax.Array, *, heads: int, nope: int, rope: int,
                   v_dim: int, tiles: AbsorbTiles = AbsorbTiles(), cache: jax.Array | None = None,
                   latent_write: paged_pallas.DecodeRows | None = None, interpret: bool = False) -> tuple:
    """q [M, heads * (nope + rope)], w_kv [R, heads * (nope + v_dim)] (kv_b_proj's kernel) -> q_latent [M, heads, R]
    in q's dtype (float32 sums of q_nope . W_UK per head), q_rope [M, heads, rope] (q's rope columns). q may come as
    the query projection's `projection.Partials` (K split, `project(finish=False)`): each program finishes the
    columns it reads as `projection.finished` does, so no XLA reduction runs between the two kernels.

    With `latent_write` (the M rows' new latent cache rows, `paged_pallas.DecodeRows`) and the paged `cache`
    [L, N, block, D] they go into, the kernel also writes them, as `paged_pallas.write`'s decode kernel does (its
    program p of each block of 16 rows writes row p: `writes_latents`), and the results go on with the cache
    (in place where its buffer is donated): the cache write needs no kernel of its own."""
    rank = _dims(w_kv, heads, nope, v_dim)
    partials = None
    if isinstance(q, projection.Partials):
        q_operands, partials = projection.partials_operands(q)
        shape, dtype = q.sums.shape[1:], jnp.dtype(q.dtype)
    else:
        q_operands, shape, dtype = [q], q.shape, q.dtype
    rows = shape[0]
    if len(shape) != 2 or shape[1] != heads * (nope + rope):
        raise ValueError(f"mla_absorb: queries {list(shape)} are not [M, {heads} x ({nope} + {rope})]")
    if not supported(rank, nope, rope, v_dim, tiles):
        raise ValueError(f"mla_absorb: head sizes nope {nope}, rope {rope}, v {v_dim}, rank {rank} not supported")
    block_r = tiling.pow2_divisor(rank, tiles.block_r)
    inputs = [*q_operands, w_kv]
    out_shape = [jax.ShapeDtypeStruct((rows, heads * rank), dtype), jax.ShapeDtypeStruct((rows, heads * rope), dtype)]
    write, aliases = None, {}
    if (cache is None) != (latent_write is None):
        raise ValueError("mla_absorb: a latent write needs both the cache and its rows")
    if latent_write is not None:
        if latent_write.positions.shape[0] != rows or not writes_latents(heads, rank, rows, tiles):
            raise ValueError(f"mla_absorb: a latent write of {latent_write.positions.shape[0]} rows with {rows} "
                             f"queries of {heads} heads (needs the same rows and `writes_latents`)")
        write_operands, write = latent_write.operands(cache)
        inputs += [*write_operands, tiling.cache_rows(cache)]
        aliases = {len(inputs) - 1: 2}
        out_shape.append(jax.ShapeDtypeStruct(inputs[-1].shape, cache.dtype))
    kernel = functools.partial(_absorb_kernel, rows=rows, nope=nope, rope=rope, v_dim=v_dim, rank=rank,
                               block_r=block_r, partials=partials, write=write, vector=tiles.cuda_cores and rows == 1)
    q_latent, q_rope, *written = tiling.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(heads, rank // block_r, -(-rows // BLOCK_ROWS)),
        input_output_aliases=aliases,
        compiler_params=tiling.compiler_params(tiles.num_warps, tiles.num_stages),
        interpret=interpret,
        name="mla_absorb_queries",
    )(*inputs)
    results = (q_latent.reshape(rows, heads, rank), q_rope.reshape(rows, heads, rope))
    return results + (written[0].reshape(cache.shape),) if written else results


def _as_split(latents: SplitLatents | jax.Array) -> SplitLatents:
    """Merged latents [M, H, R] as one split of weight 1."""
    if isinstance(latents, SplitLatents):
        return latents
    rows, heads, _ = latents.shape
    return SplitLatents(latents[:, None], jnp.zeros((rows, 1, heads), jnp.float32), heads,
                        jnp.dtype(latents.dtype).name)


def up_project_reference(latents: SplitLatents | jax.Array, w_kv: jax.Array, *, nope: int,
                         v_dim: int) -> jax.Array:
    """XLA form of `up_project`."""
    merged = latents.merged() if isinstance(latents, SplitLatents) else latents
    rows, heads, rank = merged.shape
    _dims(w_kv, heads, nope, v_dim)
    w = w_kv.reshape(rank, heads, nope + v_dim)[..., nope:].astype(merged.dtype)
    return jnp.einsum("mhr,rhv->mhv", merged, w).reshape(rows, heads * v_dim)


def _up_kernel(out_ref, lse_ref, w_ref, o_ref, *, splits, heads_p, nope, v_dim, rank, block_r, block_v):
    h, j, m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dtype = o_ref.dtype
    split_rows = (m * splits + jax.lax.broadcasted_iota(jnp.int32, (splits,), 0)) * heads_p + h  # in out / lse
    w_col = pl.multiple_of(h * (nope + v_dim) + nope + j * block_v, math.gcd(nope + v_dim, nope, block_v))

    def loads(c):  # one block_r slice of R: the splits' rows and W_UV's rows
        r0 = c * block_r if isinstance(c, int) else pl.multiple_of(c * block_r, block_r)
        return out_ref[split_rows, pl.ds(r0, block_r)], w_ref[pl.ds(r0, block_r), pl.ds(w_col, block_v)]

    steps = rank // block_r
    lse = lse_ref[split_rows]
    # with few steps, every step's loads are issued here, before the splits' weights reduce: one round trip to
    # memory, not one after each reduction's barriers
    fold = tiling.fetched_steps(steps, loads, steps <= UP_HOIST_STEPS)
    top = jnp.max(lse)
    weight = jnp.exp(lse - jnp.where(top == -jnp.inf, 0.0, top))  # 0 for splits that saw no key
    total = jnp.sum(weight)
    weight = weight * jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)

    def product(acc, parts, w):  # the splits' rows merged, rounded, times W_UV's rows
        merged = jnp.sum(weight[:, None] * parts.astype(jnp.float32), axis=0).astype(dtype).astype(jnp.float32)
        return acc + jnp.sum(merged[:, None] * w.astype(dtype).astype(jnp.float32), axis=0)

    acc = fold(lambda acc, fetched: product(acc, *fetched), jnp.zeros((block_v,), jnp.float32))
    o_ref[m, pl.ds(pl.multiple_of(h * v_dim + j * block_v, block_v), block_v)] = acc.astype(dtype)


def up_block_v(heads: int, v_dim: int, tiles: AbsorbTiles = AbsorbTiles()) -> int:
    """`up_project`'s v columns per program: the largest power of two dividing v_dim (>= 16) with about
    `min_programs` programs over the heads."""
    block = tiling.pow2_divisor(v_dim, v_dim)
    while block > 16 and heads * (v_dim // block) < tiles.min_programs:
        block //= 2
    return block


def up_block_r(rank: int, block_v: int, splits: int, tiles: AbsorbTiles = AbsorbTiles()) -> int:
    """`up_project`'s R step: a power of two dividing R with a [step, block_v] weight slice and an [S, step] block
    of split rows of at most `step_elements` each (the program holds them in float32 registers)."""
    return tiling.pow2_divisor(rank, max(16, tiles.step_elements // max(block_v, splits)))


def _pad_splits(split: SplitLatents) -> SplitLatents:
    """Split counts up to a power of two (the kernel loads all of a row's splits as one block): extra splits of
    -inf log-sum-exp, which weigh 0."""
    splits = split.out.shape[1]
    extra = tiling.pow2_at_least(splits) - splits
    if not extra:
        return split
    out = jnp.pad(split.out, ((0, 0), (0, extra), (0, 0), (0, 0)))
    lse = jnp.pad(split.lse, ((0, 0), (0, extra), (0, 0)), constant_values=-jnp.inf)
    return SplitLatents(out, lse, split.heads, split.dtype)


@functools.partial(jax.jit, static_argnames=("nope", "v_dim", "tiles", "interpret"))
def up_project(latents: SplitLatents | jax.Array, w_kv: jax.Array, *, nope: int, v_dim: int,
               tiles: AbsorbTiles = AbsorbTiles(), interpret: bool = False) -> jax.Array:
    """Decode attention's latents (`SplitLatents`, or merged [M, H, R]) and w_kv [R, H * (nope + v_dim)] -> o
    [M, H * v_dim] in the latents' dtype: the splits merged (rounded to that dtype), times W_UV per head."""
    split = _as_split(latents)
    rows, _, heads_p, rank = split.out.shape
    heads = split.heads
    if _dims(w_kv, heads, nope, v_dim) != rank:
        raise ValueError(f"mla_absorb: latents of rank {rank} for a kv_b_proj kernel of {w_kv.shape[0]} rows")
    if split.lse.shape != split.out.shape[:3]:
        raise ValueError(f"mla_absorb: log-sum-exps {split.lse.shape} for split outputs {split.out.shape}")
    if not supported(rank, nope, 16, v_dim, tiles):
        raise ValueError(f"mla_absorb: nope {nope}, v {v_dim}, rank {rank} not supported")
    split = _pad_splits(split)
    splits = split.out.shape[1]
    block_v = up_block_v(heads, v_dim, tiles)
    block_r = up_block_r(rank, block_v, splits, tiles)
    kernel = functools.partial(_up_kernel, splits=splits, heads_p=heads_p, nope=nope, v_dim=v_dim, rank=rank,
                               block_r=block_r, block_v=block_v)
    return tiling.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, heads * v_dim), jnp.dtype(split.dtype)),
        grid=(heads, v_dim // block_v, rows),
        compiler_params=tiling.compiler_params(tiles.num_warps, tiles.num_stages),
        interpret=interpret,
        name="mla_up_project",
    )(split.out.reshape(rows * splits * heads_p, rank), split.lse.reshape(-1), w_kv)
