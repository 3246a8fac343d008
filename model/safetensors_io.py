"""Reading safetensors files tensor by tensor, float8 included.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data_offsets) and the
data. We read it through numpy memory maps because the `safetensors` package's numpy backend cannot return float8
tensors (DeepSeek's e4m3 weights); only the tensor asked for is copied into memory. Every structural problem
(unreadable header, offsets past the end of a truncated file, sizes that disagree with shapes) is a CheckpointError
naming the file and tensor.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .errors import CheckpointError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype name (safetensors spelling), shape, byte range in the data section."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """One .safetensors file: `tensors` maps names to TensorInfo; `read(name)` returns a numpy array copy (or fills
    one given)."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{path}: truncated or not a safetensors file (shorter than 8 bytes)")
                header_len = int.from_bytes(head, "little")
                if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                    raise CheckpointError(f"{path}: corrupt or truncated safetensors header "
                                          f"(declares {header_len} header bytes, file has {size} bytes)")
                raw = f.read(header_len)
        except OSError as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{path}: cannot read: {e}") from None
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + header_len
        data_size = size - self.data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            try:
                dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: corrupt header entry for tensor '{name}'") from None
            if dtype not in DTYPES:
                raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {dtype}")
            expected = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
            if end - begin != expected or begin < 0:
                raise CheckpointError(f"{path}: tensor '{name}' spans {end - begin} bytes, its shape {list(shape)} "
                                      f"of {dtype} needs {expected}")
            if end > data_size:
                raise CheckpointError(f"{path}: truncated: tensor '{name}' ends at byte {end} of the data section, "
                                      f"which has only {data_size} bytes")
            self.tensors[name] = TensorInfo(name, path, dtype, shape, begin, end)

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """Tensor `name` as a new array, or copied (and cast) into `out` of its shape, which is returned."""
        info = self.tensors[name]
        dtype = DTYPES[info.dtype]
        count = (info.end - info.begin) // dtype.itemsize
        if count == 0:
            if out is None:
                return np.zeros(info.shape, dtype)
            out[...] = 0
            return out
        try:
            mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_start + info.begin,
                           shape=(info.end - info.begin,))
            if out is None:
                return np.array(mm).view(dtype).reshape(info.shape)
            np.copyto(out, mm.view(dtype).reshape(info.shape), casting="unsafe")
            return out
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.path}: cannot read tensor '{name}': {e}") from None


def save_file(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes `tensors` (any dtype of DTYPES, bfloat16 and float8 included) as one safetensors file."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        if array.dtype not in names:
            raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {array.dtype}")
        header[name] = {"dtype": names[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for array in arrays:
            f.write(array.tobytes())


INDEX = "model.safetensors.index.json"


def copy_side_files(source: str, out: str) -> None:
    """Copies a checkpoint directory's other files (tokenizer, generation config, processor, ...) into `out`: every
    regular file but the safetensors weights, their index and config.json (which a converter writes itself)."""
    for entry in sorted(os.listdir(source)):
        path = os.path.join(source, entry)
        if os.path.isfile(path) and not entry.endswith(".safetensors") and entry not in (INDEX, "config.json"):
            shutil.copy2(path, os.path.join(out, entry))


def open_checkpoint_files(directory: str) -> dict[str, SafetensorsFile]:
    """Opens `model.safetensors`, or every shard named by `model.safetensors.index.json`. Returns name -> file."""
    index_path = os.path.join(directory, INDEX)
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index_path}: unreadable shard index: {e}") from None
        shard_names = sorted(set(weight_map.values()))
        missing = [s for s in shard_names if not os.path.isfile(os.path.join(directory, s))]
        if missing:
            raise CheckpointError(f"{index_path}: shard files are missing", [f"missing file: {m}" for m in missing])
        shards = {s: SafetensorsFile(os.path.join(directory, s)) for s in shard_names}
        where: dict[str, SafetensorsFile] = {}
        problems = []
        for name, shard in weight_map.items():
            if name not in shards[shard].tensors:
                problems.append(f"tensor '{name}': the index places it in {shard}, which does not hold it")
            else:
                where[name] = shards[shard]
        if problems:
            raise CheckpointError(f"{index_path}: index and shards disagree", problems)
        return where
    if os.path.isfile(single):
        f = SafetensorsFile(single)
        return {name: f for name in f.tensors}
    raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")
