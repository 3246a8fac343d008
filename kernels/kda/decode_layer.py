"""The KDA layer's decode step between its input projections and its output projection, in one Pallas (Triton)
kernel: one token per row, one program per (row, head), or per (row, head, block of value columns) with
`value_split`.

In XLA the same step is ~13 kernels per layer at batch 1 (the conv-state gather, the q/k/v short convs, the f_b and
g_b projections, the gate and beta fusions, the recurrent step, the gated norm, the conv-state scatter: ~22 us of
GPU time per layer on the H200, benchmarks/NOTES_serving.md). A program here, for head h of row b:

1. short causal conv + SiLU of the head's q, k and v channels (`kernels.short_conv`): the last W - 1 inputs come
   from the conv cache at (layer, slot[b]), which it shifts in place;
2. the forget gate of the head's K channels from f_b (its [R, K] columns, R the low rank) applied to the row's f_a
   output (or read from the caller's f_a @ f_b: `low_rank_ups`), + dt_bias, then -exp(A_log) softplus (or the
   lower-bounded sigmoid form); beta = sigmoid(b);
3. the delta-rule step on the head's [K, V] state at (layer, slot[b]) of the state pool, in place: q and k
   l2-normalised, q scaled by K^-1/2, the output from the decayed state (`pallas._delta_step`);
4. the gated RMSNorm of the head's output (rounded to the activations' dtype first, as the model's is) with
   sigmoid(g_b applied to the row's g_a output).

With `value_split` P, a program takes K / P of the head's value columns: the delta rule treats each column of the
state apart, so only the conv of q and k and the gate over all K channels are repeated per block. The gated norm
then needs the other blocks' outputs (o_proj's kernel finishes it: `projection.HeadScaled`), and no block may shift
q's and k's conv inputs in place while the head's other blocks may still read them: the head's last block to finish
does, found by an atomic counter per (row, head) kept in the cache (`turns`), or, without counters, they go out
separately and XLA writes them into the cache after the kernel.

With `o_weight` (split, with the counters) the kernel runs o_proj too: each block multiplies its share of the output
by its rows of o_proj's weight, and the head's last block adds the head's products and scales them by the head's
1 / rms, so the step hands the next kernel one float32 partial sum of o_proj's output per head (`projection.Partials`)
and o_proj needs no kernel of its own.

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

from .. import atomics, dispatch, l2_prefetch, projection, short_conv, tiles as tiling
from . import reference as kda_reference
from .pallas import _delta_step, _l2normalize, _params

# Whether CUDA runs this kernel by default: tests/gpu/test_kda_gpu.py's decode-layer cases pass on the H200 (jax 0.11.2,
# 2026-12-01), and the medium hybrid's decode step measured faster with it (benchmarks/NOTES_serving.md).
GPU_VERIFIED = True
# The model's launch width (`model.kda.KimiDeltaAttention.decode_in_place` passes it): 4 warps measured fastest on the
# H200 at batch 1, 16 and 64 against 2 and 8 (benchmarks/kda_decode_layer.py, NOTES_serving.md); in the whole decode
# step on an H100 (2026-12-07, decode_profile.py --experts mxfp4) 8 warps still lose: 0.803-0.806 against 0.785 ms
# of kernels per token at batch 1, 2.187 against 2.134 at batch 16.
NUM_WARPS = 4
# Decode calls of at most `VALUE_SPLIT_MAX_ROWS` rows run each head as VALUE_SPLIT // rows programs of value columns
# (`decode_step(value_split=)`; ~128 programs for the medium hybrid's 16 heads): at batch 1 its 16 programs leave the
# GPU nearly idle (ncu on the H200, 2026-12-03: 12.3 us, 16 CTAs of 255 registers, one warp per scheduler, 183
# GB/s). On the H200 (seventeenth session; tests/gpu/test_kda_gpu.py -k value_split 6/6): the step kernel 11.2 ->
# 6.9 us per layer at batch 1 (8 blocks), the KDA layer 31.2 -> 29.2 us (kda_decode_layer.py: 1 row, 8 blocks;
# 2 rows 31.2 -> 29.2 with 4 blocks, 29.9 with 8; 4 rows 31.6 -> 31.4 with 4, 33.3 with 8), and the model's batch-1
# decode 1.158 -> 1.138 ms of kernels per token (pipelined 1.115 -> 1.090; decode_profile.py --set
# kernels.kda.decode_layer.VALUE_SPLIT=1 for the A/B). The XLA scatter of the q and k conv inputs after the kernel
# (1.2 us per layer) took part of what the split saves; with the cache's turn counters (`decode_step(turns=)`: each
# head's last block shifts them in place) batch 1 took 1.059 against 1.093 ms of kernels per token (221 kernels
# against 245; batch 2 1.396 against 1.431; decode_profile.py --set model.cache.TURN_ROWS=0 for the A/B, eighteenth
# session; tests/gpu/test_kda_gpu.py -k value_split passes, three calls in a row each). 1: off.
VALUE_SPLIT = 8
VALUE_SPLIT_MAX_ROWS = 2
# `decode_step(o_weight=)`: columns of o_proj's output per step of a block's product (a power-of-two divisor of the
# hidden size at most this), and whether each block asks its rows of the weight into L2 as it starts (the model
# passes it as `decode_step(o_prefetch=)`, a static argument, so a change takes effect at its next trace).
O_PROJ_CHUNK = 512
O_PROJ_PREFETCH = True
# Decode calls of at least this many rows hand the kernel f_a @ f_b and g_a @ g_b made by XLA over all rows
# (`decode_step(low_rank_ups=)`), instead of each (row, head) program loading the head's f_b and g_b columns (64 KB at
# the medium hybrid's 128 x 128 per head, as many bytes as its state) and reducing over them. 0: never. On the H200
# (medium hybrid, benchmarks/decode_profile.py, 2026-12-04, twentieth session): at batch 16 the step kernel 17.4 ->
# 12.3 us per layer, and 2.830 ms of kernels per token with the projection kernel at 16 rows against 2.854 without
# (XLA's two small matmuls take ~5 us of what the kernel saves); at batch 1 / 2 (threshold 1) 1.085 / 1.363 against
# 1.012 / 1.323: slower where the step is split over value blocks.
LOW_RANK_UPS_MIN_ROWS = 16
# `decode_step(hoist_loads=)`: every load that waits on no other (the conv taps and weights, the low-rank inputs and
# f_b's / g_b's columns, the gate and norm weights) is issued at the program's start, before any arithmetic, instead
# of where each is used. In the sm_90 build of the batch-1 step (benchmarks/triton_report.py --op kda --sass) the
# loads otherwise sit between the block-wide reductions' barriers, each group waiting its own round trip to memory
# (f_b's 32 KB per program arrive in ~5 batches of ~3 loads in flight). On the H100 (medium hybrid with MXFP4 experts,
# decode_profile.py --set kernels.kda.decode_layer.HOIST_LOADS=true, forty-sixth session; tests/gpu/test_kda_gpu.py -k
# load_order passes): the step 8.68 -> 6.98 us per layer, batch 1 0.857 -> 0.840 ms per token pipelined. That form
# still finished each projection output's partial sums (a sum across the program's threads) as it fetched them, so
# in the model's build (partial sums, `triton_report.py` "partial sums (the model's)") the loads came in five groups
# between barriers; they are now all fetched first and finished where used (`projection.partials_fetcher`): one
# group of loads before the first barrier in the offline sm_90 build, not yet measured on a GPU.
HOIST_LOADS = True
# `decode_step(low_rank_dot=)`: the f_a @ f_b and g_a @ g_b products of a program on the tensor cores (the row
# repeated to 16 rows, bf16 operands, float32 sums) instead of float32 FMAs and a reduction over R. Off: slower (the
# same runs: 8.92 us per layer with the loads hoisted; the sm_90 build at 4 warps takes 255 registers and spills).
LOW_RANK_DOT = False


def value_split(rows: int, head_dim: int) -> int:
    """The `decode_step(value_split=)` the model uses for a call of `rows` rows on heads of `head_dim` value
    columns: VALUE_SPLIT // rows, cut to a divisor of head_dim leaving blocks of at least 16 columns."""
    split = max(1, VALUE_SPLIT // rows) if rows <= VALUE_SPLIT_MAX_ROWS else 1
    while split > 1 and (head_dim % split or head_dim // split < 16):
        split -= 1
    return split


def _pow2_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def supported(heads: int, head_dim: int, value_dim: int, low_rank: int, conv_size: int, dtype) -> bool:
    """Whether the kernel takes this layer (see the module docstring)."""
    return (head_dim == value_dim and _pow2_16(head_dim) and _pow2_16(low_rank) and conv_size >= 2 and heads >= 1
            and jnp.dtype(dtype).itemsize == 2)


def choose(impl: str | None = None) -> str:
    """"pallas" / "interpret" where dispatch picks this kernel, else "reference"."""
    return dispatch.choose("kda_decode_layer", ("reference", "pallas"), impl, gpu_verified=GPU_VERIFIED)


def _projected_fetcher(refs, b, *, layout):
    """A function (index -> a function giving the float32 values of row b there) for one projection output: the
    loads are issued when it is called, the finishing arithmetic when the returned function is
    (`projection.partials_fetcher`). `layout` None: refs = (the array [B, N],); else a
    `projection.partials_operands` layout: refs = (the float32 partial sums [S, B, N], and their rows' squares
    [S, B] with a norm). refs past the ones this output uses are returned with the function."""
    n_refs = projection.operand_count(layout)
    fetch_output = projection.partials_fetcher(refs[:n_refs], b, layout)

    def fetch(index):
        finish = fetch_output(index)
        return lambda: finish().astype(jnp.float32)
    return fetch, refs[n_refs:]


def _kernel(slot_ref, len_ref, *refs, layer, heads, head_dim, low_rank, width, scale, eps, lower_bound, act,
            qkv_layout, fgb_layout, value_split, last_block_shifts, ups_given, o_chunk, prefetch, hoist_loads,
            low_rank_dot, interpret):
    b, h = pl.program_id(0), pl.program_id(1)
    part = pl.program_id(2)  # which of the head's `value_split` blocks of value columns (state columns) this is
    qkv_fetch, refs = _projected_fetcher(refs, b, layout=qkv_layout)
    if fgb_layout == "after_qkv":  # one projection output q|k|v|f_a|g_a|b: f_a|g_a|b start at column 3 * H * K
        offset = 3 * heads * head_dim
        fgb_fetch = lambda index: qkv_fetch(pl.ds(index.start + offset, index.size) if isinstance(index, pl.Slice)
                                            else index + offset)
    else:
        fgb_fetch, refs = _projected_fetcher(refs, b, layout=fgb_layout)
    qw_ref, kw_ref, vw_ref, fb_ref, alog_ref, dtb_ref, gb_ref, norm_ref, *refs = refs
    ups = ()  # (f_a @ f_b, g_a @ g_b) of all rows, where the caller made them
    if ups_given:
        ups, refs = refs[:2], refs[2:]
    ow_ref = None  # o_proj's weight [H * K, D], where the kernel runs o_proj too (`o_chunk`)
    if o_chunk:
        ow_ref, refs = refs[0], refs[1:]
    if last_block_shifts:
        refs = refs[1:]  # the turn counters' input: aliased with their output (in split_refs), not read
    conv_ref, pool_ref, o_ref, *split_refs, conv_out_ref, pool_out_ref = refs
    # split: the blocks' sums of o^2 [B, H * P], then the shifted q, k conv inputs [B, 2, H * K, W - 1] or, with
    # `last_block_shifts`, the turn counters [L, R, H]. With o_proj (`o_chunk`): o_ref is o_proj's per-head sums
    # [H, B, D], and the blocks' products [B, H, P, D] come before the squares
    squares_ref, qk_rows_ref, turns_ref, products_ref = None, None, None, None
    if o_chunk:
        products_ref, split_refs = split_refs[0], split_refs[1:]
    if split_refs:
        squares_ref, other = split_refs
        turns_ref, qk_rows_ref = (other, None) if last_block_shifts else (None, other)
    dim = heads * head_dim
    vb = head_dim // value_split
    rnd = lambda x: x.astype(act).astype(jnp.float32)  # where the model materialises a 16-bit tensor
    slot = slot_ref[b]
    live = len_ref[b] > 0
    c0 = pl.multiple_of(h * head_dim, head_dim)
    v0 = pl.multiple_of(part * vb, vb)  # the block's value columns within the head
    chans, values = pl.ds(c0, head_dim), pl.ds(pl.multiple_of(c0 + v0, vb), vb)
    # o_proj's output columns in steps of `o_chunk`; the block's rows of its weight are its value columns
    o_columns = [pl.ds(c, o_chunk) for c in range(0, ow_ref.shape[1], o_chunk)] if o_chunk else []
    if o_chunk and prefetch:  # those rows (contiguous) into L2 now: the product at the end reads them from there
        hidden = ow_ref.shape[1]
        l2_prefetch.prefetch_range(ow_ref, (c0 + v0) * hidden, vb * hidden * ow_ref.dtype.itemsize)
    state = pool_ref[layer, slot, h, :, pl.ds(v0, vb)]  # first: its HBM read overlaps the conv and gate work below

    def ahead(load):  # `hoist_loads`: the loads issued now, before any arithmetic; else where they are used
        if hoist_loads:
            values_ = load()
            return lambda: values_
        return load

    def fetch_taps(stream, cols, size):  # the channels' last W - 1 inputs from the cache; this token's, unfinished
        x = qkv_fetch(pl.ds(stream * dim + cols.start, size))
        return [conv_ref[layer, slot, stream, cols, j].astype(jnp.float32) for j in range(width - 1)], x

    def taps_of(fetched):  # the taps, this token's input finished
        cached, x = fetched
        return cached + [x()]

    def shift(taps, store):  # the cache keeps the last W - 1 inputs; padding rows keep theirs
        for j in range(width - 1):
            store(j, jnp.where(live, taps[j + 1], taps[j]))

    def store_into(ref, *index):  # store(j, value): ref[*index, j] = value
        def store(j, value):
            ref[(*index, j)] = value.astype(ref.dtype)
        return store

    def conv_inputs(stream, w_ref, cols, size):  # (the fetched taps, the conv's weights for the channels)
        return ahead(lambda: (fetch_taps(stream, cols, size),
                              [w_ref[cols, j].astype(jnp.float32) for j in range(width)]))

    def conv(stream, inputs, cols, store=True):  # -> (SiLU(conv) rounded, the taps)
        fetched, weights = inputs()
        taps = taps_of(fetched)
        acc = sum(tap * w for tap, w in zip(taps, weights))
        if store:  # in place
            shift(taps, store_into(conv_out_ref, layer, slot, stream, cols))
        return rnd(acc * jax.nn.sigmoid(acc)), taps

    def low_rank_inputs(offset, w_ref, cols):  # (the row's R low-rank values, the weight's [R, C] columns)
        if ups:  # f_a's at offset 0, g_a's at R: the caller's finished products, no weight
            return ahead(lambda: (projection.partials_fetcher([ups[offset // low_rank]], b, None)(cols), None))
        def load():  # the weight's columns first: finishing the row's values needs barriers
            w = w_ref[pl.ds(0, low_rank), cols]
            return fgb_fetch(pl.ds(offset, low_rank)), w
        return ahead(load)

    def low_rank_up(inputs):  # [R] @ [R, C], rounded as the projection's output
        a, w = inputs()
        a = a().astype(jnp.float32)
        if w is None:
            return a
        if low_rank_dot:  # on the tensor cores: the row repeated to a dot's 16 rows, the first kept (exactly)
            product = tiling.mm(jnp.broadcast_to(a.astype(w.dtype)[None, :], (16, low_rank)), w)
            first = jax.lax.broadcasted_iota(jnp.int32, product.shape, 0) == 0
            return rnd(jnp.sum(jnp.where(first, product, 0.0), axis=0))
        return rnd(jnp.sum(a[:, None] * w.astype(jnp.float32), axis=0))

    # the loads (issued here with `hoist_loads`, so one round trip to memory covers them all)
    q_in, k_in, v_in = (conv_inputs(0, qw_ref, chans, head_dim), conv_inputs(1, kw_ref, chans, head_dim),
                        conv_inputs(2, vw_ref, values, vb))
    f_in = low_rank_inputs(0, fb_ref, chans)
    decay_in = ahead(lambda: (dtb_ref[chans], alog_ref[h], fgb_fetch(2 * low_rank + h)))
    gate_in = low_rank_inputs(low_rank, gb_ref, values)
    weight_in = ahead(lambda: norm_ref[pl.ds(v0, vb)].astype(jnp.float32))

    # q and k over all of the head's key channels, v over the block's. Split, every block of a head reads all of
    # its q and k conv inputs, so none may shift them in place while another block could still read them: the
    # head's last block to finish does (`last_block_shifts`), or each block writes the shifted inputs of its share
    # of the channels (the block's value columns) to a separate output
    (q, q_taps), (k, k_taps) = (conv(i, inputs, chans, store=value_split == 1)
                                for i, inputs in ((0, q_in), (1, k_in)))
    v, _ = conv(2, v_in, values)
    if value_split > 1 and not last_block_shifts:  # (reloaded for the block's channels: no traced tap slices)
        for stream in (0, 1):
            shift(taps_of(fetch_taps(stream, values, vb)), store_into(qk_rows_ref, b, stream, values))
    dt_bias, a_log, b_in = decay_in()
    g = kda_reference.log_decay(low_rank_up(f_in) + dt_bias, a_log, lower_bound)
    beta = jax.nn.sigmoid(b_in())
    token = (_l2normalize(q), _l2normalize(k), v, jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0), live)
    state, o = _delta_step(state, token, scale, output_before_update=True)  # a padding row keeps its state
    pool_out_ref[layer, slot, h, :, pl.ds(v0, vb)] = state
    o = rnd(o)

    gate = jax.nn.sigmoid(low_rank_up(gate_in))
    weight = weight_in()
    if value_split == 1:
        normed = o * jax.lax.rsqrt(jnp.sum(o * o) / head_dim + eps)
        o_ref[b, chans] = (weight * normed * gate).astype(o_ref.dtype)
    else:  # the head's norm needs all its blocks: o_proj's loads scale by it (`projection.HeadScaled`), or with
        # o_proj here the head's last block scales the blocks' unscaled products
        y = weight * o * gate
        if o_chunk:
            for cols in o_columns:
                products_ref[b, h, part, cols] = jnp.sum(y[:, None] * ow_ref[values, cols].astype(jnp.float32), 0)
        else:
            o_ref[b, values] = y
        squares_ref[b, h * value_split + part] = jnp.sum(o * o)
    if last_block_shifts:
        # Count this block's turn once its q and k taps are used (the l2 norms and the delta step above reduce over
        # the whole program, so every warp has loaded them; the atomic is acquire-release): the head's last block
        # holds all of its q and k taps and shifts them in place, then resets the counter for the next call.
        turn = atomics.take_turn(turns_ref, (jnp.int32(layer), b, h), interpret=interpret)

        @pl.when(turn == value_split - 1)
        def _shift_head():
            for stream, taps in ((0, q_taps), (1, k_taps)):
                shift(taps, store_into(conv_out_ref, layer, slot, stream, chans))
            if o_chunk:  # o_proj's sums over the head: its blocks' products times the head's 1 / rms
                squares = squares_ref[b, pl.ds(pl.multiple_of(h * value_split, value_split), value_split)]
                head_scale = jax.lax.rsqrt(jnp.sum(squares) / head_dim + eps)
                for cols in o_columns:
                    o_ref[h, b, cols] = jnp.sum(products_ref[b, h, :, cols], axis=0) * head_scale
            turns_ref[layer, b, h] = jnp.int32(0)


def _operands(projected: projection.Projected) -> tuple[list[jax.Array], tuple | None]:
    """A projection output's kernel operands and the static layout `_projected_fetcher` reads them with."""
    if not isinstance(projected, projection.Partials):
        return [projected], None
    return projection.partials_operands(projected)


@functools.partial(jax.jit, static_argnames=("layer", "eps", "lower_bound", "num_warps", "value_split",
                                             "hoist_loads", "low_rank_dot", "o_prefetch", "interpret"))
def decode_step(qkv, fgb, conv_weights, f_b, a_log, dt_bias, g_b, norm_weight, conv_cache, state_pool, slots,
                lengths, *, layer: int, eps: float, lower_bound: float | None, num_warps: int = NUM_WARPS,
                value_split: int = 1, turns: jax.Array | None = None,
                low_rank_ups: tuple[jax.Array, jax.Array] | None = None, o_weight: jax.Array | None = None,
                hoist_loads: bool = True, low_rank_dot: bool = False, o_prefetch: bool = True,
                interpret: bool = False):
    """One decode token per row through the KDA layer's conv, gates, recurrence and gated norm.

    qkv [B, 3 * H * K] (the q, k, v projections, concatenated), fgb [B, 2R + H] (the f_a and g_a projections and
    b_proj's output, concatenated), all of the activations' 16-bit dtype, or either as the `kernels.projection`
    `Partials` of that output (`project(finish=False)` with K split: each program adds up the columns it reads,
    as `projection.finished` would); conv_weights (q, k, v) [H * K, W] each; f_b, g_b [R, H * K]; a_log [H];
    dt_bias [H * K]; norm_weight [K] (the gated norm's); conv_cache [L, S, 3, H * K, W - 1] and state_pool
    [L, S, H, K, K] float32, both updated in place at (layer, slots[b]); slots [B] int32, lengths [B] int32 (0: a
    padding row). Returns (o [B, H * K] ready for o_proj, conv_cache, state_pool), o being o_proj's output
    with `o_weight`. `fgb` None: qkv holds all six projections side by side [B, 3 * H * K + 2R + H] (one
    projection output, one XLA finishing fusion fewer).

    `value_split` P > 1: each head runs as P programs of K / P value columns (P times the programs, for batches too
    small to fill the GPU); the gated norm then cannot finish in a program, and o comes back as
    `projection.HeadScaled` (float32 weight * o * gate, and each block's sum of o^2), which o_proj's kernel (or
    `projection.finished`) scales by the head's 1 / rms. Every block reads all of its head's q and k conv inputs, so
    none may shift them in place while the others could still read them. With `turns` (int32 [L, R, H], R >= B,
    all zero: counters that the kernel leaves zero again; `model.cache`'s "kda_turns"), each block counts itself
    done with an atomic add at (layer, b, h) and the head's last block shifts its q and k inputs in place; the
    results are then (o, conv_cache, state_pool, turns). Without, the shifted q and k inputs go into the cache by
    an XLA scatter after the kernel (one kernel more per call). v's, each block's own, are shifted in place.

    `low_rank_ups` (f_up, g_up) [B, H * K] each, of the activations' dtype: the products f_a @ f_b and g_a @ g_b
    of the rows' f_a and g_a outputs, made by the caller (as the model's XLA path does: one small matmul over all
    rows, `low_rank_ups`); the kernel then reads them instead of multiplying by f_b's and g_b's head columns itself,
    which every (row, head) program would otherwise load (as many weight bytes as its state's).

    `hoist_loads` / `low_rank_dot`: see `HOIST_LOADS` / `LOW_RANK_DOT`, the model's choices (the same results, to
    float32 summation order for the dot).

    `o_weight` (o_proj's weight [H * K, D] of the activations' dtype; needs `value_split` > 1 and `turns`): the
    kernel runs o_proj too, and o comes back as its output unfinished, a `projection.Partials` of one slice per head
    (sums [H, B, D] float32, no squares; `finished` adds them up and rounds). Each block multiplies its float32
    weight * o * gate by its K / P rows of the weight (`O_PROJ_CHUNK` columns at a time, the rows asked into L2 as
    the program starts with `o_prefetch`), and the head's last block adds its blocks' products and scales them
    by the head's 1 / rms. The values go into the product unrounded: where o_proj's own kernel rounds each scaled
    value to the activations' dtype first (`projection.HeadScaled`), so the two agree to that rounding.
    """
    act = jnp.dtype(qkv.dtype)  # (a Partials' dtype is the one its sums round to)
    batch = qkv.sums.shape[1] if isinstance(qkv, projection.Partials) else qkv.shape[0]
    heads, head_dim = state_pool.shape[2], state_pool.shape[3]
    low_rank = f_b.shape[0]
    width = conv_weights[0].shape[1]
    if not supported(heads, head_dim, state_pool.shape[4], low_rank, width, act):
        raise ValueError(f"kda decode layer: heads {heads} x {head_dim}, low rank {low_rank}, conv {width}, "
                         f"{act} not supported")
    qkv_width = (qkv.sums if isinstance(qkv, projection.Partials) else qkv).shape[-1]
    if fgb is None and qkv_width != 3 * heads * head_dim + 2 * low_rank + heads:
        raise ValueError(f"kda decode layer: q|k|v|f_a|g_a|b of {qkv_width} columns for {heads} heads x {head_dim}, "
                         f"low rank {low_rank} (needs {3 * heads * head_dim + 2 * low_rank + heads})")
    if value_split < 1 or head_dim % value_split or head_dim // value_split < 16:
        raise ValueError(f"kda decode layer: value_split {value_split} does not cut {head_dim} value columns into "
                         "blocks of at least 16")
    last_block_shifts = turns is not None and value_split > 1
    if turns is not None and (turns.dtype != jnp.int32 or turns.ndim != 3 or turns.shape[0] <= layer
                              or turns.shape[1] < batch or turns.shape[2] != heads):
        raise ValueError(f"kda decode layer: turns {turns.dtype}{list(turns.shape)} for layer {layer}, {batch} rows, "
                         f"{heads} heads (needs int32 [L > layer, R >= rows, heads])")
    if low_rank_ups is not None and any(u.shape != (batch, heads * head_dim) or u.dtype != act for u in low_rank_ups):
        raise ValueError(f"kda decode layer: low_rank_ups {[f'{u.dtype}{list(u.shape)}' for u in low_rank_ups]} "
                         f"(needs two {act.name} [{batch}, {heads * head_dim}])")
    dim = heads * head_dim
    if o_weight is not None and (not last_block_shifts or o_weight.ndim != 2 or o_weight.shape[0] != dim
                                 or o_weight.dtype != act):
        raise ValueError(f"kda decode layer: o_weight {o_weight.dtype}{list(o_weight.shape)} (needs {act.name} "
                         f"[{dim}, D], a value_split above 1 ({value_split}) and turns "
                         f"({'given' if turns is not None else 'none'}))")
    o_chunk = 0 if o_weight is None else tiling.pow2_divisor(o_weight.shape[1], O_PROJ_CHUNK)
    (qkv_ops, qkv_layout), (fgb_ops, fgb_layout) = _operands(qkv), (([], "after_qkv") if fgb is None
                                                                     else _operands(fgb))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    inputs = [slots.astype(jnp.int32), lengths.astype(jnp.int32), *qkv_ops, *fgb_ops, *conv_weights, f_b,
              a_log.astype(jnp.float32), dt_bias.astype(jnp.float32), g_b, norm_weight, *(low_rank_ups or ()),
              *([o_weight] if o_chunk else []), *([turns] if last_block_shifts else []), conv_cache, state_pool]
    split = value_split > 1
    if o_chunk:  # o_proj's per-head sums, then the blocks' products
        hidden = o_weight.shape[1]
        first = [jax.ShapeDtypeStruct((heads, batch, hidden), jnp.float32),
                 jax.ShapeDtypeStruct((batch, heads, value_split, hidden), jnp.float32)]
    else:
        first = [jax.ShapeDtypeStruct((batch, dim), jnp.float32 if split else act)]
    outputs = [*first,
               *([jax.ShapeDtypeStruct((batch, heads * value_split), jnp.float32),  # the blocks' sums of o^2
                  jax.ShapeDtypeStruct(turns.shape, turns.dtype) if last_block_shifts  # the turn counters
                  else jax.ShapeDtypeStruct((batch, 2, dim, width - 1), conv_cache.dtype)]  # shifted q, k inputs
                 if split else []),
               jax.ShapeDtypeStruct(conv_cache.shape, conv_cache.dtype),
               jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)]
    aliases = {len(inputs) - 2: len(outputs) - 2, len(inputs) - 1: len(outputs) - 1}
    if last_block_shifts:
        aliases[len(inputs) - 3] = len(first) + 1
    o, *split_outs, conv_cache, state_pool = tiling.pallas_call(
        functools.partial(_kernel, layer=layer, heads=heads, head_dim=head_dim, low_rank=low_rank, width=width,
                          scale=head_dim ** -0.5, eps=eps, lower_bound=lower_bound, act=act, qkv_layout=qkv_layout,
                          fgb_layout=fgb_layout, value_split=value_split, last_block_shifts=last_block_shifts,
                          ups_given=low_rank_ups is not None, o_chunk=o_chunk,
                          prefetch=o_prefetch and l2_prefetch.available(interpret), hoist_loads=hoist_loads,
                          low_rank_dot=low_rank_dot, interpret=interpret),
        grid=(batch, heads, value_split),
        in_specs=[any_spec] * len(inputs),
        out_specs=[any_spec] * len(outputs),
        out_shape=outputs,
        input_output_aliases=aliases,
        compiler_params=_params(num_warps),
        interpret=interpret,
        name="kda_decode_layer",
    )(*inputs)
    if o_chunk:
        split_outs = split_outs[1:]  # (the blocks' products: the kernel's own scratch)
        o = projection.Partials(o, None, dim, float(eps), act.name)
    if split:
        squares, other = split_outs
        if not o_chunk:
            o = projection.HeadScaled(o, squares, head_dim, float(eps), act.name)
        if last_block_shifts:
            turns = other
        else:
            conv_cache = conv_cache.at[layer, slots, :2].set(other)  # after the kernel: no block reads them any more
    return (o, conv_cache, state_pool) if turns is None else (o, conv_cache, state_pool, turns)


def low_rank_ups(fgb: jax.Array, f_b: jax.Array, g_b: jax.Array,
                 after_qkv: bool = False) -> tuple[jax.Array, jax.Array]:
    """`decode_step(low_rank_ups=)`'s operands: (f_a @ f_b, g_a @ g_b) [B, H * K] in fgb's dtype, from a finished
    f_a|g_a|b output fgb [B, 2R + H] (`after_qkv`: the six projections side by side, q|k|v first, as `decode_step`
    takes them with fgb None) and f_b, g_b [R, H * K]; two small XLA matmuls over all rows, as the reference makes
    them."""
    low_rank, dim = f_b.shape
    start = 3 * dim if after_qkv else 0
    fa, ga = fgb[:, start:start + low_rank], fgb[:, start + low_rank:start + 2 * low_rank]
    return (fa @ f_b).astype(fgb.dtype), (ga @ g_b).astype(fgb.dtype)


def reference(qkv, fgb, conv_weights, f_b, a_log, dt_bias, g_b, norm_weight, conv_cache, state_pool, slots, lengths,
              *, layer: int, eps: float, lower_bound: float | None, conv_dtype=None):
    """`decode_step` in jnp from the model's own pieces (short_conv, the recurrent reference, the gated norm's
    math), for the tests: the same arguments and results. `conv_dtype` float32: the conv's arithmetic as the
    kernel does it (default: the activations' dtype, as the model)."""
    qkv = projection.finished(qkv)
    heads, head_dim = state_pool.shape[2], state_pool.shape[3]
    if fgb is None:  # all six side by side
        qkv, fgb = qkv[:, :3 * heads * head_dim], qkv[:, 3 * heads * head_dim:]
    fgb = projection.finished(fgb)
    batch = qkv.shape[0]
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
    f_up, g_up = low_rank_ups(fgb, f_b, g_b)
    raw = f_up.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    g = kda_reference.log_decay(raw.reshape(batch, 1, heads, head_dim), a_log.astype(jnp.float32)[:, None],
                                lower_bound)
    beta = jax.nn.sigmoid(fgb[:, None, 2 * low_rank:].astype(jnp.float32))
    o, state = kda_reference.fused_recurrent_kda(q, k, v, g, beta, initial_state=state_pool[layer, slots],
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                 lengths=lengths)
    o = o.astype(act).astype(jnp.float32)[:, 0]
    gate = g_up.astype(jnp.float32).reshape(batch, heads, head_dim)
    normed = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
    out = norm_weight.astype(jnp.float32) * normed * jax.nn.sigmoid(gate)
    conv_cache = conv_cache.at[layer, slots].set(jnp.stack(states, axis=1).astype(conv_cache.dtype))
    return (out.reshape(batch, heads * head_dim).astype(act), conv_cache,
            state_pool.at[layer, slots].set(state))
