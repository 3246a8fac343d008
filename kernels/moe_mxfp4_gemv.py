"""MXFP4 routed experts at decode sizes as matrix-vector products on the CUDA cores (no MMA).

At one or two tokens per expert a decode step streams the active experts' packed weights once and does ~1 FLOP per
weight per token: the tensor cores have nothing to gain, while feeding them costs the MMA path (`moe_mxfp4`) a trip
of every converted tile through shared memory into the MMA operand layout (~4.3 SASS instructions per weight, a
quarter to two fifths of HBM bandwidth on the H200). Here each thread converts the bytes it loaded and multiplies
them in registers:

- a thread holds one MX block (16 bytes: 32 weights, one E8M0 scale) of one weight row per item; the E2M1 nibbles
  become fp16 bit patterns (E2M1 * 2^-14) in PTX, four bytes at a time, and `fma.rn.f16x2` multiplies them into the
  rows' activations (pre-packed as fp16 pairs in the order the conversion yields, `activation_words`), summing the
  block's 32 products in fp16 (16 per lane); the block sum goes to float32, times 2^(s - 127), into a float32
  accumulator. Activations are scaled per row by a power of two to a maximum in [2^13, 2^14), so products stay
  normal fp16 numbers (|product| < 6, a block sum < 96) and the factor is undone on the float32 result.
- `rows` (1, 2 or 4) token rows of one expert share each converted block (tiles of `moe_tiles.schedule` with
  block_m = rows; with `GemvTiles.adaptive` a tile multiplies only the rows it holds); accumulator column r of each
  item holds row r (pack semantics of the inline asm, below).
- grid (tiles, weight-row blocks, K splits): every program writes float32 partial sums for its rows; small XLA
  passes add the splits at the pairs' rows, apply SwiGLU (gate/up) or weight and combine the pairs (down).

In interpret mode (and on platforms without inline PTX) the same kernel runs a jnp form of the block products
(float32 sums), so CPU tests check the indexing, schedule and epilogues; the fp16 arithmetic is checked on a GPU
(tests/gpu/test_mxfp4_gpu.py) against the float64 oracle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import dispatch, moe_tiles, tiles as tiling
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
    multiplies, and other programs on the SM hide the wait)."""

    rows: int = 1
    block_n: int = 32
    max_groups: int = 8
    split_k: int = 8
    num_warps: int = 4
    min_programs: int = 2048
    adaptive: bool = False
    num_stages: int = 1

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


def tiles_for(n_pairs: int, n_experts: int) -> GemvTiles:
    """Tiles for a layer call of `n_pairs` token-expert pairs: 1-row tiles where active experts have about one row
    (one token's experts; `rows_per_active_expert`), else 2-row tiles that multiply a single-row tile's blocks once
    (`adaptive`); 16 MX blocks per K step, 16 weight rows per program for one token's experts, else 32. H200
    (benchmarks/moe.py --sweep gemv, 2026-12-02), DeepSeek-size layer: 16 tokens 794 us (adaptive 2-row tiles)
    against 824 (1-row) and 877 (2-row), 970 us with 8 blocks per step; 32 / 64 tokens 1333 / 2224 us against
    1436 / 2373 (2-row) and 1501 / 2757 (1-row); adaptive 4-row tiles slower (1613 / 2462); 1 token 84 us with 16
    weight rows against 98 with 32."""
    if rows_per_active_expert(n_pairs, n_experts) <= 1.1:
        return GemvTiles(rows=1, block_n=16 if n_pairs <= 16 else 32, max_groups=16)
    return GemvTiles(rows=2, block_n=32, max_groups=16, adaptive=True)


def choose(n_pairs: int, n_experts: int, fmt: str) -> GemvTiles | None:
    """The decode kernels' tiles for a layer call, or None where the MMA kernels of moe_mxfp4 run it (other formats,
    or more rows per active expert than MAX_ROWS_PER_EXPERT)."""
    if fmt != "mxfp4" or rows_per_active_expert(n_pairs, n_experts) > MAX_ROWS_PER_EXPERT:
        return None
    return tiles_for(n_pairs, n_experts)


# ------------------------------------------------------------------------------------------------ activations


def activation_words(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """v [N, K] -> (words uint32 [N, G, 16], factor float32 [N]) with G = ceil(K / 32).

    Each row is scaled by a power of two to a maximum in [2^13, 2^14) and rounded to fp16; `factor` undoes the
    scaling. Word 4j + m of block g packs two fp16 (low half first) in the order the PTX conversion of the block's
    word j (bytes 4j..4j+3; byte i holds elements 2i, 2i+1) yields them: m = 0: elements (8j, 8j+2), 1: (8j+4,
    8j+6), 2: (8j+1, 8j+3), 3: (8j+5, 8j+7) (offsets in the block)."""
    n, k = v.shape
    groups = -(-k // BLOCK)
    v = jnp.pad(v.astype(jnp.float32), ((0, 0), (0, groups * BLOCK - k)))
    _, e = jnp.frexp(jnp.max(jnp.abs(v), axis=1))
    e = jnp.clip(e.astype(jnp.int32), -100, 100)
    h = (v * pow2(_TOP - e)[:, None]).astype(jnp.float16)
    # element 8j + 4b + 2 lane + parity -> word 4j + 2 parity + b, half `lane`
    h = h.reshape(n, groups, 4, 2, 2, 2).transpose(0, 1, 2, 5, 3, 4).reshape(n, groups, 16, 2)
    return jax.lax.bitcast_convert_type(h, jnp.uint32), pow2(e - _TOP)


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
# product times the scale factor), $32..$35 the block's 16 bytes, then 16 activation words per row, then the scale
# factor (16 copies of one value). Per four bytes: the E2M1 -> fp16 conversion of moe_mxfp4 (low and high nibbles,
# two fp16 per register, `_conversion`), then one fp16x2 product per row and register.
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
                  f"fma.rn.f32 ${r}, e, ${fac}, ${r};"]
    lines.append("}")
    return "\n".join(lines)


def _constraints(rows: int) -> str:
    return ",".join(["=f"] * 16 + [str(i) for i in range(16)] + ["r"] * 4 + ["r"] * (16 * rows) + ["f"] * 16)


def _block_products(acc, w, xs, fac, asm: bool):
    """acc f32 [bn, gk, 16] + (block products of the weight bytes w uint8 [bn, gk, 16] with each activation row
    xs[r] uint32 [gk, 16], times fac f32 [bn, gk]) in column r."""
    shape = w.shape
    if asm:
        args = [acc, w] + [jnp.broadcast_to(x[None], shape) for x in xs] + [jnp.broadcast_to(fac[:, :, None], shape)]
        return pltriton.elementwise_inline_asm(_block_ptx(len(xs)), args=args, constraints=_constraints(len(xs)),
                                               pack=16, result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)]
                                               )[0]
    from .moe_mxfp4 import _nibbles_to_f16  # the jnp form of the same conversion

    lo, hi = (a.astype(jnp.float32) for a in _nibbles_to_f16(w))
    col = jax.lax.broadcasted_iota(jnp.int32, shape, 2)
    for r, x in enumerate(xs):
        xe, xo = (a.astype(jnp.float32)[None] for a in _unpack_words(x))
        dot = jnp.sum(lo * xe + hi * xo, axis=2) * fac  # [bn, gk]
        acc = acc + jnp.where(col == r, dot[:, :, None], 0.0)
    return acc


# ------------------------------------------------------------------------------------------------ kernel


def _kernel(tile_ref, src_ref, factor_ref, x_ref, *refs, rows, widths, bn, gk, k_steps, n_valid, asm):
    *w_refs, o_ref = refs
    n_proj = len(w_refs) // 2
    t, j, q = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert = tile_ref[t]
    c0 = j * bn
    cmask = c0 + jnp.arange(bn, dtype=jnp.int32) < n_valid
    src = [src_ref[t * rows + r] for r in range(rows)]

    def products(width):
        """The K loop over the tile's first `width` rows; stores their partial sums."""
        def load(kk):
            groups = pl.ds((q * k_steps + kk) * gk, gk)
            ws = tuple(pltriton.load(w_refs[2 * i].at[expert, pl.ds(c0, bn), groups, :], mask=cmask[:, None, None],
                                     other=0) for i in range(n_proj))
            ss = tuple(pltriton.load(w_refs[2 * i + 1].at[expert, pl.ds(c0, bn), groups], mask=cmask[:, None],
                                     other=0) for i in range(n_proj))
            return ws, ss, tuple(x_ref[s, groups, :] for s in src[:width])

        def step(kk, accs):
            ws, ss, xs = load(kk)  # no loads carried ahead: a carried uint8 tile is unpacked byte by byte
            out = []
            for acc, w, s in zip(accs, ws, ss):
                out.append(_block_products(acc, w, xs, scale_value(s.astype(jnp.int32)), asm))
            return tuple(out)

        zeros = tuple(jnp.zeros((bn, gk, _BYTES), jnp.float32) for _ in range(n_proj))
        accs = jax.lax.fori_loop(0, k_steps, step, zeros)
        col = jax.lax.broadcasted_iota(jnp.int32, (bn, gk, _BYTES), 2)
        for r in range(width):
            f = factor_ref[src[r]] * _UNIT
            for i, acc in enumerate(accs):
                y = jnp.sum(jnp.sum(jnp.where(col == r, acc, 0.0), axis=2), axis=1) * f
                # a traced projection index (a bare int trips masked-store discharge in interpret mode)
                pltriton.store(o_ref.at[q, t * rows + r, jnp.int32(i), pl.ds(c0, bn)], y, mask=cmask)

    if len(widths) == 1:
        pl.when(expert >= 0)(lambda: products(rows))
        return
    # the tile's real rows (padding rows read the activations' last, zero row), then the narrowest products covering
    # them: each program's branch is uniform
    pad = x_ref.shape[0] - 1
    real = sum((s < pad).astype(jnp.int32) for s in src)
    for lower, width in zip((0,) + widths[:-1], widths):
        pl.when((expert >= 0) & (real > lower) & (real <= width))(functools.partial(products, width))


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


def partial_products(tile_expert, src_of_row, words, factor, weights, tiles: GemvTiles, interpret: bool = False):
    """Float32 partial sums [S, R, P, N] of the rows' products with P projections.

    tile_expert [R / rows] int32 (-1: skip), src_of_row [R] int32 (row r reads words[src_of_row[r]]), words uint32
    [X, G, 16] and factor [X] from `activation_words`, weights: P (blocks uint8 [E, N, G, 16], scales uint8
    [E, N, G]) of one expert layout. S: the K splits (sum them)."""
    n_rows = src_of_row.shape[0]
    n_out, groups = weights[0][0].shape[1], weights[0][0].shape[2]
    if words.shape[1] != groups:
        raise ValueError(f"activations cover {words.shape[1]} blocks of K, the weights {groups}")
    bn, gk, warps = _launch(groups, tiles)
    grid = (n_rows // tiles.rows, pl.cdiv(n_out, bn))
    split = _k_split(groups, tiles, grid[0] * grid[1])[1]
    widths = tuple(w for w in ROWS if w <= tiles.rows) if tiles.adaptive else (tiles.rows,)
    kernel = functools.partial(_kernel, rows=tiles.rows, widths=widths, bn=bn, gk=gk, k_steps=groups // gk // split,
                               n_valid=n_out, asm=dispatch.nvidia_ptx(interpret))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split, n_rows, len(weights), n_out), jnp.float32),
        grid=grid + (split,),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=f"moe_gemv_{'gate_up' if len(weights) == 2 else 'down'}_r{tiles.rows}{'a' * tiles.adaptive}",
    )(tile_expert, src_of_row, factor, words, *[a for w in weights for a in w])


def _swiglu(gu: jax.Array) -> jax.Array:
    g, u = gu[:, 0], gu[:, 1]
    return g / (1.0 + jnp.exp(-g)) * u


def grouped_swiglu(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, ew: ExpertWeights,
                   n_experts: int | None = None, tiles: GemvTiles | None = None,
                   interpret: bool = False) -> jax.Array:
    """Routed SwiGLU experts over MXFP4 `ew`: x [T, D], topk_ids [T, k] int, topk_weights [T, k] -> [T, D] of
    x.dtype (the hidden activations rounded to x.dtype between the projections, as the MMA path does)."""
    if ew.fmt != "mxfp4":
        raise ValueError(f"the decode kernels take MXFP4 experts, not {ew.fmt}")
    n_experts = n_experts or ew.gate.shape[0]
    tiles = tiles or tiles_for(topk_ids.size, n_experts)
    sched = moe_tiles.schedule(topk_ids, n_experts, tiles.rows)
    pairs_rows = sched.row_of_pair.reshape(-1)
    xw, xf = activation_words(jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)]))  # row T: padding rows
    gate_up = ((ew.gate, ew.gate_scales), (ew.up, ew.up_scales))
    gu = partial_products(sched.tile_expert, sched.token_of_row, xw, xf, gate_up, tiles, interpret)
    h = _swiglu(jnp.sum(gu[:, pairs_rows], axis=0)).astype(x.dtype)  # [P, I]
    hw, hf = activation_words(jnp.concatenate([h, jnp.zeros((1, h.shape[1]), h.dtype)]))  # row P: padding rows
    down = partial_products(sched.tile_expert, sched.pair_of_row(), hw, hf, ((ew.down, ew.down_scales),), tiles,
                            interpret)
    y = jnp.sum(down[:, pairs_rows, 0], axis=0).reshape(*topk_ids.shape, -1)[..., :x.shape[1]]
    return moe_tiles.weighted_sum(y, topk_weights).astype(x.dtype)
