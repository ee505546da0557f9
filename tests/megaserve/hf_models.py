"""Tiny random HF checkpoints of each supported family, written with ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import torch

# name → (family, config overrides). Together they vary the GQA ratio, head_dim, the
# number of experts, top-k ∈ {1, 2, 4}, norm_topk_prob, the shared expert, dense layers,
# tied embeddings and sharded weights.
VARIANTS = {
    "mixtral-gqa2-top2": ("mixtral", dict(num_attention_heads=4, num_key_value_heads=2,
                                          num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-mha-top1-tied": ("mixtral", dict(num_attention_heads=4, num_key_value_heads=4,
                                              num_local_experts=8, num_experts_per_tok=1,
                                              tie_word_embeddings=True)),
    "qwen2-shared-dense-top4": ("qwen2_moe", dict(num_attention_heads=4, num_key_value_heads=1,
                                                  num_experts=8, num_experts_per_tok=4,
                                                  mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen2-sparse-step2-norm": ("qwen2_moe", dict(num_attention_heads=4, num_key_value_heads=2,
                                                  num_experts=6, num_experts_per_tok=2,
                                                  decoder_sparse_step=2, norm_topk_prob=True)),
    "qwen3-headdim48-sharded": ("qwen3_moe", dict(num_attention_heads=8, num_key_value_heads=2,
                                                  head_dim=48, num_experts=8, num_experts_per_tok=2,
                                                  norm_topk_prob=True)),
    "qwen3-top1-dense0": ("qwen3_moe", dict(num_attention_heads=4, num_key_value_heads=4,
                                            head_dim=16, num_experts=4, num_experts_per_tok=1,
                                            mlp_only_layers=[0], norm_topk_prob=False)),
}


def make_checkpoint(directory: Path, family: str, seed: int = 0, shard: bool = False, **overrides):
    """Write a random checkpoint of ``family`` into ``directory``; returns the HF model."""
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    base = dict(vocab_size=160, hidden_size=64, num_hidden_layers=3, max_position_embeddings=512,
                rope_theta=10000.0, initializer_range=0.08)
    if family == "mixtral":
        config = MixtralConfig(**{**base, "intermediate_size": 48, **overrides})
        model_cls = MixtralForCausalLM
    elif family == "qwen2_moe":
        config = Qwen2MoeConfig(**{**base, "intermediate_size": 96, "moe_intermediate_size": 32,
                                   "shared_expert_intermediate_size": 80, **overrides})
        model_cls = Qwen2MoeForCausalLM
    else:
        config = Qwen3MoeConfig(**{**base, "intermediate_size": 96, "moe_intermediate_size": 32,
                                   **overrides})
        model_cls = Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(directory, max_shard_size="100KB" if shard else "5GB")
    return model
