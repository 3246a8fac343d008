"""The batch-1 MoE front on the GPU: `kernels.moe_front.front` (o_proj's partial sums + residual, post-attention
RMSNorm and router logits in one kernel) against the same in XLA (`moe_front.reference`), at the medium hybrid's
shapes (2048 features, 64 experts, o_proj's 8 K slices).

    python3 benchmarks/moe_front.py [--results benchmarks/RESULTS.md] [--warps 4,8,16]

`LAYERS` calls chained in one jitted function (each call's residual is the previous call's x, each layer with its own
router weight, as in a decode step), device time per call from a profiler trace after a warm-up; one call's results
are checked in the same run (x and normed to ~2 bf16 steps of XLA's on the same inputs, logits to float32 rounding of
a float64 product of the kernel's normed row). Appends one dated line to the results file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.kernels import moe_front, projection

from gpu_trace import device_us_per_call  # benchmarks/gpu_trace.py: a script's own folder is on sys.path
from results import append_line, git_commit  # benchmarks/results.py

LAYERS = 12
HIDDEN, EXPERTS, SLICES = 2048, 64, 8


def chained(front):
    """jit(sums [L, S, 1, H], residual [1, H], norm [L, H], router [L, E, H]) -> every layer's (x, normed, logits),
    each layer's residual the previous layer's x. (Every output is returned: with only the last layer's, XLA's form
    would drop the other layers' norms and logits.)"""
    def run(sums, residual, norm, router):
        every = []
        for layer in range(LAYERS):
            update = projection.Partials(sums[layer], None, HIDDEN, 1e-6, "bfloat16")
            outs = front(update, residual, norm[layer], router[layer], eps=1e-5)
            residual = outs[0]
            every.append(outs)
        return every

    return jax.jit(run)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    parser.add_argument("--warps", default="8", help="comma-separated num_warps for the kernel")
    args = parser.parse_args(argv)
    keys = jax.random.split(jax.random.key(0), 4)
    sums = jax.random.normal(keys[0], (LAYERS, SLICES, 1, HIDDEN), jnp.float32) * 0.1
    residual = jax.random.normal(keys[1], (1, HIDDEN), jnp.bfloat16)
    norm = jax.random.uniform(keys[2], (LAYERS, HIDDEN), jnp.float32, 0.5, 1.5)
    router = (jax.random.normal(keys[3], (LAYERS, EXPERTS, HIDDEN)) * 0.02).astype(jnp.bfloat16)
    operands = (sums, residual, norm, router)
    xla = chained(moe_front.reference)
    first = (projection.Partials(sums[0], None, HIDDEN, 1e-6, "bfloat16"), residual, norm[0], router[0])
    want = jax.jit(lambda *a: moe_front.reference(*a, eps=1e-5))(*first)
    res = {"xla_us_per_call": round(device_us_per_call(xla, *operands, calls=LAYERS)[0], 2)}
    for warps in (int(w) for w in args.warps.split(",")):
        front = lambda *a, warps=warps, **k: moe_front.front(*a, **k, num_warps=warps)
        got = jax.jit(lambda *a: front(*a, eps=1e-5))(*first)  # one call against XLA's on the same inputs
        # x and normed within ~2 bf16 steps of XLA's (which may skip a rounding: excess precision), logits within
        # float32 rounding of a float64 product of the kernel's own normed row
        close = all(np.all(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))
                           <= np.abs(np.asarray(w, np.float64)) * 2.0 ** -6 + 1e-30) for g, w in zip(got[:2], want[:2]))
        oracle = np.asarray(got[1], np.float64) @ np.asarray(router[0], np.float64).T
        close = bool(close and np.allclose(np.asarray(got[2], np.float64), oracle, rtol=1e-4, atol=1e-5))
        kernel = chained(front)
        us, top = device_us_per_call(kernel, *operands, calls=LAYERS)
        res[f"kernel_w{warps}"] = {"us_per_call": round(us, 2), "matches_xla": bool(close), "top_us": top}
        print(f"warps {warps}: {us:.2f} us per call (XLA {res['xla_us_per_call']}), matches XLA: {close}",
              flush=True)
    device = jax.devices()[0]
    append_line(args.results, f"- {datetime.date.today()} moe_front.py, {device.device_kind}, commit {git_commit()}, "
                              f"jax {jax.__version__}: the batch-1 MoE front (8-slice o_proj sums + residual, "
                              f"RMSNorm, router logits; 2048 features, 64 experts), {LAYERS} calls chained, device "
                              f"time per call, kernel against XLA in the same run: {json.dumps(res)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
