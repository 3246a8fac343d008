"""KDA Pallas kernels compiled for the GPU (Triton, not interpret) against the plain-jnp reference on the same GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels.kda import pallas as kda_pallas
from dayzero.kernels.kda import reference as kda_ref

pytestmark = pytest.mark.skipif(not any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices()),
                                reason="no GPU on this machine")


def _inputs(seed, B, T, H, K, V, dtype, g_max=2.0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, H, K)), dtype)
    k = jnp.asarray(rng.standard_normal((B, T, H, K)), dtype)
    v = jnp.asarray(rng.standard_normal((B, T, H, V)), dtype)
    g = jnp.asarray(-rng.uniform(0, g_max, (B, T, H, K)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (B, T, H)), dtype)
    h0 = jnp.asarray(rng.standard_normal((B, H, K, V)) * 0.5, jnp.float32)
    return q, k, v, g, beta, h0


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _seed():
    seed = int(np.random.SeedSequence().entropy % (2**32))
    print("seed", seed)
    return seed


@pytest.mark.parametrize("shape", [(2, 77, 3, 64, 64), (1, 1000, 4, 128, 128), (2, 130, 2, 24, 40)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_chunk_kernel_on_gpu(shape, dtype, tol):
    B, T, H, K, V = shape
    q, k, v, g, beta, h0 = _inputs(_seed(), B, T, H, K, V, dtype)
    lengths = jnp.array([T] + [max(1, T // (i + 2)) for i in range(B - 1)], jnp.int32)
    o, s, states = kda_pallas.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, lengths=lengths, output_chunk_states=True)
    with jax.default_matmul_precision("highest"):
        ref = kda_ref.chunk_kda(*(x.astype(jnp.float32) for x in (q, k, v, g, beta)), initial_state=h0,
                                output_final_state=True, use_qk_l2norm_in_kernel=True, lengths=lengths,
                                output_chunk_states=True)
    assert _rel(o, ref[0]) < tol and _rel(s, ref[1]) < tol and _rel(states, ref[2]) < tol


def test_strong_decay_on_gpu():
    q, k, v, g, beta, h0 = _inputs(_seed(), 1, 200, 2, 64, 64, jnp.float32, g_max=8.0)
    g = jnp.where(jax.random.uniform(jax.random.key(1), g.shape) < 0.3, -60.0, g)
    o, s = kda_pallas.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
    with jax.default_matmul_precision("highest"):
        o_r, s_r = kda_ref.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    assert _rel(o, o_r) < 1e-4 and _rel(s, s_r) < 1e-4


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("v_fastest", [False, True])  # the decode kernels' two launch orders (and output forms)
def test_recurrent_kernels_on_gpu(dtype, tol, v_fastest):
    B, T, H, K, V = 5, 2, 4, 128, 128
    q, k, v, g, beta, h0 = _inputs(_seed(), B, T, H, K, V, dtype)
    lengths = jnp.array([2, 1, 2, 2, 1], jnp.int32)
    tuning = kda_pallas.KdaTuning(decode_v_fastest=v_fastest, decode_output_before_update=v_fastest)  # both forms
    o, s = kda_pallas.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True, lengths=lengths, tuning=tuning)
    o_r, s_r = kda_ref.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, lengths=lengths)
    assert _rel(o, o_r) < tol and _rel(s, s_r) < tol
    pool = jnp.concatenate([h0, h0 * 2.0])[None].repeat(2, axis=0)  # [2, 10, H, K, V]
    slots = jnp.array([9, 0, 4, 6, 2], jnp.int32)
    o2, pool2 = kda_pallas.fused_recurrent_kda_slots(q, k, v, g, beta, pool + 0, slots, layer=1,
                                                     use_qk_l2norm_in_kernel=True, lengths=lengths, tuning=tuning)
    o2_r, pool2_r = kda_ref.fused_recurrent_kda_slots(q, k, v, g, beta, pool, slots, layer=1,
                                                      use_qk_l2norm_in_kernel=True, lengths=lengths)
    assert _rel(o2, o2_r) < tol and _rel(pool2, pool2_r) < tol
    assert np.array_equal(np.asarray(pool2[0]), np.asarray(pool[0]))


SPLIT_TUNINGS = {  # KdaTuning overrides: kernel 1a's channel slices, warps and levels per pass
    "default": {}, "64x8": dict(intra_block_k=64, intra_warps=8), "16x4": dict(intra_block_k=16),
    "one_level": dict(intra_level_group=1)}


@pytest.mark.parametrize("tuning_name", list(SPLIT_TUNINGS))
@pytest.mark.parametrize("dtype,tol,g_max", [(jnp.float32, 1e-5, 2.0), (jnp.bfloat16, 2e-2, 2.0),
                                             (jnp.float32, 1e-4, 8.0)])
def test_split_intra_variant_on_gpu(dtype, tol, g_max, tuning_name):
    """Kernel 1 split in two (A blocks by levels, then the block solve and WY products) against the reference:
    f32, bf16, and strong decays (-60 on a third of the channels), at the default channel slice and others, with
    three levels per pass (the default) and one."""
    B, T, H, K, V = 2, 333, 4, 128, 128
    q, k, v, g, beta, h0 = _inputs(_seed(), B, T, H, K, V, dtype, g_max=g_max)
    if g_max > 2.0:
        g = jnp.where(jax.random.uniform(jax.random.key(1), g.shape) < 0.3, -60.0, g)
    lengths = jnp.array([T, 190], jnp.int32)
    tuning = kda_pallas.KdaTuning(**SPLIT_TUNINGS[tuning_name])
    o, s = kda_pallas.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True, lengths=lengths, tuning=tuning)
    with jax.default_matmul_precision("highest"):
        ref = kda_ref.chunk_kda(*(x.astype(jnp.float32) for x in (q, k, v, g, beta)), initial_state=h0,
                                output_final_state=True, use_qk_l2norm_in_kernel=True, lengths=lengths)
    assert _rel(o, ref[0]) < tol and _rel(s, ref[1]) < tol


@pytest.mark.parametrize("wy_inverse", ["ieee", "tf32"])
@pytest.mark.parametrize("g_max", [2.0, 8.0])
def test_wy_inverse_precisions_on_gpu(wy_inverse, g_max):
    """Kernel 1b's block inverse on IEEE FMAs and on tf32 tensor-core products (bf16 inputs) against the reference,
    with ordinary and strong decays (-60 on a third of the channels)."""
    B, T, H, K, V = 2, 333, 4, 128, 128
    q, k, v, g, beta, h0 = _inputs(_seed(), B, T, H, K, V, jnp.bfloat16, g_max=g_max)
    if g_max > 2.0:
        g = jnp.where(jax.random.uniform(jax.random.key(1), g.shape) < 0.3, -60.0, g)
    lengths = jnp.array([T, 190], jnp.int32)
    tuning = kda_pallas.KdaTuning(wy_inverse=wy_inverse)
    o, s = kda_pallas.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True, lengths=lengths, tuning=tuning)
    with jax.default_matmul_precision("highest"):
        ref = kda_ref.chunk_kda(*(x.astype(jnp.float32) for x in (q, k, v, g, beta)), initial_state=h0,
                                output_final_state=True, use_qk_l2norm_in_kernel=True, lengths=lengths)
    assert _rel(o, ref[0]) < 2e-2 and _rel(s, ref[1]) < 2e-2


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("batch,padding_row", [(1, False), (16, True), (5, True)])
def test_decode_layer_on_gpu(lower_bound, batch, padding_row):
    """The one-kernel KDA decode step compiled at the medium hybrid's layer (16 heads x 128, conv 4) against the jnp
    reference on the same GPU: conv caches equal; the written states and the outputs to bf16 rounding, whether the
    reference's conv runs in float32 as the kernel's does or in the model's bf16 arithmetic (XLA on the GPU may keep
    float32 where the kernel rounds the conv outputs to bf16: `xla_allow_excess_precision`); the other slots
    untouched."""
    from dayzero.kernels.kda import decode_layer
    from test_kda_kernels import decode_layer_inputs

    seed = _seed()
    args = decode_layer_inputs(seed, batch, 16, 128, slots_total=40, padding_row=padding_row)
    options = dict(layer=1, eps=1e-5, lower_bound=lower_bound)
    got = jax.jit(lambda *a: decode_layer.decode_step(*a, **options))(*args)
    with jax.default_matmul_precision("highest"):
        same = jax.jit(lambda *a: decode_layer.reference(*a, **options, conv_dtype=jnp.float32))(*args)
        model = jax.jit(lambda *a: decode_layer.reference(*a, **options))(*args)
    written = np.zeros(args[9].shape[:2], bool)
    written[1, np.asarray(args[10])] = True
    assert np.array_equal(np.asarray(got[1], np.float32), np.asarray(same[1], np.float32))
    assert np.array_equal(np.asarray(got[2])[~written], np.asarray(args[9])[~written])
    for want in (same, model):
        assert _rel(np.asarray(got[2])[written], np.asarray(want[2])[written]) < 1e-2
        assert _rel(got[0], want[0]) < 2e-2


@pytest.mark.parametrize("batch", [16, 5])
def test_decode_layer_with_low_rank_ups_on_gpu(batch):
    """The decode step handed f_a @ f_b and g_a @ g_b by XLA (`low_rank_ups`), compiled at the medium hybrid's
    layer: the caches and output of the step that multiplies by f_b and g_b itself, to rounding (conv caches
    equal)."""
    from dayzero.kernels.kda import decode_layer
    from test_kda_kernels import decode_layer_inputs

    seed = _seed()
    args = decode_layer_inputs(seed, batch, 16, 128, slots_total=40, padding_row=True)
    options = dict(layer=1, eps=1e-5, lower_bound=None)
    own = jax.jit(lambda *a: decode_layer.decode_step(*a, **options))(*args)
    got = jax.jit(lambda *a: decode_layer.decode_step(
        *a, **options, low_rank_ups=decode_layer.low_rank_ups(a[1], a[3], a[6])))(*args)
    assert np.array_equal(np.asarray(got[1], np.float32), np.asarray(own[1], np.float32))
    assert _rel(got[2], own[2]) < 1e-3 and _rel(got[0], own[0]) < 1e-2


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_layer_with_projection_partials_on_gpu(batch):
    """The decode step given q|k|v and f_a|g_a|b as the projection kernel's 8-slice partial sums with the norm's
    squares (`projection.Partials`), compiled at the medium hybrid's layer: the same as given the arrays
    `projection.finished` makes of them, to bf16 rounding of the summation order."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer
    from test_kda_kernels import _as_partials, decode_layer_inputs

    seed = _seed()
    rng = np.random.default_rng(seed)
    args = decode_layer_inputs(seed, batch, 16, 128, slots_total=40, padding_row=batch > 1)
    qkv, fgb = (_as_partials(a, rng, 8, k_dim=2048) for a in args[:2])
    options = dict(layer=1, eps=1e-5, lower_bound=None)
    got = jax.jit(lambda q, f, *a: decode_layer.decode_step(q, f, *a, **options))(qkv, fgb, *args[2:])
    want = jax.jit(lambda q, f, *a: decode_layer.decode_step(projection.finished(q), projection.finished(f), *a,
                                                             **options))(qkv, fgb, *args[2:])
    assert _rel(got[0], want[0]) < 1e-2 and _rel(got[1], want[1]) < 1e-2 and _rel(got[2], want[2]) < 1e-3


@pytest.mark.parametrize("split", [2, 4, 8])
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_decode_layer_value_split_on_gpu(split, batch):
    """The decode step split over value blocks (`value_split`), compiled at the medium hybrid's layer: the unsplit
    kernel's caches (conv equal, states to float32 rounding) and, once its `HeadScaled` rows are finished (by XLA,
    or by o_proj's projection kernel as it loads them), the unsplit output and o_proj's product to bf16 rounding."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer
    from test_kda_kernels import decode_layer_inputs

    seed = _seed()
    args = decode_layer_inputs(seed, batch, 16, 128, slots_total=40, padding_row=batch > 1)
    options = dict(layer=1, eps=1e-5, lower_bound=None)
    one = jax.jit(lambda *a: decode_layer.decode_step(*a, **options))(*args)
    got = jax.jit(lambda *a: decode_layer.decode_step(*a, **options, value_split=split))(*args)
    assert np.array_equal(np.asarray(got[1], np.float32), np.asarray(one[1], np.float32))
    assert _rel(got[2], one[2]) < 1e-5
    # each head's last block shifting q's and k's conv inputs in place (turn counters, as the model's cache holds
    # them): the same caches and output, call after call (the counters back at zero each time)
    counted = jax.jit(lambda t, *a: decode_layer.decode_step(*a, **options, value_split=split, turns=t))
    turns = jnp.zeros((2, batch, 16), jnp.int32)
    for _ in range(3):
        *again, turns = counted(turns, *args)
        assert not np.any(np.asarray(turns))
        for c, g in zip(jax.tree.leaves(again), jax.tree.leaves(got)):
            assert np.array_equal(np.asarray(c, np.float32), np.asarray(g, np.float32))
    assert _rel(projection.finished(got[0]), one[0]) < 1e-2
    w = (jax.random.normal(jax.random.key(seed), (2048, 2048)) * 0.02).astype(jnp.bfloat16)
    residual = (jax.random.normal(jax.random.key(seed + 1), (batch, 2048)) * 0.01).astype(jnp.bfloat16)
    rows = 1 << (batch - 1).bit_length()  # the kernel's row buckets: powers of two
    pad = lambda a: jnp.pad(a, ((0, rows - batch), (0, 0)))
    head_scaled = projection.HeadScaled(pad(got[0].values), pad(got[0].squares), 128, got[0].eps, got[0].dtype)
    (kernel,) = jax.jit(lambda h, r, w: projection.project(h, ((w,),), residual=r))(head_scaled, pad(residual), w)
    (want,) = jax.jit(lambda o, r, w: projection.reference(o, ((w,),), residual=r))(one[0], residual, w)
    assert _rel(kernel[:batch], want) < 1e-2


@pytest.mark.parametrize("hoist_loads,low_rank_dot", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("split,batch", [(8, 1), (4, 2), (1, 3)])
def test_decode_layer_load_order_and_low_rank_dots_on_gpu(hoist_loads, low_rank_dot, split, batch):
    """`decode_step(hoist_loads=, low_rank_dot=)` compiled at the medium hybrid's layer (split with the turn
    counters, as the model runs it): the conv cache bit for bit and, with the loads hoisted alone, the states and
    output to float32 rounding of the default form; with the low-rank products on the tensor cores, to bf16
    rounding (their sums in another order)."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer
    from test_kda_kernels import decode_layer_inputs

    args = decode_layer_inputs(_seed(), batch, 16, 128, slots_total=40, padding_row=batch > 1)
    options = dict(layer=1, eps=1e-5, lower_bound=None, value_split=split)
    turns = jnp.zeros((2, batch, 16), jnp.int32)
    step = lambda **more: jax.jit(lambda t, *a: decode_layer.decode_step(
        *a, **options, **({"turns": t} if split > 1 else {}), **more))(turns, *args)
    base, got = step(hoist_loads=False), step(hoist_loads=hoist_loads, low_rank_dot=low_rank_dot)
    assert np.array_equal(np.asarray(got[1], np.float32), np.asarray(base[1], np.float32))
    tol = 1e-2 if low_rank_dot else 1e-5
    assert _rel(got[2], base[2]) < tol / 10
    assert _rel(projection.finished(got[0]), projection.finished(base[0])) < tol


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("split,batch", [(8, 1), (4, 2)])
def test_decode_layer_runs_o_proj_on_gpu(prefetch, split, batch):
    """o_proj in the split decode step (`decode_step(o_weight=)`, medium hybrid's layer, the rows asked into L2 or
    not): the caches of the step without it bit for bit, call after call with the counters back at zero, and its
    per-head partial sums adding up to o_proj of the finished `HeadScaled` rows (float64 product) to float32
    rounding, and to the model's bf16 product to bf16 rounding."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer
    from test_kda_kernels import decode_layer_inputs, head_scaled_o_proj

    seed = _seed()
    args = decode_layer_inputs(seed, batch, 16, 128, slots_total=40, padding_row=batch > 1)
    options = dict(layer=1, eps=1e-5, lower_bound=None, value_split=split, o_prefetch=prefetch)
    w = (jax.random.normal(jax.random.key(seed), (2048, 2048)) * 0.02).astype(jnp.bfloat16)
    plain = jax.jit(lambda t, *a: decode_layer.decode_step(*a, **options, turns=t))
    fused = jax.jit(lambda t, w, *a: decode_layer.decode_step(*a, **options, turns=t, o_weight=w))
    turns = jnp.zeros((2, batch, 16), jnp.int32)
    *want, turns = plain(turns, *args)
    for _ in range(3):
        *got, turns = fused(turns, w, *args)
        assert not np.any(np.asarray(turns))
        for g, p in zip(got[1:], want[1:]):
            assert np.array_equal(np.asarray(g, np.float32), np.asarray(p, np.float32))
        assert isinstance(got[0], projection.Partials) and got[0].sums.shape == (16, batch, 2048)
        exact = head_scaled_o_proj(want[0], w)
        total = np.asarray(jnp.sum(got[0].sums, axis=0), np.float64)
        assert np.max(np.abs(total - exact)) <= 1e-4 * np.max(np.abs(exact)) + 1e-6
    (model,) = projection.reference(want[0], ((w,),))
    assert _rel(projection.finished(got[0]), model) < 1e-2


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_layer_six_projections_side_by_side_on_gpu(batch):
    """The decode step given q|k|v|f_a|g_a|b as one array (the model's single projection output), compiled at the
    medium hybrid's layer: the same results as given q|k|v and f_a|g_a|b apart."""
    from dayzero.kernels.kda import decode_layer
    from test_kda_kernels import decode_layer_inputs

    args = decode_layer_inputs(_seed(), batch, 16, 128, slots_total=40, padding_row=batch > 1)
    options = dict(layer=1, eps=1e-5, lower_bound=None)
    apart = jax.jit(lambda *a: decode_layer.decode_step(*a, **options))(*args)
    joined = jax.jit(lambda q, f, *a: decode_layer.decode_step(jnp.concatenate([q, f], axis=1), None, *a,
                                                               **options))(*args)
    for a, j in zip(apart, joined):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(j, np.float32))


def test_model_decode_with_the_decode_layer_kernel_on_gpu(monkeypatch):
    """A bf16 hybrid with 128-wide KDA heads: a cached decode step's logits and caches with the one-kernel KDA decode
    layer against the same step through the separate ops (both compiled on the GPU), to bf16 rounding."""
    from dayzero.kernels.kda import decode_layer
    from dayzero.model import Model
    from dayzero.model.cache import init_cache
    from dayzero.model.presets import tiny

    cfg = tiny().replace(kda_num_heads=2, kda_head_dim=128)
    model = Model.random(cfg, dtype="bfloat16", seed=3)
    rng = np.random.default_rng(4)
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 9)), jnp.int32)
    tables, rows = jnp.asarray([[1], [2]], jnp.int32), jnp.asarray([1, 2], jnp.int32)
    step = jax.jit(lambda p, *a, decode: model.module.apply({"params": p}, *a, method="step", decode=decode),
                   static_argnames="decode")
    cache = init_cache(cfg, num_blocks=4, num_slots=3, dtype=jnp.bfloat16)
    _, cache = step(model.params, ids, jnp.broadcast_to(jnp.arange(9), (2, 9)), jnp.ones((2, 9), bool), cache,
                    tables, rows, decode=False)
    token, at, valid = ids[:, :1], jnp.full((2, 1), 9), jnp.asarray([[True], [False]])
    outs = {}
    for kind in ("pallas", "reference"):
        monkeypatch.setattr(decode_layer, "choose", lambda impl=None, kind=kind: kind)
        run = jax.jit(lambda p, *a: model.module.apply({"params": p}, *a, method="step", decode=True))
        outs[kind] = run(model.params, token, at, valid, cache, tables, rows)
    assert _rel(outs["pallas"][0][0], outs["reference"][0][0]) < 2e-2
    for name in ("conv", "state"):
        assert _rel(outs["pallas"][1][name], outs["reference"][1][name]) < 1e-2
