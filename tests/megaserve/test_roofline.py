"""The roofline benchmark's arithmetic, its profile summary, and on-device random weights (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from megaserve.bench import random_model, roofline
from megaserve.bench.gpu_profile import STEP_LABEL, idle_gaps, summarize_trace, union_length
from megaserve.models.config import ModelConfig
from megaserve.models.loader import load_model
from megaserve.models.random_weights import MARKER, RandomWeights, is_random_checkpoint


def preset(name: str, layers: int) -> ModelConfig:
    return ModelConfig.from_hf_dict(random_model.hf_config(name, layers))


def test_full_depth_presets_have_the_published_parameter_counts():
    # Qwen3-30B-A3B: 30.5B total, 3.3B active; Mixtral-8x7B: 46.7B total, 12.9B active.
    qwen, mixtral = preset("qwen3-30b-a3b", 48), preset("mixtral-8x7b", 32)
    assert roofline.weight_bytes(qwen, 2) / 2 == pytest.approx(30.5e9, rel=0.01)
    assert roofline.weight_bytes(mixtral, 2) / 2 == pytest.approx(46.7e9, rel=0.01)
    active = lambda c: c.num_layers * (roofline.attention_params_per_layer(c) + c.top_k * roofline.expert_params(c))  # noqa: E731
    assert active(qwen) + 2 * 151936 * 2048 == pytest.approx(3.3e9, rel=0.03)
    assert active(mixtral) + 2 * 32000 * 4096 == pytest.approx(12.9e9, rel=0.01)


def test_expected_active_experts():
    assert roofline.expected_active_experts(128, 8, 1) == pytest.approx(8)
    assert roofline.expected_active_experts(8, 2, 1) == pytest.approx(2)
    assert roofline.expected_active_experts(128, 8, 64) == pytest.approx(128 * (1 - (120 / 128) ** 64))
    assert 127.9 < roofline.expected_active_experts(128, 8, 256) <= 128
    assert roofline.expected_active_experts(128, 8, 0) == 0


def test_decode_bytes_by_kind():
    cfg = preset("qwen3-30b-a3b", 48)
    b = roofline.decode_bytes(cfg, batch=1, context=100, elt_bytes=2)
    attn = (4096 + 512 + 512) * 2048 + 2048 * 4096 + 2 * 2048 + 2 * 128 + 128 * 2048
    assert b.attention_weights == 48 * attn * 2
    assert b.expert_weights == pytest.approx(48 * 8 * 3 * 2048 * 768 * 2)
    assert b.kv_read == 48 * 100 * 2 * 4 * 128 * 2
    assert b.lm_head == (151936 * 2048 + 2048) * 2
    assert b.total == pytest.approx(b.attention_weights + b.expert_weights + b.kv_read + b.kv_write + b.lm_head)
    # batch 1 moves ~6.1 GB (issue 14: "about 6 GB"); batch 256 reads every expert
    assert 6.0e9 < b.total < 6.2e9
    big = roofline.decode_bytes(cfg, batch=256, context=100, elt_bytes=2)
    assert big.expert_weights == pytest.approx(48 * 128 * 3 * 2048 * 768 * 2, rel=1e-3)
    with pytest.raises(ValueError, match="batch"):
        roofline.decode_bytes(cfg, batch=0, context=1, elt_bytes=2)


def test_fp8_weights_count_one_byte_and_fp8_bench_agrees():
    """FP8 weights (``weight_elt_bytes`` 1): the attention-side and expert weights move one
    byte each, KV and the LM head two; fp8_bench's roofline of such a report equals its
    roofline of the same run recorded at two bytes a weight (older reports)."""
    from megaserve.kernels.fp8_bench import fp8_roofline_ms

    cfg = preset("qwen3-30b-a3b", 48)
    bf16 = roofline.decode_bytes(cfg, batch=256, context=80, elt_bytes=2)
    fp8 = roofline.decode_bytes(cfg, batch=256, context=80, elt_bytes=2, weight_elt_bytes=1)
    assert fp8.attention_weights == bf16.attention_weights / 2
    assert fp8.expert_weights == bf16.expert_weights / 2
    assert (fp8.kv_read, fp8.kv_write, fp8.lm_head) == (bf16.kv_read, bf16.kv_write, bf16.lm_head)
    embed_and_head = (2 * 151936 * 2048 + 2048) * 2
    assert roofline.weight_bytes(cfg, 2, 1) == pytest.approx(
        (roofline.weight_bytes(cfg, 2) - embed_and_head) / 2 + embed_and_head)
    old = fp8_roofline_ms({"dtype": "bfloat16"}, {"bytes": bf16.__dict__}, 4.2e12)
    new = fp8_roofline_ms({"weight_elt_bytes": 1}, {"bytes": fp8.__dict__}, 4.2e12)
    assert new == pytest.approx(old) and new == pytest.approx(fp8.total / 4.2e12 * 1e3)


def test_prefill_flops_and_layers_that_fit():
    cfg = preset("mixtral-8x7b", 32)
    per_token = roofline.prefill_flops_per_token(cfg, 4096)
    # 2 x 12.9B active (minus the embedding) plus attention over ~2k tokens x 32 layers x 4096
    assert per_token == pytest.approx(2 * 12.6e9 + 32 * 4 * 2048.5 * 4096, rel=0.02)
    one = preset("mixtral-8x7b", 1)
    per_layer = roofline.weight_bytes(preset("mixtral-8x7b", 2), 2) - roofline.weight_bytes(one, 2)
    fixed = roofline.weight_bytes(one, 2) - per_layer
    assert roofline.layers_that_fit(one, fixed + 20.5 * per_layer, 2) == 20
    assert roofline.layers_that_fit(one, fixed / 2, 2) == 0


def trace(steps, gpu, runtime=()):
    ev = [{"ph": "X", "cat": "user_annotation", "name": STEP_LABEL, "ts": s, "dur": e - s} for s, e in steps]
    ev += [{"ph": "X", "cat": "kernel", "name": n, "ts": s, "dur": e - s} for n, s, e in gpu]
    ev += [{"ph": "X", "cat": "cuda_runtime", "name": n, "ts": s, "dur": d} for n, s, d in runtime]
    return {"traceEvents": ev}


def test_union_and_gaps():
    spans = [(0, 10), (5, 20), (30, 40), (100, 150)]
    assert union_length(spans, 0, 120) == 20 + 10 + 20
    assert idle_gaps(spans, 0, 120) == [10, 60]
    assert idle_gaps([], 0, 5) == [5]


def test_summarize_trace_busy_fraction_gaps_and_top_kernels():
    t = trace(steps=[(0, 100), (100, 200)],
              gpu=[("gemm", 10, 60), ("norm", 60, 65), ("gemm", 110, 160), ("norm", 190, 200)],
              runtime=[("cudaStreamSynchronize", 65, 30), ("cudaStreamSynchronize", 165, 30)])
    s = summarize_trace(t)
    assert s["steps"] == 2
    assert s["gpu_busy_fraction"] == pytest.approx(115 / 200)
    # idle: 0-10, 65-110, 160-190 (all >= 10 us)
    assert s["host_gaps"]["total_us_per_step"] == pytest.approx((10 + 45 + 30) / 2)
    assert s["host_gaps"]["largest_us"] == 45
    assert s["top_kernels"][0] == {"name": "gemm", "us_per_step": 50.0, "calls_per_step": 1.0,
                                   "share_of_gpu_time": pytest.approx(100 / 115)}
    assert s["runtime_calls"][0]["calls_per_step"] == 1.0
    with pytest.raises(ValueError, match="annotations"):
        summarize_trace({"traceEvents": []})


def tiny_random(path, arch="MixtralForCausalLM"):
    cfg = dict(architectures=[arch], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, vocab_size=256, num_hidden_layers=2, max_position_embeddings=512,
               torch_dtype="bfloat16", num_experts_per_tok=2)
    if arch == "MixtralForCausalLM":
        cfg |= dict(num_local_experts=4, intermediate_size=96)
    else:
        cfg |= dict(num_experts=4, moe_intermediate_size=96, intermediate_size=128, norm_topk_prob=True)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    (path / MARKER).write_text(json.dumps({"seed": 0}))
    return path, cfg


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_random_checkpoint_loads_deterministically_and_equals_its_file_form(tmp_path, arch):
    path, cfg = tiny_random(tmp_path / "r", arch)
    assert is_random_checkpoint(path)
    a = load_model(path, "bfloat16", "cpu")
    b = load_model(path, "bfloat16", "cpu")
    assert a.experts.w_gate_up[1].shape == (4, 192, 64) and a.experts.w_gate_up[1].dtype == torch.bfloat16
    assert torch.equal(a.experts.w_down[1], b.experts.w_down[1])
    assert torch.equal(a.attention.layers[0].qkv, b.attention.layers[0].qkv)
    assert not torch.equal(a.experts.w_down[0], a.experts.w_down[1])  # each tensor its own stream
    assert torch.all(a.attention.layers[0].input_norm == 1)
    std = a.experts.w_gate_up[0].float().std().item()
    assert std == pytest.approx(64 ** -0.5, rel=0.05)
    # the safetensors form holds the same tensors
    filed = tmp_path / "f"
    random_model._write_file(filed, cfg)
    assert not is_random_checkpoint(filed)
    c = load_model(filed, "bfloat16", "cpu")
    assert torch.equal(c.experts.w_gate_up[1], a.experts.w_gate_up[1])
    assert torch.equal(c.attention.lm_head, a.attention.lm_head)


def test_random_weights_reject_unknown_names_and_architectures(tmp_path):
    path, cfg = tiny_random(tmp_path / "r")
    reader = RandomWeights(path, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="missing"):
        reader.get("model.layers.9.self_attn.q_proj.weight")
    (path / "config.json").write_text(json.dumps(cfg | {"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not supported"):
        RandomWeights(path, torch.float32, torch.device("cpu"))


def test_random_names_and_presets(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASERVE_CACHE", str(tmp_path))
    path = random_model.resolve_random_model("random:mixtral-8x7b:3")
    assert is_random_checkpoint(path) and not list(path.glob("*.safetensors"))
    cfg = ModelConfig.from_dir(path)
    assert (cfg.family, cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size,
            cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == ("mixtral", 3, 8, 2, 14336, 32, 8, 32000)
    for bad in ("random:nope:2", "random:qwen3-30b-a3b:0", "random:qwen3-30b-a3b"):
        with pytest.raises(ValueError, match="random:<preset>:<layers>"):
            random_model.resolve_random_model(bad)
    with pytest.raises(ValueError, match="device"):
        random_model.resolve_random_model("random:qwen3-30b-a3b:1", weights="disk")


def test_bench_decode_runs_on_cpu(tmp_path):
    from megaserve.bench import decode

    path, _ = tiny_random(tmp_path / "r")
    out = tmp_path / "out.json"
    rc = decode.main(["--model", str(path), "--dtype", "bfloat16", "--device", "cpu", "--batches", "1,3",
                      "--steps", "2", "--warmup-steps", "1", "--profile-steps", "1", "--prefill-len", "32",
                      "--prefill-prompts", "2", "--copy-mib", "4", "--matmul-n", "64",
                      "--matmul-seconds", "0.05", "--json-out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["decode"]] == [1, 3]
    for r in report["decode"]:
        assert r["steps_not_full_batch"] == 0
        assert r["steady_step_ms"] > 0
        assert r["roofline_ms"] > 0 and 0 < r["achieved"]
        assert r["bytes"]["total"] > r["bytes"]["expert_weights"] > 0
        assert r["profile"]["cpu_self_top"]
    assert report["prefill"]["tok_s"] > 0 and report["copy_bandwidth_gbs"] > 0
    assert report["matmul_held_tflops"] > 0 and report["prefill"]["of_matmul_held"] > 0


def test_summarize_trace_first_steps_only():
    t = trace(steps=[(0, 100), (100, 200)], gpu=[("gemm", 10, 60), ("other", 110, 190)])
    s = summarize_trace(t, max_steps=1)
    assert s["steps"] == 1 and [k["name"] for k in s["top_kernels"]] == ["gemm"]
    assert s["gpu_busy_fraction"] == pytest.approx(50 / 100)
