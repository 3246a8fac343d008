"""kernels/l2_prefetch.py on the GPU: a kernel issuing bulk L2 prefetches builds, runs and computes what it would
without them (what the prefetch buys is benchmarks/l2_prefetch.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from dayzero.kernels import l2_prefetch, tiles

pytestmark = pytest.mark.skipif(not any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices()),
                                reason="no GPU on this machine")


def _kernel(x_ref, w_ref, o_ref, *, chunk, prefetch):
    if prefetch:
        total = w_ref.shape[0] * w_ref.shape[1]
        l2_prefetch.prefetch(w_ref, l2_prefetch.chunk_offsets(total, 2, 8, pl.program_id(0), 128, chunk), chunk)
    i = pl.program_id(0)
    o_ref[pl.ds(i * 128, 128)] = x_ref[pl.ds(i * 128, 128)] * 2 + w_ref[i, pl.ds(0, 128)].astype(jnp.float32)


@pytest.mark.parametrize("prefetch", [False, True])
def test_prefetching_kernel_computes_the_same(prefetch):
    w = jnp.asarray(np.random.default_rng(0).standard_normal((1024, 4096)), jnp.bfloat16)  # 8 MB
    x = jnp.arange(1024, dtype=jnp.float32)
    call = pl.pallas_call(functools.partial(_kernel, chunk=8192, prefetch=prefetch),
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8,),
                          compiler_params=tiles.compiler_params(4, 1), name="prefetching_copy")
    out = np.asarray(jax.jit(call)(x, w))
    want = np.asarray(x) * 2 + np.asarray(w[:8, :128], np.float32).reshape(-1)
    np.testing.assert_array_equal(out, want)
