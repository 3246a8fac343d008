"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi's NoPE variant) with the optional DSA lightning indexer.

Two paths over the same params: `__call__` runs a whole sequence with keys/values expanded through `kv_b_proj`
(the transformers form); `step` runs new tokens against a paged cache of latents [kv_lora_rank + rope] (and indexer
keys), in absorbed form: W_UK folded into the query, W_UV applied to the latent output.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dayzero.kernels import attention as attention_kernels
from dayzero.kernels import indexer as indexer_kernels
from dayzero.kernels import paged

from . import rope as rope_lib
from .config import ModelConfig
from .norms import LayerNorm, RMSNorm


def dense(features: int, dtype, use_bias: bool = False, name: str | None = None) -> nn.Dense:
    """A linear layer with kernel [in, out] stored in `dtype` (the checkpoint's [out, in] weight transposed)."""
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name,
                    kernel_init=nn.initializers.normal(0.02))


def _rope_split(x: jax.Array, rope_dim: int, cos, sin) -> jax.Array:
    """Rotates the first `rope_dim` channels (rotate-half layout) and keeps the rest."""
    return jnp.concatenate([rope_lib.apply_rotate_half(x[..., :rope_dim], cos, sin), x[..., rope_dim:]], axis=-1)


class Indexer(nn.Module):
    """DSA lightning indexer (exact mode). Params: wq_b, wk, k_norm, weights_proj (float32)."""

    config: ModelConfig
    dtype: jnp.dtype

    def setup(self):
        cfg = self.config
        self.wq_b = dense(cfg.index_n_heads * cfg.index_head_dim, self.dtype)
        self.wk = dense(cfg.index_head_dim, self.dtype)
        self.k_norm = LayerNorm(eps=1e-6, param_dtype=self.dtype)
        self.weights_proj = nn.Dense(cfg.index_n_heads, use_bias=False, dtype=jnp.float32, param_dtype=jnp.float32,
                                     kernel_init=nn.initializers.normal(0.02))

    def keys(self, x, cos, sin) -> jax.Array:
        """x [B, T, D] -> indexer keys [B, T, index_head_dim] (normed, roped)."""
        k = self.k_norm(self.wk(x))[:, :, None, :]
        return _rope_split(k, self.config.qk_rope_head_dim, cos, sin)[:, :, 0]

    def select(self, x, q_latent, cos, sin, keys, allowed) -> jax.Array:
        """Top-k keys per query: keys [B, S, Di], allowed [B, T, S] -> selected [B, T, S] bool."""
        cfg = self.config
        batch, length, _ = x.shape
        q = self.wq_b(q_latent).reshape(batch, length, cfg.index_n_heads, cfg.index_head_dim)
        q = _rope_split(q, cfg.qk_rope_head_dim, cos, sin)
        weights = self.weights_proj(x.astype(jnp.float32)) * cfg.index_n_heads ** -0.5
        scores = indexer_kernels.index_scores(q, keys, weights, scale=cfg.index_head_dim ** -0.5)
        return indexer_kernels.topk_mask(scores, allowed, cfg.index_topk)

    def __call__(self, x, q_latent, cos, sin, allowed):
        return self.select(x, q_latent, cos, sin, self.keys(x, cos, sin), allowed)


class MLAttention(nn.Module):
    """MLA. Params follow the published names (q_proj or q_a_proj/q_a_layernorm/q_b_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj, indexer)."""

    config: ModelConfig
    dtype: jnp.dtype

    def setup(self):
        cfg = self.config
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = dense(cfg.num_heads * cfg.qk_head_dim, self.dtype)
        else:
            self.q_a_proj = dense(cfg.q_lora_rank, self.dtype, use_bias=bias)
            self.q_a_layernorm = RMSNorm(eps=1e-6, param_dtype=self.dtype)
            self.q_b_proj = dense(cfg.num_heads * cfg.qk_head_dim, self.dtype)
        self.kv_a_proj_with_mqa = dense(cfg.kv_lora_rank + cfg.qk_rope_head_dim, self.dtype, use_bias=bias)
        self.kv_a_layernorm = RMSNorm(eps=1e-6, param_dtype=self.dtype)
        self.kv_b_proj = dense(cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), self.dtype)
        self.o_proj = dense(cfg.hidden_size, self.dtype, use_bias=bias)
        if cfg.use_dsa:
            self.indexer = Indexer(cfg, self.dtype)

    def _rope(self, positions):
        cfg = self.config
        if cfg.mla_use_rope or cfg.use_dsa:
            return rope_lib.cos_sin(cfg.rope, cfg.qk_rope_head_dim, positions, self.dtype)
        return None, None

    def _queries(self, x, cos, sin):
        """-> q_nope [B, T, H, nope], q_rope [B, T, H, rope] (roped when the model uses rope), q_latent or None."""
        cfg = self.config
        batch, length, _ = x.shape
        q_latent = None
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        q = q.reshape(batch, length, cfg.num_heads, cfg.qk_head_dim)
        q_nope, q_rope = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        if cfg.mla_use_rope:
            q_rope = rope_lib.apply_interleaved(q_rope, cos, sin)
        return q_nope, q_rope, q_latent

    def _latents(self, x, cos, sin):
        """-> normed latent [B, T, kv_lora_rank], shared rope key [B, T, rope]."""
        cfg = self.config
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[..., :cfg.kv_lora_rank])
        k_rope = kv[..., cfg.kv_lora_rank:]
        if cfg.mla_use_rope:
            k_rope = rope_lib.apply_interleaved(k_rope[:, :, None, :], cos, sin)[:, :, 0]
        return latent, k_rope

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Whole sequence: x [B, T, D], positions [B, T] -> [B, T, D]."""
        cfg = self.config
        batch, length, _ = x.shape
        heads, nope, v_dim = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        cos, sin = self._rope(positions)
        q_nope, q_rope, q_latent = self._queries(x, cos, sin)
        latent, k_rope = self._latents(x, cos, sin)
        kv_up = self.kv_b_proj(latent).reshape(batch, length, heads, nope + v_dim)
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (batch, length, heads, cfg.qk_rope_head_dim))
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([kv_up[..., :nope], k_rope], axis=-1)
        allowed = jnp.broadcast_to(positions[:, :, None] >= positions[:, None, :], (batch, length, length))
        if cfg.use_dsa:
            allowed = self.indexer(x, q_latent, cos, sin, allowed)
        o = attention_kernels.masked_attention(q, k, kv_up[..., nope:], allowed, scale=cfg.mla_softmax_scale)
        return self.o_proj(o.reshape(batch, length, heads * v_dim))

    def step(self, x, positions, valid, cache: dict, layer: int, block_tables):
        """New tokens against the paged cache. x [B, T, D], positions/valid [B, T], cache {"latent": [L, N, 64,
        R + E], "index_keys": [L, N, 64, Di] (DSA)}, `layer` this layer's index among MLA layers, block_tables
        [B, max_blocks] -> (out [B, T, D], cache with the new tokens written)."""
        cfg = self.config
        batch, length, _ = x.shape
        heads, nope, rank = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        cos, sin = self._rope(positions)
        q_nope, q_rope, q_latent = self._queries(x, cos, sin)
        latent, k_rope = self._latents(x, cos, sin)
        cache = dict(cache)
        cache["latent"] = paged.write(cache["latent"], layer, block_tables, positions, valid,
                                      jnp.concatenate([latent, k_rope], axis=-1))
        context = paged.gather(cache["latent"], layer, block_tables)  # [B, S, R + E]
        key_positions = jnp.arange(context.shape[1])
        allowed = (key_positions[None, None, :] <= positions[:, :, None]) & valid[:, :, None]
        if cfg.use_dsa:
            cache["index_keys"] = paged.write(cache["index_keys"], layer, block_tables, positions, valid,
                                              self.indexer.keys(x, cos, sin))
            keys = paged.gather(cache["index_keys"], layer, block_tables)
            allowed = self.indexer.select(x, q_latent, cos, sin, keys, allowed)
        w_kv = self.kv_b_proj.variables["params"]["kernel"].reshape(rank, heads, nope + cfg.v_head_dim)
        q_absorbed = jnp.einsum("bthn,rhn->bthr", q_nope, w_kv[..., :nope].astype(q_nope.dtype))
        o_latent = attention_kernels.latent_attention(q_absorbed, q_rope, context[..., :rank], context[..., rank:],
                                                      allowed, scale=cfg.mla_softmax_scale)
        o = jnp.einsum("bthr,rhv->bthv", o_latent, w_kv[..., nope:].astype(o_latent.dtype))
        return self.o_proj(o.reshape(batch, length, heads * cfg.v_head_dim)), cache
