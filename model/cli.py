"""Command-line tools of the model package.

`dayzero-forward`: runs a model (the embedded tiny preset with random weights by default, or `--model DIR`) on a
prompt of token ids and prints what it computed: greedy continuation by repeated full-sequence forward passes,
the logits of the last position, and timings. `dayzero-presets`: parameter counts and bytes per component.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import numpy as np

from dayzero import platforms

from .errors import DayzeroError
from .presets import PRESETS, active_parameters, get_preset, parameter_table


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def format_parameter_table(name: str) -> str:
    config = get_preset(name)
    table = parameter_table(config)
    total = sum(c for c, _ in table.values())
    total_bytes = sum(b for _, b in table.values())
    experts = "MXFP4" if config.quant_method == "mxfp4" else "bf16"
    lines = [f"preset {name}: {total / 1e9:,.3f} B params, {active_parameters(config) / 1e9:,.3f} B active per "
             f"token; bytes with dense weights in bf16 and routed experts in {experts}",
             f"  {'component':<16} {'params':>20} {'bytes':>12}"]
    for comp, (count, nbytes) in table.items():
        lines.append(f"  {comp:<16} {count:>20,} {_format_bytes(nbytes):>12}")
    lines.append(f"  {'total':<16} {total:>20,} {_format_bytes(total_bytes):>12}")
    return "\n".join(lines)


def presets_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dayzero-presets", description="Parameter count and bytes per component.")
    parser.add_argument("names", nargs="*", default=list(PRESETS), help=f"presets ({', '.join(PRESETS)})")
    args = parser.parse_args(argv)
    for name in args.names:
        print(format_parameter_table(name))
        print()
    return 0


def forward_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dayzero-forward", description=__doc__.split("\n\n")[1])
    parser.add_argument("--model", help="checkpoint directory; default: the embedded preset with random weights")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--dtype", default=None, help="param/compute dtype (float32, bfloat16, float16)")
    parser.add_argument("--prompt-ids", default="1,17,42,99,7,250,3", help="comma-separated prompt token ids")
    parser.add_argument("--new-tokens", type=int, default=8, help="greedy tokens to append")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (presets only)")
    platforms.add_cli_options(parser)
    args = parser.parse_args(argv)
    from .model import Model, load_checkpoint

    try:
        start = time.perf_counter()
        if args.model:
            model = load_checkpoint(args.model, dtype=args.dtype, platform=platforms.from_cli_args(args))
            source = f"checkpoint {args.model}"
        else:
            model = Model.random(get_preset(args.preset), dtype=args.dtype or "float32", seed=args.seed,
                                 platform=platforms.from_cli_args(args))
            source = f"embedded preset '{args.preset}' with RANDOM weights (seed {args.seed}): the tokens mean nothing"
        load_s = time.perf_counter() - start
        ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        cfg = model.config
        print(f"model: {source}")
        print(f"  {cfg.model_type}: {cfg.num_layers} layers {list(cfg.layer_types)}, mlp {list(cfg.mlp_types)}, "
              f"DSA {'top-' + str(cfg.index_topk) if cfg.use_dsa else 'off'}, {model.num_params():,} params, "
              f"{model.dtype.name}, on {model.platform}; ready in {load_s:.2f} s")
        print(f"prompt ids: {ids}")
        # The model is causal: padding the sequence at the end to one fixed length leaves every earlier position's
        # logits unchanged, so one compilation serves every step.
        width = len(ids) + args.new_tokens
        window = np.zeros((1, width), np.int32)
        window[0, :len(ids)] = ids
        step_times = []
        last = None
        for n in range(len(ids), width):
            t0 = time.perf_counter()
            last = np.asarray(model(window))[0, n - 1]
            step_times.append(time.perf_counter() - t0)
            window[0, n] = int(last.argmax())
        print(f"greedy continuation ({args.new_tokens} tokens, one full-sequence forward each): "
              f"{window[0, len(ids):].tolist()}")
        if last is not None:
            top = np.argsort(-last)[:5]
            print("last position: top-5 ids " + ", ".join(f"{i} ({last[i]:.3f})" for i in top)
                  + f"; logits mean {last.mean():.4f} std {last.std():.4f}")
            print(f"first forward (compile + run) {step_times[0] * 1e3:.1f} ms; later forwards "
                  f"{np.median(step_times[1:]) * 1e3 if len(step_times) > 1 else float('nan'):.1f} ms median")
    except DayzeroError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
