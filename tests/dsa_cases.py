"""A DSA model's full forward against its cached decode through the paged cache, with each layer's top-k selections
(`Indexer.select` sows them as "index_selection" in the "intermediates" collection)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.model import Model
from dayzero.model.cache import init_cache


def index_selections(state: dict) -> list[np.ndarray]:
    """Each DSA layer's top-k key positions [B, T, k] int32, sorted along k, in layer order, from one apply's mutable
    "intermediates"."""
    found = state["intermediates"]
    layers = sorted((k for k in found if k.startswith("layers_")), key=lambda k: int(k.split("_")[1]))
    return [np.sort(np.asarray(found[k]["self_attn"]["indexer"]["index_selection"][0]), axis=-1) for k in layers]


def full_and_cached(model: Model, seq, prompt: int, tables):
    """seq [B, T] through the full forward, and through `step`: a prefill of its first `prompt` tokens, then one token
    per decode step at its position, in the paged cache's blocks `tables` [B, n] (block 0 unused).
    -> (full logits, cached logits) [B, T - prompt, V] float, predicting tokens prompt..T-1, and each DSA layer's
    selections of both runs (`index_selections`, [B, T - 1, k]: tokens 0..T-2)."""
    module = model.module
    seq, tables = jnp.asarray(seq, jnp.int32), jnp.asarray(tables, jnp.int32)
    batch, total = seq.shape
    full, state = jax.jit(lambda p, ids: module.apply({"params": p}, ids, mutable=["intermediates"]))(
        model.params, seq)

    def step(decode):
        return jax.jit(lambda p, cache, tok, pos: module.apply(
            {"params": p}, tok, pos, jnp.ones(tok.shape, bool), cache, tables, jnp.zeros((batch,), jnp.int32),
            decode, method="step", mutable=["intermediates"]))

    prefill, decode = step(False), step(True)
    cache = init_cache(model.config, num_blocks=int(jnp.max(tables)) + 1, num_slots=1, dtype=model.dtype)
    (logits, cache), chosen = prefill(model.params, cache, seq[:, :prompt],
                                      jnp.broadcast_to(jnp.arange(prompt), (batch, prompt)))
    cached, cached_sel = [logits], [index_selections(chosen)]
    for t in range(prompt, total - 1):
        (logits, cache), chosen = decode(model.params, cache, seq[:, t:t + 1], jnp.full((batch, 1), t))
        cached.append(logits)
        cached_sel.append(index_selections(chosen))
    full_sel = [layer[:, :total - 1] for layer in index_selections(state)]
    cached_sel = [np.concatenate(layer, axis=1) for layer in zip(*cached_sel)]
    return (np.asarray(full)[:, prompt - 1:-1], np.stack([np.asarray(c) for c in cached], 1), full_sel,
            cached_sel)


def first_flip(full_sel: list[np.ndarray], cached_sel: list[np.ndarray]) -> tuple[int, int] | None:
    """(token, layer) of the earliest token whose selection differs between two runs in any layer (the lowest such
    layer), or None when every selection agrees."""
    differs = np.stack([np.any(a != b, axis=(0, 2)) for a, b in zip(full_sel, cached_sel, strict=True)])  # [L, T]
    if not differs.any():
        return None
    token = int(np.flatnonzero(differs.any(axis=0))[0])
    return token, int(np.flatnonzero(differs[:, token])[0])
