"""Warming the L2 cache from inside a Pallas (Triton) kernel with bytes a later kernel will read (sm_90).

At batch-1 decode, latency-bound kernels (the KDA step, routing, norms) leave HBM idle while the weight-streaming
kernel after them waits to start. Hopper's bulk prefetch `cp.async.bulk.prefetch.L2.global [address], bytes` asks
the memory system to bring a contiguous range into L2 and returns at once: nothing waits for it, no register or
shared memory holds the data. `prefetch(ref, offsets, chunk_bytes)` issues one such prefetch per element of
`offsets` (int32 element offsets into `ref`, any shape; each thread issues the elements it holds), so a kernel can
hand its idle time to the next kernel's weight reads; `prefetch_range(ref, offset, bytes)` asks for one contiguous
range, issued by the program's first thread alone.

Only the Triton lowering emits it (a primitive with its own lowering rule through JAX's private Pallas Triton
lowering API; kept out of the jaxpr's dead-code elimination, its result unused). Callers skip it in interpret mode
and on other backends (`available`). Address and size must be multiples of 16 bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.interpreters import partial_eval as pe

_PREFETCH = "cp.async.bulk.prefetch.L2.global [$1], {bytes};"
_PTX = _PREFETCH + "\n\tmov.u32 $0, 0;"
# the same from the program's first thread only (`prefetch_range`: one range per program, not one per lane)
_PTX_FIRST_THREAD = ("{{\n\t.reg .u32 first_tid;\n\t.reg .pred first_lane;\n\tmov.u32 first_tid, %tid.x;\n\t"
                     "setp.eq.u32 first_lane, first_tid, 0;\n\t@first_lane " + _PREFETCH + "\n\t}}\n\tmov.u32 $0, 0;")

l2_prefetch_p = jax_core.Primitive("dayzero_l2_prefetch")


@l2_prefetch_p.def_abstract_eval
def _abstract_eval(ref, offsets, *, chunk_bytes, first_thread=False):
    del ref, chunk_bytes, first_thread
    return jax_core.ShapedArray(offsets.shape, jnp.int32)


pe.dce_rules[l2_prefetch_p] = lambda used_outs, eqn: ([True] * len(eqn.invars), eqn)  # the prefetch is the point


def _register_triton_lowering() -> bool:
    """Registers the Triton lowering rule; False where this JAX has no Pallas Triton lowering."""
    try:
        from jax._src.lib.mlir import ir
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering
    except ImportError:
        return False

    @lowering.register_lowering(l2_prefetch_p)
    def _lower(ctx, ptr, offsets, *, chunk_bytes, first_thread=False):
        shape = ctx.avals_in[1].shape
        ptrs = lowering._bcast_to(ptr, shape)
        addresses = tt_dialect.addptr(ptrs.type, ptrs, offsets)
        result = ir.RankedTensorType.get(shape, ir.IntegerType.get_signless(32)) if shape else \
            ir.IntegerType.get_signless(32)
        ptx = (_PTX_FIRST_THREAD if first_thread else _PTX).format(bytes=chunk_bytes)
        return tt_dialect.elementwise_inline_asm([result], ptx, constraints="=r,l",
                                                 pure=False, packed_element=1, args=[addresses])

    return True


_LOWERING = _register_triton_lowering()


def available(interpret: bool) -> bool:
    """Whether a kernel built now can prefetch: Triton lowering (not interpret mode) and the rule registered."""
    return _LOWERING and not interpret


def prefetch(ref, offsets: jax.Array, chunk_bytes: int) -> jax.Array:
    """Inside a Pallas Triton kernel: prefetch `chunk_bytes` of `ref` (a whole kernel operand, no `.at`) into L2
    from each element offset in `offsets` (int32, any shape). Returns int32 zeros of offsets' shape (unused)."""
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(f"l2_prefetch: chunk of {chunk_bytes} bytes is not a positive multiple of 16")
    return l2_prefetch_p.bind(ref, offsets.astype(jnp.int32), chunk_bytes=int(chunk_bytes))


def prefetch_range(ref, offset: jax.Array, num_bytes: int) -> jax.Array:
    """Inside a Pallas Triton kernel: prefetch the `num_bytes` of `ref` from element `offset` (an int32 scalar) into
    L2, one request issued by the program's first thread (a multiple of 16 bytes, 16-byte aligned). Returns an int32
    zero (unused)."""
    if num_bytes <= 0 or num_bytes % 16:
        raise ValueError(f"l2_prefetch: range of {num_bytes} bytes is not a positive multiple of 16")
    offset = jnp.asarray(offset, jnp.int32)
    if offset.shape:
        raise ValueError(f"l2_prefetch: prefetch_range takes one offset, not {offset.shape}")
    return l2_prefetch_p.bind(ref, offset, chunk_bytes=int(num_bytes), first_thread=True)


def chunk_offsets(total_elements: int, itemsize: int, parts: int, part: jax.Array, lanes: int,
                  chunk_bytes: int) -> jax.Array:
    """Element offsets of `lanes` chunks of `chunk_bytes` covering part `part` of `parts` equal shares of a
    [total_elements] operand (clamped to its last chunk where the share runs past the end): int32 [lanes]."""
    chunk = chunk_bytes // itemsize
    last = max(0, total_elements - chunk)
    share = -(-total_elements // parts)
    first = part * share
    return jnp.minimum(first + jax.lax.broadcasted_iota(jnp.int32, (lanes,), 0) * chunk, last)
