"""Masked multi-head attention over expanded keys/values, plain jnp (the MLA prefill reference).

Softmax in float32; probabilities cast back to the query dtype before the value product, as transformers does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """q [B, T, H, D], k [B, S, H, D], v [B, S, H, Dv], mask [B, T, S] bool (True = attend) -> [B, T, H, Dv].

    Rows whose mask is all False give zeros.
    """
    logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(logits - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = (p / jnp.where(denom > 0, denom, 1.0)).astype(q.dtype)
    return jnp.einsum("bhts,bshd->bthd", p, v, preferred_element_type=jnp.float32).astype(q.dtype)
