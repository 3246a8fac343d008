"""benchmarks/grid_barrier.py's kernels in interpret mode (the fused chain with its one-program grid) against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import grid_barrier


DIM, PHASES = 64, 3


def _chain():
    per_phase = [jax.random.normal(jax.random.key(i), (DIM, DIM), jnp.bfloat16) * float(1 / np.sqrt(DIM))
                 for i in range(PHASES)]
    assert per_phase[0].dtype == jnp.bfloat16
    x = jax.random.normal(jax.random.key(PHASES), (DIM,), jnp.float32)
    expected = np.asarray(x)
    for w in per_phase:
        expected = np.tanh(np.asarray(w, np.float32) @ expected)
    return per_phase, x, expected


@pytest.mark.parametrize("mode,programs", [("kernels", 4), ("fused", 1), ("fused_volatile", 1), ("fused_late", 1),
                                           ("ordered", 4), ("ordered_ticket", 4), ("ordered_pairs", 4),
                                           ("xla", 1), ("project", 1)])
def test_every_mode_computes_the_chain(mode, programs):
    per_phase, x, expected = _chain()
    out = grid_barrier.run_mode(mode, jnp.stack(per_phase), per_phase, [w.T for w in per_phase], x,
                                programs=programs, num_warps=4, interpret=True)
    tol = 3e-2 if mode in ("project", "xla") else 1e-5  # those round the row to bf16 before each product
    np.testing.assert_allclose(np.asarray(out), expected, atol=tol, rtol=tol)


def test_fused_chain_keeps_every_phase_and_ends_with_the_count_at_its_last_target():
    per_phase, x, expected = _chain()
    out = grid_barrier.fused_chain(jnp.stack(per_phase), x, programs=1, num_warps=4, prefetch=True, interpret=True)
    assert out.shape == (PHASES, DIM)
    np.testing.assert_allclose(np.asarray(out[-1]), expected, atol=1e-5, rtol=1e-5)
    first = np.tanh(np.asarray(per_phase[0], np.float32) @ np.asarray(x))
    np.testing.assert_allclose(np.asarray(out[0]), first, atol=1e-5, rtol=1e-5)


def test_interpret_mode_refuses_a_barrier_over_several_programs():
    per_phase, x, _ = _chain()
    with pytest.raises(ValueError, match="programs=1"):
        grid_barrier.fused_chain(jnp.stack(per_phase), x, programs=2, num_warps=4, prefetch=True, interpret=True)


def test_default_programs_is_a_power_of_two_dividing_dim_within_the_sms():
    from dayzero.kernels import tiles

    assert tiles.pow2_divisor(2048, 132) == 128
    assert tiles.pow2_divisor(2048, 78) == 64
    assert tiles.pow2_divisor(96, 132) == 32


def test_wait_until_names_a_bad_poll():
    from dayzero.kernels import atomics

    with pytest.raises(ValueError, match="poll"):
        atomics.wait_until(None, (jnp.int32(0),), 1, interpret=False, poll="spin")


def test_ordered_chain_keeps_every_phase_over_several_programs():
    per_phase, x, expected = _chain()
    out = grid_barrier.ordered_chain(jnp.stack(per_phase), x, programs=4, num_warps=4, interpret=True)
    assert out.shape == (PHASES, DIM)
    np.testing.assert_allclose(np.asarray(out[-1]), expected, atol=1e-5, rtol=1e-5)
    second = np.tanh(np.asarray(per_phase[1], np.float32) @ np.asarray(out[0]))
    np.testing.assert_allclose(np.asarray(out[1]), second, atol=1e-5, rtol=1e-5)


def test_modes_are_checked_by_name():
    import results

    assert results.chosen_modes("kernels,ordered", grid_barrier.MODES) == ["kernels", "ordered"]
    with pytest.raises(SystemExit, match="unknown \\['bogus'\\]"):
        results.chosen_modes("kernels,bogus", grid_barrier.MODES)
