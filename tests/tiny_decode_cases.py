"""A random bf16 model with short prompts in its serving cache, ready for a one-token decode step (shared by the CPU
tests that compare two paths of the decoder's step)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def prefilled_decode(cfg, seed: int, batch: int, model=None):
    """A random bf16 model of `cfg` (or `model`, of that config) with `batch` 5-token prompts in its cache ->
    (step, args): `step(*args, decode=True)` is the cached decode step of each prompt's next token (returns (logits,
    cache))."""
    from dayzero.model import Model
    from dayzero.model.cache import init_cache

    model = model or Model.random(cfg, dtype="bfloat16", seed=seed % 1000)
    rng = np.random.default_rng(seed)
    cache = init_cache(cfg, num_blocks=batch + 3, num_slots=batch + 1, dtype=jnp.bfloat16)
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, 5)), jnp.int32)
    tables = jnp.arange(1, batch + 1, dtype=jnp.int32)[:, None]
    rows = jnp.arange(1, batch + 1, dtype=jnp.int32)
    step = lambda *a, **k: model.module.apply({"params": model.params}, *a, method="step", **k)
    positions, valid = jnp.broadcast_to(jnp.arange(5), (batch, 5)), jnp.ones((batch, 5), bool)
    cache = jitted_prefill(model, ids, positions, valid, cache, tables, rows)
    return step, (ids[:, :1], jnp.full((batch, 1), 5), jnp.ones((batch, 1), bool), cache, tables, rows)


def jitted_prefill(model, *step_args):
    """`model`'s step over prompts (`Decoder.step`'s arguments, no decode) under jit -> the cache it fills. One
    compilation, where the eager step compiles each of its ops: about half of a tiny model's prefill time on the CPU;
    tests of one config and batch share it (the module is a static argument, the params are not)."""
    return _prefill(model.module, model.params, *step_args)


@functools.partial(jax.jit, static_argnums=0)
def _prefill(module, params, *step_args):
    return module.apply({"params": params}, *step_args, method="step")[1]


def as_kernels(params):
    """Params of the [out, in] layout (`model.linear.WEIGHT_ROWS` on) -> the same weights in the [in, out] layout
    ("weight" [out, in] of each `linear.ROW_MODULES` projection -> "kernel" [in, out])."""
    from dayzero.model import linear

    if not isinstance(params, dict):
        return params
    out = {}
    for name, value in params.items():
        if name in linear.ROW_MODULES and isinstance(value, dict) and getattr(value.get("weight"), "ndim", 0) == 2:
            value = {("kernel" if k == "weight" else k): (v.T if k == "weight" else v) for k, v in value.items()}
        out[name] = as_kernels(value)
    return out
