"""DeepSeek Sparse Attention's lightning indexer in exact mode, plain jnp: scores and top-k selection.

score[b, t, s] = sum_h w[b, t, h] * relu(scale * q[b, t, h] . k[b, s]); each query keeps the `topk` highest-scoring
keys among those it may attend to (causal).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def index_scores(q: jax.Array, k: jax.Array, weights: jax.Array, scale: float) -> jax.Array:
    """q [B, T, H, D], k [B, S, D], weights [B, T, H] -> scores [B, T, S] float32."""
    q, k, weights = (x.astype(jnp.float32) for x in (q, k, weights))
    per_head = jax.nn.relu(jnp.einsum("bthd,bsd->bths", q, k) * scale)
    return jnp.einsum("bth,bths->bts", weights, per_head)


def topk_mask(scores: jax.Array, allowed: jax.Array, topk: int) -> jax.Array:
    """scores [B, T, S] f32, allowed [B, T, S] bool -> selected [B, T, S] bool (a subset of `allowed`).

    When a query may attend to at most `topk` keys, all of them are selected.
    """
    n_keys = scores.shape[-1]
    if topk >= n_keys:
        return allowed
    masked = jnp.where(allowed, scores, -jnp.inf)
    _, idx = jax.lax.top_k(masked, topk)  # [B, T, topk]
    b = jnp.arange(scores.shape[0])[:, None, None]
    t = jnp.arange(scores.shape[1])[None, :, None]
    selected = jnp.zeros(scores.shape, bool).at[b, t, idx].set(True)
    return selected & allowed
