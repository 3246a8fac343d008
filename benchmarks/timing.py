"""Wall-clock timing of jitted calls for the benchmarks."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def pipelined_seconds(fn: Callable, *args, n: int = 20, reps: int = 5) -> float:
    """Seconds per call of `fn(*args)` issued `n` times back to back (no host round trip between the calls), the
    median over `reps` repeats after one warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times)


def hbm_copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB float32 read + write (x * 1.0001), calls back to back (`pipelined_seconds`): the
    roofline the benchmarks measure beside their kernels. One call waited on at a time reads 2.4-3.0 TB/s on the
    H200 (a host round trip per call), against ~4.1 pipelined."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(0), (256 * 1024 * 1024,), jnp.float32)
    return 2 * x.nbytes / pipelined_seconds(jax.jit(lambda a: a * 1.0001), x)


def hbm_read_bandwidth() -> float:
    """Bytes per second read by XLA's reductions of a 1 GiB bf16 array (calls back to back, `pipelined_seconds`):
    the best of a row sum ([2^19, 1024] -> [2^19] float32, 2 MB written) and a column sum ([1024, 2^19] -> [2^19]):
    the ceiling of a kernel that only streams weights in (the copy figure counts a write for every byte read)."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(0), (1 << 19, 1 << 10), jnp.bfloat16)
    rows = pipelined_seconds(jax.jit(lambda a: jnp.sum(a, axis=1, dtype=jnp.float32)), x)
    cols = pipelined_seconds(jax.jit(lambda a: jnp.sum(a.reshape(1 << 10, 1 << 19), axis=0, dtype=jnp.float32)), x)
    return x.nbytes / min(rows, cols)
