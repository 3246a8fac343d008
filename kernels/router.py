"""MoE router in Pallas (Triton): logits, scores, top-k choice and routing weights of a block of tokens in one
kernel (`route_tokens`), or everything after the logits in one kernel (`select_experts`, the CUDA default: XLA's
product reads the weight with the whole GPU, this kernel replaces the ~5 small XLA kernels after it).

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
DeepSeek-size router would want the experts split over programs). `select_experts` starts at the scores and takes
any weight (the same limits otherwise). Elsewhere the XLA route runs.

`select_and_schedule` (decode, up to 16 tokens) is `select_experts` with the shared parts appended in the kernel
(the shared MLP as extra experts of the grouped kernels, where it runs there) and, from 2 tokens, the pairs'
schedule for the expert kernels (`moe_tiles.Schedule`, in tiles of 16 rows for the grouped kernels or of 1 to 16
for the MXFP4 decode kernels) made in the same program: ranks and tile starts are prefix sums (small 0 / 1 and
integer products on the tensor cores, exact), instead of XLA's four or five schedule kernels per MoE layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from . import dispatch, moe_tiles, tiles as tiling

# Whether CUDA/ROCm run the kernel by default. It passes tests/gpu/test_router_gpu.py on the H200 (2026-12-01) but is
# slower there than the XLA route (benchmarks/decode_profile.py --pallas router: 18.7 us per layer at batch 1
# against ~11 us; one program reads the whole weight on one multiprocessor), so it stays off unless asked for
# (impl="pallas" or DAYZERO_KERNELS).
GPU_VERIFIED = False
# The same for `select_experts` (the router after XLA's logits product): tests/gpu/test_router_gpu.py passes on the
# H200, and the medium hybrid's decode took 1.351 / 2.968 ms of kernels per token at batch 1 / 16 with it against
# 1.468 / 3.032 without (benchmarks/decode_profile.py, 2026-12-01, eleventh session).
SELECT_GPU_VERIFIED = True
BLOCK_M = 16
MAX_EXPERTS = 256
MAX_WEIGHT_ELEMENTS = 1 << 18


def supported(n_experts: int, hidden: int, top_k: int, n_group: int = 1) -> bool:
    """Whether the kernel takes this router (see the module docstring)."""
    return (select_supported(n_experts, top_k, n_group) and n_experts * hidden <= MAX_WEIGHT_ELEMENTS
            and tiling.dots_fit(_block_k(n_experts, hidden)))


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
    r0 = pl.program_id(0) * BLOCK_M
    token = r0 + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M,), 0)
    real = token < n_tokens
    rows = jnp.where(real, token, 0)  # rows past the last token read token 0; their outputs are dropped

    def step(i, acc):
        cols = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        return acc + tiling.mm_nt(x_ref[rows, cols], w_ref[:, cols].astype(x_ref.dtype))

    logits = jax.lax.fori_loop(0, hidden // block_k, step, jnp.zeros((BLOCK_M, n_experts), jnp.float32))
    ids_ref[...], weights_ref[...] = choose_experts(logits, bias_ref[...], ids_ref.shape[1], top_k=top_k,
                                                    sigmoid=sigmoid, renormalize=renormalize, scale=scale)


def choose_experts(logits, bias, k_pad: int, *, top_k, sigmoid, renormalize, scale):
    """Inside a kernel: float32 logits [M, E], bias [E] -> (ids [M, k_pad] int32, weights [M, k_pad] float32; slots
    past top_k 0)."""
    n_rows, n_experts = logits.shape
    if sigmoid:
        scores = jax.nn.sigmoid(logits)
    else:
        exp = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
        scores = exp / jnp.sum(exp, axis=1, keepdims=True)
    choice = scores + bias[None, :]
    col = jax.lax.broadcasted_iota(jnp.int32, (n_rows, n_experts), 1)
    slot = jax.lax.broadcasted_iota(jnp.int32, (n_rows, k_pad), 1)
    ids = jnp.zeros((n_rows, k_pad), jnp.int32)
    weights = jnp.zeros((n_rows, k_pad), jnp.float32)
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
    return ids, weights * scale


def _select_kernel(logits_ref, bias_ref, ids_ref, weights_ref, *, n_tokens, top_k, sigmoid, renormalize, scale,
                   parts=0):
    token = pl.program_id(0) * BLOCK_M + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M,), 0)
    rows = jnp.where(token < n_tokens, token, 0)  # rows past the last token read token 0; their outputs are dropped
    ids, weights = choose_experts(logits_ref[rows, :], bias_ref[...], ids_ref.shape[1], top_k=top_k,
                                  sigmoid=sigmoid, renormalize=renormalize, scale=scale)
    ids_ref[...], weights_ref[...] = append_shared(ids, weights, top_k, parts, logits_ref.shape[1])


def append_shared(ids, weights, top_k: int, parts: int, n_experts: int):
    """Inside a kernel: ids / weights [M, k_pad] with the `parts` shared experts in slots top_k ..: ids E + p,
    weight 1."""
    slot = jax.lax.broadcasted_iota(jnp.int32, ids.shape, 1)
    for p in range(parts):
        ids = jnp.where(slot == top_k + p, n_experts + p, ids)
        weights = jnp.where(slot == top_k + p, 1.0, weights)
    return ids, weights


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
    bias = jnp.zeros((n_experts,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    kernel = functools.partial(_router_kernel, n_tokens=n_tokens, top_k=top_k, block_k=_block_k(n_experts, hidden),
                               sigmoid=sigmoid, renormalize=renormalize, scale=scale)
    ids, weights = _launch(kernel, (x, weight, bias), n_tokens, top_k, "moe_router", interpret)
    return ids[:n_tokens, :top_k], weights[:n_tokens, :top_k]


@functools.partial(jax.jit, static_argnames=("top_k", "sigmoid", "renormalize", "scale", "interpret"))
def select_experts(logits: jax.Array, bias: jax.Array | None, *, top_k: int, sigmoid: bool, renormalize: bool,
                   scale: float, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The router after its logits, in one kernel: float32 logits [N, E] (XLA's product, which spreads the weight's
    read over the GPU), correction bias [E] or None -> (topk_ids [N, k] int32, topk_weights [N, k] float32), as
    `model.moe.route` computes them. Needs `select_supported(E, k)`."""
    n_tokens, n_experts = logits.shape
    if not select_supported(n_experts, top_k):
        raise ValueError(f"router select kernel: {n_experts} experts, top-{top_k} not supported")
    bias = jnp.zeros((n_experts,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    kernel = functools.partial(_select_kernel, n_tokens=n_tokens, top_k=top_k, sigmoid=sigmoid,
                               renormalize=renormalize, scale=scale)
    ids, weights = _launch(kernel, (logits.astype(jnp.float32), bias), n_tokens, top_k, "moe_router_select",
                           interpret)
    return ids[:n_tokens, :top_k], weights[:n_tokens, :top_k]


def _launch(kernel, operands, n_tokens: int, slots: int, name: str, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """One program per `BLOCK_M` tokens writing (ids, weights), padded: [BLOCK_M * programs, pow2(slots)]."""
    k_pad = tiling.pow2_at_least(slots)
    n_pad = tiling.round_up(n_tokens, BLOCK_M)
    out = pl.BlockSpec((BLOCK_M, k_pad), lambda i: (i, 0))
    return tiling.pallas_call(
        kernel,
        grid=(n_pad // BLOCK_M,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * len(operands),
        out_specs=[out, out],
        out_shape=[jax.ShapeDtypeStruct((n_pad, k_pad), jnp.int32), jax.ShapeDtypeStruct((n_pad, k_pad), jnp.float32)],
        compiler_params=tiling.compiler_params(4, 2),
        interpret=interpret,
        name=name,
    )(*operands)


# `select_and_schedule`: calls of at most this many tokens (one program), in tiles of TILE_ROWS rows by default (the
# grouped kernels': every expert then fills at most one tile).
SCHEDULE_MAX_TOKENS = BLOCK_M
TILE_ROWS = moe_tiles.DECODE_BLOCK_M
# On the H200 at 16 tokens (decode_profile.py): 8.9 us per call, 15.6 with 4 warps (2026-12-02); with the pairs'
# map, rows and token table passed through memory (nineteenth session: 25 barriers in the sm_90 build, 98 before)
# 6.2 us per call, 6.4 with 4 warps; 5.4 us at 2 tokens (7.3 before).
SCHEDULE_WARPS = 8


def _schedule_kernel(logits_ref, bias_ref, ids_ref, weights_ref, row_ref, token_ref, pair_ref, tile_ref, size_ref,
                     pairs_ref, row_of_ref, *, n_tokens, top_k, parts, e_pad, block_m, stride, no_pair, sigmoid,
                     renormalize, scale, interpret):
    """One program: the top-k choice of up to BLOCK_M tokens, the `parts` shared experts appended to each (ids E ..,
    weight 1), and their schedule in tiles of `block_m` rows (moe_tiles.Schedule, with its pair table): tiles in
    expert order, an expert's rows its tokens in order (a token picks an expert at most once, so an expert has at
    most BLOCK_M rows: one 16-row tile, or several shorter ones). The pair table numbers pair (t, slot) t * `stride`
    + slot, padding rows `no_pair`.

    Between the token-by-slot domain of the ids [M, k_pad] and the expert-by-token domain [e_pad, M] of the counts,
    values pass through memory (scratch outputs `pairs_ref` [2 e_pad, M] and `row_of_ref` [e_pad, M], and the
    flat token table): a scatter or gather behind a CTA barrier, where a reduction per slot or per tile row would
    each cost a barrier of its own (the program is latency-bound: one CTA, a chain of small steps)."""
    n_experts = logits_ref.shape[1]
    k_pad, t_pad = ids_ref.shape[1], tile_ref.shape[0]
    token = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M,), 0)
    real = token < n_tokens
    ids, weights = choose_experts(logits_ref[jnp.where(real, token, 0), :], bias_ref[...], k_pad, top_k=top_k,
                                  sigmoid=sigmoid, renormalize=renormalize, scale=scale)
    ids, weights = append_shared(ids, weights, top_k, parts, n_experts)
    ids_ref[...], weights_ref[...] = ids, weights
    slot = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M, k_pad), 1)
    pair_token = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M, k_pad), 0)
    is_pair = (slot < top_k + parts) & (pair_token < n_tokens)
    table_rows = t_pad * block_m  # the tables' rows read back; padding slots write past them
    # [e, t]: token t runs expert e (a one at each pair's (expert, token); padding slots write row e_pad, unread)
    pairs_ref[pl.ds(0, e_pad), :] = jnp.zeros((e_pad, BLOCK_M), jnp.int32)
    token_ref[pl.ds(0, table_rows)] = jnp.full((table_rows,), n_tokens, jnp.int32)  # rows of no pair: token T
    pair_ref[pl.ds(0, table_rows)] = jnp.full((table_rows,), no_pair, jnp.int32)  # and pair P
    tiling.cta_barrier(interpret)
    pairs_ref[jnp.where(is_pair, ids, e_pad), pair_token] = jnp.ones((BLOCK_M, k_pad), jnp.int32)
    tiling.cta_barrier(interpret)
    chosen = pairs_ref[pl.ds(0, e_pad), :] != 0
    one = chosen.astype(jnp.bfloat16)
    # rank [e, t]: the tokens before t that run e (their order in its tile); exact in float32 sums of 0 / 1
    earlier = (jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M, BLOCK_M), 0)
               < jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M, BLOCK_M), 1)).astype(jnp.bfloat16)
    rank = tiling.mm(one, earlier).astype(jnp.int32)
    sizes = jnp.sum(chosen.astype(jnp.int32), axis=1)  # [e]: the expert's pairs
    size_ref[...] = sizes
    tiles = (sizes + block_m - 1) // block_m  # [e]: the expert's tiles (0 to BLOCK_M / block_m: exact in bf16)
    lower = (jax.lax.broadcasted_iota(jnp.int32, (e_pad, e_pad), 1)
             < jax.lax.broadcasted_iota(jnp.int32, (e_pad, e_pad), 0)).astype(jnp.bfloat16)
    tile_cols = jnp.broadcast_to(tiles[:, None], (e_pad, BLOCK_M)).astype(jnp.bfloat16)
    tile_of = jnp.max(tiling.mm(lower, tile_cols), axis=1).astype(jnp.int32)  # [e]: the tiles of experts before e
    row_of_ref[...] = tile_of[:, None] * block_m + rank  # [e, t]: rank r sits in tile tile_of + r // block_m
    tiling.cta_barrier(interpret)
    rows = row_of_ref[jnp.where(is_pair, ids, 0), pair_token]  # [t, slot]: each pair's row
    row_ref[...] = rows
    at = jnp.where(is_pair, rows, table_rows)
    token_ref[at] = pair_token  # row r of the tables: its pair's token, and the pair
    pair_ref[at] = pair_token * stride + slot
    # tile i holds the expert e with tile_of[e] <= i < tile_of[e] + tiles[e]
    expert = jax.lax.broadcasted_iota(jnp.int32, (e_pad, BLOCK_M), 0)
    tile = jax.lax.broadcasted_iota(jnp.int32, (t_pad, e_pad), 0)
    holds = ((tile >= tile_of[None, :]) & (tile < (tile_of + tiles)[None, :])).astype(jnp.bfloat16)  # [tile, e]
    tile_ref[...] = jnp.max(tiling.mm(holds, (expert + 1).astype(jnp.bfloat16)), axis=1).astype(jnp.int32) - 1


@functools.partial(jax.jit, static_argnames=("top_k", "sigmoid", "renormalize", "scale", "shared_parts", "block_m",
                                             "padded", "interpret"))
def select_and_schedule(logits: jax.Array, bias: jax.Array | None, *, top_k: int, sigmoid: bool, renormalize: bool,
                        scale: float, shared_parts: int, block_m: int = TILE_ROWS, padded: bool = False,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array, moe_tiles.Schedule]:
    """`select_experts` with `shared_parts` shared experts appended to every token (ids E .. E + parts - 1, weight
    1: the shared MLP as experts of the grouped kernels; 0: none) and, for 2 or more tokens, the pairs' schedule in
    tiles of `block_m` rows (a power of two up to 16) made in the same kernel (one program: the XLA compare schedule
    is four or five kernels per MoE layer at 16 tokens; at one token `select_experts`' kernel: the schedule is
    static): float32 logits [N, E] (N <= `SCHEDULE_MAX_TOKENS`), bias [E] or None -> (ids [N, k + parts] int32,
    weights [N, k + parts] float32, `moe_tiles.Schedule` over E + parts experts): the schedule `moe_tiles.schedule`
    makes of those ids (tiles in expert order, an expert's rows its tokens in order; for one token, tile j its j-th
    pair) with its pair table (`Schedule.pair_rows`, from 2 tokens), except that tile_expert runs on past the
    R / block_m tiles (-1, or for one token the padding of the ids: the kernels never read those). Needs
    `schedule_supported(E, k, parts)`.

    `padded`: the schedule's tables as the kernel wrote them, for consumers that read only what they need (the
    MXFP4 decode kernels): a slice of a kernel's output is a copy kernel on the GPU (~1 us each, two or three per MoE
    layer). token_of_row and pair_rows then run on past R (never to be read there); the pair table numbers pairs
    t * k_pad + slot (padding rows BLOCK_M * k_pad), in the order of `Schedule.pair_weights`, the weights as the
    kernel wrote them ([BLOCK_M, k_pad]; at one token too)."""
    n_tokens, n_experts = logits.shape
    n_pairs = top_k + shared_parts
    total = n_experts + shared_parts
    if not (1 <= n_tokens <= SCHEDULE_MAX_TOKENS and schedule_supported(n_experts, top_k, shared_parts)
            and block_m in (1, 2, 4, 8, 16)
            and moe_tiles.max_tiles(n_tokens * n_pairs, total, block_m) <= 256):  # tile numbers exact in bf16
        raise ValueError(f"router schedule kernel: {n_tokens} tokens, {n_experts} experts, top-{top_k} + "
                         f"{shared_parts} shared in {block_m}-row tiles not supported")
    bias = jnp.zeros((n_experts,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    options = dict(n_tokens=n_tokens, top_k=top_k, sigmoid=sigmoid, renormalize=renormalize, scale=scale)
    if n_tokens == 1:  # the select kernel, the shared parts appended; the schedule is static but for its tiles'
        #               experts, the ids in top-k order: the padded ids' first k + parts (a free view, where ids[0]
        #               would be a copy kernel before the grouped kernels)
        kernel = functools.partial(_select_kernel, **options, parts=shared_parts)
        ids, weights = _launch(kernel, (logits.astype(jnp.float32), bias), 1, n_pairs, "moe_router_select",
                               interpret)
        return one_token_routing(ids, weights, n_pairs, total, block_m, padded)
    k_pad = tiling.pow2_at_least(n_pairs)
    n_tiles = moe_tiles.max_tiles(n_tokens * n_pairs, total, block_m)
    t_pad = tiling.pow2_at_least(n_tiles, 16)
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    e_pad = tiling.pow2_at_least(total, 16)
    table = ((2 * t_pad * block_m,), jnp.int32)  # rows past t_pad * block_m take the padding slots' writes
    shapes = [((BLOCK_M, k_pad), jnp.int32), ((BLOCK_M, k_pad), jnp.float32), ((BLOCK_M, k_pad), jnp.int32),
              table, table, ((t_pad,), jnp.int32), ((e_pad,), jnp.int32),
              ((2 * e_pad, BLOCK_M), jnp.int32), ((e_pad, BLOCK_M), jnp.int32)]  # (the last two: scratch)
    ids, weights, rows, tokens, pairs, tiles, sizes, _, _ = tiling.pallas_call(
        functools.partial(_schedule_kernel, **options, parts=shared_parts, e_pad=e_pad, block_m=block_m,
                          stride=k_pad if padded else n_pairs,
                          no_pair=BLOCK_M * k_pad if padded else n_tokens * n_pairs, interpret=interpret),
        grid=(1,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
        out_specs=[whole(shape) for shape, _ in shapes],
        out_shape=[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes],
        compiler_params=tiling.compiler_params(SCHEDULE_WARPS, 1),
        interpret=interpret,
        name="moe_router_schedule",
    )(logits.astype(jnp.float32), bias)
    rows = rows[:n_tokens, :n_pairs]
    if padded:
        return ids[:n_tokens, :n_pairs], weights[:n_tokens, :n_pairs], moe_tiles.Schedule(
            rows, tokens, tiles, sizes[:total], pairs, weights)
    return ids[:n_tokens, :n_pairs], weights[:n_tokens, :n_pairs], moe_tiles.Schedule(
        rows, tokens[:n_tiles * block_m], tiles, sizes[:total], pairs[:n_tiles * block_m])


def one_token_routing(ids: jax.Array, weights: jax.Array, n_pairs: int, n_experts: int, block_m: int = TILE_ROWS,
                      padded: bool = False) -> tuple[jax.Array, jax.Array, moe_tiles.Schedule]:
    """One token's choice as the select kernel writes it (ids / weights [BLOCK_M, k_pad], every row the token's
    `n_pairs` choices and padding) -> `select_and_schedule`'s results over `n_experts` experts (shared parts
    included): ids / weights [1, n_pairs] and the static one-token schedule, its tiles' experts the ids in top-k
    order (the padded ids as they are: a free view, where ids[0] would be a copy kernel before the grouped
    kernels; tiles of `block_m` rows). `padded`: with the weights as written (`Schedule.pair_weights`; pair j at
    slot j of row 0, padding rows numbered BLOCK_M * k_pad)."""
    sched = moe_tiles.schedule(ids[:1, :n_pairs], n_experts, block_m)._replace(tile_expert=ids.reshape(-1))
    if padded:
        pair_rows = np.full(sched.token_of_row.shape, weights.size, np.int32)
        pair_rows[np.arange(n_pairs) * block_m] = np.arange(n_pairs)
        sched = sched._replace(pair_rows=jnp.asarray(pair_rows), pair_weights=weights)
    return ids[:1, :n_pairs], weights[:1, :n_pairs], sched


def schedule_supported(n_experts: int, top_k: int, shared_parts: int) -> bool:
    """Whether `select_and_schedule` takes this router: `select_supported`'s, with the experts and shared parts
    together at most `MAX_EXPERTS` (expert ids exact in the kernel's bf16 products up to 256)."""
    return select_supported(n_experts, top_k) and n_experts + shared_parts <= MAX_EXPERTS


def select_supported(n_experts: int, top_k: int, n_group: int = 1) -> bool:
    """Whether `select_experts` takes this router: no expert groups, E a power of two from 16 to `MAX_EXPERTS`
    (the block's logits stay in registers), k <= E."""
    power_of_two = n_experts & (n_experts - 1) == 0
    return n_group == 1 and power_of_two and 16 <= n_experts <= MAX_EXPERTS and 1 <= top_k <= n_experts


def choose(n_experts: int, hidden: int, top_k: int, n_group: int, impl: str | None = None) -> str:
    """"pallas" / "interpret" where dispatch picks the kernel and it takes the router, else "reference"."""
    kind = dispatch.choose("router", ("reference", "pallas"), impl, gpu_verified=GPU_VERIFIED)
    return kind if kind == "reference" or supported(n_experts, hidden, top_k, n_group) else "reference"


def choose_select(n_experts: int, top_k: int, n_group: int, impl: str | None = None) -> str:
    """The same for `select_experts` (dispatch name "router_select")."""
    kind = dispatch.choose("router_select", ("reference", "pallas"), impl, gpu_verified=SELECT_GPU_VERIFIED)
    return kind if kind == "reference" or select_supported(n_experts, top_k, n_group) else "reference"
