"""Decode-sized routed experts over dense weights as one Pallas (Triton) matrix-vector kernel per projection.

With a few tokens, each token-expert pair is a vector times its expert's matrix. XLA offers two ways to run that:
`ragged_dot`, which reads every expert, and gathering the chosen experts' weights (`moe_grouped.tiled_swiglu`
with 1-row tiles), which writes the gathered copy and reads it back, so about three reads of the weights. This
kernel reads each chosen weight tile once, straight from the stacked weights:

- the grid is (pair, output-column tile, K slice). Each program reads x[pair, K slice] and the slice's rows of
  W[expert of the pair][:, column tile] in `step_k`-row steps, multiplies in float32 and sums over K with a
  reduction rather than an MMA (a 1-row operand cannot fill one);
- splitting K gives a decode step enough programs to keep HBM busy (at 1 token the medium layer's gate/up kernel
  runs 6 pairs x 6 column tiles x 8 slices = 288 programs), at the cost of float32 partial sums
  [slices, pairs, N] that a small XLA reduction adds up;
- gate and up share one kernel (the same x slice feeds both), then SwiGLU and the down kernel.

Block sizes are powers of two that divide the dims (no masks; Triton needs power-of-two blocks), so any shape
runs. Rounding follows `moe.moe_experts`: each projection's output is rounded to x.dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Whether this kernel has passed tests/gpu/test_moe_gemv_gpu.py on a GPU. Until it has, dispatch runs the XLA
# paths on CUDA/ROCm unless asked for it (impl="pallas" or DAYZERO_KERNELS).
GPU_VERIFIED = False


@dataclass(frozen=True)
class GemvTiles:
    """Largest block sizes (each is cut to the largest power of two dividing its dim) and launch parameters."""

    block_n: int = 128
    step_k: int = 64
    k_slices: int = 8  # at most this many K slices per output tile (a divisor of the K step count)
    num_warps: int = 4
    num_stages: int = 2


def _pow2_divisor(n: int, limit: int) -> int:
    """Largest power of two <= limit dividing n."""
    b = 1
    while b * 2 <= limit and n % (b * 2) == 0:
        b *= 2
    return b


def _gemv_kernel(expert_ref, x_ref, *refs, n_w, bn, sk, steps):
    w_refs, o_ref = refs[:n_w], refs[n_w]
    p, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert = expert_ref[p]
    n0 = pl.multiple_of(j * bn, bn)

    def step(i, accs):
        k0 = pl.multiple_of((s * steps + i) * sk, sk)
        xv = x_ref[p, pl.ds(k0, sk)].astype(jnp.float32)
        return tuple(acc + jnp.sum(xv[:, None] * w[expert, pl.ds(k0, sk), pl.ds(n0, bn)].astype(jnp.float32), axis=0)
                     for w, acc in zip(w_refs, accs))

    accs = jax.lax.fori_loop(0, steps, step, tuple(jnp.zeros((bn,), jnp.float32) for _ in range(n_w)))
    for i, acc in enumerate(accs):
        o_ref[s, p, i, pl.ds(n0, bn)] = acc


def gathered_gemv(x_rows: jax.Array, expert: jax.Array, weights: tuple[jax.Array, ...],
                  tiles: GemvTiles = GemvTiles(), interpret: bool = False) -> jax.Array:
    """x_rows [P, K], expert [P] int32, weights: each [E, K, N] -> float32 [P, len(weights), N]: row p times
    weights[i][expert[p]], products and sums in float32."""
    n_pairs, k_dim = x_rows.shape
    n_dim = weights[0].shape[2]
    bn = _pow2_divisor(n_dim, tiles.block_n)
    sk = _pow2_divisor(k_dim, tiles.step_k)
    k_steps = k_dim // sk
    slices = max(d for d in range(1, min(tiles.k_slices, k_steps) + 1) if k_steps % d == 0)
    kernel = functools.partial(_gemv_kernel, n_w=len(weights), bn=bn, sk=sk, steps=k_steps // slices)
    partial = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((slices, n_pairs, len(weights), n_dim), jnp.float32),
        grid=(n_pairs, n_dim // bn, slices),
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="moe_gemv",
    )(expert.astype(jnp.int32), x_rows, *weights)
    return jnp.sum(partial, axis=0)


def swiglu_pairs(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                 w_down: jax.Array, tiles: GemvTiles = GemvTiles(), interpret: bool = False) -> jax.Array:
    """x [N, H], topk_ids [N, k] int, topk_weights [N, k] f32, w_gate/w_up [E, H, I], w_down [E, I, H] -> [N, H] of
    x.dtype, one kernel per projection over the N * k pairs (see the module docstring)."""
    n_tokens, top_k = topk_ids.shape
    expert = topk_ids.reshape(-1).astype(jnp.int32)
    rows = jnp.repeat(x, top_k, axis=0)  # pair p = (token p // k, choice p % k)
    gate_up = gathered_gemv(rows, expert, (w_gate, w_up), tiles, interpret).astype(x.dtype)
    hidden = (jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]).astype(x.dtype)
    out = gathered_gemv(hidden, expert, (w_down,), tiles, interpret)[:, 0].astype(x.dtype)
    weighted = out.astype(jnp.float32).reshape(n_tokens, top_k, -1) * topk_weights.astype(jnp.float32)[..., None]
    return jnp.sum(weighted, axis=1).astype(x.dtype)
