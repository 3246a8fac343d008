"""A DSA model's full forward against its cached decode through the paged cache, with each layer's top-k selections
(`Indexer.select` sows them as "index_selection" in the "intermediates" collection)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tiny_checkpoints import relative_error
from dayzero.model import Model
from dayzero.model.cache import init_cache
from dayzero.model.config import LAYER_MLA, MLP_DENSE, MLP_MOE, ModelConfig, RopeConfig
from dayzero.model.drift import index_selections


def kernel_sized_dsa_config() -> ModelConfig:
    """A small deepseek_v32-like config whose dims the Triton kernels take (every dot dimension >= 16)."""
    return ModelConfig(
        model_type="deepseek_v32", vocab_size=256, hidden_size=128, num_layers=2, layer_types=(LAYER_MLA,) * 2,
        mlp_types=(MLP_DENSE, MLP_MOE), intermediate_size=256, num_heads=16, q_lora_rank=64, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope=RopeConfig(theta=10000.0),
        index_n_heads=16, index_head_dim=32, index_topk=48, num_experts=4, num_experts_per_token=2,
        moe_intermediate_size=64, num_shared_experts=1, max_position_embeddings=1024)


def full_forward(model: Model, seq) -> tuple[jax.Array, list[np.ndarray]]:
    """seq [B, T] through the whole-sequence forward -> (logits [B, T, V], each DSA layer's selections [B, T, k],
    `drift.index_selections`)."""
    logits, state = jax.jit(lambda p, ids: model.module.apply({"params": p}, ids, mutable=["intermediates"]))(
        model.params, jnp.asarray(seq, jnp.int32))
    return logits, index_selections(state["intermediates"])


def full_and_cached(model: Model, seq, prompt: int, tables, decode_shift: int = 0):
    """seq [B, T] through the full forward, and through `step`: a prefill of its first `prompt` tokens, then one token
    per decode step at its position, in the paged cache's blocks `tables` [B, n] (block 0 unused).
    -> (full logits, cached logits) [B, T - prompt, V] float, predicting tokens prompt..T-1, and each DSA layer's
    selections of both runs ([B, T - 1, k]: tokens 0..T-2). `decode_shift` != 0 plants a bug for the checker's own
    test: each decode token is written and read that many positions late."""
    module = model.module
    seq, tables = jnp.asarray(seq, jnp.int32), jnp.asarray(tables, jnp.int32)
    batch, total = seq.shape
    full, full_sel = full_forward(model, seq)

    def step(decode):
        return jax.jit(lambda p, cache, tok, pos: module.apply(
            {"params": p}, tok, pos, jnp.ones(tok.shape, bool), cache, tables, jnp.zeros((batch,), jnp.int32),
            decode, method="step", mutable=["intermediates"]))

    prefill, decode = step(False), step(True)
    cache = init_cache(model.config, num_blocks=int(np.max(tables)) + 1, num_slots=1, dtype=model.dtype)
    (logits, cache), state = prefill(model.params, cache, seq[:, :prompt],
                                     jnp.broadcast_to(jnp.arange(prompt), (batch, prompt)))
    cached, cached_sel = [logits], [index_selections(state["intermediates"])]
    for t in range(prompt, total - 1):
        (logits, cache), state = decode(model.params, cache, seq[:, t:t + 1], jnp.full((batch, 1), t + decode_shift))
        cached.append(logits)
        cached_sel.append(index_selections(state["intermediates"]))
    full_sel = [layer[:, :total - 1] for layer in full_sel]
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


def assert_cached_matches_full(full, cached, full_sel, cached_sel, prompt: int, seed: int, bound: float = 1e-4,
                               flipped_bound: float = 0.25):
    """The cached decode equals the full forward (`full_and_cached`'s outputs) up to top-k flips.

    Where both runs select the same keys for every token, the logits agree to `bound`. A near-tie in the top k can
    flip between the runs, which compute their inputs with different kernels (a one-ulp difference can flip an e4m3
    rounding of the FP8 indexer's queries or keys): a flipped key at token t moves the logits from position t on, and
    nothing before it, since attention is causal. So the logits must agree to `bound` before the first flip, that
    flip must be a near-tie (each batch row differs in at most two keys there), and no position may move by
    `flipped_bound` or more. (On the CPU, one-ulp weight noise flipped keys that moved the logits by 0.004 and 0.04;
    decode tokens written and read one position late swapped 3-11 keys in the worse row at the first decode token,
    over 28 seeds at `kernel_sized_dsa_config`, and moved the logits by 0.18-0.44.)"""
    flip = first_flip(full_sel, cached_sel)
    compared = full.shape[1] if flip is None else max(flip[0] - (prompt - 1), 0)  # logit j is at position prompt-1+j
    errors = np.array([relative_error(cached[:, p], full[:, p]) for p in range(full.shape[1])])
    over = np.flatnonzero(errors[:compared] >= bound)
    where = (f"seed {seed}: first selection flip at (token, layer) {flip}; {len(over)} of {compared} positions "
             f"before it over {bound:g} (at {over.tolist()[:8]}; worst {errors.max():.2e} at {int(errors.argmax())})")
    assert len(over) == 0, where
    if flip is not None:
        token, layer = flip
        a, b = full_sel[layer][:, token], cached_sel[layer][:, token]
        swapped = [len(np.setdiff1d(x, y)) for x, y in zip(a, b)]
        assert max(swapped) <= 2, f"{where}; keys swapped per batch row there: {swapped}"
        assert errors.max() < flipped_bound, where
