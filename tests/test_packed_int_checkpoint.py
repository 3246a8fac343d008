"""INT4 checkpoints in compressed-tensors' `pack-quantized` format (Moonshot's Kimi K2-Thinking / K2.5 routed
experts): packed by the compressed-tensors package itself (the oracle), loaded by dayzero with the experts
dequantized, equal to compressed-tensors' own unpacking; typed errors for schemes and tensors it does not take."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from flax import traverse_util

from tiny_checkpoints import INT4_GROUP as GROUP, SEQ_LEN, int4_checkpoint, int4_quantization_config
from dayzero.model import CheckpointError, ConfigError, load_checkpoint
from dayzero.model.config import ModelConfig
from dayzero.model.safetensors_io import open_checkpoint_files, save_file

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
        raw = {**json.load(f), "quantization_config": int4_quantization_config(**change)}
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
    stray = victim.replace("experts.0.", "experts.99.")  # an expert the model does not have
    tensors[stray] = tensors[victim.replace("experts.0.", "experts.2.")]
    save_file(str(path), tensors)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "int4", progress=False)
    text = str(info.value)
    assert victim in text and "shape mismatch" in text, text
    assert victim.replace("0.down_proj.weight_packed", "1.down_proj.weight_scale") in text, text
    assert f"'{stray}': expert 99 is outside" in text, text


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


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_unpacked_on_the_device_as_on_the_host(checkpoints, tmp_path, dtype):
    """The experts travel as packed words and scales (`PackedIntWords`) and are unpacked on the device: the params
    equal the host's unpacking (`stream_params`, which dayzero-convert uses) bit for bit."""
    from dayzero.model.checkpoint import PackedIntWords, stream_params, stream_stored
    from dayzero.model.model import expected_params, resolve_dtype

    int4_checkpoint(checkpoints["deepseek_v3"], tmp_path / "int4")
    config = ModelConfig.from_pretrained(tmp_path / "int4")
    expected = expected_params(config, resolve_dtype(dtype, config))
    device_side = {path for path, host, _ in stream_stored(str(tmp_path / "int4"), config, expected, progress=False)
                   if isinstance(host, PackedIntWords)}
    assert ("layers_1", "mlp", "experts", "w_down") in device_side, sorted(device_side)
    ours = traverse_util.flatten_dict(load_checkpoint(tmp_path / "int4", dtype=dtype, progress=False).params)
    for path, host in stream_params(str(tmp_path / "int4"), config, expected, progress=False):
        assert ours[path].dtype == host.dtype and ours[path].shape == host.shape, path
        np.testing.assert_array_equal(np.asarray(ours[path]), host, err_msg=str(path))
