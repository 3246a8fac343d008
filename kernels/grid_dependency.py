"""Programmatic dependent launch (PDL, sm_90+) from inside a Pallas (Triton) kernel.

With PDL a kernel may start while the kernel before it still runs. PTX spells the two halves:

- `griddepcontrol.launch_dependents` (SASS `PREEXIT`): this grid lets the next one launch, once every program of
  it has said so or finished;
- `griddepcontrol.wait` (SASS `ACQBULK`): block until the grids this one depends on have finished and their writes
  are visible. Without a PDL launch the wait returns at once.

XLA's GPU backend (its source as of mid-2026; `xla_gpu_enable_pdl`, on by default) launches every Triton custom
call, Pallas kernels included, as a programmatic dependent on sm_90+ and puts a wait at the start of the kernel, but
gives Pallas kernels no early trigger, so a kernel's successor launches when it ends. On the H200 with jax 0.11.2 the
launch is there: a kernel that triggers early has the next kernel's span cover its own (`benchmarks/
launch_overlap.py`). These two functions let a kernel say both itself (`kernels.tiles.pallas_call`).
Both are threaded through an int32 scalar (`wait(v)` returns `v`), so a load whose address uses the result is ordered
after the instruction. The primitive is one of `inline_asm.scalar_asm_primitive`'s: not pure, kept out of dead-code
elimination; in interpret mode and every other lowering it is the identity.
The instructions need sm_90 (`dispatch.grid_dependency_ptx` says where a kernel may carry them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .inline_asm import scalar_asm_primitive

_PTX = {"wait": "griddepcontrol.wait;\n\tmov.u32 $0, $1;",
        "launch_dependents": "griddepcontrol.launch_dependents;\n\tmov.u32 $0, $1;"}

grid_dependency_p, _ = scalar_asm_primitive("dayzero_grid_dependency", _PTX)


def _bind(value, kind: str) -> jax.Array:
    value = jnp.asarray(value, jnp.int32)
    if value.shape:
        raise ValueError(f"grid_dependency.{kind}: takes an int32 scalar, got shape {value.shape}")
    return grid_dependency_p.bind(value, kind=kind)


def wait(value) -> jax.Array:
    """Inside a kernel: wait for the grids this one depends on (PDL); returns `value` (int32 scalar), so loads
    addressed through the result come after the wait."""
    return _bind(value, "wait")


def launch_dependents(value) -> jax.Array:
    """Inside a kernel: let the next grid launch (PDL); returns `value` (int32 scalar)."""
    return _bind(value, "launch_dependents")
