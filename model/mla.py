"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi's NoPE variant) with the optional DSA lightning indexer.

Full-sequence (prefill) form: the latent is expanded to per-head keys and values through `kv_b_proj`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dayzero.kernels import attention as attention_kernels
from dayzero.kernels import indexer as indexer_kernels

from . import rope as rope_lib
from .config import ModelConfig
from .norms import LayerNorm, RMSNorm


def dense(features: int, dtype, use_bias: bool = False, name: str | None = None) -> nn.Dense:
    """A linear layer with kernel [in, out] stored in `dtype` (the checkpoint's [out, in] weight transposed)."""
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name,
                    kernel_init=nn.initializers.normal(0.02))


class Indexer(nn.Module):
    """DSA lightning indexer (exact mode): selects each query's top-k keys. Params: wq_b, wk, k_norm, weights_proj."""

    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, q_latent, cos, sin, allowed):
        """x [B, T, D], q_latent [B, T, q_lora_rank], cos/sin [B, T, rope/2], allowed [B, T, S] -> selected [B, T, S]."""
        cfg = self.config
        batch, length, _ = x.shape
        heads, head_dim, rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        q = dense(heads * head_dim, self.dtype, name="wq_b")(q_latent).reshape(batch, length, heads, head_dim)
        k = LayerNorm(eps=1e-6, param_dtype=self.dtype, name="k_norm")(dense(head_dim, self.dtype, name="wk")(x))
        k = k[:, :, None, :]
        q = jnp.concatenate([rope_lib.apply_rotate_half(q[..., :rope_dim], cos, sin), q[..., rope_dim:]], axis=-1)
        k = jnp.concatenate([rope_lib.apply_rotate_half(k[..., :rope_dim], cos, sin), k[..., rope_dim:]], axis=-1)
        # weights_proj runs in float32 (transformers keeps this module in fp32)
        weights = nn.Dense(heads, use_bias=False, dtype=jnp.float32, param_dtype=jnp.float32, name="weights_proj",
                           kernel_init=nn.initializers.normal(0.02))(x.astype(jnp.float32)) * heads ** -0.5
        scores = indexer_kernels.index_scores(q, k[:, :, 0], weights, scale=head_dim ** -0.5)
        return indexer_kernels.topk_mask(scores, allowed, cfg.index_topk)


class MLAttention(nn.Module):
    """MLA over a full sequence. Params follow the published names (q_proj or q_a_proj/q_a_layernorm/q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, indexer)."""

    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [B, T, D], positions [B, T] -> [B, T, D]."""
        cfg = self.config
        batch, length, _ = x.shape
        heads, nope, rope_dim, v_dim = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        bias = cfg.attention_bias
        q_latent = None
        if cfg.q_lora_rank is None:
            q = dense(heads * cfg.qk_head_dim, self.dtype, name="q_proj")(x)
        else:
            q_latent = dense(cfg.q_lora_rank, self.dtype, use_bias=bias, name="q_a_proj")(x)
            q_latent = RMSNorm(eps=1e-6, param_dtype=self.dtype, name="q_a_layernorm")(q_latent)
            q = dense(heads * cfg.qk_head_dim, self.dtype, name="q_b_proj")(q_latent)
        q = q.reshape(batch, length, heads, cfg.qk_head_dim)
        kv = dense(cfg.kv_lora_rank + rope_dim, self.dtype, use_bias=bias, name="kv_a_proj_with_mqa")(x)
        latent = RMSNorm(eps=1e-6, param_dtype=self.dtype, name="kv_a_layernorm")(kv[..., :cfg.kv_lora_rank])
        k_rope = kv[..., cfg.kv_lora_rank:][:, :, None, :]  # [B, T, 1, rope], shared by every head
        cos = sin = None
        if cfg.mla_use_rope or cfg.use_dsa:
            cos, sin = rope_lib.cos_sin(cfg.rope, rope_dim, positions, self.dtype)
        if cfg.mla_use_rope:
            q = jnp.concatenate([q[..., :nope], rope_lib.apply_interleaved(q[..., nope:], cos, sin)], axis=-1)
            k_rope = rope_lib.apply_interleaved(k_rope, cos, sin)
        kv_up = dense(heads * (nope + v_dim), self.dtype, name="kv_b_proj")(latent).reshape(
            batch, length, heads, nope + v_dim)
        k = jnp.concatenate([kv_up[..., :nope], jnp.broadcast_to(k_rope, (batch, length, heads, rope_dim))], axis=-1)
        v = kv_up[..., nope:]
        causal = jnp.tril(jnp.ones((length, length), bool))
        allowed = (positions[:, :, None] >= positions[:, None, :]) & causal
        if cfg.use_dsa:
            allowed = Indexer(cfg, self.dtype, name="indexer")(x, q_latent, cos, sin, allowed)
        o = attention_kernels.masked_attention(q, k, v, allowed, scale=cfg.mla_softmax_scale)
        return dense(cfg.hidden_size, self.dtype, use_bias=bias, name="o_proj")(o.reshape(batch, length, heads * v_dim))
