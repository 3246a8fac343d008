"""Built-in configs: `tiny` (tests, the demo), `medium_hybrid` (the ~5 B config measured in ../shared/anchors) and
`k3_3t` (a ~3 T-parameter K3-style hybrid used for memory planning), plus per-component parameter accounting."""

from __future__ import annotations

from collections import OrderedDict

import jax.numpy as jnp
import numpy as np

from .config import LAYER_KDA, LAYER_MLA, MLP_DENSE, MLP_MOE, ModelConfig, RopeConfig

MXFP4_BITS_PER_WEIGHT = 4.25  # 4-bit E2M1 elements + one 8-bit E8M0 scale per 32


def _every_fourth_mla(n: int) -> tuple[str, ...]:
    return tuple(LAYER_MLA if (i + 1) % 4 == 0 else LAYER_KDA for i in range(n))


def tiny() -> ModelConfig:
    """A 4-layer KDA + MLA/DSA + MoE hybrid with odd sizes, for tests and the demo."""
    return ModelConfig(
        model_type="kimi_linear", vocab_size=320, hidden_size=48, num_layers=4,
        layer_types=(LAYER_KDA, LAYER_MLA, LAYER_KDA, LAYER_MLA), mlp_types=(MLP_DENSE, MLP_MOE, MLP_MOE, MLP_MOE),
        intermediate_size=80, rms_norm_eps=1e-5, num_heads=3, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=12, mla_use_rope=False, rope=RopeConfig(),
        index_n_heads=16, index_head_dim=8, index_topk=6,
        kda_num_heads=3, kda_head_dim=8, kda_conv_size=4,
        num_experts=6, num_experts_per_token=2, moe_intermediate_size=20, num_shared_experts=1,
        routed_scaling_factor=2.0, n_group=1, topk_group=1, bos_token_id=1, eos_token_ids=(2,), pad_token_id=0,
        max_position_embeddings=4096,
    )


def medium_hybrid() -> ModelConfig:
    """The anchors' medium hybrid: 16 layers (12 KDA + 4 MLA), hidden 2048, 64 experts top-6, ~5.0 B params."""
    n = 16
    return ModelConfig(
        model_type="kimi_linear", vocab_size=32000, hidden_size=2048, num_layers=n, layer_types=_every_fourth_mla(n),
        mlp_types=(MLP_DENSE,) + (MLP_MOE,) * (n - 1), intermediate_size=6144, rms_norm_eps=1e-5,
        num_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        mla_use_rope=False, kda_num_heads=16, kda_head_dim=128, kda_conv_size=4,
        num_experts=64, num_experts_per_token=6, moe_intermediate_size=768, num_shared_experts=1,
        routed_scaling_factor=2.446, bos_token_id=1, eos_token_ids=(2,), pad_token_id=0, max_position_embeddings=1048576,
    )


def k3_3t() -> ModelConfig:
    """A K3-style hybrid of ~3 T params: 68 layers, 3 KDA : 1 MLA with DSA, 1024 MXFP4 experts (top-16), hidden 7168."""
    n = 68
    return ModelConfig(
        model_type="kimi_linear", vocab_size=163840, hidden_size=7168, num_layers=n, layer_types=_every_fourth_mla(n),
        mlp_types=(MLP_DENSE,) + (MLP_MOE,) * (n - 1), intermediate_size=18432, rms_norm_eps=1e-5,
        num_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_rope=True, rope=RopeConfig(theta=50000.0),
        index_n_heads=64, index_head_dim=128, index_topk=2048,
        kda_num_heads=64, kda_head_dim=128, kda_conv_size=4,
        num_experts=1024, num_experts_per_token=16, moe_intermediate_size=2048, num_shared_experts=1,
        routed_scaling_factor=2.827, n_group=1, topk_group=1, bos_token_id=163584, eos_token_ids=(163585,),
        max_position_embeddings=1048576, quant_method="mxfp4",
    )


PRESETS = {"tiny": tiny, "medium_hybrid": medium_hybrid, "k3_3t": k3_3t}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None


def component_of(path: tuple[str, ...]) -> str:
    """The accounting component a param path belongs to."""
    if path[0] in ("vision_tower", "mm_projector"):
        return "vision"
    if path[0] == "embed_tokens":
        return "embedding"
    if path[0] == "lm_head":
        return "lm_head"
    if len(path) >= 3 and path[1] == "self_attn":
        return "dsa indexer" if path[2] == "indexer" else ("norms" if path[2] == "o_norm" else "attention")
    if len(path) >= 3 and path[1] == "mlp":
        return {"experts": "routed experts", "shared_experts": "shared experts", "gate": "router"}.get(
            path[2], "dense mlp")
    return "norms"


def parameter_table(config: ModelConfig, dtype=jnp.bfloat16, experts_mxfp4: bool | None = None) -> "OrderedDict":
    """{component: (params, bytes)} with dense weights in `dtype` and routed experts in MXFP4 when the config
    says so (or `experts_mxfp4`). Computed from shapes only: nothing is allocated."""
    from .model import expected_params

    if experts_mxfp4 is None:
        experts_mxfp4 = config.quant_method == "mxfp4"
    table: OrderedDict[str, list] = OrderedDict()
    for path, leaf in expected_params(config, dtype).items():
        count, nbytes = param_footprint(path, leaf, dtype, experts_mxfp4)
        entry = table.setdefault(component_of(path), [0, 0.0])
        entry[0] += count
        entry[1] += nbytes
    return OrderedDict((k, (v[0], int(v[1]))) for k, v in table.items())


def param_footprint(path: tuple[str, ...], leaf, dtype, experts_mxfp4: bool) -> tuple[int, float]:
    """(weights, bytes) of one param (`leaf`: its shape and dtype from `expected_params`): packed MXFP4 params as
    stored (two weights per block byte; scales count bytes only), routed experts at 4.25 bits per weight when
    `experts_mxfp4`, float32 params as float32, everything else in `dtype`."""
    count = int(np.prod(leaf.shape))
    if path[-1].endswith(("_blocks", "_scales")):
        return (2 * count if path[-1].endswith("_blocks") else 0), float(count)
    if experts_mxfp4 and component_of(path) == "routed experts":
        return count, count * MXFP4_BITS_PER_WEIGHT / 8
    itemsize = jnp.dtype(leaf.dtype).itemsize if leaf.dtype == jnp.float32 else jnp.dtype(dtype).itemsize
    return count, float(count * itemsize)


def active_parameters(config: ModelConfig) -> int:
    """Params touched per token: everything except the unchosen routed experts (a decode step of one token)."""
    return round(decode_step_parameters(config, 1))


def decode_step_parameters(config: ModelConfig, batch: int) -> float:
    """Params a decode step of `batch` tokens reads: everything but the routed experts no token chose, those at their
    expected share under uniform top-k routing (one token leaves an expert out with probability 1 - k / E, `batch`
    tokens with (1 - k / E)^batch). The medium hybrid: 0.94 B at batch 1 (`active_parameters`), 4.1 B at 16."""
    total, routed_read = _decode_step_split(config, batch)
    return total + routed_read


def decode_step_bytes(config: ModelConfig, batch: int, dtype=jnp.bfloat16) -> float:
    """Bytes of the weights a decode step of `batch` tokens reads (`decode_step_parameters`' params): dense params in
    `dtype`, the chosen routed experts in MXFP4 (4.25 bits per weight) when the config's experts are MXFP4."""
    others, routed_read = _decode_step_split(config, batch)
    expert_bytes = MXFP4_BITS_PER_WEIGHT / 8 if config.quant_method == "mxfp4" else jnp.dtype(dtype).itemsize
    return others * jnp.dtype(dtype).itemsize + routed_read * expert_bytes


def _decode_step_split(config: ModelConfig, batch: int) -> tuple[float, float]:
    """(params other than the routed experts, routed-expert params at their chosen share) of a `batch`-token step."""
    if batch < 1:
        raise ValueError(f"a decode step's batch must be at least 1, got {batch}")
    table = parameter_table(config, experts_mxfp4=False)
    total = sum(c for c, _ in table.values())
    routed = table.get("routed experts", (0, 0))[0]
    chosen = 1.0 - (1.0 - config.num_experts_per_token / max(config.num_experts, 1)) ** batch
    return total - routed, routed * chosen
