"""INT4 checkpoints in compressed-tensors' `pack-quantized` format (Moonshot's Kimi K2-Thinking / K2.5 routed
experts): packed by the compressed-tensors package itself (the oracle), loaded by dayzero with the experts
dequantized, equal to compressed-tensors' own unpacking; typed errors for schemes and tensors it does not take."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from tiny_checkpoints import SEQ_LEN, rewrite_config
from dayzero.model import CheckpointError, ConfigError, load_checkpoint
from dayzero.model.config import ModelConfig
from dayzero.model.safetensors_io import open_checkpoint_files, save_file

GROUP = 16  # the tiny experts' widths (40, 24) are not multiples of it: partial groups at the row ends


def quantization_config(**weights) -> dict:
    scheme = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP, **weights}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme, "format": "pack-quantized"}},
            "ignore": ["lm_head"]}


def int4_checkpoint(src: str, out, twin=None) -> dict[str, np.ndarray]:
    """A copy of `src` whose routed experts are packed INT4 with bf16 group scales (and, in `twin`, the same checkpoint
    with those experts as the float32 values compressed-tensors unpacks them to). Returns {weight name: values}."""
    shutil.copytree(src, out)
    if twin is not None:
        shutil.copytree(src, twin)
    files = open_checkpoint_files(src)
    packed, plain, values = {}, {}, {}
    for name, f in files.items():
        w = f.read(name)
        plain[name] = packed[name] = w
        if ".experts." not in name or not name.endswith("_proj.weight"):
            continue
        out_dim, in_dim = w.shape
        groups = -(-in_dim // GROUP)
        padded = np.zeros((out_dim, groups * GROUP), np.float32)
        padded[:, :in_dim] = w
        scale = (np.abs(padded.reshape(out_dim, groups, GROUP)).max(axis=2) / 7.5).astype(ml_dtypes.bfloat16)
        factors = np.repeat(scale.astype(np.float32), GROUP, axis=1)[:, :in_dim]
        q = np.clip(np.round(w / factors), -8, 7).astype(np.int8)
        del packed[name]
        base = name[:-len(".weight")]
        packed[base + ".weight_packed"] = pack_to_int32(torch.from_numpy(q), 4).numpy()
        packed[base + ".weight_scale"] = scale
        packed[base + ".weight_shape"] = np.asarray([out_dim, in_dim], np.int64)
        unpacked = unpack_from_int32(torch.from_numpy(packed[base + ".weight_packed"]), 4, torch.Size(w.shape))
        values[name] = plain[name] = unpacked.numpy().astype(np.float32) * factors
    save_file(os.path.join(out, "model.safetensors"), packed)
    rewrite_config(str(out), lambda c: c.update(quantization_config=quantization_config()))
    if twin is not None:
        save_file(os.path.join(twin, "model.safetensors"), plain)
    return values


def test_int4_experts_load_as_compressed_tensors_unpacks_them(checkpoints, tmp_path):
    values = int4_checkpoint(checkpoints["deepseek_v3"], tmp_path / "int4", tmp_path / "twin")
    assert len(values) >= 3 * 8  # three projections of 8 experts, at least one MoE layer
    model = load_checkpoint(tmp_path / "int4", dtype="float32", progress=False)
    assert model.config.packed_int == (4, GROUP)
    for name, want in values.items():  # model.layers.L.mlp.experts.E.P_proj.weight
        parts = name.split(".")
        layer, expert, proj = int(parts[2]), int(parts[5]), parts[6][:-len("_proj")]
        got = np.asarray(model.params[f"layers_{layer}"]["mlp"]["experts"][f"w_{proj}"][expert])
        np.testing.assert_array_equal(got, want.T, err_msg=name)
    ids = np.random.default_rng(0).integers(3, model.config.vocab_size, (2, SEQ_LEN))
    twin = load_checkpoint(tmp_path / "twin", dtype="float32", progress=False)
    np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(twin(ids)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change, field", [
    (dict(symmetric=False), "weights.symmetric"),
    (dict(strategy="channel"), "weights.strategy"),
    (dict(num_bits=3), "weights.num_bits"),
    (dict(type="float"), "weights.type"),
])
def test_unsupported_schemes_name_the_field(checkpoints, change, field):
    with open(os.path.join(checkpoints["deepseek_v3"], "config.json")) as f:
        raw = {**json.load(f), "quantization_config": quantization_config(**change)}
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict(raw)
    assert field in str(info.value), str(info.value)


def test_mismatched_packed_tensors_are_named(checkpoints, tmp_path):
    int4_checkpoint(checkpoints["deepseek_v3"], tmp_path / "int4")
    path = tmp_path / "int4" / "model.safetensors"
    files = open_checkpoint_files(str(tmp_path / "int4"))
    tensors = {name: f.read(name) for name, f in files.items()}
    victim = next(n for n in sorted(tensors) if n.endswith("experts.0.down_proj.weight_packed"))
    tensors[victim] = tensors[victim][:, :-1]  # one word short
    del tensors[victim.replace("0.down_proj.weight_packed", "1.down_proj.weight_scale")]  # a scale gone
    save_file(str(path), tensors)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "int4", progress=False)
    text = str(info.value)
    assert victim in text and "shape mismatch" in text, text
    assert victim.replace("0.down_proj.weight_packed", "1.down_proj.weight_scale") in text, text


def test_weight_shape_that_disagrees_is_named(checkpoints, tmp_path):
    int4_checkpoint(checkpoints["deepseek_v3"], tmp_path / "int4")
    files = open_checkpoint_files(str(tmp_path / "int4"))
    tensors = {name: f.read(name) for name, f in files.items()}
    victim = next(n for n in sorted(tensors) if n.endswith("experts.2.up_proj.weight_shape"))
    tensors[victim] = tensors[victim] + 1
    save_file(str(tmp_path / "int4" / "model.safetensors"), tensors)
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        load_checkpoint(tmp_path / "int4", progress=False)
    assert json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]["format"] \
        == "pack-quantized"
