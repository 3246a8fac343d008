"""The model compiles and runs on the GPU and agrees with the CPU (fp32, highest matmul precision)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import dispatch
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


def test_batch_one_projections_compile_to_matmuls():
    """With dayzero's GPU compiler options a [1, D] @ [D, N] projection stays a matmul: no [D, N] elementwise
    product written and reduced (XLA's dot strength reduction, see dispatch._COMPILER_OPTIONS)."""
    x, w = jnp.ones((1, 2048), jnp.bfloat16), jnp.ones((2048, 2048), jnp.bfloat16)
    ours = jax.jit(lambda a, b: a @ b, compiler_options=dispatch.compiler_options()).lower(x, w).compile().as_text()
    assert "bf16[2048,2048]{1,0} multiply(" not in ours
    assert " dot(" in ours or "cublas" in ours, ours[-2000:]


def test_tiny_engine_decodes_on_gpu_like_the_cpu():
    """Decode steps (batch 1, the case the compiler options change) compile and generate the CPU's greedy tokens."""
    from dayzero.serving import Engine, EngineConfig, SamplingParams

    config = tiny()
    prompt = np.random.default_rng(1).integers(3, config.vocab_size, 37).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine_config = EngineConfig(max_num_seqs=2, max_model_len=128, enable_prefix_caching=False)
    gpu_model = Model.random(config, dtype="float32", seed=0)
    cpu_device = jax.devices("cpu")[0]
    cpu_model = Model(config, jax.device_put(gpu_model.params, cpu_device), gpu_model.dtype)
    with jax.default_matmul_precision("highest"):
        gpu = Engine(gpu_model, None, engine_config).generate(prompt_token_ids=[prompt], sampling_params=params)
        with jax.default_device(cpu_device):
            cpu = Engine(cpu_model, None, engine_config).generate(prompt_token_ids=[prompt], sampling_params=params)
    assert gpu[0].finish_reason == "length" and list(gpu[0].token_ids) == list(cpu[0].token_ids)
