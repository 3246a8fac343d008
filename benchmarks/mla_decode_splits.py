"""Dense MLA decode at a few heads (the medium hybrid's 16): how the fused decode kernel's key splits fare when one
request's context is short and its block table wide, and at long contexts.

    python3 benchmarks/mla_decode_splits.py [--results benchmarks/RESULTS.md]

One request, 16 heads, kv_lora_rank 512 + rope 64, bf16 latents in 64-token blocks (scattered), one layer read out
of four. Each case: table width (blocks), `decode_programs`, the even split of the live chunks
(`dense_even_splits`) or static ranges, and the query position. GPU time per call
(all its kernels: the decode kernel, the combine) and the decode kernel's own, from a profiler trace of 10 chained
calls after a warm-up. Then, on several positions in one batch, the even splits' output against the kernel without
it (and the heads_split variant against that), as a check that the option changes rounding only. Prints each case
and appends one dated line to the results file. Needs a GPU (on the CPU the trace holds no device kernels).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.kernels import sparse_mla

from gpu_trace import device_us_per_call  # benchmarks/gpu_trace.py
from results import append_line, git_commit  # benchmarks/results.py: a script's own folder is on sys.path

HEADS, RANK, ROPE, BLOCKS = 16, 512, 64, 520
# (table blocks, decode_programs, even splits, query position)
CASES = ((516, 264, False, 150), (516, 264, True, 150), (516, 64, True, 150), (516, 16, True, 150),
         (64, 264, False, 150), (64, 264, True, 150), (8, 264, False, 150), (4, 264, True, 150),
         (516, 264, False, 2000), (516, 264, True, 2000),
         (516, 264, False, 30000), (516, 264, True, 30000), (516, 64, True, 30000))


def config(programs: int = 264, even: bool = False) -> sparse_mla.SparseMLAConfig:
    return sparse_mla.SparseMLAConfig(decode_programs=programs, dense_even_splits=even)


def time_case(rng, cache, blocks: int, programs: int, even: bool, position: int) -> dict:
    """GPU time per call (us) of the whole op and of its decode kernel."""
    tables = jnp.asarray(rng.permutation(BLOCKS)[:blocks][None], jnp.int32)
    pos = jnp.asarray([[position]], jnp.int32)
    ql = jnp.asarray(rng.standard_normal((1, 1, HEADS, RANK)) * 0.05, jnp.bfloat16)
    qr = jnp.asarray(rng.standard_normal((1, 1, HEADS, ROPE)) * 0.05, jnp.bfloat16)
    cfg = config(programs, even)

    def chained(ql, qr, cache, tables, pos):
        for _ in range(10):  # each call's query depends on the previous output
            ql = ql + 1e-3 * sparse_mla.sparse_mla(ql, qr, cache, 1, tables, pos, None, 0.04, config=cfg)
        return ql

    total, top = device_us_per_call(jax.jit(chained), ql, qr, cache, tables, pos, calls=10, top=6)
    return {"us": round(total, 2), "kernel_us": top.get("sparse_mla_decode_fused")}


def agreement(rng, cache) -> dict:
    """Relative error of the even splits (and of heads_split) against static ranges, four positions in one batch."""
    tables = jnp.asarray(np.stack([rng.permutation(BLOCKS)[:516] for _ in range(4)]), jnp.int32)
    pos = jnp.asarray([[0], [150], [2000], [30000]], jnp.int32)
    ql = jnp.asarray(rng.standard_normal((4, 1, HEADS, RANK)) * 0.05, jnp.bfloat16)
    qr = jnp.asarray(rng.standard_normal((4, 1, HEADS, ROPE)) * 0.05, jnp.bfloat16)
    run = lambda cfg: sparse_mla.sparse_mla(ql, qr, cache, 1, tables, pos, None, 0.04, config=cfg).astype(
        jnp.float32)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    base = run(config())
    out = {"even_splits": rel(run(config(even=True)), base)}
    out["heads_split"] = rel(run(sparse_mla.SparseMLAConfig(decode_variant="heads_split")), base)
    return {k: float(f"{v:.2e}") for k, v in out.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((4, BLOCKS, 64, RANK + ROPE)) * 0.1, jnp.bfloat16)
    results = {}
    for blocks, programs, even, position in CASES:
        label = f"t{blocks}_p{programs}{'_even' if even else ''}_at{position}"
        results[label] = time_case(rng, cache, blocks, programs, even, position)
        print(label, results[label], flush=True)
    results["rel_err_vs_static_splits"] = agreement(rng, cache)
    print(results["rel_err_vs_static_splits"])
    device = jax.devices()[0]
    append_line(args.results, f"- {datetime.date.today()} mla_decode_splits.py, {device.device_kind}, commit "
                              f"{git_commit()}, jax {jax.__version__}: dense MLA decode, 16 heads, one request, "
                              f"GPU time per call (us, all kernels) and the decode kernel's: {json.dumps(results)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
