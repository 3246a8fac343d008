"""Whether a chain of decode-sized gemvs runs faster as one kernel with a grid barrier between its phases than as one
kernel per phase.

    python3 benchmarks/grid_barrier.py [--phases 16] [--dim 2048] [--programs 0] [--num-warps 8]
                                       [--modes kernels,ordered,...] [--results benchmarks/RESULTS.md]

The batch-1 decode step is ~120 latency-bound kernels, each ~3 us over its bytes at the read bandwidth (the
fifty-third session's H200 dump); programmatic launch did not take it out (the fifty-fifth session). This measures
the other way to fewer kernel boundaries: `--phases` products y_l = tanh(W_l @ y_(l-1)) of one row (W_l [dim, dim]
bf16: 8.4 MB at 2048, the size of an o_proj), with

- kernels: one Pallas kernel per phase, `--programs` programs of dim / programs weight rows each, every program
  loading its rows in one piece;
- fused: one Pallas kernel for the whole chain, the same programs and loads, a grid barrier between phases (each
  program arrives with `kernels.atomics.take_turn` and waits with `wait_until`), each program issuing its next
  phase's weight loads between its arrival and its wait (the weights do not depend on the other programs' outputs);
- fused_volatile: fused, the wait polling the count with volatile loads (one atomic read after the loop) where
  fused polls with atomics (each a fence and an L1 invalidate on sm_90);
- fused_late: fused with the weights loaded after the wait (what the barrier alone gains);
- ordered: one kernel of phases x programs programs, in phase order, each one phase's rows: it loads its weight
  rows, then (past phase 0) waits until every program of the phases before it has finished (a count that each
  program adds 1 to after its store), then reads the previous row. No program is persistent: the GPU places them as
  any grid's, many per SM, and a waiting program's weights are in flight while the phase before it ends. It relies
  on the GPU starting a grid's programs in order (a program waits only on programs started before it, which hold
  their SMs until they finish: no deadlock however few fit at once);
- ordered_ticket: ordered, each program's place in the chain taken from a count of started programs (an atomic,
  its first instruction) instead of its grid index, so no order of starting is assumed (what that atomic costs);
- ordered_pairs: ordered grids of two phases each, one kernel boundary per two phases (what the model's MXFP4
  gate/up and down kernels would get as one grid);
- project: the model's projection kernel per phase (`kernels.projection.project`, o_proj's tiles) and XLA's tanh;
- xla: XLA's dot and tanh per phase.

Per mode: microseconds per phase with the calls back to back (`timing.pipelined_seconds`), the GPU kernel time per
phase (one traced call), the share of the read roofline that the wall time gives (weights only), and the largest
difference from the first mode's output. `--programs 0` takes the largest power of two dividing `--dim` that is at
most the GPU's SM count: every program of a fused kernel must be resident at once (with more programs than SMs it
would never finish; the other modes take more). Needs a GPU.

Measured (H100, fifty-seventh session, RESULTS.md): one kernel per phase is the fastest form at every program count
(5.71 us of GPU time per phase at 128 programs against 5.54 ordered and 8.91 fused; 4.54 at 2048 programs against
21.46 ordered): a polling program holds its SM slot, so the next phase's loads are early only where slots are free.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dayzero.kernels import atomics, projection, tiles

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results  # noqa: E402  (benchmarks/)
from gpu_trace import device_us_per_call  # noqa: E402
from timing import hbm_read_bandwidth, pipelined_seconds  # noqa: E402

MODES = ("kernels", "fused", "fused_volatile", "fused_late", "ordered", "ordered_ticket", "ordered_pairs", "project",
         "xla")


def product(w: jax.Array, x: jax.Array) -> jax.Array:
    """w [R, K] bf16, x [K] float32 -> tanh(w @ x) [R] float32 (tanh keeps a long chain bounded)."""
    return jnp.tanh(jnp.sum(w.astype(jnp.float32) * x[None, :], axis=1))


def phase_kernel(w: jax.Array, x: jax.Array, *, programs: int, num_warps: int, interpret: bool) -> jax.Array:
    """One phase: w [N, K] bf16, x [K] float32 -> tanh(w @ x) [N] float32, program p computing rows
    [p * N / programs, (p + 1) * N / programs)."""
    n, k = w.shape
    rows = n // programs

    def kernel(w_ref, x_ref, y_ref):
        r0 = pl.program_id(0) * rows
        y_ref[pl.ds(r0, rows)] = product(w_ref[pl.ds(r0, rows), pl.ds(0, k)], x_ref[pl.ds(0, k)])

    return tiles.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=(programs,),
                             compiler_params=tiles.compiler_params(num_warps, 1), interpret=interpret,
                             name="gemv_phase")(w, x)


def _chain_call(kernel, w: jax.Array, x: jax.Array, phases: int, *, counters: int, grid: int, num_warps: int,
                interpret: bool, name: str) -> jax.Array:
    """`kernel(w_ref, x_ref, counter_in_ref, y_ref, counter_ref)` over a 1-D grid, its int32 counters zeros at each
    call (aliased: counter_in_ref is counter_ref's buffer) -> y [phases, N] float32."""
    out, _ = tiles.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((phases, w.shape[1]), jnp.float32),
                           jax.ShapeDtypeStruct((counters,), jnp.int32)),
        grid=(grid,), input_output_aliases={2: 1}, compiler_params=tiles.compiler_params(num_warps, 1),
        interpret=interpret, name=name)(w, x, jnp.zeros((counters,), jnp.int32))
    return out


def fused_chain(w: jax.Array, x: jax.Array, *, programs: int, num_warps: int, prefetch: bool,
                interpret: bool, poll: str = "atomic") -> jax.Array:
    """The whole chain in one kernel: w [L, N, N] bf16, x [N] float32 -> every phase's output [L, N] float32
    (phase l reads phase l - 1's row, the first x). Between phases a grid barrier on a counter that starts at 0 each
    call (phase l's wait ends once all programs arrived l + 1 times); with `prefetch` each program loads its next
    phase's weight rows between its arrival and its wait; `poll` as `atomics.wait_until` takes it. Interpret mode:
    one program only (see `atomics`)."""
    phases, n, k = w.shape
    rows = n // programs
    if interpret and programs != 1:
        raise ValueError("fused_chain: interpret mode runs programs one after another; a grid barrier there needs "
                         f"programs=1, got {programs}")

    def kernel(w_ref, x_ref, counter_in_ref, y_ref, counter_ref):
        del counter_in_ref  # the same buffer as counter_ref (aliased)
        r0 = pl.program_id(0) * rows
        weights = lambda phase: w_ref[phase, pl.ds(r0, rows), pl.ds(0, k)]
        w_next = weights(0)
        x = x_ref[pl.ds(0, k)]
        for phase in range(phases):
            y_ref[phase, pl.ds(r0, rows)] = product(w_next, x)
            if phase + 1 == phases:
                break
            atomics.take_turn(counter_ref, (jnp.int32(0),), interpret=interpret)
            if prefetch:
                w_next = weights(phase + 1)
            atomics.wait_until(counter_ref, (jnp.int32(0),), (phase + 1) * programs, interpret=interpret,
                               poll=poll)
            if not prefetch:
                w_next = weights(phase + 1)
            x = y_ref[phase, pl.ds(0, k)]

    return _chain_call(kernel, w, x, phases, counters=1, grid=programs, num_warps=num_warps, interpret=interpret,
                       name="gemv_chain_fused")


def ordered_chain(w: jax.Array, x: jax.Array, *, programs: int, num_warps: int, interpret: bool, first: int = 0,
                  phases: int | None = None, ticket: bool = False) -> jax.Array:
    """Phases first .. first + phases - 1 of the chain (default: all) in one grid of phases x programs programs:
    w [L, N, N] bf16, x [N] float32 -> those phases' outputs [phases, N] float32. Program v computes phase
    v // programs's rows of block v % programs: weights loaded first, then (past the grid's first phase) a wait
    until the count of finished programs reaches phase x programs (volatile polls), the previous phase's row, the
    product; then it adds 1 to the count. With `ticket` a program's v is not its grid index but the count of programs
    that started before it (an atomic on a second counter, its first instruction): a program then waits only on
    programs that started earlier, in whatever order the GPU starts them. Interpret mode runs the programs in order,
    so every wait there is met."""
    n, k = w.shape[1:]
    phases = w.shape[0] - first if phases is None else phases
    rows = n // programs

    def kernel(w_ref, x_ref, counter_in_ref, y_ref, counter_ref):
        del counter_in_ref  # the same buffer as counter_ref (aliased)
        v = pltriton.atomic_add(counter_ref, (jnp.int32(1),), jnp.int32(1)) if ticket else pl.program_id(0)
        phase, r0 = v // programs, (v % programs) * rows
        weights = w_ref[first + phase, pl.ds(r0, rows), pl.ds(0, k)]

        @pl.when(phase == 0)
        def _():
            y_ref[0, pl.ds(r0, rows)] = product(weights, x_ref[pl.ds(0, k)])

        @pl.when(phase > 0)
        def _():
            atomics.wait_until(counter_ref, (jnp.int32(0),), phase * programs, interpret=interpret, poll="volatile")
            y_ref[phase, pl.ds(r0, rows)] = product(weights, y_ref[phase - 1, pl.ds(0, k)])

        atomics.take_turn(counter_ref, (jnp.int32(0),), interpret=interpret)

    return _chain_call(kernel, w, x, phases, counters=2, grid=phases * programs, num_warps=num_warps,
                       interpret=interpret, name="gemv_chain_ordered")  # counters: (finished, started) programs


def run_mode(mode: str, stacked: jax.Array, per_phase: list, transposed: list, x: jax.Array, *, programs: int,
             num_warps: int, interpret: bool = False) -> jax.Array:
    """The chain's last output [N] float32 under `mode` (see the module docstring)."""
    if mode.startswith("fused"):
        return fused_chain(stacked, x, programs=programs, num_warps=num_warps, prefetch=mode != "fused_late",
                           poll="volatile" if mode == "fused_volatile" else "atomic", interpret=interpret)[-1]
    if mode in ("ordered", "ordered_ticket"):
        return ordered_chain(stacked, x, programs=programs, num_warps=num_warps, interpret=interpret,
                             ticket=mode == "ordered_ticket")[-1]
    if mode == "ordered_pairs":
        for first in range(0, stacked.shape[0], 2):
            x = ordered_chain(stacked, x, programs=programs, num_warps=num_warps, interpret=interpret, first=first,
                              phases=min(2, stacked.shape[0] - first))[-1]
        return x
    for w, wt in zip(per_phase, transposed):
        if mode == "kernels":
            x = phase_kernel(w, x, programs=programs, num_warps=num_warps, interpret=interpret)
        elif mode == "project":
            y = projection.project(x[None, :].astype(jnp.bfloat16), ((wt,),), interpret=interpret)[0]
            x = jnp.tanh(y[0].astype(jnp.float32))
        else:
            x = jnp.tanh(jnp.dot(w, x.astype(jnp.bfloat16), preferred_element_type=jnp.float32))
    return x


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", type=int, default=16)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--programs", type=int, default=0, help="0: from the GPU's SM count")
    parser.add_argument("--num-warps", type=int, default=8)
    parser.add_argument("--modes", default=",".join(MODES), help="default: all of " + ", ".join(MODES))
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    modes = results.chosen_modes(args.modes, MODES)
    if jax.default_backend() != "gpu":
        raise SystemExit("grid_barrier.py measures a GPU; no GPU backend here")
    environment = results.xla_environment()
    device = jax.devices()[0]
    sm_count = getattr(device, "core_count", None)
    if not sm_count:
        raise SystemExit("grid_barrier.py: this jax does not give the GPU's SM count (device.core_count)")
    programs = args.programs or tiles.pow2_divisor(args.dim, sm_count)
    if args.dim % programs or (programs > sm_count and any(m.startswith("fused") for m in modes)):
        raise SystemExit(f"--programs {programs}: must divide --dim {args.dim}, and for the fused modes be at most "
                         f"the {sm_count} SMs")
    scale = float(1.0 / np.sqrt(args.dim))  # a Python float keeps the weights bf16
    per_phase = [jax.random.normal(jax.random.key(i), (args.dim, args.dim), jnp.bfloat16) * scale
                 for i in range(args.phases)]
    stacked = jnp.stack(per_phase)
    transposed = [jnp.asarray(w.T) for w in per_phase]
    x = jax.random.normal(jax.random.key(args.phases), (args.dim,), jnp.float32)
    weight_bytes = args.dim * args.dim * 2
    read_bw = hbm_read_bandwidth()
    figures: dict[str, dict] = {}
    reference = None
    for mode in modes:
        fn = jax.jit(lambda s, ws, wts, x, mode=mode: run_mode(mode, s, ws, wts, x, programs=programs,
                                                               num_warps=args.num_warps))
        out = np.asarray(fn(stacked, per_phase, transposed, x))
        reference = out if reference is None else reference
        gpu_us, _ = device_us_per_call(fn, stacked, per_phase, transposed, x, calls=1)
        wall_us = pipelined_seconds(fn, stacked, per_phase, transposed, x, n=50, reps=7) * 1e6 / args.phases
        figures[mode] = {"us_per_phase": round(wall_us, 2), "gpu_us_per_phase": round(gpu_us / args.phases, 2),
                         "share_of_read_roofline": round(weight_bytes / read_bw / (wall_us * 1e-6), 3),
                         "max_diff_vs_first_mode": float(np.max(np.abs(out - reference)))}
        print(mode, figures[mode], flush=True)
    line = (f"{results.line_head('grid_barrier.py', device.device_kind, environment)}, {args.phases} phases of a "
            f"1-row gemv [{args.dim} x {args.dim}] bf16 ({weight_bytes / 1e6:.1f} MB each), {programs} programs "
            f"of {args.num_warps} warps ({sm_count} SMs), read roofline {read_bw / 1e12:.2f} TB/s, per phase: "
            f"{json.dumps(figures)}\n")
    results.append_line(args.results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
