"""MXFP4 (OCP Microscaling: E2M1 elements, one E8M0 scale per 32) in the gpt-oss packing, plain jnp.

Packed layout, as published: `blocks` uint8 [..., n, 16] and `scales` uint8 [..., n]. Byte j of block b holds element
32b+2j in its low nibble and element 32b+2j+1 in its high nibble; a nibble is sign (bit 3) | exponent (bits 2-1) |
mantissa (bit 0), magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}. The scale byte s means 2^(s-127); 0xFF means NaN. A row of
K elements takes n = ceil(K/32) blocks, zero-padded.

Converted (workspace) layout [..., n, 2, 16]: plane 0 holds the 16 even elements of a block (the low nibbles), plane
1 the 16 odd ones, so the MoE kernels can contract them against the even and odd columns of the activations without
interleaving. In float8_e4m3fn the planes hold the E2M1 values exactly and the E8M0 scales stay apart; in bfloat16
the scale is folded in (exact).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
SCALE_BIAS = 127
SCALE_NAN = 0xFF
E2M1_MAX = 6.0
WORKSPACE_DTYPES = ("float8_e4m3fn", "bfloat16")

# Per 3-bit magnitude code: |value| = (1 + m3/2) * 2^(eq + m3 - 1), i.e. twice the value is (1 + 2*m3) * 2^eq.
_TWICE_ODD = np.array([0, 0, 0, 1, 0, 1, 0, 1], np.int32)  # 2|v| = 3 * 2^eq (else 1 * 2^eq)
_TWICE_EXP = np.array([0, 0, 1, 0, 2, 1, 3, 2], np.int32)
# Round-to-nearest-even boundaries between consecutive magnitudes; a tie goes up where the lower code is odd.
_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_TIE_UP = np.array([0, 1, 0, 1, 0, 1, 0], bool)


def num_blocks(k: int) -> int:
    """Blocks of 32 covering a row of k elements."""
    return -(-k // BLOCK)


def codes(blocks: jax.Array) -> jax.Array:
    """uint8 [..., n, 16] -> int32 nibble codes [..., n, 32] in element order."""
    b = blocks.astype(jnp.int32)
    return jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(*blocks.shape[:-1], BLOCK)


def _e2m1_times_pow2_bits(code: jax.Array, exponent: jax.Array) -> jax.Array:
    """float32 bit patterns of E2M1(code) * 2^exponent, exact, subnormals included (built from integers, so a
    backend that flushes denormals cannot change them). code int32 [...], exponent int32 broadcastable."""
    mag = code & 7
    odd = jnp.asarray(_TWICE_ODD)[mag]
    # |v| = (1 + odd/2) * 2^e  with  e = eq + odd - 1 + exponent  (the normalised binary exponent)
    e = jnp.asarray(_TWICE_EXP)[mag] + odd - 1 + exponent
    normal = jnp.where(e + 127 >= 255, 0x7F800000, ((e + 127) << 23) | (odd << 22))
    # below 2^-126: significand (2 + odd) * 2^(e-1), in units of 2^-149
    subnormal = jnp.left_shift(2 + odd, jnp.clip(e + 148, 0, 31))
    bits = jnp.where(e >= -126, normal, jnp.where(e + 148 >= 0, subnormal, 0))
    bits = jnp.where(mag == 0, 0, bits)
    return bits | ((code & 8) << 28)


def dequantize(blocks: jax.Array, scales: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """blocks uint8 [..., n, 16], scales uint8 [..., n] -> [..., n*32] of `dtype`.

    Exact for float32 and bfloat16 (bit-equal to transformers' `convert_moe_packed_tensors`, which differs only at
    scale 0xFF: NaN here, as the OCP spec says); other dtypes are rounded from float32.
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"blocks {blocks.shape} and scales {scales.shape} do not pair up as [..., n, 16] / [..., n]")
    s = scales.astype(jnp.int32)[..., None]
    bits = _e2m1_times_pow2_bits(codes(blocks), s - SCALE_BIAS)
    bits = jnp.where(s == SCALE_NAN, 0x7FC00000, bits).reshape(*scales.shape[:-1], -1)
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16:  # every value has at most two significant bits: the top half of float32 is exact
        return jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def pow2(e: jax.Array) -> jax.Array:
    """2.0^e as float32 for int32 e in [-126, 127]."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def scale_value(s: jax.Array) -> jax.Array:
    """E8M0 scale codes (int32) -> 2^(s - 127) as float32; 0xFF -> NaN (code 0 gives 0.0, not the subnormal
    2^-127)."""
    return jnp.where(s == SCALE_NAN, jnp.nan, jax.lax.bitcast_convert_type(s << 23, jnp.float32))


def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [..., K] float -> (blocks uint8 [..., n, 16], scales uint8 [..., n]), n = ceil(K/32), zero-padded.

    Per block the shared exponent is floor(log2(amax)) - 2 (OCP MX: the largest element lands in [4, 8)), clamped
    to the E8M0 range; elements are divided by it and rounded to nearest even on the E2M1 grid, saturating at 6.
    """
    k = w.shape[-1]
    n = num_blocks(k)
    x = jnp.pad(w.astype(jnp.float32), [(0, 0)] * (w.ndim - 1) + [(0, n * BLOCK - k)])
    x = x.reshape(*w.shape[:-1], n, BLOCK)
    amax = jnp.max(jnp.abs(x), axis=-1)
    _, ex = jnp.frexp(amax)  # amax = m * 2^ex, m in [0.5, 1): floor(log2(amax)) = ex - 1
    s = jnp.clip(ex.astype(jnp.int32) - 3 + SCALE_BIAS, 0, 254)
    shift = SCALE_BIAS - s[..., None]  # multiply by 2^shift in two exact steps (each factor stays normal)
    half = shift // 2
    a = jnp.abs(x) * pow2(half) * pow2(shift - half)
    above = a[..., None] > jnp.asarray(_BOUNDS)
    tie = (a[..., None] == jnp.asarray(_BOUNDS)) & jnp.asarray(_TIE_UP)
    mag = jnp.sum(above | tie, axis=-1, dtype=jnp.int32)
    code = mag | (jnp.signbit(x).astype(jnp.int32) << 3)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(jnp.uint8)
    return packed, s.astype(jnp.uint8)


def to_workspace(blocks: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """Packed [..., n, 16] (+ scales [..., n]) -> converted [..., n, 2, 16] of `dtype` (see the module docstring)."""
    dtype = jnp.dtype(dtype)
    c = codes(blocks).reshape(*blocks.shape[:-1], BLOCK // 2, 2).swapaxes(-1, -2)  # [..., n, 2, 16]
    if dtype == jnp.float8_e4m3fn:
        bits = _e2m1_times_pow2_bits(c, jnp.zeros((), jnp.int32))
        return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)
    if dtype == jnp.bfloat16:
        s = scales.astype(jnp.int32)[..., None, None]
        bits = jnp.where(s == SCALE_NAN, 0x7FC00000, _e2m1_times_pow2_bits(c, s - SCALE_BIAS))
        return jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    raise ValueError(f"workspace dtype {dtype} is not one of {WORKSPACE_DTYPES}")


def from_workspace(data: jax.Array, scales: jax.Array | None, dtype=jnp.float32) -> jax.Array:
    """Converted [..., n, 2, 16] (+ scales [..., n] for float8) -> dense [..., n*32] of `dtype`."""
    x = data.astype(jnp.float32)
    if data.dtype == jnp.float8_e4m3fn:
        x = x * scale_value(scales.astype(jnp.int32)[..., None, None])
    x = x.swapaxes(-1, -2).reshape(*data.shape[:-3], -1)
    return x.astype(dtype)


def random_scale_centre(std: float = 0.02) -> int:
    """The E8M0 scale byte around which random scales are drawn (centre - 1 .. centre + 1) so that dequantized
    weights with uniform codes have about `std` standard deviation."""
    return int(np.floor(np.log2(std / 2.9))) + SCALE_BIAS


def random_packed(key: jax.Array, shape: tuple[int, ...], is_scales: bool, std: float = 0.02) -> jax.Array:
    """Random packed expert weights: uniform codes (blocks) or E8M0 scales around std / 3 (scales), so the
    dequantized weights have about `std` standard deviation (for presets and benchmarks)."""
    if is_scales:
        centre = random_scale_centre(std)
        return jax.random.randint(key, shape, centre - 1, centre + 2).astype(jnp.uint8)
    return jax.random.randint(key, shape, 0, 256).astype(jnp.uint8)


def random_experts(key: jax.Array, n_experts: int, hidden: int, inter: int, std: float = 0.02) -> "ExpertWeights":
    """Random MXFP4 routed experts of one layer (gate/up [E, inter, hidden/32, 16], down [E, hidden, inter/32, 16]
    and their scales), dequantizing to about `std` standard deviation (for benchmarks and GPU tests)."""
    def packed(k, rows, cols):
        kb, ks = jax.random.split(k)
        n = num_blocks(cols)
        return (random_packed(kb, (n_experts, rows, n, 16), False, std),
                random_packed(ks, (n_experts, rows, n), True, std))

    kg, ku, kd = jax.random.split(key, 3)
    (gb, gs), (ub, us), (db, ds) = packed(kg, inter, hidden), packed(ku, inter, hidden), packed(kd, hidden, inter)
    return ExpertWeights(gb, ub, db, gs, us, ds)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["gate", "up", "down", "gate_scales", "up_scales", "down_scales"], meta_fields=["fmt"])
@dataclass(frozen=True)
class ExpertWeights:
    """One MoE layer's routed experts by projection, in one storage format `fmt`.

    "mxfp4": gate/up blocks uint8 [E, I, ceil(D/32), 16], down [E, D, ceil(I/32), 16] (as published, [out, in]);
    "float8_e4m3fn" / "bfloat16": converted [X, I, ceil(D/32), 2, 16] and [X, D, ceil(I/32), 2, 16] for X experts
    (offline conversion) or workspace slots. Scales uint8 [E, I, ceil(D/32)] / [E, D, ceil(I/32)] are always indexed
    by expert (None for bfloat16, whose scales are folded in).
    """

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_scales: jax.Array | None
    up_scales: jax.Array | None
    down_scales: jax.Array | None
    fmt: str = "mxfp4"

    @property
    def hidden_size(self) -> int:
        return self.down.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.gate.shape[1]

    @property
    def num_experts(self) -> int:
        """E: the scales' leading size (indexed by expert even where the data are workspace slots or padded), else
        the data's (bfloat16, no scales)."""
        return (self.gate_scales if self.gate_scales is not None else self.gate).shape[0]

    def dense(self, index: jax.Array, expert: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Stored entries `index` [S] (their experts `expert` [S], for the scales) as dense reference weights:
        w_gate, w_up [S, D, I] and w_down [S, I, D] of `dtype`."""
        d, i = self.hidden_size, self.intermediate_size

        def one(data, scales, k):
            s = None if scales is None else scales[expert]
            w = dequantize(data[index], s, dtype) if self.fmt == "mxfp4" else from_workspace(data[index], s, dtype)
            return w[..., :k].swapaxes(-1, -2)

        return one(self.gate, self.gate_scales, d), one(self.up, self.up_scales, d), one(self.down, self.down_scales, i)
