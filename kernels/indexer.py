"""DeepSeek Sparse Attention's lightning indexer: scores and top-k selection.

score[b, t, s] = sum_h w[b, t, h] * relu(scale * q[b, t, h] . k[b, s]); each query keeps the `topk` highest-scoring
keys among those it may attend to (causal: key position <= query position). Ties go to the lower key position.

`indexer_topk` reads keys from a paged cache through block tables (a contiguous sequence is a paged cache too:
`paged.contiguous`) and dispatches between the plain-jnp reference here and the Pallas kernels of
`indexer_pallas`. In FP8 mode (`fp8_indexer`) q and the keys are e4m3 with per-vector scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import dispatch, indexer_pallas, paged, tiles, topk as topk_lib
from .fp8_indexer import dequantize
from .indexer_pallas import IndexerKernelConfig

# Whether this op's Pallas kernels have passed tests/gpu/test_sparse_attention_gpu.py on a GPU (H200, jax 0.11.2:
# 13/13 on 2026-11-30). Until a kernel has, dispatch runs it on CUDA/ROCm only when asked for (impl= or DAYZERO_KERNELS).
GPU_VERIFIED = True


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


def indices_to_mask(indices: jax.Array, num_keys: int) -> jax.Array:
    """indices [B, T, K] int (-1 = none) -> [B, T, num_keys] bool."""
    hits = indices[..., None] == jnp.arange(num_keys)
    return jnp.any(hits & (indices[..., None] >= 0), axis=-2)


def select_all(query_positions: jax.Array, num_keys: int, topk: int) -> jax.Array:
    """Every key a query may attend to, as indices [B, T, topk] (-1 padded): the selection when num_keys <= topk."""
    idx = jnp.arange(topk, dtype=jnp.int32)
    ok = (idx < num_keys) & (idx <= query_positions[..., None])
    return jnp.where(ok, idx, -1)


def indexer_topk_reference(q, weights, query_positions, key_cache, layer, block_tables, topk: int, scale: float,
                           q_scales=None, key_scales=None) -> jax.Array:
    """Plain jnp: gather the keys, score, mask causally, `lax.top_k`. See `indexer_topk` for the contract."""
    keys = paged.gather(key_cache, layer, block_tables)
    if key_scales is not None:
        keys = dequantize(keys, paged.gather(key_scales, layer, block_tables)[..., 0])
        q = dequantize(q, q_scales)
    scores = index_scores(q, keys, weights, scale)
    allowed = jnp.arange(keys.shape[1]) <= query_positions[..., None]
    return topk_lib.one_level(jnp.where(allowed, scores, -jnp.inf).reshape(-1, keys.shape[1]), topk).reshape(
        *query_positions.shape, topk)


def indexer_topk(q: jax.Array, weights: jax.Array, query_positions: jax.Array, key_cache: jax.Array, layer: int,
                 block_tables: jax.Array, topk: int, scale: float, q_scales: jax.Array | None = None,
                 key_scales: jax.Array | None = None, impl: str | None = None,
                 config: IndexerKernelConfig = IndexerKernelConfig()) -> jax.Array:
    """The `topk` best keys of each query -> indices [B, T, topk] int32 (key positions, -1 where fewer are allowed).

    q [B, T, H, D]; weights [B, T, H] float32 (weights_proj output times H**-0.5); query_positions [B, T] int
    (-1: a padding token that selects nothing); key_cache [L, N, block, D] read at `layer` through block_tables
    [B, max_blocks] (key s of row b is position s); scale the softmax scale (D**-0.5). FP8 mode: q and key_cache
    are e4m3, q_scales [B, T, H] and key_scales [L, N, block, 1] float32 their power-of-two scales.
    """
    num_keys = block_tables.shape[1] * key_cache.shape[2]
    if num_keys <= topk:
        return select_all(query_positions, num_keys, topk)
    choice = dispatch.choose("indexer", ("reference", "pallas"), impl, gpu_verified=GPU_VERIFIED)
    if choice == "pallas" and not tiles.dots_fit(q.shape[-1]):
        choice = "reference"  # Triton dots need >= 16-wide segments (tiny test models run the reference on GPUs)
    if choice == "reference":
        return indexer_topk_reference(q, weights, query_positions, key_cache, layer, block_tables, topk, scale,
                                      q_scales, key_scales)
    weights = weights.astype(jnp.float32) * scale
    if q_scales is not None:
        weights = weights * q_scales
    return indexer_pallas.indexer_topk(q, weights, query_positions, key_cache, layer, block_tables, topk,
                                       key_scales=key_scales, config=config, interpret=choice == "interpret")
