"""Decode-sized projections on the GPU: `kernels.projection.project` (one kernel per call with the input norm and
the residual add, plus one XLA fusion adding its partial sums where K is split) against the same in XLA
(`projection.reference`), at the medium hybrid's KDA layer shapes.

    python3 benchmarks/projection.py [--results benchmarks/RESULTS.md] [--batches 1,16] \
        [--tiles 128x64s3p1024k8w2,64x128s4p1k1] [--xla-configs] [--joined-weights]

Per layer: the input RMSNorm and the six input projections (q|k|v and f_a|g_a|b, 2048 -> 6144 + 272), then o_proj
(2048 -> 2048) with the residual add, `LAYERS` layers with their own weights chained in one jitted call (o_proj
takes the sum of the q, k and v parts of the first call's output plus each row's sum of f_a|g_a|b, one small XLA
fusion in every variant: every product is used, and every layer depends on the one before). Device time per layer from
a profiler trace of one call after a warm-up; the roofline is the layer's weight bytes at the HBM copy bandwidth
measured in the same run. Tiles are written `<block_n>x<step_k>s<stages>p<min_programs>k<k_slices>[w<warps>]`, for
both calls, or `<input tiles>/<o_proj tiles>`; each variant's kernels are also timed apart (`top_us`: the input
projections' kernel is decode_projection, o_proj's decode_projection_one_weight). `--xla-configs` prints (and
records) the tiles XLA's autotuner chose for the XLA variant's GEMM fusions, read from its compiled HLO.
`--joined-weights`: each input group's weights stored side by side as one weight (q|k|v [2048, 6144], f_a|g_a|b
[2048, 272]), as a load-time join would hold them: the kernel then runs two weights (two branches of its program
plan) instead of six, the same bytes.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import re
import sys

import jax
import jax.numpy as jnp

from dayzero.kernels import dispatch, projection
from dayzero.model.presets import get_preset

from gpu_trace import device_us_per_call  # benchmarks/gpu_trace.py: a script's own folder is on sys.path
from results import append_line, git_commit  # benchmarks/results.py
from timing import hbm_copy_bandwidth  # benchmarks/timing.py

LAYERS = 12


def parse_tiles(text: str) -> projection.ProjectionTiles:
    """'128x64s4p256k8' or '128x64s4p256k8w8' (block_n x step_k, stages, min_programs, k_slices, warps) ->
    ProjectionTiles."""
    m = re.fullmatch(r"(\d+)x(\d+)s(\d+)p(\d+)k(\d+)(?:w(\d+))?", text)
    if not m:
        raise SystemExit(f"--tiles: '{text}' is not <block_n>x<step_k>s<stages>p<min_programs>k<k_slices>[w<warps>]")
    n, k, s, p, ks, w = m.groups()
    return projection.ProjectionTiles(block_n=int(n), step_k=int(k), num_stages=int(s), min_programs=int(p),
                                      k_slices=int(ks), num_warps=int(w or 4))


def layer_weights(cfg, key, joined: bool = False) -> list[dict]:
    """Per layer: the input norm weight, the two input groups and o_proj, bf16 like the model's Dense kernels
    (`joined`: each group's weights as one array, side by side)."""
    d, dim, hd, heads = cfg.hidden_size, cfg.kda_dim, cfg.kda_head_dim, cfg.kda_num_heads
    layers = []
    for layer in range(LAYERS):
        k = jax.random.fold_in(key, layer)
        w = lambda i, n, rows=d: (jax.random.normal(jax.random.fold_in(k, i), (rows, n), jnp.float32)
                                  * 0.02).astype(jnp.bfloat16)
        qkv, fgb = (w(0, dim), w(1, dim), w(2, dim)), (w(3, hd), w(4, hd), w(5, heads))
        if joined:
            qkv, fgb = (jnp.concatenate(qkv, axis=1),), (jnp.concatenate(fgb, axis=1),)
        layers.append({"norm": jnp.ones((d,), jnp.float32), "qkv": qkv, "fgb": fgb, "o": w(6, d, rows=dim)})
    return layers


def parse_tile_pair(text: str) -> tuple[projection.ProjectionTiles, projection.ProjectionTiles]:
    """'IN' or 'IN/OUT' -> (tiles of the input projections' call, tiles of o_proj's call)."""
    first, _, second = text.partition("/")
    return parse_tiles(first), parse_tiles(second or first)


def chained(project, eps: float, output_project=None):
    """jit(layers, x) -> x through LAYERS layers of (norm + input projections, o_proj + residual) by `project` (o_proj
    by `output_project` where given)."""
    output_project = output_project or project

    def run(layers, x):
        for p in layers:
            qkv, fgb = project(x, (p["qkv"], p["fgb"]), norm_weight=p["norm"], eps=eps)
            # the layer's output depends on every column of both groups: a slice would let XLA drop the products
            # of the columns it does not read (its variant computed only q and f_a's first column before
            # 2026-12-04, reading half the weights)
            dim = p["o"].shape[0]
            o = sum(qkv[:, i * dim:(i + 1) * dim] for i in range(qkv.shape[1] // dim)) + jnp.sum(
                fgb.astype(jnp.float32), axis=1, keepdims=True).astype(qkv.dtype)
            (x,) = output_project(o, ((p["o"],),), residual=x)
        return x

    return jax.jit(run, compiler_options=dispatch.compiler_options() or None)


def gemm_configs(compiled_text: str) -> list[str]:
    """Each GEMM fusion of an optimized HLO module as 'name: its fusion backend config' (XLA's choice: the Triton
    GEMM's tiles, split-K, stages and warps, or the cuBLAS call), one entry per distinct name stem and config."""
    found = []
    for line in compiled_text.splitlines():
        if "backend_config=" not in line or not ("gemm" in line or "cublas" in line):
            continue
        stem = re.sub(r"[._]\d+$", "", line.strip().split(" ", 1)[0].lstrip("%"))
        config = line[line.index("backend_config=") + len("backend_config="):]
        inner = re.search(r'"fusion_backend_config":(\{.*)', config)
        entry = f"{stem}: {(inner.group(1) if inner else config)[:400]}"
        if entry not in found:
            found.append(entry)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--tiles", default="128x64s3p1024k8w2,128x64s3p1024k8,256x64s3p1024k8w2,128x32s4p1024k8w2,"
                                           "128x128s4p512k4")
    parser.add_argument("--preset", default="medium_hybrid")
    parser.add_argument("--joined-weights", action="store_true",
                        help="each input group's weights as one array (two kernel branches instead of six)")
    parser.add_argument("--xla-configs", action="store_true",
                        help="print and record the XLA variant's GEMM tile configs (from its compiled HLO)")
    args = parser.parse_args(argv)
    cfg = get_preset(args.preset)
    layers = layer_weights(cfg, jax.random.key(0), joined=args.joined_weights)
    weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(layers[0]))
    copy_bw = hbm_copy_bandwidth()
    res = {"hbm_copy_TBps": round(copy_bw / 1e12, 3), "layer_weight_MB": round(weight_bytes / 1e6, 2),
           "roofline_us_per_layer": round(weight_bytes / copy_bw * 1e6, 2)}
    variants = [("xla", projection.reference, None)] + [
        (name, *(functools.partial(projection.project, tiles=t) for t in parse_tile_pair(name)))
        for name in args.tiles.split(",")]
    for batch in (int(b) for b in args.batches.split(",")):
        x = jax.random.normal(jax.random.fold_in(jax.random.key(1), batch), (batch, cfg.hidden_size), jnp.bfloat16)
        row, want = {}, None
        for name, project, output_project in variants:
            fn = chained(project, cfg.rms_norm_eps, output_project)
            out = fn(layers, x)
            if args.xla_configs and name == "xla":
                configs = gemm_configs(fn.lower(layers, x).compile().as_text())
                res[f"B{batch}_xla_gemm_configs"] = configs
                print(f"B{batch} xla GEMM fusions:", *configs, sep="\n  ", flush=True)
            us, top = device_us_per_call(fn, layers, x, calls=LAYERS, top=6)
            err = None if want is None else float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
            want = out.astype(jnp.float32) if want is None else want
            row[name] = {"us_per_layer": round(us, 2), "pct_of_roofline": round(100 * weight_bytes / copy_bw * 1e6
                                                                               / us, 1) if us else None,
                         "max_abs_diff_vs_xla": err, "top_us": top}
            print(f"B{batch} {name}: {us:.2f} us per layer (roofline {res['roofline_us_per_layer']}), "
                  f"max |diff| vs xla {err}", flush=True)
        res[f"B{batch}"] = row
    device = jax.devices()[0]
    append_line(args.results, f"- {datetime.date.today()} projection.py, {device.device_kind}, commit {git_commit()}, "
                              f"jax {jax.__version__}, {args.preset} KDA layer's projections at decode (input norm + "
                              f"q|k|v|f_a|g_a|b{' joined into two weights' if args.joined_weights else ''}, o_proj + "
                              f"residual; {LAYERS} layers chained, device time per layer, roofline the weights at HBM "
                              f"copy bandwidth): {json.dumps(res)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
