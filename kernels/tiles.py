"""Tiling helpers shared by the Pallas (Triton lowering) kernels of the paged cache, the DSA indexer and sparse MLA.

Triton tiles must have power-of-two extents, so a feature width is handled as its binary decomposition into
power-of-two segments, largest first (the 576-wide MLA latent is 512 + 64: two loads and two dots). On a GPU every
segment that feeds a dot must be at least 16 wide; interpret mode takes any width.

Every kernel of the package is built through `pallas_call` here (the one place that decides how a kernel starts:
`PROGRAMMATIC_LAUNCH`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import dispatch, grid_dependency

# Programmatic dependent launch for the kernels built through `pallas_call` (read when a kernel is traced): "off", or
# where each kernel's two instructions go: "trigger_first" (let the next kernel launch, then wait for the ones before,
# first thing), "wait_first" (wait, then let the next one launch: one kernel ahead at most) or "trigger_last" (wait
# first thing, let the next one launch after the body: its programs become resident only over this one's tail).
# Off: on the H200 (jax 0.11.2) the medium hybrid's MXFP4 batch-1 decode step took 0.960 ms per token with
# "trigger_first" against 0.869 without, same call (benchmarks/NOTES_serving.md, thirtieth session); "wait_first"
# 0.966 against 0.865 (thirty-third session); "trigger_last" 0.821 against 0.823 on an H100 (fifty-fifth session).
PROGRAMMATIC_LAUNCH = "off"
LAUNCH_ORDERS = ("off", "trigger_first", "wait_first", "trigger_last")
# Which kernels take `PROGRAMMATIC_LAUNCH`: comma-separated prefixes of kernel names (a `pallas_call`'s `name`, e.g.
# "decode_projection,moe_gemv"); empty: every kernel. For finding which kernels lose by letting their successor launch
# early (decode_profile.py --set kernels.tiles.PROGRAMMATIC_LAUNCH_KERNELS=...); the others only wait, first thing.
PROGRAMMATIC_LAUNCH_KERNELS = ""

# Pallas' Triton lowering (jax 0.10.2 and 0.11.2, `_compute_offsets_from_indices`) computes the element offsets of a
# load or store in int32 for an operand of at most 2**32 bytes and in int64 above. An operand of 1-byte elements
# (uint8, float8) with more than 2**31 elements and at most 2**32 bytes therefore wraps: its offsets past 2**31 turn
# negative and the kernel reads or writes outside the operand. Found on an H100 (2026-12-06): the DeepSeek-size FP8
# layer (256 experts of 2048 x 7168 bytes a projection, 3.76e9 bytes) gave relative error 32 at every tile shape.
# `pallas_call` refuses such operands (`OffsetWrapError`); `entries_clear_of_wrap` sizes stacks that avoid them.
INT32_OFFSET_ELEMENTS = 2**31
INT64_OFFSET_BYTES = 2**32


class OffsetWrapError(ValueError):
    """A kernel operand whose element offsets would wrap in Pallas' Triton lowering (see `offsets_wrap`)."""


def offsets_wrap(shape: tuple[int, ...], dtype) -> bool:
    """Whether an operand of `shape` and `dtype` is indexed with int32 offsets that wrap in a Triton kernel: more than
    2**31 elements in at most 2**32 bytes (1-byte elements only)."""
    size = math.prod(shape)
    return size > INT32_OFFSET_ELEMENTS and size * jnp.dtype(dtype).itemsize <= INT64_OFFSET_BYTES


def entries_clear_of_wrap(n: int, entry_shapes: tuple[tuple[int, ...], ...], dtype) -> int:
    """The smallest count >= n of entries for stacks [count, *entry_shape] of `dtype` (one per shape in
    `entry_shapes`) none of which wraps (`offsets_wrap`): n itself, or enough entries to pass 2**32 bytes."""
    itemsize = jnp.dtype(dtype).itemsize
    count = n
    while any(offsets_wrap((count, *shape), dtype) for shape in entry_shapes):
        count = max(INT64_OFFSET_BYTES // (math.prod(shape) * itemsize) + 1 for shape in entry_shapes
                    if offsets_wrap((count, *shape), dtype))
    return count


def first_wrapping(arrays) -> tuple[int, object] | None:
    """(index, leaf) of the first array-like leaf of the pytree `arrays` (arrays, tracers, ShapeDtypeStructs) whose
    offsets would wrap (`offsets_wrap`), or None."""
    for i, leaf in enumerate(jax.tree.leaves(arrays)):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is not None and dtype is not None and offsets_wrap(tuple(shape), dtype):
            return i, leaf
    return None


def check_offsets(name: str, arrays) -> None:
    """Raises `OffsetWrapError` naming kernel `name` and the first array-like leaf of `arrays` (operands or output
    shapes) whose offsets would wrap."""
    found = first_wrapping(arrays)
    if found is not None:
        i, leaf = found
        raise OffsetWrapError(
            f"kernel {name}: array {i} {jnp.dtype(leaf.dtype).name}{list(leaf.shape)} has {math.prod(leaf.shape)} "
            f"elements in <= 2**32 bytes; Pallas' Triton lowering indexes it with int32 offsets that wrap past 2**31. "
            f"Stack fewer or more entries (tiles.entries_clear_of_wrap), shard it, or run the reference path")


def pow2_at_least(n: int, floor: int = 1) -> int:
    """Smallest power of two >= max(n, floor)."""
    return max(floor, 1 << max(int(n) - 1, 0).bit_length())


def pow2_divisor(n: int, limit: int) -> int:
    """Largest power of two <= limit dividing n (a tile extent that splits n evenly)."""
    d = 1
    while d * 2 <= limit and n % (d * 2) == 0:
        d *= 2
    return d


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def segments(width: int, offset: int = 0) -> tuple[tuple[int, int], ...]:
    """(start, size) power-of-two pieces of [offset, offset + width), largest first: 576 -> (0, 512), (512, 64)."""
    out = []
    for bit in reversed(range(int(width).bit_length())):
        if width >> bit & 1:
            out.append((offset, 1 << bit))
            offset += 1 << bit
    return tuple(out)


def dots_fit(*widths: int) -> bool:
    """Whether every power-of-two segment of these feature widths can feed a Triton dot (>= 16 wide)."""
    return all(size >= 16 for width in widths for _, size in segments(width))


def precision(dtype) -> jax.lax.Precision:
    """f32 operands keep f32 dots (IEEE); 16-bit operands take the tensor-core path."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def mm(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b [K, N] -> [M, N] float32."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision(a.dtype),
                               preferred_element_type=jnp.float32)


def mm_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b [N, K]^T -> [M, N] float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision(a.dtype),
                               preferred_element_type=jnp.float32)


def pallas_call(kernel, *, interpret: bool = False, **kwargs):
    """`pl.pallas_call` for dayzero's kernels. Compiled for an sm_90+ NVIDIA GPU (`dispatch.grid_dependency_ptx`)
    with `PROGRAMMATIC_LAUNCH` other than "off", the kernel body carries the two `grid_dependency` instructions
    where it says (both first, or the trigger after the body): XLA launches Triton kernels as programmatic
    dependents, so once a kernel has let the next one launch, that kernel's programs are resident and waiting as it
    ends, where otherwise they start only then.
    Every such kernel waits before its first load, so a kernel after one that lets it launch early reads finished
    outputs; a kernel that `PROGRAMMATIC_LAUNCH_KERNELS` leaves out still waits, but lets no kernel launch early.
    Elsewhere (interpret mode, ROCm, vendor plugins) and with "off" the body is the kernel's own. Compiled (not
    interpret mode), the call raises `OffsetWrapError` for an operand or output whose offsets would wrap
    (`offsets_wrap`)."""
    if PROGRAMMATIC_LAUNCH not in LAUNCH_ORDERS:
        raise ValueError(f"tiles.PROGRAMMATIC_LAUNCH is {PROGRAMMATIC_LAUNCH!r}, not one of {LAUNCH_ORDERS}")
    kernel_name = getattr(getattr(kernel, "func", kernel), "__name__", "kernel")
    if PROGRAMMATIC_LAUNCH == "off" or not dispatch.grid_dependency_ptx(interpret):
        call = pl.pallas_call(kernel, interpret=interpret, **kwargs)
    else:
        opening, closing = launch_controls(kwargs.get("name") or kernel_name)

        def dependent(*refs):
            token = 0  # threaded through the instructions, so they keep their order
            for control in opening:
                token = control(token)
            kernel(*refs)
            for control in closing:  # (not pure: kept after the body's stores)
                token = control(token)

        dependent.__name__ = kernel_name  # its debug info's name
        call = pl.pallas_call(dependent, interpret=interpret, **kwargs)
    if interpret:  # interpret mode runs on XLA's own indexing
        return call

    def checked(*operands):
        check_offsets(kwargs.get("name") or kernel_name, (operands, kwargs.get("out_shape")))
        return call(*operands)

    return checked


def launches_early(name: str) -> bool:
    """Whether the kernel called `name` is one that `PROGRAMMATIC_LAUNCH_KERNELS` names (every kernel when empty)."""
    prefixes = [p.strip() for p in str(PROGRAMMATIC_LAUNCH_KERNELS).split(",") if p.strip()]
    return not prefixes or any(name.startswith(p) for p in prefixes)


def launch_controls(name: str) -> tuple[tuple, tuple]:
    """The `grid_dependency` instructions the kernel called `name` opens with and closes with, in order, where
    `PROGRAMMATIC_LAUNCH` is on: the wait alone, opening, for a kernel `PROGRAMMATIC_LAUNCH_KERNELS` leaves out;
    else the wait and the trigger where `PROGRAMMATIC_LAUNCH` puts them."""
    wait, trigger = grid_dependency.wait, grid_dependency.launch_dependents
    if not launches_early(name):
        return (wait,), ()
    return {"trigger_first": ((trigger, wait), ()), "wait_first": ((wait, trigger), ()),
            "trigger_last": ((wait,), (trigger,))}[PROGRAMMATIC_LAUNCH]


def launch(kernel, kernel_args: dict, operands, *, out_shape, grid: tuple[int, ...], num_warps: int, num_stages: int,
           interpret: bool, name: str, aliases: dict[int, int] | None = None):
    """`pallas_call(functools.partial(kernel, **kernel_args), ...)(*operands)` for kernels on whole-array refs (no
    BlockSpecs), through a jitted function whose static arguments are the kernel, its keyword arguments (hashable
    values) and the launch. An eager `pl.pallas_call` builds a fresh jitted wrapper each time, so it traces and
    compiles on every call; through here eager calls of the same arguments and operand shapes (a test's decode
    step, layer after layer) compile once. Inside an outer jit it is the same launch. `aliases`: operand index ->
    output index, as `input_output_aliases`."""
    return _launch(tuple(operands), kernel=kernel, kernel_args=tuple(sorted(kernel_args.items())), out_shape=out_shape,
                   grid=tuple(grid), aliases=tuple(sorted((aliases or {}).items())), num_warps=num_warps,
                   num_stages=num_stages, interpret=interpret, name=name)


@functools.partial(jax.jit, static_argnames=("kernel", "kernel_args", "out_shape", "grid", "aliases", "num_warps",
                                             "num_stages", "interpret", "name"))
def _launch(operands, *, kernel, kernel_args, out_shape, grid, aliases, num_warps, num_stages, interpret, name):
    return pallas_call(functools.partial(kernel, **dict(kernel_args)), out_shape=out_shape, grid=grid,
                       input_output_aliases=dict(aliases), compiler_params=compiler_params(num_warps, num_stages),
                       interpret=interpret, name=name)(*operands)


def fetched_steps(steps: int, fetch, hoist: bool):
    """A kernel's loop of `steps` steps whose loads (`fetch(i)`: step i's loads, issued when it is called) may go
    first: with `hoist` every step's loads are issued here, at once, and the loop is unrolled; else each iteration
    of a `fori_loop` issues its own. Returns `fold(step, init)`: `step(carry, fetched)` over the steps in order (the
    same arithmetic either way), called where the products belong, so work between the two calls runs with the
    hoisted loads already in flight."""
    fetched = [fetch(i) for i in range(steps)] if hoist else None

    def fold(step, init):
        if fetched is not None:
            return functools.reduce(step, fetched, init)
        return jax.lax.fori_loop(0, steps, lambda i, carry: step(carry, fetch(i)), init)

    return fold


def compiler_params(num_warps: int, num_stages: int) -> pltriton.CompilerParams:
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


ZERO_PIECE = 1024  # elements per store of `store_zeros`


def store_zeros(ref, start, count: int) -> None:
    """Inside a kernel: zeros of ref's dtype into ref[start : start + count] (a 1-D ref; count a power of two), in
    stores of up to ZERO_PIECE elements."""
    piece = min(count, ZERO_PIECE)
    for p in range(count // piece):
        ref[pl.ds(start + p * piece, piece)] = jnp.zeros((piece,), ref.dtype)


def cta_barrier(interpret: bool) -> None:
    """Inside a kernel: a barrier across the program's threads (every warp's earlier loads and stores issued, so
    stores to memory are seen by the other threads' later loads). Interpret mode runs each program as one thread of
    array ops: nothing to wait for."""
    if not interpret:
        pltriton.debug_barrier()


def cache_rows(cache: jax.Array) -> jax.Array:
    """A paged cache [L, N, block, D] viewed as rows [L * N * block, D] (a free reshape): kernels address token
    (layer, page, offset) as row (layer * N + page) * block + offset."""
    return cache.reshape(-1, cache.shape[-1])
