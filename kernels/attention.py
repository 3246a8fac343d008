"""Masked attention references, plain jnp: over expanded keys/values (MLA prefill) and over cached latents in
absorbed form (MLA with a paged latent cache). Softmax in float32; probabilities cast back to the query dtype before
the value product, as transformers does; fully masked rows give zeros."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_softmax(logits: jax.Array, mask: jax.Array, dtype) -> jax.Array:
    """logits [B, H, T, S] float32, mask [B, T, S] bool -> probabilities [B, H, T, S] in `dtype`."""
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(logits - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return (p / jnp.where(denom > 0, denom, 1.0)).astype(dtype)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """q [B, T, H, D], k [B, S, H, D], v [B, S, H, Dv], mask [B, T, S] bool (True = attend) -> [B, T, H, Dv]."""
    logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
    p = masked_softmax(logits, mask, q.dtype)
    return jnp.einsum("bhts,bshd->bthd", p, v, preferred_element_type=jnp.float32).astype(q.dtype)


def latent_attention(q_latent: jax.Array, q_rope: jax.Array, latents: jax.Array, k_rope: jax.Array,
                     mask: jax.Array, scale: float) -> jax.Array:
    """MLA in absorbed form over cached latents (W_UK folded into the query; the caller applies W_UV).

    q_latent [B, T, H, R], q_rope [B, T, H, E], latents [B, S, R], k_rope [B, S, E], mask [B, T, S] bool
    -> latent outputs [B, T, H, R] in q_latent.dtype.
    """
    logits = (jnp.einsum("bthr,bsr->bhts", q_latent, latents, preferred_element_type=jnp.float32)
              + jnp.einsum("bthe,bse->bhts", q_rope, k_rope, preferred_element_type=jnp.float32)) * scale
    p = masked_softmax(logits, mask, q_latent.dtype)
    return jnp.einsum("bhts,bsr->bthr", p, latents, preferred_element_type=jnp.float32).astype(q_latent.dtype)
