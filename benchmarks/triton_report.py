"""Registers, spills and shared memory of dayzero's Pallas kernels as Triton builds them for the H200, on a machine
without a GPU: a resource report that costs no device time.

    python benchmarks/triton_report.py [--op indexer|kda|moe_dense|moe_gemv|moe_mxfp4|router|sparse_mla|topk]
                                       [--warps 2,4,8] [--sass DIR]

Each kernel of the chosen op is lowered for CUDA through `jax.export` (as tests/triton_lowering.py does), its Triton
IR captured, compiled by the `triton` package for sm_90 with the kernel's own num_warps / num_stages (or each of
--warps), and `ptxas -v`'s report printed. Needs `pip install triton==3.6.0` (the GPU image's version; its wheel
carries ptxas and cuobjdump). jaxlib builds kernels with its own Triton, so these figures approximate the GPU's;
what they show reliably is pressure: a kernel at 255 registers or with spill bytes runs few programs per
multiprocessor and waits on local memory.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

_TRITON_CALL = "__gpu$xla.gpu.triton"


def capture_kernels(fn, *args) -> list[dict]:
    """[{name, ir, num_warps, num_stages}] for every Pallas kernel `jax.jit(fn)(*args)` lowers to Triton for CUDA."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    modules = []
    original = registration.lowering.lower_jaxpr_to_triton_module

    def record(*a, **kw):
        result = original(*a, **kw)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = record
    try:
        checks = [jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)]
        text = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = original
    configs = []
    for part in text.split(_TRITON_CALL)[1:]:  # backend_config attributes print sorted: ..., ir = "...", name, ...
        rest = part[part.index('ir = "') + 6:]
        rest = rest[re.search(r'(?<!\\)"', rest).end():]
        attrs = rest[:rest.index("}")]
        configs.append({key: int(re.search(key + r" = (\d+)", attrs).group(1)) for key in ("num_warps", "num_stages")}
                       | {"name": re.search(r'name = "([^"]+)"', attrs).group(1)})
    if len(configs) != len(modules):
        raise RuntimeError(f"{len(modules)} Triton modules but {len(configs)} custom calls")
    return [dict(config, ir=ir) for config, ir in zip(configs, modules)]


def compile_report(ir: str, num_warps: int, num_stages: int, sass_path: str | None = None) -> dict:
    """Build one kernel's Triton IR for sm_90; ptxas' registers / spill bytes / stack and Triton's shared memory."""
    import triton
    from triton._C.libtriton import ir as triton_ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ttir")
        with open(source, "w") as f:
            f.write(ir)
        # triton.compile skips the TTIR stage's passes for an IR file; the GPU build runs them (among them the
        # combine pass that folds `acc + dot(a, b, 0)` into the MMA's accumulator), so run them here first
        backend = make_backend(target)
        context = triton_ir.context()
        triton_ir.load_dialects(context)
        backend.load_dialects(context)
        module = triton_ir.parse_mlir_module(source, context)
        module.context = context
        type(backend).make_ttir(module, {}, None, target.arch)
        with open(source, "w") as f:
            f.write(str(module))
        kernel = triton.compile(source, target=target, options={"num_warps": num_warps, "num_stages": num_stages})
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        log = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "-arch=sm_90a", ptx, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
        if sass_path:
            with open(sass_path, "w") as f:
                f.write(sass)
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, log)) else 0
    ttgir = kernel.asm["ttgir"]
    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack": number(r"(\d+) bytes stack frame"),
            "shared": kernel.metadata.shared,
            # static counts (a loop body counts once): layout conversions Triton left in the IR (most go through
            # shared memory), and the barriers and instructions of the machine code
            "convert_layouts": ttgir.count("ttg.convert_layout"), "barriers": len(re.findall(r"\bBAR\.", sass)),
            "sass_instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, flags=re.M))}


def kda_cases() -> dict:
    """The KDA kernels at the issue's benchmark shapes (B1 T8192 H32 D128 bf16 prefill; B64 decode) and the
    one-kernel decode layer step at the medium hybrid's."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer, pallas

    S = jax.ShapeDtypeStruct
    B, T, H, D = 1, 8192, 32, 128
    q, g, beta = S((B, T, H, D), jnp.bfloat16), S((B, T, H, D), jnp.float32), S((B, T, H), jnp.bfloat16)
    state = S((B, H, D, D), jnp.float32)
    def chunk(tuning=pallas.DEFAULT_TUNING):
        return lambda q, k, v, g, beta, h0: pallas.chunk_kda(q, k, v, g, beta, initial_state=h0,
                                                             output_final_state=True, tuning=tuning)

    dq, dg, dbeta = S((64, 1, H, D), jnp.bfloat16), S((64, 1, H, D), jnp.float32), S((64, 1, H), jnp.bfloat16)
    pool, slots = S((1, 64, H, D, D), jnp.float32), S((64,), jnp.int32)
    levels_apart = pallas.KdaTuning(intra_level_group=1)
    dim = 16 * D  # the medium hybrid's KDA layer (16 heads) for the one-kernel decode step, batch 16
    layer = (S((16, 3 * dim), jnp.bfloat16), S((16, 2 * D + 16), jnp.bfloat16), (S((dim, 4), jnp.bfloat16),) * 3,
             S((D, dim), jnp.bfloat16), S((16,), jnp.float32), S((dim,), jnp.float32), S((D, dim), jnp.bfloat16),
             S((D,), jnp.bfloat16), S((12, 64, 3, dim, 3), jnp.bfloat16), S((12, 64, 16, D, D), jnp.float32),
             S((16,), jnp.int32), S((16,), jnp.int32))
    decode_layer_step = lambda *a: decode_layer.decode_step(*a, layer=0, eps=1e-5, lower_bound=None)
    # at batch 1: the six projections side by side (`model.kda.PROJECTIONS_AS_ONE`), each head in 8 blocks of value
    # columns (the model passes two groups of partial sums: `PROJECTION_PARTIALS`)
    split_step = lambda q, *a: decode_layer.decode_step(q, None, *a, layer=0, eps=1e-5, lower_bound=None,
                                                        value_split=8)
    layer_b1 = (S((1, 3 * dim + 2 * D + 16), jnp.bfloat16),) + tuple(
        S((1,) + a.shape[1:], a.dtype) if i in (10, 11) else a for i, a in enumerate(layer) if i > 1)
    def counted(**options):
        return lambda turns, q, *a: decode_layer.decode_step(q, None, *a, layer=0, eps=1e-5, lower_bound=None,
                                                             value_split=8, turns=turns, **options)
    # as the model runs it at batch 1: q|k|v and f_a|g_a|b as the input projection's 8-slice partial sums with the
    # norm's squares (`model.kda.PROJECTION_PARTIALS`)
    def with_partials(**options):
        def step(turns, qkv_sums, fgb_sums, squares, *a):
            parts = [projection.Partials(x, squares, 2048, 1e-6, "bfloat16") for x in (qkv_sums, fgb_sums)]
            return decode_layer.decode_step(*parts, *a, layer=0, eps=1e-5, lower_bound=None, value_split=8,
                                            turns=turns, **options)
        return step

    partial_sums = (S((12, 2, 16), jnp.int32), S((8, 1, 3 * dim), jnp.float32), S((8, 1, 2 * D + 16), jnp.float32),
                    S((8, 1), jnp.float32)) + layer_b1[1:]
    # o_proj (the medium hybrid's 2048 x 2048) in the same kernel (`model.kda.O_PROJ_IN_STEP`)
    o_proj_step = lambda turns, w, q, *a: decode_layer.decode_step(q, None, *a, layer=0, eps=1e-5, lower_bound=None,
                                                                   value_split=8, turns=turns, o_weight=w)
    # at batch 16 as the model runs it: f_b's and g_b's products made by XLA (`decode_layer.LOW_RANK_UPS_MIN_ROWS`)
    ups_step = lambda f_up, g_up, *a: decode_layer.decode_step(*a, layer=0, eps=1e-5, lower_bound=None,
                                                               low_rank_ups=(f_up, g_up))
    return {"decode layer B16 H16": (decode_layer_step, layer),
            "decode layer B16 H16 low_rank_ups": (ups_step, (S((16, dim), jnp.bfloat16),) * 2 + layer),
            "decode layer B1 H16 value split 8": (split_step, layer_b1),
            "decode layer B1 H16 value split 8, last block shifts": (
                counted(), (S((12, 2, 16), jnp.int32),) + layer_b1),
            "decode layer B1 H16 value split 8, last block shifts, loads where used": (
                counted(hoist_loads=False), (S((12, 2, 16), jnp.int32),) + layer_b1),
            "decode layer B1 H16 value split 8, last block shifts, loads where used, low-rank dots": (
                counted(hoist_loads=False, low_rank_dot=True), (S((12, 2, 16), jnp.int32),) + layer_b1),
            "decode layer B1 H16 value split 8, last block shifts, low-rank dots": (
                counted(low_rank_dot=True), (S((12, 2, 16), jnp.int32),) + layer_b1),
            "decode layer B1 H16 value split 8, last block shifts, partial sums (the model's)": (
                with_partials(), partial_sums),
            "decode layer B1 H16 value split 8, last block shifts, partial sums, loads where used": (
                with_partials(hoist_loads=False), partial_sums),
            "decode layer B1 H16 value split 8, o_proj in the step": (
                o_proj_step, (S((12, 2, 16), jnp.int32), S((dim, 2048), jnp.bfloat16)) + layer_b1),
            "chunk_kda B1 T8192": (chunk(), (q, q, q, g, beta, state)),
            "chunk_kda B1 T8192 one level per pass": (chunk(levels_apart), (q, q, q, g, beta, state)),
            "chunk_kda B1 T8192 IEEE inverse": (chunk(pallas.KdaTuning(wy_inverse="ieee", wy_warps=4)),
                                                (q, q, q, g, beta, state)),
            "decode slots B64": (pallas.fused_recurrent_kda_slots, (dq, dq, dq, dg, dbeta, pool, slots))}


def moe_dense_cases() -> dict:
    """The dense-expert grouped matmuls at the medium hybrid's layer (64 experts, top-6, 2048 x 768, bf16) at 1 and
    16 tokens, with the XLA row gather and SwiGLU, with them in the kernels' operand loads, with the SwiGLU as the
    gate/up kernel's epilogue (16 tokens) or the partial sums of the pairs' rows only (1 token), the down kernel's
    atomic combine, and the whole MLP in one kernel (`fused_mlp`) at 16 / 32 / 64 intermediate columns per program."""
    import dataclasses

    from dayzero.kernels import moe_dense

    S = jax.ShapeDtypeStruct
    n_experts, top_k, hidden, inter = 64, 6, 2048, 768
    cases = {}
    for n_tokens in (1, 16):
        shapes = (S((n_tokens, hidden), jnp.bfloat16), S((n_tokens, top_k), jnp.int32),
                  S((n_tokens, top_k), jnp.float32), S((n_experts, hidden, inter), jnp.bfloat16),
                  S((n_experts, hidden, inter), jnp.bfloat16), S((n_experts, inter, hidden), jnp.bfloat16))
        for fused in (False, True, "epilogue" if n_tokens > 1 else "pairs"):
            tiles = dataclasses.replace(moe_dense.choose_tiles(n_tokens * top_k, n_experts),
                                        fused_prologues=fused is True, swiglu_epilogue=fused == "epilogue",
                                        pair_partials=fused == "pairs")
            name = f"moe_dense T{n_tokens}" + {False: "", True: " fused_prologues", "epilogue": " epilogue",
                                               "pairs": " pair_partials"}[fused]
            cases[name] = (lambda *a, tiles=tiles: moe_dense.grouped_swiglu(*a, tiles=tiles), shapes)
        tiles = dataclasses.replace(moe_dense.choose_tiles(n_tokens * top_k, n_experts), atomic_combine=True)
        cases[f"moe_dense T{n_tokens} atomic_combine"] = (
            lambda *a, tiles=tiles: moe_dense.grouped_swiglu(*a, tiles=tiles), shapes)
        for block_i in (16, 32, 64):
            tiles = dataclasses.replace(moe_dense.choose_tiles(n_tokens * top_k, n_experts), fused_mlp=True,
                                        block_i=block_i)
            cases[f"moe_dense T{n_tokens} fused_mlp i{block_i}"] = (
                lambda *a, tiles=tiles: moe_dense.grouped_swiglu(*a, tiles=tiles), shapes)
    return cases


def router_cases() -> dict:
    """The one-kernel MoE router at the medium hybrid's shape (64 experts, top-6, hidden 2048) and the largest it
    takes at that width (128 experts, top-8), bf16, 16 tokens (one row block); the select-and-schedule kernel at
    2 and 16 tokens."""
    from dayzero.kernels import router

    S = jax.ShapeDtypeStruct
    cases = {}
    for n_experts, hidden, top_k in ((64, 2048, 6), (128, 2048, 8)):
        fn = lambda x, w, b, k=top_k: router.route_tokens(x, w, b, top_k=k, sigmoid=True, renormalize=True,
                                                         scale=2.5)
        cases[f"router E{n_experts} D{hidden}"] = (fn, (S((16, hidden), jnp.bfloat16),
                                                        S((n_experts, hidden), jnp.bfloat16),
                                                        S((n_experts,), jnp.float32)))
    for n_tokens in (2, 16):  # the select-and-schedule kernel at decode: top-6 of 64 plus one shared part
        fn = lambda logits, b: router.select_and_schedule(logits, b, top_k=6, sigmoid=True, renormalize=True,
                                                          scale=2.5, shared_parts=1)
        cases[f"router schedule E64 T{n_tokens}"] = (fn, (S((n_tokens, 64), jnp.float32), S((64,), jnp.float32)))
    return cases


def projection_cases() -> dict:
    """The decode projections at the medium hybrid's KDA layer: the input norm + q|k|v|f_a|g_a|b (six weights, or
    each group's joined into one) and o_proj with the residual, 1 and 16 rows, bf16, default tiles."""
    from dayzero.kernels import projection

    S = jax.ShapeDtypeStruct
    bf = lambda *shape: S(shape, jnp.bfloat16)
    inputs = (bf(2048, 2048), bf(2048, 2048), bf(2048, 2048), bf(2048, 128), bf(2048, 128), bf(2048, 16))
    cases = {}
    for rows in (1, 16):
        cases[f"inputs M{rows}"] = (lambda x, n, *w: projection.project(x, (w[:3], w[3:]), norm_weight=n, eps=1e-5),
                                    (bf(rows, 2048), S((2048,), jnp.float32), *inputs))
        # each group's weights joined side by side (q|k|v [2048, 6144], f_a|g_a|b [2048, 272]): two branches
        cases[f"inputs joined M{rows}"] = (
            lambda x, n, qkv, fgb: projection.project(x, ((qkv,), (fgb,)), norm_weight=n, eps=1e-5),
            (bf(rows, 2048), S((2048,), jnp.float32), bf(2048, 6144), bf(2048, 272)))
        cases[f"o_proj M{rows}"] = (lambda o, r, w: projection.project(o, ((w,),), residual=r),
                                    (bf(rows, 2048), bf(rows, 2048), bf(2048, 2048)))
    return cases


def mla_absorb_cases() -> dict:
    """Absorbed MLA's W_UK and W_UV kernels at the medium hybrid's 16 heads and DeepSeek-V3.2's 128 (nope 128, rope
    64, v 128, latent 512, bf16), 1 and 16 rows, 8 splits."""
    from dayzero.kernels import mla_absorb, paged, paged_pallas, projection
    from dayzero.kernels.sparse_mla import SplitLatents

    S = jax.ShapeDtypeStruct
    bf = lambda *shape: S(shape, jnp.bfloat16)
    cases = {}
    for heads in (16, 128):
        for rows in (1, 16):
            cases[f"absorb H{heads} M{rows}"] = (
                lambda q, w, heads=heads: mla_absorb.absorb_queries(q, w, heads=heads, nope=128, rope=64, v_dim=128),
                (bf(rows, heads * 192), bf(512, heads * 256)))
            cases[f"up_project H{heads} M{rows} S8"] = (
                lambda o, lse, w, heads=heads: mla_absorb.up_project(SplitLatents(o, lse, heads, "bfloat16"), w,
                                                                     nope=128, v_dim=128),
                (bf(rows, 8, heads, 512), S((rows, 8, heads), jnp.float32), bf(512, heads * 256)))
    for rows in (1, 16):  # the medium hybrid's MLA decode with the latent cache write in the absorb kernel
        cases[f"absorb H16 M{rows} + latent write"] = (
            lambda s, sq, w, cache, tables, weight, rows=rows: mla_absorb.absorb_queries(
                projection.Partials(s, sq, 2048, 1e-5, "bfloat16"), w, heads=16, nope=128, rope=64, v_dim=128,
                cache=cache, latent_write=paged_pallas.DecodeRows(
                    0, tables, jnp.zeros((rows,), jnp.int32), jnp.ones((rows,), bool),
                    projection.Partials(s[..., :576], sq, 2048, 1e-5, "bfloat16"),
                    paged.LeadingNorm(weight, 512, 1e-5))),
            (S((8, rows, 16 * 192), jnp.float32), S((8, rows), jnp.float32), bf(512, 16 * 256), bf(4, 64, 64, 576),
             S((rows, 8), jnp.int32), bf(512)))
    return cases


def sparse_mla_cases() -> dict:
    """Sparse MLA decode (the fused variant, the default, and heads_split 32 x 32; at 16 heads with 32 or 16 keys per
    step) and prefill at DeepSeek-V3.2's shapes (128 heads, latent 512 + 64, top-2048, bf16), batch 16."""
    from dayzero.kernels import sparse_mla

    S = jax.ShapeDtypeStruct
    batch, heads, rank, rope, topk = 16, 128, 512, 64, 2048
    cache = S((1, batch * 512 + 1, 64, rank + rope), jnp.bfloat16)
    tables = S((batch, 512), jnp.int32)
    split = sparse_mla.SparseMLAConfig(block_h=32, block_k=32, decode_block_k=32, min_split_tokens=256,
                                       decode_variant="heads_split")
    cases = {}
    fused32 = sparse_mla.SparseMLAConfig(block_h=32, num_warps=4)
    for name, length, config, n_heads in (("decode fused", 1, sparse_mla.SparseMLAConfig(), heads),
                                          ("decode heads_split", 1, split, heads),
                                          ("decode fused h32 w4", 1, fused32, heads),
                                          ("decode fused 16 heads", 1, sparse_mla.SparseMLAConfig(), 16),
                                          ("decode fused 16 heads k16", 1, sparse_mla.SparseMLAConfig(
                                              decode_block_k=16), 16),
                                          ("decode fused 16 heads k16 st3", 1, sparse_mla.SparseMLAConfig(
                                              decode_block_k=16, num_stages=3), 16),
                                          ("prefill", 64, sparse_mla.SparseMLAConfig(), heads)):
        fn = lambda ql, qr, c, t, p, i, config=config: sparse_mla.sparse_mla(ql, qr, c, 0, t, p, i, 576 ** -0.5,
                                                                             config=config)
        cases[f"sparse_mla {name} B{batch}"] = (fn, (S((batch, length, n_heads, rank), jnp.bfloat16),
                                                     S((batch, length, n_heads, rope), jnp.bfloat16), cache, tables,
                                                     S((batch, length), jnp.int32),
                                                     S((batch, length, topk), jnp.int32)))
    return cases


def indexer_cases() -> dict:
    """The DSA indexer's decode score kernel at DeepSeek-V3.2's shapes (64 heads x 128, bf16 keys, 128K keys per
    request), batch 16: one key tile per program (the default) and runs of key tiles, the dot as heads x keys (the
    default) or keys x heads, at 64 / 128 / 256 keys per tile."""
    from dayzero.kernels import indexer_pallas

    S = jax.ShapeDtypeStruct
    batch, pages = 16, 2048
    cases = {}
    for per_program, keys_as_rows, block_k, warps in ((1, False, 128, 4), (4, False, 128, 4), (1, True, 128, 4),
                                                       (4, True, 128, 4), (16, True, 128, 4), (1, True, 64, 4),
                                                       (1, True, 256, 8), (4, True, 256, 8)):
        config = indexer_pallas.IndexerKernelConfig(tiles_per_program=per_program, keys_as_rows=keys_as_rows,
                                                    block_k=block_k, num_warps=warps)
        fn = lambda q, w, p, c, t, config=config: indexer_pallas.row_scores(q, w, p, c, 0, t, config=config)
        name = f"k{block_k}w{warps} x{per_program}{' keys-rows' * keys_as_rows}"
        cases[f"indexer decode {name} B{batch}"] = (fn, (
            S((batch, 1, 64, 128), jnp.bfloat16), S((batch, 1, 64), jnp.float32), S((batch, 1), jnp.int32),
            S((1, batch * pages + 1, 64, 128), jnp.bfloat16), S((batch, pages), jnp.int32)))
    return cases


def topk_cases() -> dict:
    """The on-chip top-k (kernels/topk_pallas.py) over batch 16's score rows (top-k 2048): one pass at 8K keys, two at
    32K and 128K (the sub-block maxima, then the chosen sub-blocks' scores), three at 512K."""
    from dayzero.kernels import topk_pallas

    S = jax.ShapeDtypeStruct
    return {f"select B16 {n // 1024}K": (lambda scores: topk_pallas.select(scores, 2048), (S((16, n), jnp.float32),))
            for n in (8192, 32768, 131072, 524288)}


def _moe_layer_shapes(n_experts: int, top_k: int, hidden: int, inter: int, n_tokens: int, fmt: str) -> tuple:
    """Shapes of an MoE layer call's arguments: x, topk_ids, topk_weights, then the experts' gate, up, down data and
    gate, up, down scales in `fmt` ("mxfp4" packed, or "float8_e4m3fn" converted)."""
    S = jax.ShapeDtypeStruct
    from dayzero.kernels import mxfp4

    gd, gi = mxfp4.num_blocks(hidden), mxfp4.num_blocks(inter)
    if fmt == "mxfp4":
        data = (S((n_experts, inter, gd, 16), jnp.uint8), S((n_experts, hidden, gi, 16), jnp.uint8))
    else:
        data = (S((n_experts, inter, gd, 2, 16), jnp.float8_e4m3fn),
                S((n_experts, hidden, gi, 2, 16), jnp.float8_e4m3fn))
    scales = (S((n_experts, inter, gd), jnp.uint8), S((n_experts, hidden, gi), jnp.uint8))
    return (S((n_tokens, hidden), jnp.bfloat16), S((n_tokens, top_k), jnp.int32), S((n_tokens, top_k), jnp.float32),
            data[0], data[0], data[1], scales[0], scales[0], scales[1])


def moe_mxfp4_cases() -> dict:
    """The MXFP4 (and pre-converted FP8) grouped matmuls at the medium hybrid's layer (64 experts, top-6, 2048 x 768)
    at 1 token (split-K tiles), 16 and 256 tokens (32 rows per tile, the weights as the MMA's A operand), and 4096
    tokens with the wide prefill tiles (`WIDE_PREFILL_TILES`), and at the DeepSeek-size layer (256 experts, top-8,
    7168 x 2048) at 16 tokens, with `choose_tiles`' tiles."""
    from dayzero.kernels import moe_mxfp4, mxfp4

    wide = moe_mxfp4.prefill_tiles(4096 * 6 / 64, wide=True)  # the medium layer's 384 rows per expert
    cases = {}
    for label, (n_experts, top_k, hidden, inter), n_tokens, fmt, tiles in (
            ("medium", (64, 6, 2048, 768), 1, "mxfp4", None), ("medium", (64, 6, 2048, 768), 16, "mxfp4", None),
            ("medium", (64, 6, 2048, 768), 16, "float8_e4m3fn", None),
            ("medium", (64, 6, 2048, 768), 256, "mxfp4", None),
            ("medium wide", (64, 6, 2048, 768), 4096, "mxfp4", wide),
            ("deepseek", (256, 8, 7168, 2048), 16, "mxfp4", None)):

        def fn(x, ids, w, g, u, d, gs, us, ds, fmt=fmt, n_experts=n_experts, tiles=tiles):
            ew = mxfp4.ExpertWeights(g, u, d, gs, us, ds, fmt=fmt)  # the MMA kernels even where decode takes moe_gemv
            tiles = tiles or moe_mxfp4.choose_tiles(ids.size, n_experts, x.shape[-1], fmt)
            return moe_mxfp4.grouped_swiglu(x, ids, w, ew, n_experts=n_experts, tiles=tiles)

        cases[f"{label} {fmt} T{n_tokens}"] = (fn, _moe_layer_shapes(n_experts, top_k, hidden, inter, n_tokens, fmt))
    return cases


def moe_gemv_cases() -> dict:
    """The MXFP4 decode kernels (CUDA-core products, kernels/moe_mxfp4_gemv.py) at the DeepSeek-size layer (256
    experts, top-8, 7168 x 2048) and the medium hybrid's (64, top-6, 2048 x 768): 1 token (`tiles_for`'s tiles, the
    activations packed in the kernels); 16 and 64 tokens with 2- and 4-row tiles, and 4-row tiles that multiply only
    their real rows ("4a": `GemvTiles.adaptive`); the medium layer's token with the shared MLP folded in (streamed,
    its gate / up sums made by the front kernel in 8 parts of K, and its down projection in the gate/up kernel as
    well, also from sums still to scale)."""
    from dayzero.kernels import moe_mxfp4_gemv, mxfp4

    tiles = moe_mxfp4_gemv.GemvTiles
    cases = {}
    for label, shape, n_tokens, rows, gemv_tiles in (
            ("deepseek", (256, 8, 7168, 2048), 1, "1 (default: packed in-kernel)", moe_mxfp4_gemv.tiles_for(8, 256)),
            ("deepseek", (256, 8, 7168, 2048), 16, "2", tiles(rows=2)),
            ("deepseek", (256, 8, 7168, 2048), 64, "4", tiles(rows=4)),
            ("deepseek", (256, 8, 7168, 2048), 64, "4a", tiles(rows=4, adaptive=True)),
            ("deepseek", (256, 8, 7168, 2048), 64, "2a s3", tiles(rows=2, block_n=32, max_groups=16, adaptive=True,
                                                                   num_stages=3)),
            ("medium", (64, 6, 2048, 768), 1, "1 (default: packed in-kernel)", moe_mxfp4_gemv.tiles_for(6, 64))):

        def fn(x, ids, w, g, u, d, gs, us, ds, gemv_tiles=gemv_tiles):
            ew = mxfp4.ExpertWeights(g, u, d, gs, us, ds)
            return moe_mxfp4_gemv.grouped_swiglu(x, ids, w, ew, tiles=gemv_tiles)

        cases[f"{label} T{n_tokens} rows{rows}"] = (fn, _moe_layer_shapes(*shape, n_tokens, "mxfp4"))
    S = jax.ShapeDtypeStruct
    shared_shapes = (S((2048, 768), jnp.bfloat16), S((2048, 768), jnp.bfloat16), S((768, 2048), jnp.bfloat16),
                     S((8, 2, 768), jnp.float32), S((1,), jnp.float32), S((1, 2048), jnp.float32))
    medium_tiles = moe_mxfp4_gemv.tiles_for(6, 64)
    for label, made, early, scaled in (
            ("streamed", False, False, False), ("gate/up sums from the front", True, False, False),
            ("and the down in the gate/up kernel", True, True, False),
            ("and the down in the gate/up kernel, the sums scaled (the front's row part)", True, True, True)):
        def folded(x, ids, w, g, u, d, gs, us, ds, sg, su, sd, sums, scale, residual, made=made, early=early,
                   scaled=scaled):
            ew = mxfp4.ExpertWeights(g, u, d, gs, us, ds)
            sums = moe_mxfp4_gemv.ScaledSums(sums, scale) if scaled else sums
            shared = moe_mxfp4_gemv.SharedMLP(sg, su, sd, gate_up_sums=sums if made else None, down_in_gate_up=early)
            return moe_mxfp4_gemv.grouped_swiglu(x, ids, w, ew, tiles=medium_tiles, shared=shared,
                                                 residual_sums=residual)

        cases[f"medium T1 shared MLP folded: {label}"] = (
            folded, _moe_layer_shapes(64, 6, 2048, 768, 1, "mxfp4") + shared_shapes)
    return cases


def moe_front_cases() -> dict:
    """The MoE front (residual add, norm, router logits) at the medium hybrid's MoE layer (2048 features, 64
    experts) for one row, after o_proj's 8 K slices: alone, with the router's choice, and with the shared MLP's
    gate / up products (768 columns) as well (the default programs, 64 columns x 8 parts of K of the row part, and
    others)."""
    from dayzero.kernels import moe_front, projection

    S = jax.ShapeDtypeStruct

    def fn(sums, residual, norm_weight, router_weight):
        update = projection.Partials(sums, None, 2048, 1e-6, "bfloat16")
        return moe_front.front(update, residual, norm_weight, router_weight, eps=1e-5)

    def choosing(sums, residual, norm_weight, router_weight, bias, turns):  # + the router's choice (top-6 + 2 shared)
        update = projection.Partials(sums, None, 2048, 1e-6, "bfloat16")
        return moe_front.front(update, residual, norm_weight, router_weight, eps=1e-5,
                               select=moe_front.Select(6, True, True, 2.446, 2), bias=bias, turns=turns, layer=1)

    def sharing(sums, residual, norm_weight, router_weight, bias, turns, gate, up, programs=None):  # + shared gate/up
        update = projection.Partials(sums, None, 2048, 1e-6, "bfloat16")
        return moe_front.front(update, residual, norm_weight, router_weight, eps=1e-5,
                               select=moe_front.Select(6, True, True, 2.446, 4), bias=bias, turns=turns, layer=1,
                               shared=(gate, up), shared_programs=programs)

    shapes = (S((8, 1, 2048), jnp.float32), S((1, 2048), jnp.bfloat16), S((2048,), jnp.float32),
              S((64, 2048), jnp.bfloat16))
    choice = (S((64,), jnp.float32), S((16, 4), jnp.int32))
    return {"front B1": (fn, shapes),
            "front B1 with the router's choice": (choosing, shapes + choice),
            **{f"front B1 with the choice and the shared gate/up{name}": (
                functools.partial(sharing, programs=programs),
                shapes + choice + (S((2048, 768), jnp.bfloat16), S((2048, 768), jnp.bfloat16)))
               for name, programs in (("", None), (", 16 columns x 2 parts", moe_front.SharedProducts(16, 2)),
                                      (", 128 columns x 16 parts", moe_front.SharedProducts(128, 16)),
                                      (", 64 x 8 without the row part", moe_front.SharedProducts(64, 8, False)))}}


CASES = {"indexer": indexer_cases, "kda": kda_cases, "mla_absorb": mla_absorb_cases, "moe_dense": moe_dense_cases,
         "moe_front": moe_front_cases, "moe_gemv": moe_gemv_cases, "moe_mxfp4": moe_mxfp4_cases,
         "projection": projection_cases, "router": router_cases, "sparse_mla": sparse_mla_cases, "topk": topk_cases}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", default="kda", choices=sorted(CASES))
    parser.add_argument("--warps", help="comma-separated num_warps to build each kernel with (default: its own)")
    parser.add_argument("--sass", help="folder to write each kernel's SASS into")
    args = parser.parse_args(argv)
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
    if importlib.util.find_spec("triton") is None:
        raise SystemExit("needs the triton package: pip install triton==3.6.0")
    print("| case | kernel | warps | stages | registers | spill bytes (st/ld) | stack | shared | layout conversions "
          "| barriers | SASS instructions |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for case, (fn, shapes) in CASES[args.op]().items():
        for kernel in capture_kernels(fn, *shapes):
            for warps in ([int(w) for w in args.warps.split(",")] if args.warps else [kernel["num_warps"]]):
                stem = re.sub(r"\W+", "_", f"{case} {kernel['name']} w{warps}")
                sass = os.path.join(args.sass, f"{stem}.sass") if args.sass else None
                r = compile_report(kernel["ir"], warps, kernel["num_stages"], sass)
                print(f"| {case} | {kernel['name']} | {warps} | {kernel['num_stages']} | {r['registers']} | "
                      f"{r['spill_stores']}/{r['spill_loads']} | {r['stack']} | {r['shared']} | {r['convert_layouts']} | "
                      f"{r['barriers']} | {r['sass_instructions']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
