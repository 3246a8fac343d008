"""`load_params` placing params in worker threads while the next are read (`model.checkpoint.LOAD_WORKERS`): the
same params as placing them in the reading thread, on the caller's default device and under its kernel policy, and a
placement that fails fails the load with its own error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dayzero.kernels import dispatch
from dayzero.model import ModelConfig, checkpoint
from dayzero.model.model import expected_params, resolve_dtype


def _load(path, workers, dtype=None):
    config = ModelConfig.from_pretrained(path)
    expected = expected_params(config, resolve_dtype(dtype, config))
    return expected, checkpoint.load_params(path, config, expected, progress=False, workers=workers)


@pytest.mark.parametrize("kind", ["deepseek_v32", "kimi_linear"])
def test_workers_place_the_same_params(checkpoints, kind):
    expected, alone = _load(str(checkpoints[kind]), workers=0)
    _, threaded = _load(str(checkpoints[kind]), workers=3)
    assert list(threaded) == list(expected)  # every param, in the model's order
    projections = 0
    for path, want in expected.items():
        got = threaded[path]
        assert got.shape == want.shape and got.dtype == want.dtype, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(alone[path]), err_msg=str(path))
        projections += path[-1] == "kernel" or path[-1] in checkpoint.EXPERT_PARAMS
    assert projections > 10  # the device-transposed kind is among them


def test_a_failed_placement_fails_the_load(checkpoints, monkeypatch):
    place = checkpoint._place_param
    calls = []

    def failing(host, as_published, sharding, dtype):
        calls.append(as_published)
        if len(calls) == 5:
            raise RuntimeError("placement 5 failed")
        return place(host, as_published, sharding, dtype)

    monkeypatch.setattr(checkpoint, "_place_param", failing)
    with pytest.raises(RuntimeError, match="placement 5 failed"):
        _load(str(checkpoints["deepseek_v32"]), workers=3)
    # the load stopped within its window: placement 5 is awaited once placements 6 and 7 are queued, later ones never
    assert 5 <= len(calls) <= 7
    config = ModelConfig.from_pretrained(str(checkpoints["deepseek_v32"]))
    assert len(expected_params(config, resolve_dtype(None, config))) > 20


_ON_THE_SECOND_DEVICE = textwrap.dedent("""
    import sys, jax
    from dayzero.model import load_checkpoint
    assert jax.device_count() == 2
    second = jax.devices()[1]
    with jax.default_device(second):
        model = load_checkpoint(sys.argv[1], progress=False)
    leaves = jax.tree_util.tree_leaves(model.params)
    elsewhere = [leaf.devices() for leaf in leaves if leaf.devices() != {second}]
    assert not elsewhere, elsewhere[:3]
    print("ALL ON", second, len(leaves))
""")


def test_workers_place_on_the_callers_default_device(checkpoints):
    """In a fresh process with 2 CPU devices: a load under `jax.default_device(devices[1])` (as
    `load_checkpoint(platform=)` makes it) puts every param there, though worker threads place them (JAX's default
    device is a per-thread setting)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _ON_THE_SECOND_DEVICE, checkpoints["deepseek_v32"]],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ALL ON" in proc.stdout


def test_workers_see_the_callers_kernel_policy(checkpoints, monkeypatch):
    place = checkpoint._place_param
    seen = []

    def spying(host, as_published, sharding, dtype):
        seen.append(dispatch.active_policy())
        return place(host, as_published, sharding, dtype)

    monkeypatch.setattr(checkpoint, "_place_param", spying)
    policy = {"cpu": [sorted(dispatch.KERNELS)[0]]}
    with dispatch.use_policy(policy):
        want = dispatch.active_policy()
        expected, _ = _load(str(checkpoints["kimi_linear"]), workers=3)
    assert len(seen) == len(expected)
    assert all(p == want for p in seen)
    assert want != dispatch.active_policy()  # the policy was the block's, not the process's
