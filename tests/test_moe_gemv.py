"""The dense-expert decode kernel (kernels/moe_gemv.py) in interpret mode against a numpy oracle, its Triton
lowering, and where moe_experts uses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triton_lowering import count_triton_kernels
from dayzero.kernels import dispatch, moe, moe_gemv
from dayzero.kernels.moe_grouped import choose_block_m


def _oracle(x, ids, weights, wg, wu, wd):
    """float64 SwiGLU experts, weighted and summed per token."""
    x, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t]):
            g, u = x[t] @ wg[e], x[t] @ wu[e]
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    return out


def _case(rng, n_tokens, n_experts, hidden, inter, top_k):
    x = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    wg, wu = (rng.standard_normal((n_experts, hidden, inter)).astype(np.float32) * 0.3 for _ in range(2))
    wd = rng.standard_normal((n_experts, inter, hidden)).astype(np.float32) * 0.3
    ids = np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    if n_tokens > 1:
        ids[1] = ids[0]  # two tokens on the same experts
    weights = rng.uniform(0.1, 1.0, (n_tokens, top_k)).astype(np.float32)
    return x, ids, weights, wg, wu, wd


_swiglu = jax.jit(moe_gemv.swiglu_pairs, static_argnames=("tiles", "interpret"))


@pytest.mark.parametrize("shape", [(1, 6, 40, 24, 2), (3, 8, 64, 96, 3), (2, 5, 48, 80, 5)])
def test_matches_oracle(seed, shape):
    """Odd dims (blocks cut to their power-of-two divisors), several K slices, pairs sharing experts."""
    rng = np.random.default_rng(seed)
    args = _case(rng, *shape)
    tiles = moe_gemv.GemvTiles(block_n=16, step_k=8, k_slices=3)
    got = _swiglu(*(jnp.asarray(a) for a in args), tiles=tiles, interpret=True)
    want = _oracle(*args)
    err = float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))
    assert got.dtype == jnp.float32 and err < 1e-5, f"{shape}: {err:.2e} (seed={seed})"


def test_bf16_and_moe_experts_route(seed):
    """bf16 activations and weights through moe_experts(impl="interpret"): the kernel at decode sizes, rounding like
    the XLA paths."""
    rng = np.random.default_rng(seed)
    x, ids, weights, wg, wu, wd = _case(rng, 2, 8, 64, 32, 2)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (x, wg, wu, wd)]
    got = jax.jit(lambda *a: moe.moe_experts(*a, impl="interpret"))(bf[0], jnp.asarray(ids), jnp.asarray(weights),
                                                                    *bf[1:])
    xla = moe.moe_experts(bf[0], jnp.asarray(ids), jnp.asarray(weights), *bf[1:], block_m=1, impl="reference")
    assert got.dtype == jnp.bfloat16
    want = _oracle(np.asarray(bf[0], np.float32), ids, weights, *(np.asarray(w, np.float32) for w in bf[1:]))
    scale = np.max(np.abs(want))
    assert np.max(np.abs(np.asarray(got, np.float32) - want)) / scale < 2e-2, f"seed={seed}"
    assert np.max(np.abs(np.asarray(got, np.float32) - np.asarray(xla, np.float32))) / scale < 2e-2, f"seed={seed}"


def test_lowers_to_triton_at_model_shapes():
    spec = jax.ShapeDtypeStruct
    for n_experts, hidden, inter, top_k in ((64, 2048, 768, 6), (256, 7168, 2048, 8)):
        args = (spec((1, hidden), jnp.bfloat16), spec((1, top_k), jnp.int32), spec((1, top_k), jnp.float32),
                spec((n_experts, hidden, inter), jnp.bfloat16), spec((n_experts, hidden, inter), jnp.bfloat16),
                spec((n_experts, inter, hidden), jnp.bfloat16))
        assert count_triton_kernels(lambda *a: moe_gemv.swiglu_pairs(*a), *args) == 2


def test_dispatch_and_cost_model():
    """CPU runs the XLA paths; with the kernel, decode batches that ragged_dot would win take 1-row pairs."""
    assert dispatch.choose("moe_gemv", ("reference", "pallas"), platform="cpu") == "reference"
    medium = (64, 2048, 768, 2)
    assert choose_block_m(8 * 6, *medium) is None  # XLA only: the gathered copy costs three reads
    assert choose_block_m(8 * 6, *medium, gemv=True) == 1
    assert choose_block_m(64 * 6, *medium, gemv=True) is None
