"""A routed SwiGLU expert MLP in one Pallas (Triton) kernel for decode-sized calls over dense (bf16 / fp32) weights.

At a decode step the split-K path of `moe_dense` runs a row gather, the gate/up kernel, XLA's sums and SwiGLU, the
down kernel and XLA's weighted combine: five launches per MoE layer, each a few microseconds of ramp and tail at
these sizes. Here one program takes one row tile of one expert (the `moe_tiles` schedule) and one block of
`block_i` intermediate columns, and does the whole MLP for that block:

1. gate and up [rows, block_i]: the tile's rows read from x by token (padding rows zero) times the expert's gate and
   up columns, walking all of K (the SwiGLU needs complete sums, so K is not split);
2. hidden = silu(gate) * up, each rounded to x's dtype first (as `moe.moe_experts` rounds);
3. the down product of those block_i hidden columns with the matching block_i rows of w_down, [rows, H] in
   `block_n`-column steps, times each row's routing weight, added atomically into a float32 [T, H] output.

The down projection is linear in the hidden columns, so the per-block products add up to the expert's output; the
routing weight applies per row, so the atomics also do the combine. The output is not rounded per pair before the
weighting (the unfused path rounds each pair's down output to x's dtype): the sums differ from it by that rounding.
Float32 atomics add in no fixed order, so results can differ run to run in the last bits.

Interpret mode (CPU tests) cannot mask an atomic: padding rows there add zeros into scratch rows past the T tokens;
on a GPU the atomics are masked to the tile's real rows. A shared-expert MLP rides along as extra experts, split
into parts of the experts' intermediate width (`moe_dense.grouped_swiglu(shared=)`).

Measured on the H200 (benchmarks/NOTES_serving.md, sixteenth session): correct, but no faster than the split-K
kernels, so off by default (`moe_dense.FUSED_MLP_MAX_PAIRS`). With K whole, a layer has only 72-144 programs of 4
warps and each warp waits on its own MMA accumulator chain (ncu: 6.9% achieved occupancy). `k_chains` splits each K
step over independent accumulators, to give a warp more MMAs in flight: no gain measured (seventeenth session, one
token with the shared MLP inside: 2 chains 31.65 us, 4 chains 33.0, against 33.55 with one and 31.48 for the split-K
kernels; moe.py --sweep mlp --shared-parts 2; tests/gpu/test_moe_dense_gpu.py -k mlp_chains passes). Two forms
measured and dropped: per-pair partial sums added by XLA instead of the atomics (same kernel time, more traffic) and programs
starting their down-product column walk at different chunks (no change: the atomics' contention is not the cost).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import atomics, moe_tiles, tiles as tiling


def _fused_kernel(tile_expert_ref, token_ref, row_weight_ref, x_ref, *refs, bm, bi, sk, bn, chains, n_routed,
                  has_shared, masked):
    w_gate, w_up, w_down = refs[:3]
    shared = refs[3:6] if has_shared else None
    o_ref = refs[-1]  # [(T + bm) * H] float32 sums, aliased to the zeros passed in
    n_tokens, hidden = x_ref.shape
    t, b = pl.program_id(0), pl.program_id(1)
    expert = tile_expert_ref[t]
    r0 = pl.multiple_of(t * bm, bm)
    i0 = pl.multiple_of(b * bi, bi)
    token = token_ref[pl.ds(r0, bm)]
    real = token < n_tokens
    safe = jnp.where(real, token, 0)
    part_k = sk // chains

    def run(gate_up_block, down_block):  # gate_up_block(w, k0, size) [size, bi]; down_block(n0) [bi, bn]
        def gate_up_step(i, accs):  # accs: gate and up accumulators of each chain, chain c over part c of the step
            out = []
            for c in range(chains):
                k0 = pl.multiple_of(i * sk + c * part_k, part_k)
                xb = x_ref[safe, pl.ds(k0, part_k)]
                xb = jnp.where(real[:, None], xb, jnp.zeros_like(xb))
                out += [accs[2 * c + w] + tiling.mm(xb, gate_up_block(w, k0, part_k).astype(xb.dtype))
                        for w in range(2)]
            return tuple(out)

        zeros = jnp.zeros((bm, bi), jnp.float32)
        accs = jax.lax.fori_loop(0, hidden // sk, gate_up_step, (zeros,) * (2 * chains))
        dtype = x_ref.dtype
        gate, up = (sum(accs[w::2][1:], accs[w]).astype(dtype).astype(jnp.float32) for w in range(2))
        h = (jax.nn.silu(gate) * up).astype(dtype)  # [bm, bi]
        row_weight = row_weight_ref[pl.ds(r0, bm)]

        def down_step(j, carry):
            n0 = pl.multiple_of(j * bn, bn)
            y = tiling.mm(h, down_block(n0).astype(dtype)) * row_weight[:, None]
            add_to_tokens(o_ref, token, y, n0, n_tokens=n_tokens, n_dim=hidden, masked=masked)
            return carry

        jax.lax.fori_loop(0, hidden // bn, down_step, 0)

    def routed_gate_up(w, k0, size):
        return refs[w][expert, pl.ds(k0, size), pl.ds(i0, bi)]

    def routed_down(n0):
        return w_down[expert, pl.ds(i0, bi), pl.ds(n0, bn)]

    if not has_shared:
        pl.when(expert >= 0)(lambda: run(routed_gate_up, routed_down))
        return
    part = expert - n_routed  # which part of the shared MLP's intermediate columns this tile runs
    inter = w_gate.shape[2]

    def shared_gate_up(w, k0, size):  # [H, parts * I]: the part's columns
        return shared[w][pl.ds(k0, size), pl.ds(pl.multiple_of(part * inter + i0, bi), bi)]

    def shared_down(n0):  # [parts * I, H]: the part's rows
        return shared[2][pl.ds(pl.multiple_of(part * inter + i0, bi), bi), pl.ds(n0, bn)]

    pl.when((expert >= 0) & (expert < n_routed))(lambda: run(routed_gate_up, routed_down))
    pl.when(expert >= n_routed)(lambda: run(shared_gate_up, shared_down))


def fused_swiglu(x: jax.Array, sched: moe_tiles.Schedule, topk_weights: jax.Array, w_gate: jax.Array,
                 w_up: jax.Array, w_down: jax.Array, *, block_m: int, block_i: int, step_k: int, block_n: int,
                 num_warps: int, num_stages: int, k_chains: int = 1,
                 shared: tuple[jax.Array, jax.Array, jax.Array] | None = None, interpret: bool = False) -> jax.Array:
    """x [T, H], `sched` in `block_m`-row tiles, topk_weights [T, k] float32 (k: the schedule's pairs per token),
    w_gate / w_up [E, H, I], w_down [E, I, H] -> [T, H] float32: over each token's pairs, the sum of
    weight * down(silu(gate) * up), added up by float32 atomics (run-to-run order varies). `shared` (gate [H, P * I],
    up [H, P * I], down [P * I, H]): a shared MLP whose P parts are experts E .. E + P - 1 of the schedule. Blocks are
    cut to the largest powers of two dividing the dims (block_i of I, step_k and block_n of H); each K step runs
    `k_chains` independent accumulator pairs over its parts (a power of two dividing the step)."""
    n_tokens, hidden = x.shape
    n_experts, _, inter = w_gate.shape
    if w_gate.shape[1] != hidden or w_up.shape != w_gate.shape or w_down.shape != (n_experts, inter, hidden):
        raise ValueError(f"experts gate {w_gate.shape}, up {w_up.shape}, down {w_down.shape} for rows of {hidden}")
    bi = tiling.pow2_divisor(inter, block_i)
    sk = tiling.pow2_divisor(hidden, step_k)
    bn = tiling.pow2_divisor(hidden, block_n)
    if k_chains < 1 or sk % k_chains:
        raise ValueError(f"k_chains {k_chains} does not split K steps of {sk}")
    kernel = functools.partial(_fused_kernel, bm=block_m, bi=bi, sk=sk, bn=bn, chains=k_chains, n_routed=n_experts,
                               has_shared=shared is not None, masked=not interpret)
    operands = (sched.tile_expert.astype(jnp.int32), sched.token_of_row.astype(jnp.int32),
                moe_tiles.row_weights(sched, topk_weights), x, w_gate, w_up, w_down, *(shared or ()))
    return token_sums(kernel, operands, n_tokens, block_m, hidden,
                      grid=(sched.token_of_row.shape[0] // block_m, inter // bi),
                      compiler_params=tiling.compiler_params(num_warps, num_stages), interpret=interpret,
                      name="moe_dense_fused_mlp")


def add_to_tokens(o_ref, token, y, n0, *, n_tokens: int, n_dim: int, masked: bool):
    """In a kernel of `token_sums`: adds y [bm, bn] float32 (one tile's rows, of tokens `token` [bm], T or more for
    padding rows) into the flat sums o_ref [(T + bm) * n_dim] at columns n0 .. n0 + bn, by relaxed atomics.
    `masked` (GPU): padding rows add nothing; unmasked (interpret mode, which cannot mask an atomic): they add into
    distinct scratch rows past the tokens."""
    bm, bn = y.shape
    real = token < n_tokens
    target = jnp.where(real, token, n_tokens + jax.lax.broadcasted_iota(jnp.int32, (bm,), 0))
    columns = n0 + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 1)
    atomics.add_relaxed(o_ref, (target[:, None] * n_dim + columns,), y,
                        mask=jnp.broadcast_to(real[:, None], (bm, bn)) if masked else None)


def token_sums(kernel, operands, n_tokens: int, block_m: int, n_dim: int, **call) -> jax.Array:
    """Runs `kernel` (pl.pallas_call options `call`) on `operands` plus a zeroed float32 buffer [(T + block_m) *
    n_dim] that it adds into (`add_to_tokens`; its last ref) -> the tokens' sums [T, n_dim] float32."""
    zeros = jnp.zeros(((n_tokens + block_m) * n_dim,), jnp.float32)
    sums = tiling.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(zeros.shape, jnp.float32),
                          input_output_aliases={len(operands): 0}, **call)(*operands, zeros)
    return sums[:n_tokens * n_dim].reshape(n_tokens, n_dim)

