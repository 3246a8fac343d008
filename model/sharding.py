"""Sharding over a device mesh with axes `data`, `expert`, `tensor`: one table of rules for every param and cache
array, and the helpers that place arrays by it.

- `tensor`: tensor parallelism over attention heads (MLA q/kv_b/o projections; KDA q/k/v/f_b/g_b/b/o projections,
  short convs, A_log, dt_bias and the recurrent state's head dim) and over the intermediate dim of dense MLPs and
  shared experts; the LM head over the vocabulary. GSPMD inserts the collectives.
- `expert`: expert parallelism: routed experts' leading expert dim (bf16/fp32 weights, MXFP4 blocks and scales,
  offline-converted experts alike); the MoE layer then dispatches tokens with all-to-all inside `shard_map`
  (`dayzero.model.moe.expert_parallel`).
- `data`: batch rows of the full-sequence path, and tokens inside the expert-parallel MoE; params are replicated
  over it.

Everything else is replicated: embeddings, norms, routers, the MLA latent projections (q_a, kv_a), the DSA indexer
(its top-k is a discrete choice over a sum across heads: replicated, it selects what a single device selects), the
vision tower, and the MLA latent / indexer-key caches (no head dim). A dimension whose unit count (heads, experts,
the dim itself) does not divide the mesh axis size falls back to replicated on that axis rather than failing.

Multi-host: start every process with `initialize_distributed(coordinator, num_processes, process_id)` (a thin
`jax.distributed.initialize` wrapper) before anything else touches JAX; `make_mesh` then spans the devices of all
processes, and `place` puts host values on shards that other processes own (each process passes the same value).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .config import LAYER_KDA, MLP_MOE, ModelConfig
from .errors import ConfigError

ParamPath = tuple[str, ...]
AXES = ("data", "expert", "tensor")
# Tokens of the expert-parallel MoE are split over every mesh axis; all-to-all runs over `expert`.
TOKEN_AXES = ("data", "tensor", "expert")

# One table for params: (pattern, layout). The pattern fully matches a param's key (see `param_key`: the path with
# the layer replaced by its kind, e.g. "kda/q_proj/kernel", "mla/o_proj/kernel", "moe/experts/w_gate_blocks",
# "mlp/down_proj/kernel"); the first match wins. The layout gives, per leading dim, None (replicated) or
# (mesh axis, unit): the dim is split over the axis when the axis size divides the unit count (units: "kda_heads",
# "mla_heads", "experts", or "dim" for the dim's own size), else replicated. Dims past the layout are replicated.
PARAM_RULES: tuple[tuple[str, tuple], ...] = (
    (r"lm_head", (None, ("tensor", "dim"))),                                        # [D, V]: vocab
    (r"kda/(q|k|v)_proj/kernel", (None, ("tensor", "kda_heads"))),                   # [D, H*K]
    (r"kda/(q|k|v)_conv1d/weight", (("tensor", "kda_heads"),)),                      # [H*K, W]
    (r"kda/(A_log|dt_bias)", (("tensor", "kda_heads"),)),                            # [H], [H*K]
    (r"kda/(f_b_proj|g_b_proj|b_proj)/kernel", (None, ("tensor", "kda_heads"))),     # [K, H*K], [D, H]
    (r"kda/o_proj/kernel", (("tensor", "kda_heads"), None)),                         # [H*K, D]
    (r"mla/(q_proj|q_b_proj|kv_b_proj)/kernel", (None, ("tensor", "mla_heads"))),    # [., H*(nope+rope|nope+v)]
    (r"mla/o_proj/kernel", (("tensor", "mla_heads"), None)),                         # [H*v, D]
    # the same projections stored [out, in] (`model.linear.WEIGHT_ROWS`)
    (r"kda/(q|k|v|b)_proj/weight", (("tensor", "kda_heads"),)),                      # [H*K, D], [H, D]
    (r"kda/o_proj/weight", (None, ("tensor", "kda_heads"))),                         # [D, H*K]
    (r"mla/q_proj/weight", (("tensor", "mla_heads"),)),                              # [H*(nope+rope), D]
    (r"mla/o_proj/weight", (None, ("tensor", "mla_heads"))),                         # [D, H*v]
    (r"(mlp|moe/shared_experts)/(gate_proj|up_proj)/kernel", (None, ("tensor", "dim"))),  # [D, I]
    (r"(mlp|moe/shared_experts)/down_proj/kernel", (("tensor", "dim"), None)),            # [I, D]
    (r"moe/experts/\w+", (("expert", "experts"),)),                                  # [E, ...] any format
    (r".*", ()),  # embeddings, norms, router, q_a/kv_a latents, DSA indexer, biases, vision tower: replicated
)

# Cache arrays (see `dayzero.model.cache`; KDA snapshots share the conv/state layouts).
CACHE_RULES: tuple[tuple[str, tuple], ...] = (
    (r"conv", (None, None, None, ("tensor", "kda_heads"))),    # [L, S, 3, H*K, W-1]
    (r"state", (None, None, ("tensor", "kda_heads"))),         # [L, S, H, K, V] float32
    (r".*", ()),  # latent [L, N, 64, R+E], index_keys, index_scales: no head dim, replicated
)


def make_mesh(data: int = 1, expert: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A `data` x `expert` x `tensor` mesh over the first data*expert*tensor of `devices` (default `jax.devices()`,
    every process's devices in multi-host runs); axes are of the GSPMD ("auto") kind."""
    shape = (data, expert, tensor)
    if min(shape) < 1:
        raise ConfigError("mesh", f"axis sizes must be at least 1, got data={data}, expert={expert}, tensor={tensor}")
    devices = list(jax.devices() if devices is None else devices)
    size = data * expert * tensor
    if size > len(devices):
        raise ConfigError("mesh", f"data={data} x expert={expert} x tensor={tensor} needs {size} devices; "
                          f"{len(devices)} available")
    grid = np.asarray(devices[:size], dtype=object).reshape(shape)
    return Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def parse_mesh(text: str) -> dict[str, int]:
    """"expert=2,tensor=4" -> {"expert": 2, "tensor": 4} (the `make_mesh` keywords; unnamed axes stay 1)."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in AXES or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError("mesh", f"'{part}' is not AXIS=SIZE with AXIS one of {AXES} and SIZE >= 1")
        sizes[name] = int(value)
    return sizes


def axis_size(mesh: Mesh | None, axis: str) -> int:
    return 1 if mesh is None else dict(mesh.shape).get(axis, 1)


def expert_parallel_size(config: ModelConfig, mesh: Mesh | None) -> int:
    """The number of expert shards: the `expert` axis size when it divides num_experts, else 1 (replicated)."""
    size = axis_size(mesh, "expert")
    return size if size > 1 and config.num_experts % size == 0 else 1


def param_key(path: ParamPath, config: ModelConfig) -> str:
    """The key the rules match: "layers_<i>/self_attn/..." -> "kda/..." or "mla/...", "layers_<i>/mlp/..." ->
    "moe/..." or "mlp/...", other per-layer params "layer/...", the rest as the path joined by "/"."""
    if path[0].startswith("layers_") and len(path) > 2:
        index = int(path[0][len("layers_"):])
        if path[1] == "self_attn":
            return "/".join(("kda" if config.layer_types[index] == LAYER_KDA else "mla", *path[2:]))
        if path[1] == "mlp":
            return "/".join(("moe" if config.mlp_types[index] == MLP_MOE else "mlp", *path[2:]))
        return "/".join(("layer", *path[1:]))
    return "/".join(path)


def _units(unit: str, size: int, config: ModelConfig) -> int:
    return {"kda_heads": config.kda_num_heads, "mla_heads": config.num_heads, "experts": config.num_experts,
            "dim": size}[unit]


def _spec(rules, key: str, shape: tuple[int, ...], config: ModelConfig, mesh: Mesh) -> PartitionSpec:
    layout = next(layout for pattern, layout in rules if re.fullmatch(pattern, key))
    entries = []
    for dim, rule in zip(shape, layout):
        if rule is None:
            entries.append(None)
            continue
        axis, unit = rule
        n = axis_size(mesh, axis)
        units = _units(unit, dim, config)
        entries.append(axis if n > 1 and units % n == 0 and dim % n == 0 else None)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def param_spec(path: ParamPath, shape: tuple[int, ...], config: ModelConfig, mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of the param at `path` with `shape` (see PARAM_RULES)."""
    return _spec(PARAM_RULES, param_key(path, config), tuple(shape), config, mesh)


def cache_spec(name: str, shape: tuple[int, ...], config: ModelConfig, mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of the cache (or KDA snapshot) array `name` with `shape` (see CACHE_RULES)."""
    return _spec(CACHE_RULES, name, tuple(shape), config, mesh)


def param_shardings(config: ModelConfig, mesh: Mesh,
                    shapes: dict[ParamPath, Any] | None = None) -> Callable[[ParamPath], NamedSharding]:
    """`sharding_for(path) -> NamedSharding` for the params of `config` on `mesh`. `shapes` maps paths to shapes
    (or anything with `.shape`); by default the model's expected params."""
    if shapes is None:
        from .model import expected_params  # model.py imports this module

        shapes = expected_params(config, np.float32)
    dims = {path: tuple(getattr(s, "shape", s)) for path, s in shapes.items()}

    def sharding_for(path: ParamPath) -> NamedSharding:
        return NamedSharding(mesh, param_spec(path, dims[path], config, mesh))

    return sharding_for


def cache_shardings(config: ModelConfig, mesh: Mesh, shapes: dict[str, Any]) -> dict[str, NamedSharding]:
    """{name: NamedSharding} of cache arrays given {name: shape (or an array)}."""
    return {name: NamedSharding(mesh, cache_spec(name, tuple(getattr(s, "shape", s)), config, mesh))
            for name, s in shapes.items()}


def place(value, sharding: NamedSharding) -> jax.Array:
    """`value` (host or device array, the same on every process) placed by `sharding`; on a mesh spanning several
    processes each process transfers only the shards its devices hold."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(np.shape(value), sharding, lambda index: np.asarray(value[index]))


def shard_params(params: dict, config: ModelConfig, mesh: Mesh) -> dict:
    """A nested params pytree placed on `mesh` by the rules (one param at a time)."""
    flat = traverse_util.flatten_dict(params)
    sharding_for = param_shardings(config, mesh, flat)
    return traverse_util.unflatten_dict({path: place(value, sharding_for(path)) for path, value in flat.items()})


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Rows [B, ...] split over `data` when it divides B (else replicated)."""
    n = axis_size(mesh, "data")
    return NamedSharding(mesh, PartitionSpec("data") if n > 1 and shape and shape[0] % n == 0 else PartitionSpec())


def constrain(x: jax.Array, mesh: Mesh | None, dim: int, units: int, axis: str = "tensor") -> jax.Array:
    """Inside jit: pins dim `dim` of x (holding `units` heads) to mesh `axis` when the axis divides them, other
    dims left to GSPMD; x unchanged without a mesh or when it does not divide (replicated fallback)."""
    n = axis_size(mesh, axis)
    if n == 1 or units % n or x.shape[dim] % n:
        return x
    spec = [PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[dim] = axis
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def initialize_distributed(coordinator: str, num_processes: int, process_id: int,
                           local_device_ids=None, **kwargs) -> None:
    """Joins a multi-process (multi-host) JAX run: `jax.distributed.initialize(coordinator_address=coordinator,
    num_processes=..., process_id=...)`. Call it first in every process (process 0 hosts the coordinator at
    "host:port"); then `jax.devices()` lists every process's devices and `make_mesh` builds a global mesh. CPU
    processes exchange collectives through gloo (`jax_cpu_collectives_implementation`)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids, **kwargs)
