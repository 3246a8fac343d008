"""Pallas (Triton) grouped expert matmuls over MXFP4 or converted (FP8 / BF16) routed experts, and the MXFP4 ->
workspace conversion kernel.

`grouped_swiglu` runs one MoE layer's routed experts: pairs are grouped into one-expert row tiles (`moe_tiles`), a
gate/up kernel computes silu(x W_gate^T) * (x W_up^T) for each tile, a down kernel projects back, and the outputs are
combined per token. The grid is (row tiles, output-column tiles); a tile past the used ones exits at once, so a
decode step reads only the chosen experts' weights.

Conversion happens on each weight tile immediately before the MMA, in registers:
- the K axis is split into even and odd elements (the low and high nibbles of each byte), and the activations are
  split the same way outside the kernel, so out = x_even W_lo^T + x_odd W_hi^T needs no interleaving;
- an E2M1 nibble becomes an fp16 bit pattern: (mag << 9) | (sign << 15) reads as E2M1 * 2^-14 (0.5 lands on the
  fp16 subnormal 2^-15); an FP8 e4m3 byte likewise reads as its value * 2^-8. On the GPU a few PTX instructions build
  these for four bytes at once (`_E2M1_LO_PTX`, ...); in interpret mode jnp integer ops build the same bits;
- per weight row and K step (up to `max_groups` blocks of 32), blocks are rescaled by 2^(s - s_max) in fp16 and
  2^(s_max - 127) is applied to the fp32 partial sum after the dot. Exact while the scales of a row inside one K step
  span at most 9 binades (fp16 subnormals below that lose bits of the smaller blocks);
- the MMA runs in fp16 x fp16 -> fp32; activations are rounded to fp16 (11 significant bits, more than bf16) after a
  per-row power-of-two scaling that keeps them below 2^15, undone on the fp32 result.
The BF16 workspace format holds scaled bf16 values and runs a plain bf16 MMA.

Split-K (`Tiles.split_k` > 1, for decode): with one or a few tokens per expert the grid above has only
(active experts) x (column tiles) programs, each walking all of K serially: under one wave, latency-bound. Split-K
adds a third grid axis over contiguous ranges of K steps; each program writes its float32 partial sums (row factors
applied) for the tile's real rows only (padding rows are masked off, so the partials cost ~S x pairs x N x 4 bytes,
not S x padded rows). Small jnp passes then read back only the pairs' rows: gate/up sums its partials and applies
silu(gate) * up (the SwiGLU needs complete sums), gathered into the padded row layout for the down kernel (padding
rows zero); down sums its partials straight into per-pair outputs, which are weighted and combined per token.
No atomics: the result does not depend on the order programs run in.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import dispatch, moe_mxfp4_gemv, moe_tiles, tiles as tiling
from .mxfp4 import BLOCK, SCALE_NAN, ExpertWeights

_HALF = BLOCK // 2
_UNIT = {"mxfp4": 2.0 ** 14, "float8_e4m3fn": 2.0 ** 8}  # what the fp16 bit patterns are scaled down by


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and Triton launch parameters of the grouped matmuls (block dims powers of two, >= 16)."""

    block_m: int = 16
    block_n: int = 64
    max_groups: int = 8  # blocks of 32 per K step (the K of each dot is 16 * groups)
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 1  # > 1: K split over up to this many programs per output tile (see the module docstring)
    weights_as_a: bool = False  # the converted weights as the MMA's A operand (out^T = W x^T), the rows as its B
    # Load each K step's scales one step ahead (carried through the K loop). Triton's pipeline stages cover the
    # activations and weight bytes (async copies to shared memory) but not the scales: without this, every step
    # waits on a global load of its scales before it can convert (offline sm_90 build: an LDG in the loop body).
    prefetch_scales: bool = False


# Whether calls of 17-48 rows per active expert take their 32-row tiles with the weights as the MMA's A operand. On
# an H100 (benchmarks/moe.py --sweep many, 2026-12-06, forty-ninth session) the medium layer at 256 tokens (24 rows
# per expert) took 217.5 us against 268.4 with the rows as A; every other tile of the sweep was slower than these
# two (NOTES_moe.md). tests/gpu/test_mxfp4_gpu.py::test_many_row_tiles checks them against the reference.
WEIGHTS_AS_A_32_ROWS = True

# Whether calls of more rows per active expert (prefill) take 128-column tiles with the weights as the MMA's A
# operand: 64 rows up to 128 rows per expert, then 128 rows at 8 warps; else 64 x 64 tiles with the rows as A. On an
# H100 (moe.py --sweep many, 8192 tokens; NOTES_moe.md) the medium layer took 2844 / 2607 us with the 64- / 128-row
# wide tiles against 3429, the DeepSeek-size layer 31255 / 30038 against 39197; serving.py's TTFT (one H100, same
# machine, fiftieth session) 32.0 -> 29.7 ms at 2K and 1913 -> 1856 ms at 32K.
# tests/gpu/test_mxfp4_gpu.py::test_wide_prefill_tiles passed on the H100 (2026-12-06).
WIDE_PREFILL_TILES = True

# Calls of at most 16 rows per active expert (not split-K) into packed MXFP4 experts of at least this hidden size walk
# K in steps of 8 blocks of 32 instead of 4. On an H100 (moe.py --sweep decode16 / many, fiftieth session) the
# DeepSeek-size layer (hidden 7168) took 1760 against 1886 us at 16 tokens, 4270 against 4734 at 128 and 4354 against
# 4838 at 256 (8 rows per expert; 44.9% of read bandwidth from 40.8); the medium layer (hidden 2048) was as fast or
# slower with 8 (172 against 166 us at 64 tokens), so it keeps 4. FP8 experts (the workspace) keep 4, as timed. (The
# garbage the DeepSeek-size FP8 layer gave on the H100 with 8 blocks, fiftieth session, came from its unpadded
# 3.76e9-byte stacks, whose int32 offsets wrap at every tile shape: `tiles.offsets_wrap`, fifty-first session.)
LONG_K_MIN_HIDDEN = 4096

# Layer calls of at most this many token-expert pairs take split-K tiles (64 columns x 4 groups x 8 K splits,
# `choose_tiles`). On the H200 (benchmarks/moe.py --sweep split_k, 2026-12-01) the medium layer at 1 token ran
# 42.6 us with split-K tiles against 52.1 us for the 16-row tiles without splits;
# tests/gpu/test_mxfp4_gpu.py::test_split_k_decode_tiles passed on the H200 (2026-12-01, fourth and sixth sessions).
# 8: one decode token's top-k (medium top-6, DeepSeek top-8).
SPLIT_K_MAX_PAIRS = 8


def choose_tiles(n_pairs: int, n_experts: int, hidden: int = 0, fmt: str = "mxfp4") -> Tiles:
    """Tiles for a layer call of `n_pairs` token-expert pairs: 16-row tiles for decode-sized batches (the weights
    are read once per tile; fewer wasted rows), 32-row tiles up to 48 rows per active expert, then `prefill_tiles`
    (`WIDE_PREFILL_TILES`). Decode tiles (split-K at one token, 16 rows) load each K step's scales one step ahead:
    on the H200 (benchmarks/moe.py --sweep, 2026-12-01, sixth session) one token took 38.5 / 183 us (medium /
    DeepSeek-size layer) against 44.4 / 196 us for the best tiles without it, 16 tokens 146.6 / 1669 us against
    170.5 / 1710. `hidden` (the experts' input width) and `fmt` (their format) set the 16-row tiles' K step
    (`LONG_K_MIN_HIDDEN`)."""
    rows = n_pairs / max(1, min(n_experts, n_pairs))
    if n_pairs <= SPLIT_K_MAX_PAIRS:  # one token's experts: split K so enough programs stream the weights
        return Tiles(block_m=16, block_n=64, max_groups=4, num_stages=3, split_k=8, prefetch_scales=True)
    if rows <= 16:
        groups = 8 if fmt == "mxfp4" and hidden >= LONG_K_MIN_HIDDEN else 4
        return Tiles(block_m=16, block_n=64, max_groups=groups, num_stages=3, prefetch_scales=True)
    if rows <= 48:  # the weights as the MMA's A operand: its M is the tile's 64 columns (one wgmma warpgroup)
        return Tiles(block_m=32, block_n=64, max_groups=4, num_stages=3, weights_as_a=WEIGHTS_AS_A_32_ROWS)
    return prefill_tiles(rows, WIDE_PREFILL_TILES)


def prefill_tiles(rows: float, wide: bool) -> Tiles:
    """`choose_tiles`' tiles above 48 rows per active expert (`rows`): 64 x 64 with the rows as the MMA's A operand,
    or with `wide` (`WIDE_PREFILL_TILES`) 128 columns with the weights as A, 64 rows up to 128 rows per expert, then
    128 rows at 8 warps."""
    if not wide:
        return Tiles(block_m=64, block_n=64, max_groups=4, num_stages=3)
    if rows <= 128:
        return Tiles(block_m=64, block_n=128, max_groups=4, num_warps=4, num_stages=3, weights_as_a=True)
    return Tiles(block_m=128, block_n=128, max_groups=4, num_warps=8, num_stages=3, weights_as_a=True)



def _k_split(groups: int, tiles: Tiles) -> tuple[int, int]:
    """(groups per K step, K splits) of a kernel over `groups` blocks of 32: the splits are the largest divisor of
    the K step count not above `tiles.split_k`, so every program walks the same number of whole K steps."""
    gk = tiling.pow2_divisor(groups, tiles.max_groups)
    steps = groups // gk
    split = max(d for d in range(1, min(steps, max(1, tiles.split_k)) + 1) if steps % d == 0)
    return gk, split


def _plane(i: int):
    """A constant index as a traced int32 (a bare Python int trips masked-load discharge in interpret mode)."""
    return jnp.int32(i)


def _pow2_f32(e):
    """2^(e-127) as float32 from an int32 biased exponent e in [1, 254] (0 -> 0.0)."""
    return jax.lax.bitcast_convert_type(e << 23, jnp.float32)


def _f16(bits):
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)


def _nibbles_to_f16(b, asm: bool = False):
    """uint8 bytes -> (low, high) nibbles as fp16 E2M1 * 2^-14; `asm`: in PTX, four bytes per 32-bit word (Triton's
    own code handles one byte per register: ~5 integer instructions per value against ~1.4 here)."""
    if asm:  # one output per asm block (jax's lowering of multi-output asm returns one value); no work is shared
        f16 = [jax.ShapeDtypeStruct(b.shape, jnp.float16)]
        return tuple(pltriton.elementwise_inline_asm(ptx, args=[b], constraints="=r,=r,r", pack=4,
                                                     result_shape_dtypes=f16)[0]
                     for ptx in (_E2M1_LO_PTX, _E2M1_HI_PTX))
    b = b.astype(jnp.int32)
    lo = ((b & 0x7) << 9) | ((b & 0x8) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    return _f16(lo), _f16(hi)


def _e4m3_to_f16(b, asm: bool = False):
    """uint8 e4m3 bytes -> fp16 value * 2^-8 (exponent and mantissa fields move up unchanged); `asm` as above."""
    if asm:
        return pltriton.elementwise_inline_asm(_E4M3_PTX, args=[b], constraints="=r,=r,r", pack=4,
                                               result_shape_dtypes=[jax.ShapeDtypeStruct(b.shape, jnp.float16)])[0]
    b = b.astype(jnp.int32)
    return _f16(((b & 0x7F) << 7) | ((b & 0x80) << 8))


# The PTX forms: the input register holds four bytes B0..B3 (element 0 lowest), each output register two fp16
# (element 0 in the low half). Each value's high byte is built for all four bytes at once (shifts and masks on the
# whole word), then prmt spreads the bytes into the halves: [B1' 0 B0' 0] and [B3' 0 B2' 0] (e4m3 also fills the low
# bytes). Per four bytes: 6 / 5 instructions for the low / high nibbles, 7 for e4m3. Every read of the input comes
# before the first write of an output (an output may share its register).
_E2M1_LO_PTX = """{
.reg .b32 m, n;
shl.b32 m, $2, 1;
and.b32 m, m, 0x0E0E0E0E;
shl.b32 n, $2, 4;
and.b32 n, n, 0x80808080;
or.b32 m, m, n;
prmt.b32 $0, m, 0, 0x1404;
prmt.b32 $1, m, 0, 0x3424;
}"""
_E2M1_HI_PTX = """{
.reg .b32 m, n;
shr.b32 m, $2, 3;
and.b32 m, m, 0x0E0E0E0E;
and.b32 n, $2, 0x80808080;
or.b32 m, m, n;
prmt.b32 $0, m, 0, 0x1404;
prmt.b32 $1, m, 0, 0x3424;
}"""
_E4M3_PTX = """{
.reg .b32 h, l, n;
shr.b32 h, $2, 1;
and.b32 h, h, 0x3F3F3F3F;
and.b32 n, $2, 0x80808080;
or.b32 h, h, n;
shl.b32 l, $2, 7;
and.b32 l, l, 0x80808080;
prmt.b32 $0, l, h, 0x5140;
prmt.b32 $1, l, h, 0x7362;
}"""


def _scales(scale_ref, expert, c0, p, g0, gk, bn, wmask):
    """The E8M0 scales of weight rows [c0, c0+bn) (parity p), K groups [g0, g0+gk): int32 [bn, gk]."""
    return pltriton.load(scale_ref.at[expert, pl.ds(c0, bn), p, pl.ds(g0, gk)], mask=wmask[:, None],
                         other=0).astype(jnp.int32)


def _tile(fmt, data_ref, scale_ref, slot, expert, c0, p, g0, gk, bn, wmask, asm, s=None):
    """One K step of weight rows [c0, c0+bn) (parity p): (lo, hi) [bn, gk*16] in the MMA dtype and the per-row
    factor [bn] float32 to apply to their dot (None when the scale is already folded in); `asm`: convert in PTX;
    `s`: the step's scales when already loaded (`_scales`)."""
    rows, groups = pl.ds(c0, bn), pl.ds(g0, gk)
    m3 = wmask[:, None, None]
    if fmt == "bfloat16":
        lo = pltriton.load(data_ref.at[slot, rows, p, groups, _plane(0), :], mask=m3, other=0)
        hi = pltriton.load(data_ref.at[slot, rows, p, groups, _plane(1), :], mask=m3, other=0)
        return lo.reshape(bn, gk * _HALF), hi.reshape(bn, gk * _HALF), None
    if s is None:
        s = _scales(scale_ref, expert, c0, p, g0, gk, bn, wmask)
    if fmt == "mxfp4":
        lo, hi = _nibbles_to_f16(pltriton.load(data_ref.at[slot, rows, p, groups, :], mask=m3, other=0), asm)
    else:
        lo, hi = (_e4m3_to_f16(pltriton.load(data_ref.at[slot, rows, p, groups, _plane(i), :], mask=m3, other=0),
                               asm) for i in (0, 1))
    s_max = jnp.max(s, axis=1)
    rel = _pow2_f32(jnp.maximum(s - s_max[:, None] + 127, 0)).astype(jnp.float16)[:, :, None]
    lo = (lo * rel).reshape(bn, gk * _HALF)
    hi = (hi * rel).reshape(bn, gk * _HALF)
    factor = jnp.where(s_max == SCALE_NAN, jnp.nan, _pow2_f32(s_max) * _UNIT[fmt])
    return lo, hi, factor


def _dot_t(a, b):
    """a [m, k] . b [n, k]^T -> [m, n] float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _matmul_kernel(te_ref, ts_ref, rs_ref, x_ref, *refs, fmt, gated, bm, bn, gk, k_steps, col_tiles, n_valid,
                   n_out, split, asm, swap, prefetch):
    if split > 1:  # the rows' validity (1: a pair's row, 0: padding), then the weights
        rv_ref, refs = refs[0], refs[1:]
    per = 1 if fmt == "bfloat16" else 2
    n_w = 2 if gated else 1
    wrefs = [refs[i * per:(i + 1) * per] for i in range(n_w)]
    o_ref = refs[-1]
    t = pl.program_id(0)
    j = pl.program_id(1)
    q = pl.program_id(2) if split > 1 else 0  # the K split
    expert = te_ref[t]

    @pl.when(expert >= 0)
    def _():
        slot = ts_ref[t]
        p = j // col_tiles
        c0 = (j % col_tiles) * bn
        cols = c0 + jnp.arange(bn, dtype=jnp.int32)
        wmask = cols < n_valid
        r0 = pl.multiple_of(t * bm, bm)

        k0 = q * k_steps
        prefetch_now = prefetch and fmt != "bfloat16"

        def scales_at(kk):  # one tuple entry per projection
            g0 = (k0 + jnp.minimum(kk, k_steps - 1)) * gk
            return tuple(_scales(w[1], expert, c0, p, g0, gk, bn, wmask) for w in wrefs)

        def step(kk, carry):
            accs, s_now = carry
            if prefetch_now:
                s_next = scales_at(kk + 1)  # issued before this step's work; used by the next step
            g0 = (k0 + kk) * gk
            xl = x_ref[pl.ds(r0, bm), 0, pl.ds(g0 * _HALF, gk * _HALF)]
            xh = x_ref[pl.ds(r0, bm), 1, pl.ds(g0 * _HALF, gk * _HALF)]
            out = []
            for i, (w, acc) in enumerate(zip(wrefs, accs)):
                lo, hi, factor = _tile(fmt, w[0], w[1] if per == 2 else None, slot, expert, c0, p, g0, gk, bn, wmask,
                                       asm, s_now[i] if prefetch_now else None)
                # [bn, bm] with the weights as the A operand, else [bm, bn]
                d = _dot_t(lo, xl) + _dot_t(hi, xh) if swap else _dot_t(xl, lo) + _dot_t(xh, hi)
                if factor is not None:
                    d = d * (factor[:, None] if swap else factor[None, :])
                out.append(acc + d)
            return tuple(out), (s_next if prefetch_now else s_now)

        shape = (bn, bm) if swap else (bm, bn)
        accs, _ = jax.lax.fori_loop(0, k_steps, step, (tuple(jnp.zeros(shape, jnp.float32) for _ in range(n_w)),
                                                       scales_at(0) if prefetch_now else ()))
        if swap:
            accs = tuple(a.T for a in accs)
        rs = rs_ref[pl.ds(r0, bm)][:, None]
        if split > 1:  # partial sums of the pairs' rows: [split, R, projection, parity, n_out]
            mask = (rv_ref[pl.ds(r0, bm)] != 0)[:, None] & (cols < n_out)[None, :]
            for i, acc in enumerate(accs):
                pltriton.store(o_ref.at[q, pl.ds(r0, bm), _plane(i), p, pl.ds(c0, bn)], acc * rs,
                               mask=mask)
            return
        if gated:
            g, u = accs[0] * rs, accs[1] * rs
            y = g / (1.0 + jnp.exp(-g)) * u
        else:
            y = accs[0] * rs
        pltriton.store(o_ref.at[pl.ds(r0, bm), p, pl.ds(c0, bn)], y.astype(o_ref.dtype), mask=(cols < n_out)[None, :])


def _matmul(x_rows, row_scale, tile_expert, tile_slot, weights, *, fmt, gated, n_valid, n_out, parity, out_dtype,
            tiles: Tiles, interpret: bool, row_valid=None):
    """x_rows [R, 2, Kh] (MMA dtype), row_scale [R] f32, weights: per projection (data view, scales view or None)
    -> [R, parity, n_out] of out_dtype; with K split (`_k_split` > 1 and `row_valid` [R] int32 given): float32
    partial sums [split, R, projections, parity, n_out], row_scale applied, written only where row_valid != 0."""
    n_rows, _, kh = x_rows.shape
    gk, split = _k_split(kh // _HALF, tiles)
    if row_valid is None:
        split = 1
    col_tiles = pl.cdiv(n_out, tiles.block_n)
    kernel = functools.partial(_matmul_kernel, fmt=fmt, gated=gated, bm=tiles.block_m, bn=tiles.block_n, gk=gk,
                               k_steps=kh // _HALF // gk // split, col_tiles=col_tiles, n_valid=n_valid,
                               n_out=n_out, split=split, asm=dispatch.nvidia_ptx(interpret),
                               swap=tiles.weights_as_a, prefetch=tiles.prefetch_scales)
    flat = [a for w in weights for a in w if a is not None]
    grid = (n_rows // tiles.block_m, parity * col_tiles)
    if split > 1:
        out_shape = jax.ShapeDtypeStruct((split, n_rows, len(weights), parity, n_out), jnp.float32)
        grid, flat = grid + (split,), [row_valid] + flat
    else:
        out_shape = jax.ShapeDtypeStruct((n_rows, parity, n_out), out_dtype)
    return tiling.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=("moe_gate_up" if gated else "moe_down") + ("_split_k" if split > 1 else ""),
    )(tile_expert, tile_slot, row_scale, x_rows, *flat)


def mma_operand(v: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """v [R, 2, K] -> (v in the MMA dtype, per-row factor [R] float32 to multiply results by). For fp16 each row is
    scaled by a power of two that keeps it below 2^15 (exact; only rows with values >= 2^15 are scaled)."""
    if jnp.dtype(dtype) != jnp.float16:
        return v.astype(dtype), jnp.ones(v.shape[:1], jnp.float32)
    v = v.astype(jnp.float32)
    _, ex = jnp.frexp(jnp.max(jnp.abs(v), axis=(1, 2)))
    c = jnp.clip(ex.astype(jnp.int32) - 15, 0, 126)
    return (v * _pow2_f32(127 - c)[:, None, None]).astype(jnp.float16), _pow2_f32(127 + c)


def split_even_odd(x: jax.Array, groups: int) -> jax.Array:
    """x [T, K] -> [T, 2, groups*16]: zero-padded to groups*32 columns, even columns in plane 0, odd in plane 1."""
    t, k = x.shape
    x = jnp.pad(x, ((0, 0), (0, groups * BLOCK - k)))
    return x.reshape(t, groups * _HALF, 2).swapaxes(1, 2)


def _views(ew: ExpertWeights):
    """Kernel views: gate/up rows split by parity ([X, I/2, 2, ...]: output column c, parity p is row 2c + p, so the
    gate/up kernel writes the down kernel's even/odd split directly); down with a unit parity axis."""
    e_i = ew.intermediate_size

    def split(a):
        return None if a is None else a.reshape(a.shape[0], e_i // 2, 2, *a.shape[2:])

    def unit(a):
        return None if a is None else a.reshape(a.shape[0], a.shape[1], 1, *a.shape[2:])

    def as_bits(a):  # fp8 is read bytewise
        return jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype == jnp.float8_e4m3fn else a

    gate_up = [(split(as_bits(ew.gate)), split(ew.gate_scales)), (split(as_bits(ew.up)), split(ew.up_scales))]
    down = [(unit(as_bits(ew.down)), unit(ew.down_scales))]
    return gate_up, down


class Plan(NamedTuple):
    """A layer call's schedule and activations, ready for the kernels: the tile schedule, each tile's storage entry
    (tile_slot [tiles], -1 past the used ones), the rows' activations x_rows [R, 2, Kh] in the MMA dtype (even and odd
    columns split) and their power-of-two factors x_scale [R]."""

    sched: moe_tiles.Schedule
    tile_slot: jax.Array
    x_rows: jax.Array
    x_scale: jax.Array


def plan(x: jax.Array, topk_ids: jax.Array, ew: ExpertWeights, slot_of_expert: jax.Array | None, n_experts: int,
         tiles: Tiles) -> Plan:
    """Groups the pairs of topk_ids [T, k] by expert and gathers x [T, D] into the tiles' rows."""
    sched = moe_tiles.schedule(topk_ids, n_experts, tiles.block_m)
    tile_slot = sched.tile_expert
    if slot_of_expert is not None:
        tile_slot = jnp.where(tile_slot >= 0, slot_of_expert[jnp.maximum(tile_slot, 0)], -1)
    groups = ew.gate.shape[2]
    xk, xs = mma_operand(jnp.concatenate([split_even_odd(x, groups), jnp.zeros((1, 2, groups * _HALF), x.dtype)]),
                         _mma_dtype(ew))
    return Plan(sched, tile_slot, xk[sched.token_of_row], xs[sched.token_of_row])


def _mma_dtype(ew: ExpertWeights):
    return jnp.bfloat16 if ew.fmt == "bfloat16" else jnp.float16


def _split_k(ew: ExpertWeights, tiles: Tiles) -> bool:
    """Whether a layer call with these tiles takes the split-K path (either kernel's K splits)."""
    return tiles.split_k > 1 and max(_k_split(ew.gate.shape[2], tiles)[1], _k_split(ew.down.shape[2], tiles)[1]) > 1


def _gate_up(p: Plan, ew: ExpertWeights, out_dtype, common: dict, row_valid=None) -> jax.Array:
    """The gate/up kernel over the plan's rows (`_matmul`: SwiGLU applied, or float32 partial sums with row_valid)."""
    return _matmul(p.x_rows, p.x_scale, p.sched.tile_expert, p.tile_slot, _views(ew)[0], gated=True,
                   n_valid=ew.intermediate_size // 2, n_out=ew.down.shape[2] * _HALF, parity=2, out_dtype=out_dtype,
                   row_valid=row_valid, **common)


def _down(p: Plan, ew: ExpertWeights, h: jax.Array, common: dict, row_valid=None) -> jax.Array:
    """The down kernel over the hidden rows h [R, 2, I/2] (float32 out; partial sums with row_valid)."""
    hk, hs = mma_operand(h, _mma_dtype(ew))
    return _matmul(hk, hs, p.sched.tile_expert, p.tile_slot, _views(ew)[1], gated=False, n_valid=ew.hidden_size,
                   n_out=ew.hidden_size, parity=1, out_dtype=jnp.float32, row_valid=row_valid, **common)


def expert_pairs(p: Plan, ew: ExpertWeights, hidden_dtype, tiles: Tiles, interpret: bool = False) -> jax.Array:
    """The split-K path (`Tiles.split_k`): the two kernels with their K split, the partial sums reduced over the
    pairs' rows only -> per-pair outputs [T * k, D] float32 (pairs in topk_ids order)."""
    common = dict(fmt=ew.fmt, tiles=tiles, interpret=interpret)
    rows = p.sched.row_of_pair.reshape(-1)
    row_valid = p.sched.real_rows().astype(jnp.int32)
    if _k_split(ew.gate.shape[2], tiles)[1] > 1:
        gu = jnp.sum(_gate_up(p, ew, jnp.float32, common, row_valid)[:, rows], axis=0)  # [P, 2, parity, I/2]
        g, u = gu[:, 0], gu[:, 1]
        h_pairs = (g / (1.0 + jnp.exp(-g)) * u).astype(hidden_dtype)
        h = moe_tiles.take_or_zero(h_pairs, p.sched.pair_of_row())
    else:
        h = _gate_up(p, ew, hidden_dtype, common)
    if _k_split(ew.down.shape[2], tiles)[1] > 1:
        return jnp.sum(_down(p, ew, h, common, row_valid)[:, rows, 0, 0], axis=0)
    return _down(p, ew, h, common)[rows, 0]


def expert_rows(p: Plan, ew: ExpertWeights, hidden_dtype, tiles: Tiles, interpret: bool = False) -> jax.Array:
    """The two kernels: gate/up (with SwiGLU, h in `hidden_dtype`) then down -> per-row outputs [R, D] float32
    (with split-K tiles, through `expert_pairs`: padding rows zero)."""
    if _split_k(ew, tiles):
        pairs = expert_pairs(p, ew, hidden_dtype, tiles, interpret)
        rows = p.sched.row_of_pair.reshape(-1)
        return jnp.zeros((p.x_rows.shape[0], pairs.shape[1]), jnp.float32).at[rows].set(pairs)
    common = dict(fmt=ew.fmt, tiles=tiles, interpret=interpret)
    return _down(p, ew, _gate_up(p, ew, hidden_dtype, common), common)[:, 0, :]


def grouped_swiglu(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, ew: ExpertWeights,
                   slot_of_expert: jax.Array | None = None, n_experts: int | None = None,
                   tiles: Tiles | moe_mxfp4_gemv.GemvTiles | None = None, interpret: bool = False, *,
                   sched: moe_tiles.Schedule | None = None, x_words: tuple[jax.Array, jax.Array] | None = None,
                   shared: moe_mxfp4_gemv.SharedMLP | tuple[jax.Array, jax.Array, jax.Array] | None = None,
                   residual_sums: jax.Array | None = None) -> jax.Array:
    """Routed SwiGLU experts. x [T, D], topk_ids [T, k] int, topk_weights [T, k] -> [T, D] of x.dtype.

    `ew` holds the weights in any format; entry `slot_of_expert[e]` holds expert e (default: entry e). The
    intermediate size must be even. Decode-sized calls on packed MXFP4 experts run the CUDA-core kernels of
    `moe_mxfp4_gemv` where `moe_mxfp4_gemv.choose` takes them (or `tiles` is a `GemvTiles`); `sched` and `x_words`,
    made ahead for those (`moe_mxfp4_gemv.grouped_swiglu`), are unused by the MMA kernels; so is `shared`, a shared
    MLP folded into those kernels (`moe_mxfp4_gemv.SharedFold`), which the MMA kernels do not take; so are
    `residual_sums`, residual rows those kernels add into (then float32 [T, D] comes back).
    """
    if ew.intermediate_size % 2:
        raise ValueError(f"the experts' intermediate size ({ew.intermediate_size}) must be even")
    if n_experts is None:
        n_experts = slot_of_expert.shape[0] if slot_of_expert is not None else ew.gate.shape[0]
    if tiles is None and slot_of_expert is None:
        tiles = moe_mxfp4_gemv.choose(topk_ids.size, n_experts, ew.fmt)
    if isinstance(tiles, moe_mxfp4_gemv.GemvTiles):
        if slot_of_expert is not None or ew.fmt != "mxfp4":
            raise ValueError("GemvTiles run packed MXFP4 experts, not workspace slots or converted experts")
        return moe_mxfp4_gemv.grouped_swiglu(x, topk_ids, topk_weights, ew, n_experts, tiles, interpret,
                                             sched=sched, x_words=x_words, shared=shared, residual_sums=residual_sums)
    if shared is not None or residual_sums is not None:
        raise ValueError("a shared MLP and residual rows fold into the MXFP4 decode kernels only (GemvTiles), not "
                         "the MMA kernels")
    tiles = tiles or choose_tiles(topk_ids.size, n_experts, x.shape[-1], ew.fmt)
    p = plan(x, topk_ids, ew, slot_of_expert, n_experts, tiles)
    if _split_k(ew, tiles):
        pairs = expert_pairs(p, ew, x.dtype, tiles, interpret).reshape(*topk_ids.shape, -1)
        return moe_tiles.weighted_sum(pairs, topk_weights).astype(x.dtype)
    rows = expert_rows(p, ew, x.dtype, tiles, interpret)
    return moe_tiles.combine(rows, p.sched, topk_weights).astype(x.dtype)


# ------------------------------------------------------------------------------------------------ conversion


def _convert_kernel(need_ref, expert_ref, blocks_ref, scales_ref, ws_in_ref, ws_ref, *, fmt, br, gb, n_rows, asm):
    del ws_in_ref  # aliased with ws_ref: slots not converted here keep their contents
    s = pl.program_id(0)
    i = pl.program_id(1)
    kk = pl.program_id(2)

    @pl.when(need_ref[s] != 0)
    def _():
        e = expert_ref[s]
        rows, groups = pl.ds(i * br, br), pl.ds(kk * gb, gb)
        valid = (i * br + jnp.arange(br, dtype=jnp.int32)) < n_rows
        lo, hi = _nibbles_to_f16(pltriton.load(blocks_ref.at[e, rows, groups, :], mask=valid[:, None, None], other=0),
                                 asm)
        if fmt == "float8_e4m3fn":
            lo = (lo * _UNIT["mxfp4"]).astype(ws_ref.dtype)  # exact: E2M1 values fit e4m3
            hi = (hi * _UNIT["mxfp4"]).astype(ws_ref.dtype)
        else:
            sc = pltriton.load(scales_ref.at[e, rows, groups], mask=valid[:, None], other=0).astype(jnp.int32)
            f = jnp.where(sc == SCALE_NAN, jnp.nan, _pow2_f32(sc) * _UNIT["mxfp4"])[:, :, None]
            lo = (lo.astype(jnp.float32) * f).astype(ws_ref.dtype)
            hi = (hi.astype(jnp.float32) * f).astype(ws_ref.dtype)
        pltriton.store(ws_ref.at[s, rows, groups, _plane(0), :], lo, mask=valid[:, None, None])
        pltriton.store(ws_ref.at[s, rows, groups, _plane(1), :], hi, mask=valid[:, None, None])


def convert(ws: jax.Array, need: jax.Array, slot_expert: jax.Array, blocks: jax.Array, scales: jax.Array,
            block_rows: int = 64, max_groups: int = 8, interpret: bool = False) -> jax.Array:
    """Converts expert `slot_expert[s]` of packed `blocks` [E, N, n, 16] / `scales` [E, N, n] into workspace slot s
    of `ws` [S, N, n, 2, 16] (float8_e4m3fn or bfloat16) wherever need[s] != 0; other slots keep their contents
    (the workspace buffer is updated in place)."""
    n_slots, n_rows, groups = ws.shape[:3]
    gb = tiling.pow2_divisor(groups, max_groups)
    kernel = functools.partial(_convert_kernel, fmt=jnp.dtype(ws.dtype).name, br=block_rows, gb=gb, n_rows=n_rows,
                               asm=dispatch.nvidia_ptx(interpret))
    return tiling.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(ws.shape, ws.dtype),
        grid=(n_slots, pl.cdiv(n_rows, block_rows), groups // gb),
        input_output_aliases={4: 0},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="mxfp4_to_workspace",
    )(need.astype(jnp.int32), slot_expert.astype(jnp.int32), blocks, scales, ws)
