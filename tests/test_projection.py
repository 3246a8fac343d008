"""kernels/projection.py: decode-sized projections with the input norm and the residual add in one kernel, in
interpret mode against a float64 oracle and the XLA form, its program plan, its errors, and its Triton lowering at
the medium hybrid's KDA layer shapes."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import dispatch, projection
from mla_decode_cases import prefilled_mla_layer, spy_unfinished_consumers
from tiny_decode_cases import prefilled_decode
from triton_lowering import count_triton_kernels

SMALL = projection.ProjectionTiles(block_n=64, step_k=64, k_slices=1)


def _oracle(x, groups, norm_weight, eps, residual):
    """float64 numpy, rounding to x's dtype where the model does (the norm's two roundings, each product)."""
    dt = x.dtype
    rnd = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(dt), np.float64)
    h = np.asarray(x, np.float64)
    if norm_weight is not None:
        normed = rnd(h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps))
        h = rnd(np.asarray(norm_weight, np.float64) * normed)
    outs = [np.concatenate([h @ np.asarray(w, np.float64) for w in group], axis=-1) for group in groups]
    if residual is not None:
        outs = [np.asarray(residual, np.float64) + rnd(outs[0])]
    return outs


def _case(rng, rows, k_dim, widths, dtype):
    x = jnp.asarray(rng.standard_normal((rows, k_dim)), dtype)
    weights = [jnp.asarray(rng.standard_normal((k_dim, n)) * 0.05, dtype) for n in widths]
    norm_weight = jnp.asarray(rng.uniform(0.5, 1.5, k_dim), jnp.float32)
    return x, weights, norm_weight


@pytest.mark.parametrize("rows", [1, 2, 4, 16])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("norm", [True, False])
def test_matches_oracle(seed, rows, dtype, norm):
    """Two groups (three and two weights of widths that take different block widths), the input norm on or off:
    each output within rounding of the float64 oracle, and equal to the XLA form up to one rounding step."""
    rng = np.random.default_rng(seed)
    x, w, norm_weight = _case(rng, rows, 256, (128, 64, 32, 16, 48), dtype)
    groups = ((w[0], w[1], w[2]), (w[3], w[4]))
    nw = norm_weight if norm else None
    got = projection.project(x, groups, norm_weight=nw, eps=1e-5, tiles=SMALL, interpret=True)
    want = projection.reference(x, groups, norm_weight=nw, eps=1e-5)
    oracle = _oracle(x, groups, nw, 1e-5, None)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    for g, r, o in zip(got, want, oracle):
        assert g.shape == r.shape == o.shape and g.dtype == x.dtype
        scale = np.max(np.abs(o))
        assert np.max(np.abs(np.asarray(g, np.float64) - o)) <= tol * scale
        assert np.max(np.abs(np.asarray(g, np.float64) - np.asarray(r, np.float64))) <= tol * scale


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_residual(seed, rows):
    """o_proj with the residual add: x + (o @ W) rounded as the layer's bf16 add, one group of one weight."""
    rng = np.random.default_rng(seed)
    o, (w,), _ = _case(rng, rows, 128, (256,), jnp.bfloat16)
    residual = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
    (got,) = projection.project(o, ((w,),), residual=residual, tiles=SMALL, interpret=True)
    (want,) = projection.reference(o, ((w,),), residual=residual)
    (oracle,) = _oracle(o, ((w,),), None, 0.0, residual)
    assert np.max(np.abs(np.asarray(got, np.float64) - oracle)) <= 1e-2 * np.max(np.abs(oracle))
    # away from rounding ties the two forms round the same sums the same way
    assert np.mean(np.asarray(got, np.float32) == np.asarray(want, np.float32)) > 0.95


def test_plan_covers_every_column_once():
    """The program blocks: each weight's columns split in equal power-of-two blocks of at most `block_n`, programs
    numbered without gaps; K split in powers of two until there are `min_programs` programs (at most `k_slices`)."""
    tiles = projection.ProjectionTiles(block_n=128, min_programs=256, k_slices=8)
    widths = [(0, 0, 2048), (0, 2048, 2048), (0, 4096, 2048), (1, 0, 128), (1, 128, 128), (1, 256, 16)]
    blocks, slices = projection._plan(widths, 32, tiles)
    start = 0
    for b, (group, column, n) in zip(blocks, widths):
        assert (b.group, b.column, b.start) == (group, column, start) and b.width * b.count == n
        assert b.width == min(128, n)
        start += b.count
    assert start == 51 and slices == 8  # 51 x 4 < 256
    assert projection._plan(widths, 32, dataclasses.replace(tiles, min_programs=100))[1] == 2
    assert projection._plan(widths, 6, tiles)[1] == 2  # slices divide the K steps
    assert projection._plan([(0, 0, 2048)], 32, dataclasses.replace(tiles, k_slices=1))[1] == 1


@pytest.mark.parametrize("slices", [2, 4])
def test_split_k(seed, slices):
    """K in slices: float32 partial sums (and the rows' partial squares for the norm) added up by XLA, then the
    norm's scale, the rounding and the residual as without the split."""
    rng = np.random.default_rng(seed)
    x, w, norm_weight = _case(rng, 4, 256, (128, 64, 48), jnp.bfloat16)
    tiles = projection.ProjectionTiles(block_n=64, step_k=32, min_programs=10 ** 6, k_slices=slices)
    assert projection._plan([(0, 0, 128)], 8, tiles)[1] == slices
    groups = ((w[0], w[1]), (w[2],))
    for nw in (norm_weight, None):
        got = projection.project(x, groups, norm_weight=nw, eps=1e-5, tiles=tiles, interpret=True)
        for g, o in zip(got, _oracle(x, groups, nw, 1e-5, None)):
            assert g.dtype == x.dtype and np.max(np.abs(np.asarray(g, np.float64) - o)) <= 1e-2 * np.max(np.abs(o))
    residual = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)
    (got,) = projection.project(x, ((w[0],),), residual=residual, tiles=tiles, interpret=True)
    (oracle,) = _oracle(x, ((w[0],),), None, 0.0, residual)
    assert np.max(np.abs(np.asarray(got, np.float64) - oracle)) <= 1e-2 * np.max(np.abs(oracle))


@pytest.mark.parametrize("parts,slices", [(1, 1), (2, 1), (4, 4)])
def test_head_scaled_rows(seed, parts, slices):
    """x as `HeadScaled` (float32 values, `parts` sums of squares per 32-column head): each loaded block scaled by
    its head's 1 / rms and rounded to the weights' dtype, then the product and the residual, K split or not: the
    XLA form's result (finished rows, then the product) to bf16 rounding, against a float64 oracle; shapes that do
    not split into heads, or a norm weight besides, are refused by name."""
    rng = np.random.default_rng(seed)
    rows, k_dim, head_dim = 4, 128, 32
    values = jnp.asarray(rng.standard_normal((rows, k_dim)) * rng.uniform(0.1, 10, (rows, 1)), jnp.float32)
    squares = jnp.asarray(rng.uniform(0.5, 2.0, (rows, k_dim // head_dim * parts)) * head_dim / parts, jnp.float32)
    x = projection.HeadScaled(values, squares, head_dim, 1e-5, "bfloat16")
    assert x.parts == parts
    w = jnp.asarray(rng.standard_normal((k_dim, 64)) * 0.05, jnp.bfloat16)
    residual = jnp.asarray(rng.standard_normal((rows, 64)), jnp.bfloat16)
    tiles = projection.ProjectionTiles(block_n=32, step_k=64, min_programs=10 ** 6, k_slices=slices)
    (got,) = projection.project(x, ((w,),), residual=residual, tiles=tiles, interpret=True)
    (xla,) = projection.reference(x, ((w,),), residual=residual)
    finished = projection.finished(x)
    ms = np.asarray(squares, np.float64).reshape(rows, -1, parts).sum(-1) / head_dim
    scaled = np.asarray(values, np.float64) / np.sqrt(np.repeat(ms, head_dim, axis=1) + 1e-5)
    assert finished.dtype == jnp.bfloat16 and np.allclose(np.asarray(finished, np.float64), scaled, rtol=8e-3)
    (oracle,) = _oracle(finished, ((w,),), None, 0.0, residual)
    assert got.dtype == jnp.bfloat16 and got.shape == (rows, 64)
    for out in (got, xla):
        assert np.max(np.abs(np.asarray(out, np.float64) - oracle)) <= 1e-2 * np.max(np.abs(oracle))
    with pytest.raises(ValueError, match="heads of 48"):
        projection.project(projection.HeadScaled(values, squares, 48, 1e-5, "bfloat16"), ((w,),), interpret=True)
    with pytest.raises(ValueError, match="no norm weight"):
        projection.project(x, ((w,),), norm_weight=jnp.ones(k_dim), interpret=True)


def test_unfinished_partials(seed):
    """`project(finish=False)`: with K split, each group's `Partials` (float32 sums per slice, the norm's squares,
    the dtype they round to), which `finished` turns into exactly the default call's output; without a split, the
    finished arrays; a residual needs the finish; `reference` always finishes."""
    rng = np.random.default_rng(seed)
    x, w, norm_weight = _case(rng, 2, 256, (64, 32), jnp.bfloat16)
    tiles = projection.ProjectionTiles(block_n=64, step_k=32, min_programs=10 ** 6, k_slices=4)
    groups = ((w[0],), (w[1],))
    done = projection.project(x, groups, norm_weight=norm_weight, eps=1e-5, tiles=tiles, interpret=True)
    parts = projection.project(x, groups, norm_weight=norm_weight, eps=1e-5, tiles=tiles, interpret=True,
                               finish=False)
    for p, d in zip(parts, done):
        assert isinstance(p, projection.Partials) and p.slices == 4 and p.sums.shape == (4, 2, d.shape[1])
        assert p.squares.shape == (4, 2) and p.dtype == "bfloat16" and p.k_dim == 256
        assert np.array_equal(np.asarray(projection.finished(p), np.float32), np.asarray(d, np.float32))
    unsplit = projection.project(x, groups, norm_weight=norm_weight, eps=1e-5, tiles=SMALL, interpret=True,
                                 finish=False)
    assert all(isinstance(u, jax.Array) and u.dtype == x.dtype for u in unsplit)
    with pytest.raises(ValueError, match="residual"):
        projection.project(x, ((w[0],),), residual=x[:, :64], tiles=tiles, interpret=True, finish=False)
    assert all(isinstance(r, jax.Array) for r in projection.reference(x, groups, norm_weight=norm_weight,
                                                                       finish=False))


@pytest.mark.parametrize("slices", [1, 4])
def test_float32_rows_round_as_they_load(seed, slices):
    """float32 rows and residual for bf16 weights (the residual stream as the MXFP4 down kernel leaves it,
    `model.moe.RESIDUAL_IN_SUMS`): the kernel rounds them to bf16 as it loads, so every output (norm on, K split or
    not, the residual added in the kernel or by `finished`) equals bit for bit the output for the rounded rows, and
    so does the XLA form. 16-bit rows of other weights and a residual of a third dtype are refused."""
    rng = np.random.default_rng(seed)
    x, w, norm_weight = _case(rng, 2, 256, (128, 64), jnp.bfloat16)
    wide = jnp.asarray(rng.standard_normal((2, 256)) * 3, jnp.float32)
    wide_residual = jnp.asarray(rng.standard_normal((2, 128)) * 3, jnp.float32)
    tiles = dataclasses.replace(SMALL, k_slices=slices, min_programs=1024)
    for impl in (functools.partial(projection.project, tiles=tiles, interpret=True), projection.reference):
        for kwargs in (dict(norm_weight=norm_weight), {}):
            got = impl(wide, ((w[0], w[1]),), eps=1e-5, **kwargs)
            want = impl(wide.astype(jnp.bfloat16), ((w[0], w[1]),), eps=1e-5, **kwargs)
            assert got[0].dtype == jnp.bfloat16
            assert np.array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
        got = impl(wide, ((w[0],),), residual=wide_residual)
        want = impl(wide.astype(jnp.bfloat16), ((w[0],),), residual=wide_residual.astype(jnp.bfloat16))
        assert got[0].dtype == jnp.bfloat16
        assert np.array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    with pytest.raises(ValueError, match="float32 rows"):
        projection.project(x.astype(jnp.float16), ((w[0],),), interpret=True)
    with pytest.raises(ValueError, match="residual float16"):
        projection.project(x, ((w[0],),), residual=wide_residual.astype(jnp.float16), interpret=True)


def test_names_what_it_does_not_take():
    """Rows that are not a power of two up to 16, widths or K off the 16 grid, mixed dtypes, a mismatched K, a
    residual with more than one weight: a ValueError naming the shape; `supported` and `choose` agree."""
    x = jnp.zeros((3, 64), jnp.bfloat16)
    w = jnp.zeros((64, 32), jnp.bfloat16)
    assert not projection.supported(3, 64, (32,)) and not projection.supported(32, 64, (32,))
    assert not projection.supported(4, 64, (24,)) and projection.supported(4, 64, (32, 16))
    assert projection.choose(3, 64, (32,), impl="interpret") == "reference"
    assert projection.choose(4, 64, (32,), impl="interpret") == "interpret"
    assert projection.choose(16, 64, (32,), impl="interpret") == "interpret"
    with dispatch.use_policy({"cpu": ["projection"]}):  # a platform's default: XLA above CHOOSE_MAX_ROWS rows
        assert projection.choose(projection.CHOOSE_MAX_ROWS, 64, (32,)) == "pallas"
        assert projection.choose(2 * projection.CHOOSE_MAX_ROWS, 64, (32,)) == "reference"
    with pytest.raises(ValueError, match="3 rows"):
        projection.project(x, ((w,),), interpret=True)
    with pytest.raises(ValueError, match="group 0 weight 1"):
        projection.project(x[:2], ((w, w.astype(jnp.float32)),), interpret=True)
    with pytest.raises(ValueError, match=r"needs bfloat16\[64, N\]"):
        projection.project(x[:2], ((jnp.zeros((32, 32), jnp.bfloat16),),), interpret=True)
    with pytest.raises(ValueError, match="one group of one weight"):
        projection.project(x[:2], ((w, w),), residual=jnp.zeros((2, 64), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="residual"):
        projection.project(x[:2], ((w,),), residual=jnp.zeros((2, 16), jnp.bfloat16), interpret=True)


@pytest.mark.parametrize("rows", [1, 16])
def test_lowers_to_triton_at_model_shapes(rows):
    """The medium hybrid's KDA input projections with the norm (2048 -> 3 x 2048 + 128 + 128 + 16) and o_proj with
    the residual: one Triton kernel each."""
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    x, norm = spec(rows, 2048), spec(2048, dtype=jnp.float32)
    ins = (spec(2048, 2048), spec(2048, 2048), spec(2048, 2048)), (spec(2048, 128), spec(2048, 128), spec(2048, 16))
    fn = lambda x, n, *w: projection.project(x, (w[:3], w[3:]), norm_weight=n, eps=1e-5)
    assert count_triton_kernels(fn, x, norm, *ins[0], *ins[1]) == 1
    out = lambda o, r, w: projection.project(o, ((w,),), residual=r)
    assert count_triton_kernels(out, x, x, spec(2048, 2048)) == 1
    # o_proj of the KDA step split in 4 value blocks per head: float32 rows scaled per 128-column head as they load
    scaled = lambda v, sq, r, w: projection.project(projection.HeadScaled(v, sq, 128, 1e-5, "bfloat16"), ((w,),),
                                                    residual=r)
    assert count_triton_kernels(scaled, spec(rows, 2048, dtype=jnp.float32), spec(rows, 64, dtype=jnp.float32), x,
                                spec(2048, 2048)) == 1
    # float32 rows of the residual stream (`model.moe.RESIDUAL_IN_SUMS`), rounded as they load
    wide = spec(rows, 2048, dtype=jnp.float32)
    assert count_triton_kernels(fn, wide, norm, *ins[0], *ins[1]) == 1
    assert count_triton_kernels(out, x, wide, spec(2048, 2048)) == 1


@pytest.mark.parametrize("q_lora_rank", [None, 32])
def test_mla_decode_with_projection_kernel(seed, monkeypatch, q_lora_rank):
    """`model.mla.DECODE_PROJECTIONS`: a one-MLA-layer model's cached decode step with the input norm, the query
    and latent projections and o_proj + residual in the projection kernel (interpret mode; two calls per layer,
    counted as traced) gives the logits of the same step with XLA's projections, to bf16 rounding."""
    from dayzero.model import mla

    step, args = prefilled_mla_layer(seed, q_lora_rank=q_lora_rank)
    plain, _ = step(*args, decode=True)
    calls = []
    project = projection.project
    monkeypatch.setattr(mla, "DECODE_PROJECTIONS", True)
    monkeypatch.setattr(projection, "choose", lambda *a, impl=None: "interpret")
    monkeypatch.setattr(projection, "project", lambda *a, **k: calls.append(k) or project(*a, **k))
    fused, _ = step(*args, decode=True)
    assert len(calls) == 2 and calls[0]["norm_weight"] is not None and calls[1]["residual"] is not None
    err = np.max(np.abs(np.asarray(fused, np.float32) - np.asarray(plain, np.float32)))
    assert err <= 3e-2 * np.max(np.abs(np.asarray(plain, np.float32)))


@pytest.mark.parametrize("q_lora_rank,use_rope,taken", [(None, False, 2), (None, True, 1), (32, False, 1)])
def test_mla_decode_projection_partials(seed, monkeypatch, q_lora_rank, use_rope, taken):
    """`model.mla.PROJECTION_PARTIALS` (every kernel in interpret mode, hidden 256: the projection kernel splits K):
    the query projection's partial sums go unfinished to the absorb kernel (no query LoRA) and the latent rows' to
    the cache write (no rope on the shared key), which finish them as they load; the next-token logits and the latent
    cache equal the step with XLA finishing them, to bf16 rounding."""
    from dayzero.model import mla

    step, args = prefilled_mla_layer(seed, q_lora_rank=q_lora_rank, hidden_size=256, mla_use_rope=use_rope)
    monkeypatch.setenv("DAYZERO_KERNELS", "interpret")
    monkeypatch.setattr(mla, "PROJECTION_PARTIALS", False)
    plain, plain_cache = step(*args, decode=True)
    given = spy_unfinished_consumers(monkeypatch)
    monkeypatch.setattr(mla, "PROJECTION_PARTIALS", True)
    split, split_cache = step(*args, decode=True)
    assert given.count("Partials") == taken, given
    a, b = np.asarray(split, np.float32), np.asarray(plain, np.float32)
    assert np.max(np.abs(a - b)) <= 2e-2 * np.max(np.abs(b))
    c, d = np.asarray(split_cache["latent"], np.float32), np.asarray(plain_cache["latent"], np.float32)
    assert np.max(np.abs(c - d)) <= 2e-2 * np.max(np.abs(d))


@pytest.mark.parametrize("rows", [1, 16, 3])
def test_shared_mlp_through_projection_kernel(seed, monkeypatch, rows):
    """`model.moe.MLP(projection_max_tokens=...)` (the shared experts where they run apart from the routed ones):
    gate|up and down as two projection kernel calls (interpret mode, the model's SHARED_PROJECTION_TILES, K split)
    give the XLA layers' output to bf16 rounding; rows the kernel does not take (3) keep XLA's layers."""
    from dayzero.model import moe

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
    plain_mlp = moe.MLP(128, 256, jnp.bfloat16)
    params = jax.tree.map(lambda p: (p * 2.5).astype(jnp.bfloat16), plain_mlp.init(jax.random.key(seed % 1000), x))
    plain = plain_mlp.apply(params, x)
    calls = []
    project = projection.project
    monkeypatch.setattr(projection, "choose", lambda rows, k, widths, impl=None:
                        "interpret" if projection.supported(rows, k, widths) else "reference")
    monkeypatch.setattr(projection, "project", lambda *a, **k: calls.append(k) or project(*a, **k))
    fused = moe.MLP(128, 256, jnp.bfloat16, projection_max_tokens=16).apply(params, x)
    assert len(calls) == (0 if rows == 3 else 2)
    assert all(call["tiles"] in moe.SHARED_PROJECTION_TILES for call in calls)
    err = np.max(np.abs(np.asarray(fused, np.float32) - np.asarray(plain, np.float32)))
    assert err <= 2e-2 * np.max(np.abs(np.asarray(plain, np.float32))), err
    if rows == 3:
        assert err == 0.0


@pytest.mark.parametrize("rows", [1, 4])
def test_dense_mlp_with_norm_and_residual_in_the_kernels(seed, rows):
    """`moe.swiglu_projected(norm_weight=, residual=)` (interpret mode, the model's DENSE_PROJECTION_TILES, K split):
    x + MLP(RMSNorm(x)) as the XLA layers compute it, to bf16 rounding; without the kernel (reference dispatch) it
    gives None and the caller keeps its layers. Lowers to one Triton kernel per call at the medium hybrid's dense
    layer (2048 x 6144)."""
    from dayzero.model import moe
    from dayzero.model.norms import RMSNorm

    rng = np.random.default_rng(seed)
    hidden, inter = 256, 384
    x = jnp.asarray(rng.standard_normal((rows, hidden)) * 3.0, jnp.bfloat16)
    w = lambda k, n: jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    gate, up, down = w(hidden, inter), w(hidden, inter), w(inter, hidden)
    norm_weight = jnp.asarray(rng.uniform(0.5, 1.5, hidden), jnp.float32)
    normed = RMSNorm(1e-5).apply({"params": {"weight": norm_weight}}, x)
    mlp_params = {"params": {name: {"kernel": k} for name, k in (("gate_proj", gate), ("up_proj", up),
                                                                  ("down_proj", down))}}
    want = np.asarray(x + moe.MLP(inter, hidden, jnp.bfloat16).apply(mlp_params, normed), np.float32)
    got = moe.swiglu_projected(x, gate, up, down, tiles=moe.DENSE_PROJECTION_TILES, impl="interpret",
                               norm_weight=norm_weight, eps=1e-5, residual=x)
    assert got.shape == x.shape and got.dtype == jnp.bfloat16
    err = np.max(np.abs(np.asarray(got, np.float32) - want))
    assert err <= 2e-2 * np.max(np.abs(want)), err
    assert moe.swiglu_projected(x, gate, up, down, impl="reference", norm_weight=norm_weight, residual=x) is None
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    gate_up = lambda x, n, g, u: projection.project(x, ((g, u),), norm_weight=n, eps=1e-5,
                                                    tiles=moe.DENSE_PROJECTION_TILES[0])
    assert count_triton_kernels(gate_up, spec(rows, 2048), spec(2048, dtype=jnp.float32), spec(2048, 6144),
                                spec(2048, 6144)) == 1
    down_call = lambda h, r, d: projection.project(h, ((d,),), residual=r, tiles=moe.DENSE_PROJECTION_TILES[1])
    assert count_triton_kernels(down_call, spec(rows, 6144), spec(rows, 2048), spec(6144, 2048)) == 1


def test_model_decode_with_the_dense_mlp_in_projection_kernels(seed, monkeypatch):
    """`model.moe.DENSE_PROJECTION_MAX_TOKENS` (every kernel in interpret mode, a tiny model of dense MLPs only: no
    router choice to move): a 2-row decode step runs each dense layer's norm, MLP and residual add as the two
    projection kernels, and gives the next-token logits and caches of the step with XLA's layers, to bf16
    rounding."""
    from dayzero.model import moe
    from dayzero.model.config import MLP_DENSE
    from dayzero.model.presets import tiny

    cfg = tiny().replace(hidden_size=64, kda_num_heads=4, kda_head_dim=16, mlp_types=(MLP_DENSE,) * 4,
                         intermediate_size=96, index_topk=0, q_lora_rank=32, kv_lora_rank=28, num_heads=4,
                         v_head_dim=16)
    step, args = prefilled_decode(cfg, seed, 2)
    monkeypatch.setenv("DAYZERO_KERNELS", "interpret")
    calls = []
    projected = moe.swiglu_projected
    monkeypatch.setattr(moe, "swiglu_projected", lambda *a, **k: calls.append(
        (k.get("norm_weight") is not None, k.get("residual") is not None)) or projected(*a, **k))
    plain, plain_cache = step(*args, decode=True)
    assert moe.DENSE_PROJECTION_MAX_TOKENS == 0 and not calls
    monkeypatch.setattr(moe, "DENSE_PROJECTION_MAX_TOKENS", 16)
    fused, fused_cache = step(*args, decode=True)
    assert calls == [(True, True)] * cfg.num_layers
    a, b = np.asarray(fused, np.float64), np.asarray(plain, np.float64)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2
    for name in plain_cache:
        c, d = np.asarray(fused_cache[name], np.float32), np.asarray(plain_cache[name], np.float32)
        assert np.abs(c - d).max() <= 2e-2 * max(np.abs(d).max(), 1e-6), name


VECTOR = projection.ProjectionTiles(block_n=64, step_k=32, num_warps=4, num_stages=1, min_programs=1, k_slices=1,
                                    cuda_cores=True)


@pytest.mark.parametrize("slices", [1, 4])
@pytest.mark.parametrize("norm", [True, False])
def test_one_row_on_cuda_cores(seed, slices, norm):
    """`ProjectionTiles.cuda_cores` (one row, no MMA): two groups with the norm on or off, K split or not, float32
    rows rounded as they load, o_proj with the residual, and `HeadScaled` rows: each within rounding of the float64
    oracle and of the MMA path; finished from `Partials` as the MMA path's are."""
    rng = np.random.default_rng(seed)
    tiles = dataclasses.replace(VECTOR, k_slices=slices, min_programs=10 ** 6)
    x, w, norm_weight = _case(rng, 1, 256, (128, 64, 32, 16, 48), jnp.bfloat16)
    groups = ((w[0], w[1], w[2]), (w[3], w[4]))
    nw = norm_weight if norm else None
    mma = dataclasses.replace(tiles, cuda_cores=False, num_stages=3)
    for rows in (x, x.astype(jnp.float32) + jnp.asarray(rng.standard_normal((1, 256)) * 1e-3, jnp.float32)):
        got = projection.project(rows, groups, norm_weight=nw, eps=1e-5, tiles=tiles, interpret=True)
        want = projection.project(rows, groups, norm_weight=nw, eps=1e-5, tiles=mma, interpret=True)
        for g, m, o in zip(got, want, _oracle(rows.astype(jnp.bfloat16), groups, nw, 1e-5, None)):
            assert g.shape == m.shape == o.shape and g.dtype == jnp.bfloat16
            scale = np.max(np.abs(o))
            assert np.max(np.abs(np.asarray(g, np.float64) - o)) <= 1e-2 * scale
            assert np.max(np.abs(np.asarray(g, np.float64) - np.asarray(m, np.float64))) <= 1e-2 * scale
    parts = projection.project(x, groups, norm_weight=nw, eps=1e-5, tiles=tiles, interpret=True, finish=False)
    if slices > 1:
        assert all(isinstance(p, projection.Partials) and p.sums.shape[:2] == (slices, 1) for p in parts)
        assert (parts[0].squares is not None) == norm
    residual = jnp.asarray(rng.standard_normal((1, 128)), jnp.bfloat16)
    (got,) = projection.project(x, ((w[0],),), residual=residual, tiles=tiles, interpret=True)
    (oracle,) = _oracle(x, ((w[0],),), None, 0.0, residual)
    assert np.max(np.abs(np.asarray(got, np.float64) - oracle)) <= 1e-2 * np.max(np.abs(oracle))
    values = jnp.asarray(rng.standard_normal((1, 256)) * 4, jnp.float32)
    squares = jnp.asarray(rng.uniform(0.5, 2.0, (1, 16)) * 16, jnp.float32)  # 8 heads of 32, 2 parts each
    scaled = projection.HeadScaled(values, squares, 32, 1e-5, "bfloat16")
    (got,) = projection.project(scaled, ((w[0],),), residual=residual, tiles=tiles, interpret=True)
    (oracle,) = _oracle(projection.finished(scaled), ((w[0],),), None, 0.0, residual)
    assert np.max(np.abs(np.asarray(got, np.float64) - oracle)) <= 1e-2 * np.max(np.abs(oracle))


def test_one_row_calls_take_the_cuda_cores_only_when_switched_on(monkeypatch):
    """`ONE_ROW_ON_CUDA_CORES` gives one-row calls `ONE_ROW_TILES` (CUDA cores); other calls keep their tiles."""
    monkeypatch.setattr(projection, "ONE_ROW_ON_CUDA_CORES", False)
    assert projection.default_tiles(3, 1) is projection.TILES
    assert projection.default_tiles(1, 1) is projection.ONE_WEIGHT_TILES
    monkeypatch.setattr(projection, "ONE_ROW_ON_CUDA_CORES", True)
    assert projection.default_tiles(3, 1).cuda_cores and projection.default_tiles(1, 1).cuda_cores
    assert projection.default_tiles(3, 2) is projection.TILES
    assert projection.default_tiles(1, 16) is projection.ONE_WEIGHT_TILES


def test_a_switch_change_takes_effect_at_the_next_trace(monkeypatch):
    """`project` picks its default tiles outside its jit: a caller traced again after `ONE_ROW_ON_CUDA_CORES`
    changes runs the path the switch now names (inside the jit the cached trace would have kept the first)."""
    traced, products = [], projection._vector_products
    monkeypatch.setattr(projection, "_vector_products", lambda *a, **k: traced.append(1) or products(*a, **k))
    x = jnp.ones((1, 64), jnp.bfloat16)
    w = jnp.ones((64, 32), jnp.bfloat16)
    call = lambda: jax.jit(lambda x, w: projection.project(x, ((w,),), interpret=True))(x, w)
    monkeypatch.setattr(projection, "ONE_ROW_ON_CUDA_CORES", False)
    mma = call()
    assert not traced
    monkeypatch.setattr(projection, "ONE_ROW_ON_CUDA_CORES", True)
    vector = call()
    assert traced and np.array_equal(np.asarray(mma[0], np.float32), np.asarray(vector[0], np.float32))


def test_one_row_on_cuda_cores_lowers_to_triton(monkeypatch):
    """With the switch on, the medium hybrid's one-row KDA input projections, o_proj with the residual and o_proj of
    head-scaled rows each lower to one Triton kernel."""
    monkeypatch.setattr(projection, "ONE_ROW_ON_CUDA_CORES", True)
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    x, norm = spec(1, 2048), spec(2048, dtype=jnp.float32)
    ws = (spec(2048, 2048),) * 3 + (spec(2048, 128), spec(2048, 128), spec(2048, 16))
    fn = lambda x, n, *w: projection.project(x, (w[:3], w[3:]), norm_weight=n, eps=1e-5, finish=False)
    assert count_triton_kernels(fn, x, norm, *ws) == 1
    out = lambda o, r, w: projection.project(o, ((w,),), residual=r)
    assert count_triton_kernels(out, x, x, spec(2048, 2048)) == 1
    scaled = lambda v, sq, r, w: projection.project(projection.HeadScaled(v, sq, 128, 1e-5, "bfloat16"), ((w,),),
                                                    residual=r)
    assert count_triton_kernels(scaled, spec(1, 2048, dtype=jnp.float32), spec(1, 64, dtype=jnp.float32), x,
                                spec(2048, 2048)) == 1


ROWS_TILES = projection.ProjectionTiles(block_n=2, step_k=32, num_warps=4, num_stages=1, min_programs=1, k_slices=1,
                                        cuda_cores=True)


@pytest.mark.parametrize("rows,tiles", [(1, ROWS_TILES), (1, None), (4, SMALL)])
@pytest.mark.parametrize("norm", [True, False])
def test_weight_rows(seed, rows, tiles, norm):
    """`project(weight_rows=True)`: the weights stored [N, K] (torch's Linear layout), one row on the CUDA cores with
    whole weight rows per program (K never split: finished outputs even with `finish=False`) or several rows on the
    MMA: two groups with the norm on or off, float32 rows rounded as they load, o_proj with the residual and
    `HeadScaled` rows; each within rounding of the float64 oracle and of the [K, N] path on the same weights."""
    rng = np.random.default_rng(seed)
    x, w, norm_weight = _case(rng, rows, 256, (128, 64, 32, 16, 48), jnp.bfloat16)
    rows_of = lambda gs: tuple(tuple(jnp.asarray(a.T) for a in g) for g in gs)  # the same weights, [N, K]
    groups = ((w[0], w[1], w[2]), (w[3], w[4]))
    nw = norm_weight if norm else None
    noisy = x.astype(jnp.float32) + jnp.asarray(rng.standard_normal(x.shape) * 1e-3, jnp.float32)
    for xs in (x, noisy):
        got = projection.project(xs, rows_of(groups), norm_weight=nw, eps=1e-5, tiles=tiles, interpret=True,
                                 weight_rows=True, finish=False)
        kn = projection.project(xs, groups, norm_weight=nw, eps=1e-5, interpret=True)
        xla = projection.reference(xs, rows_of(groups), norm_weight=nw, eps=1e-5, weight_rows=True)
        for g, k, r, o in zip(got, kn, xla, _oracle(xs.astype(jnp.bfloat16), groups, nw, 1e-5, None)):
            assert isinstance(g, jax.Array) and g.shape == k.shape == r.shape == o.shape and g.dtype == jnp.bfloat16
            scale = np.max(np.abs(o))
            for other in (o, k, r):
                assert np.max(np.abs(np.asarray(g, np.float64) - np.asarray(other, np.float64))) <= 1e-2 * scale
    residual = jnp.asarray(rng.standard_normal((rows, 128)), jnp.bfloat16)
    (got,) = projection.project(x, rows_of(((w[0],),)), residual=residual, tiles=tiles, interpret=True,
                                weight_rows=True)
    (oracle,) = _oracle(x, ((w[0],),), None, 0.0, residual)
    assert np.max(np.abs(np.asarray(got, np.float64) - oracle)) <= 1e-2 * np.max(np.abs(oracle))
    values = jnp.asarray(rng.standard_normal((rows, 256)) * 4, jnp.float32)
    squares = jnp.asarray(rng.uniform(0.5, 2.0, (rows, 16)) * 16, jnp.float32)  # 8 heads of 32, 2 parts each
    scaled = projection.HeadScaled(values, squares, 32, 1e-5, "bfloat16")
    (got,) = projection.project(scaled, rows_of(((w[0],),)), residual=residual, tiles=tiles, interpret=True,
                                weight_rows=True)
    (oracle,) = _oracle(projection.finished(scaled), ((w[0],),), None, 0.0, residual)
    assert np.max(np.abs(np.asarray(got, np.float64) - oracle)) <= 1e-2 * np.max(np.abs(oracle))


def test_weight_rows_names_the_layout_it_needs():
    """A [K, N] weight handed over as weight rows is refused, naming the [N, K] shape it needs."""
    x = jnp.ones((1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"needs bfloat16\[N, 64\] \(weight rows\)"):
        projection.project(x, ((jnp.ones((64, 32), jnp.bfloat16),),), interpret=True, weight_rows=True)
    assert projection.default_tiles(6, 1, weight_rows=True) is projection.WEIGHT_ROWS_TILES
    assert projection.default_tiles(1, 1, weight_rows=True) is projection.WEIGHT_ROWS_ONE_WEIGHT_TILES
    assert projection.default_tiles(1, 2, weight_rows=True) is projection.ONE_WEIGHT_TILES  # MMA, [N, K] blocks


@pytest.mark.parametrize("weight_rows", [True, False])
def test_splits_k_says_what_project_returns(weight_rows):
    """`splits_k` (shapes only) is whether `project(finish=False)` returns `Partials`, for plain and head-scaled rows
    at 1 and 16 rows of the medium hybrid's o_proj, the default tiles and tiles that never split."""
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    weight = spec(2048, 2048)
    seen = set()
    for rows in (1, 16):
        scaled = projection.HeadScaled(spec(rows, 2048, dtype=jnp.float32), spec(rows, 32, dtype=jnp.float32), 128,
                                       1e-5, "bfloat16")
        for x in (spec(rows, 2048), scaled):
            for tiles in (None, dataclasses.replace(projection.TILES, k_slices=1)):
                (out,) = jax.eval_shape(lambda x, w: projection.project(x, ((w,),), tiles=tiles, finish=False,
                                                                         weight_rows=weight_rows), x, weight)
                split = projection.splits_k(x, ((weight,),), tiles=tiles, weight_rows=weight_rows)
                assert split == isinstance(out, projection.Partials), (rows, type(x).__name__, tiles)
                seen.add(split)
    assert seen == {True, False}
    assert not projection.splits_k(spec(1, 2048), ((weight,),), weight_rows=True)  # whole rows: K never split
    assert projection.splits_k(spec(16, 2048), ((weight,),), weight_rows=True)  # the MMA path's K slices


def test_weight_rows_lower_to_triton():
    """The medium hybrid's one-row KDA input projections, o_proj with the residual and o_proj of head-scaled rows,
    from weights stored [N, K], each lower to one Triton kernel."""
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    x, norm = spec(1, 2048), spec(2048, dtype=jnp.float32)
    ws = (spec(2048, 2048),) * 3 + (spec(128, 2048), spec(128, 2048), spec(16, 2048))
    fn = lambda x, n, *w: projection.project(x, (w[:3], w[3:]), norm_weight=n, eps=1e-5, weight_rows=True)
    assert count_triton_kernels(fn, x, norm, *ws) == 1
    out = lambda o, r, w: projection.project(o, ((w,),), residual=r, weight_rows=True)
    assert count_triton_kernels(out, x, x, spec(2048, 2048)) == 1
    scaled = lambda v, sq, r, w: projection.project(projection.HeadScaled(v, sq, 128, 1e-5, "bfloat16"), ((w,),),
                                                    residual=r, weight_rows=True)
    assert count_triton_kernels(scaled, spec(1, 2048, dtype=jnp.float32), spec(1, 64, dtype=jnp.float32), x,
                                spec(2048, 2048)) == 1
