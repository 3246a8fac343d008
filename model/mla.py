"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi's NoPE variant) with the optional DSA lightning indexer.

Two paths over the same params. `__call__` runs whole sequences: dense MLA expands keys/values through `kv_b_proj`
(the transformers form); with DSA the indexer's top-k selection and the sparse attention run in absorbed form over
the sequence's own latents viewed as a paged cache, exactly as `step` does. `step` runs new tokens against the
serving cache of latents [kv_lora_rank + rope] (and indexer keys), in absorbed form: W_UK folded into the query,
sparse (or, without DSA, dense) MLA over the cached latents, W_UV applied to the latent output. Both paths select
and attend with the same kernels, so cached decoding reproduces the full forward (ties in the indexer's scores go
to the lower position everywhere).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dayzero.kernels import attention as attention_kernels
from dayzero.kernels import fp8_indexer
from dayzero.kernels import indexer as indexer_kernels
from dayzero.kernels import mla_absorb, paged, paged_pallas, projection

from . import rope as rope_lib
from .config import ModelConfig
from .linear import decode_weight, dense, projection_dense, unfinished_output
from .norms import LayerNorm, RMSNorm

# Decode steps of up to `projection.CHOOSE_MAX_ROWS` rows run the layer's input norm with the query and latent
# projections (q_proj or q_a_proj, and kv_a_proj_with_mqa) as one `kernels.projection` call, and o_proj with the
# residual add as another (`MLAttention.decode_projection_kind`), where dispatch picks that kernel; layers with DSA
# (the indexer reads the normed input) or projection biases keep XLA's. On the H200 (medium hybrid,
# benchmarks/decode_profile.py, 2026-12-02, thirteenth session) batch-1 decode took 1.253 ms of kernels per token
# with it against 1.284 without (295 kernels against 306); tests/gpu/test_projection_gpu.py -k mla 2/2.
DECODE_PROJECTIONS = True
# Whether those decode projections hand their K-split partial sums over unfinished where the next kernel can finish
# them as it loads them (`kernels.projection.partials_loader`): the queries to `kernels.mla_absorb.absorb_queries`
# (no query LoRA), the latent rows to the paged cache write with its leading norm (no rope on the shared key), in
# place of XLA's reductions between the kernels (one or two per MLA layer). On the H200 (medium hybrid with MXFP4
# experts and `model.moe.RESIDUAL_IN_SUMS`, decode_profile.py --batches 1, one machine, thirty-fourth session): 124.5
# against 136.5 kernels per token, 0.862 against 0.864 ms of kernels (0.843 against 0.844 pipelined);
# tests/gpu/test_mla_absorb_gpu.py -k partials passes.
PROJECTION_PARTIALS = True
# Whether a decode step whose queries go through `kernels.mla_absorb.absorb_queries` has that kernel write the layer's
# latent cache rows too (`absorb_queries(latent_write=)`: a program per row beside its W_UK product, the loads of
# both in flight together), instead of the paged write's own decode kernel: one kernel fewer per MLA layer. On the
# H100 (medium hybrid with MXFP4 experts, decode_profile.py --set model.mla.LATENT_WRITE_IN_ABSORB=True, thirty-eighth
# session): batch 1 0.905 against 0.914 ms per token pipelined (0.917 against 0.925 ms of kernels, 120.5 kernels
# against 124.5), batch 16 2.106 against 2.110 (247.5 kernels against 251.5); tests/gpu/test_mla_absorb_gpu.py -k
# 'latent_rows or writes_latents' passes, and the CPU interpret tests give the cache bit for bit as the write kernel
# leaves it.
LATENT_WRITE_IN_ABSORB = True


def _rope_split(x: jax.Array, rope_dim: int, cos, sin) -> jax.Array:
    """Rotates the first `rope_dim` channels (rotate-half layout) and keeps the rest."""
    return jnp.concatenate([rope_lib.apply_rotate_half(x[..., :rope_dim], cos, sin), x[..., rope_dim:]], axis=-1)


class Indexer(nn.Module):
    """DSA lightning indexer. Params: wq_b, wk, k_norm, weights_proj (float32). With `config.index_fp8`, queries and
    keys are Hadamard-rotated and quantized to e4m3 with power-of-two scales (DeepSeek-V3.2's inference mode)."""

    config: ModelConfig
    dtype: jnp.dtype

    def setup(self):
        cfg = self.config
        self.wq_b = dense(cfg.index_n_heads * cfg.index_head_dim, self.dtype)
        self.wk = dense(cfg.index_head_dim, self.dtype)
        self.k_norm = LayerNorm(eps=1e-6, param_dtype=self.dtype)
        self.weights_proj = nn.Dense(cfg.index_n_heads, use_bias=False, dtype=jnp.float32, param_dtype=jnp.float32,
                                     kernel_init=nn.initializers.normal(0.02))

    def keys(self, x, cos, sin) -> tuple[jax.Array, jax.Array | None]:
        """x [B, T, D] -> (keys [B, T, index_head_dim] normed and roped, None), or in FP8 mode (e4m3 keys, their
        scales [B, T, 1] float32)."""
        k = self.k_norm(self.wk(x))[:, :, None, :]
        k = _rope_split(k, self.config.qk_rope_head_dim, cos, sin)[:, :, 0]
        if not self.config.index_fp8:
            return k, None
        k8, scales = fp8_indexer.rotate_and_quantize(k)
        return k8, scales[..., None]

    def select(self, x, q_latent, cos, sin, key_cache, key_scales, layer: int, block_tables,
               query_positions) -> jax.Array:
        """Top-k keys per query among the cached keys of `layer` ([L, N, 64, Di], FP8 scales [L, N, 64, 1] or None)
        -> indices [B, T, index_topk] int32 (key positions, -1 = none), also sown as "index_selection" in the
        "intermediates" collection when it is mutable (a cached decode's selections against the full forward's)."""
        cfg = self.config
        batch, length, _ = x.shape
        q = self.wq_b(q_latent).reshape(batch, length, cfg.index_n_heads, cfg.index_head_dim)
        q = _rope_split(q, cfg.qk_rope_head_dim, cos, sin)
        q_scales = None
        if cfg.index_fp8:
            q, q_scales = fp8_indexer.rotate_and_quantize(q)
        weights = self.weights_proj(x.astype(jnp.float32)) * cfg.index_n_heads ** -0.5
        indices = indexer_kernels.indexer_topk(q, weights, query_positions, key_cache, layer, block_tables,
                                               cfg.index_topk, scale=cfg.index_head_dim ** -0.5, q_scales=q_scales,
                                               key_scales=key_scales)
        self.sow("intermediates", "index_selection", indices)
        return indices

    def __call__(self, x, q_latent, cos, sin, positions):
        """Whole sequences (key s at position s) -> indices [B, T, index_topk]."""
        keys, scales = self.keys(x, cos, sin)
        key_cache, tables = paged.contiguous(keys)
        scale_cache = None if scales is None else paged.contiguous(scales)[0]
        return self.select(x, q_latent, cos, sin, key_cache, scale_cache, 0, tables, positions)


class MLAttention(nn.Module):
    """MLA. Params follow the published names (q_proj or q_a_proj/q_a_layernorm/q_b_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj, indexer)."""

    config: ModelConfig
    dtype: jnp.dtype
    mesh: Any = None  # where the params live (the decode projections' kernel is not sharded)

    def setup(self):
        cfg = self.config
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = projection_dense(cfg.num_heads * cfg.qk_head_dim, self.dtype)
        else:
            self.q_a_proj = projection_dense(cfg.q_lora_rank, self.dtype, use_bias=bias)
            self.q_a_layernorm = RMSNorm(eps=1e-6, param_dtype=self.dtype)
            self.q_b_proj = dense(cfg.num_heads * cfg.qk_head_dim, self.dtype)
        self.kv_a_proj_with_mqa = projection_dense(cfg.kv_lora_rank + cfg.qk_rope_head_dim, self.dtype, use_bias=bias)
        self.kv_a_layernorm = RMSNorm(eps=1e-6, param_dtype=self.dtype)
        self.kv_b_proj = dense(cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), self.dtype)
        self.o_proj = projection_dense(cfg.hidden_size, self.dtype, use_bias=bias)
        if cfg.use_dsa:
            self.indexer = Indexer(cfg, self.dtype)

    def _rope(self, positions):
        cfg = self.config
        if cfg.mla_use_rope or cfg.use_dsa:
            return rope_lib.cos_sin(cfg.rope, cfg.qk_rope_head_dim, positions, self.dtype)
        return None, None

    def _query_projection(self, x, projected=None):
        """-> q [B, T, H * (nope + rope)] (unroped), q_latent (the normed query LoRA) or None. `projected`: q_proj(x)
        (or q_a_proj(x) with a query LoRA) computed already."""
        cfg = self.config
        q_latent = None
        first = self.q_proj if cfg.q_lora_rank is None else self.q_a_proj
        q = first(x) if projected is None else projected
        if cfg.q_lora_rank is not None:
            q_latent = self.q_a_layernorm(q)
            q = self.q_b_proj(q_latent)
        return q, q_latent

    def _queries(self, x, cos, sin, projected=None):
        """-> q_nope [B, T, H, nope], q_rope [B, T, H, rope] (roped when the model uses rope), q_latent or None.
        `projected`: as `_query_projection` takes it."""
        cfg = self.config
        batch, length, _ = x.shape
        q, q_latent = self._query_projection(x, projected)
        q = q.reshape(batch, length, cfg.num_heads, cfg.qk_head_dim)
        q_nope, q_rope = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        if cfg.mla_use_rope:
            q_rope = rope_lib.apply_interleaved(q_rope, cos, sin)
        return q_nope, q_rope, q_latent

    def _latents(self, x, cos, sin, projected=None, normed: bool = True):
        """-> latent [B, T, kv_lora_rank] (kv_a_layernorm applied unless `normed` is False), shared rope key
        [B, T, rope]. `projected`: kv_a_proj_with_mqa(x) computed already."""
        cfg = self.config
        kv = self.kv_a_proj_with_mqa(x) if projected is None else projected
        latent = kv[..., :cfg.kv_lora_rank]
        if normed:
            latent = self.kv_a_layernorm(latent)
        k_rope = kv[..., cfg.kv_lora_rank:]
        if cfg.mla_use_rope:
            k_rope = rope_lib.apply_interleaved(k_rope[:, :, None, :], cos, sin)[:, :, 0]
        return latent, k_rope

    def _cache_rows(self, x, cos, sin, projected=None):
        """-> (the latent cache's new rows [B, T, R + rope], a `paged.LeadingNorm` for the write or None). One token
        per row: kv_a_layernorm goes with the rows into the cache write (one kernel with the write where it runs),
        the rope key roped beside them; else the rows come normed (`_latents`). `projected` as the projection's
        `Partials` (one token per row, no rope: `PROJECTION_PARTIALS`) are the rows as they are, for the write to
        finish."""
        in_write = isinstance(projected, projection.Partials) or (x.shape[1] == 1 and not self.is_initializing())
        if isinstance(projected, projection.Partials):
            rows = projected
        else:
            latent, k_rope = self._latents(x, cos, sin, projected, normed=not in_write)
            rows = jnp.concatenate([latent, k_rope], axis=-1)
        if not in_write:
            return rows, None
        norm = self.kv_a_layernorm
        return rows, paged.LeadingNorm(norm.variables["params"]["weight"], self.config.kv_lora_rank, norm.eps)

    def _kv_b_kernel(self) -> jax.Array:
        """kv_b_proj's kernel [R, H * (nope + v)], which the absorbed path reads without calling the layer."""
        if self.is_initializing():
            self.kv_b_proj(jnp.zeros((1, self.config.kv_lora_rank), self.dtype))
        return self.kv_b_proj.variables["params"]["kernel"]

    def _out(self, o, out_project=None):
        """o [B, T, H * v] -> o_proj(o) [B, T, D], or `out_project(o, o_proj's weight)`: o_proj by other means (the
        decode projections with the residual added; the weight as `linear.decode_weight` gives it)."""
        if out_project is not None:
            return out_project(o, decode_weight(self.o_proj)[0])
        return self.o_proj(o)

    def _absorbed(self, q_nope, q_rope, latent_cache, layer: int, block_tables, query_positions, indices,
                  out_project=None):
        """Absorbed MLA over the paged latents of `layer` (W_UK folded into q, W_UV after) -> [B, T, D] (`_out`)."""
        cfg = self.config
        batch, length, heads, nope = q_nope.shape
        w_kv = self._kv_b_kernel().reshape(cfg.kv_lora_rank, heads, nope + cfg.v_head_dim)
        q_absorbed = jnp.einsum("bthn,rhn->bthr", q_nope, w_kv[..., :nope].astype(q_nope.dtype))
        o_latent = attention_kernels.sparse_mla(q_absorbed, q_rope, latent_cache, layer, block_tables,
                                                query_positions, indices, scale=cfg.mla_softmax_scale)
        o = jnp.einsum("bthr,rhv->bthv", o_latent, w_kv[..., nope:].astype(o_latent.dtype))
        return self._out(o.reshape(batch, length, heads * cfg.v_head_dim), out_project)

    def absorb_kind(self, x) -> str:
        """Which implementation `step` runs absorbed MLA's W_UK and W_UV products with for these rows x [B, T, D]:
        "pallas" / "interpret" (`kernels.mla_absorb`: one token per row, off a mesh, where dispatch picks it and the
        head sizes fit) or "reference" (the einsums of `_absorbed`)."""
        cfg = self.config
        if self.mesh is not None or self.is_initializing() or x.shape[1] != 1:
            return "reference"
        return mla_absorb.choose(cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)

    def _absorbed_decode(self, q, cos, sin, latent_cache, layer: int, block_tables, query_positions, indices, kind,
                         out_project=None, latent_write=None):
        """`_absorbed` for one token per row through `kernels.mla_absorb` (`kind` "pallas" / "interpret"): q
        [B, 1, H * (nope + rope)] unroped -> ([B, 1, D] (`_out`), the latent cache). `latent_write`: the step's
        latent rows (`paged_pallas.DecodeRows`), written into the cache by the absorb kernel."""
        cfg = self.config
        unfinished = isinstance(q, projection.Partials)  # the query projection's sums, for the kernel to finish
        batch = q.sums.shape[1] if unfinished else q.shape[0]
        heads, nope, rope, v_dim = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        w_kv = self._kv_b_kernel()
        interpret = kind == "interpret"
        written = {} if latent_write is None else dict(cache=latent_cache, latent_write=latent_write)
        q_absorbed, q_rope, *latent_cache_out = mla_absorb.absorb_queries(
            q if unfinished else q[:, 0], w_kv, heads=heads, nope=nope, rope=rope, v_dim=v_dim,
            tiles=mla_absorb.default_tiles(batch), interpret=interpret, **written)
        latent_cache = latent_cache_out[0] if latent_cache_out else latent_cache
        q_rope = q_rope[:, None]
        if cfg.mla_use_rope:
            q_rope = rope_lib.apply_interleaved(q_rope, cos, sin)
        up_kernel = batch <= mla_absorb.UP_PROJECT_MAX_ROWS
        latents = attention_kernels.sparse_mla(q_absorbed[:, None], q_rope, latent_cache, layer, block_tables,
                                               query_positions, indices, scale=cfg.mla_softmax_scale,
                                               merge=not up_kernel)
        if not isinstance(latents, mla_absorb.SplitLatents):
            latents = latents.reshape(batch, heads, cfg.kv_lora_rank)
        if up_kernel:
            o = mla_absorb.up_project(latents, w_kv, nope=nope, v_dim=v_dim, interpret=interpret)
        else:
            o = mla_absorb.up_project_reference(latents, w_kv, nope=nope, v_dim=v_dim)
        return self._out(o[:, None], out_project), latent_cache

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Whole sequence: x [B, T, D], positions [B, T] (each row 0, 1, ..., T - 1) -> [B, T, D]."""
        cfg = self.config
        batch, length, _ = x.shape
        heads, nope, v_dim = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        cos, sin = self._rope(positions)
        q_nope, q_rope, q_latent = self._queries(x, cos, sin)
        latent, k_rope = self._latents(x, cos, sin)
        if cfg.use_dsa:
            indices = self.indexer(x, q_latent, cos, sin, positions)
            latent_cache, tables = paged.contiguous(jnp.concatenate([latent, k_rope], axis=-1))
            return self._absorbed(q_nope, q_rope, latent_cache, 0, tables, positions, indices)
        kv_up = self.kv_b_proj(latent).reshape(batch, length, heads, nope + v_dim)
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (batch, length, heads, cfg.qk_rope_head_dim))
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([kv_up[..., :nope], k_rope], axis=-1)
        allowed = jnp.broadcast_to(positions[:, :, None] >= positions[:, None, :], (batch, length, length))
        o = attention_kernels.masked_attention(q, k, kv_up[..., nope:], allowed, scale=cfg.mla_softmax_scale)
        return self.o_proj(o.reshape(batch, length, heads * v_dim))

    def decode_projection_kind(self, x) -> str:
        """Which implementation `step` with a `norm_weight` runs its projections with for these rows x [B, 1, D]:
        "pallas" / "interpret" (`kernels.projection`, where `DECODE_PROJECTIONS` is on, dispatch picks it and it
        takes the shapes) or "reference" (also for DSA layers, projection biases, on a mesh and at init)."""
        cfg = self.config
        if (not DECODE_PROJECTIONS or self.mesh is not None or self.is_initializing() or x.shape[1] != 1
                or cfg.use_dsa or cfg.attention_bias):
            return "reference"
        first = cfg.num_heads * cfg.qk_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank
        return projection.choose(x.shape[0], x.shape[2], (first, cfg.kv_lora_rank + cfg.qk_rope_head_dim))

    def step(self, x, positions, valid, cache: dict, layer: int, block_tables, norm_weight=None,
             unfinished: bool = False):
        """New tokens against the paged cache. x [B, T, D], positions/valid [B, T], cache {"latent": [L, N, 64,
        R + E], "index_keys": [L, N, 64, Di] (DSA), "index_scales": [L, N, 64, 1] (FP8 indexer)}, `layer` this
        layer's index among MLA layers, block_tables [B, max_blocks] -> (out [B, T, D], cache with the new tokens
        written). One token per row (decode) takes the split decode kernels.

        With `norm_weight` [D] (only where `decode_projection_kind(x)` != "reference"), x is the layer's input
        before its input RMSNorm and out is x + attention(norm(x)): the norm with the query and latent projections
        is one `kernels.projection` call, o_proj with the residual add another; with `unfinished` too, out is
        (o_proj's output as `project(finish=False)` gives it, x [B, D]) for a consumer that adds them up itself
        (`kernels.moe_front`), or with the weights stored [out, in] (`linear.WEIGHT_ROWS`) where o_proj's kernel does
        not split K (None, their sum [B, D]): `linear.unfinished_output`."""
        cfg = self.config
        cos, sin = self._rope(positions)
        projected, out_project = (None, None), None
        absorb = self.absorb_kind(x)
        if norm_weight is not None:
            kind = self.decode_projection_kind(x)
            if kind == "reference":
                raise ValueError("MLAttention.step: a norm weight is for the decode projections, which these rows "
                                 f"{x.shape} do not take")
            first = self.q_proj if cfg.q_lora_rank is None else self.q_a_proj
            rows = x[:, 0]
            (q_weight, weight_rows), (kv_weight, _) = decode_weight(first), decode_weight(self.kv_a_proj_with_mqa)
            project = functools.partial(projection.by_kind(kind), weight_rows=weight_rows)  # o_proj's layout too
            q, kv = project(rows, ((q_weight,), (kv_weight,)), norm_weight=norm_weight, eps=cfg.rms_norm_eps,
                            finish=not PROJECTION_PARTIALS)
            # partial sums stay unfinished where the next kernel finishes them: the absorb kernel (no query LoRA),
            # the cache write (no rope on the shared key)
            keep = (absorb != "reference" and cfg.q_lora_rank is None, not cfg.mla_use_rope)
            projected = tuple(out if taken and isinstance(out, projection.Partials) else
                              projection.finished(out)[:, None] for out, taken in zip((q, kv), keep))
            if unfinished:
                out_project = lambda o, w: unfinished_output(project, o[:, 0], w, rows, weight_rows)
            else:
                out_project = lambda o, w: project(o[:, 0], ((w,),), residual=rows)[0][:, None]
        elif unfinished:
            raise ValueError("MLAttention.step: `unfinished` needs the decode projections (a norm weight)")
        if absorb == "reference":
            q_nope, q_rope, q_latent = self._queries(x, cos, sin, projected[0])
        else:
            q, q_latent = self._query_projection(x, projected[0])
        latent_rows, norm = self._cache_rows(x, cos, sin, projected[1])
        query_positions = jnp.where(valid, positions, -1)
        cache = dict(cache)
        latent_write = None  # the rows, where the absorb kernel writes them (`LATENT_WRITE_IN_ABSORB`)
        if (LATENT_WRITE_IN_ABSORB and absorb != "reference" and paged.decode_kernel_kind(norm) is not None
                and mla_absorb.writes_latents(cfg.num_heads, cfg.kv_lora_rank, x.shape[0])):
            latent_write = paged_pallas.DecodeRows(layer, block_tables, positions, valid, latent_rows, norm)
        else:
            cache["latent"] = paged.write(cache["latent"], layer, block_tables, positions, valid, latent_rows,
                                          norm=norm)
        indices = None
        if cfg.use_dsa:
            keys, scales = self.indexer.keys(x, cos, sin)
            cache["index_keys"] = paged.write(cache["index_keys"], layer, block_tables, positions, valid, keys)
            if scales is not None:
                cache["index_scales"] = paged.write(cache["index_scales"], layer, block_tables, positions, valid,
                                                    scales)
            indices = self.indexer.select(x, q_latent, cos, sin, cache["index_keys"], cache.get("index_scales"),
                                          layer, block_tables, query_positions)
        if absorb == "reference":
            out = self._absorbed(q_nope, q_rope, cache["latent"], layer, block_tables, query_positions, indices,
                                 out_project)
        else:
            out, cache["latent"] = self._absorbed_decode(q, cos, sin, cache["latent"], layer, block_tables,
                                                         query_positions, indices, absorb, out_project, latent_write)
        return out, cache
