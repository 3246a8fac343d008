"""Tests of the plain-jnp kernel references in `dayzero.kernels` (CPU, small shapes).

Oracles: the token-by-token KDA recurrence, transformers' torch Kimi-Linear functions (float32, CPU), and dense numpy
loops. Inputs are fresh random draws every run; each test prints its seed and puts it in every assertion message.
Set DAYZERO_TEST_SEED=<int> to replay a failing draw.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxfp4_cases import dense_oracle
from dayzero.kernels import attention, dispatch, indexer, moe, moe_tiles, short_conv
from dayzero.kernels import kda as kda_ops
from dayzero.kernels.kda import reference as kda_ref
from dayzero.kernels.moe_grouped import GroupingCost, choose_block_m, estimated_seconds

torch = pytest.importorskip("torch")
hf_kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _torch_fn(fn):
    """The plain torch function under transformers' hub-kernel / fla fallback decorator."""
    return getattr(fn, "__wrapped__", fn)


# Jitted once at module level so repeated shapes reuse the compilation (eager `lax.scan` recompiles every call).
_STATIC = ("output_final_state", "use_qk_l2norm_in_kernel", "output_chunk_states")
chunk_kda = jax.jit(kda_ref.chunk_kda, static_argnames=_STATIC + ("chunk_size",))
fused_recurrent_kda = jax.jit(kda_ref.fused_recurrent_kda, static_argnames=_STATIC[:2])
causal_conv1d = jax.jit(short_conv.causal_conv1d, static_argnames=("activation",))
topk_mask = jax.jit(indexer.topk_mask, static_argnames=("topk",))
moe_experts = jax.jit(moe.moe_experts, static_argnames="block_m")
masked_attention = jax.jit(attention.masked_attention)

hf_chunk_kda = _torch_fn(hf_kimi.chunk_kimi_delta_attention)
hf_recurrent_kda = _torch_fn(hf_kimi.recurrent_kimi_delta_attention)
hf_conv_fn = _torch_fn(hf_kimi.causal_conv1d_fn)
hf_conv_update = _torch_fn(hf_kimi.causal_conv1d_update)


# ----------------------------------------------------------------------------------------------------------- helpers


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

# Most KDA tests share one shape and flag set so that the jitted functions compile once per length.
STD = dict(B=2, H=2, K=16, V=8)  # K != V


def std_inputs(seed, T, **kwargs):
    return kda_inputs(seed, STD["B"], T, STD["H"], STD["K"], STD["V"], l2norm=True, init=True, **kwargs)


# (T, B, H, K, V, l2norm, init): every length runs with the shared shape (l2norm, initial state) and with another
# shape/flag combination; K != V, l2norm on/off and initial state on/off all appear at several lengths.
KDA_CASES = [(T, STD["B"], STD["H"], STD["K"], STD["V"], True, True) for T in (1, 7, 63, 64, 65, 130)] + [
    (1, 1, 1, 8, 8, False, False),
    (7, 1, 3, 4, 16, False, True),
    (64, 2, 4, 8, 12, True, False),
    (130, 1, 3, 4, 16, False, True),
]


@pytest.mark.parametrize("T,B,H,K,V,l2norm,init", KDA_CASES)
def test_chunk_matches_recurrent(seed, T, B, H, K, V, l2norm, init):
    inputs = kda_inputs(seed, B, T, H, K, V, l2norm=l2norm, init=init)
    o_c, s_c = run_kda(chunk_kda, inputs, l2norm=l2norm)
    o_r, s_r = run_kda(fused_recurrent_kda, inputs, l2norm=l2norm)
    assert o_c.shape == (B, T, H, V) and o_c.dtype == jnp.float32 and o_r.dtype == jnp.float32
    assert s_c.shape == (B, H, K, V) and s_c.dtype == jnp.float32 and s_r.dtype == jnp.float32
    assert_close(o_c, o_r, 1e-4, "chunk vs recurrent output", seed)
    assert_close(s_c, s_r, 1e-4, "chunk vs recurrent final state", seed)


def test_l2norm_flag_matters(seed):
    """Guards the tests above: with k norms in [0.3, 1.2] and unnormalised q, the flag changes the result."""
    inputs = std_inputs(seed, 7)
    on, _ = run_kda(fused_recurrent_kda, inputs, l2norm=True)
    off, _ = run_kda(fused_recurrent_kda, inputs, l2norm=False)
    assert rel_err(on, off) > 1e-2, f"use_qk_l2norm_in_kernel had no effect (seed={seed})"
    q, k = inputs[0], inputs[1]
    normed = (q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6), k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6))
    manual, _ = run_kda(fused_recurrent_kda, normed + tuple(inputs[2:]), l2norm=False)
    assert_close(on, manual, 1e-5, "in-kernel l2norm == l2norm(x) = x / sqrt(sum x^2 + 1e-6)", seed)


def test_chunk_size_does_not_change_result(seed):
    inputs = std_inputs(seed, 65)
    o64, s64 = run_kda(chunk_kda, inputs, l2norm=True)
    o, s = run_kda(chunk_kda, inputs, l2norm=True, chunk_size=16)
    assert_close(o, o64, 1e-4, "chunk_size=16 output", seed)
    assert_close(s, s64, 1e-4, "chunk_size=16 state", seed)


def test_final_state_only_when_requested(seed):
    q, k, v, g, beta, _ = kda_inputs(seed, 1, 5, 2, 8, 4)
    args = [jnp.asarray(x) for x in (q, k, v, g, beta)]
    for fn in (kda_ref.chunk_kda, kda_ref.fused_recurrent_kda):  # traced only: shapes and the None state
        o, s = jax.eval_shape(fn, *args)
        assert s is None and o.shape == (1, 5, 2, 4) and o.dtype == jnp.float32


def test_explicit_scale(seed):
    """`scale` multiplies q (after the optional l2norm); the chunk form gets it through the same preparation."""
    inputs = std_inputs(seed, 7)
    o_r, s_r = run_kda(fused_recurrent_kda, inputs, l2norm=True, scale=0.7)
    o_d, s_d = run_kda(fused_recurrent_kda, inputs, l2norm=True)
    # The state does not depend on the query scale; the output is linear in it (default scale K ** -0.5).
    assert_close(s_r, s_d, 1e-6, "state independent of scale", seed)
    assert_close(o_r, to_np(o_d) * 0.7 * np.sqrt(STD["K"]), 1e-5, "output linear in scale", seed)


@pytest.mark.parametrize("T", [7, 65, 130])
@pytest.mark.parametrize("g_max,g_extreme", [(8.0, None), (8.0, -50.0), (1.0, -50.0)])
def test_strong_decay(seed, T, g_max, g_extreme):
    """Log-decays of -5 per step and beyond (up to -8), and a third of the entries at -50.

    With -50 entries the within-chunk cumulative log-decay reaches ~-1e3, where float32 resolves ~6e-5: the chunk
    form's exp(G_t - G_s) then carries relative errors of that order (transformers' torch chunk form too). Over 600
    draws chunk vs recurrent peaked at 9.7e-5, hence 3e-4 there; without the -50 entries it stays under 1e-5.
    """
    rtol = 1e-4 if g_extreme is None else 3e-4
    inputs = std_inputs(seed, T, g_max=g_max, g_extreme=g_extreme)
    o_c, s_c = run_kda(chunk_kda, inputs, l2norm=True)
    o_r, s_r = run_kda(fused_recurrent_kda, inputs, l2norm=True)
    what = f"g_max={g_max}, extreme={g_extreme}"
    for name, x in (("chunk out", o_c), ("chunk state", s_c), ("rec out", o_r), ("rec state", s_r)):
        assert np.all(np.isfinite(to_np(x))), f"{name} not finite ({what}, seed={seed})"
    assert_close(o_c, o_r, rtol, f"strong decay output ({what})", seed)
    assert_close(s_c, s_r, rtol, f"strong decay state ({what})", seed)


def test_absurd_decay_stays_finite(seed):
    """A third of the log-decays at -1e4 per step: finite, and chunk still close to recurrent.

    Only loosely: within a chunk the cumulative log-decay reaches ~-3e5, where float32 keeps ~0.03 absolute, so the
    differences G_t - G_s of the ordinary channels lose precision (transformers' torch chunk form does the same): over
    300 draws the error peaked at 1.3e-2. At -50 (test_strong_decay) it stays under 1e-4.
    """
    inputs = std_inputs(seed, 65, g_max=0.5, g_extreme=-1e4)
    o_c, s_c = run_kda(chunk_kda, inputs, l2norm=True)
    o_r, s_r = run_kda(fused_recurrent_kda, inputs, l2norm=True)
    assert_close(o_c, o_r, 5e-2, "absurd decay output", seed)
    assert_close(s_c, s_r, 5e-2, "absurd decay state", seed)


def test_fully_decayed_state_is_forgotten(seed):
    """With g = -50 on every channel at one step, everything before it is gone: what follows ignores the prefix."""
    T, cut = 130, 65
    q, k, v, g, beta, s0 = std_inputs(seed, T)
    g[:, cut] = -50.0
    full = run_kda(chunk_kda, (q, k, v, g, beta, s0), l2norm=True)
    zeros = np.zeros_like(s0)
    tail = run_kda(chunk_kda, tuple(x[:, cut:] for x in (q, k, v, g, beta)) + (zeros,), l2norm=True)
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


@pytest.mark.parametrize("case", [c for c in KDA_CASES if c[0] in (1, 7, 65, 130)],
                         ids=lambda c: "T{}-B{}-H{}-K{}-V{}-l2{}-init{}".format(*c))
def test_kda_matches_transformers(seed, case):
    T, B, H, K, V, l2norm, init = case
    inputs = kda_inputs(seed, B, T, H, K, V, g_max=2.0, l2norm=l2norm, init=init)
    hf_o_c, hf_s_c = _hf_kda(hf_chunk_kda, inputs, l2norm)
    hf_o_r, hf_s_r = _hf_kda(hf_recurrent_kda, inputs, l2norm)
    o_c, s_c = run_kda(chunk_kda, inputs, l2norm=l2norm)
    o_r, s_r = run_kda(fused_recurrent_kda, inputs, l2norm=l2norm)
    assert_close(o_c, hf_o_c, 1e-4, "chunk_kda vs transformers chunk output", seed)
    assert_close(s_c, hf_s_c, 1e-4, "chunk_kda vs transformers chunk state", seed)
    assert_close(o_r, hf_o_r, 1e-4, "fused_recurrent_kda vs transformers recurrent output", seed)
    assert_close(s_r, hf_s_r, 1e-4, "fused_recurrent_kda vs transformers recurrent state", seed)
    assert_close(o_c, hf_o_r, 1e-4, "chunk_kda vs transformers recurrent output", seed)


def test_kda_strong_decay_matches_transformers(seed):
    inputs = std_inputs(seed, 130, g_max=8.0, g_extreme=-50.0)
    hf_o, hf_s = _hf_kda(hf_recurrent_kda, inputs, True)
    o, s = run_kda(chunk_kda, inputs, l2norm=True)
    assert_close(o, hf_o, 3e-4, "strong decay vs transformers output", seed)  # see test_strong_decay
    assert_close(s, hf_s, 3e-4, "strong decay vs transformers state", seed)


# ------------------------------------------------------------------------------------------------ KDA: state carry


@pytest.mark.parametrize("T1,T2", [(65, 65), (64, 1), (1, 64), (63, 1), (1, 63)])
def test_chunk_state_carry(seed, T1, T2):
    q, k, v, g, beta, s0 = std_inputs(seed, T1 + T2)
    o_full, s_full = run_kda(chunk_kda, (q, k, v, g, beta, s0), l2norm=True)
    o1, s1 = run_kda(chunk_kda, tuple(x[:, :T1] for x in (q, k, v, g, beta)) + (s0,), l2norm=True)
    o2, s2 = run_kda(chunk_kda, tuple(x[:, T1:] for x in (q, k, v, g, beta)) + (to_np(s1),), l2norm=True)
    what = f"split {T1}+{T2}"
    assert_close(np.concatenate([to_np(o1), to_np(o2)], axis=1), o_full, 1e-4, f"{what}: output", seed)
    assert_close(s2, s_full, 1e-4, f"{what}: final state", seed)


def test_prefill_then_decode(seed):
    """Chunked prefill, then one token at a time through the recurrent form, equals one chunked pass."""
    T, T1 = 65, 63
    q, k, v, g, beta, s0 = std_inputs(seed, T)
    o_full, s_full = run_kda(chunk_kda, (q, k, v, g, beta, s0), l2norm=True)
    o, state = run_kda(chunk_kda, tuple(x[:, :T1] for x in (q, k, v, g, beta)) + (s0,), l2norm=True)
    outs = [to_np(o)]
    for t in range(T1, T):
        o, state = run_kda(fused_recurrent_kda, tuple(x[:, t:t + 1] for x in (q, k, v, g, beta)) + (to_np(state),),
                           l2norm=True)
        outs.append(to_np(o))
    assert_close(np.concatenate(outs, axis=1), o_full, 1e-4, "prefill + decode output", seed)
    assert_close(state, s_full, 1e-4, "prefill + decode state", seed)


# ---------------------------------------------------------------------------------------------------- KDA: bf16


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda], ids=["chunk", "recurrent"])
def test_kda_bf16(seed, fn):
    inputs = std_inputs(seed, 65)
    o32, s32 = run_kda(fn, inputs, l2norm=True)
    o16, s16 = run_kda(fn, inputs, dtype=jnp.bfloat16, l2norm=True)
    assert o16.dtype == jnp.bfloat16, o16.dtype
    assert s16.dtype == jnp.float32, s16.dtype
    assert_close(o16, o32, 2e-2, "bf16 output vs fp32", seed)
    assert_close(s16, s32, 2e-2, "bf16 state vs fp32", seed)
    # On the bf16-rounded inputs the math runs in fp32: only the final cast of the output to bf16 differs.
    rounded = tuple(to_np(jnp.asarray(x, jnp.bfloat16)) for x in inputs[:5]) + (inputs[5],)
    o_r32, s_r32 = run_kda(fn, rounded, l2norm=True)
    assert_close(o16, o_r32, 8e-3, "bf16 output vs fp32 on rounded inputs", seed)
    assert_close(s16, s_r32, 1e-5, "bf16 state vs fp32 on rounded inputs", seed)


# --------------------------------------------------------------------------------------------- KDA: the wrappers


def test_kda_wrappers_dispatch(seed, monkeypatch):
    """The public ops forward every argument to the implementation dispatch chooses: the reference by default on
    CPU and for impl="reference", the Pallas module for "pallas" / "interpret" (interpret=True only for the
    latter); an unknown implementation name raises."""
    from dayzero.kernels.kda import pallas as kda_pallas

    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    inputs = std_inputs(seed, 7)
    for name, jitted in (("chunk_kda", chunk_kda), ("fused_recurrent_kda", fused_recurrent_kda)):
        wrapper = getattr(kda_ops, name)
        o_ref, s_ref = run_kda(jitted, inputs, l2norm=True, scale=0.3)
        calls = []

        def spy(*args, _jitted=jitted, _who="reference", **kwargs):  # the jitted reference: one compilation
            calls.append((_who, kwargs.pop("interpret", None)))
            return _jitted(*args, **kwargs)

        monkeypatch.setattr(kda_ref, name, spy)
        monkeypatch.setattr(kda_pallas, name, lambda *a, _spy=spy, **kw: _spy(*a, _who="pallas", **kw))
        for impl in (None, "reference", "pallas", "interpret"):
            o, s = run_kda(wrapper, inputs, l2norm=True, scale=0.3, impl=impl)
            assert_close(o, o_ref, 0.0, f"{name} impl={impl} output", seed)
            assert_close(s, s_ref, 0.0, f"{name} impl={impl} state", seed)
        assert calls == [("reference", None), ("reference", None), ("pallas", False), ("pallas", True)], calls
        with pytest.raises(ValueError):
            run_kda(wrapper, inputs, impl="triton")
        monkeypatch.setenv(dispatch.ENV_OVERRIDE, "cuda")  # not an implementation name
        with pytest.raises(ValueError):
            run_kda(wrapper, inputs)
        monkeypatch.delenv(dispatch.ENV_OVERRIDE)


# ------------------------------------------------------------------------------------------------- causal conv1d


def _silu(x):
    return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("T,W", [(1, 4), (3, 4), (37, 4), (16, 2)])
def test_causal_conv1d_matches_transformers(seed, T, W, activation):
    rng = np.random.default_rng(seed)
    B, C = 2, 6
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    w = rng.standard_normal((C, W)).astype(np.float32)
    y, state = causal_conv1d(jnp.asarray(x), jnp.asarray(w), activation=activation)
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
    y, s = causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(s0))
    y1, s1 = causal_conv1d(jnp.asarray(x[:, :T1]), jnp.asarray(w), jnp.asarray(s0))
    y2, s2 = causal_conv1d(jnp.asarray(x[:, T1:]), jnp.asarray(w), s1)
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
    selected = np.asarray(topk_mask(jnp.asarray(scores), jnp.asarray(allowed), topk))
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
@pytest.mark.parametrize("N", [1, 13])
def test_moe_experts_matches_dense(seed, N, kind):
    rng = np.random.default_rng(seed)
    E, Hd, I = 6, 8, 12
    x = rng.standard_normal((N, Hd)).astype(np.float32)
    wg, wu = (rng.standard_normal((E, Hd, I)).astype(np.float32) * 0.3 for _ in range(2))
    wd = rng.standard_normal((E, I, Hd)).astype(np.float32) * 0.3
    ids, weights = _routing(rng, kind, N, E)
    got = moe_experts(*(jnp.asarray(a) for a in (x, ids, weights, wg, wu, wd)))
    assert got.shape == (N, Hd) and got.dtype == jnp.float32
    assert_close(got, dense_oracle(x, ids, weights, wg, wu, wd), 1e-5, f"moe_experts ({kind}, N={N})", seed)


@pytest.mark.parametrize("block_m", [None, 1, 4, 16])
@pytest.mark.parametrize("kind", ["random", "one_expert_takes_all"])
def test_moe_experts_groupings_agree(seed, kind, block_m):
    """ragged_dot (None) and gathered tiles of any size give the same layer output, skewed routing included."""
    rng = np.random.default_rng(seed)
    N, E, Hd, I = 13, 6, 8, 12
    x = rng.standard_normal((N, Hd)).astype(np.float32)
    wg, wu = (rng.standard_normal((E, Hd, I)).astype(np.float32) * 0.3 for _ in range(2))
    wd = rng.standard_normal((E, I, Hd)).astype(np.float32) * 0.3
    ids, weights = _routing(rng, kind, N, E)
    got = moe_experts(*(jnp.asarray(a) for a in (x, ids, weights, wg, wu, wd)), block_m=block_m)
    assert_close(got, dense_oracle(x, ids, weights, wg, wu, wd), 1e-5, f"moe_experts ({kind}, block_m={block_m})", seed)


def test_moe_grouping_choice():
    """Decode reads only its experts (1-row tiles), mid-size batches keep ragged_dot, prefill takes large tiles, and
    the gathered copies stay within the cap."""
    medium, deepseek = (64, 2048, 768), (256, 7168, 2048)
    assert choose_block_m(6, *medium, 2) == 1
    assert choose_block_m(16 * 6, *medium, 2) is None
    for n_pairs, (e, d, i) in ((2048 * 6, medium), (32768 * 6, medium), (8192 * 8, deepseek)):
        block_m = choose_block_m(n_pairs, e, d, i, 2)
        assert block_m is not None and block_m >= 64, (n_pairs, block_m)
        assert moe_tiles.max_tiles(n_pairs, e, block_m) <= GroupingCost().max_tiles_per_expert * e
        assert estimated_seconds(n_pairs, e, d, i, 2, block_m) < estimated_seconds(n_pairs, e, d, i, 2, None) / 5


def test_moe_experts_bf16(seed):
    rng = np.random.default_rng(seed)
    N, E, Hd, I = 11, 4, 16, 8
    x = rng.standard_normal((N, Hd)).astype(np.float32)
    wg, wu = (rng.standard_normal((E, Hd, I)).astype(np.float32) * 0.3 for _ in range(2))
    wd = rng.standard_normal((E, I, Hd)).astype(np.float32) * 0.3
    ids, weights = _routing(rng, "random", N, E)
    got = moe_experts(jnp.asarray(x, jnp.bfloat16), *(jnp.asarray(a) for a in (ids, weights, wg, wu, wd)))
    assert got.dtype == jnp.bfloat16
    assert_close(got, dense_oracle(x, ids, weights, wg, wu, wd), 3e-2, "moe_experts bf16", seed)


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
    got = np.asarray(masked_attention(*(jnp.asarray(a) for a in (q, k, v, mask)), scale))
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
    assert dispatch.choose("kda", both, platform="cpu") == "reference"
    assert dispatch.choose("kda", both, platform="musa") == "reference"
    assert dispatch.choose("kda", both, platform="tpu") == "reference"
    for platform in ("cuda", "gpu"):  # "gpu" resolves to CUDA unless this process has a ROCm backend
        assert dispatch.choose("kda", both, platform=platform) == "pallas"
        assert dispatch.choose("kda", ("reference",), platform=platform) == "reference"
    # ROCm: only kernels whose lowering is declared to work there (none yet).
    assert dispatch.choose("kda", both, platform="rocm") == "reference"
    assert dispatch.current_platform() == jax.devices()[0].platform
    assert dispatch.choose("kda", both) == ("pallas" if jax.devices()[0].platform in ("gpu", "cuda") else "reference")


def test_choose_overrides(no_env):
    both = ("reference", "pallas")
    assert dispatch.choose("kda", both, impl="interpret", platform="cpu") == "interpret"
    assert dispatch.choose("kda", both, impl="interpret", platform="cuda") == "interpret"
    assert dispatch.choose("kda", both, impl="pallas", platform="cpu") == "pallas"
    assert dispatch.choose("kda", both, impl="reference", platform="cuda") == "reference"
    # An override naming an implementation the op lacks falls back to the reference.
    assert dispatch.choose("kda", ("reference",), impl="pallas", platform="cuda") == "reference"
    assert dispatch.choose("kda", ("reference",), impl="interpret", platform="cuda") == "reference"
    with pytest.raises(ValueError):
        dispatch.choose("kda", both, impl="triton", platform="cuda")
    # A kernel not yet verified on a GPU runs only when asked for.
    assert dispatch.choose("kda", both, platform="cuda", gpu_verified=False) == "reference"
    assert dispatch.choose("kda", both, impl="pallas", platform="cuda", gpu_verified=False) == "pallas"


def test_choose_env_override(no_env):
    both = ("reference", "pallas")
    no_env.setenv(dispatch.ENV_OVERRIDE, "interpret")
    assert dispatch.choose("kda", both, platform="cpu") == "interpret"
    assert dispatch.choose("kda", ("reference",), platform="cpu") == "reference"
    assert dispatch.choose("kda", both, impl="reference", platform="cpu") == "reference"  # impl= beats the variable
    no_env.setenv(dispatch.ENV_OVERRIDE, "reference")
    assert dispatch.choose("kda", both, platform="cuda") == "reference"
    no_env.setenv(dispatch.ENV_OVERRIDE, "")  # empty means unset
    assert dispatch.choose("kda", both, platform="cuda") == "pallas"
    no_env.setenv(dispatch.ENV_OVERRIDE, "musa")
    with pytest.raises(ValueError):
        dispatch.choose("kda", both, platform="cpu")


def test_dispatch_follows_the_default_device(monkeypatch):
    """The platform is that of the devices in use: a `jax.default_device` in effect overrides the backend."""
    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    assert dispatch.current_platform() == jax.default_backend()
    with jax.default_device("gpu"):
        assert dispatch.current_platform() == "gpu"
        assert dispatch.choose("kda", ("reference", "pallas")) == "pallas"
        assert dispatch.choose("kda", ("reference", "pallas"), gpu_verified=False) == "reference"
    with jax.default_device(jax.devices("cpu")[0]):
        assert dispatch.choose("kda", ("reference", "pallas")) == "reference"
