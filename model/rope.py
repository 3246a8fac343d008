"""Rotary position embeddings: default and YaRN (with DeepSeek's mscale), interleaved and rotate-half layouts."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .config import RopeConfig


def inverse_frequencies(rope: RopeConfig, dim: int) -> np.ndarray:
    """Per-pair inverse frequencies [dim // 2] float32 for `rope` (YaRN blends interpolation and extrapolation)."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(rope.theta), exponents, dtype=np.float32)
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if rope.kind != "yarn":
        return extrapolation
    interpolation = (np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = (np.float32(1.0) - ramp).astype(np.float32)
    return (interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight).astype(np.float32)


def cos_sin(rope: RopeConfig, dim: int, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] int -> (cos, sin) [B, T, dim // 2] in `dtype`, scaled by YaRN's attention factor."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies(rope, dim))
    scale = rope.cos_sin_scale
    return (jnp.cos(freqs) * scale).astype(dtype), (jnp.sin(freqs) * scale).astype(dtype)


def _rotate(x1, x2, cos, sin):
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def apply_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """DeepSeek MLA layout: pairs (x0, x1), (x2, x3), ... ; x [B, T, H, D], cos/sin [B, T, D/2].

    The output is de-interleaved ([rotated evens | rotated odds]); apply it to queries and keys alike.
    """
    return _rotate(x[..., 0::2], x[..., 1::2], cos[:, :, None], sin[:, :, None])


def apply_rotate_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """NeoX layout: pairs (x[i], x[i + D/2]) (the DSA indexer's); x [B, T, H, D], cos/sin [B, T, D/2]."""
    half = x.shape[-1] // 2
    return _rotate(x[..., :half], x[..., half:], cos[:, :, None], sin[:, :, None])
