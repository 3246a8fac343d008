"""KDA kernels on the GPU: dayzero's Pallas chunked prefill and recurrent decode step beside flash-linear-attention
(fla-core 0.6.0, in a subprocess of the same run) and the HBM copy bandwidth measured in the same run.

    python3 benchmarks/kda.py [--results benchmarks/RESULTS.md] [--no-peer] [--no-decode]
                              [--intra-variants fused,split,split:intra_block_k=64:intra_warps=8]

Prefill: chunk_kda at B1 H32 D128 bf16, T 8192 and 32768 (inputs as ../shared/anchors: l2-normalised q/k, g in
[-0.1, 0] f32, initial state, final state out). At T8192 every entry of --intra-variants (a KdaTuning: the
intra_variant name, then optional `field=value` overrides of KdaTuning fields) is compiled (compile seconds
reported), checked against the reference, and timed twice: prefill kernel 1 alone (`chunk_intra`) and the whole
chunk_kda, whose kernels the profiler also times one by one (`*_kernels_us`; fla's by torch.profiler); T32768 runs
the fastest. Decode: one token per row at B1 and B64, device time per step from 50 steps
unrolled inside one jitted function (the state pool updated in place), the effective state bandwidth (state
read + written, f32), and the same 50 kernels as the profiler times them (median kernel, and the span per kernel
with launch gaps; the best median gives `decode_B*_kernel_*`). Prints a table and, when a GPU ran it, appends a
dated line to RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from gpu_trace import gpu_kernels, kernel_time_split, per_kernel_us, traced_events  # benchmarks/gpu_trace.py
from timing import hbm_copy_bandwidth, pipelined_seconds  # benchmarks/timing.py
from results import append_line, git_commit  # benchmarks/results.py: a script's own folder is on sys.path

H, D = 32, 128
PREFILL_T = (8192, 32768)
DECODE_B = (1, 64)
DECODE_STEPS = 50


# ------------------------------------------------------------------------------------------------ the peer: fla


def measure_fla() -> dict:
    """fla-core's chunk_kda and fused_recurrent_kda on the same shapes (torch CUDA events / graph replay)."""
    import torch
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    dev, res = "cuda", {}

    def inputs(B, T, h0_random):
        q = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16), dim=-1)
        v = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
        g = -torch.rand(B, T, H, D, device=dev, dtype=torch.float32) * 0.1
        beta = torch.rand(B, T, H, device=dev, dtype=torch.bfloat16)
        h0 = (torch.randn if h0_random else torch.zeros)(B, H, D, D, device=dev, dtype=torch.float32)
        return q, k, v, g, beta, h0

    def event_ms(fn, n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    for T in PREFILL_T:
        q, k, v, g, beta, h0 = inputs(1, T, False)
        run = lambda: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        for _ in range(3):
            run()
        res[f"chunk_T{T}_ms"] = round(statistics.median(event_ms(run, 20) for _ in range(5)), 4)
        if T == PREFILL_T[0]:
            try:
                res[f"chunk_T{T}_kernels_us"] = torch_kernel_us(run)
            except Exception as exc:  # noqa: BLE001 - the breakdown is extra: keep the timings
                res[f"chunk_T{T}_kernels_error"] = repr(exc)[:200]
    for B in DECODE_B:
        q, k, v, g, beta, h0 = inputs(B, 1, True)
        run = lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            run()
        torch.cuda.synchronize()
        res[f"decode_B{B}_host_us"] = round((time.perf_counter() - t) / 100 * 1e6, 1)
        try:  # device time: 50 steps captured in one CUDA graph
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    run()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(DECODE_STEPS):
                    run()
            graph.replay()
            torch.cuda.synchronize()
            res[f"decode_B{B}_graph_us"] = round(
                statistics.median(event_ms(graph.replay, 10) for _ in range(5)) / DECODE_STEPS * 1e3, 2)
        except Exception as exc:  # noqa: BLE001 - report, keep the rest of the figures
            res[f"decode_B{B}_graph_error"] = repr(exc)[:200]
    return res


def torch_kernel_us(fn, calls: int = 10, top: int = 10) -> dict:
    """GPU time per call of `fn` by kernel (torch.profiler): {kernel name: us}, the `top` longest."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [{"name": e.key, "dur": getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)}
              for e in prof.key_averages()]
    return per_kernel_us([e for e in events if e["dur"]], calls, top)


def run_peer() -> dict:
    proc = subprocess.run([sys.executable, __file__, "--peer-only"], capture_output=True, text=True, timeout=600)
    if proc.returncode:
        print("fla peer failed:", proc.stderr[-2000:])
        return {}
    for line in proc.stdout.splitlines():
        if line.startswith("PEER "):
            return json.loads(line[len("PEER "):])
    return {}


# ----------------------------------------------------------------------------------------------------- dayzero


def tuning_with(overrides, base=None):
    """A KdaTuning: `base` (default: the kernels' defaults) with `field=value` overrides (an iterable of strings; bool
    fields take 1/0, true/false or yes/no)."""
    import dataclasses

    from dayzero.kernels.kda import pallas

    base = pallas.DEFAULT_TUNING if base is None else base
    fields = {f.name for f in dataclasses.fields(pallas.KdaTuning)}
    changes = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in fields or not value:
            raise SystemExit(f"bad KdaTuning override {item!r} (fields: {', '.join(sorted(fields))})")
        kind = type(getattr(base, key))
        changes[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return dataclasses.replace(base, **changes)


def parse_tunings(spec: str) -> dict:
    """'fused,split:intra_block_k=64' -> {name: KdaTuning}: each entry an intra_variant plus `field=value` overrides."""
    tunings = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        variant, *overrides = entry.split(":")
        tunings[entry] = tuning_with([f"intra_variant={variant}", *overrides])
    return tunings


def measure_dayzero(tunings: dict, decode: bool = True, res: dict | None = None) -> dict:
    """Fills `res` as it goes (each prefill tuning's figures are also printed when measured), so that an interrupted
    run still reports what it measured; returns it."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    import functools

    import jax
    import jax.numpy as jnp

    from dayzero.kernels.kda import pallas, reference

    res = {} if res is None else res

    res["hbm_copy_TBps"] = round(hbm_copy_bandwidth() / 1e12, 3)  # the roofline of the memory-bound step

    def inputs(B, T, key):
        ks = jax.random.split(key, 6)
        norm = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
        q = norm(jax.random.normal(ks[0], (B, T, H, D))).astype(jnp.bfloat16)
        k = norm(jax.random.normal(ks[1], (B, T, H, D))).astype(jnp.bfloat16)
        v = jax.random.normal(ks[2], (B, T, H, D), jnp.bfloat16)
        g = -jax.random.uniform(ks[3], (B, T, H, D), jnp.float32) * 0.1
        beta = jax.random.uniform(ks[4], (B, T, H), jnp.bfloat16)
        return q, k, v, g, beta, jax.random.normal(ks[5], (B, H, D, D), jnp.float32)

    rel = lambda a, b: float(jnp.linalg.norm((a.astype(jnp.float32) - b.astype(jnp.float32)).ravel())
                             / jnp.linalg.norm(b.astype(jnp.float32).ravel()))
    best_name = None  # the first T tries every tuning; the later ones run its best
    for T in PREFILL_T:
        q, k, v, g, beta, _ = inputs(1, T, jax.random.key(T))
        h0 = jnp.zeros((1, H, D, D), jnp.float32)
        lengths = jnp.full((1,), T, jnp.int32)
        first = T == PREFILL_T[0]
        if first:  # sanity reference for every variant, on these inputs
            o_r, s_r = jax.jit(functools.partial(reference.chunk_kda, output_final_state=True))(
                q, k, v, g, beta, initial_state=h0)
        names = list(tunings) if first else [best_name]
        best = None
        for name in names:
            fn = jax.jit(lambda q, k, v, g, beta, h0, t=tunings[name]: pallas.chunk_kda(
                q, k, v, g, beta, initial_state=h0, output_final_state=True, tuning=t))
            if first:
                start = time.perf_counter()
                fn.lower(q, k, v, g, beta, h0).compile()  # Triton compiles the kernels here
                res[f"compile_{name}_s"] = round(time.perf_counter() - start, 1)
                intra = jax.jit(lambda *a, t=tunings[name]: pallas.chunk_intra(
                    *a, scale=D ** -0.5, l2norm=False, tuning=t))  # kernel 1 alone
                res[f"intra_T{T}_{name}_ms"] = round(pipelined_seconds(intra, q, k, v, g, beta, lengths) * 1e3, 4)
                if tunings[name].intra_variant == "split":  # kernels 1a and 1b apart
                    akk = jax.jit(lambda q, k, g, beta, n, t=tunings[name]: pallas.chunk_akk(
                        q, k, g, beta, n, scale=D ** -0.5, l2norm=False, tuning=t))
                    wy = jax.jit(lambda x, v, beta, a, n, t=tunings[name]: pallas.chunk_wy(x, v, beta, a, n, tuning=t))
                    a_kk, _, _, _, x_rhs, _ = akk(q, k, g, beta, lengths)
                    res[f"akk_T{T}_{name}_ms"] = round(pipelined_seconds(akk, q, k, g, beta, lengths) * 1e3, 4)
                    res[f"wy_T{T}_{name}_ms"] = round(pipelined_seconds(wy, x_rhs, v, beta, a_kk, lengths) * 1e3, 4)
                    del a_kk, x_rhs
                o, s = fn(q, k, v, g, beta, h0)
                res[f"chunk_T{T}_{name}_rel_err_vs_reference"] = [round(rel(o, o_r), 5), round(rel(s, s_r), 5)]
            ms = pipelined_seconds(fn, q, k, v, g, beta, h0) * 1e3
            res[f"chunk_T{T}_{name}_ms"] = round(ms, 4)
            if first:  # kernel by kernel, as the profiler times them
                calls = 10
                events = traced_events(lambda: [jax.block_until_ready(fn(q, k, v, g, beta, h0)) for _ in range(calls)])
                res[f"chunk_T{T}_{name}_kernels_us"] = per_kernel_us(gpu_kernels(events), calls)
            print(f"  chunk_kda T{T} {name}: {ms:.4f} ms"
                  + (f" (kernel 1 {res[f'intra_T{T}_{name}_ms']} ms)" if first else ""), flush=True)
            if best is None or ms < best:
                best, best_name = ms, name
        res[f"chunk_T{T}_ms"] = round(best, 4)
        res[f"chunk_T{T}_best"] = best_name
    if not decode:
        return res

    # name: V columns, warps, "vf" when V blocks launch side by side, "after" for the output reduced after the update
    decode_tunings = {f"bv{bv}w{w}{'vf' if vf else ''}{'' if before else 'after'}": pallas.KdaTuning(
        decode_block_v=bv, decode_warps=w, decode_v_fastest=vf, decode_output_before_update=before)
        for bv, w, vf, before in ((64, 4, True, False), (64, 8, True, False), (32, 4, True, True), (64, 4, True, True),
                                  (64, 8, True, True), (128, 4, True, True))}
    for B in sorted(DECODE_B, reverse=True):
        q, k, v, g, beta, h0 = inputs(B, 1, jax.random.key(B))
        slots = jnp.arange(B, dtype=jnp.int32)
        best, best_kernel = None, None
        for name in decode_tunings:  # every launch shape at every batch: the best at B64 is not the best at B1
            @functools.partial(jax.jit, donate_argnums=(5,))
            def decode_loop(q, k, v, g, beta, pool, slots, t=decode_tunings[name]):
                for _ in range(DECODE_STEPS):  # one kernel per step: each step's pool feeds the next
                    o, pool = pallas.fused_recurrent_kda_slots(q, k, v, g, beta, pool, slots, tuning=t)
                return o, pool

            pool = h0[None]  # [1, B, H, D, D]
            acc, pool = decode_loop(q, k, v, g, beta, pool, slots)
            jax.block_until_ready(pool)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                acc, pool = decode_loop(q, k, v, g, beta, pool, slots)
                jax.block_until_ready(pool)
                times.append((time.perf_counter() - start) / DECODE_STEPS)
            us = statistics.median(times) * 1e6
            res[f"decode_B{B}_{name}_us"] = round(us, 2)
            if best is None or us < best:
                best, best_name = us, name
            # the same 50 kernels as the profiler times them: kernel time apart from the gaps between launches
            traced = {}
            events = traced_events(lambda: traced.update(out=jax.block_until_ready(decode_loop(
                q, k, v, g, beta, pool, slots))))
            pool = traced["out"][1]
            split = kernel_time_split(gpu_kernels(events), "kda_recurrent_slots")
            res[f"decode_B{B}_{name}_profiled"] = split
            if split.get("median_us") and (best_kernel is None or split["median_us"] < best_kernel):
                best_kernel, best_kernel_name = split["median_us"], name
        res[f"decode_B{B}_us"] = round(best, 2)
        res[f"decode_B{B}_best"] = best_name
        if best_kernel is not None:
            res[f"decode_B{B}_kernel_us"] = best_kernel
            res[f"decode_B{B}_kernel_best"] = best_kernel_name
            res[f"decode_B{B}_kernel_state_TBps"] = round(B * H * D * D * 4 * 2 / (best_kernel * 1e-6) / 1e12, 3)
        res[f"decode_B{B}_state_TBps"] = round(B * H * D * D * 4 * 2 / (best * 1e-6) / 1e12, 3)
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    parser.add_argument("--no-peer", action="store_true", help="skip the fla measurements")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode-step measurements")
    parser.add_argument("--intra-variants", default="fused,split",
                        help="comma-separated prefill tunings: an intra_variant, then optional :field=value overrides")
    parser.add_argument("--peer-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer_only:
        print("PEER " + json.dumps(measure_fla()))
        return 0
    tunings = parse_tunings(args.intra_variants)
    peer = {} if args.no_peer else run_peer()
    if peer:
        print("fla: " + json.dumps(peer), flush=True)
    ours, start = {}, time.perf_counter()
    try:
        measure_dayzero(tunings, decode=not args.no_decode, res=ours)
    except KeyboardInterrupt:  # `timeout -s INT`: report what was measured
        ours["interrupted_after_s"] = round(time.perf_counter() - start)
        print(f"interrupted after {ours['interrupted_after_s']} s: reporting what was measured", flush=True)
    import jax

    device = jax.devices()[0]
    print(f"\n{device.device_kind}, jax {jax.__version__}, HBM copy {ours.get('hbm_copy_TBps')} TB/s")
    T = PREFILL_T[0]
    print(f"| prefill tuning | compile (s) | kernel 1 T{T} (ms) | chunk_kda T{T} (ms) | rel err (o, state) |\n"
          "|---|---|---|---|---|")
    for name in tunings:
        if f"chunk_T{T}_{name}_ms" not in ours:
            continue
        apart = (f" (1a {ours[f'akk_T{T}_{name}_ms']}, 1b {ours[f'wy_T{T}_{name}_ms']})"
                 if f"akk_T{T}_{name}_ms" in ours else "")
        print(f"| {name} | {ours[f'compile_{name}_s']} | {ours[f'intra_T{T}_{name}_ms']}{apart} | "
              f"{ours[f'chunk_T{T}_{name}_ms']} | {ours[f'chunk_T{T}_{name}_rel_err_vs_reference']} |")
    print("\n| what | dayzero | fla | ratio (fla / dayzero) |\n|---|---|---|---|")
    for T in PREFILL_T:
        a, b = ours.get(f"chunk_T{T}_ms"), peer.get(f"chunk_T{T}_ms")
        if a is None:
            continue
        print(f"| chunk_kda T{T} (ms, {ours[f'chunk_T{T}_best']}) | {a} | {b or '-'} | "
              f"{round(b / a, 2) if b else '-'} |")
    for B in DECODE_B if not args.no_decode else ():
        a = ours.get(f"decode_B{B}_us")
        if a is None:
            continue
        b = peer.get(f"decode_B{B}_graph_us")
        kernel = (f"; profiled kernel {ours[f'decode_B{B}_kernel_us']} us, {ours[f'decode_B{B}_kernel_state_TBps']} "
                  f"TB/s, {ours[f'decode_B{B}_kernel_best']}" if f"decode_B{B}_kernel_us" in ours else "")
        print(f"| decode step B{B} (us, device, {ours[f'decode_B{B}_best']}) | {a} "
              f"({ours[f'decode_B{B}_state_TBps']} TB/s{kernel}) | "
              f"{b or '-'} (host loop {peer.get(f'decode_B{B}_host_us', '-')}) | {round(b / a, 2) if b else '-'} |")
    line = (f"- {datetime.date.today()} kda.py, {device.device_kind}, commit {git_commit()}, jax {jax.__version__},"
            f" Pallas (Triton) kernels: dayzero {json.dumps(ours)}; fla-core 0.6.0 same run "
            f"{json.dumps(peer) if peer else 'not run'}\n")
    if device.platform == "gpu":
        append_line(args.results, line)
    else:
        print(f"not a GPU ({device.platform}): nothing appended to {args.results}\n{line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
