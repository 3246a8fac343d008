"""ModelConfig parsing: published and transformers forms, and typed errors naming the field."""

from __future__ import annotations

import copy

import pytest

from dayzero.model import ConfigError, ModelConfig
from dayzero.model.presets import (PRESETS, active_parameters, decode_step_bytes, decode_step_parameters, get_preset,
                                   parameter_table)

# Field values as Moonshot publishes them for Kimi-Linear-48B-A3B-Instruct.
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
    "hidden_size": 2304, "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
    "head_dim": 72, "intermediate_size": 9216, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839, "model_max_length": 1048576,
    "rope_theta": 10000.0, "rope_scaling": None, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "dtype": "bfloat16",
}

DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "num_nextn_predict_layers": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "torch_dtype": "bfloat16", "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0,
}


def test_published_kimi_linear():
    cfg = ModelConfig.from_hf_dict(KIMI_LINEAR_48B)
    assert cfg.num_layers == 27
    assert [i + 1 for i, t in enumerate(cfg.layer_types) if t == "mla"] == [4, 8, 12, 16, 20, 24, 27]
    assert cfg.mlp_types[0] == "dense" and set(cfg.mlp_types[1:]) == {"moe"}
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size) == (32, 128, 4)
    assert not cfg.mla_use_rope and cfg.q_lora_rank is None and not cfg.use_dsa
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.n_group) == (256, 8, 1)
    assert cfg.mla_softmax_scale == pytest.approx(192 ** -0.5)
    assert cfg.kda_gate_lower_bound is None and cfg.max_position_embeddings == 1048576


def test_kimi_gate_lower_bound_and_layer_freq():
    raw = copy.deepcopy(KIMI_LINEAR_48B)
    raw["linear_attn_config"]["gate_lower_bound"] = -5.0
    raw["moe_layer_freq"] = 2
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.kda_gate_lower_bound == -5.0
    assert cfg.mlp_types[:5] == ("dense", "dense", "moe", "dense", "moe")


def test_deepseek_v32_published():
    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V32)
    assert cfg.use_dsa and cfg.index_topk == 2048 and cfg.index_n_heads == 64
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 40 and cfg.rope.original_max_position_embeddings == 4096
    assert cfg.rope.cos_sin_scale == pytest.approx(1.0)
    m = 0.1 * 1.0 * __import__("math").log(40) + 1.0
    assert cfg.mla_softmax_scale == pytest.approx(192 ** -0.5 * m * m)
    assert cfg.quant_method == "fp8" and cfg.weight_block_size == (128, 128)
    assert cfg.num_mtp_layers == 1 and cfg.mlp_types[:4] == ("dense", "dense", "dense", "moe")
    assert (cfg.n_group, cfg.topk_group, cfg.router_bias) == (8, 4, True)


def test_kimi_k2_and_v3_have_no_indexer():
    raw = {k: v for k, v in DEEPSEEK_V32.items() if not k.startswith("index_")}
    for model_type in ("kimi_k2", "deepseek_v3"):
        cfg = ModelConfig.from_hf_dict({**raw, "model_type": model_type, "n_group": 1, "topk_group": 1})
        assert not cfg.use_dsa and cfg.model_type == model_type


def test_rope_parameters_form_matches_rope_scaling_form():
    a = ModelConfig.from_hf_dict(DEEPSEEK_V32)
    raw = {k: v for k, v in DEEPSEEK_V32.items() if k not in ("rope_scaling", "rope_theta")}
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                              "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 32, "beta_slow": 1}
    assert ModelConfig.from_hf_dict(raw).rope == a.rope


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(model_type="mystery"), "model_type"),
    (lambda c: c.update(model_type="kimi_k25"), "text_config"),  # kimi_k25 wraps a text_config and a vision_config
    (lambda c: c["linear_attn_config"].update(kda_layers=[0, 1]), "linear_attn_config.kda_layers"),
    (lambda c: c["linear_attn_config"].update(full_attn_layers=[1, 4]), "linear_attn_config.kda_layers"),
    (lambda c: c["linear_attn_config"].update(kda_layers=[1, 2]), "linear_attn_config.kda_layers"),
    (lambda c: c.update(num_experts_per_token=300), "num_experts_per_token"),
    (lambda c: c.update(hidden_size="big"), "hidden_size"),
    (lambda c: c.update(num_key_value_heads=8), "num_key_value_heads"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(moe_router_activation_func="relu"), "router_activation"),
    (lambda c: c.update(layer_types=["linear_attention"] * 3), "layer_types"),
])
def test_bad_kimi_fields_name_the_field(edit, field):
    raw = copy.deepcopy(KIMI_LINEAR_48B)
    edit(raw)
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict(raw)
    assert info.value.field == field, str(info.value)


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(rope_scaling={"type": "longrope", "factor": 2}), "rope_scaling.rope_type"),
    (lambda c: c.update(q_lora_rank=None), "q_lora_rank"),
    (lambda c: c.update(n_group=7), "n_group"),
    (lambda c: c.update(index_head_dim=32), "index_head_dim"),
    (lambda c: c["quantization_config"].update(quant_method="gptq"), "quantization_config.quant_method"),
    (lambda c: c.pop("num_hidden_layers"), "num_hidden_layers"),
])
def test_bad_deepseek_fields_name_the_field(edit, field):
    raw = copy.deepcopy(DEEPSEEK_V32)
    edit(raw)
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict(raw)
    assert info.value.field == field, str(info.value)


def test_presets():
    assert set(PRESETS) == {"tiny", "medium_hybrid", "k3_3t"}
    medium = get_preset("medium_hybrid")
    total = sum(c for c, _ in parameter_table(medium).values())
    assert 5.0e9 < total < 5.1e9  # the anchors' 5.04 B
    assert 0.93e9 < active_parameters(medium) < 0.95e9  # 0.94 B active per token
    assert abs(decode_step_parameters(medium, 1) - active_parameters(medium)) < 1.0  # one token: its own experts
    steps = [decode_step_parameters(medium, b) for b in (1, 16, 64, 4096)]
    assert 4.0e9 < steps[1] < 4.2e9  # ~51 of 64 experts chosen by 16 tokens x top-6
    assert steps == sorted(steps) and abs(steps[-1] - total) < 1.0  # every expert, at a batch that large
    with pytest.raises(ValueError, match="batch"):
        decode_step_parameters(medium, 0)
    packed = medium.replace(quant_method="mxfp4")
    assert decode_step_parameters(packed, 16) == pytest.approx(steps[1])  # the same weights, packed
    for batch in (1, 16):
        bf16, mx = decode_step_bytes(medium, batch), decode_step_bytes(packed, batch)
        assert bf16 == pytest.approx(2 * decode_step_parameters(medium, batch))
        routed = parameter_table(medium)["routed experts"][0] * (1 - (1 - 6 / 64) ** batch)
        assert mx == pytest.approx(bf16 - routed * (2 - 4.25 / 8))  # the chosen experts at 4.25 bits per weight
    k3 = get_preset("k3_3t")
    table = parameter_table(k3)
    assert 2.9e12 < sum(c for c, _ in table.values()) < 3.2e12
    assert k3.use_dsa and "kda" in k3.layer_types
    experts, expert_bytes = table["routed experts"]
    assert expert_bytes == pytest.approx(experts * 4.25 / 8)  # MXFP4 accounting
