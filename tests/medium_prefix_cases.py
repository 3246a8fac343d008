"""The medium hybrid's first layers (random bf16 weights) with one prompt in their serving cache, ready for a one-token
decode step (shared by the GPU tests that compare a decode kernel inside the model against the path without it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def prefilled_medium_prefix(prompt_len: int, num_blocks: int, num_layers: int = 4):
    """-> (run, decode_args): `run(*decode_args, decode=True)` is the cached decode step of the prompt's next token
    (returns (logits, cache)), jitted anew at each call, so the dispatch choices in force when it is called are the
    ones it traces with. The prompt (`prompt_len` random tokens, seed 0) fills the first blocks of a cache of
    `num_blocks` blocks; the model is `medium_hybrid`'s first `num_layers` layers."""
    from dayzero.kernels.paged import BLOCK_SIZE
    from dayzero.model import Model
    from dayzero.model.cache import init_cache
    from dayzero.model.presets import medium_hybrid

    full = medium_hybrid()
    cfg = full.replace(num_layers=num_layers, layer_types=full.layer_types[:num_layers],
                       mlp_types=full.mlp_types[:num_layers])
    model = Model.random(cfg, dtype="bfloat16", seed=0)
    cache = init_cache(cfg, num_blocks=num_blocks, num_slots=2, dtype=jnp.bfloat16)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (1, prompt_len)), jnp.int32)
    blocks = -(-(prompt_len + 1) // BLOCK_SIZE)  # the prompt and the decoded token
    tables, rows = jnp.arange(1, blocks + 1, dtype=jnp.int32)[None], jnp.asarray([1], jnp.int32)
    run = lambda *a, **k: jax.jit(lambda p, *a: model.module.apply({"params": p}, *a, method="step", **k))(
        model.params, *a)
    _, cache = run(ids, jnp.arange(prompt_len)[None], jnp.ones((1, prompt_len), bool), cache, tables, rows)
    return run, (ids[:, :1], jnp.full((1, 1), prompt_len), jnp.ones((1, 1), bool), cache, tables, rows)
