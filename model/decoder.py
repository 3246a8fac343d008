"""The decoder stack (Flax Linen): embedding, hybrid KDA/MLA layers with dense or MoE MLPs, final norm, LM head.

`__call__` is the full-sequence path; `step` runs a batch of new tokens against the serving caches (see
`cache.py`) and returns the logits of each row's last valid token.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dayzero.kernels import moe_front

from . import moe, sharding
from .config import LAYER_KDA, MLP_MOE, ModelConfig
from .kda import KimiDeltaAttention
from .mla import MLAttention
from .moe import MLP, MoE, new_workspace
from .norms import RMSNorm

# Whether an MLA layer's decode step (with the decode projections) also hands o_proj's output unfinished to
# `kernels.moe_front`, as KDA layers do, instead of finishing the residual add in o_proj's kernel and leaving the
# post-attention norm and the router's logits to XLA. On the H200 (medium hybrid, eighteenth session): batch 1
# 1.047 against 1.054 ms of kernels per token (213 kernels against 221; decode_profile.py --set
# model.decoder.FRONT_AFTER_MLA=false for the A/B); tests/gpu/test_moe_front_gpu.py -k model_decode passes.
FRONT_AFTER_MLA = True
# Whether the front kernel also makes the router's choice in its last program (`moe_front.front(select=)`, with the
# cache's "moe_turns" counters), where the router would run its one-token select kernel next: one kernel fewer per
# MoE layer at batch 1. tests/gpu/test_moe_front_gpu.py passes on the H200; batch-1 decode 1.048 against 1.050 ms of
# kernels per token alone (pipelined 1.020 / 1.030, eighteenth-session tree), 1.014 against 1.020 with the MLA
# absorb kernels (174 kernels against 189; decode_profile.py, nineteenth session).
FRONT_SELECT = True


def layer_slots(config: ModelConfig) -> list[int]:
    """Per layer, its index among the layers of its kind (KDA layers and MLA layers are counted separately)."""
    counts = {}
    slots = []
    for kind in config.layer_types:
        slots.append(counts.get(kind, 0))
        counts[kind] = slots[-1] + 1
    return slots


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    config: ModelConfig
    layer: int
    dtype: jnp.dtype
    mesh: Any = None

    def setup(self):
        cfg = self.config
        self.is_kda = cfg.layer_types[self.layer] == LAYER_KDA
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.self_attn = (KimiDeltaAttention(cfg, self.dtype, self.mesh) if self.is_kda
                          else MLAttention(cfg, self.dtype, self.mesh))
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        if cfg.mlp_types[self.layer] == MLP_MOE:
            self.mlp = MoE(cfg, self.dtype, layer=self.layer, mesh=self.mesh)
        else:
            self.mlp = MLP(cfg.intermediate_size, cfg.hidden_size, self.dtype,
                           projection_max_tokens=moe.DENSE_PROJECTION_MAX_TOKENS if self.mesh is None else 0,
                           projection_tiles=moe.DENSE_PROJECTION_TILES)

    def _front_kind(self, x) -> str:
        """The `kernels.moe_front` implementation for this layer's decode step on x [B, 1, D] ("reference": none;
        the attention finishes its residual add and the MoE block normalises and routes as usual)."""
        cfg = self.config
        if not (isinstance(self.mlp, MoE) and self.mesh is None and x.shape[1] == 1):
            return "reference"
        return moe_front.choose(x.shape[0], cfg.hidden_size, cfg.num_experts, self.dtype)

    def _mlp_front(self, update, residual, workspace, kind: str, cache: dict):
        """The MoE half of a decode step from the attention's unfinished output: o_proj's `update` and the layer
        input `residual` [B, D] -> (x [B, 1, D], workspace, cache), the residual add, the norm and the router's
        logits in `kernels.moe_front`'s one kernel (with `FRONT_SELECT` and the cache's "moe_turns", the router's
        choice too, where the router would make it in its one-token select kernel, and then the shared MLP's gate /
        up sums where `MoE.front_shared` asks; x's words for the MXFP4 decode kernels where they take them,
        `MoE.front_packs`). Where the MXFP4 down kernel adds the experts into the residual rows the front kernel
        writes (`MoE.residual_in_sums`), x comes back as those float32 sums, which the next layer's kernels round as
        they load (`DecoderLayer.step`)."""
        cfg = self.config
        router_weight = self.mlp.variables["params"]["gate"]["weight"]
        norm_weight = self.post_attention_layernorm.variables["params"]["weight"]
        front = moe_front.by_kind(kind)
        select = (self.mlp.front_select(residual.shape[0], workspace) if FRONT_SELECT and "moe_turns" in cache
                  else None)
        pack = self.mlp.front_packs(residual.shape[0], workspace)  # x's words for the MXFP4 decode kernels
        sums = self.mlp.residual_in_sums(residual.shape[0], workspace)  # x as float32, for the down kernel's sums
        choice = {} if select is None else dict(select=select[0], bias=select[1], zeros=select[2],
                                                turns=cache["moe_turns"], layer=self.layer)
        shared = None if select is None else self.mlp.front_shared(residual.shape[0], workspace)
        if shared is not None:  # the shared MLP's gate / up products, in programs beside the router's
            choice.update(shared)
        x, normed, logits, *rest = front(update, residual, norm_weight, router_weight, eps=cfg.rms_norm_eps,
                                         pack=pack, sums=sums, **choice)
        x_words, rest = (rest[0], rest[1:]) if pack else (None, rest)
        x_sums, rest = (rest[0], rest[1:]) if sums else (None, rest)
        shared_sums, rest = (rest[-1], rest[:-1]) if shared is not None else (None, rest)
        counters = rest[3] if len(rest) > 3 else None  # the decode kernels' turn counters, zeroed (`zeros`)
        y, workspace = self.mlp(normed[:, None], workspace, logits=logits, chosen=tuple(rest[:2]) if choice else None,
                                x_words=x_words, counters=counters, residual_sums=x_sums, shared_sums=shared_sums)
        cache = dict(cache, moe_turns=rest[2]) if choice else cache
        return (y if sums else x[:, None] + y), workspace, cache

    def _mlp(self, x, workspace):
        """x + mlp(norm(x)) -> (x, workspace)."""
        if isinstance(self.mlp, MoE):
            y, workspace = self.mlp(self.post_attention_layernorm(x), workspace)
            return x + y, workspace
        # a dense MLP: the norm and the residual add inside the projection kernels, where they run
        y = self.mlp.projected(x, norm=self.post_attention_layernorm, residual=x)
        return (x + self.mlp(self.post_attention_layernorm(x)) if y is None else y), workspace

    def __call__(self, x, positions, workspace=None):
        """Returns (x, workspace): the MXFP4 expert workspace (or None) passes from layer to layer."""
        h = self.input_layernorm(x)
        h = self.self_attn(h) if self.is_kda else self.self_attn(h, positions)
        return self._mlp(x + h, workspace)

    def step(self, x, positions, valid, cache: dict, block_tables, slots, decode: bool, workspace=None):
        """Cached step of this layer; returns (x, cache, workspace). x may come as float32 sums of a model of 16-bit
        dtype (the previous layer's residual add done in the MXFP4 down kernel: `MoE.residual_in_sums`): the fused
        decode path's kernels round it as they load, every other path takes it rounded here."""
        index = layer_slots(self.config)[self.layer]
        rounded = x.astype(self.dtype)  # (only its shape and dtype where the fused path takes x as it is)
        # one-token decode steps may take the input norm and the residual add inside (with the projections)
        fused = decode and (self.self_attn.decode_layer_kind(rounded) if self.is_kda
                            else self.self_attn.decode_projection_kind(rounded)) != "reference"
        if not fused:
            x = rounded
        norm_weight = self.input_layernorm.variables["params"]["weight"] if fused else None
        # the MoE block's front (residual add, norm, router logits) in one kernel after the attention's decode step
        front = self._front_kind(x) if fused and (self.is_kda or FRONT_AFTER_MLA) else "reference"
        if fused and self.is_kda:
            x, conv, state, *turns = self.self_attn.decode_in_place(
                x, norm_weight, valid, cache["conv"], cache["state"], slots, index, unfinished=front != "reference",
                turns=cache.get("kda_turns"))
            cache = dict(cache, conv=conv, state=state, **({"kda_turns": turns[0]} if turns else {}))
            if front != "reference":
                x, workspace, cache = self._mlp_front(*x, workspace, front, cache)
                return x, cache, workspace
        elif fused:
            x, cache = self.self_attn.step(x, positions, valid, cache, index, block_tables, norm_weight=norm_weight,
                                           unfinished=front != "reference")
            if front != "reference":
                x, workspace, cache = self._mlp_front(*x, workspace, front, cache)
                return x, cache, workspace
        elif self.is_kda:
            h, conv, state = self.self_attn.step(self.input_layernorm(x), valid, cache["conv"][index, slots],
                                                 cache["state"], slots, index, decode)
            cache = dict(cache, conv=cache["conv"].at[index, slots].set(conv.astype(cache["conv"].dtype)),
                         state=state)
            x = x + h
        else:
            h, cache = self.self_attn.step(self.input_layernorm(x), positions, valid, cache, index, block_tables)
            x = x + h
        x, workspace = self._mlp(x, workspace)
        return x, cache, workspace


class Decoder(nn.Module):
    """token_ids [B, T] -> logits [B, T, V] float32 (and, when asked, the hidden states after the embedding and
    after every layer, the last one after the final norm, as transformers' `output_hidden_states`).

    `mesh` (a `sharding.make_mesh` mesh, or None) is where the params live: MoE layers then run expert-parallel
    and `step` keeps the cache arrays on their `sharding.CACHE_RULES` shardings."""

    config: ModelConfig
    dtype: jnp.dtype = jnp.bfloat16
    mesh: Any = None

    def setup(self):
        cfg = self.config
        self.embed_tokens = self.param("embed_tokens", nn.initializers.normal(0.02),
                                       (cfg.vocab_size, cfg.hidden_size), self.dtype)
        self.layers = [DecoderLayer(cfg, i, self.dtype, self.mesh) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = self.param("lm_head", nn.initializers.normal(0.02), (cfg.hidden_size, cfg.vocab_size),
                                      self.dtype)

    def _logits(self, x):
        if self.config.tie_word_embeddings:
            return jnp.einsum("...d,vd->...v", x, self.embed_tokens, preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", x, self.lm_head, preferred_element_type=jnp.float32)

    def _sow_workspace(self, workspace):
        """Records the MXFP4 workspace's [hits, misses] in the "intermediates" collection (when it is mutable)."""
        if workspace is not None:
            self.sow("intermediates", "mxfp4_workspace", jnp.stack([workspace.hits, workspace.misses]))

    def embed(self, token_ids, inputs_embeds=None, embeds_mask=None):
        """Token embeddings [B, T, D]; where `embeds_mask` [B, T] is set, `inputs_embeds` [B, T, D] instead (image
        features at their placeholder tokens). As transformers' kimi_k25 does, an image placeholder id anywhere else
        (a generated one) embeds as id 0."""
        if self.config.vision is not None:
            token_ids = jnp.where(token_ids == self.config.image_token_id, 0, token_ids)
        x = jnp.take(self.embed_tokens, token_ids, axis=0)
        if inputs_embeds is not None:
            x = jnp.where(embeds_mask[..., None], inputs_embeds.astype(x.dtype), x)
        return x

    def __call__(self, token_ids: jax.Array, positions: jax.Array | None = None, return_hidden_states: bool = False,
                 inputs_embeds: jax.Array | None = None, embeds_mask: jax.Array | None = None):
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(token_ids.shape[1]), token_ids.shape)
        x = self.embed(token_ids, inputs_embeds, embeds_mask)
        hidden = [x]
        workspace = new_workspace(self.config, token_ids.size, self.mesh)
        for layer in self.layers:
            x, workspace = layer(x, positions, workspace)
            hidden.append(x)
        self._sow_workspace(workspace)
        x = self.norm(x)
        hidden[-1] = x
        logits = self._logits(x)
        return (logits, hidden) if return_hidden_states else logits

    def step(self, token_ids, positions, valid, cache: dict, block_tables, slots, decode: bool = False,
             inputs_embeds=None, embeds_mask=None):
        """A serving step. token_ids/positions/valid [B, T] (valid tokens first in each row), block_tables
        [B, max_blocks], slots [B], optional inputs_embeds [B, T, D] where embeds_mask [B, T] -> (logits [B, V]
        float32 of each row's last valid token, updated cache)."""
        x = self.embed(token_ids, inputs_embeds, embeds_mask)
        workspace = new_workspace(self.config, token_ids.size, self.mesh)
        for layer in self.layers:
            x, cache, workspace = layer.step(x, positions, valid, cache, block_tables, slots, decode, workspace)
        self._sow_workspace(workspace)
        if self.mesh is not None:
            placements = sharding.cache_shardings(self.config, self.mesh, cache)
            cache = {name: jax.lax.with_sharding_constraint(value, placements[name]) for name, value in cache.items()}
        x = x.astype(self.dtype)  # float32 sums of the last MoE layer (`MoE.residual_in_sums`): rounded
        if x.shape[1] == 1:  # decode: the one token (no gather kernel)
            x = self.norm(x[:, 0])
        else:
            last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
            x = self.norm(jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0])
        return self._logits(x), cache
