"""The dense-expert grouped matmuls (kernels/moe_dense.py) compiled for real (Triton) on the GPU, against a float32
oracle (one expert at a time over every token, `_float32_experts`), at the medium-hybrid and DeepSeek shapes from one
token to a prefill chunk, skewed loads included. Passing here is what lets `moe_dense.GPU_VERIFIED` become True."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import moe, moe_dense

pytestmark = pytest.mark.skipif(not any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices()),
                                reason="no GPU on this machine")

_experts = jax.jit(moe.moe_experts, static_argnames=("block_m", "impl"))
_grouped = jax.jit(moe_dense.grouped_swiglu, static_argnames=("tiles",))


@jax.jit
def _float32_experts(x, ids, weights, w_gate, w_up, w_down):
    """x [N, H], ids [N, k], weights [N, k] f32, w_gate/w_up [E, H, I], w_down [E, I, H] -> [N, H] float32: every
    expert's SwiGLU MLP over all N tokens in float32 at the highest precision, one expert per scan step (so only one
    expert's weights are ever float32: the DeepSeek-size layer's whole float32 copy, or XLA's ragged_dot over it,
    does not fit an 80 GB card), weighted by the tokens' combine weights for it (zero where not chosen)."""
    n_experts = w_gate.shape[0]
    combine = jnp.zeros((x.shape[0], n_experts), jnp.float32).at[jnp.arange(x.shape[0])[:, None], ids].add(weights)
    h = x.astype(jnp.float32)

    def one_expert(acc, expert):
        wg, wu, wd, c = expert
        dot = lambda a, b: jnp.dot(a, b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        return acc + c[:, None] * dot(jax.nn.silu(dot(h, wg)) * dot(h, wu), wd), None

    acc, _ = jax.lax.scan(one_expert, jnp.zeros(h.shape, jnp.float32), (w_gate, w_up, w_down, combine.T))
    return acc


def _layer(key, n_experts, hidden, inter, dtype):
    k1, k2, k3 = jax.random.split(key, 3)
    return (jax.random.normal(k1, (n_experts, hidden, inter), dtype) * 0.02,
            jax.random.normal(k2, (n_experts, hidden, inter), dtype) * 0.02,
            jax.random.normal(k3, (n_experts, inter, hidden), dtype) * 0.02)


@pytest.mark.parametrize("shape,n_tokens,dtype,skewed", [
    ((64, 6, 2048, 768), 1, jnp.bfloat16, False), ((64, 6, 2048, 768), 16, jnp.bfloat16, False),
    ((64, 6, 2048, 768), 77, jnp.bfloat16, True), ((64, 6, 2048, 768), 1031, jnp.bfloat16, False),
    ((64, 6, 2048, 768), 5, jnp.float32, False), ((256, 8, 7168, 2048), 1, jnp.bfloat16, False),
    ((256, 8, 7168, 2048), 64, jnp.bfloat16, False)])
# "fused": DenseTiles.fused_prologues (row gather and SwiGLU in the operand loads); "epilogue": swiglu_epilogue;
# "pairs": pair_partials; "mlp": fused_mlp (the whole MLP in one kernel, float32 atomics); "combine": atomic_combine
# (the down kernel's weighted combine by float32 atomics); "mlp_chains": fused_mlp with 4 accumulator chains
@pytest.mark.parametrize("fused", [False, "fused", "epilogue", "pairs", "mlp", "combine", "mlp_chains"])
def test_grouped_matches_the_float32_oracle(seed, shape, n_tokens, dtype, skewed, fused):
    n_experts, top_k, hidden, inter = shape
    key = jax.random.key(seed)
    weights = _layer(key, n_experts, hidden, inter, dtype)
    _, ids = jax.lax.top_k(jax.random.uniform(jax.random.fold_in(key, 1), (n_tokens, n_experts)), top_k)
    if skewed:  # expert 3 takes every token
        ids = jnp.where(ids == 3, ids[:, :1], ids).at[:, 0].set(3)
    w = jax.random.uniform(jax.random.fold_in(key, 2), (n_tokens, top_k), jnp.float32)
    x = jax.random.normal(jax.random.fold_in(key, 3), (n_tokens, hidden), dtype)
    if fused:
        tiles = dataclasses.replace(moe_dense.choose_tiles(ids.size, n_experts), fused_prologues=fused == "fused",
                                    swiglu_epilogue=fused == "epilogue", pair_partials=fused == "pairs",
                                    fused_mlp=fused.startswith("mlp"), k_chains=4 if fused == "mlp_chains" else 1,
                                    atomic_combine=fused == "combine")
        got = _grouped(x, ids.astype(jnp.int32), w, *weights, tiles=tiles)
    else:
        got = _experts(x, ids.astype(jnp.int32), w, *weights, impl="pallas")
    want = _float32_experts(x, ids.astype(jnp.int32), w, *weights)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert np.all(np.isfinite(got)) and err < tol, f"{shape} T={n_tokens} {dtype}: {err:.2e} (seed={seed})"


@pytest.mark.parametrize("n_tokens", [1, 16, 64])
def test_shared_expert_as_one_grouped_expert(n_tokens):
    """The medium hybrid's shared expert (2048 -> 768) at decode sizes through the grouped kernels as one expert,
    against the MLP's dense layers at float32 precision."""
    from dayzero.model.moe import MLP

    grouped, plain = MLP(768, 2048, jnp.bfloat16, grouped_max_tokens=64), MLP(768, 2048, jnp.bfloat16)
    params = plain.init(jax.random.key(0), jnp.zeros((1, 1, 2048), jnp.bfloat16))
    x = jax.random.normal(jax.random.key(n_tokens), (n_tokens, 1, 2048), jnp.bfloat16)
    got = jax.jit(grouped.apply)(params, x).astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(MLP(768, 2048, jnp.float32).apply)(jax.tree.map(lambda p: p.astype(jnp.float32), params),
                                                          x.astype(jnp.float32))
    rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert rel < 2e-2, rel


@pytest.mark.parametrize("n_tokens", [1, 8, 16])
@pytest.mark.parametrize("fused", [False, True, "epilogue", "pairs", "mlp", "combine"])
def test_shared_mlp_in_routed_kernels(n_tokens, fused):
    """The medium hybrid's MoE layer (64 experts top-6, 2048 x 768) with its 1536-wide shared MLP as two extra experts
    of the routed kernels (`grouped_swiglu(shared=)`), against the routed kernels plus the MLP at float32 precision."""
    key = jax.random.key(n_tokens)
    wg, wu, wd = _layer(key, 64, 2048, 768, jnp.bfloat16)
    sg, su = (jax.random.normal(jax.random.fold_in(key, i), (2048, 1536), jnp.bfloat16) * 0.02 for i in (1, 2))
    sd = jax.random.normal(jax.random.fold_in(key, 3), (1536, 2048), jnp.bfloat16) * 0.02
    x = jax.random.normal(jax.random.fold_in(key, 4), (n_tokens, 2048), jnp.bfloat16)
    ids = jnp.asarray(np.random.default_rng(n_tokens).permuted(np.tile(np.arange(64), (n_tokens, 1)), axis=1)[:, :6],
                      jnp.int32)
    weights = jax.random.uniform(jax.random.fold_in(key, 5), (n_tokens, 6), jnp.float32)
    tiles = dataclasses.replace(moe_dense.choose_tiles(n_tokens * 8, 66), fused_prologues=fused is True,
                                swiglu_epilogue=fused == "epilogue", pair_partials=fused == "pairs",
                                fused_mlp=fused == "mlp", atomic_combine=fused == "combine")
    got = jax.jit(lambda *a: moe_dense.grouped_swiglu(*a[:6], tiles=tiles, shared=a[6:]))(
        x, ids, weights, wg, wu, wd, sg, su, sd).astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        f32 = lambda a: a.astype(jnp.float32)
        routed = jax.jit(lambda *a: moe.moe_experts(*a, block_m=None))(f32(x), ids, weights, f32(wg), f32(wu), f32(wd))
        h = f32(x)
        want = routed + (jax.nn.silu(h @ f32(sg)) * (h @ f32(su))) @ f32(sd)
    rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert np.all(np.isfinite(np.asarray(got))) and rel < 2e-2, rel


@pytest.mark.parametrize("n_tokens", [1, 5, 16])
def test_moe_block_with_the_router_schedule_kernel(monkeypatch, n_tokens):
    """The medium hybrid's MoE block (bf16, its shared expert in the routed kernels) at decode sizes: with the
    router's select-and-schedule kernel (`model.moe.ROUTER_SCHEDULE`) the same output as with the select kernel and
    XLA's schedule (the same schedule, so the same kernels' sums), both compiled on the GPU."""
    from dayzero.model import moe as model_moe
    from dayzero.model.presets import medium_hybrid

    cfg = medium_hybrid()
    block = model_moe.MoE(cfg, jnp.bfloat16)
    x = jax.random.normal(jax.random.key(n_tokens), (n_tokens, 1, cfg.hidden_size), jnp.bfloat16)
    params = jax.jit(block.init)(jax.random.key(0), x)
    run = lambda: np.asarray(jax.jit(lambda p, x: block.apply(p, x))(params, x)[0], np.float32)  # traced anew
    with_kernel = run()
    monkeypatch.setattr(model_moe, "ROUTER_SCHEDULE", False)
    without = run()
    assert np.all(np.isfinite(with_kernel)) and np.array_equal(with_kernel, without)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("atomic_combine", [False, True])
def test_one_token_block_matches_gather(monkeypatch, shared, atomic_combine):
    """`moe_dense.ONE_TOKEN_BLOCK` compiled on the GPU: one token of the medium hybrid's layer (its shared MLP as
    two extra experts or not), the gate/up kernel reading the token as every tile's first row instead of gathered
    rows, gives what the gather path gives (the same kernels' sums, bit for bit without atomics)."""
    key = jax.random.key(7)
    wg, wu, wd = _layer(key, 64, 2048, 768, jnp.bfloat16)
    extra = ()
    if shared:
        extra = tuple(jax.random.normal(jax.random.fold_in(key, i), s, jnp.bfloat16) * 0.02
                      for i, s in ((1, (2048, 1536)), (2, (2048, 1536)), (3, (1536, 2048))))
    x = jax.random.normal(jax.random.fold_in(key, 4), (1, 2048), jnp.bfloat16)
    ids = jnp.asarray([[5, 17, 3, 40, 63, 22]], jnp.int32)
    w = jax.random.uniform(jax.random.fold_in(key, 5), (1, 6), jnp.float32)
    tiles = dataclasses.replace(moe_dense.choose_tiles(6 + 2 * shared, 64 + 2 * shared),
                                atomic_combine=atomic_combine)
    # a new function each time: the module constant is read when the call traces
    run = lambda: np.asarray(jax.jit(lambda *a: moe_dense.grouped_swiglu(
        *a[:6], tiles=tiles, shared=a[6:] or None))(x, ids, w, wg, wu, wd, *extra), np.float32)
    monkeypatch.setattr(moe_dense, "ONE_TOKEN_BLOCK", False)
    gathered = run()
    monkeypatch.setattr(moe_dense, "ONE_TOKEN_BLOCK", True)
    block = run()
    assert np.all(np.isfinite(block))
    if atomic_combine:  # the order of the float32 adds varies
        np.testing.assert_allclose(block, gathered, rtol=0, atol=1e-2 * float(np.max(np.abs(gathered))))
    else:
        assert np.array_equal(block, gathered)
