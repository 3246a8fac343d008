"""How much a chain of weight-streaming Pallas kernels gains from programmatic dependent launch (PDL, sm_90+).

    python3 benchmarks/launch_overlap.py [--layers 24] [--modes none,trigger_first,wait_first,after_step]
                                         [--results benchmarks/RESULTS.md]

A stand-in for the decode step's chain: `--layers` gemv kernels (x [16, 2048] bf16 @ W [2048, 4096] bf16, 16.8 MB
of weight each, programs of 16 columns, K in steps of 512), each reading the one before it, either directly
("direct") or through an XLA add between them ("chain"). Modes, through `kernels.grid_dependency`:

- none: the kernels as they are;
- trigger_first: each program lets the next kernel launch, then waits for the kernels before it, first thing
  (`kernels.tiles.PROGRAMMATIC_LAUNCH` = "trigger_first" for every kernel of the model);
- wait_first: the same two the other way round (one kernel ahead at most);
- after_step: it lets the next kernel launch first thing, loads its first K step of weights, then waits before
  reading x.

XLA (jax 0.11.2) launches Pallas' Triton kernels as programmatic dependents, so a kernel that lets the next one
launch early has that kernel's programs resident and waiting as it ends. Per mode: microseconds per kernel with the
calls back to back (`timing.pipelined_seconds`), the kernels' summed GPU time (their spans overlap when the next
kernel starts early), and the largest difference from "none"'s output (must be 0: the same products).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dayzero.kernels import grid_dependency

from gpu_trace import device_us_per_call  # benchmarks/: a script's own folder is on sys.path
from results import append_line, chosen_modes, git_commit
from timing import pipelined_seconds

K, N, BLOCK_N, STEP_K, ROWS = 2048, 4096, 16, 512, 16
MODES = ("none", "trigger_first", "wait_first", "after_step")


def gemv(x: jax.Array, w: jax.Array, mode: str) -> jax.Array:
    """x [ROWS, K] bf16 @ w [K, N] bf16 -> tanh of the product [ROWS, N] bf16 (tanh keeps a long chain bounded)."""
    steps = K // STEP_K

    def kernel(x_ref, w_ref, o_ref):
        n0 = pl.program_id(0) * BLOCK_N
        token = 0
        if mode == "wait_first":
            token = grid_dependency.wait(0)
        if mode != "none":
            grid_dependency.launch_dependents(0)
        if mode == "trigger_first":
            token = grid_dependency.wait(0)
        w0 = w_ref[pl.ds(0, STEP_K), pl.ds(n0, BLOCK_N)]
        if mode == "after_step":
            token = grid_dependency.wait(0)
        offset = token * STEP_K  # x's loads come after the wait (a multiple of STEP_K keeps them vectorised)

        def dot(k0, wk):
            return jax.lax.dot_general(x_ref[pl.ds(0, ROWS), pl.ds(k0 + offset, STEP_K)], wk,
                                       (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

        def step(s, acc):
            return acc + dot(s * STEP_K, w_ref[pl.ds(s * STEP_K, STEP_K), pl.ds(n0, BLOCK_N)])

        acc = jax.lax.fori_loop(1, steps, step, dot(0, w0))
        o_ref[pl.ds(0, ROWS), pl.ds(n0, BLOCK_N)] = jnp.tanh(acc).astype(o_ref.dtype)

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((ROWS, N), jnp.bfloat16), grid=(N // BLOCK_N,),
                          compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3))(x, w)


def chain(weights, x, mode: str, through_xla: bool):
    for w in weights:
        y = gemv(x, w, mode)
        x = y[:, :K] + y[:, K:] if through_xla else y[:, :K]
    return x


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    modes = chosen_modes(args.modes, MODES)
    if jax.default_backend() != "gpu":
        raise SystemExit("launch_overlap.py measures a GPU; no GPU backend here")
    weights = [jax.random.normal(jax.random.key(i), (K, N), jnp.bfloat16) * 0.02 for i in range(args.layers)]
    x = jax.random.normal(jax.random.key(args.layers), (ROWS, K), jnp.bfloat16)
    figures: dict[str, dict] = {}
    for form, through_xla in (("chain", True), ("direct", False)):
        reference = None
        for mode in modes:
            fn = jax.jit(lambda ws, x, mode=mode, through_xla=through_xla: chain(ws, x, mode, through_xla))
            out = np.asarray(fn(weights, x).astype(jnp.float32))
            reference = out if reference is None else reference
            gpu_us, _ = device_us_per_call(fn, weights, x, calls=1)
            figures[f"{form}_{mode}"] = {
                "us_per_kernel": round(pipelined_seconds(fn, weights, x, n=50, reps=7) * 1e6 / args.layers, 2),
                "gpu_us_per_kernel": round(gpu_us / args.layers, 2),
                "max_diff_vs_first_mode": float(np.max(np.abs(out - reference)))}
            print(form, mode, figures[f"{form}_{mode}"], flush=True)
    device = jax.devices()[0].device_kind
    line = (f"- {datetime.date.today()} launch_overlap.py, {device}, commit {git_commit()}, jax {jax.__version__}, "
            f"{args.layers} gemv kernels of {K * N * 2 / 1e6:.1f} MB weight each (16-column programs, K steps of "
            f"{STEP_K}), per kernel: {json.dumps(figures)}\n")
    append_line(args.results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
