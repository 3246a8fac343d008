"""Inline PTX on an int32 scalar, as a JAX primitive for Pallas (Triton) kernels.

`scalar_asm_primitive(name, ptx)` makes a primitive of one int32 scalar `value` and a static `kind` (a key of
`ptx`). In a kernel lowered through Triton it emits `ptx[kind]` as inline assembly that is not pure, with `$0` its
result and `$1` the value, so instructions can be ordered through their data: a load addressed through the result
comes after the instruction, and an instruction fed a value comes after what made it. Dead-code elimination keeps
it even when its result goes unused. In interpret mode and every other lowering it is the identity.

The Triton rule goes through JAX's private Pallas Triton lowering API (as `l2_prefetch` does). Used by
`grid_dependency` (programmatic dependent launch) and by benchmarks/pdl_placement.py (special-register reads).
"""

from __future__ import annotations

from jax._src import core as jax_core
from jax._src.interpreters import partial_eval as pe
from jax.interpreters import mlir


def scalar_asm_primitive(name: str, ptx: dict[str, str]) -> tuple[jax_core.Primitive, bool]:
    """(the primitive, whether its Triton lowering rule is registered: False where this JAX has no Pallas Triton
    lowering). Binding a `kind` that is not a key of `ptx` raises ValueError."""
    primitive = jax_core.Primitive(name)
    primitive.def_impl(lambda value, *, kind: value)

    def abstract_eval(value, *, kind):
        if kind not in ptx:
            raise ValueError(f"{name}: unknown kind {kind!r} (one of {sorted(ptx)})")
        return jax_core.ShapedArray(value.shape, value.dtype)

    primitive.def_abstract_eval(abstract_eval)
    pe.dce_rules[primitive] = lambda used_outs, eqn: ([True] * len(eqn.invars), eqn)  # the instruction is the point
    mlir.register_lowering(primitive, lambda ctx, value, *, kind: [value])  # no Triton: the identity
    return primitive, _register_triton_lowering(primitive, ptx)


def _register_triton_lowering(primitive: jax_core.Primitive, ptx: dict[str, str]) -> bool:
    try:
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering
    except ImportError:
        return False

    @lowering.register_lowering(primitive)
    def _lower(ctx, value, *, kind):
        value = lowering._ensure_ir_value(value, ctx.avals_in[0])  # a literal operand arrives as a constant
        return tt_dialect.elementwise_inline_asm([value.type], ptx[kind], constraints="=r,r", pure=False,
                                                 packed_element=1, args=[value])

    return True
