"""kimi_k25 vision: preprocessing equal to the reference processor (fixtures), config forms, checkpoint names, and the
MoonViT tower, image features and logits against transformers' kimi_k25 in fp32; typed errors for bad images."""

from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import pytest
import torch

from tiny_checkpoints import (KIMI_K25_IMAGE_TOKEN, build_kimi_k25, published_kimi_k25_config, relative_error,
                              save_kimi_k25)
from dayzero.model import CheckpointError, ConfigError, ModelConfig, load_checkpoint
from dayzero.model.errors import ImageError
from dayzero.model.image_processing import (ImageProcessorConfig, expand_placeholders, preprocess, preprocess_images,
                                            tokens_per_image)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "vision")
REFERENCE = np.load(os.path.join(FIXTURES, "reference.npz"))
CASES = json.loads(bytes(REFERENCE["meta"]).decode())["cases"]
IMAGES = ["gradient_37x53", "noise_101x67", "alpha_64x129", "gray_45x45", "wide_150x113"]


def image_path(name: str) -> str:
    return os.path.join(FIXTURES, f"{name}.png")


def reference(setting: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    key = f"{setting}/{name}"
    return REFERENCE[f"{key}/levels"][REFERENCE[f"{key}/codes"]], REFERENCE[f"{key}/grid_thw"]


def processor_config(kwargs: dict) -> ImageProcessorConfig:
    """Our settings for the reference processor kwargs a fixture case used."""
    fields = {}
    if "max_patches" in kwargs:
        fields["max_patches"] = kwargs["max_patches"]
    if "size" in kwargs:
        fields["max_patches_per_side"] = kwargs["size"]["max_height"]
    return ImageProcessorConfig(**fields)


# ---------------------------------------------------------------------------------------------------- preprocessing
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['setting']}-{c['image']}")
def test_pixel_values_equal_the_reference_processor(case):
    ours = preprocess(image_path(case["image"]), processor_config(case["kwargs"]))
    ref_pixels, ref_grid = reference(case["setting"], case["image"])
    assert list(ours.grid_thw) == ref_grid[0].tolist()
    assert ours.pixel_values.shape == ref_pixels.shape and ours.pixel_values.dtype == np.float32
    assert float(np.max(np.abs(ours.pixel_values - ref_pixels))) <= 1e-5


def test_resize_rules_were_exercised_and_images_batch_in_order():
    """The fixtures cover no resize, the patch budget and the per-side limit; a batch is the concatenation."""
    grids = {(c["setting"], c["image"]): c["grid_thw"][0] for c in CASES}
    assert grids[("default", "wide_150x113")] == [1, 12, 10]  # 150x113 px padded to 168x140: never upscaled
    assert grids[("patch_limit_24", "wide_150x113")] == [1, 6, 6]  # 10x8 patches > 24: scaled by sqrt(24/80)
    assert grids[("side_limit_6", "noise_101x67")] == [1, 6, 4]  # at most 6 patches (84 px) per side
    pixel_values, grid = preprocess_images([image_path(n) for n in IMAGES], ImageProcessorConfig())
    refs = [reference("default", n) for n in IMAGES]
    assert np.array_equal(grid, np.concatenate([g for _, g in refs]))
    assert np.max(np.abs(pixel_values - np.concatenate([p for p, _ in refs]))) <= 1e-5


def test_images_from_arrays_and_pil_equal_files():
    from PIL import Image

    pixels = np.asarray(Image.open(image_path("noise_101x67")).convert("RGB"))
    config = ImageProcessorConfig(max_patches=24)
    from_file = preprocess(image_path("noise_101x67"), config).pixel_values
    assert np.array_equal(preprocess(pixels, config).pixel_values, from_file)
    assert np.array_equal(preprocess(Image.fromarray(pixels), config).pixel_values, from_file)


# ---------------------------------------------------------------------------------------------------- config
def test_config_forms_transformers_and_published(kimi_k25):
    path, hf = kimi_k25
    with open(os.path.join(path, "config.json")) as f:
        written = json.load(f)
    ours = ModelConfig.from_hf_dict(written)
    published = ModelConfig.from_hf_dict(published_kimi_k25_config(copy.deepcopy(written)))
    assert ours.model_type == published.model_type == "kimi_k25"
    assert ours.vision == published.vision and ours.image_token_id == published.image_token_id == KIMI_K25_IMAGE_TOKEN
    assert ours.replace(checkpoint_dtype=None) == published.replace(checkpoint_dtype=None)
    v = ours.vision
    vc = hf.config.vision_config
    assert (v.hidden_size, v.num_heads, v.num_layers, v.intermediate_size) == (
        vc.hidden_size, vc.num_attention_heads, vc.num_hidden_layers, vc.intermediate_size)
    assert (v.pos_emb_height, v.pos_emb_width, v.merge_kernel_size, v.projector_hidden_size) == (8, 8, (2, 2), 32)
    assert ours.hidden_size == 40 and ours.num_experts == 8 and not ours.tie_word_embeddings


def test_preprocessor_config_forms():
    vision_free = ImageProcessorConfig.from_dict({
        "image_processor_type": "Kimi_K25ImageProcessor", "max_patches": 1024, "size": {"max_height": 64,
                                                                                           "max_width": 64},
        "patch_size": 14, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})
    published = ImageProcessorConfig.from_dict({"media_proc_cfg": {
        "in_patch_limit": 1024, "patch_limit_on_one_side": 64, "patch_size": 14, "merge_kernel_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fixed_output_tokens": None}})
    assert vision_free == published == ImageProcessorConfig(max_patches=1024, max_patches_per_side=64)
    with pytest.raises(ConfigError) as info:
        ImageProcessorConfig.from_dict({"media_proc_cfg": {"fixed_output_tokens": 64}})
    assert info.value.field == "preprocessor_config.media_proc_cfg.fixed_output_tokens"


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.pop("text_config"), "text_config"),
    (lambda c: c["text_config"].update(model_type="llama"), "text_config.model_type"),
    (lambda c: c["text_config"].pop("hidden_size"), "text_config.hidden_size"),
    (lambda c: c["vision_config"].update(num_attention_heads=3), "vision_config.num_attention_heads"),
    (lambda c: c["vision_config"].update(hidden_act="relu"), "vision_config.hidden_act"),
    (lambda c: c["vision_config"].update(rope_parameters={"rope_type": "default"}),
     "vision_config.rope_parameters.rope_type"),
    (lambda c: c.update(projection_hidden_size=64), "vision_config.projection_hidden_size"),
    (lambda c: c.update(image_token_id=10_000), "image_token_id"),
])
def test_bad_kimi_k25_fields_name_the_field(kimi_k25, edit, field):
    with open(os.path.join(kimi_k25[0], "config.json")) as f:
        raw = json.load(f)
    edit(raw)
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict(raw)
    assert info.value.field == field, str(info.value)


@pytest.mark.parametrize("edit, field", [
    (lambda v: v.update(mm_projector_type="patchmergerv2"), "vision_config.mm_projector_type"),
    (lambda v: v.update(pos_emb_interpolation_mode="bilinear"), "vision_config.pos_emb_interpolation_mode"),
    (lambda v: v.update(text_hidden_size=7168), "vision_config.text_hidden_size"),
    (lambda v: v.pop("vt_hidden_size"), "vision_config.hidden_size"),
])
def test_bad_published_vision_fields_name_the_field(kimi_k25, edit, field):
    with open(os.path.join(kimi_k25[0], "config.json")) as f:
        raw = published_kimi_k25_config(json.load(f))
    edit(raw["vision_config"])
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict(raw)
    assert info.value.field == field, str(info.value)


# ---------------------------------------------------------------------------------------------------- model
def reference_outputs(hf, ids, pixel_values, grid):
    """transformers' vision tower output, image features and logits (fp32)."""
    pv, g = torch.from_numpy(pixel_values), torch.from_numpy(grid)
    with torch.no_grad():
        hidden = hf.model.vision_tower(pv, grid_thw=g).last_hidden_state.numpy()
        features = torch.cat(hf.model.get_image_features(pv, g).pooler_output).numpy()
        logits = hf(input_ids=torch.from_numpy(ids), pixel_values=pv, image_grid_thw=g).logits.numpy()
    return hidden, features, logits


def prompt_with_images(rng, grid, batch: int = 1) -> np.ndarray:
    """[batch, T] random text around one placeholder per image (expanded); images split across the rows."""
    counts = tokens_per_image(grid, 2)
    per_row = np.array_split(np.arange(len(counts)), batch)
    rows = []
    for images in per_row:
        ids = rng.integers(3, 200, int(rng.integers(3, 9))).tolist()
        for _ in images:
            ids += [KIMI_K25_IMAGE_TOKEN] + rng.integers(3, 200, int(rng.integers(1, 6))).tolist()
        rows.append(expand_placeholders(ids, KIMI_K25_IMAGE_TOKEN, [counts[i] for i in images]))
    width = max(map(len, rows))
    return np.asarray([r + rng.integers(3, 200, width - len(r)).tolist() for r in rows])


def test_vision_tower_features_and_logits_match_transformers(kimi_k25, seed):
    path, hf = kimi_k25
    rng = np.random.default_rng(seed)
    names = list(rng.permutation(IMAGES))  # grids 4x4, 8x6, 6x10, 4x4, 12x10: the 8x8 table resampled up and down
    model = load_checkpoint(path, dtype="float32", progress=False)
    pixel_values, grid = preprocess_images([image_path(n) for n in names], model.image_processor)
    ids = prompt_with_images(rng, grid, batch=2)
    hidden, features, logits = reference_outputs(hf, ids, pixel_values, grid)
    errors = {"tower": relative_error(model.vision_hidden_states(pixel_values, grid), hidden),
              "features": relative_error(model.encode_images(pixel_values, grid), features),
              "logits": relative_error(model(ids, pixel_values, grid), logits)}
    assert max(errors.values()) <= 1e-4, f"{errors} (seed {seed}, images {names})"
    other_pictures = np.asarray(model(ids, -pixel_values, grid))  # same shapes: nothing new to compile
    assert relative_error(other_pictures, logits) > 1e-3, "the images did not change the logits: test is vacuous"


def test_published_config_and_tied_embeddings(tmp_path, seed):
    hf = build_kimi_k25(seed=seed % 1000, tie_word_embeddings=True)
    path = save_kimi_k25(hf, tmp_path / "tied", published_config=True)
    model = load_checkpoint(path, dtype="float32", progress=False)
    assert model.config.tie_word_embeddings and "lm_head" not in model.params
    rng = np.random.default_rng(seed)
    pixel_values, grid = preprocess_images([image_path("alpha_64x129"), image_path("gray_45x45")],
                                           model.image_processor)
    ids = prompt_with_images(rng, grid)
    _, _, logits = reference_outputs(hf, ids, pixel_values, grid)
    assert relative_error(model(ids, pixel_values, grid), logits) <= 1e-4, f"seed {seed}"


def test_checkpoint_errors_name_the_published_vision_tensors(kimi_k25, tmp_path):
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "broken")
    shutil.copytree(kimi_k25[0], path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["vision_tower.encoder.blocks.1.wqkv.weight"]
    del tensors["language_model.model.layers.0.self_attn.o_proj.weight"]
    tensors["mm_projector.proj.2.weight"] = tensors["mm_projector.proj.2.weight"][:, :-1].contiguous()
    tensors["vision_tower.encoder.blocks.7.norm0.weight"] = tensors["mm_projector.pre_norm.weight"].clone()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, progress=False)
    text = str(info.value)
    for expected in ("missing tensor 'vision_tower.encoder.blocks.1.wqkv.weight'",
                     "missing tensor 'language_model.model.layers.0.self_attn.o_proj.weight'",
                     "shape mismatch: 'mm_projector.proj.2.weight'",
                     "unexpected tensor 'vision_tower.encoder.blocks.7.norm0.weight'"):
        assert expected in text, text
    assert len(info.value.problems) == 4


def test_image_errors(kimi_k25, tmp_path):
    model = load_checkpoint(kimi_k25[0], dtype="float32", progress=False)
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("this is not a PNG")
    for bad in (str(not_an_image), str(tmp_path / "missing.png")):
        with pytest.raises(ImageError, match="cannot be read as an image") as info:
            preprocess_images([image_path("gray_45x45"), bad], model.image_processor, request_id="r7")
        assert "image 1" in str(info.value) and bad in str(info.value) and info.value.request_id == "r7"
    pixel_values, grid = preprocess_images([image_path("gray_45x45")], model.image_processor)  # 16 patches, 4 tokens
    ids = np.asarray([[5, 6] + [KIMI_K25_IMAGE_TOKEN] * 3 + [7]])
    with pytest.raises(ImageError, match="3 image placeholder tokens .* 4 features"):
        model(ids, pixel_values, grid)
    with pytest.raises(ImageError, match="no pixel_values"):
        model(ids)
    with pytest.raises(ImageError, match="16 patches but image_grid_thw describes 24"):
        model(ids, pixel_values, np.asarray([[1, 4, 6]]))
    with pytest.raises(ImageError, match="multiple of the merge kernel"):
        model(ids, pixel_values[:15], np.asarray([[1, 3, 5]]))
    with pytest.raises(ImageError, match=r"2 image placeholder token\(s\) .* for 1 image"):
        expand_placeholders([1, KIMI_K25_IMAGE_TOKEN, 2, KIMI_K25_IMAGE_TOKEN], KIMI_K25_IMAGE_TOKEN, [4])
    assert expand_placeholders([1, KIMI_K25_IMAGE_TOKEN, 2], KIMI_K25_IMAGE_TOKEN, [3]) == [1] + [209] * 3 + [2]
    assert np.isfinite(np.asarray(model(np.asarray([[5, 6, 7]])))).all()  # text-only prompts still work


def test_hybrid_text_with_vision_through_the_engine(kimi_k25, seed):
    """A K3-style config: kimi_k25 whose text_config is a KDA + MLA hybrid. Engine greedy (chunked prefill over the
    image, KDA state snapshots) equals full-forward greedy, and the image changes the logits."""
    from tiny_checkpoints import kimi_linear_config
    from dayzero.model import Model
    from dayzero.serving.engine import Engine, EngineConfig
    from dayzero.serving.sampling import SamplingParams

    with open(os.path.join(kimi_k25[0], "config.json")) as f:
        raw = json.load(f)
    raw["text_config"] = kimi_linear_config(vocab_size=211).to_dict()
    config = ModelConfig.from_hf_dict(raw)
    assert config.layer_types == ("kda", "mla", "kda", "mla") and config.vision is not None
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 200, 11).tolist() + [KIMI_K25_IMAGE_TOKEN] + rng.integers(3, 200, 4).tolist()
    for attempt in range(8):  # a random model may pick the image placeholder id itself: then another model
        model = Model.random(config, "float32", seed=seed % 1000 + attempt)
        pixel_values, grid = preprocess_images([image_path("noise_101x67")], model.image_processor)  # 12 tokens
        ids = expand_placeholders(prompt, KIMI_K25_IMAGE_TOKEN, tokens_per_image(grid, 2))
        window = np.zeros((1, 32), np.int32)
        window[0, :len(ids)] = ids
        for i in range(len(ids), len(ids) + 4):
            window[0, i] = int(np.asarray(model(window, pixel_values, grid))[0, i - 1].argmax())
            if window[0, i] == KIMI_K25_IMAGE_TOKEN:
                break
        else:
            break
    assert KIMI_K25_IMAGE_TOKEN not in window[0, len(ids):len(ids) + 4].tolist(), f"seed {seed}: 8 models chose it"
    assert window[0, len(ids):len(ids) + 4].tolist() != [0] * 4
    other_picture = np.asarray(model(window, -pixel_values, grid))
    assert relative_error(other_picture, model(window, pixel_values, grid)) > 1e-4, "the image changed nothing"
    engine = Engine(model, None, EngineConfig(max_num_seqs=2, max_model_len=64, block_size=16, max_prefill_tokens=16,
                                              max_prefill_rows=1, prefill_len_buckets=(16,), block_buckets=(4,),
                                              decode_buckets=(2,)))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for _ in range(2):  # the second time from the prefix cache (a KDA snapshot after the image's block)
        out = engine.generate(prompt_token_ids=[prompt], sampling_params=params,
                              images=[image_path("noise_101x67")])[0]
        assert out.token_ids == window[0, len(ids):len(ids) + 4].tolist(), f"seed {seed}"
    assert out.num_cached_tokens == 16
