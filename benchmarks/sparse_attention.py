"""DeepSeek Sparse Attention kernels on the GPU, dense MLA attention beside them in the same run.

    python3 benchmarks/sparse_attention.py [--results benchmarks/RESULTS.md] [--quick] [--heads 128,16]
        [--batches 1,16] [--no-prefill] [--no-sweep]

DeepSeek-V3.2 shapes, bf16: absorbed queries over the paged latent cache (kv_lora_rank 512 + rope 64, blocks of 64
tokens, scattered), indexer 64 heads x 128, top-k 2048, one layer. The MLA decode runs at 128 query heads (V3.2 on
one device: 242 FLOP per gathered latent byte, above the H200's ridge, so compute-bound) and at 16 (one rank of
tensor parallelism 8, how V3.2 is served on an 8-GPU node: 30 FLOP per byte, bandwidth-bound). Measured:
- decode, batch 1 and 16 (`--batches`), contexts 8K / 32K / 128K / 512K: sparse MLA attention after selection (its
  gathered latent bytes against the HBM copy bandwidth, and its TFLOP/s: flat in context by design), the indexer +
  top-k (exact bf16 keys, and FP8 keys; their key bytes against the copy bandwidth), the score kernel alone, and dense
  MLA decode (the same kernel with every token selected); the context where sparse (indexer + top-k + attention)
  overtakes dense. `--profile` adds each decode op's device time (its kernels per call, from a profiler trace).
- prefill, batch 1, 32K and 128K tokens: sparse MLA attention (each token its own 2048 keys) in TFLOP/s, dense
  attention (cuDNN flash attention over expanded 192/128 heads) beside it, and the indexer + top-k at 32K.
- the FP8 indexer's error against exact mode (`fp8_selection_error`, 32K keys).
Device time: decode ops are chained N times inside one jit (each call's input depends on the previous output),
prefill ops run whole; warm-up, then the median of repeats. Prints a table and appends a dated line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

from gpu_trace import device_us_per_call  # benchmarks/gpu_trace.py
from results import append_line, git_commit  # benchmarks/results.py: a script's own folder is on sys.path
from timing import hbm_copy_bandwidth  # benchmarks/timing.py

HEADS, RANK, ROPE, IDX_HEADS, IDX_DIM, TOPK, BLOCK = 128, 512, 64, 64, 128, 2048, 64
CONTEXTS = (8192, 32768, 131072, 524288)
BATCHES = (1, 16)
PREFILL = (32768, 131072)
CHAIN = 10


def _tunings():
    from dayzero.kernels.indexer_pallas import IndexerKernelConfig
    from dayzero.kernels.sparse_mla import SparseMLAConfig

    def heads_split(block_h, block_k, **kw):
        return SparseMLAConfig(block_h=block_h, block_k=block_k, decode_block_k=block_k, decode_variant="heads_split",
                               **{"min_split_tokens": 256, **kw})

    # the default (first) is the fused variant (benchmarks/NOTES_dsa.md): two 64-head halves, many splits
    decode = {"fused_h64k32w8": SparseMLAConfig(),
              "fused_h64k16w8_s64": SparseMLAConfig(decode_block_k=16, decode_programs=132, min_split_tokens=64),
              # 32-head blocks: no register spills at 8 warps when built for sm_90 offline (triton_report.py --op
              # sparse_mla: 250 registers, against 255 + 484 bytes of spills at 64 heads); the fastest at batch 1
              "fused_h32k32w8": SparseMLAConfig(block_h=32),
              "fused_h32k32w8_s64": SparseMLAConfig(block_h=32, min_split_tokens=64),
              "h32k32w8": heads_split(32, 32), "h64k16w8": heads_split(64, 16)}
    prefill = {"h64k16w8": SparseMLAConfig(), "h32k32w8": SparseMLAConfig(block_h=32, block_k=32)}
    # one tensor-parallel rank's heads (16 of 128 at TP 8): 16-head blocks, the default (first) and smaller launches
    small = {"fused_h16w4": SparseMLAConfig(), "fused_h16w8": SparseMLAConfig(small_decode_warps=8),
             "fused_h16w4_s64": SparseMLAConfig(min_split_tokens=64),
             "fused_h16w4_s256": SparseMLAConfig(min_split_tokens=256),
             "fused_h16k64w4": SparseMLAConfig(decode_block_k=64),
             "fused_h16w4_st3": SparseMLAConfig(num_stages=3),
             "fused_h16w4_s32": SparseMLAConfig(min_split_tokens=32)}
    # the default (first): keys x heads, runs of up to 16 key tiles (benchmarks/indexer.py measured the halves apart)
    indexer = {"k128w4_kr_x16": IndexerKernelConfig(),
               "k128w4": IndexerKernelConfig(keys_as_rows=False, tiles_per_program=1),  # the old default
               "k64w4_kr_x8": IndexerKernelConfig(block_k=64, tiles_per_program=8),
               # the top-k by XLA sorts in two levels (topk.two_level), the default before the on-chip select
               "k128w4_kr_x16_two_level": IndexerKernelConfig(topk="two_level")}
    return {HEADS: decode, 16: small}, prefill, indexer


def fp8_selection_error(ctx: int = 8192, queries: int = 16, seed: int = 0) -> dict:
    """FP8 indexer mode against exact mode on synthetic V3.2-shaped inputs (64 heads x 128, `ctx` keys, top-2048):
    keys layer-normed with a shared direction and 4 outlier channels (as activations have), queries Gaussian.
    -> relative (Frobenius) score error, mean top-k recall; also without the Hadamard rotation."""
    import jax
    import jax.numpy as jnp

    from dayzero.kernels import fp8_indexer, indexer, topk

    ks = jax.random.split(jax.random.key(seed), 4)
    keys = jax.random.normal(ks[0], (1, ctx, IDX_DIM)) + 0.5 * jax.random.normal(ks[1], (1, 1, IDX_DIM))
    keys = keys.at[..., :4].multiply(10.0)
    keys = (keys - keys.mean(-1, keepdims=True)) / keys.std(-1, keepdims=True)
    q = jax.random.normal(ks[2], (1, queries, IDX_HEADS, IDX_DIM))
    w = jax.random.normal(ks[3], (1, queries, IDX_HEADS)) * IDX_HEADS ** -0.5
    scale = IDX_DIM ** -0.5

    def select(qq, kk):
        scores = indexer.index_scores(qq, kk, w, scale)
        return scores, topk.one_level(scores[0], TOPK)

    exact, exact_sel = select(q, keys)
    out = {}
    for name, quant in (("fp8", fp8_indexer.rotate_and_quantize), ("fp8_no_hadamard", fp8_indexer.quantize)):
        (q8, qs), (k8, kscale) = quant(q), quant(keys)
        scores, sel = select(fp8_indexer.dequantize(q8, qs), fp8_indexer.dequantize(k8, kscale))
        out[f"{name}_score_rel_err"] = round(float(jnp.linalg.norm(scores - exact) / jnp.linalg.norm(exact)), 5)
        recall = jnp.mean(jnp.sum(sel[:, :, None] == exact_sel[:, None, :], axis=(1, 2)) / TOPK)
        out[f"{name}_topk_recall"] = round(float(recall), 4)
    return out


def _heads_suffix(heads: int) -> str:
    """Result-key suffix of a decode head count: none for V3.2's 128 heads on one device, `_h16` for 16."""
    return "" if heads == HEADS else f"_h{heads}"


def measure(quick: bool, res: dict, sweep: bool = True, head_counts=(HEADS, 16), batches=BATCHES,
            prefill_too: bool = True, profile: bool = False) -> dict:
    """Fills `res` as it goes (so an interrupted run still reports what it measured) and returns it. `head_counts`:
    query heads per device of the MLA decode (128: V3.2 on one device; 16: one rank of tensor parallelism 8).
    `profile`: also each decode op's kernel time per call by kernel (`*_kernels_us`, from a jax.profiler trace)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    import jax
    import jax.numpy as jnp

    from dayzero.kernels import fp8_indexer, indexer_pallas, sparse_mla

    decode_tunings, prefill_tunings, indexer_tunings = _tunings()
    if not sweep:  # the first (default) tuning of each kernel only: fewer compilations
        prefill_tunings, indexer_tunings = (dict([next(iter(t.items()))]) for t in (prefill_tunings, indexer_tunings))
        decode_tunings = {h: dict([next(iter(t.items()))]) for h, t in decode_tunings.items()}
    contexts = CONTEXTS[:2] if quick else CONTEXTS
    prefill = PREFILL[:1] if quick else PREFILL

    def median_time(fn, *args, reps=5, per_call=1):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        return statistics.median(times) / per_call

    def chained(op, per_call=()):
        """op(q, *rest) run CHAIN times in one jit, each q nudged by the previous output (eps = 0 at run time).
        per_call: indices into rest of arguments stacked [CHAIN, ...]; call n takes their n-th entries (each call
        reads other requests' blocks and gathers other tokens, as one decode step's layers do: no call finds the
        previous call's bytes in L2)."""
        def run(eps, q, *rest):
            outs = []  # every call's output returned: else XLA's forms might compute only element 0 of the others
            for n in range(CHAIN):
                args = tuple(a[n] if i in per_call else a for i, a in enumerate(rest))
                out = op(q, *args)
                outs.append(out)
                q = q + (eps * out.reshape(-1)[0].astype(jnp.float32)).astype(q.dtype)
            return outs

        return jax.jit(run)

    eps = jnp.float32(0.0)
    copy_bw = hbm_copy_bandwidth()
    res["hbm_copy_TBps"] = round(copy_bw / 1e12, 3)

    # ------------------------------------------------------------------------------------------------- decode
    max_batch, max_ctx = max(batches), max(contexts)
    pages = max_ctx // BLOCK
    key = jax.random.key(1)
    n_pages = max_batch * pages + 1
    latent = jax.random.normal(key, (1, n_pages, BLOCK, RANK + ROPE), jnp.bfloat16)
    keys_bf16 = jax.random.normal(jax.random.fold_in(key, 1), (1, n_pages, BLOCK, IDX_DIM), jnp.bfloat16)
    keys_fp8, key_scales = fp8_indexer.rotate_and_quantize(keys_bf16)
    key_scales = key_scales[..., None]
    perm = jax.random.permutation(jax.random.fold_in(key, 2), jnp.arange(1, n_pages, dtype=jnp.int32))
    all_tables = perm.reshape(max_batch, pages)  # scattered blocks
    mla_ops, index_ops = {}, {}

    def mla_op(heads, name, dense):
        """Sparse (indices given) or dense MLA decode over `heads` query heads with tuning `name`, chained."""
        if (heads, name, dense) not in mla_ops:
            cfg = decode_tunings[heads][name]
            mla_ops[heads, name, dense] = chained(
                (lambda q, qr, c, t, p: sparse_mla.sparse_mla(q, qr, c, 0, t, p, None, 576 ** -0.5, config=cfg))
                if dense else
                (lambda q, qr, c, t, p, i: sparse_mla.sparse_mla(q, qr, c, 0, t, p, i, 576 ** -0.5, config=cfg)),
                per_call=(2,) if dense else (2, 4))
        return mla_ops[heads, name, dense]

    def index_op(name, kind):
        """kind "topk" / "topk_fp8" / "scores", tuning `name`; chained through the float32 weights (first arg)."""
        if (name, kind) not in index_ops:
            cfg = indexer_tunings[name]
            index_ops[name, kind] = chained({
                "topk": lambda w, q, p, c, t: indexer_pallas.indexer_topk(q, w, p, c, 0, t, TOPK, config=cfg),
                "topk_fp8": lambda w, q, p, c, t, s: indexer_pallas.indexer_topk(q, w, p, c, 0, t, TOPK,
                                                                                 key_scales=s, config=cfg),
                "scores": lambda w, q, p, c, t: indexer_pallas.row_scores(q, w, p, c, 0, t, config=cfg)}[kind],
                per_call=(3,))
        return index_ops[name, kind]

    def profiled(tag, bytes_read, fn, *args):
        """`profile` only: a chained op's GPU kernel time per call, by kernel (the 8 longest) and in all (device
        time: what the op costs inside a model step, whose host runs ahead of the GPU; the per-call timing above also
        holds the host's launch cost, which a call of small kernels at batch 1 cannot hide) and the latter's share
        of the copy bandwidth on `bytes_read`."""
        device_us, res[f"{tag}_kernels_us"] = device_us_per_call(fn, *args, calls=CHAIN, top=8)
        res[f"{tag}_device_us"] = round(device_us, 2)
        if device_us > 0:  # no GPU events (a CPU run): no share
            res[f"{tag}_device_pct_hbm"] = round(100 * bytes_read / (device_us * 1e-6) / copy_bw, 1)

    def best_of(names, op_of, args, tag):
        """Times op_of(name)(eps, *args) per call for every tuning in `names` (recorded under `tag`) -> (best name,
        its time in us)."""
        times = {name: median_time(op_of(name), eps, *args, per_call=CHAIN) * 1e6 for name in names}
        if len(names) > 1:
            res[f"tunings_{tag}_us"] = {n: round(t, 2) for n, t in times.items()}
        best = min(times, key=times.get)
        return best, times[best]

    for batch in batches:
        k = jax.random.fold_in(key, 100 + batch)
        queries = {h: (jax.random.normal(jax.random.fold_in(k, 10 * h), (batch, 1, h, RANK), jnp.bfloat16) * 0.05,
                       jax.random.normal(jax.random.fold_in(k, 10 * h + 1), (batch, 1, h, ROPE), jnp.bfloat16) * 0.05)
                   for h in head_counts}
        q_idx = jax.random.normal(jax.random.fold_in(k, 2), (batch, 1, IDX_HEADS, IDX_DIM), jnp.bfloat16)
        q_idx8, q_idx_scales = fp8_indexer.rotate_and_quantize(q_idx)
        w = jax.random.normal(jax.random.fold_in(k, 3), (batch, 1, IDX_HEADS), jnp.float32) * IDX_DIM ** -0.5
        w8 = w * q_idx_scales
        mla_names = {h: list(decode_tunings[h]) for h in head_counts}  # swept at the first context
        index_names = list(indexer_tunings)
        # call n of a chain reads rows n*batch.. of the block tables (mod max_batch): at batch 1, ten calls over ten
        # requests' caches (94 MB at 8K, more than the 50 MB L2) instead of one request's 9.4 MB ten times
        rows = (jnp.arange(CHAIN)[:, None] * batch + jnp.arange(batch)[None]) % max_batch  # [CHAIN, batch]
        for ctx in contexts:
            tag = f"B{batch}_{ctx // 1024}K"
            tables = all_tables[rows][:, :, :ctx // BLOCK]  # [CHAIN, batch, pages]
            pos = jnp.full((batch, 1), ctx - 1, jnp.int32)
            sel = jax.vmap(lambda kk: jax.random.choice(kk, ctx, (TOPK,), replace=False))(  # [CHAIN, B, 1, K]
                jax.random.split(jax.random.fold_in(k, ctx), CHAIN * batch)).astype(jnp.int32).reshape(
                CHAIN, batch, 1, TOPK)
            for heads in head_counts:
                h_tag = tag + _heads_suffix(heads)
                q_lat, q_rope = queries[heads]
                name, us = best_of(mla_names[heads], lambda n: mla_op(heads, n, False),
                                   (q_lat, q_rope, latent, all_tables[rows], pos, sel), f"sparse_decode_{h_tag}")
                mla_names[heads] = [name]
                res[f"sparse_decode_{h_tag}_us"] = round(us, 2)
                res[f"sparse_decode_{h_tag}_pct_hbm"] = round(100 * batch * TOPK * 576 * 2 / (us * 1e-6) / copy_bw, 1)
                res[f"sparse_decode_{h_tag}_TFLOPs"] = round(batch * TOPK * heads * 2 * (576 + 512) / (us * 1e-6)
                                                             / 1e12, 1)
                if profile:
                    profiled(f"sparse_decode_{h_tag}", batch * TOPK * 576 * 2, mla_op(heads, name, False), eps, q_lat,
                             q_rope, latent, all_tables[rows], pos, sel)
                us = median_time(mla_op(heads, name, True), eps, q_lat, q_rope, latent, tables, pos,
                                 per_call=CHAIN) * 1e6
                res[f"dense_decode_{h_tag}_us"] = round(us, 2)
                res[f"dense_decode_{h_tag}_pct_hbm"] = round(100 * batch * ctx * 576 * 2 / (us * 1e-6) / copy_bw, 1)
            name, us = best_of(index_names, lambda n: index_op(n, "topk"), (w, q_idx, pos, keys_bf16, tables),
                               f"indexer_topk_{tag}")
            index_names = [name]
            res[f"indexer_topk_{tag}_us"] = round(us, 2)
            res[f"indexer_topk_{tag}_pct_hbm"] = round(100 * batch * ctx * IDX_DIM * 2 / (us * 1e-6) / copy_bw, 1)
            if profile:
                profiled(f"indexer_topk_{tag}", batch * ctx * IDX_DIM * 2, index_op(name, "topk"), eps, w, q_idx, pos,
                         keys_bf16, tables)
            us = median_time(index_op(name, "topk_fp8"), eps, w8, q_idx8, pos, keys_fp8, tables, key_scales,
                             per_call=CHAIN) * 1e6
            res[f"indexer_topk_fp8_{tag}_us"] = round(us, 2)
            res[f"indexer_topk_fp8_{tag}_pct_hbm"] = round(
                100 * batch * ctx * (IDX_DIM + 4) / (us * 1e-6) / copy_bw, 1)
            us = median_time(index_op(name, "scores"), eps, w, q_idx, pos, keys_bf16, tables, per_call=CHAIN) * 1e6
            res[f"index_scores_{tag}_us"] = round(us, 2)
            res[f"index_scores_{tag}_pct_hbm"] = round(100 * batch * ctx * IDX_DIM * 2 / (us * 1e-6) / copy_bw, 1)
        res[f"decode_tunings_B{batch}"] = {"indexer": index_names[0],
                                           **{f"sparse_mla{_heads_suffix(h)}": mla_names[h][0] for h in head_counts}}
        for heads in head_counts:
            b_tag = f"B{batch}{_heads_suffix(heads)}"
            lat = [res[f"sparse_decode_B{batch}_{c // 1024}K{_heads_suffix(heads)}_us"] for c in contexts]
            res[f"sparse_decode_{b_tag}_max_over_min"] = round(max(lat) / min(lat), 3)
            device = [res.get(f"sparse_decode_B{batch}_{c // 1024}K{_heads_suffix(heads)}_device_us") for c in contexts]
            if all(device):
                res[f"sparse_decode_{b_tag}_device_max_over_min"] = round(max(device) / min(device), 3)
            over = [c for c, t in zip(contexts, lat) if res[f"indexer_topk_B{batch}_{c // 1024}K_us"] + t
                    < res[f"dense_decode_B{batch}_{c // 1024}K{_heads_suffix(heads)}_us"]]
            res[f"sparse_overtakes_dense_{b_tag}"] = f"{over[0] // 1024}K" if over else f">{max(contexts) // 1024}K"
    del latent, keys_bf16, keys_fp8, key_scales

    if not prefill_too:
        return res
    # ------------------------------------------------------------------------------------------------ prefill
    prefill_best = None  # tunings are swept at the first prefill length
    for ctx in prefill:
        k = jax.random.fold_in(key, 1000 + ctx)
        n_blocks = ctx // BLOCK
        cache = jax.random.normal(k, (1, n_blocks + 1, BLOCK, RANK + ROPE), jnp.bfloat16)
        tables = jnp.arange(1, n_blocks + 1, dtype=jnp.int32)[None]
        t = jnp.arange(ctx, dtype=jnp.int32)[:, None]
        j = jnp.arange(TOPK, dtype=jnp.int32)[None, :]
        u = jax.random.uniform(jax.random.fold_in(k, 1), (ctx, TOPK))
        strided = jnp.floor((j + u) * (t + 1).astype(jnp.float32) / TOPK).astype(jnp.int32)
        sel = jnp.where(t + 1 <= TOPK, jnp.where(j <= t, j, -1), jnp.minimum(strided, t))[None]
        pos = t.T
        q_lat = jax.random.normal(jax.random.fold_in(k, 2), (1, ctx, HEADS, RANK), jnp.bfloat16) * 0.05
        q_rope = jax.random.normal(jax.random.fold_in(k, 3), (1, ctx, HEADS, ROPE), jnp.bfloat16) * 0.05
        names = list(prefill_tunings) if prefill_best is None else [prefill_best]
        times = {}
        for name in names:
            run = jax.jit(lambda q, qr, c, tb, p, i, cfg=prefill_tunings[name]: sparse_mla.sparse_mla(
                q, qr, c, 0, tb, p, i, 576 ** -0.5, config=cfg))
            times[name] = median_time(run, q_lat, q_rope, cache, tables, pos, sel, reps=3)
        prefill_best = min(times, key=times.get)
        s = times[prefill_best]
        pairs = sum(min(i + 1, TOPK) for i in range(ctx))
        if len(names) > 1:
            res[f"tunings_sparse_prefill_{ctx // 1024}K_ms"] = {n: round(t * 1e3, 2) for n, t in times.items()}
        res[f"sparse_prefill_{ctx // 1024}K_ms"] = round(s * 1e3, 2)
        res[f"sparse_prefill_{ctx // 1024}K_TFLOPs"] = round(HEADS * pairs * 2 * (576 + 512) / s / 1e12, 1)
        del q_lat, q_rope, sel, cache, u, strided
        try:  # dense prefill beside it: cuDNN flash attention on the expanded heads (q/k 192, v 128 padded to 192)
            shape = (1, ctx, HEADS, 192)
            qd, kd, vd = (jax.random.normal(jax.random.fold_in(k, 10 + i), shape, jnp.bfloat16) for i in range(3))
            attend = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=True,
                                                                          implementation="cudnn"))
            s = median_time(attend, qd, kd, vd, reps=3)
            res[f"dense_prefill_cudnn_{ctx // 1024}K_ms"] = round(s * 1e3, 2)
            res[f"dense_prefill_cudnn_{ctx // 1024}K_TFLOPs"] = round(
                HEADS * ctx * (ctx + 1) / 2 * 2 * (192 + 128) / s / 1e12, 1)
            del qd, kd, vd
        except Exception as err:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
            res[f"dense_prefill_cudnn_{ctx // 1024}K_ms"] = f"failed: {type(err).__name__}"
    ctx = PREFILL[0]
    k = jax.random.fold_in(key, 5000)
    n_blocks = ctx // BLOCK
    idx_keys = jax.random.normal(k, (1, n_blocks + 1, BLOCK, IDX_DIM), jnp.bfloat16)
    q_idx = jax.random.normal(jax.random.fold_in(k, 1), (1, ctx, IDX_HEADS, IDX_DIM), jnp.bfloat16)
    w = jax.random.normal(jax.random.fold_in(k, 2), (1, ctx, IDX_HEADS), jnp.float32) * IDX_DIM ** -0.5
    tables = jnp.arange(1, n_blocks + 1, dtype=jnp.int32)[None]
    pos = jnp.arange(ctx, dtype=jnp.int32)[None]
    run = jax.jit(lambda q, w, p, c, tb: indexer_pallas.indexer_topk(q, w, p, c, 0, tb, TOPK))
    res[f"indexer_topk_prefill_{ctx // 1024}K_ms"] = round(median_time(run, q_idx, w, pos, idx_keys, tables,
                                                                       reps=2) * 1e3, 1)
    res.update(fp8_selection_error(32768))
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    parser.add_argument("--quick", action="store_true", help="8K/32K decode and 32K prefill only")
    parser.add_argument("--no-sweep", action="store_true", help="default tunings only (no per-kernel tile sweep)")
    parser.add_argument("--heads", default=f"{HEADS},16",
                        help="MLA decode query heads per device, comma-separated (128: V3.2 on one device, 16: one "
                             "rank of tensor parallelism 8)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="decode batch sizes")
    parser.add_argument("--no-prefill", action="store_true", help="decode only")
    parser.add_argument("--profile", action="store_true", help="decode ops' kernel time per call by kernel")
    args = parser.parse_args(argv)
    head_counts = tuple(int(h) for h in args.heads.split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    unknown = [h for h in head_counts if h not in (HEADS, 16)]
    if unknown:
        parser.error(f"--heads: no decode tunings for {unknown} heads (known: {HEADS}, 16)")
    start = time.perf_counter()
    res: dict = {}
    try:
        measure(args.quick, res, sweep=not args.no_sweep, head_counts=head_counts, batches=batches,
                prefill_too=not args.no_prefill, profile=args.profile)
    except KeyboardInterrupt:  # `timeout -s INT`: report what was measured, marked as partial
        res["interrupted_after_s"] = round(time.perf_counter() - start)
    import jax

    device = jax.devices()[0]
    print(f"\n{device.device_kind}, jax {jax.__version__}, HBM copy {res.get('hbm_copy_TBps')} TB/s, "
          f"{time.perf_counter() - start:.0f} s")
    if "interrupted_after_s" in res:
        print(f"interrupted: partial results {json.dumps(res)}")
    else:
        print_table(res, args.quick, head_counts, batches, not args.no_prefill)
    line = (f"- {datetime.date.today()} sparse_attention.py, {device.device_kind}, commit {git_commit()}, "
            f"jax {jax.__version__}, Pallas (Triton) kernels, DeepSeek-V3.2 shapes (MLA decode at "
            f"{' and '.join(map(str, head_counts))} query heads per device: keys without a suffix are 128 heads, "
            f"'_h16' 16; 512+64 latent, indexer 64x128, top-k 2048): {json.dumps(res)} (dense MLA decode and cuDNN "
            f"dense prefill measured in the same run)\n")
    append_line(args.results, line)
    return 0


def print_table(res: dict, quick: bool, head_counts=(HEADS,), batches=BATCHES, prefill_too=True) -> None:
    """The decode table and the prefill lines of a complete run."""
    print("| batch | context | heads | sparse attn (us, % HBM) | dense MLA (us, % HBM) | indexer+top-k bf16 (us, % HBM) "
          "| fp8 (us, % HBM) | scores only (us) |\n|---|---|---|---|---|---|---|---|")
    contexts = CONTEXTS[:2] if quick else CONTEXTS
    for batch in batches:
        for ctx in contexts:
            tag = f"B{batch}_{ctx // 1024}K"
            for heads in head_counts:
                h_tag = tag + _heads_suffix(heads)
                device = (f"; device {res[f'sparse_decode_{h_tag}_device_us']} "
                          f"({res[f'sparse_decode_{h_tag}_device_pct_hbm']})"
                          if f"sparse_decode_{h_tag}_device_pct_hbm" in res else "")
                print(f"| {batch} | {ctx // 1024}K | {heads} | {res[f'sparse_decode_{h_tag}_us']} "
                      f"({res[f'sparse_decode_{h_tag}_pct_hbm']}){device} | {res[f'dense_decode_{h_tag}_us']} "
                      f"({res[f'dense_decode_{h_tag}_pct_hbm']}) | {res[f'indexer_topk_{tag}_us']} "
                      f"({res[f'indexer_topk_{tag}_pct_hbm']}) | {res[f'indexer_topk_fp8_{tag}_us']} "
                      f"({res[f'indexer_topk_fp8_{tag}_pct_hbm']}) | {res[f'index_scores_{tag}_us']} |")
        for heads in head_counts:
            b_tag = f"B{batch}{_heads_suffix(heads)}"
            print(f"batch {batch}, {heads} heads: sparse latency max/min over contexts "
                  f"{res[f'sparse_decode_{b_tag}_max_over_min']}, sparse overtakes dense at "
                  f"{res[f'sparse_overtakes_dense_{b_tag}']}")
    for ctx in (PREFILL[:1] if quick else PREFILL) if prefill_too else ():
        print(f"prefill {ctx // 1024}K: sparse {res[f'sparse_prefill_{ctx // 1024}K_ms']} ms "
              f"({res[f'sparse_prefill_{ctx // 1024}K_TFLOPs']} TFLOP/s); dense cuDNN "
              f"{res.get(f'dense_prefill_cudnn_{ctx // 1024}K_ms')} ms "
              f"({res.get(f'dense_prefill_cudnn_{ctx // 1024}K_TFLOPs', '-')} TFLOP/s)")


if __name__ == "__main__":
    sys.exit(main())
