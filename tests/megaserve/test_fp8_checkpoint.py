"""Block-FP8 checkpoints (DeepSeek's format) on CPU: refused where not understood, read
with their scales, equal to the dequantized model run through HF transformers.

The CPU path dequantizes at load (``fp8 * weight_scale_inv`` in float32, rounded once to
the compute dtype), so in float32 the model computes with exactly the weights the HF
reference is given: greedy tokens must be equal, logprobs within LOGPROB_TOL.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megaserve import LLM, SamplingParams
from megaserve.models.config import ModelConfig
from megaserve.models.loader import load_model
from megaserve.models.quantization import dequantize, quantize
from tests.megaserve.hf_models import make_checkpoint, write_fp8_checkpoint

LOGPROB_TOL = 1e-4
TIE_MARGIN = 1e-4
STEPS = 24
# Non-square blocks that do not divide the tiny dims: ragged edge blocks are exercised.
BLOCK = (16, 24)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    src = tmp_path_factory.mktemp("qwen3-bf")
    model = make_checkpoint(src, "qwen3_moe", num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            mlp_only_layers=[1])
    dst = tmp_path_factory.mktemp("qwen3-fp8")
    reference = write_fp8_checkpoint(src, dst, BLOCK)
    # The reference: HF's own loader reads the dequantized weights (it maps the per-expert
    # names onto its fused expert tensors).
    deq = tmp_path_factory.mktemp("qwen3-dequantized")
    save_file(reference, str(deq / "model.safetensors"))
    shutil.copy(src / "config.json", deq / "config.json")
    hf = type(model).from_pretrained(deq, dtype=torch.float32).eval()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(hf.model.layers[0].self_attn.q_proj.weight, reference[name])
    return src, dst, hf


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("quant, field", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method"),
    ({"quant_method": "awq"}, "quant_method"),
    ({"fmt": "e4m3", "weight_block_size": [128, 128]}, "quant_method"),
    ({"quant_method": "fp8"}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme"),
])
def test_unknown_quantization_config_is_refused_naming_the_field(qwen3, tmp_path, quant, field):
    path = _copy(qwen3[1], tmp_path)
    _edit_config(path, quantization_config=quant)
    with pytest.raises(ValueError, match=field) as info:
        ModelConfig.from_dir(path)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=field):
        LLM(model=str(path), dtype="float32")


def test_fp8_weight_without_scale_is_refused(qwen3, tmp_path):
    path = _copy(qwen3[1], tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="weight_scale_inv") as info:
        load_model(path, "float32")
    assert name in str(info.value)


def test_fp8_weight_without_quantization_config_is_refused(qwen3, tmp_path):
    path = _copy(qwen3[1], tmp_path)
    _edit_config(path, quantization_config=None)
    with pytest.raises(ValueError, match="quantization_config"):
        load_model(path, "float32")


def test_scale_of_the_wrong_shape_is_refused(qwen3, tmp_path):
    path = _copy(qwen3[1], tmp_path)
    _edit_config(path, quantization_config={"quant_method": "fp8", "weight_block_size": [32, 32]})
    with pytest.raises(ValueError, match="weight_block_size"):
        load_model(path, "float32")


def test_dequantize_matches_the_block_format():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 70, generator=g)
    q, scale = quantize(w, (16, 32))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 3)
    ref = q.double()
    for r in range(3):
        for c in range(3):
            ref[r * 16:(r + 1) * 16, c * 32:(c + 1) * 32] *= scale[r, c].double()
    got = dequantize(q, scale, (16, 32), torch.float64)
    # The product is computed in float32: the exact product rounded once.
    assert torch.equal(got, ref.float().double())
    # e4m3 keeps 3 mantissa bits: relative error of a block's largest values <= 2^-4.
    assert ((got - w.double()).abs() <= w.abs().double() * 2**-4 + scale.max() * 2**-9).all()


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 19, 40)]


def test_fp8_checkpoint_matches_dequantized_transformers(qwen3):
    _, path, hf = qwen3
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(model=str(path), dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    compared = 0
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].double(), -1)
        for step, token in enumerate(tokens):
            row = ref[len(prompt) - 1 + step]
            assert abs(out.outputs[0].logprobs[step][token] - row[token].item()) < LOGPROB_TOL
            top2 = torch.topk(row, 2)
            if (top2.values[0] - top2.values[1]).item() < TIE_MARGIN:
                break
            assert token == top2.indices[0].item(), f"step {step}: greedy token differs"
            compared += 1
    assert compared >= 16


def test_quantize_at_load_equals_the_fp8_checkpoint(qwen3, tmp_path):
    """``quantization="fp8"`` on a float checkpoint computes with the weights a block-FP8
    checkpoint of it (128 x 128 blocks, written here) holds: bitwise the same outputs."""
    src = qwen3[0]
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            out[name], out[name.removesuffix(".weight") + ".weight_scale_inv"] = quantize(w)
        else:
            out[name] = w
    path = tmp_path / "fp8-128"
    path.mkdir()
    save_file(out, str(path / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
    prompt = {"prompt_token_ids": _prompts(100)[1]}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    with LLM(model=str(path), dtype="float32") as llm:
        ref = llm.generate(prompt, params)[0].outputs[0]
    with LLM(model=str(src), dtype="float32", quantization="fp8") as llm:
        got = llm.generate(prompt, params)[0].outputs[0]
    with LLM(model=str(src), dtype="float32") as llm:
        plain = llm.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == ref.token_ids
    assert got.logprobs == ref.logprobs
    assert plain.logprobs != got.logprobs  # the rounding through e4m3 did happen


def test_fp8_weights_kept_for_the_fp8_gemms_compute_the_same(tmp_path, monkeypatch):
    """Where weights stay FP8 (CUDA: BlockFp8 through kernels.fp8_linear / fp8_expert_ffn),
    the model is wired to the FP8 GEMMs; on CPU those dequantize exactly as the loader
    does, so forcing the FP8-kept load here must give the same bits."""
    from megaserve.kernels.fp8 import BlockFp8
    from megaserve.models import loader

    src = tmp_path / "wide"
    make_checkpoint(src, "qwen3_moe", hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    prompt = {"prompt_token_ids": _prompts(100)[1]}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    with LLM(model=str(src), dtype="float32", quantization="fp8") as llm:
        ref = llm.generate(prompt, params)[0].outputs[0]
    monkeypatch.setattr(loader, "keeps_fp8", lambda device, block: True)
    model = loader.load_model(src, "float32", quantization="fp8")
    layer = model.attention.layers[0]
    kept = [layer.qkv, layer.o_proj, model.experts.w_gate_up[0], model.experts.w_down[0]]
    assert all(isinstance(w, BlockFp8) for w in kept)
    with LLM(model=str(src), dtype="float32", quantization="fp8") as llm:
        got = llm.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == ref.token_ids and got.logprobs == ref.logprobs


def test_quantize_at_load_reaches_every_expert_worker(qwen3):
    """A disaggregated layout quantizes its expert workers' weights too: bitwise the
    single engine's outputs."""
    src = qwen3[0]
    prompt = {"prompt_token_ids": _prompts(100)[2]}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(model=str(src), dtype="float32", quantization="fp8") as llm:
        ref = llm.generate(prompt, params)[0].outputs[0]
    with LLM(model=str(src), dtype="float32", quantization="fp8", attention_replicas=2,
             expert_workers=2, transport="inproc") as llm:
        got = llm.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == ref.token_ids and got.logprobs == ref.logprobs


def test_scale_on_a_weight_that_is_not_fp8_is_refused(qwen3, tmp_path):
    path = _copy(qwen3[1], tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].float() * tensors[name.removesuffix("weight") + "weight_scale_inv"][0, 0]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="only float8_e4m3fn weights carry block scales"):
        load_model(path, "float32")
