"""Paged cache access: writing new tokens into 64-token blocks and gathering a request's tokens back.

A cache array is [layers, num_blocks, block_size, D]; a block table row [max_blocks] lists a request's blocks in
order (block 0 is the engine's scratch block: padding rows and padded tokens write there and nothing reads it back).
`write` dispatches between the plain-jnp reference and the Pallas write kernels (`paged_pallas`), optionally
normalizing each row's leading features on the way (`LeadingNorm`: MLA's latent norm at decode); `contiguous`
views whole sequences [B, S, D] as a one-layer paged cache, so every paged kernel also serves contiguous inputs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from . import dispatch, paged_pallas, projection

# Whether this op's Pallas kernels have passed tests/gpu/test_sparse_attention_gpu.py on a GPU (H200, jax 0.11.2:
# 13/13 on 2026-11-30). Until a kernel has, dispatch runs it on CUDA/ROCm only when asked for (impl= or DAYZERO_KERNELS).
GPU_VERIFIED = True

# Whether CUDA runs a `LeadingNorm` inside the decode write kernel (else the norm runs in XLA before it):
# tests/gpu/test_mla_absorb_gpu.py's latent-write case passes on the H200 (2026-12-03); the medium hybrid's batch-1
# decode measured the same 1.020 ms per token with it, in 4 kernels fewer (decode_profile.py, nineteenth session).
NORM_GPU_VERIFIED = True

BLOCK_SIZE = 64


@functools.partial(jax.tree_util.register_dataclass, data_fields=["weight"], meta_fields=["width", "eps"])
@dataclass(frozen=True)
class LeadingNorm:
    """An RMSNorm over each value row's first `width` features (weight [width]), as `model.norms.RMSNorm` computes it
    (statistics in float32, x / rms rounded to the values' dtype, times the weight, rounded again); the features
    after them are written unchanged."""

    weight: jax.Array
    width: int
    eps: float

    def apply(self, values: jax.Array) -> jax.Array:
        """values [..., D] -> the same with the first `width` features normalized."""
        lead = projection.rms_norm(values[..., :self.width], self.weight, self.eps)
        return jnp.concatenate([lead, values[..., self.width:]], axis=-1)


def write_reference(cache: jax.Array, layer: int, block_tables: jax.Array, positions: jax.Array, valid: jax.Array,
                    values: jax.Array) -> jax.Array:
    """Stores values [B, T, D] at token positions [B, T] of `layer`; invalid tokens go to the scratch block 0."""
    block_size = cache.shape[2]
    blocks = jnp.take_along_axis(block_tables, jnp.where(valid, positions, 0) // block_size, axis=1)
    blocks = jnp.where(valid, blocks, 0)
    offsets = jnp.where(valid, positions % block_size, 0)
    return cache.at[layer, blocks, offsets].set(values.astype(cache.dtype))


def _choice(norm: LeadingNorm | None, impl: str | None) -> tuple[str, bool]:
    """(the write's implementation, whether a Pallas kernel writes the values as given: no norm, or the norm inside
    the decode kernel)."""
    choice = dispatch.choose("paged_write", ("reference", "pallas"), impl, gpu_verified=GPU_VERIFIED)
    norm_outside = norm is not None and choice == "pallas" and not NORM_GPU_VERIFIED
    return choice, choice != "reference" and not norm_outside


def decode_kernel_kind(norm: LeadingNorm | None = None, impl: str | None = None) -> str | None:
    """"pallas" / "interpret" where `write` runs one token per request through the Pallas decode kernel with this
    `norm` inside it (so another kernel may do that write in its place: `paged_pallas.DecodeRows`), else None."""
    choice, in_kernel = _choice(norm, impl)
    return choice if in_kernel else None


def write(cache: jax.Array, layer: int, block_tables: jax.Array, positions: jax.Array, valid: jax.Array,
          values: jax.Array | projection.Partials, impl: str | None = None,
          norm: LeadingNorm | None = None) -> jax.Array:
    """`write_reference`'s contract; on CUDA/ROCm the Pallas kernels (one token per request: the decode kernel).
    `norm`: the rows' leading features normalized first (in the decode kernel where it runs: `NORM_GPU_VERIFIED`
    on CUDA, or interpret mode). values may be a projection's `projection.Partials` of one token per request
    (sums [S, B, D]): the decode kernel finishes them as it loads them, else XLA first (`projection.finished`)."""
    choice, in_kernel = _choice(norm, impl)
    if isinstance(values, projection.Partials) and not in_kernel:
        values = projection.finished(values)[:, None]
    if norm is not None and (not in_kernel or (not isinstance(values, projection.Partials) and values.shape[1] != 1)):
        values, norm = norm.apply(values), None
    if choice == "reference":
        return write_reference(cache, layer, block_tables, positions, valid, values)
    return paged_pallas.write(cache, layer, block_tables, positions, valid, values, interpret=choice == "interpret",
                              norm=norm)


def gather(cache: jax.Array, layer: int, block_tables: jax.Array) -> jax.Array:
    """[B, max_blocks * block_size, D]: the tokens of each request's blocks, in position order."""
    tokens = cache[layer, block_tables]  # [B, max_blocks, block_size, D]
    return tokens.reshape(tokens.shape[0], -1, tokens.shape[-1])


def contiguous(x: jax.Array, block_size: int = BLOCK_SIZE) -> tuple[jax.Array, jax.Array]:
    """x [B, S, ...] -> (cache [1, B * nb, block_size, ...], block_tables [B, nb] int32) with token s of row b at
    position s (S padded with zeros to nb * block_size)."""
    batch, length = x.shape[:2]
    n_blocks = -(-length // block_size)
    x = jnp.pad(x, [(0, 0), (0, n_blocks * block_size - length)] + [(0, 0)] * (x.ndim - 2))
    cache = x.reshape(1, batch * n_blocks, block_size, *x.shape[2:])
    return cache, jnp.arange(batch * n_blocks, dtype=jnp.int32).reshape(batch, n_blocks)
