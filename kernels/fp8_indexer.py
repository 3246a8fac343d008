"""The DSA indexer's optional FP8 mode, after DeepSeek-V3.2's inference code: queries and keys are rotated by an
orthonormal Hadamard transform (dot products unchanged, outliers spread over all channels), then quantized to
float8_e4m3fn with one power-of-two scale per vector (per token for keys, per token and head for queries):
scale = 2 ** ceil(log2(amax / 448)), x8 = x / scale.

The scores then use the dequantized values: q . k = (q8 . k8) * q_scale * k_scale. Keys are cached as e4m3 with
their scales (`index_scales` [L, N, 64, 1] float32 beside `index_keys`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import mxfp4

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
_MIN_AMAX = 1e-12


@functools.lru_cache(maxsize=None)
def hadamard_matrix(n: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix [n, n] float32 (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two width, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotate(x: jax.Array) -> jax.Array:
    """x [..., n] -> x @ H [..., n] float32 (symmetric orthonormal H: rotating queries and keys keeps q . k)."""
    h = jnp.asarray(hadamard_matrix(x.shape[-1]))
    return jnp.einsum("...i,ij->...j", x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST)


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., n] -> (e4m3 [..., n], power-of-two scales [...] float32) with x ~= e4m3 * scale per vector."""
    x = x.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), _MIN_AMAX)
    # 2 ** ceil(log2(amax / 448)) built from the exponent bits: XLA's exp2 and log2 on CPU are not exact at integers
    # (a scale one ulp off a power of two, or a ceil pushed up by log2's rounding)
    mantissa, exponent = jnp.frexp(amax / E4M3_MAX)  # = mantissa * 2 ** exponent, mantissa in [0.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    scale = mxfp4.pow2(exponent.astype(jnp.int32))
    return jnp.clip(x / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(E4M3), scale


def rotate_and_quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Hadamard rotation, then e4m3 with power-of-two scales (see `quantize`)."""
    return quantize(rotate(x))


def dequantize(x8: jax.Array, scale: jax.Array) -> jax.Array:
    """e4m3 [..., n], scales [...] (or [..., 1]) -> float32 [..., n]."""
    scale = scale if scale.ndim == x8.ndim else scale[..., None]
    return x8.astype(jnp.float32) * scale
