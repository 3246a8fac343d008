"""Whether a one-row projection streams faster from its weight stored [N, K] (each output's K contiguous) than from
the [K, N] layout `kernels.projection` reads today.

    python3 benchmarks/gemv_layout.py [--shapes 2048x6416,2048x2048] [--results PATH]

Each variant runs as read_floor.py's links do: a jitted chain over distinct weights (more bytes than L2 holds), each
link's input taking the previous output's first element times 0 (one small XLA kernel between links, the same in
every variant), timed as GPU time per link from the profiler's trace:

- `projection`: `kernels.projection.project` of one row with the input norm, K split (`default_tiles`: today's
  one-row CUDA-core tiles), partial sums left unfinished, as the model's KDA input projections run;
- `rows_R_wW`: a Pallas kernel over the weight stored [N, K], R whole output rows per program (K contiguous, no K
  split, so the outputs come finished), W warps;
- `loop_RxS_wW_sN`: the same with each program walking S blocks of R rows in a loop (N pipeline stages);
- `kn_BKxBN_wW`: a Pallas kernel over [K, N] blocks of BK x BN as the projection kernel reads them (K split,
  float32 partial sums), without its norm or groups;
- `projection_rows_R_kS_wW`: `project(weight_rows=True)` over the same groups stored [N, K]: R whole weight rows
  per program in K steps of S, W warps, outputs finished in the kernel; with `WEIGHT_ROWS_TILES` also without the
  norm (`_default_no_norm`) and over the whole width as one weight (`_default_one_weight`: one branch per program);
- `xla_dot`: XLA's product of the [N, K] weight and the row.

The batch-1 step's KDA input projections (2048 x 6416, 26.3 MB) took ~12.2 us on an H100 where XLA's row reduction
of as many bytes takes ~10.3 (read_floor.py); the question is whether the layout accounts for the difference.
Appends one line to RESULTS.md. Figures and their reading: benchmarks/NOTES_serving.md (fifty-eighth session).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dayzero.kernels import projection, tiles  # noqa: E402
import results  # noqa: E402  (benchmarks/)
from read_floor import chain_length, link_figures, time_us  # noqa: E402

ROW_VARIANTS = ((1, 4), (2, 2), (2, 4), (4, 4), (1, 8), (2, 8))  # (rows, warps)
LOOP_VARIANTS = ((2, 4, 4, 3),)  # (rows, steps, warps, stages)
# the model's groups of output columns for a weight width (the KDA layer's q|k|v and f_a|g_a|b, the MLA layer's
# query and latent projections); other widths: one weight
ROWS_PROJECTION_VARIANTS = ((1, 2048, 4), (2, 512, 4), (2, 2048, 2), (4, 512, 4), (1, 512, 2))  # R, step_k, warps
KN_VARIANTS = ((128, 64, 4), (256, 64, 4), (128, 128, 4), (64, 128, 4), (2048, 16, 4))  # [K, N] blocks, warps
GROUPS = {6416: ((2048, 2048, 2048), (128, 128, 16)), 3648: ((3072,), (576,))}


def rows_gemv(w: jax.Array, x: jax.Array, *, rows: int, num_warps: int, interpret: bool = False) -> jax.Array:
    """w [N, K] bf16, x [K] float32 -> w @ x [N] float32, `rows` whole rows of w per program."""
    n, k = w.shape

    def kernel(w_ref, x_ref, y_ref):
        r0 = pl.multiple_of(pl.program_id(0) * rows, rows)
        block = w_ref[pl.ds(r0, rows), pl.ds(0, k)].astype(jnp.float32)
        y_ref[pl.ds(r0, rows)] = jnp.sum(block * x_ref[pl.ds(0, k)][None, :], axis=1)

    return tiles.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=(n // rows,),
                             compiler_params=tiles.compiler_params(num_warps, 1), interpret=interpret,
                             name="gemv_rows")(w, x)


def kn_blocks_gemv(w: jax.Array, x: jax.Array, *, block_k: int, block_n: int, num_warps: int,
                   interpret: bool = False) -> jax.Array:
    """w [K, N] bf16, x [K] float32 -> the partial sums [K / block_k, N] float32 of x @ w over K slices, one
    [block_k, block_n] block per program: the projection kernel's one-row tiling without its norm, residual or
    layout of several weights."""
    k, n = w.shape
    slices = k // block_k

    def kernel(w_ref, x_ref, y_ref):
        c0 = pl.multiple_of(pl.program_id(0) * block_n, block_n)
        k0 = pl.multiple_of(pl.program_id(1) * block_k, block_k)
        block = w_ref[pl.ds(k0, block_k), pl.ds(c0, block_n)].astype(jnp.float32)
        y_ref[pl.program_id(1), pl.ds(c0, block_n)] = jnp.sum(block * x_ref[pl.ds(k0, block_k)][:, None], axis=0)

    return tiles.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((slices, n), jnp.float32),
                             grid=(n // block_n, slices), compiler_params=tiles.compiler_params(num_warps, 1),
                             interpret=interpret, name="gemv_kn_blocks")(w, x)


def dependent_chain(link, first_x):
    """A jitted function of a list of each link's weights: y = link(weights, x) link after link, x starting as
    first_x(the first link's weights) and taking the previous y's first element times 0 (one small XLA kernel between
    links, as in read_floor.py's chains); returns the last y."""

    @jax.jit
    def chain(weights):
        x, y = first_x(weights[0]), None
        for w in weights:
            y = link(w, x)
            x = x + (y.reshape(-1)[0] * 0.0).astype(x.dtype)
        return y

    return chain


def ones_row(k_axis: int, dtype=jnp.float32):
    """first_x for `dependent_chain`: ones along a weight's K axis."""
    return lambda w: jnp.ones((w.shape[k_axis],), dtype)


def kn_chain(block_k: int, block_n: int, num_warps: int, interpret: bool = False):
    link = lambda w, x: kn_blocks_gemv(w, x, block_k=block_k, block_n=block_n, num_warps=num_warps,
                                       interpret=interpret)
    return dependent_chain(link, ones_row(0))


def looped_gemv(w: jax.Array, x: jax.Array, *, rows: int, steps: int, num_warps: int, num_stages: int,
                interpret: bool = False) -> jax.Array:
    """`rows_gemv` with each program walking `steps` blocks of `rows` rows in a loop (Triton may pipeline the
    next block's loads with `num_stages` > 1)."""
    n, k = w.shape
    span = rows * steps

    def kernel(w_ref, x_ref, y_ref):
        x_row = x_ref[pl.ds(0, k)][None, :]
        first = pl.program_id(0) * span

        def body(i, carry):
            r0 = pl.multiple_of(first + i * rows, rows)
            block = w_ref[pl.ds(r0, rows), pl.ds(0, k)].astype(jnp.float32)
            y_ref[pl.ds(r0, rows)] = jnp.sum(block * x_row, axis=1)
            return carry

        jax.lax.fori_loop(0, steps, body, 0)

    return tiles.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=(n // span,),
                             compiler_params=tiles.compiler_params(num_warps, num_stages), interpret=interpret,
                             name="gemv_looped")(w, x)


def rows_chain(rows: int, num_warps: int, interpret: bool = False, steps: int = 0, num_stages: int = 1):
    if steps:
        link = lambda w, x: looped_gemv(w, x, rows=rows, steps=steps, num_warps=num_warps, num_stages=num_stages,
                                        interpret=interpret)
    else:
        link = lambda w, x: rows_gemv(w, x, rows=rows, num_warps=num_warps, interpret=interpret)
    return dependent_chain(link, ones_row(1))


def xla_chain():
    return dependent_chain(lambda w, x: jnp.dot(w, x, preferred_element_type=jnp.float32),
                           ones_row(1, jnp.bfloat16))


def projection_chain(interpret: bool = False, rows_tiles: projection.ProjectionTiles | None = None,
                     norm: bool = True):
    """`project` over each link's weights as the model's groups (`split_columns`); with `rows_tiles`, the weights
    stored [N, K] (`project(weight_rows=True)`) and those tiles; `norm` False: without the input norm."""
    weight_rows = rows_tiles is not None

    def link(groups, x):
        norm_weight = jnp.ones(x.shape[1:], jnp.bfloat16) if norm else None
        outs = projection.project(x, groups, norm_weight=norm_weight, eps=1e-5, finish=False, interpret=interpret,
                                  weight_rows=weight_rows, tiles=rows_tiles)
        return outs[0].sums if isinstance(outs[0], projection.Partials) else outs[0]

    first_x = lambda groups: jnp.ones((1, groups[0][0].shape[1 if weight_rows else 0]), jnp.bfloat16)
    return dependent_chain(link, first_x)


def split_columns(w: jax.Array) -> tuple[tuple[jax.Array, ...], ...]:
    """w [K, N] -> the model's groups of weights for width N (`GROUPS`), slices of w (one weight otherwise)."""
    widths = GROUPS.get(w.shape[1], ((w.shape[1],),))
    groups, start = [], 0
    for group in widths:
        ws = []
        for width in group:
            ws.append(w[:, start:start + width])
            start += width
        groups.append(tuple(ws))
    return tuple(groups)


def measure_shape(k: int, n: int, chain_mb: float, key: jax.Array) -> dict:
    """Every variant's GPU time per link (us) for one [K, N] weight shape."""
    nbytes = k * n * 2
    count = chain_length(nbytes, chain_mb * 1e6)
    keys = jax.random.split(key, count)
    by_variant = {}
    w_kn = [jax.random.normal(s, (k, n), jnp.bfloat16) for s in keys]
    for block_k, block_n, warps in KN_VARIANTS:
        if n % block_n == 0 and k % block_k == 0:
            by_variant[f"kn_{block_k}x{block_n}_w{warps}"] = time_us(
                link_figures(kn_chain(block_k, block_n, warps), w_kn))
    w_kn = [split_columns(w) for w in w_kn]
    by_variant["projection"] = time_us(link_figures(projection_chain(), w_kn))
    del w_kn
    w_nk = [jax.random.normal(s, (n, k), jnp.bfloat16) for s in keys]
    grouped = [tuple(tuple(a.T for a in g) for g in split_columns(w.T)) for w in w_nk]  # [N_i, K] each
    for block, step_k, warps in ROWS_PROJECTION_VARIANTS:
        tiles_ = projection.ProjectionTiles(block_n=block, step_k=step_k, num_warps=warps, num_stages=1,
                                            min_programs=1, k_slices=1, cuda_cores=True)
        by_variant[f"projection_rows_{block}_k{step_k}_w{warps}"] = time_us(
            link_figures(projection_chain(rows_tiles=tiles_), grouped))
    # where the default weight-rows tiles lose against the plain gemv: without the norm; one weight (no branches)
    tiles_ = projection.WEIGHT_ROWS_TILES
    by_variant["projection_rows_default_no_norm"] = time_us(
        link_figures(projection_chain(rows_tiles=tiles_, norm=False), grouped))
    by_variant["projection_rows_default_one_weight"] = time_us(
        link_figures(projection_chain(rows_tiles=tiles_), [((w,),) for w in w_nk]))
    del grouped
    for rows, warps in ROW_VARIANTS:
        if n % rows == 0:
            by_variant[f"rows_{rows}_w{warps}"] = time_us(link_figures(rows_chain(rows, warps), w_nk))
    for rows, steps, warps, stages in LOOP_VARIANTS:
        if n % (rows * steps) == 0:
            by_variant[f"loop_{rows}x{steps}_w{warps}_s{stages}"] = time_us(
                link_figures(rows_chain(rows, warps, steps=steps, num_stages=stages), w_nk))
    by_variant["xla_dot"] = time_us(link_figures(xla_chain(), w_nk))
    return {"k": k, "n": n, "mb": round(nbytes / 1e6, 2), "chain": count, "us_per_link": by_variant}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="2048x6416,2048x2048", help="KxN weight shapes")
    parser.add_argument("--chain-mb", type=float, default=400.0)
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    environment = results.xla_environment()
    device = jax.devices()[0]
    figures = []
    for i, (k, n) in enumerate(shapes):
        figure = measure_shape(k, n, args.chain_mb, jax.random.key(i))
        figures.append(figure)
        print(f"{k} x {n} ({figure['mb']} MB, chain of {figure['chain']}): GPU us per link {figure['us_per_link']}")
    results.append_line(args.results, (
        f"{results.line_head('gemv_layout.py', device.device_kind, environment)}: one-row projection from a [K, N] "
        f"weight (the projection kernel, K split) against [N, K] whole-row programs and XLA's dot, GPU time per "
        f"link of a dependent chain (each link with one XLA glue kernel): {json.dumps(figures)}\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
