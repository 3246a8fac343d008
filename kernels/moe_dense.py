"""Routed experts over dense (bf16 / fp32) weights as Pallas (Triton) grouped matmuls, any batch size.

XLA offers `ragged_dot`, whose default lowering reads every expert and multiplies every row by every expert, and
the gathered tiles of `moe_grouped`, which copy each tile's weights before multiplying. These kernels read each
used weight tile once, straight from the stacked [E, K, N] experts, and do only the tiles' matmul work:

- pairs are grouped into one-expert tiles of `block_m` rows (`moe_tiles.schedule`, as for the MXFP4 kernels);
  tiles past the used ones exit at once, so a decode step reads only its tokens' experts, each once;
- the grid is (row tile, output-column tile, K slice). Each program walks its slice of K in `step_k` steps:
  x rows [block_m, step_k] times W[expert][step_k, block_n] on the tensor cores, float32 accumulation;
- decode-sized calls have few tiles, so K is split over up to `k_slices` programs per output tile (enough programs
  to keep HBM busy); the float32 partial sums [slices, rows, N] are added up by a small XLA reduction (with
  `DenseTiles.pair_partials`, stored and added up for the pairs' rows only);
- gate and up share one kernel (the same x tile feeds both), then SwiGLU in XLA and the down kernel; with
  `DenseTiles.swiglu_epilogue` (K not split) the gate/up kernel applies the SwiGLU to its sums, and with
  `DenseTiles.fused_prologues` the row gather (and the SwiGLU) happen in the kernels' operand loads instead;
- `DenseTiles.fused_mlp` runs the whole MLP in one kernel instead (`moe_dense_fused`; off by default);
- a shared-expert MLP can ride along (`grouped_swiglu(shared=)`): split over its intermediate columns into parts
  of the experts' shape, it runs as extra experts of the same two kernels, read in place from its own weights.

Block sizes are the largest powers of two dividing the dims up to the tile's setting (Triton needs power-of-two
blocks; on a GPU each must be >= 16 to feed a dot, see `supported`). Rounding follows `moe.moe_experts`: weights
are used in x's dtype (f32 dots at IEEE precision) and each projection's output is rounded to x.dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import moe_dense_fused, moe_tiles, tiles as tiling

# Whether these kernels have passed tests/gpu/test_moe_dense_gpu.py on a GPU (H200, jax 0.11.2: 7/7 on 2026-11-30,
# and faster than both XLA paths at 1 and 16 tokens, benchmarks/RESULTS.md). Until a kernel has, dispatch runs the
# XLA paths on CUDA/ROCm unless asked for them (impl="pallas" or DAYZERO_KERNELS).
GPU_VERIFIED = True


@dataclass(frozen=True)
class DenseTiles:
    """Tile sizes (block_n and step_k are cut to the largest power of two dividing their dim) and launch
    parameters. `min_programs`: K is split (into at most `k_slices` slices) until a kernel has about this many."""

    block_m: int = 16
    block_n: int = 128
    step_k: int = 64
    k_slices: int = 8
    min_programs: int = 1024
    num_warps: int = 4
    num_stages: int = 3
    # The XLA steps around the kernels moved into their operand loads: the gate/up kernel reads each row's token
    # from x by index (zeros for padding rows), instead of an XLA gather writing the rows first, and (without
    # `swiglu_epilogue`) the down kernel computes silu(gate) * up as it loads them, instead of an XLA fusion writing
    # the hidden rows. Two kernels fewer per MoE layer (at batch 1 and 16 on the H200 those two took ~4 and ~10 us
    # per layer). Off: in the whole model on the H200 the kernels grew by more than the passes they save
    # (NOTES_serving.md, tenth session).
    fused_prologues: bool = False
    # The gate/up kernel computes silu(gate) * up on its accumulators and writes the hidden rows in x's dtype (K not
    # split: the SwiGLU needs complete sums), instead of float32 gate and up rows that XLA sums over K slices and
    # turns into hidden rows in two more passes over every padded row. For batches whose tiles fill the GPU without
    # splitting K (`choose_tiles`: calls of at least `EPILOGUE_MIN_PAIRS` pairs).
    swiglu_epilogue: bool = False
    # Where K is split (decode), the kernels write their float32 partial sums for the pairs' rows only and XLA adds
    # up just those rows (`_pair_partials_swiglu`), instead of every padded row of every tile: at one token 7 of
    # 112 rows are pairs, and the partials of both kernels are ~5.5 MB each per medium-hybrid layer. The MXFP4
    # kernels' split-K path does the same. Off: on the H200 (benchmarks/decode_profile.py --dense-pair-partials,
    # 2026-12-02) batch-1 decode took 1.351 ms of kernels per token with it against 1.356 without (15 more kernels
    # per token for the sums over just the pairs' rows); tests/gpu/test_moe_dense_gpu.py -k pairs passes at the
    # medium shapes.
    pair_partials: bool = False
    # The whole SwiGLU MLP in one kernel (`moe_dense_fused`: gate/up, SwiGLU, down, routing weight and combine by
    # float32 atomics, one program per tile and `block_i` intermediate columns), instead of the gather, two kernels
    # and XLA's sums, SwiGLU and combine. block_n is then the down product's column step, step_k the gate/up K step.
    # Chosen up to `FUSED_MLP_MAX_PAIRS` pairs (0: off; see there for its H200 figures).
    fused_mlp: bool = False
    block_i: int = 32
    k_chains: int = 1  # the one-kernel MLP's independent accumulators per K step
    # The down kernel weights its rows and adds them into the tokens' [T, H] float32 sums by atomics (K slices
    # included), instead of storing per-row (per-slice) sums for XLA to add up and combine: one kernel fewer per MoE
    # layer, plus a zero fill. Off: on the H200 (medium hybrid, decode_profile.py --dense-tiles atomic_combine=true,
    # 2026-12-03) batch 1 took 1.204 ms of kernels per token against 1.174 (309 kernels against 280: the zero fill
    # and the float32 sums' convert are kernels of their own in the model), batch 16 2.980 against 2.934, though a
    # lone layer call measured 29.9 against 31.5 us (moe.py --sweep mlp); tests/gpu/test_moe_dense_gpu.py -k
    # combine passes.
    atomic_combine: bool = False


# Calls of at least this many token-expert pairs take `DenseTiles.swiglu_epilogue`: on the H200 (medium hybrid,
# benchmarks/decode_profile.py, 2026-12-01, eleventh session) batch-16 decode (128 pairs with the shared experts
# inside) took 3.092 ms of kernels per token with it against 3.171 without. 96: 16 tokens of top-6.
EPILOGUE_MIN_PAIRS = 96
# Calls of at most this many pairs split K in at most 4 slices (else 8): on the H200 at one token of the medium
# hybrid (benchmarks/moe.py --sweep dense: the two kernels 18.7 us against 19.9 with 8 slices; decode_profile.py
# batch 1: 1.180 ms of kernels per token against 1.218, fifteenth session) the longer programs stream better.
FEW_PAIRS = 16
# Calls of at most this many pairs run the one-kernel MLP (`DenseTiles.fused_mlp`) with FUSED_MLP_TILES' blocks. 0:
# never. On the H200 (medium hybrid layer with its shared MLP, benchmarks/moe.py --sweep mlp --shared-parts 2,
# sixteenth session) its best tiles took the same GPU time per layer call as the split-K kernels at one token (31.25
# against 31.22 us, one kernel against five) and more at 16 tokens (139 against 130 us): with K whole, a program per
# 64 intermediate columns leaves ~1 warp per scheduler, each waiting on its own MMA accumulator chain (ncu: 6%
# achieved occupancy, 1.9 TB/s).
FUSED_MLP_MAX_PAIRS = 0
# One-token calls (a batch-1 decode step) hand the gate/up kernel the token itself, which every tile reads as its first
# row above zero rows (the single-token schedule puts the token there), instead of gathering R rows
# (at batch 1 of the medium hybrid a 112 x 2048 gather, ~2 us per MoE layer on the H200). On the H200 (medium
# hybrid, benchmarks/decode_profile.py, 2026-12-03, seventeenth session): batch 1 1.152 ms of kernels per token
# against 1.174 without (pipelined 1.105 against 1.129); tests/gpu/test_moe_dense_gpu.py -k one_token 4/4.
ONE_TOKEN_BLOCK = True
FUSED_MLP_TILES = dict(block_i=64, step_k=256, block_n=512)
# The last-program fusions of the eighteenth session, measured on the H200 and removed (nineteenth session, medium
# hybrid, benchmarks/decode_profile.py batch 1, ms of kernels per token against 1.050): the gate/up kernel's last K
# slice of each tile applying the SwiGLU ("swiglu_last", 1.067) and the down kernel's last program combining the pairs
# and adding the residual ("combine_last", 1.054). The fused last program does the work of the launch it saves in
# series, on one SM (benchmarks/NOTES_serving.md).


def choose_tiles(n_pairs: int, n_experts: int) -> DenseTiles:
    """16-row tiles while experts see few rows (decode; K split for parallelism, or the one-kernel MLP up to
    `FUSED_MLP_MAX_PAIRS` pairs), 64-row tiles for prefill."""
    rows = n_pairs / max(1, min(n_experts, n_pairs))
    if n_pairs <= FUSED_MLP_MAX_PAIRS:
        return DenseTiles(block_m=moe_tiles.DECODE_BLOCK_M, fused_mlp=True, **FUSED_MLP_TILES)
    if rows <= 16:
        return DenseTiles(block_m=moe_tiles.DECODE_BLOCK_M, swiglu_epilogue=n_pairs >= EPILOGUE_MIN_PAIRS,
                          k_slices=4 if n_pairs <= FEW_PAIRS else 8)
    if rows <= 48:
        return DenseTiles(block_m=32)
    return DenseTiles(block_m=64, num_warps=8)



def supported(hidden: int, inter: int, tiles: DenseTiles = DenseTiles()) -> bool:
    """Whether both projections' blocks can feed Triton dots on a GPU (every block >= 16; interpret mode takes any
    shape)."""
    blocks = [tiling.pow2_divisor(dim, limit) for dim in (hidden, inter) for limit in (tiles.block_n, tiles.step_k)]
    return min(blocks + [tiles.block_m]) >= 16


def _load_rows(x_ref, token_ref, r0, k0, *, bm, sk, prologue):
    """The x block [bm, sk] of rows r0.. at columns k0.. that tile's matmul reads. prologue None: x_ref holds the
    rows; "gather": x_ref holds the tokens [T, K] and token_ref each row's token (T or more: a padding row, zeros);
    "swiglu": x_ref holds gate and up side by side [R, 2K], the block is silu(gate) * up rounded to their dtype;
    "block": x_ref holds one token [1, K] that every tile reads as its first row, above bm - 1 zero rows."""
    if prologue == "block":
        first = jax.lax.broadcasted_iota(jnp.int32, (bm,), 0) == 0
        rows = x_ref[jnp.zeros((bm,), jnp.int32), pl.ds(k0, sk)]  # the token in every row, then all but the first
        return jnp.where(first[:, None], rows, jnp.zeros_like(rows))
    if prologue == "gather":
        n_tokens = x_ref.shape[0]
        token = token_ref[pl.ds(r0, bm)]
        real = token < n_tokens
        rows = x_ref[jnp.where(real, token, 0), pl.ds(k0, sk)]
        return jnp.where(real[:, None], rows, jnp.zeros_like(rows))
    if prologue == "swiglu":
        half = x_ref.shape[1] // 2
        gate = x_ref[pl.ds(r0, bm), pl.ds(k0, sk)]
        up = x_ref[pl.ds(r0, bm), pl.ds(half + k0, sk)]
        return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)
    return x_ref[pl.ds(r0, bm), pl.ds(k0, sk)]


def _grouped_kernel(tile_expert_ref, *refs, n_w, bm, bn, sk, steps, prologue, epilogue, n_routed, has_shared,
                    masked, masked_atomics, combine_tokens):
    # epilogue "combine": each row's token and routing weight come first
    (row_token_ref, row_weight_ref), refs = (refs[:2], refs[2:]) if epilogue == "combine" else ((None, None), refs)
    valid_ref, refs = (refs[0], refs[1:]) if masked else (None, refs)  # rows to store (the rest stay unwritten)
    token_ref = refs[0] if prologue == "gather" else None  # the rows' tokens come first where they are gathered
    x_ref, *refs = refs[1:] if prologue == "gather" else refs
    w_refs, shared_refs, o_ref = refs[:n_w], refs[n_w:n_w * (1 + has_shared)], refs[-1]
    t, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert = tile_expert_ref[t]
    r0 = pl.multiple_of(t * bm, bm)
    n0 = pl.multiple_of(j * bn, bn)

    def run(block):  # block(i, k0): weight i's [sk, bn] block at rows k0.. of this tile's expert
        def step(i, accs):
            k0 = pl.multiple_of((s * steps + i) * sk, sk)
            xb = _load_rows(x_ref, token_ref, r0, k0, bm=bm, sk=sk, prologue=prologue)
            return tuple(acc + tiling.mm(xb, block(w, k0).astype(xb.dtype)) for w, acc in enumerate(accs))

        accs = jax.lax.fori_loop(0, steps, step, tuple(jnp.zeros((bm, bn), jnp.float32) for _ in range(n_w)))
        if epilogue == "swiglu":  # each projection rounded to the output dtype first, as the unfused path does
            gate, up = (acc.astype(o_ref.dtype).astype(jnp.float32) for acc in accs)
            o_ref[pl.ds(r0, bm), pl.ds(n0, bn)] = (jax.nn.silu(gate) * up).astype(o_ref.dtype)
            return
        if epilogue == "combine":  # weighted, added into the flat [(T + bm) * N] sums of the rows' tokens
            moe_dense_fused.add_to_tokens(o_ref, row_token_ref[pl.ds(r0, bm)],
                                          accs[0] * row_weight_ref[pl.ds(r0, bm)][:, None], n0,
                                          n_tokens=combine_tokens, n_dim=w_refs[0].shape[2], masked=masked_atomics)
            return
        for i, acc in enumerate(accs):
            if masked:
                # (the plane as a traced int32: a bare Python int trips masked-store discharge in interpret mode)
                pltriton.store(o_ref.at[s, pl.ds(r0, bm), jnp.int32(i), pl.ds(n0, bn)], acc.astype(o_ref.dtype),
                               mask=(valid_ref[pl.ds(r0, bm)] != 0)[:, None])
            else:
                o_ref[s, pl.ds(r0, bm), i, pl.ds(n0, bn)] = acc.astype(o_ref.dtype)

    def routed(i, k0):
        return w_refs[i][expert, pl.ds(k0, sk), pl.ds(n0, bn)]

    if not has_shared:
        pl.when(expert >= 0)(lambda: run(routed))
    else:
        part = expert - n_routed  # which N-column part of the shared MLP this tile runs

        def shared(i, k0):
            w = shared_refs[i]
            if len(w.shape) == 2:  # [K, parts * N]: the part's columns
                n_dim = w_refs[i].shape[2]
                return w[pl.ds(k0, sk), pl.ds(pl.multiple_of(part * n_dim + n0, bn), bn)]
            return w[part, pl.ds(k0, sk), pl.ds(n0, bn)]  # [parts, K, N]

        pl.when((expert >= 0) & (expert < n_routed))(lambda: run(routed))
        pl.when(expert >= n_routed)(lambda: run(shared))


def grouped_matmul(x_rows: jax.Array, tile_expert: jax.Array, weights: tuple[jax.Array, ...], tiles: DenseTiles,
                   interpret: bool = False, token_of_row: jax.Array | None = None,
                   prologue: str | None = None, shared: tuple[jax.Array, ...] | None = None,
                   epilogue: str | None = None, out_dtype=jnp.float32, row_valid: jax.Array | None = None,
                   sum_slices: bool = True, combine: tuple[jax.Array, jax.Array, int] | None = None
                   ) -> jax.Array:
    """x_rows [R, K] (R a multiple of block_m; tile t = rows [t*block_m, (t+1)*block_m) uses expert tile_expert[t],
    -1: unused), weights: each [E, K, N] -> [R, len(weights), N] (rows of unused tiles undefined), float32 sums
    rounded to `out_dtype` (once, after the K slices are added up). `epilogue` "swiglu" (two weights, gate and up):
    [R, N] of out_dtype, silu(gate) * up with each rounded to out_dtype first; K is then not split. `row_valid` [R]
    int (not with the epilogue): only rows where it is nonzero are written. `sum_slices` False: the per-slice sums
    [slices, R, len(weights), N] as they are (float32, or out_dtype when K is not split), for the caller to reduce
    over just the rows it reads.

    `prologue` (see `_load_rows`): "gather" takes the tokens [T, K] as x_rows and the rows' tokens `token_of_row`
    [R] (R from it); "block" takes one token [1, K] that every tile reads as its first row above zero rows (and
    `token_of_row` [R] for R); "swiglu" takes gate and up [R, 2K] and multiplies silu(gate) * up. `epilogue`
    "combine" (one weight; `combine` = (the rows' tokens [R], T for padding rows; their routing weights [R] float32;
    T)): [T, N] float32, each row's sums times its weight added into its token's row by float32 atomics (K slices
    included; no rounding per row; the order of the adds varies run to run). `shared` (one per weight): an MLP's
    weight split in P parts of the experts' shape, as extra experts E .. E + P - 1; each either [K, P * N] (part p
    its columns p*N ..) or [P, K, N]."""
    weights_k = weights[0].shape[1]
    if prologue in ("gather", "block"):
        n_rows, k_dim = token_of_row.shape[0], x_rows.shape[1]
        if prologue == "block" and x_rows.shape[0] != 1:
            raise ValueError(f"prologue 'block' takes one token row, not {x_rows.shape[0]}")
    elif prologue == "swiglu":
        n_rows, k_dim = x_rows.shape[0], x_rows.shape[1] // 2
    elif prologue is None:
        n_rows, k_dim = x_rows.shape
    else:
        raise ValueError(f"unknown prologue {prologue!r} (None, 'gather', 'block' or 'swiglu')")
    if k_dim != weights_k:
        raise ValueError(f"rows of {k_dim} features for weights of {weights_k} inputs")
    if epilogue not in (None, "swiglu", "combine") or (
            epilogue == "swiglu" and (len(weights) != 2 or row_valid is not None)) or (
            epilogue == "combine" and (len(weights) != 1 or row_valid is not None or combine is None)):
        raise ValueError(f"epilogue {epilogue!r} for {len(weights)} weights (None; 'swiglu' for gate and up, all rows "
                         f"written; or 'combine' for one weight, with the rows' tokens and weights)")
    n_dim = weights[0].shape[2]
    bm = tiles.block_m
    bn = tiling.pow2_divisor(n_dim, tiles.block_n)
    sk = tiling.pow2_divisor(k_dim, tiles.step_k)
    k_steps = k_dim // sk
    grid = (n_rows // bm, n_dim // bn)
    wanted = -(-tiles.min_programs // (grid[0] * grid[1]))
    slices = 1 if epilogue == "swiglu" else max(d for d in range(1, min(tiles.k_slices, wanted, k_steps) + 1)
                                                if k_steps % d == 0)
    combine_tokens = combine[2] if epilogue == "combine" else None
    kernel = functools.partial(_grouped_kernel, n_w=len(weights), bm=bm, bn=bn, sk=sk, steps=k_steps // slices,
                               prologue=prologue, epilogue=epilogue, n_routed=weights[0].shape[0],
                               has_shared=shared is not None, masked=row_valid is not None,
                               masked_atomics=not interpret, combine_tokens=combine_tokens)
    operands = [tile_expert.astype(jnp.int32)]
    if epilogue == "combine":
        operands += [combine[0].astype(jnp.int32), combine[1].astype(jnp.float32)]
    operands += [*([] if row_valid is None else [row_valid.astype(jnp.int32)]),
                 *([token_of_row.astype(jnp.int32)] if prologue == "gather" else []), x_rows, *weights,
                 *(shared or ())]
    common = dict(grid=grid + (slices,), compiler_params=tiling.compiler_params(tiles.num_warps, tiles.num_stages),
                  interpret=interpret, name="moe_dense_gate_up" if len(weights) == 2 else "moe_dense_down")
    if epilogue == "combine":
        return moe_dense_fused.token_sums(kernel, operands, combine_tokens, bm, n_dim, **common)
    out_shape = (n_rows, n_dim) if epilogue else (slices, n_rows, len(weights), n_dim)
    partial = tiling.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype if slices == 1 else jnp.float32), **common,
    )(*operands)
    if epilogue or not sum_slices:
        return partial
    return partial[0] if slices == 1 else jnp.sum(partial, axis=0).astype(out_dtype)


def grouped_swiglu(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, tiles: DenseTiles | None = None, interpret: bool = False,
                   shared: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                   sched: moe_tiles.Schedule | None = None) -> jax.Array:
    """x [N, H], topk_ids [N, k] int, topk_weights [N, k] f32, w_gate/w_up [E, H, I], w_down [E, I, H] -> [N, H] of
    x.dtype (see the module docstring; `tiles` default: `choose_tiles`).

    `shared` (gate [H, S], up [H, S], down [S, H], S a multiple of I): a shared-expert MLP that every token runs
    unweighted, added in: its S / I parts of I columns run as experts E .. E + S/I - 1 of the same kernels (a SwiGLU
    splits over its intermediate columns), so y = routed + shared comes out of one combine in float32.

    `sched`: the pairs' schedule, made already (`kernels.router.select_and_schedule`, `moe_tiles.DECODE_BLOCK_M`-row
    tiles); topk_ids and
    topk_weights then hold the shared parts' columns too (ids E .., weight 1) where `shared` is given."""
    n_tokens = x.shape[0]
    n_experts = w_gate.shape[0]
    shared_up = shared_down = None
    if shared is not None:
        s_gate, s_up, s_down = shared
        inter = w_gate.shape[2]
        if s_gate.shape != s_up.shape or s_gate.shape[0] != w_gate.shape[1] or s_gate.shape[1] % inter \
                or s_down.shape != s_gate.shape[::-1]:
            raise ValueError(f"shared MLP {s_gate.shape} / {s_up.shape} / {s_down.shape} does not split into experts "
                             f"of {w_gate.shape[1:]} / {w_down.shape[1:]}")
        parts = s_gate.shape[1] // inter
        if sched is None:
            topk_ids = jnp.concatenate([topk_ids.astype(jnp.int32), jnp.broadcast_to(
                jnp.arange(n_experts, n_experts + parts, dtype=jnp.int32), (n_tokens, parts))], axis=1)
            topk_weights = jnp.concatenate([topk_weights.astype(jnp.float32),
                                            jnp.ones((n_tokens, parts), jnp.float32)], axis=1)
        shared_up, shared_down = (s_gate, s_up), (s_down.reshape(parts, inter, s_down.shape[1]),)
        n_experts += parts
    tiles = tiles or choose_tiles(topk_ids.size, n_experts)
    if sched is None:
        sched = moe_tiles.schedule(topk_ids, n_experts, tiles.block_m)
    elif tiles.block_m != moe_tiles.DECODE_BLOCK_M or sched.row_of_pair.shape != topk_ids.shape:
        raise ValueError(f"a schedule of {sched.row_of_pair.shape} pairs in {moe_tiles.DECODE_BLOCK_M}-row tiles "
                         f"for {topk_ids.shape} pairs in {tiles.block_m}-row tiles")
    if tiles.fused_mlp:
        return moe_dense_fused.fused_swiglu(
            x, sched, topk_weights, w_gate, w_up, w_down, block_m=tiles.block_m, block_i=tiles.block_i,
            step_k=tiles.step_k, block_n=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            k_chains=tiles.k_chains, shared=shared, interpret=interpret).astype(x.dtype)
    if tiles.fused_prologues:  # padding rows of used tiles read zeros, so their hidden rows are silu(0) * 0 = 0
        rows, gather = x, dict(token_of_row=sched.token_of_row, prologue="gather")
    elif ONE_TOKEN_BLOCK and n_tokens == 1 and not tiles.pair_partials:
        # one token: each tile holds it in its first row (`moe_tiles` single-token schedule), so every tile reads
        # the token as its first row above zero rows, instead of a gather writing R rows
        rows, gather = x, dict(token_of_row=sched.token_of_row, prologue="block")
    else:
        rows, gather = moe_tiles.take_or_zero(x, sched.token_of_row), {}  # padding rows zero
    if tiles.pair_partials and not (tiles.swiglu_epilogue or tiles.fused_prologues):
        return _pair_partials_swiglu(rows, sched, topk_weights, (w_gate, w_up), (w_down,), shared_up, shared_down,
                                     tiles, interpret)
    down_prologue = None
    if tiles.swiglu_epilogue:
        hidden = grouped_matmul(rows, sched.tile_expert, (w_gate, w_up), tiles, interpret, shared=shared_up,
                                epilogue="swiglu", out_dtype=x.dtype, **gather)
    elif tiles.fused_prologues:  # the down kernel computes the SwiGLU as it loads gate and up
        gate_up = grouped_matmul(rows, sched.tile_expert, (w_gate, w_up), tiles, interpret, shared=shared_up,
                                 out_dtype=x.dtype, **gather)
        hidden, down_prologue = gate_up.reshape(gate_up.shape[0], -1), "swiglu"
    else:
        gate_up = grouped_matmul(rows, sched.tile_expert, (w_gate, w_up), tiles, interpret, shared=shared_up,
                                 out_dtype=x.dtype, **gather)
        real = sched.real_rows()[:, None]  # rows of unused tiles hold whatever the buffer held
        hidden = jnp.where(real, jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], 0).astype(x.dtype)
    # rows of unused tiles stay undefined, but no program of the down kernel and no pair of `combine` reads them
    if tiles.atomic_combine:
        combine = (sched.token_of_row, moe_tiles.row_weights(sched, topk_weights), n_tokens)
        return grouped_matmul(hidden, sched.tile_expert, (w_down,), tiles, interpret, shared=shared_down,
                              prologue=down_prologue, epilogue="combine", combine=combine).astype(x.dtype)
    out = grouped_matmul(hidden, sched.tile_expert, (w_down,), tiles, interpret, shared=shared_down,
                         prologue=down_prologue, out_dtype=x.dtype)
    return moe_tiles.combine(out[:, 0], sched, topk_weights).astype(x.dtype)


def _pair_partials_swiglu(rows: jax.Array, sched: moe_tiles.Schedule, topk_weights: jax.Array, gate_up: tuple,
                          down: tuple, shared_up, shared_down, tiles: DenseTiles, interpret: bool) -> jax.Array:
    """`grouped_swiglu` after the schedule with `DenseTiles.pair_partials`: rows [R, H] (padding rows zero) -> [T, H]
    of rows.dtype. Both kernels store only the pairs' rows; each sum over K slices reads only those rows, so the
    gate/up sums come out per pair [P, 2, I] and go back into the padded row layout for the down kernel (padding
    rows zero); the down sums per pair feed the weighted combine directly. Rounding as the default path."""
    dtype = rows.dtype
    pair_rows = sched.row_of_pair.reshape(-1)
    common = dict(tiles=tiles, interpret=interpret, out_dtype=dtype, row_valid=sched.real_rows().astype(jnp.int32),
                  sum_slices=False)
    sums = jnp.sum(grouped_matmul(rows, sched.tile_expert, gate_up, shared=shared_up, **common)[:, pair_rows]
                   .astype(jnp.float32), axis=0).astype(dtype)  # [P, 2, I]
    hidden_pairs = (jax.nn.silu(sums[:, 0]) * sums[:, 1]).astype(dtype)
    hidden = moe_tiles.take_or_zero(hidden_pairs, sched.pair_of_row())
    out = jnp.sum(grouped_matmul(hidden, sched.tile_expert, down, shared=shared_down, **common)[:, pair_rows, 0]
                  .astype(jnp.float32), axis=0).astype(dtype)  # [P, H]
    return moe_tiles.weighted_sum(out.reshape(*sched.row_of_pair.shape, -1), topk_weights).astype(dtype)
