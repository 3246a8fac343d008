"""`ModelConfig`: one frozen dataclass for the whole family, parsed from a hub `config.json`.

Supported `model_type`s: `kimi_linear` (KDA + MLA-NoPE + MoE, in the published `linear_attn_config` form and in
the form transformers writes), `deepseek_v3`, `kimi_k2` (MLA + MoE), `deepseek_v32` (MLA + DSA indexer + MoE) and
`kimi_k25` (a deepseek_v3/kimi_k2 `text_config` plus a MoonViT `vision_config`, published `vt_*` form or the form
transformers writes). A hybrid (KDA + MLA with DSA + MoE) is just a config: a `kimi_linear` config that also carries
`index_*` fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

LAYER_KDA = "kda"
LAYER_MLA = "mla"
MLP_DENSE = "dense"
MLP_MOE = "moe"

SUPPORTED_MODEL_TYPES = ("kimi_linear", "deepseek_v3", "kimi_k2", "deepseek_v32", "kimi_k25")
KIMI_K25_TEXT_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v32", "kimi_linear")  # kimi_linear: a K3-style hybrid
VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")  # tanh approximation, exact erf


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. `kind` is "default" or "yarn" (YaRN with DeepSeek's mscale)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def yarn_mscale(self, scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    @property
    def cos_sin_scale(self) -> float:
        """Factor applied to cos/sin (YaRN's attention factor; 1 for default rope)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return self.yarn_mscale(self.factor, self.mscale) / self.yarn_mscale(self.factor, self.mscale_all_dim)
        return self.yarn_mscale(self.factor)

    def softmax_scale_multiplier(self) -> float:
        """DeepSeek multiplies the attention softmax scale by mscale(factor, mscale_all_dim)**2 under YaRN."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        m = self.yarn_mscale(self.factor, self.mscale_all_dim)
        return m * m


@dataclass(frozen=True)
class VisionConfig:
    """Kimi-K2.5's MoonViT tower and its patch-merger projector.

    Patches of `patch_size`² pixels, a learned `[pos_emb_height, pos_emb_width, hidden_size]` position table
    resampled bicubically to each image's grid, 2-D rotary embedding over (column, row), `merge_kernel_size` patches
    merged into one language-model token by the projector (LayerNorm per patch, Linear, GELU, Linear).
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int = 14
    num_channels: int = 3
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    merge_kernel_size: tuple[int, int] = (2, 2)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-5
    projector_hidden_size: int | None = None  # defaults to hidden_size (the projector's LayerNorm width)
    projector_layer_norm_eps: float = 1e-5
    projector_hidden_act: str = "gelu"

    def __post_init__(self):
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_size(self) -> int:
        """Patches merged into one token (kh * kw)."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size * self.patch_size

    def validate(self) -> None:
        def need(name: str, ok: bool, msg: str):
            if not ok:
                raise ConfigError(f"vision_config.{name}", msg)

        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "patch_size", "num_channels",
                     "pos_emb_height", "pos_emb_width", "pos_emb_time"):
            value = getattr(self, name)
            need(name, isinstance(value, int) and not isinstance(value, bool) and value > 0,
                 f"must be a positive integer, got {value!r}")
        need("num_attention_heads", self.hidden_size % self.num_heads == 0,
             f"({self.num_heads}) must divide hidden_size ({self.hidden_size})")
        need("num_attention_heads", self.head_dim % 4 == 0,
             f"head_dim {self.head_dim} must be a multiple of 4 for the 2-D rotary embedding")
        need("merge_kernel_size", len(self.merge_kernel_size) == 2 and all(
            isinstance(k, int) and k > 0 for k in self.merge_kernel_size),
             f"expected two positive integers, got {self.merge_kernel_size!r}")
        for name in ("hidden_act", "projector_hidden_act"):
            need(name, getattr(self, name) in VISION_ACTIVATIONS,
                 f"'{getattr(self, name)}' is not supported ({', '.join(VISION_ACTIVATIONS)})")
        if self.projector_hidden_size is not None:
            need("projection_hidden_size", self.projector_hidden_size == self.hidden_size,
                 f"({self.projector_hidden_size}) must equal the vision hidden_size ({self.hidden_size}): the "
                 "projector normalises each patch before merging")


QUANT_METHODS = ("fp8", "mxfp4", "compressed-tensors")
MXFP4_MODES = ("auto", "fused", "workspace", "offline")


@dataclass(frozen=True)
class MXFP4Execution:
    """How MXFP4 routed experts run (not read from config.json; set with `ModelConfig.replace(mxfp4=...)`).

    mode: "fused" converts each weight tile right before its MMA (no workspace); "workspace" converts a layer's
    active experts into the one-layer workspace (reused by every layer) and multiplies from it; "auto" picks
    "workspace" when the experts see at least `workspace_min_rows` token rows on average, "fused" below; "offline"
    means the experts were converted once, in full, at load (`model.mxfp4.convert_offline`).
    workspace_dtype: "float8_e4m3fn" (E2M1 values, E8M0 scales kept) or "bfloat16" (scales folded in).
    impl: the experts' kernel implementation ("pallas", "interpret", "reference"); None lets `kernels.dispatch`
    choose.
    """

    mode: str = "auto"
    workspace_dtype: str = "float8_e4m3fn"
    # H200 (benchmarks/moe.py, 2026-12-01, fourth session): fused ran faster than the workspace at every size
    # measured, up to 8192-token prefills (medium layer, 768 rows per expert: 3.44 against 4.55 ms; DeepSeek-size
    # layer, 256 rows: 36.2 against 61.0 ms), and faster than experts pre-converted to FP8 (4.22 / 46.5 ms).
    # So "auto" stays fused up to far larger calls than those (the workspace stays available as a mode).
    workspace_min_rows: int = 4096
    impl: str | None = None

    def uses_workspace(self, n_tokens: int, top_k: int, n_experts: int) -> bool:
        """Whether a layer call over `n_tokens` tokens converts into the workspace (static: decided by shapes)."""
        if self.mode != "auto":
            return self.mode == "workspace"
        return n_tokens * top_k >= self.workspace_min_rows * min(n_experts, n_tokens * top_k)


@dataclass(frozen=True)
class ModelConfig:
    """Every architecture of the family as one frozen dataclass.

    `layer_types[i]` is "kda" or "mla"; `mlp_types[i]` is "dense" or "moe". MLA layers use DSA (the lightning
    indexer's top-k selection) when `index_topk > 0`.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    # MLA
    num_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_bias: bool = False
    mla_use_rope: bool = True
    rope: RopeConfig = field(default_factory=RopeConfig)
    # DSA indexer
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    index_fp8: bool = False  # inference option (not in config.json): FP8 indexer (Hadamard + e4m3), see kernels/fp8_indexer
    # KDA
    kda_num_heads: int = 0
    kda_head_dim: int = 0
    kda_conv_size: int = 4
    kda_gate_lower_bound: float | None = None
    # MoE
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    router_activation: str = "sigmoid"
    routed_scaling_factor: float = 1.0
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    router_bias: bool = True  # noaux_tc: e_score_correction_bias added for selection only
    # special tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # storage
    checkpoint_dtype: str | None = None
    quant_method: str | None = None
    weight_block_size: tuple[int, int] | None = None
    packed_int: tuple[int, int] | None = None  # compressed-tensors pack-quantized: (bits, group size)
    num_mtp_layers: int = 0
    mxfp4: MXFP4Execution = field(default_factory=MXFP4Execution)
    # vision (kimi_k25): the MoonViT tower and the token id whose positions receive image features
    vision: VisionConfig | None = None
    image_token_id: int | None = None

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def use_dsa(self) -> bool:
        return self.index_topk > 0

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def mla_softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.mla_use_rope:
            scale *= self.rope.softmax_scale_multiplier()
        return scale

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def need(name: str, ok: bool, msg: str):
            if not ok:
                raise ConfigError(name, msg)

        for name in ("vocab_size", "hidden_size", "num_layers"):
            need(name, isinstance(getattr(self, name), int) and getattr(self, name) > 0, "must be a positive integer")
        need("layer_types", len(self.layer_types) == self.num_layers,
             f"has {len(self.layer_types)} entries for {self.num_layers} layers")
        need("mlp_types", len(self.mlp_types) == self.num_layers,
             f"has {len(self.mlp_types)} entries for {self.num_layers} layers")
        bad = sorted({t for t in self.layer_types if t not in (LAYER_KDA, LAYER_MLA)})
        need("layer_types", not bad, f"unknown layer type(s) {bad}")
        bad = sorted({t for t in self.mlp_types if t not in (MLP_DENSE, MLP_MOE)})
        need("mlp_types", not bad, f"unknown mlp type(s) {bad}")
        need("hidden_act", self.hidden_act == "silu", f"'{self.hidden_act}' is not supported (only 'silu')")
        if LAYER_MLA in self.layer_types:
            for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                need(name, getattr(self, name) > 0, "must be positive for MLA layers")
            need("qk_rope_head_dim", self.qk_rope_head_dim >= 0 and self.qk_rope_head_dim % 2 == 0,
                 "must be a non-negative even number")
            if self.q_lora_rank is not None:
                need("q_lora_rank", self.q_lora_rank > 0, "must be positive or null")
            need("rope.kind", self.rope.kind in ("default", "yarn"),
                 f"rope type '{self.rope.kind}' is not supported (default, yarn)")
            if self.rope.kind == "yarn":
                need("rope_scaling.factor", self.rope.factor > 0, "must be positive for YaRN")
                need("rope_scaling.original_max_position_embeddings",
                     self.rope.original_max_position_embeddings is not None, "is required for YaRN")
        if self.use_dsa:
            need("index_n_heads", self.index_n_heads > 0, "must be positive when index_topk > 0")
            need("index_head_dim", self.index_head_dim >= self.qk_rope_head_dim,
                 f"({self.index_head_dim}) must be at least qk_rope_head_dim ({self.qk_rope_head_dim})")
            need("q_lora_rank", self.q_lora_rank is not None, "DSA's indexer reads the q-LoRA latent: it must be set")
            need("layer_types", LAYER_MLA in self.layer_types, "index_topk is set but there is no MLA layer")
            if self.index_fp8:
                need("index_head_dim", self.index_head_dim & (self.index_head_dim - 1) == 0,
                     f"({self.index_head_dim}) must be a power of two for the FP8 indexer's Hadamard rotation")
        if LAYER_KDA in self.layer_types:
            need("linear_attn_config.num_heads", self.kda_num_heads > 0, "must be positive for KDA layers")
            need("linear_attn_config.head_dim", self.kda_head_dim > 0, "must be positive for KDA layers")
            need("linear_attn_config.short_conv_kernel_size", self.kda_conv_size >= 1, "must be at least 1")
        if MLP_DENSE in self.mlp_types:
            need("intermediate_size", self.intermediate_size > 0, "must be positive for dense MLP layers")
        if MLP_MOE in self.mlp_types:
            need("num_experts", self.num_experts > 0, "must be positive for MoE layers")
            need("num_experts_per_token", 0 < self.num_experts_per_token <= self.num_experts,
                 f"({self.num_experts_per_token}) must be in 1..num_experts ({self.num_experts})")
            need("moe_intermediate_size", self.moe_intermediate_size > 0, "must be positive for MoE layers")
            need("router_activation", self.router_activation in ("sigmoid", "softmax"),
                 f"'{self.router_activation}' is not supported (sigmoid, softmax)")
            need("n_group", self.n_group >= 1 and self.num_experts % self.n_group == 0,
                 f"({self.n_group}) must divide num_experts ({self.num_experts})")
            need("topk_group", 1 <= self.topk_group <= self.n_group,
                 f"({self.topk_group}) must be in 1..n_group ({self.n_group})")
            if self.n_group > 1:
                need("n_group", self.num_experts // self.n_group >= 2,
                     "grouped top-k scores each group by its best two experts: groups need at least 2")
                need("num_experts_per_token",
                     self.num_experts_per_token <= self.topk_group * (self.num_experts // self.n_group),
                     "exceeds the experts available in the selected groups")
        if self.vision is not None:
            need("image_token_id", isinstance(self.image_token_id, int) and 0 <= self.image_token_id < self.vocab_size,
                 f"({self.image_token_id}) must be a token id in 0..{self.vocab_size - 1}")
        if self.quant_method is not None:
            need("quantization_config.quant_method", self.quant_method in QUANT_METHODS,
                 f"'{self.quant_method}' is not supported ({', '.join(QUANT_METHODS)})")
        if self.quant_method == "mxfp4" and MLP_MOE in self.mlp_types:
            need("moe_intermediate_size", self.moe_intermediate_size % 2 == 0,
                 f"({self.moe_intermediate_size}) must be even for MXFP4 experts")
        need("mxfp4.mode", self.mxfp4.mode in MXFP4_MODES, f"'{self.mxfp4.mode}' is not one of {MXFP4_MODES}")
        need("mxfp4.workspace_dtype", self.mxfp4.workspace_dtype in ("float8_e4m3fn", "bfloat16"),
             f"'{self.mxfp4.workspace_dtype}' is not one of ('float8_e4m3fn', 'bfloat16')")
        need("mxfp4.workspace_min_rows", self.mxfp4.workspace_min_rows >= 1, "must be at least 1")
        need("mxfp4.impl", self.mxfp4.impl in (None, "reference", "pallas", "interpret"),
             f"'{self.mxfp4.impl}' is not one of None, 'reference', 'pallas', 'interpret'")

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Reads `path/config.json` (or `path` itself when it is a file)."""
        path = os.fspath(path)
        file = path if os.path.isfile(path) else os.path.join(path, "config.json")
        try:
            with open(file) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ConfigError("config.json", f"no config.json at {file}") from None
        except json.JSONDecodeError as e:
            raise ConfigError("config.json", f"{file} is not valid JSON: {e}") from None
        return cls.from_hf_dict(raw)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parses a hub config dict, in the published form or in the form transformers writes."""
        if not isinstance(raw, dict):
            raise ConfigError("config.json", "must be a JSON object")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError("model_type", f"unknown model_type {model_type!r}; supported: "
                              + ", ".join(SUPPORTED_MODEL_TYPES))
        r = _Reader(raw)
        if model_type == "kimi_linear":
            return _parse_kimi_linear(r)
        if model_type == "kimi_k25":
            return _parse_kimi_k25(r)
        return _parse_deepseek(r, model_type)


class _Reader:
    """Typed access to a raw config dict with aliases; every error names the field."""

    def __init__(self, raw: dict[str, Any]):
        self.raw = raw

    def get(self, *names: str, default: Any = None, kind: type | tuple | None = None, required: bool = False):
        for name in names:
            if name in self.raw and self.raw[name] is not None:
                value = self.raw[name]
                if kind is not None and not _is_kind(value, kind):
                    raise ConfigError(name, f"expected {_kind_name(kind)}, got {value!r}")
                return value
        if required:
            raise ConfigError(names[0], "is required")
        return default

    def int(self, *names, default=None, required=False) -> int | None:
        return self.get(*names, default=default, kind=int, required=required)

    def float(self, *names, default=None, required=False) -> float | None:
        v = self.get(*names, default=default, kind=(int, float), required=required)
        return None if v is None else float(v)


def _is_kind(value, kind) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False
    return isinstance(value, kinds)


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _eos_ids(r: _Reader) -> tuple[int, ...]:
    eos = r.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError("eos_token_id", f"expected an integer or a list of integers, got {eos!r}")
    return tuple(ids)


def _parse_rope(r: _Reader) -> RopeConfig:
    params = r.get("rope_parameters", "rope_scaling", default=None, kind=dict)
    field_name = "rope_parameters" if "rope_parameters" in r.raw else "rope_scaling"
    theta = r.float("rope_theta", default=None)
    if params is None:
        return RopeConfig(theta=theta if theta is not None else 10000.0)
    p = _Reader(params)
    kind = p.get("rope_type", "type", default="default", kind=str)
    if theta is None:
        theta = p.float("rope_theta", default=10000.0)
    if kind not in ("default", "yarn"):
        raise ConfigError(f"{field_name}.rope_type", f"rope type '{kind}' is not supported (default, yarn)")
    if kind == "default":
        return RopeConfig(theta=theta)
    omax = p.int("original_max_position_embeddings", default=r.int("original_max_position_embeddings"))
    factor = p.float("factor", default=None)
    if factor is None:
        if omax is None:
            raise ConfigError(f"{field_name}.factor", "YaRN needs factor or original_max_position_embeddings")
        factor = r.int("max_position_embeddings", required=True) / omax
    if omax is None:
        omax = r.int("max_position_embeddings", default=None)
        if omax is None:
            raise ConfigError(f"{field_name}.original_max_position_embeddings", "is required for YaRN")
    return RopeConfig(
        theta=theta, kind="yarn", factor=factor, original_max_position_embeddings=omax,
        beta_fast=p.float("beta_fast", default=32.0) or 32.0, beta_slow=p.float("beta_slow", default=1.0) or 1.0,
        mscale=p.float("mscale"), mscale_all_dim=p.float("mscale_all_dim"),
        attention_factor=p.float("attention_factor"), truncate=bool(p.get("truncate", default=True, kind=bool)),
    )


def _mlp_types(r: _Reader, n_layers: int, first_dense_default: int) -> tuple[str, ...]:
    listed = r.get("mlp_layer_types", kind=list)
    if listed is not None:
        if len(listed) != n_layers:
            raise ConfigError("mlp_layer_types", f"has {len(listed)} entries for {n_layers} layers")
        mapping = {"dense": MLP_DENSE, "sparse": MLP_MOE, "moe": MLP_MOE}
        bad = sorted({str(t) for t in listed if t not in mapping})
        if bad:
            raise ConfigError("mlp_layer_types", f"unknown entries {bad} (dense, sparse)")
        return tuple(mapping[t] for t in listed)
    first_dense = r.int("first_k_dense_replace", default=first_dense_default)
    freq = r.int("moe_layer_freq", default=1)
    if freq < 1:
        raise ConfigError("moe_layer_freq", "must be at least 1")
    has_experts = (r.int("num_experts", "n_routed_experts", "num_local_experts", default=0) or 0) > 0
    return tuple(MLP_MOE if has_experts and i >= first_dense and i % freq == 0 else MLP_DENSE for i in range(n_layers))


def _moe_fields(r: _Reader) -> dict[str, Any]:
    topk_method = r.get("topk_method", default="noaux_tc", kind=str)
    if topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise ConfigError("topk_method", f"'{topk_method}' is not supported (noaux_tc, greedy, group_limited_greedy)")
    activation = r.get("moe_router_activation_func", "scoring_func", default="sigmoid", kind=str)
    grouped = r.get("use_grouped_topk", default=True, kind=bool)
    n_group = r.int("n_group", "num_expert_group", default=1) if grouped else 1
    topk_group = r.int("topk_group", default=1) if grouped else 1
    if topk_method == "greedy":
        n_group, topk_group = 1, 1
    return dict(
        num_experts=r.int("num_experts", "n_routed_experts", "num_local_experts", default=0),
        num_experts_per_token=r.int("num_experts_per_token", "num_experts_per_tok", default=0),
        moe_intermediate_size=r.int("moe_intermediate_size", default=0),
        num_shared_experts=r.int("num_shared_experts", "n_shared_experts", default=0),
        router_activation=activation,
        routed_scaling_factor=r.float("routed_scaling_factor", default=1.0),
        renormalize=bool(r.get("moe_renormalize", "norm_topk_prob", default=True, kind=bool)),
        n_group=n_group, topk_group=topk_group, router_bias=topk_method == "noaux_tc",
    )


def _quant_fields(r: _Reader) -> dict[str, Any]:
    q = r.get("quantization_config", kind=dict)
    if q is None:
        return {}
    qr = _Reader(q)
    method = qr.get("quant_method", kind=str, required=True)
    out: dict[str, Any] = {"quant_method": method}
    if method == "fp8":
        block = qr.get("weight_block_size", default=[128, 128], kind=list)
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ConfigError("quantization_config.weight_block_size", f"expected two positive integers, got {block}")
        fmt = qr.get("fmt", default="e4m3", kind=str)
        if fmt != "e4m3":
            raise ConfigError("quantization_config.fmt", f"'{fmt}' is not supported (e4m3)")
        out["weight_block_size"] = (block[0], block[1])
    elif method == "compressed-tensors":
        out["packed_int"] = _packed_int_scheme(qr)
    return out


def _packed_int_scheme(qr: _Reader) -> tuple[int, int]:
    """compressed-tensors' `pack-quantized` format with one weight scheme: symmetric integers of `num_bits` (<= 8)
    with one scale per `group_size` inputs (Moonshot's INT4 Kimi K2-Thinking / K2.5) -> (bits, group size)."""
    field = "quantization_config."
    groups = qr.get("config_groups", kind=dict, required=True)
    if len(groups) != 1:
        raise ConfigError(field + "config_groups", f"one weight scheme is supported, got {len(groups)}")
    name, group = next(iter(groups.items()))
    where = f"{field}config_groups.{name}"
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise ConfigError(where + ".weights", "expected an object")
    if group.get("input_activations") is not None:
        raise ConfigError(where + ".input_activations", "quantized activations are not supported (weights only)")
    fmt = group.get("format") or qr.get("format", kind=str)
    if fmt != "pack-quantized":
        raise ConfigError(field + "format", f"'{fmt}' is not supported (pack-quantized)")
    weights = group["weights"]
    expected = {"type": "int", "symmetric": True, "strategy": "group"}
    for key, value in expected.items():
        if weights.get(key) != value:
            raise ConfigError(f"{where}.weights.{key}", f"{weights.get(key)!r} is not supported ({value!r})")
    bits, size = weights.get("num_bits"), weights.get("group_size")
    if not (isinstance(bits, int) and 1 <= bits <= 8 and 32 % bits == 0):
        raise ConfigError(where + ".weights.num_bits", f"expected 1, 2, 4 or 8, got {bits!r}")
    if not (isinstance(size, int) and size > 0):
        raise ConfigError(where + ".weights.group_size", f"expected a positive integer, got {size!r}")
    return bits, size


def _common(r: _Reader, n_layers: int) -> dict[str, Any]:
    return dict(
        vocab_size=r.int("vocab_size", required=True),
        hidden_size=r.int("hidden_size", required=True),
        num_layers=n_layers,
        intermediate_size=r.int("intermediate_size", default=0),
        rms_norm_eps=r.float("rms_norm_eps", default=1e-6),
        hidden_act=r.get("hidden_act", default="silu", kind=str),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", default=False, kind=bool)),
        num_heads=r.int("num_attention_heads", default=0),
        q_lora_rank=r.int("q_lora_rank", default=None),
        kv_lora_rank=r.int("kv_lora_rank", default=0),
        qk_nope_head_dim=r.int("qk_nope_head_dim", default=0),
        qk_rope_head_dim=r.int("qk_rope_head_dim", default=0),
        v_head_dim=r.int("v_head_dim", default=0),
        attention_bias=bool(r.get("attention_bias", default=False, kind=bool)),
        index_n_heads=r.int("index_n_heads", default=0),
        index_head_dim=r.int("index_head_dim", default=0),
        index_topk=r.int("index_topk", default=0),
        bos_token_id=r.int("bos_token_id"),
        eos_token_ids=_eos_ids(r),
        pad_token_id=r.int("pad_token_id"),
        checkpoint_dtype=r.get("dtype", "torch_dtype", kind=str),
        **_moe_fields(r),
        **_quant_fields(r),
    )


def _check_kv_heads(r: _Reader):
    kv = r.int("num_key_value_heads")
    heads = r.int("num_attention_heads")
    if kv is not None and heads is not None and kv != heads:
        raise ConfigError("num_key_value_heads", f"MLA needs num_key_value_heads == num_attention_heads ({heads}), got {kv}")


def _parse_deepseek(r: _Reader, model_type: str) -> ModelConfig:
    n = r.int("num_hidden_layers", required=True)
    _check_kv_heads(r)
    fields = _common(r, n)
    if model_type != "deepseek_v32":
        fields.update(index_n_heads=0, index_head_dim=0, index_topk=0)
    return ModelConfig(
        model_type=model_type,
        layer_types=(LAYER_MLA,) * n,
        mlp_types=_mlp_types(r, n, first_dense_default=3 if model_type == "deepseek_v32" else 0),
        max_position_embeddings=r.int("max_position_embeddings", default=4096),
        mla_use_rope=True,
        rope=_parse_rope(r),
        num_mtp_layers=r.int("num_nextn_predict_layers", "num_mtp_layers", default=0),
        **fields,
    )


def _parse_kimi_linear(r: _Reader) -> ModelConfig:
    n = r.int("num_hidden_layers", required=True)
    _check_kv_heads(r)
    lac = r.get("linear_attn_config", kind=dict)
    lr = _Reader(lac or {})
    prefix = "linear_attn_config." if lac is not None else ""
    layer_types = _kimi_layer_types(r, lr, n, prefix)
    kda_heads = lr.int("num_heads", default=None) if lac is not None else None
    kda_dim = lr.int("head_dim", default=None) if lac is not None else None
    conv = lr.int("short_conv_kernel_size", default=None) if lac is not None else None
    lower = lr.float("gate_lower_bound", default=None) if lac is not None else None
    fields = _common(r, n)
    use_nope = r.get("mla_use_nope", default=True, kind=bool)
    return ModelConfig(
        model_type="kimi_linear",
        layer_types=layer_types,
        mlp_types=_mlp_types(r, n, first_dense_default=1),
        max_position_embeddings=r.int("model_max_length", "max_position_embeddings", default=1048576),
        mla_use_rope=not use_nope,
        rope=_parse_rope(r),
        kda_num_heads=kda_heads if kda_heads is not None else r.int("linear_num_heads", default=32),
        kda_head_dim=kda_dim if kda_dim is not None else r.int("linear_head_dim", default=128),
        kda_conv_size=conv if conv is not None else r.int("linear_conv_kernel_dim", default=4),
        kda_gate_lower_bound=lower if lower is not None else r.float("linear_gate_lower_bound", "gate_lower_bound"),
        **fields,
    )


def _kimi_layer_types(r: _Reader, lr: _Reader, n: int, prefix: str) -> tuple[str, ...]:
    listed = r.get("layer_types", kind=list)
    if listed is not None:
        if len(listed) != n:
            raise ConfigError("layer_types", f"has {len(listed)} entries for {n} layers")
        mapping = {"linear_attention": LAYER_KDA, "full_attention": LAYER_MLA, "kda": LAYER_KDA, "mla": LAYER_MLA}
        bad = sorted({str(t) for t in listed if t not in mapping})
        if bad:
            raise ConfigError("layer_types", f"unknown entries {bad} (linear_attention, full_attention)")
        return tuple(mapping[t] for t in listed)
    kda = lr.get("kda_layers", kind=list)
    full = lr.get("full_attn_layers", kind=list)
    if kda is None or full is None:
        return tuple(LAYER_MLA if i and i % 4 == 0 else LAYER_KDA for i in range(n))
    types: list[str | None] = [None] * n
    for name, ids, kind in (("full_attn_layers", full, LAYER_MLA), ("kda_layers", kda, LAYER_KDA)):
        for i in ids:
            if not isinstance(i, int) or not 1 <= i <= n:
                raise ConfigError(f"{prefix}{name}", f"layer {i!r} is outside 1..{n} (the list is 1-indexed)")
            if types[i - 1] is not None:
                raise ConfigError(f"{prefix}{name}", f"layer {i} is listed both as KDA and as full attention")
            types[i - 1] = kind
    missing = [i + 1 for i, t in enumerate(types) if t is None]
    if missing:
        raise ConfigError(f"{prefix}kda_layers", f"layers {missing} are in neither kda_layers nor full_attn_layers")
    return tuple(types)  # type: ignore[arg-type]


def _nested(prefix: str, parse, *args):
    """Runs `parse(*args)`, naming fields of a nested dict with `prefix` (e.g. `text_config.hidden_size`)."""
    try:
        return parse(*args)
    except ConfigError as e:
        if e.field.startswith(prefix):
            raise
        raise ConfigError(prefix + e.field, e.reason) from None


def _parse_kimi_k25(r: _Reader) -> ModelConfig:
    """kimi_k25: a deepseek_v3/kimi_k2 `text_config` (or a kimi_linear one: a K3-style hybrid with vision), a MoonViT
    `vision_config` and the image placeholder id."""
    text = r.get("text_config", kind=dict, required=True)
    vision = r.get("vision_config", kind=dict, required=True)
    text_type = text.get("model_type", "deepseek_v3")
    if text_type not in KIMI_K25_TEXT_TYPES:
        raise ConfigError("text_config.model_type", f"{text_type!r} is not supported for kimi_k25 ("
                          + ", ".join(KIMI_K25_TEXT_TYPES) + ")")
    # Fields the published form keeps at the top level fill in where text_config lacks them.
    inherited = ("dtype", "torch_dtype", "quantization_config", "bos_token_id", "eos_token_id", "pad_token_id")
    text = {**{k: r.raw[k] for k in inherited if r.raw.get(k) is not None}, **text}
    if "tie_word_embeddings" in r.raw:  # the top-level flag decides (transformers ties lm_head from it)
        text["tie_word_embeddings"] = r.raw["tie_word_embeddings"]
    if text_type == "kimi_linear":
        config = _nested("text_config.", _parse_kimi_linear, _Reader(text))
    else:
        config = _nested("text_config.", _parse_deepseek, _Reader(text), text_type)
    moonvit = _nested("vision_config.", _parse_moonvit, _Reader(vision), r, config.hidden_size)
    image_token = r.int("image_token_id", "media_placeholder_token_id", default=163605)
    return config.replace(model_type="kimi_k25", vision=moonvit, image_token_id=image_token)


def _parse_moonvit(v: _Reader, top: _Reader, text_hidden: int) -> VisionConfig:
    """The vision_config in the form transformers writes or the published one (`vt_*`, `init_pos_emb_*`)."""
    for name, supported in (("pos_emb_type", "divided_fixed"), ("merge_type", "sd2_tpool"),
                            ("mm_projector_type", "patchmerger"), ("norm_type", "layernorm"),
                            ("pos_emb_interpolation_mode", "bicubic")):
        value = v.get(name, kind=str)
        if value is not None and value != supported:
            raise ConfigError(name, f"{value!r} is not supported (only {supported!r})")
    hidden = v.int("hidden_size", "vt_hidden_size", required=True)
    qkv = v.int("qkv_hidden_size")
    if qkv is not None and qkv != hidden:
        raise ConfigError("qkv_hidden_size", f"({qkv}) must equal vt_hidden_size ({hidden})")
    out = v.int("text_hidden_size")
    if out is not None and out != text_hidden:
        raise ConfigError("text_hidden_size", f"({out}) must equal text_config.hidden_size ({text_hidden})")
    merge = v.get("merge_kernel_size", default=[2, 2], kind=(list, int))
    merge = (merge, merge) if isinstance(merge, int) else tuple(merge)
    rope = v.get("rope_parameters", kind=dict)
    theta = v.float("rope_theta", default=10000.0)
    if rope is not None:
        kind = rope.get("rope_type", "axial")
        if kind != "axial":
            raise ConfigError("rope_parameters.rope_type", f"{kind!r} is not supported (axial)")
        theta = _Reader(rope).float("rope_theta", default=theta)
    projector_width = top.int("projection_hidden_size", default=None)
    if projector_width is None:
        projector_width = v.int("mm_hidden_size", default=None)
    projector_eps = top.float("projection_layer_norm_eps", default=None)
    if projector_eps is None:
        projector_eps = v.float("projector_ln_eps", default=1e-5)
    return VisionConfig(
        hidden_size=hidden,
        intermediate_size=v.int("intermediate_size", "vt_intermediate_size", required=True),
        num_layers=v.int("num_hidden_layers", "vt_num_hidden_layers", required=True),
        num_heads=v.int("num_attention_heads", "vt_num_attention_heads", required=True),
        patch_size=v.int("patch_size", default=14),
        num_channels=v.int("num_channels", default=3),
        pos_emb_height=v.int("pos_emb_height", "init_pos_emb_height", default=64),
        pos_emb_width=v.int("pos_emb_width", "init_pos_emb_width", default=64),
        pos_emb_time=v.int("pos_emb_time", "init_pos_emb_time", default=4),
        merge_kernel_size=merge,
        hidden_act=v.get("hidden_act", default="gelu_pytorch_tanh", kind=str),
        rope_theta=theta,
        projector_hidden_size=projector_width,
        projector_layer_norm_eps=projector_eps,
        projector_hidden_act=v.get("projector_hidden_act", default="gelu", kind=str),
    )
