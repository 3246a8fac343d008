"""The dense-expert grouped matmuls (kernels/moe_dense.py) in interpret mode against a float64 oracle, their
Triton lowering at model shapes, and where moe_experts uses them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxfp4_cases import dense_oracle, rel_err, routing
from triton_lowering import count_triton_kernels
from dayzero.kernels import dispatch, moe, moe_dense


def _case(rng, n_tokens, n_experts, hidden, inter, top_k, kind="random"):
    x = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    wg, wu = (rng.standard_normal((n_experts, hidden, inter)).astype(np.float32) * 0.3 for _ in range(2))
    wd = rng.standard_normal((n_experts, inter, hidden)).astype(np.float32) * 0.3
    ids, weights = routing(rng, kind, n_tokens, n_experts, top_k)
    if n_tokens > 1 and kind == "random":
        ids[1] = ids[0]  # two tokens on the same experts
    return x, ids, weights, wg, wu, wd


_grouped = jax.jit(moe_dense.grouped_swiglu, static_argnames=("tiles", "interpret"))


@pytest.mark.parametrize("shape,kind,tiles", [
    ((1, 6, 40, 24, 2), "random", moe_dense.DenseTiles(block_m=4, block_n=8, step_k=8, k_slices=3, min_programs=64)),
    ((9, 8, 64, 96, 3), "random", moe_dense.DenseTiles(block_m=4, block_n=16, step_k=16, k_slices=2)),
    ((37, 5, 48, 80, 2), "one_expert_takes_all", moe_dense.DenseTiles(block_m=8, block_n=16, step_k=16, k_slices=1)),
])
# "fused": row gather and SwiGLU in the kernels' operand loads; "epilogue": the SwiGLU on the gate/up kernel's sums;
# "pairs": partial sums stored and reduced for the pairs' rows only; "mlp": the whole MLP in one kernel (atomic sums),
# "mlp_chains": with two accumulator chains per K step; "+combine": the down kernel's atomic weighted combine
@pytest.mark.parametrize("variant", ["xla", "fused", "epilogue", "pairs", "mlp", "mlp_chains", "xla+combine",
                                     "fused+combine", "epilogue+combine"])
def test_matches_oracle(seed, shape, kind, tiles, variant):
    """Odd dims (blocks cut to their power-of-two divisors), K split or not, pairs sharing experts, one expert
    spread over several tiles while others sit idle."""
    rng = np.random.default_rng(seed)
    args = _case(rng, *shape, kind=kind)
    base = variant.split("+")[0]
    tiles = dataclasses.replace(tiles, fused_prologues=base == "fused", swiglu_epilogue=base == "epilogue",
                                pair_partials=base == "pairs", fused_mlp=base.startswith("mlp"),
                                k_chains=2 if base == "mlp_chains" else 1, atomic_combine=variant.endswith("combine"))
    got = _grouped(*(jnp.asarray(a) for a in args), tiles=tiles, interpret=True)
    err = rel_err(got, dense_oracle(*args))
    assert got.dtype == jnp.float32 and err < 1e-5, f"{shape}: {err:.2e} (seed={seed})"


def test_bf16_through_moe_experts(seed):
    """bf16 activations and weights through moe_experts(impl="interpret") at decode sizes (one token: its own
    schedule) and a prefill size, against
    the oracle and the XLA path."""
    rng = np.random.default_rng(seed)
    for n_tokens in (1, 2, 40):
        x, ids, weights, wg, wu, wd = _case(rng, n_tokens, 8, 64, 32, 2)
        bf = [jnp.asarray(a, jnp.bfloat16) for a in (x, wg, wu, wd)]
        run = jax.jit(lambda *a, impl: moe.moe_experts(*a, impl=impl), static_argnames="impl")
        got = run(bf[0], jnp.asarray(ids), jnp.asarray(weights), *bf[1:], impl="interpret")
        xla = run(bf[0], jnp.asarray(ids), jnp.asarray(weights), *bf[1:], impl="reference")
        assert got.dtype == jnp.bfloat16
        want = dense_oracle(bf[0].astype(jnp.float32), ids, weights, *(w.astype(jnp.float32) for w in bf[1:]))
        assert rel_err(got, want) < 2e-2 and rel_err(xla, want) < 2e-2, f"T={n_tokens} (seed={seed})"
        assert rel_err(got, xla) < 2e-2, f"T={n_tokens} (seed={seed})"


@pytest.mark.parametrize("n_tokens", [1, 512])
def test_lowers_to_triton_at_model_shapes(n_tokens):
    spec = jax.ShapeDtypeStruct
    for n_experts, hidden, inter, top_k in ((64, 2048, 768, 6), (256, 7168, 2048, 8)):
        args = (spec((n_tokens, hidden), jnp.bfloat16), spec((n_tokens, top_k), jnp.int32),
                spec((n_tokens, top_k), jnp.float32), spec((n_experts, hidden, inter), jnp.bfloat16),
                spec((n_experts, hidden, inter), jnp.bfloat16), spec((n_experts, inter, hidden), jnp.bfloat16))
        assert moe_dense.supported(hidden, inter)
        assert count_triton_kernels(lambda *a: moe_dense.grouped_swiglu(*a), *args) == 2
        fused = dataclasses.replace(moe_dense.choose_tiles(n_tokens * top_k, n_experts), fused_prologues=True)
        assert count_triton_kernels(lambda *a: moe_dense.grouped_swiglu(*a, tiles=fused), *args) == 2
        epilogue = dataclasses.replace(moe_dense.choose_tiles(n_tokens * top_k, n_experts), swiglu_epilogue=True)
        assert count_triton_kernels(lambda *a: moe_dense.grouped_swiglu(*a, tiles=epilogue), *args) == 2
        pairs = dataclasses.replace(moe_dense.choose_tiles(n_tokens * top_k, n_experts), pair_partials=True)
        assert count_triton_kernels(lambda *a: moe_dense.grouped_swiglu(*a, tiles=pairs), *args) == 2
        mlp = dataclasses.replace(moe_dense.choose_tiles(n_tokens * top_k, n_experts), fused_mlp=True)
        assert count_triton_kernels(lambda *a: moe_dense.grouped_swiglu(*a, tiles=mlp), *args) == 1
        combine = dataclasses.replace(moe_dense.choose_tiles(n_tokens * top_k, n_experts), atomic_combine=True)
        assert count_triton_kernels(lambda *a: moe_dense.grouped_swiglu(*a, tiles=combine), *args) == 2
        shared = (spec((hidden, 2 * inter), jnp.bfloat16),) * 2 + (spec((2 * inter, hidden), jnp.bfloat16),)
        assert count_triton_kernels(lambda *a: moe_dense.grouped_swiglu(*a[:6], shared=a[6:]), *args, *shared) == 2


def test_dispatch_and_tiles(monkeypatch):
    """CPU runs the XLA paths; decode-sized calls take 16-row tiles with K split (in at most 4 slices up to FEW_PAIRS
    pairs), prefill 64-row tiles; the SwiGLU epilogue from EPILOGUE_MIN_PAIRS pairs on; the one-kernel MLP up to
    FUSED_MLP_MAX_PAIRS pairs (0 by default); an epilogue the kernels do not have, or accumulator chains that do not
    split the K step, are refused by name."""
    assert dispatch.choose("moe_dense", ("reference", "pallas"), platform="cpu") == "reference"
    assert not moe_dense.supported(40, 24) and moe_dense.supported(2048, 768)
    assert moe_dense.choose_tiles(6, 64).block_m == 16 and moe_dense.choose_tiles(2048 * 6, 64).block_m == 64
    assert moe_dense.choose_tiles(7, 65).k_slices == 4 and moe_dense.choose_tiles(48, 64).k_slices == 8  # few pairs
    monkeypatch.setattr(moe_dense, "EPILOGUE_MIN_PAIRS", 64)
    assert moe_dense.choose_tiles(96, 64).swiglu_epilogue and not moe_dense.choose_tiles(48, 64).swiglu_epilogue
    x, w = jnp.zeros((16, 32)), jnp.zeros((2, 32, 16))
    with pytest.raises(ValueError, match="epilogue"):
        moe_dense.grouped_matmul(x, jnp.zeros((1,), jnp.int32), (w,), moe_dense.DenseTiles(), interpret=True,
                                 epilogue="swiglu")
    assert not moe_dense.choose_tiles(8, 66).fused_mlp  # the one-kernel MLP: off unless FUSED_MLP_MAX_PAIRS says
    monkeypatch.setattr(moe_dense, "FUSED_MLP_MAX_PAIRS", 8)
    chosen = moe_dense.choose_tiles(8, 66)
    assert chosen.fused_mlp and chosen.block_i == moe_dense.FUSED_MLP_TILES["block_i"]
    assert not moe_dense.choose_tiles(9, 66).fused_mlp
    ids, ones = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), jnp.float32)
    with pytest.raises(ValueError, match="k_chains"):
        moe_dense.grouped_swiglu(jnp.zeros((1, 32)), ids, ones, w, w, w.transpose(0, 2, 1),
                                 tiles=dataclasses.replace(chosen, step_k=16, k_chains=3), interpret=True)


def test_shared_expert_runs_as_one_grouped_expert_at_decode_sizes(seed, monkeypatch):
    """The MoE block's shared-expert MLP: calls of up to `grouped_max_tokens` tokens run through the grouped kernels
    as one expert (interpret mode here) and equal the dense layers; longer calls and the CPU's default dispatch
    keep the dense layers exactly."""
    from dayzero.model.moe import MLP

    rng = np.random.default_rng(seed)
    hidden, inter = 32, 48
    grouped, plain = MLP(inter, hidden, jnp.float32, grouped_max_tokens=4), MLP(inter, hidden, jnp.float32)
    params = plain.init(jax.random.key(seed % 2**31), jnp.zeros((1, 1, hidden)))
    params = jax.tree.map(lambda p: p * 10.0, params)  # weights of order 0.2: outputs well above rounding
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "interpret")
    for tokens in (1, 4, 5):
        x = jnp.asarray(rng.standard_normal((1, tokens, hidden)), jnp.float32)
        want = np.asarray(plain.apply(params, x))
        got = np.asarray(grouped.apply(params, x))
        assert got.shape == want.shape == (1, tokens, hidden)
        if tokens <= 4:
            assert rel_err(got, want) < 1e-5, tokens
            w = params["params"]
            direct = moe.swiglu_as_one_expert(x[0], w["gate_proj"]["kernel"], w["up_proj"]["kernel"],
                                              w["down_proj"]["kernel"])
            assert direct is not None and np.array_equal(np.asarray(direct), got[0])
        else:  # above the threshold: the dense layers themselves
            assert np.array_equal(got, want)
    monkeypatch.delenv(dispatch.ENV_OVERRIDE)
    w = params["params"]
    assert moe.swiglu_as_one_expert(x[0], w["gate_proj"]["kernel"], w["up_proj"]["kernel"],
                                    w["down_proj"]["kernel"]) is None  # CPU: the caller's dense layers run


@pytest.mark.parametrize("n_tokens,parts,fused", [(1, 2, False), (5, 1, False), (3, 3, True), (4, 2, "pairs"),
                                                   (1, 2, "mlp"), (6, 3, "mlp"), (1, 2, "combine"),
                                                   (5, 2, "combine")])
def test_shared_mlp_as_extra_experts(seed, n_tokens, parts, fused):
    """A shared-expert SwiGLU MLP (intermediate `parts` x the experts') passed as `shared`: the routed experts' output
    plus the MLP's, against the float64 oracle of both; one token (its own schedule), several, the fused loads, the one-kernel MLP; a
    shared MLP that does not split into the experts' shape is refused by name."""
    rng = np.random.default_rng(seed)
    hidden, inter = 32, 16
    x, ids, weights, wg, wu, wd = _case(rng, n_tokens, 6, hidden, inter, 2)
    sg, su = (rng.standard_normal((hidden, parts * inter)).astype(np.float32) * 0.3 for _ in range(2))
    sd = rng.standard_normal((parts * inter, hidden)).astype(np.float32) * 0.3
    tiles = moe_dense.DenseTiles(block_m=4, block_n=8, step_k=8, k_slices=2, min_programs=16,
                                 fused_prologues=fused is True, pair_partials=fused == "pairs",
                                 fused_mlp=fused == "mlp", atomic_combine=fused == "combine")
    got = jax.jit(moe_dense.grouped_swiglu, static_argnames=("tiles", "interpret"))(
        *(jnp.asarray(a) for a in (x, ids, weights, wg, wu, wd)), tiles=tiles, interpret=True,
        shared=tuple(jnp.asarray(a) for a in (sg, su, sd)))
    shared_out = dense_oracle(x, np.zeros((n_tokens, 1), np.int32), np.ones((n_tokens, 1), np.float32),
                              sg[None], su[None], sd[None])
    want = np.asarray(dense_oracle(x, ids, weights, wg, wu, wd)) + np.asarray(shared_out)
    err = rel_err(got, want)
    assert got.shape == (n_tokens, hidden) and err < 1e-5, f"{err:.2e} (seed={seed})"
    with pytest.raises(ValueError, match="does not split"):
        moe_dense.grouped_swiglu(*(jnp.asarray(a) for a in (x, ids, weights, wg, wu, wd)), tiles=tiles,
                                 interpret=True, shared=(jnp.asarray(sg[:, :-1]), jnp.asarray(su[:, :-1]),
                                                         jnp.asarray(sd[:-1])))


def test_model_moe_with_shared_in_routed_kernels(seed, monkeypatch):
    """The MoE block with `SHARED_IN_ROUTED_KERNELS` (interpret mode) equals the block that runs the shared experts
    apart (the CPU's XLA paths), at decode sizes; above SHARED_IN_ROUTED_MAX_TOKENS tokens the block keeps them
    apart."""
    from dayzero.model import moe as model_moe
    from dayzero.model.presets import tiny

    cfg = tiny()
    rng = np.random.default_rng(seed)
    block = model_moe.MoE(cfg, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, cfg.hidden_size)), jnp.float32)
    params = block.init(jax.random.key(seed % 1000), x)
    with jax.default_matmul_precision("highest"):
        want, _ = block.apply(params, x)
        monkeypatch.setattr(model_moe, "SHARED_IN_ROUTED_KERNELS", True)
        monkeypatch.setenv(dispatch.ENV_OVERRIDE, "interpret")
        calls = []
        original = moe_dense.grouped_swiglu

        def recorded(*args, **kwargs):
            calls.append(kwargs.get("shared"))
            return original(*args, **kwargs)

        monkeypatch.setattr(moe_dense, "grouped_swiglu", recorded)
        monkeypatch.setattr(model_moe, "SHARED_IN_ROUTED_MAX_TOKENS", 8)
        got, _ = block.apply(params, x)
        assert len(calls) == 1 and calls[0] is not None  # one call, the shared MLP in it
        assert rel_err(got, want) < 1e-5
        many = jnp.concatenate([x, x[:, ::-1]], axis=1)  # 12 tokens
        block.apply(params, many)
        assert len(calls) == 2 and calls[1] is None  # the routed experts alone; the shared MLP its own way


def test_model_moe_with_the_router_schedule_kernel(seed, monkeypatch):
    """The MoE block at decode sizes with the kernels in interpret mode (the router's logits by XLA, as on CUDA):
    the router's select-and-schedule kernel
    appends the shared parts and makes the schedule that the grouped kernels take (one call each), and the block
    equals the CPU's XLA paths."""
    from dayzero.kernels import router
    from dayzero.model import moe as model_moe
    from dayzero.model.presets import tiny

    cfg = tiny().replace(num_experts=16, num_experts_per_token=4)
    rng = np.random.default_rng(seed)
    block = model_moe.MoE(cfg, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, cfg.hidden_size)), jnp.float32)  # 6 tokens
    params = block.init(jax.random.key(seed % 1000), x)
    with jax.default_matmul_precision("highest"):
        want, _ = block.apply(params, x)
        monkeypatch.setenv(dispatch.ENV_OVERRIDE, "interpret")
        monkeypatch.setattr(router, "choose", lambda *a, **k: "reference")  # XLA's logits, as on CUDA
        schedules, made = [], []
        original_swiglu, original_schedule = moe_dense.grouped_swiglu, router.select_and_schedule
        monkeypatch.setattr(moe_dense, "grouped_swiglu",
                            lambda *a, **k: schedules.append(k.get("sched")) or original_swiglu(*a, **k))
        monkeypatch.setattr(router, "select_and_schedule", lambda *a, **k: made.append(k) or original_schedule(*a, **k))
        got, _ = block.apply(params, x)
    assert len(made) == 1 and made[0]["shared_parts"] == 1
    assert len(schedules) == 1 and schedules[0] is not None
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("variant", ["xla", "epilogue", "combine", "shared"])
def test_one_token_block_rows(seed, monkeypatch, variant):
    """`ONE_TOKEN_BLOCK`: a one-token call's gate/up kernel reads the token as the first row of every tile (zero rows
    below it) instead of gathered rows: the same result as the gather (exactly, in interpret mode) and the float64 oracle; a
    block of the wrong height is refused by name."""
    rng = np.random.default_rng(seed)
    x, ids, weights, wg, wu, wd = _case(rng, 1, 6, 32, 16, 3)
    shared = None
    if variant == "shared":
        shared = tuple(jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.3)
                       for s in ((32, 32), (32, 32), (32, 32)))
    tiles = moe_dense.DenseTiles(block_m=4, block_n=8, step_k=8, k_slices=2, min_programs=16,
                                 swiglu_epilogue=variant == "epilogue", atomic_combine=variant == "combine")
    args = [jnp.asarray(a) for a in (x, ids, weights, wg, wu, wd)]
    # a new function each time: the module constant is read when the call traces
    run = lambda: np.asarray(jax.jit(lambda *a: moe_dense.grouped_swiglu(*a, tiles=tiles, interpret=True,
                                                                          shared=shared))(*args))
    monkeypatch.setattr(moe_dense, "ONE_TOKEN_BLOCK", False)
    gathered = run()
    monkeypatch.setattr(moe_dense, "ONE_TOKEN_BLOCK", True)
    block = run()
    assert np.array_equal(block, gathered)
    if shared is None:
        assert rel_err(block, dense_oracle(x, ids, weights, wg, wu, wd)) < 1e-5
    with pytest.raises(ValueError, match="block"):
        moe_dense.grouped_matmul(jnp.zeros((3, 32)), jnp.zeros((1,), jnp.int32), (jnp.asarray(wg),), tiles,
                                 interpret=True, token_of_row=jnp.zeros((4,), jnp.int32), prologue="block")
    if variant == "xla":  # the block prologue lowers to Triton at the medium hybrid's shape
        spec = jax.ShapeDtypeStruct
        shapes = (spec((1, 2048), jnp.bfloat16), spec((1, 6), jnp.int32), spec((1, 6), jnp.float32),
                  spec((64, 2048, 768), jnp.bfloat16), spec((64, 2048, 768), jnp.bfloat16),
                  spec((64, 768, 2048), jnp.bfloat16))
        assert count_triton_kernels(lambda *a: moe_dense.grouped_swiglu(*a), *shapes) == 2
