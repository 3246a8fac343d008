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
