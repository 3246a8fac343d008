"""Masked attention, plain jnp: over expanded keys/values (MLA prefill) and over cached latents in absorbed form; and
`sparse_mla`, attention over each query's selected tokens of the paged latent cache, dispatching between its
reference here and the Pallas kernels of `sparse_mla`. Softmax in float32; probabilities cast back to the query
dtype before the value product, as transformers does; fully masked rows give zeros."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import dispatch, paged, tiles
from . import sparse_mla as sparse_mla_pallas
from .indexer import indices_to_mask
from .sparse_mla import SparseMLAConfig, SplitLatents

# Whether this op's Pallas kernels have passed tests/gpu/test_sparse_attention_gpu.py on a GPU (H200, jax 0.11.2:
# 13/13 on 2026-11-30). Until a kernel has, dispatch runs it on CUDA/ROCm only when asked for (impl= or DAYZERO_KERNELS).
GPU_VERIFIED = True


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
    # Operands go up to float32 (exact for 16-bit inputs, so the same products and float32 sums as a mixed-precision
    # dot; XLA:CPU lacks some bf16 x bf16 -> f32 dots).
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    lat = latents.astype(f32)
    logits = (jnp.einsum("bthr,bsr->bhts", q_latent.astype(f32), lat, precision=hi)
              + jnp.einsum("bthe,bse->bhts", q_rope.astype(f32), k_rope.astype(f32), precision=hi)) * scale
    p = masked_softmax(logits, mask, q_latent.dtype).astype(f32)
    return jnp.einsum("bhts,bsr->bthr", p, lat, precision=hi).astype(q_latent.dtype)


def sparse_mla_reference(q_latent, q_rope, cache, layer, block_tables, query_positions, indices, scale):
    """Plain jnp: gather the request's latents, mask to the selected causal keys, `latent_attention`."""
    context = paged.gather(cache, layer, block_tables)
    rank = q_latent.shape[-1]
    mask = jnp.arange(context.shape[1]) <= query_positions[..., None]
    if indices is not None:
        mask = mask & indices_to_mask(indices, context.shape[1])
    return latent_attention(q_latent, q_rope.astype(q_latent.dtype), context[..., :rank].astype(q_latent.dtype),
                            context[..., rank:].astype(q_latent.dtype), mask, scale)


def sparse_mla(q_latent: jax.Array, q_rope: jax.Array, cache: jax.Array, layer: int, block_tables: jax.Array,
               query_positions: jax.Array, indices: jax.Array | None, scale: float, impl: str | None = None,
               config: SparseMLAConfig = SparseMLAConfig(), merge: bool = True) -> jax.Array | SplitLatents:
    """Absorbed MLA over each query's selected tokens of the paged latent cache.

    q_latent [B, T, H, R] (q_nope with W_UK folded in), q_rope [B, T, H, E], cache [L, N, block, R + E] read at
    `layer` through block_tables [B, max_blocks] (key s of row b is position s), query_positions [B, T] int (-1: a
    padding token, output zeros), indices [B, T, K] int32 key positions (-1 = none; the DSA selection) or None
    (every key at or before the query position: dense MLA) -> latent outputs [B, T, H, R] in q_latent.dtype.
    `merge` False (one token per request): where the split decode kernel runs, its splits unmerged (`SplitLatents`
    over the B rows, for `mla_absorb.up_project`); elsewhere the merged outputs as above.
    """
    choice = dispatch.choose("sparse_mla", ("reference", "pallas"), impl, gpu_verified=GPU_VERIFIED)
    if choice == "pallas" and not tiles.dots_fit(q_latent.shape[-1], q_rope.shape[-1]):
        choice = "reference"  # Triton dots need >= 16-wide segments (tiny test models run the reference on GPUs)
    if choice == "reference":
        return sparse_mla_reference(q_latent, q_rope, cache, layer, block_tables, query_positions, indices, scale)
    merge = merge or q_latent.shape[1] != 1 or config.decode_variant != "fused"
    return sparse_mla_pallas.sparse_mla(q_latent, q_rope, cache, layer, block_tables, query_positions, indices, scale,
                                        config=config, interpret=choice == "interpret", merge=merge)
