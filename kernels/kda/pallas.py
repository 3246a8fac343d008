"""Pallas (Triton lowering) Kimi Delta Attention: a chunked prefill scan in two kernels and a recurrent decode step.

Same semantics and signatures as `reference` (flash-linear-attention's): layout [B, T, H, K], `g` the per-channel
log-decay, state [B, H, K, V] float32.

Prefill (`chunk_kda`), chunks of C = 64 tokens:
  1. `_intra_kernel`, one program per (row, chunk, head), all chunks in parallel. Within the chunk it forms, from
     16-token sub-chunks, A_kk[t, s] = k_t . (k_s * exp(G_t - G_s)) (s < t) and A_qk (s <= t), solves the unit lower
     triangular system (I + beta A_kk) by 16 x 16 blocks (diagonal inverses as nilpotent products), and writes
     the WY factors w = T (beta k exp(G)), u = T (beta v), the decayed queries and keys, A_qk and the chunk decay.
     Safe decay: off-diagonal sub-chunk pairs are scaled about the sub-chunk boundary (both exponents <= 0), the
     diagonal ones take exp(G_t - G_s) element by element for s <= t only: no positive cumulative log-decay is
     ever exponentiated, so strong decays underflow to 0 instead of overflowing.
     By default (`KdaTuning.intra_variant="split"`) two kernels without serial loops replace it: `_akk_kernel`
     (A_kk and A_qk of a chunk as six masked [64, 64] products, one per "pair level", their exponents from sums of
     g within 16-token sub-chunks, plus the decayed q, k) and `_wy_kernel` (the block solve and w, u), A_kk passing
     through HBM in f32.
  2. `_state_kernel`, one program per (row, head, V block), sequential over chunks: v' = u - w S,
     o = (q exp(G)) S + A_qk v', S <- exp(G_C) S + (k exp(G_C - G))^T v'. Optionally writes S after every chunk.
Decode (`fused_recurrent_kda`, `fused_recurrent_kda_slots`): one program per (row, head, V block) holding its
[K, BV] slice of the state in registers across the step's tokens, the V blocks of a head launched side by side;
the slot variant reads and writes the state pool in place by slot index.

Rows may have different lengths (`lengths` [B]): tokens at or past a row's length leave its state unchanged and
produce zeros. Head dims that are not powers of two >= 16 are zero-padded (padded channels change nothing).
Measured on the H200 (benchmarks/RESULTS.md, NOTES_kda.md): chunk_kda 0.91-0.92 ms at B1 T8192 H32 D128 (kernels:
1a 0.53 ms, 1b 0.17, the state pass 0.19) against fla's 0.99 ms of kernels in the same runs; the decode step's
kernel 3.55-3.6 TB/s of state traffic at B64 (profiler).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .. import dispatch, tiles as tiling
from .reference import l2norm as _l2norm_ref

CHUNK = 64
SUB = 16
_EPS = 1e-6


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << (int(n) - 1).bit_length())


def _pad_last(x, size):
    pad = size - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def _precision(dtype):
    """f32 inputs keep f32 dots (IEEE); 16-bit inputs use the tensor-core path (tf32 for f32 operands)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _mm(a, b, precision):
    """a [M, K] @ b [K, N] -> f32."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _mm_nt(a, b, precision):
    """a [M, K] @ b[N, K]^T -> f32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _mm_tn(a, b, precision):
    """a[K, M]^T @ b [K, N] -> f32."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _rownorm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _EPS)


def _unit_lower_inverse(n, precision=jax.lax.Precision.HIGHEST):
    """(I + n)^-1 for strictly lower n [S, S] f32 (S a power of two): n is nilpotent (n^S = 0), so
    (I + n)^-1 = (I - n)(I + n^2)(I + n^4)...(I + n^(S/2)), a few small matmuls instead of S sequential row steps."""
    size = n.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
    eye = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)
    inv = eye - n
    power = n
    width = 2
    while width < size:
        power = _mm(power, power, precision)
        inv = _mm(inv, eye + power, precision)
        width *= 2
    return inv


# Precision of the block inverse's f32 products by `KdaTuning.wy_inverse`: IEEE FMAs on the CUDA cores, or tf32
# tensor-core products (what fla's solve_tril uses where tf32 exists).
_INVERSE_PRECISIONS = {"ieee": jax.lax.Precision.HIGHEST, "tf32": jax.lax.Precision.DEFAULT}


def _block_inverse(a, n_sub, precision=_INVERSE_PRECISIONS["ieee"]):
    """T = (I + A)^-1 for a strictly lower A given as 16 x 16 blocks {(i, j): A_ij, j <= i}: diagonal inverses by
    nilpotent products, then T_ij = -T_ii sum_{j<=m<i} A_im T_mj, all products at `precision`. Returns the blocks
    {(i, j): T_ij, j <= i}."""
    t = {}
    for i in range(n_sub):
        t[i, i] = _unit_lower_inverse(a[i, i], precision)
        for j in range(i - 1, -1, -1):
            acc = _mm(a[i, j], t[j, j], precision)
            for m in range(j + 1, i):
                acc = acc + _mm(a[i, m], t[m, j], precision)
            t[i, j] = -_mm(t[i, i], acc, precision)
    return t


# ---------------------------------------------------------------------------------------------------------------
# Prefill kernel 1: per-chunk WY factors.


def _intra_kernel(len_ref, q_ref, k_ref, v_ref, g_ref, b_ref,
                  w_ref, u_ref, qg_ref, kd_ref, aqk_ref, gl_ref, *, scale, l2norm, precision):
    """One chunk. Keeps only 16 x 16 blocks of A and T live across sub-chunks; [16, K] tiles are reloaded from
    the (cached) inputs where needed, so the register footprint stays a few tiles."""
    chunk = pl.program_id(1)
    length = len_ref[0]
    n_sub = CHUNK // SUB
    key_dim = q_ref.shape[-1]
    row16 = jax.lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
    row1d = jax.lax.broadcasted_iota(jnp.int32, (SUB,), 0)
    io_dtype = w_ref.dtype

    all_cols = pl.ds(0, key_dim)

    def live(i):
        return chunk * CHUNK + i * SUB + row16 < length  # [SUB, 1]

    def tile(ref, i, cols=None):
        return ref[pl.ds(i * SUB, SUB), all_cols if cols is None else cols].astype(jnp.float32)

    def inv_norm(ref, i):
        x = tile(ref, i)
        return jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + _EPS)  # [SUB, 1]

    q_norm = [inv_norm(q_ref, i) if l2norm else None for i in range(n_sub)]
    k_norm = [inv_norm(k_ref, i) if l2norm else None for i in range(n_sub)]

    def load_k(i, cols=None):
        k = tile(k_ref, i, cols)
        return jnp.where(live(i), k * k_norm[i] if l2norm else k, 0.0)

    def load_q(i, cols=None):
        q = tile(q_ref, i, cols)
        return jnp.where(live(i), (q * q_norm[i] if l2norm else q) * scale, 0.0)

    def load_g(i, cols=None):
        return jnp.where(live(i), tile(g_ref, i, cols), 0.0)

    def load_beta(i):
        return jnp.where(chunk * CHUNK + i * SUB + row1d < length, b_ref[pl.ds(i * SUB, SUB)].astype(jnp.float32),
                         0.0)

    offsets = [jnp.zeros((key_dim,), jnp.float32)]  # log-decay before each sub-chunk, [K]
    for i in range(n_sub):
        offsets.append(offsets[-1] + jnp.sum(load_g(i), axis=0))
    g_last = offsets[-1]

    def cum(i):
        return offsets[i][None, :] + jnp.cumsum(load_g(i), axis=0)  # [SUB, K]

    col16 = jax.lax.broadcasted_iota(jnp.int32, (1, SUB), 1)
    strictly_lower = row16 > col16  # [t, s]
    a_kk = {}
    for i in range(n_sub):
        q_i, k_i, cum_i, beta_i = load_q(i), load_k(i), cum(i), load_beta(i)

        # Diagonal block, one column s at a time: exp(G_t - G_s) only for t >= s.
        def column(j, carry, q_i=q_i, k_i=k_i, cum_i=cum_i, i=i):
            kk, qk, cum_j = carry
            live_j = chunk * CHUNK + i * SUB + j < length
            k_j = k_ref[i * SUB + j, :].astype(jnp.float32)
            if l2norm:
                k_j = k_j * jax.lax.rsqrt(jnp.sum(k_j * k_j) + _EPS)
            k_j = jnp.where(live_j, k_j, 0.0)
            cum_j = cum_j + jnp.where(live_j, g_ref[i * SUB + j, :].astype(jnp.float32), 0.0)
            decay_k = jnp.exp(jnp.where(row16 >= j, cum_i - cum_j[None, :], -jnp.inf)) * k_j[None, :]
            kk = jnp.where(col16 == j, jnp.sum(k_i * decay_k, axis=1)[:, None], kk)
            qk = jnp.where(col16 == j, jnp.sum(q_i * decay_k, axis=1)[:, None], qk)
            return kk, qk, cum_j

        zeros = jnp.zeros((SUB, SUB), jnp.float32)
        kk_ii, qk_ii, _ = jax.lax.fori_loop(0, SUB, column, (zeros, zeros, offsets[i]))
        a_kk[i, i] = beta_i[:, None] * jnp.where(strictly_lower, kk_ii, 0.0)
        aqk_ref[pl.ds(i * SUB, SUB), pl.ds(i * SUB, SUB)] = qk_ii.astype(aqk_ref.dtype)

        # Off-diagonal blocks, scaled about the start of sub-chunk i: both exponents <= 0.
        rel_i = jnp.exp(cum_i - offsets[i][None, :])
        k_left, q_left = k_i * rel_i, q_i * rel_i
        for j in range(i):
            k_right = load_k(j) * jnp.exp(offsets[i][None, :] - cum(j))
            a_kk[i, j] = beta_i[:, None] * _mm_nt(k_left, k_right, precision)
            aqk_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = _mm_nt(q_left, k_right, precision).astype(
                aqk_ref.dtype)
        for j in range(i + 1, n_sub):
            aqk_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = jnp.zeros((SUB, SUB), aqk_ref.dtype)
        rows = pl.ds(i * SUB, SUB)
        qg_ref[rows, :] = (q_i * jnp.exp(cum_i)).astype(io_dtype)
        kd_ref[rows, :] = (k_i * jnp.exp(g_last[None, :] - cum_i)).astype(io_dtype)
    gl_ref[...] = g_last

    t = _block_inverse(a_kk, n_sub)

    # WY factors w = T (beta k exp(G)), u = T (beta v), one row block at a time.
    for i in range(n_sub):
        w_i = jnp.zeros((SUB, key_dim), jnp.float32)
        u_i = jnp.zeros((SUB, u_ref.shape[-1]), jnp.float32)
        for j in range(i + 1):
            beta_j = load_beta(j)[:, None]
            v_j = jnp.where(live(j), v_ref[pl.ds(j * SUB, SUB), :].astype(jnp.float32), 0.0)  # [SUB, V]
            w_i = w_i + _mm(t[i, j], beta_j * load_k(j) * jnp.exp(cum(j)), precision)
            u_i = u_i + _mm(t[i, j], beta_j * v_j, precision)
        w_ref[pl.ds(i * SUB, SUB), :] = w_i.astype(io_dtype)
        u_ref[pl.ds(i * SUB, SUB), :] = u_i.astype(io_dtype)


# ---------------------------------------------------------------------------------------------------------------
# Prefill kernel 1, split variant: (1a) the A blocks of a chunk without serial loops, (1b) the solve and WY factors.

# Pair levels of the 64-token chunk: the pair (t, s), s < t, belongs to the level h (a power of two) where t and s
# first differ, i.e. h <= t ^ s < 2h: s lies in the even h-block just before t's odd one, inside one 2h-block.
_LEVELS = (32, 16, 8, 4, 2, 1)

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_EX2_PTX = "ex2.approx.ftz.f32 $0, $1;"


def _exp2(x, asm: bool):
    """2^x for f32 x; `asm`: one MUFU instruction (PTX ex2.approx.ftz, max relative error ~2^-22; subnormal results
    flush to 0), where libdevice's expf takes ~8 instructions per element."""
    if asm:
        return pltriton.elementwise_inline_asm(_EX2_PTX, args=[x], constraints="=r,r", pack=1,
                                               result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]
    return jnp.exp2(x)


def _level_exponent_from_local(gs_ref, local, cols, h, row, rows, odd):
    """Level h's exponents [C, BK] from the sub-chunk sums `local` (= gs_ref[:, cols]: sum of g from the row's
    16-token sub-chunk start to the row): G_t - G_ref on rows of odd h-blocks, G_ref - G_s on rows of even ones,
    G_ref the cumulative log-decay at the end of the even block. Each is a sum of g over at most two sub-chunks, so
    it loses ~ulp of those sums, not of the chunk's cumulative G (what a difference of chunk cumulative sums loses,
    and what the last tokens of strongly decaying chunks feel)."""
    if h < SUB:  # both rows and the reference in one sub-chunk
        ref = gs_ref[(rows & ~(2 * h - 1)) + (h - 1), cols]
        return jnp.where(odd, local - ref, ref - local)
    block_end = gs_ref[rows | (SUB - 1), cols]  # the sum over the row's whole sub-chunk
    if h == SUB:  # the reference ends the sub-chunk before t's: G_t - G_ref = local_t
        return jnp.where(odd, local, block_end - local)
    assert h == 2 * SUB == CHUNK // 2, h
    # reference: the end of sub-chunk 1; t in sub-chunk 3 adds sub-chunk 2's sum, s in sub-chunk 0 adds sub-chunk 1's
    sub1, sub2 = gs_ref[pl.ds(2 * SUB - 1, 1), cols], gs_ref[pl.ds(3 * SUB - 1, 1), cols]
    return jnp.where(odd, local + jnp.where(row >= 3 * SUB, sub2, 0.0),
                     block_end - local + jnp.where(row < SUB, sub1, 0.0))


def _akk_kernel(len_ref, q_ref, k_ref, g_ref, b_ref, akk_ref, aqk_ref, qg_ref, kd_ref, x_ref, gl_ref, gs_ref, *, scale,
                l2norm, precision, block_k, prologue_block_k, level_group, dot_dtype, asm, barrier):
    """Kernel 1a, one chunk, all 64 rows at once: A_kk (beta-scaled, strictly lower, f32), A_qk, q exp(G),
    k exp(G_C - G), x = beta k exp(G) (the right-hand side of w, rounded to the input dtype as fla does) and G_C.

    1. `_akk_first_pass`: the sums of g within 16-token sub-chunks (scratch output `gs_ref`), the decayed outputs,
       G_C and diag(A_qk), with the per-row factors (scale, l2 norm, length mask).
    2. A barrier (the loads by index below read rows other threads stored), then `_akk_levels`: A_kk and A_qk below
       the diagonal by pair levels.
    """
    live, beta, q_mul, k_mul = _akk_rows(len_ref, q_ref, k_ref, b_ref, scale=scale, l2norm=l2norm,
                                         block_k=prologue_block_k)
    diag = _akk_first_pass(q_ref, k_ref, g_ref, qg_ref, kd_ref, x_ref, gl_ref, gs_ref, live, beta, q_mul, k_mul,
                           block_k=prologue_block_k, asm=asm)
    if barrier:
        pltriton.debug_barrier()
    _akk_levels(q_ref, k_ref, gs_ref, akk_ref, aqk_ref, beta, q_mul, k_mul, diag, precision=precision,
                block_k=block_k, level_group=level_group, dot_dtype=dot_dtype, asm=asm)


def _cols(kb, width):
    """Slice kb of `width` channels (an aligned dynamic slice)."""
    return pl.ds(pl.multiple_of(kb * width, width), width)


def _load_cols(ref, kb, width):
    return ref[:, _cols(kb, width)].astype(jnp.float32)


def _akk_rows(len_ref, q_ref, k_ref, b_ref, *, scale, l2norm, block_k):
    """A chunk's per-row values [C] f32: live (bool), beta, and the factors of q (scale, l2 norm) and k (l2 norm),
    all 0 on rows at or past the row's length. The l2 norms are summed over slices of `block_k` channels."""
    chunk = pl.program_id(1)
    rows = jax.lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    live = chunk * CHUNK + rows < len_ref[0]
    q_mul = jnp.where(live, scale, 0.0)
    k_mul = jnp.where(live, 1.0, 0.0)
    if l2norm:
        def sum_squares(kb, acc):
            q, k = _load_cols(q_ref, kb, block_k), _load_cols(k_ref, kb, block_k)
            return acc[0] + jnp.sum(q * q, axis=1), acc[1] + jnp.sum(k * k, axis=1)

        zero = jnp.zeros((CHUNK,), jnp.float32)
        q_sq, k_sq = jax.lax.fori_loop(0, q_ref.shape[-1] // block_k, sum_squares, (zero, zero))
        q_mul = q_mul * jax.lax.rsqrt(q_sq + _EPS)
        k_mul = k_mul * jax.lax.rsqrt(k_sq + _EPS)
    beta = jnp.where(live, b_ref[...].astype(jnp.float32), 0.0)
    return live, beta, q_mul, k_mul


def _akk_first_pass(q_ref, k_ref, g_ref, qg_ref, kd_ref, x_ref, gl_ref, gs_ref, live, beta, q_mul, k_mul, *, block_k,
                    asm):
    """Over slices of `block_k` channels: the sums of g (in base 2: g log2 e) within each 16-token sub-chunk up to
    each row, stored to `gs_ref` [C, K] f32; from them and the sub-chunks' totals G, G_C - G and G_C, the decayed
    outputs q exp(G), x = beta k exp(G), k exp(G_C - G) (input dtype) and G_C. Returns diag(A_qk) = q . k [C] (with
    the row factors)."""
    io_dtype = qg_ref.dtype
    pk = block_k
    n_sub = CHUNK // SUB
    sub = jax.lax.broadcasted_iota(jnp.int32, (n_sub, 1, 1), 0)
    pos = jax.lax.broadcasted_iota(jnp.int32, (1, SUB, 1), 1)

    cols = functools.partial(_cols, width=pk)

    def body(kb, diag):
        q = _load_cols(q_ref, kb, pk) * q_mul[:, None]
        k = _load_cols(k_ref, kb, pk) * k_mul[:, None]
        g = jnp.where(live[:, None], _load_cols(g_ref, kb, pk), 0.0) * _LOG2E  # base-2 log-decays
        # G and G_C - G from sums within 16-token sub-chunks and the sub-chunks' totals: G_C - G_t computed as
        # G_C minus a cumulative sum loses ~ulp(|G_C|) (the decay of the chunk's last tokens, which the state
        # update weighs most); this way it loses ~ulp of one sub-chunk's sum
        blocks = g.reshape(n_sub, SUB, pk)
        inclusive = jnp.cumsum(blocks, axis=1)
        # each sub-chunk's total taken from the scan's own last row (a masked sum: exact), so that G_C - G is
        # exactly 0 on the chunk's last token and the same numbers on every row (a separate sum rounds otherwise)
        totals = jnp.sum(jnp.where(pos == SUB - 1, inclusive, 0.0), axis=1, keepdims=True)  # [n_sub, 1, BK]
        t = [jnp.sum(jnp.where(sub == i, totals, 0.0), axis=0, keepdims=True) for i in range(n_sub)]  # [1, 1, BK]
        before, after = jnp.zeros_like(totals), jnp.zeros_like(totals)
        for i in range(1, n_sub):
            before = jnp.where(sub == i, sum(t[:i]), before)
            after = jnp.where(sub == n_sub - 1 - i, sum(t[n_sub - i:]), after)
        cum = (before + inclusive).reshape(CHUNK, pk)  # G within the chunk
        remaining = (totals - inclusive + after).reshape(CHUNK, pk)  # G_C - G
        last = sum(t).reshape(pk)  # G_C
        gs_ref[:, cols(kb)] = inclusive.reshape(CHUNK, pk)  # the levels' exponents come from these sums
        decay = _exp2(cum, asm)
        qg_ref[:, cols(kb)] = (q * decay).astype(io_dtype)
        x_ref[:, cols(kb)] = (beta[:, None] * k * decay).astype(io_dtype)
        kd_ref[:, cols(kb)] = (k * _exp2(remaining, asm)).astype(io_dtype)
        gl_ref[cols(kb)] = last * _LN2
        return diag + jnp.sum(q * k, axis=1)

    return jax.lax.fori_loop(0, q_ref.shape[-1] // pk, body, jnp.zeros((CHUNK,), jnp.float32))


def _akk_levels(q_ref, k_ref, gs_ref, akk_ref, aqk_ref, beta, q_mul, k_mul, diag, *, precision, block_k, level_group,
                dot_dtype, asm):
    """A_kk (beta-scaled, strictly lower, f32) and A_qk of one chunk from q, k (raw) and the sub-chunk sums of g.

    Over slices of `block_k` channels, the pair levels h of `_LEVELS`: rows of odd h-blocks take G_t - G_ref, rows of
    even blocks G_ref - G_s (`_level_exponent_from_local`; both sums of g <= 0: no positive log-decay is
    exponentiated), f = 2^exponent (one MUFU op), kf = k f. A level's pairs (t, s) have t in an odd h-block and s in
    the even one before it, so in kf . Y^T with Y = q f on odd-block rows and kf on even-block rows, entry (t, s)
    (t > s) is A_kk[t, s] and entry (s, t) is A_qk[t, s]: one product per level and slice, accumulated in the MMA's
    own accumulator and masked to the level's pairs once per level. `level_group` levels share one pass over the
    slices (their q, k and sums loads; one accumulator each). The per-row factors (scale, l2 norm, length mask) are
    applied to the [C, C] result once, not to each operand: entry (i, j) below the diagonal is k_i . k_j (factor
    k_mul_i k_mul_j), above it k_i . q_j (k_mul_i q_mul_j). Products on `dot_dtype` operands (f32: tf32 on the GPU
    for 16-bit inputs, exact for f32 inputs; or bf16).
    """
    n_k = q_ref.shape[-1] // block_k
    row = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, 1), 0)
    rows = jax.lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)

    cols = functools.partial(_cols, width=block_k)

    r = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
    differ = r ^ c
    zeros = jnp.zeros((CHUNK, CHUNK), jnp.float32)
    total = zeros
    for first in range(0, len(_LEVELS), level_group):
        levels = _LEVELS[first:first + level_group]

        def level(kb, accs, levels=levels):
            q, k = _load_cols(q_ref, kb, block_k), _load_cols(k_ref, kb, block_k)
            local = gs_ref[:, cols(kb)]  # sums of g within each 16-token sub-chunk, up to and including the row
            out = []
            for h, acc in zip(levels, accs):
                odd = (row & h) != 0  # [C, 1]: rows of odd h-blocks
                f = _exp2(_level_exponent_from_local(gs_ref, local, cols(kb), h, row, rows, odd), asm)
                kf = k * f
                out.append(acc + _mm_nt(kf.astype(dot_dtype), jnp.where(odd, q * f, kf).astype(dot_dtype),
                                        precision))
            return tuple(out)

        accs = jax.lax.fori_loop(0, n_k, level, tuple(zeros for _ in levels))
        for h, acc in zip(levels, accs):
            total = total + jnp.where((differ >= h) & (differ < 2 * h), acc, 0.0)
    lower = r > c
    scaled = total * k_mul[:, None]
    akk_ref[...] = jnp.where(lower, (beta * k_mul)[:, None] * total * k_mul[None, :], 0.0)
    upper = scaled * q_mul[None, :]  # (s, t), s < t: A_qk[t, s]
    aqk_ref[...] = (jnp.where(lower, upper.T, 0.0) + jnp.where(r == c, diag[:, None], 0.0)).astype(aqk_ref.dtype)


def _wy_kernel(len_ref, x_ref, v_ref, b_ref, akk_ref, w_ref, u_ref, *, precision, dot_dtype, inverse_precision):
    """One chunk: T = (I + A_kk)^-1 from A_kk's 16 x 16 blocks (f32 operands; products at `inverse_precision`), then
    w = T x (x = beta k exp(G) from kernel 1a) and u = T (beta v), products on `dot_dtype` operands."""
    chunk = pl.program_id(1)
    length = len_ref[0]
    n_sub = CHUNK // SUB
    row16 = jax.lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
    io_dtype = w_ref.dtype
    blocks = {(i, j): akk_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] for i in range(n_sub) for j in range(i + 1)}
    t = _block_inverse(blocks, n_sub, inverse_precision)

    def rhs(j):  # x_j and beta_j v_j, [SUB, K] and [SUB, V], reloaded per use (cached) to keep few tiles live
        rows = pl.ds(j * SUB, SUB)
        live = chunk * CHUNK + j * SUB + row16 < length
        beta = jnp.where(live, b_ref[rows].astype(jnp.float32)[:, None], 0.0)
        y = beta * jnp.where(live, v_ref[rows, :].astype(jnp.float32), 0.0)
        return x_ref[rows, :].astype(dot_dtype), y.astype(dot_dtype)

    t = {key: value.astype(dot_dtype) for key, value in t.items()}
    for i in range(n_sub):
        x, y = rhs(0)
        w_i, u_i = _mm(t[i, 0], x, precision), _mm(t[i, 0], y, precision)
        for j in range(1, i + 1):
            x, y = rhs(j)
            w_i = w_i + _mm(t[i, j], x, precision)
            u_i = u_i + _mm(t[i, j], y, precision)
        w_ref[pl.ds(i * SUB, SUB), :] = w_i.astype(io_dtype)
        u_ref[pl.ds(i * SUB, SUB), :] = u_i.astype(io_dtype)


# ---------------------------------------------------------------------------------------------------------------
# Prefill kernel 2: the sequential pass over chunks.


def _state_kernel(*refs, n_chunks, precision, has_initial, chunk_states):
    w_ref, u_ref, qg_ref, kd_ref, aqk_ref, gl_ref = refs[:6]
    rest = refs[6:]
    h0_ref = rest[0] if has_initial else None
    rest = rest[1:] if has_initial else rest
    o_ref, hT_ref = rest[:2]
    hc_ref = rest[2] if chunk_states else None
    io_dtype = w_ref.dtype
    key_dim, block_v = hT_ref.shape
    if has_initial:
        state = h0_ref[...].astype(jnp.float32)
    else:
        state = jnp.zeros((key_dim, block_v), jnp.float32)
    row = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)

    def body(c, carry):
        state, g_last = carry
        # the next chunk's log-decays loaded one chunk ahead: used elementwise, this load is outside Triton's
        # pipeline, and waiting on it held each chunk (ncu, H200: the exp's first instruction was the top stall)
        g_next = gl_ref[jnp.minimum(c + 1, n_chunks - 1), :]
        rows = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
        s_in = state.astype(io_dtype)
        v_new = u_ref[rows, :].astype(jnp.float32) - _mm(w_ref[rows, :], s_in, precision)
        v_cast = v_new.astype(io_dtype)
        a_qk = jnp.where(row >= col, aqk_ref[rows, :], 0).astype(io_dtype)
        o = _mm(qg_ref[rows, :], s_in, precision) + _mm(a_qk, v_cast, precision)
        o_ref[rows, :] = o.astype(o_ref.dtype)
        state = state * jnp.exp(g_last)[:, None] + _mm_tn(kd_ref[rows, :], v_cast, precision)
        if chunk_states:
            hc_ref[c, :, :] = state
        return state, g_next

    state, _ = jax.lax.fori_loop(0, n_chunks, body, (state, gl_ref[0, :]))
    hT_ref[...] = state


def _params(num_warps, num_stages=None):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _bhv_grid(batch, heads, n_v, v_fastest):
    """Launch grid over (row, head, V block) and the map from a program's indices to (b, h, j). Pallas launches grid
    axis 0 as CUDA's fastest axis: with `v_fastest` the V blocks of one head run side by side (neighbouring
    programs read neighbouring bytes of its state and share its q/k/g reads), else the rows do."""
    if v_fastest:
        return (n_v, heads, batch), lambda j, h, b: (b, h, j)
    return (batch, heads, n_v), lambda b, h, j: (b, h, j)


def _bhv_spec(block, index, order):
    """A BlockSpec whose index map is written in (b, h, j), for a grid from `_bhv_grid`."""
    return pl.BlockSpec(block, lambda *ids: index(*order(*ids)))


@dataclasses.dataclass(frozen=True)
class KdaTuning:
    """Launch parameters of the KDA kernels (the H200 measurements behind the defaults: benchmarks/RESULTS.md)."""

    state_block_v: int = 32  # V columns per program of the sequential prefill pass
    intra_warps: int = 4
    intra_stages: int = 1
    state_warps: int = 4
    state_stages: int = 3
    # The recurrent step: V columns and warps per program, launch order (`_bhv_grid`: V blocks of a head side by side,
    # or rows side by side), and whether the step's two reductions over K both read the decayed state (the output
    # then q.S + (q.k) delta, `_delta_step`) or the output is reduced after the update. Defaults: the shortest kernel
    # time the profiler measured on the H200 at B64, 74.2-75.2 us (3.57-3.62 TB/s) in three runs against 75-78 us for
    # the other shapes (75.4 us with the output after the update; benchmarks/NOTES_kda.md).
    decode_block_v: int = 64
    decode_warps: int = 4
    decode_v_fastest: bool = True
    decode_output_before_update: bool = True
    # Prefill kernel 1: "fused" (one kernel per chunk, 16-step column loops for the diagonal blocks) or "split"
    # (kernel 1a: A blocks by pair levels, no serial loop, over `intra_block_k` channels at a time, with intra_warps /
    # intra_stages; kernel 1b: block solve and WY factors with wy_warps). `intra_bf16_dots`: the split variant's A
    # and WY products on bf16 operands for 16-bit inputs (fla's choice for WY) instead of tf32.
    # Defaults: the fastest measured on the H200 for bf16 (with today's kernel 1a, 2026-12-01: chunk_kda T8192
    # 0.918-0.931 ms with 32 channels x 4 warps, against 1.03 ms for 64 x 8 warps; the fused
    # kernel 3.56 ms); float32 inputs run the split kernels with at most F32_INTRA_BLOCK_K channels and
    # F32_INTRA_WARPS warps, the setting that passed tests/gpu/test_kda_gpu.py.
    intra_variant: str = "split"
    intra_block_k: int = 32
    wy_warps: int = 2
    intra_bf16_dots: bool = True
    # Kernel 1a (`_akk_kernel`): its first pass over slices of `intra_prologue_block_k` channels (0: all of K), and how
    # many pair levels share one pass over the `intra_block_k`-channel slices. H200, 2026-12-01 (fifth session, fla
    # in the same runs; NOTES_kda.md items 14-15): 64 channels and three levels per pass, chunk_kda T8192
    # 0.918-0.931 ms against 0.978-1.008 for 32 or 128 channels and one level per pass; six levels per pass 1.12 ms
    # (spills).
    intra_prologue_block_k: int = 64
    intra_level_group: int = 3
    # Kernel 1b's block inverse for 16-bit inputs (`_INVERSE_PRECISIONS`): "tf32" (tensor-core products, as fla's
    # solve_tril) or "ieee" (f32 FMAs); f32 inputs always take "ieee". H200, 2026-12-01 (sixth session, three runs
    # beside fla): kernel 1b 166-169 us with tf32 at 2 warps (chunk_kda T8192 0.907-0.922 ms) against 183-185 us
    # with ieee at 4 warps (0.925-0.934 ms); tf32 at 1 or 4 warps 191-201 / 169 us, ieee at 2 warps 198 us.
    wy_inverse: str = "tf32"


DEFAULT_TUNING = KdaTuning()
F32_INTRA_BLOCK_K, F32_INTRA_WARPS = 32, 4


def chunk_intra(q, k, v, g, beta, lengths, *, scale, l2norm, interpret=False, tuning=DEFAULT_TUNING):
    """Prefill kernel 1 on padded inputs (T a multiple of 64, head dims powers of two >= 16).

    Returns w, u, q exp(G) (scaled), k exp(G_C - G) [B, T, H, K or V] and A_qk [B, T, H, 64] in the input dtype
    (f32 for f32 inputs), and the chunk log-decays G_C [B, T / 64, H, K] f32.
    """
    if tuning.intra_variant == "split":
        return _chunk_intra_split(q, k, v, g, beta, lengths, scale=scale, l2norm=l2norm, interpret=interpret,
                                  tuning=tuning)
    if tuning.intra_variant != "fused":
        raise ValueError(f"unknown intra_variant {tuning.intra_variant!r} (fused or split)")
    batch, t_pad, heads, kp = k.shape
    vp = v.shape[-1]
    n_chunks = t_pad // CHUNK
    io_dtype = jnp.float32 if q.dtype == jnp.float32 else q.dtype
    sq = pl.squeezed
    chunk_spec = lambda d: pl.BlockSpec((sq, CHUNK, sq, d), lambda b, c, h: (b, c, h, 0))
    shape = lambda d: jax.ShapeDtypeStruct((batch, t_pad, heads, d), io_dtype)
    return tiling.pallas_call(
        functools.partial(_intra_kernel, scale=scale, l2norm=l2norm, precision=_precision(io_dtype)),
        grid=(batch, n_chunks, heads),
        in_specs=[pl.BlockSpec((1,), lambda b, c, h: (b,)), chunk_spec(kp), chunk_spec(kp), chunk_spec(vp),
                  chunk_spec(kp), pl.BlockSpec((sq, CHUNK, sq), lambda b, c, h: (b, c, h))],
        out_specs=[chunk_spec(kp), chunk_spec(vp), chunk_spec(kp), chunk_spec(kp), chunk_spec(CHUNK),
                   pl.BlockSpec((sq, sq, sq, kp), lambda b, c, h: (b, c, h, 0))],
        out_shape=[shape(kp), shape(vp), shape(kp), shape(kp), shape(CHUNK),
                   jax.ShapeDtypeStruct((batch, n_chunks, heads, kp), jnp.float32)],
        compiler_params=_params(tuning.intra_warps, tuning.intra_stages),
        interpret=interpret,
        name="kda_chunk_intra",
    )(lengths, q, k, v, g, beta)


def _split_settings(io_dtype, tuning):
    """(precision, dot dtype, channels per slice, warps) of the split kernels for inputs of `io_dtype`."""
    dot_dtype = jnp.bfloat16 if tuning.intra_bf16_dots and io_dtype != jnp.float32 else jnp.float32
    block_k, warps = tuning.intra_block_k, tuning.intra_warps
    if io_dtype == jnp.float32:
        block_k, warps = min(block_k, F32_INTRA_BLOCK_K), min(warps, F32_INTRA_WARPS)
    return _precision(io_dtype), dot_dtype, block_k, warps


def _chunk_specs(batch, t_pad, heads, io_dtype):
    sq = pl.squeezed
    index = lambda b, c, h: (b, c, h, 0)
    chunk_spec = lambda d: pl.BlockSpec((sq, CHUNK, sq, d), index)
    beta_spec = pl.BlockSpec((sq, CHUNK, sq), lambda b, c, h: (b, c, h))
    len_spec = pl.BlockSpec((1,), lambda b, c, h: (b,))
    shape = lambda d, dtype=io_dtype: jax.ShapeDtypeStruct((batch, t_pad, heads, d), dtype)
    return chunk_spec, beta_spec, len_spec, shape


def chunk_akk(q, k, g, beta, lengths, *, scale, l2norm, interpret=False, tuning=DEFAULT_TUNING):
    """Split prefill kernel 1a on padded inputs: A_kk [B, T, H, 64] f32 (beta-scaled, strictly lower), A_qk
    [B, T, H, 64], q exp(G) (scaled), k exp(G_C - G), x = beta k exp(G) [B, T, H, K] in the input dtype, and G_C
    [B, T / 64, H, K] f32."""
    batch, t_pad, heads, kp = k.shape
    n_chunks = t_pad // CHUNK
    io_dtype = jnp.float32 if q.dtype == jnp.float32 else q.dtype
    precision, dot_dtype, block_k, warps = _split_settings(io_dtype, tuning)
    chunk_spec, beta_spec, len_spec, shape = _chunk_specs(batch, t_pad, heads, io_dtype)
    prologue_k = min(tuning.intra_prologue_block_k or kp, kp)
    if kp % prologue_k or not 1 <= tuning.intra_level_group <= len(_LEVELS):
        raise ValueError(f"KdaTuning: intra_prologue_block_k {tuning.intra_prologue_block_k} must divide the padded "
                         f"key dim {kp}; intra_level_group {tuning.intra_level_group} must be 1..{len(_LEVELS)}")
    # the barrier has no meaning (and no interpreter rule) in interpret mode, where a program runs as one thread
    kernel = functools.partial(_akk_kernel, scale=scale, l2norm=l2norm, precision=precision, block_k=min(block_k, kp),
                               prologue_block_k=prologue_k, level_group=tuning.intra_level_group, dot_dtype=dot_dtype,
                               asm=dispatch.nvidia_ptx(interpret), barrier=not interpret)
    outs = tiling.pallas_call(
        kernel,
        grid=(batch, n_chunks, heads),
        in_specs=[len_spec, chunk_spec(kp), chunk_spec(kp), chunk_spec(kp), beta_spec],
        # the last output is scratch: the sums of g within each sub-chunk, read back by index (dropped below)
        out_specs=[chunk_spec(CHUNK), chunk_spec(CHUNK), chunk_spec(kp), chunk_spec(kp), chunk_spec(kp),
                   pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, kp), lambda b, c, h: (b, c, h, 0)),
                   chunk_spec(kp)],
        out_shape=[shape(CHUNK, jnp.float32), shape(CHUNK), shape(kp), shape(kp), shape(kp),
                   jax.ShapeDtypeStruct((batch, n_chunks, heads, kp), jnp.float32), shape(kp, jnp.float32)],
        compiler_params=_params(warps, tuning.intra_stages),
        interpret=interpret,
        name="kda_chunk_akk",
    )(lengths, q, k, g, beta)
    return tuple(outs[:6])


def chunk_wy(x, v, beta, a_kk, lengths, *, interpret=False, tuning=DEFAULT_TUNING):
    """Split prefill kernel 1b: the WY factors w = T x [B, T, H, K] and u = T (beta v) [B, T, H, V], T = (I + A_kk)^-1
    per chunk, from kernel 1a's x and A_kk."""
    batch, t_pad, heads, kp = x.shape
    vp = v.shape[-1]
    io_dtype = x.dtype
    precision, dot_dtype, _, _ = _split_settings(io_dtype, tuning)
    if tuning.wy_inverse not in _INVERSE_PRECISIONS:
        raise ValueError(f"KdaTuning.wy_inverse {tuning.wy_inverse!r}: one of {', '.join(_INVERSE_PRECISIONS)}")
    inverse = _INVERSE_PRECISIONS["ieee" if io_dtype == jnp.float32 else tuning.wy_inverse]
    chunk_spec, beta_spec, len_spec, shape = _chunk_specs(batch, t_pad, heads, io_dtype)
    return tiling.pallas_call(
        functools.partial(_wy_kernel, precision=precision, dot_dtype=dot_dtype, inverse_precision=inverse),
        grid=(batch, t_pad // CHUNK, heads),
        in_specs=[len_spec, chunk_spec(kp), chunk_spec(vp), beta_spec, chunk_spec(CHUNK)],
        out_specs=[chunk_spec(kp), chunk_spec(vp)],
        out_shape=[shape(kp), shape(vp)],
        compiler_params=_params(tuning.wy_warps),
        interpret=interpret,
        name="kda_chunk_wy",
    )(lengths, x, v, beta, a_kk)


def _chunk_intra_split(q, k, v, g, beta, lengths, *, scale, l2norm, interpret, tuning):
    """`chunk_intra`'s outputs from two kernels: 1a (A_kk, A_qk, decayed q and k, G_C, x) and 1b (w, u)."""
    a_kk, a_qk, qg, kd, x, g_last = chunk_akk(q, k, g, beta, lengths, scale=scale, l2norm=l2norm,
                                              interpret=interpret, tuning=tuning)
    w, u = chunk_wy(x, v, beta, a_kk, lengths, interpret=interpret, tuning=tuning)
    return w, u, qg, kd, a_qk, g_last


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "use_qk_l2norm_in_kernel",
                                             "output_chunk_states", "interpret", "tuning"))
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, lengths=None, output_chunk_states=False, interpret=False,
              tuning: KdaTuning = DEFAULT_TUNING):
    """Chunked KDA. q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V];
    lengths [B] int32 (default: T for every row).

    Returns (o [B, T, H, V] in q.dtype, final state [B, H, K, V] f32 or None), and with `output_chunk_states`
    a third value: the state after each chunk of 64 tokens, [B, ceil(T / 64), H, K, V] f32.
    """
    batch, length, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    out_dtype = q.dtype
    io_dtype = jnp.float32 if out_dtype == jnp.float32 else q.dtype
    scale = key_dim ** -0.5 if scale is None else scale
    if lengths is None:
        lengths = jnp.full((batch,), length, jnp.int32)
    lengths = jnp.minimum(lengths.astype(jnp.int32), length)
    kp, vp = _pow2_at_least_16(key_dim), _pow2_at_least_16(value_dim)
    block_v = min(tuning.state_block_v, vp)
    n_chunks = max(1, -(-length // CHUNK))
    t_pad = n_chunks * CHUNK
    q, k, g = (_pad_last(x, kp) for x in (q, k, g))
    v = _pad_last(v, vp)
    if t_pad != length:
        widths = ((0, 0), (0, t_pad - length), (0, 0), (0, 0))
        q, k, v, g = (jnp.pad(x, widths) for x in (q, k, v, g))
        beta = jnp.pad(beta, widths[:3])
    inputs = list(chunk_intra(q, k, v, g, beta, lengths, scale=scale, l2norm=use_qk_l2norm_in_kernel,
                              interpret=interpret, tuning=tuning))

    sq = pl.squeezed
    seq_spec = lambda d: pl.BlockSpec((sq, t_pad, sq, d), lambda b, h, j: (b, 0, h, 0))
    v_spec = pl.BlockSpec((sq, t_pad, sq, block_v), lambda b, h, j: (b, 0, h, j))
    state_spec = pl.BlockSpec((sq, sq, kp, block_v), lambda b, h, j: (b, h, 0, j))
    in_specs = [seq_spec(kp), v_spec, seq_spec(kp), seq_spec(kp), seq_spec(CHUNK),
                pl.BlockSpec((sq, n_chunks, sq, kp), lambda b, h, j: (b, 0, h, 0))]
    if initial_state is not None:
        h0 = initial_state.astype(jnp.float32)
        inputs.append(jnp.pad(h0, ((0, 0), (0, 0), (0, kp - key_dim), (0, vp - value_dim))))
        in_specs.append(state_spec)
    out_specs = [v_spec, state_spec]
    out_shape = [jax.ShapeDtypeStruct((batch, t_pad, heads, vp), out_dtype),
                 jax.ShapeDtypeStruct((batch, heads, kp, vp), jnp.float32)]
    if output_chunk_states:
        out_specs.append(pl.BlockSpec((sq, n_chunks, sq, kp, block_v), lambda b, h, j: (b, 0, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((batch, n_chunks, heads, kp, vp), jnp.float32))
    outs = tiling.pallas_call(
        functools.partial(_state_kernel, n_chunks=n_chunks, precision=_precision(io_dtype),
                          has_initial=initial_state is not None, chunk_states=output_chunk_states),
        grid=(batch, heads, vp // block_v),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        # f32 tiles take twice the shared memory per pipeline stage: 3 stages of them exceed the H200's 227 KiB.
        compiler_params=_params(tuning.state_warps,
                                tuning.state_stages if jnp.dtype(io_dtype).itemsize <= 2 else min(2, tuning.state_stages)),
        interpret=interpret,
        name="kda_chunk_state",
    )(*inputs)
    o = outs[0][:, :length, :, :value_dim]
    final = outs[1][:, :, :key_dim, :value_dim] if output_final_state else None
    if output_chunk_states:
        return o, final, outs[2][:, :, :, :key_dim, :value_dim]
    return o, final


# ---------------------------------------------------------------------------------------------------------------
# Decode: the recurrent step.


def _load_token(t, q_ref, k_ref, v_ref, g_ref, b_ref, *, l2norm, length):
    """Token t's inputs in f32: q, k (l2-normalised if asked) [K], v [BV], g [K] and beta, the last two zeroed past
    `length`; and whether t is live."""
    q = q_ref[t, :].astype(jnp.float32)
    k = k_ref[t, :].astype(jnp.float32)
    if l2norm:
        q, k = _l2normalize(q), _l2normalize(k)
    live = t < length
    g = jnp.where(live, g_ref[t, :].astype(jnp.float32), 0.0)
    beta = jnp.where(live, b_ref[t].astype(jnp.float32), 0.0)
    return q, k, v_ref[t, :].astype(jnp.float32), g, beta, live


def _l2normalize(x):
    """x [K] float32 / sqrt(sum(x^2) + eps) (fla's form, as `reference.l2norm`)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x) + _EPS)


def _delta_step(state, token, scale, output_before_update):
    """One token of the delta rule on a [K, BV] state slice: (new state, output [BV], zeros if the token is dead).

    `output_before_update`: both reductions over K read the decayed state before the update, o = q.(S + k delta) =
    q.S + (q.k) delta, so neither waits on the other and q.k needs no state; otherwise o = q.S_new after it."""
    q, k, v, g, beta, live = token
    q = q * scale
    state = state * jnp.exp(g)[:, None]
    q_state = jnp.sum(q[:, None] * state, axis=0) if output_before_update else None
    delta = beta * (v - jnp.sum(k[:, None] * state, axis=0))
    state = state + k[:, None] * delta[None, :]
    o = q_state + jnp.sum(q * k) * delta if output_before_update else jnp.sum(q[:, None] * state, axis=0)
    return state, jnp.where(live, o, 0.0)


def _recurrent_steps(load_state, steps, token_refs, o_ref, *, scale, l2norm, length, output_before_update):
    """Runs `steps` tokens on the state that `load_state()` reads, writing o [steps, BV]; returns the new state.

    A single token's inputs are read before the state, so that their reads overlap the state read (in the slots
    kernel the state's address waits on the slot index read first)."""
    def load(t):
        return _load_token(t, *token_refs, l2norm=l2norm, length=length)

    if steps == 1:
        token = load(0)
        state, o = _delta_step(load_state(), token, scale, output_before_update)
        o_ref[0, :] = o.astype(o_ref.dtype)
        return state

    def body(t, state):
        state, o = _delta_step(state, load(t), scale, output_before_update)
        o_ref[t, :] = o.astype(o_ref.dtype)
        return state

    return jax.lax.fori_loop(0, steps, body, load_state())


def _recurrent_kernel(*refs, steps, scale, l2norm, has_initial, output_before_update):
    len_ref, q_ref, k_ref, v_ref, g_ref, b_ref = refs[:6]
    h0_ref = refs[6] if has_initial else None
    o_ref, hT_ref = refs[-2:]

    def load_state():
        return h0_ref[...].astype(jnp.float32) if has_initial else jnp.zeros(hT_ref.shape, jnp.float32)

    hT_ref[...] = _recurrent_steps(load_state, steps, (q_ref, k_ref, v_ref, g_ref, b_ref), o_ref, scale=scale,
                                   l2norm=l2norm, length=len_ref[0], output_before_update=output_before_update)


def _token_specs(steps, kp, vp, block_v, order):
    sq = pl.squeezed
    tok = lambda d: _bhv_spec((sq, steps, sq, d), lambda b, h, j: (b, 0, h, 0), order)
    return [tok(kp), tok(kp), _bhv_spec((sq, steps, sq, block_v), lambda b, h, j: (b, 0, h, j), order), tok(kp),
            _bhv_spec((sq, steps, sq), lambda b, h, j: (b, 0, h), order)]


def _recurrent_inputs(q, k, v, g, beta, lengths, scale):
    batch, steps, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    kp, vp = _pow2_at_least_16(key_dim), _pow2_at_least_16(value_dim)
    scale = key_dim ** -0.5 if scale is None else scale
    if lengths is None:
        lengths = jnp.full((batch,), steps, jnp.int32)
    q, k, g = (_pad_last(x, kp) for x in (q, k, g))
    return q, k, _pad_last(v, vp), g, beta, lengths.astype(jnp.int32), scale, kp, vp


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "use_qk_l2norm_in_kernel",
                                             "interpret", "tuning"))
def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, lengths=None, interpret=False, tuning=DEFAULT_TUNING):
    """Token-by-token KDA for a few tokens per row. Shapes as `chunk_kda`; returns (o, final state or None)."""
    batch, steps, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    q, k, v, g, beta, lengths, scale, kp, vp = _recurrent_inputs(q, k, v, g, beta, lengths, scale)
    block_v = min(tuning.decode_block_v, vp)
    sq = pl.squeezed
    grid, order = _bhv_grid(batch, heads, vp // block_v, tuning.decode_v_fastest)
    state_spec = _bhv_spec((sq, sq, kp, block_v), lambda b, h, j: (b, h, 0, j), order)
    inputs = [lengths, q, k, v, g, beta]
    in_specs = [_bhv_spec((1,), lambda b, h, j: (b,), order)] + _token_specs(steps, kp, vp, block_v, order)
    if initial_state is not None:
        h0 = initial_state.astype(jnp.float32)
        inputs.append(jnp.pad(h0, ((0, 0), (0, 0), (0, kp - key_dim), (0, vp - value_dim))))
        in_specs.append(state_spec)
    o, final = tiling.pallas_call(
        functools.partial(_recurrent_kernel, steps=steps, scale=scale, l2norm=use_qk_l2norm_in_kernel,
                          has_initial=initial_state is not None,
                          output_before_update=tuning.decode_output_before_update),
        grid=grid,
        in_specs=in_specs,
        out_specs=[_bhv_spec((sq, steps, sq, block_v), lambda b, h, j: (b, 0, h, j), order), state_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, steps, heads, vp), q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, kp, vp), jnp.float32)],
        compiler_params=_params(tuning.decode_warps),
        interpret=interpret,
        name="kda_recurrent",
    )(*inputs)
    o = o[..., :value_dim]
    return o, (final[:, :, :key_dim, :value_dim] if output_final_state else None)


def _slots_kernel(slot_ref, len_ref, q_ref, k_ref, v_ref, g_ref, b_ref, pool_ref, o_ref, pool_out_ref, *,
                       steps, scale, l2norm, layer, block_v, order, output_before_update):
    _, head, j = order(pl.program_id(0), pl.program_id(1), pl.program_id(2))
    cols = pl.ds(j * block_v, block_v)
    slot = slot_ref[0]
    state = _recurrent_steps(lambda: pool_ref[layer, slot, head, :, cols], steps, (q_ref, k_ref, v_ref, g_ref, b_ref),
                             o_ref, scale=scale, l2norm=l2norm, length=len_ref[0],
                             output_before_update=output_before_update)
    pool_out_ref[layer, slot, head, :, cols] = state


def slots_supported(pool_shape) -> bool:
    """Whether the in-place slots kernel takes a pool [L, S, H, K, V] as it is (K, V powers of two >= 16)."""
    return all(_pow2_at_least_16(d) == d for d in pool_shape[-2:])


@functools.partial(jax.jit, static_argnames=("layer", "scale", "use_qk_l2norm_in_kernel", "interpret", "tuning"))
def fused_recurrent_kda_slots(q, k, v, g, beta, state_pool, slots, layer=0, scale=None,
                              use_qk_l2norm_in_kernel=False, lengths=None, interpret=False, tuning=DEFAULT_TUNING):
    """Recurrent KDA reading and writing states in place in a pool, for serving.

    state_pool [L, S, H, K, V] f32 (every KDA layer's slots; K and V powers of two >= 16), slots [B] int32 (row b
    uses state_pool[layer, slots[b]]). Returns (o [B, T, H, V], the updated pool). Rows sharing a slot race: give
    padding rows a scratch slot.
    """
    batch, steps, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    if state_pool.shape[-2:] != (key_dim, value_dim) or not slots_supported(state_pool.shape):
        raise ValueError(f"state pool {state_pool.shape} needs head dims ({key_dim}, {value_dim}) that are powers "
                         "of two >= 16")
    q, k, v, g, beta, lengths, scale, kp, vp = _recurrent_inputs(q, k, v, g, beta, lengths, scale)
    block_v = min(tuning.decode_block_v, vp)
    sq = pl.squeezed
    grid, order = _bhv_grid(batch, heads, vp // block_v, tuning.decode_v_fastest)
    row = _bhv_spec((1,), lambda b, h, j: (b,), order)
    o, pool = tiling.pallas_call(
        functools.partial(_slots_kernel, steps=steps, scale=scale, l2norm=use_qk_l2norm_in_kernel,
                          layer=layer, block_v=block_v, order=order,
                          output_before_update=tuning.decode_output_before_update),
        grid=grid,
        in_specs=[row, row] + _token_specs(steps, kp, vp, block_v, order) + [pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[_bhv_spec((sq, steps, sq, block_v), lambda b, h, j: (b, 0, h, j), order),
                   pl.BlockSpec(memory_space=pl.ANY)],
        out_shape=[jax.ShapeDtypeStruct((batch, steps, heads, vp), q.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={7: 1},
        compiler_params=_params(tuning.decode_warps),
        interpret=interpret,
        name="kda_recurrent_slots",
    )(slots.astype(jnp.int32), lengths, q, k, v, g, beta, state_pool)
    return o, pool


def l2norm(x):
    """The l2 normalisation the kernels apply with `use_qk_l2norm_in_kernel` (same as the reference's)."""
    return _l2norm_ref(x, _EPS)
