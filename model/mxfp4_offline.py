"""Offline (whole-model, at load) conversions of MXFP4 routed experts, for comparison with online conversion.

`convert_offline(model, "float8_e4m3fn" | "bfloat16")` converts every expert once into the workspace format, so the
grouped matmuls read converted weights directly (memory: 8.25 or 16 bits per weight instead of 4.25).
`dequantize_experts(model)` turns them into ordinary dense experts of the model dtype: the same weights run
through the dense-expert path (the "offline-dequantized" column of the drift report).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import traverse_util

from dayzero.kernels import mxfp4

from .config import MXFP4Execution
from .errors import ConfigError
from .model import Model
from .moe import PROJECTIONS


def _check(model: Model) -> None:
    if model.config.quant_method != "mxfp4" or model.config.mxfp4.mode == "offline":
        raise ConfigError("quantization_config.quant_method",
                          f"the model's routed experts are not packed MXFP4 (quant_method "
                          f"{model.config.quant_method!r}, mode {model.config.mxfp4.mode!r})")


def _map_experts(model: Model, convert) -> dict:
    """Applies convert(layer params {name: array}) -> new {name: array} to each MoE layer's `experts` params."""
    flat = traverse_util.flatten_dict(model.params)
    layers = sorted({path[:-1] for path in flat if len(path) >= 2 and path[-2] == "experts"})
    for layer in layers:
        names = [path[-1] for path in flat if path[:-1] == layer]
        new = convert({name: flat.pop(layer + (name,)) for name in names})
        flat.update({layer + (name,): value for name, value in new.items()})
    return traverse_util.unflatten_dict(flat)


def convert_offline(model: Model, dtype="float8_e4m3fn") -> Model:
    """A model whose MXFP4 experts are converted in full to `dtype` (float8_e4m3fn: E2M1 values with the E8M0 scales
    kept; bfloat16: scales folded in), run with mode "offline"."""
    _check(model)
    name = jnp.dtype(dtype).name
    convert_one = jax.jit(lambda blocks, scales: mxfp4.to_workspace(blocks, scales, name))

    def convert(p):
        out = {}
        for proj in PROJECTIONS:
            blocks, scales = p[f"{proj}_blocks"], p[f"{proj}_scales"]
            out[f"{proj}_converted"] = jnp.stack([convert_one(blocks[e], scales[e]) for e in range(blocks.shape[0])])
            if name == "float8_e4m3fn":
                out[f"{proj}_scales"] = scales
        return out

    config = model.config.replace(mxfp4=MXFP4Execution(mode="offline", workspace_dtype=name))
    return Model(config, _map_experts(model, convert), model.dtype)


def dequantize_experts(model: Model) -> Model:
    """A model with ordinary dense experts (w_gate, w_up [E, D, I], w_down [E, I, D] of the model dtype) holding the
    MXFP4 weights dequantized (exactly, for float32 and bfloat16)."""
    _check(model)
    dtype = model.dtype
    d, i = model.config.hidden_size, model.config.moe_intermediate_size
    one = jax.jit(lambda blocks, scales, k: mxfp4.dequantize(blocks, scales, dtype)[..., :k].T, static_argnums=2)

    def convert(p):
        width = {"w_gate": d, "w_up": d, "w_down": i}
        return {proj: jnp.stack([one(p[f"{proj}_blocks"][e], p[f"{proj}_scales"][e], width[proj])
                                 for e in range(p[f"{proj}_blocks"].shape[0])]) for proj in PROJECTIONS}

    return Model(model.config.replace(quant_method=None), _map_experts(model, convert), model.dtype)
