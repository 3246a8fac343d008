"""Tiny random checkpoints built with transformers at test time (the reference oracle), and comparison helpers."""

from __future__ import annotations

import json
import os
import re

import numpy as np

SEQ_LEN = 77  # not a multiple of 64: KDA chunks and DSA selection both see a ragged tail


def kimi_linear_config(**overrides):
    from transformers import KimiLinearConfig

    fields = dict(
        vocab_size=203, hidden_size=40, intermediate_size=72, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=12, q_lora_rank=None, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=10, num_local_experts=6, num_experts_per_tok=2, n_shared_experts=1,
        linear_head_dim=8, linear_num_heads=3, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
        routed_scaling_factor=2.446,
    )
    fields.update(overrides)
    return KimiLinearConfig(**fields)


def deepseek_v32_config(**overrides):
    from transformers import DeepseekV32Config

    fields = dict(
        vocab_size=211, hidden_size=40, intermediate_size=72, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=12, q_lora_rank=20, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, index_topk=9, index_head_dim=8, index_n_heads=16,
        max_position_embeddings=256, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1},
    )
    fields.update(overrides)
    return DeepseekV32Config(**fields)


def deepseek_v3_config(**overrides):
    from transformers import DeepseekV3Config

    fields = dict(
        vocab_size=197, hidden_size=40, intermediate_size=72, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=12, q_lora_rank=None, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        first_k_dense_replace=1, n_shared_experts=2, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    fields.update(overrides)
    return DeepseekV3Config(**fields)


BUILDERS = {"kimi_linear": kimi_linear_config, "deepseek_v32": deepseek_v32_config,
            "deepseek_v3": deepseek_v3_config}


def build_hf_model(kind: str, seed: int = 0, **overrides):
    """A transformers model of `kind` with random weights; router biases made nonzero so they matter."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(BUILDERS[kind](**overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand_like(buf) * 0.1)
    return model


def save_hf_model(model, path, dtype=None, **kwargs) -> str:
    import torch

    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, **kwargs)
    return str(path)


def hf_logits(path: str, ids: np.ndarray, dtype: str = "float32") -> np.ndarray:
    from dayzero.model.compare import reference_outputs

    return reference_outputs(path, ids, dtype)[1]


def relative_error(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def rewrite_config(path: str, edit) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg = edit(cfg) or cfg
    with open(file, "w") as f:
        json.dump(cfg, f, indent=2)


# ---------------------------------------------------------------------------------------------------- kimi_k25
KIMI_K25_IMAGE_TOKEN = 209


def fp8_checkpoint(src: str, out, block: int = 16, experts: bool = False) -> int:
    """A copy of checkpoint `src` in `out` whose 2-D projection weights (routed experts' too with `experts`) are e4m3
    with `weight_scale_inv` blocks of `block` x `block` (partial blocks at odd edges); returns how many."""
    import shutil

    from dayzero.model.checkpoint import quantize_fp8_blocks
    from dayzero.model.safetensors_io import open_checkpoint_files, save_file

    shutil.copytree(src, out)
    files = open_checkpoint_files(src)
    tensors, n = {}, 0
    for name, f in files.items():
        w = f.read(name)
        if name.endswith("_proj.weight") and (experts or "experts" not in name) and w.ndim == 2:
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(w, (block, block))
            n += 1
        else:
            tensors[name] = w
    save_file(os.path.join(out, "model.safetensors"), tensors)
    rewrite_config(str(out), lambda c: c.update(dtype="bfloat16", quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}))
    return n


INT4_GROUP = 16  # the tiny experts' widths (40, 24) are not multiples of it: partial groups at the row ends


def int4_quantization_config(**weights) -> dict:
    """compressed-tensors' quantization_config of a pack-quantized INT4 group scheme (fields of `weights` changed)."""
    scheme = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT4_GROUP, **weights}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme, "format": "pack-quantized"}},
            "ignore": ["lm_head"]}


def int4_checkpoint(src: str, out, twin=None) -> dict[str, np.ndarray]:
    """A copy of `src` whose routed experts are packed INT4 with bf16 group scales by the compressed-tensors package
    (and, in `twin`, the same checkpoint with those experts as the float32 values compressed-tensors unpacks them
    to). Returns {weight name: those values}."""
    import shutil

    import ml_dtypes
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    from dayzero.model.safetensors_io import open_checkpoint_files, save_file

    shutil.copytree(src, out)
    if twin is not None:
        shutil.copytree(src, twin)
    files = open_checkpoint_files(src)
    packed, plain, values = {}, {}, {}
    for name, f in files.items():
        w = f.read(name)
        plain[name] = packed[name] = w
        if ".experts." not in name or not name.endswith("_proj.weight"):
            continue
        out_dim, in_dim = w.shape
        groups = -(-in_dim // INT4_GROUP)
        padded = np.zeros((out_dim, groups * INT4_GROUP), np.float32)
        padded[:, :in_dim] = w
        scale = (np.abs(padded.reshape(out_dim, groups, INT4_GROUP)).max(axis=2) / 7.5).astype(ml_dtypes.bfloat16)
        factors = np.repeat(scale.astype(np.float32), INT4_GROUP, axis=1)[:, :in_dim]
        q = np.clip(np.round(w / factors), -8, 7).astype(np.int8)
        del packed[name]
        base = name[:-len(".weight")]
        packed[base + ".weight_packed"] = pack_to_int32(torch.from_numpy(q), 4).numpy()
        packed[base + ".weight_scale"] = scale
        packed[base + ".weight_shape"] = np.asarray([out_dim, in_dim], np.int64)
        unpacked = unpack_from_int32(torch.from_numpy(packed[base + ".weight_packed"]), 4, torch.Size(w.shape))
        values[name] = plain[name] = unpacked.numpy().astype(np.float32) * factors
    save_file(os.path.join(out, "model.safetensors"), packed)
    rewrite_config(str(out), lambda c: c.update(quantization_config=int4_quantization_config()))
    if twin is not None:
        save_file(os.path.join(twin, "model.safetensors"), plain)
    return values


def kimi_k25_config(**overrides):
    """A tiny kimi_k25: deepseek_v3 text (2 layers, MoE) and a 2-layer MoonViT whose 8x8 position table is resampled
    both up and down by the fixture images' grids."""
    from transformers import Kimi_K25Config

    text = dict(
        model_type="deepseek_v3", vocab_size=211, hidden_size=40, intermediate_size=72, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=12, q_lora_rank=None,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
        topk_group=2, first_k_dense_replace=1, n_shared_experts=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, tie_word_embeddings=False,
    )
    vision = dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, num_attention_heads=2, num_hidden_layers=2,
                  hidden_size=32, intermediate_size=48, rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    fields = dict(text_config=text, vision_config=vision, projection_hidden_size=32,
                  image_token_id=KIMI_K25_IMAGE_TOKEN, tie_word_embeddings=False)
    fields.update(overrides)
    return Kimi_K25Config(**fields)


def build_kimi_k25(seed: int = 0, feature_gain: float = 1.0, attention_gain: float = 1.0, **overrides):
    """transformers' Kimi_K25ForConditionalGeneration with random weights (router biases nonzero); the projector's
    output scaled by `feature_gain` and the text attention's o_proj by `attention_gain`, so that images visibly
    steer a random model's logits at the text positions after them."""
    import torch
    from transformers import Kimi_K25ForConditionalGeneration

    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(kimi_k25_config(**overrides)).to(torch.float32).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand_like(buf) * 0.1)
        model.model.mm_projector.out_proj.weight.mul_(feature_gain)
        model.model.mm_projector.out_proj.bias.mul_(feature_gain)
        for layer in model.model.language_model.layers:
            layer.self_attn.o_proj.weight.mul_(attention_gain)
    return model


def _interleave_rope_rows(weight, num_heads: int):
    """transformers keeps MoonViT's q/k rows in rotate-half order; the checkpoint interleaves each head's pairs."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def kimi_k25_published_tensors(model) -> dict:
    """The model's weights under the published Kimi-K2.5 tensor names (what the hub checkpoint holds)."""
    import torch

    heads = model.config.vision_config.num_attention_heads
    moe_size = model.config.text_config.moe_intermediate_size
    renames = [(r"^model\.language_model\.", "language_model.model."), (r"^lm_head\.", "language_model.lm_head."),
               (r"^model\.vision_tower\.patch_embed\.pos_emb\.position_embeddings$",
                "vision_tower.patch_embed.pos_emb.weight"),
               (r"^model\.vision_tower\.patch_embed\.", "vision_tower.patch_embed."),
               (r"^model\.vision_tower\.final_layernorm\.", "vision_tower.encoder.final_layernorm."),
               (r"^model\.vision_tower\.layers\.(\d+)\.norm1\.", r"vision_tower.encoder.blocks.\1.norm0."),
               (r"^model\.vision_tower\.layers\.(\d+)\.norm2\.", r"vision_tower.encoder.blocks.\1.norm1."),
               (r"^model\.vision_tower\.layers\.(\d+)\.attn\.proj\.", r"vision_tower.encoder.blocks.\1.wo."),
               (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc1\.", r"vision_tower.encoder.blocks.\1.mlp.fc0."),
               (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc2\.", r"vision_tower.encoder.blocks.\1.mlp.fc1."),
               (r"^model\.mm_projector\.in_proj\.", "mm_projector.proj.0."),
               (r"^model\.mm_projector\.out_proj\.", "mm_projector.proj.2."),
               (r"^model\.mm_projector\.", "mm_projector.")]
    out = {}
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, tensor in state.items():
        m = re.match(r"model\.vision_tower\.layers\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)$", name)
        if m is not None:
            if m[2] != "q":
                continue
            parts = [state[f"model.vision_tower.layers.{m[1]}.attn.{x}_proj.{m[3]}"] for x in "qkv"]
            parts[:2] = [_interleave_rope_rows(t, heads) for t in parts[:2]]
            out[f"vision_tower.encoder.blocks.{m[1]}.wqkv.{m[3]}"] = torch.cat(parts).contiguous()
            continue
        m = re.match(r"model\.language_model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m is not None:
            prefix = f"language_model.model.layers.{m[1]}.mlp.experts"
            for e in range(tensor.shape[0]):
                if m[2] == "gate_up_proj":
                    out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :moe_size].contiguous()
                    out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, moe_size:].contiguous()
                else:
                    out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].contiguous()
            continue
        new = name
        for pattern, repl in renames:
            new, n = re.subn(pattern, repl, new)
            if n:
                break
        out[new] = tensor
    return out


def published_kimi_k25_config(cfg: dict) -> dict:
    """Rewrites transformers' kimi_k25 config.json into the published form (vt_* names, kimi_k2 text model)."""
    vision = cfg.pop("vision_config")
    cfg["vision_config"] = {
        "vt_hidden_size": vision["hidden_size"], "vt_intermediate_size": vision["intermediate_size"],
        "vt_num_attention_heads": vision["num_attention_heads"], "vt_num_hidden_layers": vision["num_hidden_layers"],
        "patch_size": vision["patch_size"], "init_pos_emb_height": vision["pos_emb_height"],
        "init_pos_emb_width": vision["pos_emb_width"], "init_pos_emb_time": vision["pos_emb_time"],
        "merge_kernel_size": vision["merge_kernel_size"], "merge_type": "sd2_tpool", "pos_emb_type": "divided_fixed",
        "mm_projector_type": "patchmerger", "mm_hidden_size": cfg.pop("projection_hidden_size"),
        "projector_ln_eps": cfg.pop("projection_layer_norm_eps"), "projector_hidden_act": "gelu",
        "text_hidden_size": cfg["text_config"]["hidden_size"], "video_attn_type": "spatial_temporal",
    }
    cfg["media_placeholder_token_id"] = cfg.pop("image_token_id")
    cfg["text_config"]["model_type"] = "kimi_k2"
    for key in ("video_token_id", "vision_start_token_id", "vision_end_token_id"):
        cfg.pop(key, None)
    return cfg


def save_kimi_k25(model, path, published_config: bool = False) -> str:
    """A kimi_k25 checkpoint directory with the published tensor names and config.json in the form transformers
    writes (or, with `published_config`, the published one). transformers' own save_pretrained does not round-trip
    kimi_k25's tensor names, so the tensors are written here."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    if published_config:
        rewrite_config(str(path), published_kimi_k25_config)
    save_file(kimi_k25_published_tensors(model), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def _boundary_gap(scores: np.ndarray, k: int) -> float:
    """The smallest gap, over the rows of scores [..., M] (-inf where not allowed), between a row's k-th and
    (k+1)-th best, relative to its best |score| (rows with fewer than k + 1 allowed, or none: inf)."""
    ranked = -np.sort(-np.asarray(scores, np.float64), axis=-1)
    if ranked.shape[-1] <= k:
        return np.inf
    gap = (ranked[..., k - 1] - ranked[..., k]) / np.maximum(np.abs(ranked[..., 0]), 1e-30)
    return float(np.min(np.where(np.isfinite(gap), gap, np.inf), initial=np.inf))


def _trace_afresh(model, ids: np.ndarray) -> None:
    """One full-sequence forward pass of `model` on `ids` [B, T] through a new jitted function, so that a patch or
    interceptor active now sees the trace (the model's own jit may hold one already)."""
    import jax

    from dayzero.model import model as model_lib

    forward = jax.jit(lambda params, tokens: model_lib._forward(model.module, params, tokens, None, False))
    jax.block_until_ready(forward(model.params, np.asarray(ids, np.int32)))


def indexer_margin(model, ids: np.ndarray) -> float:
    """Smallest gap between the k-th and (k+1)-th lightning-indexer score over every DSA layer and query of `model`
    on `ids` [B, T], relative to that query's largest score (inf when no query has more than k candidates).

    Random token draws now and then put two keys within float32 rounding of each other at the top-k boundary; which
    one each implementation keeps then depends on summation order, not on correctness. Tests that compare DSA models
    against transformers and disagree check this margin, and retry on tokens that clear the noise (`tie_free_ids`).
    """
    import jax
    from unittest import mock

    from dayzero.kernels import indexer

    topk, margins = model.config.index_topk, [np.inf]
    scores_of = indexer.index_scores

    def margin_of(scores):
        allowed = np.tril(np.ones(scores.shape[-2:], bool))
        s = np.where(allowed, np.asarray(scores), -np.inf)[:, topk:]  # queries with more than topk candidates
        margins.append(_boundary_gap(s, topk))

    def recording(q, k, weights, scale):
        scores = scores_of(q, k, weights, scale)
        jax.debug.callback(margin_of, scores)
        return scores

    with mock.patch.object(indexer, "index_scores", recording):  # a new function, so a fresh trace sees the patch
        _trace_afresh(model, ids)
    return min(margins)


MIN_INDEXER_MARGIN = 1e-5  # relative gap at the top-k boundary that float32 summation order cannot close


def router_margin(model, ids: np.ndarray) -> float:
    """Smallest gap at the routers' top-k boundary over every MoE layer and token of `model` on `ids` [B, T]:
    between the k-th and (k+1)-th expert's selection score (scores + correction bias, among the kept groups), and
    where groups restrict the choice, between the topk_group-th and next group score; relative to the token's
    best score (inf for a model without routed experts).

    As with the indexer (`indexer_margin`), a token whose routers sit within float32 rounding of a tie may pick
    another expert in another implementation, and move by a whole expert's output."""
    import flax.linen as nn
    import jax

    from dayzero.model.moe import Router, restricting_groups

    cfg, margins = model.config, [np.inf]

    def margin_of(x, weight, bias):
        logits = np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T
        if cfg.router_activation == "sigmoid":
            scores = 1 / (1 + np.exp(-logits))
        else:
            scores = np.exp(logits - logits.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
        choice = scores + (0.0 if bias is None else np.asarray(bias, np.float64))
        groups = restricting_groups(cfg)
        if groups > 1:
            grouped = choice.reshape(choice.shape[0], groups, -1)
            group_scores = -np.sort(-grouped, axis=-1)[..., :2].sum(-1)
            margins.append(_boundary_gap(group_scores, cfg.topk_group))
            kept = np.argsort(-group_scores, axis=-1)[:, :cfg.topk_group]
            keep = np.zeros(group_scores.shape, bool)
            np.put_along_axis(keep, kept, True, axis=-1)
            choice = np.where(np.repeat(keep, grouped.shape[-1], axis=-1), choice, -np.inf)
        margins.append(_boundary_gap(choice, cfg.num_experts_per_token))

    def recording(next_fun, args, kwargs, context):
        if isinstance(context.module, Router) and context.method_name == "__call__":
            params = context.module.variables["params"]
            jax.debug.callback(margin_of, args[0], params["weight"], params.get("e_score_correction_bias"))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(recording):
        _trace_afresh(model, ids)
    return min(margins)


MIN_ROUTER_MARGIN = 1e-6  # ~10x the float32 rounding between two implementations' router scores


def near_tie(model, ids: np.ndarray) -> bool:
    """Whether `model`'s DSA indexer or MoE routers sit within rounding of a top-k tie on `ids` [B, T]."""
    if model.config.use_dsa and indexer_margin(model, ids) < MIN_INDEXER_MARGIN:
        return True
    return router_margin(model, ids) < MIN_ROUTER_MARGIN


def tie_free_ids(model, ids: np.ndarray, seed: int, tries: int = 20) -> np.ndarray:
    """`ids` when `model` has no near-tie on them (`near_tie`); otherwise fresh draws (same shape and range, from a
    stream derived from `seed`, not the one `ids` came from) until one has none."""
    rng = np.random.default_rng([seed, 1])
    for _ in range(tries):
        if not near_tie(model, ids):
            return ids
        ids = rng.integers(3, 197, ids.shape)
    raise AssertionError(f"no tie-free token draw in {tries} tries (token seed {seed})")
