"""MXFP4 format: dequantize bit-exact against transformers' gpt-oss converter, NaN scales, quantize against an
independent OCP oracle (ml_dtypes' round-to-nearest-even E2M1 cast), round trips, and the workspace formats."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dayzero.kernels import mxfp4

torch = pytest.importorskip("torch")
hf_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

dequantize = jax.jit(mxfp4.dequantize, static_argnums=2)
quantize = jax.jit(mxfp4.quantize)


def _hf_dequantize(blocks: np.ndarray, scales: np.ndarray, dtype) -> np.ndarray:
    """transformers' converter (it returns [E, n*32, N] for [E, N, n, 16]: transpose back), as raw bits."""
    out = hf_mxfp4.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
    out = out.transpose(1, 2).contiguous()
    return (out.view(torch.int16) if dtype == torch.bfloat16 else out.view(torch.int32)).numpy()


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.int16) if x.dtype == ml_dtypes.bfloat16 else x.view(np.int32)


def _random_packed(rng, experts=2, rows=127, groups=2):
    """Every code in every nibble position and every scale byte 0..254 (shuffled) appear."""
    blocks = rng.integers(0, 256, (experts, rows, groups, 16), dtype=np.uint8)
    scales = rng.permutation(np.resize(np.arange(255, dtype=np.uint8), experts * rows * groups))
    return blocks, scales.reshape(experts, rows, groups)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dequantize_bit_exact_vs_transformers(seed, dtype):
    blocks, scales = _random_packed(np.random.default_rng(seed))
    ours = dequantize(jnp.asarray(blocks), jnp.asarray(scales), dtype)
    assert ours.shape == (2, 127, 64) and ours.dtype == jnp.dtype(dtype)
    theirs = _hf_dequantize(blocks, scales, getattr(torch, dtype))
    mismatch = np.argwhere(_bits(ours) != theirs)
    assert mismatch.size == 0, f"{len(mismatch)} values differ, first at {mismatch[0]} (seed={seed})"


def test_dequantize_nibble_order_and_values():
    # byte 0x2F: low nibble 0xF = -6 (element 0), high nibble 0x2 = 1.0 (element 1); scale 128 doubles them
    blocks = np.zeros((1, 16), np.uint8)
    blocks[0, 0], blocks[0, 15] = 0x2F, 0x91  # last byte: low 0x1 = 0.5 (element 30), high 0x9 = -0.5 (31)
    out = np.asarray(dequantize(jnp.asarray(blocks), jnp.asarray([128], jnp.uint8), "float32"))
    assert out[0] == -12.0 and out[1] == 2.0 and out[30] == 1.0 and out[31] == -1.0
    assert np.all(out[2:30] == 0)


def test_nan_scale(seed):
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (3, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (3, 4), dtype=np.uint8)
    scales[1, 2] = 0xFF
    out = np.asarray(dequantize(jnp.asarray(blocks), jnp.asarray(scales), "float32")).reshape(3, 4, 32)
    assert np.all(np.isnan(out[1, 2]))
    finite = np.ones((3, 4), bool)
    finite[1, 2] = False
    assert np.all(np.isfinite(out[finite]))
    theirs = _hf_dequantize(blocks[None], scales[None], torch.float32)[0].view(np.float32).reshape(3, 4, 32)
    np.testing.assert_array_equal(out[finite], theirs[finite])


def _oracle_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP MX by the book, in numpy: shared exponent floor(log2(amax)) - emax(E2M1)=2, elements cast with ml_dtypes'
    float4_e2m1fn (round to nearest even, saturating)."""
    x = w.reshape(*w.shape[:-1], -1, 32).astype(np.float64)
    amax = np.max(np.abs(x), axis=-1)
    e = np.floor(np.log2(np.where(amax > 0, amax, 1.0))).astype(np.int64) - 2
    e = np.where(amax > 0, e, -3)
    s = np.clip(e + 127, 0, 254)
    scaled = (x / np.exp2(s - 127.0)[..., None]).astype(np.float32)
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).astype(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), s.astype(np.uint8)


def test_quantize_matches_ocp_oracle(seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((5, 8, 64)) * np.exp2(rng.integers(-12, 4, (5, 8, 1)))
    # exact rounding ties (k.25, .75, 2.5, 3.5, 5) and saturating values (in (6, 8)) at the block's scale
    grid = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.5, -0.25, -2.5, 6.5, 4.0])
    w[0, :, :12] = grid * 2.0 ** -5
    w[0, :, 12:32] = 0.0
    w[1, 0, :32] = 0.0  # an all-zero block
    w = w.astype(np.float32)
    blocks, scales = quantize(jnp.asarray(w))
    want_blocks, want_scales = _oracle_quantize(w)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(np.asarray(blocks), want_blocks)


def test_quantize_round_trip(seed):
    rng = np.random.default_rng(seed)
    # values on the MXFP4 grid come back exactly
    codes = rng.integers(0, 16, (4, 6, 3, 16), dtype=np.uint8)
    blocks = codes | (rng.integers(0, 16, codes.shape, dtype=np.uint8) << 4)
    scales = rng.integers(90, 160, (4, 6, 3), dtype=np.uint8)
    w = dequantize(jnp.asarray(blocks), jnp.asarray(scales), "float32")
    back = dequantize(*quantize(w), "float32")
    np.testing.assert_array_equal(np.asarray(back), np.asarray(w))
    # arbitrary values: within half the grid spacing (saturation: 2 units) of the scale, and idempotent
    x = jnp.asarray(rng.standard_normal((7, 96)).astype(np.float32))
    b, s = quantize(x)
    deq = dequantize(b, s, "float32")
    unit = np.exp2(np.asarray(s, np.float64) - 127).repeat(32, axis=-1)
    assert np.all(np.abs(np.asarray(deq) - np.asarray(x)) <= 2 * unit)
    assert 0.05 < float(jnp.linalg.norm(deq - x) / jnp.linalg.norm(x)) < 0.2
    b2, s2 = quantize(deq)
    np.testing.assert_array_equal(np.asarray(dequantize(b2, s2, "float32")), np.asarray(deq))


def test_quantize_pads_rows_to_blocks(seed):
    x = np.random.default_rng(seed).standard_normal((3, 40)).astype(np.float32)
    b, s = quantize(jnp.asarray(x))
    assert b.shape == (3, 2, 16) and s.shape == (3, 2)
    deq = np.asarray(dequantize(b, s, "float32"))
    assert deq.shape == (3, 64) and np.all(deq[:, 40:] == 0)
    assert np.max(np.abs(deq[:, :40] - x)) < 0.5 * np.max(np.abs(x))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_workspace_format_round_trip(seed, dtype):
    rng = np.random.default_rng(seed)
    blocks = jnp.asarray(rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8))
    scales = jnp.asarray(rng.integers(100, 150, (3, 5, 2), dtype=np.uint8))
    data = mxfp4.to_workspace(blocks, scales, dtype)
    assert data.shape == (3, 5, 2, 2, 16) and data.dtype == jnp.dtype(dtype)
    codes = np.asarray(mxfp4.codes(blocks))
    lo_plane = np.asarray(mxfp4.to_workspace(blocks, scales, "float8_e4m3fn"), np.float32)[..., 0, :]
    np.testing.assert_array_equal(np.sign(lo_plane) * (lo_plane != 0), np.where(
        codes[..., 0::2] & 7, np.where(codes[..., 0::2] & 8, -1.0, 1.0), 0.0))  # plane 0 = even elements
    back = mxfp4.from_workspace(data, scales if dtype == "float8_e4m3fn" else None, jnp.float32)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(dequantize(blocks, scales, "float32")))
