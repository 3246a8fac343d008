"""DeepSeek Sparse Attention kernels on the GPU, dense MLA attention beside them in the same run.

    python3 benchmarks/sparse_attention.py [--results benchmarks/RESULTS.md] [--quick]

DeepSeek-V3.2 shapes, bf16: 128 heads of absorbed queries over the paged latent cache (kv_lora_rank 512 + rope 64,
blocks of 64 tokens, scattered), indexer 64 heads x 128, top-k 2048, one layer. Measured:
- decode, batch 1 and 16, contexts 8K / 32K / 128K / 512K: sparse MLA attention after selection (its gathered latent
  bytes against the HBM copy bandwidth: flat in context by design), the indexer + top-k (exact bf16 keys, and FP8
  keys; their key bytes against the copy bandwidth), the score kernel alone, and dense MLA decode (the same kernel
  with every token selected); the context where sparse (indexer + top-k + attention) overtakes dense.
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

from results import append_line, git_commit  # benchmarks/results.py: a script's own folder is on sys.path

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
              "fused_h64k32w16_s64": SparseMLAConfig(num_warps=16, decode_programs=132, min_split_tokens=64),
              "fused_h64k16w8_s64": SparseMLAConfig(decode_block_k=16, decode_programs=132, min_split_tokens=64),
              # 32-head blocks: no register spills at 8 warps when built for sm_90 offline (triton_report.py --op
              # sparse_mla: 250 registers, against 255 + 484 bytes of spills at 64 heads)
              "fused_h32k32w8": SparseMLAConfig(block_h=32),
              "fused_h32k32w8_s64": SparseMLAConfig(block_h=32, min_split_tokens=64),
              "h32k32w8": heads_split(32, 32), "h64k16w8": heads_split(64, 16),
              "h32k32w8_split1024": heads_split(32, 32, min_split_tokens=1024),
              "h16k32w4": heads_split(16, 32, num_warps=4)}
    prefill = {"h64k16w8": SparseMLAConfig(), "h32k32w8": SparseMLAConfig(block_h=32, block_k=32)}
    indexer = {"k128w4": IndexerKernelConfig(), "k64w4": IndexerKernelConfig(block_k=64),
               "k256w8": IndexerKernelConfig(block_k=256, num_warps=8)}
    return decode, prefill, indexer


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


def measure(quick: bool, res: dict, sweep: bool = True) -> dict:
    """Fills `res` as it goes (so an interrupted run still reports what it measured) and returns it."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    import jax
    import jax.numpy as jnp

    from dayzero.kernels import fp8_indexer, indexer_pallas, sparse_mla

    decode_tunings, prefill_tunings, indexer_tunings = _tunings()
    if not sweep:  # the first (default) tuning of each kernel only: fewer compilations
        decode_tunings, prefill_tunings, indexer_tunings = ({k: v} for k, v in
                                                            (next(iter(t.items())) for t in _tunings()))
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
            for n in range(CHAIN):
                args = tuple(a[n] if i in per_call else a for i, a in enumerate(rest))
                out = op(q, *args)
                q = q + (eps * out.reshape(-1)[0].astype(jnp.float32)).astype(q.dtype)
            return out

        return jax.jit(run)

    eps = jnp.float32(0.0)
    x = jax.random.normal(jax.random.key(0), (256 * 1024 * 1024,), jnp.float32)  # 1 GiB
    copy_bw = 2 * x.nbytes / median_time(jax.jit(lambda a: a * 1.0001), x)
    res["hbm_copy_TBps"] = round(copy_bw / 1e12, 3)
    del x

    # ------------------------------------------------------------------------------------------------- decode
    max_batch, max_ctx = max(BATCHES), max(contexts)
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

    def mla_op(name, dense):
        """Sparse (indices given) or dense MLA decode with tuning `name`, chained."""
        if (name, dense) not in mla_ops:
            cfg = decode_tunings[name]
            mla_ops[name, dense] = chained(
                (lambda q, qr, c, t, p: sparse_mla.sparse_mla(q, qr, c, 0, t, p, None, 576 ** -0.5, config=cfg))
                if dense else
                (lambda q, qr, c, t, p, i: sparse_mla.sparse_mla(q, qr, c, 0, t, p, i, 576 ** -0.5, config=cfg)),
                per_call=(2,) if dense else (2, 4))
        return mla_ops[name, dense]

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

    def best_of(names, op_of, args, tag):
        """Times op_of(name)(eps, *args) per call for every tuning in `names` (recorded under `tag`) -> (best name,
        its time in us)."""
        times = {name: median_time(op_of(name), eps, *args, per_call=CHAIN) * 1e6 for name in names}
        if len(names) > 1:
            res[f"tunings_{tag}_us"] = {n: round(t, 2) for n, t in times.items()}
        best = min(times, key=times.get)
        return best, times[best]

    for batch in BATCHES:
        k = jax.random.fold_in(key, 100 + batch)
        q_lat = jax.random.normal(k, (batch, 1, HEADS, RANK), jnp.bfloat16) * 0.05
        q_rope = jax.random.normal(jax.random.fold_in(k, 1), (batch, 1, HEADS, ROPE), jnp.bfloat16) * 0.05
        q_idx = jax.random.normal(jax.random.fold_in(k, 2), (batch, 1, IDX_HEADS, IDX_DIM), jnp.bfloat16)
        q_idx8, q_idx_scales = fp8_indexer.rotate_and_quantize(q_idx)
        w = jax.random.normal(jax.random.fold_in(k, 3), (batch, 1, IDX_HEADS), jnp.float32) * IDX_DIM ** -0.5
        w8 = w * q_idx_scales
        mla_names, index_names = list(decode_tunings), list(indexer_tunings)  # swept at the first context
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
            name, us = best_of(mla_names, lambda n: mla_op(n, False),
                               (q_lat, q_rope, latent, all_tables[rows], pos, sel), f"sparse_decode_{tag}")
            mla_names = [name]
            res[f"sparse_decode_{tag}_us"] = round(us, 2)
            res[f"sparse_decode_{tag}_pct_hbm"] = round(100 * batch * TOPK * 576 * 2 / (us * 1e-6) / copy_bw, 1)
            us = median_time(mla_op(name, True), eps, q_lat, q_rope, latent, tables, pos, per_call=CHAIN) * 1e6
            res[f"dense_decode_{tag}_us"] = round(us, 2)
            res[f"dense_decode_{tag}_pct_hbm"] = round(100 * batch * ctx * 576 * 2 / (us * 1e-6) / copy_bw, 1)
            name, us = best_of(index_names, lambda n: index_op(n, "topk"), (w, q_idx, pos, keys_bf16, tables),
                               f"indexer_topk_{tag}")
            index_names = [name]
            res[f"indexer_topk_{tag}_us"] = round(us, 2)
            res[f"indexer_topk_{tag}_pct_hbm"] = round(100 * batch * ctx * IDX_DIM * 2 / (us * 1e-6) / copy_bw, 1)
            us = median_time(index_op(name, "topk_fp8"), eps, w8, q_idx8, pos, keys_fp8, tables, key_scales,
                             per_call=CHAIN) * 1e6
            res[f"indexer_topk_fp8_{tag}_us"] = round(us, 2)
            res[f"indexer_topk_fp8_{tag}_pct_hbm"] = round(
                100 * batch * ctx * (IDX_DIM + 4) / (us * 1e-6) / copy_bw, 1)
            us = median_time(index_op(name, "scores"), eps, w, q_idx, pos, keys_bf16, tables, per_call=CHAIN) * 1e6
            res[f"index_scores_{tag}_us"] = round(us, 2)
        res[f"decode_tunings_B{batch}"] = {"sparse_mla": mla_names[0], "indexer": index_names[0]}
        lat = [res[f"sparse_decode_B{batch}_{c // 1024}K_us"] for c in contexts]
        res[f"sparse_decode_B{batch}_max_over_min"] = round(max(lat) / min(lat), 3)
        over = [c for c in contexts if res[f"indexer_topk_B{batch}_{c // 1024}K_us"]
                + res[f"sparse_decode_B{batch}_{c // 1024}K_us"] < res[f"dense_decode_B{batch}_{c // 1024}K_us"]]
        res[f"sparse_overtakes_dense_B{batch}"] = f"{over[0] // 1024}K" if over else f">{max(contexts) // 1024}K"
    del latent, keys_bf16, keys_fp8, key_scales

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
    args = parser.parse_args(argv)
    start = time.perf_counter()
    res: dict = {}
    try:
        measure(args.quick, res, sweep=not args.no_sweep)
    except KeyboardInterrupt:  # `timeout -s INT`: report what was measured, marked as partial
        res["interrupted_after_s"] = round(time.perf_counter() - start)
    import jax

    device = jax.devices()[0]
    print(f"\n{device.device_kind}, jax {jax.__version__}, HBM copy {res.get('hbm_copy_TBps')} TB/s, "
          f"{time.perf_counter() - start:.0f} s")
    if "interrupted_after_s" in res:
        print(f"interrupted: partial results {json.dumps(res)}")
    else:
        print_table(res, args.quick)
    line = (f"- {datetime.date.today()} sparse_attention.py, {device.device_kind}, commit {git_commit()}, "
            f"jax {jax.__version__}, Pallas (Triton) kernels, DeepSeek-V3.2 shapes (128 heads, 512+64 latent, "
            f"indexer 64x128, top-k 2048): {json.dumps(res)} (dense MLA decode and cuDNN dense prefill measured in "
            f"the same run)\n")
    append_line(args.results, line)
    return 0


def print_table(res: dict, quick: bool) -> None:
    """The decode table and the prefill lines of a complete run."""
    print("| batch | context | sparse attn (us, % HBM) | indexer+top-k bf16 (us, % HBM) | fp8 (us, % HBM) | "
          "scores only (us) | dense MLA (us, % HBM) |\n|---|---|---|---|---|---|---|")
    contexts = CONTEXTS[:2] if quick else CONTEXTS
    for batch in BATCHES:
        for ctx in contexts:
            tag = f"B{batch}_{ctx // 1024}K"
            print(f"| {batch} | {ctx // 1024}K | {res[f'sparse_decode_{tag}_us']} "
                  f"({res[f'sparse_decode_{tag}_pct_hbm']}) | {res[f'indexer_topk_{tag}_us']} "
                  f"({res[f'indexer_topk_{tag}_pct_hbm']}) | {res[f'indexer_topk_fp8_{tag}_us']} "
                  f"({res[f'indexer_topk_fp8_{tag}_pct_hbm']}) | {res[f'index_scores_{tag}_us']} | "
                  f"{res[f'dense_decode_{tag}_us']} ({res[f'dense_decode_{tag}_pct_hbm']}) |")
        print(f"batch {batch}: sparse latency max/min over contexts {res[f'sparse_decode_B{batch}_max_over_min']}, "
              f"sparse overtakes dense at {res[f'sparse_overtakes_dense_B{batch}']}")
    for ctx in PREFILL[:1] if quick else PREFILL:
        print(f"prefill {ctx // 1024}K: sparse {res[f'sparse_prefill_{ctx // 1024}K_ms']} ms "
              f"({res[f'sparse_prefill_{ctx // 1024}K_TFLOPs']} TFLOP/s); dense cuDNN "
              f"{res.get(f'dense_prefill_cudnn_{ctx // 1024}K_ms')} ms "
              f"({res.get(f'dense_prefill_cudnn_{ctx // 1024}K_TFLOPs', '-')} TFLOP/s)")


if __name__ == "__main__":
    sys.exit(main())
