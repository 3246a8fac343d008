"""Kimi Delta Attention layer (Flax Linen): q/k/v projections with short causal convs + SiLU, the per-channel forget
gate, beta, the chunked delta-rule scan, a gated RMSNorm and the output projection."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from dayzero.kernels import kda as kda_kernels
from dayzero.kernels import short_conv

from .config import ModelConfig
from .mla import dense
from .norms import GatedRMSNorm


def _a_log_init(key, shape, dtype):
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def _dt_bias_init(key, shape, dtype):
    dt = jnp.maximum(jnp.exp(jax.random.uniform(key, shape, jnp.float32, math.log(1e-3), math.log(1e-1))), 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)  # inverse softplus


def forget_gate(raw: jax.Array, a_log: jax.Array, dt_bias: jax.Array, lower_bound: float | None) -> jax.Array:
    """Per-channel log-decay g [B, T, H, K] float32 from the f_b_proj output raw [B, T, H*K].

    Default: g = -exp(A_log) * softplus(raw + dt_bias) (softplus linear above 20).
    With a lower bound: g = lower_bound * sigmoid(exp(A_log) * (raw + dt_bias)), in (lower_bound, 0).
    """
    heads = a_log.shape[0]
    x = (raw.astype(jnp.float32) + dt_bias.astype(jnp.float32)).reshape(*raw.shape[:-1], heads, -1)
    rate = jnp.exp(a_log.astype(jnp.float32))[:, None]
    if lower_bound is not None:
        return lower_bound * jax.nn.sigmoid(rate * x)
    softplus = jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))
    return -rate * softplus


class KimiDeltaAttention(nn.Module):
    """KDA over a full sequence. Params: q/k/v_proj, q/k/v_conv1d (`weight` [C, W]), f_a_proj, f_b_proj,
    A_log [H], dt_bias [H*K], b_proj, g_a_proj, g_b_proj, o_norm, o_proj."""

    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, D]."""
        cfg = self.config
        batch, length, _ = x.shape
        heads, head_dim, width = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
        dim = heads * head_dim

        q, k, v = (
            ShortConv(dim, width, self.dtype, name=f"{name}_conv1d")(
                dense(dim, self.dtype, name=f"{name}_proj")(x)).reshape(batch, length, heads, head_dim)
            for name in ("q", "k", "v"))
        a_log = self.param("A_log", _a_log_init, (heads,), jnp.float32)
        dt_bias = self.param("dt_bias", _dt_bias_init, (dim,), jnp.float32)
        raw = dense(dim, self.dtype, name="f_b_proj")(dense(head_dim, self.dtype, name="f_a_proj")(x))
        g = forget_gate(raw, a_log, dt_bias, cfg.kda_gate_lower_bound)
        beta = jax.nn.sigmoid(dense(heads, self.dtype, name="b_proj")(x).astype(jnp.float32))
        o, _ = kda_kernels.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        gate = dense(dim, self.dtype, name="g_b_proj")(dense(head_dim, self.dtype, name="g_a_proj")(x))
        o = GatedRMSNorm(eps=cfg.rms_norm_eps, param_dtype=self.dtype, name="o_norm")(
            o, gate.reshape(batch, length, heads, head_dim))
        return dense(cfg.hidden_size, self.dtype, name="o_proj")(o.reshape(batch, length, dim))


class ShortConv(nn.Module):
    """Depthwise causal conv + SiLU with param `weight` [C, W]."""

    channels: int
    width: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.normal(0.2), (self.channels, self.width), self.dtype)
        y, _ = short_conv.causal_conv1d(x, weight, activation="silu")
        return y
