"""`dayzero-generate`: batch generation from a JSONL or text file, `--prompt`, or the embedded default.

Writes one JSON line per prompt (text, token ids, finish reason, TTFT, ITL) and prints a summary table (TTFT/ITL
percentiles, tokens/s). With no `--model` it runs the embedded default: the built-in tiny hybrid preset (KDA +
MLA/DSA + MoE) with RANDOM weights on random token-id prompts, and says so. For a vision checkpoint (kimi_k25),
`--image PATH` goes with `--prompt` (one each, in order) and a JSONL line may carry "image" (a path) or "images"
(a list of paths; relative paths are taken from the JSONL file's folder); the prompt holds the image placeholder
token once per image.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NamedTuple, Sequence

import jax
import numpy as np

from dayzero import platforms
from dayzero.model import sharding
from dayzero.model.errors import DayzeroError
from dayzero.model.model import Model
from dayzero.model.presets import PRESETS, get_preset

from .engine import Engine, EngineConfig
from .sampling import SamplingParams

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "logprobs")


def read_prompts(path: str) -> list[dict]:
    """A .jsonl file (objects with "prompt" or "prompt_token_ids", optional sampling fields and "image" / "images")
    or a text file (one prompt per non-empty line)."""
    with open(path) as f:
        lines = [line.rstrip("\n") for line in f]
    if path.endswith(".jsonl"):
        entries = []
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{number}: not JSON: {e}") from None
                images = entry_images(entries[-1], f"{path}:{number}")
                if images is not None:
                    folder = os.path.dirname(os.path.abspath(path))
                    entries[-1]["images"] = [os.path.join(folder, i) for i in images]
        return entries
    return [{"prompt": line} for line in lines if line.strip()]


def entry_images(entry: dict, where: str) -> list[str] | None:
    """The image paths of one JSONL entry ("image": path or "images": [paths]), or None."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if "image" in entry and "images" in entry:
        raise ValueError(f"{where}: give \"image\" or \"images\", not both")
    images = [entry["image"]] if "image" in entry else entry.get("images")
    if images is not None and not (isinstance(images, list) and all(isinstance(i, str) for i in images)):
        raise ValueError(f"{where}: \"image\" must be a path and \"images\" a list of paths")
    return images


def embedded_prompts(count: int, vocab: int, seed: int) -> list[dict]:
    """Random token-id prompts of mixed lengths, half sharing a 64-token prefix (exercises the prefix cache)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, 64).tolist()
    out = []
    for i in range(count):
        body = rng.integers(3, vocab, int(rng.integers(4, 120))).tolist()
        out.append({"prompt_token_ids": (shared + body) if i % 2 else body})
    return out


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    p = np.percentile(np.asarray(values) * 1e3, [50, 90, 99])
    return f"{p[0]:8.2f} {p[1]:8.2f} {p[2]:8.2f}"


class BatchRun(NamedTuple):
    """What `_load_and_generate` did: the engine and its outputs, load / warm-up / generation seconds, the functions
    warm-up compiled and those compiled while generating."""

    engine: Engine
    outputs: list
    load_s: float
    warm_s: float
    warmed: int
    compiled: int
    wall: float


def _load_and_generate(args: argparse.Namespace, parser: argparse.ArgumentParser, options: dict) -> BatchRun:
    """Builds the engine the options ask for (a checkpoint, or the embedded preset) and generates every prompt."""
    start = time.perf_counter()
    platform = platforms.from_cli_args(args)
    mesh = None
    if args.mesh:  # over the platform's devices (initialised first: a plugin registers before JAX starts)
        devices = platforms.init_platform(platform) if platform is not None else None
        mesh = sharding.make_mesh(**sharding.parse_mesh(args.mesh), devices=devices)
    if args.model:
        engine = Engine.from_checkpoint(args.model, dtype=args.dtype, mesh=mesh, platform=platform, **options)
        print(f"model: {args.model} ({engine.model.config.model_type}, {engine.model.dtype.name})")
    else:
        model = Model.random(get_preset(args.preset), dtype=args.dtype or "float32", seed=args.seed, mesh=mesh,
                             platform=platform)
        engine = Engine(model, None, EngineConfig(**options))
        print(f"model: embedded preset '{args.preset}' with RANDOM weights (seed {args.seed}): the generated "
              "tokens mean nothing; pass --model DIR for a real checkpoint")
    load_s = time.perf_counter() - start
    if args.input:
        entries = read_prompts(args.input)
        if not entries:
            raise ValueError(f"{args.input}: no prompts in the file")
    elif args.prompt:
        entries = [{"prompt": p} for p in args.prompt]
        if args.image and len(args.image) != len(args.prompt):
            parser.error(f"{len(args.image)} --image for {len(args.prompt)} --prompt: give one image per prompt")
        for entry, image in zip(entries, args.image or []):
            entry["images"] = [image]
    elif args.model:
        parser.error("give --input FILE or --prompt TEXT with --model")
    else:
        entries = embedded_prompts(args.num_prompts, engine.model.config.vocab_size, args.seed)
    base = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, stop=tuple(args.stop), seed=None)
    params = [SamplingParams(**{**base, **{k: e[k] for k in SAMPLING_FIELDS if k in e}}) for e in entries]
    warm_start = time.perf_counter()
    warmed = engine.warmup() if args.warmup else 0
    warm_s = time.perf_counter() - warm_start
    compiled_before = engine.num_compilations
    run_start = time.perf_counter()
    outputs = engine.generate(prompts=None if "prompt_token_ids" in entries[0] else [e.get("prompt") for e in entries],
                              prompt_token_ids=[e["prompt_token_ids"] for e in entries]
                              if "prompt_token_ids" in entries[0] else None,
                              sampling_params=params, progress=not args.no_progress,
                              images=[e.get("images") for e in entries]
                              if any(e.get("images") for e in entries) else None)
    wall = time.perf_counter() - run_start
    return BatchRun(engine, outputs, load_s, warm_s, warmed, engine.num_compilations - compiled_before, wall)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dayzero-generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: embedded tiny preset, random weights)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="preset when --model is absent")
    parser.add_argument("--input", help="prompts: .jsonl (prompt / prompt_token_ids per line) or a text file")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    parser.add_argument("--image", action="append", help="an image for the --prompt of the same rank (repeatable; "
                        "vision checkpoints)")
    parser.add_argument("--num-prompts", type=int, default=24, help="random prompts for the embedded default")
    parser.add_argument("--output", default="dayzero_generations.jsonl", help="JSONL results ('-' for stdout)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None, help="default 4096 (256 for the embedded preset)")
    parser.add_argument("--max-prefill-tokens", type=int, default=None, help="default 512 (128 for the preset)")
    parser.add_argument("--decode-steps", type=int, default=4, help="decode steps per device dispatch")
    parser.add_argument("--no-trim-decode-steps", action="store_true",
                        help="run every decode dispatch's --decode-steps steps, even where all its rows need fewer "
                             "(fewer compiled functions: one step count)")
    parser.add_argument("--no-overlap-decode", action="store_true",
                        help="read each decode dispatch's tokens before launching the next")
    parser.add_argument("--no-overlap-prefill", action="store_true",
                        help="read a prefill's token before launching the prompt's first decode dispatch")
    parser.add_argument("--unrolled-decode", action=argparse.BooleanOptionalAction, default=None,
                        help="compile each dispatch's decode steps as straight-line code rather than a loop (longer "
                             "compiles, faster GPU decode; default: on a GPU, off elsewhere)")
    parser.add_argument("--warmup", action="store_true", help="compile every bucketed shape before generating")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--mesh", help="run on a device mesh, e.g. expert=2,tensor=4 (axes data, expert, tensor; "
                        "unnamed axes 1; default: one device); see docs/SHARDING.md")
    platforms.add_cli_options(parser)
    args = parser.parse_args(argv)
    if args.image and (args.input or not args.prompt):
        parser.error("--image goes with --prompt (in a JSONL file, give an \"image\" field)")
    options = dict(max_num_seqs=args.max_num_seqs, seed=args.seed, decode_steps=args.decode_steps,
                   overlap_decode=not args.no_overlap_decode, overlap_prefill=not args.no_overlap_prefill,
                   unrolled_decode=args.unrolled_decode, trim_decode_steps=not args.no_trim_decode_steps,
                   max_model_len=args.max_model_len or (4096 if args.model else 256),
                   max_prefill_tokens=args.max_prefill_tokens or (512 if args.model else 128))
    with platforms.compilation_cache.counting() as cache_use:
        try:
            run = _load_and_generate(args, parser, options)
        except (DayzeroError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    outputs = run.outputs
    lines = [json.dumps({"request_id": o.request_id, "text": o.text, "token_ids": o.token_ids,
                         "finish_reason": o.finish_reason, "error": o.error, "ttft_s": o.ttft, "itl_s": o.itl,
                         "num_cached_tokens": o.num_cached_tokens}) for o in outputs]
    if args.output == "-":
        print("\n".join(lines))
    else:
        with open(args.output, "w") as f:
            f.write("\n".join(lines) + "\n")
    ok = [o for o in outputs if o.error is None]
    tokens = sum(len(o.token_ids) for o in ok)
    itl = [o.mean_itl for o in ok if o.mean_itl is not None]  # per request: decode dispatches return bursts
    stats = run.engine.stats()
    print(f"\n{len(outputs)} requests ({len(outputs) - len(ok)} rejected), {tokens} tokens generated in "
          f"{run.wall:.2f} s = {tokens / max(run.wall, 1e-9):.1f} tokens/s (compilation included unless --warmup); "
          f"load {run.load_s:.1f} s" + (f", warm-up {run.warm_s:.1f} s ({run.warmed} functions)" if run.warmed else ""))
    print(f"{'':10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
    print(f"{'TTFT':10} {percentiles([o.ttft for o in ok if o.ttft is not None])}")
    print(f"{'ITL':10} {percentiles(itl)}  (each request's mean gap between tokens)")
    print(f"prefix-cache hit rate {stats['prefix_hit_rate']:.1%}; functions first needed during the run (compiled, "
          f"or read from the compilation cache): {run.compiled}; results in {args.output}")
    cache = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
    print(f"compilation cache: {cache}: {cache_use.hits} compilations read back, {cache_use.written} written"
          if cache else "compilation cache: off")
    for out in outputs:
        if out.error:
            print(f"rejected {out.request_id}: {out.error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
