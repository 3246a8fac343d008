"""The one-kernel MoE router (kernels/router.py) compiled for real (Triton) on the GPU against the XLA route at
float32 precision, at the medium hybrid's router from one token to a prefill chunk; likewise the kernel of the
router's steps after its logits. Passing here is what lets `router.GPU_VERIFIED` / `SELECT_GPU_VERIFIED` become
True."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import router
from dayzero.model.moe import route
from dayzero.model.presets import medium_hybrid

pytestmark = pytest.mark.skipif(not any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices()),
                                reason="no GPU on this machine")


@pytest.mark.parametrize("n_tokens", [1, 16, 77, 2048])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kernel", ["route_tokens", "select_experts"])
def test_router_matches_xla_route(seed, n_tokens, dtype, kernel):
    """The whole router in one kernel, or (select_experts) the rest of it after the logits' XLA product."""
    cfg = medium_hybrid()
    key = jax.random.key(seed)
    x = jax.random.normal(key, (n_tokens, cfg.hidden_size), dtype)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (cfg.num_experts, cfg.hidden_size)) * 0.02).astype(dtype)
    bias = jax.random.normal(jax.random.fold_in(key, 2), (cfg.num_experts,), jnp.float32) * 0.01
    options = dict(top_k=cfg.num_experts_per_token, sigmoid=True, renormalize=cfg.renormalize,
                   scale=cfg.routed_scaling_factor)
    with jax.default_matmul_precision("highest"):
        logits = x.astype(jnp.float32) @ w.astype(jnp.float32).T
    if kernel == "route_tokens":
        ids, weights = jax.jit(lambda x, w, b: router.route_tokens(x, w, b, **options))(x, w, bias)
    else:  # given the reference's logits (XLA's own float32 product may run TF32: not this kernel's doing)
        ids, weights = jax.jit(lambda l, b: router.select_experts(l, b, **options))(logits, bias)
    with jax.default_matmul_precision("highest"):
        want_ids, want_weights = jax.jit(lambda l, b: route(l, b, cfg))(logits, bias)
    ids, want_ids = np.asarray(ids), np.asarray(want_ids)
    choice = np.asarray(jax.nn.sigmoid(logits) + bias)
    for t in range(n_tokens):  # the same set, up to swaps of choices within float32 rounding of each other
        if set(ids[t]) != set(want_ids[t]):
            boundary = choice[t, want_ids[t]].min()
            swapped = set(ids[t]) ^ set(want_ids[t])
            assert all(abs(choice[t, e] - boundary) < 1e-5 for e in swapped), (t, ids[t], want_ids[t])
    same = np.all(ids == want_ids, axis=1)
    assert same.mean() > 0.95
    np.testing.assert_allclose(np.asarray(weights)[same], np.asarray(want_weights)[same], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("n_tokens,parts,block_m", [(1, 1, 16), (2, 1, 16), (7, 1, 16), (16, 1, 16), (5, 0, 2),
                                                    (16, 0, 2)])
def test_select_and_schedule_on_gpu(seed, n_tokens, parts, block_m):
    """The select-and-schedule kernel compiled at the medium hybrid's router (64 experts, top-6; one shared part
    in 16-row tiles for the grouped kernels, none in 2-row tiles for the MXFP4 decode kernels): the same ids and
    weights as `select_experts` on the same logits, the shared part appended, and exactly the schedule
    `moe_tiles.schedule` makes of those ids, pair table included (its products run on the tensor cores: exact for
    these 0 / 1 and small-integer operands)."""
    from test_router import assert_schedule_of

    cfg = medium_hybrid()
    key = jax.random.key(seed)
    logits = jax.random.normal(key, (n_tokens, cfg.num_experts), jnp.float32) * 2
    bias = jax.random.normal(jax.random.fold_in(key, 2), (cfg.num_experts,), jnp.float32) * 0.01
    options = dict(top_k=cfg.num_experts_per_token, sigmoid=True, renormalize=cfg.renormalize,
                   scale=cfg.routed_scaling_factor)
    ids, weights, sched = jax.jit(lambda l, b: router.select_and_schedule(l, b, **options, shared_parts=parts,
                                                                           block_m=block_m))(logits, bias)
    want_ids, want_weights = jax.jit(lambda l, b: router.select_experts(l, b, **options))(logits, bias)
    k = cfg.num_experts_per_token
    assert ids.shape[1] == k + parts and np.array_equal(ids[:, :k], want_ids)
    np.testing.assert_allclose(np.asarray(weights[:, :k]), np.asarray(want_weights), rtol=1e-6)
    if parts:
        assert np.all(np.asarray(ids[:, k]) == cfg.num_experts) and np.all(np.asarray(weights[:, k]) == 1.0)
    assert_schedule_of(sched, ids, cfg.num_experts + parts, block_m)
