"""How long one read-only kernel takes to stream a given number of bytes, when it is one link of a dependent chain.

    python3 benchmarks/read_floor.py [--sizes-mb 0.004,1,5,8.4,10,26.4,131] [--results PATH]

A batch-1 decode step is a chain of ~120 kernels, each reading 0.3-30 MB (a layer's weights) and each waiting on
the one before. Past a few hundred megabytes a read runs at the HBM roofline; a few megabytes cannot, because every
kernel pays its launch, its programs' start, the first loads' DRAM latency and its drain before the next one may
start. This script measures that floor with the simplest kernels that only stream bytes in: for each size S, a
jitted chain of K links over K distinct bf16 buffers of S bytes ([S / 4 KB, 2048]), K large enough that the buffers
(~`--chain-mb` in all) far outsize the 50 MB L2, each link depending on the one before as a layer's kernel depends
on the last. The kinds of link (`LINKS`), the fastest kept per size:

- XLA's reduction of the buffer over its rows or over its columns (adding the previous sums' first element times 0
  to its input; XLA may run one reduction as two kernels);
- a Pallas gemv (`grid_barrier.phase_kernel`: one weight row per program, 4 warps, the fastest launch of that
  benchmark's sweep on the H100) of the buffer times a vector that takes the previous product's first element
  times 0 (an XLA kernel of its own between the gemvs: ~1 us of each link on the H100, so this kind shows the
  Pallas launch's cost beside XLA's rather than a lower floor).

Per size it reports the GPU time per link (all of the chain's kernels in the profiler's trace over its links) and
the chain's wall time per link (calls back to back), the bytes over the GPU time, and their share of the 1 GiB read
roofline (`timing.hbm_read_bandwidth`) measured in the same run. (Until the fifty-seventh session the kernel figure
was the median of the trace's reduction kernels, which undercounted links that XLA splits into two kernels: 1 GiB
"read" at 6.1 TB/s on an H100.)

A kernel in the model that reads S bytes cannot be expected to beat the floor at S, so the sum of the floors over a
step's kernels bounds what any tiling of the same kernels can reach, and what only fewer kernels can. The script
also fits time = fixed + S / stream over the sizes up to `FIT_MAX_MB` (`linear_fit`): a chain of N kernels reading
B bytes in all then takes at least about N * fixed + B / stream. Appends one line to RESULTS.md (the per-size
figures and the fit as JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_trace  # noqa: E402  (benchmarks/)
import results  # noqa: E402
from grid_barrier import phase_kernel  # noqa: E402
import timing  # noqa: E402

ROW = 2048  # bf16 elements per row: one 4 KB row
DEFAULT_SIZES_MB = (0.004, 1, 2, 5, 8.4, 10, 16, 26.4, 50, 131, 1024)
FIT_MAX_MB = 200.0  # the sizes a decode step's kernels read


def buffer_shape(size_bytes: float) -> tuple[int, int]:
    """[rows, ROW] bf16 of about `size_bytes` (at least one row)."""
    return max(1, round(size_bytes / (2 * ROW))), ROW


def chain_length(size_bytes: float, chain_bytes: float, min_kernels: int = 8, max_kernels: int = 256) -> int:
    """How many distinct buffers of `size_bytes` the chain reads: enough for `chain_bytes` in all, within bounds."""
    return int(min(max_kernels, max(min_kernels, math.ceil(chain_bytes / size_bytes))))


def reduction_chain(axis: int):
    """A jitted function of a list of [R, C] bf16 buffers: each summed over `axis` in float32 after adding 0 times
    the previous sum's first element (a dependency, no extra bytes); returns the last sums."""

    @jax.jit
    def chain(buffers):
        carry = jnp.zeros((), jnp.float32)
        sums = None
        for buf in buffers:
            sums = jnp.sum(buf.astype(jnp.float32) + carry, axis=axis)
            carry = sums[0] * 0.0
        return sums

    return chain


def gemv_chain(interpret: bool = False):
    """A jitted function of a list of [R, C] bf16 buffers: each times a float32 vector [C] in a Pallas gemv (one row
    per program), the vector taking the previous product's first element times 0; returns the last product [R]."""

    @jax.jit
    def chain(buffers):
        x = jnp.ones((buffers[0].shape[1],), jnp.float32)
        y = None
        for buf in buffers:
            y = phase_kernel(buf, x, programs=buf.shape[0], num_warps=4, interpret=interpret)
            x = x + y[0] * 0.0
        return y

    return chain


LINKS = {"reduce_rows": lambda: reduction_chain(1), "reduce_columns": lambda: reduction_chain(0),
         "pallas_gemv": gemv_chain}


def link_figures(chain, buffers: list[jax.Array]) -> dict:
    """One chain's wall time per link (us, calls back to back) and, where the trace holds GPU kernels, its GPU
    time per link (us: every kernel of one traced call over the links) and kernels per link."""
    count = len(buffers)
    wall_us = timing.pipelined_seconds(chain, buffers, n=3, reps=3) * 1e6 / count
    kernels = gpu_trace.gpu_kernels(gpu_trace.traced_events(lambda: jax.block_until_ready(chain(buffers))))
    figure = {"wall_us_per_kernel": round(wall_us, 2)}
    if kernels:
        figure["kernel_us"] = round(sum(e["dur"] for e in kernels) / count, 2)
        figure["kernels_per_link"] = round(len(kernels) / count, 2)
    return figure


def measure_size(size_mb: float, chain_mb: float, key: jax.Array) -> dict:
    """One size's figures: bytes per buffer, links in the chain, and for the fastest kind of link (`LINKS`, by GPU
    time where traced, else wall time) its `link_figures` and name; every kind's time under "by_link"."""
    shape = buffer_shape(size_mb * 1e6)
    nbytes = shape[0] * shape[1] * 2
    count = chain_length(nbytes, chain_mb * 1e6)
    keys = jax.random.split(key, count)
    buffers = [jax.random.normal(k, shape, jnp.bfloat16) for k in keys]
    best, by_link = None, {}
    for name in LINKS:
        figure = {"link": name, **link_figures(LINKS[name](), buffers)}
        by_link[name] = time_us(figure)
        if best is None or time_us(figure) < time_us(best):
            best = figure
    return {"size_mb": round(nbytes / 1e6, 3), "chain": count, **best, "by_link": by_link}


def time_us(figure: dict) -> float:
    """A size's time per kernel: the traced kernel duration where the trace had one, else the wall time."""
    return figure.get("kernel_us", figure["wall_us_per_kernel"])


def with_shares(figure: dict, read_bandwidth: float) -> dict:
    """`figure` plus its bandwidth over the kernel time (or the wall time without a trace) and that as a share of
    the roofline `read_bandwidth` (bytes / s)."""
    seconds = time_us(figure) * 1e-6
    rate = figure["size_mb"] * 1e6 / seconds
    return {**figure, "tb_s": round(rate / 1e12, 3), "share_of_roofline": round(rate / read_bandwidth, 3)}


def linear_fit(figures: list[dict]) -> dict | None:
    """Least squares of time (kernel_us, else wall_us_per_kernel) = fixed_us + size / stream over the figures up to
    `FIT_MAX_MB`: {"fixed_us", "stream_tb_s", "sizes"}; None with fewer than two such sizes."""
    points = [(f["size_mb"] * 1e6, time_us(f) * 1e-6) for f in figures
              if f["size_mb"] <= FIT_MAX_MB]
    if len({size for size, _ in points}) < 2:
        return None
    n = len(points)
    mean_size = sum(size for size, _ in points) / n
    mean_time = sum(t for _, t in points) / n
    slope = (sum((size - mean_size) * (t - mean_time) for size, t in points)
             / sum((size - mean_size) ** 2 for size, _ in points))
    return {"fixed_us": round((mean_time - slope * mean_size) * 1e6, 2),
            "stream_tb_s": round(1 / slope / 1e12, 3) if slope > 0 else None, "sizes": n}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default=",".join(map(str, DEFAULT_SIZES_MB)))
    parser.add_argument("--chain-mb", type=float, default=400.0, help="bytes the chain of one size reads in all")
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    try:
        sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes-mb takes comma-separated numbers, got {args.sizes_mb!r}")
    if not sizes or min(sizes) <= 0:
        parser.error("--sizes-mb needs positive sizes")
    environment = results.xla_environment()
    device = jax.devices()[0]
    read_bandwidth = timing.hbm_read_bandwidth()
    print(f"{device.device_kind}, jax {jax.__version__}: 1 GiB read roofline {read_bandwidth / 1e12:.3f} TB/s")
    figures = []
    for i, size in enumerate(sizes):
        figure = with_shares(measure_size(size, args.chain_mb, jax.random.key(i)), read_bandwidth)
        figures.append(figure)
        print(f"{figure['size_mb']:>9.3f} MB: GPU {figure.get('kernel_us', '-')} us per link ({figure['link']}; "
              f"each kind {figure['by_link']}), wall {figure['wall_us_per_kernel']} us per link, {figure['tb_s']} TB/s "
              f"({100 * figure['share_of_roofline']:.1f}% of the roofline; chain of {figure['chain']})")
    fit = linear_fit(figures)
    if fit:
        print(f"fit over {fit['sizes']} sizes up to {FIT_MAX_MB:g} MB: {fit['fixed_us']} us + bytes at "
              f"{fit['stream_tb_s']} TB/s per kernel")
    results.append_line(args.results, (
        f"{results.line_head('read_floor.py', device.device_kind, environment)}: the fastest of XLA's reductions and "
        f"a Pallas gemv per size in a dependent chain of distinct buffers (GPU time per link), 1 GiB read roofline "
        f"{read_bandwidth / 1e12:.3f} TB/s: "
        f"{json.dumps(figures)}; fit {json.dumps(fit)}\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
