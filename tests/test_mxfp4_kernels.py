"""MXFP4 MoE kernels: the Pallas grouped matmuls (interpret mode) and the jnp reference against a float64 oracle at
odd token counts and skewed loads, the workspace (residency, conversion kernel), the tile schedule, and the Triton
lowering of every kernel for CUDA at the medium-hybrid and DeepSeek shapes."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxfp4_cases import ROUTINGS, expert_specs, oracle, packed_experts, rel_err, routing
from triton_lowering import count_triton_kernels, lower_for_cuda
from dayzero.kernels import moe, moe_mxfp4, moe_tiles, moe_workspace, mxfp4
from dayzero.kernels import tiles as tiling

E, D, I = 6, 72, 40  # 72 = 2.25 blocks of 32: a padded, odd number of K groups; 40: masked column tiles
SMALL = moe_mxfp4.Tiles(block_m=16, block_n=16, max_groups=2)  # several column tiles and K steps


_packed = jax.jit(moe.moe_experts_packed, static_argnames=("tiles", "impl"))


def _run(x, ids, w, ew, impl, tiles=SMALL, workspace=None, layer=0):
    return _packed(x, ids, w, ew, layer=layer, workspace=workspace, tiles=tiles, impl=impl)


def _check_fused(rng, kind, n_tokens, seed, top_k=2):
    ew = packed_experts(rng, E, D, I)
    x = rng.standard_normal((n_tokens, D)).astype(np.float32)
    ids, w = routing(rng, kind, n_tokens, E, top_k)
    want = oracle(x, ids, w, ew)
    got, _ = _run(jnp.asarray(x), ids, w, ew, "interpret")
    assert np.all(np.isfinite(np.asarray(got)))
    assert rel_err(got, want) < 4e-3, f"pallas {kind} T={n_tokens}: {rel_err(got, want):.2e} (seed={seed})"
    ref, _ = _run(jnp.asarray(x), ids, w, ew, "reference")
    assert rel_err(ref, want) < 1e-5, f"reference {kind}: {rel_err(ref, want):.2e} (seed={seed})"


@pytest.mark.parametrize("n_tokens", [1, 13])
def test_fused_mxfp4_matches_oracle(seed, n_tokens):
    _check_fused(np.random.default_rng(seed), "random", n_tokens, seed)


def test_fused_mxfp4_skewed_loads(seed):
    """Empty experts, one expert in every token's choices, and every token on one expert (top-1)."""
    rng = np.random.default_rng(seed)
    for kind in ROUTINGS[1:]:
        _check_fused(rng, kind, 9, seed, top_k=1 if kind == "single_last" else 2)


@pytest.mark.parametrize("fmt,tol", [("float8_e4m3fn", 4e-3), ("bfloat16", 2e-2)])
def test_offline_converted_matches_oracle(seed, fmt, tol):
    rng = np.random.default_rng(seed)
    ew = packed_experts(rng, E, D, I, fmt)
    x = rng.standard_normal((11, D)).astype(np.float32)
    ids, w = routing(rng, "random", 11, E)
    want = oracle(x, ids, w, ew)
    got, _ = _run(jnp.asarray(x), ids, w, ew, "interpret")
    assert rel_err(got, want) < tol, f"pallas {fmt}: {rel_err(got, want):.2e} (seed={seed})"


def test_choose_tiles_by_rows_per_expert(monkeypatch):
    """16-row tiles (split-K for one token's experts; 8 blocks per K step from `LONG_K_MIN_HIDDEN`) up to 16 rows per
    active expert, 32 rows with the weights as the MMA's A operand up to 48, then 64 x 64 tiles, or with
    `WIDE_PREFILL_TILES` 128-column tiles with the weights as A: 64 rows up to 128, then 128 rows."""
    assert moe_mxfp4.choose_tiles(6, 64).split_k > 1
    assert moe_mxfp4.choose_tiles(64 * 6, 64).block_m == 16  # 6 rows per expert
    groups = [moe_mxfp4.choose_tiles(64 * 6, 64, hidden, fmt).max_groups
              for hidden, fmt in ((2048, "mxfp4"), (7168, "mxfp4"), (7168, "float8_e4m3fn"))]
    assert groups == [4, 8, 4]  # longer K steps for wide MXFP4 experts (`LONG_K_MIN_HIDDEN`)
    many = moe_mxfp4.choose_tiles(256 * 6, 64)  # 24 rows per expert
    assert many.block_m == 32 and many.weights_as_a is moe_mxfp4.WEIGHTS_AS_A_32_ROWS
    shape = lambda t: (t.block_m, t.block_n, t.weights_as_a)  # noqa: E731
    for wide, want in ((False, [(64, 64, False)] * 2), (True, [(64, 128, True), (128, 128, True)])):
        monkeypatch.setattr(moe_mxfp4, "WIDE_PREFILL_TILES", wide)
        tiles = moe_mxfp4.choose_tiles(1024 * 6, 64), moe_mxfp4.choose_tiles(4096 * 6, 64)  # 96, 384 rows per expert
        assert [shape(t) for t in tiles] == want


def test_default_tiles_bf16_activations(seed):
    """choose_tiles' prefill tiles (64 rows, 4 groups per K step) with bf16 activations."""
    rng = np.random.default_rng(seed)
    ew = packed_experts(rng, 2, 128, 32)
    x = jnp.asarray(rng.standard_normal((60, 128)), jnp.bfloat16)
    ids, w = routing(rng, "random", 60, 2)
    tiles = moe_mxfp4.choose_tiles(120, 2)
    assert tiles.block_m == 64 and tiling.pow2_divisor(4, tiles.max_groups) == 4
    got, _ = _run(x, ids, w, ew, "interpret", tiles=None)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, oracle(np.asarray(x, np.float32), ids, w, ew)) < 2e-2


@pytest.mark.parametrize("dtype,impl", [("float8_e4m3fn", "interpret"), ("bfloat16", "reference")])
def test_workspace_layers_reuse_and_match(seed, dtype, impl):
    """One workspace through two layers and back: conversions counted, resident experts reused, outputs right."""
    rng = np.random.default_rng(seed)
    layers = [packed_experts(rng, E, D, I), packed_experts(rng, E, D, I)]
    x = rng.standard_normal((5, D)).astype(np.float32)
    ids, w = routing(rng, "random", 5, E)
    active = len(np.unique(ids))
    ws = moe_workspace.create(moe_workspace.num_slots(ids.size, E), D, I, dtype)
    tol = 4e-3 if dtype == "float8_e4m3fn" else 2e-2
    counts = []
    for layer in (0, 0, 1):
        y, ws = _run(jnp.asarray(x), ids, w, layers[layer], impl, workspace=ws, layer=jnp.int32(layer))
        assert rel_err(y, oracle(x, ids, w, layers[layer])) < tol, f"layer {layer} (seed={seed})"
        counts.append((int(ws.hits), int(ws.misses)))
    assert counts == [(0, active), (active, active), (active, 2 * active)]
    assert moe_workspace.hit_rate(ws) == pytest.approx(1 / 3)


def test_workspace_assign_policy():
    assign = jax.jit(moe_workspace.assign)
    ws = moe_workspace.create(4, 32, 32)
    sizes = lambda *experts: jnp.zeros(8, jnp.int32).at[jnp.asarray(experts)].set(3)  # noqa: E731
    ws, a = assign(ws, 2, sizes(1, 5, 6))
    assert np.asarray(a.need).tolist() == [True, True, True, False]
    assert np.asarray(a.slot_of_expert)[[1, 5, 6]].tolist() == [0, 1, 2]
    assert np.asarray(ws.tags).tolist() == [17, 21, 22, -1]
    # experts 5 and 6 stay resident in their slots; 0 and 3 take the free slot and the slot of expert 1
    ws, a = assign(ws, 2, sizes(0, 3, 5, 6))
    assert np.asarray(a.slot_of_expert)[[5, 6]].tolist() == [1, 2]
    assert sorted(np.asarray(a.slot_of_expert)[[0, 3]].tolist()) == [0, 3]
    assert np.asarray(a.need).tolist() == [True, False, False, True]
    assert (int(ws.hits), int(ws.misses)) == (2, 5)
    # the same experts of another layer are other weights: all misses
    ws, a = assign(ws, 3, sizes(0, 3, 5, 6))
    assert bool(jnp.all(a.need)) and (int(ws.hits), int(ws.misses)) == (2, 9)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_convert_kernel_writes_only_needed_slots(seed, dtype):
    rng = np.random.default_rng(seed)
    blocks = jnp.asarray(rng.integers(0, 256, (5, 70, 3, 16), dtype=np.uint8))
    scales = jnp.asarray(rng.integers(110, 140, (5, 70, 3), dtype=np.uint8))
    old = mxfp4.to_workspace(blocks[:4], scales[:4], dtype)
    need = jnp.asarray([True, False, True, False])
    slot_expert = jnp.asarray([4, 0, 2, 0], jnp.int32)
    new = jax.jit(lambda ws: moe_mxfp4.convert(ws, need, slot_expert, blocks, scales, block_rows=32,
                                               max_groups=2, interpret=True))(old)
    want = mxfp4.to_workspace(blocks[jnp.asarray([4, 1, 2, 3])], scales[jnp.asarray([4, 1, 2, 3])], dtype)
    np.testing.assert_array_equal(np.asarray(new, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("n_tokens", [21, 1])
def test_tile_schedule(seed, n_tokens):
    """The general schedule (sorted by expert) and a single token's (one tile per pair, no sort) keep the same
    invariants."""
    rng = np.random.default_rng(seed)
    ids, _ = routing(rng, "empty_experts", n_tokens, 8, top_k=3)
    bm = 4
    s = jax.jit(moe_tiles.schedule, static_argnums=(1, 2))(jnp.asarray(ids), 8, bm)
    rows = np.asarray(s.row_of_pair).reshape(-1)
    assert len(set(rows.tolist())) == rows.size  # each pair its own row
    tile_expert = np.asarray(s.tile_expert)
    assert tile_expert.size == moe_tiles.max_tiles(ids.size, 8, bm)
    np.testing.assert_array_equal(tile_expert[rows // bm], ids.reshape(-1))  # a pair's tile is its expert's
    used = tile_expert[tile_expert >= 0]
    assert set(used.tolist()) == set(np.unique(ids).tolist())  # empty experts get no tile
    sizes = np.bincount(ids.reshape(-1), minlength=8)
    np.testing.assert_array_equal(np.asarray(s.group_sizes), sizes)
    assert used.size == int(np.sum(-(-sizes // bm))) and np.all(tile_expert[used.size:] == -1)
    token_of_row = np.asarray(s.token_of_row)
    np.testing.assert_array_equal(token_of_row[rows], np.repeat(np.arange(n_tokens), 3))
    assert np.sum(token_of_row == n_tokens) == token_of_row.size - rows.size  # the rest read the zero row


@pytest.mark.parametrize("n_tokens, n_experts, top_k, block_m, kind", [
    (2, 8, 3, 4, "random"), (16, 64, 6, 16, "random"), (37, 8, 2, 4, "empty_experts"), (50, 8, 1, 16, "single_last"),
    (64, 64, 2, 16, "one_expert_takes_all")])
def test_compare_schedule_equals_sorted(seed, n_tokens, n_experts, top_k, block_m, kind):
    """The sort-free schedule of decode-sized calls is the sort-based one, array for array; its pairs' rows, made in
    the same pass, are the scatter that `Schedule.pair_of_row` makes for the sorted one."""
    rng = np.random.default_rng(seed)
    ids, _ = routing(rng, kind, n_tokens, n_experts, top_k=top_k)
    ids = jnp.asarray(ids)
    got = jax.jit(moe_tiles._compare_schedule, static_argnums=(1, 2))(ids, n_experts, block_m)
    want = jax.jit(moe_tiles._sorted_schedule, static_argnums=(1, 2))(ids, n_experts, block_m)
    assert want.pair_rows is None and got.pair_rows is not None
    for name, g, w in zip(moe_tiles.Schedule._fields, got[:4], want[:4]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{name} ({kind}, seed={seed})")
    np.testing.assert_array_equal(np.asarray(got.pair_of_row()), np.asarray(jax.jit(want.pair_of_row)()),
                                  err_msg=f"pair_of_row ({kind}, seed={seed})")
    assert ids.size <= moe_tiles.COMPARE_MAX_PAIRS  # what schedule() runs for these sizes


SHAPES = {"medium": (64, 2048, 768, 6), "deepseek": (256, 7168, 2048, 8)}


def _specs(n_experts, hidden, inter, fmt):
    ew = expert_specs(n_experts, hidden, inter, fmt)
    # converted stacks as offline conversion leaves them for the kernels (the DeepSeek-size layer's FP8 padded)
    return ew if fmt == "mxfp4" else jax.eval_shape(moe_workspace.clear_of_offset_wrap, ew)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("n_tokens", [1, 8192])
def test_kernels_lower_to_triton(shape, n_tokens):
    n_experts, hidden, inter, top_k = SHAPES[shape]
    s = jax.ShapeDtypeStruct
    args = (s((n_tokens, hidden), jnp.bfloat16), s((n_tokens, top_k), jnp.int32), s((n_tokens, top_k), jnp.float32))
    for fmt in ("mxfp4", "float8_e4m3fn", "bfloat16"):
        fused = lambda x, i, w, ew: moe.moe_experts_packed(x, i, w, ew, impl="pallas")[0]  # noqa: E731
        assert count_triton_kernels(fused, *args, _specs(n_experts, hidden, inter, fmt)) == 2, fmt
    for dtype in ("float8_e4m3fn", "bfloat16"):
        ws = jax.eval_shape(lambda: moe_workspace.create(min(n_experts, n_tokens * top_k), hidden, inter, dtype))
        staged = lambda x, i, w, ew, ws: moe.moe_experts_packed(x, i, w, ew, workspace=ws, impl="pallas")  # noqa
        assert count_triton_kernels(staged, *args, _specs(n_experts, hidden, inter, "mxfp4"), ws) == 5, dtype


# split-K (decode): gate/up K = 3 groups -> 3 splits of one group; down K = 2 groups -> 2 splits (SPLIT) or one
# K step, not split (SPLIT_GATE_UP: only gate/up split, the down kernel on the default path)
SPLIT = moe_mxfp4.Tiles(block_m=16, block_n=16, max_groups=1, split_k=4)
SPLIT_GATE_UP = moe_mxfp4.Tiles(block_m=16, block_n=32, max_groups=2, split_k=3)


@pytest.mark.parametrize("kind,n_tokens,top_k,tiles", [
    ("random", 1, 2, SPLIT), ("one_expert_takes_all", 3, 2, SPLIT), ("single_last", 3, 1, SPLIT_GATE_UP)])
def test_split_k_matches_oracle(seed, kind, n_tokens, top_k, tiles):
    rng = np.random.default_rng(seed)
    ew = packed_experts(rng, E, D, I)
    assert moe_mxfp4._k_split(3, tiles)[1] == 3 and moe_mxfp4._split_k(ew, tiles)
    x = rng.standard_normal((n_tokens, D)).astype(np.float32)
    ids, w = routing(rng, kind, n_tokens, E, top_k)
    got, _ = _run(jnp.asarray(x), ids, w, ew, "interpret", tiles=tiles)
    assert np.all(np.isfinite(np.asarray(got)))
    assert rel_err(got, oracle(x, ids, w, ew)) < 4e-3, f"split-K {kind} T={n_tokens} (seed={seed})"
    if n_tokens == 1:  # the pairs' rows of the kernels alone agree with the default path's
        p = moe_mxfp4.plan(jnp.asarray(x), jnp.asarray(ids), ew, None, E, tiles)
        pairs = np.asarray(p.sched.row_of_pair).reshape(-1)
        rows = moe_mxfp4.expert_rows(p, ew, jnp.float32, tiles, interpret=True)
        ref = moe_mxfp4.expert_rows(p, ew, jnp.float32, SMALL, interpret=True)
        np.testing.assert_allclose(np.asarray(rows)[pairs], np.asarray(ref)[pairs], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_tokens,tiles", [
    (5, moe_mxfp4.Tiles(block_m=16, block_n=16, max_groups=2, weights_as_a=True)),
    (1, dataclasses.replace(SPLIT, weights_as_a=True)),
    (5, moe_mxfp4.Tiles(block_m=16, block_n=16, max_groups=1, prefetch_scales=True)),
    (1, dataclasses.replace(SPLIT_GATE_UP, prefetch_scales=True, weights_as_a=True)),
    (40, moe_mxfp4.Tiles(block_m=32, block_n=16, max_groups=2, weights_as_a=True)),
    (150, moe_mxfp4.Tiles(block_m=128, block_n=32, max_groups=2, num_warps=8, weights_as_a=True))])
def test_tile_options_match_oracle(seed, n_tokens, tiles):
    """Tiles.weights_as_a (out^T = W x^T in the kernels, transposed before the epilogue) and Tiles.prefetch_scales
    (each K step's scales loaded one step ahead) against the oracle, with and without split-K, in MXFP4 and
    pre-converted FP8."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tokens, D)).astype(np.float32)
    ids, w = routing(rng, "random", n_tokens, E, 2)
    for fmt in ("mxfp4", "float8_e4m3fn"):
        ew = packed_experts(rng, E, D, I, fmt)
        got, _ = _run(jnp.asarray(x), ids, w, ew, "interpret", tiles=tiles)
        err = rel_err(got, oracle(x, ids, w, ew))
        assert err < 4e-3, f"{tiles} {fmt} T={n_tokens}: {err:.2e} (seed={seed})"


def test_split_k_lowers_to_triton():
    """The split-K kernels at the medium hybrid's decode shape (gate/up K split 8 ways, down 6 ways)."""
    n_experts, hidden, inter, top_k = SHAPES["medium"]
    s = jax.ShapeDtypeStruct
    args = (s((1, hidden), jnp.bfloat16), s((1, top_k), jnp.int32), s((1, top_k), jnp.float32))
    tiles = moe_mxfp4.Tiles(block_m=16, block_n=32, max_groups=4, split_k=8)
    assert [moe_mxfp4._k_split(g, tiles)[1] for g in (hidden // 32, inter // 32)] == [8, 6]
    for fmt in ("mxfp4", "float8_e4m3fn"):
        fused = lambda x, i, w, ew: moe.moe_experts_packed(x, i, w, ew, tiles=tiles, impl="pallas")[0]  # noqa: E731
        text = lower_for_cuda(fused, *args, _specs(n_experts, hidden, inter, fmt))
        assert text.count("__gpu$xla.gpu.triton") == 2, fmt


def _run_ptx(ptx: str, word: int, n_out: int) -> list[int]:
    """Emulates the integer PTX of the conversion blocks (prmt, shl, shr, and, or on .b32) on one input word."""
    n_in = max(int(t) for t in re.findall(r"[$]([0-9]+)", ptx))  # the input: the highest operand
    regs = {f"${n_in}": word}

    def val(tok):
        tok = tok.strip()
        return int(tok, 0) & 0xFFFFFFFF if tok[0].isdigit() else regs[tok]

    for line in ptx.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        a = [val(t) for t in src]
        if op == "prmt.b32":
            pool = [(a[0] >> (8 * i)) & 0xFF for i in range(4)] + [(a[1] >> (8 * i)) & 0xFF for i in range(4)]
            out = sum(pool[(a[2] >> (4 * i)) & 0x7] << (8 * i) for i in range(4))  # no sign-replicate selectors
            assert all(not (a[2] >> (4 * i)) & 0x8 for i in range(4))
        else:
            out = {"shl.b32": lambda: a[0] << a[1], "shr.b32": lambda: a[0] >> a[1], "and.b32": lambda: a[0] & a[1],
                   "or.b32": lambda: a[0] | a[1]}[op]()
        regs[dst] = out & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(n_out)]


@pytest.mark.parametrize("which", ["e2m1_lo", "e2m1_hi", "e4m3"])
def test_conversion_ptx_matches_jnp(which):
    """The PTX conversion blocks (the GPU path) give the same fp16 bit patterns as the jnp form (the interpret path)
    for every byte in every position of a word: four bytes in, two fp16 per output register, element 0 lowest."""
    ptx = {"e2m1_lo": moe_mxfp4._E2M1_LO_PTX, "e2m1_hi": moe_mxfp4._E2M1_HI_PTX, "e4m3": moe_mxfp4._E4M3_PTX}[which]
    rng = np.random.default_rng(0)
    words = np.concatenate([np.repeat(np.arange(256, dtype=np.uint8), 4).reshape(-1, 4),
                            rng.integers(0, 256, (256, 4), dtype=np.uint8)])
    if which == "e4m3":
        want = np.asarray(jax.lax.bitcast_convert_type(moe_mxfp4._e4m3_to_f16(jnp.asarray(words)), jnp.uint16))
    else:
        lo, hi = moe_mxfp4._nibbles_to_f16(jnp.asarray(words))
        want = np.asarray(jax.lax.bitcast_convert_type(lo if which == "e2m1_lo" else hi, jnp.uint16))
    for bytes4, expect in zip(words, want):
        r0, r1 = _run_ptx(ptx, int.from_bytes(bytes(bytes4), "little"), 2)
        got = [r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16]
        assert got == [int(e) for e in expect], f"{which} {list(bytes4)}: {got} != {list(expect)}"


@pytest.mark.parametrize("platform,ptx", [("cpu", True), ("gpu", True), ("musa", False)])
def test_ptx_conversion_only_for_nvidia(monkeypatch, platform, ptx):
    """The PTX conversion blocks go into the kernels compiled for NVIDIA GPUs only: a vendor plugin's Triton (MUSA,
    through a KernelPolicy) or ROCm gets the jnp form (here: the lowering traced under each platform)."""
    from dayzero.kernels import dispatch

    monkeypatch.setattr(dispatch, "current_platform", lambda: platform)
    monkeypatch.setattr(dispatch, "canonical_platform", lambda p: "cuda" if p == "gpu" else p)
    seen = []
    for name in ("_nibbles_to_f16", "_e4m3_to_f16"):
        real = getattr(moe_mxfp4, name)
        monkeypatch.setattr(moe_mxfp4, name, lambda b, asm=False, real=real: seen.append(asm) or real(b, asm))
    n_experts, hidden, inter, top_k = 4, 64, 32, 2
    s = jax.ShapeDtypeStruct
    args = (s((3, hidden), jnp.bfloat16), s((3, top_k), jnp.int32), s((3, top_k), jnp.float32))
    for fmt in ("mxfp4", "float8_e4m3fn"):
        fused = lambda x, i, w, ew: moe.moe_experts_packed(x, i, w, ew, tiles=SMALL, impl="pallas")[0]  # noqa: E731
        lower_for_cuda(fused, *args, _specs(n_experts, hidden, inter, fmt))
    assert seen and set(seen) == {ptx}, (platform, seen)
