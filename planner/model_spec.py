"""MoE model specs: parameter bytes per side, KV bytes per token, FLOPs per token.

A spec comes from an HF ``config.json`` (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) or
from a built-in name. The built-in dimensions are the values of each model's public
``config.json`` on the Hugging Face Hub (repository named in ``BUILTIN_SOURCES``).

"Attention side" = everything the attention worker holds: attention, norms, router gates,
shared experts, dense (non-MoE) layers, embeddings and the LM head. "Expert side" = the
routed experts of the MoE layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from megaserve.planner.errors import InputError


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions the performance model needs. Counts are parameters, not bytes."""

    name: str
    num_layers: int
    num_moe_layers: int
    hidden: int
    vocab: int
    num_experts: int
    top_k: int
    expert_params: int  # one routed expert of one layer
    attn_params_per_layer: int  # attention + norms + router (+ shared expert) of one MoE layer
    dense_mlp_params: int  # MLP of one dense (non-MoE) layer, 0 if none
    embed_params: int  # embeddings + LM head (not tied)
    head_params: int  # LM head alone
    kv_elems_per_token_layer: int  # cached elements per token per layer
    kv_heads: int  # heads the KV cache shards over under TP (1 for MLA: replicated)
    attn_flops_per_ctx_token: int  # per decoded token per layer per cached token
    weight_bytes: float = 2.0  # bytes per weight (2 = bf16, 1 = fp8)
    kv_bytes: float = 2.0  # bytes per cached element

    def __post_init__(self) -> None:
        if not 0 < self.num_moe_layers <= self.num_layers:
            raise ValueError(f"{self.name}: need 0 < num_moe_layers <= num_layers")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"{self.name}: need 0 < top_k <= num_experts")
        for f in ("hidden", "vocab", "expert_params", "attn_params_per_layer", "kv_elems_per_token_layer"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{self.name}: {f} must be positive")

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def attn_side_bytes(self) -> float:
        """All weights held by the attention side (before tensor parallelism)."""
        params = (
            self.num_layers * self.attn_params_per_layer
            + self.num_dense_layers * self.dense_mlp_params
            + self.embed_params
        )
        return params * self.weight_bytes

    @property
    def expert_bytes(self) -> float:
        """Bytes of one routed expert of one layer."""
        return self.expert_params * self.weight_bytes

    @property
    def expert_side_bytes(self) -> float:
        return self.num_moe_layers * self.num_experts * self.expert_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache bytes per token over all layers (before TP sharding)."""
        return self.num_layers * self.kv_elems_per_token_layer * self.kv_bytes

    @property
    def total_params(self) -> float:
        return (self.attn_side_bytes + self.expert_side_bytes) / self.weight_bytes


def _get(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    if default is None:
        raise InputError(f"config.json lacks {' / '.join(keys)}")
    return default


def spec_from_config(cfg: Mapping[str, Any], name: str = "config") -> ModelSpec:
    """Build a spec from a parsed HF config.json. Raises InputError for non-MoE configs."""
    h = int(_get(cfg, "hidden_size"))
    layers = int(_get(cfg, "num_hidden_layers"))
    vocab = int(_get(cfg, "vocab_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    experts = int(_get(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0))
    if experts <= 0:
        raise InputError(f"{name}: not a MoE config (no num_local_experts / num_experts / n_routed_experts)")
    top_k = int(_get(cfg, "num_experts_per_tok", "num_experts_per_token"))
    inter_e = int(_get(cfg, "moe_intermediate_size", "intermediate_size"))
    shared_i = int(cfg.get("shared_expert_intermediate_size") or 0)
    shared_i += int(cfg.get("n_shared_experts") or 0) * inter_e
    dense_layers = int(cfg.get("first_k_dense_replace") or 0)
    dense_layers += len(cfg.get("mlp_only_layers") or [])
    dense_i = int(cfg.get("intermediate_size") or 0) if dense_layers else 0
    router = h * experts + (h if cfg.get("shared_expert_intermediate_size") else 0)
    norms = 2 * h
    if cfg.get("kv_lora_rank"):  # DeepSeek-V2/V3 multi-head latent attention
        q_lora = int(cfg.get("q_lora_rank") or 0)
        nope, rope = int(_get(cfg, "qk_nope_head_dim")), int(_get(cfg, "qk_rope_head_dim"))
        v_dim, kv_lora = int(_get(cfg, "v_head_dim")), int(cfg["kv_lora_rank"])
        q_proj = h * q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        attn = q_proj + h * (kv_lora + rope) + kv_lora * heads * (nope + v_dim) + heads * v_dim * h
        kv_elems, kv_heads = kv_lora + rope, 1  # compressed latent + shared rope key, per token
        # absorbed MLA decode: scores over (kv_lora + rope) dims, values over kv_lora dims
        ctx_flops = 2 * heads * (2 * kv_lora + rope)
    else:
        hd = int(cfg.get("head_dim") or h // heads)
        kv = int(_get(cfg, "num_key_value_heads", default=heads))
        attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
        kv_elems, kv_heads = 2 * kv * hd, kv
        ctx_flops = 4 * heads * hd  # QK^T and PV
    tied = bool(cfg.get("tie_word_embeddings", False))
    qcfg = cfg.get("quantization_config") or {}
    weight_bytes = 1.0 if str(qcfg.get("quant_method", "")).lower() == "fp8" else 2.0
    return ModelSpec(
        name=name,
        num_layers=layers,
        num_moe_layers=layers - dense_layers,
        hidden=h,
        vocab=vocab,
        num_experts=experts,
        top_k=top_k,
        expert_params=3 * h * inter_e,
        attn_params_per_layer=attn + norms + router + 3 * h * shared_i,
        dense_mlp_params=3 * h * dense_i,
        embed_params=vocab * h * (1 if tied else 2),
        head_params=vocab * h,
        kv_elems_per_token_layer=kv_elems,
        kv_heads=kv_heads,
        attn_flops_per_ctx_token=ctx_flops,
        weight_bytes=weight_bytes,
    )


# Values of each model's public config.json (Hugging Face Hub repository in BUILTIN_SOURCES).
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False,
    ),
    "mixtral-8x22b": dict(
        model_type="mixtral", hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
        num_attention_heads=48, num_key_value_heads=8, vocab_size=32768, num_local_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, num_experts=128, num_experts_per_tok=8, mlp_only_layers=[],
        tie_word_embeddings=False,
    ),
    "qwen3-235b-a22b": dict(
        model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, num_experts=128, num_experts_per_tok=8, mlp_only_layers=[],
        tie_word_embeddings=False,
    ),
    "qwen2-57b-a14b": dict(
        model_type="qwen2_moe", hidden_size=3584, intermediate_size=18944, moe_intermediate_size=2560,
        shared_expert_intermediate_size=20480, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=151936, num_experts=64, num_experts_per_tok=8,
        tie_word_embeddings=False,
    ),
    "deepseek-v3": dict(
        model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
        tie_word_embeddings=False, quantization_config={"quant_method": "fp8"},
    ),
}

BUILTIN_SOURCES: dict[str, str] = {
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1/config.json",
    "mixtral-8x22b": "mistralai/Mixtral-8x22B-v0.1/config.json",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B/config.json",
    "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B/config.json",
    "qwen2-57b-a14b": "Qwen/Qwen2-57B-A14B/config.json",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3/config.json (fp8 weights as released)",
}


def load_model(name_or_path: str) -> ModelSpec:
    """A built-in name, a config.json path, or a directory holding config.json."""
    key = name_or_path.lower()
    if key in BUILTIN_CONFIGS:
        return spec_from_config(BUILTIN_CONFIGS[key], name=key)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise InputError(
            f"unknown model {name_or_path!r}: not a built-in ({', '.join(BUILTIN_CONFIGS)}) "
            "and no config.json at that path"
        )
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"cannot parse {str(path)!r} as JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{str(path)!r}: expected a JSON object")
    try:
        return spec_from_config(cfg, name=str(name_or_path))
    except ValueError as e:
        raise InputError(f"{str(path)!r}: {e}") from None
