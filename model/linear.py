"""The model's linear layers: `dense` (Flax's Dense, kernel [in, out]) and `projection_dense`, which builds the
attention projections that the decode projection kernel reads (`kernels.projection`) in one of two weight layouts.

- `WEIGHT_ROWS` False: Flax's `nn.Dense`, param "kernel" [in, out] (the checkpoint's [out, in] weight transposed as
  it loads). A one-row projection kernel then reads each program's K slice as runs of `block_n` columns (128 bytes)
  strided by the weight's width, and splits K so that enough programs stream it (float32 partial sums that the
  next kernel adds up).
- `WEIGHT_ROWS` True (the default): `RowDense`, param "weight" [out, in] as published (torch's Linear layout), so
  each output's K is contiguous: the one-row kernel reads whole rows, never splits K and finishes its outputs itself
  (`project(weight_rows=True)`).

Which modules take the layout: `ROW_MODULES` (KDA's q/k/v, f_a/g_a/b and o_proj; MLA's q_proj or q_a_proj,
kv_a_proj_with_mqa and o_proj). The checkpoint loader maps their published weights to "weight" without the swap
(`model.checkpoint.map_tensor_name`), the sharding rules split them on their heads' dim, and converted checkpoints
record the layout. Flax sets a module up at every apply (and trace), so the switch must stay as it was when the params
were made or loaded: params of the other layout fail by name (a "kernel" or "weight" param not found).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
from flax.linen.dtypes import promote_dtype

from dayzero.kernels import projection

# Whether `ROW_MODULES` store their weights [out, in] (`RowDense`). On: the one-row kernel over whole weight rows
# streams faster than over [K, N] blocks (benchmarks/gemv_layout.py) and hands the KDA step and the MoE front
# finished rows instead of 16 partial slices; in the model (decode_profile.py --experts mxfp4, H100, fifty-ninth
# session, A/B on one machine) the batch-1 step's GPU kernels took 0.795 against 0.813 ms per token and batch 16
# 2.137 against 2.143. benchmarks/NOTES_serving.md has the runs.
WEIGHT_ROWS = True
# The attention projections `projection_dense` builds, by their published names.
ROW_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj", "o_proj", "q_a_proj",
                         "kv_a_proj_with_mqa"})


def dense(features: int, dtype, use_bias: bool = False, name: str | None = None) -> nn.Dense:
    """A linear layer with kernel [in, out] stored in `dtype` (the checkpoint's [out, in] weight transposed)."""
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name,
                    kernel_init=nn.initializers.normal(0.02))


class RowDense(nn.Module):
    """`nn.Dense` with its weight stored [out, in] (param "weight"; "bias" [out] with `use_bias`): x [..., in] ->
    [..., out] in `dtype`, the product contracting x's last axis with the weight's second."""

    features: int
    dtype: Any
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.normal(0.02), (self.features, x.shape[-1]), self.dtype)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), self.dtype) if self.use_bias else None
        x, weight, bias = promote_dtype(x, weight, bias, dtype=self.dtype)
        y = jax.lax.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())))
        return y if bias is None else y + bias


def projection_dense(features: int, dtype, use_bias: bool = False) -> nn.Module:
    """One of `ROW_MODULES`: `RowDense` with `WEIGHT_ROWS`, else `dense`."""
    return RowDense(features, dtype, use_bias) if WEIGHT_ROWS else dense(features, dtype, use_bias)


def decode_weight(module: nn.Module) -> tuple[jax.Array, bool]:
    """A bound projection's weight as the projection kernel takes it, and whether it is stored [out, in]
    (`project(weight_rows=)`): a `RowDense`'s "weight", or a Dense's "kernel" [in, out]."""
    rows = isinstance(module, RowDense)
    return module.variables["params"]["weight" if rows else "kernel"], rows


def unfinished_output(project, o: jax.Array, weight: jax.Array, residual: jax.Array,
                      weight_rows: bool) -> tuple[Any, jax.Array]:
    """o_proj's output for a consumer that adds up the update and the residual itself (`kernels.moe_front`):
    (`project(finish=False)`'s output, residual); or, with the weight stored [out, in] where the kernel does not
    split K (one row: whole weight rows per program), (None, residual + o_proj(o)) with the residual added in the
    kernel. Where K is split (the MMA path of several rows) the partial sums go to the consumer in either layout,
    so that no XLA kernel adds them up in between. `project`: the projection callable (`kernels.projection.by_kind`'s)
    with `weight_rows` bound; o [B, K] (or `HeadScaled`), residual [B, D]."""
    if weight_rows and not projection.splits_k(o, ((weight,),), weight_rows=True):
        return None, project(o, ((weight,),), residual=residual)[0]
    return project(o, ((weight,),), finish=False)[0], residual
