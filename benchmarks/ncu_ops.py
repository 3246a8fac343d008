"""One kernel-bearing op at a benchmark's shape, run a few times: the program that Nsight Compute (`ncu`) profiles.

    ncu --clock-control none -k regex:kda_chunk -c 3 --set full -o kda python3 benchmarks/ncu_ops.py kda
    ncu --clock-control none -k "regex:moe_(gemv_)?(gate|down)" -c 2 --set full -o moe \
        python3 benchmarks/ncu_ops.py moe --shape deepseek --tokens 16

Ops (shapes and inputs as in benchmarks/kda.py and benchmarks/moe.py):
  kda   chunk_kda at B1 H32 D128 bf16, T `--tokens` (default 8192): kernels kda_chunk_akk, kda_chunk_wy, kda_chunk_state
  moe   the MXFP4 layer as the model runs it (`--shape` medium or deepseek, `--tokens`): at decode sizes the CUDA-core
        kernels moe_gemv_gate_up_r*, moe_gemv_down_r*; else moe_gate_up[_split_k], moe_down[...]; `--shared N`: one
        token with a shared MLP of N x the experts' width folded into those kernels (the model's batch-1 layer)
  kda_decode  the medium hybrid's one-kernel KDA decode step (kernels/kda/decode_layer.py: 16 heads x 128, low rank
        128, conv 4, bf16) at `--tokens` rows (default 1): kernel kda_decode_layer
  projection  the medium hybrid's KDA input projections at `--tokens` rows (default 1): the input norm and q|k|v,
        f_a|g_a|b (2048 -> 6144 + 272) in kernels/projection.py's kernel, as the model calls it: kernel decode_projection
  moe_front  the medium hybrid's MoE front at one row with the router's choice (kernels/moe_front.py: o_proj's 8
        partial sums, 2048 features, 64 experts, top-6): kernel moe_front; `--shared`: with the shared MLP's gate / up
        products (768 columns) in programs beside the router's, `--tiles block_n=64,k_parts=8` their shape
  moe_dense  the same layer with bf16 experts through kernels/moe_dense.py (`--tiles field=value,...` overrides the
        fields of `choose_tiles`' DenseTiles, e.g. fused_mlp=true,block_i=64): moe_dense_gate_up / moe_dense_down,
        or moe_dense_fused_mlp
`--tuning field=value,...` overrides KdaTuning fields (kda). The first call compiles; `--calls` calls run in all,
so `ncu -c` with the kernels of one call profiles them once compiled (Triton's compile launches nothing).
"""

from __future__ import annotations

import argparse
import os
import sys


def _fields(spec: str | None) -> dict:
    """'name=value,...' (`--tiles`) -> {name: value}, values parsed as decode_profile.py's `--set` parses them."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from decode_profile import parse_value  # benchmarks/decode_profile.py

    return {name: parse_value(text) for name, _, text in
            (pair.partition("=") for pair in filter(None, (spec or "").split(",")))}


def run_kda(tokens: int, calls: int, tuning_spec: str | None) -> None:
    import jax
    import jax.numpy as jnp

    from kda import tuning_with  # benchmarks/kda.py

    from dayzero.kernels.kda import pallas

    heads, dim = 32, 128
    ks = jax.random.split(jax.random.key(tokens), 6)
    norm = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    shape = (1, tokens, heads, dim)
    q = norm(jax.random.normal(ks[0], shape)).astype(jnp.bfloat16)
    k = norm(jax.random.normal(ks[1], shape)).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], shape, jnp.bfloat16)
    g = -jax.random.uniform(ks[3], shape, jnp.float32) * 0.1
    beta = jax.random.uniform(ks[4], shape[:3], jnp.bfloat16)
    h0 = jax.random.normal(ks[5], (1, heads, dim, dim), jnp.float32)
    tuning = tuning_with(filter(None, (tuning_spec or "").split(",")))
    fn = jax.jit(lambda *a: pallas.chunk_kda(*a, initial_state=h0, output_final_state=True, tuning=tuning))
    for _ in range(calls):
        out = jax.block_until_ready(fn(q, k, v, g, beta))
    print(f"kda T{tokens} {tuning}: |o| {float(jnp.linalg.norm(out[0].astype(jnp.float32))):.4g}")


def run_moe(shape: str, tokens: int, calls: int, shared: int = 0) -> None:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from moe import SHAPES, routing  # benchmarks/moe.py

    from dayzero.kernels import moe, moe_mxfp4_gemv, mxfp4

    n_experts, top_k, hidden, inter = SHAPES[shape]
    ew = mxfp4.random_experts(jax.random.key(0), n_experts, hidden, inter)
    ids, w = routing(jax.random.key(tokens), tokens, n_experts, top_k)
    x = jax.random.normal(jax.random.key(1), (tokens, hidden), jnp.bfloat16)
    # with `shared`: a shared MLP of `shared` x the experts' width, folded into the decode kernels as the model folds
    # it at one token (moe_mxfp4_gemv.SharedFold)
    keys = jax.random.split(jax.random.key(2), 3)
    s_inter = shared * inter
    mlp = (tuple((jax.random.normal(k, shape, jnp.bfloat16) * 0.02)
                 for k, shape in zip(keys, ((hidden, s_inter), (hidden, s_inter), (s_inter, hidden))))
           if shared else None)
    fn = jax.jit(lambda x, e, m: moe.moe_experts_packed(x, ids, w, e, impl="pallas", shared=m,
                                                        tiles=moe_mxfp4_gemv.tiles_for(ids.size, n_experts)
                                                        if m else None)[0])
    for _ in range(calls):
        y = jax.block_until_ready(fn(x, ew, mlp))
    print(f"moe {shape} T{tokens}: |y| {float(jnp.linalg.norm(y.astype(jnp.float32))):.4g}")


def run_kda_decode(rows: int, calls: int) -> None:
    import jax
    import jax.numpy as jnp

    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer

    heads, dim, rank, width, layers = 16, 128, 128, 4, 2
    hd = heads * dim
    ks = iter(jax.random.split(jax.random.key(rows), 12))
    normal = lambda shape, dtype=jnp.bfloat16, s=1.0: (jax.random.normal(next(ks), shape) * s).astype(dtype)
    args = (normal((rows, 3 * hd)), normal((rows, 2 * rank + heads)),
            tuple(normal((hd, width), s=0.3) for _ in range(3)), normal((rank, hd), s=0.1),
            jnp.zeros((heads,), jnp.float32), jnp.zeros((hd,), jnp.float32), normal((rank, hd), s=0.1),
            jnp.ones((dim,), jnp.float32), normal((layers, 2 * rows, 3, hd, width - 1)),
            normal((layers, 2 * rows, heads, dim, dim), jnp.float32, 0.1))
    slots, lengths = jnp.arange(rows, dtype=jnp.int32), jnp.ones((rows,), jnp.int32)
    # as the model runs it: split over value blocks at few rows, each head's last block shifting the q/k conv inputs
    split = decode_layer.value_split(rows, dim)
    turns = jnp.zeros((layers, rows, heads), jnp.int32)
    fn = jax.jit(lambda t, *a: decode_layer.decode_step(*a, layer=1, eps=1e-5, lower_bound=None, value_split=split,
                                                        turns=t), donate_argnums=(0, 9, 10))
    conv, pool = args[8], args[9]
    for _ in range(calls):
        o, conv, pool, turns = jax.block_until_ready(fn(turns, *args[:8], conv, pool, slots, lengths))
    o = projection.finished(o)
    print(f"kda_decode B{rows} (value split {split}): |o| {float(jnp.linalg.norm(o.astype(jnp.float32))):.4g}")


def run_projection(rows: int, calls: int) -> None:
    import jax
    import jax.numpy as jnp

    from dayzero.kernels import projection

    keys = iter(jax.random.split(jax.random.key(rows), 8))
    weight = lambda n: (jax.random.normal(next(keys), (2048, n)) * 0.02).astype(jnp.bfloat16)
    groups = ((weight(2048), weight(2048), weight(2048)), (weight(128), weight(128), weight(16)))
    x = jax.random.normal(next(keys), (rows, 2048), jnp.bfloat16)
    norm = jnp.ones((2048,), jnp.float32)
    fn = jax.jit(lambda x, n, g: projection.project(x, g, norm_weight=n, eps=1e-5))
    for _ in range(calls):
        out = jax.block_until_ready(fn(x, norm, groups))
    print(f"projection B{rows}: |qkv| {float(jnp.linalg.norm(out[0].astype(jnp.float32))):.4g}")


def run_moe_front(shared: bool, calls: int, tiles_spec: str | None) -> None:
    import jax
    import jax.numpy as jnp

    from dayzero.kernels import moe_front, projection

    keys = iter(jax.random.split(jax.random.key(0), 6))
    sums = jax.random.normal(next(keys), (8, 1, 2048), jnp.float32)
    residual = jax.random.normal(next(keys), (1, 2048), jnp.bfloat16)
    norm = jnp.ones((2048,), jnp.float32)
    router_weight = (jax.random.normal(next(keys), (64, 2048)) * 0.02).astype(jnp.bfloat16)
    mlp = tuple((jax.random.normal(next(keys), (2048, 768)) * 0.02).astype(jnp.bfloat16) for _ in range(2))
    programs = moe_front.shared_products(2048, 768)._replace(**_fields(tiles_spec)) if shared else None
    select = moe_front.Select(6, True, True, 2.446, 4 if shared else 2)

    def fn(sums, residual, norm, router_weight, turns, *mlp):
        update = projection.Partials(sums, None, 2048, 1e-6, "bfloat16")
        return moe_front.front(update, residual, norm, router_weight, eps=1e-5, select=select, turns=turns, layer=0,
                               zeros=64, shared=mlp or None, shared_programs=programs)

    run, turns = jax.jit(fn), jnp.zeros((1, 4), jnp.int32)
    for _ in range(calls):
        out = jax.block_until_ready(run(sums, residual, norm, router_weight, turns, *(mlp if shared else ())))
        turns = out[5]  # x, normed, logits, ids, weights, turns, zeros[, shared sums]
    print(f"moe_front B1 shared={programs}: ids {out[3][0].tolist()}")


def run_moe_dense(shape: str, tokens: int, calls: int, tiles_spec: str | None) -> None:
    import dataclasses

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from moe import SHAPES, routing  # benchmarks/moe.py

    from dayzero.kernels import moe_dense

    n_experts, top_k, hidden, inter = SHAPES[shape]
    keys = jax.random.split(jax.random.key(0), 3)
    w_gate, w_up = (jax.random.normal(k, (n_experts, hidden, inter), jnp.bfloat16) * 0.02 for k in keys[:2])
    w_down = jax.random.normal(keys[2], (n_experts, inter, hidden), jnp.bfloat16) * 0.02
    ids, w = routing(jax.random.key(tokens), tokens, n_experts, top_k)
    x = jax.random.normal(jax.random.key(1), (tokens, hidden), jnp.bfloat16)
    tiles = dataclasses.replace(moe_dense.choose_tiles(ids.size, n_experts), **_fields(tiles_spec))
    fn = jax.jit(lambda x, *d: moe_dense.grouped_swiglu(x, ids, w, *d, tiles=tiles))
    for _ in range(calls):
        y = jax.block_until_ready(fn(x, w_gate, w_up, w_down))
    print(f"moe_dense {shape} T{tokens} {tiles}: |y| {float(jnp.linalg.norm(y.astype(jnp.float32))):.4g}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=("kda", "kda_decode", "moe", "moe_dense", "moe_front", "projection"))
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--shape", default="deepseek", help="moe: medium or deepseek")
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--tuning", help="kda: KdaTuning overrides, e.g. intra_block_k=64,intra_warps=8")
    parser.add_argument("--shared", type=int, default=0,
                        help="moe: fold a shared MLP of this many x the experts' width into the decode kernels; "
                             "moe_front: > 0 adds the shared MLP's gate / up programs")
    parser.add_argument("--tiles", help="moe_dense: DenseTiles overrides, e.g. fused_mlp=true,block_i=64; moe_front: "
                                        "SharedProducts fields, e.g. block_n=64,k_parts=8")
    args = parser.parse_args(argv)
    if args.op == "kda":
        run_kda(args.tokens or 8192, args.calls, args.tuning)
    elif args.op == "kda_decode":
        run_kda_decode(args.tokens or 1, args.calls)
    elif args.op == "projection":
        run_projection(args.tokens or 1, args.calls)
    elif args.op == "moe":
        run_moe(args.shape, args.tokens or 16, args.calls, args.shared)
    elif args.op == "moe_front":
        run_moe_front(args.shared > 0, args.calls, args.tiles)
    else:
        run_moe_dense(args.shape, args.tokens or 1, args.calls, args.tiles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
