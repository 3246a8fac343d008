"""Kimi-K2.5's MoonViT vision tower and patch-merger projector (Flax Linen, plain jnp), and their tensor names.

`KimiVision(patches, layout)` runs several images packed into one sequence of patches:

    patches [N, 3*p*p] --patch_embed (Conv2d p x p as a matmul)--> [N, D]
      + learned [Hp, Wp, D] position table resampled bicubically to each image's grid (torch's F.interpolate
        bicubic, a = -0.75, align_corners=False, as a 16-tap gather whose weights the host computes)
      -> blocks: x + wo(attn(norm0(x))), x + fc1(gelu_tanh(fc0(norm1(x)))); attention is per image (block-diagonal),
         q/k rotated by a 2-D rotary embedding in the checkpoint's interleaved (complex-pair) layout: pair 2j turns
         with the patch column, pair 2j+1 with its row, both at theta^(-4j/head_dim)
      -> final_layernorm -> hidden [N, D]
      -> kh x kw neighbouring patches gathered [M, kh*kw, D], LayerNorm each, concatenated, Linear, GELU, Linear
      -> image features [M, text hidden] (one per placeholder token, image after image, raster order).

The host-side `image_layout` turns `image_grid_thw` into the index arrays above; `N` is padded to a bucket so a
compiled tower serves many image sizes (padding patches form their own attention segment and are never merged).
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .config import VisionConfig
from .errors import ImageError
from .norms import LayerNorm

PatchLayout = dict  # str -> np.ndarray (see image_layout)
_QUERY_CHUNK = 1024  # queries per attention block: peak memory ~ chunk * N * heads floats


def _dense(features: int, dtype, name: str | None = None) -> nn.Dense:
    """Linear with bias; kernel [in, out] (the checkpoint's [out, in] transposed)."""
    return nn.Dense(features, use_bias=True, dtype=dtype, param_dtype=dtype, name=name,
                    kernel_init=nn.initializers.normal(0.02))


def _gelu(x: jax.Array, kind: str) -> jax.Array:
    return jax.nn.gelu(x, approximate=kind == "gelu_pytorch_tanh")


# ---------------------------------------------------------------------------------------------------- host layout
def _bicubic_taps(out_size: int, in_size: int) -> tuple[np.ndarray, np.ndarray]:
    """F.interpolate(mode="bicubic", align_corners=False) along one axis: source taps [out, 4] (clamped to the
    border) and weights [out, 4] (Keys kernel, a = -0.75), float64."""
    a = -0.75
    src = (np.arange(out_size) + 0.5) * (in_size / out_size) - 0.5
    floor = np.floor(src)
    offsets = np.arange(-1, 3)
    taps = np.clip(floor[:, None].astype(np.int64) + offsets, 0, in_size - 1)
    d = np.abs(src[:, None] - floor[:, None] - offsets)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return taps, np.where(d <= 1, near, far)


def check_grid(image_grid_thw, config: VisionConfig, num_patches: int | None = None,
               request_id: str | None = None) -> np.ndarray:
    """image_grid_thw as an int64 [n, 3] array; raises ImageError naming the image when a row is not
    [1, h, w] with h, w multiples of the merge kernel, or (given `num_patches`) when the rows do not add up."""
    grid = np.asarray(image_grid_thw)
    if grid.ndim != 2 or grid.shape[1] != 3 or not np.issubdtype(grid.dtype, np.integer):
        raise ImageError(request_id, f"image_grid_thw must be an integer array [num_images, 3], got "
                         f"{grid.dtype}{list(grid.shape)}")
    kh, kw = config.merge_kernel_size
    for i, (t, h, w) in enumerate(grid.tolist()):
        if t != 1:
            raise ImageError(request_id, f"image {i}: grid {[t, h, w]} has t={t}; only still images (t=1) are "
                             "supported")
        if h <= 0 or w <= 0 or h % kh or w % kw:
            raise ImageError(request_id, f"image {i}: grid {[t, h, w]} is not a positive multiple of the merge "
                             f"kernel {[kh, kw]}")
    total = int(np.prod(grid, axis=1).sum()) if len(grid) else 0
    if num_patches is not None and total != num_patches:
        raise ImageError(request_id, f"pixel_values has {num_patches} patches but image_grid_thw describes {total}")
    return grid.astype(np.int64)


def patch_bucket(num_patches: int, minimum: int = 64) -> int:
    """Padded patch count: the next power of two from `minimum` (one compiled tower per bucket)."""
    size = minimum
    while size < num_patches:
        size *= 2
    return size


def image_layout(grid: np.ndarray, config: VisionConfig, padded: int) -> PatchLayout:
    """Index arrays for `padded` >= sum(h*w) patches of the images in `grid` [n, 3]:
    rows, cols, segment [padded] int32 (segment -1: padding), pos_index, pos_weight [padded, 16] (int32, float32),
    merge_index [padded // (kh*kw), kh*kw] int32 (rows past the real count point at patch 0)."""
    kh, kw = config.merge_kernel_size
    rows = np.zeros(padded, np.int32)
    cols = np.zeros(padded, np.int32)
    segment = np.full(padded, -1, np.int32)
    pos_index = np.zeros((padded, 16), np.int32)
    pos_weight = np.zeros((padded, 16), np.float32)
    merged = []
    start = 0
    for i, (_, h, w) in enumerate(grid.tolist()):
        r, c = np.divmod(np.arange(h * w), w)
        stop = start + h * w
        rows[start:stop], cols[start:stop], segment[start:stop] = r, c, i
        row_taps, row_w = _bicubic_taps(h, config.pos_emb_height)
        col_taps, col_w = _bicubic_taps(w, config.pos_emb_width)
        index = row_taps[r][:, :, None] * config.pos_emb_width + col_taps[c][:, None, :]
        pos_index[start:stop] = index.reshape(h * w, 16)
        pos_weight[start:stop] = (row_w[r][:, :, None] * col_w[c][:, None, :]).reshape(h * w, 16)
        base = start + np.arange(h * w).reshape(h // kh, kh, w // kw, kw).transpose(0, 2, 1, 3)
        merged.append(base.reshape(-1, kh * kw))
        start = stop
    merge_index = np.zeros((max(padded // (kh * kw), 1), kh * kw), np.int32)
    if merged:
        real = np.concatenate(merged)
        merge_index[:len(real)] = real
    return {"rows": rows, "cols": cols, "segment": segment, "pos_index": pos_index, "pos_weight": pos_weight,
            "merge_index": merge_index}


# ---------------------------------------------------------------------------------------------------- modules
def rope_2d(x: jax.Array, rows: jax.Array, cols: jax.Array, theta: float) -> jax.Array:
    """x [N, H, Dh] rotated in interleaved pairs: pair 2j by cols * f_j, pair 2j+1 by rows * f_j, f_j =
    theta^(-4j/Dh); computed in float32, returned in x.dtype."""
    dh = x.shape[-1]
    freqs = 1.0 / (theta ** (jnp.arange(0, dh // 2, 2, dtype=jnp.float32) / (dh // 2)))  # [Dh/4]
    angles = jnp.stack([cols[:, None] * freqs, rows[:, None] * freqs], axis=-1).reshape(-1, dh // 2)  # [N, Dh/2]
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], dh // 2, 2)
    re_, im = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([re_ * cos - im * sin, re_ * sin + im * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array) -> jax.Array:
    """Bidirectional attention within each image: q, k, v [N, H, Dh], segment [N] -> [N, H, Dh]. Softmax in
    float32; queries in blocks of _QUERY_CHUNK to bound memory."""
    n, heads, dh = q.shape
    scale = dh ** -0.5

    def block(args):
        qb, seg_b = args
        logits = jnp.einsum("thd,shd->hts", qb, k, preferred_element_type=jnp.float32) * scale
        logits = jnp.where((seg_b[:, None] == segment[None, :])[None], logits, -jnp.inf)
        p = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return jnp.einsum("hts,shd->thd", p, v, preferred_element_type=jnp.float32).astype(q.dtype)

    if n <= _QUERY_CHUNK or n % _QUERY_CHUNK:
        return block((q, segment))
    out = jax.lax.map(block, (q.reshape(n // _QUERY_CHUNK, _QUERY_CHUNK, heads, dh),
                              segment.reshape(n // _QUERY_CHUNK, _QUERY_CHUNK)))
    return out.reshape(n, heads, dh)


class MLP2(nn.Module):
    """fc1(gelu(fc0(x))): [N, D] -> [N, D]."""

    config: VisionConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        h = _dense(cfg.intermediate_size, self.dtype, name="fc0")(x)
        return _dense(cfg.hidden_size, self.dtype, name="fc1")(_gelu(h, cfg.hidden_act))


class EncoderBlock(nn.Module):
    """Pre-norm ViT block with fused wqkv [D, 3D] (q, k, v each [heads, head_dim]), 2-D rope, per-image attention."""

    config: VisionConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, layout):
        cfg = self.config
        n = x.shape[0]
        h = LayerNorm(cfg.layer_norm_eps, self.dtype, name="norm0")(x)
        qkv = _dense(3 * cfg.hidden_size, self.dtype, name="wqkv")(h).reshape(n, 3, cfg.num_heads, cfg.head_dim)
        q = rope_2d(qkv[:, 0], layout["rows"], layout["cols"], cfg.rope_theta)
        k = rope_2d(qkv[:, 1], layout["rows"], layout["cols"], cfg.rope_theta)
        attn = segment_attention(q, k, qkv[:, 2], layout["segment"]).reshape(n, cfg.hidden_size)
        x = x + _dense(cfg.hidden_size, self.dtype, name="wo")(attn)
        return x + MLP2(cfg, self.dtype, name="mlp")(LayerNorm(cfg.layer_norm_eps, self.dtype, name="norm1")(x))


class PatchEmbed(nn.Module):
    """patches [N, C*p*p] -> [N, D]: the p x p stride-p convolution as a matmul, plus the resampled position table."""

    config: VisionConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, patches, layout):
        cfg = self.config
        x = _dense(cfg.hidden_size, self.dtype, name="proj")(patches.astype(self.dtype))
        table = self.param("pos_emb", nn.initializers.normal(0.02),
                           (cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size), self.dtype)
        flat = table.reshape(-1, cfg.hidden_size).astype(jnp.float32)
        pos = jnp.einsum("nk,nkd->nd", layout["pos_weight"], flat[layout["pos_index"]])
        return x + pos.astype(x.dtype)


class MoonViT(nn.Module):
    """patches [N, C*p*p] -> hidden [N, D] after the final LayerNorm."""

    config: VisionConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, patches, layout):
        cfg = self.config
        x = PatchEmbed(cfg, self.dtype, name="patch_embed")(patches, layout)
        for i in range(cfg.num_layers):
            x = EncoderBlock(cfg, self.dtype, name=f"blocks_{i}")(x, layout)
        return LayerNorm(cfg.layer_norm_eps, self.dtype, name="final_layernorm")(x)


class Projector(nn.Module):
    """merged [M, kh*kw, D] -> [M, text_hidden]: LayerNorm per patch, concatenate, Linear, GELU, Linear."""

    config: VisionConfig
    text_hidden: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, merged):
        cfg = self.config
        width = cfg.merge_size * cfg.hidden_size
        x = LayerNorm(cfg.projector_layer_norm_eps, self.dtype, name="pre_norm")(merged).reshape(-1, width)
        x = _gelu(_dense(width, self.dtype, name="proj_0")(x), cfg.projector_hidden_act)
        return _dense(self.text_hidden, self.dtype, name="proj_2")(x)


class KimiVision(nn.Module):
    """patches [N, C*p*p] + layout -> (image features [N / (kh*kw), text_hidden], tower hidden [N, D]).
    Params: `vision_tower` (MoonViT) and `mm_projector`."""

    config: VisionConfig
    text_hidden: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, patches, layout):
        hidden = MoonViT(self.config, self.dtype, name="vision_tower")(patches, layout)
        merged = hidden[layout["merge_index"]]  # [M, kh*kw, D]; one frame, so the temporal mean is the identity
        features = Projector(self.config, self.text_hidden, self.dtype, name="mm_projector")(merged)
        return features, hidden


def vision_param_shapes(config: VisionConfig, text_hidden: int, dtype) -> dict:
    """{"vision_tower": ..., "mm_projector": ...} param shapes (jax.ShapeDtypeStruct), nothing allocated."""
    kh, kw = config.merge_kernel_size
    grid = np.asarray([[1, kh, kw]], np.int64)
    layout = image_layout(grid, config, kh * kw)
    patches = jnp.zeros((kh * kw, config.patch_dim), dtype)
    module = KimiVision(config, text_hidden, dtype)
    return jax.eval_shape(module.init, jax.random.key(0), patches, layout)["params"]


# ---------------------------------------------------------------------------------------------------- tensor names
_BLOCK = re.compile(r"vision_tower\.encoder\.blocks\.(\d+)\.(norm0|norm1|wqkv|wo|mlp\.fc0|mlp\.fc1)\.(weight|bias)")
_LINEARS = frozenset({"wqkv", "wo", "mlp.fc0", "mlp.fc1", "proj.0", "proj.2"})


def vision_tensor_target(name: str) -> tuple[tuple[str, ...], str] | None:
    """(param path, kind) of a published vision tensor name (kind as in checkpoint.Target: copy | linear | patch),
    or None when the name is not one. `patch`: the Conv2d weight [D, C, p, p] flattened and transposed."""
    m = _BLOCK.fullmatch(name)
    if m is not None:
        module, leaf = m[2], m[3]
        linear = module in _LINEARS
        path = ("vision_tower", f"blocks_{m[1]}", *module.split("."), "kernel" if linear and leaf == "weight" else leaf)
        return path, "linear" if linear and leaf == "weight" else "copy"
    fixed = {
        "vision_tower.patch_embed.proj.weight": (("vision_tower", "patch_embed", "proj", "kernel"), "patch"),
        "vision_tower.patch_embed.proj.bias": (("vision_tower", "patch_embed", "proj", "bias"), "copy"),
        "vision_tower.patch_embed.pos_emb.weight": (("vision_tower", "patch_embed", "pos_emb"), "copy"),
        "vision_tower.encoder.final_layernorm.weight": (("vision_tower", "final_layernorm", "weight"), "copy"),
        "vision_tower.encoder.final_layernorm.bias": (("vision_tower", "final_layernorm", "bias"), "copy"),
        "mm_projector.pre_norm.weight": (("mm_projector", "pre_norm", "weight"), "copy"),
        "mm_projector.pre_norm.bias": (("mm_projector", "pre_norm", "bias"), "copy"),
    }
    if name in fixed:
        return fixed[name]
    m = re.fullmatch(r"mm_projector\.proj\.([02])\.(weight|bias)", name)
    if m is not None:
        return ("mm_projector", f"proj_{m[1]}", "kernel" if m[2] == "weight" else "bias"), \
            "linear" if m[2] == "weight" else "copy"
    return None


def vision_published_name(path: tuple[str, ...]) -> str:
    """The published tensor name of a vision param path (inverse of vision_tensor_target)."""
    parts = []
    for part in path:
        if part.startswith("blocks_"):
            parts += ["encoder", "blocks", part[len("blocks_"):]]
        elif part == "final_layernorm":
            parts += ["encoder", "final_layernorm"]
        elif part.startswith("proj_"):
            parts += ["proj", part[len("proj_"):]]
        elif part == "kernel":
            parts.append("weight")
        elif part == "pos_emb":
            parts += ["pos_emb", "weight"]
        else:
            parts.append(part)
    return ".".join(parts)


def num_merged_tokens(grid: np.ndarray, config: VisionConfig) -> int:
    return int(np.prod(np.asarray(grid).reshape(-1, 3), axis=1).sum()) // config.merge_size


__all__ = ["KimiVision", "MoonViT", "Projector", "image_layout", "check_grid", "patch_bucket", "rope_2d",
           "segment_attention", "vision_param_shapes", "vision_tensor_target", "vision_published_name",
           "num_merged_tokens"]
