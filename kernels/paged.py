"""Paged cache access, plain jnp: writing new tokens into 64-token blocks and gathering a request's tokens back.

A cache array is [layers, num_blocks, block_size, D]; a block table row [max_blocks] lists a request's blocks in
order (block 0 is the engine's scratch block: padding rows and padded tokens write there and nothing reads it back).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write(cache: jax.Array, layer: int, block_tables: jax.Array, positions: jax.Array, valid: jax.Array,
          values: jax.Array) -> jax.Array:
    """Stores values [B, T, D] at token positions [B, T] of `layer`; invalid tokens go to the scratch block 0."""
    block_size = cache.shape[2]
    blocks = jnp.take_along_axis(block_tables, positions // block_size, axis=1)
    blocks = jnp.where(valid, blocks, 0)
    offsets = jnp.where(valid, positions % block_size, 0)
    return cache.at[layer, blocks, offsets].set(values.astype(cache.dtype))


def gather(cache: jax.Array, layer: int, block_tables: jax.Array) -> jax.Array:
    """[B, max_blocks * block_size, D]: the tokens of each request's blocks, in position order."""
    tokens = cache[layer, block_tables]  # [B, max_blocks, block_size, D]
    return tokens.reshape(tokens.shape[0], -1, tokens.shape[-1])
