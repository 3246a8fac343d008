"""Loading hub checkpoints (safetensors, single file or sharded) into dayzero's params pytree.

Two passes. The first reads only headers: every tensor name is mapped to a param (published names of kimi_linear,
deepseek_v3/v32 and kimi_k2), and missing, unexpected, shape- or dtype-mismatched tensors are collected and raised
together as one CheckpointError. The second streams tensors one at a time (FP8 e4m3 weights dequantized with their
128x128 `weight_scale_inv` blocks, experts stacked per projection) and places each on the device(s) as soon as it is
read, in a few worker threads (`LOAD_WORKERS`), so host memory stays near that many tensors (stacked expert
projections at most); linear and expert weights travel as published ([out, in], FP8 ones as float8 bytes with their
scales) and are dequantized, transposed to [in, out] and cast to their param dtype on the device (`load_params`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextvars
import functools
import re
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from . import linear
from .config import ModelConfig
from .errors import CheckpointError
from .sharding import place
from .safetensors_io import DTYPES, SafetensorsFile, TensorInfo, open_checkpoint_files
from .vision import vision_published_name, vision_tensor_target

ParamPath = tuple[str, ...]

LINEAR_MODULES = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
    "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "wq_b", "wk", "weights_proj",
    "gate_proj", "up_proj", "down_proj",
})
EXPERT_PROJECTIONS = {"gate_proj": "w_gate", "w1": "w_gate", "up_proj": "w_up", "w3": "w_up",
                      "down_proj": "w_down", "w2": "w_down"}
FLOAT_SOURCES = frozenset({"F64", "F32", "F16", "BF16"})
FP8_SOURCES = frozenset({"F8_E4M3", "F8_E5M2"})
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(\w+)\.weight")
_PACKED = re.compile(r"mlp\.experts\.(\w+?)_(blocks|scales)")  # MXFP4 experts, gpt-oss style, stacked [E, ...]
EXPERT_PARAMS = frozenset(EXPERT_PROJECTIONS.values())


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes. kind: copy | linear (transpose) | rows (a projection kept [out, in]:
    `model.linear.WEIGHT_ROWS`; FP8 and packed integer ones dequantized) | conv ([C,1,W] -> [C,W]) | flat (reshape)
    | expert (transpose into slot `expert` of a stacked [E, ...] param) | patch (Conv2d [D,C,p,p] -> [C*p*p, D])
    | packed (MXFP4 expert blocks/scales, uint8, copied as stored)."""

    path: ParamPath
    kind: str
    expert: int = -1


IGNORE = Target((), "ignore")
_SHAPE_HINTS = {"linear": " (after transposing [out, in] to [in, out])",
                "rows": " (kept [out, in]: model.linear.WEIGHT_ROWS)",
                "expert": " (after transposing [out, in] to [in, out])",
                "patch": " (after flattening [out, C, p, p] and transposing to [C*p*p, out])",
                "packed": " (MXFP4: blocks [experts, out, ceil(in/32), 16], scales [experts, out, ceil(in/32)])"}


def map_tensor_name(name: str, config: ModelConfig) -> Target | None:
    """Maps a published tensor name to its param, IGNORE for tensors dayzero deliberately skips (DeepSeek's MTP
    layers, tied lm_head copies, rotary buffers), or None when the name is not part of the architecture.
    kimi_k25 prefixes the text model with `language_model.` and adds `vision_tower.*` and `mm_projector.*`."""
    if config.vision is not None:
        if name.startswith(("vision_tower.", "mm_projector.")):
            found = vision_tensor_target(name)
            return None if found is None else Target(*found)
        if not name.startswith("language_model."):
            return None
        name = name[len("language_model."):]
    if name == "lm_head.weight":
        return IGNORE if config.tie_word_embeddings else Target(("lm_head",), "linear")
    if name == "model.embed_tokens.weight":
        return Target(("embed_tokens",), "copy")
    if name == "model.norm.weight":
        return Target(("norm", "weight"), "copy")
    if name.endswith("rotary_emb.inv_freq"):
        return IGNORE
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    index, sub = int(m[1]), m[2]
    if index >= config.num_layers:
        return IGNORE if index < config.num_layers + config.num_mtp_layers else None
    layer = f"layers_{index}"
    if sub.startswith("block_sparse_moe."):  # Kimi's published name for the MLP / MoE block
        sub = "mlp." + sub[len("block_sparse_moe."):]
    m = _EXPERT.fullmatch(sub)
    if m is not None:
        proj = EXPERT_PROJECTIONS.get(m[2])
        return None if proj is None else Target((layer, "mlp", "experts", proj), "expert", int(m[1]))
    m = _PACKED.fullmatch(sub)
    if m is not None:
        proj = EXPERT_PROJECTIONS.get(m[1])
        return None if proj is None else Target((layer, "mlp", "experts", f"{proj}_{m[2]}"), "packed")
    parts = tuple(sub.split("."))
    if linear.WEIGHT_ROWS and len(parts) == 3 and parts[0] == "self_attn" and parts[1] in linear.ROW_MODULES \
            and parts[2] == "weight":  # an attention projection stored [out, in] as published
        return Target((layer, *parts), "rows")
    if len(parts) >= 2 and parts[-2] in LINEAR_MODULES and parts[-1] == "weight":
        return Target((layer, *parts[:-1], "kernel"), "linear")
    if len(parts) >= 2 and parts[-2] in LINEAR_MODULES and parts[-1] == "bias":
        return Target((layer, *parts[:-1], "bias"), "copy")
    if len(parts) == 3 and parts[-2].endswith("_conv1d") and parts[-1] == "weight":
        return Target((layer, *parts), "conv")
    if sub in ("self_attn.A_log", "self_attn.dt_bias"):
        return Target((layer, *parts), "flat")
    return Target((layer, *parts), "copy")


def published_name(path: ParamPath, config: ModelConfig | None = None) -> str:
    """The canonical published tensor name for a param path (for messages)."""
    if path[0] in ("vision_tower", "mm_projector"):
        return vision_published_name(path)
    if config is not None and config.vision is not None:
        return "language_model." + published_name(path)
    if path == ("lm_head",):
        return "lm_head.weight"
    if path == ("embed_tokens",):
        return "model.embed_tokens.weight"
    parts = list(path)
    if parts[0].startswith("layers_"):
        parts[0:1] = ["layers", parts[0][len("layers_"):]]
    if parts[-1] == "kernel":
        parts[-1] = "weight"
    if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] not in EXPERT_PARAMS:  # w_gate_blocks, ...
        proj, kind = parts[-1].rsplit("_", 1)
        parts[-1] = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}[proj] + "_" + kind
    elif len(parts) >= 2 and parts[-2] == "experts":
        parts[-1] = {"w_gate": "N.gate_proj.weight", "w_up": "N.up_proj.weight", "w_down": "N.down_proj.weight"}[
            parts[-1]]
    return "model." + ".".join(parts)


def _transformed_shape(target: Target, shape: tuple[int, ...], expected: tuple[int, ...]) -> tuple[int, ...] | None:
    if target.kind in ("copy", "packed", "rows"):
        return shape
    if target.kind in ("linear", "expert"):
        return tuple(reversed(shape)) if len(shape) == 2 else None
    if target.kind == "patch":
        return (int(np.prod(shape[1:])), shape[0]) if len(shape) == 4 else None
    if target.kind == "conv":
        if len(shape) == 3 and shape[1] == 1:
            return (shape[0], shape[2])
        return shape if len(shape) == 2 else None
    if target.kind == "flat":
        return expected if int(np.prod(shape)) == int(np.prod(expected)) else shape
    raise AssertionError(target.kind)


@dataclass
class LoadPlan:
    """Header-only result of matching a checkpoint against the expected params."""

    sources: dict[ParamPath, list[tuple[TensorInfo, Target]]] = field(default_factory=dict)
    scales: dict[str, TensorInfo] = field(default_factory=dict)
    packed: dict[str, "PackedInt"] = field(default_factory=dict)  # `X.weight_packed` -> its scales and shape
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PackedInt:
    """A compressed-tensors `pack-quantized` weight's companions: `X.weight_scale` [out, ceil(in / group)], the
    optional `X.weight_shape` [2] (the unpacked [out, in]), the unpacked width and the scheme (bits, group size)."""

    scale: TensorInfo
    shape: TensorInfo | None
    in_dim: int
    scheme: tuple[int, int]


def plan_load(files: dict[str, SafetensorsFile], expected: dict[ParamPath, jax.ShapeDtypeStruct],
              config: ModelConfig) -> LoadPlan:
    """Matches every checkpoint tensor to a param and lists every problem (nothing is read but headers)."""
    plan = LoadPlan()
    infos = {name: f.tensors[name] for name, f in files.items()}
    scale_names = {n for n in infos if n.endswith(".weight_scale_inv")}
    if config.packed_int is not None:  # compressed-tensors: X.weight_packed with X.weight_scale and X.weight_shape
        scale_names |= {n[:-len("_packed")] + suffix for n in infos if n.endswith(".weight_packed")
                        for suffix in ("_scale", "_shape") if n[:-len("_packed")] + suffix in infos}
    unexpected, missing, mismatched, bad_dtype = [], [], [], []
    rejected: set[tuple[ParamPath, int]] = set()  # present but unusable: reported once, not also as missing
    for name in sorted(infos):
        if name in scale_names:
            continue
        info = infos[name]
        packed_int = config.packed_int is not None and name.endswith(".weight_packed")
        target = map_tensor_name(name[:-len("_packed")] if packed_int else name, config)
        if target is IGNORE:
            continue
        if target is None or target.path not in expected:
            unexpected.append(f"unexpected tensor '{name}' {list(info.shape)} ({info.dtype})")
            continue
        want = expected[target.path]
        rejected.add((target.path, target.expert))
        want_shape = want.shape[1:] if target.kind == "expert" else want.shape
        if target.kind == "expert" and not 0 <= target.expert < want.shape[0]:
            unexpected.append(f"unexpected tensor '{name}': expert {target.expert} is outside 0..{want.shape[0] - 1}")
            continue
        if packed_int:
            problem = _plan_packed_int(name, info, infos, target, tuple(want_shape), config.packed_int, plan)
            if problem is not None:
                (mismatched if problem.startswith("shape") else bad_dtype).append(problem)
            else:
                plan.sources.setdefault(target.path, []).append((info, target))
            continue
        got = _transformed_shape(target, info.shape, tuple(want_shape))
        if got != tuple(want_shape):
            hint = _SHAPE_HINTS.get(target.kind, "")
            mismatched.append(f"shape mismatch: '{name}' is {list(info.shape)}, the model expects "
                              f"{list(want_shape)}{hint}")
            continue
        if info.dtype in FP8_SOURCES:
            scale = name[: -len("weight")] + "weight_scale_inv"
            if scale not in infos:
                bad_dtype.append(f"dtype mismatch: '{name}' is {info.dtype} but '{scale}' (its block scales) is absent")
                continue
            if config.weight_block_size is None:
                bad_dtype.append(f"dtype mismatch: '{name}' is {info.dtype} but config.json has no fp8 "
                                 "quantization_config.weight_block_size")
                continue
            block = config.weight_block_size
            need = tuple(-(-d // b) for d, b in zip(info.shape, block))
            if len(info.shape) != 2 or infos[scale].shape != need:
                mismatched.append(f"shape mismatch: '{scale}' is {list(infos[scale].shape)}, blocks of {list(block)} "
                                  f"over {list(info.shape)} need {list(need)}")
                continue
            plan.scales[name] = infos[scale]
        elif target.kind == "packed":
            if info.dtype != "U8":
                bad_dtype.append(f"dtype mismatch: '{name}' is {info.dtype}, expected U8 (packed MXFP4)")
                continue
        elif info.dtype not in FLOAT_SOURCES:
            bad_dtype.append(f"dtype mismatch: '{name}' is {info.dtype}, expected a floating-point tensor")
            continue
        plan.sources.setdefault(target.path, []).append((info, target))
    for name in sorted(n for n in scale_names if n.endswith("_scale_inv")):
        weight = name[: -len("weight_scale_inv")] + "weight"
        if weight not in infos:
            unexpected.append(f"unexpected tensor '{name}' (no weight '{weight}' beside it)")
    for path, want in expected.items():
        srcs = plan.sources.get(path)
        if len(path) >= 2 and path[-2] == "experts" and path[-1] in EXPERT_PARAMS:
            have = sorted(t.expert for _, t in srcs or [])
            dupes = sorted({e for e in have if have.count(e) > 1})
            absent = sorted(e for e in set(range(want.shape[0])) - set(have) if (path, e) not in rejected)
            layer = published_name(path, config).replace(".N.", ".{" + ",".join(map(str, absent)) + "}.")
            if absent:
                missing.append(f"missing tensor(s) {layer}" if len(absent) < want.shape[0]
                               else f"missing tensor(s) {published_name(path, config)} for all {want.shape[0]} experts")
            if dupes:
                mismatched.append(f"experts {dupes} of {published_name(path, config)} appear more than once")
        elif not srcs and (path, -1) not in rejected:
            missing.append(f"missing tensor '{published_name(path, config)}' {list(want.shape)}")
        elif srcs and len(srcs) > 1:
            mismatched.append(f"'{published_name(path, config)}' is given by several tensors: "
                              + ", ".join(i.name for i, _ in srcs))
    plan.problems = missing + unexpected + mismatched + bad_dtype
    return plan


def _plan_packed_int(name: str, info: TensorInfo, infos: dict[str, TensorInfo], target: Target,
                     want_shape: tuple[int, ...], scheme: tuple[int, int], plan: LoadPlan) -> str | None:
    """Checks a `X.weight_packed` tensor of a linear or expert projection and its companions against the param
    ([in, out]) and records them in `plan.packed`; returns the problem, or None."""
    bits, group = scheme
    base = name[:-len("_packed")]
    if target.kind not in ("linear", "expert", "rows"):
        return f"dtype mismatch: '{name}' is packed integers, but '{base}' is not a projection"
    if info.dtype != "I32":
        return f"dtype mismatch: '{name}' is {info.dtype}, expected I32 (compressed-tensors pack-quantized)"
    scale = infos.get(base + "_scale")
    if scale is None:
        return f"dtype mismatch: '{name}' is packed integers but '{base}_scale' (its group scales) is absent"
    if scale.dtype not in FLOAT_SOURCES:
        return f"dtype mismatch: '{base}_scale' is {scale.dtype}, expected a floating-point tensor"
    in_dim, out_dim = want_shape[::-1] if target.kind == "rows" else want_shape
    need_packed, need_scale = (out_dim, -(-in_dim * bits // 32)), (out_dim, -(-in_dim // group))
    if info.shape != need_packed or scale.shape != need_scale:
        return (f"shape mismatch: '{name}' is {list(info.shape)} and '{base}_scale' {list(scale.shape)}; the model's "
                f"[{out_dim}, {in_dim}] at {bits} bits in groups of {group} needs {list(need_packed)} and "
                f"{list(need_scale)}")
    plan.packed[name] = PackedInt(scale, infos.get(base + "_shape"), in_dim, scheme)
    return None


def dequantize_packed_int(packed: np.ndarray, scale: np.ndarray, in_dim: int, bits: int, group: int) -> np.ndarray:
    """compressed-tensors `pack-quantized` -> float32 [out, in_dim]: packed int32 [out, ceil(in_dim * bits / 32)] holds
    each row's values densely along the input, LSB first (value j at bit j * bits of the row's little-endian words),
    each as the unsigned q + 2 ** (bits - 1); scale [out, ceil(in_dim / group)] multiplies q group by group."""
    return _packed_int_values(packed.astype("<i4", copy=False).view(np.uint32), scale, in_dim, (bits, group), np)


def _packed_int_values(words, scales, in_dim: int, scheme: tuple[int, int], xp):
    """`dequantize_packed_int` in array module `xp` (numpy on the host, jax.numpy on the device): words uint32
    [..., out, W], scales [..., out, G] -> float32 [..., out, in_dim]."""
    bits, group = scheme
    fields = (words[..., None] >> (xp.arange(32 // bits, dtype=xp.uint32) * bits)) & ((1 << bits) - 1)
    q = fields.reshape(*words.shape[:-1], -1)[..., :in_dim].astype(xp.float32) - float(1 << (bits - 1))
    return q * xp.repeat(scales.astype(xp.float32), group, axis=-1)[..., :in_dim]


def quantize_fp8_blocks(array: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """`dequantize_fp8_blocks`' inverse, DeepSeek's format (for test and benchmark checkpoints): [out, in] float ->
    (e4m3 weight [out, in], float32 weight_scale_inv [ceil(out/b0), ceil(in/b1)]), each block scaled to its peak
    (partial blocks at the edges)."""
    (b0, b1), (out_dim, in_dim) = block, array.shape
    rows, cols = -(-out_dim // b0), -(-in_dim // b1)
    padded = np.zeros((rows * b0, cols * b1), np.float32)
    padded[:out_dim, :in_dim] = array
    blocks = padded.reshape(rows, b0, cols, b1)
    scale = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0
    quantized = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:out_dim, :in_dim]
    return quantized.astype(ml_dtypes.float8_e4m3fn), scale


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """w [out, in] float8 with scale_inv [ceil(out/b0), ceil(in/b1)] -> float32 w * scale per block (contiguous).
    The float8 values come from a 256-entry table (numpy's float8 cast is ~10x slower) and each scale multiplies its
    block in place: ~450 MB/s of float8 on one CPU core, bit for bit the cast-and-multiply."""
    out_dim, in_dim = weight.shape
    (b0, b1), (rows, cols) = block, scale_inv.shape
    values = np.arange(256, dtype=np.uint8).view(weight.dtype).astype(np.float32)[weight.view(np.uint8)]
    if (rows * b0, cols * b1) != (out_dim, in_dim):  # partial blocks at the edges
        values = np.pad(values, ((0, rows * b0 - out_dim), (0, cols * b1 - in_dim)))
    blocks = values.reshape(rows, b0, cols, b1)
    blocks *= scale_inv.astype(np.float32)[:, None, :, None]
    values = blocks.reshape(rows * b0, cols * b1)
    return values if values.shape == (out_dim, in_dim) else np.ascontiguousarray(values[:out_dim, :in_dim])


@dataclass(frozen=True)
class Fp8Blocks:
    """FP8 weights as published with their block scales, for the device to dequantize (`load_params`): weight
    [..., out, in] float8, scale_inv [..., ceil(out/b0), ceil(in/b1)] float32, block (b0, b1)."""

    weight: np.ndarray
    scale_inv: np.ndarray
    block: tuple[int, int]

    @property
    def ndim(self) -> int:
        return self.weight.ndim


def _read(files, info: TensorInfo, plan: LoadPlan, config: ModelConfig, out: np.ndarray | None = None) -> np.ndarray:
    """Tensor `info` (FP8 and packed integer weights dequantized to float32), as a new array or copied (and cast)
    into `out`."""
    if info.name in plan.packed:
        array = _read_packed_int(files, info, plan.packed[info.name])
    elif info.name in plan.scales:
        scale = plan.scales[info.name]
        array = dequantize_fp8_blocks(files[info.name].read(info.name), files[scale.name].read(scale.name),
                                      config.weight_block_size)
    else:
        return files[info.name].read(info.name, out)
    if out is None:
        return array
    out[...] = array
    return out


def _check_weight_shape(files, info: TensorInfo, packed: PackedInt) -> None:
    """A `X.weight_packed` tensor's `X.weight_shape`, where present, must be the model's [out, in]."""
    if packed.shape is not None:
        stored = files[packed.shape.name].read(packed.shape.name).reshape(-1).tolist()
        if stored != [info.shape[0], packed.in_dim]:
            raise CheckpointError(f"{info.file}: '{packed.shape.name}' says {stored}, the model's projection is "
                                  f"[{info.shape[0]}, {packed.in_dim}]")


def _read_packed_int(files, info: TensorInfo, packed: PackedInt) -> np.ndarray:
    """A `X.weight_packed` tensor dequantized (float32 [out, in]); its `X.weight_shape`, where present, must agree."""
    _check_weight_shape(files, info, packed)
    return dequantize_packed_int(files[info.name].read(info.name), files[packed.scale.name].read(packed.scale.name),
                                 packed.in_dim, *packed.scheme)


def _read_dtype(info: TensorInfo, plan: LoadPlan) -> np.dtype:
    """The dtype `_read` returns for `info`."""
    return np.dtype(np.float32) if info.name in plan.scales or info.name in plan.packed else DTYPES[info.dtype]


def _transform(array: np.ndarray, target: Target, shape: tuple[int, ...]) -> np.ndarray:
    """A stored tensor laid out as its param (or its expert's slot), without the [out, in] -> [in, out] swap of linear
    and expert projections, which `stream_stored`'s callers make."""
    if target.kind == "patch":
        return array.reshape(array.shape[0], -1).T
    if target.kind in ("linear", "expert"):
        return array
    return array.reshape(shape)


def _stored_dtype(source: np.dtype, param: np.dtype) -> np.dtype:
    """The dtype a projection travels in as published: the param's where that is narrower than the source (cast on the
    host, tensor by tensor), else the source's (widened where it is swapped)."""
    return param if param.itemsize < source.itemsize else source


def stream_stored(directory: str, config: ModelConfig, expected: dict[ParamPath, jax.ShapeDtypeStruct],
                  progress: bool | None = None, desc: str = "loading", swap_on_host: bool = False):
    """Yields (path, host numpy array, as_published) for every param of `expected`, in order, one at a time (an expert
    projection is stacked from its per-expert tensors first), so callers hold about one param at once.

    `as_published` (linear and expert projections, unless `swap_on_host`): the array is the param with its last two
    axes swapped ([..., out, in] as published) and in a dtype of its own (`_stored_dtype`); the caller swaps and casts
    it where that is cheapest (on the device: `load_params`); FP8 projections then come as `Fp8Blocks` (the float8
    bytes and their scales) and packed integer ones as `PackedIntWords`, dequantized there too. Otherwise the array
    is the param, in the param's dtype.
    Raises CheckpointError listing every problem before any tensor data is read.
    """
    files = open_checkpoint_files(directory)
    plan = plan_load(files, expected, config)
    if plan.problems:
        raise CheckpointError(f"{directory}: the checkpoint does not match the {config.model_type} model "
                              f"({len(plan.problems)} problem(s))", plan.problems)
    bar = tqdm(total=sum(len(v) for v in plan.sources.values()), unit="tensor", desc=desc,
               disable=True if progress is False else None, leave=False)
    for path, want in expected.items():
        dtype = np.dtype(want.dtype)
        sources = plan.sources[path]
        as_published = sources[0][1].kind in ("linear", "expert") and not swap_on_host
        if as_published and all(info.name in plan.scales for info, _ in sources) \
                and len({info.dtype for info, _ in sources}) == 1:  # FP8 as published, for the device to dequantize
            host = _fp8_blocks(files, sources, plan, config, want.shape)
            bar.update(len(sources))
        elif as_published and all(info.name in plan.packed for info, _ in sources):  # packed ints, the same way
            host = _packed_int_words(files, sources, plan, want.shape)
            bar.update(len(sources))
        elif sources[0][1].kind == "expert":
            if as_published:  # each expert read in place (cast where narrower)
                host = np.empty((want.shape[0], *want.shape[1:][::-1]),
                                _stored_dtype(_read_dtype(sources[0][0], plan), dtype))
                for info, target in sources:
                    _read(files, info, plan, config, out=host[target.expert])
                    bar.update(1)
            else:
                host = np.empty(want.shape, dtype)
                for info, target in sources:
                    host[target.expert] = _read(files, info, plan, config).T
                    bar.update(1)
        else:
            info, target = sources[0]
            host = _transform(_read(files, info, plan, config), target, want.shape)
            if as_published:
                host = np.ascontiguousarray(host.astype(_stored_dtype(host.dtype, dtype), copy=False))
            else:
                host = np.ascontiguousarray(host.T if target.kind == "linear" else host).astype(dtype, copy=False)
            bar.update(1)
        yield path, host, as_published
        del host
    bar.close()


def _as_stored(files, sources: list[tuple[TensorInfo, Target]], tensor_of, n_experts: int, dtype) -> np.ndarray:
    """The tensors `tensor_of(info)` (a weight, or its scales) of a projection's sources, cast to `dtype`: one
    tensor as stored, or the experts' read in place into [n_experts, ...]."""
    first, target = sources[0]
    if target.kind != "expert":
        tensor = tensor_of(first)
        return files[tensor.name].read(tensor.name).astype(dtype, copy=False)
    out = np.empty((n_experts, *tensor_of(first).shape), dtype)
    for info, target in sources:
        tensor = tensor_of(info)
        files[tensor.name].read(tensor.name, out=out[target.expert])
    return out


def _fp8_blocks(files, sources: list[tuple[TensorInfo, Target]], plan: LoadPlan, config: ModelConfig,
                shape: tuple[int, ...]) -> Fp8Blocks:
    """A projection's FP8 tensors as published and their block scales (float32): one [out, in] weight, or the
    experts' read in place into [E, out, in] (param `shape` [E, in, out])."""
    weight = _as_stored(files, sources, lambda info: info, shape[0], DTYPES[sources[0][0].dtype])
    scales = _as_stored(files, sources, lambda info: plan.scales[info.name], shape[0], np.float32)
    return Fp8Blocks(weight, scales, config.weight_block_size)


@dataclass(frozen=True)
class PackedIntWords:
    """compressed-tensors `pack-quantized` weights as published, for the device to dequantize (`load_params`): words
    int32 [..., out, ceil(in * bits / 32)], scales [..., out, ceil(in / group)] (as stored), in_dim, (bits, group)."""

    words: np.ndarray
    scales: np.ndarray
    in_dim: int
    scheme: tuple[int, int]

    @property
    def ndim(self) -> int:
        return self.words.ndim


def _packed_int_words(files, sources: list[tuple[TensorInfo, Target]], plan: LoadPlan,
                      shape: tuple[int, ...]) -> PackedIntWords:
    """A projection's packed words and group scales as published: one [out, words] weight, or the experts' read in
    place into [E, out, words] (param `shape` [E, in, out]); each `weight_shape` checked as `_read_packed_int` does."""
    packed = plan.packed[sources[0][0].name]
    for info, _ in sources:
        _check_weight_shape(files, info, plan.packed[info.name])
    words = _as_stored(files, sources, lambda info: info, shape[0], np.int32)
    scales = _as_stored(files, sources, lambda info: plan.packed[info.name].scale, shape[0],
                        DTYPES[packed.scale.dtype])
    return PackedIntWords(words, scales, packed.in_dim, packed.scheme)


def stream_params(directory: str, config: ModelConfig, expected: dict[ParamPath, jax.ShapeDtypeStruct],
                  progress: bool | None = None, desc: str = "loading"):
    """Yields (path, host numpy array of the param's dtype and shape) for every param of `expected`, in order, one at a
    time (`stream_stored` with the projections swapped on the host). Raises CheckpointError listing every problem
    before any tensor data is read."""
    for path, host, _ in stream_stored(directory, config, expected, progress, desc, swap_on_host=True):
        yield path, host


def _swap_and_cast(array: jax.Array, dtype) -> jax.Array:
    return jnp.swapaxes(array, -1, -2).astype(dtype)


def _dequantize_swap_and_cast(weight: jax.Array, scale_inv: jax.Array, block: tuple[int, int], dtype) -> jax.Array:
    """`Fp8Blocks` on the device -> the param: w * scale per block in float32 (as `dequantize_fp8_blocks`), [..., out,
    in] -> [..., in, out], cast to `dtype`."""
    out_dim, in_dim = weight.shape[-2:]
    scale = jnp.repeat(jnp.repeat(scale_inv, block[0], axis=-2), block[1], axis=-1)[..., :out_dim, :in_dim]
    return _swap_and_cast(weight.astype(jnp.float32) * scale, dtype)


def _unpack_swap_and_cast(words: jax.Array, scales: jax.Array, in_dim: int, scheme: tuple[int, int],
                          dtype) -> jax.Array:
    """`PackedIntWords` on the device -> the param: `dequantize_packed_int`'s values, [..., out, in] -> [..., in, out],
    cast to `dtype`."""
    values = _packed_int_values(jax.lax.bitcast_convert_type(words, jnp.uint32), scales, in_dim, scheme, jnp)
    return _swap_and_cast(values, dtype)


@functools.lru_cache(maxsize=256)
def _placed_jit(fun, static_argnums: tuple[int, ...], sharding: NamedSharding | None):
    """`fun` jitted to place its result on `sharding` (None: where its inputs are)."""
    return jax.jit(fun, static_argnums=static_argnums, out_shardings=sharding)


def _put(host: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
    return place(host, sharding) if sharding is not None else jax.device_put(host)


def _leading_sharding(sharding: NamedSharding | None, ndim: int) -> NamedSharding | None:
    """Scales (and packed words) placed by their weight's leading (expert) axes; their last two axes replicated."""
    if sharding is None:
        return None
    spec = (list(sharding.spec) + [None] * ndim)[:ndim - 2]
    return NamedSharding(sharding.mesh, PartitionSpec(*spec, None, None))


def _swapped_sharding(sharding: NamedSharding | None, ndim: int) -> NamedSharding | None:
    """The sharding of a param's [..., out, in] form: `sharding` with its last two axes' entries swapped."""
    if sharding is None:
        return None
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    spec[-2:] = spec[-1], spec[-2]
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


# Threads placing params while the next ones are read (`load_params`; 0: none). Each new param shape compiles its
# device transpose (18 shapes for the medium hybrid: 3.63 s of compiles in a 10.98 s hub load on the H100 host,
# thirty-sixth session), and in threads those compiles run side by side and under the file reads. Host memory grows
# by up to this many params (a stacked expert projection each at most) beyond the one being read. CPU (2 cores,
# benchmarks/load.py --layers 4 --repeat 3): the hub load 3.60 / 3.56 / 3.08 s with 0 / 2 / 4 workers, peak RSS
# 3.08 / 3.28 / 3.43 GB. The H100 host (thirty-seventh session, --layers 4 --load-workers 0 / 4): 6.94 against
# 2.84 s, its compiles 4.24 against 1.82 s, peak RSS 2.38 against 2.56 GB.
LOAD_WORKERS = 4


def _place_param(host, as_published: bool, sharding: NamedSharding | None, dtype) -> jax.Array:
    """One param from `stream_stored`'s host form onto its device(s): swapped, dequantized and cast there where it
    comes as published."""
    if isinstance(host, Fp8Blocks):
        inputs = (_put(host.weight, _swapped_sharding(sharding, host.ndim)),
                  _put(host.scale_inv, _leading_sharding(sharding, host.ndim)))
        return _placed_jit(_dequantize_swap_and_cast, (2, 3), sharding)(*inputs, tuple(host.block), dtype)
    if isinstance(host, PackedIntWords):
        inputs = (_put(host.words, _leading_sharding(sharding, host.ndim)),
                  _put(host.scales, _leading_sharding(sharding, host.ndim)))
        return _placed_jit(_unpack_swap_and_cast, (2, 3, 4), sharding)(*inputs, host.in_dim, tuple(host.scheme), dtype)
    if as_published:
        stored = _put(host, _swapped_sharding(sharding, host.ndim))
        return _placed_jit(_swap_and_cast, (1,), sharding)(stored, dtype)
    return _put(host, sharding)


def _place_under(device, host, as_published: bool, sharding: NamedSharding | None, dtype) -> jax.Array:
    """`_place_param` with `device` as JAX's default device (None: JAX's own), as the loading thread has it."""
    with jax.default_device(device):
        return _place_param(host, as_published, sharding, dtype)


def load_params(directory: str, config: ModelConfig, expected: dict[ParamPath, jax.ShapeDtypeStruct],
                sharding_for=None, progress: bool | None = None,
                workers: int | None = None) -> dict[ParamPath, jax.Array]:
    """Streams the checkpoint in `directory` into device arrays keyed by param path.

    `sharding_for(path) -> jax.sharding.Sharding | None` places each param as it is read (None: default device).
    Linear and expert projections go to the device as published ([..., out, in]) and are swapped to [..., in, out]
    (and cast) there: a device transpose is ~free on a GPU, where the host's strided copy dominated the load (and
    ~3x faster than numpy's on a CPU). `workers` threads (None: LOAD_WORKERS) place params while the next are read
    (0: in the reading thread), up to `workers` params held on the host at once besides the one being read.
    Raises CheckpointError listing every problem before any tensor data is read.
    """
    workers = LOAD_WORKERS if workers is None else workers
    # JAX's default device is the calling thread's setting (`jax.default_device`, as `platforms.build_on` sets
    # it), and dayzero's kernel policy a context variable: the workers place under both, as the caller would.
    device = jax.config.jax_default_device
    placing = ((path, (device, host, as_published, sharding_for(path) if sharding_for is not None else None,
                       np.dtype(expected[path].dtype)))
               for path, host, as_published in stream_stored(directory, config, expected, progress))
    if workers < 1:
        return {path: _place_under(*args) for path, args in placing}
    params: dict[ParamPath, jax.Array] = {}
    in_flight: collections.deque = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dayzero-load") as pool:
        try:
            for path, args in placing:
                in_flight.append((path, pool.submit(contextvars.copy_context().run, _place_under, *args)))
                del args
                if len(in_flight) == workers:
                    done_path, placed = in_flight.popleft()
                    params[done_path] = placed.result()
            for done_path, placed in in_flight:
                params[done_path] = placed.result()
        finally:  # after an error: the queued placements are let go, none of their results awaited
            for _, placed in in_flight:
                placed.cancel()
    return params


__all__ = ["load_params", "stream_params", "stream_stored", "Fp8Blocks", "PackedIntWords", "plan_load",
           "map_tensor_name", "published_name", "quantize_fp8_blocks", "dequantize_fp8_blocks",
           "dequantize_packed_int", "DTYPES"]
