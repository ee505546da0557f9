"""ModelConfig: one normalised description of the supported MoE families.

HF config files differ by family and by transformers version (``rope_theta`` at the top
level or under ``rope_parameters``; ``num_experts`` or ``num_local_experts``); this module
is the one place that reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# HF `architectures[0]` → our family name.
SUPPORTED_ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

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
            return _from_hf(family, raw)
        except KeyError as e:
            raise ValueError(f"model: config.json lacks required field {e.args[0]!r}") from e


def _from_hf(family: str, raw: dict[str, Any]) -> ModelConfig:
    hidden = raw["hidden_size"]
    num_heads = raw["num_attention_heads"]
    num_layers = raw["num_hidden_layers"]
    rope = raw.get("rope_parameters") or {}
    rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"model: rope_type {rope['rope_type']!r} is not supported (only 'default')")
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
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        eos_token_ids=eos_ids,
    )
