"""The MXFP4 expert workspace: one buffer of converted (FP8 or BF16) experts, sized for one layer's active experts
and reused by every layer, with residency tags so a conversion already resident is not redone.

A `Workspace` is a value threaded through the layers of a forward pass (functional state: each layer takes it and
returns the updated one, and XLA updates the buffer in place). `assign` maps the layer's active experts to slots:
an expert whose (layer, expert) tag is resident keeps its slot (a hit), the others take slots holding nothing this
layer needs (a miss: converted by `fill`). `hits` and `misses` count expert conversions reused and done.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import moe_mxfp4, mxfp4, tiles as tiling
from .mxfp4 import ExpertWeights

EMPTY = -1


class Workspace(NamedTuple):
    """gate, up [S, I, ceil(D/32), 2, 16] and down [S, D, ceil(I/32), 2, 16] of float8_e4m3fn or bfloat16;
    tags [S] int32 (layer * E + expert, or EMPTY); hits, misses int32 scalars."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    tags: jax.Array
    hits: jax.Array
    misses: jax.Array

    @property
    def num_slots(self) -> int:
        return self.tags.shape[0]

    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (self.gate, self.up, self.down))


class Assignment(NamedTuple):
    """slot_of_expert [E] int32 (EMPTY for inactive experts); need [S] bool: slots to convert now;
    slot_expert [S] int32: the expert to convert into each such slot."""

    slot_of_expert: jax.Array
    need: jax.Array
    slot_expert: jax.Array


def num_slots(n_pairs: int, n_experts: int) -> int:
    """Slots for one layer's active experts: at most one per token-expert pair, at most every expert."""
    return min(n_pairs, n_experts)


def create(slots: int, hidden: int, intermediate: int, dtype="float8_e4m3fn") -> Workspace:
    """An empty workspace of at least `slots` experts of a layer with hidden size `hidden` and expert width
    `intermediate`. Where `slots` FP8 experts would make a buffer the kernels cannot index (more than 2**31 bytes and
    at most 2**32: `tiles.offsets_wrap`, e.g. 147-292 slots of the DeepSeek-size layer) it has enough slots to pass
    2**32 bytes; the extra slots keep more conversions resident."""
    if jnp.dtype(dtype).name not in mxfp4.WORKSPACE_DTYPES:
        raise ValueError(f"workspace dtype {dtype} is not one of {mxfp4.WORKSPACE_DTYPES}")
    gd, gi = mxfp4.num_blocks(hidden), mxfp4.num_blocks(intermediate)
    half = mxfp4.BLOCK // 2
    slots = tiling.entries_clear_of_wrap(slots, ((intermediate, gd, 2, half), (hidden, gi, 2, half)), dtype)
    zeros = lambda *shape: jnp.zeros(shape, dtype)  # noqa: E731
    return Workspace(zeros(slots, intermediate, gd, 2, half), zeros(slots, intermediate, gd, 2, half),
                     zeros(slots, hidden, gi, 2, half), jnp.full((slots,), EMPTY, jnp.int32),
                     jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def clear_of_offset_wrap(ew: ExpertWeights) -> ExpertWeights:
    """Offline-converted experts `ew` (float8_e4m3fn / bfloat16 entries [X, ...]) as the kernels can index them:
    unchanged, or, where X entries of a projection make a buffer whose offsets wrap (`tiles.offsets_wrap`: FP8
    stacks of 2**31-2**32 bytes, e.g. the whole DeepSeek-size layer), every projection padded with zero entries past
    2**32 bytes. The scales stay indexed by expert, so the padding entries are never read."""
    if ew.fmt == "mxfp4":
        raise ValueError("clear_of_offset_wrap takes converted experts (float8_e4m3fn / bfloat16), not packed MXFP4")
    data = (ew.gate, ew.up, ew.down)
    count = tiling.entries_clear_of_wrap(data[0].shape[0], tuple(a.shape[1:] for a in data), data[0].dtype)
    if count == data[0].shape[0]:
        return ew
    gate, up, down = (jnp.pad(a, ((0, count - a.shape[0]),) + ((0, 0),) * (a.ndim - 1)) for a in data)
    return dataclasses.replace(ew, gate=gate, up=up, down=down)


def assign(ws: Workspace, layer: int | jax.Array,
           group_sizes: jax.Array) -> tuple[Workspace, Assignment]:
    """Maps the experts with rows (group_sizes [E] > 0) of `layer` (an int, or a traced int32) to slots; returns the
    workspace with new tags and counters (its data is unchanged until `fill`) and the assignment. At most
    `ws.num_slots` experts may be active."""
    n_slots = ws.num_slots
    n_experts = group_sizes.shape[0]
    active = jnp.nonzero(group_sizes > 0, size=n_slots, fill_value=EMPTY)[0].astype(jnp.int32)
    is_active = active >= 0
    want = jnp.where(is_active, layer * n_experts + active, EMPTY - 1)  # padding never matches a tag
    match = ws.tags[None, :] == want[:, None]  # [wanted, slot]
    hit = jnp.any(match, axis=1)
    miss = is_active & ~hit
    free = jnp.nonzero(~jnp.any(match, axis=0), size=n_slots, fill_value=n_slots - 1)[0]
    slot = jnp.where(hit, jnp.argmax(match, axis=1), free[jnp.clip(jnp.cumsum(miss) - 1, 0, n_slots - 1)])
    slot = jnp.where(is_active, slot, EMPTY).astype(jnp.int32)
    target = jnp.where(miss, slot, n_slots)  # out of range: dropped
    tags = ws.tags.at[target].set(want, mode="drop")
    need = jnp.zeros((n_slots,), bool).at[target].set(True, mode="drop")
    slot_expert = jnp.zeros((n_slots,), jnp.int32).at[target].set(active, mode="drop")
    slot_of_expert = jnp.full((n_experts,), EMPTY, jnp.int32).at[jnp.where(is_active, active, n_experts)].set(
        slot, mode="drop")
    ws = ws._replace(tags=tags, hits=ws.hits + jnp.sum(hit, dtype=jnp.int32),
                     misses=ws.misses + jnp.sum(miss, dtype=jnp.int32))
    return ws, Assignment(slot_of_expert, need, slot_expert)


def fill(ws: Workspace, a: Assignment, experts: ExpertWeights, pallas: bool = False,
         interpret: bool = False) -> Workspace:
    """Converts the packed experts the assignment needs into their slots (Pallas kernel, or jnp reference)."""
    if pallas:
        def conv(data, blocks, scales):
            return moe_mxfp4.convert(data, a.need, a.slot_expert, blocks, scales, interpret=interpret)
    else:
        def conv(data, blocks, scales):  # a scatter, not a select: XLA then updates the buffer in place
            new = mxfp4.to_workspace(blocks[a.slot_expert], scales[a.slot_expert], data.dtype)
            target = jnp.where(a.need, jnp.arange(a.need.shape[0]), a.need.shape[0])
            return data.at[target].set(new, mode="drop")

    return ws._replace(gate=conv(ws.gate, experts.gate, experts.gate_scales),
                       up=conv(ws.up, experts.up, experts.up_scales),
                       down=conv(ws.down, experts.down, experts.down_scales))


def weights(ws: Workspace, experts: ExpertWeights) -> ExpertWeights:
    """The workspace as expert weights (slot-indexed data; scales, for float8, still indexed by expert)."""
    fp8 = ws.gate.dtype == jnp.float8_e4m3fn
    scales = (experts.gate_scales, experts.up_scales, experts.down_scales) if fp8 else (None, None, None)
    return ExpertWeights(ws.gate, ws.up, ws.down, *scales, fmt=jnp.dtype(ws.gate.dtype).name)


def hit_rate(ws: Workspace) -> float:
    """Fraction of expert conversions served from the workspace (nan before any)."""
    hits, misses = int(ws.hits), int(ws.misses)
    return hits / (hits + misses) if hits + misses else float("nan")
