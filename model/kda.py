"""Kimi Delta Attention layer (Flax Linen): q/k/v projections with short causal convs + SiLU, the per-channel forget
gate, beta, the delta-rule scan, a gated RMSNorm and the output projection.

`__call__` runs whole sequences from zero state; `step` continues from per-request state slots (conv state
[3, dim, W - 1] for q/k/v and recurrent state [H, K, V] float32), chunked for prefill and recurrent for decode.
`decode_in_place` is the decode step with everything between the input projections and o_proj in one kernel
(`kernels.kda.decode_layer`), reading and writing both caches in place; `decode_layer_kind` says where it applies.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dayzero.kernels import kda as kda_kernels
from dayzero.kernels import projection, short_conv
from dayzero.kernels.kda import decode_layer
from dayzero.kernels.kda import reference as kda_reference

from . import sharding
from .config import ModelConfig
from .linear import decode_weight, dense, projection_dense, unfinished_output
from .norms import GatedRMSNorm

# Whether `decode_in_place` hands the projection kernel's split-K partial sums to the decode-step kernel, which adds
# up the columns it reads, instead of XLA's kernels that finish them first (tests/gpu/test_kda_gpu.py -k partials
# passes). On the H200 (medium hybrid, benchmarks/decode_profile.py): no gain while the step ran one program per head
# (thirteenth session, batch 1 1.230 against 1.227 ms of kernels per token: the step kernel grew by ~3.4 us per
# layer); with the step split over value blocks each program adds up only its share, and batch 1 took 1.113 against
# 1.133 ms (pipelined 1.075 against 1.086; batch 2 and 16 unchanged: 1.425 / 2.948 against 1.425 / 2.957;
# eighteenth session).
PROJECTION_PARTIALS = True
# Whether `decode_in_place` takes the six input projections as one projection output (q|k|v|f_a|g_a|b side by side:
# one XLA fusion finishes them where K is split, instead of two) rather than as two groups. On the H200 (eighteenth
# session; tests/gpu/test_kda_gpu.py -k side_by_side passes): with XLA finishing the partial sums, batch 1 took 1.123
# against 1.133 ms of kernels per token; with `PROJECTION_PARTIALS` (nothing left for XLA to finish) no gain: 1.059
# against 1.055 at batch 1, 2.923 against 2.923 at batch 16 (where XLA's projections then concatenate the weights
# every step). Off.
PROJECTIONS_AS_ONE = False
# Whether `decode_in_place` has the decode-step kernel run o_proj as well where the step is split over value blocks
# with turn counters (`decode_layer.decode_step(o_weight=)`: its output one partial sum per head, finished by the MoE
# front kernel or XLA), one kernel per KDA layer fewer than o_proj's own projection kernel. Off: slower. On the H100
# (medium hybrid with MXFP4 experts, decode_profile.py --set model.kda.O_PROJ_IN_STEP=True, thirty-seventh session;
# tests/gpu/test_kda_gpu.py -k o_proj passes) batch 1 took 0.971 ms of kernels per token against 0.932 (113.5
# kernels against 124.5): the step kernel grew 8.6 -> 16.0 us per layer (15.1 without the L2 prefetch,
# `decode_layer.O_PROJ_PREFETCH`: 0.954 ms), more than o_proj's own kernel took (5.4 us), and the front reading 16
# slices instead of 8 ~0.6 us more. Each block's product waits on its 64 KB of weight after the step, and the
# head's last block then reads its blocks' products back: two latency-bound phases in place of one kernel.
O_PROJ_IN_STEP = False


def _a_log_init(key, shape, dtype):
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def _dt_bias_init(key, shape, dtype):
    dt = jnp.maximum(jnp.exp(jax.random.uniform(key, shape, jnp.float32, np.log(1e-3), np.log(1e-1))), 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)  # inverse softplus


def forget_gate(raw: jax.Array, a_log: jax.Array, dt_bias: jax.Array, lower_bound: float | None) -> jax.Array:
    """Per-channel log-decay g [B, T, H, K] float32 from the f_b_proj output raw [B, T, H*K]: `log_decay` of
    raw + dt_bias with A_log per head (-exp(A_log) * softplus, or the lower-bounded sigmoid form)."""
    heads = a_log.shape[0]
    x = (raw.astype(jnp.float32) + dt_bias.astype(jnp.float32)).reshape(*raw.shape[:-1], heads, -1)
    return kda_reference.log_decay(x, a_log.astype(jnp.float32)[:, None], lower_bound)


class ShortConv(nn.Module):
    """Depthwise causal conv + SiLU with param `weight` [C, W]. Returns (y, state [B, C, W - 1])."""

    channels: int
    width: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, initial_state=None, lengths=None):
        weight = self.param("weight", nn.initializers.normal(0.2), (self.channels, self.width), self.dtype)
        return short_conv.causal_conv1d(x, weight, initial_state, activation="silu", lengths=lengths)


class KimiDeltaAttention(nn.Module):
    """KDA. Params: q/k/v_proj, q/k/v_conv1d (`weight` [C, W]), f_a_proj, f_b_proj, A_log [H], dt_bias [H*K],
    b_proj, g_a_proj, g_b_proj, o_norm, o_proj. On a `mesh`, the per-head streams are pinned to `tensor` (the
    head-sharded params' and state's axis)."""

    config: ModelConfig
    dtype: jnp.dtype
    mesh: Any = None

    def setup(self):
        cfg = self.config
        heads, head_dim = cfg.kda_num_heads, cfg.kda_head_dim
        dim = cfg.kda_dim
        self.q_proj, self.k_proj, self.v_proj = (projection_dense(dim, self.dtype) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            ShortConv(dim, cfg.kda_conv_size, self.dtype) for _ in range(3))
        self.A_log = self.param("A_log", _a_log_init, (heads,), jnp.float32)
        self.dt_bias = self.param("dt_bias", _dt_bias_init, (dim,), jnp.float32)
        self.f_a_proj = projection_dense(head_dim, self.dtype)
        self.f_b_proj = dense(dim, self.dtype)
        self.b_proj = projection_dense(heads, self.dtype)
        self.g_a_proj = projection_dense(head_dim, self.dtype)
        self.g_b_proj = dense(dim, self.dtype)
        self.o_norm = GatedRMSNorm(eps=cfg.rms_norm_eps, param_dtype=self.dtype)
        self.o_proj = projection_dense(cfg.hidden_size, self.dtype)

    def _inputs(self, x, conv_state=None, lengths=None):
        """-> q, k, v [B, T, H, K], g [B, T, H, K] f32, beta [B, T, H] f32, conv state [B, 3, dim, W - 1]."""
        cfg = self.config
        batch, length, _ = x.shape
        shape = (batch, length, cfg.kda_num_heads, cfg.kda_head_dim)
        streams, states = [], []
        for i, (proj, conv) in enumerate(((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d),
                                          (self.v_proj, self.v_conv1d))):
            y, state = conv(proj(x), None if conv_state is None else conv_state[:, i], lengths)
            streams.append(y.reshape(shape))
            states.append(state)
        g = forget_gate(self.f_b_proj(self.f_a_proj(x)), self.A_log, self.dt_bias, cfg.kda_gate_lower_bound)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        heads = cfg.kda_num_heads
        streams = [sharding.constrain(t, self.mesh, 2, heads) for t in (*streams, g, beta)]
        return (*streams, jnp.stack(states, axis=1))

    def _output(self, x, o):
        batch, length, heads, head_dim = o.shape
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(o.shape)
        return self.o_proj(self.o_norm(o, gate).reshape(batch, length, heads * head_dim))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Whole sequences from zero state: x [B, T, D] -> [B, T, D]."""
        q, k, v, g, beta, _ = self._inputs(x)
        o, _ = kda_kernels.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        return self._output(x, o)

    def decode_layer_kind(self, x) -> str:
        """Which implementation `decode_in_place` runs for these rows x [B, 1, D]: "pallas" / "interpret" (the
        one-kernel step of `kernels.kda.decode_layer`, where dispatch picks it and it takes this layer) or
        "reference" (`step`'s ops; also on a mesh and at init). The layer's dtype decides, not x's (x may be float32
        rows of a 16-bit model, which the projection kernel rounds as it loads)."""
        cfg = self.config
        if self.mesh is not None or self.is_initializing() or x.shape[1] != 1:
            return "reference"
        if not decode_layer.supported(cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim, cfg.kda_head_dim,
                                      cfg.kda_conv_size, self.dtype):
            return "reference"
        return decode_layer.choose()

    def decode_in_place(self, x, norm_weight, valid, conv_cache, state_pool, slots, layer: int,
                        unfinished: bool = False, turns=None):
        """One decode token per row through `kernels.kda.decode_layer` (needs `decode_layer_kind(x)` != "reference"):
        x [B, 1, D] the layer's input before its input RMSNorm (weight `norm_weight` [D]), valid [B, 1], conv_cache
        [L, S, 3, dim, W - 1] and state_pool [L, S, H, K, V] (every KDA layer's; row b uses slot slots[b] of layer
        `layer`, both updated in place) -> (x + attention(norm(x)) [B, 1, D], conv_cache, state_pool).

        The norm and the six input projections are one `kernels.projection` call where dispatch picks it (q|k|v and
        f_a|g_a|b come out side by side, or all six with `PROJECTIONS_AS_ONE`, as the step kernel takes them; where
        K is split, as float32 partial sums that the step kernel adds up itself, with `PROJECTION_PARTIALS`), and so
        are o_proj and the residual add
        (with the step split over value blocks, o_proj's loads finish the gated norm: `projection.HeadScaled`; or,
        with `O_PROJ_IN_STEP` and the counters, the step kernel runs o_proj itself, one partial sum per head).
        From `decode_layer.LOW_RANK_UPS_MIN_ROWS` rows on, f_b's and g_b's products of the rows' f_a and g_a outputs
        are two XLA matmuls handed to the step kernel (`decode_step(low_rank_ups=)`) instead of a weight load per
        (row, head) program.

        `unfinished`: the first result is (o_proj's output as `project(finish=False)` gives it, x [B, D]) instead of
        their sum [B, 1, D], for a consumer that adds them up itself (`kernels.moe_front`); with the weights stored
        [out, in] (`linear.WEIGHT_ROWS`) where o_proj's kernel does not split K (one row) it is (None, their sum [B, D])
        (`linear.unfinished_output`).
        `turns`: the cache's "kda_turns" counters (or None), with which a step split over value blocks shifts q's and
        k's conv inputs in its kernel; then the results end with the counters (kept zero), as a fourth."""
        cfg = self.config
        rows = x[:, 0]
        weight = lambda module, name="kernel": module.variables["params"][name]
        # the input projections and o_proj share one layout (`linear.WEIGHT_ROWS`)
        weight_rows = decode_weight(self.q_proj)[1]
        inputs = (tuple(decode_weight(p)[0] for p in (self.q_proj, self.k_proj, self.v_proj)),
                  tuple(decode_weight(p)[0] for p in (self.f_a_proj, self.g_a_proj, self.b_proj)))
        if PROJECTIONS_AS_ONE:  # q|k|v|f_a|g_a|b side by side (one XLA fusion finishes them where K is split)
            inputs = (inputs[0] + inputs[1],)
        project = projection.by_kind(projection.choose(rows.shape[0], rows.shape[1],
                                                       tuple(projection.out_width(w, weight_rows)
                                                             for g in inputs for w in g)))
        project = functools.partial(project, weight_rows=weight_rows)
        projected = project(rows, inputs, norm_weight=norm_weight, eps=cfg.rms_norm_eps,
                            finish=not PROJECTION_PARTIALS)
        qkv, fgb = projected if len(projected) == 2 else (projected[0], None)
        f_b, g_b = weight(self.f_b_proj), weight(self.g_b_proj)
        ups = None
        if 0 < decode_layer.LOW_RANK_UPS_MIN_ROWS <= rows.shape[0]:  # f_b's and g_b's products by XLA, all rows
            if fgb is None:  # the six side by side
                qkv = projection.finished(qkv)
                ups = decode_layer.low_rank_ups(qkv, f_b, g_b, after_qkv=True)
            else:
                fgb = projection.finished(fgb)
                ups = decode_layer.low_rank_ups(fgb, f_b, g_b)
        fits = turns is not None and turns.shape[1] >= rows.shape[0]  # else: the XLA scatter, the counters untouched
        split = decode_layer.value_split(rows.shape[0], cfg.kda_head_dim)
        o_weight = decode_weight(self.o_proj)[0]
        o_in_step = (O_PROJ_IN_STEP and fits and split > 1 and o_weight.dtype == jnp.dtype(self.dtype)
                     and not weight_rows)  # the step kernel reads o_proj's weight [H * K, D]
        o, conv_cache, state_pool, *counters = decode_layer.decode_step(
            qkv, fgb, tuple(weight(c, "weight") for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)),
            f_b, self.A_log, self.dt_bias, g_b, weight(self.o_norm, "weight"),
            conv_cache, state_pool, slots, jnp.sum(valid, axis=1), layer=layer, eps=cfg.rms_norm_eps,
            lower_bound=cfg.kda_gate_lower_bound, num_warps=decode_layer.NUM_WARPS,
            value_split=split, turns=turns if fits else None, low_rank_ups=ups,
            o_weight=o_weight if o_in_step else None, hoist_loads=decode_layer.HOIST_LOADS,
            low_rank_dot=decode_layer.LOW_RANK_DOT, o_prefetch=decode_layer.O_PROJ_PREFETCH,
            interpret=self.decode_layer_kind(x) == "interpret")
        turns = tuple(counters) if fits else (() if turns is None else (turns,))
        if o_in_step:  # o is o_proj's output already, one partial sum per head
            out = (o, rows) if unfinished else projection.finished(o, residual=rows)[:, None]
        elif unfinished:
            out = unfinished_output(project, o, o_weight, rows, weight_rows)
        else:  # the residual added in o_proj's kernel
            out = project(o, ((o_weight,),), residual=rows)[0][:, None]
        return (out, conv_cache, state_pool, *turns)

    def step(self, x, valid, conv_state, state_pool, slots, layer: int, decode: bool):
        """Continues from slot states: x [B, T, D], valid [B, T] (padding at the end of rows), conv_state
        [B, 3, dim, W - 1] (these rows'), state_pool [L, S, H, K, V] f32 (every KDA layer's slots; row b uses
        state_pool[layer, slots[b]]) -> (out [B, T, D], new conv_state, updated pool). Padded tokens leave both
        states unchanged (the kernels stop at each row's length; the conv state is taken before the padding)."""
        lengths = jnp.sum(valid, axis=1).astype(jnp.int32)
        q, k, v, g, beta, conv_state = self._inputs(x, conv_state, lengths)
        if decode:
            o, state_pool = kda_kernels.fused_recurrent_kda_slots(
                q, k, v, g, beta, state_pool, slots, layer=layer, use_qk_l2norm_in_kernel=True, lengths=lengths)
        else:
            o, state = kda_kernels.chunk_kda(q, k, v, g, beta, initial_state=state_pool[layer, slots],
                                             output_final_state=True, use_qk_l2norm_in_kernel=True, lengths=lengths)
            state_pool = state_pool.at[layer, slots].set(state)
        return self._output(x, o), conv_state, state_pool
