"""Routed-expert SwiGLU MLP over top-k assignments: `moe_experts` (dense weights, plain XLA: `jax.lax.ragged_dot` or
gathered one-expert tiles, whichever `moe_grouped` expects to be cheaper for the call; the MoE reference) and
`moe_experts_packed` (MXFP4 or converted experts: the Pallas grouped matmuls on CUDA/ROCm, dequantize +
`moe_experts` elsewhere).

Token-expert pairs are grouped by expert, run through one grouped matmul per projection, weighted, and summed back
per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import dispatch, moe_dense, moe_grouped, moe_mxfp4, moe_mxfp4_gemv, moe_tiles, moe_workspace, tiles as tiling
from .moe_mxfp4 import Tiles
from .moe_workspace import Workspace
from .mxfp4 import ExpertWeights

# Whether the MXFP4 grouped matmuls have passed tests/gpu/test_mxfp4_gpu.py on a GPU (H200, jax 0.11.2: 20/20 on
# 2026-11-30). Until they have, dispatch runs them on CUDA/ROCm only when asked for (impl="pallas", DAYZERO_KERNELS
# or MXFP4Execution.impl).
PACKED_GPU_VERIFIED = True


def _dense_kernel_kind(hidden: int, inter: int, impl: str | None) -> str:
    """Which `moe_dense` implementation dispatch picks for experts of hidden x inter: "pallas", "interpret", or
    "reference" (also where Triton dots need >= 16-wide blocks that the dims do not give: tiny test models run XLA
    on GPUs)."""
    kind = dispatch.choose("moe_dense", ("reference", "pallas"), impl, gpu_verified=moe_dense.GPU_VERIFIED)
    return "reference" if kind == "pallas" and not moe_dense.supported(hidden, inter) else kind


def swiglu_as_one_expert(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                         impl: str | None = None) -> jax.Array | None:
    """A dense SwiGLU MLP (a shared expert) through `moe_dense`'s grouped matmuls, as one expert that every token
    uses with weight 1: x [N, H], w_gate/w_up [H, I], w_down [I, H] -> [N, H] of x.dtype. None where dispatch does
    not pick those kernels (`impl` overrides) or they do not take the shape: the caller then runs its own layers.

    Why: at decode sizes XLA's GEMM for [1, H] @ [H, 2I] read the medium hybrid's shared expert at ~0.4 TB/s on an
    H200 (16 us per layer, benchmarks/NOTES_serving.md); the grouped kernels split K at one token.
    """
    kind = _dense_kernel_kind(w_gate.shape[0], w_gate.shape[1], impl)
    if kind == "reference" or not moe_dense.supported(w_gate.shape[0], w_gate.shape[1]):
        return None  # (interpret mode too: shapes a GPU's kernels would not take keep the caller's layers)
    ids = jnp.zeros((x.shape[0], 1), jnp.int32)
    ones = jnp.ones((x.shape[0], 1), jnp.float32)
    return moe_dense.grouped_swiglu(x, ids, ones, w_gate[None], w_up[None], w_down[None],
                                    interpret=kind == "interpret")


def routed_and_shared(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                      w_down: jax.Array, shared: tuple[jax.Array, jax.Array, jax.Array],
                      impl: str | None = None, sched: moe_tiles.Schedule | None = None) -> jax.Array | None:
    """The routed experts (as `moe_experts`) plus a shared-expert SwiGLU MLP (gate [H, S], up [H, S], down [S, H],
    S a multiple of the experts' I) in one set of `moe_dense` grouped kernels, the MLP as S / I extra experts that
    every token uses with weight 1: x [N, H] -> [N, H] of x.dtype. None where dispatch does not pick those kernels
    (`impl` overrides): the caller then runs the two its own way. `sched`: the pairs' schedule made by the router
    (`kernels.router.select_and_schedule`), topk_ids / topk_weights then with the shared parts' columns."""
    kind = shared_kernel_kind(w_gate, impl)
    if kind == "reference":
        return None
    return moe_dense.grouped_swiglu(x, topk_ids, topk_weights, w_gate, w_up, w_down, interpret=kind == "interpret",
                                    shared=shared, sched=sched)


def shared_kernel_kind(w_gate: jax.Array, impl: str | None = None) -> str:
    """Which implementation `routed_and_shared` runs for experts w_gate [E, H, I]: "pallas" / "interpret" (the
    `moe_dense` kernels), or "reference" (it then returns None)."""
    return _dense_kernel_kind(w_gate.shape[1], w_gate.shape[2], impl)


def moe_experts(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array, block_m: int | None | str = "auto", impl: str | None = None) -> jax.Array:
    """x [N, H], topk_ids [N, k] int, topk_weights [N, k] f32, w_gate/w_up [E, H, I], w_down [E, I, H] -> [N, H].

    Accumulates the weighted expert outputs in float32 and returns x.dtype. Where dispatch picks the Pallas
    grouped matmuls of `moe_dense` (`impl` overrides) and `block_m` is "auto", they run; otherwise plain XLA:
    `block_m` None runs `jax.lax.ragged_dot`, an int the gathered one-expert tiles of `moe_grouped.tiled_swiglu`,
    "auto" whichever `moe_grouped.choose_block_m` expects to be cheaper for this call's shape.
    """
    if block_m == "auto":
        kind = _dense_kernel_kind(w_gate.shape[1], w_gate.shape[2], impl)
        if kind != "reference":
            return moe_dense.grouped_swiglu(x, topk_ids, topk_weights, w_gate, w_up, w_down,
                                            interpret=kind == "interpret")
        block_m = moe_grouped.choose_block_m(topk_ids.size, w_gate.shape[0], w_gate.shape[1], w_gate.shape[2],
                                             jnp.dtype(x.dtype).itemsize)
    if block_m is not None:
        return moe_grouped.tiled_swiglu(x, topk_ids, topk_weights, w_gate, w_up, w_down, block_m)
    n_tokens, top_k = topk_ids.shape
    n_experts = w_gate.shape[0]
    flat_ids = topk_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    rows = x[order // top_k]
    group_sizes = jnp.bincount(flat_ids, length=n_experts).astype(jnp.int32)
    gate = jax.lax.ragged_dot(rows, w_gate.astype(x.dtype), group_sizes)
    up = jax.lax.ragged_dot(rows, w_up.astype(x.dtype), group_sizes)
    hidden = (jax.nn.silu(gate) * up).astype(x.dtype)
    out = jax.lax.ragged_dot(hidden, w_down.astype(x.dtype), group_sizes)
    weighted = out.astype(jnp.float32) * topk_weights.reshape(-1)[order][:, None]
    y = jnp.zeros((n_tokens, x.shape[-1]), jnp.float32).at[order // top_k].add(weighted)
    return y.astype(x.dtype)


def packed_decode_tiles(n_pairs: int, experts: ExpertWeights, workspace: Workspace | None,
                        impl: str | None = None) -> moe_mxfp4_gemv.GemvTiles | None:
    """The MXFP4 decode kernels' tiles (`moe_mxfp4_gemv.choose`) where `moe_experts_packed` runs them for a call of
    `n_pairs` token-expert pairs over `experts` (arrays, or shape structs of them): packed MXFP4, no workspace, a
    kernel platform, and stacks the kernels can index (`kernels_index`); else None. A caller that makes their
    schedule or packed activations ahead (`moe_experts_packed(sched=, x_words=)`) asks this first."""
    if _packed_kind(impl, experts) == "reference" or experts.fmt != "mxfp4" or workspace is not None:
        return None
    return moe_mxfp4_gemv.choose(n_pairs, experts.num_experts, experts.fmt)


def moe_experts_packed(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, experts: ExpertWeights, *,
                       layer: int | jax.Array = 0, workspace: Workspace | None = None,
                       tiles: Tiles | moe_mxfp4_gemv.GemvTiles | None = None, impl: str | None = None,
                       sched: moe_tiles.Schedule | None = None, x_words: tuple[jax.Array, jax.Array] | None = None,
                       shared: moe_mxfp4_gemv.SharedMLP | tuple[jax.Array, jax.Array, jax.Array] | None = None,
                       residual_sums: jax.Array | None = None) -> tuple[jax.Array, Workspace | None]:
    """x [N, H], topk_ids [N, k], topk_weights [N, k] -> ([N, H] of x.dtype, workspace).

    MXFP4 `experts` with a `workspace`: the layer's active experts are converted into it (unless resident from an
    earlier call for the same `layer`), then multiplied from it. MXFP4 without one: converted tile by tile in the
    matmul ("fused"), or at decode sizes through the CUDA-core kernels (`packed_decode_tiles`, or `tiles` given as
    theirs), which take the pairs' schedule and x's packed words made ahead (`sched`, `x_words`:
    `moe_mxfp4_gemv.grouped_swiglu`), and may add in a shared MLP (`shared`: gate [H, S], up [H, S], down [S, H]
    bf16, `moe_mxfp4_gemv.SharedFold`; the ids and weights then as that function takes them), and may add into the
    tokens' residual rows (`residual_sums` float32 [N, H]: the result is then float32 [N, H], residual + experts;
    `moe_mxfp4_gemv.sums_take_residual`).
    Converted experts (offline FP8 / BF16): multiplied directly. `layer` names the weights for the workspace's
    residency tags.
    """
    kind = _packed_kind(impl, experts, workspace)
    pallas, interpret = kind != "reference", kind == "interpret"
    n_experts = experts.num_experts
    source, slot_of_expert = experts, None
    if workspace is not None and experts.fmt == "mxfp4":
        if workspace.num_slots < min(n_experts, topk_ids.size):
            raise ValueError(f"the workspace has {workspace.num_slots} slots; this call may activate "
                             f"{min(n_experts, topk_ids.size)} experts (moe_workspace.num_slots)")
        sizes = jnp.bincount(topk_ids.reshape(-1), length=n_experts)
        workspace, assignment = moe_workspace.assign(workspace, layer, sizes)
        workspace = moe_workspace.fill(workspace, assignment, experts, pallas=pallas, interpret=interpret)
        source, slot_of_expert = moe_workspace.weights(workspace, experts), assignment.slot_of_expert
    decode_kernels = pallas and isinstance(tiles, moe_mxfp4_gemv.GemvTiles) and workspace is None
    if shared is not None and not decode_kernels:
        raise ValueError("moe_experts_packed: a shared MLP folds into the MXFP4 decode kernels only (packed experts, "
                         "no workspace, GemvTiles on a kernel platform)")
    if residual_sums is not None and not decode_kernels:
        raise ValueError("moe_experts_packed: the residual rows are added into by the MXFP4 decode kernels only "
                         "(packed experts, no workspace, GemvTiles on a kernel platform)")
    if pallas:
        y = moe_mxfp4.grouped_swiglu(x, topk_ids, topk_weights, source, slot_of_expert, n_experts, tiles, interpret,
                                     sched=sched, x_words=x_words, shared=shared, residual_sums=residual_sums)
    else:
        y = _packed_reference(x, topk_ids, topk_weights, source, slot_of_expert, n_experts)
    return y, workspace


def kernels_index(experts, workspace: Workspace | None = None) -> bool:
    """Whether the compiled MoE kernels can index every array of `experts` (an `ExpertWeights`, or any pytree of
    arrays or shape structs) and `workspace`: none has offsets that wrap in Pallas' Triton lowering
    (`tiles.offsets_wrap`; e.g. the DeepSeek-size layer's 256 experts pre-converted to FP8 unpadded, or one device
    holding a Kimi-K2-size layer's 384 packed MXFP4 experts). Where not, a call that was not asked for the kernels
    (impl="pallas") runs the reference path."""
    return tiling.first_wrapping((experts, workspace)) is None


def _packed_kind(impl: str | None, experts, workspace: Workspace | None = None) -> str:
    """The packed-expert path ("reference", "pallas" or "interpret") `dispatch` picks for `impl`, except that where it
    chose the compiled kernels (not asked for with impl="pallas") for `experts` / `workspace` they cannot index
    (`kernels_index`), the reference path: run correctly rather than raise `tiles.OffsetWrapError`."""
    kind = dispatch.choose("moe_mxfp4", ("reference", "pallas"), impl, gpu_verified=PACKED_GPU_VERIFIED)
    if kind == "pallas" and impl != "pallas" and not kernels_index(experts, workspace):
        return "reference"
    return kind


def _packed_reference(x, topk_ids, topk_weights, ew: ExpertWeights, slot_of_expert, n_experts):
    """Dequantizes the entries the call uses (the active experts, or the workspace slots) and runs `moe_experts`."""
    if slot_of_expert is None:
        n_entries = min(n_experts, topk_ids.size)
        sizes = jnp.bincount(topk_ids.reshape(-1), length=n_experts)
        index = jnp.nonzero(sizes > 0, size=n_entries, fill_value=0)[0].astype(jnp.int32)
        expert = index
        local = jnp.zeros((n_experts,), jnp.int32).at[index].set(jnp.arange(n_entries, dtype=jnp.int32))
    else:
        n_entries = ew.gate.shape[0]
        index = jnp.arange(n_entries, dtype=jnp.int32)
        valid = slot_of_expert >= 0
        expert = jnp.zeros((n_entries,), jnp.int32).at[jnp.where(valid, slot_of_expert, n_entries)].set(
            jnp.arange(n_experts, dtype=jnp.int32), mode="drop")
        local = jnp.maximum(slot_of_expert, 0)
    w_gate, w_up, w_down = ew.dense(index, expert, x.dtype)
    return moe_experts(x, local[topk_ids], topk_weights, w_gate, w_up, w_down)
