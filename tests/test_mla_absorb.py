"""kernels/mla_absorb.py: absorbed MLA's W_UK and W_UV products at decode, in interpret mode against a float64 oracle
and the XLA form, the split merge's corner cases (empty splits, heads that saw nothing, padded heads), errors, the
Triton lowering at the medium hybrid's and DeepSeek-V3.2's head sizes, the MLA decode step through them, and the
latent cache write inside the absorb kernel (`model.mla.LATENT_WRITE_IN_ABSORB`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import mla_absorb
from dayzero.kernels.sparse_mla import SplitLatents
from mla_decode_cases import prefilled_mla_layer
from triton_lowering import count_triton_kernels

HEADS, NOPE, ROPE, V, RANK = 4, 32, 16, 32, 128


def _weights(rng, dtype, heads=HEADS, nope=NOPE, v_dim=V, rank=RANK):
    return jnp.asarray(rng.standard_normal((rank, heads * (nope + v_dim))) / np.sqrt(rank), dtype)


def _tol(dtype):
    return 2e-2 if dtype == jnp.bfloat16 else 1e-5


@pytest.mark.parametrize("rows", [1, 3, 16, 17])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_absorb_queries(seed, rows, dtype):
    """q_nope . W_UK^T per head against float64, and the rope columns copied exactly; 16 rows a whole row block
    (loaded as a slice), 17 rows span two row blocks."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((rows, HEADS * (NOPE + ROPE))), dtype)
    w = _weights(rng, dtype)
    q_lat, q_rope = mla_absorb.absorb_queries(q, w, heads=HEADS, nope=NOPE, rope=ROPE, v_dim=V, interpret=True)
    assert q_lat.shape == (rows, HEADS, RANK) and q_lat.dtype == dtype and q_rope.shape == (rows, HEADS, ROPE)
    q64 = np.asarray(q, np.float64).reshape(rows, HEADS, NOPE + ROPE)
    w64 = np.asarray(w, np.float64).reshape(RANK, HEADS, NOPE + V)
    want = np.einsum("mhn,rhn->mhr", q64[..., :NOPE], w64[..., :NOPE])
    err = np.max(np.abs(np.asarray(q_lat, np.float64) - want))
    assert err <= _tol(dtype) * np.max(np.abs(want))
    np.testing.assert_array_equal(np.asarray(q_rope), np.asarray(q).reshape(rows, HEADS, NOPE + ROPE)[..., NOPE:])
    ref_lat, ref_rope = mla_absorb.absorb_reference(q, w, heads=HEADS, nope=NOPE, rope=ROPE, v_dim=V)
    np.testing.assert_array_equal(np.asarray(q_rope), np.asarray(ref_rope))
    np.testing.assert_allclose(np.asarray(q_lat, np.float32), np.asarray(ref_lat, np.float32),
                               atol=_tol(dtype) * float(np.max(np.abs(want))))


@pytest.mark.parametrize("rows,squares", [(1, True), (3, False), (16, True), (32, False)])
def test_absorb_queries_finishes_partial_sums(seed, rows, squares):
    """q as the query projection's K-split `projection.Partials` (with the norm's squares or without): each program
    finishes the columns it reads as `projection.finished` does, so q_latent and q_rope equal those of the finished
    q; the XLA form takes them too. Equal to rounding, not always bit for bit: XLA may contract the norm's
    sum / k + eps into one FMA in one program and not in the other (at the tests' optimization level,
    tests/conftest.py), which can move a row's scale by an ulp and so some of its bf16 values by one rounding."""
    from dayzero.kernels import projection

    rng = np.random.default_rng(seed)
    sums = jnp.asarray(rng.standard_normal((4, rows, HEADS * (NOPE + ROPE))), jnp.float32)
    sq = jnp.asarray(rng.uniform(1, 3, (4, rows)), jnp.float32) if squares else None
    parts = projection.Partials(sums, sq, 256, 1e-6, "bfloat16")
    w = _weights(rng, jnp.bfloat16)
    kw = dict(heads=HEADS, nope=NOPE, rope=ROPE, v_dim=V)
    got = mla_absorb.absorb_queries(parts, w, **kw, interpret=True)
    want = mla_absorb.absorb_queries(projection.finished(parts), w, **kw, interpret=True)
    assert got[0].dtype == jnp.bfloat16

    def same_to_rounding(g, r):  # a few values one bf16 rounding apart at most (seed 3526623398: 20 of 8192)
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.abs(g - r).max() <= 2.0 ** -7 * np.abs(r).max() and np.mean(g != r) < 0.05, (seed, rows)

    for g, r in zip(got, want):
        same_to_rounding(g, r)
    for g, r in zip(mla_absorb.absorb_reference(parts, w, **kw), mla_absorb.absorb_reference(
            projection.finished(parts), w, **kw)):
        same_to_rounding(g, r)


def _split_case(rng, rows, splits, heads_p, dtype):
    out = jnp.asarray(rng.standard_normal((rows, splits, heads_p, RANK)), dtype)
    lse = rng.standard_normal((rows, splits, heads_p)) * 3
    if splits > 1:
        lse[:, -1] = -np.inf  # a split that saw no key
    lse[0, :, 1] = -np.inf  # a head of row 0 that saw no key at all
    return SplitLatents(out, jnp.asarray(lse, jnp.float32), HEADS, jnp.dtype(dtype).name)


def _up_oracle(latents: SplitLatents, w):
    """float64: the splits merged by their log-sum-exps, rounded to the output dtype as the reference rounds, then
    times W_UV."""
    merged = np.asarray(latents.merged(), np.float64)
    rank = merged.shape[-1]
    w64 = np.asarray(w, np.float64).reshape(rank, HEADS, NOPE + V)[..., NOPE:]
    return np.einsum("mhr,rhv->mhv", merged, w64).reshape(merged.shape[0], -1)


@pytest.mark.parametrize("rows,splits,heads_p", [(1, 1, 4), (1, 8, 4), (5, 4, 8), (17, 2, 4), (2, 3, 4)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_up_project_merges_splits(seed, rows, splits, heads_p, dtype):
    """The splits' merge and W_UV: against float64 and the XLA form; zeros for a head that saw no key; padded heads
    (heads_p > heads) ignored."""
    rng = np.random.default_rng(seed)
    latents = _split_case(rng, rows, splits, heads_p, dtype)
    w = _weights(rng, dtype)
    o = mla_absorb.up_project(latents, w, nope=NOPE, v_dim=V, interpret=True)
    assert o.shape == (rows, HEADS * V) and o.dtype == dtype
    want = _up_oracle(latents, w)
    scale = np.max(np.abs(want))
    assert np.max(np.abs(np.asarray(o, np.float64) - want)) <= _tol(dtype) * scale
    assert not np.any(np.asarray(o, np.float32)[0, V:2 * V])  # row 0's head 1 saw no key
    ref = mla_absorb.up_project_reference(latents, w, nope=NOPE, v_dim=V)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ref, np.float32), atol=_tol(dtype) * scale)


def test_up_project_takes_merged_latents(seed):
    rng = np.random.default_rng(seed)
    merged = jnp.asarray(rng.standard_normal((3, HEADS, RANK)), jnp.float32)
    w = _weights(rng, jnp.float32)
    o = mla_absorb.up_project(merged, w, nope=NOPE, v_dim=V, interpret=True)
    want = np.einsum("mhr,rhv->mhv", np.asarray(merged, np.float64),
                     np.asarray(w, np.float64).reshape(RANK, HEADS, NOPE + V)[..., NOPE:]).reshape(3, -1)
    np.testing.assert_allclose(np.asarray(o, np.float64), want, rtol=1e-5, atol=1e-5)


def test_block_v_keeps_programs():
    assert mla_absorb.up_block_v(16, 128) == 16  # the medium hybrid: 16 heads x 8 blocks = 128 programs
    assert mla_absorb.up_block_v(128, 128) == 128  # DeepSeek-V3.2: one block per head
    assert mla_absorb.up_block_v(4, 32) == 16
    assert mla_absorb.up_block_r(512, 16, 8) == 256 and mla_absorb.up_block_r(512, 128, 8) == 32
    assert mla_absorb.up_block_r(512, 16, 256) == 16


def test_names_what_it_does_not_take():
    w = jnp.zeros((RANK, HEADS * (NOPE + V)), jnp.float32)
    with pytest.raises(ValueError, match="kv_b_proj kernel"):
        mla_absorb.absorb_queries(jnp.zeros((1, HEADS * (NOPE + ROPE))), w[:, :-1], heads=HEADS, nope=NOPE,
                                  rope=ROPE, v_dim=V, interpret=True)
    with pytest.raises(ValueError, match="queries"):
        mla_absorb.absorb_queries(jnp.zeros((1, 7)), w, heads=HEADS, nope=NOPE, rope=ROPE, v_dim=V, interpret=True)
    with pytest.raises(ValueError, match="not supported"):
        mla_absorb.absorb_queries(jnp.zeros((1, HEADS * 20)), jnp.zeros((RANK, HEADS * 20)), heads=HEADS, nope=8,
                                  rope=12, v_dim=12, interpret=True)
    bad = SplitLatents(jnp.zeros((1, 2, HEADS, RANK)), jnp.zeros((1, 3, HEADS)), HEADS, "float32")
    with pytest.raises(ValueError, match="log-sum-exps"):
        mla_absorb.up_project(bad, w, nope=NOPE, v_dim=V, interpret=True)
    assert not mla_absorb.supported(RANK, 8, ROPE, V) and mla_absorb.supported(512, 128, 64, 128)


@pytest.mark.parametrize("heads,rows", [(16, 1), (16, 16), (128, 1)])
def test_lowers_to_triton(heads, rows):
    """The medium hybrid's (16 heads) and DeepSeek-V3.2's (128) head sizes: one Triton kernel each side, the absorb
    kernel with the latent cache write in it too."""
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    w = spec(512, heads * 256)
    absorb = lambda q, w, **k: mla_absorb.absorb_queries(q, w, heads=heads, nope=128, rope=64, v_dim=128, **k)
    assert count_triton_kernels(absorb, spec(rows, heads * 192), w) == 1
    from dayzero.kernels import projection  # the query projection's partial sums, finished as loaded

    split = lambda s, sq, w: absorb(projection.Partials(s, sq, 2048, 1e-5, "bfloat16"), w)
    assert count_triton_kernels(split, spec(8, rows, heads * 192, dtype=jnp.float32),
                                spec(8, rows, dtype=jnp.float32), w) == 1
    up = lambda o, lse, w: mla_absorb.up_project(SplitLatents(o, lse, heads, "bfloat16"), w, nope=128, v_dim=128)
    assert count_triton_kernels(up, spec(rows, 8, heads, 512), spec(rows, 8, heads, dtype=jnp.float32), w) == 1
    from dayzero.kernels import paged, paged_pallas  # with the latent cache write (576 features, norm over 512)

    def written(s, sq, w, cache, tables, weight):
        rows_in = projection.Partials(s[..., :576], sq, 2048, 1e-5, "bfloat16")
        write = paged_pallas.DecodeRows(1, tables, jnp.zeros((rows,), jnp.int32), jnp.ones((rows,), bool), rows_in,
                                        paged.LeadingNorm(weight, 512, 1e-6))
        return absorb(projection.Partials(s, sq, 2048, 1e-5, "bfloat16"), w, cache=cache, latent_write=write)

    assert count_triton_kernels(written, spec(8, rows, heads * 192, dtype=jnp.float32),
                                spec(8, rows, dtype=jnp.float32), w, spec(4, 32, 64, 576),
                                spec(rows, 8, dtype=jnp.int32), spec(512)) == 1


@pytest.mark.parametrize("q_lora_rank,use_rope,up_max_rows", [(None, False, 2), (32, True, 2), (32, True, 1)])
def test_mla_decode_through_the_kernels(seed, monkeypatch, q_lora_rank, use_rope, up_max_rows):
    """A one-MLA-layer model's cached decode step with absorbed MLA through the kernels (interpret mode, with the
    split decode attention handing them its splits unmerged) gives the logits of the einsum path, to bf16 rounding.
    Steps of more rows than `UP_PROJECT_MAX_ROWS` merge the splits in the attention and take XLA's W_UV product."""
    monkeypatch.setattr(mla_absorb, "UP_PROJECT_MAX_ROWS", up_max_rows)
    from dayzero.kernels import attention

    step, args = prefilled_mla_layer(seed, q_lora_rank=q_lora_rank, kv_lora_rank=32, mla_use_rope=use_rope)
    sparse = attention.sparse_mla
    monkeypatch.setattr(attention, "sparse_mla", lambda *a, **k: sparse(*a, impl="interpret", **k))
    plain, _ = step(*args, decode=True)
    calls = []
    up = mla_absorb.up_project
    monkeypatch.setattr(mla_absorb, "choose", lambda *a, impl=None: "interpret")
    monkeypatch.setattr(mla_absorb, "up_project",
                        lambda latents, *a, **k: calls.append(latents) or up(latents, *a, **k))
    fused, _ = step(*args, decode=True)
    assert (len(calls) == 1 and isinstance(calls[0], SplitLatents)) if up_max_rows >= 2 else not calls
    err = np.max(np.abs(np.asarray(fused, np.float32) - np.asarray(plain, np.float32)))
    assert err <= 3e-2 * np.max(np.abs(np.asarray(plain, np.float32)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_latent_write_with_its_norm(seed, dtype):
    """`paged.write(norm=LeadingNorm)`: the decode write kernel (interpret mode) normalizes the latent (the first 32
    of 48 features) as `model.norms.RMSNorm` does and stores the rope key after it unchanged; invalid rows go to the
    scratch block."""
    from dayzero.kernels import paged
    from dayzero.model.norms import RMSNorm

    rng = np.random.default_rng(seed)
    cache = jnp.zeros((2, 4, 8, 48), dtype)
    values = jnp.asarray(rng.standard_normal((3, 1, 48)) * 4, dtype)
    weight = jnp.asarray(rng.standard_normal(32), dtype)
    tables = jnp.asarray([[1, 2], [3, 0], [2, 1]], jnp.int32)
    positions, valid = jnp.asarray([[9], [3], [0]]), jnp.asarray([[True], [True], [False]])
    norm = paged.LeadingNorm(weight, 32, 1e-6)
    got = paged.write(cache, 1, tables, positions, valid, values, impl="interpret", norm=norm)
    normed = RMSNorm(eps=1e-6, param_dtype=dtype).apply({"params": {"weight": weight}}, values[..., :32])
    want = paged.write_reference(cache, 1, tables, positions, valid,
                                 jnp.concatenate([normed, values[..., 32:]], axis=-1))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(got[1, 2, 1, 32:]), np.asarray(values[0, 0, 32:]))
    np.testing.assert_array_equal(np.asarray(norm.apply(values)), np.asarray(
        jnp.concatenate([normed, values[..., 32:]], axis=-1)))
    with pytest.raises(ValueError, match="one token per request"):
        from dayzero.kernels import paged_pallas
        paged_pallas.write(cache, 1, tables, jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2), bool),
                           jnp.zeros((3, 2, 48), dtype), interpret=True, norm=norm)


@pytest.mark.parametrize("rows,partials", [(1, True), (3, False), (16, True), (17, True)])
def test_absorb_queries_writes_the_latent_rows(seed, rows, partials):
    """`absorb_queries(latent_write=)` (interpret mode): the cache comes back bit for bit as `paged_pallas.write`'s
    decode kernel leaves it (the latent normed, the rope key after it; an invalid row into the scratch block; 17 rows
    span two row blocks) and q_latent / q_rope as without the write; the rows as the latent projection's unfinished
    partial sums or finished. A write of other rows than the queries' is refused; `writes_latents` says where a row
    block has too few programs."""
    from dayzero.kernels import paged, paged_pallas, projection

    rng = np.random.default_rng(seed)
    width = 48  # a 32-feature latent and a 16-feature rope key
    cache = jnp.asarray(rng.standard_normal((2, 8, 8, width)), jnp.bfloat16)
    tables = jnp.asarray(rng.integers(1, 8, (rows, 4)), jnp.int32)
    positions = jnp.asarray(rng.integers(0, 32, (rows, 1)), jnp.int32)
    valid = jnp.asarray(np.arange(rows)[:, None] != rows - 1 if rows > 1 else np.ones((1, 1), bool))
    if partials:
        values = projection.Partials(jnp.asarray(rng.standard_normal((4, rows, width)), jnp.float32),
                                     jnp.asarray(rng.uniform(1, 3, (4, rows)), jnp.float32), 256, 1e-6, "bfloat16")
    else:
        values = jnp.asarray(rng.standard_normal((rows, 1, width)) * 3, jnp.bfloat16)
    norm = paged.LeadingNorm(jnp.asarray(rng.standard_normal(32), jnp.bfloat16), 32, 1e-6)
    q = jnp.asarray(rng.standard_normal((rows, HEADS * (NOPE + ROPE))), jnp.bfloat16)
    w = _weights(rng, jnp.bfloat16)
    tiles = mla_absorb.AbsorbTiles(block_r=16)  # 4 heads x 8 latent blocks: a program for each of 16 rows
    kw = dict(heads=HEADS, nope=NOPE, rope=ROPE, v_dim=V, tiles=tiles, interpret=True)
    want_cache = paged_pallas.write(cache, 1, tables, positions, valid, values, interpret=True, norm=norm)
    want = mla_absorb.absorb_queries(q, w, **kw)
    write = paged_pallas.DecodeRows(1, tables, positions, valid, values, norm)
    q_lat, q_rope, got_cache = mla_absorb.absorb_queries(q, w, cache=cache, latent_write=write, **kw)
    np.testing.assert_array_equal(np.asarray(got_cache, np.float32), np.asarray(want_cache, np.float32))
    assert not np.array_equal(np.asarray(got_cache, np.float32), np.asarray(cache, np.float32))  # something written
    for g, r in zip((q_lat, q_rope), want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))
    assert mla_absorb.writes_latents(HEADS, RANK, rows, tiles) and not mla_absorb.writes_latents(HEADS, RANK, 17)
    with pytest.raises(ValueError, match="latent write"):  # rows other than the queries'
        mla_absorb.absorb_queries(jnp.concatenate([q, q]), w, cache=cache, latent_write=write, **kw)
    with pytest.raises(ValueError, match="both the cache"):
        mla_absorb.absorb_queries(q, w, latent_write=write, **kw)


@pytest.mark.parametrize("q_lora_rank,use_rope", [(None, False), (32, True)])
def test_mla_decode_writes_latents_in_the_absorb_kernel(seed, monkeypatch, q_lora_rank, use_rope):
    """`model.mla.LATENT_WRITE_IN_ABSORB` (every kernel in interpret mode, hidden 256: the latent rows come as the
    projection's partial sums without rope, finished with it): the absorb kernel writes the step's latent rows and
    the paged write kernel does not run; the next-token logits and the latent cache equal those of the step with the
    write kernel, bit for bit."""
    from dayzero.kernels import paged_pallas
    from dayzero.model import mla

    step, args = prefilled_mla_layer(seed, q_lora_rank=q_lora_rank, hidden_size=256, mla_use_rope=use_rope,
                                     kv_lora_rank=64)
    monkeypatch.setenv("DAYZERO_KERNELS", "interpret")
    monkeypatch.setattr(mla, "LATENT_WRITE_IN_ABSORB", False)
    plain, plain_cache = step(*args, decode=True)
    writes, absorbs = [], []
    write, absorb = paged_pallas.write, mla_absorb.absorb_queries
    monkeypatch.setattr(paged_pallas, "write", lambda *a, **k: writes.append(a[1]) or write(*a, **k))
    monkeypatch.setattr(mla_absorb, "absorb_queries",
                        lambda *a, **k: absorbs.append(k.get("latent_write")) or absorb(*a, **k))
    monkeypatch.setattr(mla, "LATENT_WRITE_IN_ABSORB", True)
    fused, fused_cache = step(*args, decode=True)
    assert not writes and len(absorbs) == 1 and isinstance(absorbs[0], paged_pallas.DecodeRows)
    np.testing.assert_array_equal(np.asarray(fused, np.float32), np.asarray(plain, np.float32))
    np.testing.assert_array_equal(np.asarray(fused_cache["latent"], np.float32),
                                  np.asarray(plain_cache["latent"], np.float32))
    assert not np.array_equal(np.asarray(fused_cache["latent"], np.float32),
                              np.asarray(args[3]["latent"], np.float32))  # the step wrote its rows


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_row_absorb_on_cuda_cores(seed, dtype):
    """`AbsorbTiles.cuda_cores` (one row, no MMA): q_nope . W_UK^T against float64 and the MMA path, the rope
    columns copied exactly, from finished queries or the query projection's partial sums, with the latent rows
    written as the MMA path writes them; calls of more rows ignore it."""
    from dayzero.kernels import paged, paged_pallas, projection

    rng = np.random.default_rng(seed)
    vector = mla_absorb.AbsorbTiles(block_r=16, cuda_cores=True)
    kw = dict(heads=HEADS, nope=NOPE, rope=ROPE, v_dim=V, interpret=True)
    q = jnp.asarray(rng.standard_normal((1, HEADS * (NOPE + ROPE))), dtype)
    w = _weights(rng, dtype)
    got = mla_absorb.absorb_queries(q, w, tiles=vector, **kw)
    mma = mla_absorb.absorb_queries(q, w, tiles=mla_absorb.AbsorbTiles(block_r=16), **kw)
    q64 = np.asarray(q, np.float64).reshape(1, HEADS, NOPE + ROPE)
    want = np.einsum("mhn,rhn->mhr", q64[..., :NOPE], np.asarray(w, np.float64).reshape(RANK, HEADS, NOPE + V)[
        ..., :NOPE])
    for lat in (got[0], mma[0]):
        assert np.max(np.abs(np.asarray(lat, np.float64) - want)) <= _tol(dtype) * np.max(np.abs(want))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(mma[1]))
    sums = jnp.asarray(rng.standard_normal((4, 1, HEADS * (NOPE + ROPE))), jnp.float32)
    parts = projection.Partials(sums, jnp.asarray(rng.uniform(1, 3, (4, 1)), jnp.float32), 256, 1e-6, "bfloat16")
    finished = projection.finished(parts)
    w16 = w.astype(jnp.bfloat16)
    for g, r in zip(mla_absorb.absorb_queries(parts, w16, tiles=vector, **kw),
                    mla_absorb.absorb_queries(finished, w16, tiles=vector, **kw)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))
    cache = jnp.asarray(rng.standard_normal((2, 8, 8, 48)), jnp.bfloat16)
    rows_in = jnp.asarray(rng.standard_normal((1, 1, 48)), jnp.bfloat16)
    write = paged_pallas.DecodeRows(1, jnp.ones((1, 4), jnp.int32), jnp.asarray([[5]], jnp.int32),
                                    jnp.ones((1, 1), bool), rows_in, paged.LeadingNorm(jnp.ones(32, jnp.bfloat16), 32,
                                                                                       1e-6))
    *_, got_cache = mla_absorb.absorb_queries(finished, w16, tiles=vector, cache=cache, latent_write=write, **kw)
    *_, mma_cache = mla_absorb.absorb_queries(finished, w16, tiles=mla_absorb.AbsorbTiles(block_r=16), cache=cache,
                                              latent_write=write, **kw)
    np.testing.assert_array_equal(np.asarray(got_cache, np.float32), np.asarray(mma_cache, np.float32))
    q3 = jnp.asarray(rng.standard_normal((3, HEADS * (NOPE + ROPE))), dtype)
    for g, r in zip(mla_absorb.absorb_queries(q3, w, tiles=vector, **kw),
                    mla_absorb.absorb_queries(q3, w, tiles=mla_absorb.AbsorbTiles(block_r=16), **kw)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))


def test_one_row_absorb_tiles_follow_the_switch(monkeypatch):
    """`default_tiles` (what the model passes): the CUDA-core tiles for one row only where the switch is on."""
    monkeypatch.setattr(mla_absorb, "ONE_ROW_ON_CUDA_CORES", False)
    assert not mla_absorb.default_tiles(1).cuda_cores
    monkeypatch.setattr(mla_absorb, "ONE_ROW_ON_CUDA_CORES", True)
    assert mla_absorb.default_tiles(1).cuda_cores and not mla_absorb.default_tiles(2).cuda_cores
    assert mla_absorb.default_tiles(2) == mla_absorb.AbsorbTiles()


@pytest.mark.parametrize("heads", [16, 128])
def test_one_row_absorb_on_cuda_cores_lowers_to_triton(heads):
    """The one-row CUDA-core absorb at the medium hybrid's and DeepSeek-V3.2's head sizes, from finished queries and
    from the query projection's partial sums: one Triton kernel each."""
    from dayzero.kernels import projection

    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    tiles = mla_absorb.AbsorbTiles(cuda_cores=True)
    absorb = lambda q, w: mla_absorb.absorb_queries(q, w, heads=heads, nope=128, rope=64, v_dim=128, tiles=tiles)
    w = spec(512, heads * 256)
    assert count_triton_kernels(absorb, spec(1, heads * 192), w) == 1
    split = lambda s, sq, w: absorb(projection.Partials(s, sq, 2048, 1e-5, "bfloat16"), w)
    assert count_triton_kernels(split, spec(16, 1, heads * 192, dtype=jnp.float32), spec(16, 1, dtype=jnp.float32),
                                w) == 1


def test_mla_decode_with_the_one_row_absorb_on_cuda_cores(seed, monkeypatch):
    """A one-MLA-layer model's one-row decode step through the kernels (interpret mode) with
    `ONE_ROW_ON_CUDA_CORES`: the logits of the einsum path to bf16 rounding, the CUDA-core tiles taken."""
    from dayzero.kernels import attention

    step, (ids, positions, valid, cache, tables, slots) = prefilled_mla_layer(seed, q_lora_rank=None, kv_lora_rank=32,
                                                                              mla_use_rope=False)
    args = (ids[:1], positions[:1], valid[:1], cache, tables[:1], slots[:1])  # the first sequence alone: one row
    plain, _ = step(*args, decode=True)
    sparse = attention.sparse_mla
    monkeypatch.setattr(attention, "sparse_mla", lambda *a, **k: sparse(*a, impl="interpret", **k))
    monkeypatch.setattr(mla_absorb, "choose", lambda *a, impl=None: "interpret")
    monkeypatch.setattr(mla_absorb, "ONE_ROW_ON_CUDA_CORES", True)
    tiles, absorb = [], mla_absorb.absorb_queries
    monkeypatch.setattr(mla_absorb, "absorb_queries", lambda *a, **k: tiles.append(k["tiles"]) or absorb(*a, **k))
    fused, _ = step(*args, decode=True)
    assert tiles and all(t.cuda_cores for t in tiles)
    err = np.max(np.abs(np.asarray(fused, np.float32) - np.asarray(plain, np.float32)))
    assert err <= 3e-2 * np.max(np.abs(np.asarray(plain, np.float32)))
