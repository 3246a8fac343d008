"""Tiny random checkpoints built with transformers at test time (the reference oracle), and comparison helpers."""

from __future__ import annotations

import json
import os

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
