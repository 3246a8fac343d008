"""The paged-cache, DSA indexer and sparse MLA Pallas kernels compiled for real (Triton) on the GPU, against their
references on fresh random inputs at DeepSeek-V3.2's shapes (latent 512 + 64, 128 heads, indexer 64 x 128), and a
DSA model whose cached decode must equal its full forward with the kernels on, up to a near-tie top-k flip
(`dsa_cases.assert_cached_matches_full`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_cases import assert_cached_matches_full, full_and_cached, full_forward, kernel_sized_dsa_config
from dayzero.kernels import attention, dispatch, fp8_indexer, indexer, paged
from dayzero.kernels.indexer_pallas import IndexerKernelConfig
from dayzero.kernels.sparse_mla import SparseMLAConfig
from dayzero.model import Model

pytestmark = pytest.mark.skipif(not any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices()),
                                reason="no GPU on this machine")

BLOCK = 64


@pytest.fixture
def seed():
    """A fresh seed per test (printed, and named by assertions that take it), so each run tries new inputs."""
    return int(np.random.SeedSequence().entropy % (2**32))


@pytest.fixture
def rng(seed):
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def tables_for(rng, batch, per_row, num_blocks):
    return jnp.asarray(rng.permutation(np.arange(1, num_blocks))[:batch * per_row].reshape(batch, per_row), jnp.int32)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("length", [1, 300])
def test_paged_write(rng, length):
    num_blocks, batch = 64, 4
    cache = jnp.asarray(rng.standard_normal((3, num_blocks, BLOCK, 576)), jnp.bfloat16)
    tables = tables_for(rng, batch, 8, num_blocks)
    start = rng.integers(0, 8 * BLOCK - length, batch)
    positions = jnp.asarray(start[:, None] + np.arange(length), jnp.int32)
    valid = jnp.asarray(rng.random((batch, length)) < 0.9)
    values = jnp.asarray(rng.standard_normal((batch, length, 576)), jnp.bfloat16)
    run = jax.jit(lambda impl, *a: paged.write(a[0], 1, *a[1:], impl=impl), static_argnums=0)
    ref = run("reference", cache, tables, positions, valid, values)
    got = run("pallas", cache, tables, positions, valid, values)
    keep = np.ones(cache.shape[:3], bool)
    keep[1, 0, 0] = False
    np.testing.assert_array_equal(np.asarray(got, np.float32)[keep], np.asarray(ref, np.float32)[keep])


def assert_same_selection(got, ref, scores, tol=2e-3):
    got, ref = np.asarray(got), np.asarray(ref)
    for b, t in np.ndindex(*got.shape[:2]):
        g, r = set(got[b, t].tolist()) - {-1}, set(ref[b, t].tolist()) - {-1}
        assert len(g) == len(r) == (got[b, t] >= 0).sum(), (b, t)
        if g != r:
            row = scores[b, t]
            boundary = min(row[list(r)])
            off = [k for k in g ^ r if abs(row[k] - boundary) > tol * np.max(np.abs(row[np.isfinite(row)]))]
            assert not off, f"({b}, {t}) differs beyond boundary ties: {len(off)} keys"


@pytest.mark.parametrize("topk_form, per_program, keys_as_rows", [
    ("on_chip", 16, True), ("two_level", 1, False), ("on_chip", 8, False), ("on_chip", 1, True),
    ("two_level", 4, True), ("two_level", 16, True)])  # the first: the default
@pytest.mark.parametrize("length, fp8", [(1, False), (1, True), (200, False), (200, True)])
def test_indexer_topk(rng, length, fp8, topk_form, per_program, keys_as_rows):
    batch, heads, dim, topk, per_row, num_blocks = 2, 64, 128, 2048, 96, 200  # 6144 keys per row
    tables = tables_for(rng, batch, per_row, num_blocks)
    keys = jnp.asarray(rng.standard_normal((2, num_blocks, BLOCK, dim)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((batch, length, heads, dim)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((batch, length, heads)), jnp.float32)
    context = np.array([per_row * BLOCK, 3000])
    positions = jnp.asarray(context[:, None] - length + np.arange(length), jnp.int32)
    q_scales = k_scales = None
    if fp8:
        q, q_scales = fp8_indexer.rotate_and_quantize(q)
        keys, k_scales = fp8_indexer.rotate_and_quantize(keys)
        k_scales = k_scales[..., None]
    else:
        q, keys = q.astype(jnp.bfloat16), keys.astype(jnp.bfloat16)
    config = IndexerKernelConfig(topk=topk_form, tiles_per_program=per_program, keys_as_rows=keys_as_rows,
                                 min_programs=1)  # the runs as asked for, however few programs
    run = jax.jit(lambda impl, *a: indexer.indexer_topk(*a[:4], 1, a[4], topk, dim ** -0.5, q_scales=a[5],
                                                        key_scales=a[6], impl=impl, config=config), static_argnums=0)
    args = (q, w, positions, keys, tables, q_scales, k_scales)  # arguments, not constants folded into the jit
    got, ref = run("pallas", *args), run("reference", *args)
    gathered = paged.gather(keys, 1, tables)
    qq = q
    if fp8:
        gathered = fp8_indexer.dequantize(gathered, paged.gather(k_scales, 1, tables)[..., 0])
        qq = fp8_indexer.dequantize(q, q_scales)
    scores = np.asarray(indexer.index_scores(qq, gathered, w, dim ** -0.5), np.float64)
    scores = np.where(np.arange(scores.shape[-1]) <= np.asarray(positions)[..., None], scores, -np.inf)
    assert_same_selection(got, ref, scores)


DEFAULT = SparseMLAConfig()  # decode: the fused variant; prefill 64 heads x 16 keys
HEADS_SPLIT = SparseMLAConfig(block_h=32, block_k=32, decode_block_k=32, min_split_tokens=256,
                              decode_variant="heads_split")


@pytest.mark.parametrize("length, dense, dtype, config", [
    (1, False, jnp.bfloat16, DEFAULT), (1, True, jnp.bfloat16, DEFAULT), (1, False, jnp.float32, DEFAULT),
    (64, False, jnp.bfloat16, DEFAULT), (64, True, jnp.float32, DEFAULT),
    (1, False, jnp.bfloat16, HEADS_SPLIT), (1, True, jnp.float32, HEADS_SPLIT), (64, False, jnp.bfloat16, HEADS_SPLIT)],
    ids=lambda v: getattr(v, "decode_variant", None))
def test_sparse_mla(rng, length, dense, dtype, config, heads=128):
    batch, rank, rope, topk, per_row, num_blocks = 4, 512, 64, 2048, 64, 300
    tables = tables_for(rng, batch, per_row, num_blocks)
    cache = jnp.asarray(rng.standard_normal((2, num_blocks, BLOCK, rank + rope)), dtype)
    context = rng.integers(length + 1, per_row * BLOCK, batch)
    positions = context[:, None] - length + np.arange(length)
    q_lat = jnp.asarray(rng.standard_normal((batch, length, heads, rank)) * 0.05, dtype)
    q_rope = jnp.asarray(rng.standard_normal((batch, length, heads, rope)) * 0.05, dtype)
    idx = None
    if not dense:
        idx = np.stack([[np.sort(rng.choice(p + 1, min(topk, p + 1), replace=False)).tolist()
                         + [-1] * (topk - min(topk, p + 1)) for p in row] for row in positions])
        idx = jnp.asarray(idx, jnp.int32)
    run = jax.jit(lambda impl, *a: attention.sparse_mla(*a[:3], 1, *a[3:], 576 ** -0.5, impl=impl, config=config),
                  static_argnums=0)
    args = (q_lat, q_rope, cache, tables, jnp.asarray(positions, jnp.int32), idx)
    got, ref = run("pallas", *args), run("reference", *args)
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    assert rel_err(got, ref) < tol, rel_err(got, ref)


# decode at one tensor-parallel rank's heads (16 of 128): the tunings benchmarks/sparse_attention.py sweeps there
SMALL_HEAD_TUNINGS = {"default": DEFAULT, "w8": SparseMLAConfig(small_decode_warps=8),
                      "s64": SparseMLAConfig(min_split_tokens=64), "k64": SparseMLAConfig(decode_block_k=64),
                      "static": SparseMLAConfig(dense_even_splits=False),
                      "st3": SparseMLAConfig(num_stages=3), "s32": SparseMLAConfig(min_split_tokens=32)}


@pytest.mark.parametrize("tuning", list(SMALL_HEAD_TUNINGS))
@pytest.mark.parametrize("dense, dtype", [(False, jnp.bfloat16), (True, jnp.bfloat16), (False, jnp.float32)])
def test_sparse_mla_decode_16_heads(rng, dense, dtype, tuning):
    test_sparse_mla(rng, 1, dense, dtype, SMALL_HEAD_TUNINGS[tuning], heads=16)


@pytest.mark.parametrize("fp8", [False, True])
def test_dsa_model_decode_equals_full_forward(rng, seed, monkeypatch, fp8):
    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    config = kernel_sized_dsa_config().replace(index_fp8=fp8)
    model = Model.random(config, dtype="float32", seed=int(rng.integers(1000)))
    prompt, total, batch = 100, 140, 2
    seq = jnp.asarray(rng.integers(3, 256, (batch, total)), jnp.int32)
    tables = jnp.asarray([[7, 2, 9], [4, 8, 1]], jnp.int32)
    with jax.default_matmul_precision("highest"):
        full, cached, full_sel, cached_sel = full_and_cached(model, seq, prompt, tables)
        assert_cached_matches_full(full, cached, full_sel, cached_sel, prompt, seed)
        if fp8:
            # Not compared with the reference here: the Triton kernel's e4m3 score products round differently from
            # the reference's (the op-level test_indexer_topk bounds that: selections equal up to ties within 2e-3
            # of the score scale), and in this small random model one swapped key of 48 moves the logits by 0.1
            # (seeds 791416543 and 3699880609 on an H200, also at highest matmul precision; interpret mode on the
            # CPU agrees with the reference to 5e-7).
            return
        monkeypatch.setenv(dispatch.ENV_OVERRIDE, "reference")
        ref_full = np.asarray(full_forward(model, seq)[0])[:, prompt - 1:-1]
    assert rel_err(full, ref_full) < 1e-3
