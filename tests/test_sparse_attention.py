"""The paged-cache, DSA indexer and sparse MLA kernels (Pallas, interpret mode on CPU) against their references.

Fresh random inputs every run (the `seed` fixture prints the seed; DAYZERO_TEST_SEED replays it). Block tables hold
scattered, reordered blocks; lengths are not multiples of the tiles; top-k results are compared as sets, where a
swap is accepted only between keys whose reference scores tie at the selection boundary. Every kernel must also
lower to a Triton call for CUDA (tests/triton_lowering.py), at DeepSeek-V3.2's shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triton_lowering import count_triton_kernels
from dayzero.kernels import (attention, fp8_indexer, indexer, indexer_pallas, paged, paged_pallas, sparse_mla, topk,
                             topk_pallas)

LAYERS, BLOCKS, BLOCK = 2, 14, 64
LAYER = 1
# the default decode kernel (keys x heads, runs of up to 16 key tiles: here one run per row, past its keys), small tiles
IDX_CFG = indexer_pallas.IndexerKernelConfig(block_k=32, block_q=16, score_bytes=4 * 2 * 16 * 320, min_programs=1)
# heads x keys, one tile per program; the top-k by XLA sorts in two levels instead of on chip
IDX_TWO_LEVEL = dataclasses.replace(IDX_CFG, topk="two_level", keys_as_rows=False, tiles_per_program=1)
# heads x keys, 4 key tiles per program; the top-k on chip (kernels/topk_pallas.py)
IDX_RUNS = dataclasses.replace(IDX_TWO_LEVEL, tiles_per_program=4, topk="on_chip")
# keys x heads, runs of 2 tiles; two levels of sorts
IDX_KEYS_ROWS = dataclasses.replace(IDX_CFG, tiles_per_program=2, topk="two_level")
MLA_CFG = sparse_mla.SparseMLAConfig(block_h=16, block_k=8, decode_block_k=8, decode_programs=64, min_split_tokens=8,
                                     decode_variant="heads_split")  # decode splits
# Whole ops under jit: one compilation per shape instead of one per eager op.
topk_op = jax.jit(indexer.indexer_topk, static_argnums=(4, 6, 7), static_argnames=("impl", "config"))
mla_op = jax.jit(attention.sparse_mla, static_argnums=(3, 7), static_argnames=("impl", "config"))
write_op = jax.jit(paged.write, static_argnums=(1,), static_argnames=("impl",))
scores_op = jax.jit(indexer.index_scores, static_argnums=(3,))


def scattered_tables(rng, batch, per_row):
    """Distinct blocks (never the scratch block 0) in random order for each row."""
    blocks = rng.permutation(np.arange(1, BLOCKS))[:batch * per_row]
    return jnp.asarray(blocks.reshape(batch, per_row), jnp.int32)


def positions(rng, batch, length, context):
    """Row b holds the last `length` tokens of a context of context[b] tokens."""
    return jnp.asarray(np.stack([np.arange(c - length, c) for c in context]), jnp.int32)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def reference_scores(q, w, pos, key_cache, tables, scale, q_scales=None, key_scales=None):
    keys = paged.gather(key_cache, LAYER, tables)
    if key_scales is not None:
        keys = fp8_indexer.dequantize(keys, paged.gather(key_scales, LAYER, tables)[..., 0])
        q = fp8_indexer.dequantize(q, q_scales)
    scores = np.asarray(scores_op(q, keys, w, scale), np.float64)
    return np.where(np.arange(keys.shape[1]) <= np.asarray(pos)[..., None], scores, -np.inf)


def assert_same_selection(got, ref, scores, what, tol=1e-5):
    """got/ref [B, T, K] key indices (-1 = none) select the same keys, up to swaps of boundary ties."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape and got.dtype == np.int32, (what, got.shape, got.dtype)
    for b, t in np.ndindex(*got.shape[:2]):
        g, r = set(got[b, t].tolist()) - {-1}, set(ref[b, t].tolist()) - {-1}
        assert len(g) == len(got[b, t][got[b, t] >= 0]), f"{what}: duplicate selections at ({b}, {t})"
        assert len(g) == len(r), f"{what}: ({b}, {t}) selected {len(g)} keys, reference {len(r)}"
        if g != r:
            row = scores[b, t]
            boundary = min(row[list(r)])
            scale = max(np.max(np.abs(row[np.isfinite(row)])), 1e-30)
            off = [k for k in g ^ r if abs(row[k] - boundary) > tol * scale]
            assert not off, f"{what}: ({b}, {t}) differs beyond boundary ties: {sorted(off)}"


# ------------------------------------------------------------------------------------------------------ paged write


@pytest.mark.parametrize("length", [1, 37])
def test_paged_write_kernels_match_reference(seed, length):
    rng = np.random.default_rng(seed)
    batch, width = 3, 20
    cache = jnp.asarray(rng.standard_normal((LAYERS, BLOCKS, BLOCK, width)), jnp.float32)
    tables = scattered_tables(rng, batch, 4)
    pos = positions(rng, batch, length, [length, 64 + length // 2, 250])  # crosses block boundaries
    valid = jnp.asarray(rng.random((batch, length)) < 0.85)
    values = jnp.asarray(rng.standard_normal((batch, length, width)), jnp.float32)
    ref = paged.write_reference(cache, LAYER, tables, pos, valid, values)
    got = write_op(cache, LAYER, tables, pos, valid, values, impl="interpret")
    keep = np.ones(cache.shape[:3], bool)
    keep[LAYER, 0, 0] = False  # the scratch row takes whichever invalid token came last
    np.testing.assert_array_equal(np.asarray(got)[keep], np.asarray(ref)[keep], err_msg=f"seed={seed}")
    assert not np.array_equal(np.asarray(ref), np.asarray(cache)), "nothing written: test is vacuous"


@pytest.mark.parametrize("norm", [False, True])
def test_paged_write_finishes_partial_sums(seed, norm):
    """One token per request as a projection's K-split `projection.Partials` (the latent rows,
    `model.mla.PROJECTION_PARTIALS`): the decode kernel finishes them as it loads them, with the leading norm or
    without, and stores bit for bit what it stores for the finished rows; the XLA form finishes them first; they lower
    to one Triton kernel. Partial sums of another width are refused by name."""
    from dayzero.kernels import projection

    rng = np.random.default_rng(seed)
    batch, width = 3, 24
    cache = jnp.asarray(rng.standard_normal((LAYERS, BLOCKS, BLOCK, width)), jnp.bfloat16)
    tables = scattered_tables(rng, batch, 4)
    pos = positions(rng, batch, 1, [1, 70, 250])
    valid = jnp.asarray([[True], [True], [False]])
    parts = projection.Partials(jnp.asarray(rng.standard_normal((4, batch, width)), jnp.float32),
                                jnp.asarray(rng.uniform(1, 3, (4, batch)), jnp.float32), 64, 1e-6, "bfloat16")
    lead = paged.LeadingNorm(jnp.asarray(rng.uniform(0.5, 1.5, 16), jnp.bfloat16), 16, 1e-6) if norm else None
    finished = projection.finished(parts)[:, None]
    for impl in ("interpret", "reference"):
        got = paged.write(cache, LAYER, tables, pos, valid, parts, impl=impl, norm=lead)
        want = paged.write(cache, LAYER, tables, pos, valid, finished, impl=impl, norm=lead)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        assert not np.array_equal(np.asarray(got, np.float32), np.asarray(cache, np.float32))
    with pytest.raises(ValueError, match="partial sums"):
        paged.write(cache, LAYER, tables, pos, valid, projection.Partials(parts.sums[..., :8], parts.squares, 64,
                                                                          1e-6, "bfloat16"), impl="interpret")
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    medium = lambda c, t, p, v, s, sq, w: paged.write(c, 0, t, p, v, projection.Partials(s, sq, 2048, 1e-5, "bfloat16"),
                                                      impl="pallas", norm=paged.LeadingNorm(w, 512, 1e-6))
    assert count_triton_kernels(medium, spec(4, 64, 64, 576), spec(1, 16, dtype=jnp.int32),
                                spec(1, 1, dtype=jnp.int32), spec(1, 1, dtype=jnp.bool_),
                                spec(8, 1, 576, dtype=jnp.float32), spec(8, 1, dtype=jnp.float32), spec(512)) == 1


# ----------------------------------------------------------------------------------------------------------- top-k


def tied_scores(rng, rows, num_keys):
    """Score rows [rows >= 4, num_keys] f32 of heavy ties; row 0 allows 50 keys, row 1 none, row 2 about half."""
    scores = rng.integers(-20, 20, (rows, num_keys)).astype(np.float32)
    scores[0, 50:] = -np.inf  # fewer allowed keys than k
    scores[1] = -np.inf
    scores[2, rng.random(num_keys) < 0.5] = -np.inf
    return scores


@pytest.mark.parametrize("num_keys, k", [(5000, 16), (20_000, 100), (600, 200)])
def test_two_level_topk_equals_one_level(seed, num_keys, k):
    rng = np.random.default_rng(seed)
    scores = tied_scores(rng, 4, num_keys)
    one = np.asarray(topk.one_level(jnp.asarray(scores), k))
    two = np.asarray(topk.two_level(jnp.asarray(scores), k, direct_below=2))
    np.testing.assert_array_equal(two, one, err_msg=f"seed={seed}")
    assert (one[0] >= 0).sum() == min(50, k) and (one[1] == -1).all()


@pytest.mark.parametrize("num_keys, k, max_keys", [
    (5000, 16, 8192), (600, 200, 1024), (150, 200, 1024),  # one pass
    (9000, 64, 1024), (20_000, 100, 2048), (3000, 256, 1024),  # two
    (20_000, 100, 512)])  # four: 313 maxima of 64, then 400 of 16 among 6400 candidates, then 400 of 4 among 1600
def test_on_chip_select_equals_one_level(seed, num_keys, k, max_keys):
    """The on-chip top-k (interpret mode) in one pass (rows of at most `max_keys`) and in more (sub-block maxima, then
    their scores): `lax.top_k`'s keys (ties to the lowest index, through every pass), in index order, -1 after them;
    -0.0 ties 0.0; rows of fewer allowed keys than k, and of none."""
    rng = np.random.default_rng(seed)
    scores = tied_scores(rng, 6, num_keys)
    scores[3] = rng.standard_normal(num_keys).astype(np.float32) * np.float32(1e-30)  # tiny, both signs
    scores[4] = np.where(rng.random(num_keys) < 0.5, -0.0, 0.0) * (rng.random(num_keys) < 0.9)
    scores[5] = rng.standard_normal(num_keys).astype(np.float32)  # no ties: the very indices
    plain = np.where(scores == 0, 0.0, scores)
    one = np.asarray(topk.one_level(jnp.asarray(plain), k))
    assert topk_pallas.fits(num_keys, k, max_keys)
    got = np.asarray(jax.jit(lambda s: topk_pallas.select(s, k, max_keys, interpret=True))(jnp.asarray(scores)))
    assert got.shape == (6, k) and got.dtype == np.int32
    for r in range(6):
        chosen = got[r][got[r] >= 0]
        np.testing.assert_array_equal(chosen, np.sort(one[r][one[r] >= 0]), f"row {r} (seed={seed})")
        assert np.all(got[r][len(chosen):] == -1), f"row {r} (seed={seed})"
    assert not topk_pallas.fits(40_000, 1500, 2048)  # the candidates of 1500 sub-blocks would not shrink the row
    with pytest.raises(ValueError, match="fits"):
        topk_pallas.select(jnp.asarray(np.zeros((1, 40_000), np.float32)), 1500, 2048)
    with pytest.raises(ValueError, match="topk"):
        indexer_pallas.IndexerKernelConfig(topk="sorted")


# --------------------------------------------------------------------------------------------------------- indexer


def indexer_inputs(rng, batch, length, context, heads=5, dim=None, fp8=False):
    dim = dim or (16 if fp8 else 12)  # the Hadamard rotation needs a power of two
    tables = scattered_tables(rng, batch, 5)
    keys = rng.standard_normal((LAYERS, BLOCKS, BLOCK, dim)).astype(np.float32)
    q = rng.standard_normal((batch, length, heads, dim)).astype(np.float32)
    w = rng.standard_normal((batch, length, heads)).astype(np.float32)
    pos = positions(rng, batch, length, context)
    if not fp8:
        return jnp.asarray(q), jnp.asarray(w), pos, jnp.asarray(keys), tables, None, None
    q8, q_scales = fp8_indexer.rotate_and_quantize(jnp.asarray(q))
    k8, k_scales = fp8_indexer.rotate_and_quantize(jnp.asarray(keys))
    return q8, jnp.asarray(w), pos, k8, tables, q_scales, k_scales[..., None]


@pytest.mark.parametrize("length, context, k, fp8", [
    (1, [300, 77], 21, False),  # decode rows kernel; topk below the context
    (3, [130, 5], 40, True),  # rows kernel, FP8; row 1 has fewer keys than topk
    (37, [37, 290], 20, False),  # prefill tiles kernel, three query chunks, many key tiles skipped
    (21, [100, 60], 200, True),  # tiles kernel, FP8; topk above the context (320 cached slots > topk)
])
@pytest.mark.parametrize("config", [IDX_CFG, IDX_TWO_LEVEL, IDX_RUNS, IDX_KEYS_ROWS],
                         ids=lambda c: f"{c.topk}_x{c.tiles_per_program}{'_keys_rows' * c.keys_as_rows}")
def test_indexer_topk_matches_reference(seed, length, context, k, fp8, config):
    rng = np.random.default_rng(seed)
    q, w, pos, keys, tables, q_scales, k_scales = indexer_inputs(rng, 2, length, context, fp8=fp8)
    args = (q, w, pos, keys, LAYER, tables, k, 0.3)
    ref = topk_op(*args, q_scales=q_scales, key_scales=k_scales, impl="reference")
    got = topk_op(*args, q_scales=q_scales, key_scales=k_scales, impl="interpret", config=config)
    scores = reference_scores(q, w, pos, keys, tables, 0.3, q_scales, k_scales)
    assert_same_selection(got, ref, scores, f"indexer T={length} k={k} fp8={fp8} seed={seed}")
    allowed = np.minimum(np.asarray(pos) + 1, k)
    assert ((np.asarray(got) >= 0).sum(-1) == allowed).all(), f"seed={seed}"


def test_decode_runs_shorten_until_the_grid_fills():
    cfg = indexer_pallas.IndexerKernelConfig(tiles_per_program=16, min_programs=512)
    runs = indexer_pallas.decode_tiles_per_program
    assert runs(cfg, 16, 1024) == 16  # batch 16 at 128K keys: 1024 programs
    assert runs(cfg, 16, 64) == 2  # batch 16 at 8K: 512 programs of 2 tiles
    assert runs(cfg, 1, 4096) == 8 and runs(cfg, 1, 64) == 1
    assert runs(dataclasses.replace(cfg, min_programs=1), 1, 5) == 8  # one run past the row's 5 tiles


@pytest.mark.parametrize("keys_as_rows", [False, True])
@pytest.mark.parametrize("per_program", [1, 2, 8])
def test_decode_scores_by_runs_of_key_tiles(seed, per_program, keys_as_rows):
    """The decode score kernel walking `per_program` key tiles per program, its dot as heads x keys or keys x heads:
    scores equal the reference's where a key is allowed and are -inf elsewhere, with runs that are whole, partly and
    not at all before the position."""
    rng = np.random.default_rng(seed)
    q, w, pos, keys, tables, _, _ = indexer_inputs(rng, 2, 1, [320, 97])
    cfg = dataclasses.replace(IDX_CFG, tiles_per_program=per_program, keys_as_rows=keys_as_rows)
    got = np.asarray(indexer_pallas.row_scores(q, w * 0.3, pos, keys, LAYER, tables, config=cfg, interpret=True))
    want = reference_scores(q, w, pos, keys, tables, 0.3).reshape(2, -1)
    assert got.shape[1] % (32 * per_program) == 0 and got.shape[1] >= want.shape[1], got.shape
    np.testing.assert_allclose(got[:, :want.shape[1]], want, rtol=1e-5, atol=1e-5, err_msg=f"seed={seed}")
    assert np.all(got[:, want.shape[1]:] == -np.inf)


@pytest.mark.parametrize("config", [IDX_CFG, IDX_TWO_LEVEL], ids=lambda c: c.topk)
def test_indexer_exact_ties_break_to_lower_position(seed, config):
    """Integer q and keys, power-of-two weights and scale: scores are exact, with massive ties (one head: every
    key with q . k <= 0 scores exactly 0). Kernel and reference must pick the very same keys."""
    rng = np.random.default_rng(seed)
    batch, length, dim = 2, 17, 16
    tables = scattered_tables(rng, batch, 5)
    keys = jnp.asarray(rng.integers(-1, 2, (LAYERS, BLOCKS, BLOCK, dim)), jnp.float32)
    q = jnp.asarray(rng.integers(-1, 2, (batch, length, 1, dim)), jnp.float32)
    w = jnp.asarray(rng.choice([-2.0, -0.5, 0.5, 4.0], (batch, length, 1)), jnp.float32)
    pos = positions(rng, batch, length, [300, 150])
    args = (q, w, pos, keys, LAYER, tables, 24, 0.25)
    ref = np.asarray(topk_op(*args, impl="reference"))
    got = np.asarray(topk_op(*args, impl="interpret", config=config))
    scores = reference_scores(q, w, pos, keys, tables, 0.25)
    kth = np.sort(scores, axis=-1)[..., -24]
    assert ((scores == kth[..., None]).sum(-1) > 1).any(), "no tie at the boundary: test is vacuous"
    np.testing.assert_array_equal(np.sort(got, -1), np.sort(ref, -1), err_msg=f"seed={seed}")


def test_contiguous_and_paged_give_identical_results(seed):
    """A sequence written into scattered blocks of a paged cache, or viewed contiguously: the kernels give the same
    selection and the same attention output (bit for bit), equal to the reference's."""
    rng = np.random.default_rng(seed)
    batch, length, heads = 2, 75, 3
    tables = scattered_tables(rng, batch, 2)
    all_pos = positions(rng, batch, length, [length, length])
    keys = jnp.asarray(rng.standard_normal((batch, length, 8)), jnp.float32)
    latents = jnp.asarray(rng.standard_normal((batch, length, 16)), jnp.float32)
    key_paged = paged.write_reference(jnp.zeros((LAYERS, BLOCKS, BLOCK, 8)), LAYER, tables, all_pos,
                                      jnp.ones((batch, length), bool), keys)
    lat_paged = paged.write_reference(jnp.zeros((LAYERS, BLOCKS, BLOCK, 16)), LAYER, tables, all_pos,
                                      jnp.ones((batch, length), bool), latents)
    key_contig, contig_tables = paged.contiguous(keys)
    lat_contig, _ = paged.contiguous(latents)
    q = jnp.asarray(rng.standard_normal((batch, length, 4, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((batch, length, 4)), jnp.float32)
    q_lat = jnp.asarray(rng.standard_normal((batch, length, heads, 12)), jnp.float32)
    q_rope = jnp.asarray(rng.standard_normal((batch, length, heads, 4)), jnp.float32)
    kernels = dict(impl="interpret")
    sel_paged = topk_op(q, w, all_pos, key_paged, LAYER, tables, 10, 0.3, config=IDX_CFG, **kernels)
    sel_contig = topk_op(q, w, all_pos, key_contig, 0, contig_tables, 10, 0.3, config=IDX_CFG,
                                      **kernels)
    np.testing.assert_array_equal(sel_paged, sel_contig, err_msg=f"seed={seed}")
    scores = reference_scores(q, w, all_pos, key_paged, tables, 0.3)
    assert_same_selection(sel_paged, topk_op(q, w, all_pos, key_contig, 0, contig_tables, 10, 0.3,
                                                          impl="reference"), scores, f"seed={seed}")
    out_paged = mla_op(q_lat, q_rope, lat_paged, LAYER, tables, all_pos, sel_paged, 0.2,
                                     config=MLA_CFG, **kernels)
    out_contig = mla_op(q_lat, q_rope, lat_contig, 0, contig_tables, all_pos, sel_contig, 0.2,
                                      config=MLA_CFG, **kernels)
    np.testing.assert_array_equal(out_paged, out_contig, err_msg=f"seed={seed}")
    ref = mla_op(q_lat, q_rope, lat_contig, 0, contig_tables, all_pos, sel_contig, 0.2,
                               impl="reference")
    assert rel_err(out_paged, ref) < 1e-5, f"seed={seed}"


# ------------------------------------------------------------------------------------------------------ sparse MLA


def random_selection(rng, pos, k):
    """Per query, up to k - 2 distinct causal keys in random order, then -1 padding (no keys for pos -1)."""
    out = -np.ones((*pos.shape, k), np.int32)
    for b, t in np.ndindex(*pos.shape):
        if pos[b, t] >= 0:
            n = min(k - 2, pos[b, t] + 1)
            out[b, t, :n] = rng.choice(pos[b, t] + 1, n, replace=False)
    return jnp.asarray(out)


@pytest.mark.parametrize("length, k, dtype", [
    (1, 45, jnp.float32),  # decode: split over several programs
    (1, None, jnp.float32),  # dense decode (MLA without DSA)
    (5, 30, jnp.float32),  # prefill, a padding query
    (5, None, jnp.bfloat16),  # dense prefill, bf16
])
def test_sparse_mla_matches_reference(seed, length, k, dtype):
    rng = np.random.default_rng(seed)
    batch, heads, rank, rope = 2, 3, 12, 4
    tables = scattered_tables(rng, batch, 5)
    cache = jnp.asarray(rng.standard_normal((LAYERS, BLOCKS, BLOCK, rank + rope)), dtype)
    pos = np.array(positions(rng, batch, length, [300, 70]))
    if length > 1:
        pos[1, 2] = -1  # a padding token: zeros
    q_lat = jnp.asarray(rng.standard_normal((batch, length, heads, rank)), dtype)
    q_rope = jnp.asarray(rng.standard_normal((batch, length, heads, rope)), dtype)
    idx = None if k is None else random_selection(rng, pos, k)
    args = (q_lat, q_rope, cache, LAYER, tables, jnp.asarray(pos), idx, 0.2)
    ref = mla_op(*args, impl="reference")
    got = mla_op(*args, impl="interpret", config=MLA_CFG)
    assert got.shape == ref.shape and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert rel_err(got, ref) < tol, f"relative error {rel_err(got, ref):.2e} (seed={seed})"
    if length > 1:
        assert np.all(np.asarray(got, np.float32)[1, 2] == 0), f"padding query is not zero (seed={seed})"


@pytest.mark.parametrize("k, dtype, block_h, even", [
    (45, jnp.float32, 16, False),  # odd top-k, -1 padding, 3 heads padded to one head block
    (None, jnp.float32, 2, False),  # dense decode, static split ranges; two head blocks (the grid's innermost axis)
    (37, jnp.bfloat16, 16, False),  # bf16: partials in bf16
    (None, jnp.float32, 2, True),  # dense decode, live chunks dealt out evenly
    (None, jnp.bfloat16, 16, True),
    (45, jnp.float32, 16, True),  # a selection: even splits leave its static ranges
])
def test_fused_decode_matches_reference(seed, k, dtype, block_h, even):
    rng = np.random.default_rng(seed)
    batch, heads, rank, rope = 3, 3, 12, 4
    tables = scattered_tables(rng, batch, 4)
    cache = jnp.asarray(rng.standard_normal((LAYERS, BLOCKS, BLOCK, rank + rope)), dtype)
    pos = np.array(positions(rng, batch, 1, [250, 70, 1]))  # row 2: a single key
    q_lat = jnp.asarray(rng.standard_normal((batch, 1, heads, rank)), dtype)
    q_rope = jnp.asarray(rng.standard_normal((batch, 1, heads, rope)), dtype)
    idx = None if k is None else random_selection(rng, pos, k)
    args = (q_lat, q_rope, cache, LAYER, tables, jnp.asarray(pos), idx, 0.2)
    cfg = sparse_mla.SparseMLAConfig(block_h=block_h, block_k=8, decode_block_k=8, decode_programs=64,
                                     min_split_tokens=8, decode_variant="fused", dense_even_splits=even)
    ref = mla_op(*args, impl="reference")
    got = mla_op(*args, impl="interpret", config=cfg)
    assert got.shape == ref.shape and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert rel_err(got, ref) < tol, f"relative error {rel_err(got, ref):.2e} (seed={seed})"


def test_fused_decode_cache_rows_computed_once_for_all_layers():
    """Dense decode (no DSA selection): every MLA layer of a step reads the same keys at its own layer's rows. The
    keys' cache rows are computed without the layer (the kernel adds its first row), so XLA makes them once for all
    layers: one fusion, where a layer offset in them made one per layer (plus the shared table lookup)."""
    rng = np.random.default_rng(0)
    batch, heads, rank, rope = 2, 3, 12, 4
    cfg = sparse_mla.SparseMLAConfig(block_h=16, block_k=8, decode_block_k=8, decode_programs=64,
                                     min_split_tokens=8, decode_variant="fused")
    cache = jnp.asarray(rng.standard_normal((LAYERS, BLOCKS, BLOCK, rank + rope)), jnp.float32)
    tables = scattered_tables(rng, batch, 4)
    pos = jnp.asarray([[200], [30]], jnp.int32)
    q_lat = jnp.asarray(rng.standard_normal((batch, 1, heads, rank)), jnp.float32)
    q_rope = jnp.asarray(rng.standard_normal((batch, 1, heads, rope)), jnp.float32)

    def both_layers(q_lat, q_rope, cache, tables, pos):
        return [attention.sparse_mla(q_lat, q_rope, cache, layer, tables, pos, None, 0.2, impl="interpret",
                                     config=cfg) for layer in range(LAYERS)]

    hlo = jax.jit(both_layers).lower(q_lat, q_rope, cache, tables, pos).compile().as_text()
    keys = tables.shape[1] * BLOCK
    entry = hlo[hlo.index("\nENTRY"):]
    rows = [line for line in entry.splitlines() if f"= s32[{batch},{keys}]" in line]
    assert len(rows) == 1, f"the keys' cache rows are made {len(rows)} times: {rows}"
    got = both_layers(q_lat, q_rope, cache, tables, pos)  # and each layer still reads its own rows
    for layer, out in enumerate(got):
        ref = attention.sparse_mla(q_lat, q_rope, cache, layer, tables, pos, None, 0.2, impl="reference")
        assert rel_err(out, ref) < 1e-5, f"layer {layer}: relative error {rel_err(out, ref):.2e}"


@pytest.mark.parametrize("splits, chunks_per_split", [(1, 9), (4, 3), (8, 16), (256, 4)])
def test_even_split_chunks_partition_the_live_chunks(splits, chunks_per_split):
    """Dense decode with even splits: the splits' ranges tile [0, live) in order, none longer than ceil(live /
    splits) or its static share; without `live` the static ranges."""
    for live in sorted({0, 1, 2, splits - 1, splits, splits + 1, splits * chunks_per_split // 2,
                        splits * chunks_per_split}):
        ranges = [tuple(int(v) for v in sparse_mla.split_chunks(s, splits, chunks_per_split, jnp.int32(live)))
                  for s in range(splits)]
        assert [c for first, last in ranges for c in range(first, last)] == list(range(live)), (splits, live)
        assert max(last - first for first, last in ranges) <= min(chunks_per_split, -(-live // splits)), live
    assert [sparse_mla.split_chunks(s, splits, chunks_per_split, None) for s in range(2)] == [
        (0, chunks_per_split), (chunks_per_split, 2 * chunks_per_split)]


def test_decode_splits():
    """Splits of about decode_programs programs with at least 128 keys each; 16-head blocks at least 8 splits of at
    least 32 keys (the medium hybrid at a 4-block table: 8 splits, where the 128-key rule gave 2)."""
    cfg = sparse_mla.SparseMLAConfig()
    assert sparse_mla.decode_splits(1, 256, 16, cfg) == 8 and sparse_mla.decode_splits(16, 256, 16, cfg) == 8
    assert sparse_mla.decode_splits(1, 33024, 16, cfg) == 256 and sparse_mla.decode_splits(16, 33024, 16, cfg) == 32
    assert sparse_mla.decode_splits(1, 100, 16, cfg) == 2 and sparse_mla.decode_splits(1, 20, 16, cfg) == 1
    assert sparse_mla.decode_splits(2, 2048, 64, cfg) == 16  # DeepSeek-V3.2 at one request: two 64-head blocks
    assert sparse_mla.decode_splits(2, 256, 64, cfg) == 2  # large head blocks keep the 128-key rule
    assert sparse_mla.decode_splits(1, 256, 16, sparse_mla.SparseMLAConfig(small_head_min_splits=1)) == 2


def test_fused_decode_combine_handles_empty_splits():
    """Splits that saw no key (lse -inf) get weight 0; a row no split saw comes out zero."""
    out = jnp.asarray(np.arange(2 * 3 * 1 * 2, dtype=np.float32).reshape(2, 3, 1, 2))
    lse = jnp.asarray([[[-jnp.inf], [0.0], [np.log(3.0)]], [[-jnp.inf]] * 3], jnp.float32)
    got = np.asarray(sparse_mla.combine_normalized(out, lse, jnp.float32))
    np.testing.assert_allclose(got[0, 0], (np.array([2.0, 3.0]) + 3 * np.array([4.0, 5.0])) / 4, rtol=1e-6)
    np.testing.assert_array_equal(got[1], 0)
    with pytest.raises(ValueError):
        sparse_mla.SparseMLAConfig(decode_variant="nope")


# ---------------------------------------------------------------------------------------------------------- FP8


def test_fp8_quantization(seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((64, 128)) * rng.uniform(0.01, 100, (64, 1)), jnp.float32)
    h = fp8_indexer.hadamard_matrix(128)
    np.testing.assert_allclose(h @ h.T, np.eye(128), atol=1e-6)
    rotated = fp8_indexer.rotate(x)
    r64, x64 = np.asarray(rotated, np.float64), np.asarray(x, np.float64)
    assert rel_err(r64 @ r64.T, x64 @ x64.T) < 1e-5, "the rotation changed dot products"
    assert not np.allclose(r64, x64), "the rotation did nothing: test is vacuous"
    x8, scales = fp8_indexer.quantize(rotated)
    assert x8.dtype == jnp.float8_e4m3fn and scales.shape == (64,)
    mantissa, _ = np.frexp(np.asarray(scales))
    assert np.all(mantissa == 0.5), "scales are not powers of two"
    back = np.asarray(fp8_indexer.dequantize(x8, scales))
    bound = 2.0 ** -4 * np.abs(np.asarray(rotated)) + np.asarray(scales)[:, None] * 2.0 ** -9
    assert np.all(np.abs(back - np.asarray(rotated)) <= bound), f"e4m3 rounding out of bounds (seed={seed})"
    assert np.all(np.max(np.abs(np.asarray(x8, np.float32)), -1) >= 224), "scale wastes the e4m3 range"


def test_fp8_indexer_selection_close_to_exact(seed):
    """FP8 mode vs exact mode on indexer-like inputs: most of the top-k survives (see README for measured
    figures at DeepSeek-V3.2's shapes)."""
    rng = np.random.default_rng(seed)
    batch, length, heads, dim, k = 1, 8, 16, 128, 128
    q, w, pos, keys, tables, _, _ = indexer_inputs(rng, batch, length, [320], heads=heads, dim=dim)
    keys = keys + jnp.asarray(rng.standard_normal((1, 1, 1, dim)), jnp.float32)  # a shared direction, as real keys
    exact = np.asarray(topk_op(q, w, pos, keys, LAYER, tables, k, dim ** -0.5,
                                            impl="reference"))
    q8, q_scales = fp8_indexer.rotate_and_quantize(q)
    k8, k_scales = fp8_indexer.rotate_and_quantize(keys)
    fp8 = np.asarray(topk_op(q8, w, pos, k8, LAYER, tables, k, dim ** -0.5, q_scales=q_scales,
                                          key_scales=k_scales[..., None], impl="reference"))
    recall = np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(exact.reshape(-1, k), fp8.reshape(-1, k))])
    assert recall > 0.93, f"FP8 top-k recall {recall:.3f} (seed={seed})"


# ---------------------------------------------------------------------------------------------- Triton lowering

S = jax.ShapeDtypeStruct
BF16, I32, F32, E4M3 = jnp.bfloat16, jnp.int32, jnp.float32, jnp.float8_e4m3fn
V32_LATENT = S((4, 512, 64, 576), BF16)  # 4 MLA layers' latents (512 + 64 rope)
V32_KEYS, V32_SCALES = S((4, 512, 64, 128), BF16), S((4, 512, 64, 1), F32)


def _write(length):
    return (lambda c, t, p, v, x: paged_pallas.write(c, 2, t, p, v, x),
            (V32_LATENT, S((4, 32), I32), S((4, length), I32), S((4, length), jnp.bool_), S((4, length, 576), BF16)))


def _indexer(length, fp8, config=indexer_pallas.IndexerKernelConfig()):
    keys = S(V32_KEYS.shape, E4M3 if fp8 else BF16)
    q = S((2, length, 64, 128), E4M3 if fp8 else BF16)
    fn = (lambda q, w, p, c, t, s: indexer_pallas.indexer_topk(q, w, p, c, 3, t, 2048, key_scales=s,
                                                               config=config)) if fp8 else (
        lambda q, w, p, c, t: indexer_pallas.indexer_topk(q, w, p, c, 3, t, 2048, config=config))
    args = (q, S((2, length, 64), F32), S((2, length), I32), keys, S((2, 128), I32))
    return fn, args + ((V32_SCALES,) if fp8 else ())


HEADS_SPLIT = sparse_mla.SparseMLAConfig(block_h=32, block_k=32, decode_block_k=32, min_split_tokens=256,
                                         decode_variant="heads_split")


def _sparse(length, dense, config=sparse_mla.SparseMLAConfig()):
    def fn(ql, qr, c, t, p, i):
        return sparse_mla.sparse_mla(ql, qr, c, 1, t, p, None if dense else i, 0.1, config=config)

    return fn, (S((2, length, 128, 512), BF16), S((2, length, 128, 64), BF16), V32_LATENT, S((2, 64), I32),
                S((2, length), I32), S((2, length, 2048), I32))


@pytest.mark.parametrize("name, case", [
    ("write decode", lambda: _write(1)), ("write prefill", lambda: _write(100)),
    ("indexer decode", lambda: _indexer(1, False, indexer_pallas.IndexerKernelConfig(min_programs=1))),  # x16
    ("indexer decode fp8", lambda: _indexer(1, True)),
    ("indexer prefill", lambda: _indexer(128, False)), ("indexer prefill fp8", lambda: _indexer(128, True)),
    ("indexer decode two-level top-k", lambda: _indexer(1, False, indexer_pallas.IndexerKernelConfig(
        topk="two_level"))),
    ("indexer decode heads x keys, runs of 8 key tiles", lambda: _indexer(
        1, False, indexer_pallas.IndexerKernelConfig(tiles_per_program=8, min_programs=1, keys_as_rows=False))),
    ("indexer decode one tile per program", lambda: _indexer(
        1, False, indexer_pallas.IndexerKernelConfig(tiles_per_program=1))),
    ("sparse decode", lambda: _sparse(1, False)), ("dense decode", lambda: _sparse(1, True)),
    ("dense decode, static splits", lambda: _sparse(1, True, sparse_mla.SparseMLAConfig(dense_even_splits=False))),
    ("sparse decode heads_split", lambda: _sparse(1, False, HEADS_SPLIT)),
    ("dense decode heads_split", lambda: _sparse(1, True, HEADS_SPLIT)),
    ("sparse prefill", lambda: _sparse(64, False)), ("dense prefill", lambda: _sparse(64, True)),
])
def test_kernels_lower_to_triton(name, case):
    fn, args = case()
    assert count_triton_kernels(fn, *args) >= 1, name


def test_small_dims_run_the_reference_when_pallas_is_asked(seed):
    """Triton dots need >= 16-wide segments: an op asked for "pallas" with narrower dims (the tiny test models on a
    GPU) runs its reference instead of failing to compile (on this CPU, "pallas" would not run at all)."""
    rng = np.random.default_rng(seed)
    q, w, pos, keys, tables, _, _ = indexer_inputs(rng, 2, 3, [200, 100], dim=8)
    np.testing.assert_array_equal(topk_op(q, w, pos, keys, LAYER, tables, 9, 0.3, impl="pallas"),
                                  topk_op(q, w, pos, keys, LAYER, tables, 9, 0.3, impl="reference"))
    cache = jnp.asarray(rng.standard_normal((LAYERS, BLOCKS, BLOCK, 20)), jnp.float32)
    q_lat, q_rope = (jnp.asarray(rng.standard_normal((2, 3, 4, d)), jnp.float32) for d in (16, 4))
    np.testing.assert_array_equal(mla_op(q_lat, q_rope, cache, LAYER, tables, pos, None, 0.2, impl="pallas"),
                                  mla_op(q_lat, q_rope, cache, LAYER, tables, pos, None, 0.2, impl="reference"))
