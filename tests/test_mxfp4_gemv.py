"""MXFP4 decode kernels (kernels/moe_mxfp4_gemv.py): the layer in interpret mode against the float64 oracle at odd
token counts and skewed loads for every tile height, the activation packing, the inline PTX block product emulated
instruction by instruction against the jnp form, dispatch, and the lowering to Triton at the real shapes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxfp4_cases import oracle, packed_experts, rel_err, routing, shared_gate_up_sums
from triton_lowering import lower_for_cuda
from dayzero.kernels import moe, moe_mxfp4, moe_mxfp4_gemv as gemv, moe_tiles, mxfp4

E, D, I = 6, 72, 40  # 72: a padded, odd number of K blocks; 40: a masked block of weight rows
SMALL = dict(block_n=16, max_groups=2, split_k=2, min_programs=64)  # several row blocks, K steps and splits


@pytest.mark.parametrize("rows,adaptive,in_kernel", [(1, False, True), (1, False, False), (2, False, False),
                                                     (4, False, True), (4, True, False), (4, True, True)])
@pytest.mark.parametrize("kind,n_tokens,top_k", [("random", 1, 2), ("random", 5, 2), ("one_expert_takes_all", 7, 2),
                                                 ("empty_experts", 4, 2), ("single_last", 3, 1)])
def test_layer_matches_oracle(seed, rows, adaptive, in_kernel, kind, n_tokens, top_k):
    """Every tile height, 4-row tiles that multiply only their real rows (`adaptive`: 1, 2 or 4 of them), the
    activations packed by each program or by XLA (`in_kernel`)."""
    rng = np.random.default_rng(seed)
    ew = packed_experts(rng, E, D, I)
    x = rng.standard_normal((n_tokens, D)).astype(np.float32)
    ids, w = routing(rng, kind, n_tokens, E, top_k)
    tiles = gemv.GemvTiles(rows=rows, adaptive=adaptive, pack_in_kernel=in_kernel, **SMALL)
    got = gemv.grouped_swiglu(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), ew, tiles=tiles, interpret=True)
    assert got.shape == x.shape and got.dtype == jnp.float32
    err = rel_err(got, oracle(x, ids, w, ew))
    assert err < 2e-3, f"rows={rows} adaptive={adaptive} {kind} T={n_tokens}: {err:.2e} (seed={seed})"


@pytest.mark.parametrize("rows,adaptive,in_kernel,kind,block_n", [
    (1, False, True, "random", 16), (1, False, True, "random", 32), (1, False, False, "random", 16),
    (2, True, False, "one_expert_takes_all", 16), (2, True, False, "random", 32), (4, True, True, "empty_experts", 16)])
def test_split_k_finish(seed, rows, adaptive, in_kernel, kind, block_n):
    """K split over several programs in both kernels: gate/up's splits meet in float32 atomics and the last program
    of each weight-row block (a turn counter) applies SwiGLU (with 32-column programs writing h packed for the down
    kernel, from in-kernel or XLA packing); down's splits add into the tokens' sums."""
    hidden, inter = 256, 128
    rng = np.random.default_rng(seed)
    ew = packed_experts(rng, E, hidden, inter)
    tiles = gemv.GemvTiles(rows=rows, adaptive=adaptive, block_n=block_n, max_groups=2, split_k=4,
                           min_programs=512, pack_in_kernel=in_kernel)
    n_tokens, top_k = 5, 2
    tiles_max = moe_tiles.max_tiles(n_tokens * top_k, E, rows)
    assert gemv._launch(8, tiles)[0] == block_n
    assert gemv._k_split(8, tiles, tiles_max * inter // block_n)[1] == 4  # gate/up: 8 blocks of K in 4 splits
    assert gemv._k_split(4, tiles, tiles_max * hidden // block_n)[1] == 2  # down: 4 blocks in 2
    x = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    ids, w = routing(rng, kind, n_tokens, E, top_k)
    got = gemv.grouped_swiglu(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), ew, tiles=tiles, interpret=True)
    err = rel_err(got, oracle(x, ids, w, ew))
    assert err < 2e-3, f"rows={rows} {kind}: {err:.2e} (seed={seed})"


@pytest.mark.parametrize("in_kernel,split_k", [(True, 1), (False, 2), (True, 2)])
def test_hoisted_steps_give_the_same_sums(monkeypatch, seed, in_kernel, split_k):
    """Every K step's loads issued before the first step's products (`DOWN_HOIST_MAX_STEPS`,
    `GATE_UP_HOIST_MAX_STEPS`, 1-row tiles): the same arithmetic in the same order, so the layer's output is the
    loop's bit for bit, for the raw rows each program packs, XLA's packed rows and the gate/up kernel's packed h,
    with K split or not; 2-row tiles keep the loop."""
    hidden, inter = 256, 128
    rng = np.random.default_rng(seed)
    ew = packed_experts(rng, E, hidden, inter)
    x = rng.standard_normal((5, hidden)).astype(np.float32)
    ids, w = routing(rng, "random", 5, E, 2)
    kernel, hoisting = gemv._kernel, []

    def recorded(*refs, **kwargs):
        hoisting.append((kwargs["rows"], kwargs["role"], kwargs["hoist"], kwargs["k_steps"]))
        return kernel(*refs, **kwargs)

    def run(rows, hoist_steps):
        tiles = gemv.GemvTiles(rows=rows, adaptive=rows > 1, block_n=32, max_groups=2, split_k=split_k,
                               min_programs=512, pack_in_kernel=in_kernel)
        for name in ("DOWN_HOIST_MAX_STEPS", "GATE_UP_HOIST_MAX_STEPS"):
            monkeypatch.setattr(gemv, name, hoist_steps)
        return np.asarray(gemv.grouped_swiglu(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), ew, tiles=tiles,
                                              interpret=True))

    looped = run(1, 0)
    monkeypatch.setattr(gemv, "_kernel", recorded)
    hoisted = run(1, 4)
    assert {role for _, role, hoist, _ in hoisting if hoist} == {"gate_up", "down"}, hoisting
    assert max(steps for *_, steps in hoisting) > 1  # more than one step's loads moved ahead
    assert rel_err(looped, oracle(x, ids, w, ew)) < 2e-3
    np.testing.assert_array_equal(hoisted, looped)
    hoisting.clear()
    run(2, 4)
    assert hoisting and not any(hoist for *_, hoist, _ in hoisting), hoisting


def test_hidden_halves_match_packing(seed):
    """With 32-column programs the gate/up kernel writes h packed (each MX block's fp16 halves in word order, read
    as words, and its factor): bit for bit what packing its h values gives (`block_scaled_words`), a partial last
    block included (I = 40), whether its input was packed in the kernel or by XLA."""
    rng = np.random.default_rng(seed)
    ew = packed_experts(rng, E, D, I)
    n_tokens = 3
    x = jnp.asarray(rng.standard_normal((n_tokens, D)).astype(np.float32))
    ids, _ = routing(rng, "random", n_tokens, E, 2)
    sched = moe_tiles.schedule(jnp.asarray(ids), E, 1)
    gate_up = ((ew.gate, ew.gate_scales), (ew.up, ew.up_scales))
    tiles = gemv.GemvTiles(block_n=32, max_groups=2, pack_in_kernel=True)
    (words, factors), form, zeros = gemv.hidden_rows(sched.tile_expert, sched.token_of_row, x, "raw", gate_up,
                                                     tiles, n_tokens, jnp.float32, interpret=True, zeroed=100)
    assert form == "blocks" and words.dtype == jnp.uint32 and words.shape[1:] == (2, 16) and factors.shape[1] == 2
    assert zeros.shape[0] >= 100 and zeros.dtype == jnp.float32 and not np.asarray(zeros).any()
    h, form, zeros = gemv.hidden_rows(sched.tile_expert, sched.token_of_row, x, "raw", gate_up,
                                      gemv.GemvTiles(block_n=32, max_groups=2, pack_hidden=False), n_tokens,
                                      jnp.float32, interpret=True)
    assert form == "raw" and h.shape[1] == I and zeros is None
    real = np.asarray(sched.token_of_row) < n_tokens
    want_words, want_factors = (np.asarray(a)[real] for a in gemv.block_scaled_words(h))
    np.testing.assert_array_equal(np.asarray(words)[real], want_words)
    np.testing.assert_array_equal(np.asarray(factors)[real], want_factors)
    assert np.abs(np.asarray(h)[real]).max() > 0
    # XLA's row-packed input: the same h, packed the same way
    xs = gemv.row_scaled_words(jnp.concatenate([x, jnp.zeros((1, D), x.dtype)]))
    (words2, factors2), form, _ = gemv.hidden_rows(sched.tile_expert, sched.token_of_row, xs, "rows", gate_up,
                                                   gemv.GemvTiles(block_n=32, max_groups=2), n_tokens, jnp.float32,
                                                   interpret=True)
    h2, _, _ = gemv.hidden_rows(sched.tile_expert, sched.token_of_row, xs, "rows", gate_up,
                                gemv.GemvTiles(block_n=32, max_groups=2, pack_hidden=False), n_tokens, jnp.float32,
                                interpret=True)
    assert form == "blocks"
    want_words, want_factors = (np.asarray(a)[real] for a in gemv.block_scaled_words(h2))
    np.testing.assert_array_equal(np.asarray(words2)[real], want_words)
    np.testing.assert_array_equal(np.asarray(factors2)[real], want_factors)


def test_splits_and_programs():
    tiles = gemv.GemvTiles(block_n=32, max_groups=8, split_k=8, min_programs=2048)
    assert gemv._k_split(224, tiles, 8 * 64) == (8, 4)  # DeepSeek gate/up at one token: 28 steps, 4 splits
    assert gemv._k_split(224, tiles, 4096) == (8, 1)  # enough programs already
    assert gemv._k_split(24, tiles, 96) == (8, 3)  # 3 steps: at most 3 splits
    assert gemv._k_split(3, tiles, 1) == (1, 3)
    assert gemv._launch(224, tiles) == (32, 8, 4)  # 32 x 8 blocks: two per thread of 4 warps
    assert gemv._launch(3, gemv.GemvTiles(block_n=32)) == (32, 1, 1)  # one block of K per step: one warp
    assert gemv._launch(1, gemv.GemvTiles(block_n=16, num_warps=2)) == (32, 1, 1)  # rows added to fill a warp
    for groups in (1, 2, 3, 24, 64, 224):
        for tiles_ in (gemv.GemvTiles(block_n=16), gemv.GemvTiles(block_n=64, num_warps=8), tiles):
            bn, gk, warps = gemv._launch(groups, tiles_)
            assert bn * gk >= 32 * warps, (groups, tiles_)  # every thread holds whole MX blocks
    with pytest.raises(ValueError, match="rows"):
        gemv.GemvTiles(rows=3)
    with pytest.raises(ValueError, match="block_n"):
        gemv.GemvTiles(block_n=24)
    with pytest.raises(ValueError, match="num_stages"):
        gemv.GemvTiles(num_stages=0)


def test_activation_words_order_and_scale(seed):
    """Word 4j + m of a block holds the fp16 pair the PTX conversion of the block's word j pairs it with, each MX
    block scaled to a maximum in [2^13, 2^14) (what the kernels pack in place), its factor undoing it;
    _unpack_words gives back each byte's two elements. Blocks of very different magnitude in one row keep their
    own scale."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal((3, 70)) * np.array([[1e-3], [1.0], [300.0]])).astype(np.float32)
    v[1, 32:64] *= 1e-6  # a block far below the rest of its row: still ~11 bits, not fp16 subnormals
    words, factor = gemv.block_scaled_words(jnp.asarray(v))
    assert words.shape == (3, 3, 16) and words.dtype == jnp.uint32 and factor.shape == (3, 3)
    even, odd = (np.asarray(a, np.float64) for a in gemv._unpack_words(words))
    scaled = np.zeros((3, 96))
    scaled[:, :70] = v
    want = scaled / np.repeat(np.asarray(factor, np.float64), 32, axis=1)
    peaks = np.abs(want).reshape(3, 3, 32).max(axis=2)
    assert np.all(peaks < 2 ** 14) and np.all(peaks >= 2 ** 13), peaks
    np.testing.assert_allclose(even.reshape(3, -1), want[:, 0::2], rtol=2 ** -11)
    np.testing.assert_allclose(odd.reshape(3, -1), want[:, 1::2], rtol=2 ** -11)
    h = np.asarray(jax.lax.bitcast_convert_type(words, jnp.float16), np.float64)  # [3, G, 16, 2]
    for j, m, lane, element in ((0, 0, 1, 2), (0, 1, 0, 4), (1, 2, 0, 9), (3, 3, 1, 31)):
        np.testing.assert_allclose(h[:, 1, 4 * j + m, lane], want[:, 32 + element], rtol=2 ** -11)
    zero, _ = gemv.block_scaled_words(jnp.zeros((1, 32)))
    assert not np.any(np.asarray(zero))
    # XLA's form for the kernels that take packed rows: the same words, one factor per row (the row's maximum)
    row_words, row_factor = gemv.row_scaled_words(jnp.asarray(v))
    assert row_factor.shape == (3,)
    want = scaled / np.asarray(row_factor, np.float64)[:, None]
    peaks = np.abs(want).max(axis=1)
    assert np.all(peaks < 2 ** 14) and np.all(peaks >= 2 ** 13), peaks
    even, odd = (np.asarray(a, np.float64) for a in gemv._unpack_words(row_words))
    np.testing.assert_allclose(even.reshape(3, -1), want[:, 0::2], rtol=2 ** -11, atol=2 ** -24)
    np.testing.assert_allclose(odd.reshape(3, -1), want[:, 1::2], rtol=2 ** -11, atol=2 ** -24)


def _f16(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], np.uint16).view(np.float16)[0])


def _f16_bits(value: float) -> int:
    return int(np.array([value], np.float16).view(np.uint16)[0])


def _f32(bits: int) -> float:
    return float(np.array([bits & 0xFFFFFFFF], np.uint32).view(np.float32)[0])


def _f32_bits(value: float) -> int:
    return int(np.array([value], np.float32).view(np.uint32)[0])


def run_block_ptx(ptx: str, operands: dict[int, int]) -> dict[int, int]:
    """Emulates the block-product PTX: operands {$k: 32-bit pattern}; returns the final operands. Integer ops on
    .b32, fp16x2 products with one rounding per operation, float32 ops rounded to float32."""
    regs = {f"${k}": v for k, v in operands.items()}

    def val(tok):
        tok = tok.strip()
        return int(tok, 0) & 0xFFFFFFFF if tok[0].isdigit() else regs[tok]

    def halves(op, *vals):
        lanes = []
        for lane in (0, 1):
            a = [_f16(v >> (16 * lane)) for v in vals]
            lanes.append(_f16_bits(a[0] * a[1] + (a[2] if op == "fma" else 0.0)))
        return lanes[0] | lanes[1] << 16

    for line in ptx.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32":  # {u, v}, a
            dst, src = args.rsplit(",", 1)
            u, v = re.findall(r"\w+", dst)
            regs[u], regs[v] = val(src) & 0xFFFF, val(src) >> 16
            continue
        dst, *src = [a.strip() for a in args.split(",")]
        a = [val(t) for t in src]
        if op == "prmt.b32":
            pool = [(a[0] >> (8 * i)) & 0xFF for i in range(4)] + [(a[1] >> (8 * i)) & 0xFF for i in range(4)]
            out = sum(pool[(a[2] >> (4 * i)) & 0x7] << (8 * i) for i in range(4))
        elif op in ("mul.rn.f16x2", "fma.rn.f16x2"):
            out = halves(op[:3], *a)
        elif op == "cvt.f32.f16":
            out = _f32_bits(_f16(a[0]))
        elif op == "add.f32":
            out = _f32_bits(np.float32(_f32(a[0])) + np.float32(_f32(a[1])))
        elif op == "fma.rn.f32":
            out = _f32_bits(_f32(a[0]) * _f32(a[1]) + _f32(a[2]))
        else:
            out = {"shl.b32": lambda: a[0] << a[1], "shr.b32": lambda: a[0] >> a[1], "and.b32": lambda: a[0] & a[1],
                   "or.b32": lambda: a[0] | a[1]}[op]()
        regs[dst] = out & 0xFFFFFFFF
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


@pytest.mark.parametrize("rows", gemv.ROWS)
def test_block_ptx_matches_jnp(seed, rows):
    """The inline PTX (the GPU path) on one MX block: every nibble value, rows of activations from
    `block_scaled_words`; column r < rows gets the jnp form's block product (fp16 sums: to ~1e-3 of the block's
    magnitude), the other columns keep the accumulator bit for bit."""
    rng = np.random.default_rng(seed)
    ptx = gemv._block_ptx(rows)
    assert gemv._constraints(rows).count(",") + 1 == 16 + 16 + 4 + 16 * rows + 16 * rows
    for trial in range(4):
        block = np.arange(16, dtype=np.uint8) * 17 if trial == 0 else rng.integers(0, 256, 16, dtype=np.uint8)
        words, _ = gemv.block_scaled_words(jnp.asarray(rng.standard_normal((rows, 32)).astype(np.float32)))
        words = np.asarray(words)[:, 0]  # [rows, 16]
        acc = rng.standard_normal(16).astype(np.float32)
        facs = (2.0 ** rng.integers(-8, 8, rows)).astype(np.float32)  # each row's own factor
        operands = {k: _f32_bits(acc[k]) for k in range(16)}
        operands.update({32 + j: int.from_bytes(bytes(block[4 * j:4 * j + 4]), "little") for j in range(4)})
        operands.update({36 + 16 * r + i: int(words[r, i]) for r in range(rows) for i in range(16)})
        operands.update({36 + 16 * rows + 16 * r + i: _f32_bits(facs[r]) for r in range(rows) for i in range(16)})
        out = run_block_ptx(ptx, operands)
        got = np.array([_f32(out[k]) for k in range(16)], np.float32)
        fac_list = [jnp.full((1, 1), f) for f in facs]
        want = np.asarray(gemv._block_products(jnp.asarray(acc)[None, None], jnp.asarray(block)[None, None],
                                               [jnp.asarray(words[r])[None] for r in range(rows)],
                                               fac_list, asm=False))[0, 0]
        magnitude = np.asarray(gemv._block_products(  # the sum of |products|, what fp16 rounding scales with
            jnp.zeros((1, 1, 16)), jnp.asarray(block & 0x77)[None, None],
            [jnp.asarray(words[r] & 0x7FFF7FFF)[None] for r in range(rows)], fac_list, asm=False))[0, 0]
        assert np.all(np.abs(got[:rows] - want[:rows]) <= 2e-3 * magnitude[:rows] + 1e-6), (got, want, magnitude)
        assert np.array_equal(got[rows:].view(np.uint32), acc[rows:].view(np.uint32))


def _expert_specs(n_experts: int, hidden: int, inter: int) -> mxfp4.ExpertWeights:
    """Shapes of packed MXFP4 experts, for lowering without data."""
    s = jax.ShapeDtypeStruct
    gd, gi = mxfp4.num_blocks(hidden), mxfp4.num_blocks(inter)
    up = s((n_experts, inter, gd, 16), jnp.uint8)
    up_scales = s((n_experts, inter, gd), jnp.uint8)
    return mxfp4.ExpertWeights(up, up, s((n_experts, hidden, gi, 16), jnp.uint8), up_scales, up_scales,
                               s((n_experts, hidden, gi), jnp.uint8))


def test_dispatch(monkeypatch):
    """`choose` takes MXFP4 calls whose active experts average up to MAX_ROWS_PER_EXPERT rows; moe_mxfp4's
    grouped_swiglu (and so the model's MoE layers) runs these kernels for them, with tiles as tall as an active
    expert's rows on average, and the MMA kernels for the rest."""
    assert gemv.tiles_for(8, 256) == gemv.GemvTiles(rows=1, block_n=32, max_groups=16, min_programs=512,
                                                    pack_in_kernel=True)
    one_token = gemv.tiles_for(8, 256)
    assert gemv._k_split(224, one_token, 8 * 2048 // 32)[1] == 1  # DeepSeek-size gate/up: 512 programs, K unsplit
    assert gemv._k_split(64, one_token, 6 * 768 // 32)[1] == 4  # the medium layer's 144 programs: K in 4
    assert gemv.tiles_for(32, 256) == gemv.GemvTiles(rows=1, block_n=32, max_groups=16)  # 4 tokens: XLA packs
    assert gemv.tiles_for(128, 256) == gemv.GemvTiles(rows=2, block_n=32, max_groups=16, adaptive=True)
    assert gemv.tiles_for(512, 256).rows == 2
    assert gemv.rows_per_active_expert(8, 256) == pytest.approx(1.014, abs=1e-3)
    assert gemv.rows_per_active_expert(128, 256) == pytest.approx(1.269, abs=1e-3)
    monkeypatch.setattr(gemv, "MAX_ROWS_PER_EXPERT", 3.5)
    assert gemv.choose(6, 64, "mxfp4") is not None and gemv.choose(192, 64, "mxfp4") is not None  # 3.15 rows
    assert gemv.choose(768, 256, "mxfp4") is not None  # DeepSeek-size layer at 96 tokens: 3.16 rows
    assert gemv.choose(384, 64, "mxfp4") is None and gemv.choose(8192 * 8, 256, "mxfp4") is None  # 6 rows, prefill
    assert gemv.choose(8, 64, "float8_e4m3fn") is None
    s = jax.ShapeDtypeStruct
    ew = _expert_specs(64, 2048, 768)
    args = (s((2, 2048), jnp.bfloat16), s((2, 6), jnp.int32), s((2, 6), jnp.float32))
    fn = lambda x, i, w, ew: moe.moe_experts_packed(x, i, w, ew, impl="pallas")[0]  # noqa: E731
    text = lower_for_cuda(fn, *args, ew)
    assert text.count("__gpu$xla.gpu.triton") == 2 and "moe_gemv_gate_up_r1" in text, "the decode kernels"
    monkeypatch.setattr(gemv, "MAX_ROWS_PER_EXPERT", 0.0)
    again = lambda x, i, w, ew: moe.moe_experts_packed(x, i, w, ew, impl="pallas")[0]  # noqa: E731 (a fresh trace)
    assert "moe_gemv_gate_up" not in lower_for_cuda(again, *args, ew)


@pytest.mark.parametrize("shape,n_tokens,rows", [((256, 8, 7168, 2048), 1, 1), ((256, 8, 7168, 2048), 16, 2),
                                                 ((64, 6, 2048, 768), 3, 4)])
def test_lowers_to_triton(shape, n_tokens, rows):
    """Both kernels lower for CUDA at the DeepSeek-size and medium layers, the block PTX inside."""
    n_experts, top_k, hidden, inter = shape
    s = jax.ShapeDtypeStruct
    ew = _expert_specs(n_experts, hidden, inter)
    args = (s((n_tokens, hidden), jnp.bfloat16), s((n_tokens, top_k), jnp.int32), s((n_tokens, top_k), jnp.float32))
    tiles = gemv.GemvTiles(rows=rows, pack_in_kernel=rows == 1)  # both ways of packing the activations
    text = lower_for_cuda(lambda x, i, w, ew: gemv.grouped_swiglu(x, i, w, ew, tiles=tiles), *args, ew)
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert "fma.rn.f16x2" in text


@pytest.mark.parametrize("n_tokens", [1, 16])
def test_no_float_zero_fill_between_kernels(n_tokens):
    """At the medium layer's decode sizes (one token: K split in the gate/up kernel; 16 tokens: 2-row tiles) no
    float32 buffer is zeroed outside the kernels: the split sums are stored per split, and the gate/up kernel writes
    the zeros the down kernel adds into (XLA's zero fills are ~1 us launches each on the GPU). The turn counters
    (int32) remain. At 16 tokens the schedule has no scatter (a fill and a scatter kernel on the GPU) either, and h
    goes from kernel to kernel packed (`GemvTiles.pack_hidden`): the only row maximum XLA takes is x's."""
    s = jax.ShapeDtypeStruct
    ew = _expert_specs(64, 2048, 768)
    args = (s((n_tokens, 2048), jnp.bfloat16), s((n_tokens, 6), jnp.int32), s((n_tokens, 6), jnp.float32))
    tiles = gemv.tiles_for(6 * n_tokens, 64)
    if n_tokens == 1:  # 6 tiles x 24 column blocks: K split in 4 (the partial sums' path)
        assert gemv._k_split(64, tiles, 6 * 24)[1] == 4
    text = lower_for_cuda(lambda x, i, w, ew: gemv.grouped_swiglu(x, i, w, ew, tiles=tiles), *args, ew)
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert not re.search(r"constant dense<0\.0+e\+00> : tensor<[0-9x]*f32>", text)
    if n_tokens > 1:  # the compare schedule gives each row's pair in the pass that finds its token: no scatter
        assert "stablehlo.scatter" not in text
        assert re.findall(r"applies stablehlo.maximum across dimensions = \[1\] : \(tensor<(\d+)x", text) == ["17"]


@pytest.mark.parametrize("shape,packed", [((64, 6, 2048, 768), True), ((256, 8, 7168, 2048), False)])
def test_hidden_packed_where_the_gate_up_kernel_splits_k(shape, packed):
    """At 16 tokens (2-row tiles, x packed by XLA) the gate/up kernel writes h packed where it splits K (the medium
    layer: its block's last program packs), and leaves it to XLA where every program finishes its own block (the
    DeepSeek-size layer, where packing in the kernel measured slower): XLA takes one row maximum (x's) or two."""
    n_experts, top_k, hidden, inter = shape
    s = jax.ShapeDtypeStruct
    ew = _expert_specs(n_experts, hidden, inter)
    args = (s((16, hidden), jnp.bfloat16), s((16, top_k), jnp.int32), s((16, top_k), jnp.float32))
    tiles = gemv.tiles_for(16 * top_k, n_experts)
    n_rows = moe_tiles.max_tiles(16 * top_k, n_experts, 2) * 2
    split = gemv._k_split(hidden // 32, tiles, n_rows // 2 * inter // 32)[1]
    assert tiles.rows == 2 and not tiles.pack_in_kernel and (split > 1) == packed
    text = lower_for_cuda(lambda x, i, w, ew: gemv.grouped_swiglu(x, i, w, ew, tiles=tiles), *args, ew)
    assert len(re.findall(r"applies stablehlo.maximum across dimensions = \[1\]", text)) == (1 if packed else 2)


def test_token_sums_rejects_a_short_buffer():
    rng = np.random.default_rng(0)
    ew = packed_experts(rng, E, D, I)
    sched = moe_tiles.schedule(jnp.zeros((1, 2), jnp.int32).at[0, 1].set(1), E, 1)
    h = jnp.zeros((sched.token_of_row.shape[0], I), jnp.float32)
    with pytest.raises(ValueError, match="sums buffer"):
        gemv.token_sums(sched.tile_expert, sched.pair_of_row(), h, "raw", jnp.ones((2,)), 2, 1,
                        ((ew.down, ew.down_scales),), gemv.GemvTiles(), interpret=True, sums=jnp.zeros((3,)))


def test_rejects_other_formats():
    rng = np.random.default_rng(0)
    ew = packed_experts(rng, E, D, I, "float8_e4m3fn")
    with pytest.raises(ValueError, match="MXFP4"):
        gemv.grouped_swiglu(jnp.zeros((1, D)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), ew, interpret=True)


def test_moe_mxfp4_rejects_workspace_slots_for_gemv_tiles():
    """Explicit decode tiles with workspace slots (converted entries, not packed MXFP4) is a typed error."""
    rng = np.random.default_rng(0)
    ew = packed_experts(rng, E, D, I)
    with pytest.raises(ValueError, match="packed MXFP4"):
        moe_mxfp4.grouped_swiglu(jnp.zeros((1, D)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), ew,
                                 slot_of_expert=jnp.arange(E), tiles=gemv.GemvTiles(), interpret=True)



def _shared_mlp(rng, hidden: int, shared_inter: int):
    """A bf16 shared MLP (gate [H, S], up [H, S], down [S, H]) and its float32 oracle x [T, H] -> [T, H]."""
    weights = tuple(jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.bfloat16)
                    for shape in ((hidden, shared_inter), (hidden, shared_inter), (shared_inter, hidden)))
    gate, up, down = (np.asarray(w, np.float32) for w in weights)

    def oracle_mlp(x):
        g, u = x @ gate, x @ up
        return (g / (1.0 + np.exp(-g)) * u) @ down

    return weights, oracle_mlp


@pytest.mark.parametrize("n_tokens,split_k,in_kernel,given", [(1, 4, True, False), (1, 1, True, True),
                                                              (3, 4, False, False), (2, 2, True, True)])
def test_shared_mlp_folds_into_the_kernels(seed, n_tokens, split_k, in_kernel, given):
    """The shared MLP as pseudo-experts of the decode kernels (`SharedFold`, 1-row tiles): each part of I columns
    runs as SHARED_QUARTERS pseudo-experts over a quarter of K, their gate/up sums meeting in the partials (also
    where the routed programs do not split K), h written packed into each quarter's row for its down slice; routed +
    shared against the float32 oracle. Its ids and weights appended here, or given with the schedule made ahead
    (the router's form: `given`)."""
    hidden, inter, shared_inter, top_k = 1024, 256, 512, 2
    rng = np.random.default_rng(seed)
    ew = packed_experts(rng, E, hidden, inter)
    shared, oracle_mlp = _shared_mlp(rng, hidden, shared_inter)
    tiles = gemv.GemvTiles(rows=1, block_n=32, max_groups=2, split_k=split_k, min_programs=512,
                           pack_in_kernel=in_kernel)
    parts = gemv.shared_parts(n_tokens, top_k, hidden, inter, shared_inter, tiles)
    assert parts == gemv.SHARED_QUARTERS * shared_inter // inter
    x = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    ids, w = routing(rng, "random", n_tokens, E, top_k)
    sched = None
    if given:
        ids_all = np.concatenate([ids, np.broadcast_to(np.arange(E, E + parts), (n_tokens, parts))], axis=1)
        w_all = np.concatenate([w, np.ones((n_tokens, parts), np.float32)], axis=1)
        sched = moe_tiles.schedule(jnp.asarray(ids_all), E + parts, 1)
        ids, w = ids_all, w_all
    got = gemv.grouped_swiglu(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), ew, E, tiles, interpret=True,
                              sched=sched, shared=shared)
    want = oracle(x, ids[:, :top_k], w[:, :top_k], ew) + oracle_mlp(x)
    err = rel_err(got, want)
    assert err < 2e-3, f"T={n_tokens} split_k={split_k}: {err:.2e} (seed={seed})"


def _one_token_with_shared(seed: int, split_k: int):
    """One token of a 1024-wide layer (E experts of 256 columns, top-2) with a 512-column shared MLP, in 1-row
    tiles splitting K up to `split_k` -> (rng, experts, shared MLP, its oracle, x [1, 1024] bf16, ids, weights,
    tiles)."""
    hidden, inter, shared_inter, top_k = 1024, 256, 512, 2
    rng = np.random.default_rng(seed)
    ew = packed_experts(rng, E, hidden, inter)
    shared, oracle_mlp = _shared_mlp(rng, hidden, shared_inter)
    tiles = gemv.GemvTiles(rows=1, block_n=32, max_groups=2, split_k=split_k, min_programs=512, pack_in_kernel=True)
    x = jnp.asarray(rng.standard_normal((1, hidden)), jnp.bfloat16)
    ids, w = routing(rng, "random", 1, E, top_k)
    return rng, ew, shared, oracle_mlp, x, ids, w, tiles


@pytest.mark.parametrize("split_k,parts_of_k", [(4, 2), (1, 1), (2, 4)])
def test_shared_gate_up_sums_made_ahead(seed, split_k, parts_of_k):
    """One token with the shared MLP's gate / up sums made ahead (`SharedMLP.gate_up_sums`, as the MoE front kernel
    makes them in parts of K): the gate/up kernel finishes them (quarter 0's programs) instead of streaming gate and
    up, giving the same result as the fold that streams them, near the float32 oracle, and the same again from sums
    with a factor still to apply (`ScaledSums`); sums for more than one token or of another shape, and a factor not
    float32 [1], are refused by name."""
    rng, ew, shared, oracle_mlp, x, ids, w, tiles = _one_token_with_shared(seed, split_k)
    made = gemv.SharedMLP(*shared, gate_up_sums=shared_gate_up_sums(x, shared, parts_of_k))
    args = (x, jnp.asarray(ids), jnp.asarray(w), ew, E, tiles)
    got = gemv.grouped_swiglu(*args, interpret=True, shared=made)
    streamed = gemv.grouped_swiglu(*args, interpret=True, shared=shared)
    want = oracle(np.asarray(x, np.float32), ids, w, ew) + oracle_mlp(np.asarray(x, np.float32))
    # (x and the result in bf16: the oracle within its rounding)
    assert rel_err(got, streamed) < 1e-2 and rel_err(got, want) < 6e-3, (rel_err(got, streamed), rel_err(got, want))
    with pytest.raises(ValueError, match="one token"):
        gemv.grouped_swiglu(jnp.concatenate([x, x]), jnp.asarray(np.concatenate([ids, ids])),
                            jnp.asarray(np.concatenate([w, w])), ew, E, tiles, interpret=True, shared=made)
    with pytest.raises(ValueError, match=r"float32 \[F, 2, 512\]"):
        gemv.grouped_swiglu(*args, interpret=True, shared=made._replace(gate_up_sums=made.gate_up_sums[:, :1]))
    # the sums with a factor still to apply (`ScaledSums`, the front's row-part form): their total times it
    factor = jnp.asarray([0.37], jnp.float32)
    scaled = made._replace(gate_up_sums=gemv.ScaledSums(made.gate_up_sums / factor[0], factor))
    # (other float32 roundings of the sums may move h's or the result's bf16 rounding by a step)
    assert rel_err(gemv.grouped_swiglu(*args, interpret=True, shared=scaled), got) < 8e-3
    with pytest.raises(ValueError, match=r"factor is float32 \[1\]"):
        gemv.grouped_swiglu(*args, interpret=True,
                            shared=made._replace(gate_up_sums=gemv.ScaledSums(made.gate_up_sums, factor[None])))


@pytest.mark.parametrize("split_k", [1, 2])
def test_shared_down_in_the_gate_up_kernel(seed, split_k):
    """One token with the shared MLP's gate / up sums made ahead and `down_in_gate_up`: the gate/up kernel's shared
    tiles run the down projection from those sums into the residual rows (`SharedFold.down_cols`) and the down
    kernel's skip them; residual + routed + shared as with the down kernel running the shared down, near the float32
    oracle, and the same from sums with a factor still to apply (`ScaledSums`). Without the residual rows, or without
    the sums, it is refused by name."""
    rng, ew, shared, oracle_mlp, x, ids, w, tiles = _one_token_with_shared(seed, split_k)
    residual = jnp.asarray(rng.standard_normal((1, x.shape[1])) * 4, jnp.float32)
    sums = shared_gate_up_sums(x, shared, 1)
    args = (x, jnp.asarray(ids), jnp.asarray(w), ew, E, tiles)
    made_early = gemv.SharedMLP(*shared, gate_up_sums=sums, down_in_gate_up=True)
    assert len(jax.tree_util.tree_leaves(made_early)) == 4  # the switch is static: it may cross a jit boundary
    early = jax.jit(lambda sh: gemv.grouped_swiglu(*args, interpret=True, residual_sums=residual, shared=sh))(
        made_early)
    late = gemv.grouped_swiglu(*args, interpret=True, residual_sums=residual,
                               shared=gemv.SharedMLP(*shared, gate_up_sums=sums))
    assert early.dtype == jnp.float32 and early.shape == x.shape
    want = (np.asarray(residual, np.float64) + oracle(np.asarray(x, np.float32), ids, w, ew)
            + oracle_mlp(np.asarray(x, np.float32)))
    assert rel_err(early, late) < 1e-5 and rel_err(early, want) < 3e-3, (rel_err(early, late), rel_err(early, want))
    factor = jnp.asarray([2.5], jnp.float32)  # the sums with a factor still to apply (`ScaledSums`)
    scaled = gemv.SharedMLP(*shared, gate_up_sums=gemv.ScaledSums(sums / factor[0], factor), down_in_gate_up=True)
    assert len(jax.tree_util.tree_leaves(scaled)) == 5
    got = jax.jit(lambda sh: gemv.grouped_swiglu(*args, interpret=True, residual_sums=residual, shared=sh))(scaled)
    assert rel_err(got, early) < 1e-3  # (other float32 roundings of the sums may move h's bf16 rounding by a step)
    with pytest.raises(ValueError, match="residual rows"):
        gemv.grouped_swiglu(*args, interpret=True, shared=gemv.SharedMLP(*shared, gate_up_sums=sums,
                                                                         down_in_gate_up=True))
    with pytest.raises(ValueError, match="residual rows"):
        gemv.grouped_swiglu(*args, interpret=True, residual_sums=residual,
                            shared=gemv.SharedMLP(*shared, down_in_gate_up=True))


def test_shared_mlp_fold_limits():
    """Where the fold does not apply `shared_parts` is 0 (2-row tiles; I not a multiple of 32 x quarters; the down
    kernel's K splits not dividing a quarter), and `grouped_swiglu(shared=)` refuses such a call with a typed error;
    the MMA kernels refuse a shared MLP."""
    one = gemv.GemvTiles(rows=1, block_n=32, max_groups=2, min_programs=512, pack_in_kernel=True)
    assert gemv.shared_parts(1, 2, 1024, 256, 256, one) == gemv.SHARED_QUARTERS
    assert gemv.shared_parts(1, 2, 1024, 256, 256, gemv.GemvTiles(rows=2, adaptive=True)) == 0
    assert gemv.shared_parts(1, 2, 1024, 96, 96, one) == 0
    assert gemv.shared_parts(1, 2, 1024, 256, 128, one) == 0  # S not a multiple of I
    assert gemv.shared_parts(1, 8, 7168, 2048, 2048, gemv.tiles_for(8, 256)) == gemv.SHARED_QUARTERS
    assert gemv.shared_parts(1, 6, 2048, 768, 768, gemv.tiles_for(6, 64)) == gemv.SHARED_QUARTERS
    rng = np.random.default_rng(0)
    ew = packed_experts(rng, E, 1024, 96)
    shared, _ = _shared_mlp(rng, 1024, 96)
    with pytest.raises(ValueError, match="does not fold"):
        gemv.grouped_swiglu(jnp.zeros((1, 1024)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), ew, tiles=one,
                            interpret=True, shared=shared)
    with pytest.raises(ValueError, match="MMA kernels"):
        moe_mxfp4.grouped_swiglu(jnp.zeros((1, 1024)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), ew,
                                 tiles=moe_mxfp4.Tiles(), interpret=True, shared=shared)


@pytest.mark.parametrize("shape", [(64, 6, 2048, 768), (256, 8, 7168, 2048)])
def test_shared_fold_lowers_to_triton(shape):
    """With the shared MLP folded in, one token is still two Triton kernels at the medium and DeepSeek-size layers
    (no projection kernels or XLA SwiGLU for the shared MLP), the routed block PTX inside."""
    n_experts, top_k, hidden, inter = shape
    s = jax.ShapeDtypeStruct
    ew = _expert_specs(n_experts, hidden, inter)
    args = (s((1, hidden), jnp.bfloat16), s((1, top_k), jnp.int32), s((1, top_k), jnp.float32))
    shared = (s((hidden, inter), jnp.bfloat16), s((hidden, inter), jnp.bfloat16), s((inter, hidden), jnp.bfloat16))
    tiles = gemv.tiles_for(top_k, n_experts)
    fn = lambda x, i, w, ew, sh: gemv.grouped_swiglu(x, i, w, ew, tiles=tiles, shared=sh)  # noqa: E731
    text = lower_for_cuda(fn, *args, ew, shared)
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert "fma.rn.f16x2" in text and "stablehlo.dot" not in text


@pytest.mark.parametrize("n_tokens,kind", [(1, "random"), (3, "random"), (4, "one_expert_takes_all")])
def test_down_kernel_adds_into_the_residual_rows(seed, n_tokens, kind):
    """`grouped_swiglu(residual_sums=)`, 1-row tiles (no padding rows) over whole blocks of the hidden size: the down
    kernel adds into the given float32 residual rows instead of zeros, and the result is float32 residual + experts,
    unrounded, near the oracle's and the zero-start result's plus the residual. Taller tiles, a short or
    16-bit residual and a hidden size that the kernel's blocks do not tile are refused by name."""
    hidden, inter = 64, 40
    rng = np.random.default_rng(seed)
    ew = packed_experts(rng, E, hidden, inter)
    x = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    residual = (rng.standard_normal((n_tokens, hidden)) * 4).astype(np.float32)
    ids, w = routing(rng, kind, n_tokens, E, 2)
    tiles = gemv.GemvTiles(rows=1, block_n=16, max_groups=2, split_k=2, min_programs=64, pack_in_kernel=True)
    assert gemv.sums_take_residual(hidden, inter, tiles)
    args = (jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), ew)
    got = gemv.grouped_swiglu(*args, tiles=tiles, interpret=True, residual_sums=jnp.asarray(residual))
    assert got.shape == x.shape and got.dtype == jnp.float32
    want = residual.astype(np.float64) + oracle(x, ids, w, ew)
    assert rel_err(got, want) < 2e-3, f"{kind} T={n_tokens}: {rel_err(got, want):.2e} (seed={seed})"
    plain = gemv.grouped_swiglu(*args, tiles=tiles, interpret=True)  # the same experts, from zeros
    np.testing.assert_allclose(np.asarray(got) - residual, np.asarray(plain), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="1-row tiles"):
        gemv.grouped_swiglu(*args, tiles=gemv.GemvTiles(rows=2, **SMALL), interpret=True,
                            residual_sums=jnp.asarray(residual))
    with pytest.raises(ValueError, match="residual rows"):
        gemv.grouped_swiglu(*args, tiles=tiles, interpret=True, residual_sums=jnp.asarray(residual, jnp.bfloat16))
    with pytest.raises(ValueError, match="residual rows"):
        gemv.grouped_swiglu(*args, tiles=tiles, interpret=True, residual_sums=jnp.asarray(residual[:, :32]))
    assert not gemv.sums_take_residual(72, inter, tiles)  # 72 rows: the kernel's sums rows are 80 wide
    assert not gemv.sums_take_residual(hidden, inter, gemv.GemvTiles(rows=2, **SMALL))
