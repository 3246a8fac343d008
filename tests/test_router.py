"""The one-kernel MoE router (kernels/router.py) in interpret mode against the XLA route of model/moe.py, its
Triton lowering at model shapes, and where the model uses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triton_lowering import count_triton_kernels
from dayzero.kernels import dispatch, router
from dayzero.model.moe import Router, route
from dayzero.model.presets import tiny


def _config(n_experts, top_k, activation, renormalize, hidden=64, scale=2.5):
    return tiny().replace(hidden_size=hidden, num_experts=n_experts, num_experts_per_token=top_k,
                          router_activation=activation, renormalize=renormalize, routed_scaling_factor=scale)


@pytest.mark.parametrize("n_tokens,n_experts,top_k,activation,renormalize,bias", [
    (1, 64, 6, "sigmoid", True, True), (21, 32, 3, "softmax", False, False), (40, 16, 1, "sigmoid", True, True),
    (17, 64, 8, "softmax", True, True)])
@pytest.mark.parametrize("kernel", ["route_tokens", "select_experts"])
def test_matches_the_xla_route(seed, n_tokens, n_experts, top_k, activation, renormalize, bias, kernel):
    """Odd token counts (partial row blocks), both activations, with and without the correction bias and the
    renormalisation, top-1 up to top-8: the same experts in the same order, weights to float32 rounding. The whole
    router in one kernel, or the kernel of its steps after the logits (given the same logits)."""
    rng = np.random.default_rng(seed)
    cfg = _config(n_experts, top_k, activation, renormalize)
    x = jnp.asarray(rng.standard_normal((n_tokens, cfg.hidden_size)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n_experts, cfg.hidden_size)) * 0.3, jnp.float32)
    b = jnp.asarray(rng.standard_normal(n_experts) * 0.1, jnp.float32) if bias else None
    options = dict(top_k=top_k, sigmoid=activation == "sigmoid", renormalize=renormalize,
                   scale=cfg.routed_scaling_factor, interpret=True)
    with jax.default_matmul_precision("highest"):
        logits = x @ w.T
        want_ids, want_weights = route(logits, b, cfg)
        if kernel == "route_tokens":
            ids, weights = router.route_tokens(x, w, b, **options)
        else:
            ids, weights = router.select_experts(logits, b, **options)
    assert ids.shape == want_ids.shape == (n_tokens, top_k) and ids.dtype == jnp.int32
    assert np.array_equal(np.asarray(ids), np.asarray(want_ids)), f"seed={seed}"
    # route_tokens sums its own logits in another order (float32, 64 terms of magnitude ~2): a few ulps of a logit
    # move a softmax weight by ~1e-6 of itself; select_experts gets the same logits
    rtol = 1e-5 if kernel == "route_tokens" else 2e-6
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=rtol, atol=1e-7)


def test_ties_break_like_top_k():
    """Equal choices: the lower expert first, as jax.lax.top_k orders them."""
    x = jnp.ones((3, 32), jnp.float32)
    w = jnp.zeros((16, 32), jnp.float32).at[5].set(1.0).at[9].set(1.0).at[2].set(0.5)
    ids, weights = router.route_tokens(x, w, None, top_k=3, sigmoid=True, renormalize=False, scale=1.0,
                                       interpret=True)
    assert np.array_equal(np.asarray(ids), [[5, 9, 2]] * 3)
    want_ids, want_weights = route(x @ w.T, None, _config(16, 3, "sigmoid", False, hidden=32, scale=1.0))
    assert np.array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-6)


_select = router.select_experts


def test_model_router_uses_it_where_dispatch_picks_it(seed, monkeypatch):
    """The Router module: the kernel under DAYZERO_KERNELS=interpret equals the XLA route, and so does the select
    kernel after XLA's logits where the whole kernel does not take the weight; the CPU's default and a mesh
    (one_kernel=False) keep XLA; grouped routing (DeepSeek's n_group) is not taken."""
    cfg = _config(64, 6, "sigmoid", True, hidden=96).replace(router_bias=True)
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((5, 96)), jnp.float32)
    params = Router(cfg, jnp.float32).init(jax.random.key(0), x)
    params = jax.tree.map(lambda p: p + 0.01 * jnp.arange(p.size, dtype=p.dtype).reshape(p.shape) / p.size, params)
    with jax.default_matmul_precision("highest"):
        want = Router(cfg, jnp.float32).apply(params, x)  # CPU default: the XLA route
        monkeypatch.setenv(dispatch.ENV_OVERRIDE, "interpret")
        got = Router(cfg, jnp.float32).apply(params, x)
        mesh_like = Router(cfg, jnp.float32, one_kernel=False).apply(params, x)
    assert np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=2e-6)
    assert np.array_equal(np.asarray(mesh_like[0]), np.asarray(want[0]))
    assert router.choose(64, 96, 6, n_group=1, impl="interpret") == "interpret"
    monkeypatch.setattr(router, "MAX_WEIGHT_ELEMENTS", 1024)  # the whole kernel refuses: logits in XLA, then select
    calls = []
    monkeypatch.setattr(router, "select_experts", lambda *a, **k: calls.append(1) or _select(*a, **k))
    with jax.default_matmul_precision("highest"):
        selected = Router(cfg, jnp.float32).apply(params, x)
    assert calls and np.array_equal(np.asarray(selected[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(selected[1]), np.asarray(want[1]), rtol=2e-6)
    assert router.choose_select(256, 8, n_group=8, impl="interpret") == "reference"  # expert groups
    assert router.choose_select(256, 8, n_group=1, impl="interpret") == "interpret"  # any weight size
    monkeypatch.undo()
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "interpret")
    assert router.choose(256, 7168, 8, n_group=8, impl="interpret") == "reference"  # DeepSeek's expert groups
    assert router.choose(384, 7168, 8, n_group=1, impl="interpret") == "reference"  # not a power of two
    assert router.choose(256, 7168, 8, n_group=1, impl="interpret") == "reference"  # weight too big for one program
    monkeypatch.delenv(dispatch.ENV_OVERRIDE)
    assert router.choose(64, 96, 6, n_group=1, impl=None) == "reference"  # CPU
    assert dispatch.choose("router", ("reference", "pallas"), platform="cuda",
                           gpu_verified=router.GPU_VERIFIED) == ("pallas" if router.GPU_VERIFIED else "reference")


@pytest.mark.parametrize("n_tokens", [1, 16, 64])
def test_lowers_to_triton_at_model_shapes(n_tokens):
    spec = jax.ShapeDtypeStruct
    for n_experts, hidden, top_k in ((64, 2048, 6), (128, 2048, 8)):
        assert router.supported(n_experts, hidden, top_k)
        args = (spec((n_tokens, hidden), jnp.bfloat16), spec((n_experts, hidden), jnp.bfloat16),
                spec((n_experts,), jnp.float32))
        fn = lambda x, w, b, k=top_k: router.route_tokens(x, w, b, top_k=k, sigmoid=True, renormalize=True,
                                                         scale=2.5)
        assert count_triton_kernels(fn, *args) == 1
        select = lambda logits, b, k=top_k: router.select_experts(logits, b, top_k=k, sigmoid=True, renormalize=True,
                                                                  scale=2.5)
        assert count_triton_kernels(select, spec((n_tokens, n_experts), jnp.float32), args[2]) == 1


@pytest.mark.parametrize("n_tokens,n_experts,top_k,parts,activation,block_m", [
    (1, 64, 6, 1, "sigmoid", 16), (5, 16, 4, 2, "softmax", 16), (16, 64, 6, 1, "sigmoid", 16),
    (11, 32, 8, 3, "softmax", 16), (16, 64, 6, 0, "sigmoid", 2), (12, 16, 8, 0, "softmax", 2),
    (16, 16, 8, 0, "sigmoid", 4), (9, 32, 4, 1, "sigmoid", 1), (1, 64, 6, 0, "sigmoid", 2)])
def test_select_and_schedule(seed, n_tokens, n_experts, top_k, parts, activation, block_m):
    """The select-and-schedule kernel (interpret mode): the ids and weights of `select_experts` with the shared
    parts appended (ids E .., weight 1), and exactly the schedule `moe_tiles.schedule` makes of them in tiles of
    `block_m` rows (tile_expert running on past its tiles: -1, or for one token the padding of the ids), its pair
    table included. Few experts at 16 tokens: experts with several short tiles."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.standard_normal((n_tokens, n_experts)) * 2, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(n_experts) * 0.1, jnp.float32)
    options = dict(top_k=top_k, sigmoid=activation == "sigmoid", renormalize=True, scale=2.5)
    ids, weights, sched = router.select_and_schedule(logits, bias, **options, shared_parts=parts, block_m=block_m,
                                                     interpret=True)
    want_ids, want_weights = router.select_experts(logits, bias, **options, interpret=True)
    assert ids.shape == weights.shape == (n_tokens, top_k + parts)
    assert np.array_equal(ids[:, :top_k], want_ids) and np.array_equal(weights[:, :top_k], want_weights)
    assert np.array_equal(ids[:, top_k:], np.broadcast_to(n_experts + np.arange(parts), (n_tokens, parts)))
    assert np.all(np.asarray(weights[:, top_k:]) == 1.0)
    assert_schedule_of(sched, ids, n_experts + parts, block_m)
    if n_tokens > 1 and block_m < 16:  # some expert ran more tokens than one tile holds
        assert np.asarray(sched.group_sizes).max() > block_m


@pytest.mark.parametrize("n_tokens,block_m", [(1, 1), (16, 2), (5, 2)])
def test_select_and_schedule_padded(seed, n_tokens, block_m):
    """`padded=True` (the MXFP4 decode kernels' form): the kernel's tables unsliced, their first R rows the
    schedule's; the pair table numbering pairs t * k_pad + slot in the weights' padded rows (`pair_weights`), whose
    pairs hold the routing weights; padding rows numbered past them."""
    from dayzero.kernels import moe_tiles

    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.standard_normal((n_tokens, 64)) * 2, jnp.float32)
    options = dict(top_k=6, sigmoid=True, renormalize=True, scale=2.5, shared_parts=0, block_m=block_m)
    ids, weights, sched = router.select_and_schedule(logits, None, **options, padded=True, interpret=True)
    want = moe_tiles.schedule(ids, 64, block_m)
    n_rows = want.token_of_row.shape[0]
    assert sched.token_of_row.shape[0] >= n_rows and sched.pair_rows.shape == sched.token_of_row.shape
    assert np.array_equal(sched.token_of_row[:n_rows], want.token_of_row)
    assert np.array_equal(sched.row_of_pair, want.row_of_pair)
    padded = np.asarray(sched.pair_weights)
    stride = padded.shape[1]
    assert padded.shape[0] == router.BLOCK_M and stride == 8
    pairs = np.asarray(sched.pair_rows[:n_rows])
    real = np.asarray(want.token_of_row) < n_tokens
    want_pairs = np.asarray(want.pair_of_row())
    assert np.array_equal(pairs[real], want_pairs[real] // 6 * stride + want_pairs[real] % 6)
    assert np.all(pairs[~real] == padded.size)
    assert np.array_equal(padded.reshape(-1)[pairs[real]], np.asarray(weights).reshape(-1)[want_pairs[real]])


def assert_schedule_of(sched, ids, n_experts: int, block_m: int = 16):
    """`sched` is the schedule `moe_tiles.schedule` makes of ids [T, k] over n_experts in `block_m`-row tiles;
    its tile_expert may run on past the tiles (-1 there; for one token, the padding of the ids); from two tokens it
    carries its pair table."""
    from dayzero.kernels import moe_tiles

    want = moe_tiles.schedule(ids, n_experts, block_m)
    for field in ("row_of_pair", "token_of_row", "group_sizes"):
        assert np.array_equal(getattr(sched, field), getattr(want, field)), field
    n_tiles = want.tile_expert.shape[0]
    assert np.array_equal(sched.tile_expert[:n_tiles], want.tile_expert)
    if ids.shape[0] > 1:
        assert np.all(np.asarray(sched.tile_expert[n_tiles:]) == -1)
        assert sched.pair_rows is not None
        assert np.array_equal(sched.pair_of_row(), want.pair_of_row()), "pair_rows"


def test_select_and_schedule_names_what_it_does_not_take():
    logits = jnp.zeros((17, 64), jnp.float32)
    with pytest.raises(ValueError, match="17 tokens, 64 experts, top-6 \\+ 1 shared"):
        router.select_and_schedule(logits, None, top_k=6, sigmoid=True, renormalize=True, scale=1.0, shared_parts=1,
                                   interpret=True)
    assert router.schedule_supported(64, 6, 1) and not router.schedule_supported(256, 8, 1)
    assert not router.schedule_supported(48, 6, 1)  # not a power of two


@pytest.mark.parametrize("n_tokens,parts,block_m", [(1, 1, 16), (2, 1, 16), (16, 1, 16), (16, 0, 2)])
def test_select_and_schedule_lowers_to_triton(n_tokens, parts, block_m):
    spec = jax.ShapeDtypeStruct
    fn = lambda logits, b: router.select_and_schedule(logits, b, top_k=6, sigmoid=True, renormalize=True, scale=2.5,
                                                      shared_parts=parts, block_m=block_m)
    assert count_triton_kernels(fn, spec((n_tokens, 64), jnp.float32), spec((64,), jnp.float32)) == 1
