"""dayzero-convert: hub checkpoints -> orbax, restored by load_checkpoint bit-identical to the hub load (kimi_linear,
deepseek_v32 with MXFP4 experts, deepseek_v3 with FP8 weights), onto meshes, with typed errors for broken dirs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import traverse_util

from tiny_checkpoints import SEQ_LEN, fp8_checkpoint, rewrite_config
from dayzero.model import CheckpointError, load_checkpoint
from dayzero.model.convert import MARKER, PARAMS_DIR, convert_checkpoint, is_converted, main, restore_converted
from dayzero.model.quantize import quantize_checkpoint


def _ids(seed, vocab):
    return np.random.default_rng(seed).integers(3, vocab, (2, SEQ_LEN))


def assert_same_params(ours, ref):
    a, b = traverse_util.flatten_dict(ours.params), traverse_util.flatten_dict(ref.params)
    assert a.keys() == b.keys()
    for path in a:
        assert a[path].dtype == b[path].dtype, path
        np.testing.assert_array_equal(np.asarray(a[path]), np.asarray(b[path]), err_msg=str(path))


def test_kimi_linear_round_trip(checkpoints, tmp_path, seed):
    """Small items force many orbax items; params and logits are bit-identical to the hub load, the dir is
    self-contained, and a 1-device mesh receives every param."""
    src, out = checkpoints["kimi_linear"], tmp_path / "conv"
    report = convert_checkpoint(src, out, item_bytes=16 << 10, progress=False)
    assert report.items > 5 and report.dtype == "float32" and is_converted(out) and not is_converted(src)
    assert os.path.isfile(out / "generation_config.json") and not list(out.glob("*.safetensors"))
    marker = json.loads((out / MARKER).read_text())
    assert marker["format"] == "dayzero-orbax" and marker["version"] == 1 and marker["dtype"] == "float32"
    hub = load_checkpoint(src, progress=False)
    conv = load_checkpoint(out, progress=False)
    assert_same_params(conv, hub)
    ids = _ids(seed, 200)
    np.testing.assert_array_equal(np.asarray(conv(ids)), np.asarray(hub(ids)))
    chunks = _stored_chunks(out)
    experts = [c for p, c in chunks.items() if p[-2:-1] == ("experts",)]
    assert len(experts) == 9 and all(c[0] == 1 for c in experts)  # an expert shard reads its experts only
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    placed = load_checkpoint(out, mesh=mesh, progress=False)
    for leaf in jax.tree_util.tree_leaves(placed.params):
        assert isinstance(leaf.sharding, jax.sharding.NamedSharding) and leaf.sharding.mesh == mesh
    assert_same_params(placed, hub)


def _stored_chunks(out) -> dict:
    """{param path: storage chunk shape} from orbax's metadata of every item."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    chunks = {}
    for item in sorted(os.listdir(out / PARAMS_DIR)):
        meta = checkpointer.metadata(str(out / PARAMS_DIR / item))
        tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
        chunks.update({p: tuple(m.storage.chunk_shape) for p, m in traverse_util.flatten_dict(tree).items()})
    return chunks


def test_dtype_option_and_cast_on_restore(checkpoints, tmp_path):
    """--dtype bfloat16 stores bf16 and declares it, so the default load is bf16 and equals the hub load at bf16;
    restoring at float32 casts exactly."""
    src, out = checkpoints["kimi_linear"], tmp_path / "bf16"
    assert main(["--model", src, "--out", str(out), "--dtype", "bfloat16", "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    conv = load_checkpoint(out, progress=False)
    assert conv.dtype == np.dtype(ml_dtypes.bfloat16)
    hub = load_checkpoint(src, dtype="bfloat16", progress=False)
    assert_same_params(conv, hub)
    up = load_checkpoint(out, dtype="float32", progress=False)
    a, b = traverse_util.flatten_dict(up.params), traverse_util.flatten_dict(hub.params)
    for path in a:
        want = np.asarray(b[path]).astype(np.float32) if b[path].dtype == ml_dtypes.bfloat16 else np.asarray(b[path])
        assert a[path].dtype == want.dtype, path
        np.testing.assert_array_equal(np.asarray(a[path]), want)


def test_deepseek_v32_mxfp4_experts_stay_packed(checkpoints, tmp_path, seed):
    packed = tmp_path / "mxfp4"
    quantize_checkpoint(checkpoints["deepseek_v32"], str(packed))
    convert_checkpoint(packed, tmp_path / "conv", progress=False)
    hub = load_checkpoint(packed, progress=False)
    conv = load_checkpoint(tmp_path / "conv", progress=False)
    blocks = conv.params["layers_1"]["mlp"]["experts"]["w_gate_blocks"]
    assert blocks.dtype == np.uint8 and blocks.ndim == 4
    assert_same_params(conv, hub)
    ids = _ids(seed, 200)
    np.testing.assert_array_equal(np.asarray(conv(ids)), np.asarray(hub(ids)))


@pytest.mark.usefixtures("in_out_layout")
def test_fp8_weights_are_stored_dequantized(checkpoints, tmp_path):
    fp8 = tmp_path / "fp8"
    assert fp8_checkpoint(checkpoints["deepseek_v3"], fp8) > 5
    report = convert_checkpoint(fp8, tmp_path / "conv", progress=False)
    assert report.dtype == "bfloat16"
    conv = load_checkpoint(tmp_path / "conv", progress=False)
    assert conv.params["layers_0"]["self_attn"]["o_proj"]["kernel"].dtype == ml_dtypes.bfloat16
    assert_same_params(conv, load_checkpoint(fp8, progress=False))


@pytest.mark.usefixtures("in_out_layout")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_experts_dequantized_on_the_device_as_on_the_host(checkpoints, tmp_path, dtype):
    """FP8 projections, routed experts included, travel to the device as float8 bytes with their block scales
    (`Fp8Blocks`) and are dequantized there: the params equal the host dequantization's (`stream_params`) bit for
    bit, and stay within e4m3's rounding of the float32 original."""
    from dayzero.model.checkpoint import Fp8Blocks, stream_params, stream_stored
    from dayzero.model.config import ModelConfig
    from dayzero.model.model import expected_params

    fp8 = tmp_path / "fp8"
    assert fp8_checkpoint(checkpoints["deepseek_v3"], fp8, block=16, experts=True) > 20
    config = ModelConfig.from_pretrained(fp8)
    expected = expected_params(config, np.dtype(getattr(ml_dtypes, dtype, None) or dtype))
    device_side = {path for path, host, _ in stream_stored(str(fp8), config, expected, progress=False)
                   if isinstance(host, Fp8Blocks)}
    assert ("layers_1", "mlp", "experts", "w_gate") in device_side and len(device_side) > 20, sorted(device_side)
    model = load_checkpoint(fp8, dtype=dtype, progress=False)
    ours = traverse_util.flatten_dict(model.params)
    for path, host in stream_params(str(fp8), config, expected, progress=False):
        assert ours[path].dtype == host.dtype and ours[path].shape == host.shape, path
        np.testing.assert_array_equal(np.asarray(ours[path]), host, err_msg=str(path))
    original = traverse_util.flatten_dict(load_checkpoint(checkpoints["deepseek_v3"], dtype="float32",
                                                          progress=False).params)
    for path in device_side:
        ref, got = original[path], np.asarray(ours[path]).astype(np.float32)
        assert np.abs(got - ref).max() <= 0.07 * np.abs(ref).max() + 1e-6, path  # e4m3: 3 mantissa bits


@pytest.fixture
def converted(checkpoints, tmp_path):
    out = tmp_path / "conv"
    convert_checkpoint(checkpoints["kimi_linear"], out, item_bytes=16 << 10, progress=False)
    return out


def _raises(path, *needles):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, progress=False)
    text = str(info.value)
    for needle in needles:
        assert needle in text, text
    return text


def test_missing_marker(converted):
    os.remove(converted / MARKER)
    _raises(converted, str(converted), MARKER)


def test_missing_item(converted):
    shutil.rmtree(converted / PARAMS_DIR / "00003")
    _raises(converted, str(converted / PARAMS_DIR / "00003"), "layers_")


def test_corrupt_item_data(converted):
    item = converted / PARAMS_DIR / "00000"
    data = [os.path.join(d, f) for d, _, fs in os.walk(item) for f in fs
            if os.path.basename(d) == "d"]
    assert data
    for file in data:
        with open(file, "r+b") as f:
            f.truncate(7)
    _raises(converted, str(item), "embed_tokens")


def test_config_mismatch_names_tensors(converted):
    rewrite_config(str(converted), lambda c: c.update(vocab_size=c["vocab_size"] + 1))
    text = _raises(converted, str(converted), "shape mismatch", "embed_tokens")
    assert "lm_head" in text


def test_stored_dtype_mismatch(converted):
    marker = json.loads((converted / MARKER).read_text())
    marker["dtype"] = "bfloat16"
    (converted / MARKER).write_text(json.dumps(marker))
    _raises(converted, "dtype mismatch", "is stored as float32")


def test_convert_refuses_an_occupied_dir(checkpoints, tmp_path, capsys):
    out = tmp_path / "conv"
    convert_checkpoint(checkpoints["kimi_linear"], out, progress=False)
    assert main(["--model", checkpoints["kimi_linear"], "--out", str(out), "--quiet"]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err


_SHARDED_RESTORE = textwrap.dedent("""
    import sys, jax, numpy as np
    from flax import traverse_util
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from dayzero.model import load_checkpoint
    from dayzero.model.config import ModelConfig
    from dayzero.model.convert import restore_converted
    hub_dir, conv_dir = sys.argv[1:3]
    assert jax.device_count() == 4
    mesh = Mesh(np.array(jax.devices()), ("x",))
    split = NamedSharding(mesh, P("x", None))
    rep = NamedSharding(mesh, P())
    params = restore_converted(conv_dir, ModelConfig.from_pretrained(conv_dir), None,
                               lambda path: split if path == ("lm_head",) else rep)
    hub = load_checkpoint(hub_dir, progress=False)
    want = np.asarray(hub.params["lm_head"])
    got = params[("lm_head",)]
    assert got.sharding == split and len(got.addressable_shards) == 4
    assert len({s.device for s in got.addressable_shards}) == 4
    for shard in got.addressable_shards:
        assert shard.data.shape == (want.shape[0] // 4, want.shape[1])
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    emb = params[("embed_tokens",)]
    assert emb.sharding == rep
    for shard in emb.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(hub.params["embed_tokens"]))
    from dayzero.model.sharding import make_mesh
    rules = make_mesh(expert=2, tensor=2)  # the sharding rules: experts split, MLP widths split, 3 heads replicated
    ours = traverse_util.flatten_dict(load_checkpoint(conv_dir, mesh=rules, progress=False).params)
    ref = traverse_util.flatten_dict(hub.params)
    split_params = 0
    for path, array in ours.items():
        assert array.sharding.mesh == rules, path
        split_params += array.sharding.spec != P()
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(ref[path])[shard.index])
    assert ours[("layers_1", "mlp", "experts", "w_gate")].sharding.spec == P("expert")
    assert split_params > 10
    print("SHARDS OK", len(params), split_params)
""")


def test_restore_onto_four_devices_each_reads_its_shard(checkpoints, converted):
    """In a fresh process with 4 CPU devices: lm_head split over the mesh, each device's shard its rows only; then
    load_checkpoint with an expert=2 x tensor=2 mesh places every param by the sharding rules, shards equal to the
    hub params' slices."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SHARDED_RESTORE, checkpoints["kimi_linear"], str(converted)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SHARDS OK" in proc.stdout


def test_restore_converted_direct(checkpoints, converted):
    """restore_converted returns every param by path, in the model's order, on the default device."""
    from dayzero.model.config import ModelConfig
    from dayzero.model.model import expected_params

    config = ModelConfig.from_pretrained(converted)
    params = restore_converted(converted, config)
    assert list(params) == list(expected_params(config, np.float32))
    assert all(len(a.devices()) == 1 for a in params.values())
