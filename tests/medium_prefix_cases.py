"""The medium hybrid's first layers (random bf16 weights) with one prompt in their serving cache, ready for a one-token
decode step (shared by the GPU tests that compare a decode kernel inside the model against the path without it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def medium_prefix_config(num_layers: int = 4, mxfp4: bool = False):
    """`medium_hybrid`'s first `num_layers` layers (`mxfp4`: its routed experts MXFP4)."""
    from dayzero.model.presets import medium_hybrid

    full = medium_hybrid()
    return full.replace(num_layers=num_layers, layer_types=full.layer_types[:num_layers],
                        mlp_types=full.mlp_types[:num_layers], quant_method="mxfp4" if mxfp4 else None)


def prefilled_medium_prefix(prompt_len: int, num_blocks: int, num_layers: int = 4, batch: int = 1,
                            mxfp4: bool = False, model=None):
    """-> (run, decode_args): `run(*decode_args, decode=True)` is the cached decode step of the prompts' next tokens
    (returns (logits, cache)), jitted anew at each call, so the dispatch choices in force when it is called are the
    ones it traces with. `batch` prompts (`prompt_len` random tokens each, seed 0) fill the first blocks of a cache
    of `num_blocks` blocks (at least `batch` times the blocks of one), one KDA slot each; the model is a random one
    of `medium_prefix_config(num_layers, mxfp4)`, or `model`."""
    from dayzero.kernels.paged import BLOCK_SIZE
    from dayzero.model import Model
    from dayzero.model.cache import init_cache

    model = model or Model.random(medium_prefix_config(num_layers, mxfp4), dtype="bfloat16", seed=0)
    cfg = model.config
    cache = init_cache(cfg, num_blocks=num_blocks, num_slots=batch + 1, dtype=jnp.bfloat16)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
    blocks = -(-(prompt_len + 1) // BLOCK_SIZE)  # the prompt and the decoded token
    if num_blocks < batch * blocks + 1:
        raise ValueError(f"{num_blocks} blocks for {batch} prompts of {blocks} blocks (and the scratch block 0)")
    tables = jnp.arange(1, batch * blocks + 1, dtype=jnp.int32).reshape(batch, blocks)
    rows = jnp.arange(1, batch + 1, dtype=jnp.int32)
    run = lambda *a, **k: jax.jit(lambda p, *a: model.module.apply({"params": p}, *a, method="step", **k))(
        model.params, *a)
    positions = jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len))
    _, cache = run(ids, positions, jnp.ones((batch, prompt_len), bool), cache, tables, rows)
    return run, (ids[:, :1], jnp.full((batch, 1), prompt_len), jnp.ones((batch, 1), bool), cache, tables, rows)


def decode_off_and_on(monkeypatch, run, args, module, constant: str, values: tuple, took) -> list:
    """The decode step `run(*args, decode=True)` with `module.constant` at values[0], then at values[1], while each
    call of the MXFP4 decode kernels (`moe_mxfp4_gemv.grouped_swiglu`) records `took(its keyword arguments)`:
    asserts that no call took the path the constant turns on with the first value, and every call with the second
    -> [(logits, cache) with the first, with the second]."""
    from dayzero.kernels import moe_mxfp4_gemv

    given, experts = [], moe_mxfp4_gemv.grouped_swiglu
    monkeypatch.setattr(moe_mxfp4_gemv, "grouped_swiglu",
                        lambda *a, **k: given.append(bool(took(k))) or experts(*a, **k))
    runs = []
    for value, taken in zip(values, (False, True)):
        given.clear()
        monkeypatch.setattr(module, constant, value)
        runs.append(run(*args, decode=True))
        assert given and all(g is taken for g in given), (constant, value, given)
    return runs


def logits_change(changed, plain) -> float:
    """||changed - plain|| / ||plain|| of two steps' logits, asserting the changed ones finite."""
    a, b = np.asarray(changed, np.float64), np.asarray(plain, np.float64)
    assert np.all(np.isfinite(a))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
