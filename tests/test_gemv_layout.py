"""benchmarks/gemv_layout.py's kernels and chains in interpret mode (no GPU needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import gemv_layout
from dayzero.kernels import projection


def test_each_gemv_variant_computes_the_product():
    """Whole rows of [N, K] (one block or a loop of blocks) and [K, N] blocks (partial sums over K slices): each
    the float32 product of the weight and the row."""
    w = jax.random.normal(jax.random.key(0), (64, 256), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (256,), jnp.float32)
    want = np.asarray(w, np.float64) @ np.asarray(x, np.float64)
    got = [gemv_layout.rows_gemv(w, x, rows=4, num_warps=4, interpret=True),
           gemv_layout.looped_gemv(w, x, rows=2, steps=4, num_warps=4, num_stages=2, interpret=True),
           gemv_layout.kn_blocks_gemv(w.T, x, block_k=64, block_n=32, num_warps=4, interpret=True).sum(0)]
    for out in got:
        assert out.shape == (64,)
        np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-4, atol=1e-4)
    assert gemv_layout.kn_blocks_gemv(w.T, x, block_k=64, block_n=32, num_warps=4, interpret=True).shape == (4, 64)


def test_model_groups_and_projection_chains():
    """The KDA input projections' width splits into the model's groups; the projection chain over [K, N] weights
    and over the same weights stored [N, K] ends on the same product, to bf16 rounding."""
    w = jax.random.normal(jax.random.key(2), (64, 6416), jnp.bfloat16) * 0.1
    groups = gemv_layout.split_columns(w)
    assert [[a.shape[1] for a in g] for g in groups] == [[2048, 2048, 2048], [128, 128, 16]]
    assert np.array_equal(np.asarray(groups[1][2]), np.asarray(w[:, -16:]))
    assert [[a.shape for a in g] for g in gemv_layout.split_columns(w[:, :96])] == [[(64, 96)]]
    rows_tiles = projection.ProjectionTiles(block_n=2, step_k=32, num_warps=4, num_stages=1, min_programs=1,
                                            k_slices=1, cuda_cores=True)
    plain = gemv_layout.projection_chain(interpret=True)([groups])
    rows = gemv_layout.projection_chain(interpret=True, rows_tiles=rows_tiles)([tuple(tuple(a.T for a in g)
                                                                                      for g in groups)])
    plain = np.asarray(plain, np.float32)  # K = 64 is one step: no split, finished in the kernel
    assert rows.shape == plain.shape == (1, 6144)
    np.testing.assert_allclose(np.asarray(rows, np.float32), plain, rtol=2e-2, atol=2e-2)


def test_weight_rows_chain_without_norm_over_one_weight():
    """The benchmark's one-weight, no-norm form of the weight-rows chain: the plain product, to bf16 rounding."""
    w = jax.random.normal(jax.random.key(3), (96, 64), jnp.bfloat16) * 0.1  # [N, K]
    tiles = projection.ProjectionTiles(block_n=2, step_k=32, num_warps=4, num_stages=1, min_programs=1, k_slices=1,
                                       cuda_cores=True)
    got = gemv_layout.projection_chain(interpret=True, rows_tiles=tiles, norm=False)([((w,),)])
    want = np.asarray(w, np.float64).sum(axis=1)  # the chain's row is all ones
    assert got.shape == (1, 96)
    np.testing.assert_allclose(np.asarray(got, np.float64)[0], want, rtol=1e-2, atol=1e-2)
