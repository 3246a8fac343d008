"""Kernel operands whose int32 offsets would wrap in Pallas' Triton lowering (1-byte arrays of 2**31-2**32 bytes):
the check every compiled kernel call makes, the stacks sized clear of it (the FP8 workspace, offline-converted
experts) and the MoE dispatch that runs the reference path rather than such kernels. Shapes only: nothing of that
size is allocated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from mxfp4_cases import expert_specs
from dayzero.kernels import moe, moe_mxfp4_gemv, moe_workspace, mxfp4, tiles

DEEPSEEK_ENTRY = (2048, 224, 2, 16)  # one DeepSeek-size expert's gate rows, converted: 14,680,064 bytes
DEEPSEEK_DOWN_ENTRY = (7168, 64, 2, 16)


@pytest.mark.parametrize("shape, dtype, wraps", [
    ((2**31,), jnp.uint8, False),  # largest offset 2**31 - 1
    ((2**31 + 1,), jnp.uint8, True),
    ((2**32,), jnp.float8_e4m3fn, True),  # 2**32 bytes: still int32 offsets
    ((2**32 + 1,), jnp.uint8, False),  # past 2**32 bytes: int64 offsets
    ((256, *DEEPSEEK_ENTRY), jnp.float8_e4m3fn, True),  # the DeepSeek-size layer in FP8
    ((256, 2048, 224, 16), jnp.uint8, False),  # ... in MXFP4
    ((384, 2048, 224, 16), jnp.uint8, True),  # a Kimi-K2-size layer in MXFP4 on one device
    ((2**31 + 1,), jnp.bfloat16, False),
])
def test_offsets_wrap(shape, dtype, wraps):
    assert tiles.offsets_wrap(shape, dtype) is wraps


def test_entries_clear_of_wrap():
    shapes = (DEEPSEEK_ENTRY, DEEPSEEK_DOWN_ENTRY)
    assert tiles.entries_clear_of_wrap(146, shapes, jnp.float8_e4m3fn) == 146  # 2.143e9 bytes
    count = tiles.entries_clear_of_wrap(147, shapes, jnp.float8_e4m3fn)
    assert count == 293
    assert not any(tiles.offsets_wrap((count, *s), jnp.float8_e4m3fn) for s in shapes)
    assert tiles.offsets_wrap((count - 1, *DEEPSEEK_ENTRY), jnp.float8_e4m3fn)
    assert tiles.entries_clear_of_wrap(256, shapes, jnp.bfloat16) == 256
    # entries of different sizes: the count that clears one stack must not leave the other wrapping
    mixed = ((1 << 20,), (3 << 20,))
    count = tiles.entries_clear_of_wrap(1200, mixed, jnp.uint8)
    assert not any(tiles.offsets_wrap((count, *s), jnp.uint8) for s in mixed)


def _copy_kernel(x_ref, o_ref):
    o_ref[0] = x_ref[0]


def test_compiled_kernel_refuses_wrapping_operand():
    big = jax.ShapeDtypeStruct((256, *DEEPSEEK_ENTRY), jnp.float8_e4m3fn)
    out = jax.ShapeDtypeStruct((1,), jnp.float8_e4m3fn)
    call = tiles.pallas_call(_copy_kernel, out_shape=out, grid=(1,), name="copy_first")
    with pytest.raises(tiles.OffsetWrapError, match=r"copy_first: array 0 float8_e4m3fn\[256, 2048, 224, 2, 16\]"):
        jax.eval_shape(call, big)
    with pytest.raises(tiles.OffsetWrapError, match="array 1"):  # the output is checked too
        jax.eval_shape(tiles.pallas_call(_copy_kernel, out_shape=big, grid=(1,), name="copy_out"), out)


def test_interpret_mode_takes_any_operand():
    small = jnp.arange(4, dtype=jnp.float32)
    call = tiles.pallas_call(_copy_kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.float32), interpret=True,
                             grid=(1,))
    assert float(call(small)[0]) == 0.0
    big = jax.ShapeDtypeStruct((2**31 + 1,), jnp.uint8)
    out = jax.eval_shape(tiles.pallas_call(_copy_kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.uint8),
                                           interpret=True, grid=(1,)), big)  # traced (not run): no OffsetWrapError
    assert out.shape == (1,)
    with pytest.raises(tiles.OffsetWrapError):
        jax.eval_shape(tiles.pallas_call(_copy_kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.uint8), grid=(1,)),
                       big)


def test_workspace_slots_clear_of_wrap():
    ws = jax.eval_shape(lambda: moe_workspace.create(146, 7168, 2048))
    assert ws.tags.shape == (146,)
    ws = jax.eval_shape(lambda: moe_workspace.create(256, 7168, 2048))
    assert ws.tags.shape == (293,) and ws.gate.shape[0] == ws.down.shape[0] == 293
    assert moe.kernels_index(_packed_deepseek(256), ws)
    ws = jax.eval_shape(lambda: moe_workspace.create(256, 7168, 2048, "bfloat16"))
    assert ws.tags.shape == (256,)


def _packed_deepseek(n_experts):
    return expert_specs(n_experts, 7168, 2048, "mxfp4")


def _fp8_deepseek():
    return expert_specs(256, 7168, 2048, "float8_e4m3fn")


def test_offline_fp8_padded_clear_of_wrap():
    fp8 = _fp8_deepseek()
    assert not moe.kernels_index(fp8)
    padded = jax.eval_shape(moe_workspace.clear_of_offset_wrap, fp8)
    assert padded.gate.shape[0] == padded.up.shape[0] == padded.down.shape[0] == 293
    assert padded.gate_scales.shape[0] == 256  # the experts stay 256: scales are indexed by expert
    assert moe.kernels_index(padded)
    small = mxfp4.ExpertWeights(*(jax.ShapeDtypeStruct((8, 64, 2, 2, 16), jnp.float8_e4m3fn),) * 3,
                                *(jax.ShapeDtypeStruct((8, 64, 2), jnp.uint8),) * 3, fmt="float8_e4m3fn")
    assert moe_workspace.clear_of_offset_wrap(small) is small
    with pytest.raises(ValueError, match="converted experts"):
        moe_workspace.clear_of_offset_wrap(_packed_deepseek(4))


def test_padded_fp8_entries_give_the_same_layer(seed):
    """Padding entries change nothing: the reference path over padded offline-FP8 experts gives the unpadded
    result (a small layer, padded by hand the way clear_of_offset_wrap pads)."""
    key = jax.random.key(seed)
    ew = mxfp4.random_experts(key, 8, 64, 32)
    fp8 = [jax.vmap(lambda b, s: mxfp4.to_workspace(b, s, "float8_e4m3fn"))(b, s)
           for b, s in ((ew.gate, ew.gate_scales), (ew.up, ew.up_scales), (ew.down, ew.down_scales))]
    plain = mxfp4.ExpertWeights(*fp8, ew.gate_scales, ew.up_scales, ew.down_scales, fmt="float8_e4m3fn")
    padded = mxfp4.ExpertWeights(*(jnp.pad(a, ((0, 5),) + ((0, 0),) * (a.ndim - 1)) for a in fp8),
                                 ew.gate_scales, ew.up_scales, ew.down_scales, fmt="float8_e4m3fn")
    x = jax.random.normal(jax.random.fold_in(key, 1), (5, 64), jnp.float32)
    ids = jnp.array([[0, 7], [3, 1], [7, 2], [5, 6], [4, 0]], jnp.int32)
    w = jax.random.uniform(jax.random.fold_in(key, 2), (5, 2))
    for impl in ("reference", "interpret"):
        want, _ = moe.moe_experts_packed(x, ids, w, plain, impl=impl)
        got, _ = moe.moe_experts_packed(x, ids, w, padded, impl=impl)
        assert jnp.allclose(got, want, rtol=1e-6, atol=1e-6), impl


def test_dispatch_falls_back_rather_than_wrap(monkeypatch):
    """Where dispatch picks the kernels (as on a GPU), experts the kernels cannot index run the reference path and
    take no decode tiles; asked for explicitly (impl="pallas"), the kernels are still tried."""
    monkeypatch.setattr(moe.dispatch, "choose", lambda *args, **kwargs: "pallas")
    tiles_small = moe.packed_decode_tiles(8, _packed_deepseek(256), None, None)
    assert isinstance(tiles_small, moe_mxfp4_gemv.GemvTiles)
    assert moe.packed_decode_tiles(8, _packed_deepseek(384), None, None) is None
    assert moe.packed_decode_tiles(8, _packed_deepseek(384), None, "pallas") is not None
    assert moe.kernels_index(_packed_deepseek(256)) and not moe.kernels_index(_packed_deepseek(384))
    x, ids, w = jnp.zeros((2, 7168), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 8), jnp.float32)
    taken = []
    monkeypatch.setattr(moe, "_packed_reference", lambda x, *args: taken.append("reference") or x)
    monkeypatch.setattr(moe.moe_mxfp4, "grouped_swiglu", lambda x, *args, **kwargs: taken.append("kernels") or x)
    jax.eval_shape(lambda: moe.moe_experts_packed(x, ids, w, _packed_deepseek(384)))
    jax.eval_shape(lambda: moe.moe_experts_packed(x, ids, w, _packed_deepseek(256)))
    jax.eval_shape(lambda: moe.moe_experts_packed(x, ids, w, _packed_deepseek(384), impl="pallas"))
    assert taken == ["reference", "kernels", "kernels"]
