"""Load benchmark: streaming a hub checkpoint (safetensors) vs restoring its dayzero-convert (orbax) form.

Writes a preset's random weights as a hub checkpoint (published kimi_linear names, bf16, 4 GiB shards) into a
temporary directory, converts it with `dayzero-convert`, then loads each form with `load_checkpoint` in a fresh
subprocess per run, measuring the load time (until every param is on the device), the XLA compile time within it
(the jitted transposes, casts and dequantisation; none persisted between runs) and the process's peak host memory
(VmHWM, the RSS high-water mark, and the RSS after JAX started, before loading). The conversion is measured the same
way. Prints a table and appends one dated line to the results file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

from dayzero.kernels.mxfp4 import random_scale_centre
from dayzero.model import checkpoint
from dayzero.model.checkpoint import EXPERT_PARAMS, map_tensor_name, published_name, quantize_fp8_blocks
from dayzero.model.config import LAYER_KDA, MLP_MOE, ModelConfig
from dayzero.model.presets import PRESETS, get_preset
from dayzero.model.quantize import _ShardWriter

from results import append_line, git_commit  # benchmarks/results.py: a script's own folder is on sys.path


def memory_status() -> dict[str, int]:
    """VmRSS and VmHWM (bytes) of this process, from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def hub_config(config: ModelConfig, dtype: str) -> dict:
    """The published-style config.json of a kimi_linear preset (checked to parse back to the same config)."""
    if config.model_type != "kimi_linear" or config.vision is not None:
        raise ValueError(f"only kimi_linear presets are written (got {config.model_type})")
    raw = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "dtype": dtype,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_heads,
        "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": config.tie_word_embeddings,
        "q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim, "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim, "mla_use_nope": not config.mla_use_rope, "rope_theta": config.rope.theta,
        "layer_types": ["linear_attention" if t == LAYER_KDA else "full_attention" for t in config.layer_types],
        "mlp_layer_types": ["sparse" if t == MLP_MOE else "dense" for t in config.mlp_types],
        "linear_attn_config": {"num_heads": config.kda_num_heads, "head_dim": config.kda_head_dim,
                               "short_conv_kernel_size": config.kda_conv_size},
        "num_experts": config.num_experts, "num_experts_per_token": config.num_experts_per_token,
        "moe_intermediate_size": config.moe_intermediate_size, "num_shared_experts": config.num_shared_experts,
        "routed_scaling_factor": config.routed_scaling_factor, "n_group": config.n_group,
        "topk_group": config.topk_group, "moe_router_activation_func": config.router_activation,
        "moe_renormalize": config.renormalize, "index_n_heads": config.index_n_heads,
        "index_head_dim": config.index_head_dim, "index_topk": config.index_topk,
        "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids),
        "pad_token_id": config.pad_token_id, "model_max_length": config.max_position_embeddings,
    }
    if config.quant_method == "fp8":
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                      "weight_block_size": list(config.weight_block_size)}
    elif config.quant_method is not None:
        raw["quantization_config"] = {"quant_method": config.quant_method}
    parsed = ModelConfig.from_hf_dict(raw)
    if parsed != config.replace(checkpoint_dtype=dtype):
        raise AssertionError(f"the written config does not parse back to the preset: {parsed}")
    return raw


def _random_tensor(rng, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    if name.endswith("_blocks"):
        return rng.integers(0, 256, shape, dtype=np.uint8)
    if name.endswith("_scales"):
        centre = random_scale_centre(0.02)
        return rng.integers(centre - 1, centre + 2, shape).astype(np.uint8)
    if name.endswith("A_log"):
        return np.log(rng.uniform(1, 16, shape)).astype(np.float32)
    if name.endswith(("dt_bias", "bias")):
        return np.zeros(shape, np.float32)
    if name.endswith("weight") and len(shape) == 1:
        return np.ones(shape, dtype)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)


def write_hub_checkpoint(config: ModelConfig, directory: str, dtype: str = "bfloat16", seed: int = 0,
                         shard_bytes: int = 4 << 30) -> int:
    """Writes random weights of `config` as a hub checkpoint (published names, [out, in] linears, one tensor per
    expert or packed MXFP4 experts; with `config.quant_method` "fp8", every 2-D projection as e4m3 with its block
    scales), one tensor at a time; returns the bytes written."""
    from dayzero.model.model import expected_params

    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hub_config(config, dtype), f, indent=2)
    rng = np.random.default_rng(seed)
    writer = _ShardWriter(directory, shard_bytes)
    total = 0
    for path, leaf in expected_params(config, np_dtype).items():
        name = published_name(path, config)
        names = [name]
        if len(path) >= 2 and path[-2] == "experts" and path[-1] in EXPERT_PARAMS:
            names = [name.replace(".N.", f".{e}.") for e in range(leaf.shape[0])]
        for tensor in names:
            target = map_tensor_name(tensor, config)
            if target is None or target.path != path:
                raise AssertionError(f"'{tensor}' does not map back to {path}")
            shape = tuple(leaf.shape[1:] if target.kind == "expert" else leaf.shape)
            if target.kind in ("linear", "expert"):
                shape = shape[::-1]
            elif target.kind == "conv":
                shape = (shape[0], 1, shape[1])
            if config.quant_method == "fp8" and target.kind in ("linear", "expert") and tensor.endswith("_proj.weight"):
                array, scale = quantize_fp8_blocks(_random_tensor(rng, tensor, shape, np.float32),
                                                   config.weight_block_size)
                total += scale.nbytes
                writer.add(tensor + "_scale_inv", scale)
            else:
                array = _random_tensor(rng, tensor, shape, leaf.dtype if leaf.dtype == np.float32 else np_dtype)
            total += array.nbytes
            writer.add(tensor, array)
    writer.close()
    return total


_WORKER = """
import json, os, sys, time
sys.path.insert(0, {bench!r})
from load import memory_status
import jax
kind, path, dtype, out, item_bytes, load_workers = sys.argv[1:7]
if load_workers:
    import dayzero.model.checkpoint
    dayzero.model.checkpoint.LOAD_WORKERS = int(load_workers)
device = jax.devices()[0]
compiles = []  # XLA backend compile durations (s) during the load: the jitted transposes, casts, dequantisation
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: compiles.append(seconds) if "backend_compile" in event else None)
before = memory_status()["VmRSS"]
start = time.perf_counter()
if kind == "convert":
    from dayzero.model.convert import convert_checkpoint
    convert_checkpoint(path, out, dtype, int(item_bytes), progress=False)
else:
    from dayzero.model import load_checkpoint
    model = load_checkpoint(path, dtype=dtype, progress=False)
    jax.block_until_ready(model.params)
seconds = time.perf_counter() - start
mem = memory_status()
print("RESULT " + json.dumps({{"seconds": seconds, "peak_rss": mem["VmHWM"], "rss_before": before,
                             "device": device.device_kind, "platform": device.platform,
                             "compiles": len(compiles), "compile_seconds": sum(compiles)}}))
"""


def run_worker(kind: str, path: str, dtype: str, out: str = "", item_bytes: int = 0,
               load_workers: int | None = None) -> dict:
    """Runs one load (or the conversion) in a fresh Python process; returns its measurements. `load_workers`:
    `model.checkpoint.LOAD_WORKERS` for the load (None: the module's default)."""
    script = _WORKER.format(bench=os.path.dirname(os.path.abspath(__file__)))
    workers = "" if load_workers is None else str(load_workers)
    proc = subprocess.run([sys.executable, "-c", script, kind, path, dtype, out, str(item_bytes), workers],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="medium_hybrid", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, help="keep only the first N layers (smaller runs)")
    parser.add_argument("--dtype", default="bfloat16", help="hub, converted and loaded param dtype")
    parser.add_argument("--fp8", action="store_true",
                        help="projections written as e4m3 with 128x128 block scales (DeepSeek V3 / Kimi K2's format)")
    parser.add_argument("--item-gib", type=float, default=1.0, help="dayzero-convert's orbax item size")
    parser.add_argument("--repeat", type=int, default=1, help="loads per method (the fastest is reported)")
    parser.add_argument("--load-workers", type=int,
                        help="model.checkpoint.LOAD_WORKERS for the hub load (threads placing params while the next "
                             "are read; 0: none; default: the module's)")
    parser.add_argument("--workdir", help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    parser.add_argument("--label", default="", help="added to the results line (e.g. 'CPU check run')")
    parser.add_argument("--no-append", action="store_true", help="print only; do not append to the results file")
    args = parser.parse_args(argv)
    config = get_preset(args.preset)
    if args.layers:
        n = args.layers
        config = config.replace(num_layers=n, layer_types=config.layer_types[:n], mlp_types=config.mlp_types[:n])
    if args.fp8:
        config = config.replace(quant_method="fp8", weight_block_size=(128, 128))
    with tempfile.TemporaryDirectory(dir=args.workdir) as root:
        hub, conv = os.path.join(root, "hub"), os.path.join(root, "converted")
        start = time.perf_counter()
        nbytes = write_hub_checkpoint(config, hub, args.dtype)
        print(f"{args.preset}{f' ({args.layers} layers)' if args.layers else ''}: wrote {nbytes / 1e9:.2f} GB of "
              f"random weights in {time.perf_counter() - start:.1f} s")
        convert = run_worker("convert", hub, args.dtype, conv, int(args.item_gib * 2**30))
        runs = {"hub": [], "converted": []}
        for _ in range(args.repeat):
            for kind, path in (("hub", hub), ("converted", conv)):
                runs[kind].append(run_worker(kind, path, args.dtype, load_workers=args.load_workers))
        sizes = {"hub": dir_bytes(hub), "converted": dir_bytes(conv)}
    device = runs["hub"][0]
    res = {"convert_s": round(convert["seconds"], 2), "convert_peak_rss_GB": round(convert["peak_rss"] / 1e9, 3),
           "convert_item_GiB": args.item_gib, "convert_compile_s": round(convert["compile_seconds"], 2)}
    print("\n| method | load s | of which XLA compiles s (count) | peak RSS GB | RSS before load GB | on disk GB |\n"
          "|---|---|---|---|---|---|")
    print(f"| dayzero-convert (once) | {convert['seconds']:.2f} | {convert['compile_seconds']:.2f} "
          f"({convert['compiles']}) | {convert['peak_rss'] / 1e9:.3f} | {convert['rss_before'] / 1e9:.3f} | "
          f"{sizes['converted'] / 1e9:.3f} |")
    for kind in ("hub", "converted"):
        best = min(runs[kind], key=lambda r: r["seconds"])
        peak = max(r["peak_rss"] for r in runs[kind])
        res[f"{kind}_load_s"] = round(best["seconds"], 2)
        res[f"{kind}_peak_rss_GB"] = round(peak / 1e9, 3)
        res[f"{kind}_rss_before_GB"] = round(best["rss_before"] / 1e9, 3)
        res[f"{kind}_compiles"] = best["compiles"]
        res[f"{kind}_compile_s"] = round(best["compile_seconds"], 2)
        print(f"| {kind} ({'safetensors stream' if kind == 'hub' else 'orbax restore'}) | {best['seconds']:.2f} | "
              f"{best['compile_seconds']:.2f} ({best['compiles']}) | {peak / 1e9:.3f} | "
              f"{best['rss_before'] / 1e9:.3f} | {sizes[kind] / 1e9:.3f} |")
    res["params_GB"] = round(nbytes / 1e9, 3)
    res["hub_load_workers"] = checkpoint.LOAD_WORKERS if args.load_workers is None else args.load_workers
    hardware = f"{device['device']} ({device['platform']})"
    from importlib.metadata import version

    import jax

    label = f" {args.label}" if args.label else ""
    line = (f"- {datetime.date.today()} load.py{label}, {hardware}, commit {git_commit()}, jax {jax.__version__}, "
            f"orbax-checkpoint {version('orbax-checkpoint')}: preset {args.preset}"
            f"{f' ({args.layers} layers)' if args.layers else ''}"
            f"{' FP8 e4m3 projections (128x128 blocks),' if args.fp8 else ''} {args.dtype}, each load in a fresh "
            "process "
            f"(files just written, so in the page cache): {json.dumps(res)}\n")
    if args.no_append:
        print(line)
    else:
        append_line(args.results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
