"""DSA indexer decode on the GPU, its two halves apart: every score-kernel tuning and every top-k selection, device
time per call at long context, beside the HBM copy bandwidth measured in the same run.

    python3 benchmarks/indexer.py [--results benchmarks/RESULTS.md] [--batches 16,64] [--contexts 32768,131072,524288]

DeepSeek-V3.2's indexer: 64 heads x 128, bf16 keys in a paged cache (blocks of 64 tokens, scattered), top-k 2048,
one query per request at the last position. For each (batch, context):
- each tuning of `indexer_pallas.row_scores` (`score_tunings`): its kernels' device time per call and its share of
  the copy bandwidth on the key bytes it reads (batch x context x 256 bytes);
- each selection of `indexer_pallas.SELECTIONS` over those scores: device time per call, and whether it picks the
  very keys `two_level` picks (as sets);
- the best pair's share of the copy bandwidth: what `IndexerKernelConfig` should default to.
Each op runs `CHAIN` times inside one jit, call n on other requests' blocks (or other score rows), so no call finds
the previous one's bytes in L2; device time is the sum of its GPU kernels in a profiler trace, divided by `CHAIN`.
`benchmarks/sparse_attention.py` measures the indexer + top-k inside the whole DSA decode sweep.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from gpu_trace import device_us_per_call  # benchmarks/gpu_trace.py
from results import append_line, git_commit  # benchmarks/results.py: a script's own folder is on sys.path
from timing import hbm_copy_bandwidth  # benchmarks/timing.py

HEADS, DIM, TOPK, BLOCK, CHAIN = 64, 128, 2048, 64, 10


def score_tunings() -> dict:
    """name -> IndexerKernelConfig of the decode score kernel (the first: the default)."""
    from dayzero.kernels.indexer_pallas import IndexerKernelConfig as C

    one = dict(tiles_per_program=1)
    return {"k128w4_kr_x16": C(),  # the default: keys x heads, runs of up to 16 key tiles
            # heads x keys, one tile per program (the default before 2026-12-01's eighth session)
            "k128w4": C(keys_as_rows=False, **one), "k64w4": C(block_k=64, keys_as_rows=False, **one),
            # the dot as keys x heads (IndexerKernelConfig.keys_as_rows): the sum over heads within a thread's quad
            "k128w4_kr": C(**one), "k64w4_kr": C(block_k=64, **one), "k256w8_kr": C(block_k=256, num_warps=8, **one),
            # runs of key tiles per program, the queries loaded once and the key gathers pipelined
            "k128w4_kr_x4": C(tiles_per_program=4), "k64w4_kr_x8": C(block_k=64, tiles_per_program=8),
            "k128w4_x4": C(keys_as_rows=False, tiles_per_program=4)}


def measure(res: dict, batches, contexts, score_names=None, selection_names=None) -> dict:
    """Fills `res` as it goes (an interrupted run still reports what it measured) and returns it. `score_names` /
    `selection_names`: the tunings / selections to run (default: all)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dayzero.kernels import indexer_pallas

    copy_bw = hbm_copy_bandwidth()
    res["hbm_copy_TBps"] = round(copy_bw / 1e12, 3)

    max_batch, max_ctx = max(batches), max(contexts)
    pages = max_ctx // BLOCK
    key = jax.random.key(1)
    n_pages = max_batch * pages + 1
    keys = jax.random.normal(key, (1, n_pages, BLOCK, DIM), jnp.bfloat16)
    perm = jax.random.permutation(jax.random.fold_in(key, 2), jnp.arange(1, n_pages, dtype=jnp.int32))
    all_tables = perm.reshape(max_batch, pages)  # scattered blocks
    eps = jnp.float32(0.0)

    def device_us(fn, *args) -> tuple[float, dict]:
        """Device time per call of a chained op and its 4 longest kernels."""
        return device_us_per_call(fn, *args, calls=CHAIN, top=4)

    def chained(op):
        """op(w, tables[n], ...) CHAIN times in one jit, each w nudged by the previous output (eps = 0 at run time)."""
        def run(eps, w, stacked, *rest):
            outs = []  # every call's output returned: else XLA's forms might compute only element 0 of the others
            for n in range(CHAIN):
                out = op(w, stacked[n], *rest)
                outs.append(out)
                w = w + eps * out.reshape(-1)[0].astype(jnp.float32)
            return outs

        return jax.jit(run)

    for batch in batches:
        k = jax.random.fold_in(key, 100 + batch)
        q = jax.random.normal(jax.random.fold_in(k, 2), (batch, 1, HEADS, DIM), jnp.bfloat16)
        w = jax.random.normal(jax.random.fold_in(k, 3), (batch, 1, HEADS), jnp.float32) * DIM ** -0.5
        rows = (jnp.arange(CHAIN)[:, None] * batch + jnp.arange(batch)[None]) % max_batch  # [CHAIN, batch]
        for ctx in contexts:
            tag = f"B{batch}_{ctx // 1024}K"
            tables = all_tables[rows][:, :, :ctx // BLOCK]  # [CHAIN, batch, pages]
            pos = jnp.full((batch, 1), ctx - 1, jnp.int32)
            key_bytes = batch * ctx * DIM * 2
            scores_us, kernels = {}, {}
            for name, cfg in score_tunings().items():
                if score_names and name not in score_names:
                    continue
                op = chained(lambda ww, t, qq, p, cache, cfg=cfg: indexer_pallas.row_scores(qq, ww, p, cache, 0, t,
                                                                                          config=cfg))
                us, top = device_us(op, eps, w, tables, q, pos, keys)  # the cache an argument, not a constant
                scores_us[name] = round(us, 2)
                kernels[name] = top
            res[f"scores_{tag}_device_us"] = scores_us
            res[f"scores_{tag}_pct_hbm"] = {n: round(100 * key_bytes / (us * 1e-6) / copy_bw, 1)
                                            for n, us in scores_us.items() if us > 0}  # no GPU events: none
            # CHAIN different score rows for the selections (the score kernel's own output, per chain step)
            score_rows = jnp.stack([indexer_pallas.row_scores(q, w, pos, keys, 0, tables[n]) for n in range(CHAIN)])
            topk_us, agree = {}, {}
            picked = {}
            # two_level first: the reference the others' keys are compared with
            for name in sorted(indexer_pallas.SELECTIONS, key=lambda n: n != "two_level"):
                select = indexer_pallas.SELECTIONS[name]
                if selection_names and name not in selection_names and name != "two_level":  # the reference
                    continue
                op = chained(lambda ww, s, select=select: select(s + ww[0, 0, 0] * 0.0, TOPK))
                us, top = device_us(op, eps, w, score_rows)
                topk_us[name] = round(us, 2)
                kernels[f"topk_{name}"] = top
                picked[name] = np.sort(np.asarray(jax.jit(select, static_argnums=1)(score_rows[0], TOPK)), axis=-1)
                agree[name] = bool(np.array_equal(picked[name], picked["two_level"]))
            res[f"topk_{tag}_device_us"] = topk_us
            res[f"topk_{tag}_same_keys"] = agree
            res[f"kernels_{tag}_us"] = kernels
            best_s, best_t = min(scores_us, key=scores_us.get), min(topk_us, key=topk_us.get)
            total = scores_us[best_s] + topk_us[best_t]
            res[f"best_{tag}"] = {"scores": best_s, "topk": best_t, "device_us": round(total, 2)}
            if total > 0:
                res[f"best_{tag}"]["pct_hbm"] = round(100 * key_bytes / (total * 1e-6) / copy_bw, 1)
            print(tag, json.dumps(res[f"best_{tag}"]), json.dumps(scores_us), json.dumps(topk_us), flush=True)
            del score_rows
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--contexts", default="32768,131072,524288")
    parser.add_argument("--scores", help="comma-separated score tunings to run (default: all of score_tunings)")
    parser.add_argument("--selections", help="comma-separated top-k selections to run besides two_level (default: "
                                             "all of indexer_pallas.SELECTIONS)")
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    contexts = tuple(int(c) for c in args.contexts.split(","))
    res: dict = {}
    try:
        measure(res, batches, contexts, args.scores and args.scores.split(","),
                args.selections and args.selections.split(","))
    except KeyboardInterrupt:  # `timeout -s INT`: report what was measured, marked as partial
        res["interrupted"] = True
    import jax

    device = jax.devices()[0]
    line = (f"- {datetime.date.today()} indexer.py, {device.device_kind}, commit {git_commit()}, "
            f"jax {jax.__version__}, "
            f"DSA indexer decode (64 heads x 128, bf16 keys, top-k {TOPK}), device time per call of each score "
            f"tuning and each top-k selection, HBM copy measured in the same run: {json.dumps(res)}\n")
    append_line(args.results, line)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
