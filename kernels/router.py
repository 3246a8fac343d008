"""MoE router in one Pallas (Triton) kernel: logits, scores, top-k choice and routing weights of a block of tokens.

`model.moe.route` in XLA is about eight kernels per MoE layer at decode (the weight's f32 convert, a cuBLAS gemv,
the score and bias fusion, a sort for top-k, the gather of the chosen scores, the renormalisation); on the H200 they
took ~11 us per layer at batch 1 (benchmarks/NOTES_serving.md). Here one program takes `BLOCK_M` tokens:

- logits [BLOCK_M, E] = x @ W^T over the hidden dim in `block_k` steps (x's dtype on the tensor cores, float32
  accumulation: bf16 x bf16 products are exact in float32, as the reference's upcast ones are);
- scores: sigmoid, or softmax over the experts; choice = scores + the correction bias;
- top-k by k rounds of (row max, lowest column holding it, mask it out): the order and tie-breaking of
  `jax.lax.top_k` (larger first, lower index first among equals);
- weights: the chosen experts' unbiased scores, renormalised when asked, times the routed scaling factor.

Takes what the kernel can hold: no expert groups (`n_group` 1), E a power of two from 16 to `MAX_EXPERTS` (the
block's logits stay in registers), k <= E, and a weight of at most `MAX_WEIGHT_ELEMENTS` (one program reads all of
it, so a decode step's router runs on one multiprocessor: fine for the medium hybrid's 64 x 2048, 256 KB; a
DeepSeek-size router would want the experts split over programs). Elsewhere the XLA route runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import dispatch, tiles as tiling

# Whether CUDA/ROCm run the kernel by default. It passes tests/gpu/test_router_gpu.py on the H200 (2026-12-01) but is
# slower there than the XLA route (benchmarks/decode_profile.py --pallas router: 18.7 us per layer at batch 1
# against ~11 us; one program reads the whole weight on one multiprocessor), so it stays off unless asked for
# (impl="pallas" or DAYZERO_KERNELS).
GPU_VERIFIED = False
BLOCK_M = 16
MAX_EXPERTS = 256
MAX_WEIGHT_ELEMENTS = 1 << 18


def supported(n_experts: int, hidden: int, top_k: int, n_group: int = 1) -> bool:
    """Whether the kernel takes this router (see the module docstring)."""
    power_of_two = n_experts & (n_experts - 1) == 0
    return (n_group == 1 and power_of_two and 16 <= n_experts <= MAX_EXPERTS and 1 <= top_k <= n_experts
            and n_experts * hidden <= MAX_WEIGHT_ELEMENTS and tiling.dots_fit(_block_k(n_experts, hidden)))


def _block_k(n_experts: int, hidden: int) -> int:
    """Hidden-dim step: the largest power of two dividing `hidden`, at most 8192 / E (the weight block [E, step]
    stays ~8K elements)."""
    step = 1
    while step * 2 <= max(16, 8192 // n_experts) and hidden % (step * 2) == 0:
        step *= 2
    return step


def _router_kernel(x_ref, w_ref, bias_ref, ids_ref, weights_ref, *, n_tokens, top_k, block_k, sigmoid,
                   renormalize, scale):
    n_experts, hidden = w_ref.shape
    k_pad = ids_ref.shape[1]
    r0 = pl.program_id(0) * BLOCK_M
    token = r0 + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M,), 0)
    real = token < n_tokens
    rows = jnp.where(real, token, 0)  # rows past the last token read token 0; their outputs are dropped

    def step(i, acc):
        cols = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        return acc + tiling.mm_nt(x_ref[rows, cols], w_ref[:, cols].astype(x_ref.dtype))

    logits = jax.lax.fori_loop(0, hidden // block_k, step, jnp.zeros((BLOCK_M, n_experts), jnp.float32))
    if sigmoid:
        scores = jax.nn.sigmoid(logits)
    else:
        exp = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
        scores = exp / jnp.sum(exp, axis=1, keepdims=True)
    choice = scores + bias_ref[...][None, :]
    col = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M, n_experts), 1)
    slot = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M, k_pad), 1)
    ids = jnp.zeros((BLOCK_M, k_pad), jnp.int32)
    weights = jnp.zeros((BLOCK_M, k_pad), jnp.float32)
    for i in range(top_k):
        best = jnp.max(choice, axis=1, keepdims=True)
        # the lowest column holding the maximum (NaN rows fall back to the last expert: an index in range)
        idx = jnp.minimum(jnp.min(jnp.where(choice == best, col, n_experts), axis=1, keepdims=True), n_experts - 1)
        picked = col == idx
        ids = jnp.where(slot == i, idx, ids)
        weights = jnp.where(slot == i, jnp.sum(jnp.where(picked, scores, 0.0), axis=1, keepdims=True), weights)
        choice = jnp.where(picked, -jnp.inf, choice)
    if renormalize and top_k > 1:  # unused slots hold 0
        weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + 1e-20)
    ids_ref[...] = ids
    weights_ref[...] = weights * scale


@functools.partial(jax.jit, static_argnames=("top_k", "sigmoid", "renormalize", "scale", "interpret"))
def route_tokens(x: jax.Array, weight: jax.Array, bias: jax.Array | None, *, top_k: int, sigmoid: bool,
                 renormalize: bool, scale: float, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [N, D], router weight [E, D] (checkpoint layout), correction bias [E] f32 or None -> (topk_ids [N, k]
    int32, topk_weights [N, k] float32), as `model.moe.route` computes them from float32 logits. Needs
    `supported(E, D, k)`."""
    n_tokens, hidden = x.shape
    n_experts = weight.shape[0]
    if not supported(n_experts, hidden, top_k):
        raise ValueError(f"router kernel: {n_experts} experts x {hidden}, top-{top_k} not supported")
    k_pad = tiling.pow2_at_least(top_k)
    n_pad = tiling.round_up(n_tokens, BLOCK_M)
    bias = jnp.zeros((n_experts,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    out = pl.BlockSpec((BLOCK_M, k_pad), lambda i: (i, 0))
    ids, weights = pl.pallas_call(
        functools.partial(_router_kernel, n_tokens=n_tokens, top_k=top_k, block_k=_block_k(n_experts, hidden),
                          sigmoid=sigmoid, renormalize=renormalize, scale=scale),
        grid=(n_pad // BLOCK_M,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 3,
        out_specs=[out, out],
        out_shape=[jax.ShapeDtypeStruct((n_pad, k_pad), jnp.int32), jax.ShapeDtypeStruct((n_pad, k_pad), jnp.float32)],
        compiler_params=tiling.compiler_params(4, 2),
        interpret=interpret,
        name="moe_router",
    )(x, weight, bias)
    return ids[:n_tokens, :top_k], weights[:n_tokens, :top_k]


def choose(n_experts: int, hidden: int, top_k: int, n_group: int, impl: str | None = None) -> str:
    """"pallas" / "interpret" where dispatch picks the kernel and it takes the router, else "reference"."""
    kind = dispatch.choose("router", ("reference", "pallas"), impl, gpu_verified=GPU_VERIFIED)
    return kind if kind == "reference" or supported(n_experts, hidden, top_k, n_group) else "reference"
