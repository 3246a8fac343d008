"""Kimi-K2.5 image preprocessing in numpy, equal to transformers' `Kimi_K25ImageProcessor`, and prompt placeholders.

An image becomes `pixel_values` [N, 3, p, p] float32 (N = grid_h * grid_w patches of p = patch_size pixels, raster
order) and its `image_grid_thw` row [1, grid_h, grid_w]:

1. load: RGB uint8, EXIF orientation applied, transparency composited onto white;
2. resize (never up): scale = min(1, sqrt(max_patches / (max(1, H // p) * max(1, W // p))),
   max_patches_per_side * p / H, max_patches_per_side * p / W); each side int(side * scale) (at least 1, at most
   max_patches_per_side * p), with torch's antialiased bicubic for uint8 (PIL's filter, a = -0.5, int16 fixed-point
   weights, width pass then height pass, each rounded to uint8) reproduced bit for bit;
3. pad right and bottom with black to multiples of merge_size * p (28 for Kimi-K2.5);
4. normalize (x - 255 * mean) / (255 * std) in float32 (mean = std = 0.5) and cut into patches.

Each image then stands for grid_h * grid_w / merge_size² tokens: a prompt carries one image placeholder token per
image (expanded here to that many) or already exactly that many.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .config import VisionConfig
from .errors import ConfigError, ImageError

PREPROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The resize rules and normalisation (transformers' `max_patches`, `size.max_height`; published
    `media_proc_cfg.in_patch_limit`, `patch_limit_on_one_side`)."""

    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384
    max_patches_per_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    def __post_init__(self):
        for name in ("patch_size", "merge_size", "max_patches", "max_patches_per_side"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"preprocessor_config.{name}", f"must be a positive integer, got {value!r}")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if len(value) != 3 or (name == "image_std" and min(value) <= 0):
                raise ConfigError(f"preprocessor_config.{name}", f"expected three (positive) numbers, got {value!r}")

    @classmethod
    def for_vision(cls, vision: VisionConfig, **overrides) -> "ImageProcessorConfig":
        """Defaults matching a vision tower (its patch size and square merge kernel)."""
        return cls(**{"patch_size": vision.patch_size, "merge_size": vision.merge_kernel_size[0], **overrides})

    @classmethod
    def from_dict(cls, raw: dict[str, Any], vision: VisionConfig | None = None) -> "ImageProcessorConfig":
        """Parses preprocessor_config.json in the form transformers writes or the published `media_proc_cfg` one."""
        if "media_proc_cfg" in raw:
            cfg = raw["media_proc_cfg"]
            prefix = "preprocessor_config.media_proc_cfg."
            if cfg.get("fixed_output_tokens") is not None:
                raise ConfigError(prefix + "fixed_output_tokens", "a fixed token count per image is not supported")
            names = {"max_patches": "in_patch_limit", "max_patches_per_side": "patch_limit_on_one_side",
                     "patch_size": "patch_size", "merge_size": "merge_kernel_size", "image_mean": "image_mean",
                     "image_std": "image_std"}
        else:
            cfg = dict(raw)
            prefix = "preprocessor_config."
            size = cfg.get("size") or {}
            if size.get("max_height") != size.get("max_width"):
                raise ConfigError(prefix + "size", f"max_height and max_width must be equal, got {size}")
            if size.get("max_height") is not None:
                cfg["max_patches_per_side"] = size["max_height"]
            for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
                if cfg.get(flag) is False:
                    raise ConfigError(prefix + flag, "only the reference pipeline (true) is supported")
            if cfg.get("resample", 3) != 3:
                raise ConfigError(prefix + "resample", f"only bicubic (3) is supported, got {cfg['resample']!r}")
            names = {k: k for k in ("max_patches", "max_patches_per_side", "patch_size", "merge_size", "image_mean",
                                    "image_std", "rescale_factor")}
        fields: dict[str, Any] = {}
        for field_name, key in names.items():
            value = cfg.get(key)
            if value is None:
                continue
            if key == "merge_kernel_size" and isinstance(value, (list, tuple)):
                if len(set(value)) != 1:
                    raise ConfigError(prefix + key, f"only square merge kernels are supported, got {value}")
                value = value[0]
            if field_name in ("image_mean", "image_std"):
                value = tuple(float(x) for x in value)
            fields[field_name] = value
        config = cls.for_vision(vision, **fields) if vision is not None else cls(**fields)
        if vision is not None:
            config.check_matches(vision)
        return config

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, vision: VisionConfig) -> "ImageProcessorConfig":
        """`path/preprocessor_config.json` when the checkpoint has one, else the defaults for `vision`."""
        file = os.path.join(os.fspath(path), PREPROCESSOR_FILE)
        if not os.path.isfile(file):
            return cls.for_vision(vision)
        try:
            with open(file) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(PREPROCESSOR_FILE, f"{file} is not valid JSON: {e}") from None
        return cls.from_dict(raw, vision)

    def check_matches(self, vision: VisionConfig) -> None:
        if self.patch_size != vision.patch_size:
            raise ConfigError("preprocessor_config.patch_size",
                              f"({self.patch_size}) differs from vision_config.patch_size ({vision.patch_size})")
        if (self.merge_size, self.merge_size) != tuple(vision.merge_kernel_size):
            raise ConfigError("preprocessor_config.merge_size", f"({self.merge_size}) differs from "
                              f"vision_config.merge_kernel_size {list(vision.merge_kernel_size)}")


# ---------------------------------------------------------------------------------------------------- loading
def load_image(image: Any, name: str = "image", request_id: str | None = None) -> np.ndarray:
    """A path, PIL image or uint8 array ([H, W], [H, W, 3] or [H, W, 4]) -> RGB uint8 [H, W, 3].

    Files get their EXIF orientation applied; transparency is composited onto white (as the reference does for
    PIL images). Raises ImageError naming `name` when the input cannot be read as an image.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    if isinstance(image, (str, os.PathLike)):
        try:
            with Image.open(os.fspath(image)) as opened:
                opened.load()
                image = ImageOps.exif_transpose(opened)
        except (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise ImageError(request_id, f"{name} ({os.fspath(image)!r}) cannot be read as an image: {e}") from None
    if isinstance(image, Image.Image):
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        return np.asarray(image.convert("RGB"), dtype=np.uint8)
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ImageError(request_id, f"{name}: expected a uint8 array, got {image.dtype}")
        if image.ndim == 2:
            return np.repeat(image[:, :, None], 3, axis=2)
        if image.ndim == 3 and image.shape[2] == 3:
            return image
        if image.ndim == 3 and image.shape[2] == 4:
            return load_image(Image.fromarray(image, "RGBA"), name, request_id)
        raise ImageError(request_id, f"{name}: expected an array [H, W], [H, W, 3] or [H, W, 4], got "
                         f"{list(image.shape)}")
    raise ImageError(request_id, f"{name}: expected a path, a PIL image or a uint8 array, got {type(image).__name__}")


# ---------------------------------------------------------------------------------------------------- resizing
def resized_size(height: int, width: int, config: ImageProcessorConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """((new_h, new_w), (padded_h, padded_w)) by the reference rules: patch budget, per-side limit, never upscale,
    then pad to multiples of merge_size * patch_size."""
    p, side = config.patch_size, config.max_patches_per_side
    patches = max(1.0, height // p) * max(1.0, width // p)
    scale = min(1.0, math.sqrt(config.max_patches / patches), side * p / height, side * p / width)
    new_h = min(max(1, int(height * scale)), side * p)
    new_w = min(max(1, int(width * scale)), side * p)
    factor = config.merge_size * p
    return (new_h, new_w), (-(-new_h // factor) * factor, -(-new_w // factor) * factor)


def _cubic(x: float) -> float:
    """PIL's antialiasing bicubic filter (a = -0.5), in torch's evaluation order."""
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return 0.0


def _fixed_point_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One axis of torch's uint8 antialiased bicubic: (first source index [out], int16 weights [out, taps] as int64,
    precision bits). Weights are normalised in float64, then scaled by the largest power of two that keeps the
    largest weight within int16, and rounded half away from zero."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = int(math.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    starts = np.zeros(out_size, np.int64)
    weights = np.zeros((out_size, taps), np.float64)
    largest = 0.0
    for i in range(out_size):
        center = scale * (i + 0.5)
        first = max(int(center - support + 0.5), 0)
        count = min(max(min(int(center + support + 0.5), in_size) - first, 0), taps)
        row = [_cubic((j + first - center + 0.5) * invscale) for j in range(count)]
        total = 0.0
        for w in row:
            total += w
        if total != 0.0:
            row = [w / total for w in row]
            largest = max([largest, *row])
        starts[i] = first
        weights[i, :count] = row
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    fixed = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int64)
    return starts, fixed, precision


def _resample_axis(pixels: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """uint8 [H, W, C] resampled along `axis` (1: width, 0: height) to `out_size`, rounded back to uint8."""
    starts, fixed, precision = _fixed_point_taps(pixels.shape[axis], out_size)
    src = np.moveaxis(pixels, axis, 0).astype(np.int64)  # [in, other, C]
    index = np.minimum(starts[:, None] + np.arange(fixed.shape[1]), src.shape[0] - 1)  # zero-weight taps clamped
    acc = np.full((out_size, *src.shape[1:]), 1 << (precision - 1), np.int64)
    for k in range(fixed.shape[1]):
        acc += src[index[:, k]] * fixed[:, k, None, None]
    out = np.clip(acc >> precision, 0, 255).astype(np.uint8)
    return np.moveaxis(out, 0, axis)


def resize_bicubic(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """RGB uint8 [H, W, 3] -> [height, width, 3], bit-equal to torchvision's antialiased bicubic on uint8 (CPU)."""
    if pixels.shape[1] != width:
        pixels = _resample_axis(pixels, width, axis=1)
    if pixels.shape[0] != height:
        pixels = _resample_axis(pixels, height, axis=0)
    return pixels


# ---------------------------------------------------------------------------------------------------- processing
@dataclass(frozen=True)
class ProcessedImage:
    """pixel_values [N, 3, p, p] float32 (raster patch order) and grid (1, grid_h, grid_w)."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]

    @property
    def num_patches(self) -> int:
        return int(np.prod(self.grid_thw))


def preprocess(image: Any, config: ImageProcessorConfig, name: str = "image",
               request_id: str | None = None) -> ProcessedImage:
    """One image (path, PIL image or uint8 array) -> its patches, as the reference processor makes them."""
    pixels = load_image(image, name, request_id)
    height, width = pixels.shape[:2]
    if height == 0 or width == 0:
        raise ImageError(request_id, f"{name} is empty ({height}x{width} pixels)")
    (new_h, new_w), (pad_h, pad_w) = resized_size(height, width, config)
    pixels = resize_bicubic(pixels, new_h, new_w)
    padded = np.zeros((pad_h, pad_w, 3), np.uint8)
    padded[:new_h, :new_w] = pixels
    mean = np.asarray(config.image_mean, np.float32) * np.float32(1.0 / config.rescale_factor)
    std = np.asarray(config.image_std, np.float32) * np.float32(1.0 / config.rescale_factor)
    normed = (padded.astype(np.float32) - mean) / std  # [H, W, 3]
    p = config.patch_size
    gh, gw = pad_h // p, pad_w // p
    patches = normed.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    return ProcessedImage(np.ascontiguousarray(patches), (1, gh, gw))


def preprocess_images(images: Sequence[Any], config: ImageProcessorConfig,
                      request_id: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Several images -> (pixel_values [sum N, 3, p, p] float32, image_grid_thw [n, 3] int64), the layout of
    the reference processor's output for a list of images."""
    done = [preprocess(image, config, f"image {i}", request_id) for i, image in enumerate(images)]
    if not done:
        p = config.patch_size
        return np.zeros((0, 3, p, p), np.float32), np.zeros((0, 3), np.int64)
    return (np.concatenate([d.pixel_values for d in done]),
            np.asarray([d.grid_thw for d in done], np.int64))


# ---------------------------------------------------------------------------------------------------- prompts
def tokens_per_image(image_grid_thw: np.ndarray, merge_size: int) -> list[int]:
    """Placeholder tokens each image stands for: t * h * w / merge_size²."""
    return [int(t * h * w) // (merge_size * merge_size) for t, h, w in np.asarray(image_grid_thw).reshape(-1, 3)]


def expand_placeholders(token_ids: Sequence[int], image_token_id: int, counts: Sequence[int],
                        request_id: str | None = None) -> list[int]:
    """Prompt ids with each image's placeholder expanded to `counts[i]` tokens.

    The prompt holds either one placeholder per image (each is expanded) or already sum(counts) of them (kept).
    Anything else raises ImageError saying how many there are and how many the images need.
    """
    ids = [int(t) for t in token_ids]
    found = sum(1 for t in ids if t == image_token_id)
    if found == sum(counts):
        return ids
    if found == len(counts):
        out: list[int] = []
        image = 0
        for t in ids:
            if t == image_token_id:
                out.extend([image_token_id] * counts[image])
                image += 1
            else:
                out.append(t)
        return out
    raise ImageError(request_id, f"the prompt has {found} image placeholder token(s) (id {image_token_id}) for "
                     f"{len(counts)} image(s): expected one per image (expanded here) or {sum(counts)} (already "
                     f"expanded: {list(counts)} per image)")


__all__ = ["ImageProcessorConfig", "ProcessedImage", "load_image", "resized_size", "resize_bicubic", "preprocess",
           "preprocess_images", "tokens_per_image", "expand_placeholders"]
