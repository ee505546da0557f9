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


# Linear weights DeepSeek's block-FP8 checkpoints store in e4m3 (router gates, embeddings,
# the LM head and norms stay in the checkpoint's dtype).
FP8_SUFFIXES = ("_proj.weight", "_proj_with_mqa.weight", ".w1.weight", ".w2.weight", ".w3.weight")


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Rewrite the safetensors checkpoint ``src`` into ``dst`` in DeepSeek's block-FP8 format
    (e4m3 weights, ``weight_scale_inv`` `[ceil(N/bn), ceil(K/bk)]` = block amax / 448,
    ``quantization_config`` in config.json). Returns every tensor of the dequantized model
    (``fp8.float() * scale`` of its block, float32): what HF runs as the reference."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors |= load_file(str(file))
    out, reference = {}, {}
    bn, bk = block
    for name, w in tensors.items():
        if not name.endswith(FP8_SUFFIXES) or w.dim() != 2:
            out[name] = reference[name] = w
            continue
        n, k = w.shape
        rows, cols = -(-n // bn), -(-k // bk)
        scale = torch.ones(rows, cols)
        q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        deq = torch.empty(n, k)
        for r in range(rows):
            for c in range(cols):
                tile = w[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk].float()
                amax = tile.abs().max().item()
                s = amax / 448.0 if amax > 0 else 1.0
                scale[r, c] = s
                qt = (tile / s).to(torch.float8_e4m3fn)
                q[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk] = qt
                deq[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk] = qt.float() * scale[r, c]
        out[name], reference[name] = q, deq
        out[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config))
    for extra in ("generation_config.json",):
        if (src / extra).is_file():
            shutil.copy(src / extra, dst / extra)
    return reference


# name → DeepseekV3Config overrides. Together: q_lora_rank or q_proj, interleaved or
# half-split rope, YaRN or plain rope, group-limited routing or one group, dense first layers.
DEEPSEEK_VARIANTS = {
    "deepseek-qlora-yarn-groups": dict(
        q_lora_rank=48, rope_interleave=True, n_group=4, topk_group=2, num_experts_per_tok=3,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=1.0,
                             beta_fast=32, beta_slow=1)),
    "deepseek-qproj-plainrope": dict(
        q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=2, norm_topk_prob=False, routed_scaling_factor=1.5,
        n_shared_experts=2, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
}


def make_deepseek_checkpoint(directory: Path, seed: int = 0, **overrides):
    """Write a tiny random ``DeepseekV3ForCausalLM`` checkpoint (float32) into
    ``directory``; returns the HF model. The routers' e_score_correction_bias is drawn
    (HF initialises it to zeros) so the bias-corrected choice is exercised."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**{
        "vocab_size": 160, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_routed_experts": 8, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
        "v_head_dim": 24, "max_position_embeddings": 512, "initializer_range": 0.08, **overrides})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0.0, 0.05)
    model.save_pretrained(directory)
    return model
