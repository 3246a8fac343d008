"""Decode-sized projections (kernels/projection.py) compiled for real (Triton) on the GPU, at the medium hybrid's KDA
layer shapes, against a float32 reference of the same roundings; and the model's KDA decode step with the kernel
against the same step without it. Passing here is what lets `projection.GPU_VERIFIED` become True."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import projection
from dayzero.model.presets import medium_hybrid

pytestmark = pytest.mark.skipif(not any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices()),
                                reason="no GPU on this machine")

TILES = {"default": None, "bn32": projection.ProjectionTiles(block_n=32), "k128s3":
         projection.ProjectionTiles(step_k=128, num_stages=3), "w4": projection.ProjectionTiles(num_warps=4),
         "unsplit": projection.ProjectionTiles(k_slices=1), "cuda_cores": projection.ONE_ROW_TILES,
         "cuda_cores_unsplit": projection.ProjectionTiles(block_n=64, num_warps=4, num_stages=1, k_slices=1,
                                                          cuda_cores=True)}


def _want(x, groups, norm_weight, eps, residual):
    """The reference's roundings with float32 products at full precision (XLA's float32 dots may run TF32)."""
    h = x if norm_weight is None else projection.rms_norm(x, norm_weight, eps)
    with jax.default_matmul_precision("highest"):
        outs = [jnp.concatenate([(h.astype(jnp.float32) @ w.astype(jnp.float32)) for w in g], axis=-1)
                for g in groups]
    if residual is not None:
        outs = [residual.astype(jnp.float32) + outs[0].astype(x.dtype).astype(jnp.float32)]
    return outs


def _swiglu_want(x, gate, up, down, norm_weight=None, eps=0.0, residual=None):
    """`moe.swiglu_projected`'s roundings (`_want` for gate|up, SwiGLU in x's dtype, `_want` for down)."""
    inter = gate.shape[1]
    gate_up = _want(x, ((gate, up),), norm_weight, eps, None)[0].astype(x.dtype)
    hidden = jax.nn.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    return _want(hidden, ((down,),), None, 0.0, residual)[0]


def _kda_layer_case(seed, rows):
    """The medium hybrid's KDA layer projections, bf16 -> (cfg, key, w(i, k, n) a random [k, n] weight, x [rows, D],
    the input norm's weight, the input projections' groups (q|k|v, f_a|g_a|b))."""
    cfg = medium_hybrid()
    d, dim, hd, heads = cfg.hidden_size, cfg.kda_dim, cfg.kda_head_dim, cfg.kda_num_heads
    key = jax.random.key(seed)
    w = lambda i, k, n: (jax.random.normal(jax.random.fold_in(key, i), (k, n)) * 0.02).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.fold_in(key, 99), (rows, d), jnp.bfloat16)
    norm = jax.random.uniform(jax.random.fold_in(key, 98), (d,), jnp.float32, 0.5, 1.5)
    groups = ((w(0, d, dim), w(1, d, dim), w(2, d, dim)), (w(3, d, hd), w(4, d, hd), w(5, d, heads)))
    return cfg, key, w, x, norm, groups


@pytest.mark.parametrize("rows", [1, 2, 16])
@pytest.mark.parametrize("tiles", list(TILES))
def test_kda_layer_projections(seed, rows, tiles):
    """The input norm + q|k|v + f_a|g_a|b, and o_proj + the residual, at 2048 features, bf16."""
    cfg, key, w, x, norm, groups = _kda_layer_case(seed, rows)
    d, dim = cfg.hidden_size, cfg.kda_dim
    t = TILES[tiles]
    got = jax.jit(lambda x, n, g: projection.project(x, g, norm_weight=n, eps=cfg.rms_norm_eps, tiles=t))(
        x, norm, groups)
    for g, want in zip(got, _want(x, groups, norm, cfg.rms_norm_eps, None)):
        err = np.max(np.abs(np.asarray(g, np.float32) - np.asarray(want)))
        assert err <= 1e-2 * float(jnp.max(jnp.abs(want))), err
    o, res, wo = got[0][:, :dim], jax.random.normal(jax.random.fold_in(key, 97), (rows, d), jnp.bfloat16), w(6, dim, d)
    (out,) = jax.jit(lambda o, r, wo: projection.project(o, ((wo,),), residual=r, tiles=t))(o, res, wo)
    (want,) = _want(o, ((wo,),), None, 0.0, res)
    err = np.max(np.abs(np.asarray(out, np.float32) - np.asarray(want)))
    assert err <= 1e-2 * float(jnp.max(jnp.abs(want))), err


@pytest.mark.parametrize("rows", [1, 8])
def test_mla_layer_projections(seed, rows):
    """The medium hybrid's MLA layer (`model.mla.DECODE_PROJECTIONS`): the input norm + q_proj (16 x 192) and
    kv_a_proj_with_mqa (512 + 64) as two groups, then o_proj (16 x 128 -> 2048) + the residual, bf16."""
    cfg = medium_hybrid()
    d = cfg.hidden_size
    key = jax.random.key(seed)
    w = lambda i, k, n: (jax.random.normal(jax.random.fold_in(key, i), (k, n)) * 0.02).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.fold_in(key, 99), (rows, d), jnp.bfloat16)
    norm = jax.random.uniform(jax.random.fold_in(key, 98), (d,), jnp.float32, 0.5, 1.5)
    groups = ((w(0, d, cfg.num_heads * cfg.qk_head_dim),), (w(1, d, cfg.kv_lora_rank + cfg.qk_rope_head_dim),))
    got = jax.jit(lambda x, n, g: projection.project(x, g, norm_weight=n, eps=cfg.rms_norm_eps))(x, norm, groups)
    for g, want in zip(got, _want(x, groups, norm, cfg.rms_norm_eps, None)):
        err = np.max(np.abs(np.asarray(g, np.float32) - np.asarray(want)))
        assert err <= 1e-2 * float(jnp.max(jnp.abs(want))), err
    o, wo = x, w(2, cfg.num_heads * cfg.v_head_dim, d)
    (out,) = jax.jit(lambda o, r, wo: projection.project(o, ((wo,),), residual=r))(o, x, wo)
    (want,) = _want(o, ((wo,),), None, 0.0, x)
    assert np.max(np.abs(np.asarray(out, np.float32) - np.asarray(want))) <= 1e-2 * float(jnp.max(jnp.abs(want)))


def test_model_kda_decode_with_projection_kernel(seed, monkeypatch):
    """The medium hybrid's KDA layer at decode (16 rows, bf16): `decode_in_place` with the projection kernel (its
    sums finished by XLA, or by the step kernel: `PROJECTION_PARTIALS`; f_b's and g_b's products by XLA or, with
    `LOW_RANK_UPS_MIN_ROWS` 0, by the step kernel) against the same with XLA's projections and the step kernel's own
    products, on the GPU's own one-kernel step."""
    from dayzero.kernels.kda import decode_layer
    from dayzero.model import kda as kda_model
    from dayzero.model.kda import KimiDeltaAttention

    cfg = medium_hybrid()
    attn = KimiDeltaAttention(cfg, jnp.bfloat16)
    key = jax.random.key(seed)
    rows, slots_total, layers = 16, 17, 2
    x = jax.random.normal(key, (rows, 1, cfg.hidden_size), jnp.bfloat16) * 0.02
    params = attn.init(jax.random.fold_in(key, 1), x)
    norm = jnp.ones((cfg.hidden_size,), jnp.float32)
    conv = jax.random.normal(jax.random.fold_in(key, 2), (layers, slots_total, 3, cfg.kda_dim, cfg.kda_conv_size - 1),
                             jnp.bfloat16)
    pool = jax.random.normal(jax.random.fold_in(key, 3), (layers, slots_total, cfg.kda_num_heads, cfg.kda_head_dim,
                                                          cfg.kda_head_dim)) * 0.1
    slots, valid = jnp.arange(1, rows + 1, dtype=jnp.int32), jnp.ones((rows, 1), bool)
    outs = {}
    for kind, partials, ups in (("reference", False, 0), ("pallas", False, 16), ("partials", True, 16),
                                ("partials_own_ups", True, 0)):
        monkeypatch.setattr(projection, "choose", lambda *a, impl=None, kind=kind: "reference" if kind == "reference"
                            else "pallas")
        monkeypatch.setattr(kda_model, "PROJECTION_PARTIALS", partials)
        monkeypatch.setattr(decode_layer, "LOW_RANK_UPS_MIN_ROWS", ups)
        run = jax.jit(lambda p, x, c, s: attn.apply(p, x, norm, valid, c, s, slots, 1, method="decode_in_place"))
        outs[kind] = run(params, x, conv, pool)
    for kind in ("pallas", "partials", "partials_own_ups"):
        for got, want in zip(outs[kind], outs["reference"]):
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want)), kind


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_shared_expert_through_projection_kernel(seed, rows):
    """The medium hybrid's shared expert (2048 x 768 SwiGLU) as two projection kernel calls (`moe.swiglu_projected`,
    SHARED_PROJECTION_TILES) against the same roundings with float32 products."""
    from dayzero.model import moe

    cfg = medium_hybrid()
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts
    key = jax.random.key(seed)
    w = lambda i, k, n: (jax.random.normal(jax.random.fold_in(key, i), (k, n)) * 0.02).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.fold_in(key, 99), (rows, d), jnp.bfloat16)
    gate, up, down = w(0, d, inter), w(1, d, inter), w(2, inter, d)
    got = jax.jit(lambda *a: moe.swiglu_projected(*a, impl="pallas"))(x, gate, up, down)
    want = _swiglu_want(x, gate, up, down)
    err = np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want)))
    assert err <= 1e-2 * float(jnp.max(jnp.abs(want))), err


@pytest.mark.parametrize("rows", [1, 16])
def test_dense_mlp_through_projection_kernels(seed, rows):
    """The medium hybrid's dense layer MLP (2048 x 6144 SwiGLU) with the post-attention norm and the residual add as
    two projection kernel calls (`moe.swiglu_projected(norm_weight=, residual=)`, DENSE_PROJECTION_TILES) against
    the same roundings with float32 products."""
    from dayzero.model import moe

    cfg = medium_hybrid()
    d, inter = cfg.hidden_size, cfg.intermediate_size
    key = jax.random.key(seed)
    w = lambda i, k, n: (jax.random.normal(jax.random.fold_in(key, i), (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    x = (jax.random.normal(jax.random.fold_in(key, 99), (rows, d)) * 3.0).astype(jnp.bfloat16)
    norm_weight = jax.random.uniform(jax.random.fold_in(key, 98), (d,), jnp.float32, 0.5, 1.5)
    gate, up, down = w(0, d, inter), w(1, d, inter), w(2, inter, d)
    got = jax.jit(lambda *a: moe.swiglu_projected(*a[:4], tiles=moe.DENSE_PROJECTION_TILES, impl="pallas",
                                                  norm_weight=a[4], eps=cfg.rms_norm_eps, residual=a[0]))(
        x, gate, up, down, norm_weight)
    want = _swiglu_want(x, gate, up, down, norm_weight, cfg.rms_norm_eps, residual=x)
    err = np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want)))
    assert err <= 1e-2 * float(jnp.max(jnp.abs(want))), err


@pytest.mark.parametrize("batch", [1, 16])
def test_decode_step_with_the_dense_mlp_in_projection_kernels_on_gpu(monkeypatch, batch):
    """The medium hybrid's layer 0 (KDA + the dense 2048 x 6144 MLP; no router to move), a one-token decode step with
    `model.moe.DENSE_PROJECTION_MAX_TOKENS`: the MLP's norm, products and residual add as the two projection kernels,
    against XLA's layers: the next-token logits and the caches to bf16 rounding."""
    from dayzero.model import moe
    from medium_prefix_cases import prefilled_medium_prefix

    run, args = prefilled_medium_prefix(9, num_blocks=batch + 1, num_layers=1, batch=batch)
    calls, projected = [], moe.swiglu_projected
    monkeypatch.setattr(moe, "swiglu_projected", lambda *a, **k: calls.append(
        (k.get("norm_weight") is not None, k.get("residual") is not None)) or projected(*a, **k))
    monkeypatch.setattr(moe, "DENSE_PROJECTION_MAX_TOKENS", 0)
    plain, plain_cache = run(*args, decode=True)
    assert not calls
    monkeypatch.setattr(moe, "DENSE_PROJECTION_MAX_TOKENS", 16)
    fused, fused_cache = run(*args, decode=True)
    assert calls == [(True, True)]
    a, b = np.asarray(fused, np.float64), np.asarray(plain, np.float64)
    assert np.all(np.isfinite(a)) and np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2
    for name in plain_cache:
        c, d = np.asarray(fused_cache[name], np.float32), np.asarray(plain_cache[name], np.float32)
        assert np.abs(c - d).max() <= 2e-2 * max(np.abs(d).max(), 1e-6), name


@pytest.mark.usefixtures("in_out_layout")
def test_one_token_decode_with_projections_on_cuda_cores_on_gpu(monkeypatch):
    """The medium hybrid's first four layers (three KDA, one MLA; MXFP4 routed experts), a one-token decode step with
    `projection.ONE_ROW_ON_CUDA_CORES` (every one-row projection on the CUDA cores) against the MMA tiles, each
    traced with the path it names: the next-token logits and the caches to bf16 rounding. The attention projections
    stored [in, out], the layout that switch serves (weight rows always run their one-row calls on the CUDA cores)."""
    from medium_prefix_cases import logits_change, prefilled_medium_prefix

    run, args = prefilled_medium_prefix(9, num_blocks=2, num_layers=4, batch=1, mxfp4=True)
    traced, products = [], projection._vector_products
    monkeypatch.setattr(projection, "_vector_products", lambda *a, **k: traced.append(1) or products(*a, **k))
    monkeypatch.setattr(projection, "ONE_ROW_ON_CUDA_CORES", False)
    plain, plain_cache = run(*args, decode=True)
    assert not traced
    monkeypatch.setattr(projection, "ONE_ROW_ON_CUDA_CORES", True)
    vector, vector_cache = run(*args, decode=True)
    assert traced
    assert logits_change(vector, plain) < 2e-2
    for name in plain_cache:
        c, d = np.asarray(vector_cache[name], np.float32), np.asarray(plain_cache[name], np.float32)
        assert np.abs(c - d).max() <= 2e-2 * max(np.abs(d).max(), 1e-6), name


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("tiles", ["default", "r1_k2048", "r4_k512"])
def test_kda_layer_projections_from_weight_rows(seed, rows, tiles):
    """`project(weight_rows=True)`: the KDA layer's input norm + q|k|v + f_a|g_a|b and o_proj + the residual (plain
    and head-scaled rows) from weights stored [N, K], at 2048 features, bf16: the reference's roundings within
    bf16 rounding."""
    cfg, key, w, x, norm, groups = _kda_layer_case(seed, rows)
    d, dim, hd, heads = cfg.hidden_size, cfg.kda_dim, cfg.kda_head_dim, cfg.kda_num_heads
    as_rows = lambda gs: tuple(tuple(jnp.asarray(a.T) for a in g) for g in gs)
    block, step = {"default": (None, None), "r1_k2048": (1, 2048), "r4_k512": (4, 512)}[tiles]
    t = None if block is None else projection.ProjectionTiles(block_n=block, step_k=step, num_warps=4, num_stages=1,
                                                              min_programs=1, k_slices=1, cuda_cores=True)
    call = jax.jit(lambda x, n, g: projection.project(x, g, norm_weight=n, eps=cfg.rms_norm_eps, tiles=t,
                                                      weight_rows=True))
    got = call(x, norm, as_rows(groups))
    for g, want in zip(got, _want(x, groups, norm, cfg.rms_norm_eps, None)):
        err = np.max(np.abs(np.asarray(g, np.float32) - np.asarray(want)))
        assert err <= 1e-2 * float(jnp.max(jnp.abs(want))), err
    o, res, wo = got[0][:, :dim], jax.random.normal(jax.random.fold_in(key, 97), (rows, d), jnp.bfloat16), w(6, dim, d)
    out_call = jax.jit(lambda o, r, wo: projection.project(o, ((wo,),), residual=r, tiles=t, weight_rows=True))
    (out,) = out_call(o, res, wo.T)
    (want,) = _want(o, ((wo,),), None, 0.0, res)
    err = np.max(np.abs(np.asarray(out, np.float32) - np.asarray(want)))
    assert err <= 1e-2 * float(jnp.max(jnp.abs(want))), err
    squares = jax.random.uniform(jax.random.fold_in(key, 96), (rows, heads * 8), jnp.float32, 1.0, 30.0)
    scaled = projection.HeadScaled(o.astype(jnp.float32) * 3.0, squares, hd, cfg.rms_norm_eps, "bfloat16")
    (out,) = jax.jit(lambda s, r, wo: projection.project(s, ((wo,),), residual=r, tiles=t, weight_rows=True))(
        scaled, res, wo.T)
    (want,) = _want(projection.finished(scaled), ((wo,),), None, 0.0, res)
    err = np.max(np.abs(np.asarray(out, np.float32) - np.asarray(want)))
    assert err <= 1e-2 * float(jnp.max(jnp.abs(want))), err


@pytest.mark.parametrize("batch", [1, 4])
def test_decode_step_from_weight_rows_on_gpu(monkeypatch, batch):
    """`model.linear.WEIGHT_ROWS`: the medium hybrid's first four layers (three KDA, one MLA; MXFP4 routed experts)
    with the attention projections stored [out, in], a one-token decode step against the same weights in the
    [in, out] layout: the next-token logits and the caches to bf16 rounding."""
    from dayzero.model import Model, linear
    from medium_prefix_cases import logits_change, medium_prefix_config, prefilled_medium_prefix
    from tiny_decode_cases import as_kernels

    def decode(model):
        run, args = prefilled_medium_prefix(9, num_blocks=batch + 1, batch=batch, model=model)
        return run(*args, decode=True)

    monkeypatch.setattr(linear, "WEIGHT_ROWS", True)
    rows_model = Model.random(medium_prefix_config(4, mxfp4=True), dtype="bfloat16", seed=0)
    rows_logits, rows_cache = decode(rows_model)
    monkeypatch.setattr(linear, "WEIGHT_ROWS", False)
    plain_logits, plain_cache = decode(Model(rows_model.config, as_kernels(rows_model.params), rows_model.dtype))
    assert logits_change(rows_logits, plain_logits) < 2e-2
    for name in plain_cache:
        c, d = np.asarray(rows_cache[name], np.float32), np.asarray(plain_cache[name], np.float32)
        assert np.abs(c - d).max() <= 2e-2 * max(np.abs(d).max(), 1e-6), name
