"""Atomics for Pallas (Triton) kernels: a float add with relaxed memory ordering, and the turn counter of the
last-program pattern (`take_turn`).

`pallas.triton.atomic_add` lowers with acquire-release ordering: on sm_90 Triton fences every call (MEMBAR.ALL.GPU
before the atomic, an L1 invalidate after), so a loop that streams weights and adds its results atomically waits for
every load in flight at each add. Kernels that only accumulate sums, and read them after the kernel ends, need no
ordering between their atomics; `add_relaxed` emits them relaxed (the same vectorised ATOMG / RED, no fences).

It reuses the Pallas atomic primitive's shape rules and its interpret-mode discharge (there, as for
`atomic_add`, no mask, and either all slice / scalar indices or all array indices), and lowers with Triton's
RELAXED semantic. This leans on Pallas' internal lowering module (present in jax 0.10 and 0.11); where it is
missing, `add_relaxed` falls back to `pallas.triton.atomic_add`.

`take_turn` is how a kernel's programs find the last of them to finish a shared piece of work (the KDA decode
step's conv shift, the MoE front's router choice): each adds 1 to an int32 counter after its own loads and stores,
and the one that sees N - 1 does the work and sets the counter back to zero, so the counters (kept in the serving
cache) are zero between calls.

`take_turn` and `wait_until` also make waits across programs of one counter: a program arrives (`take_turn`, its
stores released), may issue loads that do not depend on the others' stores (the next phase's weights), then spins
until the count reaches its target. As a grid-wide barrier every program of the grid must be resident at once (at
most one program per SM), and interpret mode, which runs programs one after another, supports only a grid of one
program there; a program that waits only on programs started before it (a grid in phase order:
benchmarks/grid_barrier.py's ordered chain) needs neither.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from . import tiles as tiling

try:  # Pallas internals: the atomic primitive's pieces and the Triton lowering registry
    from jax._src import core as _core
    from jax._src import state as _state
    from jax._src import tree_util as _tree_util
    from jax._src.lib.triton import dialect as _tt
    from jax._src.pallas.triton import lowering as _lowering
    from jax._src.pallas.triton import primitives as _primitives
    from jax._src.state import discharge as _discharge
    from jax._src.state import indexing as _indexing
    from jax._src.state import primitives as _state_primitives
except ImportError:  # pragma: no cover - a jax without them: the acquire-release atomic
    _primitives = None


def _build_primitive():
    """The relaxed atomic-add primitive, or None where this jax lacks the Pallas pieces it reuses."""
    needed = ("atomic_rmw_p", "_atomic_abstract_eval", "_atomic_rmw_discharge_rule", "AtomicOpType")
    if _primitives is None or not all(hasattr(_primitives, name) for name in needed) or not all(
            hasattr(_lowering, name) for name in ("register_lowering", "_compute_pointers_from_indices",
                                                  "_ensure_ir_value", "_atomic_rmw")):
        return None
    prim = _core.Primitive("atomic_add_relaxed")
    prim.def_effectful_abstract_eval(_primitives._atomic_abstract_eval)
    _discharge.register_discharge_rule(prim)(_primitives._atomic_rmw_discharge_rule)

    @_lowering.register_lowering(prim)
    def _lower(ctx, *args_flat, args_tree, atomic_type):
        block_info, *_ = ctx.block_infos
        ptr, indexers, val, mask = args_tree.unflatten(args_flat)
        *_, value_aval, mask_aval = args_tree.unflatten(ctx.avals_in)
        indexers = list(indexers)
        if not indexers or not isinstance(indexers[-1], _indexing.NDIndexer):
            ref_aval = _state.transform_type(indexers, ctx.avals_in[0])
            indexers.append(_indexing.NDIndexer.make_trivial_indexer(ref_aval.shape))
        if len(indexers) != 1:
            raise ValueError(f"add_relaxed takes one index into the ref, got {len(indexers)} (index a view instead)")
        ptr = _lowering._compute_pointers_from_indices(ptr, block_info, indexers[0])
        val = _lowering._ensure_ir_value(val, value_aval)
        if mask is not None:
            mask = _lowering._ensure_ir_value(mask, mask_aval)
        return _lowering._atomic_rmw(_tt.RMWOp.FADD, ptr, val, mask=mask, semantic=_tt.MemSemantic.RELAXED)

    return prim


_ADD_RELAXED = _build_primitive()


def add_relaxed(ref, idx, val, *, mask: Any | None = None):
    """ref[idx] += val atomically, with no ordering against other memory operations (float refs). Returns
    nothing useful (the old values: unused results let Triton emit reductions)."""
    if _ADD_RELAXED is None:
        return pltriton.atomic_add(ref, idx, val, mask=mask)
    x_ref, transforms = _state_primitives.get_ref_and_transforms(ref, idx, "atomic_add_relaxed")
    args_flat, args_tree = _tree_util.tree_flatten((x_ref, transforms, val, mask))
    return _ADD_RELAXED.bind(*args_flat, args_tree=args_tree, atomic_type=_primitives.AtomicOpType.ADD)


def take_turn(counters_ref, idx, *, interpret: bool):
    """One program's turn on a counter shared by the programs of a last-program pattern: a CTA barrier (every warp's
    earlier loads and stores issued: the atomic below is one thread's), then counters_ref[idx] += 1 with
    acquire-release ordering at GPU scope. Returns the count before this turn: the program that sees N - 1 of N
    knows the others' stores are visible to it and their loads are done. (Interpret mode runs programs one after
    another: no barrier there.)"""
    tiling.cta_barrier(interpret)
    return pltriton.atomic_add(counters_ref, idx, jnp.int32(1))


def wait_until(counter_ref, idx, target, *, interpret: bool, poll: str = "atomic") -> jax.Array:
    """Spins until int32 counter_ref[idx] >= target, then returns the count after an acquire-release atomic read (so
    the other programs' stores released by their `take_turn` are visible to this program's later loads). `poll`: how
    the loop reads the count, "atomic" (each read such an atomic: on sm_90 a full fence and an L1 invalidate per
    read) or "volatile" (plain volatile loads from L2, the one atomic read after the loop). `idx`: a tuple of int32
    scalars. In interpret mode the count is read once: programs run one after another there, so a barrier needs a
    grid of one program (whose own arrivals are the whole count), and a wait on earlier programs is met already."""
    if poll not in ("atomic", "volatile"):
        raise ValueError(f"wait_until: poll must be 'atomic' or 'volatile', got {poll!r}")
    read = lambda: pltriton.atomic_add(counter_ref, idx, jnp.int32(0))
    if interpret:
        return read()
    if poll == "atomic":
        return jax.lax.while_loop(lambda count: count < target, lambda _: read(), read())
    peek = lambda: pltriton.load(counter_ref.at[idx], volatile=True)
    count = jax.lax.while_loop(lambda count: count < target, lambda _: peek(), peek())
    # the atomic adds 0 (count >= target here) through the loop's result: JAX keeps the loop only for an effect
    return pltriton.atomic_add(counter_ref, idx, jnp.minimum(count - target, 0))
