"""`dayzero-convert`: a hub checkpoint directory -> dayzero's params pytree saved with orbax-checkpoint, restored later
straight onto a mesh (each device reading only its shards).

The converted directory holds exactly the params `load_checkpoint` builds from the hub files (FP8 weights
dequantized, MXFP4 experts kept packed, published names mapped, linear weights transposed, experts stacked), in one
dtype, plus everything needed to serve it:

    config.json                  the hub config, its declared dtype (`dtype`/`torch_dtype`) set to the stored one
    tokenizer*, generation_config.json, preprocessor_config.json, ...   copied unchanged (every other plain file)
    dayzero_params/00000/ ...    orbax PyTree checkpoints ("items"), each a consecutive group of whole params,
                                 stored in chunks of at most 16 MiB (routed experts cut by expert first)
    dayzero_checkpoint.json      written last: format, version, dtype, and every item's params (shape, dtype)

Streaming: params are read one at a time from the hub files (`checkpoint.stream_params`) and saved as soon as the
pending group reaches `item_bytes` (default 1 GiB), so the host holds one item (at most `item_bytes` + the largest
single param, i.e. one stacked expert projection) plus one source tensor, never the whole model. Orbax/tensorstore
stage and compress a copy while writing: measured on CPU (jax 0.10.2, orbax 0.12.8, medium_hybrid cut to 4 layers,
2.3 GB) the process peaks at 2.5-3.5x the largest item above its baseline (0.25 GiB items: +1.6 GB; 1 GiB: +3.3 GB;
one 2.3 GB item: +5.5 GB). An interrupted conversion leaves no marker; restoring it raises CheckpointError.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from tqdm.auto import tqdm

from . import linear
from .checkpoint import ParamPath, published_name, stream_params
from .config import ModelConfig
from .errors import CheckpointError, DayzeroError
from .safetensors_io import copy_side_files

FORMAT = "dayzero-orbax"
FORMAT_VERSION = 1
MARKER = "dayzero_checkpoint.json"
PARAMS_DIR = "dayzero_params"
DEFAULT_ITEM_BYTES = 1 << 30
CHUNK_BYTES = 16 << 20  # storage chunks: a device restoring its shard reads only the chunks it overlaps


@dataclass(frozen=True)
class ConvertReport:
    """What a conversion wrote: params, their bytes, orbax items, the stored dtype and the wall time."""

    params: int
    nbytes: int
    items: int
    dtype: str
    seconds: float

    def format(self) -> str:
        return (f"{self.params} params, {self.nbytes / 2**30:.3f} GiB in {self.items} orbax item(s), "
                f"dtype {self.dtype}, {self.seconds:.1f} s")


def _orbax():
    """orbax.checkpoint, imported where a conversion or restore needs it (it adds ~0.2 s to `import dayzero`)."""
    import orbax.checkpoint

    return orbax.checkpoint


def _key(path: ParamPath) -> str:
    return "/".join(path)


def _checkpointer():
    ocp = _orbax()
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler())


def _save_args(path: ParamPath):
    """Chunks of at most CHUNK_BYTES; routed experts ([E, ...]) are cut along the expert dim first, so an expert
    shard's chunks hold its experts only (`shard_axes`, where this orbax has it)."""
    ocp = _orbax()
    if path[-2:-1] == ("experts",) and "shard_axes" in {f.name for f in dataclasses.fields(ocp.SaveArgs)}:
        return ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES, shard_axes=(0,))
    return ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES)


def _declare_dtype(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """The hub config with every declared dtype (top level and a kimi_k25 text_config) set to `name`."""
    raw = dict(raw)
    keys = [k for k in ("dtype", "torch_dtype") if k in raw] or ["dtype"]
    raw.update({k: name for k in keys})
    if isinstance(raw.get("text_config"), dict):
        text = dict(raw["text_config"])
        text.update({k: name for k in ("dtype", "torch_dtype") if k in text})
        raw["text_config"] = text
    return raw


def is_converted(path: str | os.PathLike) -> bool:
    """Whether `path` is (or was being written as) a checkpoint converted by `dayzero-convert`."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, MARKER)) or os.path.isdir(os.path.join(path, PARAMS_DIR))


def convert_checkpoint(source: str | os.PathLike, out: str | os.PathLike, dtype: Any = None,
                       item_bytes: int = DEFAULT_ITEM_BYTES, progress: bool | None = None) -> ConvertReport:
    """Converts hub checkpoint `source` into directory `out` (created; must not hold a checkpoint) with params of
    `dtype` (default: what `load_checkpoint(source)` picks). See the module docstring for the layout."""
    from .model import expected_params, resolve_dtype

    source, out = os.fspath(source), os.fspath(out)
    start = time.perf_counter()
    config = ModelConfig.from_pretrained(source)
    dtype = resolve_dtype(dtype, config)
    with open(os.path.join(source, "config.json")) as f:
        raw = _declare_dtype(json.load(f), dtype.name)
    if resolve_dtype(None, ModelConfig.from_hf_dict(raw)) != dtype:  # load_checkpoint's default must be it
        raise CheckpointError(f"{source}: cannot declare dtype {dtype.name} in the converted config.json")
    if os.path.exists(os.path.join(out, "config.json")) or is_converted(out):
        raise CheckpointError(f"{out}: already holds a checkpoint; choose an empty directory")
    os.makedirs(os.path.join(out, PARAMS_DIR))
    expected = expected_params(config, dtype)
    ocp = _orbax()
    checkpointer = _checkpointer()
    items: list[dict[str, Any]] = []
    pending: dict[ParamPath, np.ndarray] = {}
    total = 0

    def flush():
        name = f"{len(items):05d}"
        tree = traverse_util.unflatten_dict(pending)
        save_args = traverse_util.unflatten_dict({p: _save_args(p) for p in pending})
        checkpointer.save(os.path.join(os.path.abspath(out), PARAMS_DIR, name),
                          args=ocp.args.PyTreeSave(tree, save_args=save_args))
        items.append({"dir": name, "params": {_key(p): {"shape": list(a.shape), "dtype": a.dtype.name}
                                              for p, a in pending.items()}})
        pending.clear()

    for path, host in stream_params(source, config, expected, progress, desc="converting"):
        pending[path] = host
        total += host.nbytes
        del host
        if sum(a.nbytes for a in pending.values()) >= item_bytes:
            flush()
    if pending:
        flush()
    copy_side_files(source, out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    marker = {"format": FORMAT, "version": FORMAT_VERSION, "dtype": dtype.name, "model_type": config.model_type,
              "source_dtype": config.checkpoint_dtype, "quant_method": config.quant_method, "nbytes": total,
              "weight_rows": linear.WEIGHT_ROWS, "items": items}
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump(marker, f, indent=1)
    return ConvertReport(len(expected), total, len(items), dtype.name, time.perf_counter() - start)


def read_marker(path: str | os.PathLike) -> dict[str, Any]:
    """The converted checkpoint's metadata; CheckpointError when absent, unreadable or of another format."""
    path = os.fspath(path)
    file = os.path.join(path, MARKER)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: not a complete converted checkpoint: {MARKER} is missing "
                              f"(was dayzero-convert interrupted?)")
    try:
        with open(file) as f:
            marker = json.load(f)
        ok = marker.get("format") == FORMAT and isinstance(marker.get("items"), list) and "dtype" in marker
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{file}: unreadable converted-checkpoint metadata: {e}") from None
    if not ok:
        raise CheckpointError(f"{file}: not {FORMAT} metadata (format, dtype and items are required)")
    if marker.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: format version {marker.get('version')!r}; this dayzero reads version "
                              f"{FORMAT_VERSION} (convert the hub checkpoint again)")
    return marker


def _check_against_config(path: str, marker: dict[str, Any], config: ModelConfig,
                          stored: dict[ParamPath, jax.ShapeDtypeStruct]) -> None:
    """Every problem between the stored params (per the marker) and the config's params, raised together."""
    stored_rows = bool(marker.get("weight_rows", False))
    if stored_rows != linear.WEIGHT_ROWS:
        layouts = {True: "[out, in]", False: "[in, out]"}
        raise CheckpointError(f"{path}: the attention projections are stored {layouts[stored_rows]}; this process "
                              f"builds them {layouts[linear.WEIGHT_ROWS]} (model.linear.WEIGHT_ROWS = "
                              f"{linear.WEIGHT_ROWS}): set it as it was at conversion, or convert the hub checkpoint "
                              "again")
    listed: dict[str, dict] = {}
    for item in marker["items"]:
        listed.update(item.get("params", {}))
    want = {_key(p): s for p, s in stored.items()}
    problems = [f"missing tensor '{k}' ({published_name(tuple(k.split('/')), config)}) {list(s.shape)}"
                for k, s in want.items() if k not in listed]
    problems += [f"unexpected tensor '{k}' {info.get('shape')} ({info.get('dtype')})"
                 for k, info in listed.items() if k not in want]
    for k, info in listed.items():
        if k not in want:
            continue
        if tuple(info.get("shape", ())) != tuple(want[k].shape):
            problems.append(f"shape mismatch: '{k}' is stored as {info.get('shape')}, the config expects "
                            f"{list(want[k].shape)}")
        elif info.get("dtype") != jnp.dtype(want[k].dtype).name:
            problems.append(f"dtype mismatch: '{k}' is stored as {info.get('dtype')}, a {marker['dtype']} "
                            f"checkpoint of this config holds {jnp.dtype(want[k].dtype).name}")
    if problems:
        raise CheckpointError(f"{path}: the converted checkpoint does not match its {config.model_type} config "
                              f"({len(problems)} problem(s))", problems)


def _default_sharding() -> jax.sharding.Sharding:
    """The default device in effect (jax.default_device included), as a sharding."""
    return jax.sharding.SingleDeviceSharding(next(iter(jnp.zeros((), jnp.int8).devices())))


def restore_converted(path: str | os.PathLike, config: ModelConfig, dtype: Any = None,
                      sharding_for: Callable[[ParamPath], jax.sharding.Sharding | None] | None = None,
                      progress: bool | None = None) -> dict[ParamPath, jax.Array]:
    """Restores a converted checkpoint's params, keyed by param path, each placed by `sharding_for(path)` (None or
    a None result: the default device) as orbax reads it, so every device reads only its own shards. `dtype`
    (default: the stored one) casts floating params on restore. Raises CheckpointError naming the directory and
    tensors when the checkpoint is incomplete, corrupt, or does not match `config`."""
    from .model import expected_params

    path = os.fspath(path)
    marker = read_marker(path)
    stored_dtype = jnp.dtype(marker["dtype"])
    dtype = stored_dtype if dtype is None else jnp.dtype(dtype)
    stored = expected_params(config, stored_dtype)
    _check_against_config(path, marker, config, stored)
    target = stored if dtype == stored_dtype else expected_params(config, dtype)
    default = None
    ocp = _orbax()
    checkpointer = _checkpointer()
    params: dict[ParamPath, jax.Array] = {}
    for item in tqdm(marker["items"], unit="item", desc="restoring", leave=False,
                     disable=True if progress is False else None):
        item_dir = os.path.join(os.path.abspath(path), PARAMS_DIR, str(item["dir"]))
        paths = [tuple(k.split("/")) for k in item["params"]]
        args = {}
        for p in paths:
            sharding = sharding_for(p) if sharding_for is not None else None
            if sharding is None:
                default = default or _default_sharding()
                sharding = default
            cast = target[p].dtype if target[p].dtype != stored[p].dtype else None
            args[p] = ocp.ArrayRestoreArgs(sharding=sharding, dtype=cast)
        names = ", ".join(_key(p) for p in paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
        if not os.path.isdir(item_dir):
            raise CheckpointError(f"{path}: item directory {item_dir} is missing (tensors {names})")
        try:
            restored = checkpointer.restore(
                item_dir, args=ocp.args.PyTreeRestore(restore_args=traverse_util.unflatten_dict(args)))
            flat = traverse_util.flatten_dict(restored)
        except Exception as e:  # orbax/tensorstore raise many types for unreadable or corrupt data
            raise CheckpointError(f"{path}: cannot restore {item_dir} (tensors {names}): "
                                  f"{type(e).__name__}: {e}") from None
        for p in paths:
            array = flat.get(p)
            want = target[p]
            if array is None or tuple(array.shape) != tuple(want.shape) or array.dtype != want.dtype:
                got = "absent" if array is None else f"{array.dtype}{list(array.shape)}"
                raise CheckpointError(f"{path}: {item_dir} holds tensor '{_key(p)}' as {got}, expected "
                                      f"{jnp.dtype(want.dtype).name}{list(want.shape)}")
            params[p] = array
    return {p: params[p] for p in target}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dayzero-convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="hub checkpoint directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="output directory (created) for the converted checkpoint")
    parser.add_argument("--dtype", default=None, help="stored param dtype: bfloat16, float16 or float32 (default: "
                        "the checkpoint's; bfloat16 for FP8 checkpoints)")
    parser.add_argument("--item-gib", type=float, default=DEFAULT_ITEM_BYTES / 2**30,
                        help="params are saved in orbax items of about this many GiB (bounds host memory)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        report = convert_checkpoint(args.model, args.out, args.dtype, int(args.item_gib * 2**30),
                                    progress=False if args.quiet else None)
    except DayzeroError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {report.format()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
