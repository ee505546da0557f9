"""ModelConfig: one normalised description of the supported MoE families.

HF config files differ by family and by transformers version (``rope_theta`` at the top
level or under ``rope_parameters``; ``num_experts`` or ``num_local_experts``); this module
is the one place that reads them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megaserve.models.quantization import QuantConfig, quant_config_from_hf

# HF `architectures[0]` → our family name.
SUPPORTED_ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rotary scaling (``rope_type: yarn``), as HF transformers computes it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # None: derived from factor and the mscales
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError("config: rope_scaling.factor and original_max_position_embeddings "
                             "must be positive")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention dims (DeepSeek-V2/V3, Kimi-K2), validated.

    Per token and layer the cache holds ``kv_lora_rank + qk_rope_head_dim`` values: the
    normed latent and the rotated shared rope key.
    """

    q_lora_rank: int  # 0: q_proj reads the hidden state directly
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank < 0:
            raise ValueError(f"config: q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a MoE decoder (validated)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    # Per layer: True where the MLP is a routed MoE, False for a dense MLP.
    moe_layers: tuple[bool, ...]
    dense_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    # Routing: "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3: sigmoid scores, a
    # per-expert correction bias for the choice, group-limited top-k, scaled weights).
    scoring: str = "softmax"
    num_groups: int = 1  # n_group
    topk_groups: int = 1  # topk_group
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert
    mla: MLAConfig | None = None
    rope_scaling: YarnScaling | None = None
    quantization: QuantConfig | None = None  # the checkpoint's block-FP8 weights

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"unknown model family {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "num_experts", "top_k", "moe_intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"config: num_experts_per_tok ({self.top_k}) exceeds the number of experts "
                f"({self.num_experts})"
            )
        if len(self.moe_layers) != self.num_layers:
            raise ValueError("config: moe_layers must have one entry per layer")
        if not all(self.moe_layers) and self.dense_intermediate_size <= 0:
            raise ValueError("config: dense layers need intermediate_size > 0")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"config: scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if self.num_groups <= 0 or self.num_experts % self.num_groups:
            raise ValueError(f"config: n_group ({self.num_groups}) must divide the number of "
                             f"experts ({self.num_experts})")
        if not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"config: topk_group ({self.topk_groups}) must be in 1..n_group "
                             f"({self.num_groups})")
        if self.num_groups > 1 and self.num_experts // self.num_groups < 2:
            raise ValueError("config: group-limited routing needs at least 2 experts per group")
        if self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(f"config: num_experts_per_tok ({self.top_k}) exceeds the experts of "
                             f"topk_group ({self.topk_groups}) groups")
        if self.family == "deepseek_v3" and self.mla is None:
            raise ValueError("config: DeepseekV3ForCausalLM needs the MLA dims (kv_lora_rank, ...)")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def cache_kv_heads(self) -> int:
        """Heads per token of the KV cache (MLA: one latent "head")."""
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def cache_head_dim(self) -> int:
        """Values per cached head (MLA: kv_lora_rank + qk_rope_head_dim)."""
        return self.mla.cache_dim if self.mla is not None else self.head_dim

    @property
    def cache_shares_kv(self) -> bool:
        """True where the keys are the values (MLA's latent): the cache's K and V of a
        layer are one tensor, allocated once."""
        return self.mla is not None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` of an HF checkpoint directory.

        Raises ``ValueError`` naming the file for a missing or malformed config and naming
        the architecture for an unsupported one.
        """
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"model: no config.json in {path} (is it an HF checkpoint directory?)")
        try:
            raw = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"model: {config_path} is not valid JSON: {e}") from e
        return cls.from_hf_dict(raw)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Normalise an HF config dict (any supported family and transformers version)."""
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        family = SUPPORTED_ARCHITECTURES.get(arch)
        if family is None:
            raise ValueError(
                f"model: unsupported architecture {arch!r} (config.json 'architectures'); "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            quantization = quant_config_from_hf(raw)
            config = _from_deepseek(raw) if family == "deepseek_v3" else _from_hf(family, raw)
            return dataclasses.replace(config, quantization=quantization)
        except KeyError as e:
            raise ValueError(f"model: config.json lacks required field {e.args[0]!r}") from e


def _from_hf(family: str, raw: dict[str, Any]) -> ModelConfig:
    hidden = raw["hidden_size"]
    num_heads = raw["num_attention_heads"]
    num_layers = raw["num_hidden_layers"]
    rope_theta, rope_scaling = _rope(raw)
    if rope_scaling is not None:
        raise ValueError("model: rope_type 'yarn' is supported for DeepseekV3ForCausalLM only")
    num_experts = raw.get("num_local_experts") or raw.get("num_experts")
    if num_experts is None:
        raise KeyError("num_local_experts")
    if family == "mixtral":
        moe_layers = (True,) * num_layers
        moe_inter = raw["intermediate_size"]
        norm_topk = True
    else:
        mlp_only = set(raw.get("mlp_only_layers") or [])
        step = raw.get("decoder_sparse_step", 1) or 1
        moe_layers = tuple(
            i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        )
        moe_inter = raw["moe_intermediate_size"]
        norm_topk = bool(raw.get("norm_topk_prob", False))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    return ModelConfig(
        family=family,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or hidden // num_heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        num_experts=num_experts,
        top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=moe_inter,
        norm_topk_prob=norm_topk,
        moe_layers=moe_layers,
        dense_intermediate_size=raw.get("intermediate_size", 0) if family != "mixtral" else 0,
        shared_expert_intermediate_size=(
            raw.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
        ),
        qkv_bias=bool(raw.get("qkv_bias", True)) if family == "qwen2_moe"
        else bool(raw.get("attention_bias", False)),
        qk_norm=family == "qwen3_moe",
        shared_expert_gated=family == "qwen2_moe",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        eos_token_ids=eos_ids,
    )


def _rope(raw: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN scaling or None) from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (older files). ValueError for another rope type."""
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    theta = float(raw.get("rope_theta", rope.get("rope_theta", 10000.0)))
    params = {**scaling, **rope}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ValueError(f"model: rope_type {kind!r} is not supported ('default', 'yarn')")
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("model: rope_scaling.original_max_position_embeddings is required for yarn")
    if factor is None:
        factor = raw["max_position_embeddings"] / original
    return theta, YarnScaling(
        factor=float(factor), original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
    )


def _from_deepseek(raw: dict[str, Any]) -> ModelConfig:
    """DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi-K2). The multi-token-prediction layers
    (``num_nextn_predict_layers``, stored past the last decoder layer) are not loaded."""
    num_layers = raw["num_hidden_layers"]
    first_dense = raw.get("first_k_dense_replace") or 0
    step = raw.get("moe_layer_freq", 1) or 1
    num_experts = raw["n_routed_experts"]
    moe_layers = tuple(i >= first_dense and i % step == 0 for i in range(num_layers))
    mla = MLAConfig(
        q_lora_rank=raw.get("q_lora_rank") or 0,
        kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"],
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"model: scoring_func {scoring!r} is not supported for DeepseekV3 (only 'sigmoid')")
    method = raw.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ValueError(f"model: topk_method {method!r} is not supported (only 'noaux_tc')")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    if raw.get("attention_bias"):
        raise ValueError("model: attention_bias true is not supported for DeepseekV3")
    rope_theta, rope_scaling = _rope(raw)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    num_heads = raw["num_attention_heads"]
    moe_inter = raw["moe_intermediate_size"]
    return ModelConfig(
        family="deepseek_v3",
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=mla.qk_head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        num_experts=num_experts,
        top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=moe_inter,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        moe_layers=moe_layers,
        dense_intermediate_size=raw.get("intermediate_size", 0),
        shared_expert_intermediate_size=moe_inter * (raw.get("n_shared_experts") or 0),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        eos_token_ids=eos_ids,
        scoring="sigmoid",
        num_groups=raw.get("n_group") or 1,
        topk_groups=raw.get("topk_group") or 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        mla=mla,
        rope_scaling=rope_scaling,
    )
