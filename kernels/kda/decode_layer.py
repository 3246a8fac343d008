"""The KDA layer's decode step between its input projections and its output projection, in one Pallas (Triton)
kernel: one token per row, one program per (row, head).

In XLA the same step is ~13 kernels per layer at batch 1 (the conv-state gather, the q/k/v short convs, the f_b and
g_b projections, the gate and beta fusions, the recurrent step, the gated norm, the conv-state scatter: ~22 us of
GPU time per layer on the H200, benchmarks/NOTES_serving.md). A program here, for head h of row b:

1. short causal conv + SiLU of the head's q, k and v channels (`kernels.short_conv`): the last W - 1 inputs come
   from the conv cache at (layer, slot[b]), which it shifts in place;
2. the forget gate of the head's K channels from f_b (its [R, K] columns, R the low rank) applied to the row's f_a
   output, + dt_bias, then -exp(A_log) softplus (or the lower-bounded sigmoid form); beta = sigmoid(b);
3. the delta-rule step on the head's [K, V] state at (layer, slot[b]) of the state pool, in place: q and k
   l2-normalised, q scaled by K^-1/2, the output from the decayed state (`pallas._delta_step`);
4. the gated RMSNorm of the head's output (rounded to the activations' dtype first, as the model's is) with
   sigmoid(g_b applied to the row's g_a output).

Arithmetic is float32 throughout, rounded to the activations' dtype where the model's XLA path materialises a
16-bit tensor (the conv outputs, the f_b and g_b outputs, the recurrent output); XLA may keep more precision inside
its fusions (`xla_allow_excess_precision`), so the two agree to 16-bit rounding, not bit for bit. Rows of length 0
(padding) leave both caches as they were and output zeros. Needs K = V a power of two >= 16, the low rank R a power
of two >= 16, and 16-bit activations (`supported`). `reference` is the same step in jnp, for the tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .. import dispatch, projection, short_conv
from . import reference as kda_reference
from .pallas import _delta_step, _l2normalize, _params

# Whether CUDA runs this kernel by default: tests/gpu/test_kda_gpu.py's decode-layer cases pass on the H200 (jax 0.11.2,
# 2026-12-01), and the medium hybrid's decode step measured faster with it (benchmarks/NOTES_serving.md).
GPU_VERIFIED = True
# The model's launch width (`model.kda.KimiDeltaAttention.decode_in_place` passes it): 4 warps measured fastest on the
# H200 at batch 1, 16 and 64 against 2 and 8 (benchmarks/kda_decode_layer.py, NOTES_serving.md).
NUM_WARPS = 4


def _pow2_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def supported(heads: int, head_dim: int, value_dim: int, low_rank: int, conv_size: int, dtype) -> bool:
    """Whether the kernel takes this layer (see the module docstring)."""
    return (head_dim == value_dim and _pow2_16(head_dim) and _pow2_16(low_rank) and conv_size >= 2 and heads >= 1
            and jnp.dtype(dtype).itemsize == 2)


def choose(impl: str | None = None) -> str:
    """"pallas" / "interpret" where dispatch picks this kernel, else "reference"."""
    return dispatch.choose("kda_decode_layer", ("reference", "pallas"), impl, gpu_verified=GPU_VERIFIED)


def _projected_loader(refs, b, *, act, layout):
    """A function (index -> float32 values of row b) for one projection output: `layout` None: refs = (the array
    [B, N],); else (k_dim, eps, has_squares): refs = (the float32 partial sums [S, B, N], and their rows' squares
    [S, B] with a norm), added up, scaled by the norm's 1 / rms and rounded to `act` as `projection.finished`
    does. refs past the ones this output uses are returned with the function."""
    if layout is None:
        return (lambda index: refs[0][b, index].astype(jnp.float32)), refs[1:]
    k_dim, eps, has_squares = layout
    sums_ref = refs[0]
    slices = pl.ds(0, sums_ref.shape[0])
    scale = 1.0
    if has_squares:
        scale = jax.lax.rsqrt(jnp.sum(refs[1][slices, b]) / k_dim + eps)
    load = lambda index: (jnp.sum(sums_ref[slices, b, index], axis=0) * scale).astype(act).astype(jnp.float32)
    return load, refs[1 + has_squares:]


def _kernel(slot_ref, len_ref, *refs, layer, heads, head_dim, low_rank, width, scale, eps, lower_bound, act,
            qkv_layout, fgb_layout):
    b, h = pl.program_id(0), pl.program_id(1)
    qkv_at, refs = _projected_loader(refs, b, act=act, layout=qkv_layout)
    fgb_at, refs = _projected_loader(refs, b, act=act, layout=fgb_layout)
    (qw_ref, kw_ref, vw_ref, fb_ref, alog_ref, dtb_ref, gb_ref, norm_ref, conv_ref, pool_ref, o_ref, conv_out_ref,
     pool_out_ref) = refs
    dim = heads * head_dim
    rnd = lambda x: x.astype(act).astype(jnp.float32)  # where the model materialises a 16-bit tensor
    slot = slot_ref[b]
    live = len_ref[b] > 0
    c0 = pl.multiple_of(h * head_dim, head_dim)
    chans = pl.ds(c0, head_dim)
    state = pool_ref[layer, slot, h, :, :]  # first: its HBM read overlaps the conv and gate work below

    def conv(stream, w_ref):
        x = qkv_at(pl.ds(pl.multiple_of(stream * dim + c0, head_dim), head_dim))
        history = [conv_ref[layer, slot, stream, chans, j].astype(jnp.float32) for j in range(width - 1)]
        taps = history + [x]
        acc = sum(tap * w_ref[chans, j].astype(jnp.float32) for j, tap in enumerate(taps))
        for j in range(width - 1):  # the cache keeps the last W - 1 inputs; padding rows keep theirs
            conv_out_ref[layer, slot, stream, chans, j] = jnp.where(live, taps[j + 1], history[j]).astype(
                conv_out_ref.dtype)
        return rnd(acc * jax.nn.sigmoid(acc))

    def low_rank_up(offset, w_ref):  # [R] @ [R, K] columns of the head, rounded as the projection's output
        a = fgb_at(pl.ds(offset, low_rank))
        w = w_ref[pl.ds(0, low_rank), chans].astype(jnp.float32)
        return rnd(jnp.sum(a[:, None] * w, axis=0))

    q, k, v = conv(0, qw_ref), conv(1, kw_ref), conv(2, vw_ref)
    g = kda_reference.log_decay(low_rank_up(0, fb_ref) + dtb_ref[chans], alog_ref[h], lower_bound)
    beta = jax.nn.sigmoid(fgb_at(2 * low_rank + h))
    token = (_l2normalize(q), _l2normalize(k), v, jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0), live)
    state, o = _delta_step(state, token, scale, output_before_update=True)  # a padding row keeps its state
    pool_out_ref[layer, slot, h, :, :] = state
    o = rnd(o)

    gate = low_rank_up(low_rank, gb_ref)
    normed = o * jax.lax.rsqrt(jnp.sum(o * o) / head_dim + eps)
    out = norm_ref[...].astype(jnp.float32) * normed * jax.nn.sigmoid(gate)
    o_ref[b, chans] = out.astype(o_ref.dtype)


def _operands(projected: projection.Projected) -> tuple[list[jax.Array], tuple | None]:
    """A projection output's kernel operands and the static layout `_projected_loader` reads them with."""
    if not isinstance(projected, projection.Partials):
        return [projected], None
    squares = [] if projected.squares is None else [projected.squares]
    return [projected.sums, *squares], (projected.k_dim, projected.eps, bool(squares))


@functools.partial(jax.jit, static_argnames=("layer", "eps", "lower_bound", "num_warps", "interpret"))
def decode_step(qkv, fgb, conv_weights, f_b, a_log, dt_bias, g_b, norm_weight, conv_cache, state_pool, slots,
                lengths, *, layer: int, eps: float, lower_bound: float | None, num_warps: int = NUM_WARPS,
                interpret: bool = False):
    """One decode token per row through the KDA layer's conv, gates, recurrence and gated norm.

    qkv [B, 3 * H * K] (the q, k, v projections, concatenated), fgb [B, 2R + H] (the f_a and g_a projections and
    b_proj's output, concatenated), all of the activations' 16-bit dtype, or either as the `kernels.projection`
    `Partials` of that output (`project(finish=False)` with K split: each program adds up the columns it reads,
    as `projection.finished` would); conv_weights (q, k, v) [H * K, W] each; f_b, g_b [R, H * K]; a_log [H];
    dt_bias [H * K]; norm_weight [K] (the gated norm's); conv_cache [L, S, 3, H * K, W - 1] and state_pool
    [L, S, H, K, K] float32, both updated in place at (layer, slots[b]); slots [B] int32, lengths [B] int32 (0: a
    padding row). Returns (o [B, H * K] ready for o_proj, conv_cache, state_pool).
    """
    act = jnp.dtype(qkv.dtype)  # (a Partials' dtype is the one its sums round to)
    batch = qkv.sums.shape[1] if isinstance(qkv, projection.Partials) else qkv.shape[0]
    heads, head_dim = state_pool.shape[2], state_pool.shape[3]
    low_rank = f_b.shape[0]
    width = conv_weights[0].shape[1]
    if not supported(heads, head_dim, state_pool.shape[4], low_rank, width, act):
        raise ValueError(f"kda decode layer: heads {heads} x {head_dim}, low rank {low_rank}, conv {width}, "
                         f"{act} not supported")
    (qkv_ops, qkv_layout), (fgb_ops, fgb_layout) = _operands(qkv), _operands(fgb)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    inputs = [slots.astype(jnp.int32), lengths.astype(jnp.int32), *qkv_ops, *fgb_ops, *conv_weights, f_b,
              a_log.astype(jnp.float32), dt_bias.astype(jnp.float32), g_b, norm_weight, conv_cache, state_pool]
    return pl.pallas_call(
        functools.partial(_kernel, layer=layer, heads=heads, head_dim=head_dim, low_rank=low_rank, width=width,
                          scale=head_dim ** -0.5, eps=eps, lower_bound=lower_bound, act=act, qkv_layout=qkv_layout,
                          fgb_layout=fgb_layout),
        grid=(batch, heads),
        in_specs=[any_spec] * len(inputs),
        out_specs=[any_spec] * 3,
        out_shape=[jax.ShapeDtypeStruct((batch, heads * head_dim), act),
                   jax.ShapeDtypeStruct(conv_cache.shape, conv_cache.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={len(inputs) - 2: 1, len(inputs) - 1: 2},
        compiler_params=_params(num_warps),
        interpret=interpret,
        name="kda_decode_layer",
    )(*inputs)


def reference(qkv, fgb, conv_weights, f_b, a_log, dt_bias, g_b, norm_weight, conv_cache, state_pool, slots, lengths,
              *, layer: int, eps: float, lower_bound: float | None, conv_dtype=None):
    """`decode_step` in jnp from the model's own pieces (short_conv, the recurrent reference, the gated norm's
    math), for the tests: the same arguments and results. `conv_dtype` float32: the conv's arithmetic as the
    kernel does it (default: the activations' dtype, as the model)."""
    qkv, fgb = projection.finished(qkv), projection.finished(fgb)
    batch = qkv.shape[0]
    heads, head_dim = state_pool.shape[2], state_pool.shape[3]
    low_rank = f_b.shape[0]
    act = qkv.dtype
    streams, states = [], []
    for i, w in enumerate(conv_weights):
        x = qkv[:, None, i * heads * head_dim:(i + 1) * heads * head_dim]
        y, st = short_conv.causal_conv1d(x, w, conv_cache[layer, slots, i], activation="silu", lengths=lengths,
                                         compute_dtype=conv_dtype)
        streams.append(y.reshape(batch, 1, heads, head_dim))
        states.append(st)
    q, k, v = streams
    raw = (fgb[:, :low_rank] @ f_b).astype(act).astype(jnp.float32) + dt_bias.astype(jnp.float32)
    g = kda_reference.log_decay(raw.reshape(batch, 1, heads, head_dim), a_log.astype(jnp.float32)[:, None],
                                lower_bound)
    beta = jax.nn.sigmoid(fgb[:, None, 2 * low_rank:].astype(jnp.float32))
    o, state = kda_reference.fused_recurrent_kda(q, k, v, g, beta, initial_state=state_pool[layer, slots],
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                 lengths=lengths)
    o = o.astype(act).astype(jnp.float32)[:, 0]
    gate = (fgb[:, low_rank:2 * low_rank] @ g_b).astype(act).astype(jnp.float32).reshape(batch, heads, head_dim)
    normed = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
    out = norm_weight.astype(jnp.float32) * normed * jax.nn.sigmoid(gate)
    conv_cache = conv_cache.at[layer, slots].set(jnp.stack(states, axis=1).astype(conv_cache.dtype))
    return (out.reshape(batch, heads * head_dim).astype(act), conv_cache,
            state_pool.at[layer, slots].set(state))
