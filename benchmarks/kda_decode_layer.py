"""The KDA attention layer at decode on the GPU, as the model runs it: its separate XLA ops around the recurrent
slots kernel (`KimiDeltaAttention.step`) against the one-kernel decode step (`decode_in_place`,
kernels/kda/decode_layer.py) at several launch widths.

    python3 benchmarks/kda_decode_layer.py [--results benchmarks/RESULTS.md] [--batches 1,16,64] [--warps 2,4,8]
                                           [--splits 1,2,4]

The medium hybrid's KDA layer (16 heads x 128, hidden 2048, bf16): `LAYERS` layers, each with its own weights and
cache slice, chained in one jitted call (the caches donated and passed on, as the engine's decode does), one token
per row. Device time per layer, kernels per layer and the longest kernels per layer (instance numbers folded) from a
profiler trace of one call after a warm-up; the bytes roofline is the layer's weights plus its rows' states (read and
written) and conv states at the HBM copy bandwidth measured in the same run. Both variants include the layer's input
and output projections; both compile with the model's GPU compiler options (`dispatch.compiler_options`). `--splits`:
the one-kernel step with each head split over that many blocks of value columns (`decode_layer.VALUE_SPLIT`, at
every batch size here), o_proj finishing the heads' norm; variants are named fused_w{warps} or fused_w{warps}_s{split}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import jax
import jax.numpy as jnp

from dayzero.kernels import dispatch
from dayzero.kernels.kda import decode_layer
from dayzero.model.kda import KimiDeltaAttention
from dayzero.model.norms import RMSNorm
from dayzero.model.presets import get_preset

from gpu_trace import gpu_kernels, kernel_family, per_kernel_us, traced_events  # benchmarks/gpu_trace.py
from results import append_line, git_commit  # benchmarks/results.py: a script's own folder is on sys.path
from timing import hbm_copy_bandwidth  # benchmarks/timing.py

LAYERS = 12


def chained(attn, variant: str):
    """jit(params, x, valid, slots, conv, pool) -> (x, conv, pool) through LAYERS layers of `variant`."""
    def run(params, x, valid, slots, conv, pool):
        norm_weight = jnp.ones((x.shape[-1],), jnp.float32)
        # the cache's turn counters, as the model's step passes them (one zero fill per call, not per layer)
        turns = jnp.zeros((len(params), x.shape[0], attn.config.kda_num_heads), jnp.int32)
        for layer, p in enumerate(params):  # each layer: x + attention(rms_norm(x)), unit norm weight
            if variant == "xla":
                h = RMSNorm(attn.config.rms_norm_eps).apply({"params": {"weight": norm_weight}}, x)
                out, rows, pool = attn.apply(p, h, valid, conv[layer, slots], pool, slots, layer, True,
                                             method="step")
                conv = conv.at[layer, slots].set(rows.astype(conv.dtype))
                x = x + out
            else:
                x, conv, pool, turns = attn.apply(p, x, norm_weight, valid, conv, pool, slots, layer, turns=turns,
                                                  method="decode_in_place")
        return x, conv, pool

    return jax.jit(run, donate_argnums=(4, 5), compiler_options=dispatch.compiler_options() or None)


def time_variant(fn, params, x, valid, slots, conv, pool):
    """(us per layer, kernels per layer, top kernels per layer, conv, pool) from one traced call after a warm-up."""
    _, conv, pool = jax.block_until_ready(fn(params, x, valid, slots, conv, pool))
    result = {}

    def call():
        result["out"] = jax.block_until_ready(fn(params, x, valid, slots, conv, pool))

    kernels = gpu_kernels(traced_events(call))
    _, conv, pool = result["out"]
    us = sum(e["dur"] for e in kernels) / LAYERS
    # each layer's kernels carry their own instance numbers (`kda_decode_layer__3`, `gemm_fusion_dot_27`): fold them
    folded = [dict(e, name=kernel_family(e["name"])) for e in kernels]
    return us, len(kernels) / LAYERS, per_kernel_us(folded, LAYERS, top=6), conv, pool


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--splits", default="1", help="value blocks per head for the one-kernel step")
    parser.add_argument("--preset", default="medium_hybrid")
    args = parser.parse_args(argv)
    cfg = get_preset(args.preset)
    attn = KimiDeltaAttention(cfg, jnp.bfloat16)
    key = jax.random.key(0)
    x0 = jnp.zeros((1, 1, cfg.hidden_size), jnp.bfloat16)
    params = [attn.init(jax.random.fold_in(key, layer), x0) for layer in range(LAYERS)]
    weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params[0]))
    copy_bw = hbm_copy_bandwidth()
    res = {"hbm_copy_TBps": round(copy_bw / 1e12, 3), "layer_weight_MB": round(weight_bytes / 1e6, 2)}
    heads, dim, width = cfg.kda_num_heads, cfg.kda_dim, cfg.kda_conv_size
    original = decode_layer.NUM_WARPS, decode_layer.VALUE_SPLIT, decode_layer.VALUE_SPLIT_MAX_ROWS
    for batch in (int(b) for b in args.batches.split(",")):
        slots_total = batch + 1
        conv = jnp.zeros((LAYERS, slots_total, 3, dim, width - 1), jnp.bfloat16)
        pool = jax.random.normal(key, (LAYERS, slots_total, heads, cfg.kda_head_dim, cfg.kda_head_dim)) * 0.1
        x = jax.random.normal(jax.random.fold_in(key, batch), (batch, 1, cfg.hidden_size), jnp.bfloat16)
        valid = jnp.ones((batch, 1), bool)
        slots = jnp.arange(1, batch + 1, dtype=jnp.int32)
        state_bytes = batch * (2 * heads * cfg.kda_head_dim ** 2 * 4 + 2 * 3 * dim * (width - 1) * 2)
        roofline_us = (weight_bytes + state_bytes) / copy_bw * 1e6
        row = {"roofline_us": round(roofline_us, 2)}
        variants = [("xla", None, 1)] + [(f"fused_w{w}" + (f"_s{p}" if int(p) > 1 else ""), int(w), int(p))
                                         for w in args.warps.split(",") for p in args.splits.split(",")]
        for name, warps, split in variants:
            decode_layer.NUM_WARPS = warps or original[0]
            decode_layer.VALUE_SPLIT, decode_layer.VALUE_SPLIT_MAX_ROWS = split * batch, batch
            fn = chained(attn, "xla" if warps is None else "fused")
            us, n_kernels, top, conv, pool = time_variant(fn, params, x, valid, slots, conv, pool)
            row[name] = {"us_per_layer": round(us, 2), "kernels_per_layer": round(n_kernels, 1),
                         "pct_of_roofline": round(100 * roofline_us / us, 1) if us else None, "top_us": top}
            print(f"B{batch} {name}: {us:.2f} us per layer, {n_kernels:.1f} kernels per layer", flush=True)
        decode_layer.NUM_WARPS, decode_layer.VALUE_SPLIT, decode_layer.VALUE_SPLIT_MAX_ROWS = original
        res[f"B{batch}"] = row
    device = jax.devices()[0]
    append_line(args.results, f"- {datetime.date.today()} kda_decode_layer.py, {device.device_kind}, commit "
                              f"{git_commit()}, jax {jax.__version__}, {args.preset} KDA attention layer at decode "
                              f"(projections included; {LAYERS} layers chained, device time per layer, roofline the "
                              f"layer's weights + states at HBM copy bandwidth): {json.dumps(res)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
