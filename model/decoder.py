"""The decoder stack (Flax Linen): embedding, hybrid KDA/MLA layers with dense or MoE MLPs, final norm, LM head."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import LAYER_KDA, MLP_MOE, ModelConfig
from .kda import KimiDeltaAttention
from .mla import MLAttention
from .moe import MLP, MoE
from .norms import RMSNorm


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    config: ModelConfig
    layer: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, positions):
        cfg = self.config
        h = RMSNorm(cfg.rms_norm_eps, self.dtype, name="input_layernorm")(x)
        if cfg.layer_types[self.layer] == LAYER_KDA:
            h = KimiDeltaAttention(cfg, self.dtype, name="self_attn")(h)
        else:
            h = MLAttention(cfg, self.dtype, name="self_attn")(h, positions)
        x = x + h
        h = RMSNorm(cfg.rms_norm_eps, self.dtype, name="post_attention_layernorm")(x)
        if cfg.mlp_types[self.layer] == MLP_MOE:
            h = MoE(cfg, self.dtype, name="mlp")(h)
        else:
            h = MLP(cfg.intermediate_size, cfg.hidden_size, self.dtype, name="mlp")(h)
        return x + h


class Decoder(nn.Module):
    """token_ids [B, T] -> logits [B, T, V] float32 (and, when asked, the hidden states after the embedding and
    after every layer, the last one after the final norm, as transformers' `output_hidden_states`)."""

    config: ModelConfig
    dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, token_ids: jax.Array, positions: jax.Array | None = None, return_hidden_states: bool = False):
        cfg = self.config
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(token_ids.shape[1]), token_ids.shape)
        embed = self.param("embed_tokens", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.hidden_size),
                           self.dtype)
        x = jnp.take(embed, token_ids, axis=0)
        hidden = [x]
        for i in range(cfg.num_layers):
            x = DecoderLayer(cfg, i, self.dtype, name=f"layers_{i}")(x, positions)
            hidden.append(x)
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(x)
        hidden[-1] = x
        if cfg.tie_word_embeddings:
            logits = jnp.einsum("btd,vd->btv", x, embed, preferred_element_type=jnp.float32)
        else:
            head = self.param("lm_head", nn.initializers.normal(0.02), (cfg.hidden_size, cfg.vocab_size), self.dtype)
            logits = jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
        if return_hidden_states:
            return logits, hidden
        return logits
