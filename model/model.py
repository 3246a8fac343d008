"""`Model`: a loaded (or randomly initialised) checkpoint as a callable, and `load_checkpoint`.

A kimi_k25 model also holds the MoonViT tower and projector (params `vision_tower`, `mm_projector` beside the text
decoder's): `model(token_ids, pixel_values, image_grid_thw)` puts each image's features at its placeholder tokens.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dayzero import platforms
from dayzero.kernels import dispatch, mxfp4

from . import linear, sharding
from .checkpoint import ParamPath, load_params
from .convert import is_converted, restore_converted
from .config import ModelConfig
from .decoder import Decoder
from .errors import ConfigError, ImageError, RequestError
from .image_processing import ImageProcessorConfig, tokens_per_image
from .vision import KimiVision, check_grid, image_layout, num_merged_tokens, patch_bucket, vision_param_shapes

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
    """Shapes and dtypes of every param, by path, without allocating anything (a fresh dict per call). Tracing a
    large config's init takes seconds (the medium hybrid ~2.5 s on 2 CPU cores), so the last few configs' shapes
    are kept (`_traced_params`)."""
    dtype = jnp.dtype(dtype)
    try:
        hash(config)
    except TypeError:  # a field holding a list: trace it every time
        return dict(_traced_params.__wrapped__(config, dtype, linear.WEIGHT_ROWS))
    return dict(_traced_params(config, dtype, linear.WEIGHT_ROWS))


@functools.lru_cache(maxsize=8)
def _traced_params(config: ModelConfig, dtype: jnp.dtype,
                   weight_rows: bool) -> tuple[tuple[ParamPath, jax.ShapeDtypeStruct], ...]:
    """`expected_params` as a tuple; `weight_rows` (`linear.WEIGHT_ROWS`, which the modules read as they are set
    up) is part of the cache key: it changes the attention projections' params."""
    module = Decoder(config, dtype)
    shapes = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    if config.vision is not None:
        shapes = {**shapes, **vision_param_shapes(config.vision, config.hidden_size, dtype)}
    return tuple(traverse_util.flatten_dict(shapes).items())


def random_params(config: ModelConfig, dtype: jnp.dtype, seed: int = 0) -> dict[str, Any]:
    """Random params from the shapes alone (no forward trace), drawn on the default device: norms 1, biases 0,
    weights N(0, 0.02) (convs N(0, 0.2); MXFP4 experts of about that spread), KDA's A_log = log U(1, 16) and dt_bias = softplus^-1(U_log(1e-3, 1e-1)),
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
        elif name.endswith(("_blocks", "_scales")):  # MXFP4 experts: uniform codes, scales for std ~0.02
            value = mxfp4.random_packed(k, leaf.shape, name.endswith("_scales"))
        elif name.endswith("_converted"):  # offline-converted MXFP4 experts
            blocks = mxfp4.random_packed(k, leaf.shape[:-2] + (mxfp4.BLOCK // 2,), False)
            value = mxfp4.to_workspace(blocks, mxfp4.random_packed(k, leaf.shape[:-2], True), leaf.dtype)
        else:
            std = 0.2 if len(path) > 1 and path[-2].endswith("conv1d") else 0.02
            value = jax.random.normal(k, leaf.shape, leaf.dtype) * jnp.asarray(std, leaf.dtype)
        out[path] = value.astype(leaf.dtype)
    return traverse_util.unflatten_dict(out)


def _forward(module: Decoder, params, ids, features, hidden: bool):
    """The full-sequence path; image features [M, D] (or None) replace the placeholder tokens of ids, in order."""
    kwargs = {}
    if features is not None:
        mask = ids == module.config.image_token_id
        index = jnp.maximum(jnp.cumsum(mask.reshape(-1)) - 1, 0).reshape(mask.shape)
        kwargs = {"inputs_embeds": features[index], "embeds_mask": mask}
    return module.apply({"params": params}, ids, return_hidden_states=hidden, **kwargs)


def _encode(module: KimiVision, params, patches, layout):
    return module.apply({"params": {k: params[k] for k in ("vision_tower", "mm_projector")}}, patches, layout)


# Module-level jits: models over equal modules (same config and dtype) share compiled code.
_FORWARD = dispatch.PlatformJit(_forward, static_argnums=(0, 4))
_ENCODE = dispatch.PlatformJit(_encode, static_argnums=(0,))


@dataclass
class Model:
    """A model of the family with its params. `model(token_ids)` -> logits [B, T, V] float32 (full-sequence path);
    a kimi_k25 model also takes `pixel_values`, `image_grid_thw` (the reference processor's layout; see
    `image_processing.preprocess_images` and `image_processor`, the checkpoint's preprocessing settings)."""

    config: ModelConfig
    params: dict[str, Any]
    dtype: jnp.dtype = jnp.bfloat16
    image_processor: ImageProcessorConfig | None = None
    mesh: jax.sharding.Mesh | None = None  # where the params live (`sharding.make_mesh`); None: one device
    placement: platforms.Placement | None = None  # the device calls run on (default: that of one-device params)
    module: Decoder = field(init=False)

    def __post_init__(self):
        self.dtype = jnp.dtype(self.dtype)
        self.module = Decoder(self.config, self.dtype, self.mesh)
        if self.placement is None:
            self.placement = platforms.placement_of(self.params)
        self._logits = lambda p, ids, feats: self._run(_FORWARD, self.module, p, ids, feats, False)
        self._hidden = lambda p, ids, feats: self._run(_FORWARD, self.module, p, ids, feats, True)
        if self.config.vision is not None:
            self.vision = KimiVision(self.config.vision, self.config.hidden_size, self.dtype)
            if self.image_processor is None:
                self.image_processor = ImageProcessorConfig.for_vision(self.config.vision)
            self._vision = lambda p, patches, layout: self._run(_ENCODE, self.vision, p, patches, layout)

    @property
    def platform(self) -> str:
        """The platform this model's calls run on, as JAX names it ('cpu', 'gpu', a plugin's name): its placement's,
        its mesh's, else JAX's default backend."""
        if self.placement is not None:
            return self.placement.platform
        if self.mesh is not None:
            return self.mesh.devices.flat[0].platform
        return jax.default_backend()

    def _run(self, fn, *args):
        """`fn(*args)` with this model's placement active: its device in use, so kernel dispatch (decided while
        tracing) picks that platform's implementations."""
        with platforms.activate(self.placement):
            return fn(*args)

    def _check_tokens(self, token_ids) -> jax.Array:
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise RequestError(None, f"token_ids must be an integer array [batch, length], got {ids.dtype}{list(ids.shape)}")
        if ids.size == 0:
            raise RequestError(None, "token_ids is empty")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            raise RequestError(None, f"token id {int(ids[bad][0])} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if self.mesh is not None:  # rows split over the mesh's `data` axis when it divides the batch
            return sharding.place(ids.astype(np.int32), sharding.batch_sharding(self.mesh, ids.shape))
        return jnp.asarray(ids, jnp.int32)

    def __call__(self, token_ids, pixel_values=None, image_grid_thw=None) -> jax.Array:
        """token_ids [B, T] int (kimi_k25: image_token_id once per image feature, images in order, row-major),
        pixel_values [N, 3, p, p], image_grid_thw [n, 3] -> logits [B, T, V] float32."""
        ids = self._check_tokens(token_ids)
        return self._logits(self.params, ids, self._image_features(ids, pixel_values, image_grid_thw))

    def hidden_states(self, token_ids, pixel_values=None, image_grid_thw=None) -> list[jax.Array]:
        """[embeddings, after layer 0, ..., after the last layer (final norm applied)], each [B, T, D]."""
        ids = self._check_tokens(token_ids)
        _, hidden = self._hidden(self.params, ids, self._image_features(ids, pixel_values, image_grid_thw))
        return hidden

    def _image_features(self, ids: jax.Array, pixel_values, image_grid_thw) -> jax.Array | None:
        vision = self.config.vision
        if pixel_values is None and image_grid_thw is None:
            if vision is not None and bool(jnp.any(ids == self.config.image_token_id)):
                raise ImageError(None, f"token_ids hold image placeholder tokens (id {self.config.image_token_id}) "
                                 "but no pixel_values were given")
            return None
        if vision is None:
            raise ConfigError("vision_config", f"this {self.config.model_type} model has no vision tower: "
                              "pixel_values/image_grid_thw cannot be used")
        if pixel_values is None or image_grid_thw is None:
            raise ImageError(None, "give both pixel_values and image_grid_thw")
        features = self.encode_images(pixel_values, image_grid_thw)
        found = int(jnp.sum(ids == self.config.image_token_id))
        if found != features.shape[0]:
            raise ImageError(None, f"token_ids hold {found} image placeholder tokens (id {self.config.image_token_id})"
                             f" but the images give {features.shape[0]} features "
                             f"({tokens_per_image(image_grid_thw, vision.merge_kernel_size[0])} per image)")
        return features

    def _run_vision(self, pixel_values, image_grid_thw, request_id=None) -> tuple[jax.Array, jax.Array, int, int]:
        vision = self.config.vision
        if vision is None:
            raise ConfigError("vision_config", f"this {self.config.model_type} model has no vision tower")
        pixels = np.asarray(pixel_values)
        p = vision.patch_size
        if pixels.ndim != 4 or pixels.shape[1:] != (vision.num_channels, p, p):
            raise ImageError(request_id, f"pixel_values must be [num_patches, {vision.num_channels}, {p}, {p}], got "
                             f"{list(pixels.shape)}")
        grid = check_grid(image_grid_thw, vision, pixels.shape[0], request_id)
        padded = patch_bucket(pixels.shape[0])
        patches = np.zeros((padded, vision.patch_dim), np.float32)
        patches[:pixels.shape[0]] = pixels.reshape(pixels.shape[0], -1)
        features, hidden = self._vision(self.params, patches, image_layout(grid, vision, padded))
        return features, hidden, num_merged_tokens(grid, vision), pixels.shape[0]

    def encode_images(self, pixel_values, image_grid_thw, request_id=None) -> jax.Array:
        """pixel_values [N, 3, p, p], image_grid_thw [n, 3] -> image features [M, hidden_size] in the model dtype
        (M = N / merge kernel size; image after image), projected for the text model."""
        features, _, merged, _ = self._run_vision(pixel_values, image_grid_thw, request_id)
        return features[:merged]

    def vision_hidden_states(self, pixel_values, image_grid_thw) -> jax.Array:
        """The vision tower's output [N, vision hidden] (after its final LayerNorm, before merging)."""
        _, hidden, _, patches = self._run_vision(pixel_values, image_grid_thw)
        return hidden[:patches]

    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(self.params))

    @classmethod
    def random(cls, config: ModelConfig, dtype: Any = jnp.float32, seed: int = 0,
               mesh: jax.sharding.Mesh | None = None, platform: platforms.PlatformConfig | str | None = None
               ) -> "Model":
        """A model with random weights (for presets, tests and benchmarks); with `mesh`, placed by the sharding
        rules (`dayzero.model.sharding`); with `platform`, drawn on that platform's first device (as in
        `load_checkpoint`)."""
        if platform is not None:
            return platforms.build_on(platform, mesh, lambda: cls.random(config, dtype, seed, mesh))
        dtype = resolve_dtype(dtype, config)
        params = random_params(config, dtype, seed)
        if mesh is not None:
            params = sharding.shard_params(params, config, mesh)
        return cls(config, params, dtype, mesh=mesh)


def load_checkpoint(path: str | os.PathLike, dtype: Any = None, mesh: jax.sharding.Mesh | None = None,
                    progress: bool | None = None, platform: platforms.PlatformConfig | str | None = None) -> Model:
    """Loads a hub checkpoint directory (config.json + safetensors), or one converted by `dayzero-convert`, as a
    `Model`.

    `dtype` picks the param and compute dtype (default: the checkpoint's; bf16 for FP8 checkpoints). With `mesh`
    (`sharding.make_mesh`), every param is placed straight onto its shards as it is read, by the rules of
    `dayzero.model.sharding` (tensor-parallel heads / MLP dims, expert-parallel routed experts, the rest
    replicated), and the model runs on that mesh. `platform` (a `dayzero.platforms.PlatformConfig` or a platform
    name) initialises that platform first (registering its PJRT plugin, if the config names one), places the params
    on its first device and runs the model's calls with that device in use, so kernel dispatch picks its kernels.
    """
    if platform is not None:
        return platforms.build_on(platform, mesh, lambda: load_checkpoint(path, dtype, mesh, progress))
    path = os.fspath(path)
    config = ModelConfig.from_pretrained(path)
    dtype = resolve_dtype(dtype, config)
    expected = expected_params(config, dtype)
    sharding_for = None
    if mesh is not None:
        sharding_for = sharding.param_shardings(config, mesh, expected)
    if is_converted(path):  # written by dayzero-convert: orbax restores each param straight onto its sharding
        flat = restore_converted(path, config, dtype, sharding_for, progress=progress)
    else:
        flat = load_params(path, config, expected, sharding_for=sharding_for, progress=progress)
    processor = ImageProcessorConfig.from_pretrained(path, config.vision) if config.vision is not None else None
    return Model(config, traverse_util.unflatten_dict(flat), dtype, processor, mesh=mesh)
