"""Random-weight checkpoints with the layer shapes of real MoE models, for benchmarks.

``random:<preset>:<layers>`` (e.g. ``random:qwen3-30b-a3b:2``) names a Qwen3-MoE-format
checkpoint with the preset's per-layer dimensions and fewer layers, written once into the
cache directory. Weights are small random numbers: speed is realistic, text is not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

# Per-layer dimensions from the models' public config.json files.
PRESETS = {
    "qwen3-30b-a3b": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          vocab_size=151936),
    "mixtral-8x7b-like": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
                              vocab_size=32000),
}


def resolve_random_model(name: str) -> Path:
    """Path of the checkpoint named ``random:<preset>:<layers>``, written on first use."""
    try:
        _, preset, layers = name.split(":")
        num_layers = int(layers)
        dims = PRESETS[preset]
    except (ValueError, KeyError):
        raise ValueError(f"model: expected random:<preset>:<layers> with preset in {sorted(PRESETS)}, "
                         f"got {name!r}") from None
    root = Path(os.environ.get("MEGASERVE_CACHE", Path.home() / ".cache" / "megaserve"))
    path = root / "random" / f"{preset}-{num_layers}l"
    if not (path / "model.safetensors").is_file():
        _write(path, dims, num_layers)
    return path


def _write(path: Path, dims: dict, num_layers: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    d, e, inter = dims["hidden_size"], dims["num_experts"], dims["moe_intermediate_size"]
    hq, hkv, dh = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
    config = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=num_layers,
                  intermediate_size=4 * d, max_position_embeddings=8192, rms_norm_eps=1e-6,
                  rope_theta=1e6, norm_topk_prob=True, tie_word_embeddings=False, torch_dtype="bfloat16",
                  mlp_only_layers=[], decoder_sparse_step=1, **dims)
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).bfloat16()

    tensors = {"model.embed_tokens.weight": rand(dims["vocab_size"], d), "model.norm.weight": torch.ones(d).bfloat16(),
               "lm_head.weight": rand(dims["vocab_size"], d)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": torch.ones(d).bfloat16(),
                    p + "post_attention_layernorm.weight": torch.ones(d).bfloat16(),
                    p + "self_attn.q_proj.weight": rand(hq * dh, d), p + "self_attn.k_proj.weight": rand(hkv * dh, d),
                    p + "self_attn.v_proj.weight": rand(hkv * dh, d), p + "self_attn.o_proj.weight": rand(d, hq * dh),
                    p + "self_attn.q_norm.weight": torch.ones(dh).bfloat16(),
                    p + "self_attn.k_norm.weight": torch.ones(dh).bfloat16(),
                    p + "mlp.gate.weight": rand(e, d)}
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            tensors |= {q + "gate_proj.weight": rand(inter, d), q + "up_proj.weight": rand(inter, d),
                        q + "down_proj.weight": rand(d, inter)}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=1))
