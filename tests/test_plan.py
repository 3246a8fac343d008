"""dayzero-plan: component bytes equal real params, sharding divides them, cache formulas equal real allocations,
the smallest-fit search is minimal, and the CLI prints the table."""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest
from flax import traverse_util

from dayzero.model import Model
from dayzero.model.cache import init_cache
from dayzero.model.plan import (MeshShape, PlanSettings, cache_bytes_per_token, candidate_meshes, kda_state_bytes,
                                main, param_specs, plan_memory, smallest_fit)
from dayzero.model.presets import component_of, medium_hybrid, tiny


def _actual_bytes(config) -> dict[str, int]:
    params = traverse_util.flatten_dict(Model.random(config, "bfloat16").params)
    out: dict[str, int] = {}
    for path, leaf in params.items():
        out[component_of(path)] = out.get(component_of(path), 0) + leaf.nbytes
    return out


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_component_bytes_equal_real_params(experts):
    config = tiny() if experts == "bf16" else tiny().replace(quant_method="mxfp4")
    plan = plan_memory(config, MeshShape(), context=64, batch=1)
    rows = {r.component: r for r in plan.weights}
    assert {k: int(r.total_bytes) for k, r in rows.items()} == _actual_bytes(config)
    assert all(r.per_device == r.total_bytes for r in plan.weights)
    assert ("routed experts" in rows) and rows["routed experts"].total_bytes > 0


def test_expert_and_tensor_axes_divide_what_they_split():
    """The plan follows dayzero.model.sharding: expert splits routed experts; tensor splits heads (3 in tiny), the
    dense MLP (80) and shared experts (20) and lm_head's vocab (320) where it divides them; data splits no param."""
    config = tiny()
    whole = {r.component: r.per_device for r in plan_memory(config, MeshShape(), 64, 1).weights}
    for e in (2, 3, 6):
        rows = {r.component: r.per_device for r in plan_memory(config, MeshShape(expert=e), 64, 1).weights}
        assert rows["routed experts"] == pytest.approx(whole["routed experts"] / e)
        assert {k: v for k, v in rows.items() if k != "routed experts"} == \
            {k: v for k, v in whole.items() if k != "routed experts"}
    two = {r.component: r.per_device for r in plan_memory(config, MeshShape(tensor=2), 64, 1).weights}
    for comp in ("dense mlp", "shared experts", "lm_head"):
        assert two[comp] == pytest.approx(whole[comp] / 2), comp
    for comp in ("routed experts", "attention", "embedding", "norms", "router"):  # 3 heads do not split in 2
        assert two[comp] == whole[comp], comp
    three = {r.component: r.per_device for r in plan_memory(config, MeshShape(tensor=3), 64, 1).weights}
    assert whole["attention"] / 3 < three["attention"] < whole["attention"]  # heads split, latent A's not
    assert three["dense mlp"] == whole["dense mlp"]  # 80 does not split in 3: replicated, as sharding places it
    replicas = {r.component: r.per_device for r in plan_memory(config, MeshShape(data=4), 64, 1).weights}
    assert replicas == whole


@pytest.mark.parametrize("index_fp8", [False, True])
def test_cache_formulas_equal_real_allocations(index_fp8):
    config = tiny().replace(index_fp8=index_fp8)
    blocks, slots = 3, 5
    cache = init_cache(config, blocks, slots, jnp.bfloat16)
    paged = sum(cache[k].nbytes for k in ("latent", "index_keys", "index_scales") if k in cache)
    assert sum(cache_bytes_per_token(config, "bfloat16").values()) * blocks * 64 == paged
    state = cache["conv"].nbytes + cache["state"].nbytes
    assert sum(kda_state_bytes(config, "bfloat16").values()) * slots == state
    plan = plan_memory(config, MeshShape(data=2), context=100, batch=4)
    latent = next(r for r in plan.runtime if r.component == "mla latent cache")
    assert latent.per_device == cache["latent"].nbytes / (blocks * 64) * 128 * 2  # 2 blocks, 2 requests
    split = plan_memory(config, MeshShape(tensor=3), context=100, batch=4)
    kda = next(r for r in split.runtime if r.component == "kda recurrent state")
    assert kda.per_device == cache["state"].nbytes / slots * 4 / 3  # 4 requests, 3 heads over tensor=3
    assert next(r for r in split.runtime if r.component == "mla latent cache").per_device == \
        cache["latent"].nbytes / (blocks * 64) * 128 * 4  # replicated over tensor


def test_smallest_fit_is_minimal():
    config = medium_hybrid()
    settings = PlanSettings(device_bytes=9e9)  # ~10 GB of bf16 weights + ~10 GB of cache: needs several devices
    specs = param_specs(config, settings)
    best = smallest_fit(config, 131072, 16, settings, specs)
    assert best is not None and best.fits and best.per_device <= settings.capacity and best.mesh.devices > 1
    fewer = [m for m in candidate_meshes(config, 16, settings) if m.devices < best.mesh.devices]
    assert fewer
    assert not any(plan_memory(config, m, 131072, 16, settings, specs).fits for m in fewer)
    assert smallest_fit(config, 131072, 16, PlanSettings(device_bytes=1e6), specs) is None


def test_mesh_parse():
    assert MeshShape.parse("expert=8,tensor=8,data=1") == MeshShape(1, 8, 8)
    assert MeshShape.parse("tensor=4").devices == 4
    with pytest.raises(ValueError, match="pipeline"):
        MeshShape.parse("pipeline=2")


def test_cli_k3_3t(capsys):
    assert main(["k3_3t", "--mesh", "expert=8,tensor=8,data=1", "--context", "131072", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    print(out)
    for needle in ("routed experts", "mla latent cache", "dsa indexer key cache", "kda recurrent state",
                   "fp8 expert workspace", "= total per device", "routed experts MXFP4", "smallest fit:"):
        assert needle in out, needle
    total = float(re.search(r"= total per device\s+([\d.]+)", out)[1])
    weights = float(re.search(r"= weights\s+[\d.]+ B\s+[\d.]+\s+([\d.]+)", out)[1])
    assert 0 < weights < total
    devices = int(re.search(r"smallest fit: (\d+) x", out)[1])
    assert 16 <= devices <= 256
    assert main(["k3_3t", "--mesh", "pipeline=2"]) == 2
