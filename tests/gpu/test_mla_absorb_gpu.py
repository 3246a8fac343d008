"""Absorbed MLA's W_UK / W_UV kernels (kernels/mla_absorb.py) compiled for real (Triton) on the GPU, at the medium
hybrid's (16 heads) and DeepSeek-V3.2's (128 heads) sizes, against float64 oracles; and the medium hybrid's decode
step through them against the einsum path; the latent's norm inside the decode cache write. Passing here is what
lets `mla_absorb.GPU_VERIFIED` and `paged.NORM_GPU_VERIFIED` become True."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import mla_absorb
from dayzero.kernels.sparse_mla import SplitLatents

pytestmark = pytest.mark.skipif(not any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices()),
                                reason="no GPU on this machine")

NOPE, ROPE, V, RANK = 128, 64, 128, 512


@pytest.mark.parametrize("heads,rows,splits", [(16, 1, 8), (16, 16, 4), (16, 3, 256), (128, 1, 16), (128, 8, 1)])
def test_both_sides_against_float64(heads, rows, splits):
    rng = np.random.default_rng(heads + rows + splits)
    q = jnp.asarray(rng.standard_normal((rows, heads * (NOPE + ROPE))), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((RANK, heads * (NOPE + V))) / np.sqrt(RANK), jnp.bfloat16)
    q_lat, q_rope = jax.jit(lambda q, w: mla_absorb.absorb_queries(q, w, heads=heads, nope=NOPE, rope=ROPE,
                                                                   v_dim=V))(q, w)
    q64 = np.asarray(q, np.float64).reshape(rows, heads, NOPE + ROPE)
    w64 = np.asarray(w, np.float64).reshape(RANK, heads, NOPE + V)
    want = np.einsum("mhn,rhn->mhr", q64[..., :NOPE], w64[..., :NOPE])
    assert np.max(np.abs(np.asarray(q_lat, np.float64) - want)) <= 1e-2 * np.max(np.abs(want))
    np.testing.assert_array_equal(np.asarray(q_rope), np.asarray(q).reshape(rows, heads, -1)[..., NOPE:])

    out = jnp.asarray(rng.standard_normal((rows, splits, heads, RANK)), jnp.bfloat16)
    lse = rng.standard_normal((rows, splits, heads)) * 3
    if splits > 1:
        lse[:, splits // 2:] = -np.inf  # empty splits, as a short context leaves them
    lse[0, :, 1] = -np.inf
    latents = SplitLatents(out, jnp.asarray(lse, jnp.float32), heads, "bfloat16")
    o = jax.jit(lambda l, w: mla_absorb.up_project(l, w, nope=NOPE, v_dim=V))(latents, w)
    merged = np.asarray(latents.merged(), np.float64)
    want = np.einsum("mhr,rhv->mhv", merged, w64[..., NOPE:]).reshape(rows, -1)
    got = np.asarray(o, np.float64)
    assert np.all(np.isfinite(got)) and np.max(np.abs(got - want)) <= 1e-2 * np.max(np.abs(want))
    assert not np.any(got[0, V:2 * V])


def test_model_decode_through_the_kernels_on_gpu(monkeypatch):
    """The medium hybrid's first four layers (an MLA layer last), batch 1: the decode step's logits with the kernels
    against the einsum path, to bf16 rounding."""
    from medium_prefix_cases import prefilled_medium_prefix

    run, args = prefilled_medium_prefix(150, num_blocks=8)
    monkeypatch.setattr(mla_absorb, "choose", lambda *a, impl=None: "reference")
    plain, _ = run(*args, decode=True)
    from dayzero.kernels import paged
    monkeypatch.setattr(paged, "NORM_GPU_VERIFIED", True)  # and the latent's norm in the cache write
    calls = []
    up = mla_absorb.up_project
    monkeypatch.setattr(mla_absorb, "choose", lambda *a, impl=None: "pallas")
    monkeypatch.setattr(mla_absorb, "up_project", lambda l, *a, **k: calls.append(l) or up(l, *a, **k))
    fused, _ = run(*args, decode=True)
    assert len(calls) == 1 and isinstance(calls[0], SplitLatents)
    a, b = np.asarray(fused, np.float64), np.asarray(plain, np.float64)
    assert np.all(np.isfinite(a)) and np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2


@pytest.mark.parametrize("rows", [1, 16])
def test_latent_write_with_its_norm_on_gpu(monkeypatch, rows):
    """`paged.write(norm=LeadingNorm)` in the decode write kernel at the medium hybrid's latent (512 + 64, bf16)
    against the norm in XLA before the same kernel: equal to bf16 rounding, the rope key bit for bit."""
    from dayzero.kernels import paged

    rng = np.random.default_rng(rows)
    cache = jnp.zeros((2, 40, 64, 576), jnp.bfloat16)
    values = jnp.asarray(rng.standard_normal((rows, 1, 576)) * 4, jnp.bfloat16)
    norm = paged.LeadingNorm(jnp.asarray(rng.standard_normal(512), jnp.bfloat16), 512, 1e-6)
    tables = jnp.asarray(rng.permutation(np.arange(1, 40))[:rows * 2].reshape(rows, 2), jnp.int32)
    positions, valid = jnp.asarray(rng.integers(0, 128, (rows, 1))), jnp.ones((rows, 1), bool)
    write = jax.jit(lambda c, v: paged.write(c, 1, tables, positions, valid, v, norm=norm))
    monkeypatch.setattr(paged, "NORM_GPU_VERIFIED", False)
    want = np.asarray(write(cache, values), np.float32)
    monkeypatch.setattr(paged, "NORM_GPU_VERIFIED", True)
    got = np.asarray(jax.jit(lambda c, v: paged.write(c, 1, tables, positions, valid, v, norm=norm))(cache, values),
                     np.float32)
    assert np.max(np.abs(got - want)) <= 1e-2 * np.max(np.abs(want))
    np.testing.assert_array_equal(got[..., 512:], want[..., 512:])
    assert np.count_nonzero(np.any(got != 0, axis=-1)) == rows


@pytest.mark.usefixtures("in_out_layout")
@pytest.mark.parametrize("batch", [1, 2])
def test_model_decode_with_projection_partials_on_gpu(monkeypatch, batch):
    """`model.mla.PROJECTION_PARTIALS`: the medium hybrid's first four layers (an MLA layer last: no query LoRA, no
    rope), the MLA input projections' K-split partial sums finished by the absorb kernel and the latent cache write
    as they load them, against XLA finishing them: the logits to bf16 rounding, both kernels given the sums. In the
    [in, out] layout: over weight rows the one-row kernel never splits K, so at batch 1 no sums would reach them."""
    from dayzero.model import mla
    from medium_prefix_cases import prefilled_medium_prefix
    from mla_decode_cases import spy_unfinished_consumers

    run, args = prefilled_medium_prefix(150, num_blocks=4 * batch, batch=batch)
    monkeypatch.setattr(mla, "PROJECTION_PARTIALS", False)
    plain, _ = run(*args, decode=True)
    given = spy_unfinished_consumers(monkeypatch)
    monkeypatch.setattr(mla, "PROJECTION_PARTIALS", True)
    split, _ = run(*args, decode=True)
    assert given.count("Partials") == 2, given
    a, b = np.asarray(split, np.float64), np.asarray(plain, np.float64)
    assert np.all(np.isfinite(a)) and np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2


@pytest.mark.parametrize("rows", [1, 16])
def test_absorb_writes_the_latent_rows_on_gpu(rows):
    """`absorb_queries(latent_write=)` at the medium hybrid's sizes (16 heads, latent 512 + 64, the rows as the
    latent projection's partial sums, the norm inside): the cache as the paged write kernel leaves it (to bf16
    rounding, the rope key bit for bit; only the step's rows changed) and q_latent / q_rope as without the write."""
    from dayzero.kernels import paged, paged_pallas, projection

    rng = np.random.default_rng(rows)
    heads, nope, rope, v_dim, rank = 16, 128, 64, 128, 512
    cache = jnp.asarray(rng.standard_normal((2, 40, 64, rank + rope)), jnp.bfloat16)
    sums = jnp.asarray(rng.standard_normal((8, rows, rank + rope)), jnp.float32)
    values = projection.Partials(sums, jnp.asarray(rng.uniform(1, 3, (8, rows)), jnp.float32), 2048, 1e-5,
                                 "bfloat16")
    norm = paged.LeadingNorm(jnp.asarray(rng.standard_normal(rank), jnp.bfloat16), rank, 1e-6)
    tables = jnp.asarray(rng.permutation(np.arange(1, 40))[:rows * 2].reshape(rows, 2), jnp.int32)
    positions, valid = jnp.asarray(rng.integers(0, 128, (rows, 1)), jnp.int32), jnp.ones((rows, 1), bool)
    q = jnp.asarray(rng.standard_normal((rows, heads * (nope + rope))), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((rank, heads * (nope + v_dim))) / np.sqrt(rank), jnp.bfloat16)
    kw = dict(heads=heads, nope=nope, rope=rope, v_dim=v_dim)
    want_cache = jax.jit(lambda c: paged_pallas.write(c, 1, tables, positions, valid, values, norm=norm))(cache)
    want = jax.jit(lambda q: mla_absorb.absorb_queries(q, w, **kw))(q)
    write = paged_pallas.DecodeRows(1, tables, positions, valid, values, norm)
    got = jax.jit(lambda q, c: mla_absorb.absorb_queries(q, w, cache=c, latent_write=write, **kw))(q, cache)
    for g, r in zip(got[:2], want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))
    a, b, before = (np.asarray(t, np.float32) for t in (got[2], want_cache, cache))
    assert np.max(np.abs(a - b)) <= 1e-2 * np.max(np.abs(b))
    np.testing.assert_array_equal(a[..., rank:], b[..., rank:])
    assert np.count_nonzero(np.any(a != before, axis=-1)) == rows


def test_model_decode_writes_latents_in_the_absorb_kernel_on_gpu(monkeypatch):
    """`model.mla.LATENT_WRITE_IN_ABSORB`: the medium hybrid's first four layers (an MLA layer last) at batch 1, the
    latent rows written by the absorb kernel against the paged write kernel: the logits to bf16 rounding."""
    from dayzero.model import mla
    from medium_prefix_cases import prefilled_medium_prefix

    run, args = prefilled_medium_prefix(150, num_blocks=4, batch=1)
    monkeypatch.setattr(mla, "LATENT_WRITE_IN_ABSORB", False)
    plain, _ = run(*args, decode=True)
    monkeypatch.setattr(mla, "LATENT_WRITE_IN_ABSORB", True)
    fused, _ = run(*args, decode=True)
    a, b = np.asarray(fused, np.float64), np.asarray(plain, np.float64)
    assert np.all(np.isfinite(a)) and np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2


@pytest.mark.parametrize("heads", [16, 128])
def test_one_row_absorb_on_cuda_cores_on_gpu(heads):
    """`AbsorbTiles.cuda_cores` for one query row, compiled for real: q_nope . W_UK^T against float64 and against
    the MMA path to bf16 rounding, the rope columns copied exactly."""
    rng = np.random.default_rng(heads)
    q = jnp.asarray(rng.standard_normal((1, heads * (NOPE + ROPE))), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((RANK, heads * (NOPE + V))) / np.sqrt(RANK), jnp.bfloat16)
    absorb = jax.jit(lambda q, w, cuda: mla_absorb.absorb_queries(
        q, w, heads=heads, nope=NOPE, rope=ROPE, v_dim=V, tiles=mla_absorb.AbsorbTiles(cuda_cores=cuda)),
        static_argnums=2)
    (q_lat, q_rope), (mma_lat, mma_rope) = absorb(q, w, True), absorb(q, w, False)
    q64 = np.asarray(q, np.float64).reshape(1, heads, NOPE + ROPE)
    want = np.einsum("mhn,rhn->mhr", q64[..., :NOPE], np.asarray(w, np.float64).reshape(RANK, heads, NOPE + V)[
        ..., :NOPE])
    scale = np.max(np.abs(want))
    assert np.max(np.abs(np.asarray(q_lat, np.float64) - want)) <= 1e-2 * scale
    assert np.max(np.abs(np.asarray(q_lat, np.float64) - np.asarray(mma_lat, np.float64))) <= 1e-2 * scale
    np.testing.assert_array_equal(np.asarray(q_rope), np.asarray(mma_rope))
