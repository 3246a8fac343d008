"""Mixture-of-Experts block (Flax Linen): router with sigmoid/softmax scoring, grouped (noaux_tc) top-k with the
score-correction bias, renormalisation and routed scaling; routed SwiGLU experts; shared experts; and the dense MLP."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from dayzero.kernels import moe as moe_kernels
from dayzero.kernels import moe_front, moe_mxfp4_gemv, moe_tiles, moe_workspace, mxfp4, projection
from dayzero.kernels import router as router_kernel
from dayzero.kernels.moe_workspace import Workspace

from . import sharding
from .config import MLP_MOE, ModelConfig
from .linear import dense
from .norms import RMSNorm

# Token counts up to which the shared experts run as one expert of the grouped kernels. On the H200 (medium hybrid,
# 2026-12-01) batch-1 decode went from 1.88-1.95 to 1.71 ms per token with them; batch 16 measured 3.62 ms against
# 3.54-3.59 without (not an A/B run in one process), so larger batches keep XLA's GEMMs.
SHARED_GROUPED_MAX_TOKENS = 8
# Token counts up to which the shared experts, where they run apart from the routed experts (MXFP4 experts; bf16
# ones past SHARED_IN_ROUTED_MAX_TOKENS), take the decode projection kernel (`kernels.projection`) for gate|up and
# for down (`MLP.projection_max_tokens`), with SHARED_PROJECTION_TILES (gate|up, down): one medium-hybrid shared
# expert (2048 x 768) is 12 column blocks of 128, so both split K for a few hundred programs. On the H200 (medium
# hybrid with MXFP4 experts, benchmarks/decode_profile.py --experts mxfp4, 2026-12-04): batch 1 1.014 ms of kernels
# per token against 1.062 through the grouped kernels (the shared expert 8.3 against 11.5 us per layer); at batch 16
# 2.278 against 2.263 with XLA's GEMMs, so 16 tokens keep those. 32-column blocks: 1.043 at batch 1. 0: off.
SHARED_PROJECTION_MAX_TOKENS = 8
SHARED_PROJECTION_TILES = (projection.ProjectionTiles(block_n=64, k_slices=16),
                           projection.ProjectionTiles(block_n=64, step_k=32, k_slices=8))
# Token counts up to which a dense layer's MLP (one device) runs as two decode projection kernels with the layer's
# post-attention norm inside gate|up's and its residual add inside down's (`MLP.projected(norm=, residual=)`,
# DENSE_PROJECTION_TILES: `kernels.projection`'s defaults for a group of weights and for one weight), in place of
# XLA's norm, three products, SwiGLU and add (the medium hybrid's layer 0 at 2048 x 6144, DeepSeek V3's
# first three at 7168 x 18432). 0: off. Measured on an H100 (thirty-sixth session, no H200 lent; decode_profile.py
# --experts mxfp4 --set model.moe.DENSE_PROJECTION_MAX_TOKENS=16 against the default, same machine): batch 1 0.930
# against 0.932 ms of kernels per token (124.5 kernels either way: XLA's form of the MLP takes no more kernels than the
# two projection calls), batch 16 2.193 against 2.198; no gain worth the second path, so it stays off
# (tests/gpu/test_projection_gpu.py -k dense passes on that H100). Again on an H100 (2026-12-07, with the one-row
# tiles of weight rows): batch 1 0.788 / 0.789 against 0.785 / 0.785 ms, batch 16 2.136 against 2.134.
DENSE_PROJECTION_MAX_TOKENS = 0
DENSE_PROJECTION_TILES = (projection.ProjectionTiles(), projection.ProjectionTiles(block_n=64))
# Whether decode-sized calls run the shared experts inside the routed experts' grouped kernels (bf16 experts on one
# device: `kernels.moe.routed_and_shared`, the shared MLP as extra experts), one set of kernels for both instead of
# two. On the H200 (medium hybrid, benchmarks/decode_profile.py, 2026-12-01, eleventh session): batch 1 1.472 ms of
# kernels per token against 1.601 without, batch 16 3.171 against 3.262 (tests/gpu/test_moe_dense_gpu.py -k
# shared_mlp 9/9).
SHARED_IN_ROUTED_KERNELS = True
# Token counts up to which that applies: at 16 tokens each part of the shared MLP (its columns cut to the experts'
# width) fills one 16-row tile.
SHARED_IN_ROUTED_MAX_TOKENS = 16
# Whether decode-sized calls with the shared experts in the routed kernels take the router's select-and-schedule
# kernel (`kernels.router.select_and_schedule`: the top-k choice, the shared parts appended and, from 2 tokens, the
# pairs' schedule in one launch) where dispatch picks the select kernel. On the H200 (medium hybrid,
# benchmarks/decode_profile.py, 2026-12-02, thirteenth session): 1.230 / 2.955 ms of kernels per token at batch 1 / 16
# with it against 1.241 / 2.964 without (244 / 276 kernels against 259 / 338); tests/gpu/test_router_gpu.py and
# tests/gpu/test_moe_dense_gpu.py -k router_schedule pass. The one program takes ~8.9 us at 16 tokens (the select
# kernel alone ~3.3, XLA's four schedule kernels ~6). The same kernel makes the MXFP4 decode kernels' schedule (in
# their tiles' rows, `kernels.moe.packed_decode_tiles`; its tables and weights unsliced, `padded`).
ROUTER_SCHEDULE = True
# Token counts from which the MXFP4 decode kernels read x packed by the MoE front kernel (`kernels.moe_front.front(
# pack=True)`, in the launch that normalises x) instead of packing it themselves (the one-token tiles'
# `GemvTiles.pack_in_kernel`: each gate/up program its own K slice) or in XLA (a reduction and two fusions per MoE
# layer at 16 tokens).
FRONT_PACKED_MIN_TOKENS = 2
# Token counts up to which the MXFP4 decode kernels also run the shared MLP (`moe_mxfp4_gemv.SharedFold`: its parts
# as pseudo-experts over a quarter of K each, from its bf16 weights), where they take the call
# (`moe_mxfp4_gemv.shared_parts`: 1-row tiles), instead of its own projection kernels and SwiGLU between; the router's
# choice at one token is then made by the MoE front kernel (`MoE.front_select`), as with bf16 experts. On the H200
# (medium hybrid with MXFP4 experts, benchmarks/decode_profile.py --experts mxfp4, 2026-12-04): batch 1 0.923 -> 0.886
# / 0.896 ms per token pipelined in two calls, 250 -> 175 kernels (the shared MLP's projection kernels, its SwiGLU
# multiply and the router's select kernel gone; gate/up 7.1 -> 11.1 us, down 4.7 -> 6.3 us per layer). 0: never.
SHARED_IN_PACKED_MAX_TOKENS = 1
# Whether the front kernel, where it makes one token's choice (`MoE.front_select`), also writes the zeros the MXFP4
# decode kernels take as turn counters (`moe_mxfp4_gemv.turn_count`): in place of XLA's zero fill per MoE layer (a
# ~1.2 us memset launch on the H200, 15 per token in the medium hybrid's batch-1 step).
COUNTERS_FROM_FRONT = True
# Whether a decode MoE block whose front kernel runs before the MXFP4 decode kernels has that kernel write the layer's
# residual rows as float32 (`kernels.moe_front.front(sums=True)`) for the down kernel to add the experts into, in
# place of the zeros it adds into now (`MoE.residual_in_sums`): the layer's output is then those float32 sums, and the
# next layer's kernels round them to the model dtype as they load (`kernels.projection`, `kernels.moe_front`), so the
# residual add (one XLA kernel per MoE layer, ~1.1 us each on the H200: 15 per batch-1 token of the medium hybrid)
# disappears. The sums are rounded once (residual + experts) where XLA's add rounded the experts' sums first. On the
# H200 (medium hybrid with MXFP4 experts, benchmarks/decode_profile.py --experts mxfp4 --batches 1, one machine,
# thirty-fourth session): 0.844 against 0.858 ms per token pipelined, 0.864 against 0.885 ms of kernels, 136.5
# against 150.5 kernels per token; tests/gpu/test_mxfp4_gpu.py -k residual passes.
RESIDUAL_IN_SUMS = True
# Whether the MoE front kernel, where it makes one token's choice (`MoE.front_select`) and the MXFP4 decode kernels
# fold in the shared MLP, also multiplies the normed row by the shared MLP's gate and up weights, in programs beside
# the router's (`kernels.moe_front.front(shared=)`, `MoE.front_shared`), so the gate/up kernel finishes those sums
# (`moe_mxfp4_gemv.SharedFold.front_parts`) instead of streaming the 6.3 MB of bf16 weights itself (the medium
# hybrid). Used where `kernels.moe_front.shared_products` takes the shapes. With SHARED_DOWN_IN_GATE_UP, on the H100
# (medium hybrid with MXFP4 experts, decode_profile.py --experts mxfp4 --batches 1, one machine, forty-third session,
# the front's programs at 64 columns x 8 parts of K): 0.867 / 0.868 ms per token pipelined in two calls against
# 0.895 / 0.894 with both switches off; the gate/up kernel 12.0 -> 10.0 us and the down kernel 6.6 -> 5.0 us per MoE
# layer. The former 16 x 2 programs lost (0.907 there; on the H200, forty-first session, 0.857 alone and 0.832 with
# SHARED_DOWN_IN_GATE_UP against 0.829 off). Batch 16 takes neither (2.106 against 2.110 ms). Not yet measured on the
# H200 at 64 x 8.
SHARED_GATE_UP_IN_FRONT = True
# Whether, with SHARED_GATE_UP_IN_FRONT, the MXFP4 gate/up kernel's shared tiles also run the shared MLP's down
# projection from those sums, adding into the residual rows (`RESIDUAL_IN_SUMS`; `moe_mxfp4_gemv.SharedMLP.
# down_in_gate_up`), so the down kernel streams the routed experts alone (the medium hybrid's 3.1 MB of bf16 down
# moves beside the gate/up kernel's routed programs). Measured with the first switch, above.
SHARED_DOWN_IN_GATE_UP = True
# Router calls of up to this many tokens compute their logits as one multiply-and-sum fusion (`router_logits`). On
# the H200 (medium hybrid, with kernels.router.select_experts, 2026-12-01): 1.351 / 2.968 ms of kernels per decode
# token at batch 1 / 16 against 1.397 / 2.990 with the dot (benchmarks/decode_profile.py --router-dot).
REDUCE_LOGITS_MAX_TOKENS = 16


class MLP(nn.Module):
    """SwiGLU MLP: down_proj(silu(gate_proj(x)) * up_proj(x)). Calls of at most `projection_max_tokens` tokens run
    gate|up and down through the decode projection kernel where dispatch picks it and it takes the shapes
    (`projected`, `projection_tiles`); else calls of at most `grouped_max_tokens` through the grouped expert kernels
    as one expert (`swiglu_as_one_expert`); 0: never."""

    intermediate_size: int
    hidden_size: int
    dtype: jnp.dtype
    grouped_max_tokens: int = 0
    projection_max_tokens: int = 0
    projection_tiles: tuple[projection.ProjectionTiles, projection.ProjectionTiles] | None = None

    @nn.compact
    def __call__(self, x):
        y = self.projected(x)
        if y is not None:
            return y
        if (self.grouped_max_tokens and not self.is_initializing()
                and math.prod(x.shape[:-1]) <= self.grouped_max_tokens):
            y = moe_kernels.swiglu_as_one_expert(x.reshape(-1, x.shape[-1]), *self._kernels())
            if y is not None:
                return y.reshape(*x.shape[:-1], self.hidden_size)
        gate = dense(self.intermediate_size, self.dtype, name="gate_proj")(x)
        up = dense(self.intermediate_size, self.dtype, name="up_proj")(x)
        return dense(self.hidden_size, self.dtype, name="down_proj")(jax.nn.silu(gate) * up)

    def projected(self, x, norm: RMSNorm | None = None, residual: jax.Array | None = None) -> jax.Array | None:
        """x [..., H] -> [..., H] through the decode projection kernels (`swiglu_projected` with `projection_tiles`),
        for calls of at most `projection_max_tokens` tokens; None where they do not take the call (the caller runs
        its other paths). `norm`: the RMSNorm whose output the MLP takes, applied inside gate|up's kernel (x then its
        input); `residual` [..., H]: added inside down's kernel (the layer's `residual + y`)."""
        n_tokens = math.prod(x.shape[:-1])
        if not self.projection_max_tokens or self.is_initializing() or n_tokens > self.projection_max_tokens:
            return None
        rows = lambda a: a.reshape(n_tokens, a.shape[-1])
        norm_args = {} if norm is None else dict(norm_weight=norm.variables["params"]["weight"], eps=norm.eps)
        y = swiglu_projected(rows(x), *self._kernels(), tiles=self.projection_tiles, **norm_args,
                             residual=None if residual is None else rows(residual))
        return None if y is None else y.reshape(*x.shape[:-1], self.hidden_size)

    def _kernels(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The (gate, up, down) projections' kernels [H, I], [H, I], [I, H]."""
        params = self.variables["params"]
        return tuple(params[name]["kernel"] for name in ("gate_proj", "up_proj", "down_proj"))


def swiglu_projected(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                     tiles: tuple[projection.ProjectionTiles, projection.ProjectionTiles] | None = None,
                     impl: str | None = None, norm_weight: jax.Array | None = None, eps: float = 1e-6,
                     residual: jax.Array | None = None) -> jax.Array | None:
    """x [M, H] -> [M, H] of the weights' dtype: the SwiGLU MLP (w_gate / w_up [H, I], w_down [I, H]) as two decode
    projection kernel calls, gate|up in one and down in the other, with XLA's silu(gate) * up between (each product
    rounded to the weights' dtype, as `MLP`'s dense layers round). With `norm_weight` [H] (and `eps`) x is normalised
    first (`norms.RMSNorm`, inside gate|up's kernel); with `residual` [M, H] the result is residual + the MLP, rounded
    as the layer's `x + y` (inside down's kernel). `tiles`: (gate|up, down), default `SHARED_PROJECTION_TILES`. None
    where dispatch does not pick the kernel for either call or it does not take the shapes (`projection.choose`; M a
    power of two up to 16): the caller then runs its own layers."""
    rows, hidden = x.shape
    inter = w_gate.shape[1]
    kinds = (projection.choose(rows, hidden, (inter, inter), impl=impl),
             projection.choose(rows, inter, (hidden,), impl=impl))
    if "reference" in kinds:
        return None
    gate_up_tiles, down_tiles = tiles or SHARED_PROJECTION_TILES
    (gate_up,) = projection.by_kind(kinds[0])(x, ((w_gate, w_up),), norm_weight=norm_weight, eps=eps,
                                              tiles=gate_up_tiles)
    hidden_rows = jax.nn.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    (y,) = projection.by_kind(kinds[1])(hidden_rows, ((w_down,),), residual=residual, tiles=down_tiles)
    return y


def route(logits: jax.Array, bias: jax.Array | None, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] float32 -> (topk_ids [N, k] int32, topk_weights [N, k] float32).

    Selection uses scores (+ the correction bias when present), restricted to the `topk_group` best groups (a group
    scores the sum of its two best experts); weights are the unbiased scores of the chosen experts, renormalised
    when configured, times `routed_scaling_factor`.
    """
    scores = jax.nn.sigmoid(logits) if cfg.router_activation == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if restricting_groups(cfg) > 1:
        grouped = choice.reshape(choice.shape[0], cfg.n_group, -1)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        keep = jnp.zeros(group_scores.shape, bool).at[jnp.arange(choice.shape[0])[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, cfg.num_experts // cfg.n_group, axis=-1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, cfg.num_experts_per_token)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.renormalize and cfg.num_experts_per_token > 1:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * cfg.routed_scaling_factor


def restricting_groups(cfg: ModelConfig) -> int:
    """The expert groups that restrict the choice: n_group when only topk_group of them are kept, else 1."""
    return cfg.n_group if cfg.topk_group < cfg.n_group else 1


def router_logits(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [N, D] @ weight [E, D]^T -> float32 logits [N, E]. Operands of one 16-bit dtype stay in it: their products
    are exact in the float32 accumulator, as upcast ones are, and no float32 copy of the weight is made per step
    (on the H200 that convert was its own kernel in every MoE layer of a decode step). Otherwise both go to float32.
    Calls of up to `REDUCE_LOGITS_MAX_TOKENS` tokens multiply and sum in one fusion instead of a dot, which XLA
    runs there as a cuBLAS float32 gemv behind converts of both operands, or a split-K GEMM and its reduction."""
    if x.shape[0] <= REDUCE_LOGITS_MAX_TOKENS:
        products = x[:, None, :].astype(jnp.float32) * weight[None, :, :].astype(jnp.float32)
        return jnp.sum(products, axis=-1)
    if x.dtype != weight.dtype or jnp.dtype(x.dtype).itemsize > 2:
        x, weight = x.astype(jnp.float32), weight.astype(jnp.float32)
    return jax.lax.dot_general(x, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def select_route(cfg: ModelConfig, n_tokens: int, shared_parts: int,
                 one_kernel: bool = True, schedule_rows: int = 0) -> tuple[str, bool]:
    """What `Router` runs after given logits for `n_tokens` tokens with the shared MLP as `shared_parts` extra
    experts, or asked for a schedule in `schedule_rows`-row tiles: ("schedule"
    (`kernels.router.select_and_schedule`), "select" (`select_experts`) or "reference", whether in interpret
    mode)."""
    kind = (router_kernel.choose_select(cfg.num_experts, cfg.num_experts_per_token, restricting_groups(cfg))
            if one_kernel else "reference")
    interpret = kind == "interpret"
    wants = shared_parts or schedule_rows
    if (kind != "reference" and wants and ROUTER_SCHEDULE and n_tokens <= router_kernel.SCHEDULE_MAX_TOKENS
            and router_kernel.schedule_supported(cfg.num_experts, cfg.num_experts_per_token, shared_parts)
            and (not schedule_rows or moe_tiles.max_tiles(n_tokens * cfg.num_experts_per_token, cfg.num_experts,
                                                          schedule_rows) <= 256)):
        return "schedule", interpret
    return ("select" if kind != "reference" else "reference"), interpret


def _schedule_tiles(schedule_rows: int) -> dict:
    """The router kernel's schedule options for `Router`'s `schedule_rows`: the grouped kernels' 16-row tiles (0), or
    the MXFP4 decode kernels' tiles of that many rows with the tables and weights as written (`padded`)."""
    return dict(block_m=schedule_rows or router_kernel.TILE_ROWS, padded=bool(schedule_rows))


class Router(nn.Module):
    """Params: `weight` [E, D] (checkpoint layout, model dtype) and `e_score_correction_bias` [E] float32.
    `one_kernel`: route with `kernels.router` where dispatch picks it (off on a mesh: the kernels are not sharded):
    the whole router in one kernel, or XLA's logits product and then the rest in one kernel."""

    config: ModelConfig
    dtype: jnp.dtype
    one_kernel: bool = True

    @nn.compact
    def __call__(self, x, shared_parts: int = 0, logits: jax.Array | None = None, chosen=None,
                 schedule_rows: int = 0):
        """x [N, D] -> (topk_ids [N, k] int32, topk_weights [N, k] float32). With `shared_parts` P > 0: (ids,
        weights, schedule), where the select-and-schedule kernel ran (`kernels.router.select_and_schedule`, up to
        `SCHEDULE_MAX_TOKENS` tokens): the shared MLP's P parts appended to every token as experts E .. E + P - 1 of
        weight 1 (ids / weights [N, k + P], `kernels.moe.routed_and_shared`'s layout) and their
        `moe_tiles.Schedule` in 16-row tiles from the same launch; elsewhere the routed [N, k] and None. With
        `schedule_rows` > 0 (no shared parts): (ids, weights, schedule in tiles of that many rows with the kernel's
        padded tables and weights, `select_and_schedule(padded=True)`, where the kernel made it, else None). `logits`
        [N, E] float32: x's logits, computed already (`kernels.moe_front`), not again here. `chosen`: one token's
        choice made already as the select kernel writes it (ids / weights [16, k_pad], `kernels.moe_front.front`
        with `select=MoE.front_select(...)`): only the schedule is made here."""
        cfg = self.config
        weight = self.param("weight", nn.initializers.normal(0.02), (cfg.num_experts, cfg.hidden_size), self.dtype)
        bias = None
        if cfg.router_bias:
            bias = self.param("e_score_correction_bias", nn.initializers.zeros, (cfg.num_experts,), jnp.float32)
        if chosen is not None:
            if not shared_parts or x.shape[0] != 1:
                raise ValueError(f"Router: a choice made already is for one token with shared parts, not "
                                 f"{x.shape[0]} tokens and {shared_parts} parts")
            return router_kernel.one_token_routing(*chosen, cfg.num_experts_per_token + shared_parts,
                                                   cfg.num_experts + shared_parts, **_schedule_tiles(schedule_rows))
        ids, weights, sched = self._route(x, weight, bias, shared_parts, logits, schedule_rows)
        return (ids, weights, sched) if shared_parts or schedule_rows else (ids, weights)

    def _route(self, x, weight, bias, shared_parts: int, logits: jax.Array | None = None, schedule_rows: int = 0):
        """(ids, weights, schedule or None): the shared parts and schedule included only where the
        select-and-schedule kernel ran."""
        cfg = self.config
        kind = (router_kernel.choose(cfg.num_experts, cfg.hidden_size, cfg.num_experts_per_token,
                                     restricting_groups(cfg))
                if self.one_kernel else "reference")
        options = dict(top_k=cfg.num_experts_per_token, sigmoid=cfg.router_activation == "sigmoid",
                       renormalize=cfg.renormalize, scale=float(cfg.routed_scaling_factor))
        if kind != "reference" and logits is None:
            return *router_kernel.route_tokens(x, weight, bias, **options, interpret=kind == "interpret"), None
        if logits is None:
            logits = router_logits(x, weight)
        kind, interpret = select_route(cfg, x.shape[0], shared_parts, self.one_kernel, schedule_rows)
        if kind == "schedule":
            return router_kernel.select_and_schedule(logits, bias, **options, shared_parts=shared_parts,
                                                     **_schedule_tiles(schedule_rows), interpret=interpret)
        if kind == "select":
            return *router_kernel.select_experts(logits, bias, **options, interpret=interpret), None
        return *route(logits, bias, cfg), None


PROJECTIONS = ("w_gate", "w_up", "w_down")


def packed_experts(params: dict, fmt: str) -> mxfp4.ExpertWeights:
    """The routed experts' params of `packed_param_shapes` (arrays, or shape structs of them) as `ExpertWeights` in
    format `fmt` (`packed_format`)."""
    data = [params[f"{proj}_blocks" if fmt == "mxfp4" else f"{proj}_converted"] for proj in PROJECTIONS]
    return mxfp4.ExpertWeights(*data, *[params.get(f"{proj}_scales") for proj in PROJECTIONS], fmt=fmt)


def packed_param_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
    """Param name -> (shape, dtype) of MXFP4 routed experts: `{proj}_blocks` uint8 [E, out, ceil(in/32), 16] and
    `{proj}_scales` uint8 [E, out, ceil(in/32)] ([out, in] as published); after an offline conversion
    `{proj}_converted` [E, out, ceil(in/32), 2, 16] of the workspace dtype (and the scales, for float8)."""
    e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    dims = {"w_gate": (i, mxfp4.num_blocks(d)), "w_up": (i, mxfp4.num_blocks(d)), "w_down": (d, mxfp4.num_blocks(i))}
    half = mxfp4.BLOCK // 2
    offline = cfg.mxfp4.mode == "offline"
    out = {}
    for proj, (rows, groups) in dims.items():
        if offline:
            out[f"{proj}_converted"] = ((e, rows, groups, 2, half), jnp.dtype(cfg.mxfp4.workspace_dtype))
        else:
            out[f"{proj}_blocks"] = ((e, rows, groups, half), jnp.dtype(jnp.uint8))
        if not offline or cfg.mxfp4.workspace_dtype == "float8_e4m3fn":
            out[f"{proj}_scales"] = ((e, rows, groups), jnp.dtype(jnp.uint8))
    return out


def new_workspace(cfg: ModelConfig, n_tokens: int, mesh: Mesh | None = None) -> Workspace | None:
    """The one-layer expert workspace a forward pass over `n_tokens` tokens threads through its MoE layers, or None
    when its experts are not MXFP4 or run without one (fused, offline, or expert-parallel on `mesh`)."""
    if cfg.quant_method != "mxfp4" or MLP_MOE not in cfg.mlp_types or sharding.expert_parallel_size(cfg, mesh) > 1:
        return None
    if not cfg.mxfp4.uses_workspace(n_tokens, cfg.num_experts_per_token, cfg.num_experts):
        return None
    slots = moe_workspace.num_slots(n_tokens * cfg.num_experts_per_token, cfg.num_experts)
    return moe_workspace.create(slots, cfg.hidden_size, cfg.moe_intermediate_size, cfg.mxfp4.workspace_dtype)


def packed_format(cfg: ModelConfig) -> str:
    """The format the MXFP4 checkpoint's routed experts run in: "mxfp4" (packed), or the workspace dtype after an
    offline conversion."""
    return cfg.mxfp4.workspace_dtype if cfg.mxfp4.mode == "offline" else "mxfp4"


def expert_parallel(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, experts: dict[str, jax.Array],
                    run_local: Callable[[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]], jax.Array],
                    mesh: Mesh, num_experts: int) -> jax.Array:
    """Expert-parallel routed experts: x [N, D], topk_ids [N, k] int32, topk_weights [N, k] float32, `experts` the
    layer's stacked expert arrays (leading dim E, any format) -> [N, D] of x.dtype.

    Inside `shard_map`, the tokens are split over every mesh axis and the experts over `expert` (S shards of E / S
    experts; replicated over `data` and `tensor`). Each shard packs its token-expert pairs by destination shard into
    a send buffer [S, C, D] with C = n * min(k, E / S) rows per destination (n local tokens): the exact worst case,
    every pair of every local token bound for one shard, so no pair is ever dropped. One all-to-all over `expert`
    delivers the rows, `run_local(rows [S*C, D], local ids [S*C, 1], weights [S*C, 1], local experts)` runs them
    through the shard's experts (empty rows: zeros at weight 0), a second all-to-all returns the outputs, and each
    token sums its pairs' outputs times their routing weights in float32, as the single-device path does.
    """
    n_tokens, top_k = topk_ids.shape
    n_shards = sharding.axis_size(mesh, "expert")
    local_experts = num_experts // n_shards
    token_shards = mesh.size
    padded = -(-n_tokens // token_shards) * token_shards
    if padded != n_tokens:  # padding tokens: zero rows, distinct experts, weight 0
        extra = padded - n_tokens
        x = jnp.concatenate([x, jnp.zeros((extra, x.shape[1]), x.dtype)])
        topk_ids = jnp.concatenate([topk_ids, jnp.broadcast_to(jnp.arange(top_k, dtype=topk_ids.dtype),
                                                               (extra, top_k))])
        topk_weights = jnp.concatenate([topk_weights, jnp.zeros((extra, top_k), topk_weights.dtype)])

    def body(x, ids, weights, local):
        n = x.shape[0]
        capacity = n * min(top_k, local_experts)
        flat = ids.reshape(-1)
        dest = flat // local_experts
        order = jnp.argsort(flat, stable=True)  # by expert, hence by destination shard
        counts = jnp.bincount(dest, length=n_shards)
        starts = jnp.cumsum(counts) - counts
        pairs = jnp.arange(n * top_k, dtype=jnp.int32)
        pos = jnp.zeros_like(pairs).at[order].set(pairs - starts[dest[order]].astype(jnp.int32))
        token = pairs // top_k
        send = jnp.zeros((n_shards, capacity, x.shape[1]), x.dtype).at[dest, pos].set(x[token])
        send_ids = jnp.full((n_shards, capacity), -1, jnp.int32).at[dest, pos].set(flat % local_experts)
        rows = jax.lax.all_to_all(send, "expert", 0, 0, tiled=True).reshape(n_shards * capacity, x.shape[1])
        row_ids = jax.lax.all_to_all(send_ids, "expert", 0, 0, tiled=True).reshape(-1, 1)
        valid = row_ids >= 0
        out = run_local(rows, jnp.maximum(row_ids, 0), valid.astype(jnp.float32), local)
        back = jax.lax.all_to_all(out.reshape(n_shards, capacity, -1), "expert", 0, 0, tiled=True)
        weighted = back[dest, pos].astype(jnp.float32) * weights.reshape(-1, 1).astype(jnp.float32)
        return jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(weighted).astype(x.dtype)

    tokens = PartitionSpec(sharding.TOKEN_AXES)
    # check_vma=False: the shard's expert kernels may be Pallas calls, whose outputs carry no varying-axes types
    y = jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, PartitionSpec("expert")),
                      out_specs=tokens, check_vma=False)(x, topk_ids, topk_weights, experts)
    return y[:n_tokens]


class Experts(nn.Module):
    """Routed experts stacked per projection: w_gate, w_up [E, D, I] and w_down [E, I, D]; or, for MXFP4 checkpoints,
    the packed params of `packed_param_shapes`. Returns (y, workspace). On a `mesh` whose `expert` axis divides E,
    the experts run expert-parallel (`expert_parallel`; MXFP4 then converts each shard's active experts per call,
    without the workspace)."""

    config: ModelConfig
    dtype: jnp.dtype
    layer: int = 0
    mesh: Any = None

    @nn.compact
    def __call__(self, x, ids, weights, workspace: Workspace | None = None, tiles=None, sched=None, x_words=None,
                 shared=None, residual_sums=None):
        """`tiles` / `sched` / `x_words`: the MXFP4 decode kernels' tiles (`MoE.decode_tiles`), their schedule and
        packed x, made ahead (`kernels.moe.moe_experts_packed`), and `shared`, the shared MLP's (gate, up, down)
        kernels for those kernels to add in (`moe_mxfp4_gemv.SharedFold`); unused otherwise. `residual_sums`: the
        float32 residual rows those kernels add into (`MoE.residual_in_sums`; y is then float32, residual + experts)."""
        cfg = self.config
        ep = sharding.expert_parallel_size(cfg, self.mesh) > 1
        if cfg.quant_method == "mxfp4":
            p = {name: self.param(name, _packed_init(name), shape, dtype)
                 for name, (shape, dtype) in packed_param_shapes(cfg).items()}
            packed = functools.partial(packed_experts, fmt=packed_format(cfg))
            if ep:
                def run_local(rows, local_ids, row_weights, local):
                    return moe_kernels.moe_experts_packed(rows, local_ids, row_weights, packed(local),
                                                          impl=cfg.mxfp4.impl)[0]

                return expert_parallel(x, ids, weights, p, run_local, self.mesh, cfg.num_experts), workspace
            return moe_kernels.moe_experts_packed(x, ids, weights, packed(p), layer=self.layer, workspace=workspace,
                                                  tiles=tiles, impl=cfg.mxfp4.impl, sched=sched, x_words=x_words,
                                                  shared=shared, residual_sums=residual_sums)
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = nn.initializers.normal(0.02)
        w = {"w_gate": self.param("w_gate", init, (e, d, i), self.dtype),
             "w_up": self.param("w_up", init, (e, d, i), self.dtype),
             "w_down": self.param("w_down", init, (e, i, d), self.dtype)}
        if ep:
            def run_local(rows, local_ids, row_weights, local):
                return moe_kernels.moe_experts(rows, local_ids, row_weights, local["w_gate"], local["w_up"],
                                               local["w_down"])

            return expert_parallel(x, ids, weights, w, run_local, self.mesh, cfg.num_experts), workspace
        return moe_kernels.moe_experts(x, ids, weights, w["w_gate"], w["w_up"], w["w_down"]), workspace


def _packed_init(name: str):
    if name.endswith("_converted"):
        return nn.initializers.zeros
    return lambda key, shape, dtype: mxfp4.random_packed(key, shape, name.endswith("_scales"))


class MoE(nn.Module):
    """Routed experts plus shared experts (unscaled). x [B, T, D] -> [B, T, D] (and the workspace). `mesh`: the
    device mesh the params live on (None: one device); see `Experts`."""

    config: ModelConfig
    dtype: jnp.dtype
    layer: int = 0
    mesh: Any = None

    def _shared_parts(self, n_tokens: int, tiles) -> int:
        """How many extra experts of the expert kernels the shared MLP runs as in a call of `n_tokens` tokens, or 0
        where it runs apart: bf16 experts' grouped kernels (`SHARED_IN_ROUTED_KERNELS`), or the MXFP4 decode kernels
        (`tiles`, the call's `decode_tiles`; `SHARED_IN_PACKED_MAX_TOKENS`, `moe_mxfp4_gemv.shared_parts`)."""
        cfg = self.config
        params = {} if self.is_initializing() else self.variables["params"]
        if not (cfg.num_shared_experts and self.mesh is None and params):
            return 0
        shared_inter = params["shared_experts"]["gate_proj"]["kernel"].shape[1]
        if cfg.quant_method == "mxfp4":
            return 0 if tiles is None or n_tokens > SHARED_IN_PACKED_MAX_TOKENS else moe_mxfp4_gemv.shared_parts(
                n_tokens, cfg.num_experts_per_token, cfg.hidden_size, cfg.moe_intermediate_size, shared_inter, tiles)
        if (SHARED_IN_ROUTED_KERNELS and n_tokens <= SHARED_IN_ROUTED_MAX_TOKENS
                and moe_kernels.shared_kernel_kind(params["experts"]["w_gate"]) != "reference"):
            return shared_inter // params["experts"]["w_gate"].shape[2]
        return 0

    def decode_tiles(self, n_tokens: int, workspace: Workspace | None = None):
        """The MXFP4 decode kernels' tiles (`moe_mxfp4_gemv.GemvTiles`) where the routed experts of a call of
        `n_tokens` tokens run them (`kernels.moe.packed_decode_tiles`; one device), else None."""
        cfg = self.config
        if cfg.quant_method != "mxfp4" or self.mesh is not None:
            return None
        specs = {name: jax.ShapeDtypeStruct(*spec) for name, spec in packed_param_shapes(cfg).items()}
        return moe_kernels.packed_decode_tiles(n_tokens * cfg.num_experts_per_token,
                                               packed_experts(specs, packed_format(cfg)), workspace, cfg.mxfp4.impl)

    def front_packs(self, n_tokens: int, workspace: Workspace | None = None) -> bool:
        """Whether a decode call of `n_tokens` tokens takes x packed by the front kernel (`FRONT_PACKED_MIN_TOKENS`,
        the MXFP4 decode kernels; `__call__(x_words=)`)."""
        return (n_tokens >= FRONT_PACKED_MIN_TOKENS and self.config.hidden_size % mxfp4.BLOCK == 0
                and self.decode_tiles(n_tokens, workspace) is not None)

    def residual_in_sums(self, n_tokens: int, workspace: Workspace | None = None) -> bool:
        """Whether a decode call of `n_tokens` tokens after the front kernel takes the layer's residual rows for the
        MXFP4 down kernel to add into (`RESIDUAL_IN_SUMS`; `__call__(residual_sums=)`): where those kernels run in
        1-row tiles over whole blocks of the hidden size (`moe_mxfp4_gemv.sums_take_residual`) and the shared MLP,
        if any, folds into them."""
        cfg = self.config
        tiles = self.decode_tiles(n_tokens, workspace) if RESIDUAL_IN_SUMS else None
        return (tiles is not None
                and moe_mxfp4_gemv.sums_take_residual(cfg.hidden_size, cfg.moe_intermediate_size, tiles)
                and (not cfg.num_shared_experts or self._shared_parts(n_tokens, tiles) > 0))

    def front_select(self, n_tokens: int, workspace: Workspace | None = None
                     ) -> tuple[Any, jax.Array | None, int] | None:
        """For a call of `n_tokens` tokens: where it is one token whose router would run
        `kernels.router.select_and_schedule` (the front kernel chooses for one token only), (the choice as
        `kernels.moe_front.Select`, the correction bias [E] float32 or None, the int32 zeros the MXFP4 decode kernels
        take as turn counters: `moe_mxfp4_gemv.turn_count`, 0 where they take none or `COUNTERS_FROM_FRONT` is off)
        for the front kernel to make (`kernels.moe_front.front(select=, zeros=)`), the choice then handed back as
        `chosen` and the zeros as `counters`; else None."""
        cfg = self.config
        if n_tokens != 1:
            return None
        tiles = self.decode_tiles(1, workspace)
        parts = self._shared_parts(1, tiles)
        if self.mesh is not None or not parts or select_route(cfg, 1, parts)[0] != "schedule":
            return None
        select = moe_front.Select(cfg.num_experts_per_token, cfg.router_activation == "sigmoid", cfg.renormalize,
                                  float(cfg.routed_scaling_factor), parts)
        if not moe_front.select_supported(cfg.num_experts, select):
            return None
        zeros = 0 if tiles is None or not COUNTERS_FROM_FRONT else moe_mxfp4_gemv.turn_count(
            cfg.num_experts_per_token + parts, cfg.num_experts + parts, cfg.hidden_size, cfg.moe_intermediate_size,
            tiles, True)
        return select, self.variables["params"]["gate"].get("e_score_correction_bias"), zeros

    def front_shared(self, n_tokens: int, workspace: Workspace | None = None) -> dict | None:
        """For a call of `n_tokens` tokens whose choice the front kernel makes (asked only where `front_select` gave
        one): the front kernel's keywords for the shared MLP's products (`SHARED_GATE_UP_IN_FRONT`,
        `kernels.moe_front.front(shared=, shared_programs=)`): its (gate, up) kernels [H, S] to multiply the normed
        row by and the programs that do it (`moe_front.shared_products`), the sums then handed back as
        `__call__(shared_sums=)`; else None."""
        if not SHARED_GATE_UP_IN_FRONT or self.decode_tiles(n_tokens, workspace) is None:
            return None  # (the MXFP4 decode kernels finish the sums; bf16 experts' kernels take none)
        mlp = self.variables["params"]["shared_experts"]
        gate, up = (mlp[n]["kernel"] for n in ("gate_proj", "up_proj"))
        programs = moe_front.shared_products(*gate.shape)
        return None if programs is None else dict(shared=(gate, up), shared_programs=programs)

    def _sow_choice(self, ids: jax.Array):
        """Records the routed experts [N, k] int32 (the router's choice, shared parts left off) as
        "routed_experts" in the "intermediates" collection, when it is mutable (`model.drift`)."""
        self.sow("intermediates", "routed_experts", ids[:, :self.config.num_experts_per_token])

    @nn.compact
    def __call__(self, x, workspace: Workspace | None = None, logits: jax.Array | None = None, chosen=None,
                 x_words=None, counters=None, residual_sums=None, shared_sums=None):
        """Returns (y, workspace): the MXFP4 expert workspace threads through the layers (see `new_workspace`).
        `logits` [B * T, E] float32: the router's logits of x, computed already (`kernels.moe_front`); `chosen`:
        one token's choice made already (`front_select`); `x_words`: x packed for the MXFP4 decode kernels
        (`front_packs`; `kernels.moe_front.front(pack=True)`); `counters`: int32 zeros for those kernels' turn
        counters (`front_select`); `residual_sums`: float32 [B * T, D], the layer's residual rows for those kernels
        to add into (`residual_in_sums`), y then float32 [B, T, D], the residual and the experts (shared included);
        `shared_sums`: the shared MLP's gate / up sums of x made by the front kernel (`front_shared`), float32
        [F, 2, S] or `moe_mxfp4_gemv.ScaledSums`, for the MXFP4 gate/up kernel to finish
        (`moe_mxfp4_gemv.SharedMLP.gate_up_sums`).
        Where those kernels run, the router's select kernel also makes their schedule (`ROUTER_SCHEDULE`; static but
        for the experts at one token)."""
        cfg = self.config
        flat = x.reshape(-1, x.shape[-1])
        router = Router(cfg, self.dtype, one_kernel=self.mesh is None, name="gate")
        tiles = self.decode_tiles(flat.shape[0], workspace)
        parts = self._shared_parts(flat.shape[0], tiles)
        shared = None
        if parts:
            params = self.variables["params"]
            mlp = params["shared_experts"]
            shared = moe_mxfp4_gemv.SharedMLP(*(mlp[n]["kernel"] for n in ("gate_proj", "up_proj", "down_proj")),
                                              gate_up_sums=shared_sums,
                                              down_in_gate_up=(SHARED_DOWN_IN_GATE_UP and shared_sums is not None
                                                               and residual_sums is not None))
        elif shared_sums is not None:
            raise ValueError("MoE: the shared MLP's gate / up sums need it folded into the MXFP4 decode kernels")
        if parts and cfg.quant_method != "mxfp4":
            if shared_sums is not None:
                raise ValueError("MoE: the shared MLP's gate / up sums are finished by the MXFP4 decode kernels only")
            experts = params["experts"]
            ids, weights, sched = router(flat, shared_parts=parts, logits=logits, chosen=chosen)
            self._sow_choice(ids)
            y = moe_kernels.routed_and_shared(flat, ids, weights, experts["w_gate"], experts["w_up"],
                                              experts["w_down"], tuple(shared[:3]), sched=sched)
            return y.reshape(x.shape), workspace
        if chosen is not None and not parts:
            raise ValueError("MoE: a choice made already needs the shared MLP in the expert kernels")
        if residual_sums is not None and not self.residual_in_sums(flat.shape[0], workspace):
            raise ValueError("MoE: residual rows to add into need RESIDUAL_IN_SUMS and the MXFP4 decode kernels "
                             "taking them (`residual_in_sums`)")
        if tiles is not None:  # (the shared MLP's parts, where it folds into these kernels, the router's to append)
            ids, weights, sched = router(flat, shared_parts=parts, logits=logits, chosen=chosen,
                                         schedule_rows=tiles.rows)
            sched = sched if counters is None else sched._replace(turns=counters)
        else:
            (ids, weights), sched = router(flat, logits=logits), None
        self._sow_choice(ids)
        y, workspace = Experts(cfg, self.dtype, self.layer, self.mesh, name="experts")(
            flat, ids, weights, workspace, tiles=tiles, sched=sched, x_words=x_words, shared=shared,
            residual_sums=residual_sums)
        y = y.reshape(x.shape)
        if cfg.num_shared_experts and not parts:
            # decode-sized calls on one device through the projection or grouped expert kernels (a mesh shards these
            # weights)
            y = y + MLP(cfg.moe_intermediate_size * cfg.num_shared_experts, cfg.hidden_size, self.dtype,
                        grouped_max_tokens=SHARED_GROUPED_MAX_TOKENS if self.mesh is None else 0,
                        projection_max_tokens=SHARED_PROJECTION_MAX_TOKENS if self.mesh is None else 0,
                        name="shared_experts")(x)
        return y, workspace
