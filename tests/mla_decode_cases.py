"""A one-MLA-layer tiny model with two sequences of 5 tokens in its serving cache, ready for a one-token decode step
(shared by the tests of the MLA decode kernels)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tiny_decode_cases import jitted_prefill


def prefilled_mla_layer(seed: int, **config):
    """-> (step, decode_args): `step(*decode_args, decode=True)` is the model's cached decode step of one token per
    sequence (returns (logits, cache)). `config`: `ModelConfig` fields over the tiny one-MLA-layer preset."""
    from dayzero.model import Model
    from dayzero.model.cache import init_cache
    from dayzero.model.config import LAYER_MLA, MLP_DENSE
    from dayzero.model.presets import tiny

    cfg = tiny().replace(num_layers=1, layer_types=(LAYER_MLA,), mlp_types=(MLP_DENSE,), index_topk=0,
                         qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, **config)
    rng = np.random.default_rng(seed)
    model = Model.random(cfg, dtype="bfloat16", seed=seed % 1000)
    cache = init_cache(cfg, num_blocks=4, num_slots=3, dtype=jnp.bfloat16)
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 5)), jnp.int32)
    tables, slots = jnp.asarray([[1], [2]], jnp.int32), jnp.asarray([1, 2], jnp.int32)
    step = lambda *a, **k: model.module.apply({"params": model.params}, *a, method="step", **k)
    cache = jitted_prefill(model, ids, jnp.broadcast_to(jnp.arange(5), (2, 5)), jnp.ones((2, 5), bool), cache, tables,
                           slots)
    return step, (ids[:, :1], jnp.full((2, 1), 5), jnp.ones((2, 1), bool), cache, tables, slots)


def spy_unfinished_consumers(monkeypatch) -> list[str]:
    """Wraps `kernels.mla_absorb.absorb_queries` and `kernels.paged_pallas.write` to record the type name of what each
    call gets as its queries / values, the absorb kernel's latent rows too where it writes them
    (`model.mla.LATENT_WRITE_IN_ABSORB`) ("Partials" where `model.mla.PROJECTION_PARTIALS` hands the projection's
    sums over unfinished); returns the list they append to."""
    from dayzero.kernels import mla_absorb, paged_pallas

    given = []
    absorb, write = mla_absorb.absorb_queries, paged_pallas.write

    def spied_absorb(q, *a, **k):  # the latent rows too, where the absorb kernel writes them
        given.append(type(q).__name__)
        if k.get("latent_write") is not None:
            given.append(type(k["latent_write"].values).__name__)
        return absorb(q, *a, **k)

    monkeypatch.setattr(mla_absorb, "absorb_queries", spied_absorb)
    monkeypatch.setattr(paged_pallas, "write", lambda *a, **k: given.append(type(a[5]).__name__) or write(*a, **k))
    return given
