"""The MoE front kernel (kernels/moe_front.py: residual add, post-attention norm, router logits) compiled for real
(Triton) on the GPU at the medium hybrid's shapes, against its XLA form; and the model's decode step with it
against the same step without it. Passing here is what lets `moe_front.GPU_VERIFIED` become True."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import moe_front, projection

pytestmark = pytest.mark.skipif(not any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices()),
                                reason="no GPU on this machine")


@pytest.mark.parametrize("slices,rows", [(8, 1), (4, 1), (0, 1), (8, 16), (8, 5)])
def test_front_matches_xla_on_gpu(slices, rows):
    """x and the normed rows within ~2 bf16 steps of the XLA form's (the partial sums' order of addition; XLA may
    also skip the norm's inner rounding: excess precision), logits within float32 rounding of a float64 product of
    the kernel's own normed rows."""
    key = jax.random.key(slices + rows)
    k = jax.random.split(key, 4)
    residual = jax.random.normal(k[0], (rows, 2048), jnp.bfloat16)
    update = None
    if slices:
        update = projection.Partials(jax.random.normal(k[1], (slices, rows, 2048), jnp.float32), None, 2048, 1e-6,
                                     "bfloat16")
    norm_weight = jax.random.uniform(k[2], (2048,), jnp.float32, 0.5, 1.5)
    router_weight = (jax.random.normal(k[3], (64, 2048)) * 0.02).astype(jnp.bfloat16)
    got = jax.jit(lambda *a: moe_front.front(*a, eps=1e-5))(update, residual, norm_weight, router_weight)
    want = jax.jit(lambda *a: moe_front.reference(*a, eps=1e-5))(update, residual, norm_weight, router_weight)
    for g, w in zip(got[:2], want[:2]):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.all(np.abs(g - w) <= np.abs(w) * 2.0 ** -6 + 1e-30)
    oracle = np.asarray(got[1], np.float64) @ np.asarray(router_weight, np.float64).T
    np.testing.assert_allclose(np.asarray(got[2], np.float64), oracle, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 16])
def test_front_packs_x_on_gpu(rows):
    """`front(pack=True)` at the medium hybrid's shapes: the kernel's words and factors for the MXFP4 decode kernels
    are bit for bit `packed_rows` of its own normed rows (`row_scaled_words` and a zero row)."""
    k = jax.random.split(jax.random.key(rows), 4)
    residual = jax.random.normal(k[0], (rows, 2048), jnp.bfloat16)
    update = projection.Partials(jax.random.normal(k[1], (8, rows, 2048), jnp.float32), None, 2048, 1e-6, "bfloat16")
    norm_weight = jax.random.uniform(k[2], (2048,), jnp.float32, 0.5, 1.5)
    router_weight = (jax.random.normal(k[3], (64, 2048)) * 0.02).astype(jnp.bfloat16)
    _, normed, _, (words, factors) = jax.jit(lambda *a: moe_front.front(*a, eps=1e-5, pack=True))(
        update, residual, norm_weight, router_weight)
    want_words, want_factors = jax.jit(moe_front.packed_rows)(normed)
    assert words.shape == (rows + 1, 64, 16)
    assert np.array_equal(np.asarray(words), np.asarray(want_words))
    assert np.array_equal(np.asarray(factors), np.asarray(want_factors))  # the zero row's factor written too
    assert np.asarray(words[:rows]).any() and not np.asarray(words[rows]).any()


@pytest.mark.parametrize("batch", [1, 16])
def test_model_decode_with_the_front_on_gpu(monkeypatch, batch):
    """The medium hybrid's decode step (batch 1 or 16, random weights) with the front kernel after every KDA layer's
    decode kernel and the MLA layer's decode projections (`decoder.FRONT_AFTER_MLA`) against the same step without
    it: next-token logits to bf16 rounding."""
    from dayzero.model import decoder
    from medium_prefix_cases import prefilled_medium_prefix

    run, args = prefilled_medium_prefix(9, num_blocks=batch + 2, batch=batch)
    monkeypatch.setattr(moe_front, "choose", lambda *a, impl=None: "reference")
    plain, _ = run(*args, decode=True)
    calls = []
    front = moe_front.front
    monkeypatch.setattr(moe_front, "choose", lambda *a, impl=None: "pallas")
    monkeypatch.setattr(moe_front, "front", lambda *a, **k: calls.append(1) or front(*a, **k))
    fused, _ = run(*args, decode=True)
    # layers 1 and 2: KDA with MoE (layer 0's MLP is dense), and layer 3 (MLA with MoE)
    assert len(calls) == 2 + decoder.FRONT_AFTER_MLA
    a, b = np.asarray(fused, np.float64), np.asarray(plain, np.float64)
    assert np.all(np.isfinite(a)) and np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2
    # the front making the router's choice too (`decoder.FRONT_SELECT`, counters in the cache): the same logits to
    # bf16 rounding, the counters left at zero (batch 16: no choice made in the front, the same step)
    monkeypatch.setattr(decoder, "FRONT_SELECT", True)
    choosing, after = run(*args, decode=True)
    c = np.asarray(choosing, np.float64)
    assert np.all(np.isfinite(c)) and np.linalg.norm(c - b) / np.linalg.norm(b) < 2e-2
    assert not np.any(np.asarray(after["moe_turns"]))


@pytest.mark.parametrize("sigmoid", [True, False])
def test_front_makes_the_routers_choice_on_gpu(sigmoid):
    """`front(select=)` compiled on the GPU at the medium hybrid's MoE layer (64 experts, top-6, 2 shared parts):
    x, normed and logits as without the choice, and the last program's choice exactly the router's select kernel's
    on those logits, call after call (the counters back at zero each time: the last program found every time)."""
    from dayzero.kernels import router

    k = jax.random.split(jax.random.key(int(sigmoid)), 5)
    residual = jax.random.normal(k[0], (1, 2048), jnp.bfloat16)
    update = projection.Partials(jax.random.normal(k[1], (8, 1, 2048), jnp.float32), None, 2048, 1e-6, "bfloat16")
    norm_weight = jax.random.uniform(k[2], (2048,), jnp.float32, 0.5, 1.5)
    router_weight = (jax.random.normal(k[3], (64, 2048)) * 0.02).astype(jnp.bfloat16)
    bias = jax.random.normal(k[4], (64,), jnp.float32) * 0.01
    select = moe_front.Select(6, sigmoid, True, 2.446, 2)
    choosing = jax.jit(lambda u, r, n, w, b, t: moe_front.front(u, r, n, w, eps=1e-5, select=select, bias=b, turns=t,
                                                                 layer=3))
    plain = jax.jit(lambda *a: moe_front.front(*a, eps=1e-5))(update, residual, norm_weight, router_weight)
    select_kernel = jax.jit(lambda lg, b: router.select_and_schedule(lg, b, top_k=6, sigmoid=sigmoid,
                                                                     renormalize=True, scale=2.446, shared_parts=2))
    turns = jnp.zeros((16, 4), jnp.int32)
    for _ in range(3):
        *front3, ids, weights, turns = choosing(update, residual, norm_weight, router_weight, bias, turns)
        assert not np.any(np.asarray(turns))
        for a, b in zip(front3[:2], plain[:2]):  # (another build of the same sums: within ~2 bf16 steps)
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.all(np.abs(a - b) <= np.abs(b) * 2.0 ** -6 + 1e-30)
        np.testing.assert_allclose(np.asarray(front3[2]), np.asarray(plain[2]), rtol=1e-4, atol=1e-5)
        want = select_kernel(front3[2], bias)  # on the kernel's own logits
        got = router.one_token_routing(ids, weights, 8, 66)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("row_part", [False, True])
def test_front_makes_the_shared_products_on_gpu(row_part):
    """`front(shared=)` compiled on the GPU at the medium hybrid's MoE layer (2048 features, 64 experts, top-6, the
    shared MLP's 768 columns): the router's results as without the shared programs, call after call (the counters
    back at zero), and the shared gate / up sums within float32 rounding of a float64 product of the kernel's normed
    row; with `SharedProducts.row_part`, of its x times the norm weight, with the row's 1 / rms beside them."""
    k = jax.random.split(jax.random.key(5), 6)
    residual = jax.random.normal(k[0], (1, 2048), jnp.bfloat16)
    update = projection.Partials(jax.random.normal(k[1], (8, 1, 2048), jnp.float32), None, 2048, 1e-6, "bfloat16")
    norm_weight = jax.random.uniform(k[2], (2048,), jnp.float32, 0.5, 1.5)
    router_weight = (jax.random.normal(k[3], (64, 2048)) * 0.02).astype(jnp.bfloat16)
    gate, up = ((jax.random.normal(key, (2048, 768)) * 0.02).astype(jnp.bfloat16) for key in k[4:6])
    select = moe_front.Select(6, True, True, 2.446, 4)

    programs = moe_front.SharedProducts(moe_front.SHARED_BLOCK_N, moe_front.SHARED_K_PARTS, row_part)

    def run(u, r, n, w, t, *shared):
        return moe_front.front(u, r, n, w, eps=1e-5, select=select, turns=t, layer=3, zeros=64, sums=True,
                               shared=shared or None, shared_programs=programs if shared else None)

    plain, sharing = jax.jit(run), jax.jit(run)
    turns = jnp.zeros((16, 4), jnp.int32)
    want = plain(update, residual, norm_weight, router_weight, turns)
    for _ in range(3):
        *got, sums = sharing(update, residual, norm_weight, router_weight, turns, gate, up)
        assert not np.any(np.asarray(got[6])) and not np.any(np.asarray(got[7]))  # counters, zeros
        turns = got[6]
        for i in (0, 1, 3):  # x, normed, x as float32 (another build of the same sums: within ~2 bf16 steps)
            a, b = np.asarray(got[i], np.float64), np.asarray(want[i], np.float64)
            assert np.all(np.abs(a - b) <= np.abs(b) * 2.0 ** -6 + 1e-30)
        np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-4, atol=1e-5)  # logits
        assert np.array_equal(np.asarray(got[4]), np.asarray(want[4]))  # the choice (ids)
        row = np.asarray(got[1], np.float64)[0]  # normed
        if row_part:
            x = np.asarray(got[0], np.float64)[0]
            np.testing.assert_allclose(float(sums.scale[0]), 1.0 / np.sqrt(np.mean(x * x) + 1e-5), rtol=1e-5)
            row, sums = x * np.asarray(norm_weight, np.float64), sums.sums
        oracle = np.stack([row @ np.asarray(w, np.float64) for w in (gate, up)])
        assert sums.shape == (moe_front.SHARED_K_PARTS, 2, 768)
        np.testing.assert_allclose(np.asarray(sums, np.float64).sum(0), oracle, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("down_early,row_part", [(False, False), (True, False), (True, True)])
def test_model_decode_makes_the_shared_gate_up_in_the_front_on_gpu(monkeypatch, down_early, row_part):
    """The medium hybrid's first layers with MXFP4 experts, a one-row decode step: with the front kernel making the
    shared MLP's gate / up sums (`model.moe.SHARED_GATE_UP_IN_FRONT`; with `SHARED_DOWN_IN_GATE_UP` the gate/up
    kernel running the shared down projection too; with `kernels.moe_front.SHARED_ROW_PART` from the row part's sums)
    against without: the next-token logits to bf16 rounding, the gate/up kernel given the sums in every MoE layer."""
    from dayzero.model import moe as model_moe
    from medium_prefix_cases import decode_off_and_on, logits_change, prefilled_medium_prefix

    run, args = prefilled_medium_prefix(9, num_blocks=3, batch=1, mxfp4=True)
    monkeypatch.setattr(model_moe, "SHARED_DOWN_IN_GATE_UP", down_early)
    monkeypatch.setattr(moe_front, "SHARED_ROW_PART", row_part)
    (plain, _), (made, cache) = decode_off_and_on(monkeypatch, run, args, model_moe, "SHARED_GATE_UP_IN_FRONT",
                                                  (False, True),
                                                  lambda k: getattr(k.get("shared"), "gate_up_sums", None) is not None)
    assert not np.any(np.asarray(cache["moe_turns"]))
    assert logits_change(made, plain) < 1e-2
