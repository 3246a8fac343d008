"""Routed experts over dense weights in plain XLA, and the choice between the two ways XLA can run them.

`jax.lax.ragged_dot` is what XLA offers for grouped matmuls, but its default GPU lowering (and the CPU one) expands
the ragged operand into one zero-padded matmul per group: every call reads all E experts and does E times the useful
FLOPs. That costs a decode step the whole layer's weights (a medium-hybrid layer measured 181 us on an H200, the
time to read all 64 experts) and a prefill chunk E times its matmul work.

`tiled_swiglu` instead groups the token-expert pairs into one-expert row tiles (`moe_tiles.schedule`, the grouped
Pallas kernels' schedule), gathers each tile's expert weights and runs one batched matmul over the tiles: the work is
the tiles' real rows, and the weight traffic is the tiles' experts (written by the gather and read back: about three
reads' worth), not all E. With 1-row tiles a decode step touches only its tokens' experts.

`choose_block_m` picks, per call shape (static), the cheaper of ragged_dot and tiles of 1..4096 rows under a simple
roofline (`GroupingCost`: bytes over bandwidth plus FLOPs over matmul throughput), and caps the gathered copies at
two layers' worth of expert weights. The constants are H200-like estimates, not measurements of this code:
`benchmarks/moe.py` times both paths ("bf16 ragged_dot", "bf16 tiles") to calibrate them. Where the Pallas grouped
matmuls of `moe_dense` run, they replace both paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from . import moe_tiles

BLOCK_SIZES = tuple(2 ** i for i in range(13))  # 1 .. 4096 rows


@dataclass(frozen=True)
class GroupingCost:
    """Roofline constants of the choice: HBM bytes/s, dense matmul FLOP/s, and the most gathered expert copies per
    projection, as a multiple of the expert count (the transient memory the tile path may take)."""

    bandwidth: float = 4.0e12
    matmul_flops: float = 6.0e14
    max_tiles_per_expert: float = 2.0


def estimated_seconds(n_pairs: int, n_experts: int, hidden: int, inter: int, itemsize: int, block_m: int | None,
                      cost: GroupingCost = GroupingCost()) -> float:
    """Roofline time of one layer call: ragged_dot (`block_m` None: all experts read, E x the FLOPs) or tiles."""
    weight_bytes = 3 * hidden * inter * itemsize  # gate, up, down of one expert
    flops_per_row = 2 * 3 * hidden * inter
    if block_m is None:
        return n_experts * weight_bytes / cost.bandwidth + n_experts * n_pairs * flops_per_row / cost.matmul_flops
    n_tiles = moe_tiles.max_tiles(n_pairs, n_experts, block_m)
    return 3 * n_tiles * weight_bytes / cost.bandwidth + n_tiles * block_m * flops_per_row / cost.matmul_flops


def choose_block_m(n_pairs: int, n_experts: int, hidden: int, inter: int, itemsize: int,
                   cost: GroupingCost = GroupingCost()) -> int | None:
    """The row-tile size of the cheapest grouping for a call of `n_pairs` token-expert pairs, or None for
    ragged_dot (see the module docstring)."""
    best, best_time = None, estimated_seconds(n_pairs, n_experts, hidden, inter, itemsize, None, cost)
    for block_m in BLOCK_SIZES:
        if moe_tiles.max_tiles(n_pairs, n_experts, block_m) > cost.max_tiles_per_expert * n_experts:
            continue
        seconds = estimated_seconds(n_pairs, n_experts, hidden, inter, itemsize, block_m, cost)
        if seconds < best_time:
            best, best_time = block_m, seconds
        if block_m >= n_pairs:
            break
    return best


def tiled_swiglu(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                 w_down: jax.Array, block_m: int) -> jax.Array:
    """x [N, H], topk_ids [N, k] int, topk_weights [N, k] f32, w_gate/w_up [E, H, I], w_down [E, I, H] -> [N, H] of
    x.dtype: the pairs in one-expert tiles of `block_m` rows, each tile's weights gathered, one batched matmul per
    projection (products accumulated in float32, each projection's output rounded to x.dtype as ragged_dot's is)."""
    n_experts = w_gate.shape[0]
    sched = moe_tiles.schedule(topk_ids, n_experts, block_m)
    n_tiles = sched.tile_expert.shape[0]
    rows = moe_tiles.take_or_zero(x, sched.token_of_row).reshape(n_tiles, block_m, x.shape[1])
    expert = jnp.maximum(sched.tile_expert, 0)  # unused tiles hold zero rows; any expert will do

    def project(a, w):
        return jnp.einsum("tmk,tkn->tmn", a, w[expert].astype(x.dtype),
                          preferred_element_type=jnp.float32).astype(x.dtype)

    hidden = (jax.nn.silu(project(rows, w_gate)) * project(rows, w_up)).astype(x.dtype)
    out = project(hidden, w_down).reshape(n_tiles * block_m, -1)
    return moe_tiles.combine(out, sched, topk_weights).astype(x.dtype)
