"""benchmarks/read_floor.py's chain and arithmetic (no GPU needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import read_floor


def test_buffers_are_whole_rows_and_the_chain_outsizes_l2():
    assert read_floor.buffer_shape(8.4e6) == (2051, 2048)
    assert read_floor.buffer_shape(10.0) == (1, 2048)  # at least one row
    assert read_floor.chain_length(8.4e6, 400e6) == 48  # 403 MB of distinct buffers
    assert read_floor.chain_length(1e9, 400e6) == 8  # never fewer than 8 kernels
    assert read_floor.chain_length(4096, 400e6) == 256  # nor more than 256


def test_each_link_sums_its_own_buffer():
    buffers = [jax.random.normal(jax.random.key(i), (4, 2048), jnp.bfloat16) for i in range(3)]
    last = np.asarray(buffers[-1], np.float32)
    np.testing.assert_allclose(read_floor.reduction_chain(1)(buffers), last.sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(read_floor.reduction_chain(0)(buffers), last.sum(axis=0), rtol=1e-5, atol=1e-5)


def test_gemv_link_multiplies_its_own_buffer():
    buffers = [jax.random.normal(jax.random.key(i), (4, 2048), jnp.bfloat16) for i in range(3)]
    last = np.asarray(buffers[-1], np.float32)
    # each link's vector is ones plus 0 times the previous product: the last product is tanh(last @ ones)
    np.testing.assert_allclose(read_floor.gemv_chain(interpret=True)(buffers), np.tanh(last.sum(axis=1)), rtol=1e-5)


def test_every_link_kind_is_known():
    assert set(read_floor.LINKS) == {"reduce_rows", "reduce_columns", "pallas_gemv"}


def test_shares_use_the_kernel_time_where_traced():
    traced = read_floor.with_shares({"size_mb": 8.4, "wall_us_per_kernel": 4.0, "kernel_us": 3.0}, 4.2e12)
    assert (traced["tb_s"], traced["share_of_roofline"]) == (2.8, 0.667)
    untraced = read_floor.with_shares({"size_mb": 8.4, "wall_us_per_kernel": 4.0}, 4.2e12)
    assert (untraced["tb_s"], untraced["share_of_roofline"]) == (2.1, 0.5)


def test_fit_recovers_a_fixed_cost_and_a_stream_rate():
    # 2 us + bytes at 4 TB/s, and one size past FIT_MAX_MB that the fit leaves out
    figures = [{"size_mb": mb, "wall_us_per_kernel": 99.0, "kernel_us": 2.0 + mb * 1e6 / 4e12 * 1e6}
               for mb in (1.0, 8.0, 26.0)] + [{"size_mb": 1024.0, "wall_us_per_kernel": 1.0}]
    assert read_floor.linear_fit(figures) == {"fixed_us": 2.0, "stream_tb_s": 4.0, "sizes": 3}
    assert read_floor.linear_fit(figures[:1]) is None


def test_link_figures_count_every_kernel_of_the_chain(monkeypatch):
    # two kernels per link (a reduction XLA splits): the GPU time per link is their sum, not one kernel's median
    events = [{"name": n, "dur": d} for n, d in [("reduce_a", 3.0), ("reduce_b", 1.0)] * 4]
    monkeypatch.setattr(read_floor.gpu_trace, "gpu_kernels", lambda _: events)
    monkeypatch.setattr(read_floor.gpu_trace, "traced_events", lambda run: run())
    monkeypatch.setattr(read_floor.timing, "pipelined_seconds", lambda *a, **k: 20e-6)
    figure = read_floor.link_figures(lambda buffers: jnp.zeros(()), [None] * 4)
    assert figure == {"wall_us_per_kernel": 5.0, "kernel_us": 4.0, "kernels_per_link": 2.0}
