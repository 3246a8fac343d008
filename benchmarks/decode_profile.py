"""Where a decode dispatch's GPU time goes, by model op: the engine's jitted decode (4 steps per dispatch) profiled
with `jax.profiler`, each GPU kernel attributed to the op that XLA's optimized HLO names in its metadata.

    python3 benchmarks/decode_profile.py [--preset medium_hybrid] [--batches 1,16] [--experts bf16|mxfp4]
                                         [--engine serving] [--top 25]
                                         [--xla-option NAME=VALUE] [--pallas router] [--dump PREFIX]
                                         [--dense-fused-prologues] [--shared-apart] [--dense-epilogue-min-pairs N]
                                         [--router-dot] [--dense-pair-partials] [--dense-tiles FIELD=VALUE]
                                         [--set MODULE.CONSTANT=VALUE]
                                         [--projection-tiles [one.|row.|rowone.]FIELD=VALUE]

`--engine serving` builds the engine with benchmarks/serving.py's options (64 rows, 33K tokens, its block pool);
`small` sizes everything for the profiled rows only. Each batch size: the dispatch time pipelined (many dispatches,
one wait; with the host time of each dispatch call: the inputs' transfer and XLA's launch, which a pipelined engine
must keep under the device's time) and waited on each time, then a 5-dispatch trace. Kernels are grouped by op (layer
numbers folded: `layers_*`), reported per generated token (ms and kernel count). Prints the tables and appends one
dated line (totals and the top ops) to the results file. Needs a GPU (on the CPU the trace holds no device kernels).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import glob
import json
import os
import re
import sys
import tempfile
import time

import jax
import numpy as np

from dayzero.kernels import dispatch, projection
from dayzero.model import Model
from dayzero.model.presets import get_preset
from dayzero.serving import Engine, EngineConfig
from dayzero.serving.runner import StepRows, unrolled_by_default

from gpu_trace import gpu_kernels, kernel_family, traced_events  # benchmarks/gpu_trace.py
from results import append_line, git_commit, xla_environment  # benchmarks/results.py (the script folder)

STEPS = 4
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = \(?(\w+\[[\d,]*\])?.*?metadata=\{op_name="([^"]*)"')
_DEDUPLICATED = re.compile(r'deduplicated_name="([\w.\-]+)"')
_PREFIXES = ("jit(_decode)/while/body/eval_jaxpr/", "jit(_decode)/while/body/closed_call/", "jit(_decode)/closed_call/",
             "jit(_decode)/")  # the third: an unrolled dispatch's steps


def op_label(op_name: str) -> str:
    """HLO metadata op_name -> a label shared by every layer: prefixes dropped, layer numbers folded."""
    for prefix in _PREFIXES:
        if op_name.startswith(prefix):
            op_name = op_name[len(prefix):]
            break
    op_name = re.sub(r"layers_\d+", "layers_*", op_name).replace("Decoder.step/", "")
    return op_name.replace("layers_*.step/layers_*._mlp/", "mlp: ").replace("layers_*.step/self_attn.step/", "attn: ")


def kernel_ops(hlo_text: str) -> dict[str, str]:
    """Kernel name -> op label and output type, from optimized HLO text: a fusion or custom call
    `%input_reduce_fusion.98` runs as kernel `input_reduce_fusion_98` (dots become underscores). Instructions that
    XLA compiled to one shared kernel carry the same `deduplicated_name`; the kernel is named after the first of them
    in schedule order and gets all their labels, joined by " | "."""
    labels = collections.defaultdict(set)
    first_of_group = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, label = match.group(1), op_label(match.group(3))
        if match.group(2):  # the (first) output's type: which of the op's shapes this kernel is
            label = f"{label} -> {match.group(2)}"
        shared = _DEDUPLICATED.search(line)
        kernel = first_of_group.setdefault(shared.group(1), name) if shared else name
        labels[kernel.replace(".", "_")].add(label)
    return {name: " | ".join(sorted(found)[:3]) + (" | ..." if len(found) > 3 else "")
            for name, found in labels.items()}


def attribute(events: list[dict], ops: dict[str, str], n_tokens: int) -> tuple[list[tuple[str, float, float]], float, float]:
    """GPU kernel events -> ([(op label, ms per token, kernels per token)] by time, total ms, kernels per token).
    A label is the op and, in brackets, the kind of kernel XLA made of it (`gemm_fusion_dot`, `loop_fusion`, ...).
    Kernels the HLO does not name (Pallas kernels run under their own names, library GEMMs) keep their name."""
    time_us, count = collections.Counter(), collections.Counter()
    for e in gpu_kernels(events):
        label = ops.get(e["name"])
        label = e["name"] if label is None else f"{label} [{kernel_family(e['name'])}]"
        time_us[label] += e["dur"]
        count[label] += 1
    rows = [(label, us / n_tokens / 1e3, count[label] / n_tokens) for label, us in time_us.most_common()]
    return rows, sum(time_us.values()) / n_tokens / 1e3, sum(count.values()) / n_tokens


def timeline(events: list[dict], ops: dict[str, str], dispatches: int) -> list[dict]:
    """The last traced dispatch's kernels in launch order: name, op label, start (us from the dispatch's first
    kernel), duration, the gap since the previous kernel ended and how far the kernel moved the dispatch's end
    (`end_gain_us`: its share of the dispatch's time where kernels overlap, as they do when one lets the next launch
    early and the next one's span starts with a wait; the durations then count that wait). The trace holds
    `dispatches` dispatches of the same program, so each is the same number of kernels."""
    kernels = gpu_kernels(events)
    last = kernels[len(kernels) - len(kernels) // dispatches:] if dispatches else []
    rows, end = [], 0.0  # (the first kernel starts at 0: its gap is 0)
    for e in last:
        start = e["ts"] - last[0]["ts"]
        new_end = max(end, start + e["dur"])
        rows.append({"kernel": e["name"][:80], "op": ops.get(e["name"], ""), "start_us": round(start, 2),
                     "dur_us": round(e["dur"], 2), "gap_us": round(start - end, 2),
                     "end_gain_us": round(new_end - end, 2)})
        end = new_end
    return rows


def engine_for(model: Model, kind: str, batch: int, unrolled_decode: bool | None = None) -> Engine:
    if kind == "serving":
        return Engine(model, None, EngineConfig(
            max_num_seqs=64, max_model_len=32768 + 256, max_prefill_tokens=4096, max_prefill_rows=16,
            prefill_len_buckets=(128, 2048, 4096), num_snapshots=8, enable_prefix_caching=False, seed=0,
            unrolled_decode=unrolled_decode))
    return Engine(model, None, EngineConfig(max_num_seqs=batch, max_model_len=256, max_prefill_tokens=256,
                                            prefill_len_buckets=(256,), block_buckets=(4,),
                                            enable_prefix_caching=False, unrolled_decode=unrolled_decode))


def decode_rows(batch: int, context: int, vocab_size: int) -> StepRows:
    """A 4-step decode dispatch of `batch` rows at position `context`, each row on its own 4 blocks and slot, with
    random input tokens (one token in every row would route every row to the same experts)."""
    rows = StepRows.padding(batch, 1, 4, decode_steps=STEPS)
    rows.tokens[:] = np.random.default_rng(batch).integers(3, vocab_size, rows.tokens.shape)
    rows.positions[:] = context
    rows.valid[:] = True
    rows.steps[:] = STEPS
    rows.block_tables[:] = 1 + np.arange(4, dtype=np.int32)[None] + 4 * np.arange(batch, dtype=np.int32)[:, None]
    rows.slots[:] = np.arange(1, batch + 1, dtype=np.int32)
    return rows


def dump_hlo_to(folder: str) -> None:
    """Has XLA write the decode functions' optimized HLO into `folder` (XLA reads XLA_FLAGS when the backend
    starts: call before anything uses a device)."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={folder} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_module_re=.*_decode.*").strip()


def latest_hlo(folder: str) -> str:
    files = sorted(glob.glob(os.path.join(folder, "*_decode*after_optimizations.txt")), key=os.path.getmtime)
    return open(files[-1]).read() if files else ""


def call_host_ms(engine: Engine, rows: StepRows, repeats: int) -> dict[str, float]:
    """Where the dispatch call's host time goes, in medians of `repeats` calls (ms), the cache donated as the engine
    does: "put" the step inputs' `jax.device_put` alone; the decode function's call alone with: "fresh" new input
    buffers each time, put just before it; "ready" new input buffers each time, all put and transferred before the
    loop; "same" one set of input buffers for every call; and "waited" the put, a wait for its transfer and the call
    together. fresh against ready: what a transfer still in flight costs the call; ready against same: what new
    input addresses cost XLA's launch (command buffers); waited against put + fresh: whether waiting for the
    transfer first shortens the whole."""
    from dayzero import platforms
    from dayzero.serving import runner as runner_module
    from dayzero.serving.sampling import GREEDY_EPS

    runner = engine.runner
    greedy, steps = bool(np.all(rows.temperature < GREEDY_EPS)), runner.dispatch_steps(rows)
    times = {"put": [], "fresh": [], "ready": [], "same": [], "waited": []}
    with platforms.activate(engine.model.placement):
        packed, layout = runner_module.pack_rows(rows)
        zeros = np.zeros(rows.keys.shape[:2], np.int32)
        ready = jax.block_until_ready([jax.device_put((packed, zeros)) for _ in range(repeats)])
        for kind in ("fresh", "ready", "same", "waited"):
            for i in range(repeats):
                called = time.perf_counter()
                if kind in ("fresh", "waited"):
                    arrays, previous = jax.device_put((packed, zeros))
                    if kind == "waited":
                        jax.block_until_ready((arrays, previous))
                else:
                    arrays, previous = ready[i if kind == "ready" else 0]
                called_put = time.perf_counter()
                *out, runner.cache = runner_module._DECODE(
                    engine.model.module, engine.model.params, runner.cache, arrays, layout, previous, greedy,
                    runner.unrolled_decode, steps)
                done = time.perf_counter()
                times[kind].append(done - (called if kind == "waited" else called_put))
                if kind == "fresh":
                    times["put"].append(called_put - called)
            jax.block_until_ready(out)
    return {kind: float(np.median(t)) * 1e3 for kind, t in times.items()}


def profile(engine: Engine, rows: StepRows, hlo_folder: str, repeats: int = 50) -> dict:
    engine.runner.run(rows, True)  # compiles (and dumps the HLO)
    calls = []  # host seconds of each dispatch call (inputs' transfer, XLA's launch of the executable)
    start = time.perf_counter()
    for _ in range(repeats):
        called = time.perf_counter()
        out = engine.runner.dispatch(rows, True)
        calls.append(time.perf_counter() - called)
    jax.block_until_ready(out)
    pipelined = (time.perf_counter() - start) / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        engine.runner.run(rows, True)
    waited = (time.perf_counter() - start) / repeats
    parts = call_host_ms(engine, rows, repeats)
    traced = 5
    events = traced_events(lambda: [engine.runner.run(rows, True) for _ in range(traced)])
    labels = kernel_ops(latest_hlo(hlo_folder))
    ops, total_ms, kernels = attribute(events, labels, traced * STEPS)
    return {"timeline": timeline(events, labels, traced),
            "pipelined_ms_per_token": pipelined / STEPS * 1e3, "waited_ms_per_token": waited / STEPS * 1e3,
            "host_ms_per_dispatch": float(np.median(calls)) * 1e3, "host_ms_per_dispatch_same_inputs": parts["same"],
            "host_ms_device_put": parts["put"], "host_ms_call_fresh_inputs": parts["fresh"],
            "host_ms_call_ready_inputs": parts["ready"], "host_ms_put_wait_call": parts["waited"],
            "gpu_ms_per_token": total_ms, "kernels_per_token": kernels, "ops": ops}


def parse_value(text: str):
    """A command-line value: true / false -> bool, an integer -> int, else the text."""
    lowered = text.lower()
    return lowered == "true" if lowered in ("true", "false") else int(text) if text.lstrip("-").isdigit() else text


def use_xla_options(pairs: list[str]) -> dict[str, object]:
    """Adds `NAME=VALUE` XLA options (true/false/ints parsed) to the options dayzero's model functions compile with
    on GPUs, for this process; returns them."""
    extra = {name: parse_value(text) for name, _, text in (pair.partition("=") for pair in pairs)}
    if extra:
        dispatch._COMPILER_OPTIONS = {platform: {**options, **extra}
                                      for platform, options in dispatch._COMPILER_OPTIONS.items()}
    return extra


def module_constant(text: str) -> tuple[object, str, object]:
    """'model.mla.DECODE_PROJECTIONS=false' -> (the module dayzero.model.mla, "DECODE_PROJECTIONS", False): a
    constant the model reads when it traces. Refuses a name the module does not have."""
    import importlib

    target, _, raw = text.partition("=")
    path, _, constant = target.rpartition(".")
    if not path or not raw:
        raise SystemExit(f"--set: '{text}' is not MODULE.CONSTANT=VALUE")
    try:
        module = importlib.import_module(f"dayzero.{path}")
    except ImportError as e:
        raise SystemExit(f"--set: no module dayzero.{path} ({e})") from None
    if not hasattr(module, constant):
        raise SystemExit(f"--set: dayzero.{path} has no {constant}")
    return module, constant, parse_value(raw)


def set_module_constants(texts: list[str]) -> dict[str, object]:
    """Sets each 'MODULE.CONSTANT=VALUE' (`module_constant`) for this process, before the model traces; returns
    {constant: value} for the results line."""
    done = {}
    for module, constant, value in [module_constant(text) for text in texts]:
        setattr(module, constant, value)
        done[constant] = value
    return done


def run(args, hlo_folder: str) -> dict:
    """Profiles each batch size of `args`; prints its table and returns the per-token summary by batch size."""
    config = get_preset(args.preset)
    model = Model.random(config.replace(quant_method="mxfp4") if args.experts == "mxfp4" else config,
                         dtype="bfloat16", seed=0)
    summary = {}
    for batch in (int(b) for b in args.batches.split(",")):
        engine = engine_for(model, args.engine, batch, args.unrolled_decode)
        result = profile(engine, decode_rows(batch, args.context, model.config.vocab_size), hlo_folder)
        print(f"\nbatch {batch}: {result['pipelined_ms_per_token']:.3f} ms per token pipelined, "
              f"{result['waited_ms_per_token']:.3f} ms waited on; GPU kernels {result['gpu_ms_per_token']:.3f} ms, "
              f"{result['kernels_per_token']:.0f} kernels per token; the dispatch call holds the host "
              f"{result['host_ms_per_dispatch']:.3f} ms (median; {STEPS} tokens per dispatch), "
              f"{result['host_ms_per_dispatch_same_inputs']:.3f} ms with the same input arrays each time; apart, "
              f"the inputs' device_put {result['host_ms_device_put']:.3f} ms and the call with new inputs "
              f"{result['host_ms_call_fresh_inputs']:.3f} ms, with new inputs transferred before "
              f"{result['host_ms_call_ready_inputs']:.3f} ms; put, waited for and called "
              f"{result['host_ms_put_wait_call']:.3f} ms")
        print("| op | ms / token | kernels / token |\n|---|---|---|")
        for label, ms, n in result["ops"][:args.top]:
            print(f"| {label} | {ms:.4f} | {n:g} |")
        summary[batch] = {k: round(v, 3) for k, v in result.items() if k not in ("ops", "timeline")}
        summary[batch]["top_ops_ms"] = {label: round(ms, 4) for label, ms, _ in result["ops"][:8]}
        if args.dump:
            everything = {"ops": [{"op": label, "ms_per_token": ms, "kernels_per_token": n}
                                  for label, ms, n in result["ops"]], "timeline": result["timeline"]}
            with open(f"{args.dump}.B{batch}.json", "w") as f:
                json.dump({**summary[batch], **everything}, f, indent=1)
        del engine
    return summary


@contextlib.contextmanager
def dense_tiles_with(**options):
    """Within: `moe_dense.choose_tiles` picks its tiles with these DenseTiles fields set (an A/B for this run only;
    none: unchanged)."""
    if not options:
        yield
        return
    from dayzero.kernels import moe_dense

    chosen = moe_dense.choose_tiles
    moe_dense.choose_tiles = lambda *a: dataclasses.replace(chosen(*a), **options)
    try:
        yield
    finally:
        moe_dense.choose_tiles = chosen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    parser.add_argument("--preset", default="medium_hybrid")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--experts", choices=("bf16", "mxfp4"), default="bf16",
                        help="the routed experts' format (mxfp4: random packed experts, the MXFP4 kernels)")
    parser.add_argument("--engine", choices=("serving", "small"), default="serving")
    parser.add_argument("--unrolled-decode", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine option unrolled_decode: the dispatch's steps as straight-line code "
                             "(default: on a GPU)")
    parser.add_argument("--context", type=int, default=200, help="position of the decoded tokens (< 256)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an XLA option added to dayzero's GPU compile options (repeatable), to try one")
    parser.add_argument("--pallas", action="append", default=[], metavar="KERNEL",
                        help="run this kernel's Pallas version on CUDA even if not yet GPU-verified (repeatable; "
                             "a dispatch policy for the run), to try it: e.g. router")
    parser.add_argument("--dump", metavar="PREFIX",
                        help="also write every op of each batch size, and the last traced dispatch's kernels in launch "
                             "order with their gaps, to PREFIX.B<batch>.json (the results line keeps the top 8)")
    parser.add_argument("--dense-fused-prologues", action="store_true",
                        help="dense experts with DenseTiles.fused_prologues (row gather and SwiGLU in the kernels)")
    parser.add_argument("--shared-apart", action="store_true",
                        help="decode-sized MoE calls run the shared experts apart from the routed experts' grouped "
                             "kernels (model.moe.SHARED_IN_ROUTED_KERNELS off, for this run)")
    parser.add_argument("--dense-epilogue-min-pairs", type=int, metavar="PAIRS",
                        help="dense expert calls of at least PAIRS token-expert pairs compute the SwiGLU in the "
                             "gate/up kernel (moe_dense.EPILOGUE_MIN_PAIRS, for this run)")
    parser.add_argument("--dense-pair-partials", action="store_true",
                        help="dense experts with DenseTiles.pair_partials (split-K partial sums of the pairs' rows "
                             "only)")
    parser.add_argument("--dense-tiles", action="append", default=[], metavar="FIELD=VALUE",
                        help="dense experts with this DenseTiles field set at every call (repeatable; ints and "
                             "true/false parsed), e.g. k_slices=4 or num_stages=4")
    parser.add_argument("--router-dot", action="store_true",
                        help="router logits by XLA's dot at every size (model.moe.REDUCE_LOGITS_MAX_TOKENS 0)")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.CONSTANT=VALUE",
                        help="set a dayzero module constant for this run (repeatable; true/false/ints parsed), "
                             "e.g. model.mla.DECODE_PROJECTIONS=false or kernels.projection.CHOOSE_MAX_ROWS=16")
    parser.add_argument("--projection-tiles", action="append", default=[],
                        metavar="[one.|row.|rowone.|wrow.|wrowone.]FIELD=VALUE",
                        help="the projection kernel's default ProjectionTiles field for calls of several weights "
                             "(kernels.projection.TILES), or with 'one.' of one weight (ONE_WEIGHT_TILES: o_proj), "
                             "or with 'row.' / 'rowone.' of one-row calls of several weights / one weight on the "
                             "CUDA cores (ONE_ROW_TILES / ONE_ROW_ONE_WEIGHT_TILES, with "
                             "kernels.projection.ONE_ROW_ON_CUDA_CORES), or with 'wrow.' / 'wrowone.' of one-row "
                             "calls over weights stored [out, in] (WEIGHT_ROWS_TILES / WEIGHT_ROWS_ONE_WEIGHT_TILES, "
                             "with model.linear.WEIGHT_ROWS), e.g. one.k_slices=16 or wrow.block_n=4 (repeatable)")
    args = parser.parse_args(argv)
    if args.unrolled_decode is None:  # the engine's default, resolved here so the results line names it
        args.unrolled_decode = unrolled_by_default(jax.default_backend())
    extra = use_xla_options(args.xla_option)
    for target, _, text in (pair.partition("=") for pair in args.projection_tiles):
        prefix, _, rest = target.partition(".")
        constant, field = {"one": ("ONE_WEIGHT_TILES", rest), "row": ("ONE_ROW_TILES", rest),
                           "rowone": ("ONE_ROW_ONE_WEIGHT_TILES", rest), "wrow": ("WEIGHT_ROWS_TILES", rest),
                           "wrowone": ("WEIGHT_ROWS_ONE_WEIGHT_TILES", rest)}.get(
            prefix, ("TILES", target)) if rest else ("TILES", target)
        extra[f"projection_{target}"] = value = parse_value(text)
        setattr(projection, constant, dataclasses.replace(getattr(projection, constant), **{field: value}))
    if args.pallas:
        extra["pallas"] = args.pallas
    tile_options = {}
    # the older tile switches are shorthands for --dense-tiles
    tile_pairs = [text for flag, text in ((args.dense_fused_prologues, "fused_prologues=true"),
                                          (args.dense_pair_partials, "pair_partials=true")) if flag]
    for name, _, text in (pair.partition("=") for pair in tile_pairs + args.dense_tiles):
        extra[f"dense_{name}"] = tile_options[name] = parse_value(text)
    # the older switches are shorthands for --set; (module, constant, value) read when the model traces
    shorthands = [text for flag, text in ((args.shared_apart, "model.moe.SHARED_IN_ROUTED_KERNELS=false"),
                                          (args.router_dot, "model.moe.REDUCE_LOGITS_MAX_TOKENS=0")) if flag]
    if args.dense_epilogue_min_pairs is not None:
        shorthands.append(f"kernels.moe_dense.EPILOGUE_MIN_PAIRS={args.dense_epilogue_min_pairs}")
    extra.update(set_module_constants(shorthands + args.set))  # the results line names each constant and value
    with tempfile.TemporaryDirectory(prefix="dayzero_hlo_") as hlo_folder, \
            dispatch.use_policy({"cuda": args.pallas} if args.pallas else None), \
            dense_tiles_with(**tile_options):
        environment = xla_environment()  # before the dump folder joins XLA_FLAGS
        dump_hlo_to(hlo_folder)
        summary = run(args, hlo_folder)
    device = jax.devices()[0]
    append_line(args.results, f"- {datetime.date.today()} decode_profile.py, {device.device_kind}, commit "
                              f"{git_commit()}, jax {jax.__version__}, {args.preset} (random, routed experts "
                              f"{args.experts}), engine options '{args.engine}'"
                              f"{' with the steps unrolled' if args.unrolled_decode else ', steps in a loop'}, "
                              f"XLA options and module constants set "
                              f"{extra or 'none'}, XLA environment {environment}, {STEPS} steps per dispatch at "
                              f"position {args.context}, per token: {json.dumps(summary)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
