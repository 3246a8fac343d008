"""MXFP4 routed experts at decode sizes as matrix-vector products on the CUDA cores (no MMA).

At one or two tokens per expert a decode step streams the active experts' packed weights once and does ~1 FLOP per
weight per token: the tensor cores have nothing to gain, while feeding them costs the MMA path (`moe_mxfp4`) a trip
of every converted tile through shared memory into the MMA operand layout (~4.3 SASS instructions per weight, a
quarter to two fifths of HBM bandwidth on the H200). Here each thread converts the bytes it loaded and multiplies
them in registers:

- a thread holds one MX block (16 bytes: 32 weights, one E8M0 scale) of one weight row per item; the E2M1 nibbles
  become fp16 bit patterns (E2M1 * 2^-14) in PTX, four bytes at a time, and `fma.rn.f16x2` multiplies them into the
  rows' activations (fp16 pairs in the order the conversion yields, `_word_elements`), summing the block's 32
  products in fp16 (16 per lane); the block sum goes to float32, times the row's factor (2^(s - 127) times the
  activations' scale), into a float32 accumulator. Activations are scaled by a power of two to a maximum in
  [2^13, 2^14), so products stay normal fp16 numbers (|product| < 6, a block sum < 96): with
  `GemvTiles.pack_in_kernel` each program scales and packs every MX block of its own K slice from the raw rows
  (no XLA pass before the kernels); otherwise XLA packs the rows first, one scale per row (`row_scaled_words`).
  Where its programs are 32 columns wide (one MX block of h each) and pack their input or split K, the gate/up
  kernel writes h already packed for the down kernel (`GemvTiles.pack_hidden`: each block scaled on its own, as
  words the down kernel loads like XLA's).
- `rows` (1, 2 or 4) token rows of one expert share each converted block (tiles of `moe_tiles.schedule` with
  block_m = rows; with `GemvTiles.adaptive` a tile multiplies only the rows it holds); accumulator column r of each
  item holds row r (pack semantics of the inline asm, below).
- grid (tiles, weight-row blocks, K splits). The gate/up kernel writes h = silu(gate) * up (the activations'
  dtype) at the tile's rows: directly with one K split, else each split stores its float32 sums apart and the last
  program of each weight-row block (a turn counter, `atomics.take_turn`) adds them up and applies SwiGLU. The down
  kernel adds weight * (h @ down) into each token's float32 sums by atomics, into zeros that the gate/up kernel
  wrote (no XLA zero fill between the kernels). What is left outside the kernels: the turn counters' zero fill
  (split K or a shared MLP; none where an earlier kernel wrote them: `Schedule.turns`, the MoE front kernel at one
  token), the schedule (static at one token) and the final cast.
- a shared MLP (bf16) can ride along in 1-row tiles (`grouped_swiglu(shared=)`, `SharedFold`): each part of I
  columns runs as SHARED_QUARTERS pseudo-experts over a quarter of K (a bf16 weight is ~3.8x an MXFP4 one's bytes,
  so their programs stream about a routed program's bytes), whose weight rows are read in the activations' word
  order and multiplied in float32; the quarters' gate/up sums meet in the partials, and each quarter's down
  programs read the h columns the last of them wrote into its row. A batch-1 MoE layer is then the front kernel
  and these two.

In interpret mode (and on platforms without inline PTX) the same kernel runs a jnp form of the block products
(float32 sums), so CPU tests check the indexing, schedule and epilogues; the fp16 arithmetic is checked on a GPU
(tests/gpu/test_mxfp4_gpu.py) against the float64 oracle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import atomics, dispatch, moe_tiles, tiles as tiling
from .moe_dense_fused import add_to_tokens
from .mxfp4 import BLOCK, ExpertWeights, pow2, scale_value

_BYTES = BLOCK // 2  # bytes per MX block
_UNIT = 2.0 ** 14  # the fp16 bit patterns of E2M1 read as value * 2^-14
_TOP = 14  # activations are scaled to a row maximum in [2^(_TOP-1), 2^_TOP)
ROWS = (1, 2, 4)


@dataclass(frozen=True)
class GemvTiles:
    """Launch shape of the decode kernels: `rows` token rows per tile (one expert), `block_n` weight rows per
    program, up to `max_groups` MX blocks of K per loop step; K is split over up to `split_k` programs, as far as
    needed for `min_programs` programs per kernel. `adaptive`: each tile multiplies its blocks into only as many rows
    as it holds (1, 2 or 4 of `rows`), so a tall tile costs a short one's instructions where its expert has fewer
    tokens. `num_stages`: Triton's software pipelining of the K loop's loads (1: none; each step loads, then
    multiplies, and other programs on the SM hide the wait). `pack_in_kernel`: each program scales (per MX block)
    and packs its own K slice of the raw activations, so no XLA pass runs between the routing and the two kernels;
    else XLA packs each kernel's input rows first (one scale per row: a reduction and a transpose fusion each).
    `pack_hidden`: where the gate/up kernel's programs are 32 columns wide (`_launch`) and either pack their own
    input (`pack_in_kernel`) or split K (a block's last program finishes it), each block of h is written packed for
    the down kernel (fp16 halves in word order and the block's factor), so no packing runs between the kernels; else
    h goes out as values (packed by the down kernel's programs with `pack_in_kernel`, by XLA without). H200
    (moe.py, 16 tokens, 2-row tiles, twenty-seventh session): the medium layer (K split in 2) 74.94 -> 71.78 us of
    GPU time (the kernels +1.1 us, XLA's three packing kernels gone); the DeepSeek-size layer, whose 8192 gate/up
    programs each finish their own block, 755 -> 806 us (gate/up 504 -> 545, down 239 -> 254), so unsplit calls of
    XLA-packed input keep XLA's packing of h."""

    rows: int = 1
    block_n: int = 32
    max_groups: int = 8
    split_k: int = 8
    num_warps: int = 4
    min_programs: int = 2048
    adaptive: bool = False
    num_stages: int = 1
    pack_in_kernel: bool = False
    pack_hidden: bool = True

    def __post_init__(self):
        if self.num_stages < 1:
            raise ValueError(f"GemvTiles.num_stages must be at least 1, got {self.num_stages}")
        if self.rows not in ROWS:
            raise ValueError(f"GemvTiles.rows must be one of {ROWS}, got {self.rows}")
        for name in ("block_n", "max_groups", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvTiles.{name} must be a power of two, got {v}")


# Layer calls whose active experts average at most this many token rows take these kernels (`choose`); the MMA
# kernels of moe_mxfp4 run the rest. H200 (benchmarks/moe.py, 2026-12-02, GPU time of the layer call, tiles of 1 or 2
# rows): DeepSeek-size layer at 1 / 16 / 32 / 64 / 96 tokens (1.0 / 1.3 / 1.6 / 2.4 / 3.2 rows per active expert)
# 75 / 790 / 1447 / 2321 / 3157 us against the MMA kernels' 169 / 1562 / 2474 / 3336 / 3678; the medium layer at 16
# / 32 tokens (1.9 / 3.0 rows) 79 / 110 against 119 / 131 us, at 64 tokens (6 rows) 185 against 137 us.
MAX_ROWS_PER_EXPERT = 3.5


def rows_per_active_expert(n_pairs: int, n_experts: int) -> float:
    """Token rows an active expert gets on average when `n_pairs` pairs pick among `n_experts` experts uniformly
    (E (1 - (1 - 1/E)^P) experts active): 1 for one token's distinct top-k, 1.27 for 16 tokens x top-8 of 256
    (101 active)."""
    active = n_experts * (1.0 - (1.0 - 1.0 / n_experts) ** n_pairs) if n_experts > 1 else 1.0
    return n_pairs / max(1.0, active)


# Programs a one- or two-token call's kernels are split over K for (`tiles_for`; the medium hybrid's gate/up kernel
# runs 2 splits of 2 K steps, each row block finished by its last program behind a fence and a counter; a smaller
# number leaves it unsplit, 4 K steps in a row per program). A module constant so decode_profile.py --set tries others.
ONE_TOKEN_MIN_PROGRAMS = 512


def tiles_for(n_pairs: int, n_experts: int) -> GemvTiles:
    """Tiles for a layer call of `n_pairs` token-expert pairs: 1-row tiles where active experts have about one row
    (`rows_per_active_expert`), else 2-row tiles that multiply a single-row tile's blocks once (`adaptive`); 32
    weight rows per program, 16 MX blocks per K step. Up to 16 pairs (one or two tokens' experts) each program packs
    its own activations (`pack_in_kernel`) and K is split only as far as 512 programs need (the DeepSeek-size gate/up
    kernel's 512 programs run unsplit, under one wave at the 79 registers of the GPU build; the medium layer's 144
    split in 4); larger calls take XLA's packed rows. The gate/up kernel writes h packed for the down kernel where
    its programs pack their input or split K (`pack_hidden`).

    H200, benchmarks/moe.py, GPU time of the layer call (2026-12-04, DeepSeek-size / medium layer at one token):
    these tiles 67.65 / 10.63 us (2 tokens 123.4 / 15.9); in the sweep before them, K split for 2048 programs 69.3 us
    (gate/up 46.6, down 20.8) against 66.9 (44.3 / 20.9) unsplit; more loads in flight per program did not help (8
    blocks per step with two or four steps' loads issued together: gate/up 52 us; 16 blocks, two steps: 46.8; the
    next step's activations loaded ahead: 46.0). Earlier the same day (split for 2048): 32 x 16 69.2 / 10.7 us; 16
    weight rows x 32 blocks per step 68.7 / 11.7 (h not packed by the gate/up kernel: its programs are 16 columns
    wide); 32 x 32 73.5 / 10.9 (the gate/up kernel at 203 registers; before h was packed there 68.0 / 11.1); XLA's
    packing 74.2 / 16.8. At 16 and 64 tokens in-kernel packing loses (DeepSeek-size 827 / 2445 us against 754 /
    2162 with adaptive 2-row tiles: each program's packing, ~15% more instructions, costs more than XLA's passes).
    Earlier (2026-12-02, chained time): 16 tokens 794 us with adaptive 2-row tiles against 824 (1-row) and 877
    (2-row), 970 with 8 blocks per step; 32 / 64 tokens 1333 / 2224 us against 1436 / 2373 (2-row) and 1501 / 2757
    (1-row); adaptive 4-row tiles slower (1613 / 2462)."""
    if rows_per_active_expert(n_pairs, n_experts) <= 1.1:
        if n_pairs <= 16:  # K split only where fewer than 512 programs would run (under one wave)
            return GemvTiles(rows=1, block_n=32, max_groups=16, min_programs=ONE_TOKEN_MIN_PROGRAMS,
                             pack_in_kernel=True)
        return GemvTiles(rows=1, block_n=32, max_groups=16)
    return GemvTiles(rows=2, block_n=32, max_groups=16, adaptive=True)


def choose(n_pairs: int, n_experts: int, fmt: str) -> GemvTiles | None:
    """The decode kernels' tiles for a layer call, or None where the MMA kernels of moe_mxfp4 run it (other formats,
    or more rows per active expert than MAX_ROWS_PER_EXPERT)."""
    if fmt != "mxfp4" or rows_per_active_expert(n_pairs, n_experts) > MAX_ROWS_PER_EXPERT:
        return None
    return tiles_for(n_pairs, n_experts)


# ------------------------------------------------------------------------------------------------ activations


def _word_elements(n_blocks: int) -> jax.Array:
    """int32 [n_blocks, 16]: the offset (from the first of n_blocks consecutive MX blocks) of the element that lane 0
    of each block's word w holds; lane 1 holds the element two further on. Word 4j + 2p + b packs the elements
    8j + 4b + p (lane 0) and 8j + 4b + 2 + p (lane 1): the order in which the PTX conversion of the block's weight
    bytes 4j..4j+3 (byte i: elements 2i, 2i + 1) yields its fp16 pairs."""
    w = jax.lax.broadcasted_iota(jnp.int32, (n_blocks, 16), 1)
    g = jax.lax.broadcasted_iota(jnp.int32, (n_blocks, 16), 0)
    return g * BLOCK + 8 * (w >> 2) + 4 * (w & 1) + ((w >> 1) & 1)


def _exponent(peak: jax.Array) -> jax.Array:
    """frexp's exponent of float32 `peak` (>= 0), clipped to [-100, 100] (zero: -100)."""
    return jnp.clip(((jax.lax.bitcast_convert_type(peak, jnp.int32) >> 23) & 0xFF) - 126, -100, 100)


def _fp16_halves(v: jax.Array, e: jax.Array) -> jax.Array:
    """float32 v times 2^(14 - e) (e broadcastable to v), rounded to fp16 -> its bits, int16."""
    return jax.lax.bitcast_convert_type((v * pow2(_TOP - e)).astype(jnp.float16), jnp.int16)


def _join_halves(lane0: jax.Array, lane1: jax.Array) -> jax.Array:
    """Two int16 fp16 bit patterns per word (lane 0 low) -> uint32."""
    return jax.lax.bitcast_convert_type((lane0.astype(jnp.int32) & 0xFFFF) | (lane1.astype(jnp.int32) << 16),
                                        jnp.uint32)


def _pack_words(lane0: jax.Array, lane1: jax.Array, e: jax.Array) -> jax.Array:
    """Activations in word order (lane0 / lane1 float32 [..., 16], `_word_elements`) times 2^(14 - e) (e
    broadcastable to [..., 1]), rounded to fp16, two per word (lane 0 low) -> uint32 [..., 16]."""
    return _join_halves(_fp16_halves(lane0, e), _fp16_halves(lane1, e))


def _halves_order(n: int) -> jax.Array:
    """int32 [n] (n a multiple of 32): where element c of each block goes in the block's 32 halves in word order
    (half 2w + lane of word w; the inverse of `_word_elements`)."""
    c = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
    return (c & ~31) + 2 * (4 * ((c >> 3) & 3) + 2 * (c & 1) + ((c >> 2) & 1)) + ((c >> 1) & 1)


def _block_words(lane0: jax.Array, lane1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One MX block's activations in word order (lane0 / lane1 float32 [..., 16]) -> (words uint32 [..., 16],
    factor float32 [...]): the block scaled by a power of two to a maximum in [2^13, 2^14) (`_pack_words`); `factor`
    undoes the scaling. Plain jnp: the kernels run it on their own K slices (`GemvTiles.pack_in_kernel`)."""
    e = _exponent(jnp.maximum(jnp.max(jnp.abs(lane0), axis=-1), jnp.max(jnp.abs(lane1), axis=-1)))
    return _pack_words(lane0, lane1, e[..., None]), pow2(e - _TOP)


def _lanes(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """v [N, K] -> its MX blocks in word order (lane 0, lane 1), float32 [N, G, 16] each (K zero-padded)."""
    n, k = v.shape
    groups = -(-k // BLOCK)
    v = jnp.pad(v.astype(jnp.float32), ((0, 0), (0, groups * BLOCK - k)))
    elements = _word_elements(groups)
    return v[:, elements], v[:, elements + 2]


def block_scaled_words(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """v [N, K] -> (words uint32 [N, G, 16], factor float32 [N, G]), G = ceil(K / 32): each MX block scaled on its
    own, what the kernels pack from their K slices with `GemvTiles.pack_in_kernel` (in XLA here, for tests)."""
    return _block_words(*_lanes(v))


def row_scaled_words(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """v [N, K] -> (words uint32 [N, G, 16], factor float32 [N]): each row scaled by one power of two to a maximum
    in [2^13, 2^14), packed by XLA for the kernels without `GemvTiles.pack_in_kernel`."""
    lane0, lane1 = _lanes(v)
    e = _exponent(jnp.max(jnp.abs(v.astype(jnp.float32)), axis=1))
    return _pack_words(lane0, lane1, e[:, None, None]), pow2(e - _TOP)


def row_halves(v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """In a kernel (or plain jnp): one row v float32 [K] (K a multiple of 32) packed as `row_scaled_words` packs it
    -> (positions int32 [K], halves int16 [K], factor float32 []): element c's fp16 half belongs at positions[c] of
    the row's K halves, which `halves_as_words` reads as the row's words."""
    e = _exponent(jnp.max(jnp.abs(v)))
    return _halves_order(v.shape[0]), _fp16_halves(v, e), pow2(e - _TOP)


def _unpack_words(words):
    """words uint32 [..., 16] -> (even, odd) fp16 [..., 16]: the activations of each byte's low / high nibble."""
    h = jax.lax.bitcast_convert_type(words, jnp.float16)  # [..., 16, 2]
    h = h.reshape(*words.shape[:-1], 4, 2, 2, 2)  # [j, parity, b, lane]
    return h[..., 0, :, :].reshape(*words.shape), h[..., 1, :, :].reshape(*words.shape)


# ------------------------------------------------------------------------------------------------ block products

def _conversion(word: str, low: tuple[str, str], high: tuple[str, str]) -> list[str]:
    """moe_mxfp4's PTX conversion of the four bytes in register `word` into fp16 pairs: low nibbles into the
    registers `low`, high nibbles into `high` (scratch registers m, n)."""
    from .moe_mxfp4 import _E2M1_HI_PTX, _E2M1_LO_PTX

    out = []
    for ptx, (r0, r1) in ((_E2M1_LO_PTX, low), (_E2M1_HI_PTX, high)):
        body = [ln.strip() for ln in ptx.strip().strip("{}").split("\n")]
        out += [ln.replace("$2", word).replace("$0", r0).replace("$1", r1) for ln in body
                if ln and not ln.startswith(".reg")]
    return out


# One MX block of one weight row against `rows` activation rows, for the inline asm (pack = 16 elements of every
# operand per instance): $0..$15 the accumulators (tied to the inputs $16..$31; column r < rows gets row r's block
# product times row r's factor), $32..$35 the block's 16 bytes, then 16 activation words per row, then each row's
# factor (the weight block's scale times the activation block's, 16 copies of one value per row). Per four bytes: the
# E2M1 -> fp16 conversion of moe_mxfp4 (low and high nibbles, two fp16 per register, `_conversion`), then one fp16x2
# product per row and register.
@functools.cache
def _block_ptx(rows: int) -> str:
    x0 = 36  # first activation operand
    fac = x0 + 16 * rows
    lines = ["{", ".reg .b32 m, n, l0, l1, h0, h1;", ".reg .b32 " + ", ".join(f"a{r}" for r in range(rows)) + ";",
             ".reg .b16 u, v;", ".reg .f32 e, f;"]
    for j in range(4):
        lines += _conversion(f"${32 + j}", ("l0", "l1"), ("h0", "h1"))
        for r in range(rows):
            xs = [f"${x0 + 16 * r + 4 * j + m}" for m in range(4)]
            first = f"mul.rn.f16x2 a{r}, l0, {xs[0]};" if j == 0 else f"fma.rn.f16x2 a{r}, l0, {xs[0]}, a{r};"
            lines += [first, f"fma.rn.f16x2 a{r}, l1, {xs[1]}, a{r};", f"fma.rn.f16x2 a{r}, h0, {xs[2]}, a{r};",
                      f"fma.rn.f16x2 a{r}, h1, {xs[3]}, a{r};"]
    for r in range(rows):
        lines += [f"mov.b32 {{u, v}}, a{r};", "cvt.f32.f16 e, u;", "cvt.f32.f16 f, v;", "add.f32 e, e, f;",
                  f"fma.rn.f32 ${r}, e, ${fac + 16 * r}, ${r};"]
    lines.append("}")
    return "\n".join(lines)


def _constraints(rows: int) -> str:
    return ",".join(["=f"] * 16 + [str(i) for i in range(16)] + ["r"] * 4 + ["r"] * (16 * rows) + ["f"] * (16 * rows))


def _block_products(acc, w, xs, facs, asm: bool):
    """acc f32 [bn, gk, 16] + (block products of the weight bytes w uint8 [bn, gk, 16] with each activation row
    xs[r] uint32 [gk, 16], times facs[r] f32 [bn, gk]) in column r."""
    shape = w.shape
    if asm:
        args = ([acc, w] + [jnp.broadcast_to(x[None], shape) for x in xs]
                + [jnp.broadcast_to(f[:, :, None], shape) for f in facs])
        return pltriton.elementwise_inline_asm(_block_ptx(len(xs)), args=args, constraints=_constraints(len(xs)),
                                               pack=16, result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)]
                                               )[0]
    from .moe_mxfp4 import _nibbles_to_f16  # the jnp form of the same conversion

    lo, hi = (a.astype(jnp.float32) for a in _nibbles_to_f16(w))
    col = jax.lax.broadcasted_iota(jnp.int32, shape, 2)
    for r, (x, fac) in enumerate(zip(xs, facs)):
        xe, xo = (a.astype(jnp.float32)[None] for a in _unpack_words(x))
        dot = jnp.sum(lo * xe + hi * xo, axis=2) * fac  # [bn, gk]
        acc = acc + jnp.where(col == r, dot[:, :, None], 0.0)
    return acc


# ------------------------------------------------------------------------------------------------ shared MLP

# Pseudo-experts per part of the shared MLP folded into the decode kernels (`SharedFold`), and MX blocks of K per
# step of their products. H200 (medium hybrid with MXFP4 experts, benchmarks/decode_profile.py at batch 1, 2026-12-04):
# 4 quarters 0.886 / 0.896 ms per token pipelined in two calls, 2 quarters 0.987, 8 quarters 0.914 (against 0.923
# with the shared MLP apart); the K split set by the routed tiles alone instead of all tiles: 0.894.
SHARED_QUARTERS = 4
SHARED_STEP_BLOCKS = 4
# Rows of down per step of the shared MLP's down projection where the gate/up kernel runs it (`SharedFold.down_cols`).
SHARED_DOWN_ROWS = 32
# Decode kernels of 1-row tiles whose programs walk at most this many K steps issue every step's loads (weight
# blocks, scales, activations) before the first step's products (`_kernel(hoist=)`), instead of one step's loads per
# loop iteration, each behind the last step's products and their barriers: one round trip to memory where there were
# as many as steps. Per role; 0: never. The medium hybrid's one-token down kernel walks 3 steps of 8 MX blocks (46 ->
# 65 registers in the sm_90 build, every program of its grid still resident at once). On the H100 (decode_profile.py
# --experts mxfp4, forty-seventh session, one machine): batch 1 0.824 -> 0.820 ms per token pipelined, the down kernel
# 5.20 -> 5.00 us per MoE layer. The gate/up kernel hoisted (2 steps of 16 blocks; 124 -> 168 registers, so 3
# programs per SM for its 480 where 4 ran) went 9.97 -> 10.33 us: off. At 16 tokens (2-row tiles, which the constants
# leave alone) the down kernel hoisted took 23.17 against 22.81 us. The DeepSeek-size one-token down kernel (4 steps
# of 16 blocks) is left out: hoisted, its sm_90 build takes 187 registers against 94 (2 programs per SM where 5 ran,
# for 1792 programs); correct on the GPU (tests/gpu/test_mxfp4_gpu.py -k hoisted), its time not measured.
DOWN_HOIST_MAX_STEPS = 3
GATE_UP_HOIST_MAX_STEPS = 0


class SharedFold(NamedTuple):
    """The shared MLP (bf16 gate / up [H, S], down [S, H]) run by the decode kernels' programs beside the routed
    experts (`grouped_swiglu(shared=)`): each of its S / I parts of I intermediate columns runs as `quarters`
    pseudo-experts, numbered n_routed + part * quarters + quarter after the routed experts and chosen by every token
    with weight 1. In the gate/up kernel pseudo-expert (part, quarter) multiplies the part's I columns of gate and up
    over that quarter of K (the hidden size), and the quarters' sums meet in the partials (the last program of a
    column block adds them up and applies SwiGLU); in the down kernel it multiplies its quarter of the part's h
    columns, which the gate/up kernel wrote into its own row, by those rows of down. A bf16 weight is ~3.8x an MXFP4
    one's bytes, so a quarter of K gives a pseudo-expert's programs about a routed program's bytes. `width`: the
    flat weight's row length (S for gate / up, H for down); `blocks`: MX blocks of K per pseudo-expert; one tile per
    pseudo-expert and token (1-row tiles), `tiles_per_part` (the call's tokens) apart in the schedule.
    `front_parts` > 0 (gate/up, one token): the gate and up sums come made already, float32 [front_parts, 2, S] in
    parts of K to add up (`kernels.moe_front.front(shared=)`), in place of the weights: quarter 0's programs of each
    part add them up and write h, the other quarters' programs do nothing; with `front_scaled` the added-up sums are
    multiplied by a float32 factor [1] given after them (`ScaledSums`). With `down_cols` > 0 as well the gate/up
    kernel runs the shared MLP's down projection too, from those sums (`_shared_down`: each program of a
    pseudo-expert's tile takes `down_cols` of the `hidden` output columns over its share of the quarter's rows of
    down, SwiGLU applied to the sums as it reads them, adding into the token's float32 sums; both set by
    `hidden_rows`, which knows the grid), and the down kernel's fold is `skip`: its pseudo-experts' tiles do
    nothing."""

    n_routed: int
    quarters: int
    part_inter: int
    width: int
    blocks: int
    tiles_per_part: int
    front_parts: int = 0
    front_scaled: bool = False
    down_cols: int = 0
    hidden: int = 0
    skip: bool = False

    def part_and_quarter(self, expert):
        """Pseudo-expert `expert`'s (part of the shared MLP, quarter of K) (traced ints)."""
        pseudo = expert - self.n_routed
        return pseudo // self.quarters, pseudo % self.quarters


class ScaledSums(NamedTuple):
    """A shared MLP's gate / up sums made ahead that still need one factor: sums float32 [F, 2, S] in F parts of K
    (of the unnormalised row, `kernels.moe_front.SharedProducts.row_part`) and scale float32 [1] (the row's 1 / rms);
    the gate/up kernel multiplies their total by it."""

    sums: jax.Array
    scale: jax.Array


class SharedMLP(NamedTuple):
    """A shared-expert MLP for `grouped_swiglu(shared=)`: gate [H, S], up [H, S], down [S, H] bf16, and optionally
    its gate / up sums for the call's one token made already (float32 [F, 2, S] in F parts of K, or `ScaledSums`:
    `kernels.moe_front.front(shared=)`), which the gate/up kernel then finishes instead of streaming gate and up;
    with `down_in_gate_up` as well (and residual rows to add into), the gate/up kernel also runs its down projection
    from those sums (`SharedFold.down_cols`), so the down kernel streams the routed experts alone."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_up_sums: jax.Array | ScaledSums | None = None
    down_in_gate_up: bool = False


# `down_in_gate_up` picks the kernels' form, so it stays static where a SharedMLP crosses a jit boundary
jax.tree_util.register_pytree_node(SharedMLP, lambda s: (tuple(s[:4]), s.down_in_gate_up),
                                   lambda down_in_gate_up, arrays: SharedMLP(*arrays, down_in_gate_up))


def _half_values(bits: jax.Array) -> jax.Array:
    """uint32 holding fp16 bit patterns in their low 16 bits -> float32."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def _shared_products(fold: SharedFold, role: str, s_refs, x_ref, factor_ref, x_form: str, row, ok, expert, c0, q,
                     bn: int, split: int, k_valid: int, step_blocks: int):
    """A shared pseudo-expert's products in one program (`SharedFold`): row `row` of the activations (in `x_form`,
    as `_kernel` reads them) times weight columns c0 .. c0 + bn of the flat bf16 refs `s_refs` (gate, up or down)
    over this program's K split `q` of the pseudo-expert's K -> [[sums float32 [bn] per ref]] (one row). The weight
    rows are read in the activations' word order (`_word_elements`), so the packed words multiply as they are."""
    piece, quarter = fold.part_and_quarter(expert)
    per = fold.blocks // split  # blocks of K in this program
    gs = tiling.pow2_divisor(per, step_blocks)
    if role == "gate_up":  # x is the hidden size: this quarter's K
        x_g0 = quarter * fold.blocks + q * per
        w_g0, col = x_g0, piece * fold.part_inter + c0
    else:  # x is this pseudo-expert's row of h, its columns from 0; the weight rows are the part's quarter
        x_g0 = q * per
        w_g0, col = piece * (fold.part_inter // BLOCK) + quarter * fold.blocks + x_g0, c0
    cols = col + jax.lax.broadcasted_iota(jnp.int32, (1, 1, bn), 2)

    def step(s, accs):
        words, factor = _activation_fetcher(x_ref, factor_ref, x_form, row, ok, x_g0 + s * gs, gs, k_valid)()
        factor = factor_ref[row] if factor is None else factor[:, None]
        lane0 = (_half_values(words & 0xFFFF) * factor)[:, :, None]
        lane1 = (_half_values(words >> 16) * factor)[:, :, None]
        elements = ((w_g0 + s * gs) * BLOCK + _word_elements(gs))[:, :, None]
        out = []
        for acc, ref in zip(accs, s_refs):
            w0 = ref[elements * fold.width + cols].astype(jnp.float32)
            w1 = ref[(elements + 2) * fold.width + cols].astype(jnp.float32)
            out.append(acc + jnp.sum(jnp.sum(lane0 * w0 + lane1 * w1, axis=0), axis=0))
        return tuple(out)

    zeros = tuple(jnp.zeros((bn,), jnp.float32) for _ in s_refs)
    return [list(jax.lax.fori_loop(0, per // gs, step, zeros))]


# ------------------------------------------------------------------------------------------------ kernel


def _activation_fetcher(x_ref, factor_ref, x_form: str, row, ok, g0, gk: int, k_valid: int):
    """Row `row` of the activations over MX blocks g0 .. g0 + gk as `_kernel` reads them in `x_form`, in two phases:
    the loads are issued here, and the returned function finishes them -> (words uint32 [gk, 16], each block's
    factor float32 [gk]; or None for "rows", whose one factor per row, factor_ref[row], the caller applies). The raw
    form (x_ref [X, K], any float dtype) is packed in the finish (`_block_words`), with zeros where `ok` is false (a
    padding row) and past K: its reductions across the program's threads would hold later loads behind barriers."""
    if x_form == "raw":
        elements = g0 * BLOCK + _word_elements(gk)
        row = jnp.minimum(row, x_ref.shape[0] - 1)
        lanes = []
        for element in (elements, elements + 2):
            v = x_ref[row, jnp.minimum(element, k_valid - 1)].astype(jnp.float32)
            lanes.append(jnp.where(ok & (element < k_valid), v, 0.0))
        return lambda: _block_words(*lanes)
    words = x_ref[row, pl.ds(g0, gk), :]
    factors = None if x_form == "rows" else factor_ref[row, pl.ds(g0, gk)]
    return lambda: (words, factors)


def _kernel(tile_ref, src_ref, x_ref, *refs, role, rows, widths, bn, gk, k_steps, split, n_valid, k_valid, n_src,
            top_k, n_tokens, x_form, h_form, h_dtype, asm, interpret, zero_chunk=0, sums_dim=0,
            shared: SharedFold | None = None, shared_steps: tuple[int, int], hoist: bool = False):
    """One program: `rows` token rows of one expert (tile t) x `bn` weight rows (block j) x one K split (q).

    The activations (`x_form`): "raw" rows x_ref [X, K] that each program packs; "rows", XLA's `row_scaled_words`
    (x_ref the words [X, G, 16], then their factors [X]); "blocks", the same words with a factor per MX block
    (then factors [X, G]: the gate/up kernel's packed h).
    role "gate_up": x_ref [T, D] the tokens, src_ref [R] each row's token (T: padding); writes h = silu(gate) * up
    (rounded to `h_dtype`) at the tile's rows, as values [R, I] (`h_form` "values") or packed (`h_form` "halves",
    bn = 32: a program's columns are one MX block of h; int16 [R, G * 32], each block's fp16 halves in word order,
    and float32 [R, G], its factor; two halves make a word of "blocks" input): directly with one K split, else each
    split stores its float32 sums into partials [S, R, 2, I'] and takes a turn on a counter per (tile, block), whose
    last program adds the S partials up and finishes the block. With `zero_chunk` > 0 the programs of tile 0 also
    write zeros over the down kernel's sums (one output of `zero_chunk` floats per (block, split)), so no XLA zero
    fill runs between the kernels.
    role "down": x_ref = h [R, I] (row r reads its own row), src_ref [R] each row's pair (P: padding); adds
    weight * down(h) into the tokens' flat sums [(T + 1) * D' (+ padding)] float32 (`moe_dense_fused.add_to_tokens`;
    D' = `sums_dim`, the weight rows in whole blocks) by atomics (pair p: token p // top_k).
    `shared` (`SharedFold`): tiles of experts E .. E + P - 1 run the shared MLP's pseudo-experts from its bf16
    weights (flat refs after the routed ones; `_shared_products`); their gate/up sums always go through the partials
    and turn counters, since the Q pseudo-experts of one part finish its SwiGLU together; `shared_steps`: their MX
    blocks of K per step of the products and rows of down per step of the down projection (`SHARED_STEP_BLOCKS`,
    `SHARED_DOWN_ROWS`, read by `_call`, so a kernel's trace depends on its arguments alone); `hoist`: the K loop
    unrolled with every step's loads issued before the first step's products (`DOWN_HOIST_MAX_STEPS`,
    `GATE_UP_HOIST_MAX_STEPS`; the same sums in the same order)."""
    factor_ref = None
    if x_form != "raw":
        factor_ref, *refs = refs
    if shared is None or shared.skip:
        n_shared = 0
    elif role == "gate_up":  # the weights (gate, up), or the front's sums (and down, which runs here)
        n_shared = 1 + shared.front_scaled + bool(shared.down_cols) if shared.front_parts else 2
    else:
        n_shared = 1
    if role == "gate_up":
        w_refs, s_refs = refs[:4], refs[4:4 + n_shared]
        # aliased inputs: the turn counters (split K or a shared MLP), and the token sums the shared down adds into
        n_aliased = (split > 1 or shared is not None) + bool(shared is not None and shared.down_cols)
        outs = refs[4 + n_shared + n_aliased:]
        n_h = 2 if h_form == "halves" else 1
        h_refs, outs = outs[:n_h], outs[n_h:]
        zero_ref, finish_refs = (outs[0], outs[1:]) if zero_chunk else (None, outs)
        if shared is not None and shared.down_cols:  # (partials, token sums, turn counters)
            finish_refs, sums_ref = (finish_refs[0], finish_refs[2]), finish_refs[1]
    else:
        pair_weight_ref, *w_refs = refs[:3]
        s_refs = refs[3:3 + n_shared]
        sums_ref = refs[-1]
    n_proj = len(w_refs) // 2
    t, j, q = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert = tile_ref[t]
    c0 = j * bn
    cmask = c0 + jnp.arange(bn, dtype=jnp.int32) < n_valid
    src = [src_ref[t * rows + r] for r in range(rows)]
    real = [s < n_src for s in src]

    def products(width):
        """The K loop over the tile's first `width` rows -> their sums [width][n_proj] float32 [bn]."""
        x_rows = src[:width] if role == "gate_up" else [t * rows + r for r in range(width)]

        def fetch(kk):  # step kk's loads: the weights' blocks and scales, then the rows' activations
            g0 = (q * k_steps + kk) * gk
            groups = pl.ds(g0, gk)
            ws = [pltriton.load(w_refs[2 * i].at[expert, pl.ds(c0, bn), groups, :], mask=cmask[:, None, None],
                                other=0) for i in range(n_proj)]
            ss = [pltriton.load(w_refs[2 * i + 1].at[expert, pl.ds(c0, bn), groups], mask=cmask[:, None], other=0)
                  for i in range(n_proj)]
            rows_x = [_activation_fetcher(x_ref, factor_ref, x_form, row, ok, g0, gk, k_valid)
                      for row, ok in zip(x_rows, real)]
            return ws, ss, rows_x

        def multiply(accs, fetched):
            ws, ss, rows_x = fetched
            # ("rows": the rows' factors applied after the loop)
            loaded = [finish() for finish in rows_x]
            xs = [words for words, _ in loaded]
            factors = None if x_form == "rows" else [f[None, :] for _, f in loaded]
            out = []
            for acc, w, s in zip(accs, ws, ss):
                scale = scale_value(s.astype(jnp.int32))
                facs = [scale] * width if x_form == "rows" else [scale * f for f in factors]
                out.append(_block_products(acc, w, xs, facs, asm))
            return tuple(out)

        zeros = tuple(jnp.zeros((bn, gk, _BYTES), jnp.float32) for _ in range(n_proj))
        accs = tiling.fetched_steps(k_steps, fetch, hoist)(multiply, zeros)
        col = jax.lax.broadcasted_iota(jnp.int32, (bn, gk, _BYTES), 2)
        units = [_UNIT * factor_ref[row] if x_form == "rows" else _UNIT for row in x_rows]
        return [[jnp.sum(jnp.sum(jnp.where(col == r, acc, 0.0), axis=2), axis=1) * units[r] for acc in accs]
                for r in range(width)]

    def write_hidden(row, col, g, u, mask):
        """h = silu(g) * u (float32 [bn]) into h's row `row` at columns col .. col + bn."""
        h = (g / (1.0 + jnp.exp(-g)) * u).astype(h_dtype)
        if h_form == "values":
            pltriton.store(h_refs[0].at[row, pl.ds(col, bn)], h, mask=mask)
            return
        # one MX block of h (columns past I are zeros): its fp16 halves in word order, and its factor
        positions, halves, factor = row_halves(h.astype(jnp.float32))
        h_refs[0][row, col + positions] = halves
        h_refs[1][row, col // BLOCK] = factor

    def gate_up(width):
        sums = products(width)
        if split == 1:
            for r, (g, u) in enumerate(sums):
                write_hidden(t * rows + r, c0, g, u, cmask)
            return
        partials_ref, turns_ref = finish_refs
        for r, row_sums in enumerate(sums):
            for i, y in enumerate(row_sums):  # traced indices (bare ints trip interpret-mode discharge)
                partials_ref[q, t * rows + r, jnp.int32(i), pl.ds(c0, bn)] = y
        turn = atomics.take_turn(turns_ref, (t * pl.num_programs(1) + j,), interpret=interpret)

        @pl.when(turn == split - 1)
        def _():  # the last of the block's K splits: every split's partial sums are stored
            for r in range(width):
                g, u = (sum(partials_ref[jnp.int32(s), t * rows + r, jnp.int32(i), pl.ds(c0, bn)]
                            for s in range(split)) for i in (0, 1))
                write_hidden(t * rows + r, c0, g, u, cmask)

    def shared_products(row):
        """A shared pseudo-expert's products over activation row `row` (`_shared_products`)."""
        return _shared_products(shared, role, s_refs, x_ref, factor_ref, x_form, row, real[0], expert, c0, q, bn,
                                split, k_valid, shared_steps[0])

    def gate_up_shared():
        """A shared pseudo-expert's tile (one row): its K quarter's gate / up sums into the partials; the last of
        the part's Q x split programs for this column block adds them up and writes the block of h into the row of
        the pseudo-expert whose down slice holds these columns."""
        (sums,) = shared_products(src[0])
        partials_ref, turns_ref = finish_refs
        for i, y in enumerate(sums):
            partials_ref[q, t * rows, jnp.int32(i), pl.ds(c0, bn)] = y
        quarter = shared.part_and_quarter(expert)[1]
        lead = t - quarter * shared.tiles_per_part  # the tile of quarter 0 of this part, for this token
        turn = atomics.take_turn(turns_ref, (lead * pl.num_programs(1) + j,), interpret=interpret)

        @pl.when(turn == shared.quarters * split - 1)
        def _():
            g, u = (sum(partials_ref[jnp.int32(s), (lead + jnp.int32(k * shared.tiles_per_part)) * rows,
                                     jnp.int32(i), pl.ds(c0, bn)]
                        for s in range(split) for k in range(shared.quarters)) for i in (0, 1))
            slice_cols = shared.part_inter // shared.quarters
            dest = (lead + (c0 // slice_cols) * shared.tiles_per_part) * rows
            write_hidden(dest, c0 % slice_cols, g, u, None)

    def front_sums(index):
        """The gate and up sums made ahead (`SharedFold.front_parts`) at `index(the flat offset of a part's gate or
        up row)`, added up over the parts of K and, with `SharedFold.front_scaled`, times their factor."""
        g, u = (sum(s_refs[0][index((f * 2 + i) * shared.width)] for f in range(shared.front_parts))
                for i in (0, 1))
        if shared.front_scaled:
            g, u = g * s_refs[1][0], u * s_refs[1][0]
        return g, u

    def gate_up_shared_from_front():
        """A shared pseudo-expert's tile when its gate / up sums are made already (`SharedFold.front_parts`): quarter
        0's programs (of the first K split) add up the parts of this column block and write its block of h where
        `gate_up_shared` would; the other quarters' and splits' programs have nothing to do."""
        piece, quarter = shared.part_and_quarter(expert)

        @pl.when((quarter == 0) & (q == 0))
        def _():
            col = piece * shared.part_inter + c0
            g, u = front_sums(lambda offset: pl.ds(offset + col, bn))
            slice_cols = shared.part_inter // shared.quarters
            write_hidden((t + (c0 // slice_cols) * shared.tiles_per_part) * rows, c0 % slice_cols, g, u, None)

    def shared_down():
        """A shared pseudo-expert's tile running its quarter of the down projection (`SharedFold.down_cols`): program
        (j, q) takes output columns j * C .. (j + 1) * C (C = down_cols) over split q's share of the quarter's rows
        of down, h = silu(g) * u of those rows from the front's sums (rounded to `h_dtype` as the gate/up kernel
        writes h), and adds h @ down into the token's sums (one token: row 0)."""
        piece, quarter = shared.part_and_quarter(expert)
        hidden, cols = shared.hidden, shared.down_cols
        rows_q = shared.part_inter // shared.quarters
        per = rows_q // split  # rows of down in this program
        chunk = tiling.pow2_divisor(per, shared_steps[1])
        r0 = piece * shared.part_inter + quarter * rows_q + q * per
        columns = j * cols + jax.lax.broadcasted_iota(jnp.int32, (cols,), 0)
        down_ref = s_refs[-1]  # after the sums (and their factor)

        def step(s, acc):
            r = r0 + s * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
            g, u = front_sums(lambda offset: offset + r)
            h = (g / (1.0 + jnp.exp(-g)) * u).astype(h_dtype).astype(jnp.float32)
            w = down_ref[r[:, None] * hidden + columns[None, :]].astype(jnp.float32)  # [chunk, C]
            return acc + jnp.sum(h[:, None] * w, axis=0)

        @pl.when(j * cols < hidden)  # (the tile's programs past the output columns have nothing to do)
        def _():
            acc = jax.lax.fori_loop(0, per // chunk, step, jnp.zeros((cols,), jnp.float32))
            atomics.add_relaxed(sums_ref, (columns,), acc)

    def down(width, products=products):
        pairs = [jnp.minimum(src[r], n_src - 1) for r in range(width)]
        # the pairs' routing weights before the products: loaded after them, their reads wait for the products'
        # reductions and barriers, one more round trip to memory at the program's end
        pair_weights = [pair_weight_ref[pair] for pair in pairs]
        for r, (y,) in enumerate(products(width)):
            token = jnp.where(real[r], pairs[r] // top_k, n_tokens)  # T: a padding row, which adds nothing
            add_to_tokens(sums_ref, token[None], (y * pair_weights[r])[None], c0, n_tokens=n_tokens,
                          n_dim=sums_dim, masked=not interpret)

    if zero_chunk:  # the down kernel's sums, zeroed by tile 0's programs (a chunk per block and split)
        @pl.when(t == 0)
        def _():
            tiling.store_zeros(zero_ref, (j * split + q) * zero_chunk, zero_chunk)

    body = gate_up if role == "gate_up" else down
    routed = expert >= 0
    if shared is not None:
        routed = routed & (expert < shared.n_routed)
        if role == "gate_up" and shared.down_cols:
            pl.when(expert >= shared.n_routed)(shared_down)
        elif role == "gate_up":
            pl.when(expert >= shared.n_routed)(gate_up_shared_from_front if shared.front_parts else gate_up_shared)
        elif not shared.skip:  # a pseudo-expert's row of h is its own
            pl.when(expert >= shared.n_routed)(lambda: down(1, lambda width: shared_products(t * rows)))
    if len(widths) == 1:
        pl.when(routed)(lambda: body(rows))
        return
    # the tile's real rows, then the narrowest products covering them: each program's branch is uniform
    n_real = sum(ok.astype(jnp.int32) for ok in real)
    for lower, width in zip((0,) + widths[:-1], widths):
        pl.when(routed & (n_real > lower) & (n_real <= width))(functools.partial(body, width))


def _k_split(groups: int, tiles: GemvTiles, programs: int) -> tuple[int, int]:
    """(blocks per K step, K splits) for a kernel of `programs` programs before splitting: the splits are the largest
    divisor of the step count up to `tiles.split_k` and no more than `tiles.min_programs` asks for."""
    gk = tiling.pow2_divisor(groups, tiles.max_groups)
    steps = groups // gk
    want = min(steps, tiles.split_k, max(1, -(-tiles.min_programs // programs)))
    return gk, max(d for d in range(1, want + 1) if steps % d == 0)


def _launch(groups: int, tiles: GemvTiles) -> tuple[int, int, int]:
    """(block_n, blocks per K step, warps) that give every thread at least one whole MX block: the inline asm takes
    each thread's 16 consecutive bytes as one block (pack = 16), which needs a tile of at least 32 x warps blocks
    (a smaller one is spread over threads a few bytes each, and the asm would mix blocks). Narrow K steps (few
    blocks of K) take fewer warps, then taller row blocks."""
    gk = tiling.pow2_divisor(groups, tiles.max_groups)
    warps = max(1, min(tiles.num_warps, tiles.block_n * gk // 32))
    return max(tiles.block_n, 32 * warps // gk), gk, warps


def _grid(groups: int, n_out: int, n_rows: int, tiles: GemvTiles) -> tuple[tuple[int, int], int]:
    """((row tiles, weight-row blocks), K splits) of a decode kernel over `n_rows` rows, `n_out` weight rows and
    `groups` MX blocks of K."""
    grid = (n_rows // tiles.rows, pl.cdiv(n_out, _launch(groups, tiles)[0]))
    return grid, _k_split(groups, tiles, grid[0] * grid[1])[1]


def _call(role: str, tile_expert, src_of_row, x, x_form: str, extra, weights, outputs, tiles: GemvTiles,
          interpret: bool, n_rows: int, shared_weights=(), **static):
    """One decode kernel over `weights` (P pairs of blocks uint8 [E, N, G, 16] / scales uint8 [E, N, G]) and the
    activations `x` in `x_form` (`_kernel`: "raw" [X, K]; "rows" / "blocks": (words, factors)) for the first
    `n_rows` rows of `src_of_row`: `extra` inputs after them, `outputs` a function of (row blocks, K splits,
    block_n) -> (output shapes, buffers aliased to the last outputs, static kernel arguments that depend on the
    launch). `shared_weights`: the flat bf16 weights of a folded shared MLP (`SharedFold`), after `weights`."""
    n_out, groups = weights[0][0].shape[1], weights[0][0].shape[2]
    packed = x_form != "raw"
    if x_form == "raw":
        x_groups = -(-x.shape[1] // BLOCK)
    else:
        x_groups = x[0].shape[1]
    if x_groups != groups:
        raise ValueError(f"the activations cover {x_groups} MX blocks of K, the weights {groups}")
    bn, gk, warps = _launch(groups, tiles)
    grid, split = _grid(groups, n_out, n_rows, tiles)
    out_shapes, aliased, sized = outputs(grid[1], split, bn)  # the aliased buffers are the last outputs
    n_outputs = len(out_shapes) if isinstance(out_shapes, tuple) else 1
    widths = tuple(w for w in ROWS if w <= tiles.rows) if tiles.adaptive else (tiles.rows,)
    k_steps = groups // gk // split
    hoist = tiles.rows == 1 and k_steps <= (DOWN_HOIST_MAX_STEPS if role == "down" else GATE_UP_HOIST_MAX_STEPS)
    kernel_args = dict(role=role, rows=tiles.rows, widths=widths, bn=bn, gk=gk, k_steps=k_steps, hoist=hoist,
                       split=split, n_valid=n_out, k_valid=groups * BLOCK if packed else x.shape[1], x_form=x_form,
                       asm=dispatch.nvidia_ptx(interpret), interpret=interpret,
                       shared_steps=(SHARED_STEP_BLOCKS, SHARED_DOWN_ROWS), **static, **sized)
    inputs = (tile_expert, src_of_row, *(x if packed else (x,)), *extra, *[a for w in weights for a in w],
              *shared_weights)
    return tiling.launch(
        _kernel, kernel_args, (*inputs, *aliased), out_shape=out_shapes, grid=grid + (split,), num_warps=warps,
        num_stages=tiles.num_stages, interpret=interpret, name=f"moe_gemv_{role}_r{tiles.rows}{'a' * tiles.adaptive}",
        aliases={len(inputs) + i: n_outputs - len(aliased) + i for i in range(len(aliased))})


def _packs_hidden(groups: int, split: int, tiles: GemvTiles) -> bool:
    """Whether the gate/up kernel over `groups` MX blocks of K in `split` K splits writes h packed
    (`GemvTiles.pack_hidden`)."""
    return tiles.pack_hidden and _launch(groups, tiles)[0] == BLOCK and (tiles.pack_in_kernel or split > 1)


def _call_rows(n_pairs: int, n_experts: int, tiles: GemvTiles) -> int:
    """The schedule rows R the decode kernels run for any routing of `n_pairs` pairs over `n_experts` experts."""
    return moe_tiles.max_tiles(n_pairs, n_experts, tiles.rows) * tiles.rows


def _turns_needed(groups: int, inter: int, n_rows: int, tiles: GemvTiles, shared: bool) -> int:
    """The gate/up kernel's turn counters over `groups` MX blocks of K, `inter` weight rows and `n_rows` rows: one
    per tile and weight-row block where K is split or a shared MLP folds in, else 0."""
    (n_tiles, blocks_n), split = _grid(groups, inter, n_rows, tiles)
    return n_tiles * blocks_n if split > 1 or shared else 0


def turn_count(n_pairs: int, n_experts: int, hidden: int, inter: int, tiles: GemvTiles, shared: bool) -> int:
    """The int32 turn counters the gate/up kernel takes (`hidden_rows(turns=)`) in a call of `n_pairs` pairs over
    `n_experts` experts (a folded shared MLP's parts counted in both) with hidden size `hidden`, the experts'
    intermediate size `inter` and `tiles`: one per tile and weight-row block where K is split or a shared MLP folds
    in, else 0 (no counters)."""
    return _turns_needed(-(-hidden // BLOCK), inter, _call_rows(n_pairs, n_experts, tiles), tiles, shared)


def hidden_rows(tile_expert, token_of_row, x, x_form: str, gate_up, tiles: GemvTiles, n_tokens: int, dtype,
                interpret: bool = False, zeroed: int = 0, n_rows: int | None = None,
                shared: tuple[SharedFold, tuple[jax.Array, ...]] | None = None, turns: jax.Array | None = None,
                token_sums: jax.Array | None = None):
    """The gate/up kernel: silu(x @ gate) * (x @ up) at each row's token, rounded to `dtype` -> (h, its form for
    `token_sums`, zeros): with `GemvTiles.pack_hidden` (where it applies), h already packed for the down
    kernel ((words uint32 [R, G, 16], factors float32 [R, G]): each MX block of h scaled on its own, "blocks"), else
    h [R, I] of `dtype` ("raw", for the down kernel's programs or XLA to pack). `zeroed` > 0: the kernel
    also writes a float32 buffer of at least that many zeros (the down kernel's sums, `token_sums(sums=)`), else
    zeros is None.

    tile_expert [R / rows] int32 (-1: skip), token_of_row [R] int32 (T for padding rows, which get zeros), x in
    `x_form`: the T tokens [T, D] ("raw") or `row_scaled_words` of them with a zero row T appended ("rows"); gate_up:
    ((blocks, scales) of gate, of up), blocks uint8 [E, I, G, 16], scales uint8 [E, I, G]. Rows of skipped tiles
    (and, with adaptive tiles, a tile's rows past its real ones) are left unwritten. `n_rows`: the rows R to run
    (default all of token_of_row's; a longer table's rows past R are not read). `shared`: (its `SharedFold`, the
    shared MLP's (gate, up) [H, S] bf16, or with `SharedFold.front_parts` its (gate / up sums made ahead,), their
    factor [1] after them with `SharedFold.front_scaled`): tiles of experts from fold.n_routed run it (h packed
    only); given `token_sums` (float32 [H], one token: the down kernel's sums, e.g. the residual rows; with
    `SharedFold.front_parts`, the refs (sums made ahead[, factor], down [S, H])) they run its down projection
    instead, adding into token_sums (`SharedFold.down_cols`, set here), which then come back as zeros. `turns`:
    int32 zeros, at least `turn_count` of them, for the turn counters where the kernel takes them (split K or
    `shared`), made ahead by an earlier kernel (`kernels.moe_front.front(zeros=)`) so no zero fill runs here; left
    nonzero."""
    inter, groups = gate_up[0][0].shape[1], gate_up[0][0].shape[2]
    n_rows = token_of_row.shape[0] if n_rows is None else n_rows
    fold, shared_weights = (None, ()) if shared is None else (shared[0], tuple(w.reshape(-1) for w in shared[1]))
    split = _grid(groups, inter, n_rows, tiles)[1]
    count = _turns_needed(groups, inter, n_rows, tiles, fold is not None)
    halves = _packs_hidden(groups, split, tiles)
    if fold is not None and (not halves or fold.blocks % split):
        raise ValueError(f"the shared MLP folds into the gate/up kernel where it writes h packed and its {split} K "
                         f"splits divide the pseudo-experts' {fold.blocks} blocks of K")
    down_here = token_sums is not None  # the shared down projection runs here, into token_sums
    if down_here:
        blocks_n = _grid(groups, inter, n_rows, tiles)[0][1]
        hidden = token_sums.shape[0]
        cols = tiling.pow2_at_least(-(-hidden // blocks_n))  # output columns per program of a pseudo-expert's tile
        rows_q = 0 if fold is None else fold.part_inter // fold.quarters
        if (fold is None or not fold.front_parts or zeroed or n_tokens != 1 or token_sums.ndim != 1
                or hidden % cols or rows_q % split):
            raise ValueError(f"the shared MLP's down projection runs in the gate/up kernel for one token, from its "
                             f"gate / up sums made ahead, into given sums (float32 [H], not {token_sums.shape}; no "
                             f"zeros asked), in {blocks_n} programs of {cols} columns per pseudo-expert and {split} K "
                             f"splits dividing its {rows_q} rows")
        fold = fold._replace(down_cols=cols, hidden=hidden)

    def outputs(blocks_n, split, bn):
        if halves:
            shapes = [jax.ShapeDtypeStruct((n_rows, blocks_n * BLOCK), jnp.int16),
                      jax.ShapeDtypeStruct((n_rows, blocks_n), jnp.float32)]
        else:
            shapes = [jax.ShapeDtypeStruct((n_rows, inter), dtype)]
        chunk = tiling.pow2_at_least(-(-zeroed // (blocks_n * split))) if zeroed else 0
        if chunk:  # one chunk of zeros per (block, split) of tile 0
            shapes.append(jax.ShapeDtypeStruct((blocks_n * split * chunk,), jnp.float32))
        if not count:
            return tuple(shapes), (), dict(zero_chunk=chunk)
        # each split's sums (whole blocks: no masked stores), then the turn counters (one per tile and block),
        # zeroed: the caller's where they are enough, else a zero fill here
        zeros = turns if turns is not None and turns.shape[0] >= count else jnp.zeros((count,), jnp.int32)
        shapes.append(jax.ShapeDtypeStruct((split, n_rows, 2, blocks_n * bn), jnp.float32))
        aliased = (token_sums, zeros) if down_here else (zeros,)  # (the shared down adds into the token sums)
        shapes += [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in aliased]
        return tuple(shapes), aliased, dict(zero_chunk=chunk)

    out = _call("gate_up", tile_expert, token_of_row, x, x_form, (), gate_up, outputs, tiles, interpret, n_rows,
                shared_weights, n_src=n_tokens, top_k=1, n_tokens=n_tokens, h_form="halves" if halves else "values",
                h_dtype=jnp.dtype(dtype), shared=fold)
    n_h = 2 if halves else 1
    zeros = out[n_h] if zeroed else (out[-2] if down_here else None)
    if halves:
        return (halves_as_words(out[0]), out[1]), "blocks", zeros
    return out[0], "raw", zeros


def halves_as_words(halves: jax.Array) -> jax.Array:
    """int16 [R, G * 32] (each MX block's fp16 halves in word order) -> uint32 [R, G, 16], two halves per word
    (the lower index in the low bits): a reinterpretation, no data moves."""
    rows, n = halves.shape
    return jax.lax.bitcast_convert_type(halves.reshape(rows, n // BLOCK, 16, 2), jnp.uint32)


def sums_width(hidden: int, groups: int, tiles: GemvTiles) -> int:
    """The row stride of the down kernel's token sums, whose weights have `hidden` rows of `groups` MX blocks: the
    rows in whole blocks of the kernel's programs."""
    bn = _launch(groups, tiles)[0]
    return pl.cdiv(hidden, bn) * bn


def sums_size(n_tokens: int, down, tiles: GemvTiles) -> int:
    """Floats of the down kernel's token sums for `n_tokens` tokens and `down` ((blocks, scales),): (T + 1) rows
    of `sums_width` (`hidden_rows(zeroed=)` writes the zeros)."""
    blocks, _ = down[0]
    return (n_tokens + 1) * sums_width(blocks.shape[1], blocks.shape[2], tiles)


def sums_take_residual(hidden: int, inter: int, tiles: GemvTiles) -> bool:
    """Whether the down kernel can add into the tokens' residual rows as they are (`grouped_swiglu(residual_sums=)`,
    experts of hidden size `hidden` and intermediate size `inter`): 1-row tiles (no padding rows, so no scratch row
    past the tokens) and a sums row stride equal to the hidden size."""
    return tiles.rows == 1 and sums_width(hidden, -(-inter // BLOCK), tiles) == hidden


def token_sums(tile_expert, pair_of_row, h, h_form: str, pair_weights, top_k: int, n_tokens: int, down,
               tiles: GemvTiles, interpret: bool = False, *, sums: jax.Array, n_rows: int | None = None,
               shared: tuple[SharedFold, jax.Array] | None = None, scratch_row: bool = True) -> jax.Array:
    """The down kernel: [T, D] float32, each token's sum over its pairs of weight * (h @ down) (float32 atomics:
    the order of the adds varies from run to run).

    pair_of_row [R] int32 (P for padding rows), h in `h_form` (`hidden_rows`' result, or "rows": its
    `row_scaled_words`), pair_weights [P] float32 (pair p is token p // top_k's: `top_k` the pairs' stride, which
    may count padding slots), down: ((blocks uint8 [E, D, G, 16], scales uint8 [E, D, G]),); sums: float32 zeros of
    at least `sums_size` floats to add into (`hidden_rows`' zeros); `n_rows`: as `hidden_rows`'; `shared`: (its
    `SharedFold`, the shared MLP's down [S, H] bf16), as `hidden_rows`' (the pseudo-experts' pairs weigh 1).
    `scratch_row` False: sums holds the T rows alone (T * `sums_width` floats, e.g. the residual rows to add into:
    `grouped_swiglu(residual_sums=)`), for schedules without padding rows (1-row tiles), which would add there."""
    hidden = down[0][0].shape[1]
    fold, shared_weights = (None, ()) if shared is None else (
        shared[0], () if shared[0].skip else (shared[1].reshape(-1),))
    n_pairs = pair_weights.shape[0]
    width = sums_width(hidden, down[0][0].shape[2], tiles)
    size = (n_tokens + scratch_row) * width
    if sums.shape[0] < size or sums.dtype != jnp.float32:
        raise ValueError(f"token_sums: the sums buffer holds {sums.shape[0]} {sums.dtype} values, the down kernel "
                         f"needs {size} float32")
    if not scratch_row and tiles.rows != 1:
        raise ValueError(f"token_sums: sums without a scratch row need 1-row tiles (no padding rows), not {tiles}")

    def outputs(blocks_n, split, bn):
        # rows of whole weight-row blocks (no masked columns), one scratch row (interpret mode's padding rows)
        return jax.ShapeDtypeStruct(sums.shape, sums.dtype), (sums,), dict(sums_dim=width)

    n_rows = pair_of_row.shape[0] if n_rows is None else n_rows
    if fold is not None and fold.blocks % _grid(down[0][0].shape[2], hidden, n_rows, tiles)[1]:
        raise ValueError(f"the shared MLP's down quarters ({fold.blocks} blocks of K) do not divide into the down "
                         f"kernel's K splits")
    sums = _call("down", tile_expert, pair_of_row, h, h_form, (pair_weights.astype(jnp.float32),), down, outputs,
                 tiles, interpret, n_rows, shared_weights, n_src=n_pairs, top_k=top_k, n_tokens=n_tokens,
                 h_form="values", h_dtype=None, shared=fold)
    return sums[:n_tokens * width].reshape(n_tokens, width)[:, :hidden]


def shared_parts(n_tokens: int, top_k: int, hidden: int, inter: int, shared_inter: int, tiles: GemvTiles) -> int:
    """The pseudo-experts (`SharedFold`: SHARED_QUARTERS per I columns) a shared MLP of `shared_inter` columns runs
    as in the decode kernels' call of `n_tokens` tokens x `top_k` routed experts (hidden size H, the experts'
    intermediate size I) with `tiles`; 0 where it does not fold: 1-row tiles, h packed by the gate/up kernel, I a
    multiple of 32 x SHARED_QUARTERS and S of I, H's MX blocks of the quarters, and each kernel's K splits dividing
    a quarter's blocks."""
    quarters = SHARED_QUARTERS
    if (tiles.rows != 1 or hidden % BLOCK or inter % (BLOCK * quarters) or not shared_inter or shared_inter % inter
            or (hidden // BLOCK) % quarters):
        return 0
    parts = quarters * shared_inter // inter
    n_rows = n_tokens * (top_k + parts)
    g_hidden, g_inter = hidden // BLOCK, inter // BLOCK
    split_gate_up = _grid(g_hidden, inter, n_rows, tiles)[1]
    split_down = _grid(g_inter, hidden, n_rows, tiles)[1]
    if (not _packs_hidden(g_hidden, split_gate_up, tiles) or (g_hidden // quarters) % split_gate_up
            or (g_inter // quarters) % split_down):
        return 0
    return parts


def grouped_swiglu(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, ew: ExpertWeights,
                   n_experts: int | None = None, tiles: GemvTiles | None = None, interpret: bool = False, *,
                   sched: moe_tiles.Schedule | None = None, x_words: tuple[jax.Array, jax.Array] | None = None,
                   shared: SharedMLP | tuple[jax.Array, jax.Array, jax.Array] | None = None,
                   residual_sums: jax.Array | None = None) -> jax.Array:
    """Routed SwiGLU experts over MXFP4 `ew`: x [T, D], topk_ids [T, k] int, topk_weights [T, k] -> [T, D] of
    x.dtype (the hidden activations rounded to x.dtype between the projections, as the MMA path does).

    Made ahead by the caller, where it can make them in launches it runs anyway: `sched`, the pairs' schedule in
    tiles of `tiles.rows` rows with its pair table (`kernels.router.select_and_schedule(block_m=, padded=True)`,
    whose `Schedule.pair_weights` then stand in for topk_weights; default `moe_tiles.schedule` here); `x_words`, x
    packed as `row_scaled_words` packs it with a zero row appended (words uint32 [T + 1, G, 16], factors float32
    [T + 1]; `kernels.moe_front.front(pack=True)`), which the gate/up kernel then reads in place of packing x itself
    (`GemvTiles.pack_in_kernel`) or XLA's packing. The schedule's `turns` (zeros made ahead: `turn_count`) serve as
    the gate/up kernel's turn counters where they are enough.

    `shared` (a `SharedMLP`, or its (gate [H, S], up [H, S], down [S, H]) bf16): a shared-expert MLP every token runs
    unweighted, added in by the same two kernels (`SharedFold`: its `shared_parts` pseudo-experts E .. E + P - 1 of
    weight 1; 1-row tiles); with `sched` given, topk_ids and topk_weights hold their columns already
    (`kernels.router`'s shared parts), else they are appended here. Its `gate_up_sums` (one token; `ScaledSums` to
    multiply by their factor): the gate/up kernel finishes those instead of streaming gate and up; with
    `down_in_gate_up` too (and `residual_sums`) it runs the shared down projection from them as well, and the down
    kernel the routed experts alone.

    `residual_sums` (float32 [T, D], the layer's residual rows: `kernels.moe_front.front(sums=True)`): the down kernel
    adds into it instead of zeros and the result is float32 [T, D], residual + experts, not rounded (the layer's
    residual add done, for consumers that round as they load); needs `sums_take_residual`."""
    if ew.fmt != "mxfp4":
        raise ValueError(f"the decode kernels take MXFP4 experts, not {ew.fmt}")
    n_experts = n_experts or ew.gate.shape[0]
    n_tokens = x.shape[0]
    folds, down_early = None, False
    if shared is not None:
        hidden, inter = x.shape[1], ew.gate.shape[1]
        s_gate, s_up, s_down, made, down_early = SharedMLP(*shared)
        made, scale = (made.sums, made.scale) if isinstance(made, ScaledSums) else (made, None)
        if scale is not None and (scale.dtype != jnp.float32 or scale.shape != (1,)):
            raise ValueError(f"the shared MLP's gate / up sums' factor is float32 [1], not {scale.dtype}"
                             f"{list(scale.shape)}")
        scaled = () if scale is None else (scale,)
        if s_gate.shape != s_up.shape or s_gate.shape[0] != hidden or s_down.shape != s_gate.shape[::-1]:
            raise ValueError(f"shared MLP {s_gate.shape} / {s_up.shape} / {s_down.shape} does not match hidden size "
                             f"{hidden} (gate / up [H, S], down [S, H])")
        if made is not None and (n_tokens != 1 or made.dtype != jnp.float32 or made.ndim != 3
                                 or made.shape[1:] != (2, s_gate.shape[1])):
            raise ValueError(f"the shared MLP's gate / up sums made ahead ({made.dtype}{list(made.shape)}) need one "
                             f"token and float32 [F, 2, {s_gate.shape[1]}], not {n_tokens} tokens")
        if down_early and (made is None or residual_sums is None):
            raise ValueError("the shared MLP's down projection runs in the gate/up kernel from its gate / up sums made "
                             "ahead, adding into the residual rows (`residual_sums`)")
        per_part = SHARED_QUARTERS * s_gate.shape[1] // inter
        top_k = topk_ids.shape[1] - (per_part if sched is not None else 0)
        tiles = tiles or tiles_for(n_tokens * top_k, n_experts)
        parts = shared_parts(n_tokens, top_k, hidden, inter, s_gate.shape[1], tiles)
        if not parts:
            raise ValueError(f"a shared MLP of {s_gate.shape[1]} columns does not fold into the decode kernels with "
                             f"{tiles} at {n_tokens} tokens x top-{top_k} (`shared_parts`)")
        if sched is None:
            topk_ids = jnp.concatenate([topk_ids.astype(jnp.int32), jnp.broadcast_to(
                jnp.arange(n_experts, n_experts + parts, dtype=jnp.int32), (n_tokens, parts))], axis=1)
            topk_weights = jnp.concatenate([topk_weights.astype(jnp.float32),
                                            jnp.ones((n_tokens, parts), jnp.float32)], axis=1)
        fold = functools.partial(SharedFold, n_routed=n_experts, quarters=SHARED_QUARTERS, part_inter=inter,
                                 tiles_per_part=n_tokens)
        gate_up_fold = fold(width=s_gate.shape[1], blocks=hidden // BLOCK // SHARED_QUARTERS,
                            front_parts=0 if made is None else made.shape[0], front_scaled=scale is not None)
        down_fold = fold(width=hidden, blocks=inter // BLOCK // SHARED_QUARTERS)
        if down_early:  # the down projection in the gate/up kernel's pseudo-expert tiles, none in the down kernel's
            folds = ((gate_up_fold, (made, *scaled, s_down)), (down_fold._replace(skip=True), None))
        else:
            folds = ((gate_up_fold, (s_gate, s_up) if made is None else (made, *scaled)), (down_fold, s_down))
        n_experts += parts
    tiles = tiles or tiles_for(topk_ids.size, n_experts)
    n_rows = _call_rows(topk_ids.size, n_experts, tiles)
    if sched is None:
        sched = moe_tiles.schedule(topk_ids, n_experts, tiles.rows)
    elif sched.token_of_row.shape[0] < n_rows or sched.row_of_pair.shape != topk_ids.shape:
        raise ValueError(f"the decode kernels' schedule has {sched.token_of_row.shape[0]} rows and pairs "
                         f"{sched.row_of_pair.shape}; {tiles.rows}-row tiles of the call's pairs {topk_ids.shape} "
                         f"need {n_rows}")
    if sched.pair_weights is not None:  # the router's padded weights, pairs numbered in their rows' stride
        pair_weights, stride = sched.pair_weights.reshape(-1), sched.pair_weights.shape[1]
    else:
        pair_weights, stride = topk_weights.reshape(-1), topk_ids.shape[1]
    if x_words is not None:
        words, factors = x_words
        groups = -(-x.shape[1] // BLOCK)
        if words.shape != (n_tokens + 1, groups, 16) or factors.shape != (n_tokens + 1,):
            raise ValueError(f"the packed activations {words.shape} / {factors.shape} do not match x {x.shape} "
                             f"(words [T + 1, {groups}, 16], factors [T + 1])")
        xs = x_words, "rows"
    elif tiles.pack_in_kernel:
        xs = x, "raw"
    else:
        xs = row_scaled_words(jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])), "rows"
    down = ((ew.down, ew.down_scales),)
    if residual_sums is not None and (residual_sums.shape != x.shape or residual_sums.dtype != jnp.float32
                                      or not sums_take_residual(x.shape[1], ew.down.shape[2] * BLOCK, tiles)):
        raise ValueError(f"the residual rows to add into ({residual_sums.dtype}{list(residual_sums.shape)}) need "
                         f"float32 {list(x.shape)} and 1-row tiles over whole blocks of the hidden size, not {tiles}")
    zeroed = 0 if residual_sums is not None else sums_size(n_tokens, down, tiles)  # (else the residual rows)
    h, h_form, zeros = hidden_rows(sched.tile_expert, sched.token_of_row, *xs,
                                   ((ew.gate, ew.gate_scales), (ew.up, ew.up_scales)), tiles, n_tokens, x.dtype,
                                   interpret, zeroed=zeroed, n_rows=n_rows, shared=folds and folds[0],
                                   turns=sched.turns, token_sums=residual_sums.reshape(-1) if down_early else None)
    if h_form == "raw" and not tiles.pack_in_kernel:
        h, h_form = row_scaled_words(h), "rows"
    if residual_sums is not None and not down_early:
        zeros = residual_sums.reshape(-1)
    sums = token_sums(sched.tile_expert, sched.pair_of_row(), h, h_form, pair_weights, stride, n_tokens, down,
                      tiles, interpret, sums=zeros, n_rows=n_rows, shared=folds and folds[1],
                      scratch_row=residual_sums is None)
    return sums if residual_sums is not None else sums.astype(x.dtype)
