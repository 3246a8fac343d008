"""The dense-expert decode kernel (kernels/moe_gemv.py) compiled for real (Triton) on the GPU, against the XLA
ragged_dot path at float32 matmul precision, at the medium-hybrid and DeepSeek shapes and decode token counts.
Passing here is what lets `moe_gemv.GPU_VERIFIED` become True."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import moe

pytestmark = pytest.mark.skipif(not any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices()),
                                reason="no GPU on this machine")

_experts = jax.jit(moe.moe_experts, static_argnames=("block_m", "impl"))


def _layer(key, n_experts, hidden, inter):
    k1, k2, k3 = jax.random.split(key, 3)
    return (jax.random.normal(k1, (n_experts, hidden, inter), jnp.bfloat16) * 0.02,
            jax.random.normal(k2, (n_experts, hidden, inter), jnp.bfloat16) * 0.02,
            jax.random.normal(k3, (n_experts, inter, hidden), jnp.bfloat16) * 0.02)


@pytest.mark.parametrize("shape,n_tokens", [((64, 6, 2048, 768), 1), ((64, 6, 2048, 768), 5),
                                            ((64, 6, 2048, 768), 16), ((256, 8, 7168, 2048), 1),
                                            ((256, 8, 7168, 2048), 3)])
def test_gemv_matches_ragged_dot(seed, shape, n_tokens):
    n_experts, top_k, hidden, inter = shape
    key = jax.random.key(seed)
    weights = _layer(key, n_experts, hidden, inter)
    _, ids = jax.lax.top_k(jax.random.uniform(jax.random.fold_in(key, 1), (n_tokens, n_experts)), top_k)
    if n_tokens > 1:
        ids = ids.at[1].set(ids[0])  # two tokens on the same experts
    w = jax.random.uniform(jax.random.fold_in(key, 2), (n_tokens, top_k), jnp.float32)
    x = jax.random.normal(jax.random.fold_in(key, 3), (n_tokens, hidden), jnp.bfloat16)
    got = _experts(x, ids.astype(jnp.int32), w, *weights, block_m=1, impl="pallas")
    with jax.default_matmul_precision("highest"):
        want = _experts(x.astype(jnp.float32), ids.astype(jnp.int32), w, *(a.astype(jnp.float32) for a in weights),
                        block_m=None, impl="reference")
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert np.all(np.isfinite(got)) and err < 2e-2, f"{shape} T={n_tokens}: {err:.2e} (seed={seed})"
