"""The random presets of the models that need disaggregation: their shapes are the real
models' (parameter counts), and the random-weights path loads and runs a DeepSeek-V3
checkpoint (tiny dims here), in float32 and quantized to block-FP8 at load."""

from __future__ import annotations

import json
import math

import pytest

from megaserve import LLM, SamplingParams
from megaserve.bench.random_model import hf_config, parse_random_name
from megaserve.models.config import ModelConfig
from megaserve.models.random_weights import MARKER, tensor_shapes


@pytest.mark.parametrize("name, billions", [
    ("random:deepseek-v3:61", 671.0),  # DeepSeek-V3 without its MTP layer
    ("random:qwen3-235b-a22b:94", 235.1),
])
def test_preset_has_the_real_parameter_count(name, billions):
    preset, layers = parse_random_name(name)
    config = hf_config(preset, layers)
    params = sum(math.prod(s) for s in tensor_shapes(config).values())
    assert abs(params / 1e9 - billions) < 0.1
    assert ModelConfig.from_hf_dict(config).num_layers == layers


def test_deepseek_preset_dims():
    cfg = ModelConfig.from_hf_dict(hf_config("deepseek-v3", 5))
    assert cfg.moe_layers == (False, False, False, True, True)
    assert (cfg.cache_kv_heads, cfg.cache_head_dim, cfg.cache_shares_kv) == (1, 576, True)
    assert (cfg.num_groups, cfg.topk_groups, cfg.top_k, cfg.num_experts) == (8, 4, 8, 256)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 40


TINY_DEEPSEEK = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=128, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
    qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=256, torch_dtype="float32",
    rope_scaling=dict(type="yarn", factor=4, original_max_position_embeddings=64, mscale=1.0,
                      mscale_all_dim=1.0),
)


def test_random_deepseek_checkpoint_runs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_DEEPSEEK))
    (tmp_path / MARKER).write_text(json.dumps({"seed": 0}))
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}
    with LLM(model=str(tmp_path), dtype="float32") as llm:
        plain = llm.generate(prompt, params)[0].outputs[0]
    with LLM(model=str(tmp_path), dtype="float32", quantization="fp8") as llm:
        fp8 = llm.generate(prompt, params)[0].outputs[0]
    assert len(plain.token_ids) == len(fp8.token_ids) == 6
    assert plain.logprobs != fp8.logprobs  # the weights went through e4m3
    # Rounding the weights through e4m3 moves the best first logprob a little, not a lot.
    assert abs(max(plain.logprobs[0].values()) - max(fp8.logprobs[0].values())) < 0.5


def test_roofline_counts_mla_dense_and_shared_weights():
    from megaserve.bench import roofline

    cfg = ModelConfig.from_hf_dict(hf_config("deepseek-v3", 61))
    assert abs(roofline.weight_bytes(cfg, 1) / 1e9 - 671.0) < 0.1  # every weight, one byte
    one = roofline.decode_bytes(cfg, 1, 0.0, 2)
    assert one.kv_write == 61 * 576 * 2  # one latent row per token and layer, bf16
