"""MoE layer benchmark (routed experts) on one GPU: the medium hybrid's layer (64 experts, top-6, hidden 2048, expert
width 768) and a DeepSeek-size layer (256 experts, top-8, 7168 x 2048) at 1, 16, 64, 256 tokens and an 8K prefill.

    python3 benchmarks/moe.py [--results benchmarks/RESULTS.md] [--shapes medium,deepseek] [--tokens 1,16,64,256,8192]
                              [--sweep [all|split_k|decode16|many|gemv|dense|mlp,...]]
                              [--dense-only | --variants fused,fp8,...]

Variants, on the same weights (random MXFP4; the others converted from it) and the same uniform top-k routing:
  bf16      jax.lax.ragged_dot over dense bf16 experts (dayzero.kernels.moe.moe_experts with block_m=None)
  bf16 auto the plain-XLA choice for dense bf16 experts (what the model runs where the Pallas kernels do not):
            ragged_dot or gathered one-expert tiles (kernels/moe_grouped.py; tile rows reported, "-" for ragged_dot)
  bf16 pallas the Pallas grouped matmuls over the dense bf16 experts (kernels/moe_dense.py), each used weight tile
            read once; its % of read bandwidth counts the active experts' bf16 bytes; "fused" beside it: the same
            kernels with `DenseTiles.fused_prologues` (row gather and SwiGLU inside their operand loads)
  fp8       pre-converted FP8: the whole layer converted offline (E2M1 values in e4m3 + E8M0 scales), Pallas matmul
  fused     MXFP4 online as the model runs it (kernels/moe.py's default): the MMA kernels below, or the CUDA-core
            decode kernels where `moe_mxfp4_gemv.choose` takes the call
  mma       MXFP4 online on the MMA kernels (kernels/moe_mxfp4.py, `choose_tiles`' tiles): each weight tile converted
            in registers right before its MMA
  staged    MXFP4 online through the one-layer FP8 workspace (each call is a new layer: every expert converted);
            timed where the model uses it and at the first and last token counts
  resident  staged, calling the same layer again: resident conversions reused (hit rate reported; first and last)
  online    what the model runs (MXFP4Execution "auto": fused below `workspace_min_rows` rows per expert, staged at
            and above)
  gemv      MXFP4 online on the CUDA cores (kernels/moe_mxfp4_gemv.py: no MMA; fp16x2 products of each thread's
            converted bytes), the tiles `moe_mxfp4_gemv.tiles_for` picks
  kernels   the mma variant's two Pallas kernels alone (routing, gathers and the combine left out; <= 16 tokens;
            with split-K tiles their partial sums reduced per pair)
For mma and gemv a profiler trace also gives the layer call's GPU time (`_device`: the sum of its kernels, without
the launch gaps and the timing loop's per-iteration overhead that the chained timing includes) and its two Pallas
kernels' time (`_kernels`).
Device time per call: `iters` calls chained inside one jit (each call's input depends on the previous output), median
of 5 runs. The HBM read bandwidth measured in the same run (`timing.hbm_read_bandwidth`: what XLA's reductions of
1 GiB stream in; the experts' kernels only read) is the roofline: decode must stream the active experts' MXFP4 bytes
(4.25 bits per weight); the bandwidth figures divide those bytes by the whole layer's time and by the kernels' time.
Until the twenty-second session the roofline was a chained copy of 1 GiB timed in this script, which read 3.43-3.72
TB/s against ~4.1 for timing.py's pipelined copy and ~4.29 for the read: the earlier lines' percentages are ~1.2x
what the read roofline gives. Beside the measured bf16 ragged_dot (which XLA may run over every expert, padded),
"bf16 roofline" is an ideal bf16 kernel reading only the active experts at that bandwidth. A variant that cannot run
(out of memory) is reported as not measured. Prints a table and appends a dated line to the results file.
`--sweep` also times the MMA kernels over a few tile configurations: at 1 token (split-K ones included), with
`decode16` at 16 tokens, with `many` over MANY_SWEEP at each token count from 17 to 1024 (PREFILL_SWEEP above);
`gemv`: the CUDA-core kernels over GEMV_SWEEP's tiles at each token count up to 64; `dense`: the bf16 dense-expert
kernels over DENSE_SWEEP's tiles at each token count up to 16 (GPU time); `dense16`: the same at 16 tokens over
the epilogue tiles of DENSE16_SWEEP; `mlp`: the one-kernel MLP (DenseTiles.fused_mlp) over MLP_SWEEP's tiles
likewise, and choose_tiles' own with the down kernel's atomic combine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.kernels import moe, moe_dense, moe_grouped, moe_mxfp4, moe_mxfp4_gemv, moe_tiles, moe_workspace, mxfp4
from dayzero.model.config import MXFP4Execution

from results import append_line, git_commit  # benchmarks/results.py: a script's own folder is on sys.path
from timing import hbm_copy_bandwidth, hbm_read_bandwidth  # benchmarks/timing.py

SHAPES = {"medium": (64, 6, 2048, 768), "deepseek": (256, 8, 7168, 2048), "tiny": (8, 2, 64, 32)}
TOKENS = (1, 16, 64, 256, 8192)


def per_call(step, carry, iters: int, operands=(), repeats: int = 5):
    """step(carry, i, operands) -> carry, chained `iters` times in one jit; returns (seconds per call, final carry).
    The weights go in `operands`, arguments of the jit: closed over, XLA would embed them in the program as
    constants (gigabytes at the DeepSeek shape, and minutes of compile)."""
    loop = jax.jit(lambda c, ops: jax.lax.fori_loop(0, iters, lambda i, c: step(c, i, ops), c))
    out = jax.block_until_ready(loop(carry, operands))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(loop(carry, operands))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / iters, out


def make_layer(key, n_experts: int, hidden: int, inter: int, with_fp8: bool = True, with_bf16: bool = True):
    """Random MXFP4 experts (std ~0.02) and their pre-converted FP8 and dense bf16 versions (converted per expert;
    None where not `with_fp8` / `with_bf16`: the DeepSeek-size layer's three forms are ~41 GB, which with a
    workspace and 8192 tokens' activations did not fit an H100's 80 GB)."""
    ew = mxfp4.random_experts(key, n_experts, hidden, inter)
    gb, ub, db, gs, us, ds = ew.gate, ew.up, ew.down, ew.gate_scales, ew.up_scales, ew.down_scales
    fp8 = jax.jit(lambda b, s: jax.lax.map(lambda a: mxfp4.to_workspace(a[0], a[1], "float8_e4m3fn"), (b, s)))
    # padded where the whole layer in FP8 is a stack the kernels cannot index (the DeepSeek-size layer, 3.76e9 bytes a
    # projection: tiles.offsets_wrap); before 2026-12-06 its figures came from kernels reading outside the stack
    ew8 = moe_workspace.clear_of_offset_wrap(mxfp4.ExpertWeights(
        fp8(gb, gs), fp8(ub, us), fp8(db, ds), gs, us, ds, fmt="float8_e4m3fn")) if with_fp8 else None
    dense = jax.jit(lambda b, s, k: jax.lax.map(lambda a: mxfp4.dequantize(a[0], a[1], jnp.bfloat16)[:, :k].T,
                                                (b, s)), static_argnums=2)
    bf16 = (dense(gb, gs, hidden), dense(ub, us, hidden), dense(db, ds, inter)) if with_bf16 else None
    return jax.block_until_ready((ew, ew8, bf16))


def routing(key, n_tokens: int, n_experts: int, top_k: int):
    """Uniform top-k routing (distinct experts per token) and softmax-like weights."""
    ks, kw = jax.random.split(key)
    _, ids = jax.lax.top_k(jax.random.uniform(ks, (n_tokens, n_experts)), top_k)
    w = jax.random.uniform(kw, (n_tokens, top_k), jnp.float32, 0.1, 1.0)
    return ids.astype(jnp.int32), w / jnp.sum(w, axis=1, keepdims=True)


def mxfp4_bytes(active: int, hidden: int, inter: int) -> int:
    """Bytes of `active` experts' three MXFP4 projections (blocks + scales)."""
    per = 2 * inter * mxfp4.num_blocks(hidden) + hidden * mxfp4.num_blocks(inter)
    return active * per * 17  # 16 block bytes + 1 scale byte per 32 weights


def attempt(label: str, fn):
    """fn() -> value, or None (said why) when the variant cannot run at this size: XLA's bf16 ragged_dot pads every
    group to the full row count on GPUs, which runs out of memory at 8K tokens x 256 experts."""
    start = time.perf_counter()
    try:
        value = fn()
        print(f"  {label}: {time.perf_counter() - start:.1f} s (compile and time)", flush=True)
        return value
    except Exception as e:  # noqa: BLE001 - a benchmark reports a failing variant and goes on
        print(f"  {label}: not measured ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
        return None


VARIANTS = ("bf16", "bf16_auto", "bf16_pallas", "bf16_pallas_fused", "fp8", "fused", "staged", "resident", "kernels",
            "mma", "gemv")
DENSE_VARIANTS = VARIANTS[:4]


def bench_case(name, n_tokens, layer, impl, extras: bool, bandwidth: float, variants=VARIANTS) -> dict:
    """One layer call size; `extras` adds staged (when not what the model runs) and resident timings; `variants`
    names the variants timed (VARIANTS)."""
    n_experts, top_k, hidden, inter = SHAPES[name]
    ew, ew8, dense = layer
    ids, w = routing(jax.random.key(n_tokens), n_tokens, n_experts, top_k)
    x = jax.random.normal(jax.random.key(1), (n_tokens, hidden), jnp.bfloat16)
    iters = 3 if n_tokens >= 4096 else 20
    eps = jnp.asarray(1e-3, jnp.bfloat16)
    seconds, res = {}, {}

    def plain(fn, weights):
        """fn(x, weights) -> [T, D]: the weights passed as jit arguments."""
        return per_call(lambda x, i, ops: x + eps * fn(x, ops), x, iters, weights)[0]

    def timed(variant, label, fn):
        if variant in variants:
            seconds[variant] = attempt(label, fn)

    timed("bf16", "bf16 ragged_dot", lambda: plain(
        lambda x, d: moe.moe_experts(x, ids, w, *d, block_m=None), dense))
    block_m = moe_grouped.choose_block_m(ids.size, n_experts, hidden, inter, 2)
    if block_m is None and "bf16_auto" in variants:
        seconds["bf16_auto"] = seconds.get("bf16")
    else:
        timed("bf16_auto", "bf16 tiles", lambda: plain(
            lambda x, d: moe.moe_experts(x, ids, w, *d, block_m=block_m), dense))
    timed("bf16_pallas", "bf16 pallas", lambda: plain(
        lambda x, d: moe.moe_experts(x, ids, w, *d, impl=impl), dense))
    fused_tiles = dataclasses.replace(moe_dense.choose_tiles(ids.size, n_experts), fused_prologues=True)
    timed("bf16_pallas_fused", "bf16 pallas, fused prologues", lambda: plain(
        lambda x, d: moe_dense.grouped_swiglu(x, ids, w, *d, tiles=fused_tiles, interpret=impl == "interpret"), dense))
    timed("fp8", "fp8", lambda: plain(lambda x, e: moe.moe_experts_packed(x, ids, w, e, impl=impl)[0], ew8))
    timed("fused", "fused", lambda: plain(lambda x, e: moe.moe_experts_packed(x, ids, w, e, impl=impl)[0], ew))
    mma_tiles = moe_mxfp4.choose_tiles(ids.size, n_experts, hidden)
    gemv_tiles = moe_mxfp4_gemv.tiles_for(ids.size, n_experts)
    layers = {"mma": lambda x, e: moe.moe_experts_packed(x, ids, w, e, tiles=mma_tiles, impl=impl)[0],
              "gemv": lambda x, e: moe_mxfp4_gemv.grouped_swiglu(x, ids, w, e, tiles=gemv_tiles,
                                                                 interpret=impl == "interpret")}
    for variant, tiles in (("mma", mma_tiles), ("gemv", gemv_tiles)):  # timed, then traced for their GPU time
        timed(variant, f"{variant} {tiles}", lambda: plain(layers[variant], ew))
        if seconds.get(variant):
            seconds[f"{variant}_device"], seconds[f"{variant}_kernels"], res[f"{variant}_top_kernels_us"] = (
                traced_device_time(layers[variant], x, ew, impl == "interpret"))
    ws = moe_workspace.create(moe_workspace.num_slots(ids.size, n_experts), hidden, inter)

    def staged(same_layer):
        def step(c, i, e):
            y, ws = moe.moe_experts_packed(c[0], ids, w, e, layer=0 if same_layer else i, workspace=c[1], impl=impl)
            return c[0] + eps * y, ws
        t, (_, out_ws) = per_call(step, (x, ws), iters, ew)
        if same_layer:
            res["resident_hit_rate"] = round(moe_workspace.hit_rate(out_ws), 3)
        return t

    auto = MXFP4Execution().uses_workspace(n_tokens, top_k, n_experts)
    if auto or extras:
        timed("staged", "staged", lambda: staged(False))
    if extras:
        timed("resident", "resident", lambda: staged(True))
    if n_tokens <= 16 and "kernels" in variants:  # the two fused kernels alone (schedule and activations prepared outside the loop)
        tiles = moe_mxfp4.choose_tiles(ids.size, n_experts, hidden)
        plan = moe_mxfp4.plan(x, ids, ew, None, n_experts, tiles)
        # split-K tiles: the kernels and their partial sums per pair (expert_rows would add a scatter into rows that
        # the layer does not run)
        kernels = moe_mxfp4.expert_pairs if moe_mxfp4._split_k(ew, tiles) else moe_mxfp4.expert_rows
        seconds["fused_kernels"] = attempt("kernels", lambda: per_call(
            lambda rows, i, e: rows + (1e-3 * kernels(plan._replace(x_rows=rows), e, jnp.bfloat16, tiles,
                                                      impl == "interpret")[0, 0]).astype(rows.dtype),
            plan.x_rows, iters, ew)[0])
    seconds["online"] = seconds.get("staged") if auto else seconds.get("fused")
    res["online_mode"] = "staged" if auto else "fused"
    active = int(np.unique(np.asarray(ids)).size)
    mx_bytes = mxfp4_bytes(active, hidden, inter)
    seconds["bf16_roofline"] = active * 3 * hidden * inter * 2 / bandwidth  # an ideal bf16 kernel: active experts
    res.update({f"{k}_us": None if v is None else round(v * 1e6, 2) for k, v in seconds.items()})
    res["active_experts"] = active
    res["bf16_auto_block_m"] = block_m
    res["mxfp4_MB"] = round(mx_bytes / 1e6, 2)
    for key in ("fused", "fused_kernels", "mma", "mma_device", "mma_kernels", "gemv", "gemv_device", "gemv_kernels"):
        if seconds.get(key):
            res[f"{key}_pct_of_read_bw"] = round(100 * mx_bytes / seconds[key] / bandwidth, 1)

    def ratio(a, b, digits):
        return round(seconds[a] / seconds[b], digits) if seconds.get(a) and seconds.get(b) else None

    res["online_vs_fp8"] = ratio("online", "fp8", 3)
    res["gemv_vs_fp8"] = ratio("gemv", "fp8", 3)
    res["bf16_vs_gemv"] = ratio("bf16", "gemv", 2)
    res["mma_vs_gemv"] = ratio("mma", "gemv", 2)
    res["bf16_vs_online"] = ratio("bf16", "online", 2)
    res["bf16_vs_bf16_auto"] = ratio("bf16", "bf16_auto", 2)
    res["bf16_vs_bf16_pallas"] = ratio("bf16", "bf16_pallas", 2)
    res["bf16_pallas_vs_fused_prologues"] = ratio("bf16_pallas", "bf16_pallas_fused", 3)
    if seconds.get("bf16_pallas"):
        res["bf16_pallas_pct_of_read_bw"] = round(100 * seconds["bf16_roofline"] / seconds["bf16_pallas"], 1)
    res["bf16_roofline_vs_online"] = ratio("bf16_roofline", "online", 2)
    return res


def traced_device_time(layer, x, ew, interpret: bool, calls: int = 10) -> tuple[float | None, float | None, dict]:
    """GPU time of a layer call from a profiler trace of `calls` chained calls (x + 1e-3 * layer(x, ew), so one small
    add per call is included): (seconds of all its kernels, with no launch gaps or loop overhead; seconds of its
    Pallas MoE kernels alone; its longest kernels in us). (None, None, {}) without a GPU trace."""
    from gpu_trace import device_us_per_call

    def chained(x, e):
        for _ in range(calls):
            x = x + jnp.asarray(1e-3, x.dtype) * layer(x, e)
        return x

    if interpret:
        return None, None, {}
    total, top = device_us_per_call(jax.jit(chained), x, ew, calls=calls, top=12)
    kernels = sum(us for name, us in top.items() if name.startswith("moe_"))
    return total * 1e-6 or None, kernels * 1e-6 or None, top


GEMV_SWEEP = {  # label: GemvTiles, swept by --sweep gemv at each token count (the tiles' rows as tall as they fit)
    "r1_bn32_g16_w4": moe_mxfp4_gemv.GemvTiles(1, 32, 16, 8, 4),
    "r1_bn16_g16_w4": moe_mxfp4_gemv.GemvTiles(1, 16, 16, 8, 4),
    "r2_bn32_g16_w4": moe_mxfp4_gemv.GemvTiles(2, 32, 16, 8, 4),
    "r2a_bn32_g16_w4": moe_mxfp4_gemv.GemvTiles(2, 32, 16, 8, 4, adaptive=True),
    "r4_bn32_g16_w4": moe_mxfp4_gemv.GemvTiles(4, 32, 16, 8, 4),
    "r4a_bn32_g16_w4": moe_mxfp4_gemv.GemvTiles(4, 32, 16, 8, 4, adaptive=True),
    "r4a_bn16_g16_w4": moe_mxfp4_gemv.GemvTiles(4, 16, 16, 8, 4, adaptive=True),
    "r4a_bn32_g8_w4": moe_mxfp4_gemv.GemvTiles(4, 32, 8, 8, 4, adaptive=True),
    "r4a_bn32_g16_w2": moe_mxfp4_gemv.GemvTiles(4, 32, 16, 8, 2, adaptive=True),
    "r1_bn16_g16_w4_s2": moe_mxfp4_gemv.GemvTiles(1, 16, 16, 8, 4, num_stages=2),
    "r1_bn16_g16_w4_s3": moe_mxfp4_gemv.GemvTiles(1, 16, 16, 8, 4, num_stages=3),
    "r2a_bn32_g16_w4_s2": moe_mxfp4_gemv.GemvTiles(2, 32, 16, 8, 4, adaptive=True, num_stages=2),
    "r2a_bn32_g16_w4_s3": moe_mxfp4_gemv.GemvTiles(2, 32, 16, 8, 4, adaptive=True, num_stages=3),
    "r2a_bn32_g8_w4_s3": moe_mxfp4_gemv.GemvTiles(2, 32, 8, 8, 4, adaptive=True, num_stages=3),
    # 2-row tiles at the medium layer's 16 tokens (short programs: 4 K steps of 16 blocks, K split in 2 by default):
    # K unsplit ("_x1": no partial sums or turn counter, h then packed by XLA), fewer programs before splitting
    # ("_m1024"), longer steps, 8 warps, and the default with h packed by XLA ("_hx")
    "r2a_bn32_g16_w4_x1": moe_mxfp4_gemv.GemvTiles(2, 32, 16, 1, 4, adaptive=True),
    "r2a_bn32_g16_w4_m1024": moe_mxfp4_gemv.GemvTiles(2, 32, 16, 8, 4, 1024, adaptive=True),
    "r2a_bn32_g32_w4_x1": moe_mxfp4_gemv.GemvTiles(2, 32, 32, 1, 4, adaptive=True),
    "r2a_bn32_g16_w8_x1": moe_mxfp4_gemv.GemvTiles(2, 32, 16, 1, 8, adaptive=True),
    "r2a_bn32_g16_w4_hx": moe_mxfp4_gemv.GemvTiles(2, 32, 16, 8, 4, adaptive=True, pack_hidden=False),
    # "_k": the activations packed by each program (GemvTiles.pack_in_kernel), no XLA pass around the kernels
    "r1_bn16_g16_w4_k": moe_mxfp4_gemv.GemvTiles(1, 16, 16, 8, 4, pack_in_kernel=True),
    "r1_bn32_g16_w4_k": moe_mxfp4_gemv.GemvTiles(1, 32, 16, 8, 4, pack_in_kernel=True),
    "r1_bn16_g32_w4_k": moe_mxfp4_gemv.GemvTiles(1, 16, 32, 8, 4, pack_in_kernel=True),
    "r1_bn16_g16_w8_k": moe_mxfp4_gemv.GemvTiles(1, 16, 16, 8, 8, pack_in_kernel=True),
    "r2a_bn32_g16_w4_k": moe_mxfp4_gemv.GemvTiles(2, 32, 16, 8, 4, adaptive=True, pack_in_kernel=True),
    "r2a_bn64_g16_w4_k": moe_mxfp4_gemv.GemvTiles(2, 64, 16, 8, 4, adaptive=True, pack_in_kernel=True),
    "r1_bn8_g32_w4_k": moe_mxfp4_gemv.GemvTiles(1, 8, 32, 8, 4, pack_in_kernel=True),
    "r1_bn32_g32_w4_k": moe_mxfp4_gemv.GemvTiles(1, 32, 32, 8, 4, pack_in_kernel=True),
    "r1_bn32_g16_w4_k_x1": moe_mxfp4_gemv.GemvTiles(1, 32, 16, 1, 4, pack_in_kernel=True),  # K never split
    "r1_bn32_g16_w4_k_m512": moe_mxfp4_gemv.GemvTiles(1, 32, 16, 8, 4, 512, pack_in_kernel=True),  # K split to 512
    "r1_bn32_g16_w8_k": moe_mxfp4_gemv.GemvTiles(1, 32, 16, 8, 8, pack_in_kernel=True),
    "r1_bn32_g8_w4_k": moe_mxfp4_gemv.GemvTiles(1, 32, 8, 8, 4, pack_in_kernel=True),
    "r1_bn32_g32_w8_k": moe_mxfp4_gemv.GemvTiles(1, 32, 32, 8, 8, pack_in_kernel=True),
}


def gemv_sweep(layer, name, n_tokens: int, impl, labels: tuple[str, ...] | None = None) -> dict:
    """The decode kernels' layer call over GEMV_SWEEP's tiles (those named in `labels`, default all) at `n_tokens`
    tokens: chained time (us) and, on a GPU, the layer call's GPU time from a trace (`<label>_device`, us) and its
    MoE kernels' (`<label>_kernels`); rows-2/4 tiles only where experts average more than one row."""
    n_experts, top_k, hidden, _ = SHAPES[name]
    ids, w = routing(jax.random.key(n_tokens), n_tokens, n_experts, top_k)
    x = jax.random.normal(jax.random.key(1), (n_tokens, hidden), jnp.bfloat16)
    out = {}
    for label, tiles in GEMV_SWEEP.items():
        if (tiles.rows > 1 and n_tokens * top_k < n_experts // 2) or (labels and label not in labels):
            continue

        def call(x, e, tiles=tiles):
            return moe_mxfp4_gemv.grouped_swiglu(x, ids, w, e, tiles=tiles, interpret=impl == "interpret")

        t = attempt(label, lambda: per_call(lambda x, i, e: x + jnp.asarray(1e-3, x.dtype) * call(x, e), x, 20,
                                            layer[0])[0])
        out[label] = None if t is None else round(t * 1e6, 2)
        if t is not None:
            device, _, top = traced_device_time(call, x, layer[0], impl == "interpret")
            out[f"{label}_device"] = None if device is None else round(device * 1e6, 2)
            out[f"{label}_kernels"] = {k: round(v, 2) for k, v in top.items() if k.startswith("moe_")}
    return out


def _dense(**fields) -> moe_dense.DenseTiles:
    """Decode-sized dense-expert tiles (16-row tiles) with K split into exactly `k_slices` slices where the steps
    divide (min_programs out of the way)."""
    base = dict(block_m=moe_tiles.DECODE_BLOCK_M, block_n=128, step_k=64, k_slices=8, min_programs=1 << 20)
    return moe_dense.DenseTiles(**{**base, **fields})


def _dense16(**fields) -> moe_dense.DenseTiles:
    """The batch-16 dense-expert tiles (`choose_tiles` at 16 tokens of top-6: 16-row tiles, K whole, SwiGLU in the
    gate/up kernel's epilogue) with these fields changed."""
    return dataclasses.replace(moe_dense.choose_tiles(96, 64), **fields)


DENSE16_SWEEP = {  # label: DenseTiles, swept by --sweep dense16 at 16 tokens (the epilogue tiles; GPU time)
    "ep_bn64": _dense16(block_n=64),
    "ep_bn64_sk128": _dense16(block_n=64, step_k=128),
    "ep_bn128_sk32": _dense16(step_k=32),
    "ep_bn128_sk128": _dense16(step_k=128),
    "ep_bn256_sk32": _dense16(block_n=256, step_k=32),
    "ep_st2": _dense16(num_stages=2),
    "ep_st4": _dense16(num_stages=4),
    "ep_st5": _dense16(num_stages=5),
    "ep_w8": _dense16(num_warps=8),
    "ep_bn64_w2": _dense16(block_n=64, num_warps=2),
    "ep_bn64_sk128_st4": _dense16(block_n=64, step_k=128, num_stages=4),
    "ep_bn128_sk32_st5": _dense16(step_k=32, num_stages=5),
}


DENSE_SWEEP = {  # label: DenseTiles, swept by --sweep dense at each token count up to 16 (GPU time from a trace)
    "bn128_sk64_s8": _dense(),
    "bn128_sk64_s4": _dense(k_slices=4),
    "bn128_sk64_s16": _dense(k_slices=16),
    "bn64_sk64_s8": _dense(block_n=64),
    "bn64_sk128_s8": _dense(block_n=64, step_k=128),
    "bn256_sk64_s8": _dense(block_n=256),
    "bn256_sk64_s16": _dense(block_n=256, k_slices=16),
    "bn128_sk128_s8": _dense(step_k=128),
    "bn128_sk128_s4": _dense(step_k=128, k_slices=4),
    "bn128_sk32_s8": _dense(step_k=32),
    "bn128_sk64_s8_w2": _dense(num_warps=2),
    "bn128_sk64_s8_w8": _dense(num_warps=8),
    "bn128_sk64_s8_st2": _dense(num_stages=2),
    "bn128_sk64_s8_st4": _dense(num_stages=4),
    "bn128_sk128_s4_st4": _dense(step_k=128, k_slices=4, num_stages=4),
}


# label: DenseTiles of the one-kernel MLP (kernels/moe_dense_fused.py), swept by --sweep mlp after choose_tiles' own
# tiles with the down kernel's atomic combine (DenseTiles.atomic_combine)
MLP_SWEEP = {
    "mlp_i64_sk256_bn512": _dense(fused_mlp=True, block_i=64, step_k=256, block_n=512),  # FUSED_MLP_TILES
    "mlp_i64_sk256_bn512_c2": _dense(fused_mlp=True, block_i=64, step_k=256, block_n=512, k_chains=2),
    "mlp_i64_sk256_bn512_c4": _dense(fused_mlp=True, block_i=64, step_k=256, block_n=512, k_chains=4),
    "mlp_i32_sk256_bn512_c2": _dense(fused_mlp=True, step_k=256, block_n=512, k_chains=2),
    "mlp_i32_sk256_bn512_c4": _dense(fused_mlp=True, step_k=256, block_n=512, k_chains=4),
    "mlp_i32_sk128_bn256_c4": _dense(fused_mlp=True, step_k=128, block_n=256, k_chains=4),
    "mlp_i64_sk128_bn256_c2": _dense(fused_mlp=True, block_i=64, step_k=128, block_n=256, k_chains=2),
    "mlp_i64_sk256_bn512_c4_w8": _dense(fused_mlp=True, block_i=64, step_k=256, block_n=512, k_chains=4,
                                        num_warps=8),
}


def dense_sweep(layer, name, n_tokens: int, impl, table: dict | None = None, shared_parts: int = 0,
                with_combine: bool = False) -> dict:
    """The dense-expert kernels (kernels/moe_dense.py, bf16 experts) over `choose_tiles`' own tiles and those of
    `table` (DENSE_SWEEP by default) at `n_tokens` tokens: GPU time of the layer call (us, all its kernels) and of
    its Pallas kernels, from a profiler trace. `shared_parts` P > 0: with a shared MLP of P x the experts'
    intermediate width riding in the same kernels (as the medium hybrid's 2 shared experts do). `with_combine`: also
    choose_tiles' own tiles with the down kernel's atomic combine ("choose_tiles+combine")."""
    n_experts, top_k, hidden, inter = SHAPES[name]
    ids, w = routing(jax.random.key(n_tokens), n_tokens, n_experts, top_k)
    x = jax.random.normal(jax.random.key(1), (n_tokens, hidden), jnp.bfloat16)
    shared = None
    if shared_parts:
        keys = jax.random.split(jax.random.key(2), 3)
        shared = (jax.random.normal(keys[0], (hidden, shared_parts * inter), jnp.bfloat16) * 0.02,
                  jax.random.normal(keys[1], (hidden, shared_parts * inter), jnp.bfloat16) * 0.02,
                  jax.random.normal(keys[2], (shared_parts * inter, hidden), jnp.bfloat16) * 0.02)
    out = {}
    table = DENSE_SWEEP if table is None else table
    pairs = ids.size + n_tokens * shared_parts
    chosen = moe_dense.choose_tiles(pairs, n_experts + shared_parts)
    own = {"choose_tiles": chosen}
    if with_combine:
        own["choose_tiles+combine"] = dataclasses.replace(chosen, atomic_combine=True)
    for label, tiles in {**own, **table}.items():
        call = lambda x, d, tiles=tiles: moe_dense.grouped_swiglu(x, ids, w, *d, tiles=tiles, shared=shared,
                                                                   interpret=impl == "interpret")
        got = attempt(label, lambda call=call: traced_device_time(call, x, layer[2], impl == "interpret"))
        if got is not None and got[0] is not None:
            out[label] = {"device_us": round(got[0] * 1e6, 2), "kernels_us": round(got[1] * 1e6, 2),
                          **{name: round(us, 2) for name, us in got[2].items() if name.startswith("moe_dense")}}
    return out


def sweep(layer, name, impl, which: str, n_tokens: int) -> dict:
    """The fused kernel over a few tile configurations at `n_tokens`: "all" (1 token) every tile, "split_k" (1 token)
    the split-K tiles and choose_tiles' own, "decode16" (16 tokens) choose_tiles' own against DECODE16_SWEEP, "many"
    choose_tiles' own against MANY_SWEEP, or PREFILL_SWEEP above 1024 tokens."""
    n_experts, top_k, hidden, _ = SHAPES[name]
    ew = layer[0]
    ids, w = routing(jax.random.key(1), n_tokens, n_experts, top_k)
    x = jax.random.normal(jax.random.key(1), (n_tokens, hidden), jnp.bfloat16)
    out = {}

    def time_tiles(tiles):
        t, _ = per_call(lambda x, i, e: x + jnp.asarray(1e-3, x.dtype) * moe.moe_experts_packed(
            x, ids, w, e, tiles=tiles, impl=impl)[0], x, 20, ew)
        return round(t * 1e6, 2)

    if which in ("split_k", "decode16", "many"):
        # the MMA kernels' own tiles
        out["choose_tiles"] = time_tiles(moe_mxfp4.choose_tiles(ids.size, n_experts, hidden))
    if which in ("decode16", "many"):
        table = DECODE16_SWEEP if which == "decode16" else MANY_SWEEP if n_tokens <= 1024 else PREFILL_SWEEP
        for label, tiles in table.items():
            out[label] = attempt(label, lambda tiles=tiles: time_tiles(tiles))
        return out
    for bn in (32, 64, 128) if which == "all" else ():
        for groups in (2, 4, 8):
            for warps in (4, 8):
                tiles = moe_mxfp4.Tiles(block_m=16, block_n=bn, max_groups=groups, num_warps=warps, num_stages=3)
                out[f"bn{bn}_g{groups}_w{warps}"] = time_tiles(tiles)
    for bn, groups, split in SPLIT_K_SWEEP:  # split-K (benchmarks/NOTES_moe.md)
        tiles = moe_mxfp4.Tiles(block_m=16, block_n=bn, max_groups=groups, num_warps=4, num_stages=3, split_k=split)
        out[f"bn{bn}_g{groups}_w4_s{split}"] = time_tiles(tiles)
    for bn, warps in ((32, 2), (64, 4)):  # the weights as the MMA's A operand, split-K
        tiles = moe_mxfp4.Tiles(block_m=16, block_n=bn, max_groups=4, num_warps=warps, num_stages=3, split_k=8,
                                weights_as_a=True)
        out[f"a_bn{bn}_g4_w{warps}_s8"] = time_tiles(tiles)
    for bn in (32, 64):  # the scales loaded one K step ahead, split-K
        tiles = moe_mxfp4.Tiles(block_m=16, block_n=bn, max_groups=4, num_stages=3, split_k=8, prefetch_scales=True)
        out[f"bn{bn}_g4_w4_s8_pf"] = time_tiles(tiles)
    return out


# 16-token tiles (16 rows, 3 stages): instructions per converted weight in the offline sm_90 build
# (triton_report.py) in the comments; "a_": the weights as the MMA's A operand
DECODE16_SWEEP = {
    "bn32_g4_w4": moe_mxfp4.Tiles(16, 32, 4, 4, 3),  # 5.1
    "bn64_g2_w4": moe_mxfp4.Tiles(16, 64, 2, 4, 3),  # 5.0, 98 registers
    "bn64_g8_w4": moe_mxfp4.Tiles(16, 64, 8, 4, 3),  # 4.2, 163 registers
    "bn128_g4_w8": moe_mxfp4.Tiles(16, 128, 4, 8, 3),  # 4.3
    "bn64_g4_w8": moe_mxfp4.Tiles(16, 64, 4, 8, 3),  # 5.1
    "a_bn32_g4_w2": moe_mxfp4.Tiles(16, 32, 4, 2, 3, weights_as_a=True),  # 3.8
    "a_bn64_g4_w4": moe_mxfp4.Tiles(16, 64, 4, 4, 3, weights_as_a=True),  # 4.4 (wgmma)
    "a_bn32_g4_w4": moe_mxfp4.Tiles(16, 32, 4, 4, 3, weights_as_a=True),  # 7.3 (each weight converted twice)
    "bn64_g4_w4_st2": moe_mxfp4.Tiles(16, 64, 4, 4, 2),  # pipeline depth: K steps in flight per program
    "bn64_g4_w4_st4": moe_mxfp4.Tiles(16, 64, 4, 4, 4),
    "bn64_g4_w4_st5": moe_mxfp4.Tiles(16, 64, 4, 4, 5),
    "bn64_g8_w4_st4": moe_mxfp4.Tiles(16, 64, 8, 4, 4),
    "bn64_g4_w4_pf": moe_mxfp4.Tiles(16, 64, 4, 4, 3, prefetch_scales=True),  # scales one K step ahead
    "bn64_g8_w4_pf": moe_mxfp4.Tiles(16, 64, 8, 4, 3, prefetch_scales=True),
    "bn16_g4_w1": moe_mxfp4.Tiles(16, 16, 4, 1, 3),  # 4.3, one warp per program: its barriers wait for no other
    "bn16_g4_w1_pf": moe_mxfp4.Tiles(16, 16, 4, 1, 3, prefetch_scales=True),
    "bn32_g4_w2": moe_mxfp4.Tiles(16, 32, 4, 2, 3),  # 4.4
}


def mma_tile_table(specs) -> dict:
    """{label: Tiles} for (rows, columns, groups per K step, warps, stages, weights as A) specs: "m32_n128_g4_w8_s3"
    is 32 rows, 128 columns, 4 groups, 8 warps, 3 stages; "a_" marks the weights as the MMA's A operand (its M then
    the tile's columns: Hopper's wgmma takes M = 64)."""
    return {f"{'a_' if a else ''}m{m}_n{n}_g{g}_w{w}_s{st}": moe_mxfp4.Tiles(m, n, g, w, st, weights_as_a=a)
            for m, n, g, w, st, a in specs}


# Tiles of the MMA kernels swept by --sweep many at each token count from 17 to 1024, where experts see several rows
# (choose_tiles: 16 rows up to 16 rows per active expert, then 32 up to 48; 64 columns, 4 groups, 4 warps, 3 stages;
# the last four: 16-row tiles for 4-16 rows per expert, e.g. the DeepSeek-size layer at 256 tokens, 8 rows)
MANY_SWEEP = mma_tile_table((
    (16, 64, 4, 4, 3, False), (32, 64, 4, 4, 3, False), (64, 64, 4, 4, 3, False), (32, 128, 4, 4, 3, False),
    (32, 128, 4, 8, 3, False), (64, 128, 4, 8, 3, False), (32, 64, 8, 4, 3, False), (32, 64, 2, 4, 3, False),
    (32, 64, 4, 4, 2, False), (32, 64, 4, 4, 4, False), (32, 64, 4, 4, 3, True), (32, 128, 4, 8, 3, True),
    (64, 128, 4, 8, 3, True), (16, 64, 4, 4, 3, True), (16, 128, 4, 4, 3, True), (16, 128, 4, 8, 3, True),
    (16, 128, 4, 4, 3, False), (16, 64, 8, 4, 3, False)))

# Prefill tiles (64+ rows per active expert), swept by --sweep many above 1024 tokens
PREFILL_SWEEP = mma_tile_table((
    (64, 64, 4, 4, 3, False), (64, 64, 4, 4, 3, True), (64, 128, 4, 4, 3, True), (64, 128, 4, 8, 3, True),
    (64, 128, 4, 8, 3, False), (128, 64, 4, 4, 3, False), (128, 64, 4, 8, 3, False), (128, 128, 4, 8, 3, False),
    (128, 128, 4, 8, 3, True), (64, 64, 8, 4, 3, False), (64, 64, 4, 4, 4, False), (64, 64, 4, 8, 3, False),
    (64, 64, 8, 4, 3, True), (128, 64, 4, 4, 3, True)))


# (block_n, max_groups, split_k) of the split-K tiles swept at 1 token (4 warps, 3 stages)
SPLIT_K_SWEEP = ((16, 4, 4), (16, 4, 8), (32, 4, 4), (32, 4, 8), (32, 2, 16), (64, 4, 8), (64, 2, 16), (32, 1, 32))


def measure_shapes(args, tokens: list[int], results: dict, bandwidth: float) -> None:
    """Every shape x token count of the run; fills `results` (printing a table row per case) as it goes."""
    sweeps = set(args.sweep.split(",")) if args.sweep else set()
    with_bf16 = bool(set(DENSE_VARIANTS) & set(args.variants) or {"dense", "dense16", "mlp"} & sweeps)
    for name in args.shapes.split(","):
        n_experts, top_k, hidden, inter = SHAPES[name]
        layer = make_layer(jax.random.key(0), n_experts, hidden, inter, "fp8" in args.variants, with_bf16)
        print(f"\n{name}: {n_experts} experts, top-{top_k}, {hidden} x {inter}")
        print("| tokens | active experts | bf16 ragged_dot us | bf16 auto us (tile rows) | bf16 pallas us (% of read bw) "
              "| bf16 pallas, fused prologues us | fp8 pre-converted us "
              "| mxfp4 fused us | mxfp4 staged us | online us | online / fp8 | bf16 / online | bf16 roofline / online "
              "| fused % of read bw | kernels us (% of read bw) | resident us (hit rate) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for n_tokens in tokens:
            r = bench_case(name, n_tokens, layer, args.impl, n_tokens in (tokens[0], tokens[-1]), bandwidth,
                           args.variants)
            results[f"{name}_T{n_tokens}"] = r
            cell = lambda v: "-" if v is None else v  # noqa: E731
            kernels = (f"{r['fused_kernels_us']} ({cell(r.get('fused_kernels_pct_of_read_bw'))}%)"
                       if r.get("fused_kernels_us") else "-")
            resident = f"{r['resident_us']} ({r['resident_hit_rate']:.0%})" if r.get("resident_us") else "-"
            print(f"| {n_tokens} | {r['active_experts']} | {cell(r.get('bf16_us'))} | "
                  f"{cell(r.get('bf16_auto_us'))} ({cell(r['bf16_auto_block_m'])}) | {cell(r.get('bf16_pallas_us'))} "
                  f"({cell(r.get('bf16_pallas_pct_of_read_bw'))}%) | {cell(r.get('bf16_pallas_fused_us'))} | "
                  f"{cell(r.get('fp8_us'))} | "
                  f"{cell(r.get('fused_us'))} | {cell(r.get('staged_us'))} | {cell(r.get('online_us'))} ({r['online_mode']}) "
                  f"| {cell(r['online_vs_fp8'])} | {cell(r['bf16_vs_online'])} | {cell(r['bf16_roofline_vs_online'])} "
                  f"| {cell(r.get('fused_pct_of_read_bw'))} | {kernels} | {resident} |")
            if r.get("gemv_us"):
                print(f"|   gemv: {r['gemv_us']} us ({cell(r.get('gemv_pct_of_read_bw'))}% of read bw), GPU time "
                      f"{cell(r.get('gemv_device_us'))} us ({cell(r.get('gemv_device_pct_of_read_bw'))}%), its MoE "
                      f"kernels {cell(r.get('gemv_kernels_us'))} us ({cell(r.get('gemv_kernels_pct_of_read_bw'))}%); "
                      f"mma {cell(r.get('mma_us'))} us, GPU time {cell(r.get('mma_device_us'))} us "
                      f"({cell(r.get('mma_device_pct_of_read_bw'))}%); mma / gemv {cell(r['mma_vs_gemv'])}, "
                      f"gemv / fp8 {cell(r['gemv_vs_fp8'])}, bf16 / gemv "
                      f"{cell(r['bf16_vs_gemv'])} |")
        for which in args.sweep.split(",") if args.sweep else ():
            if which == "gemv":
                for n in [t for t in tokens if t <= 64] or [1]:
                    results[f"{name}_sweep_gemv_T{n}_us"] = r = gemv_sweep(layer, name, n, args.impl, args.sweep_labels)
                    print(f"tile sweep (gemv), {n} token(s) (us):", r)
                continue
            if which == "dense":
                for n in [t for t in tokens if t <= 16] or [1]:
                    results[f"{name}_sweep_dense_T{n}_us"] = r = dense_sweep(layer, name, n, args.impl,
                                                                             shared_parts=args.shared_parts)
                    print(f"tile sweep (dense bf16), {n} token(s), GPU time (us):", r)
                continue
            if which == "dense16":
                results[f"{name}_sweep_dense16_T16_us"] = r = dense_sweep(layer, name, 16, args.impl, DENSE16_SWEEP,
                                                                          shared_parts=args.shared_parts)
                print("tile sweep (dense bf16, epilogue tiles), 16 tokens, GPU time (us):", r)
                continue
            if which == "mlp":
                for n in [t for t in tokens if t <= 16] or [1]:
                    results[f"{name}_sweep_mlp_T{n}_us"] = r = dense_sweep(layer, name, n, args.impl, MLP_SWEEP,
                                                                           args.shared_parts, with_combine=True)
                    print(f"tile sweep (dense bf16, one-kernel MLP), {n} token(s), GPU time (us):", r)
                continue
            for n in [t for t in tokens if t > 16] if which == "many" else [16 if which == "decode16" else 1]:
                results[f"{name}_sweep_{which}_T{n}_fused_us"] = r = sweep(layer, name, args.impl, which, n)
                print(f"tile sweep ({which}), fused, {n} token(s) (us):", r)
        del layer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    parser.add_argument("--shapes", default="medium,deepseek")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--impl", default="pallas", help="pallas (GPU), or interpret for a CPU smoke run")
    parser.add_argument("--sweep", nargs="?", const="all",
                        help="also sweep the fused kernel's tiles, comma-separated: all / split_k (1 token: every "
                             "tile, or the split-K ones), decode16 (16 tokens), many (MANY_SWEEP at each token count "
                             "above 16, PREFILL_SWEEP above 1024); gemv: the decode kernels' tiles at "
                             "each token count up to 64; dense: the bf16 dense-expert kernels' tiles (GPU time) "
                             "at each token count up to 16; dense16: the batch-16 epilogue tiles (DENSE16_SWEEP); "
                             "mlp: the one-kernel MLP's tiles (MLP_SWEEP) likewise")
    parser.add_argument("--sweep-labels", type=lambda text: tuple(text.split(",")),
                        help="--sweep gemv: only these GEMV_SWEEP labels (comma-separated)")
    parser.add_argument("--shared-parts", type=int, default=0,
                        help="dense / mlp sweeps: a shared MLP of this many x the experts' width in the same kernels")
    parser.add_argument("--dense-only", action="store_true", help="time the bf16 variants alone (no MXFP4 / FP8)")
    parser.add_argument("--variants", help=f"comma-separated variants to time (of {', '.join(VARIANTS)}; default all)")
    args = parser.parse_args(argv)
    if args.variants:
        unknown = set(args.variants.split(",")) - set(VARIANTS)
        if unknown:
            parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    args.variants = (tuple(args.variants.split(",")) if args.variants else
                     DENSE_VARIANTS if args.dense_only else VARIANTS)
    device = jax.devices()[0]
    start = time.perf_counter()
    bandwidth = hbm_read_bandwidth()
    copy = hbm_copy_bandwidth()
    print(f"{device.device_kind}, jax {jax.__version__}: HBM read {bandwidth / 1e12:.3f} TB/s (the roofline), copy "
          f"{copy / 1e12:.3f} TB/s (read + write)")
    results: dict = {"hbm_read_TBps": round(bandwidth / 1e12, 3), "hbm_copy_TBps": round(copy / 1e12, 3)}
    if args.variants != VARIANTS:
        results["variants"] = list(args.variants)
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]  # --tokens "": the sweep alone
    try:
        measure_shapes(args, tokens, results, bandwidth)
    except KeyboardInterrupt:  # `timeout -s INT`: report what was measured, marked as partial
        results["interrupted_after_s"] = round(time.perf_counter() - start)
    decode = {k: v for k, v in results.items() if k.endswith("_T1") and isinstance(v, dict)}
    for key, r in decode.items():
        print(f"targets {key}: decode bandwidth {r.get('fused_pct_of_read_bw')}% of read bandwidth for the layer, "
              f"{r.get('fused_kernels_pct_of_read_bw')}% for its kernels; gemv {r.get('gemv_pct_of_read_bw')}% "
              f"(layer), {r.get('gemv_kernels_pct_of_read_bw')}% (kernels) (target >= 70%); online / fp8 "
              f"{r['online_vs_fp8']} (target <= 1.05); bf16 ragged_dot / online {r['bf16_vs_online']}, ideal bf16 "
              f"(active experts at read bandwidth) / online {r['bf16_roofline_vs_online']} (target >= 2.5)")
    print(f"total {time.perf_counter() - start:.0f} s")
    line = (f"- {datetime.date.today()} moe.py, {device.device_kind}, commit {git_commit()}, jax {jax.__version__}: "
            f"MXFP4 online (fused, staged through the FP8 workspace) beside bf16 jax.lax.ragged_dot and pre-converted "
            f"FP8 measured in the same run, HBM read bandwidth as the roofline: {json.dumps(results)}\n")
    append_line(args.results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
