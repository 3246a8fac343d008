"""Lower a jitted function for CUDA on this CPU-only machine, Pallas kernels through the Triton backend.

`jax.export` runs every lowering rule for the target platform without a GPU, so a Pallas kernel that the
Triton lowering rejects (an unsupported primitive, a bad block shape) fails here, in CPU CI. It does not run
Triton's own compiler (register/shared-memory limits): the GPU tests under tests/gpu cover that.
"""

from __future__ import annotations

import jax

_TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_cuda(fn, *args, **kwargs) -> str:
    """Return the StableHLO text of `jax.jit(fn)(*args, **kwargs)` lowered for CUDA.

    Raises whatever the lowering raises. The result holds one `__gpu$xla.gpu.triton` custom call per
    Pallas kernel that took the Triton path.
    """
    checks = [jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)]
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args, **kwargs)
    return exported.mlir_module()


def count_triton_kernels(fn, *args, **kwargs) -> int:
    """How many Pallas kernels `fn` lowers to Triton custom calls for CUDA."""
    return lower_for_cuda(fn, *args, **kwargs).count(_TRITON_CALL)
