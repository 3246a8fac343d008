"""The front of a decode step's MoE block in one Pallas (Triton) kernel: the attention's residual add, the
post-attention RMSNorm and the router's logits, for up to `MAX_ROWS` rows.

After a decode layer's attention, XLA runs two reductions before the router's select kernel: one adds up o_proj's
split-K partial sums, adds the residual and sums the squares (~3.5 us per MoE layer at batch 1 on the H200), one
normalises and multiplies by the router weight (~2-2.5 us; benchmarks/NOTES_serving.md, seventeenth session); at
16 rows three fusions (~2 + 1.5 + 2.2 us). Here one launch does it all. A program takes `expert_block(rows)` experts
of one row and loads everything at once (its router weight block first: it does not depend on x), with no loop:

1. x = round(residual + round(sum of the partial sums)) (as `projection.finished` with a residual) and its squares;
2. normed = round(weight * round(x / rms)) (as `model.norms.RMSNorm`);
3. its experts' logits, the sums of normed * weight in float32 (bf16 products are exact in float32, as the
   reference's are; only the order of the adds differs); the first program also writes x and normed.

A first form (seventeenth session) walked the features in 64-column steps, twice, with the rows as a 16-row block
for the tensor cores: correct on the H200 (tests/gpu/test_moe_front_gpu.py 7/7) but 44 us per call, the 64 dependent
steps each waiting on its loads (batch 1 1.540 ms of kernels per token against 1.138 without). Takes 1 to
`MAX_ROWS` rows (one program per row and expert block: each row's programs re-read the router weight, from L2), H a
power of two up to `MAX_HIDDEN`, E a multiple of that block, 16-bit activations (`supported`). `reference` is
the same in XLA; `choose` picks (dispatch name "moe_front").

With `pack`, the first program of each row also packs its normed row for the MXFP4 decode kernels as
`moe_mxfp4_gemv.row_scaled_words` does (fp16 halves in word order, one power-of-two factor per row) and the zero
row they read for padding, so no XLA packing pass runs between the front and those kernels.

With `select` (one row only), the router's choice after the logits (`kernels.router.select_and_schedule` at one
token) is made in the same launch: every program adds 1 to an int32 counter with an acquire-release atomic once its
logits are stored, and the program that sees the others all done reads every logit back, chooses the experts
(`router.choose_experts`) and sets the counter back to zero (the counters live in the serving cache, "moe_turns").
With `zeros` as well, its first program writes the int32 zeros the MXFP4 decode kernels take as turn counters
(`moe_mxfp4_gemv.turn_count`), so no zero fill of their own runs between this kernel and theirs.

With `sums`, the first program of each row also writes x as float32 [M, H]: the buffer the MXFP4 down kernel adds the
experts' outputs into (`model.moe.RESIDUAL_IN_SUMS`), so the layer's residual add needs no kernel of its own. The
residual may then be float32 too (the previous layer's such sums), rounded to the weights' dtype as it loads.

With `shared` (one row, beside the choice), extra programs after the router's multiply the normed row by the shared
MLP's gate and up weights (`SharedProducts`: `SHARED_BLOCK_N` columns over a part of K each, the weight block
loaded first as the router's is) and store the float32 sums, which the MXFP4 gate/up kernel then finishes
(`moe_mxfp4_gemv.SharedFold.front_parts`) instead of streaming those weights itself. The router's programs use a
few SMs (16 at the medium hybrid's one row) for ~5 us, waiting on their loads and on each other; these programs stream
the shared MLP's gate and up weights on the SMs the router leaves idle.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import atomics, dispatch, moe_mxfp4_gemv, projection, router, tiles as tiling

# On by default on CUDA: tests/gpu/test_moe_front_gpu.py passes on the H200 (jax 0.11.2, eighteenth session), and
# the medium hybrid's batch-1 decode took 1.108 ms of kernels per token with it against 1.133 without (pipelined
# 1.070 against 1.086; decode_profile.py --pallas moe_front, the same call): the kernel 3.9 us per MoE layer after
# a KDA layer, in place of XLA's two reductions (4.3 + 2.6 us).
GPU_VERIFIED = True
# Experts per router program (`expert_block`): EXPERT_BLOCK for calls of several rows, ONE_ROW_EXPERT_BLOCK for one
# row. On the H100 (medium hybrid with MXFP4 experts, decode_profile.py --experts mxfp4 --batches 1 --set
# kernels.moe_front.EXPERT_BLOCK=..., forty-first session, one machine): batch 1 took 0.895 / 0.896 / 0.895 ms per
# token pipelined with 4 experts a program (16 programs; 0.910-0.912 ms of kernels) against 0.907 / 0.905 with 8
# (0.919), 0.926 with 16 (0.936), 0.895 with 2 (0.909). Batch 16 and the H200 not measured with 4: 8 stays there.
# The one-row A/B is now --set kernels.moe_front.ONE_ROW_EXPERT_BLOCK=...
EXPERT_BLOCK = 8
ONE_ROW_EXPERT_BLOCK = 4
MAX_HIDDEN = 8192
# Rows the model hands the kernel at most (`choose`): the decode calls whose router logits are XLA reductions, not
# a dot (`model.moe.REDUCE_LOGITS_MAX_TOKENS`). On the H200 (twenty-first session, decode_profile.py --set
# kernels.moe_front.MAX_ROWS=1 for the A/B): batch 16 2.795 against 2.830 ms of kernels per token (4.1 us per MoE
# layer in place of XLA's o_proj finish, norm and logits fusions), batch 2 1.318 against 1.322;
# tests/gpu/test_moe_front_gpu.py passes at 1, 5 and 16 rows and in the model at batch 16.
MAX_ROWS = 16
# 4 / 8 / 16 warps: 6.55 / 6.72 / 5.94 us per call in benchmarks/moe_front.py (H200, chained with the benchmark's
# own copy of ~3 us; the kernel alone 3.6 / 3.8 / 3.0 us). In the model (H100, medium hybrid with MXFP4 experts,
# decode_profile.py --set kernels.moe_front.NUM_WARPS=16, thirty-seventh session): the front 6.3 -> 5.7 us per MoE
# layer at batch 1, 4.8 -> 4.3 at batch 16; 0.921 / 0.922 against 0.932 ms of kernels per token at batch 1 (two
# calls), 2.197 against 2.199 at batch 16. The offline sm_90 build: 44 registers against 80 (40 / 85 with the
# router's choice), no spills.
NUM_WARPS = 16
# The shared MLP's gate / up products in this kernel (`front(shared=)`): weight columns per program and parts of K
# per column block (the medium hybrid: 768 columns / 64 x 8 parts = 96 programs of 64 KB beside the router's 16, each
# reading its [256, 64] blocks of gate and up as 128-byte runs of rows). On the H100 with both model switches on
# (medium hybrid with MXFP4 experts, decode_profile.py --experts mxfp4 --batches 1, one machine, forty-third session):
# 0.867 / 0.868 ms per token pipelined in two calls, against 0.907 at 16 x 2 (the former default: 32-byte runs),
# 0.881 at 128 x 16, 0.903 at 64 x 16, and 0.895 / 0.894 with both switches off. Under ncu (`ncu_ops.py moe_front`)
# the front at 16 x 2 took 12.7 against 7.6 us without the shared programs. The gate/up kernel adds up more parts
# (0.150 against 0.144 ms per token at 16 x 2) but the front sheds more. On the H200 16 x 2 measured 0.848 ms of
# kernels against 0.879 with 4 parts and 0.873 with 32 columns (forty-first session); 64 x 8 is not yet measured there.
SHARED_BLOCK_N = 64
SHARED_K_PARTS = 8
# The most weight elements one shared program holds per weight (`shared_products`): the medium hybrid's [256, 64]
# blocks, the shape measured. A wider model's blocks would be larger per program (more registers than the 16-warp
# front has); `shared_products` gives None there, and the MXFP4 gate/up kernel streams the shared weights as before.
SHARED_MAX_BLOCK = 256 * 64
# Whether the shared programs multiply only their K part of the row, unnormalised (x times the norm weight, float32),
# so each reads 1 / k_parts of o_proj's partial sums instead of all of them, and skips the rms reduction and the
# second read of its part; the first router program writes the row's 1 / rms, which the MXFP4 gate/up kernel applies
# to the added-up sums (`SharedProducts.row_part`, `moe_mxfp4_gemv.ScaledSums`). The shared MLP's gate / up sums then
# skip the normed row's bf16 rounding (within it of the normed form's). On one H100 (forty-fourth session, medium
# hybrid with MXFP4 experts): decode_profile.py --batches 1 0.860 ms per token pipelined (GPU 0.866) against 0.865
# (0.874) with it off in the same call; under ncu the front took 8.26 against 9.25 us; serving.py's batch-1 ITL 0.848
# and 0.867 in two calls with it, 0.897 in one without (its runs vary by ~0.05 ms). Not yet measured on an H200.
SHARED_ROW_PART = True


class Select(NamedTuple):
    """The router's choice after the logits (`kernels.router.select_and_schedule` at one token), for `front` to make
    in its last program: top-k of sigmoid or softmax scores plus the correction bias, the weights renormalised when
    asked and scaled, `parts` shared experts appended (ids E .., weight 1)."""

    top_k: int
    sigmoid: bool
    renormalize: bool
    scale: float
    parts: int


class SharedProducts(NamedTuple):
    """`front(shared=)`'s extra programs: each multiplies the normed row's K part `hidden / k_parts` by `block_n`
    columns of the shared MLP's gate and up weights; programs n_router + c * k_parts + p (column block c, part p).
    `row_part`: they multiply the unnormalised part (x times the norm weight) instead, and the front also returns
    the row's 1 / rms to scale the sums by (`SHARED_ROW_PART`)."""

    block_n: int
    k_parts: int
    row_part: bool = False


def shared_products(hidden: int, shared_inter: int) -> SharedProducts | None:
    """The extra programs for a shared MLP of `shared_inter` columns at hidden size `hidden` (`SHARED_BLOCK_N`,
    `SHARED_K_PARTS`), or None where they do not divide it or a program's block of each weight would exceed
    `SHARED_MAX_BLOCK` elements."""
    spec = _module_programs()
    fits = hidden // spec.k_parts * spec.block_n <= SHARED_MAX_BLOCK
    return spec if fits and _divides(spec, hidden, shared_inter) else None


def _module_programs() -> SharedProducts:
    """The shared programs of the module's constants (`SHARED_BLOCK_N`, `SHARED_K_PARTS`, `SHARED_ROW_PART`)."""
    return SharedProducts(SHARED_BLOCK_N, SHARED_K_PARTS, SHARED_ROW_PART)


def _divides(spec: SharedProducts, hidden: int, shared_inter: int) -> bool:
    return not (shared_inter % spec.block_n or hidden % spec.k_parts or (hidden // spec.k_parts) % 16)


def expert_block(rows: int) -> int:
    """Experts per router program for a call of `rows` rows: ONE_ROW_EXPERT_BLOCK at one row, else EXPERT_BLOCK."""
    return ONE_ROW_EXPERT_BLOCK if rows == 1 else EXPERT_BLOCK


def supported(rows: int, hidden: int, n_experts: int, dtype) -> bool:
    """Whether the kernel takes this call (see the module docstring)."""
    return (1 <= rows <= MAX_ROWS and 16 <= hidden <= MAX_HIDDEN and hidden & (hidden - 1) == 0
            and n_experts % expert_block(rows) == 0 and jnp.dtype(dtype).itemsize == 2)


def choose(rows: int, hidden: int, n_experts: int, dtype, impl: str | None = None) -> str:
    """"pallas" / "interpret" where dispatch picks the kernel and it takes the call, else "reference"."""
    kind = dispatch.choose("moe_front", ("reference", "pallas"), impl, gpu_verified=GPU_VERIFIED)
    return kind if supported(rows, hidden, n_experts, dtype) else "reference"


def model_dtype(residual: jax.Array, router_weight: jax.Array):
    """The dtype x and the normed rows take: the residual's, or for a float32 residual of 16-bit router weights (the
    MXFP4 down kernel's sums with the residual added in) the weights', to which the residual is rounded as it
    loads."""
    if residual.dtype == jnp.float32 and jnp.dtype(router_weight.dtype).itemsize == 2:
        return router_weight.dtype
    return residual.dtype


def _check(update, residual, norm_weight, router_weight):
    rows, hidden = residual.shape
    dtype = model_dtype(residual, router_weight)
    if isinstance(update, projection.Partials):
        if update.squares is not None or update.sums.shape[1:] != (rows, hidden) or update.dtype != dtype:
            raise ValueError(f"moe front: the update's partial sums {update.sums.shape} ({update.dtype}, squares "
                             f"{'given' if update.squares is not None else 'none'}) do not match the residual "
                             f"{list(residual.shape)} of {dtype} (no norm statistics expected)")
    elif update is not None and (update.shape != residual.shape or update.dtype != dtype):
        raise ValueError(f"moe front: update {update.dtype}{list(update.shape)} for residual "
                         f"{list(residual.shape)} of {dtype}")
    if norm_weight.shape != (hidden,) or router_weight.ndim != 2 or router_weight.shape[1] != hidden:
        raise ValueError(f"moe front: norm weight {norm_weight.shape} and router weight {router_weight.shape} for "
                         f"{hidden} features ([H] and [E, H])")


# The factor of the zero row after the packed rows (any value: its words are zeros). Not row_scaled_words' 2^-114
# for a zero row: the H200 run stored 0 for that constant (twenty-seventh session), and a normal value shows the
# store happened.
ZERO_ROW_FACTOR = 1.0


def packed_rows(normed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """normed [M, H] -> its words for the MXFP4 decode kernels with a zero row appended (`row_scaled_words`: words
    uint32 [M + 1, H / 32, 16], factors float32 [M + 1], the zero row's `ZERO_ROW_FACTOR`)."""
    words, factors = moe_mxfp4_gemv.row_scaled_words(
        jnp.concatenate([normed, jnp.zeros((1, normed.shape[1]), normed.dtype)]))
    return words, factors.at[-1].set(ZERO_ROW_FACTOR)


def reference(update: projection.Projected | None, residual: jax.Array, norm_weight: jax.Array,
              router_weight: jax.Array, *, eps: float, pack: bool = False, sums: bool = False,
              shared: tuple[jax.Array, jax.Array] | None = None) -> tuple:
    """XLA: (x [M, H] = residual + the update, finished and rounded as o_proj's projection does; normed [M, H] =
    RMSNorm(x) as `model.norms.RMSNorm`; logits [M, E] float32, the sums of float32 products, as
    `model.moe.router_logits` computes them for decode-sized calls), with `pack` then normed's words
    (`packed_rows`), with `sums` then x as float32, with `shared` (gate, up [H, S]) then normed times each as float32
    sums [1, 2, S] (one row; `front(shared=)`'s in one part of K). `update`: o_proj's `projection.Partials` (no
    squares), its finished [M, H] of the model's dtype (`model_dtype`), or None (x = residual). A float32 residual of
    16-bit router weights is rounded to their dtype first."""
    _check(update, residual, norm_weight, router_weight)
    residual = residual.astype(model_dtype(residual, router_weight))
    x = residual if update is None else projection.finished(update, residual)
    normed = projection.rms_norm(x, norm_weight, eps)
    logits = jnp.sum(normed[:, None, :].astype(jnp.float32) * router_weight[None].astype(jnp.float32), axis=-1)
    out = (x, normed, logits) + ((packed_rows(normed),) if pack else ()) + ((x.astype(jnp.float32),) if sums else ())
    if shared is not None:
        _check_shared(shared, residual.shape[0], residual.shape[1])
        products = jnp.stack([jnp.dot(normed[0].astype(jnp.float32), w.astype(jnp.float32),
                                      precision=jax.lax.Precision.HIGHEST) for w in shared])
        out += (products[None],)
    return out


def _check_shared(shared, rows: int, hidden: int):
    gate, up = shared
    if rows != 1:
        raise ValueError(f"moe front: the shared MLP's products are made for one row, not {rows}")
    if gate.shape != up.shape or gate.ndim != 2 or gate.shape[0] != hidden or jnp.dtype(gate.dtype).itemsize != 2:
        raise ValueError(f"moe front: the shared MLP's gate {gate.dtype}{list(gate.shape)} / up "
                         f"{up.dtype}{list(up.shape)} do not match {hidden} features (16-bit [H, S] each)")


def _kernel(*refs, hidden, block, partials, eps, pack, sums, select, layer, zeros, shared, interpret):
    """`block`: experts per router program. `partials`: o_proj's update comes as its partial sums (a
    `projection.partials_operands` layout, no squares), the first ref. `shared`: the `SharedProducts` programs after
    the router's, or None."""
    sums_ref, refs = (refs[0], refs[1:]) if partials else (None, refs)
    res_ref, norm_ref, w_ref, *refs = refs
    if select is not None:  # the correction bias, and the turn counters' input (aliased with their output: unused)
        bias_ref, _, *refs = refs
    if shared is not None:
        gate_ref, up_ref, *refs = refs
    x_out, normed_out, logits_out, *refs = refs
    if pack:
        halves_out, factor_out, *refs = refs
    if sums:
        sums_out, *refs = refs
    if select is not None:
        ids_out, weights_out, turns_ref, *refs = refs
    if zeros:
        zeros_out, *refs = refs
    row_part = shared is not None and shared.row_part
    if shared is not None:
        shared_out, *refs = refs
    if row_part:
        scale_out, *refs = refs
    dtype = x_out.dtype  # the model's (`model_dtype`: a float32 residual is rounded to it as it loads)
    n_router = w_ref.shape[0] // block
    program = pl.program_id(0)  # (read here: interpret mode takes no program_id inside a `pl.when`)
    row_id = pl.program_id(1)
    row = pl.ds(row_id, 1)

    def row_x(cols):
        """x [1, len(cols)] float32 (the model dtype's values): residual + the finished update, rounded."""
        x = res_ref[row, cols].astype(dtype).astype(jnp.float32)
        if partials:
            x = x + projection.partials_loader([sums_ref], row, partials)(cols).astype(jnp.float32)
        return x.astype(dtype).astype(jnp.float32)

    def normalised(x, inv_rms, norm_weight):
        unit = (x * inv_rms).astype(dtype).astype(jnp.float32)
        return (norm_weight.astype(jnp.float32)[None, :] * unit).astype(dtype)

    def router_program():
        e0 = pl.multiple_of(program * block, block)
        cols = pl.ds(0, hidden)
        weight = w_ref[pl.ds(e0, block), cols]  # [block, H]: first, its read overlaps the rest
        # the norm's weight before the rms reduction: loaded after it, its read waits for the reduction's barriers
        norm_weight = norm_ref[cols]
        x = row_x(cols)
        inv_rms = jax.lax.rsqrt(jnp.sum(x * x) / hidden + eps)
        normed = normalised(x, inv_rms, norm_weight)
        logits = jnp.sum(normed.astype(jnp.float32) * weight.astype(jnp.float32), axis=1)  # [block]
        logits_out[row, pl.ds(e0, block)] = logits[None, :]

        @pl.when(program == 0)
        def _():
            x_out[row, cols] = x.astype(dtype)
            normed_out[row, cols] = normed
            if sums:  # x (exact in float32) as the start of the down kernel's sums
                sums_out[row, cols] = x
            if row_part:  # the row's 1 / rms, for the shared programs' sums
                scale_out[row_id] = inv_rms
            if pack:  # the row's words for the MXFP4 decode kernels (`packed_rows`)
                positions, halves, factor = moe_mxfp4_gemv.row_halves(normed.astype(jnp.float32).reshape(hidden))
                halves_out[row_id, positions] = halves
                factor_out[row_id] = factor

        if pack:
            @pl.when((program == 0) & (row_id == 0))
            def _():  # the zero row after the last
                last = halves_out.shape[0] - 1
                halves_out[last, cols] = jnp.zeros((hidden,), jnp.int16)
                factor_out[last] = jnp.float32(ZERO_ROW_FACTOR)

        if zeros:
            @pl.when((program == 0) & (row_id == 0))
            def _():  # zeros for the MXFP4 decode kernels' turn counters (`front(zeros=)`)
                tiling.store_zeros(zeros_out, 0, zeros)

        if select is None:
            return
        # The choice needs every router program's logits: each counts itself done (an acquire-release atomic after
        # its logits' store), and the last one reads all of them back and chooses, then resets the counter for the
        # next call (the `kernels.kda.decode_layer` turns pattern).
        turn = atomics.take_turn(turns_ref, (jnp.int32(layer), jnp.int32(0)), interpret=interpret)

        @pl.when(turn == n_router - 1)
        def _choose_experts():
            n_experts = logits_out.shape[1]
            n_rows = ids_out.shape[0]  # every row of the router's [BLOCK_M, k_pad] output holds the token's choice
            logits_all = logits_out[jnp.zeros((n_rows,), jnp.int32), pl.ds(0, n_experts)]
            ids, weights = router.choose_experts(logits_all, bias_ref[pl.ds(0, n_experts)], ids_out.shape[1],
                                                 top_k=select.top_k, sigmoid=select.sigmoid,
                                                 renormalize=select.renormalize, scale=select.scale)
            ids_out[...], weights_out[...] = router.append_shared(ids, weights, select.top_k, select.parts,
                                                                  n_experts)
            turns_ref[layer, 0] = jnp.int32(0)

    if shared is None:
        router_program()
        return

    def shared_program():
        """normed's K part (or with `row_part` x's times the norm weight) times block_n columns of the shared gate and
        up weights -> float32 sums (`shared_out` [k_parts, 2, S])."""
        p = program - n_router
        k_len = hidden // shared.k_parts
        part = p % shared.k_parts
        ks = pl.ds(pl.multiple_of(part * k_len, k_len), k_len)
        cs = pl.ds(pl.multiple_of(p // shared.k_parts * shared.block_n, shared.block_n), shared.block_n)
        weights = [gate_ref[ks, cs], up_ref[ks, cs]]  # [k_len, block_n] each: first, as the router's
        if row_part:  # the part unnormalised: the router's first program writes the row's 1 / rms
            column = (norm_ref[ks].astype(jnp.float32)[None, :] * row_x(ks)).reshape(k_len, 1)
        else:
            norm_weight = norm_ref[ks]
            x = row_x(pl.ds(0, hidden))
            inv_rms = jax.lax.rsqrt(jnp.sum(x * x) / hidden + eps)  # the row's, as the router's programs find it
            column = normalised(row_x(ks), inv_rms, norm_weight).astype(jnp.float32).reshape(k_len, 1)
        for i, w in enumerate(weights):
            shared_out[part, jnp.int32(i), cs] = jnp.sum(column * w.astype(jnp.float32), axis=0)

    pl.when(program < n_router)(router_program)
    pl.when(program >= n_router)(shared_program)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "pack", "sums", "select", "layer", "zeros",
                                             "shared_programs", "interpret"))
def front(update: projection.Projected | None, residual: jax.Array, norm_weight: jax.Array,
          router_weight: jax.Array, *, eps: float, num_warps: int = NUM_WARPS, pack: bool = False, sums: bool = False,
          select: Select | None = None, bias: jax.Array | None = None, turns: jax.Array | None = None, layer: int = 0,
          zeros: int = 0, shared: tuple[jax.Array, jax.Array] | None = None,
          shared_programs: SharedProducts | None = None, interpret: bool = False) -> tuple[jax.Array, ...]:
    """`reference`'s results in one kernel (see the module docstring): update (o_proj's `projection.Partials`
    [S, M, H] float32 without squares, a finished [M, H], or None), residual [M, H] 16-bit, norm_weight [H], router
    weight [E, H] -> (x [M, H], normed [M, H], logits [M, E] float32), M the residual's rows, with `pack` then
    normed's words for the MXFP4 decode kernels ((words, factors) as `packed_rows` makes them), with `sums` then x
    as float32 [M, H] (the MXFP4 down kernel's sums to add into). The residual may be float32 (rounded to the router
    weight's 16-bit dtype as it loads: `model_dtype`). Needs `supported`.

    With `select` (one row; and the correction `bias` [E] or None, and `turns`: int32 [L, C] counters, all zero, of
    which the call uses turns[layer, 0] and leaves it zero; `model.cache`'s "moe_turns"), the last program to finish
    also makes the router's choice from all the logits: the results then go on with (ids [16, k_pad] int32, weights
    [16, k_pad] float32, turns), as `kernels.router.select_and_schedule`'s one-token kernel writes them (every row
    the token's choice, k_pad the next power of two of top_k + parts). Needs `select_supported` too. With `zeros` > 0
    as well, the results end with int32 zeros [at least `zeros`, a power of two], written by the first program: the
    MXFP4 decode kernels' turn counters (`moe_mxfp4_gemv.turn_count`, `Schedule.turns`), which would otherwise be
    a zero fill of their own between this kernel and those.

    With `shared` (the shared MLP's gate and up, 16-bit [H, S] each; needs `select`), the results end with the
    normed row times each as float32 sums [k_parts, 2, S], to add up over the parts of K, made by programs beside
    the router's (`shared_programs`, default `SHARED_BLOCK_N` x `SHARED_K_PARTS`; `shared_products`). With
    `SharedProducts.row_part` they are sums of the unnormalised row (x times the norm weight) and come back as
    `moe_mxfp4_gemv.ScaledSums` with the row's 1 / rms float32 [1] (written by the first router program)."""
    _check(update, residual, norm_weight, router_weight)
    rows, hidden = residual.shape
    n_experts = router_weight.shape[0]
    dtype = model_dtype(residual, router_weight)
    if not supported(rows, hidden, n_experts, dtype):
        raise ValueError(f"moe front kernel: {rows} rows x {hidden} features, {n_experts} experts, {dtype} "
                         f"not supported (1 to {MAX_ROWS} rows, H a power of two up to {MAX_HIDDEN}, E a multiple of "
                         f"{expert_block(rows)}, 16-bit)")
    if pack and hidden % moe_mxfp4_gemv.BLOCK:
        raise ValueError(f"moe front kernel: packing takes whole MX blocks of {moe_mxfp4_gemv.BLOCK} features, not "
                         f"{hidden}")
    if isinstance(update, projection.Partials):
        if update.slices & (update.slices - 1):  # a block of the partial sums: a power of two (as projection splits K)
            raise ValueError(f"moe front kernel: {update.slices} partial sums; takes a power of two")
        operands, partials = projection.partials_operands(update)
    elif update is not None:  # a finished update: added in XLA first (one fusion, as before)
        residual, operands, partials = residual.astype(update.dtype) + update, [], None
    else:
        operands, partials = [], None
    row = jax.ShapeDtypeStruct((rows, hidden), dtype)
    outputs = [row, row, jax.ShapeDtypeStruct((rows, n_experts), jnp.float32)]
    if pack:  # the rows' fp16 halves in word order and factors, and a zero row
        outputs += [jax.ShapeDtypeStruct((rows + 1, hidden), jnp.int16), jax.ShapeDtypeStruct((rows + 1,), jnp.float32)]
    if sums:
        outputs.append(jax.ShapeDtypeStruct((rows, hidden), jnp.float32))
    inputs = [*operands, residual, norm_weight, router_weight]
    aliases = {}
    if select is not None:
        if rows != 1:
            raise ValueError(f"moe front kernel: the router's choice is made for one row, not {rows}")
        if not select_supported(n_experts, select):
            raise ValueError(f"moe front kernel: the router's choice of top-{select.top_k} + {select.parts} shared "
                             f"of {n_experts} experts not supported (`kernels.router.schedule_supported`)")
        if turns is None or turns.dtype != jnp.int32 or turns.ndim != 2 or not 0 <= layer < turns.shape[0]:
            raise ValueError(f"moe front kernel: the choice needs turn counters int32 [L > {layer}, C], not "
                             f"{None if turns is None else (turns.dtype, turns.shape)}")
        bias = jnp.zeros((n_experts,), jnp.float32) if bias is None else bias.astype(jnp.float32)
        k_pad = tiling.pow2_at_least(select.top_k + select.parts)
        outputs += [jax.ShapeDtypeStruct((router.BLOCK_M, k_pad), jnp.int32),
                    jax.ShapeDtypeStruct((router.BLOCK_M, k_pad), jnp.float32),
                    jax.ShapeDtypeStruct(turns.shape, turns.dtype)]
        inputs += [bias, turns]
        aliases = {len(inputs) - 1: len(outputs) - 1}
    if zeros:
        if select is None:
            raise ValueError("moe front kernel: zeros for the decode kernels come with the router's choice (select)")
        zeros = tiling.pow2_at_least(zeros)
        outputs.append(jax.ShapeDtypeStruct((zeros,), jnp.int32))
    block = expert_block(rows)
    n_programs = n_experts // block
    if shared is not None:
        if select is None:
            raise ValueError("moe front kernel: the shared MLP's products come with the router's choice (select)")
        _check_shared(shared, rows, hidden)
        shared_programs = shared_programs or _module_programs()
        if not _divides(shared_programs, hidden, shared[0].shape[1]):
            raise ValueError(f"moe front kernel: a shared MLP of {shared[0].shape[1]} columns at {hidden} features "
                             f"does not divide into programs of {shared_programs.block_n} columns x "
                             f"{shared_programs.k_parts} parts of K (each part a multiple of 16)")
        inputs += list(shared)  # after the choice's (the aliased counters keep their index)
        outputs.append(jax.ShapeDtypeStruct((shared_programs.k_parts, 2, shared[0].shape[1]), jnp.float32))
        if shared_programs.row_part:  # the row's 1 / rms, for the sums of the unnormalised row
            outputs.append(jax.ShapeDtypeStruct((1,), jnp.float32))
        n_programs += shared[0].shape[1] // shared_programs.block_n * shared_programs.k_parts
    else:
        shared_programs = None
    out = tiling.pallas_call(
        functools.partial(_kernel, hidden=hidden, block=block, partials=partials, eps=float(eps), pack=pack, sums=sums,
                          select=select, layer=layer, zeros=zeros, shared=shared_programs, interpret=interpret),
        grid=(n_programs, rows),
        out_shape=outputs,
        input_output_aliases=aliases,
        compiler_params=tiling.compiler_params(num_warps, 1),
        interpret=interpret,
        name="moe_front",
    )(*inputs)
    if pack:
        out = [*out[:3], (moe_mxfp4_gemv.halves_as_words(out[3]), out[4]), *out[5:]]
    if shared_programs is not None and shared_programs.row_part:
        out = [*out[:-2], moe_mxfp4_gemv.ScaledSums(out[-2], out[-1])]
    return tuple(out)


def select_supported(n_experts: int, select: Select) -> bool:
    """Whether `front(select=)` takes this choice: as `kernels.router.select_and_schedule` at one token."""
    return router.schedule_supported(n_experts, select.top_k, select.parts)


def by_kind(kind: str):
    """The `front`-signature callable for a `choose` result."""
    if kind == "reference":
        return reference
    return functools.partial(front, num_warps=NUM_WARPS, interpret=kind == "interpret")  # NUM_WARPS read per call
