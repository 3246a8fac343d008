"""The dense-expert grouped matmuls (kernels/moe_dense.py) in interpret mode against a float64 oracle, their
Triton lowering at model shapes, and where moe_experts uses them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triton_lowering import count_triton_kernels
from dayzero.kernels import dispatch, moe, moe_dense


def _oracle(x, ids, weights, wg, wu, wd):
    """float64 SwiGLU experts, weighted and summed per token."""
    x, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t]):
            g, u = x[t] @ wg[e], x[t] @ wu[e]
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    return out


def _case(rng, n_tokens, n_experts, hidden, inter, top_k, skewed=False):
    x = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    wg, wu = (rng.standard_normal((n_experts, hidden, inter)).astype(np.float32) * 0.3 for _ in range(2))
    wd = rng.standard_normal((n_experts, inter, hidden)).astype(np.float32) * 0.3
    ids = np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    if skewed:  # expert 1 takes every token: several tiles of one expert, most experts idle
        ids[:, 0] = 1
        ids[:, 1:] = np.where(ids[:, 1:] == 1, 0, ids[:, 1:])
    weights = rng.uniform(0.1, 1.0, (n_tokens, top_k)).astype(np.float32)
    return x, ids, weights, wg, wu, wd


_grouped = jax.jit(moe_dense.grouped_swiglu, static_argnames=("tiles", "interpret"))


@pytest.mark.parametrize("shape,skewed,tiles", [
    ((1, 6, 40, 24, 2), False, moe_dense.DenseTiles(block_m=4, block_n=8, step_k=8, k_slices=3, min_programs=64)),
    ((9, 8, 64, 96, 3), False, moe_dense.DenseTiles(block_m=4, block_n=16, step_k=16, k_slices=2)),
    ((37, 5, 48, 80, 2), True, moe_dense.DenseTiles(block_m=8, block_n=16, step_k=16, k_slices=1)),
])
def test_matches_oracle(seed, shape, skewed, tiles):
    """Odd dims (blocks cut to their power-of-two divisors), K split or not, pairs sharing experts, one expert
    spread over several tiles."""
    rng = np.random.default_rng(seed)
    args = _case(rng, *shape, skewed=skewed)
    got = _grouped(*(jnp.asarray(a) for a in args), tiles=tiles, interpret=True)
    want = _oracle(*args)
    err = float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))
    assert got.dtype == jnp.float32 and err < 1e-5, f"{shape}: {err:.2e} (seed={seed})"


def test_bf16_through_moe_experts(seed):
    """bf16 activations and weights through moe_experts(impl="interpret") at a decode and a prefill size, against
    the oracle and the XLA path."""
    rng = np.random.default_rng(seed)
    for n_tokens in (2, 40):
        x, ids, weights, wg, wu, wd = _case(rng, n_tokens, 8, 64, 32, 2)
        bf = [jnp.asarray(a, jnp.bfloat16) for a in (x, wg, wu, wd)]
        run = jax.jit(lambda *a, impl: moe.moe_experts(*a, impl=impl), static_argnames="impl")
        got = run(bf[0], jnp.asarray(ids), jnp.asarray(weights), *bf[1:], impl="interpret")
        xla = run(bf[0], jnp.asarray(ids), jnp.asarray(weights), *bf[1:], impl="reference")
        assert got.dtype == jnp.bfloat16
        want = _oracle(np.asarray(bf[0], np.float32), ids, weights, *(np.asarray(w, np.float32) for w in bf[1:]))
        scale = np.max(np.abs(want))
        assert np.max(np.abs(np.asarray(got, np.float32) - want)) / scale < 2e-2, f"T={n_tokens} seed={seed}"
        assert np.max(np.abs(np.asarray(got, np.float32) - np.asarray(xla, np.float32))) / scale < 2e-2, seed


@pytest.mark.parametrize("n_tokens", [1, 512])
def test_lowers_to_triton_at_model_shapes(n_tokens):
    spec = jax.ShapeDtypeStruct
    for n_experts, hidden, inter, top_k in ((64, 2048, 768, 6), (256, 7168, 2048, 8)):
        args = (spec((n_tokens, hidden), jnp.bfloat16), spec((n_tokens, top_k), jnp.int32),
                spec((n_tokens, top_k), jnp.float32), spec((n_experts, hidden, inter), jnp.bfloat16),
                spec((n_experts, hidden, inter), jnp.bfloat16), spec((n_experts, inter, hidden), jnp.bfloat16))
        assert moe_dense.supported(hidden, inter)
        assert count_triton_kernels(lambda *a: moe_dense.grouped_swiglu(*a), *args) == 2


def test_dispatch_and_tiles():
    """CPU runs the XLA paths; decode-sized calls take 16-row tiles with K split, prefill 64-row tiles."""
    assert dispatch.choose("moe_dense", ("reference", "pallas"), platform="cpu") == "reference"
    assert not moe_dense.supported(40, 24) and moe_dense.supported(2048, 768)
    assert moe_dense.choose_tiles(6, 64).block_m == 16 and moe_dense.choose_tiles(2048 * 6, 64).block_m == 64
