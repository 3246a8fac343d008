"""GPU kernel events from a `jax.profiler` trace: what a benchmark uses to split kernel time from launch gaps."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tempfile
from typing import Callable


def traced_events(run: Callable[[], object]) -> list[dict]:
    """Runs `run()` (which must block until its device work is done) under `jax.profiler` and returns the trace's
    events (Chrome trace format: dicts with ph, name, pid, ts, dur). Empty when the trace wrote nothing."""
    import jax

    with tempfile.TemporaryDirectory(prefix="dayzero_trace_") as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
        return json.load(gzip.open(files[0]))["traceEvents"] if files else []


_COPY_NUMBERS = re.compile(r"([._]+\d+)+$")


def kernel_family(name: str) -> str:
    """A kernel's name with the numbers of its copies dropped, so every layer's copy shares it: "moe_front__3" ->
    "moe_front", "gemm_fusion_dot_255" -> "gemm_fusion_dot", "gemm_fusion_dot.20" -> "gemm_fusion_dot"."""
    return _COPY_NUMBERS.sub("", name)


def gpu_kernels(events: list[dict]) -> list[dict]:
    """The events that ran on a GPU (complete events `ph == "X"` of a process named for a GPU), by start time."""
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    kernels = [e for e in events if e.get("ph") == "X" and "dur" in e and e.get("pid") in gpu_pids]
    return sorted(kernels, key=lambda e: e.get("ts", 0.0))


def kernel_time_split(kernels: list[dict], name_contains: str) -> dict:
    """Kernels whose name contains `name_contains`: count, median and mean duration (us), and the span from the
    first one's start to the last one's end divided by the count (us per kernel including the gaps between)."""
    chosen = [e for e in kernels if name_contains in e["name"]]
    if not chosen:
        return {"count": 0}
    durations = sorted(e["dur"] for e in chosen)
    span = chosen[-1]["ts"] + chosen[-1]["dur"] - chosen[0]["ts"]
    return {"count": len(chosen), "median_us": round(durations[len(durations) // 2], 2),
            "mean_us": round(sum(durations) / len(durations), 2), "span_per_kernel_us": round(span / len(chosen), 2)}


def per_kernel_us(kernels: list[dict], calls: int, top: int = 10) -> dict:
    """Kernel time per call of a traced function run `calls` times: {kernel name: us}, the `top` longest, longest
    first (names cut to 60 characters)."""
    totals: dict[str, float] = {}
    for e in kernels:
        totals[e["name"][:60]] = totals.get(e["name"][:60], 0.0) + e["dur"]
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {name: round(total / calls, 2) for name, total in ranked}


def device_us_per_call(fn: Callable, *args, calls: int, top: int = 8) -> tuple[float, dict]:
    """Device time of a jitted `fn(*args)` that runs an op `calls` times: after one warm-up call, one traced call's
    GPU kernel time per op (us) and its `top` longest kernels (`per_kernel_us`); 0.0 and {} with no GPU events."""
    import jax

    jax.block_until_ready(fn(*args))
    kernels = gpu_kernels(traced_events(lambda: jax.block_until_ready(fn(*args))))
    return sum(e["dur"] for e in kernels) / calls, per_kernel_us(kernels, calls, top=top)


def busy_summary(kernels: list[dict]) -> dict:
    """How busy the GPU was over the traced kernels: span (first start to last end), busy time (union of kernel
    intervals), idle share, and kernel time and count by the XLA module that launched them (the kernel event's
    `hlo_module` argument; "other" where absent). Times in ms."""
    if not kernels:
        return {"kernels": 0}
    busy, end = 0.0, None
    for e in kernels:  # sorted by start
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is None or start > end:
            busy += e["dur"]
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = max(e["ts"] + e["dur"] for e in kernels) - kernels[0]["ts"]
    by_module: dict[str, list[float]] = {}
    for e in kernels:
        module = str(e.get("args", {}).get("hlo_module", "other"))
        entry = by_module.setdefault(module, [0.0, 0])
        entry[0] += e["dur"]
        entry[1] += 1
    return {"kernels": len(kernels), "span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
            "idle_share": round(1 - busy / span, 3) if span else 0.0,
            "by_module": {m: {"ms": round(t / 1e3, 3), "kernels": n}
                          for m, (t, n) in sorted(by_module.items(), key=lambda kv: -kv[1][0])}}
