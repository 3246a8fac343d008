"""Plain-jnp Kimi Delta Attention: the oracle for the Pallas kernels.

Semantics follow flash-linear-attention (`fla.ops.kda`). Per head, with state S [K, V] (float32):

    S   <- diag(exp(g_t)) S                      (per-channel decay; g_t <= 0 is the log-decay)
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T    (delta rule)
    o_t  = S^T (scale * q_t)

Layout [B, T, H, K] for q/k/g, [B, T, H, V] for v, [B, T, H] for beta; state [B, H, K, V] float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def log_decay(x: jax.Array, a_log: jax.Array, lower_bound: float | None) -> jax.Array:
    """The KDA forget gate's activation: x = f_b output + dt_bias (float32), a_log broadcasting against it (A_log per
    head) -> the per-channel log-decay g. Default: -exp(A_log) * softplus(x) (softplus linear above 20); with a lower
    bound: lower_bound * sigmoid(exp(A_log) * x), in (lower_bound, 0)."""
    rate = jnp.exp(a_log)
    if lower_bound is not None:
        return lower_bound * jax.nn.sigmoid(rate * x)
    return -rate * jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (fla's form: eps inside the root, not a max)."""
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, lengths=None):
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if lengths is not None:  # tokens at or past a row's length: no effect on the state, zero output
        live = jnp.arange(k.shape[1])[None, :] < lengths[:, None]
        q, k, v, g = (jnp.where(live[:, :, None, None], x, 0.0) for x in (q, k, v, g))
        beta = jnp.where(live[:, :, None], beta, 0.0)
    batch, _, heads, key_dim = k.shape
    scale = key_dim ** -0.5 if scale is None else scale
    if initial_state is None:
        state = jnp.zeros((batch, heads, key_dim, v.shape[-1]), jnp.float32)
    else:
        state = initial_state.astype(jnp.float32)
    return q * scale, k, v, g, beta, state


def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, lengths=None):
    """Token-by-token recurrence. Returns (o [B, T, H, V] in q.dtype, final state [B, H, K, V] f32 or None).

    `lengths` [B] int32: tokens at or past a row's length leave its state unchanged and give zeros."""
    out_dtype = q.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, lengths)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, K], ..., [B, H]
        s = s * jnp.exp(g_t)[..., None]
        delta = (v_t - jnp.einsum("bhk,bhkv->bhv", k_t, s)) * b_t[..., None]
        s = s + k_t[..., None] * delta[..., None, :]
        return s, jnp.einsum("bhk,bhkv->bhv", q_t, s)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]
    state, o = jax.lax.scan(step, state, time_major)
    o = jnp.moveaxis(o, 0, 1).astype(out_dtype)
    return o, (state if output_final_state else None)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, lengths=None, output_chunk_states=False, chunk_size: int = 64):
    """Chunked form (same results as `fused_recurrent_kda`), scanning over chunks of `chunk_size` tokens.

    Inside a chunk, with G_t the cumulative log-decay from the chunk start and S0 the incoming state:
        (I + A) U = beta * (V - (K * exp(G)) S0),   A[t, s] = beta_t sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c]), s < t
        o_t = (q_t * exp(G_t)) S0 + sum_{s<=t} (q_t . (k_s * exp(G_t - G_s))) u_s
        S_C = exp(G_C) S0 + sum_s (k_s * exp(G_C - G_s)) u_s^T
    Only differences G_t - G_s with s <= t (and G itself) are exponentiated: every exponent is <= 0, so strong
    decays underflow to 0 instead of overflowing.

    `lengths` [B] int32 as in `fused_recurrent_kda`. With `output_chunk_states` a third value is returned: the
    state after each chunk, [B, ceil(T / chunk_size), H, K, V] f32.
    """
    out_dtype = q.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, lengths)
    batch, length, heads, _ = k.shape
    if length == 0:
        empty = jnp.zeros(v.shape, out_dtype), (state if output_final_state else None)
        return (*empty, jnp.zeros((batch, 0, *state.shape[1:]), jnp.float32)) if output_chunk_states else empty
    pad = (-length) % chunk_size
    if pad:  # padded tokens: g = 0 and beta = 0 leave the state unchanged
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v, g = (jnp.pad(x, widths) for x in (q, k, v, g))
        beta = jnp.pad(beta, widths[:3])
    n_chunks = (length + pad) // chunk_size

    def chunked(x):  # [B, T, H, D] -> [N, B, H, C, D]
        x = x.reshape(batch, n_chunks, chunk_size, heads, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

    idx = jnp.arange(chunk_size)
    inclusive = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    eye = jnp.eye(chunk_size, dtype=jnp.float32)

    def step(s, xs):
        q_c, k_c, v_c, g_c, b_c = xs  # [B, H, C, K], ..., [B, H, C]
        cum = jnp.cumsum(g_c, axis=-2)
        diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [B, H, t, s, K]
        decay = jnp.exp(jnp.where(inclusive[:, :, None], diff, -jnp.inf))
        kk = jnp.einsum("bhtk,bhtsk,bhsk->bhts", k_c, decay, k_c)
        a = jnp.where(strict, kk * b_c[..., None], 0.0)
        rhs = b_c[..., None] * (v_c - jnp.einsum("bhtk,bhkv->bhtv", k_c * jnp.exp(cum), s))
        u = jax.lax.linalg.triangular_solve(eye + a, rhs, left_side=True, lower=True, unit_diagonal=True)
        qk = jnp.einsum("bhtk,bhtsk,bhsk->bhts", q_c, decay, k_c)
        o = jnp.einsum("bhtk,bhkv->bhtv", q_c * jnp.exp(cum), s) + jnp.einsum("bhts,bhsv->bhtv", qk, u)
        last = cum[:, :, -1]  # [B, H, K]
        s = jnp.exp(last)[..., None] * s + jnp.einsum(
            "bhsk,bhsv->bhkv", k_c * jnp.exp(last[:, :, None, :] - cum), u)
        return s, (o, s)

    state, (o, states) = jax.lax.scan(step, state,
                                      [chunked(x) for x in (q, k, v, g)] + [chunked(beta[..., None])[..., 0]])
    o = jnp.moveaxis(o, 0, 1)  # [B, N, H, C, V]
    o = jnp.moveaxis(o, 2, 3).reshape(batch, n_chunks * chunk_size, heads, -1)[:, :length]
    result = o.astype(out_dtype), (state if output_final_state else None)
    return (*result, jnp.moveaxis(states, 0, 1)) if output_chunk_states else result


def fused_recurrent_kda_slots(q, k, v, g, beta, state_pool, slots, layer=0, scale=None,
                              use_qk_l2norm_in_kernel=False, lengths=None):
    """Recurrent KDA on states kept in a pool: state_pool [L, S, H, K, V] f32, slots [B] int32 (row b uses
    state_pool[layer, slots[b]]). Returns (o [B, T, H, V], the pool with those slots updated)."""
    o, state = fused_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=state_pool[layer, slots],
                                   output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                   lengths=lengths)
    return o, state_pool.at[layer, slots].set(state)
