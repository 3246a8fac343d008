"""KDA Pallas kernels (interpret mode on CPU) against the plain-jnp reference and transformers' torch KDA, plus a
check that each kernel lowers through Pallas' Triton backend for CUDA at production shapes.

Fresh random inputs every run (the `seed` fixture); shapes are small because interpret mode is slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import kda as kda_ops
from dayzero.kernels.kda import pallas as kda_pallas
from dayzero.kernels.kda import reference as kda_ref
from test_kernels_reference import _hf_kda, assert_close, hf_chunk_kda, hf_recurrent_kda, kda_inputs, run_kda
from tiny_decode_cases import jitted_prefill, prefilled_decode
from triton_lowering import count_triton_kernels

F32 = 2e-5  # interpret mode computes in float32 throughout


# Prefill kernel 1 variants (KdaTuning.intra_variant); the split one over 16-channel slices so that its channel loops
# run more than once at the tests' head dims, with bf16 products for bf16 inputs (f32 inputs keep f32 products);
# "split" has the default three pair levels per pass, "split_levels_apart" one level per pass and a 16-channel
# first pass.
TUNINGS = {"fused": kda_pallas.KdaTuning(intra_variant="fused"),
           "split": kda_pallas.KdaTuning(intra_variant="split", intra_block_k=16, intra_bf16_dots=True),
           "split_levels_apart": kda_pallas.KdaTuning(intra_variant="split", intra_block_k=16, intra_bf16_dots=True,
                                                      intra_level_group=1, intra_prologue_block_k=16)}
variants = pytest.mark.parametrize("variant", list(TUNINGS))
default_variant = pytest.mark.parametrize("variant", ["split"])  # the default; the others are checked above


def _chunk(inputs, dtype=jnp.float32, variant="split", **kwargs):
    return run_kda(kda_pallas.chunk_kda, inputs, dtype=dtype, interpret=True, tuning=TUNINGS[variant], **kwargs)


def _recurrent(inputs, dtype=jnp.float32, **kwargs):
    return run_kda(kda_pallas.fused_recurrent_kda, inputs, dtype=dtype, interpret=True, **kwargs)


# Interpret mode compiles one program per shape and flag set (tens of seconds on 2 cores), so the tests share a
# few: STD (ragged length, K != V, l2norm, initial state), RAGGED (head dims padded to powers of two, rows of
# unequal lengths, chunk states) and a bf16 one (l2norm off).
STD = dict(B=2, T=77, H=2, K=32, V=16)


def _std_inputs(seed, **kwargs):
    return kda_inputs(seed, STD["B"], STD["T"], STD["H"], STD["K"], STD["V"], l2norm=True, init=True, **kwargs)


@variants
def test_chunk_kernel_matches_reference_and_transformers(seed, variant):
    inputs = _std_inputs(seed, g_max=2.0)
    o, s = _chunk(inputs, variant=variant, l2norm=True)
    o_ref, s_ref = run_kda(kda_ref.chunk_kda, inputs, l2norm=True)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert_close(o, o_ref, F32, "pallas chunk output", seed)
    assert_close(s, s_ref, F32, "pallas chunk state", seed)
    hf_o, hf_s = _hf_kda(hf_chunk_kda, inputs, True)
    assert_close(o, hf_o, 1e-4, "pallas chunk vs transformers output", seed)
    assert_close(s, hf_s, 1e-4, "pallas chunk vs transformers state", seed)


@variants
def test_strong_decay(seed, variant):
    """Log-decays of -8 per step and -50 on a third of the channels: finite, same as the recurrence."""
    inputs = _std_inputs(seed, g_max=8.0, g_extreme=-50.0)
    hf_o, hf_s = _hf_kda(hf_recurrent_kda, inputs, True)
    o, s = _chunk(inputs, variant=variant, l2norm=True)
    assert_close(o, hf_o, 3e-4, "strong decay output vs transformers recurrent", seed)
    assert_close(s, hf_s, 3e-4, "strong decay state vs transformers recurrent", seed)


@default_variant
def test_unequal_lengths_padded_dims_and_chunk_states(seed, variant):
    """Rows of different lengths in one call equal each row run alone (head dims 24 / 20 padded inside); states
    after each chunk equal the recurrence's state at that boundary; outputs past a row's length are zero."""
    B, T, H, K, V = 3, 150, 2, 24, 20
    inputs = kda_inputs(seed, B, T, H, K, V, g_max=1.0, l2norm=True, init=True)
    lengths = np.array([150, 64, 97], np.int32)
    o, s, states = _chunk(inputs, variant=variant, l2norm=True, lengths=jnp.asarray(lengths),
                          output_chunk_states=True)
    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V) and states.shape == (B, 3, H, K, V)
    ref = run_kda(kda_ref.chunk_kda, inputs, l2norm=True, lengths=jnp.asarray(lengths), output_chunk_states=True)
    for got, want, what in zip((o, s, states), ref, ("output", "final states", "chunk states")):
        assert_close(got, want, F32, f"{what} vs the reference with lengths", seed)
    for b, n in enumerate(lengths):
        assert not np.any(np.asarray(o[b, n:])), f"row {b}: nonzero output past its length (seed={seed})"
    q, k, v, g, beta, s0 = inputs  # one row run alone, by the token-by-token recurrence
    b, n = 2, lengths[2]
    row = tuple(x[b:b + 1, :n] for x in (q, k, v, g, beta)) + (s0[b:b + 1],)
    o_b, s_b = run_kda(kda_ref.fused_recurrent_kda, row, l2norm=True)
    assert_close(o[b:b + 1, :n], o_b, F32, f"row {b} output vs the row alone", seed)
    assert_close(s[b:b + 1], s_b, F32, f"row {b} final state vs the row alone", seed)
    assert_close(states[b:b + 1, 1], s_b, F32, f"row {b} state after its last chunk", seed)
    assert_close(states[1:2, 1], s[1:2], F32, "a row ending on a chunk boundary keeps its state", seed)


@pytest.mark.parametrize("T,K,V", [(1, 16, 32), (3, 24, 16)])
def test_recurrent_kernel_matches_reference(seed, T, K, V):
    inputs = kda_inputs(seed, 3, T, 2, K, V, g_max=3.0, l2norm=True, init=True)
    lengths = jnp.array([T, max(T - 1, 0), T], jnp.int32)
    o, s = _recurrent(inputs, l2norm=True, lengths=lengths)
    o_ref, s_ref = run_kda(kda_ref.fused_recurrent_kda, inputs, l2norm=True, lengths=lengths)
    assert_close(o, o_ref, F32, "pallas recurrent output", seed)
    assert_close(s, s_ref, F32, "pallas recurrent state", seed)
    hf_o, hf_s = _hf_kda(hf_recurrent_kda, inputs, True)
    assert_close(o[0], hf_o[0], 1e-4, "pallas recurrent vs transformers", seed)


def test_chunk_equals_recurrent_kernel(seed):
    inputs = _std_inputs(seed, g_max=2.0)
    o_c, s_c = _chunk(inputs, l2norm=True)
    o_r, s_r = _recurrent(inputs, l2norm=True)
    assert_close(o_c, o_r, F32, "chunk vs recurrent kernel output", seed)
    assert_close(s_c, s_r, F32, "chunk vs recurrent kernel state", seed)


@pytest.mark.parametrize("K,V,v_fastest", [(16, 32, True), (16, 32, False), (12, 20, True)])  # in place; fallback
def test_slots_update_pool_in_place(seed, K, V, v_fastest):
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, _ = kda_inputs(seed, 3, 2, 2, K, V, g_max=2.0, l2norm=True)
    pool = jnp.asarray(rng.standard_normal((2, 6, 2, K, V)), jnp.float32)
    slots = jnp.asarray(rng.permutation(np.arange(1, 6))[:3], jnp.int32)
    args = [jnp.asarray(x) for x in (q, k, v, g, beta)]
    o_ref, pool_ref = kda_ref.fused_recurrent_kda_slots(*args, pool, slots, layer=1, use_qk_l2norm_in_kernel=True)
    if not v_fastest:  # the other launch order (rows side by side), two V blocks per head, output after the update
        tuning = kda_pallas.KdaTuning(decode_v_fastest=False, decode_block_v=16, decode_output_before_update=False)
        o, new_pool = kda_pallas.fused_recurrent_kda_slots(*args, pool, slots, layer=1, use_qk_l2norm_in_kernel=True,
                                                          interpret=True, tuning=tuning)
    else:
        o, new_pool = kda_ops.fused_recurrent_kda_slots(*args, pool, slots, layer=1, use_qk_l2norm_in_kernel=True,
                                                       impl="interpret")
    assert_close(o, o_ref, F32, "slots output", seed)
    assert_close(new_pool, pool_ref, F32, "slots pool", seed)
    untouched = np.setdiff1d(np.arange(6), np.asarray(slots))
    assert np.array_equal(np.asarray(new_pool[1, untouched]), np.asarray(pool[1, untouched]))
    assert np.array_equal(np.asarray(new_pool[0]), np.asarray(pool[0]))
    assert not np.allclose(np.asarray(new_pool[1, slots]), np.asarray(pool[1, slots]))


@default_variant
def test_bf16_inputs_without_l2norm(seed, variant):
    """bf16 inputs (the fast path on GPU: bf16 dots, f32 state) stay within bf16 error of the f32 reference on the
    same rounded inputs; keys normalised outside the kernel (l2norm off)."""
    inputs = kda_inputs(seed, 1, 96, 2, 32, 32, g_max=1.0, l2norm=False, init=True)
    rounded = tuple(np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in inputs[:5]) + (inputs[5],)
    o, s = _chunk(rounded, dtype=jnp.bfloat16, variant=variant)
    o_ref, s_ref = run_kda(kda_ref.chunk_kda, rounded)
    assert o.dtype == jnp.bfloat16
    assert_close(o, o_ref, 2e-2, "bf16 chunk output", seed)
    assert_close(s, s_ref, 2e-2, "bf16 chunk state", seed)


def _shapes(B, T, H, K, V, dtype=jnp.bfloat16):
    S = jax.ShapeDtypeStruct
    return (S((B, T, H, K), dtype), S((B, T, H, K), dtype), S((B, T, H, V), dtype), S((B, T, H, K), jnp.float32),
            S((B, T, H), dtype))


@pytest.mark.parametrize("shape", [(1, 8192, 32, 128, 128), (2, 77, 3, 24, 20)])
def test_kernels_lower_to_triton(shape):
    """Every KDA kernel goes through Pallas' Triton lowering for CUDA (no GPU needed to lower): each variant of
    prefill kernel 1 at several channel slices, and both launch orders of the decode kernels."""
    B, T, H, K, V = shape
    args = _shapes(B, T, H, K, V)
    state = jax.ShapeDtypeStruct((B, H, K, V), jnp.float32)

    def chunk(q, k, v, g, beta, h0, tuning):
        return kda_pallas.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, output_chunk_states=True, tuning=tuning)

    def recurrent(q, k, v, g, beta, h0, tuning):
        return kda_pallas.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              tuning=tuning)

    for tuning, kernels in ((kda_pallas.KdaTuning(intra_variant="fused"), 2),
                            (kda_pallas.KdaTuning(intra_variant="split"), 3),
                            (kda_pallas.KdaTuning(intra_variant="split", intra_block_k=64, intra_bf16_dots=True), 3),
                            (TUNINGS["split"], 3),
                            (kda_pallas.KdaTuning(wy_inverse="ieee", wy_warps=4), 3)):  # kernel 1b's two inverses
        assert count_triton_kernels(lambda *a: chunk(*a, tuning), *args, state) == kernels, tuning
    for v_fastest in (False, True):
        tuning = kda_pallas.KdaTuning(decode_v_fastest=v_fastest)
        assert count_triton_kernels(lambda *a: recurrent(*a, tuning=tuning), *_shapes(B, 1, H, K, V), state) == 1
        if kda_pallas.slots_supported((K, V)):
            pool = jax.ShapeDtypeStruct((3, B + 1, H, K, V), jnp.float32)
            slots = jax.ShapeDtypeStruct((B,), jnp.int32)
            slot_fn = lambda *a: kda_pallas.fused_recurrent_kda_slots(*a, layer=2, tuning=tuning)
            assert count_triton_kernels(slot_fn, *_shapes(B, 1, H, K, V), pool, slots) == 1


def test_bad_tunings_are_named():
    """A KdaTuning the kernels cannot run says which field is wrong (the check runs before any kernel)."""
    q = jnp.zeros((1, 64, 1, 32), jnp.bfloat16)
    v, g, beta = q, q.astype(jnp.float32), jnp.zeros((1, 64, 1), jnp.bfloat16)
    for bad, field in ((kda_pallas.KdaTuning(wy_inverse="fp8"), "wy_inverse"),
                       (kda_pallas.KdaTuning(intra_level_group=7), "intra_level_group")):
        with pytest.raises(ValueError, match=field):
            kda_pallas.chunk_kda(q, q, v, g, beta, interpret=True, tuning=bad)


def decode_layer_inputs(seed, batch, heads, head_dim, width=4, layers=2, slots_total=6, dtype=jnp.bfloat16,
                        padding_row=True):
    """decode_layer.decode_step's arguments: random activations, weights and caches; row 0 a padding row on the
    scratch slot 0 (with `padding_row`), the others on distinct slots."""
    rng = np.random.default_rng(seed)
    dim, rank = heads * head_dim, head_dim
    arr = lambda shape, scale=1.0, dt=dtype: jnp.asarray(rng.standard_normal(shape) * scale, dt)
    pad = int(padding_row)
    slots = jnp.asarray(np.concatenate([[0] * pad, rng.permutation(np.arange(1, slots_total))[:batch - pad]]),
                        jnp.int32)
    lengths = jnp.asarray([0] * pad + [1] * (batch - pad), jnp.int32)
    return (arr((batch, 3 * dim)), arr((batch, 2 * rank + heads)), tuple(arr((dim, width), 0.5) for _ in range(3)),
            arr((rank, dim), 0.3), jnp.asarray(np.log(rng.uniform(1, 16, heads)), jnp.float32),
            arr((dim,), 0.5, jnp.float32), arr((rank, dim), 0.3),
            jnp.asarray(1 + 0.1 * rng.standard_normal(head_dim), dtype),
            arr((layers, slots_total, 3, dim, width - 1)), arr((layers, slots_total, heads, head_dim, head_dim), 0.1,
                                                                jnp.float32), slots, lengths)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("batch,heads,width", [(3, 2, 4), (2, 1, 2)])
def test_decode_layer_matches_reference(seed, lower_bound, batch, heads, width):
    """The one-kernel KDA decode step (interpret mode): equal to the jnp reference with the conv in float32, as the
    kernel computes it (to float32 rounding); within bf16 rounding of the model's own conv arithmetic; the padding
    row's slot untouched; the other layer's and slots' caches untouched."""
    from dayzero.kernels.kda import decode_layer

    args = decode_layer_inputs(seed, batch, heads, 16, width)
    conv, pool, slots = args[8], args[9], args[10]
    options = dict(layer=1, eps=1e-5, lower_bound=lower_bound)
    got = decode_layer.decode_step(*args, **options, interpret=True)
    same = decode_layer.reference(*args, **options, conv_dtype=jnp.float32)
    model = decode_layer.reference(*args, **options)
    assert got[0].shape == (batch, heads * 16) and got[0].dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(got[1], np.float32), np.asarray(same[1], np.float32))  # the shifted conv inputs
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(same[2]), rtol=1e-5, atol=1e-6)
    assert _rel_err(got[0], same[0]) < 1e-2  # bf16 outputs: an occasional one-step rounding difference
    # the model's conv rounds every product and sum to bf16: where its taps nearly cancel, a conv output moves by
    # more than a bf16 step, and a 16-channel head's normed output feels it (a loose bound against gross errors: the
    # kernel's own arithmetic is checked above). Over 600 seeds the outputs differed by at most 0.042; seed
    # 4052919476 (2 rows, 1 head, width 2) by 0.165, with the kernel equal to the float32-conv reference bit for bit.
    assert _rel_err(got[0], model[0]) < 0.3 and _rel_err(got[2], model[2]) < 5e-2
    untouched = np.ones(pool.shape[:2], bool)
    untouched[1, np.asarray(slots[1:])] = False
    assert np.array_equal(np.asarray(got[2])[untouched], np.asarray(pool)[untouched])
    assert np.array_equal(np.asarray(got[1], np.float32)[untouched], np.asarray(conv, np.float32)[untouched])
    assert np.all(np.asarray(got[0][0], np.float32) == 0)  # the padding row outputs zeros


@pytest.mark.parametrize("head_dim,split", [(32, 2), (64, 4)])
def test_decode_layer_value_split(seed, head_dim, split):
    """`decode_step(value_split=P)` (interpret mode): each head as P programs of value columns gives the unsplit
    step's caches exactly and its output as `projection.HeadScaled` rows whose finished form is the unsplit output
    (to bf16 rounding: the same float32 terms in another order); a split below 16 columns is refused by name."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer

    args = decode_layer_inputs(seed, 3, 2, head_dim)
    options = dict(layer=1, eps=1e-5, lower_bound=-5.0, interpret=True)
    one = decode_layer.decode_step(*args, **options)
    got = decode_layer.decode_step(*args, **options, value_split=split)
    assert isinstance(got[0], projection.HeadScaled) and got[0].parts == split and got[0].head_dim == head_dim
    assert got[0].values.shape == (3, 2 * head_dim) and got[0].squares.shape == (3, 2 * split)
    assert np.array_equal(np.asarray(got[1], np.float32), np.asarray(one[1], np.float32))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(one[2]), rtol=1e-6, atol=1e-6)
    finished = projection.finished(got[0])
    assert finished.dtype == one[0].dtype and _rel_err(finished, one[0]) < 4e-3
    assert np.all(np.asarray(finished[0], np.float32) == 0)  # the padding row outputs zeros
    with pytest.raises(ValueError, match="value_split"):
        decode_layer.decode_step(*args, **options, value_split=head_dim // 8)
    # each head's last block shifting q's and k's conv inputs in place (turn counters): the same results, the
    # counters left at zero; counters too few for the rows are refused by name
    turns = jnp.zeros((2, 3, 2), jnp.int32)
    counted = decode_layer.decode_step(*args, **options, value_split=split, turns=turns)
    assert len(counted) == 4 and not np.any(np.asarray(counted[3]))
    for c, g in zip(jax.tree.leaves(counted[:3]), jax.tree.leaves(got)):
        assert np.array_equal(np.asarray(c, np.float32), np.asarray(g, np.float32))
    with pytest.raises(ValueError, match="turns"):
        decode_layer.decode_step(*args, **options, value_split=split, turns=turns[:, :2])


@pytest.mark.parametrize("head_dim,split", [(16, 1), (64, 4)])
def test_decode_layer_load_order_and_low_rank_dots(seed, head_dim, split):
    """`decode_step(hoist_loads=True)` (interpret mode, unsplit and split with turn counters): the same results bit
    for bit (only where the loads are issued moves); `low_rank_dot=True`: the conv cache bit for bit, the states and
    output within float32 / bf16 rounding of the FMA form (f_a @ f_b and g_a @ g_b summed in another order, then
    rounded to bf16 as before)."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer

    args = decode_layer_inputs(seed, 3, 2, head_dim)
    options = dict(layer=1, eps=1e-5, lower_bound=-5.0, interpret=True, value_split=split)
    if split > 1:
        options["turns"] = jnp.zeros((2, 3, 2), jnp.int32)
    base = decode_layer.decode_step(*args, **options, hoist_loads=False)
    hoisted = decode_layer.decode_step(*args, **options, hoist_loads=True)
    for want, got in zip(jax.tree.leaves(base), jax.tree.leaves(hoisted)):
        assert np.array_equal(np.asarray(want, np.float32), np.asarray(got, np.float32))
    for dots in (decode_layer.decode_step(*args, **options, low_rank_dot=True, hoist_loads=False),
                 decode_layer.decode_step(*args, **options, low_rank_dot=True, hoist_loads=True)):
        assert np.array_equal(np.asarray(dots[1], np.float32), np.asarray(base[1], np.float32))
        assert _rel_err(dots[2], base[2]) < 1e-3
        assert _rel_err(projection.finished(dots[0]), projection.finished(base[0])) < 1e-2


def head_scaled_o_proj(head_scaled, w) -> np.ndarray:
    """float64 [M, D]: o_proj's weight w [K, D] times `projection.HeadScaled` rows scaled by their heads' 1 / rms, not
    rounded (what `decode_step(o_weight=)` computes)."""
    scaled = np.asarray(head_scaled.values, np.float64) * np.asarray(head_scaled.scales(), np.float64)
    return scaled @ np.asarray(w, np.float64)


@pytest.mark.parametrize("head_dim,split,hidden", [(32, 2, 48), (64, 4, 128)])
def test_decode_layer_runs_o_proj(seed, head_dim, split, hidden):
    """`decode_step(o_weight=)` (interpret mode, each head's blocks counted by the turn counters): the caches of the
    step without it bit for bit, o_proj's output as one `projection.Partials` slice per head whose sum is o_proj
    of the step's `HeadScaled` output (within bf16 rounding: that path rounds the scaled values before the product,
    this one multiplies them unrounded; checked also against float64), the counters left at zero; a weight of
    the wrong shape or without turns refused by name."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer

    heads, batch = 2, 3
    args = decode_layer_inputs(seed, batch, heads, head_dim)
    options = dict(layer=1, eps=1e-5, lower_bound=-5.0, interpret=True, value_split=split)
    rng = np.random.default_rng(seed + 1)
    w = jnp.asarray(rng.standard_normal((heads * head_dim, hidden)) * 0.05, jnp.bfloat16)
    turns = jnp.zeros((2, batch, heads), jnp.int32)
    plain = decode_layer.decode_step(*args, **options, turns=turns)
    got = decode_layer.decode_step(*args, **options, turns=turns, o_weight=w)
    assert len(got) == 4 and not np.any(np.asarray(got[3]))
    for g, p in zip(got[1:3], plain[1:3]):
        assert np.array_equal(np.asarray(g, np.float32), np.asarray(p, np.float32))
    sums = got[0]
    assert isinstance(sums, projection.Partials) and sums.squares is None
    assert sums.sums.shape == (heads, batch, hidden) and sums.sums.dtype == jnp.float32
    out = projection.finished(sums)
    assert out.dtype == jnp.bfloat16
    want = projection.reference(plain[0], ((w,),))[0]
    assert _rel_err(out, want) < 1e-2
    np.testing.assert_allclose(np.asarray(jnp.sum(sums.sums, axis=0)), head_scaled_o_proj(plain[0], w), rtol=1e-4,
                               atol=1e-4)
    assert np.all(np.asarray(sums.sums[:, 0]) == 0)  # the padding row
    with pytest.raises(ValueError, match="o_weight"):
        decode_layer.decode_step(*args, **options, o_weight=w)  # no turn counters
    with pytest.raises(ValueError, match="o_weight"):
        decode_layer.decode_step(*args, **options, turns=turns, o_weight=w[1:])


@pytest.mark.parametrize("split", [1, 2])
def test_decode_layer_takes_low_rank_ups(seed, split):
    """`decode_step(low_rank_ups=)` with f_a @ f_b and g_a @ g_b made by `low_rank_ups` (interpret mode): the
    caches and output of the step that multiplies by f_b and g_b itself (the states to float32 rounding, the output
    to bf16 rounding), and the reference's; from the six projections side by side the same products; wrong shapes
    refused by name."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer

    args = decode_layer_inputs(seed, 4, 2, 32)
    options = dict(layer=1, eps=1e-5, lower_bound=-5.0, interpret=True, value_split=split)
    ups = decode_layer.low_rank_ups(args[1], args[3], args[6])
    assert all(u.shape == (4, 64) and u.dtype == jnp.bfloat16 for u in ups)
    own = decode_layer.decode_step(*args, **options)
    got = decode_layer.decode_step(*args, **options, low_rank_ups=ups)
    ref = decode_layer.reference(*args, layer=1, eps=1e-5, lower_bound=-5.0, conv_dtype=jnp.float32)
    assert np.array_equal(np.asarray(got[1], np.float32), np.asarray(own[1], np.float32))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(own[2]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(ref[2]), rtol=1e-4, atol=1e-5)
    outs = [projection.finished(o) for o in (got[0], own[0])]
    assert _rel_err(outs[0], outs[1]) < 1e-2 and _rel_err(outs[0], ref[0]) < 1e-2
    both = jnp.concatenate(args[:2], axis=1)
    for a, b in zip(decode_layer.low_rank_ups(both, args[3], args[6], after_qkv=True), ups):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="low_rank_ups"):
        decode_layer.decode_step(*args, **options, low_rank_ups=(ups[0][:3], ups[1]))


@pytest.mark.parametrize("partials", [False, True])
def test_decode_layer_takes_the_six_projections_side_by_side(seed, partials):
    """`decode_step(qkv, None, ...)` with q|k|v|f_a|g_a|b as one array (or one `projection.Partials`, as the model's
    single projection group gives them): exactly the results of the two separate inputs; a width that does not fit
    is refused by name."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer

    rng = np.random.default_rng(seed)
    args = decode_layer_inputs(seed, 3, 2, 16)
    qkv, fgb = args[:2]
    both = jnp.concatenate([qkv, fgb], axis=1)
    if partials:
        both = _as_partials(both, rng, 4)
        qkv, fgb = (projection.Partials(both.sums[..., cols], both.squares, both.k_dim, both.eps, both.dtype)
                    for cols in (slice(0, qkv.shape[1]), slice(qkv.shape[1], None)))
    options = dict(layer=1, eps=1e-5, lower_bound=None, interpret=True)
    apart = decode_layer.decode_step(qkv, fgb, *args[2:], **options)
    joined = decode_layer.decode_step(both, None, *args[2:], **options)
    for a, j in zip(apart, joined):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(j, np.float32))
    ref = decode_layer.reference(both, None, *args[2:], layer=1, eps=1e-5, lower_bound=None, conv_dtype=jnp.float32)
    assert _rel_err(joined[0], ref[0]) < 1e-2
    with pytest.raises(ValueError, match="q\\|k\\|v\\|f_a"):
        decode_layer.decode_step(qkv if not partials else projection.finished(qkv), None, *args[2:], **options)


def _as_partials(projected, rng, slices, k_dim=256, eps=1e-6, norm=True):
    """Float32 split-K sums (and squares) whose `projection.finished` is near `projected` [B, N]: the rows'
    values cut into `slices` random parts, times the rms the squares give (so the norm's scale undoes it)."""
    from dayzero.kernels import projection

    batch = projected.shape[0]
    parts = rng.dirichlet(np.ones(slices), size=projected.shape).transpose(2, 0, 1)  # [S, B, N], sums to 1
    squares = rng.uniform(0.5, 2.0, (slices, batch)) * k_dim / slices if norm else None
    rms = np.sqrt(squares.sum(0) / k_dim + eps) if norm else np.ones(batch)
    sums = parts * np.asarray(projected, np.float64)[None] * rms[None, :, None]
    return projection.Partials(jnp.asarray(sums, jnp.float32), None if squares is None else
                               jnp.asarray(squares, jnp.float32), k_dim, eps, "bfloat16")


@pytest.mark.parametrize("slices,norm", [(4, True), (2, False)])
def test_decode_layer_adds_up_projection_partials(seed, slices, norm):
    """decode_step given q|k|v and f_a|g_a|b as `projection.Partials` (the projection kernel's split-K sums, with
    and without the norm's squares; interpret mode): the same as given the arrays `projection.finished` makes of
    them, to one bf16 step of the summation order (the kernel adds each column's slices itself)."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer

    rng = np.random.default_rng(seed)
    args = decode_layer_inputs(seed, 3, 2, 16)
    qkv, fgb = (_as_partials(a, rng, slices, norm=norm) for a in args[:2])
    finished = (projection.finished(qkv), projection.finished(fgb))
    assert _rel_err(finished[0], args[0]) < 1e-2  # the partials do stand for those activations
    options = dict(layer=1, eps=1e-5, lower_bound=None, interpret=True)
    got = decode_layer.decode_step(qkv, fgb, *args[2:], **options)
    want = decode_layer.decode_step(*finished, *args[2:], **options)
    # the partial sums fetched first and finished where used (`hoist_loads`), or finished where fetched: bit for bit
    where_used = decode_layer.decode_step(qkv, fgb, *args[2:], **options, hoist_loads=False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(where_used)):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert got[0].shape == want[0].shape and got[0].dtype == want[0].dtype
    assert _rel_err(got[0], want[0]) < 1e-2
    assert _rel_err(got[1], want[1]) < 1e-2 and _rel_err(got[2], want[2]) < 1e-3
    ref = decode_layer.reference(qkv, fgb, *args[2:], layer=1, eps=1e-5, lower_bound=None, conv_dtype=jnp.float32)
    assert _rel_err(got[0], ref[0]) < 1e-2


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_decode_layer_lowers_to_triton():
    """At the medium hybrid's KDA layer (16 heads x 128, conv 4) for 1 and 16 rows: one Triton kernel."""
    from dayzero.kernels.kda import decode_layer

    spec = jax.ShapeDtypeStruct
    for batch in (1, 16):
        args = jax.tree.map(lambda a: spec(a.shape, a.dtype),
                            decode_layer_inputs(0, batch, 16, 128, slots_total=20, padding_row=False))
        fn = lambda *a: decode_layer.decode_step(*a, layer=1, eps=1e-5, lower_bound=None)
        assert count_triton_kernels(fn, *args) == 1
    # q|k|v and f_a|g_a|b as the projection kernel's 8-slice partial sums with the norm's squares
    from dayzero.kernels import projection

    def with_partials(qkv_sums, fgb_sums, squares, *rest):
        parts = [projection.Partials(x, squares, 2048, 1e-6, "bfloat16") for x in (qkv_sums, fgb_sums)]
        return decode_layer.decode_step(*parts, *rest, layer=1, eps=1e-5, lower_bound=None)

    args = jax.tree.map(lambda a: spec(a.shape, a.dtype),
                        decode_layer_inputs(0, 1, 16, 128, slots_total=20, padding_row=False))
    sums = [spec((8,) + a.shape, jnp.float32) for a in args[:2]]
    assert count_triton_kernels(with_partials, *sums, spec((8, 1), jnp.float32), *args[2:]) == 1
    split = lambda *a: decode_layer.decode_step(*a, layer=1, eps=1e-5, lower_bound=None, value_split=4)
    assert count_triton_kernels(split, *args) == 1
    ups = (spec((1, 2048), jnp.bfloat16),) * 2
    given = lambda u, v, *a: decode_layer.decode_step(*a, layer=1, eps=1e-5, lower_bound=None, low_rank_ups=(u, v))
    assert count_triton_kernels(given, *ups, *args) == 1
    # the six projections side by side, as the model passes them (one array, or one group's partial sums)
    joined = lambda q, *a: decode_layer.decode_step(q, None, *a, layer=1, eps=1e-5, lower_bound=None, value_split=8)
    six = 3 * 2048 + 2 * 128 + 16
    assert count_triton_kernels(joined, spec((1, six), jnp.bfloat16), *args[2:]) == 1
    joined_parts = lambda sums, squares, *a: joined(projection.Partials(sums, squares, 2048, 1e-6, "bfloat16"), *a)
    assert count_triton_kernels(joined_parts, spec((8, 1, six), jnp.float32), spec((8, 1), jnp.float32),
                                *args[2:]) == 1
    # the head's last block shifting q's and k's conv inputs (turn counters, no scatter after the kernel)
    counted = lambda turns, *a: decode_layer.decode_step(*a, layer=1, eps=1e-5, lower_bound=None, value_split=8,
                                                         turns=turns)
    assert count_triton_kernels(counted, spec((2, 2, 16), jnp.int32), *args) == 1
    # and o_proj in the same kernel (its rows asked into L2 where the lowering has the prefetch)
    in_step = lambda turns, w, *a: decode_layer.decode_step(*a, layer=1, eps=1e-5, lower_bound=None, value_split=8,
                                                            turns=turns, o_weight=w)
    assert count_triton_kernels(in_step, spec((2, 2, 16), jnp.int32), spec((2048, 2048), jnp.bfloat16), *args) == 1


@pytest.mark.usefixtures("in_out_layout")
def test_model_decode_layer_path_equals_step(seed, monkeypatch):
    """KimiDeltaAttention at decode: the one-kernel path (`decode_in_place`, interpret mode; the input norm, the
    projections and the residual add by XLA, then by `kernels.projection` in interpret mode) against the layer's
    norm, `step`'s ops on the gathered states (the CPU's reference kernels) and the residual add, in bf16; then the
    whole decoder's cached decode step (the layer input and norm weight passed in, the residual added inside), both
    ways, gives the same next tokens' logits to bf16 rounding."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer
    from dayzero.model import Model
    from dayzero.model.cache import init_cache
    from dayzero.model import kda as kda_model
    from dayzero.model.kda import KimiDeltaAttention
    from dayzero.model.norms import RMSNorm
    from dayzero.model.presets import tiny

    cfg = tiny().replace(kda_num_heads=16, kda_head_dim=16)  # every projection width a multiple of 16
    rng = np.random.default_rng(seed)
    batch, slots_total, layer = 4, 5, 1
    widths = (cfg.kda_dim,) * 3 + (cfg.kda_head_dim,) * 2 + (cfg.kda_num_heads,)
    assert projection.choose(batch, cfg.hidden_size, widths, impl="interpret") == "interpret"
    assert projection.choose(batch, cfg.kda_dim, (cfg.hidden_size,), impl="interpret") == "interpret"
    attn = KimiDeltaAttention(cfg, jnp.bfloat16)
    # x small beside the attention's output, so that got - x keeps it to bf16 rounding (the norm undoes the scale)
    x = jnp.asarray(rng.standard_normal((batch, 1, cfg.hidden_size)) * 0.02, jnp.bfloat16)
    norm_weight = jnp.asarray(rng.uniform(0.5, 1.5, cfg.hidden_size), jnp.float32)
    h = RMSNorm(cfg.rms_norm_eps).apply({"params": {"weight": norm_weight}}, x)
    params = attn.init(jax.random.key(seed % 1000), x)
    conv = jnp.asarray(rng.standard_normal((2, slots_total, 3, cfg.kda_dim, cfg.kda_conv_size - 1)), jnp.bfloat16)
    pool = jnp.asarray(rng.standard_normal((2, slots_total, cfg.kda_num_heads, 16, 16)) * 0.1, jnp.float32)
    slots, valid = jnp.asarray([4, 0, 2, 3], jnp.int32), jnp.asarray([[True], [False], [True], [True]])
    assert attn.apply(params, x, method="decode_layer_kind") == "reference"  # the CPU's default
    out, conv_rows, want_pool = attn.apply(params, h, valid, conv[layer, slots], pool, slots, layer, True,
                                           method="step")
    want_conv = conv.at[layer, slots].set(conv_rows)
    monkeypatch.setattr(decode_layer, "choose", lambda impl=None: "interpret")
    assert attn.apply(params, x, method="decode_layer_kind") == "interpret"
    chosen, project = projection.choose, projection.project
    live = np.asarray(valid[:, 0])
    for projections in ("reference", "interpret"):
        monkeypatch.setattr(projection, "choose", lambda *a, impl=None, p=projections: chosen(*a, impl=p))
        calls = []
        monkeypatch.setattr(projection, "project", lambda x, groups, **k: calls.append(
            ([w.shape[1] for g in groups for w in g], k.get("finish", True))) or project(x, groups, **k))
        got, got_conv, got_pool = attn.apply(params, x, norm_weight, valid, conv, pool, slots, layer,
                                             method="decode_in_place")
        finish = not kda_model.PROJECTION_PARTIALS
        assert calls == ([] if projections == "reference" else [(list(widths), finish), ([cfg.hidden_size], True)])
        assert _rel_err(got[live] - x[live], out[live]) < 3e-2, projections
        assert _rel_err(got_pool, want_pool) < 3e-2, projections
        if projections == "reference":  # the same projections: the same bf16 conv inputs
            assert np.array_equal(np.asarray(got_conv, np.float32), np.asarray(want_conv, np.float32))
        else:  # the kernel's norm rounds differently; the padding row's slot stays as it was
            assert _rel_err(got_conv, want_conv) < 2e-2
            assert np.array_equal(np.asarray(got_conv[layer, slots[1]]), np.asarray(conv[layer, slots[1]]))
    monkeypatch.setattr(projection, "choose", chosen)  # the decoder's wiring with XLA's projections (CPU's default)

    model = Model.random(cfg, dtype="bfloat16", seed=seed % 1000)
    cache = init_cache(cfg, num_blocks=4, num_slots=3, dtype=jnp.bfloat16)
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 5)), jnp.int32)
    tables, rows = jnp.asarray([[1], [2]], jnp.int32), jnp.asarray([1, 2], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    step = lambda *a, **k: model.module.apply({"params": model.params}, *a, method="step", **k)
    cache = jitted_prefill(model, ids, positions, jnp.ones((2, 5), bool), cache, tables, rows)
    token, at = ids[:, :1], jnp.full((2, 1), 5)
    fused, _ = step(token, at, jnp.ones((2, 1), bool), cache, tables, rows, decode=True)
    monkeypatch.setattr(decode_layer, "choose", lambda impl=None: "reference")
    plain, _ = step(token, at, jnp.ones((2, 1), bool), cache, tables, rows, decode=True)
    assert _rel_err(fused, plain) < 3e-2


@pytest.mark.usefixtures("in_out_layout")
def test_model_decode_with_value_split(seed, monkeypatch):
    """KimiDeltaAttention.decode_in_place with the step split over value blocks (`decode_layer.VALUE_SPLIT`, interpret
    mode) and o_proj through the projection kernel (interpret mode, finishing the heads' norm as it loads) or XLA:
    the unsplit path's output and caches to bf16 rounding; with the turn counters the same, and with o_proj in the
    step kernel (`O_PROJ_IN_STEP`) the same caches and the output to bf16 rounding."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer
    from dayzero.model import kda as kda_model
    from dayzero.model.kda import KimiDeltaAttention
    from dayzero.model.presets import tiny

    cfg = tiny().replace(kda_num_heads=16, kda_head_dim=32)
    rng = np.random.default_rng(seed)
    layer, slots_total = 1, 5
    attn = KimiDeltaAttention(cfg, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, 1, cfg.hidden_size)) * 0.02, jnp.bfloat16)
    norm_weight = jnp.asarray(rng.uniform(0.5, 1.5, cfg.hidden_size), jnp.float32)
    params = attn.init(jax.random.key(seed % 1000), x)
    conv = jnp.asarray(rng.standard_normal((2, slots_total, 3, cfg.kda_dim, cfg.kda_conv_size - 1)), jnp.bfloat16)
    pool = jnp.asarray(rng.standard_normal((2, slots_total, 16, 32, 32)) * 0.1, jnp.float32)
    slots, valid = jnp.asarray([3, 1], jnp.int32), jnp.ones((2, 1), bool)
    monkeypatch.setattr(decode_layer, "choose", lambda impl=None: "interpret")
    monkeypatch.setattr(decode_layer, "VALUE_SPLIT_MAX_ROWS", 2)
    chosen = projection.choose
    run = lambda: attn.apply(params, x, norm_weight, valid, conv, pool, slots, layer, method="decode_in_place")
    for projections in ("reference", "interpret"):
        monkeypatch.setattr(projection, "choose", lambda *a, impl=None, p=projections: chosen(*a, impl=p))
        monkeypatch.setattr(decode_layer, "VALUE_SPLIT", 1)
        want = run()
        monkeypatch.setattr(decode_layer, "VALUE_SPLIT", 4)  # 2 blocks per head for these 2 rows
        got = run()
        assert decode_layer.value_split(2, 32) == 2 and decode_layer.value_split(3, 32) == 1
        assert decode_layer.value_split(1, 32) == 2 and decode_layer.value_split(1, 16) == 1  # blocks >= 16
        assert _rel_err(got[0] - x, want[0] - x) < 1e-2, projections
        assert np.array_equal(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32))
        np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6, atol=1e-6)
        # with the cache's turn counters: q's and k's conv inputs shifted by each head's last block, no scatter
        turns = jnp.zeros((2, 2, 16), jnp.int32)
        counted = attn.apply(params, x, norm_weight, valid, conv, pool, slots, layer, turns=turns,
                             method="decode_in_place")
        assert len(counted) == 4 and not np.any(np.asarray(counted[3]))  # the counters left at zero
        for c, g in zip(counted[:3], got):
            assert np.array_equal(np.asarray(c, np.float32), np.asarray(g, np.float32))
        # o_proj in the step kernel (`O_PROJ_IN_STEP`): the same caches, the output to bf16 rounding; unfinished,
        # one partial sum per head for the front kernel
        monkeypatch.setattr(kda_model, "O_PROJ_IN_STEP", True)
        in_step = attn.apply(params, x, norm_weight, valid, conv, pool, slots, layer, turns=turns,
                             method="decode_in_place")
        (parts, rows), *_ = attn.apply(params, x, norm_weight, valid, conv, pool, slots, layer, turns=turns,
                                       unfinished=True, method="decode_in_place")
        monkeypatch.setattr(kda_model, "O_PROJ_IN_STEP", False)
        assert len(in_step) == 4 and not np.any(np.asarray(in_step[3]))
        assert _rel_err(in_step[0] - x, counted[0] - x) < 1e-2, projections
        for c, g in zip(in_step[1:3], counted[1:3]):
            assert np.array_equal(np.asarray(c, np.float32), np.asarray(g, np.float32))
        assert isinstance(parts, projection.Partials) and parts.sums.shape == (16, 2, cfg.hidden_size)
        assert np.array_equal(np.asarray(projection.finished(parts, residual=rows)), np.asarray(in_step[0][:, 0]))


@pytest.mark.parametrize("projections", ["reference", "interpret"])
def test_model_decode_with_projections_as_one(seed, monkeypatch, projections):
    """KimiDeltaAttention.decode_in_place with the six input projections as one output (`PROJECTIONS_AS_ONE`; the
    decode kernel in interpret mode, the projections by XLA or the projection kernel in interpret mode, K split):
    exactly the two-group results."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer
    from dayzero.model import kda as kda_model
    from dayzero.model.kda import KimiDeltaAttention
    from dayzero.model.presets import tiny

    cfg = tiny().replace(kda_num_heads=16, kda_head_dim=16)
    rng = np.random.default_rng(seed)
    attn = KimiDeltaAttention(cfg, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, 1, cfg.hidden_size)), jnp.bfloat16)
    norm_weight = jnp.asarray(rng.uniform(0.5, 1.5, cfg.hidden_size), jnp.float32)
    params = attn.init(jax.random.key(seed % 1000), x)
    conv = jnp.asarray(rng.standard_normal((2, 4, 3, cfg.kda_dim, cfg.kda_conv_size - 1)), jnp.bfloat16)
    pool = jnp.asarray(rng.standard_normal((2, 4, 16, 16, 16)) * 0.1, jnp.float32)
    slots, valid = jnp.asarray([3, 1], jnp.int32), jnp.ones((2, 1), bool)
    monkeypatch.setattr(decode_layer, "choose", lambda impl=None: "interpret")
    chosen = projection.choose
    monkeypatch.setattr(projection, "choose", lambda *a, impl=None: chosen(*a, impl=projections))
    run = lambda: attn.apply(params, x, norm_weight, valid, conv, pool, slots, 1, method="decode_in_place")
    monkeypatch.setattr(kda_model, "PROJECTIONS_AS_ONE", False)
    apart = run()
    monkeypatch.setattr(kda_model, "PROJECTIONS_AS_ONE", True)
    joined = run()
    for a, j in zip(apart, joined):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(j, np.float32)), projections


def test_decode_layer_names_what_it_does_not_take():
    """Head dims that are not powers of two >= 16, or float32 activations: a ValueError naming the layer's shape;
    `supported` says so first, and the model then keeps its separate ops."""
    from dayzero.kernels.kda import decode_layer

    assert decode_layer.supported(16, 128, 128, 128, 4, jnp.bfloat16)
    assert not decode_layer.supported(3, 8, 8, 8, 4, jnp.bfloat16)  # tiny's KDA heads
    assert not decode_layer.supported(2, 16, 16, 16, 4, jnp.float32)
    assert not decode_layer.supported(2, 16, 32, 16, 4, jnp.bfloat16)  # K != V
    args = decode_layer_inputs(0, 2, 2, 16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="heads 2 x 16.*float32"):
        decode_layer.decode_step(*args, layer=0, eps=1e-5, lower_bound=None, interpret=True)


def test_model_decode_of_sixteen_rows_with_low_rank_ups(seed, monkeypatch):
    """The decoder's cached decode step of 16 rows as the GPU runs it (the KDA decode kernel and the projection
    kernel in interpret mode; f_b's and g_b's products by XLA at 16 rows, `LOW_RANK_UPS_MIN_ROWS`) against the same
    step with the step kernel making those products itself, and against the XLA path: the next-token logits to
    bf16 rounding, the caches' KDA states likewise."""
    from dayzero.kernels import projection
    from dayzero.kernels.kda import decode_layer
    from dayzero.model.config import MLP_DENSE
    from dayzero.model.presets import tiny

    # dense MLPs only: a router choice that the paths' bf16 rounding moves at a near tie (seed 1489334257 moved one
    # row's logits by 8.5%) would say nothing of the KDA step
    cfg = tiny().replace(hidden_size=64, kda_num_heads=4, kda_head_dim=16, mlp_types=(MLP_DENSE,) * 4,
                         index_topk=0, q_lora_rank=32, kv_lora_rank=28, qk_rope_head_dim=4, num_heads=4,
                         v_head_dim=16)
    rows = 16
    step, args = prefilled_decode(cfg, seed, rows)
    plain, plain_cache = step(*args, decode=True)
    monkeypatch.setattr(decode_layer, "choose", lambda impl=None: "interpret")
    chosen = projection.choose
    monkeypatch.setattr(projection, "choose", lambda *a, impl=None: chosen(*a, impl="interpret"))
    ups_made = []
    made = decode_layer.low_rank_ups
    monkeypatch.setattr(decode_layer, "low_rank_ups", lambda *a, **k: ups_made.append(a[0].shape) or made(*a, **k))
    monkeypatch.setattr(decode_layer, "LOW_RANK_UPS_MIN_ROWS", 16)
    given, given_cache = step(*args, decode=True)
    assert len(ups_made) == sum(t == "kda" for t in cfg.layer_types) and ups_made[0][0] == rows
    monkeypatch.setattr(decode_layer, "LOW_RANK_UPS_MIN_ROWS", 0)
    own, own_cache = step(*args, decode=True)
    assert len(ups_made) == sum(t == "kda" for t in cfg.layer_types)
    for got in (given, own):
        assert _rel_err(got, plain) < 2e-2
    assert _rel_err(given, own) < 1e-2
    assert _rel_err(given_cache["state"], own_cache["state"]) < 1e-3
    assert _rel_err(given_cache["state"], plain_cache["state"]) < 2e-2
