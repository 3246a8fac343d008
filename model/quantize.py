"""`dayzero-quantize`: a bf16 (or f16/f32) kimi_linear or deepseek checkpoint -> the same checkpoint with its routed
experts in MXFP4, which dayzero loads back packed.

Every other tensor is copied unchanged (name, dtype, bytes). Per MoE layer and projection, the experts' [out, in]
weights are quantized one expert at a time (`dayzero.kernels.mxfp4.quantize`: OCP scale choice, round to nearest
even) and written stacked, gpt-oss style, under the source's block prefix (`mlp` or Kimi's `block_sparse_moe`):
`<prefix>.experts.{gate,up,down}_proj_blocks` uint8 [E, out, ceil(in/32), 16] and `..._scales` uint8
[E, out, ceil(in/32)]. config.json gains `quantization_config: {"quant_method": "mxfp4"}`; other files (tokenizer,
generation config) are copied. Host memory stays near one projection's packed experts plus one output shard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.kernels import mxfp4

from .checkpoint import map_tensor_name, plan_load
from .config import MLP_MOE, ModelConfig
from .errors import CheckpointError, ConfigError, DayzeroError
from .model import expected_params
from .safetensors_io import INDEX, copy_side_files, open_checkpoint_files, save_file

CANONICAL = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


@dataclass
class QuantizeReport:
    """What a conversion did: experts and bytes converted, and the relative RMS error per projection
    (||dequantize(quantize(w)) - w|| / ||w|| over all experts)."""

    experts: int = 0
    source_bytes: int = 0
    packed_bytes: int = 0
    rel_rms_error: dict[str, float] = field(default_factory=dict)

    def format(self) -> str:
        errors = ", ".join(f"{k} {v:.4f}" for k, v in self.rel_rms_error.items())
        return (f"{self.experts} expert weights quantized: {self.source_bytes / 2**20:.3f} MiB -> "
                f"{self.packed_bytes / 2**20:.3f} MiB; relative RMS error {errors}")


class _ShardWriter:
    """Writes tensors into shards of about `shard_bytes`, then the index (or one model.safetensors)."""

    def __init__(self, directory: str, shard_bytes: int):
        self.directory, self.shard_bytes = directory, shard_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.files: list[list[str]] = []

    def add(self, name: str, array: np.ndarray) -> None:
        self.pending[name] = array
        if sum(a.nbytes for a in self.pending.values()) >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            save_file(os.path.join(self.directory, f"model-{len(self.files) + 1:05d}.safetensors"), self.pending)
            self.files.append(list(self.pending))
            self.pending = {}

    def close(self) -> None:
        self._flush()
        names = [f"model-{i + 1:05d}.safetensors" for i in range(len(self.files))]
        if len(names) == 1:
            os.replace(os.path.join(self.directory, names[0]), os.path.join(self.directory, "model.safetensors"))
            return
        total = sum(os.path.getsize(os.path.join(self.directory, n)) for n in names)
        weight_map = {t: n for n, tensors in zip(names, self.files) for t in tensors}
        with open(os.path.join(self.directory, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


@jax.jit
def _quantize_one(w):
    blocks, scales = mxfp4.quantize(w)
    err = mxfp4.dequantize(blocks, scales, jnp.float32)[..., :w.shape[-1]] - w
    return blocks, scales, jnp.sum(err * err), jnp.sum(w * w)


def quantize_checkpoint(source: str, out: str, shard_bytes: int = 4 << 30) -> QuantizeReport:
    """Writes the MXFP4 version of checkpoint `source` to directory `out` (created; must not hold a checkpoint)."""
    config = ModelConfig.from_pretrained(source)  # ConfigError when config.json is absent or invalid
    with open(os.path.join(source, "config.json")) as f:
        raw = json.load(f)
    if config.quant_method is not None:
        raise ConfigError("quantization_config.quant_method", f"the checkpoint is already quantized "
                          f"({config.quant_method!r}); dayzero-quantize needs bf16, f16 or f32 weights")
    if MLP_MOE not in config.mlp_types:
        raise ConfigError("mlp_layer_types", "the model has no MoE layer: there are no routed experts to quantize")
    quantized = config.replace(quant_method="mxfp4")  # validates what MXFP4 needs (an even expert width)
    files = open_checkpoint_files(source)
    plan = plan_load(files, expected_params(config, jnp.float32), config)
    if plan.problems:
        raise CheckpointError(f"{source}: the checkpoint does not match the {config.model_type} model", plan.problems)
    if os.path.exists(os.path.join(out, "config.json")):
        raise CheckpointError(f"{out}: already holds a checkpoint; choose an empty directory")
    os.makedirs(out, exist_ok=True)
    writer = _ShardWriter(out, shard_bytes)
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for name in sorted(files):
        target = map_tensor_name(name, config)
        if target is not None and target.kind == "expert":
            prefix = name[:name.index(".experts.")]
            groups.setdefault((prefix, target.path[-1]), {})[target.expert] = name
        else:
            writer.add(name, files[name].read(name))
    report = QuantizeReport()
    sums: dict[str, list[float]] = {}
    for (prefix, proj), experts in sorted(groups.items()):
        blocks, scales = [], []
        for e in range(quantized.num_experts):
            w = files[experts[e]].read(experts[e])
            b, s, err, ref = _quantize_one(jnp.asarray(w, jnp.float32))
            blocks.append(np.asarray(b))
            scales.append(np.asarray(s))
            acc = sums.setdefault(CANONICAL[proj], [0.0, 0.0])
            acc[0] += float(err)
            acc[1] += float(ref)
            report.source_bytes += w.nbytes
        report.experts += len(experts)
        stacked_b, stacked_s = np.stack(blocks), np.stack(scales)
        report.packed_bytes += stacked_b.nbytes + stacked_s.nbytes
        writer.add(f"{prefix}.experts.{CANONICAL[proj]}_blocks", stacked_b)
        writer.add(f"{prefix}.experts.{CANONICAL[proj]}_scales", stacked_s)
    writer.close()
    report.rel_rms_error = {k: float(np.sqrt(e / max(r, 1e-30))) for k, (e, r) in sorted(sums.items())}
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    copy_side_files(source, out)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dayzero-quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="source checkpoint directory (bf16/f16/f32 weights)")
    parser.add_argument("--out", required=True, help="output directory for the MXFP4 checkpoint")
    parser.add_argument("--shard-gib", type=float, default=4.0, help="approximate shard size in GiB")
    args = parser.parse_args(argv)
    try:
        report = quantize_checkpoint(args.model, args.out, int(args.shard_gib * 2**30))
    except DayzeroError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {report.format()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
