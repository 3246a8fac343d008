"""Routed-expert SwiGLU MLP over top-k assignments, plain jnp with `jax.lax.ragged_dot` (the MoE reference).

Token-expert pairs are sorted by expert so each expert's rows are contiguous, run through one grouped matmul per
projection, weighted, and summed back per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def moe_experts(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array) -> jax.Array:
    """x [N, H], topk_ids [N, k] int, topk_weights [N, k] f32, w_gate/w_up [E, H, I], w_down [E, I, H] -> [N, H].

    Accumulates the weighted expert outputs in float32 and returns x.dtype.
    """
    n_tokens, top_k = topk_ids.shape
    n_experts = w_gate.shape[0]
    flat_ids = topk_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    rows = x[order // top_k]
    group_sizes = jnp.bincount(flat_ids, length=n_experts).astype(jnp.int32)
    gate = jax.lax.ragged_dot(rows, w_gate.astype(x.dtype), group_sizes)
    up = jax.lax.ragged_dot(rows, w_up.astype(x.dtype), group_sizes)
    hidden = (jax.nn.silu(gate) * up).astype(x.dtype)
    out = jax.lax.ragged_dot(hidden, w_down.astype(x.dtype), group_sizes)
    weighted = out.astype(jnp.float32) * topk_weights.reshape(-1)[order][:, None]
    y = jnp.zeros((n_tokens, x.shape[-1]), jnp.float32).at[order // top_k].add(weighted)
    return y.astype(x.dtype)
