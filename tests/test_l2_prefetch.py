"""kernels/l2_prefetch.py: the bulk prefetch reaches the Triton IR with its byte count and survives Pallas'
dead-code elimination; its chunk offsets cover a program's share; bad chunk sizes are refused. (What it does to a
later kernel's time is a benchmark: benchmarks/l2_prefetch.py; that it leaves results alone: tests/gpu.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from dayzero.kernels import l2_prefetch, tiles


def _copy_with_prefetch(x_ref, w_ref, o_ref, *, chunk):
    offsets = l2_prefetch.chunk_offsets(w_ref.shape[0] * w_ref.shape[1], 2, 4, pl.program_id(0), 32, chunk)
    l2_prefetch.prefetch(w_ref, offsets, chunk)
    o_ref[...] = x_ref[...] * 2


def _call(x, w, chunk=256):
    return pl.pallas_call(functools.partial(_copy_with_prefetch, chunk=chunk),
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
                          compiler_params=tiles.compiler_params(1, 1), name="prefetching_copy")(x, w)


def test_prefetch_reaches_triton_ir():
    pytest.importorskip("jax._src.pallas.triton.lowering")
    from triton_report import capture_kernels

    spec = jax.ShapeDtypeStruct
    (kernel,) = capture_kernels(_call, spec((16,), jnp.float32), spec((64, 128), jnp.bfloat16))
    asm = [line for line in kernel["ir"].splitlines() if "elementwise_inline_asm" in line]
    assert len(asm) == 1 and "cp.async.bulk.prefetch.L2.global [$1], 256;" in asm[0] and "pure = false" in asm[0]


def _copy_with_range(x_ref, w_ref, o_ref):
    l2_prefetch.prefetch_range(w_ref, pl.program_id(0) * 2048, 4096)
    o_ref[...] = x_ref[...] * 2


def test_prefetch_range_is_one_request_from_the_first_thread():
    """`prefetch_range`: one scalar request of the given bytes, predicated on the program's first thread."""
    pytest.importorskip("jax._src.pallas.triton.lowering")
    from triton_report import capture_kernels

    call = lambda x, w: pl.pallas_call(_copy_with_range, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
                                       compiler_params=tiles.compiler_params(4, 1), name="range_copy")(x, w)
    spec = jax.ShapeDtypeStruct
    (kernel,) = capture_kernels(call, spec((16,), jnp.float32), spec((64, 128), jnp.bfloat16))
    asm = [line for line in kernel["ir"].splitlines() if "elementwise_inline_asm" in line]
    assert len(asm) == 1 and "cp.async.bulk.prefetch.L2.global [$1], 4096;" in asm[0]
    assert "%tid.x" in asm[0] and "@first_lane" in asm[0] and "tensor<" not in asm[0].split("->")[-1]


def test_chunk_offsets_cover_a_share():
    # 4 programs over 8192 bf16 elements: 2048 each, 32 chunks of 128 elements (256 bytes), clamped at the end
    got = [np.asarray(l2_prefetch.chunk_offsets(8192, 2, 4, jnp.int32(p), 32, 256)) for p in range(4)]
    assert list(got[0][:3]) == [0, 128, 256] and got[1][0] == 2048
    covered = np.zeros(8192, bool)
    for offsets in got:
        for start in offsets:
            covered[start:start + 128] = True
    assert covered.all() and max(o.max() for o in got) == 8192 - 128


def test_refuses_unaligned_chunks():
    with pytest.raises(ValueError, match="multiple of 16"):
        l2_prefetch.prefetch(None, jnp.zeros((4,), jnp.int32), 24)
    with pytest.raises(ValueError, match="multiple of 16"):
        l2_prefetch.prefetch_range(None, 0, 100)
    with pytest.raises(ValueError, match="one offset"):
        l2_prefetch.prefetch_range(None, jnp.zeros((4,), jnp.int32), 64)
    assert not l2_prefetch.available(interpret=True)
