"""`Model`: a loaded (or randomly initialised) checkpoint as a callable, and `load_checkpoint`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from .checkpoint import ParamPath, load_params
from .config import ModelConfig
from .decoder import Decoder
from .errors import ConfigError, RequestError

_CHECKPOINT_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype: Any, config: ModelConfig) -> jnp.dtype:
    """`dtype` (a JAX dtype or its name) or, when None, the checkpoint's declared dtype (bf16 for FP8/unknown)."""
    if dtype is None:
        return jnp.dtype(_CHECKPOINT_DTYPES.get(config.checkpoint_dtype or "", jnp.bfloat16))
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        raise ConfigError("dtype", f"{dtype!r} is not a dtype") from None
    if resolved not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ConfigError("dtype", f"{resolved} is not supported (float32, bfloat16, float16)")
    return resolved


def expected_params(config: ModelConfig, dtype: jnp.dtype) -> dict[ParamPath, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of every param, by path, without allocating anything."""
    module = Decoder(config, dtype)
    shapes = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    return traverse_util.flatten_dict(shapes)


def random_params(config: ModelConfig, dtype: jnp.dtype, seed: int = 0) -> dict[str, Any]:
    """Random params from the shapes alone (no forward trace), drawn on the default device: norms 1, biases 0,
    weights N(0, 0.02) (convs N(0, 0.2)), KDA's A_log = log U(1, 16) and dt_bias = softplus^-1(U_log(1e-3, 1e-1)),
    as transformers initialises them."""
    key = jax.random.key(seed)
    out = {}
    for i, (path, leaf) in enumerate(expected_params(config, dtype).items()):
        k = jax.random.fold_in(key, i)
        name = path[-1]
        if name == "A_log":
            value = jnp.log(jax.random.uniform(k, leaf.shape, jnp.float32, 1.0, 16.0))
        elif name == "dt_bias":
            dt = jnp.maximum(jnp.exp(jax.random.uniform(k, leaf.shape, jnp.float32, np.log(1e-3), np.log(1e-1))),
                             1e-4)
            value = dt + jnp.log(-jnp.expm1(-dt))
        elif name in ("bias", "e_score_correction_bias"):
            value = jnp.zeros(leaf.shape, jnp.float32)
        elif name == "weight" and len(leaf.shape) == 1:
            value = jnp.ones(leaf.shape, jnp.float32)
        else:
            std = 0.2 if len(path) > 1 and path[-2].endswith("conv1d") else 0.02
            value = jax.random.normal(k, leaf.shape, leaf.dtype) * jnp.asarray(std, leaf.dtype)
        out[path] = value.astype(leaf.dtype)
    return traverse_util.unflatten_dict(out)


@dataclass
class Model:
    """A model of the family with its params. `model(token_ids)` -> logits [B, T, V] float32 (full-sequence path)."""

    config: ModelConfig
    params: dict[str, Any]
    dtype: jnp.dtype = jnp.bfloat16
    module: Decoder = field(init=False)

    def __post_init__(self):
        self.dtype = jnp.dtype(self.dtype)
        self.module = Decoder(self.config, self.dtype)
        self._logits = jax.jit(lambda p, ids: self.module.apply({"params": p}, ids))
        self._hidden = jax.jit(lambda p, ids: self.module.apply({"params": p}, ids, return_hidden_states=True))

    def _check_tokens(self, token_ids) -> jax.Array:
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise RequestError(None, f"token_ids must be an integer array [batch, length], got {ids.dtype}{list(ids.shape)}")
        if ids.size == 0:
            raise RequestError(None, "token_ids is empty")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            raise RequestError(None, f"token id {int(ids[bad][0])} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        return jnp.asarray(ids, jnp.int32)

    def __call__(self, token_ids, pixel_values=None, image_grid_thw=None) -> jax.Array:
        """token_ids [B, T] int -> logits [B, T, V] float32."""
        if pixel_values is not None or image_grid_thw is not None:
            raise ConfigError("vision_config", f"this {self.config.model_type} model has no vision tower: "
                              "pixel_values/image_grid_thw cannot be used")
        return self._logits(self.params, self._check_tokens(token_ids))

    def hidden_states(self, token_ids) -> list[jax.Array]:
        """[embeddings, after layer 0, ..., after the last layer (final norm applied)], each [B, T, D]."""
        _, hidden = self._hidden(self.params, self._check_tokens(token_ids))
        return hidden

    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(self.params))

    @classmethod
    def random(cls, config: ModelConfig, dtype: Any = jnp.float32, seed: int = 0) -> "Model":
        """A model with random weights (for presets, tests and benchmarks)."""
        dtype = resolve_dtype(dtype, config)
        return cls(config, random_params(config, dtype, seed), dtype)


def load_checkpoint(path: str | os.PathLike, dtype: Any = None, mesh: jax.sharding.Mesh | None = None,
                    progress: bool | None = None) -> Model:
    """Loads a hub checkpoint directory (config.json + safetensors) as a `Model`.

    `dtype` picks the param and compute dtype (default: the checkpoint's; bf16 for FP8 checkpoints). With `mesh`,
    every param is placed on the mesh as it is read (replicated; expert/tensor-parallel rules come with sharding).
    """
    path = os.fspath(path)
    config = ModelConfig.from_pretrained(path)
    dtype = resolve_dtype(dtype, config)
    expected = expected_params(config, dtype)
    sharding_for = None
    if mesh is not None:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        sharding_for = lambda _path: replicated  # noqa: E731
    flat = load_params(path, config, expected, sharding_for=sharding_for, progress=progress)
    return Model(config, traverse_util.unflatten_dict(flat), dtype)
