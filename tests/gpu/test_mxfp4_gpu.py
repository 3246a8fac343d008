"""MXFP4 MoE kernels compiled for real on the GPU (Triton), against the reference path on the same device with fresh
random inputs: fused MXFP4, pre-converted FP8 / BF16, the workspace (conversion kernel bit-exact, residency), at the
medium-hybrid and DeepSeek shapes, odd token counts, skewed loads, and a whole MXFP4 model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxfp4_cases import (ROUTINGS, assert_forward_top_tokens, converted, oracle, packed_experts, rel_err, routing,
                         shared_gate_up_sums)
from dayzero.kernels import moe, moe_mxfp4, moe_mxfp4_gemv, moe_workspace, mxfp4

pytestmark = pytest.mark.skipif(not any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices()),
                                reason="no GPU on this machine")

_packed = jax.jit(moe.moe_experts_packed, static_argnames=("tiles", "impl"))


def _reference_bytes() -> int:
    """At most this much dequantized expert weight per reference call: 16 GiB, or an eighth of the device's memory
    where that is less (on an H100, 2026-12-06, 16 GiB of float32 weights and their copies beside the kernels'
    operands and a 293-slot workspace ran out of memory)."""
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)
    return min(16 << 30, limit // 8) if limit else 16 << 30


def _reference(x, ids, w, ew):
    """The reference path's (y, workspace). It dequantizes the call's active experts in x's dtype; where that
    passes `_reference_bytes()` (the DeepSeek shape, 256 experts of 7168 x 2048, at 64 tokens x top-8: all 256 in
    float32, ~126 GiB with its copies, more than an H100 holds) it runs in calls of fewer tokens, whose outputs are
    the same rows: each token's output depends on its own routing alone."""
    n_experts, inter, groups = ew.gate.shape[:3]
    per_expert = 3 * inter * groups * mxfp4.BLOCK * jnp.dtype(x.dtype).itemsize
    budget = _reference_bytes()
    step = max(1, budget // per_expert // ids.shape[1])  # tokens per call
    with jax.default_matmul_precision("highest"):
        if min(n_experts, ids.size) * per_expert <= budget:
            return _packed(x, ids, w, ew, impl="reference")
        parts = [jax.block_until_ready(_packed(x[i:i + step], ids[i:i + step], w[i:i + step], ew,
                                               impl="reference")[0]) for i in range(0, x.shape[0], step)]
        return jnp.concatenate(parts), None


def _device_routing(key, n_tokens, n_experts, top_k, kind="random"):
    if kind != "random":
        ids, w = routing(np.random.default_rng(int(jax.random.randint(key, (), 0, 1 << 30))), kind, n_tokens,
                         n_experts, top_k)
        return jnp.asarray(ids), jnp.asarray(w)
    _, ids = jax.lax.top_k(jax.random.uniform(key, (n_tokens, n_experts)), top_k)
    return ids.astype(jnp.int32), jax.random.uniform(jax.random.fold_in(key, 1), (n_tokens, top_k), jnp.float32)


@pytest.mark.parametrize("n_tokens", [1, 16, 77, 256, 1031])
def test_fused_medium_shape(seed, n_tokens):
    key = jax.random.key(seed)
    ew = mxfp4.random_experts(key, 64, 2048, 768)
    ids, w = _device_routing(jax.random.fold_in(key, 1), n_tokens, 64, 6)
    x = jax.random.normal(jax.random.fold_in(key, 2), (n_tokens, 2048), jnp.float32)
    got, _ = _packed(x, ids, w, ew, impl="pallas")
    want, _ = _reference(x, ids, w, ew)
    assert np.all(np.isfinite(np.asarray(got)))
    assert rel_err(got, want) < 4e-3, f"T={n_tokens}: {rel_err(got, want):.2e} (seed={seed})"


@pytest.mark.parametrize("kind", ROUTINGS[1:])
def test_fused_skewed_loads(seed, kind):
    key = jax.random.key(seed)
    ew = mxfp4.random_experts(key, 64, 2048, 768)
    top_k = 1 if kind == "single_last" else 2
    ids, w = _device_routing(jax.random.fold_in(key, 1), 333, 64, top_k, kind)
    x = jax.random.normal(jax.random.fold_in(key, 2), (333, 2048), jnp.bfloat16)
    got, _ = _packed(x, ids, w, ew, impl="pallas")
    want, _ = _reference(x.astype(jnp.float32), ids, w, ew)
    assert rel_err(got, want) < 2e-2, f"{kind}: {rel_err(got, want):.2e} (seed={seed})"


@pytest.mark.parametrize("n_tokens", [1, 5])
def test_fused_deepseek_shape_decode(seed, n_tokens):
    key = jax.random.key(seed)
    ew = mxfp4.random_experts(key, 256, 7168, 2048)
    ids, w = _device_routing(jax.random.fold_in(key, 1), n_tokens, 256, 8)
    x = jax.random.normal(jax.random.fold_in(key, 2), (n_tokens, 7168), jnp.float32)
    got, _ = _packed(x, ids, w, ew, impl="pallas")
    want, _ = _reference(x, ids, w, ew)
    assert rel_err(got, want) < 4e-3, f"T={n_tokens}: {rel_err(got, want):.2e} (seed={seed})"


def _check_tiles(seed, shape, n_tokens, fmt, tiles, label):
    """The fused layer with `tiles` on `shape` (experts, top-k, hidden, intermediate) against the reference."""
    n_experts, top_k, hidden, inter = shape
    key = jax.random.key(seed)
    ew = mxfp4.random_experts(key, n_experts, hidden, inter)
    ew = ew if fmt == "mxfp4" else converted(ew, fmt)
    ids, w = _device_routing(jax.random.fold_in(key, 1), n_tokens, n_experts, top_k)
    x = jax.random.normal(jax.random.fold_in(key, 2), (n_tokens, hidden), jnp.float32)
    got, _ = _packed(x, ids, w, ew, tiles=tiles, impl="pallas")
    want, _ = _reference(x, ids, w, ew)
    assert np.all(np.isfinite(np.asarray(got)))
    assert rel_err(got, want) < 4e-3, f"{label} {shape} T={n_tokens} {fmt}: {rel_err(got, want):.2e} (seed={seed})"


@pytest.mark.parametrize("shape, n_tokens, fmt", [((64, 6, 2048, 768), 1, "mxfp4"), ((64, 6, 2048, 768), 3, "mxfp4"),
                                                  ((256, 8, 7168, 2048), 1, "mxfp4"),
                                                  ((64, 6, 2048, 768), 1, "float8_e4m3fn")])
def test_split_k_decode_tiles(seed, shape, n_tokens, fmt):
    """The split-K tiles `choose_tiles` takes for one decode token (64 columns, scales one K step ahead); at 3 tokens
    the same tiles, forced."""
    n_experts, top_k, _, _ = shape
    tiles = moe_mxfp4.choose_tiles(top_k, n_experts)
    assert tiles.split_k > 1
    _check_tiles(seed, shape, n_tokens, fmt, tiles, "split-K")


DECODE_VARIANTS = {  # benchmarks/moe.py --sweep split_k,decode16 times these
    "a_bn32_g4_w2": moe_mxfp4.Tiles(16, 32, 4, 2, 3, weights_as_a=True),
    "a_bn64_g4_w4": moe_mxfp4.Tiles(16, 64, 4, 4, 3, weights_as_a=True),  # wgmma
    "bn64_g8_w4": moe_mxfp4.Tiles(16, 64, 8, 4, 3),
    "a_bn64_g4_w4_s8": moe_mxfp4.Tiles(16, 64, 4, 4, 3, split_k=8, weights_as_a=True),
    "bn64_g4_w4_pf": moe_mxfp4.Tiles(16, 64, 4, 4, 3, prefetch_scales=True),
    "bn64_g8_w4_pf": moe_mxfp4.Tiles(16, 64, 8, 4, 3, prefetch_scales=True),  # choose_tiles' for wide MXFP4 experts
    "bn32_g4_w4_s8_pf": moe_mxfp4.Tiles(16, 32, 4, 4, 3, split_k=8, prefetch_scales=True),
    "bn16_g4_w1_pf": moe_mxfp4.Tiles(16, 16, 4, 1, 3, prefetch_scales=True),
}


@pytest.mark.parametrize("name", sorted(DECODE_VARIANTS))
@pytest.mark.parametrize("shape, n_tokens, fmt", [((64, 6, 2048, 768), 16, "mxfp4"), ((256, 8, 7168, 2048), 3, "mxfp4"),
                                                  ((64, 6, 2048, 768), 5, "float8_e4m3fn")])
def test_decode_tile_variants(seed, name, shape, n_tokens, fmt):
    """Decode tile variants (the weights as the MMA's A operand, wider K steps, scales loaded a step ahead) against
    the reference."""
    _check_tiles(seed, shape, n_tokens, fmt, DECODE_VARIANTS[name], name)


@pytest.mark.parametrize("n_tokens, fmt", [(64, "mxfp4"), (256, "mxfp4"), (37, "float8_e4m3fn")])
def test_long_k_tiles(seed, n_tokens, fmt):
    """`choose_tiles`' 16-row tiles for MXFP4 experts of hidden size >= `LONG_K_MIN_HIDDEN` (8 blocks per K step,
    scales one step ahead; FP8 experts keep 4) on the DeepSeek-size layer, 1-8 rows per active expert, against the
    reference (the FP8 experts padded clear of int32 offset wrap by `converted`)."""
    shape = (256, 8, 7168, 2048)
    tiles = moe_mxfp4.choose_tiles(n_tokens * shape[1], shape[0], shape[2], fmt)
    groups = 8 if fmt == "mxfp4" else 4
    assert (tiles.block_m, tiles.max_groups, tiles.split_k, tiles.prefetch_scales) == (16, groups, 1, True)
    _check_tiles(seed, shape, n_tokens, fmt, tiles, f"16 rows, {groups} groups")


@pytest.mark.parametrize("shape, n_tokens, fmt", [((64, 6, 2048, 768), 256, "mxfp4"),
                                                  ((64, 6, 2048, 768), 200, "float8_e4m3fn")])
@pytest.mark.parametrize("weights_as_a", [False, True])
def test_many_row_tiles(seed, shape, n_tokens, fmt, weights_as_a):
    """`choose_tiles`' 32-row tiles (17-48 rows per active expert), the weights as the MMA's A operand (the default,
    `WEIGHTS_AS_A_32_ROWS`) or the rows, against the reference."""
    n_experts, top_k = shape[:2]
    tiles = moe_mxfp4.choose_tiles(n_tokens * top_k, n_experts)
    assert tiles.block_m == 32
    tiles = dataclasses.replace(tiles, weights_as_a=weights_as_a)
    _check_tiles(seed, shape, n_tokens, fmt, tiles, f"32 rows, weights_as_a={weights_as_a}")


@pytest.mark.parametrize("n_tokens, fmt", [(1031, "float8_e4m3fn"), (4096, "mxfp4"), (4096, "float8_e4m3fn")])
def test_wide_prefill_tiles(seed, n_tokens, fmt, monkeypatch):
    """`choose_tiles`' prefill tiles with `WIDE_PREFILL_TILES` (128 columns, the weights as the MMA's A operand; 64
    rows at ~97 rows per expert, 128 rows at 8 warps at 384) on the medium layer against the reference."""
    monkeypatch.setattr(moe_mxfp4, "WIDE_PREFILL_TILES", True)
    tiles = moe_mxfp4.choose_tiles(n_tokens * 6, 64)
    assert tiles.weights_as_a and tiles.block_n == 128 and tiles.block_m == (64 if n_tokens < 2048 else 128)
    _check_tiles(seed, (64, 6, 2048, 768), n_tokens, fmt, tiles, f"prefill {tiles}")


@pytest.mark.parametrize("shape, n_tokens, rows, adaptive, stages, in_kernel", [
    ((64, 6, 2048, 768), 1, 1, False, 1, False), ((64, 6, 2048, 768), 1, 1, False, 1, True),
    ((64, 6, 2048, 768), 16, 2, False, 1, False), ((64, 6, 2048, 768), 77, 4, False, 1, False),
    ((64, 6, 2048, 768), 77, 4, True, 1, True),
    ((256, 8, 7168, 2048), 1, 1, False, 1, False), ((256, 8, 7168, 2048), 1, 1, False, 1, True),
    ((256, 8, 7168, 2048), 16, 1, False, 1, False), ((256, 8, 7168, 2048), 16, 2, True, 1, True),
    ((256, 8, 7168, 2048), 5, 2, False, 1, False), ((256, 8, 7168, 2048), 64, 4, False, 1, False),
    ((256, 8, 7168, 2048), 64, 4, True, 1, False), ((64, 6, 2048, 768), 16, 4, True, 1, False),
    ((256, 8, 7168, 2048), 64, 2, True, 3, False), ((64, 6, 2048, 768), 1, 1, False, 2, True)])
def test_gemv_decode_kernels(seed, shape, n_tokens, rows, adaptive, stages, in_kernel):
    """The CUDA-core decode kernels (moe_mxfp4_gemv: inline PTX, fp16 block sums) against the reference; `adaptive`:
    4-row tiles that multiply only their real rows; `stages`: the K loop's loads software-pipelined; `in_kernel`:
    the activations packed by each program (per MX block) instead of by XLA."""
    tiles = moe_mxfp4_gemv.GemvTiles(rows=rows, adaptive=adaptive, num_stages=stages, pack_in_kernel=in_kernel)
    _check_tiles(seed, shape, n_tokens, "mxfp4", tiles,
                 f"gemv rows={rows} adaptive={adaptive} stages={stages} in_kernel={in_kernel}")


@pytest.mark.parametrize("shape, n_tokens", [((256, 8, 7168, 2048), 1), ((256, 8, 7168, 2048), 2),
                                             ((64, 6, 2048, 768), 1), ((64, 6, 2048, 768), 2)])
def test_gemv_default_tiles(seed, shape, n_tokens):
    """The decode kernels with `tiles_for`'s tiles (what the model runs): at one or two tokens the activations packed
    by each program and h written packed by the gate/up kernel."""
    n_experts, top_k = shape[:2]
    tiles = moe_mxfp4_gemv.tiles_for(n_tokens * top_k, n_experts)
    assert tiles.pack_in_kernel
    _check_tiles(seed, shape, n_tokens, "mxfp4", tiles, f"gemv default {tiles}")


@pytest.mark.parametrize("shape, n_tokens", [((64, 6, 2048, 768), 1), ((256, 8, 7168, 2048), 1),
                                             ((256, 8, 7168, 2048), 2)])
def test_gemv_hoisted_steps_on_gpu(monkeypatch, seed, shape, n_tokens):
    """Every K step's loads before the first step's products (`DOWN_HOIST_MAX_STEPS` / `GATE_UP_HOIST_MAX_STEPS`,
    1-row tiles) in the compiled kernels (inline PTX, fp16 block sums): the layer's output is the loop's up to the
    order of the down kernel's atomic adds, and near the reference."""
    n_experts, top_k, hidden, inter = shape
    key = jax.random.key(seed)
    ew = mxfp4.random_experts(key, n_experts, hidden, inter)
    ids, w = _device_routing(jax.random.fold_in(key, 1), n_tokens, n_experts, top_k)
    # float32 rows: the output is the down kernel's float32 sums, not rounded again to bf16 (where one ulp of a sum
    # in another atomic order can move a rounding by a step)
    x = jax.random.normal(jax.random.fold_in(key, 2), (n_tokens, hidden), jnp.float32)
    tiles = moe_mxfp4_gemv.tiles_for(n_tokens * top_k, n_experts)
    assert tiles.rows == 1
    run = jax.jit(lambda x, ids, w, ew: moe_mxfp4_gemv.grouped_swiglu(x, ids, w, ew, tiles=tiles))
    outs = []
    for steps in (0, 4):
        for name in ("DOWN_HOIST_MAX_STEPS", "GATE_UP_HOIST_MAX_STEPS"):
            monkeypatch.setattr(moe_mxfp4_gemv, name, steps)
        jax.clear_caches()
        outs.append(np.asarray(run(x, ids, w, ew)))
    looped, hoisted = outs
    want, _ = _reference(x, ids, w, ew)
    assert rel_err(looped, want) < 4e-3, rel_err(looped, want)
    # the same products; only the down kernel's float32 atomics may land in another order (run to run, either way)
    assert rel_err(hoisted, looped) < 1e-5, rel_err(hoisted, looped)


def test_gemv_skewed_loads(seed):
    """bf16 activations, empty experts and one expert taking every token, through the decode kernels."""
    key = jax.random.key(seed)
    ew = mxfp4.random_experts(key, 64, 2048, 768)
    for kind in ROUTINGS[1:]:
        top_k = 1 if kind == "single_last" else 2
        ids, w = _device_routing(jax.random.fold_in(key, 1), 9, 64, top_k, kind)
        x = jax.random.normal(jax.random.fold_in(key, 2), (9, 2048), jnp.bfloat16)
        want, _ = _reference(x.astype(jnp.float32), ids, w, ew)
        for rows in moe_mxfp4_gemv.ROWS:
            for in_kernel in (False, True):
                tiles = moe_mxfp4_gemv.GemvTiles(rows=rows, pack_in_kernel=in_kernel)
                got, _ = _packed(x, ids, w, ew, tiles=tiles, impl="pallas")
                assert rel_err(got, want) < 2e-2, (f"{kind} rows={rows} in_kernel={in_kernel}: "
                                                   f"{rel_err(got, want):.2e} (seed={seed})")


@pytest.mark.parametrize("fmt,tol", [("float8_e4m3fn", 4e-3), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("n_tokens", [3, 700])
def test_preconverted_formats(seed, fmt, tol, n_tokens):
    key = jax.random.key(seed)
    ew = converted(mxfp4.random_experts(key, 64, 2048, 768), fmt)
    ids, w = _device_routing(jax.random.fold_in(key, 1), n_tokens, 64, 6)
    x = jax.random.normal(jax.random.fold_in(key, 2), (n_tokens, 2048), jnp.float32)
    got, _ = _packed(x, ids, w, ew, impl="pallas")
    want, _ = _reference(x, ids, w, ew)
    assert rel_err(got, want) < tol, f"{fmt} T={n_tokens}: {rel_err(got, want):.2e} (seed={seed})"


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_convert_kernel_bit_exact(seed, dtype):
    key = jax.random.key(seed)
    ew = mxfp4.random_experts(key, 16, 2048, 768)
    ws = jnp.zeros_like(mxfp4.to_workspace(ew.down[:8], ew.down_scales[:8], dtype))
    need = jnp.asarray([1, 0, 1, 1, 0, 1, 1, 1], bool)
    slot_expert = jax.random.permutation(jax.random.fold_in(key, 1), 16)[:8].astype(jnp.int32)
    got = jax.jit(moe_mxfp4.convert)(ws, need, slot_expert, ew.down, ew.down_scales)
    want = jnp.where(need[:, None, None, None, None], mxfp4.to_workspace(ew.down[slot_expert],
                                                                        ew.down_scales[slot_expert], dtype), ws)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_workspace_through_layers(seed, dtype):
    key = jax.random.key(seed)
    layers = [mxfp4.random_experts(jax.random.fold_in(key, i), 64, 2048, 768) for i in range(2)]
    ids, w = _device_routing(jax.random.fold_in(key, 5), 4096, 64, 6)
    x = jax.random.normal(jax.random.fold_in(key, 6), (4096, 2048), jnp.bfloat16)
    ws = moe_workspace.create(64, 2048, 768, dtype)
    tol = 2e-2
    for layer in (0, 1, 1):
        got, ws = _packed(x, ids, w, layers[layer], layer=jnp.int32(layer), workspace=ws, impl="pallas")
        want, _ = _reference(x.astype(jnp.float32), ids, w, layers[layer])
        assert rel_err(got, want) < tol, f"layer {layer}: {rel_err(got, want):.2e} (seed={seed})"
    assert (int(ws.hits), int(ws.misses)) == (64, 128)


def test_deepseek_workspace_past_2gib(seed):
    """The DeepSeek-size layer through the FP8 workspace with every expert active: 256 slots of 14.7 MB a
    projection would be 3.76e9 bytes, whose int32 offsets wrap in the Triton lowering (`tiles.offsets_wrap`);
    `moe_workspace.create` gives 293 slots instead. Against the reference."""
    key = jax.random.key(seed)
    ew = mxfp4.random_experts(key, 256, 7168, 2048)
    ids, w = _device_routing(jax.random.fold_in(key, 1), 40, 256, 8)
    x = jax.random.normal(jax.random.fold_in(key, 2), (40, 7168), jnp.bfloat16)
    ws = moe_workspace.create(moe_workspace.num_slots(ids.size, 256), 7168, 2048)
    assert ws.num_slots == 293
    got = jax.block_until_ready(_packed(x, ids, w, ew, workspace=ws, impl="pallas")[0])
    del ws  # 12.9 GB: the reference's float32 weights need the room on an 80 GB card
    want, _ = _reference(x.astype(jnp.float32), ids, w, ew)
    assert rel_err(got, want) < 2e-2, f"{rel_err(got, want):.2e} (seed={seed})"


@pytest.mark.parametrize("groups", [4, 8])
def test_offline_fp8_deepseek_padded(seed, groups):
    """The DeepSeek-size layer pre-converted to FP8 (`converted` pads it past 2**32 bytes a projection:
    `moe_workspace.clear_of_offset_wrap`) with 16-row tiles of 4 and 8 blocks per K step; unpadded, every tile
    shape gave relative error 32 on an H100 (2026-12-06)."""
    tiles = moe_mxfp4.Tiles(16, 64, groups, 4, 3, prefetch_scales=True)
    _check_tiles(seed, (256, 8, 7168, 2048), 37, "float8_e4m3fn", tiles, f"padded FP8, {groups} groups")


def test_small_shapes_against_float64_oracle(seed):
    """Odd sizes (padded K, masked columns) with the default tiles, against the float64 oracle."""
    rng = np.random.default_rng(seed)
    ew = packed_experts(rng, 6, 72, 40)
    for n_tokens in (1, 13, 200):
        x = rng.standard_normal((n_tokens, 72)).astype(np.float32)
        ids, w = routing(rng, "random", n_tokens, 6)
        got, _ = _packed(jnp.asarray(x), ids, w, ew, impl="pallas")
        assert rel_err(got, oracle(x, ids, w, ew)) < 4e-3, f"T={n_tokens} (seed={seed})"


def test_mxfp4_model_kernels_match_dense_experts(seed):
    """The tiny hybrid with MXFP4 experts (float32): the Pallas MoE kernels (fused and through the workspace)
    against the same weights as dense experts on the reference ragged_dot path; every other op is the same.

    The DSA indexer keeps every causal key (index_topk above the length): with the preset's top-6, keys within 1e-6
    of each other at the top-k boundary are common in random draws (margin 8e-7 at seed 358297760), and the experts'
    fp16 products flip them, which moved the logits by 3e-2 on an H200 (2e-3 in interpret mode; 1e-5 with every key
    kept). This test is about the experts; DSA selection has its own tests."""
    from dayzero.model import Model
    from dayzero.model.config import MXFP4Execution
    from dayzero.model.mxfp4_offline import dequantize_experts
    from dayzero.model.presets import tiny

    config = tiny().replace(quant_method="mxfp4", index_topk=512)
    model = Model.random(config, dtype="float32", seed=seed % 1000)
    ids = np.random.default_rng(seed).integers(3, config.vocab_size, (2, 300))
    with jax.default_matmul_precision("highest"):
        dense = np.asarray(dequantize_experts(model)(ids))
        for mode in ("fused", "workspace"):
            execution = MXFP4Execution(mode=mode, impl="pallas")
            got = np.asarray(Model(config.replace(mxfp4=execution), model.params, model.dtype)(ids))
            assert rel_err(got, dense) < 2e-3, f"{mode}: {rel_err(got, dense):.2e} (seed={seed})"


@pytest.mark.parametrize("unrolled", [False, True])
def test_mxfp4_engine_greedy_is_the_forward_top_token(seed, unrolled):
    """The serving engine over the tiny hybrid with MXFP4 experts on the GPU (float32; the Pallas MXFP4 kernels: the
    decode kernels for decode steps, the fused MMA kernels for the prefills): every greedy token is the top logit of
    a full forward over the prompt and the tokens before it, to the kernels' rounding (near ties within 1e-3 of the
    logits' scale either way). The DSA indexer keeps every key (see the test above). `unrolled`: the decode
    dispatches compiled as straight-line steps (`EngineConfig.unrolled_decode`)."""
    from dayzero.model import Model
    from dayzero.model.config import MXFP4Execution
    from dayzero.model.presets import tiny
    from dayzero.serving import Engine, EngineConfig, SamplingParams

    config = tiny().replace(quant_method="mxfp4", index_topk=512, mxfp4=MXFP4Execution(impl="pallas"))
    model = Model.random(config, dtype="float32", seed=seed % 1000)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (37, 5, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine = Engine(model, None, EngineConfig(max_num_seqs=4, max_model_len=160, enable_prefix_caching=False,
                                              unrolled_decode=unrolled))
    with jax.default_matmul_precision("highest"):
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        for prompt, out in zip(prompts, outs):
            assert len(out.token_ids) == params.max_tokens
            assert_forward_top_tokens(model, prompt, out.token_ids, 1e-3)


@pytest.mark.parametrize("batch", [2, 16])
def test_decode_step_takes_packed_x_and_the_routers_schedule_on_gpu(monkeypatch, batch):
    """The medium hybrid's first layers with MXFP4 experts, a decode step of 2 or 16 rows (the decode kernels' 2-row
    tiles): with the front kernel packing x (`MoE.front_packs`) and the router's select kernel making the 2-row
    schedule (`ROUTER_SCHEDULE`), against XLA packing x and making the schedule: the next-token logits within the
    down kernel's float32 atomics (their order varies), and the kernels given both in every MoE layer after a
    front."""
    from dayzero.model import moe as model_moe
    from medium_prefix_cases import prefilled_medium_prefix

    run, args = prefilled_medium_prefix(9, num_blocks=batch + 2, batch=batch, mxfp4=True)
    given, experts = [], moe_mxfp4_gemv.grouped_swiglu
    monkeypatch.setattr(moe_mxfp4_gemv, "grouped_swiglu", lambda *a, **k: given.append(
        (k["sched"] is not None, k["x_words"] is not None)) or experts(*a, **k))
    monkeypatch.setattr(model_moe, "FRONT_PACKED_MIN_TOKENS", 10 ** 6)
    monkeypatch.setattr(model_moe, "ROUTER_SCHEDULE", False)
    plain, _ = run(*args, decode=True)
    assert given and not any(map(any, given))
    given.clear()
    monkeypatch.setattr(model_moe, "FRONT_PACKED_MIN_TOKENS", 2)
    monkeypatch.setattr(model_moe, "ROUTER_SCHEDULE", True)
    made, _ = run(*args, decode=True)
    assert given and all(sched for sched, _ in given) and sum(words for _, words in given) >= 2, given
    a, b = np.asarray(made, np.float64), np.asarray(plain, np.float64)
    assert np.all(np.isfinite(a)) and np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2


@pytest.mark.parametrize("shape", [(64, 6, 2048, 768), (256, 8, 7168, 2048)])
def test_gemv_shared_fold(seed, shape):
    """The decode kernels at one token with the shared MLP folded in (`moe_mxfp4_gemv.SharedFold`, the model's
    tiles): routed + shared against the reference experts plus the shared MLP in float32."""
    n_experts, top_k, hidden, inter = shape
    key = jax.random.key(seed)
    ew = mxfp4.random_experts(key, n_experts, hidden, inter)
    ids, w = _device_routing(jax.random.fold_in(key, 1), 1, n_experts, top_k)
    x = jax.random.normal(jax.random.fold_in(key, 2), (1, hidden), jnp.float32)
    shared = tuple((jax.random.normal(jax.random.fold_in(key, 3 + i), shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
                   for i, shape in enumerate(((hidden, inter), (hidden, inter), (inter, hidden))))
    tiles = moe_mxfp4_gemv.tiles_for(top_k, n_experts)
    got = jax.jit(lambda x, ids, w, ew, sh: moe_mxfp4_gemv.grouped_swiglu(x, ids, w, ew, tiles=tiles, shared=sh))(
        x, ids, w, ew, shared)
    routed, _ = _reference(x, ids, w, ew)
    with jax.default_matmul_precision("highest"):
        gate, up, down = (s.astype(jnp.float32) for s in shared)
        want = routed + (jax.nn.silu(x @ gate) * (x @ up)) @ down
    assert np.all(np.isfinite(np.asarray(got)))
    assert rel_err(got, want) < 4e-3, f"{shape}: {rel_err(got, want):.2e} (seed={seed})"


def _one_token_with_residual(seed: int, shape):
    """One token of an MoE layer `shape` (experts, top-k, hidden, intermediate): random MXFP4 experts, routing, x
    [1, H] bf16, float32 residual rows [1, H] and a bf16 shared MLP (gate, up, down) of the experts' width."""
    n_experts, top_k, hidden, inter = shape
    key = jax.random.key(seed)
    ew = mxfp4.random_experts(key, n_experts, hidden, inter)
    ids, w = _device_routing(jax.random.fold_in(key, 1), 1, n_experts, top_k)
    x = jax.random.normal(jax.random.fold_in(key, 2), (1, hidden), jnp.float32).astype(jnp.bfloat16)
    residual = jax.random.normal(jax.random.fold_in(key, 3), (1, hidden), jnp.float32) * 4
    shared = tuple((jax.random.normal(jax.random.fold_in(key, 4 + i), s, jnp.float32) * 0.02).astype(jnp.bfloat16)
                   for i, s in enumerate(((hidden, inter), (hidden, inter), (inter, hidden))))
    return ew, ids, w, x, residual, shared


@pytest.mark.parametrize("shape", [(64, 6, 2048, 768), (256, 8, 7168, 2048)])
def test_gemv_shared_sums_made_ahead(seed, shape):
    """One token, the model's tiles, residual rows to add into: the shared MLP streamed by the decode kernels, its
    gate / up sums made ahead (`SharedMLP.gate_up_sums`, here on the host in two parts of K), and with its down
    projection in the gate/up kernel as well (`down_in_gate_up`) give the same sums to float32 rounding (the atomics'
    order varies), near the float32 reference."""
    n_experts, top_k = shape[:2]
    ew, ids, w, x, residual, shared = _one_token_with_residual(seed, shape)
    sums = shared_gate_up_sums(x, shared, 2)
    tiles = moe_mxfp4_gemv.tiles_for(top_k, n_experts)
    run = jax.jit(lambda x, ids, w, ew, sh, r: moe_mxfp4_gemv.grouped_swiglu(x, ids, w, ew, tiles=tiles, shared=sh,
                                                                            residual_sums=r))
    streamed = np.asarray(run(x, ids, w, ew, moe_mxfp4_gemv.SharedMLP(*shared), residual), np.float64)
    routed, _ = _reference(x.astype(jnp.float32), ids, w, ew)
    with jax.default_matmul_precision("highest"):
        gate, up, down = (s.astype(jnp.float32) for s in shared)
        xf = x.astype(jnp.float32)
        want = np.asarray(residual + routed + (jax.nn.silu(xf @ gate) * (xf @ up)) @ down, np.float64)
    scale = np.max(np.abs(want))
    for early in (False, True):
        got = np.asarray(run(x, ids, w, ew, moe_mxfp4_gemv.SharedMLP(*shared, gate_up_sums=sums,
                                                                     down_in_gate_up=early), residual), np.float64)
        assert np.all(np.isfinite(got))
        assert np.max(np.abs(got - streamed)) <= 2e-3 * scale, f"{shape} early={early} (seed={seed})"
        assert np.max(np.abs(got - want)) <= 2e-2 * scale, f"{shape} early={early} (seed={seed})"


def test_decode_step_folds_the_shared_mlp_on_gpu(monkeypatch):
    """The medium hybrid's first layers with MXFP4 experts, a one-row decode step: with the shared MLP folded into
    the decode kernels (`SHARED_IN_PACKED_MAX_TOKENS`) and the front kernel choosing with its parts, against the
    shared MLP through its own kernels: the next-token logits to bf16 rounding, the kernels given it in every MoE
    layer."""
    from dayzero.model import moe as model_moe
    from medium_prefix_cases import decode_off_and_on, logits_change, prefilled_medium_prefix

    run, args = prefilled_medium_prefix(9, num_blocks=3, batch=1, mxfp4=True)
    monkeypatch.setattr(model_moe, "RESIDUAL_IN_SUMS", False)  # both sides add the residual alike (it needs the fold)
    (apart, _), (folded, _) = decode_off_and_on(monkeypatch, run, args, model_moe, "SHARED_IN_PACKED_MAX_TOKENS",
                                                (0, 1), lambda k: k.get("shared") is not None)
    assert logits_change(folded, apart) < 1e-2


@pytest.mark.parametrize("shape", [(64, 6, 2048, 768), (256, 8, 7168, 2048)])
def test_gemv_adds_into_the_residual_rows(seed, shape):
    """One token, the model's tiles and the shared MLP folded in: the down kernel adding into the given float32
    residual rows (`grouped_swiglu(residual_sums=)`, no zeros written by the gate/up kernel) gives the residual plus
    what it gives from zeros, to float32 rounding (the atomics' order varies)."""
    n_experts, top_k, hidden, inter = shape
    ew, ids, w, x, residual, shared = _one_token_with_residual(seed, shape)
    tiles = moe_mxfp4_gemv.tiles_for(top_k, n_experts)
    assert moe_mxfp4_gemv.sums_take_residual(hidden, inter, tiles)
    run = jax.jit(lambda x, ids, w, ew, sh, r: moe_mxfp4_gemv.grouped_swiglu(x, ids, w, ew, tiles=tiles, shared=sh,
                                                                            residual_sums=r))
    got = np.asarray(run(x, ids, w, ew, shared, residual), np.float64)
    plain = jax.jit(lambda x, ids, w, ew, sh: moe_mxfp4_gemv.grouped_swiglu(x, ids, w, ew, tiles=tiles, shared=sh)
                    .astype(jnp.float32))(x, ids, w, ew, shared)
    want = np.asarray(residual, np.float64) + np.asarray(plain, np.float64)
    assert np.all(np.isfinite(got))
    assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want)), f"{shape} (seed={seed})"


def test_decode_step_adds_the_residual_in_the_down_kernel_on_gpu(monkeypatch):
    """The medium hybrid's first layers with MXFP4 experts, a one-row decode step: with `RESIDUAL_IN_SUMS` (the
    front kernel writes the residual rows as float32, the down kernel adds the experts into them, the next layer's
    kernels round them as they load) against the residual added by XLA: the next-token logits to bf16 rounding, the
    decode kernels given the rows in every MoE layer."""
    from dayzero.model import moe as model_moe
    from medium_prefix_cases import decode_off_and_on, logits_change, prefilled_medium_prefix

    run, args = prefilled_medium_prefix(9, num_blocks=3, batch=1, mxfp4=True)
    (plain, _), (summed, _) = decode_off_and_on(monkeypatch, run, args, model_moe, "RESIDUAL_IN_SUMS", (False, True),
                                                lambda k: k.get("residual_sums") is not None)
    assert logits_change(summed, plain) < 2e-2
