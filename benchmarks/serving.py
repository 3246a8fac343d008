"""Serving benchmark: the medium hybrid preset (random weights: bf16, or MXFP4 routed experts) through dayzero's Engine.

    python3 benchmarks/serving.py [--experts bf16|mxfp4] [--peer SCRIPT] [--long-prompt N] [--repeats N]
                                  [--trace-batches 1,16] [--xla-option NAME=VALUE] [--set MODULE.CONSTANT=VALUE]
                                  [--batches 1,16,64] [--skip-ttft]

Measures TTFT at prompts of 2K and 32K tokens, ITL, TTFT and tokens/s at batch 1, 16 and 64 (prompts of 128 tokens, 64
new tokens each), every shape compiled before it is timed, and the bandwidth floors of a batch-1 and a batch-16 decode
step (the weights each reads at 4.0 TB/s: `decode_step_bytes`; `--experts mxfp4` gives the model random packed MXFP4
routed experts, run by the MXFP4 kernels, and the floors count them at 4.25 bits). Each batch size's generate is timed
`--repeats` times: its ITL is the median over the runs (each run's ITL the median of its requests' mean ITLs; one host
stall in a 64-token run moves a single request's mean by as much as the stall / 63), and the runs' ITLs are reported
too; a compilation during a timed run is named in the output (`compiled_while_timed`). With `--peer SCRIPT` it runs the
peer stack's anchor script (../shared/anchors/peer_transformers_fla.py: transformers + fla) in the same run, first,
before JAX starts on the GPU and takes most of its memory (run second, on an 80 GB card, the peer ran out of memory
beside our process), and reports it beside ours, with the peer's batch-16 ITL over ours and over the batch-16 floor (the
most any bf16 engine could reach against it); with `--trace-batches 1,16` those batches' generate runs once more under
the profiler (GPU busy and idle time); `--xla-option` adds an XLA compile option to the model's GPU functions for the
run (as decode_profile.py's does), named in the results line; `--set` a dayzero module constant (as decode_profile.py's
does, e.g. a kernel switch to try), named there too; `--batches` and `--skip-ttft` time fewer figures. Prints a table
and appends one dated line to the results file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time

import jax
import numpy as np

from dayzero.model import Model
from dayzero.model.presets import decode_step_bytes, get_preset
from dayzero.serving import Engine, EngineConfig, SamplingParams
from dayzero.serving.runner import unrolled_by_default

from decode_profile import set_module_constants, use_xla_options  # benchmarks/decode_profile.py
from gpu_trace import busy_summary, gpu_kernels, traced_events  # benchmarks/gpu_trace.py
from results import append_line, git_commit, xla_environment  # benchmarks/results.py (the script folder)


def kernel_choice() -> str:
    """Which implementation dispatch runs here for each op with a Pallas version."""
    from dayzero.kernels import attention, dispatch, indexer, moe, moe_dense

    verified = {"kda": True, "indexer": indexer.GPU_VERIFIED, "sparse_mla": attention.GPU_VERIFIED,
                "moe_mxfp4": moe.PACKED_GPU_VERIFIED, "moe_dense": moe_dense.GPU_VERIFIED}
    return ", ".join(f"{name} {dispatch.choose(name, ('reference', 'pallas'), gpu_verified=ok)}"
                     for name, ok in verified.items())


def timed_generate(engine: Engine, prompts, params, repeats: int = 1):
    """One warm-up generate (compiles the shapes this run uses), then `repeats` timed ones: [(outputs, wall
    seconds, compilations made while timed)]."""
    engine.generate(prompt_token_ids=prompts, sampling_params=params)
    runs = []
    for _ in range(repeats):
        compiled = engine.num_compilations
        start = time.perf_counter()
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        runs.append((outs, time.perf_counter() - start, engine.num_compilations - compiled))
    return runs


def batch_figures(runs, batch: int) -> dict:
    """A batch size's figures from `timed_generate`'s runs: ITL (each request's mean gap, decode dispatches coming in
    bursts; the median over a run's requests, then over runs; ms), every run's ITL, the median run's tokens/s, and
    the median TTFT over every run's requests (ms; at batch 1 a run holds one sample): the price, if any, of
    launching the first decode before the prefill's token is read."""
    itls = [float(np.median([o.mean_itl for o in outs])) for outs, _, _ in runs]
    outs, wall, _ = runs[int(np.argsort(itls)[len(itls) // 2])]
    return {f"itl_B{batch}_ms": round(float(np.median(itls)) * 1e3, 3),
            f"itl_B{batch}_runs_ms": [round(t * 1e3, 3) for t in itls],
            f"tok_s_B{batch}": round(sum(len(o.token_ids) for o in outs) / wall, 1),
            f"ttft_B{batch}_ms": round(float(np.median([o.ttft for run, _, _ in runs for o in run])) * 1e3, 2)}


def peer_ratios(ours: dict, peer: dict) -> dict:
    """The peer's batch-16 ITL over ours and over the batch-16 bandwidth floor ({} without a peer figure): the second
    bounds the first for any engine reading these weights, so a peer that runs fast makes a ratio target out of reach
    in that run."""
    theirs = peer.get("hf_B16_P1024_itl_ms")
    if not theirs or "itl_B16_ms" not in ours:  # (no peer figure, or batch 16 not timed)
        return {}
    return {"itl_B16_peer_over_ours": round(theirs / ours["itl_B16_ms"], 1),
            "itl_B16_peer_over_floor": round(theirs / ours["bandwidth_floor_b16_ms"], 1)}


def run_peer(script: str, timeout_s: float) -> dict:
    """The peer script's RESULTS line as a dict ({"error": ...} when it fails or runs out of time)."""
    try:
        proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    print(proc.stdout[-3000:], proc.stderr[-2000:] if proc.returncode else "", sep="\n")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULTS "):
            return json.loads(line[len("RESULTS "):])
    return {"error": f"exit status {proc.returncode}, no RESULTS line"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    parser.add_argument("--peer", help="path of the peer anchor script to run in the same process tree")
    parser.add_argument("--peer-timeout", type=float, default=900, help="seconds the peer script may run")
    parser.add_argument("--long-prompt", type=int, default=32768)
    parser.add_argument("--experts", choices=("bf16", "mxfp4"), default="bf16",
                        help="the routed experts' format (mxfp4: random packed experts, the MXFP4 kernels)")
    parser.add_argument("--decode-steps", type=int, default=EngineConfig.decode_steps,
                        help="decode steps per dispatch (the engine option)")
    parser.add_argument("--no-trim-decode-steps", action="store_true",
                        help="every decode dispatch runs all its steps, even where each row's last ones are padding "
                        "(the engine option trim_decode_steps off)")
    parser.add_argument("--no-overlap-decode", action="store_true",
                        help="read each decode dispatch's tokens before launching the next (the engine option)")
    parser.add_argument("--no-overlap-prefill", action="store_true",
                        help="read a prefill's token before launching the prompt's first decode dispatch (the engine "
                        "option)")
    parser.add_argument("--unrolled-decode", action=argparse.BooleanOptionalAction, default=None,
                        help="each decode dispatch's steps as straight-line code, no XLA loop (the engine option; "
                             "default: on a GPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per batch size (median ITL)")
    parser.add_argument("--trace-batches", default="", help="comma-separated batch sizes whose generate runs once "
                        "more under the profiler: GPU busy time, idle share and kernel time by XLA module")
    parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an XLA option added to dayzero's GPU compile options (repeatable), to try one")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.CONSTANT=VALUE",
                        help="set a dayzero module constant for this run (repeatable; true/false/ints parsed), e.g. "
                             "model.moe.SHARED_GATE_UP_IN_FRONT=false")
    parser.add_argument("--batches", default="1,16,64", help="comma-separated decode batch sizes to time")
    parser.add_argument("--skip-ttft", action="store_true", help="time no single-prompt TTFT (2K and --long-prompt)")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    constants = set_module_constants(args.set)
    # the peer first: once JAX's GPU backend starts, its allocator holds most of the card until the process ends
    peer = run_peer(args.peer, args.peer_timeout) if args.peer else {}
    if args.peer:
        print(f"peer transformers+fla: {json.dumps(peer)}", flush=True)
    if args.unrolled_decode is None:  # the engine's default, resolved here so the results line names it
        args.unrolled_decode = unrolled_by_default(jax.default_backend())
    xla_options = use_xla_options(args.xla_option)
    args.trace_batches = {int(b) for b in args.trace_batches.split(",") if b}
    device = jax.devices()[0]
    config = get_preset("medium_hybrid")
    if args.experts == "mxfp4":
        config = config.replace(quant_method="mxfp4")
    t0 = time.perf_counter()
    model = Model.random(config, dtype="bfloat16", seed=0)
    jax.block_until_ready(model.params)
    print(f"medium hybrid (routed experts {args.experts}): {model.num_params() / 1e9:.2f} B params on "
          f"{device.device_kind}, ready in {time.perf_counter() - t0:.1f} s")
    # the weights a step of 1 / 16 tokens reads (bf16, the experts MXFP4 with --experts mxfp4) at 4.0 TB/s (the
    # anchors' convention)
    floor_ms = {batch: decode_step_bytes(config, batch) / 4.0e12 * 1e3 for batch in (1, 16)}
    engine = Engine(model, None, EngineConfig(
        max_num_seqs=64, max_model_len=args.long_prompt + 256, max_prefill_tokens=4096, max_prefill_rows=16,
        prefill_len_buckets=(128, 2048, 4096), num_snapshots=8, enable_prefix_caching=False, seed=0,
        decode_steps=args.decode_steps, overlap_decode=not args.no_overlap_decode,
        overlap_prefill=not args.no_overlap_prefill, unrolled_decode=args.unrolled_decode,
        trim_decode_steps=not args.no_trim_decode_steps))
    rng = np.random.default_rng(0)
    res = {}
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    compiled_while_timed = {}
    for length in () if args.skip_ttft else (2048, args.long_prompt):
        [(outs, wall, compiled)] = timed_generate(engine, [rng.integers(3, config.vocab_size, length).tolist()], one)
        if compiled:
            compiled_while_timed[f"P{length}"] = compiled
        res[f"ttft_P{length}_ms"] = round(outs[0].ttft * 1e3, 2)
        print(f"TTFT prompt {length}: {outs[0].ttft * 1e3:.1f} ms")
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    traces = {}
    for batch in batches:
        prompts = [rng.integers(3, config.vocab_size, 128).tolist() for _ in range(batch)]
        runs = timed_generate(engine, prompts, params, args.repeats)
        figures = batch_figures(runs, batch)
        res.update(figures)
        if any(compiled for _, _, compiled in runs):
            compiled_while_timed[f"B{batch}"] = sum(compiled for _, _, compiled in runs)
        itl, itls = figures[f"itl_B{batch}_ms"], figures[f"itl_B{batch}_runs_ms"]
        print(f"batch {batch}: ITL (median of per-request means, median of {len(runs)} runs {itls}) {itl:.2f} ms, "
              f"{figures[f'tok_s_B{batch}']} tokens/s overall, decode-only {batch / itl * 1e3:.1f} tokens/s, "
              f"TTFT (median request of all runs) {figures[f'ttft_B{batch}_ms']} ms")
        if batch in args.trace_batches:  # the same generate again, traced: where the ITL goes on the GPU
            events = traced_events(lambda: engine.generate(prompt_token_ids=prompts, sampling_params=params))
            traces[batch] = busy_summary(gpu_kernels(events))
            print(f"batch {batch} traced: {json.dumps(traces[batch])}")
    if traces:
        res["traced"] = traces
    res["bandwidth_floor_b1_ms"] = round(floor_ms[1], 3)
    res["bandwidth_floor_b16_ms"] = round(floor_ms[16], 3)
    res["compilations"] = engine.num_compilations
    if compiled_while_timed:
        res["compiled_while_timed"] = compiled_while_timed
        print(f"warning: compilations during timed runs {compiled_while_timed}: those figures include them")
    print(f"dayzero: {json.dumps(res)}", flush=True)
    print("\n| figure | dayzero | peer (transformers+fla) |\n|---|---|---|")
    rows = [("TTFT 2K (ms)", res.get("ttft_P2048_ms"), peer.get("hf_B1_P2048_ttft_ms")),
            ("ITL batch 1 (ms)", res.get("itl_B1_ms"), peer.get("hf_B1_P2048_itl_ms")),
            ("ITL batch 16 (ms)", res.get("itl_B16_ms"), peer.get("hf_B16_P1024_itl_ms")),
            ("ITL batch 64 (ms)", res.get("itl_B64_ms"), None),
            (f"TTFT {args.long_prompt // 1024}K (ms)", res.get(f"ttft_P{args.long_prompt}_ms"), None),
            ("bandwidth floor batch 1 (ms)", res["bandwidth_floor_b1_ms"], peer.get("roofline_bf16_b1_ms")),
            ("bandwidth floor batch 16 (ms)", res["bandwidth_floor_b16_ms"], None)]
    for name, ours, theirs in rows:
        print(f"| {name} | {ours if ours is not None else '-'} | {theirs if theirs is not None else '-'} |")
    ratios = peer_ratios(res, peer)
    if ratios:
        print(f"batch 16: the peer's ITL is {ratios['itl_B16_peer_over_ours']}x ours and "
              f"{ratios['itl_B16_peer_over_floor']}x the batch-16 bandwidth floor (the most an engine reading these "
              f"weights could reach)")
    line = (f"- {datetime.date.today()} serving.py, {device.device_kind}, commit {git_commit()}, jax {jax.__version__}"
            f" (routed experts {args.experts}; kernels: {kernel_choice()}; {args.decode_steps} decode steps per "
            f"dispatch, trimmed to the longest row: {not args.no_trim_decode_steps}, "
            f"overlapped: {not args.no_overlap_decode}, first decode ahead of the prefill's token: "
            f"{not (args.no_overlap_decode or args.no_overlap_prefill)}; steps unrolled: {args.unrolled_decode}; "
            f"XLA options added {xla_options or 'none'}; module constants set {constants or 'none'}; "
            f"XLA environment {xla_environment()}): "
            f"dayzero {json.dumps(res)}; "
            f"peer transformers+fla same run {json.dumps(peer) if peer else 'not run'}"
            f"{'; ratios ' + json.dumps(ratios) if ratios else ''}\n")
    append_line(args.results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
