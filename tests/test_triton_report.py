"""benchmarks/triton_report.py: each Pallas kernel's Triton IR and launch settings, captured on CPU."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest

import triton_report
from dayzero.kernels.kda import pallas as kda_pallas


def _chunk_shapes(T=300, H=2, D=32):
    S = jax.ShapeDtypeStruct
    q, g, beta = S((1, T, H, D), jnp.bfloat16), S((1, T, H, D), jnp.float32), S((1, T, H), jnp.bfloat16)
    return q, q, q, g, beta


def test_captures_every_kernel_with_its_launch_settings():
    tuning = kda_pallas.KdaTuning(intra_warps=8, wy_warps=2, state_warps=4, state_stages=2)
    kernels = triton_report.capture_kernels(lambda *a: kda_pallas.chunk_kda(*a, tuning=tuning), *_chunk_shapes())
    assert [k["name"] for k in kernels] == ["kda_chunk_akk", "kda_chunk_wy", "kda_chunk_state"]
    assert [k["num_warps"] for k in kernels] == [8, 2, 4]
    assert kernels[2]["num_stages"] == 2
    for kernel in kernels:
        assert f"tt.func public @{kernel['name']}" in kernel["ir"] and "loc(" not in kernel["ir"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the triton package is not installed")
def test_builds_a_kernel_for_sm90():
    kernel = triton_report.capture_kernels(lambda *a: kda_pallas.chunk_kda(*a), *_chunk_shapes())[1]
    report = triton_report.compile_report(kernel["ir"], kernel["num_warps"], kernel["num_stages"])
    assert 0 < report["registers"] <= 255 and report["shared"] > 0
