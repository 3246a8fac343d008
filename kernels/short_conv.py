"""Short causal depthwise convolution (the KDA layer's q/k/v conv), plain jnp.

y[t, c] = act(sum_j w[c, j] * x[t - (W - 1) + j, c]), with the W - 1 tokens before the sequence taken from
`initial_state` (zeros when absent). The returned state is the last W - 1 inputs, channel-major [B, C, W - 1].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv1d(x: jax.Array, weight: jax.Array, initial_state: jax.Array | None = None,
                  activation: str | None = "silu", lengths: jax.Array | None = None,
                  compute_dtype=None) -> tuple[jax.Array, jax.Array]:
    """x [B, T, C], weight [C, W] -> (y [B, T, C] in x.dtype, final state [B, C, W - 1] in x.dtype).

    `lengths` [B] (valid tokens per row, the rest padding at the end) makes the state the last W - 1 inputs
    before each row's padding; by default every token is valid. `compute_dtype` (default x.dtype): the dtype of the
    products, sums and activation, rounded to x.dtype once at the end.
    """
    batch, length, channels = x.shape
    width = weight.shape[-1]
    if initial_state is None:
        history = jnp.zeros((batch, width - 1, channels), x.dtype)
    else:
        history = jnp.swapaxes(initial_state, 1, 2).astype(x.dtype)
    padded = jnp.concatenate([history, x], axis=1)  # [B, W - 1 + T, C]
    compute = padded.astype(compute_dtype or x.dtype)
    w = weight.astype(compute.dtype)
    y = sum(compute[:, j:j + length, :] * w[:, j] for j in range(width))
    if activation == "silu":
        y = jax.nn.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    if lengths is None:
        state = padded[:, padded.shape[1] - (width - 1):, :]
    else:  # padded index of the last W - 1 valid inputs: lengths .. lengths + W - 2
        index = lengths[:, None] + jnp.arange(width - 1)[None, :]
        state = jnp.take_along_axis(padded, index[:, :, None], axis=1)
    state = jnp.swapaxes(state, 1, 2)
    return y.astype(x.dtype), state
