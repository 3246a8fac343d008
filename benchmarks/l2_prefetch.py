"""Does an L2 prefetch issued by a latency-bound kernel speed up the weight-streaming kernel after it (H200)?

    python3 benchmarks/l2_prefetch.py [--results benchmarks/RESULTS.md] [--spins 1500] [--widths 2048,6144]

A chain of LAYERS (busy kernel, projection) pairs, each with its own weight W [2048, N] bf16 (8 of them: more than
L2 holds, so no weight is still cached from the call before): the busy kernel (128 programs, a dependent chain of
`spins` multiply-adds per program: a stand-in for the KDA step or the router) hands its output row to
`kernels.projection.project`, which streams W. With `--fractions`, the busy kernel also prefetches that share of
the next W into L2 (`kernels.l2_prefetch`) as it starts. Device time per pair from a profiler trace; the roofline
is W at the HBM copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dayzero.kernels import dispatch, l2_prefetch, projection, tiles as tiling

from gpu_trace import device_us_per_call  # benchmarks/gpu_trace.py
from results import append_line, git_commit  # benchmarks/results.py
from timing import hbm_copy_bandwidth  # benchmarks/timing.py

LAYERS = 8
PROGRAMS = 128
LANES = 128  # prefetch chunks per program: one per thread at 4 warps


def _busy_kernel(x_ref, scale_ref, w_ref, o_ref, *, spins, fraction, width):
    i = pl.program_id(0)
    if fraction > 0:
        total = int(w_ref.shape[0] * w_ref.shape[1] * fraction)
        chunk = tiling.round_up(-(-total * 2 // (PROGRAMS * LANES)), 16)
        offsets = l2_prefetch.chunk_offsets(total, 2, PROGRAMS, i, LANES, chunk)
        l2_prefetch.prefetch(w_ref, offsets, chunk)
    block = width // PROGRAMS
    v = x_ref[0, pl.ds(pl.multiple_of(i * block, block), block)].astype(jnp.float32)
    s = scale_ref[0]
    v = jax.lax.fori_loop(0, spins, lambda _, a: a * s + (1.0 - s), v)  # s == 1: the values come back unchanged
    o_ref[0, pl.ds(pl.multiple_of(i * block, block), block)] = v.astype(o_ref.dtype)


def busy(x, scale, w_next, *, spins: int, fraction: float):
    """x [1, D] -> x after a dependent chain per program; prefetches `fraction` of w_next [K, N] into L2."""
    kernel = functools.partial(_busy_kernel, spins=spins, fraction=fraction, width=x.shape[1])
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(PROGRAMS,),
                          compiler_params=tiling.compiler_params(4, 1), name="l2_busy")(x, scale, w_next)


def chain(spins: int, fraction: float):
    def run(weights, scale, x):
        for w in weights:
            y = busy(x, scale, w, spins=spins, fraction=fraction)
            (out,) = projection.project(y, ((w,),))
            x = out[:, :x.shape[1]]
        return x

    return jax.jit(run, compiler_options=dispatch.compiler_options() or None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    parser.add_argument("--spins", default="1500")
    parser.add_argument("--widths", default="2048,6144")
    parser.add_argument("--fractions", default="0,0.5,1")
    args = parser.parse_args(argv)
    if not l2_prefetch.available(interpret=False):
        raise SystemExit("l2_prefetch.py needs JAX's Pallas Triton lowering (a CUDA build of jax)")
    copy_bw = hbm_copy_bandwidth()
    res = {"hbm_copy_TBps": round(copy_bw / 1e12, 3)}
    dim = 2048
    x = jax.random.normal(jax.random.key(1), (1, dim), jnp.bfloat16)
    scale = jnp.ones((1,), jnp.float32)
    for width in (int(w) for w in args.widths.split(",")):
        keys = jax.random.split(jax.random.key(width), LAYERS)
        weights = [(jax.random.normal(k, (dim, width), jnp.float32) * 0.02).astype(jnp.bfloat16) for k in keys]
        w_bytes = dim * width * 2
        for spins in (int(s) for s in args.spins.split(",")):
            row, want = {}, None
            for fraction in (float(f) for f in args.fractions.split(",")):
                fn = chain(spins, fraction)
                out = fn(weights, scale, x)
                us, top = device_us_per_call(fn, weights, scale, x, calls=LAYERS, top=4)
                err = None if want is None else float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
                want = out.astype(jnp.float32) if want is None else want
                row[f"prefetch {fraction}"] = {"us_per_pair": round(us, 2), "top_us": top, "max_abs_diff": err}
                print(f"W {w_bytes / 1e6:.1f} MB spins {spins} prefetch {fraction}: {us:.2f} us per pair {top}",
                      flush=True)
            res[f"W{w_bytes / 1e6:.1f}MB spins{spins}"] = row | {
                "roofline_us": round(w_bytes / copy_bw * 1e6, 2)}
    device = jax.devices()[0]
    append_line(args.results, f"- {datetime.date.today()} l2_prefetch.py, {device.device_kind}, commit "
                              f"{git_commit()}, jax {jax.__version__}, (busy kernel, projection) pairs, {LAYERS} "
                              f"weights chained, the busy kernel prefetching a share of its pair's weight into L2: "
                              f"{json.dumps(res)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
