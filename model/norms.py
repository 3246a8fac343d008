"""Normalisation layers (Flax Linen), computed in float32."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
    """y = weight * (x / rms(x)).astype(x.dtype); statistics in float32. Param `weight` [D]."""

    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return (weight * rms_normalize(x, self.eps).astype(x.dtype)).astype(x.dtype)


class GatedRMSNorm(nn.Module):
    """KDA output norm: rmsnorm(x) * weight * sigmoid(gate), all in float32, cast to x.dtype. Param `weight` [D]."""

    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        normed = rms_normalize(x, self.eps)
        return (weight.astype(jnp.float32) * normed * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with params `weight`, `bias` [D] (the DSA indexer's k_norm), statistics in float32."""

    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
        return y.astype(x.dtype)
