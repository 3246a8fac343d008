"""Sharded-model checks on 8 CPU devices, run as a child process by tests/test_mesh.py (the device count must be set
in XLA_FLAGS before JAX starts, which the parent test process cannot do for itself).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/mesh_checks.py models
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/mesh_checks.py checkpoint DSV32_CHECKPOINT_DIR

Checks, each against the same model on one device (fp32, max relative logits error <= 1e-5):
- a tiny KDA + MLA/DSA + MoE hybrid (`presets.tiny()` with 4 heads and 8 experts) on expert=8, expert=2 x tensor=4
  and data=2 x expert=4, with fp32 and MXFP4 experts;
- a tiny deepseek_v32 checkpoint saved by transformers, loaded with `load_checkpoint(mesh=)` (every param on its
  rule's sharding, spot-checked against the expected specs), as is, quantized to MXFP4, with FP8 projections
  (routed experts included) and with INT4 routed experts (compressed-tensors), dequantized on the devices as they
  load;
- the Engine's greedy output on a mesh (KDA state sharded over heads), and its cache shardings;
- the fallback of dims that do not divide the mesh (`presets.tiny()`: 3 heads, 6 experts).
Prints one "ok ..." line per check; any failure raises.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from dayzero.model import linear, load_checkpoint, sharding
from dayzero.model.config import LAYER_KDA, LAYER_MLA, MLP_DENSE, MLP_MOE
from dayzero.model.model import Model, expected_params
from dayzero.model.presets import tiny
from dayzero.model.quantize import quantize_checkpoint
from dayzero.serving import Engine, EngineConfig, SamplingParams
from tiny_checkpoints import fp8_checkpoint, int4_checkpoint  # tests/ (this script's folder)

TOLERANCE = 1e-5
MESHES = (dict(expert=8), dict(expert=2, tensor=4), dict(data=2, expert=4))
START = time.perf_counter()


def report(message: str) -> None:
    print(f"ok {message} ({time.perf_counter() - START:.1f} s)", flush=True)


def relative_error(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def numpy_params(config, seed: int) -> dict:
    """Random host params (numpy: no per-shape compilations), shaped as the model expects."""
    rng = np.random.default_rng(seed)
    flat = {}
    for path, leaf in expected_params(config, jnp.float32).items():
        name = path[-1]
        if name.endswith("_blocks"):
            value = rng.integers(0, 256, leaf.shape)
        elif name.endswith("_scales"):
            value = rng.integers(119, 122, leaf.shape)  # E8M0 2^-8 .. 2^-6: weights of spread ~0.02
        elif name == "A_log":
            value = np.log(rng.uniform(1.0, 16.0, leaf.shape))
        elif name == "weight" and len(leaf.shape) == 1:
            value = 1.0 + 0.1 * rng.normal(size=leaf.shape)
        else:
            value = rng.normal(0.0, 0.05 if len(leaf.shape) > 1 else 0.01, leaf.shape)
        flat[path] = np.asarray(value).astype(leaf.dtype)
    return traverse_util.unflatten_dict(flat)


def hybrid_config(**changes):
    """tiny() cut to two layers (KDA + dense MLP, MLA/DSA + MoE) with 4 heads and 8 experts, so tensor=4 and
    expert=8 divide them."""
    return tiny().replace(num_layers=2, layer_types=(LAYER_KDA, LAYER_MLA), mlp_types=(MLP_DENSE, MLP_MOE),
                          num_heads=4, kda_num_heads=4, num_experts=8, **changes)


def check_specs(model: Model, mesh) -> None:
    """Every param sits on the sharding its rule gives."""
    for path, leaf in traverse_util.flatten_dict(model.params).items():
        want = sharding.param_spec(path, leaf.shape, model.config, mesh)
        assert leaf.sharding.mesh == mesh and leaf.sharding.spec == want, (path, leaf.sharding, want)


def check_logits(name: str, config, params: dict, ids: np.ndarray, meshes) -> None:
    ref = np.asarray(Model(config, jax.tree.map(jnp.asarray, params), jnp.float32)(ids))
    for axes in meshes:
        mesh = sharding.make_mesh(**axes)
        model = Model(config, sharding.shard_params(params, config, mesh), jnp.float32, mesh=mesh)
        check_specs(model, mesh)
        err = relative_error(model(ids), ref)
        assert err <= TOLERANCE, (name, axes, err)
        report(f"{name} logits on {axes}: relative error {err:.2e}")


def check_hybrid(ids: np.ndarray) -> None:
    config = hybrid_config()
    check_logits("hybrid fp32", config, numpy_params(config, 0), ids, MESHES)
    config = hybrid_config(quant_method="mxfp4")
    check_logits("hybrid mxfp4", config, numpy_params(config, 1), ids, MESHES[1:2])
    default = linear.WEIGHT_ROWS  # the attention projections in the other layout too, split by its own rules
    linear.WEIGHT_ROWS = not default
    try:
        config = hybrid_config()
        check_logits(f"hybrid {'weight-rows' if linear.WEIGHT_ROWS else 'in-out'}", config, numpy_params(config, 2),
                     ids, MESHES[1:2])
    finally:
        linear.WEIGHT_ROWS = default


def check_checkpoint(path: str, ids: np.ndarray, meshes, expect_quantized: bool) -> None:
    single = load_checkpoint(path, dtype="float32", progress=False)
    ref = np.asarray(single(ids))
    for axes in meshes:
        mesh = sharding.make_mesh(**axes)
        model = load_checkpoint(path, dtype="float32", mesh=mesh, progress=False)
        check_specs(model, mesh)
        layer0, layer1 = model.params["layers_0"], model.params["layers_1"]
        experts = layer1["mlp"]["experts"]
        key = "w_gate_blocks" if expect_quantized else "w_gate"
        assert set(experts) >= {key}, sorted(experts)
        tensor = dict(mesh.shape)["tensor"]
        rows = linear.WEIGHT_ROWS  # the attention projections' layout: "weight" [out, in] or "kernel" [in, out]
        attention = lambda name: layer1["self_attn"][name]["weight" if rows else "kernel"]  # noqa: E731
        expected = [
            (experts[key], P("expert")),
            (layer1["self_attn"]["q_b_proj"]["kernel"], P(None, "tensor") if tensor > 1 else P()),
            (layer1["self_attn"]["kv_b_proj"]["kernel"], P(None, "tensor") if tensor > 1 else P()),
            (attention("o_proj"), (P(None, "tensor") if rows else P("tensor")) if tensor > 1 else P()),
            (attention("q_a_proj"), P()),
            (layer1["self_attn"]["indexer"]["wq_b"]["kernel"], P()),
            (layer1["mlp"]["gate"]["weight"], P()),
            (layer1["mlp"]["shared_experts"]["down_proj"]["kernel"], P("tensor") if tensor > 1 else P()),
            (layer0["mlp"]["gate_proj"]["kernel"], P(None, "tensor") if tensor > 1 else P()),
            (model.params["embed_tokens"], P()),
            (model.params["lm_head"], P()),  # vocab 211 does not divide: replicated
        ]
        for leaf, spec in expected:
            assert leaf.sharding.spec == spec, (leaf.shape, leaf.sharding.spec, spec)
        shard = experts[key].addressable_shards[0].data
        assert shard.shape[0] == experts[key].shape[0] // dict(mesh.shape)["expert"], shard.shape
        err = relative_error(model(ids), ref)
        assert err <= TOLERANCE, (path, axes, err)
        report(f"deepseek_v32 {os.path.basename(path)} load_checkpoint(mesh={axes}): shardings as "
               f"the rules say, logits relative error {err:.2e}")


def check_engine() -> None:
    config = hybrid_config()
    params = numpy_params(config, 2)
    prompts = [list(range(5, 17)), list(range(40, 47))]
    options = EngineConfig(max_num_seqs=2, max_model_len=64, max_prefill_tokens=64, max_prefill_rows=2,
                           decode_steps=4, num_snapshots=0, enable_prefix_caching=False)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    single = Engine(Model(config, jax.tree.map(jnp.asarray, params), jnp.float32), None, options)
    want = [o.token_ids for o in single.generate(prompt_token_ids=prompts, sampling_params=greedy)]
    mesh = sharding.make_mesh(expert=2, tensor=4)
    engine = Engine(Model(config, sharding.shard_params(params, config, mesh), jnp.float32, mesh=mesh), None, options)
    got = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling_params=greedy)]
    assert got == want and all(len(t) == 5 for t in got), (got, want)
    cache = engine.runner.cache
    assert cache["state"].sharding.spec == P(None, None, "tensor"), cache["state"].sharding
    assert cache["conv"].sharding.spec == P(None, None, None, "tensor"), cache["conv"].sharding
    assert cache["latent"].sharding.spec == P() and cache["index_keys"].sharding.spec == P()
    assert cache["state"].addressable_shards[0].data.shape[2] == config.kda_num_heads // 4
    report(f"engine greedy on expert=2 x tensor=4 equals one device: {got}")


def check_fallback() -> None:
    """tiny() has 3 heads and 6 experts: tensor=4 and expert=4 do not divide them, so those dims stay replicated
    (and the MoE runs without expert parallelism); expert=2 divides 6."""
    config = tiny()
    mesh = sharding.make_mesh(expert=4, tensor=2)
    shapes = expected_params(config, jnp.float32)
    spec = lambda path: sharding.param_spec(path, shapes[path].shape, config, mesh)  # noqa: E731
    assert spec(("layers_1", "mlp", "experts", "w_gate")) == P()
    assert sharding.expert_parallel_size(config, mesh) == 1
    mesh4 = sharding.make_mesh(expert=2, tensor=4)
    spec4 = lambda path: sharding.param_spec(path, shapes[path].shape, config, mesh4)  # noqa: E731
    assert sharding.expert_parallel_size(config, mesh4) == 2
    assert spec4(("layers_1", "mlp", "experts", "w_gate")) == P("expert")
    weight = "weight" if linear.WEIGHT_ROWS else "kernel"  # the attention projections' layout
    assert spec4(("layers_0", "self_attn", "q_proj", weight)) == P()  # 3 KDA heads
    assert spec4(("layers_1", "self_attn", "o_proj", weight)) == P()  # 3 MLA heads
    assert spec4(("layers_0", "mlp", "gate_proj", "kernel")) == P(None, "tensor")  # intermediate 80
    assert spec4(("lm_head",)) == P(None, "tensor")  # vocab 320
    assert spec(("layers_0", "self_attn", "A_log")) == P()  # 3 KDA heads over tensor=2
    assert spec(("layers_0", "mlp", "down_proj", "kernel")) == P("tensor")  # intermediate 80 over tensor=2
    report("dims that do not divide the mesh fall back to replicated")


def check_cli(path: str) -> None:
    """dayzero-generate --mesh: the checkpoint's greedy generations on expert=2 x tensor=4."""
    import json

    from dayzero.serving.cli import main as generate

    folder = os.path.dirname(os.path.abspath(path))
    prompts, results = os.path.join(folder, "prompts.jsonl"), os.path.join(folder, "generations.jsonl")
    with open(prompts, "w") as f:
        f.write(json.dumps({"prompt_token_ids": list(range(5, 14))}) + "\n")
    assert generate(["--model", path, "--input", prompts, "--output", results, "--mesh", "expert=2,tensor=4",
                     "--max-tokens", "3", "--dtype", "float32", "--max-model-len", "64", "--max-prefill-tokens", "64",
                     "--max-num-seqs", "1", "--decode-steps", "2", "--no-progress"]) == 0
    with open(results) as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == 1 and len(lines[0]["token_ids"]) == 3 and lines[0]["error"] is None, lines
    assert generate(["--model", path, "--input", prompts, "--mesh", "expert=16"]) == 2  # needs 16 devices
    report(f"dayzero-generate --mesh expert=2,tensor=4: {lines[0]['token_ids']}")


def main(argv: list[str]) -> None:
    """`models`: the hybrid's logits, the engine and the fallback; `checkpoint DIR`: the deepseek_v32 checkpoint."""
    assert len(jax.devices()) == 8, jax.devices()
    ids = np.random.default_rng(0).integers(3, 200, (2, 11))
    if argv[0] == "models":
        check_fallback()
        check_hybrid(ids)
        check_engine()
    elif argv[0] == "checkpoint":
        path = argv[1]
        check_checkpoint(path, ids, MESHES[1:], expect_quantized=False)
        quantized = os.path.join(os.path.dirname(os.path.abspath(path)), "mxfp4")
        quantize_checkpoint(path, quantized)
        check_checkpoint(quantized, ids, MESHES[:1], expect_quantized=True)
        fp8 = os.path.join(os.path.dirname(os.path.abspath(path)), "fp8")  # dequantized on the devices, sharded
        assert fp8_checkpoint(path, fp8, experts=True) > 20
        check_checkpoint(fp8, ids, MESHES[1:2], expect_quantized=False)
        int4 = os.path.join(os.path.dirname(os.path.abspath(path)), "int4")  # unpacked on the devices, sharded
        assert len(int4_checkpoint(path, int4)) > 20
        check_checkpoint(int4, ids, MESHES[1:2], expect_quantized=False)
        check_cli(path)
    else:
        raise SystemExit(f"unknown group {argv[0]!r}: models | checkpoint DIR")


if __name__ == "__main__":
    main(sys.argv[1:])
