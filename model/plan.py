"""`dayzero-plan`: bytes per device, by component, for a config on a mesh, and the fewest H200s that hold it.

Params and KDA state are split exactly as `dayzero.model.sharding` places them (its PARAM_RULES / CACHE_RULES on a
device-free `AbstractMesh` of the same axes): `tensor` splits attention heads (MLA q/q_b/kv_b/o, KDA q/k/v/o/b/f_b/
g_b, convs, A_log, dt_bias), the dense MLP and shared experts' intermediate dim, lm_head's vocab and the KDA state's
heads; `expert` splits routed experts by expert; embeddings, norms, routers, the latent A projections, the DSA
indexer and the MLA latent / indexer-key caches are replicated; a dim whose units do not divide an axis stays
replicated on it. Params are replicated over `data`; the planner treats `data` as serving replicas, each holding the
caches of its share of the requests (batch / data).

Per device: weights (dense params in `dtype`, float32 params as float32, routed experts at 4.25 bits/weight when
MXFP4), the paged MLA cache per token (latent kv_lora_rank + rope dims, plus the DSA indexer key, in `dtype`) times
the context (rounded up to 64-token blocks) times the device's requests, the KDA state per request (per KDA layer
H*K*V float32 + the q/k/v conv state in `dtype`), and, for MXFP4 experts, the FP8 workspace holding one MoE layer's
routed experts of the device in e4m3 plus their E8M0 block scales (one per 32 weights). Activations and compiler
scratch are not counted: the usable fraction (default 0.9) leaves room for them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Sequence

import jax.numpy as jnp
from jax.sharding import AbstractMesh

from . import sharding
from .cache import cache_shapes
from .config import LAYER_KDA, LAYER_MLA, MLP_MOE, ModelConfig
from .errors import DayzeroError
from .presets import PRESETS, component_of, get_preset, param_footprint

AXES = sharding.AXES
H200_BYTES = 141e9
BLOCK_TOKENS = 64


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the mesh axes data × expert × tensor."""

    data: int = 1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self):
        for axis in AXES:
            if not isinstance(getattr(self, axis), int) or getattr(self, axis) < 1:
                raise ValueError(f"mesh axis {axis} must be a positive integer, got {getattr(self, axis)!r}")

    @property
    def devices(self) -> int:
        return self.data * self.expert * self.tensor

    def abstract(self) -> AbstractMesh:
        """The device-free mesh the sharding rules read."""
        return AbstractMesh(tuple(getattr(self, axis) for axis in AXES), AXES)

    def share(self, spec) -> float:
        """Share of an array one device holds under PartitionSpec `spec`."""
        out = 1.0
        for entry in spec:
            for axis in (entry if isinstance(entry, tuple) else (entry,)):
                if axis is not None:
                    out /= getattr(self, axis)
        return out

    @classmethod
    def parse(cls, text: str) -> "MeshShape":
        """'expert=8,tensor=8,data=1' (axes left out are 1; ConfigError on a bad entry)."""
        return cls(**sharding.parse_mesh(text))

    def __str__(self) -> str:
        return ",".join(f"{axis}={getattr(self, axis)}" for axis in AXES)


@dataclass(frozen=True)
class PlanSettings:
    """What the plan assumes: param/cache dtype, MXFP4 experts (None: as the config says), device memory and the
    usable fraction of it, and the search's limits."""

    dtype: str = "bfloat16"
    experts_mxfp4: bool | None = None
    device_bytes: float = H200_BYTES
    usable_fraction: float = 0.9
    max_tensor: int = 8
    max_devices: int = 4096

    @property
    def capacity(self) -> float:
        return self.device_bytes * self.usable_fraction


@dataclass(frozen=True)
class ParamGroup:
    """Params that shard alike (same component, rule key and shape; e.g. one projection over all KDA layers): an
    example path, their shape, weights and bytes."""

    component: str
    path: tuple[str, ...]
    shape: tuple[int, ...]
    count: int
    nbytes: float

    def spec(self, config: ModelConfig, mesh: MeshShape):
        return sharding.param_spec(self.path, self.shape, config, mesh.abstract())


def param_specs(config: ModelConfig, settings: PlanSettings = PlanSettings()) -> list[ParamGroup]:
    """Every param's footprint, grouped by how it shards, from shapes only (nothing is allocated)."""
    from .model import expected_params

    mxfp4 = config.quant_method == "mxfp4" if settings.experts_mxfp4 is None else settings.experts_mxfp4
    groups: dict[tuple, list] = {}
    for path, leaf in expected_params(config, jnp.dtype(settings.dtype)).items():
        count, nbytes = param_footprint(path, leaf, settings.dtype, mxfp4)
        key = (component_of(path), sharding.param_key(path, config), tuple(leaf.shape))
        entry = groups.setdefault(key, [path, 0, 0.0])
        entry[1] += count
        entry[2] += nbytes
    return [ParamGroup(comp, path, shape, count, nbytes) for (comp, _, shape), (path, count, nbytes) in groups.items()]


def cache_bytes_per_token(config: ModelConfig, dtype="bfloat16") -> dict[str, int]:
    """Paged-cache bytes one token costs over all MLA layers: the latent (kv_lora_rank + rope dims) and, with DSA,
    the indexer key (e4m3 plus a float32 scale with the FP8 indexer)."""
    n_mla = config.layer_types.count(LAYER_MLA)
    item = jnp.dtype(dtype).itemsize
    out = {"mla latent cache": n_mla * (config.kv_lora_rank + config.qk_rope_head_dim) * item} if n_mla else {}
    if n_mla and config.use_dsa:
        key = config.index_head_dim + 4 if config.index_fp8 else config.index_head_dim * item
        out["dsa indexer key cache"] = n_mla * key
    return out


def kda_state_bytes(config: ModelConfig, dtype="bfloat16") -> dict[str, int]:
    """KDA bytes one request costs over all KDA layers: the recurrent state H*K*V float32 and the q/k/v conv
    state 3 * H*K * (conv_size - 1) in `dtype`."""
    n_kda = config.layer_types.count(LAYER_KDA)
    if not n_kda:
        return {}
    h, k = config.kda_num_heads, config.kda_head_dim
    return {"kda recurrent state": n_kda * h * k * k * 4,
            "kda conv state": n_kda * 3 * h * k * (config.kda_conv_size - 1) * jnp.dtype(dtype).itemsize}


def workspace_bytes(config: ModelConfig, mesh: MeshShape, experts_mxfp4: bool) -> float:
    """The FP8 workspace: one MoE layer's routed experts of one device in e4m3 plus an E8M0 scale per 32."""
    if not experts_mxfp4 or MLP_MOE not in config.mlp_types:
        return 0.0
    experts = config.num_experts // sharding.expert_parallel_size(config, mesh.abstract())
    return experts * 3 * config.hidden_size * config.moe_intermediate_size * (1 + 1 / 32)


@dataclass(frozen=True)
class Row:
    """One line of the plan: a component, its params (or the unit it is counted in, for runtime memory), its total
    size, how it is split and what one device holds."""

    component: str
    params: int
    total_bytes: float
    split: str
    per_device: float
    unit: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of one config on one mesh for `batch` requests of `context` tokens."""

    config_name: str
    mesh: MeshShape
    context: int
    batch: int
    settings: PlanSettings
    weights: list[Row]
    runtime: list[Row]
    experts_mxfp4: bool = False

    @property
    def weight_bytes(self) -> float:
        return sum(r.per_device for r in self.weights)

    @property
    def per_device(self) -> float:
        return self.weight_bytes + sum(r.per_device for r in self.runtime)

    @property
    def fits(self) -> bool:
        return self.per_device <= self.settings.capacity

    def format(self) -> str:
        s = self.settings
        head = (f"{self.config_name} on mesh {self.mesh} ({self.mesh.devices} devices), context {self.context}, "
                f"batch {self.batch}; params and cache {s.dtype}"
                + (", routed experts MXFP4" if self.experts_mxfp4 else ""))
        lines = [head, f"{'component':<24}{'params / unit':>15}{'total GB':>11}  {'split over':<27}"
                       f"{'per device GB':>14}"]

        def add(name: str, params: str, total: float | None, split: str, per_device: float):
            shown = "" if total is None else f"{total / 1e9:.3f}"
            lines.append(f"{name:<24}{params:>15}{shown:>11}  {split:<27}{per_device / 1e9:>14.3f}")

        for row in self.weights:
            add(row.component, f"{row.params / 1e9:.3f} B", row.total_bytes, row.split, row.per_device)
        add("= weights", f"{sum(r.params for r in self.weights) / 1e9:.3f} B",
            sum(r.total_bytes for r in self.weights), "", self.weight_bytes)
        for row in self.runtime:
            add(row.component, row.unit, row.total_bytes, row.split, row.per_device)
        verdict = "fits" if self.fits else "does NOT fit"
        add("= total per device", "", None, "", self.per_device)
        lines.append(f"{verdict}: usable {s.capacity / 1e9:.1f} GB per device ({s.usable_fraction:g} of "
                     f"{s.device_bytes / 1e9:g} GB)")
        return "\n".join(lines)


def _axes_label(spec) -> str:
    axes = [a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None]
    return "×".join(axes) or "replicated"


def _split_label(groups: list[ParamGroup], config: ModelConfig, mesh: MeshShape) -> str:
    total = sum(g.nbytes for g in groups) or 1.0
    by_axes: dict[str, float] = {}
    for g in groups:
        key = _axes_label(g.spec(config, mesh))
        by_axes[key] = by_axes.get(key, 0.0) + g.nbytes
    if len(by_axes) == 1:
        return next(iter(by_axes))
    main = max((k for k in by_axes if k != "replicated"), key=by_axes.get)
    return f"{main} ({100 * by_axes[main] / total:.0f}%)"


def plan_memory(config: ModelConfig, mesh: MeshShape, context: int, batch: int,
                settings: PlanSettings = PlanSettings(), specs: list[ParamGroup] | None = None,
                config_name: str = "model") -> MemoryPlan:
    """The per-device bytes of `config` on `mesh` serving `batch` requests of `context` tokens each."""
    specs = param_specs(config, settings) if specs is None else specs
    mxfp4 = config.quant_method == "mxfp4" if settings.experts_mxfp4 is None else settings.experts_mxfp4
    by_component: dict[str, list[ParamGroup]] = {}
    for group in specs:
        by_component.setdefault(group.component, []).append(group)
    weights = [Row(comp, sum(g.count for g in groups), sum(g.nbytes for g in groups),
                   _split_label(groups, config, mesh),
                   sum(g.nbytes * mesh.share(g.spec(config, mesh)) for g in groups))
               for comp, groups in by_component.items()]
    requests = math.ceil(batch / mesh.data)
    tokens = math.ceil(context / BLOCK_TOKENS) * BLOCK_TOKENS
    shapes = cache_shapes(config, 1, 1, jnp.dtype(settings.dtype))
    runtime = []
    for name, array, per_unit, count, unit in (
            [(n, "latent" if "latent" in n else "index_keys", b, tokens, f"{b} B/tok")
             for n, b in cache_bytes_per_token(config, settings.dtype).items()]
            + [(n, "state" if "recurrent" in n else "conv", b, 1, f"{b / 2**20:.1f} MiB/req")
               for n, b in kda_state_bytes(config, settings.dtype).items()]):
        spec = sharding.cache_spec(array, shapes[array][0], config, mesh.abstract())
        split = "data (requests)" + ("" if not spec else f" × {_axes_label(spec)}")
        runtime.append(Row(name, 0, per_unit * count * batch, split,
                           per_unit * count * requests * mesh.share(spec), unit))
    space = workspace_bytes(config, mesh, mxfp4)
    if space:
        runtime.append(Row("fp8 expert workspace", 0, workspace_bytes(config, MeshShape(), mxfp4),
                           "expert", space, "1 MoE layer"))
    return MemoryPlan(config_name, mesh, context, batch, settings, weights, runtime, mxfp4)


def candidate_meshes(config: ModelConfig, batch: int, settings: PlanSettings = PlanSettings()) -> list[MeshShape]:
    """Meshes the search tries: tensor a power of two up to `max_tensor`, expert a divisor of the expert count,
    data a divisor of the batch, at most `max_devices` devices; fewest devices first."""
    experts = [e for e in range(1, config.num_experts + 1) if config.num_experts % e == 0] or [1]
    datas = [d for d in range(1, batch + 1) if batch % d == 0]
    tensors = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= settings.max_tensor]
    meshes = [MeshShape(d, e, t) for d in datas for e in experts for t in tensors
              if d * e * t <= settings.max_devices]
    return sorted(meshes, key=lambda m: (m.devices, m.data, -m.tensor))


def smallest_fit(config: ModelConfig, context: int, batch: int, settings: PlanSettings = PlanSettings(),
                 specs: list[ParamGroup] | None = None, config_name: str = "model") -> MemoryPlan | None:
    """The plan on the fewest devices that fits (ties: the most headroom), or None when no candidate fits."""
    specs = param_specs(config, settings) if specs is None else specs
    best = None
    for mesh in candidate_meshes(config, batch, settings):
        if best is not None and mesh.devices > best.mesh.devices:
            break
        plan = plan_memory(config, mesh, context, batch, settings, specs, config_name)
        if plan.fits and (best is None or plan.per_device < best.per_device):
            best = plan
    return best


def load_config(name: str) -> ModelConfig:
    """A preset name, a checkpoint directory or a config.json."""
    if name in PRESETS:
        return get_preset(name)
    if os.path.exists(name):
        return ModelConfig.from_pretrained(name)
    raise ValueError(f"{name!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a checkpoint dir/config.json")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dayzero-plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="preset name (" + ", ".join(sorted(PRESETS)) + ") or checkpoint dir/config.json")
    parser.add_argument("--mesh", help="e.g. expert=8,tensor=8,data=1 (default: the smallest mesh that fits)")
    parser.add_argument("--context", type=int, default=131072, help="tokens per request")
    parser.add_argument("--batch", type=int, default=16, help="concurrent requests")
    parser.add_argument("--experts", choices=("auto", "mxfp4", "bf16"), default="auto",
                        help="routed expert storage (auto: MXFP4 when the config's quant_method is mxfp4)")
    parser.add_argument("--dtype", default="bfloat16", help="dense param and cache dtype")
    parser.add_argument("--device-gb", type=float, default=H200_BYTES / 1e9, help="memory per device, GB (H200: 141)")
    parser.add_argument("--usable", type=float, default=0.9, help="usable fraction of device memory")
    parser.add_argument("--max-tensor", type=int, default=8, help="largest tensor-parallel size (within a node)")
    parser.add_argument("--max-devices", type=int, default=4096, help="largest device count the search tries")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.model)
        mesh = MeshShape.parse(args.mesh) if args.mesh else None
        settings = PlanSettings(args.dtype, {"auto": None, "mxfp4": True, "bf16": False}[args.experts],
                                args.device_gb * 1e9, args.usable, args.max_tensor, args.max_devices)
        if args.context < 1 or args.batch < 1 or not 0 < args.usable <= 1:
            raise ValueError("--context and --batch must be positive and --usable in (0, 1]")
    except (DayzeroError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = os.path.basename(os.path.normpath(args.model))
    specs = param_specs(config, settings)
    best = smallest_fit(config, args.context, args.batch, settings, specs, name)
    shown = plan_memory(config, mesh, args.context, args.batch, settings, specs, name) if mesh else best
    if shown is not None:
        print(shown.format())
    if best is None:
        print(f"smallest fit: none of the meshes up to {settings.max_devices} devices (tensor <= {settings.max_tensor})"
              f" holds it in {settings.capacity / 1e9:.1f} GB per device")
    else:
        print(f"smallest fit: {best.mesh.devices} x {settings.device_bytes / 1e9:g} GB devices, mesh {best.mesh} "
              f"({best.per_device / 1e9:.1f} GB per device of {settings.capacity / 1e9:.1f} usable)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
