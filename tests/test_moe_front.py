"""kernels/moe_front.py: a decode MoE block's residual add, post-attention norm and router logits in one kernel
(interpret mode) against its XLA form and a float64 oracle, its errors, its Triton lowering at the medium hybrid's
shapes, and the decoder's decode step with it against the step without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import moe_front, projection
from router_choices import rows_that_held, spy_router_choices, taken
from tiny_decode_cases import prefilled_decode
from triton_lowering import count_triton_kernels


def _inputs(rng, rows, slices, hidden=128, n_experts=32):
    residual = jnp.asarray(rng.standard_normal((rows, hidden)), jnp.bfloat16)
    update = None
    if slices:
        update = projection.Partials(jnp.asarray(rng.standard_normal((slices, rows, hidden)), jnp.float32), None,
                                     256, 1e-6, "bfloat16")
    norm_weight = jnp.asarray(rng.uniform(0.5, 1.5, hidden), jnp.float32)
    router_weight = jnp.asarray(rng.standard_normal((n_experts, hidden)) * 0.1, jnp.bfloat16)
    return update, residual, norm_weight, router_weight


def _bf16_steps(a, b, scale=0.0):
    """The largest difference of a and b in units of the bf16 spacing of b, or of `scale` where that is larger."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    spacing = np.maximum(np.maximum(np.abs(b), np.abs(np.asarray(scale, np.float64))), 1e-30) * 2.0 ** -7
    return float(np.max(np.abs(a - b) / spacing))


@pytest.mark.parametrize("slices,hidden,n_experts,rows", [(8, 128, 32, 1), (2, 256, 16, 1), (0, 128, 32, 1),
                                                           (4, 64, 8, 1), (8, 128, 32, 16), (0, 64, 16, 3)])
def test_matches_xla_and_oracle(seed, slices, hidden, n_experts, rows):
    """o_proj's partial sums (2-8 slices) or none, one row or several: x and the normed rows as the XLA form rounds
    them (to one bf16 step of x or of the update: the partial sums' order of addition may differ), logits to float32
    rounding of the XLA form's and near a float64 oracle of the normed rows."""
    rng = np.random.default_rng(seed)
    args = _inputs(rng, rows, slices, hidden, n_experts)
    got = moe_front.front(*args, eps=1e-5, interpret=True)
    want = moe_front.reference(*args, eps=1e-5)
    assert [g.shape for g in got] == [(rows, hidden), (rows, hidden), (rows, n_experts)]
    assert got[0].dtype == got[1].dtype == jnp.bfloat16 and got[2].dtype == jnp.float32
    # each side rounds its own order of the partials' sum to bf16 before adding the residual: at a rounding tie one
    # step of the update, which is several of x where the residual cancels it (seed 3182697486: 2 steps of x)
    update = np.asarray(projection.finished(args[0]), np.float64) if slices else 0.0
    x = np.asarray(want[0], np.float64)
    normed_update = update / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * np.asarray(args[2], np.float64)
    assert _bf16_steps(got[0], want[0], update) <= 1 and _bf16_steps(got[1], want[1], normed_update) <= 2
    if slices == 0:  # nothing to add up: x and the normed rows by the same rounding steps exactly
        assert all(np.array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
                   for g, w in zip(got[:2], want[:2]))
    oracle = np.asarray(got[1], np.float64) @ np.asarray(args[3], np.float64).T
    np.testing.assert_allclose(np.asarray(got[2], np.float64), oracle, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(want[2], np.float64), np.asarray(want[1], np.float64)
                               @ np.asarray(args[3], np.float64).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slices,select", [(8, False), (0, False), (2, True)])
def test_float32_residual_and_the_sums_it_writes(seed, slices, select):
    """A float32 residual (the previous layer's residual added into the MXFP4 down kernel's sums,
    `model.moe.RESIDUAL_IN_SUMS`) is rounded to the router weights' bf16 as it loads: x, normed, the logits (and the
    router's choice) bit for bit those of the rounded residual, in the kernel and the XLA form. With `sums` the
    results also hold x as float32 (exactly x's bf16 values), the rows the down kernel adds the experts into."""
    from dayzero.kernels import router

    rng = np.random.default_rng(seed)
    update, _, norm_weight, router_weight = _inputs(rng, 1, slices)
    wide = jnp.asarray(rng.standard_normal((1, 128)) * 3, jnp.float32)
    choice = {}
    if select:
        choice = dict(select=moe_front.Select(2, True, True, 1.0, 1), turns=jnp.zeros((2, 1), jnp.int32), layer=1)
    got = moe_front.front(update, wide, norm_weight, router_weight, eps=1e-5, sums=True, interpret=True, **choice)
    plain = moe_front.front(update, wide.astype(jnp.bfloat16), norm_weight, router_weight, eps=1e-5,
                            interpret=True, **choice)
    assert len(got) == len(plain) + 1 and got[3].dtype == jnp.float32 and got[3].shape == (1, 128)
    assert got[0].dtype == jnp.bfloat16
    for g, p in zip(got[:3] + got[4:], plain):
        assert np.array_equal(np.asarray(g, np.float32), np.asarray(p, np.float32))
    assert np.array_equal(np.asarray(got[3]), np.asarray(got[0], np.float32))
    if select:
        assert got[4].shape == (router.BLOCK_M, 4) and not np.any(np.asarray(got[6]))
    ref = moe_front.reference(update, wide, norm_weight, router_weight, eps=1e-5, sums=True)
    ref_plain = moe_front.reference(update, wide.astype(jnp.bfloat16), norm_weight, router_weight, eps=1e-5)
    for g, p in zip(ref[:3], ref_plain):
        assert np.array_equal(np.asarray(g, np.float32), np.asarray(p, np.float32))
    assert np.array_equal(np.asarray(ref[3]), np.asarray(ref[0], np.float32))
    if update is not None:  # 16-bit rows of another dtype than o_proj's output
        with pytest.raises(ValueError, match="float16"):
            moe_front.front(update, wide.astype(jnp.float16), norm_weight, router_weight, eps=1e-5, interpret=True)


def test_finished_update_and_errors(seed):
    """A finished o_proj output is added to the residual first; shapes that do not fit are refused by name, and
    `supported` says what the kernel takes."""
    rng = np.random.default_rng(seed)
    _, residual, norm_weight, router_weight = _inputs(rng, 1, 0)
    update = jnp.asarray(rng.standard_normal((1, 128)), jnp.bfloat16)
    got = moe_front.front(update, residual, norm_weight, router_weight, eps=1e-5, interpret=True)
    want = moe_front.reference(update, residual, norm_weight, router_weight, eps=1e-5)
    assert all(np.array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
               for g, w in zip(got[:2], want[:2]))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="update"):
        moe_front.front(update[:, :64], residual, norm_weight, router_weight, eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="router weight"):
        moe_front.front(None, residual, norm_weight, router_weight[:, :64], eps=1e-5, interpret=True)
    squared = projection.Partials(jnp.zeros((2, 1, 128)), jnp.zeros((2, 1)), 128, 1e-6, "bfloat16")
    with pytest.raises(ValueError, match="squares given"):
        moe_front.front(squared, residual, norm_weight, router_weight, eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="not supported"):
        moe_front.front(None, residual, norm_weight, router_weight[:10], eps=1e-5, interpret=True)
    # one row: programs of `ONE_ROW_EXPERT_BLOCK` experts, so 12 experts fit one row and not two
    assert moe_front.expert_block(1) == moe_front.ONE_ROW_EXPERT_BLOCK == 4 and moe_front.expert_block(2) == 8
    twelve = moe_front.front(None, residual, norm_weight, router_weight[:12], eps=1e-5, interpret=True)
    np.testing.assert_allclose(np.asarray(twelve[2]), np.asarray(moe_front.reference(
        None, residual, norm_weight, router_weight[:12], eps=1e-5)[2]), rtol=1e-5, atol=1e-5)
    assert moe_front.supported(1, 2048, 12, jnp.bfloat16) and not moe_front.supported(2, 2048, 12, jnp.bfloat16)
    three = projection.Partials(jnp.zeros((3, 1, 128)), None, 128, 1e-6, "bfloat16")
    with pytest.raises(ValueError, match="3 partial sums"):
        moe_front.front(three, residual, norm_weight, router_weight, eps=1e-5, interpret=True)
    many = jnp.concatenate([residual] * (moe_front.MAX_ROWS + 1))
    with pytest.raises(ValueError, match=f"{moe_front.MAX_ROWS + 1} rows"):
        moe_front.front(None, many, norm_weight, router_weight, eps=1e-5, interpret=True)
    select = moe_front.Select(2, True, True, 1.0, 0)
    with pytest.raises(ValueError, match="one row, not 2"):
        moe_front.front(None, many[:2], norm_weight, router_weight, eps=1e-5, select=select,
                        turns=jnp.zeros((1, 1), jnp.int32), interpret=True)
    assert moe_front.supported(1, 2048, 64, jnp.bfloat16) and moe_front.supported(16, 2048, 64, jnp.bfloat16)
    assert not moe_front.supported(moe_front.MAX_ROWS + 1, 2048, 64, jnp.bfloat16)
    assert not moe_front.supported(1, 48, 64, jnp.bfloat16) and not moe_front.supported(1, 2048, 6, jnp.bfloat16)
    assert not moe_front.supported(1, 2048, 64, jnp.float32)
    assert moe_front.choose(1, 2048, 64, jnp.bfloat16) == "reference"  # the CPU's default


@pytest.mark.parametrize("slices,rows", [(8, 1), (0, 1), (8, 16)])
def test_lowers_to_triton_at_model_shapes(slices, rows):
    """The medium hybrid's MoE front (2048 features, 64 experts) after o_proj's 8 K slices or a finished sum, at 1
    and 16 rows: one Triton kernel."""
    spec = jax.ShapeDtypeStruct

    def fn(residual, norm_weight, router_weight, *sums):
        update = projection.Partials(sums[0], None, 2048, 1e-6, "bfloat16") if sums else None
        return moe_front.front(update, residual, norm_weight, router_weight, eps=1e-5)

    args = [spec((rows, 2048), jnp.bfloat16), spec((2048,), jnp.float32), spec((64, 2048), jnp.bfloat16)]
    assert count_triton_kernels(fn, *args, *([spec((slices, rows, 2048), jnp.float32)] if slices else [])) == 1


def _tiny_mxfp4():
    """The tiny hybrid with 128 features and MXFP4 experts (16 of them, top-2, 128 wide) that the MXFP4 decode kernels
    take at one row (1-row tiles, the shared MLP folded in), in interpret mode."""
    from dayzero.model.config import MXFP4Execution
    from dayzero.model.presets import tiny

    return tiny().replace(hidden_size=128, kda_num_heads=4, kda_head_dim=16, num_experts=16, num_experts_per_token=2,
                          index_topk=0, q_lora_rank=32, kv_lora_rank=28, qk_rope_head_dim=4, num_heads=4,
                          v_head_dim=16, moe_intermediate_size=128, quant_method="mxfp4",
                          mxfp4=MXFP4Execution(impl="interpret"))


def _assert_step_close(plain, plain_cache, got, got_cache, tag=None):
    """Next-token logits within 2% of the largest |logit| of `plain`'s, and each cache entry within 2% of its largest
    |value| (bf16 rounding of float32 sums taken in another order)."""
    a, f = np.asarray(plain, np.float32), np.asarray(got, np.float32)
    assert np.abs(f - a).max() < 0.02 * np.abs(a).max(), (tag, np.abs(f - a).max(), np.abs(a).max())
    for name in plain_cache:
        c, d = np.asarray(plain_cache[name], np.float32), np.asarray(got_cache[name], np.float32)
        assert np.abs(d - c).max() <= 0.02 * max(np.abs(c).max(), 1e-6), (tag, name)


@pytest.mark.usefixtures("in_out_layout")
@pytest.mark.parametrize("projections,batch", [("reference", 1), ("interpret", 1), ("interpret", 4)])
def test_model_decode_with_the_front(seed, monkeypatch, projections, batch):
    """The decoder's cached decode step of one row (or 4: the front makes no router choice then) with the KDA decode
    kernel (interpret mode), o_proj by XLA or by the projection kernel (K split: its partial sums go to the front
    unfinished), and the MoE front in one kernel (interpret mode) against the same step without the front: the same
    next-token logits to bf16 rounding (in the rows whose router choices all held: `router_choices`), and the front
    kernel called once per MoE layer after a KDA layer, and after an MLA layer where its decode projections run in
    the projection kernel (`decoder.FRONT_AFTER_MLA`; MLA without DSA here)."""
    from dayzero.kernels.kda import decode_layer
    from dayzero.model.presets import tiny

    cfg = tiny().replace(hidden_size=64, kda_num_heads=16, kda_head_dim=16, num_experts=16,
                         num_experts_per_token=2, index_topk=0, q_lora_rank=32,
                         kv_lora_rank=28, qk_rope_head_dim=4, num_heads=4, v_head_dim=16)
    step, args = prefilled_decode(cfg, seed, batch)
    monkeypatch.setattr(decode_layer, "choose", lambda impl=None: "interpret")
    chosen_projection = projection.choose
    monkeypatch.setattr(projection, "choose", lambda *a, impl=None: chosen_projection(*a, impl=projections))
    choices = spy_router_choices(monkeypatch)
    plain, _ = step(*args, decode=True)
    plain_choices = taken(choices)
    calls, selects = [], []
    front = moe_front.front
    monkeypatch.setattr(moe_front, "choose", lambda *a, impl=None: "interpret")
    monkeypatch.setattr(moe_front, "front", lambda *a, **k: calls.append(type(a[0]).__name__)
                        or selects.append(k.get("select")) or front(*a, **k))
    fused, _ = step(*args, decode=True)
    moe_after = {kind: sum(t == kind and m == "moe" for t, m in zip(cfg.layer_types, cfg.mlp_types))
                 for kind in ("kda", "mla")}
    assert moe_after["kda"] >= 1 and moe_after["mla"] >= 1
    # MLA layers take the fused decode step only with the projection kernel
    assert len(calls) == moe_after["kda"] + (moe_after["mla"] if projections == "interpret" else 0)
    if projections == "interpret":  # the KDA o_proj's K split: its partial sums reach the front unfinished (the
        assert "Partials" in calls     # MLA o_proj's 64 columns of K are not split: a finished array)
    if batch > 1:
        assert not any(selects)
    held = rows_that_held(plain_choices, choices, cfg.num_experts_per_token)  # the others moved at a near tie
    a, b = np.asarray(fused, np.float64)[held], np.asarray(plain, np.float64)[held]
    assert a.size == 0 or np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2


def test_model_decode_with_the_front_choosing(seed, monkeypatch):
    """`decoder.FRONT_SELECT` (every kernel in interpret mode): the front kernel also makes the router's choice in
    its last program (turn counters in the cache), and the decode step gives exactly the logits and caches of the
    step whose router makes the choice in its own select kernel; the counters are left at zero."""
    from dayzero.model import decoder
    from dayzero.model.presets import tiny

    cfg = tiny().replace(hidden_size=64, kda_num_heads=4, kda_head_dim=16, num_experts=16, num_experts_per_token=2,
                         index_topk=0, q_lora_rank=32, kv_lora_rank=28, qk_rope_head_dim=4, num_heads=4,
                         v_head_dim=16, moe_intermediate_size=16)
    step, args = prefilled_decode(cfg, seed, 1)
    assert args[3]["moe_turns"].shape == (cfg.num_layers, 1)
    monkeypatch.setenv("DAYZERO_KERNELS", "interpret")
    selects = []
    front = moe_front.front
    monkeypatch.setattr(moe_front, "front", lambda *a, **k: selects.append(k.get("select")) or front(*a, **k))
    monkeypatch.setattr(decoder, "FRONT_SELECT", False)
    plain, plain_cache = step(*args, decode=True)
    assert selects and not any(selects)
    selects.clear()
    monkeypatch.setattr(decoder, "FRONT_SELECT", True)
    chosen, chosen_cache = step(*args, decode=True)
    moe_layers = sum(m == "moe" for m in cfg.mlp_types)
    assert len(selects) == moe_layers and all(s is not None and s.parts >= 1 for s in selects)
    assert np.array_equal(np.asarray(chosen), np.asarray(plain))
    for name in plain_cache:
        assert np.array_equal(np.asarray(chosen_cache[name], np.float32), np.asarray(plain_cache[name], np.float32))
    assert not np.any(np.asarray(chosen_cache["moe_turns"]))


@pytest.mark.usefixtures("in_out_layout")
def test_model_decode_with_o_proj_in_the_kda_step(seed, monkeypatch):
    """`model.kda.O_PROJ_IN_STEP` (every kernel in interpret mode, one row, the KDA step split in 2 value blocks per
    head): the KDA layers' o_proj runs in their step kernel and its per-head partial sums go to the front kernel
    (one slice per head); the logits match the step with o_proj's own kernel to bf16 rounding (where the router
    choices held); the first KDA layer's caches are the same, the later ones' to bf16 rounding."""
    from dayzero.kernels.kda import decode_layer
    from dayzero.model import kda as kda_model
    from dayzero.model.presets import tiny

    cfg = tiny().replace(hidden_size=64, kda_num_heads=4, kda_head_dim=32, num_experts=16, num_experts_per_token=2,
                         index_topk=0, q_lora_rank=32, kv_lora_rank=28, qk_rope_head_dim=4, num_heads=4,
                         v_head_dim=16, moe_intermediate_size=16)
    assert decode_layer.value_split(1, 32) == 2
    step, args = prefilled_decode(cfg, seed, 1)
    monkeypatch.setenv("DAYZERO_KERNELS", "interpret")
    updates = []
    front = moe_front.front
    monkeypatch.setattr(moe_front, "front", lambda *a, **k: updates.append(a[0]) or front(*a, **k))
    choices = spy_router_choices(monkeypatch)
    plain, plain_cache = step(*args, decode=True)
    plain_choices = taken(choices)
    plain_slices = [u.slices for u in taken(updates) if isinstance(u, projection.Partials)]
    monkeypatch.setattr(kda_model, "O_PROJ_IN_STEP", True)
    fused, fused_cache = step(*args, decode=True)
    kda_moe = sum(t == "kda" and m == "moe" for t, m in zip(cfg.layer_types, cfg.mlp_types))
    heads = [u.slices for u in updates if isinstance(u, projection.Partials) and u.slices == cfg.kda_num_heads]
    assert kda_moe >= 1 and len(heads) == kda_moe and cfg.kda_num_heads not in plain_slices
    for name in ("conv", "state"):  # the first KDA layer's exactly (its o_proj comes after), the later ones close
        got, want = np.asarray(fused_cache[name], np.float64), np.asarray(plain_cache[name], np.float64)
        assert np.array_equal(got[0], want[0]) and np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
    assert not np.any(np.asarray(fused_cache["kda_turns"]))
    held = rows_that_held(plain_choices, choices, cfg.num_experts_per_token)
    a, b = np.asarray(fused, np.float64)[held], np.asarray(plain, np.float64)[held]
    assert a.size == 0 or np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2


@pytest.mark.parametrize("sigmoid,parts", [(True, 2), (False, 1)])
def test_front_makes_the_routers_choice(seed, sigmoid, parts):
    """`front(select=)` (interpret mode): the same x, normed and logits as without, and the last program's choice
    exactly `kernels.router.select_and_schedule`'s on those logits (ids, weights, the one-token schedule), the
    counters left at zero; with `zeros`, the same and int32 zeros for the decode kernels' turn counters (a power of
    two at least that many; refused without the choice); the choice without counters, or of a layer past them, is
    refused by name; it lowers to one Triton kernel at the medium hybrid's shapes."""
    from dayzero.kernels import router

    rng = np.random.default_rng(seed)
    hidden, n_experts = 128, 64
    residual = jnp.asarray(rng.standard_normal((1, hidden)), jnp.bfloat16)
    update = projection.Partials(jnp.asarray(rng.standard_normal((4, 1, hidden)), jnp.float32), None, hidden, 1e-6,
                                 "bfloat16")
    norm_weight = jnp.asarray(rng.uniform(0.5, 1.5, hidden), jnp.float32)
    router_weight = jnp.asarray(rng.standard_normal((n_experts, hidden)) * 0.1, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(n_experts) * 0.1, jnp.float32)
    select = moe_front.Select(6, sigmoid, True, 2.5, parts)
    turns = jnp.zeros((3, 4), jnp.int32)
    args = (update, residual, norm_weight, router_weight)
    *front3, ids, weights, turns_after = moe_front.front(*args, eps=1e-5, select=select, bias=bias, turns=turns,
                                                         layer=2, interpret=True)
    plain = moe_front.front(*args, eps=1e-5, interpret=True)
    for a, b in zip(front3, plain):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    want = router.select_and_schedule(plain[2], bias, top_k=6, sigmoid=sigmoid, renormalize=True, scale=2.5,
                                      shared_parts=parts, interpret=True)
    got = router.one_token_routing(ids, weights, 6 + parts, n_experts + parts)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.any(np.asarray(turns_after))
    *same, zeros = moe_front.front(*args, eps=1e-5, select=select, bias=bias, turns=turns, layer=2, zeros=40,
                                   interpret=True)
    for a, b in zip(same, (*front3, ids, weights, turns_after)):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert zeros.shape == (64,) and zeros.dtype == jnp.int32 and not np.any(np.asarray(zeros))
    with pytest.raises(ValueError, match="with the router's choice"):
        moe_front.front(*args, eps=1e-5, zeros=8, interpret=True)
    with pytest.raises(ValueError, match="turn counters"):
        moe_front.front(*args, eps=1e-5, select=select, bias=bias, interpret=True)
    with pytest.raises(ValueError, match="turn counters"):
        moe_front.front(*args, eps=1e-5, select=select, bias=bias, turns=turns, layer=3, interpret=True)
    spec = jax.ShapeDtypeStruct

    def model_shapes(sums, residual, norm_weight, router_weight, bias, turns):
        update = projection.Partials(sums, None, 2048, 1e-6, "bfloat16")
        return moe_front.front(update, residual, norm_weight, router_weight, eps=1e-5, select=select, bias=bias,
                               turns=turns, layer=1)

    assert count_triton_kernels(model_shapes, spec((8, 1, 2048), jnp.float32), spec((1, 2048), jnp.bfloat16),
                                spec((2048,), jnp.float32), spec((64, 2048), jnp.bfloat16),
                                spec((64,), jnp.float32), spec((16, 4), jnp.int32)) == 1

    def with_sums(sums, residual, norm_weight, router_weight, bias, turns):  # float32 rows in, x as float32 out
        update = projection.Partials(sums, None, 2048, 1e-6, "bfloat16")
        return moe_front.front(update, residual, norm_weight, router_weight, eps=1e-5, select=select, bias=bias,
                               turns=turns, layer=1, sums=True, zeros=64)

    assert count_triton_kernels(with_sums, spec((8, 1, 2048), jnp.float32), spec((1, 2048), jnp.float32),
                                spec((2048,), jnp.float32), spec((64, 2048), jnp.bfloat16),
                                spec((64,), jnp.float32), spec((16, 4), jnp.int32)) == 1


def _shared_case(seed):
    """One row of 128 features, 64 experts and a shared MLP of 192 columns, with the router's choice (interpret
    mode) -> (args, the choice's keywords, (gate, up), the front's results without the shared programs)."""
    rng = np.random.default_rng(seed)
    hidden, n_experts, inter = 128, 64, 192
    args = _inputs(rng, 1, 4, hidden, n_experts)
    shared = tuple(jnp.asarray(rng.standard_normal((hidden, inter)) * 0.1, jnp.bfloat16) for _ in range(2))
    choice = dict(select=moe_front.Select(6, True, True, 2.5, 4), turns=jnp.zeros((3, 4), jnp.int32), layer=2,
                  zeros=16)
    return args, choice, shared, moe_front.front(*args, eps=1e-5, interpret=True, **choice)


def _shared_kernels_at_medium_shapes(programs) -> int:
    """Triton kernels `front(shared=)` lowers to at the medium hybrid's shapes (2048 features, 64 experts, a shared
    MLP of 768 columns, o_proj's 8 K slices) with these `shared_programs`."""
    spec = jax.ShapeDtypeStruct

    def model_shapes(sums, residual, norm_weight, router_weight, bias, turns, gate, up):
        update = projection.Partials(sums, None, 2048, 1e-6, "bfloat16")
        return moe_front.front(update, residual, norm_weight, router_weight, eps=1e-5, bias=bias, turns=turns,
                               select=moe_front.Select(6, True, True, 2.5, 4), layer=1, sums=True, zeros=64,
                               shared=(gate, up), shared_programs=programs)

    return count_triton_kernels(model_shapes, spec((8, 1, 2048), jnp.float32), spec((1, 2048), jnp.float32),
                                spec((2048,), jnp.float32), spec((64, 2048), jnp.bfloat16), spec((64,), jnp.float32),
                                spec((16, 4), jnp.int32), spec((2048, 768), jnp.bfloat16),
                                spec((2048, 768), jnp.bfloat16))


@pytest.mark.parametrize("block_n,k_parts", [(16, 2), (32, 4), (64, 1)])
def test_front_makes_the_shared_products(seed, block_n, k_parts):
    """`front(shared=)` (interpret mode, with the router's choice): programs beside the router's multiply the normed
    row by the shared MLP's gate and up weights; everything else is bit for bit the front without them, and the sums
    over the parts of K are within float32 rounding of a float64 product of the kernel's normed row, as the XLA
    form's are. The products without the choice, for several rows, of weights that do not fit the hidden size or of
    columns the programs do not divide are refused by name; it lowers to one Triton kernel at the medium hybrid's
    shapes."""
    args, choice, (gate, up), plain = _shared_case(seed)
    residual, norm_weight, router_weight, inter = args[1], args[2], args[3], gate.shape[1]
    *same, sums = moe_front.front(*args, eps=1e-5, interpret=True, shared=(gate, up),
                                  shared_programs=moe_front.SharedProducts(block_n, k_parts), **choice)
    assert len(same) == len(plain) and sums.shape == (k_parts, 2, inter) and sums.dtype == jnp.float32
    for a, b in zip(same, plain):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    oracle = np.stack([np.asarray(same[1], np.float64)[0] @ np.asarray(w, np.float64) for w in (gate, up)])
    np.testing.assert_allclose(np.asarray(sums, np.float64).sum(0), oracle, rtol=1e-5, atol=1e-5)
    ref = moe_front.reference(*args, eps=1e-5, shared=(gate, up))
    ref_oracle = np.stack([np.asarray(ref[1], np.float64)[0] @ np.asarray(w, np.float64) for w in (gate, up)])
    assert ref[-1].shape == (1, 2, inter)
    np.testing.assert_allclose(np.asarray(ref[-1][0], np.float64), ref_oracle, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="with the router's choice"):
        moe_front.front(*args, eps=1e-5, interpret=True, shared=(gate, up))
    with pytest.raises(ValueError, match="do not match 128 features"):
        moe_front.front(*args, eps=1e-5, interpret=True, shared=(gate[:64], up[:64]), **choice)
    with pytest.raises(ValueError, match="programs of 128 columns"):
        moe_front.front(*args, eps=1e-5, interpret=True, shared=(gate, up),
                        shared_programs=moe_front.SharedProducts(128, 2), **choice)
    with pytest.raises(ValueError, match="one row, not 2"):
        moe_front.reference(None, jnp.concatenate([residual] * 2), norm_weight, router_weight, eps=1e-5,
                            shared=(gate, up))
    assert moe_front.shared_products(2048, 768) == moe_front.SharedProducts(
        moe_front.SHARED_BLOCK_N, moe_front.SHARED_K_PARTS, moe_front.SHARED_ROW_PART)
    assert moe_front.shared_products(2048, 760) is None
    assert moe_front.shared_products(4096, 768) is None  # [512, 64] blocks: over SHARED_MAX_BLOCK
    assert _shared_kernels_at_medium_shapes(None) == 1


def test_front_makes_the_shared_products_of_the_row_part(seed):
    """`SharedProducts.row_part` (interpret mode, with the router's choice): each shared program multiplies its K part
    of the unnormalised row (x times the norm weight) and the front returns the sums with the row's 1 / rms
    (`moe_mxfp4_gemv.ScaledSums`); everything else is bit for bit the front without them, the sums are within float32
    rounding of a float64 product of the kernel's x, the factor is the row's 1 / rms, and their product is the
    normed row's to bf16 rounding. It lowers to one Triton kernel at the medium hybrid's shapes."""
    from dayzero.kernels import moe_mxfp4_gemv
    args, choice, (gate, up), plain = _shared_case(seed)
    norm_weight, inter = args[2], gate.shape[1]
    *same, made = moe_front.front(*args, eps=1e-5, interpret=True, shared=(gate, up),
                                  shared_programs=moe_front.SharedProducts(32, 4, True), **choice)
    assert isinstance(made, moe_mxfp4_gemv.ScaledSums)
    assert made.sums.shape == (4, 2, inter) and made.scale.shape == (1,) and made.scale.dtype == jnp.float32
    assert len(same) == len(plain)
    for a, b in zip(same, plain):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    x = np.asarray(same[0], np.float64)[0]
    inv_rms = 1.0 / np.sqrt(np.mean(x * x) + 1e-5)
    np.testing.assert_allclose(float(made.scale[0]), inv_rms, rtol=1e-6)
    unnormed = x * np.asarray(norm_weight, np.float64)
    oracle = np.stack([unnormed @ np.asarray(w, np.float64) for w in (gate, up)])
    np.testing.assert_allclose(np.asarray(made.sums, np.float64).sum(0), oracle, rtol=1e-5, atol=1e-4)
    normed = np.stack([np.asarray(same[1], np.float64)[0] @ np.asarray(w, np.float64) for w in (gate, up)])
    scaled = np.asarray(made.sums, np.float64).sum(0) * float(made.scale[0])
    assert np.max(np.abs(scaled - normed)) < 2.0 ** -7 * np.max(np.abs(normed)), np.max(np.abs(scaled - normed))
    assert _shared_kernels_at_medium_shapes(moe_front.SharedProducts(64, 8, True)) == 1


def test_model_decode_mxfp4_takes_packed_x_and_the_routers_schedule(seed, monkeypatch):
    """MXFP4 experts at a 4-row decode step (2-row tiles of the MXFP4 decode kernels), every kernel in interpret
    mode: the front kernel packs x for those kernels (`MoE.front_packs`) and the router's select kernel makes their
    schedule (`ROUTER_SCHEDULE`, 2-row tiles) in every MoE layer after a fused attention step; the logits and caches
    are bit for bit those of the step where XLA packs x and makes the schedule (the same words and arrays)."""
    from dayzero.kernels import moe_mxfp4_gemv, router
    from dayzero.model import moe
    from dayzero.model.config import MXFP4Execution
    from dayzero.model.presets import tiny

    batch = 4
    cfg = tiny().replace(hidden_size=64, kda_num_heads=4, kda_head_dim=16, num_experts=16, num_experts_per_token=2,
                         index_topk=0, q_lora_rank=32, kv_lora_rank=28, qk_rope_head_dim=4, num_heads=4,
                         v_head_dim=16, moe_intermediate_size=32, quant_method="mxfp4",
                         mxfp4=MXFP4Execution(impl="interpret"))
    step, args = prefilled_decode(cfg, seed, batch)
    monkeypatch.setenv("DAYZERO_KERNELS", "interpret")
    packs, schedules = [], []
    front, schedule = moe_front.front, router.select_and_schedule
    monkeypatch.setattr(moe_front, "front", lambda *a, **k: packs.append(k.get("pack")) or front(*a, **k))
    monkeypatch.setattr(router, "select_and_schedule",
                        lambda *a, **k: schedules.append(k.get("block_m")) or schedule(*a, **k))
    given, experts = [], moe_mxfp4_gemv.grouped_swiglu
    monkeypatch.setattr(moe_mxfp4_gemv, "grouped_swiglu", lambda *a, **k: given.append(
        (k["sched"] is not None, k["x_words"] is not None)) or experts(*a, **k))
    monkeypatch.setattr(moe, "FRONT_PACKED_MIN_TOKENS", batch + 1)
    monkeypatch.setattr(moe, "ROUTER_SCHEDULE", False)
    plain, plain_cache = step(*args, decode=True)
    assert packs and not any(packs) and not schedules and given and not any(map(any, given))
    packs.clear()
    given.clear()
    monkeypatch.setattr(moe, "FRONT_PACKED_MIN_TOKENS", 2)
    monkeypatch.setattr(moe, "ROUTER_SCHEDULE", True)
    made, made_cache = step(*args, decode=True)
    moe_layers = sum(m == "moe" for m in cfg.mlp_types)
    assert packs and all(packs) and schedules == [2] * moe_layers and given == [(True, True)] * moe_layers
    assert np.array_equal(np.asarray(made), np.asarray(plain))
    for name in plain_cache:
        assert np.array_equal(np.asarray(made_cache[name], np.float32), np.asarray(plain_cache[name], np.float32))


def test_model_decode_mxfp4_folds_the_shared_mlp(seed, monkeypatch):
    """MXFP4 experts at a one-row decode step, every kernel in interpret mode: the MXFP4 decode kernels run the
    shared MLP too (`SHARED_IN_PACKED_MAX_TOKENS`, `moe_mxfp4_gemv.SharedFold`) and the front kernel makes the
    router's choice with its parts appended (`MoE.front_select`), in every MoE layer after a fused attention step;
    the next-token logits match the step where the shared MLP runs apart (its own kernels, bf16 between them) to bf16
    rounding. With the choice the front kernel also writes the zeros the decode kernels take as turn counters
    (`front(zeros=)`, `Schedule.turns`), which they find enough (`moe_mxfp4_gemv.turn_count`)."""
    from dayzero.kernels import moe_mxfp4_gemv
    from dayzero.model import moe
    cfg = _tiny_mxfp4()
    step, args = prefilled_decode(cfg, seed, 1)
    monkeypatch.setenv("DAYZERO_KERNELS", "interpret")
    selects, given, turns = [], [], []
    front, experts = moe_front.front, moe_mxfp4_gemv.grouped_swiglu
    monkeypatch.setattr(moe_front, "front", lambda *a, **k: selects.append(k.get("select")) or front(*a, **k))
    monkeypatch.setattr(moe_mxfp4_gemv, "grouped_swiglu", lambda *a, **k: given.append(
        (k.get("shared") is not None, k["sched"] is not None)) or turns.append(k["sched"].turns) or experts(*a, **k))
    monkeypatch.setattr(moe, "RESIDUAL_IN_SUMS", False)  # both sides add the residual alike (it needs the fold)
    monkeypatch.setattr(moe, "SHARED_IN_PACKED_MAX_TOKENS", 0)
    choices = spy_router_choices(monkeypatch)
    apart, _ = step(*args, decode=True)
    apart_choices = taken(choices)
    moe_layers = sum(m == "moe" for m in cfg.mlp_types)
    assert selects and not any(selects) and given == [(False, True)] * moe_layers
    assert all(t is None for t in turns)
    selects.clear()
    given.clear()
    turns.clear()
    monkeypatch.setattr(moe, "SHARED_IN_PACKED_MAX_TOKENS", 1)
    folded, _ = step(*args, decode=True)
    assert len(selects) == moe_layers and all(s is not None and s.parts == moe_mxfp4_gemv.SHARED_QUARTERS
                                              for s in selects)
    assert given == [(True, True)] * moe_layers
    tiles = moe_mxfp4_gemv.tiles_for(cfg.num_experts_per_token, cfg.num_experts)
    parts = moe_mxfp4_gemv.SHARED_QUARTERS
    need = moe_mxfp4_gemv.turn_count(cfg.num_experts_per_token + parts, cfg.num_experts + parts, cfg.hidden_size,
                                     cfg.moe_intermediate_size, tiles, True)
    assert need and len(turns) == moe_layers and all(t is not None and t.shape[0] >= need for t in turns)
    if not rows_that_held(apart_choices, choices, cfg.num_experts_per_token).all():
        return  # a choice moved at a near tie (`router_choices`): the later layers see other inputs
    a, f = np.asarray(apart, np.float32), np.asarray(folded, np.float32)
    assert np.abs(f - a).max() < 0.02 * np.abs(a).max(), (np.abs(f - a).max(), np.abs(a).max())


def test_model_decode_makes_the_shared_gate_up_in_the_front(seed, monkeypatch):
    """`model.moe.SHARED_GATE_UP_IN_FRONT` (MXFP4 experts, a one-row decode step, every kernel in interpret mode): in
    every MoE layer the front kernel also makes the shared MLP's gate / up sums and the MXFP4 gate/up kernel finishes
    them (`SharedMLP.gate_up_sums`), then with `SHARED_DOWN_IN_GATE_UP` runs the shared down projection there too,
    and then from the row part's sums with the row's 1 / rms (`kernels.moe_front.SHARED_ROW_PART`); each way the
    next-token logits and caches match the step with the switches off to bf16 rounding (float32 sums in another
    order, rounded where the model rounds; unless a router's near tie moved a choice: `router_choices`), the counters
    left at zero."""
    from dayzero.kernels import moe_mxfp4_gemv
    from dayzero.model import moe
    cfg = _tiny_mxfp4()
    step, args = prefilled_decode(cfg, seed, 1)
    monkeypatch.setenv("DAYZERO_KERNELS", "interpret")
    fronts, given = [], []
    front, experts = moe_front.front, moe_mxfp4_gemv.grouped_swiglu
    monkeypatch.setattr(moe_front, "front",
                        lambda *a, **k: fronts.append(k.get("shared") is not None) or front(*a, **k))
    monkeypatch.setattr(moe_mxfp4_gemv, "grouped_swiglu", lambda *a, **k: given.append(
        (getattr(k["shared"], "gate_up_sums", None) is not None, getattr(k["shared"], "down_in_gate_up", False),
         isinstance(getattr(k["shared"], "gate_up_sums", None), moe_mxfp4_gemv.ScaledSums))) or experts(*a, **k))
    choices = spy_router_choices(monkeypatch)
    monkeypatch.setattr(moe, "SHARED_GATE_UP_IN_FRONT", False)
    plain, plain_cache = step(*args, decode=True)
    plain_choices = taken(choices)
    moe_layers = sum(m == "moe" for m in cfg.mlp_types)
    assert fronts == [False] * moe_layers and given == [(False, False, False)] * moe_layers
    monkeypatch.setattr(moe, "SHARED_GATE_UP_IN_FRONT", True)
    for down_early, row_part in ((False, False), (True, False), (True, True)):
        fronts.clear()
        given.clear()
        monkeypatch.setattr(moe, "SHARED_DOWN_IN_GATE_UP", down_early)
        monkeypatch.setattr(moe_front, "SHARED_ROW_PART", row_part)
        made, made_cache = step(*args, decode=True)
        made_choices = taken(choices)
        assert fronts == [True] * moe_layers and given == [(True, down_early, row_part)] * moe_layers
        assert not np.any(np.asarray(made_cache["moe_turns"]))
        if not rows_that_held(plain_choices, made_choices, cfg.num_experts_per_token).all():
            continue  # a choice moved at a near tie: the later layers see other inputs
        _assert_step_close(plain, plain_cache, made, made_cache, tag=(down_early, row_part))


def test_model_decode_adds_the_residual_in_the_down_kernel(seed, monkeypatch):
    """`model.moe.RESIDUAL_IN_SUMS` (MXFP4 experts, a one-row decode step, every kernel in interpret mode): in every
    MoE layer the front kernel writes the residual rows as float32 and the MXFP4 down kernel adds the experts into
    them (no residual add after it), the next layer's kernels round the float32 rows as they load; the next-token
    logits and the caches match the step with the switch off to bf16 rounding (the sum is rounded once instead of
    twice), and the turn counters are left at zero. Where that rounding moves a router's choice, the choice must have
    been a near tie (seen at some seeds: 2nd and 3rd logits 5e-4 apart); the logits are then not compared
    (`router_choices`)."""
    from dayzero.kernels import moe_mxfp4_gemv
    from dayzero.model import moe
    cfg = _tiny_mxfp4()
    step, args = prefilled_decode(cfg, seed, 1)
    monkeypatch.setenv("DAYZERO_KERNELS", "interpret")
    fronts, experts_out = [], []
    front, experts = moe_front.front, moe_mxfp4_gemv.grouped_swiglu
    choices = spy_router_choices(monkeypatch)

    def spy_experts(*a, **k):
        out = experts(*a, **k)
        experts_out.append((k.get("residual_sums") is not None, out.dtype))
        return out

    monkeypatch.setattr(moe_front, "front", lambda *a, **k: fronts.append(k.get("sums", False)) or front(*a, **k))
    monkeypatch.setattr(moe_mxfp4_gemv, "grouped_swiglu", spy_experts)
    monkeypatch.setattr(moe, "RESIDUAL_IN_SUMS", False)
    plain, plain_cache = step(*args, decode=True)
    moe_layers = sum(m == "moe" for m in cfg.mlp_types)
    assert fronts == [False] * moe_layers and experts_out == [(False, jnp.bfloat16)] * moe_layers
    plain_choices = taken(choices)
    fronts.clear()
    experts_out.clear()
    monkeypatch.setattr(moe, "RESIDUAL_IN_SUMS", True)
    summed, summed_cache = step(*args, decode=True)
    assert fronts == [True] * moe_layers and experts_out == [(True, jnp.float32)] * moe_layers
    assert not np.any(np.asarray(summed_cache["moe_turns"]))
    assert len(choices) == moe_layers
    if not rows_that_held(plain_choices, choices, cfg.num_experts_per_token).all():
        return  # a choice moved at a near tie: the later layers see other inputs
    _assert_step_close(plain, plain_cache, summed, summed_cache)


def test_front_packs_x_as_xla_does(seed):
    """`front(pack=True)` (interpret mode): besides x, normed and the logits, normed's words for the MXFP4 decode
    kernels bit for bit as `moe_mxfp4_gemv.row_scaled_words` packs them, and a zero row after them (`packed_rows`);
    a feature count of part of an MX block is refused."""
    from dayzero.kernels import moe_mxfp4_gemv

    rng = np.random.default_rng(seed)
    update, residual, norm_weight, router_weight = _inputs(rng, 5, 2)
    got = moe_front.front(update, residual, norm_weight, router_weight, eps=1e-5, pack=True, interpret=True)
    want = moe_front.reference(update, residual, norm_weight, router_weight, eps=1e-5, pack=True)
    assert len(got) == len(want) == 4
    for g, w in zip(got[:2], want[:2]):
        assert np.array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    words, factors = got[3]
    assert words.shape == (6, 4, 16) and words.dtype == jnp.uint32 and factors.shape == (6,)
    want_words, want_factors = moe_mxfp4_gemv.row_scaled_words(got[1])
    assert np.array_equal(words[:5], want_words) and np.array_equal(factors[:5], want_factors)
    assert factors[5] == moe_front.ZERO_ROW_FACTOR
    assert not np.asarray(words[5]).any() and np.asarray(words[:5]).any()
    with pytest.raises(ValueError, match="whole MX blocks"):
        moe_front.front(None, residual[:, :16], norm_weight[:16], router_weight[:, :16], eps=1e-5, pack=True,
                        interpret=True)
