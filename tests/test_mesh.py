"""Sharded models on 8 CPU devices equal one device (tests/mesh_checks.py, run in two child processes at once: the
device count must be set before JAX starts, and the two groups of compilations use both cores).

The children compile with XLA's backend optimisations off (compile time only: the same flags hold for the
one-device references they compare against)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tiny_checkpoints import build_hf_model, save_hf_model

HERE = os.path.dirname(os.path.abspath(__file__))
FLAGS = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
         "--xla_llvm_disable_expensive_passes=true")
TIMEOUT_S = 600


def _start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {FLAGS}".strip(), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, os.path.join(HERE, "mesh_checks.py"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        return -1, out, err + f"\ntimed out after {TIMEOUT_S} s"
    return process.returncode, out, err


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    """{group: (returncode, stdout, stderr)}: the "models" child starts at once; the "checkpoint" child once a tiny
    deepseek_v32 (4 heads so that tensor=4 divides them, 8 experts, 2 layers) is saved by transformers."""
    models = _start("models")
    try:
        path = tmp_path_factory.mktemp("mesh") / "deepseek_v32"
        save_hf_model(build_hf_model("deepseek_v32", num_attention_heads=4, num_key_value_heads=4,
                                     num_hidden_layers=2), path)
        checkpoint = _start("checkpoint", str(path))
    except BaseException:
        models.kill()
        raise
    return {"models": _finish(models), "checkpoint": _finish(checkpoint)}


def _ok_lines(run, group: str) -> list[str]:
    code, out, err = run[group]
    print(out)
    assert code == 0, f"mesh_checks.py {group} failed ({code}):\n{out}\n{err[-6000:]}"
    return [line for line in out.splitlines() if line.startswith("ok ")]


def test_hybrid_logits_on_meshes(mesh_runs):
    """Tiny KDA + MLA/DSA + MoE hybrid: fp32 experts on expert=8, expert=2 x tensor=4, data=2 x expert=4, MXFP4
    experts on expert=2 x tensor=4, the attention projections in the layout other than the default
    (`model.linear.WEIGHT_ROWS`) on expert=2 x tensor=4; every param on its rule's sharding; logits within 1e-5 of
    one device."""
    lines = _ok_lines(mesh_runs, "models")
    assert sum("hybrid fp32 logits" in line for line in lines) == 3, lines
    assert sum("hybrid mxfp4 logits" in line for line in lines) == 1, lines
    assert sum("hybrid in-out logits" in line for line in lines) == 1, lines  # the [in, out] layout
    assert any("fall back to replicated" in line for line in lines), lines


def test_engine_greedy_on_mesh(mesh_runs):
    """The Engine on expert=2 x tensor=4 (KDA state sharded over heads) generates the one-device greedy tokens."""
    lines = _ok_lines(mesh_runs, "models")
    assert any(line.startswith("ok engine greedy") for line in lines), lines


def test_load_checkpoint_on_meshes(mesh_runs):
    """deepseek_v32 via load_checkpoint(mesh=): params straight on their shardings, logits within 1e-5, for the
    fp32 checkpoint on two meshes and its MXFP4 conversion on expert=8."""
    lines = _ok_lines(mesh_runs, "checkpoint")
    assert sum("deepseek_v32 load_checkpoint" in line for line in lines) == 2, lines
    assert sum("deepseek_v32 mxfp4 load_checkpoint" in line for line in lines) == 1, lines


def test_generate_cli_with_mesh(mesh_runs):
    lines = _ok_lines(mesh_runs, "checkpoint")
    assert any(line.startswith("ok dayzero-generate --mesh") for line in lines), lines


def test_mesh_options_checked():
    """--mesh syntax and device counts are checked, naming the field (no devices beyond this process's needed)."""
    from dayzero.model import ConfigError, sharding

    assert sharding.parse_mesh("expert=2, tensor=4") == {"expert": 2, "tensor": 4}
    assert sharding.parse_mesh("") == {}
    for bad in ("expert", "pipeline=2", "tensor=0", "data=two"):
        with pytest.raises(ConfigError) as info:
            sharding.parse_mesh(bad)
        assert info.value.field == "mesh"
    with pytest.raises(ConfigError, match="needs 4096 devices"):
        sharding.make_mesh(expert=4096)
    mesh = sharding.make_mesh()
    assert dict(mesh.shape) == {"data": 1, "expert": 1, "tensor": 1}
