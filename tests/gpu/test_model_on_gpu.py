"""The model compiles and runs on the GPU and agrees with the CPU (fp32, highest matmul precision)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dayzero.model import Model
from dayzero.model.presets import tiny

pytestmark = pytest.mark.skipif(not any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices()),
                                reason="no GPU on this machine")


def test_tiny_hybrid_gpu_matches_cpu():
    config = tiny()
    ids = np.random.default_rng(0).integers(3, config.vocab_size, (2, 77))
    gpu_model = Model.random(config, dtype="float32", seed=0)
    with jax.default_matmul_precision("highest"):
        gpu = np.asarray(gpu_model(ids))
    cpu_device = jax.devices("cpu")[0]
    cpu_model = Model(config, jax.device_put(gpu_model.params, cpu_device), gpu_model.dtype)
    with jax.default_device(cpu_device):
        cpu = np.asarray(cpu_model(ids))
    err = np.max(np.abs(gpu - cpu)) / np.max(np.abs(cpu))
    assert err < 1e-4, err
    assert (gpu.argmax(-1) == cpu.argmax(-1)).mean() > 0.99
