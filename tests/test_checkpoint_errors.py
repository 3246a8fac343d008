"""Bad checkpoints raise typed errors that name what is wrong, all problems at once."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tiny_checkpoints import rewrite_config
from dayzero.model import CheckpointError, ConfigError, load_checkpoint


def _copy(checkpoints, tmp_path, kind="deepseek_v32"):
    path = tmp_path / kind
    shutil.copytree(checkpoints[kind], path)
    return path


def _edit_tensors(path, edit):
    from safetensors.torch import load_file, save_file

    file = str(path / "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_named(checkpoints, tmp_path):
    path = _copy(checkpoints, tmp_path)
    _edit_tensors(path, lambda t: t.pop("model.layers.1.self_attn.indexer.wk.weight"))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, progress=False)
    assert any("model.layers.1.self_attn.indexer.wk.weight" in p and "missing" in p for p in info.value.problems)


def test_all_problems_reported_together(checkpoints, tmp_path):
    import torch

    path = _copy(checkpoints, tmp_path)

    def edit(t):
        t.pop("model.norm.weight")
        t.pop("model.layers.2.mlp.experts.5.up_proj.weight")
        t["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(7, 7)
        t["model.layers.0.self_attn.surprise.weight"] = torch.zeros(3)
        t["model.layers.1.mlp.gate.weight"] = torch.zeros(t["model.layers.1.mlp.gate.weight"].shape,
                                                          dtype=torch.int32)

    _edit_tensors(path, edit)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, progress=False)
    text = "\n".join(info.value.problems)
    assert "missing tensor 'model.norm.weight'" in text
    assert "model.layers.2.mlp.experts.{5}.up_proj.weight" in text
    assert "shape mismatch: 'model.layers.0.self_attn.kv_b_proj.weight' is [7, 7]" in text
    assert "unexpected tensor 'model.layers.0.self_attn.surprise.weight'" in text
    assert "dtype mismatch: 'model.layers.1.mlp.gate.weight' is I32" in text
    assert len(info.value.problems) == 5
    assert str(info.value).count("\n") >= 5  # the message lists them


def test_truncated_file(checkpoints, tmp_path):
    path = _copy(checkpoints, tmp_path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path, progress=False)


def test_corrupt_header(checkpoints, tmp_path):
    path = _copy(checkpoints, tmp_path)
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:40] = b"\x00garbage that is not json at all"
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path, progress=False)


def test_no_weights_at_all(checkpoints, tmp_path):
    path = _copy(checkpoints, tmp_path)
    os.remove(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(path, progress=False)


def test_missing_shard(tmp_path, checkpoints):
    path = _copy(checkpoints, tmp_path)
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}, f)
    with pytest.raises(CheckpointError, match="missing file: model-00002-of-00002.safetensors"):
        load_checkpoint(path, progress=False)


def test_fp8_weight_without_scale(checkpoints, tmp_path):
    import torch

    path = _copy(checkpoints, tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    _edit_tensors(path, lambda t: t.__setitem__(name, t[name].to(torch.float8_e4m3fn)))
    rewrite_config(str(path), lambda c: c.update(quantization_config={"quant_method": "fp8",
                                                                      "weight_block_size": [16, 16]}))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, progress=False)
    assert any(name in p and "weight_scale_inv" in p for p in info.value.problems)


def test_unknown_model_type(checkpoints, tmp_path):
    path = _copy(checkpoints, tmp_path)
    rewrite_config(str(path), lambda c: c.update(model_type="llama_but_new"))
    with pytest.raises(ConfigError) as info:
        load_checkpoint(path, progress=False)
    assert info.value.field == "model_type" and "llama_but_new" in str(info.value)


def test_bad_token_ids_rejected_model_keeps_working(checkpoints):
    from dayzero.model import RequestError

    model = load_checkpoint(checkpoints["kimi_linear"], dtype="float32", progress=False)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        model(np.array([[1, 2, 10_000]]))
    with pytest.raises(ConfigError, match="no vision tower"):
        model(np.array([[1, 2]]), pixel_values=np.zeros((1, 3)))
    assert np.isfinite(np.asarray(model(np.array([[1, 2, 3]])))).all()
