"""Serving cache layouts (allocated by `dayzero.serving`, read and written by `Decoder.step`).

- "latent": [mla_layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (MLA latent + shared rope key)
- "index_keys": [mla_layers, num_blocks, block_size, index_head_dim] (DSA models only; float8_e4m3fn with the FP8
  indexer, whose per-token power-of-two scales sit in "index_scales": [mla_layers, num_blocks, block_size, 1] float32)
- "conv": [kda_layers, num_slots, 3, kda_dim, conv_size - 1] (q/k/v short-conv states)
- "state": [kda_layers, num_slots, H, K, V] float32 (KDA recurrent states)
- "kda_turns": [kda_layers, TURN_ROWS, H] int32, all zero between steps: the counters with which the one-kernel KDA
  decode step finds each head's last block (`kernels.kda.decode_layer.decode_step(turns=)`), for steps of at most
  TURN_ROWS rows (larger steps do without)
- "moe_turns": [num_layers, 1] int32, all zero between steps: per layer, the counter with which the MoE front kernel
  finds its last program when it also makes the router's choice (`kernels.moe_front.front(select=)`)
Block 0 and slot 0 are scratch: padding writes there and nothing reads them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dayzero.kernels.kda import decode_layer

from .config import LAYER_KDA, LAYER_MLA, MLP_MOE, ModelConfig

BLOCK_SIZE = 64
TURN_ROWS = decode_layer.VALUE_SPLIT_MAX_ROWS  # the largest decode step split over value blocks


def cache_shapes(config: ModelConfig, num_blocks: int, num_slots: int, dtype,
                 block_size: int = BLOCK_SIZE) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
    """{name: (shape, dtype)} of every cache array."""
    n_mla = config.layer_types.count(LAYER_MLA)
    n_kda = config.layer_types.count(LAYER_KDA)
    shapes = {}
    if n_mla:
        shapes["latent"] = ((n_mla, num_blocks, block_size, config.kv_lora_rank + config.qk_rope_head_dim), dtype)
        if config.use_dsa:
            key_dtype = jnp.float8_e4m3fn if config.index_fp8 else dtype
            shapes["index_keys"] = ((n_mla, num_blocks, block_size, config.index_head_dim), key_dtype)
            if config.index_fp8:
                shapes["index_scales"] = ((n_mla, num_blocks, block_size, 1), jnp.float32)
    if n_kda:
        shapes["conv"] = ((n_kda, num_slots, 3, config.kda_dim, config.kda_conv_size - 1), dtype)
        shapes["state"] = ((n_kda, num_slots, config.kda_num_heads, config.kda_head_dim, config.kda_head_dim),
                           jnp.float32)
        shapes["kda_turns"] = ((n_kda, TURN_ROWS, config.kda_num_heads), jnp.int32)
    if MLP_MOE in config.mlp_types:
        shapes["moe_turns"] = ((config.num_layers, 1), jnp.int32)
    return shapes


def init_cache(config: ModelConfig, num_blocks: int, num_slots: int, dtype, block_size: int = BLOCK_SIZE):
    """Zeroed cache arrays (see the module docstring)."""
    return {name: jnp.zeros(shape, dt) for name, (shape, dt) in
            cache_shapes(config, num_blocks, num_slots, dtype, block_size).items()}


def bytes_per_block(config: ModelConfig, dtype, block_size: int = BLOCK_SIZE) -> int:
    """Cache bytes one 64-token block costs across all MLA layers (latents + indexer keys)."""
    return sum(int(np.prod(s[0][2:])) * jnp.dtype(s[1]).itemsize * s[0][0]
               for k, s in cache_shapes(config, 1, 1, dtype, block_size).items()
               if k in ("latent", "index_keys", "index_scales"))


def bytes_per_slot(config: ModelConfig, dtype) -> int:
    """KDA state bytes one request slot costs across all KDA layers (conv + recurrent)."""
    return sum(int(np.prod(s[0][2:])) * jnp.dtype(s[1]).itemsize * s[0][0]
               for k, s in cache_shapes(config, 1, 1, dtype).items() if k in ("conv", "state"))
