"""kernels/grid_dependency.py and tiles.pallas_call's PROGRAMMATIC_LAUNCH: the griddepcontrol instructions reach the
Triton IR (not pure, before the kernel's first load, kept when their result is unused), are the identity in
interpret mode, and are left out where they do not apply. (What they do to a chain of kernels is a benchmark:
benchmarks/launch_overlap.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import partial_eval as pe
from jax.experimental import pallas as pl

from dayzero.kernels import dispatch, grid_dependency, tiles


_PTX = ("griddepcontrol.launch_dependents", "griddepcontrol.wait")


def _scale(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def _doubled(x, interpret=False):
    return tiles.pallas_call(_scale, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                             in_specs=[pl.BlockSpec((8,), lambda i: (i,))], out_specs=pl.BlockSpec((8,), lambda i: (i,)),
                             compiler_params=tiles.compiler_params(1, 1), interpret=interpret, name="doubling")(x)


def _asm_lines(ir: str) -> list[str]:
    return [line for line in ir.splitlines() if "elementwise_inline_asm" in line]


@pytest.mark.parametrize("order", tiles.LAUNCH_ORDERS)
def test_pallas_call_places_the_launch_controls(monkeypatch, order):
    pytest.importorskip("jax._src.pallas.triton.lowering")
    from triton_report import capture_kernels

    monkeypatch.setattr(tiles, "PROGRAMMATIC_LAUNCH", order)
    jax.clear_caches()  # the constant is read when the kernel is traced: no trace of another case may be reused
    (kernel,) = capture_kernels(_doubled, jax.ShapeDtypeStruct((16,), jnp.float32))
    assert kernel["name"] == "doubling"
    asm = _asm_lines(kernel["ir"])
    if order == "off":
        assert asm == []
        return
    assert len(asm) == 2 and all("pure = false" in line for line in asm)
    expected = _PTX if order == "trigger_first" else _PTX[::-1]
    assert expected[0] in asm[0] and expected[1] in asm[1], f"{order}: {asm}"
    lines = kernel["ir"].splitlines()
    first_load = next(i for i, line in enumerate(lines) if "tt.load" in line)
    last_store = max(i for i, line in enumerate(lines) if "tt.store" in line)
    trigger_at, wait_at = (next(i for i, line in enumerate(lines) if "elementwise_inline_asm" in line and ptx in line)
                           for ptx in _PTX)
    assert wait_at < first_load, "the wait must come before the kernel reads anything"
    assert (trigger_at > last_store) if order == "trigger_last" else (trigger_at < first_load), f"{order}: trigger"


@pytest.mark.parametrize("selected, named", [("doub", True), ("decode_projection, doubling", True),
                                             ("moe_gemv", False), ("doubling_more", False)])
def test_only_the_named_kernels_let_the_next_launch_early(monkeypatch, selected, named):
    pytest.importorskip("jax._src.pallas.triton.lowering")
    from triton_report import capture_kernels

    monkeypatch.setattr(tiles, "PROGRAMMATIC_LAUNCH", "wait_first")
    monkeypatch.setattr(tiles, "PROGRAMMATIC_LAUNCH_KERNELS", selected)
    jax.clear_caches()
    (kernel,) = capture_kernels(_doubled, jax.ShapeDtypeStruct((16,), jnp.float32))
    asm = _asm_lines(kernel["ir"])
    assert tiles.launches_early("doubling") == named
    # named: wait, then the trigger; left out: the wait alone, still before the first load
    assert len(asm) == (2 if named else 1) and _PTX[1] in asm[0], asm
    assert named == any(_PTX[0] in line for line in asm)
    lines = kernel["ir"].splitlines()
    first_load = next(i for i, line in enumerate(lines) if "tt.load" in line)
    assert max(lines.index(line) for line in asm) < first_load


def test_refuses_an_unknown_launch_order(monkeypatch):
    monkeypatch.setattr(tiles, "PROGRAMMATIC_LAUNCH", True)
    with pytest.raises(ValueError, match="PROGRAMMATIC_LAUNCH"):
        _doubled(jnp.zeros((16,), jnp.float32), interpret=True)


def test_interpret_mode_and_other_lowerings_leave_the_kernel_alone(monkeypatch):
    monkeypatch.setattr(tiles, "PROGRAMMATIC_LAUNCH", "trigger_first")
    assert not dispatch.grid_dependency_ptx(interpret=True)
    x = jnp.arange(16, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(_doubled(x, interpret=True)), np.arange(16) * 2)


def test_identity_values_and_kept_when_unused():
    def body(v):
        grid_dependency.launch_dependents(v)  # result unused: the instruction is the point
        return grid_dependency.wait(v + 1)

    assert int(jax.jit(body)(jnp.int32(4))) == 5
    jaxpr = jax.make_jaxpr(body)(jnp.int32(4)).jaxpr
    kept, _ = pe.dce_jaxpr(jaxpr, [True])
    kinds = [eqn.params["kind"] for eqn in kept.eqns if eqn.primitive is grid_dependency.grid_dependency_p]
    assert kinds == ["launch_dependents", "wait"]


def test_takes_an_int32_scalar_only():
    with pytest.raises(ValueError, match="int32 scalar"):
        grid_dependency.wait(jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="unknown kind"):
        jax.make_jaxpr(lambda v: grid_dependency.grid_dependency_p.bind(v, kind="sync"))(jnp.int32(0))
