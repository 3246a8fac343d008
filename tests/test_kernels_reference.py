"""Tests of the plain-jnp kernel references in `dayzero.kernels` (CPU, small shapes).

Oracles: the token-by-token KDA recurrence, transformers' torch Kimi-Linear functions (float32, CPU), and dense numpy
loops. Inputs are fresh random draws every run; each test prints its seed and puts it in every assertion message.
Set DAYZERO_TEST_SEED=<int> to replay a failing draw.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import attention, dispatch, indexer, moe, short_conv
from dayzero.kernels import kda as kda_ops
from dayzero.kernels.kda import reference as kda_ref

torch = pytest.importorskip("torch")
hf_kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _torch_fn(fn):
    """The plain torch function under transformers' hub-kernel / fla fallback decorator."""
    return getattr(fn, "__wrapped__", fn)


hf_chunk_kda = _torch_fn(hf_kimi.chunk_kimi_delta_attention)
hf_recurrent_kda = _torch_fn(hf_kimi.recurrent_kimi_delta_attention)
hf_conv_fn = _torch_fn(hf_kimi.causal_conv1d_fn)
hf_conv_update = _torch_fn(hf_kimi.causal_conv1d_update)


# ----------------------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def seed(request):
    env = os.environ.get("DAYZERO_TEST_SEED")
    value = int(env) if env else int(np.random.SeedSequence().entropy % (2**32))
    print(f"{request.node.nodeid}: seed={value} (replay with DAYZERO_TEST_SEED={value})")
    return value


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected| (absolute error when expected is all zeros)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = np.max(np.abs(expected)) if expected.size else 0.0
    err = np.max(np.abs(actual - expected)) if expected.size else 0.0
    return float(err / scale) if scale > 0 else float(err)


def assert_close(actual, expected, rtol, what, seed):
    assert np.all(np.isfinite(np.asarray(actual, np.float64))), f"{what}: non-finite values (seed={seed})"
    err = rel_err(actual, expected)
    assert err <= rtol, f"{what}: relative max error {err:.3e} > {rtol:.1e} (seed={seed})"


def to_np(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def kda_inputs(seed, B, T, H, K, V, *, g_max=1.0, g_extreme=None, l2norm=False, init=False):
    """Float32 numpy inputs. Without the in-kernel l2norm, k gets a norm in [0.3, 1.2] so the delta rule is stable."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k = rng.standard_normal((B, T, H, K))
    if not l2norm:
        k = k / np.linalg.norm(k, axis=-1, keepdims=True) * rng.uniform(0.3, 1.2, (B, T, H, 1))
    k = k.astype(np.float32)
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    g = -rng.uniform(0.0, g_max, (B, T, H, K))
    g[..., 0] = 0.0  # one channel that never decays
    if g_extreme is not None:  # a random ~third of the entries decay by g_extreme per step
        g = np.where(rng.random(g.shape) < 0.3, g_extreme, g)
    g = g.astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (B, T, H)).astype(np.float32)
    s0 = (0.5 * rng.standard_normal((B, H, K, V))).astype(np.float32) if init else None
    return q, k, v, g, beta, s0


def run_kda(fn, inputs, dtype=jnp.float32, l2norm=False, **kwargs):
    q, k, v, g, beta, s0 = inputs
    args = [jnp.asarray(x, dtype) for x in (q, k, v, g, beta)]
    state = None if s0 is None else jnp.asarray(s0, jnp.float32)
    return fn(*args, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=l2norm, **kwargs)


# ------------------------------------------------------------------------------------------- KDA: chunk vs recurrent

# (B, H, K, V, l2norm, init): every length runs every row, so each length sees K != V, both flags on and off.
KDA_CONFIGS = [
    (1, 1, 8, 8, False, False),
    (2, 3, 16, 8, True, True),
    (1, 2, 4, 16, False, True),
    (2, 4, 8, 12, True, False),
]


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 130])
@pytest.mark.parametrize("B,H,K,V,l2norm,init", KDA_CONFIGS)
def test_chunk_matches_recurrent(seed, T, B, H, K, V, l2norm, init):
    inputs = kda_inputs(seed, B, T, H, K, V, l2norm=l2norm, init=init)
    o_c, s_c = run_kda(kda_ref.chunk_kda, inputs, l2norm=l2norm)
    o_r, s_r = run_kda(kda_ref.fused_recurrent_kda, inputs, l2norm=l2norm)
    assert o_c.shape == (B, T, H, V) and o_c.dtype == jnp.float32
    assert s_c.shape == (B, H, K, V) and s_c.dtype == jnp.float32 and s_r.dtype == jnp.float32
    assert_close(o_c, o_r, 1e-4, "chunk vs recurrent output", seed)
    assert_close(s_c, s_r, 1e-4, "chunk vs recurrent final state", seed)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_size_does_not_change_result(seed, chunk_size):
    inputs = kda_inputs(seed, 2, 77, 2, 8, 16, l2norm=True, init=True)
    o64, s64 = run_kda(kda_ref.chunk_kda, inputs, l2norm=True)
    o, s = run_kda(kda_ref.chunk_kda, inputs, l2norm=True, chunk_size=chunk_size)
    assert_close(o, o64, 1e-4, f"chunk_size={chunk_size} output", seed)
    assert_close(s, s64, 1e-4, f"chunk_size={chunk_size} state", seed)


def test_final_state_only_when_requested(seed):
    q, k, v, g, beta, _ = kda_inputs(seed, 1, 5, 2, 8, 8)
    args = [jnp.asarray(x) for x in (q, k, v, g, beta)]
    for fn in (kda_ref.chunk_kda, kda_ref.fused_recurrent_kda):
        o, s = fn(*args)
        assert s is None and o.shape == (1, 5, 2, 8)


def test_explicit_scale(seed):
    inputs = kda_inputs(seed, 1, 33, 2, 8, 4, init=True)
    o_c, s_c = run_kda(kda_ref.chunk_kda, inputs, scale=0.7)
    o_r, s_r = run_kda(kda_ref.fused_recurrent_kda, inputs, scale=0.7)
    o_d, _ = run_kda(kda_ref.fused_recurrent_kda, inputs)
    assert_close(o_c, o_r, 1e-4, "scale=0.7 chunk vs recurrent", seed)
    assert_close(s_c, s_r, 1e-4, "scale=0.7 state", seed)
    # The state does not depend on the query scale; the output is linear in it.
    assert_close(o_r, to_np(o_d) * 0.7 * np.sqrt(8), 1e-5, "output linear in scale", seed)


@pytest.mark.parametrize("T", [7, 65, 130])
@pytest.mark.parametrize("g_max,g_extreme", [(8.0, None), (8.0, -50.0), (1.0, -50.0), (0.5, -1e4)])
def test_strong_decay(seed, T, g_max, g_extreme):
    inputs = kda_inputs(seed, 2, T, 2, 8, 8, g_max=g_max, g_extreme=g_extreme, l2norm=True, init=True)
    o_c, s_c = run_kda(kda_ref.chunk_kda, inputs, l2norm=True)
    o_r, s_r = run_kda(kda_ref.fused_recurrent_kda, inputs, l2norm=True)
    for name, x in (("chunk out", o_c), ("chunk state", s_c), ("rec out", o_r), ("rec state", s_r)):
        assert np.all(np.isfinite(to_np(x))), f"{name} not finite (seed={seed}, g_max={g_max}, extreme={g_extreme})"
    assert_close(o_c, o_r, 1e-4, f"strong decay output (g_max={g_max}, extreme={g_extreme})", seed)
    assert_close(s_c, s_r, 1e-4, f"strong decay state (g_max={g_max}, extreme={g_extreme})", seed)


def test_fully_decayed_state_is_forgotten(seed):
    """With g = -50 everywhere at one step, everything before it is gone: the output after it ignores the prefix."""
    B, T, H, K, V = 1, 70, 2, 8, 8
    q, k, v, g, beta, s0 = kda_inputs(seed, B, T, H, K, V, l2norm=True, init=True)
    cut = 40
    g[:, cut] = -50.0
    full = run_kda(kda_ref.chunk_kda, (q, k, v, g, beta, s0), l2norm=True)
    tail = run_kda(kda_ref.chunk_kda, tuple(x[:, cut:] for x in (q, k, v, g, beta)) + (None,), l2norm=True)
    assert_close(full[0][:, cut:], tail[0], 1e-5, "output after a total forget", seed)
    assert_close(full[1], tail[1], 1e-5, "state after a total forget", seed)


# ------------------------------------------------------------------------------------------ KDA: transformers oracle


def _hf_kda(fn, inputs, l2norm):
    q, k, v, g, beta, s0 = (None if x is None else torch.from_numpy(np.array(x, np.float32)) for x in inputs)
    with torch.no_grad():
        if fn is hf_chunk_kda:
            o, s = fn(q, k, v, g, beta, chunk_size=64, initial_state=s0, output_final_state=True,
                      use_qk_l2norm_in_kernel=l2norm)
        else:
            o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    return o.numpy(), s.numpy()


@pytest.mark.parametrize("T,l2norm,init", [(1, True, True), (7, False, True), (65, True, True), (130, False, True),
                                            (130, True, False)])
def test_kda_matches_transformers(seed, T, l2norm, init):
    inputs = kda_inputs(seed, 2, T, 3, 8, 12, g_max=2.0, l2norm=l2norm, init=init)
    hf_o_c, hf_s_c = _hf_kda(hf_chunk_kda, inputs, l2norm)
    hf_o_r, hf_s_r = _hf_kda(hf_recurrent_kda, inputs, l2norm)
    assert_close(hf_o_c, hf_o_r, 1e-4, "transformers chunk vs transformers recurrent (sanity)", seed)
    o_c, s_c = run_kda(kda_ref.chunk_kda, inputs, l2norm=l2norm)
    o_r, s_r = run_kda(kda_ref.fused_recurrent_kda, inputs, l2norm=l2norm)
    assert_close(o_c, hf_o_c, 1e-4, "chunk_kda vs transformers chunk output", seed)
    assert_close(s_c, hf_s_c, 1e-4, "chunk_kda vs transformers chunk state", seed)
    assert_close(o_r, hf_o_r, 1e-4, "fused_recurrent_kda vs transformers recurrent output", seed)
    assert_close(s_r, hf_s_r, 1e-4, "fused_recurrent_kda vs transformers recurrent state", seed)


def test_kda_strong_decay_matches_transformers(seed):
    inputs = kda_inputs(seed, 1, 67, 2, 8, 8, g_max=8.0, g_extreme=-50.0, l2norm=True, init=True)
    hf_o, hf_s = _hf_kda(hf_recurrent_kda, inputs, True)
    o, s = run_kda(kda_ref.chunk_kda, inputs, l2norm=True)
    assert_close(o, hf_o, 1e-4, "strong decay vs transformers output", seed)
    assert_close(s, hf_s, 1e-4, "strong decay vs transformers state", seed)


# ------------------------------------------------------------------------------------------------ KDA: state carry


@pytest.mark.parametrize("T1", [1, 37, 64, 100])
def test_chunk_state_carry(seed, T1):
    T = 130
    q, k, v, g, beta, s0 = kda_inputs(seed, 2, T, 2, 8, 4, l2norm=True, init=True)
    o_full, s_full = run_kda(kda_ref.chunk_kda, (q, k, v, g, beta, s0), l2norm=True)
    o1, s1 = run_kda(kda_ref.chunk_kda, tuple(x[:, :T1] for x in (q, k, v, g, beta)) + (s0,), l2norm=True)
    o2, s2 = run_kda(kda_ref.chunk_kda, tuple(x[:, T1:] for x in (q, k, v, g, beta)) + (to_np(s1),), l2norm=True)
    assert_close(np.concatenate([to_np(o1), to_np(o2)], axis=1), o_full, 1e-4, f"split at {T1}: output", seed)
    assert_close(s2, s_full, 1e-4, f"split at {T1}: final state", seed)


def test_prefill_then_decode(seed):
    """Chunked prefill, then one token at a time through the recurrent form, equals one chunked pass."""
    T, T1 = 75, 69
    q, k, v, g, beta, s0 = kda_inputs(seed, 2, T, 2, 8, 8, l2norm=True, init=True)
    o_full, s_full = run_kda(kda_ref.chunk_kda, (q, k, v, g, beta, s0), l2norm=True)
    outs = []
    o, state = run_kda(kda_ref.chunk_kda, tuple(x[:, :T1] for x in (q, k, v, g, beta)) + (s0,), l2norm=True)
    outs.append(to_np(o))
    for t in range(T1, T):
        o, state = run_kda(kda_ref.fused_recurrent_kda, tuple(x[:, t:t + 1] for x in (q, k, v, g, beta))
                           + (to_np(state),), l2norm=True)
        outs.append(to_np(o))
    assert_close(np.concatenate(outs, axis=1), o_full, 1e-4, "prefill + decode output", seed)
    assert_close(state, s_full, 1e-4, "prefill + decode state", seed)


# ---------------------------------------------------------------------------------------------------- KDA: bf16


@pytest.mark.parametrize("fn", [kda_ref.chunk_kda, kda_ref.fused_recurrent_kda], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("T", [7, 65])
def test_kda_bf16(seed, fn, T):
    inputs = kda_inputs(seed, 2, T, 2, 16, 8, l2norm=True, init=True)
    o32, s32 = run_kda(fn, inputs, l2norm=True)
    o16, s16 = run_kda(fn, inputs, dtype=jnp.bfloat16, l2norm=True)
    assert o16.dtype == jnp.bfloat16, o16.dtype
    assert s16.dtype == jnp.float32, s16.dtype
    assert_close(o16, o32, 2e-2, "bf16 output vs fp32", seed)
    assert_close(s16, s32, 2e-2, "bf16 state vs fp32", seed)
    # On the bf16-rounded inputs the math runs in fp32: only the final cast to bf16 differs.
    rounded = tuple(None if x is None else to_np(jnp.asarray(x, jnp.bfloat16)) for x in inputs[:5]) + (inputs[5],)
    o_r32, s_r32 = run_kda(fn, rounded, l2norm=True)
    assert_close(o16, o_r32, 8e-3, "bf16 output vs fp32 on rounded inputs", seed)
    assert_close(s16, s_r32, 1e-5, "bf16 state vs fp32 on rounded inputs", seed)


# --------------------------------------------------------------------------------------------- KDA: the wrappers


def test_kda_wrappers_dispatch_to_reference(seed, monkeypatch):
    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    inputs = kda_inputs(seed, 1, 9, 2, 8, 4, l2norm=True, init=True)
    for wrapper, ref in ((kda_ops.chunk_kda, kda_ref.chunk_kda),
                         (kda_ops.fused_recurrent_kda, kda_ref.fused_recurrent_kda)):
        o_ref, s_ref = run_kda(ref, inputs, l2norm=True)
        for impl in (None, "reference", "pallas", "interpret"):
            o, s = run_kda(wrapper, inputs, l2norm=True, impl=impl)
            assert_close(o, o_ref, 0.0, f"{wrapper.__name__} impl={impl} output", seed)
            assert_close(s, s_ref, 0.0, f"{wrapper.__name__} impl={impl} state", seed)
        with pytest.raises(ValueError):
            run_kda(wrapper, inputs, impl="triton")
        monkeypatch.setenv(dispatch.ENV_OVERRIDE, "pallas")
        o, _ = run_kda(wrapper, inputs, l2norm=True)
        assert_close(o, o_ref, 0.0, f"{wrapper.__name__} with DAYZERO_KERNELS=pallas", seed)
        monkeypatch.delenv(dispatch.ENV_OVERRIDE)


# ------------------------------------------------------------------------------------------------- causal conv1d


def _silu(x):
    return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("T,W", [(1, 4), (3, 4), (37, 4), (16, 2), (9, 3)])
def test_causal_conv1d_matches_transformers(seed, T, W, activation):
    rng = np.random.default_rng(seed)
    B, C = 2, 6
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    w = rng.standard_normal((C, W)).astype(np.float32)
    y, state = short_conv.causal_conv1d(jnp.asarray(x), jnp.asarray(w), activation=activation)
    with torch.no_grad():  # transformers: x [B, C, T], weight [C, W] (the conv1d weight [C, 1, W] squeezed)
        hf = hf_conv_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w), activation=activation)
    assert y.shape == (B, T, C) and state.shape == (B, C, W - 1)
    assert_close(y, hf.transpose(1, 2).numpy(), 1e-5, f"conv vs transformers (T={T}, W={W})", seed)
    # Dense numpy oracle as well.
    padded = np.concatenate([np.zeros((B, W - 1, C), np.float32), x], axis=1)
    ref = sum(padded[:, j:j + T] * w[:, j] for j in range(W))
    ref = _silu(ref) if activation == "silu" else ref
    assert_close(y, ref, 1e-5, "conv vs numpy", seed)
    assert_close(state, np.swapaxes(padded[:, -(W - 1):], 1, 2), 0.0, "state = last W-1 inputs", seed)


@pytest.mark.parametrize("T1", [1, 2, 5, 20])
def test_causal_conv1d_split_and_state(seed, T1):
    rng = np.random.default_rng(seed)
    B, T, C, W = 2, 21, 5, 4
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    w = rng.standard_normal((C, W)).astype(np.float32)
    s0 = rng.standard_normal((B, C, W - 1)).astype(np.float32)
    y, s = short_conv.causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(s0))
    y1, s1 = short_conv.causal_conv1d(jnp.asarray(x[:, :T1]), jnp.asarray(w), jnp.asarray(s0))
    y2, s2 = short_conv.causal_conv1d(jnp.asarray(x[:, T1:]), jnp.asarray(w), s1)
    assert_close(np.concatenate([to_np(y1), to_np(y2)], axis=1), y, 1e-6, f"conv split at {T1}", seed)
    assert_close(s2, s, 0.0, f"conv split at {T1}: state", seed)
    history = np.concatenate([np.swapaxes(s0, 1, 2), x], axis=1)  # [B, W-1+T, C]
    assert_close(s, np.swapaxes(history[:, -(W - 1):], 1, 2), 0.0, "state = last W-1 inputs", seed)
    assert_close(s1, np.swapaxes(history[:, T1:T1 + W - 1], 1, 2), 0.0, "state mixes initial state and inputs",
                 seed)
    # transformers' update path with the same carried state (state [B, C, W-1], x [B, C, T]).
    with torch.no_grad():
        conv_state = torch.from_numpy(s0.copy())
        hf = hf_conv_update(torch.from_numpy(x[:, :T1]).transpose(1, 2).contiguous(), conv_state,
                            torch.from_numpy(w), activation="silu")
    assert_close(y1, hf.transpose(1, 2).numpy(), 1e-5, "conv vs transformers causal_conv1d_update", seed)
    assert_close(s1, conv_state.numpy(), 0.0, "conv state vs transformers causal_conv1d_update", seed)


def test_causal_conv1d_bad_activation():
    with pytest.raises(ValueError):
        short_conv.causal_conv1d(jnp.zeros((1, 3, 2)), jnp.zeros((2, 4)), activation="gelu")


# ------------------------------------------------------------------------------------------------------- indexer


def test_index_scores_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    B, T, S, H, D = 2, 5, 11, 3, 8
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k = rng.standard_normal((B, S, D)).astype(np.float32)
    w = rng.standard_normal((B, T, H)).astype(np.float32)
    got = indexer.index_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w), 0.3)
    ref = np.zeros((B, T, S))
    for b in range(B):
        for t in range(T):
            for h in range(H):
                ref[b, t] += w[b, t, h] * np.maximum(0.3 * (k[b] @ q[b, t, h]), 0.0)
    assert got.dtype == jnp.float32
    assert_close(got, ref, 1e-5, "index_scores", seed)


@pytest.mark.parametrize("topk", [1, 3, 8, 12, 13, 20])
def test_topk_mask(seed, topk):
    rng = np.random.default_rng(seed)
    B, T, S = 2, 9, 13
    scores = rng.permuted(np.tile(np.arange(S, dtype=np.float32), (B, T, 1)), axis=-1)  # distinct per row
    scores = (scores - S / 2) * rng.uniform(0.1, 3.0, (B, T, 1)).astype(np.float32)  # negatives too
    causal = np.arange(S)[None, None, :] <= np.arange(T)[None, :, None] + (S - T)
    allowed = causal & (rng.random((B, T, S)) < 0.8)
    allowed[0, 0] = False  # a row with nothing allowed
    allowed[1, -1] = True  # a row with everything allowed
    selected = np.asarray(indexer.topk_mask(jnp.asarray(scores), jnp.asarray(allowed), topk))
    assert selected.shape == (B, T, S) and selected.dtype == bool
    if topk >= S:
        np.testing.assert_array_equal(selected, allowed, err_msg=f"topk >= n keys returns allowed (seed={seed})")
    for b in range(B):
        for t in range(T):
            allowed_idx = np.flatnonzero(allowed[b, t])
            want = min(topk, allowed_idx.size)
            chosen = set(np.flatnonzero(selected[b, t]).tolist())
            where = f"row ({b}, {t}), topk={topk}, seed={seed}"
            assert len(chosen) == want, f"{where}: {len(chosen)} selected, expected {want}"
            assert chosen <= set(allowed_idx.tolist()), f"{where}: selected a disallowed key"
            top = allowed_idx[np.argsort(-scores[b, t, allowed_idx])[:want]]
            assert chosen == set(top.tolist()), f"{where}: selected {sorted(chosen)}, top scores {sorted(top)}"


# ----------------------------------------------------------------------------------------------------------- MoE


def _moe_dense(x, ids, weights, wg, wu, wd):
    x, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
    y = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[n, j]
            h = _silu(x[n] @ wg[e]) * (x[n] @ wu[e])
            y[n] += weights[n, j] * (h @ wd[e])
    return y


def _routing(rng, kind, N, E):
    if kind == "random":  # top-2, distinct experts per token
        ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(N)])
    elif kind == "one_expert_takes_all":  # expert 4 gets every token, experts 0, 3, 5 none
        ids = np.stack([np.full(N, 4), rng.choice([1, 2], N)], axis=1)
    elif kind == "single_last":  # top-1, all on the last expert
        ids = np.full((N, 1), E - 1)
    elif kind == "single_first":  # top-1, all on expert 0
        ids = np.zeros((N, 1), np.int64)
    else:
        raise AssertionError(kind)
    weights = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
    return ids.astype(np.int32), weights


@pytest.mark.parametrize("kind", ["random", "one_expert_takes_all", "single_last", "single_first"])
@pytest.mark.parametrize("N", [1, 7, 13])
def test_moe_experts_matches_dense(seed, N, kind):
    rng = np.random.default_rng(seed)
    E, Hd, I = 6, 8, 12
    x = rng.standard_normal((N, Hd)).astype(np.float32)
    wg, wu = (rng.standard_normal((E, Hd, I)).astype(np.float32) * 0.3 for _ in range(2))
    wd = rng.standard_normal((E, I, Hd)).astype(np.float32) * 0.3
    ids, weights = _routing(rng, kind, N, E)
    got = moe.moe_experts(*(jnp.asarray(a) for a in (x, ids, weights, wg, wu, wd)))
    assert got.shape == (N, Hd) and got.dtype == jnp.float32
    assert_close(got, _moe_dense(x, ids, weights, wg, wu, wd), 1e-5, f"moe_experts ({kind}, N={N})", seed)


def test_moe_experts_bf16(seed):
    rng = np.random.default_rng(seed)
    N, E, Hd, I = 11, 4, 16, 8
    x = rng.standard_normal((N, Hd)).astype(np.float32)
    wg, wu = (rng.standard_normal((E, Hd, I)).astype(np.float32) * 0.3 for _ in range(2))
    wd = rng.standard_normal((E, I, Hd)).astype(np.float32) * 0.3
    ids, weights = _routing(rng, "random", N, E)
    got = moe.moe_experts(jnp.asarray(x, jnp.bfloat16), *(jnp.asarray(a) for a in (ids, weights, wg, wu, wd)))
    assert got.dtype == jnp.bfloat16
    assert_close(got, _moe_dense(x, ids, weights, wg, wu, wd), 3e-2, "moe_experts bf16", seed)


# ----------------------------------------------------------------------------------------------------- attention


def test_masked_attention_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    B, T, S, H, D, Dv = 2, 5, 9, 3, 8, 6
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k = rng.standard_normal((B, S, H, D)).astype(np.float32)
    v = rng.standard_normal((B, S, H, Dv)).astype(np.float32)
    causal = np.arange(S)[None, None, :] <= np.arange(T)[None, :, None] + (S - T)
    mask = causal & (rng.random((B, T, S)) < 0.7)
    mask[:, :, 0] = True
    mask[1, 2] = False  # a fully masked row
    scale = D ** -0.5
    got = np.asarray(attention.masked_attention(*(jnp.asarray(a) for a in (q, k, v, mask)), scale))
    ref = np.zeros((B, T, H, Dv))
    for b in range(B):
        for t in range(T):
            if not mask[b, t].any():
                continue
            for h in range(H):
                logits = (k[b, :, h] @ q[b, t, h]).astype(np.float64) * scale
                logits = np.where(mask[b, t], logits, -np.inf)
                p = np.exp(logits - logits.max())
                ref[b, t, h] = (p / p.sum()) @ v[b, :, h]
    assert got.shape == (B, T, H, Dv)
    assert_close(got, ref, 1e-5, "masked_attention", seed)
    assert np.all(got[1, 2] == 0.0), f"fully masked row is not zero (seed={seed})"


# ------------------------------------------------------------------------------------------------------ dispatch


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    return monkeypatch


def test_choose_by_platform(no_env):
    both = ("reference", "pallas")
    assert dispatch.choose(both, platform="cpu") == "reference"
    assert dispatch.choose(both, platform="musa") == "reference"
    assert dispatch.choose(both, platform="tpu") == "reference"
    for platform in ("cuda", "rocm", "gpu"):
        assert dispatch.choose(both, platform=platform) == "pallas"
        assert dispatch.choose(("reference",), platform=platform) == "reference"
    assert dispatch.current_platform() == jax.devices()[0].platform
    assert dispatch.choose(both) == ("pallas" if jax.devices()[0].platform in dispatch.PALLAS_PLATFORMS
                                     else "reference")


def test_choose_overrides(no_env):
    both = ("reference", "pallas")
    assert dispatch.choose(both, impl="interpret", platform="cpu") == "interpret"
    assert dispatch.choose(both, impl="interpret", platform="cuda") == "interpret"
    assert dispatch.choose(both, impl="pallas", platform="cpu") == "pallas"
    assert dispatch.choose(both, impl="reference", platform="cuda") == "reference"
    # An override naming an implementation the op lacks falls back to the reference.
    assert dispatch.choose(("reference",), impl="pallas", platform="cuda") == "reference"
    assert dispatch.choose(("reference",), impl="interpret", platform="cuda") == "reference"
    with pytest.raises(ValueError):
        dispatch.choose(both, impl="triton", platform="cuda")


def test_choose_env_override(no_env):
    both = ("reference", "pallas")
    no_env.setenv(dispatch.ENV_OVERRIDE, "interpret")
    assert dispatch.choose(both, platform="cpu") == "interpret"
    assert dispatch.choose(("reference",), platform="cpu") == "reference"
    assert dispatch.choose(both, impl="reference", platform="cpu") == "reference"  # impl= beats the variable
    no_env.setenv(dispatch.ENV_OVERRIDE, "reference")
    assert dispatch.choose(both, platform="cuda") == "reference"
    no_env.setenv(dispatch.ENV_OVERRIDE, "")  # empty means unset
    assert dispatch.choose(both, platform="cuda") == "pallas"
    no_env.setenv(dispatch.ENV_OVERRIDE, "musa")
    with pytest.raises(ValueError):
        dispatch.choose(both, platform="cpu")
