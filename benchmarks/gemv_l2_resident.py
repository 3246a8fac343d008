"""The MXFP4 decode kernels at one token with their weights read from HBM against the same kernels with their
weights resident in L2: how much of a kernel's time is its own issue work and how much is waiting on HBM.

    python benchmarks/gemv_l2_resident.py [--shapes deepseek,medium]

"distinct": the token's top-k experts are k different experts (what a decode step reads, all from HBM); "same": all
k pairs go to one expert, so k tiles read the same weights (15.6 MB of gate/up at the DeepSeek size: after the first
tile, L2 hits). Each with `tiles_for`'s tiles ("default") and with K never split ("unsplit"). GPU time of the layer
call and of each MoE kernel from a trace of 10 chained calls (moe.py's `traced_device_time`); printed, not appended
to RESULTS.md (a diagnostic, not a target).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="deepseek,medium")
    args = parser.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from moe import SHAPES, traced_device_time  # benchmarks/moe.py

    from dayzero.kernels import moe_mxfp4_gemv as gemv, mxfp4

    for name in args.shapes.split(","):
        n_experts, top_k, hidden, inter = SHAPES[name]
        ew = mxfp4.random_experts(jax.random.key(0), n_experts, hidden, inter)
        x = jax.random.normal(jax.random.key(1), (1, hidden), jnp.bfloat16)
        w = jnp.full((1, top_k), 1.0 / top_k, jnp.float32)
        routings = {"distinct": jnp.arange(top_k, dtype=jnp.int32)[None] * 7 % n_experts,
                    "same": jnp.full((1, top_k), 3, jnp.int32)}
        default = gemv.tiles_for(top_k, n_experts)
        for routing, ids in routings.items():
            for label, tiles in (("default", default), ("unsplit", dataclasses.replace(default, split_k=1))):
                def layer(x, e, ids=ids, tiles=tiles):
                    return gemv.grouped_swiglu(x, ids, w, e, tiles=tiles)

                total, _, top = traced_device_time(layer, x, ew, interpret=False)
                kernels = {k: round(v, 2) for k, v in top.items() if k.startswith("moe")}
                print(f"{name} {routing} {label}: layer {total * 1e6:.2f} us, kernels {kernels}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
