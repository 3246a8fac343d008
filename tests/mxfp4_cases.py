"""Shared MoE test cases (CPU interpret tests and tests/gpu): random packed MXFP4 experts, routings, and float64
numpy oracles of the routed SwiGLU experts (dense or MXFP4 weights), and a check of served greedy tokens against
full forwards that allows the kernel paths' near ties."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.kernels import moe_workspace, mxfp4

_quantize = jax.jit(mxfp4.quantize)
_to_workspace = jax.jit(mxfp4.to_workspace, static_argnums=2)

ROUTINGS = ("random", "one_expert_takes_all", "empty_experts", "single_last")


def packed_experts(rng, n_experts: int, hidden: int, inter: int, fmt: str = "mxfp4") -> mxfp4.ExpertWeights:
    """Experts quantized from N(0, 1/sqrt(fan_in)) weights (scales vary a few binades, like real ones)."""
    def one(rows, cols):
        w = rng.standard_normal((n_experts, rows, cols)).astype(np.float32) / np.sqrt(cols)
        return _quantize(jnp.asarray(w))

    (gb, gs), (ub, us), (db, ds) = one(inter, hidden), one(inter, hidden), one(hidden, inter)
    ew = mxfp4.ExpertWeights(gb, ub, db, gs, us, ds)
    return ew if fmt == "mxfp4" else converted(ew, fmt)


def expert_specs(n_experts: int, hidden: int, inter: int, fmt: str) -> mxfp4.ExpertWeights:
    """Shape structs of a layer's experts in `fmt` ("mxfp4" packed, or converted "float8_e4m3fn" / "bfloat16"),
    unpadded: for lowering and dispatch checks that allocate nothing."""
    s = jax.ShapeDtypeStruct
    gd, gi = mxfp4.num_blocks(hidden), mxfp4.num_blocks(inter)
    tail, dtype = ((16,), jnp.uint8) if fmt == "mxfp4" else ((2, 16), jnp.dtype(fmt))
    data = [s((n_experts, inter, gd, *tail), dtype)] * 2 + [s((n_experts, hidden, gi, *tail), dtype)]
    scales = [s((n_experts, inter, gd), jnp.uint8)] * 2 + [s((n_experts, hidden, gi), jnp.uint8)]
    return mxfp4.ExpertWeights(*data, *(scales if fmt != "bfloat16" else [None] * 3), fmt=fmt)


def converted(ew: mxfp4.ExpertWeights, fmt: str) -> mxfp4.ExpertWeights:
    """The same experts converted offline to a workspace format (padded where the kernels need it:
    `moe_workspace.clear_of_offset_wrap`)."""
    data = [_to_workspace(b, s, fmt) for b, s in ((ew.gate, ew.gate_scales), (ew.up, ew.up_scales),
                                                       (ew.down, ew.down_scales))]
    scales = (ew.gate_scales, ew.up_scales, ew.down_scales) if fmt == "float8_e4m3fn" else (None, None, None)
    return moe_workspace.clear_of_offset_wrap(mxfp4.ExpertWeights(*data, *scales, fmt=fmt))


def routing(rng, kind: str, n_tokens: int, n_experts: int, top_k: int = 2):
    """topk_ids [T, k] int32 and weights [T, k] float32 for a routing pattern:
    random (distinct experts per token); one_expert_takes_all (expert 1 in every token's choices, the second choice
    from two others: the rest empty); empty_experts (only the even experts are used); single_last (everything on
    the last expert, top-1)."""
    if kind == "random":
        ids = np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(n_tokens)])
    elif kind == "one_expert_takes_all":
        ids = np.stack([np.full(n_tokens, 1), rng.choice([2, n_experts - 1], n_tokens)], axis=1)[:, :top_k]
    elif kind == "empty_experts":
        ids = np.stack([rng.choice(np.arange(0, n_experts, 2), top_k, replace=False) for _ in range(n_tokens)])
    elif kind == "single_last":
        ids = np.full((n_tokens, 1), n_experts - 1)
    else:
        raise AssertionError(kind)
    return ids.astype(np.int32), rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)


@jax.jit
def _dense(ew: mxfp4.ExpertWeights):
    n = ew.gate.shape[0]
    return ew.dense(jnp.arange(n), jnp.arange(n), jnp.float32)


def dense_oracle(x, ids, weights, w_gate, w_up, w_down) -> np.ndarray:
    """Routed SwiGLU experts in float64 over dense weights in `moe_experts`' layout (w_gate/w_up [E, H, I], w_down
    [E, I, H]): sum_k w_k * down(silu(gate x) * up x) of expert ids[:, k]."""
    x, w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in (x, w_gate, w_up, w_down))
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            g, u = x[t] @ w_gate[e], x[t] @ w_up[e]
            y[t] += weights[t, j] * ((g / (1 + np.exp(-g)) * u) @ w_down[e])
    return y


def oracle(x, ids, weights, ew: mxfp4.ExpertWeights) -> np.ndarray:
    """`dense_oracle` of MXFP4 or offline-converted experts."""
    return dense_oracle(x, ids, weights, *_dense(ew))


def shared_gate_up_sums(x, shared, parts: int) -> jax.Array:
    """x [1, H] times a shared MLP's gate and up [H, S] in float64, as float32 sums [parts, 2, S] over `parts` equal
    parts of K (as `kernels.moe_front.front(shared=)` hands them over)."""
    xs = np.asarray(x, np.float64).reshape(parts, -1)
    width = shared[0].shape[1]
    return jnp.asarray(np.stack([np.stack([xs[f] @ np.asarray(m, np.float64).reshape(parts, -1, width)[f]
                                           for m in shared[:2]]) for f in range(parts)]), jnp.float32)


def rel_err(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def assert_forward_top_tokens(model, prompt, tokens, rel_margin):
    """Each of `tokens` (greedy after `prompt`) is the top logit of a full forward over the prompt and the tokens
    before it, within `rel_margin` of the logits' largest magnitude (near ties between kernel paths)."""
    logits = np.asarray(model(np.asarray([prompt + tokens[:-1]])))[0, len(prompt) - 1:]
    chosen = logits[np.arange(len(tokens)), tokens]
    assert np.all(chosen >= logits.max(-1) - rel_margin * np.max(np.abs(logits))), chosen - logits.max(-1)
