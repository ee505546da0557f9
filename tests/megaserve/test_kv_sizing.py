"""KV-cache sizing (megaserve.engine.memory): the arithmetic, the precedence of the three
sources, the log line, the flags, and the attention workers of a disaggregated layout."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from megaserve import LLM
from megaserve.engine import memory
from megaserve.engine.config import (CPU_MAX_NUM_BATCHED_TOKENS, DEFAULT_CPU_KV_CACHE_BYTES,
                                     EngineConfig, batch_defaults_for,
                                     default_max_num_batched_tokens, default_max_num_seqs)
from megaserve.entrypoints.generate_cli import add_runtime_flags, runtime_options

GIB = 1 << 30


def _profile(total=80, free=79, weights=10, activations=2, graphs=1, other=0.5):
    return memory.MemoryProfile(int(total * GIB), int(free * GIB), int(weights * GIB),
                                int(activations * GIB), int(graphs * GIB), int(other * GIB))


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    # 2 (K, V) x 48 layers x 16 tokens x 4 heads x 128 dims x 2 bytes.
    assert memory.kv_bytes_per_block(48, 16, 4, 128, torch.bfloat16) == 2 * 48 * 16 * 4 * 128 * 2
    assert memory.kv_bytes_per_block(4, 16, 2, 32, torch.float32) == 2 * 4 * 16 * 2 * 32 * 4


def test_utilization_budget_is_the_fraction_minus_what_the_engine_needs_besides_kv():
    profile = _profile()
    assert profile.non_kv_bytes == int(13.5 * GIB)
    assert memory.kv_budget_from_utilization(profile, 0.9) == int(0.9 * 80 * GIB) - int(13.5 * GIB)
    assert memory.kv_budget_from_utilization(profile, 0.5) == 40 * GIB - int(13.5 * GIB)
    # The weights and activations alone exceed the budget.
    with pytest.raises(ValueError, match="gpu_memory_utilization.*leaves no memory"):
        memory.kv_budget_from_utilization(profile, 0.15)
    # Other processes hold the memory the budget needs.
    with pytest.raises(ValueError, match="only 30.00 GiB were free"):
        memory.kv_budget_from_utilization(_profile(free=30), 0.9)


def test_plan_precedence_blocks_then_bytes_then_utilization_then_cpu_default():
    per_block = 1 << 20
    profile = _profile()
    plan = memory.plan_kv_cache(EngineConfig(num_kv_blocks=40, kv_cache_memory_bytes=GIB),
                                per_block, 512, profile)
    assert (plan.num_blocks, plan.source) == (40, "num_kv_blocks")
    plan = memory.plan_kv_cache(EngineConfig(kv_cache_memory_bytes=GIB + 5), per_block, 512, profile)
    assert (plan.num_blocks, plan.source) == (1024, "kv_cache_memory_bytes")
    plan = memory.plan_kv_cache(EngineConfig(gpu_memory_utilization=0.5), per_block, 512, profile)
    assert plan.source == "gpu_memory_utilization"
    assert plan.num_blocks == (40 * GIB - int(13.5 * GIB)) // per_block
    assert plan.memory_bytes <= 40 * GIB - profile.non_kv_bytes
    plan = memory.plan_kv_cache(EngineConfig(max_num_seqs=8), per_block, 512, None)
    assert (plan.num_blocks, plan.source) == (8 * 32, "cpu default")  # 8 requests x 32 blocks
    plan = memory.plan_kv_cache(EngineConfig(max_num_seqs=4096), per_block, 512, None)
    assert plan.num_blocks == DEFAULT_CPU_KV_CACHE_BYTES // per_block


def test_plan_reports_tokens_and_full_length_requests_and_refuses_too_small():
    plan = memory.KVCachePlan(num_blocks=1000, block_size=16, bytes_per_block=4096,
                              max_model_len=1000, source="kv_cache_memory_bytes")
    assert plan.num_tokens == 16000
    assert plan.max_full_length_requests == 15  # 63 blocks each
    text = plan.describe()
    assert "16000 tokens" in text and "15 concurrent requests of max_model_len=1000" in text
    with pytest.raises(ValueError, match="cannot hold one request"):
        memory.plan_kv_cache(EngineConfig(kv_cache_memory_bytes=10 * 4096), 4096, 1000, None)


def test_config_validates_and_resolves_auto_device(monkeypatch):
    assert EngineConfig().device == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig(device="auto").device == "cuda"
    assert EngineConfig(device="cpu").device == "cpu"
    for bad in (dict(gpu_memory_utilization=0), dict(gpu_memory_utilization=1.01),
                dict(kv_cache_memory_bytes=0), dict(kv_cache_memory_bytes=True),
                dict(device="tpu"), dict(device="auto:0")):
        with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
            EngineConfig(**bad)


def test_max_num_batched_tokens_defaults_follow_vllms_table(monkeypatch):
    assert batch_defaults_for(80 * GIB, "NVIDIA H100 80GB HBM3")[0] == 16384
    assert batch_defaults_for(80 * GIB, "NVIDIA H100 80GB HBM3", "server")[0] == 8192
    assert batch_defaults_for(141 * GIB, "NVIDIA H200", "server")[0] == 8192
    assert batch_defaults_for(80 * GIB, "NVIDIA A100-SXM4-80GB")[0] == 8192
    assert batch_defaults_for(80 * GIB, "NVIDIA A100-SXM4-80GB", "server")[0] == 2048
    assert batch_defaults_for(48 * GIB, "NVIDIA L40S")[0] == 8192
    with pytest.raises(ValueError, match="usage"):
        batch_defaults_for(80 * GIB, "NVIDIA H100", "offline")
    assert default_max_num_batched_tokens("cpu") == CPU_MAX_NUM_BATCHED_TOKENS == 2048
    assert EngineConfig(device="cpu").max_num_batched_tokens == 2048
    assert EngineConfig(device="cpu", max_num_batched_tokens=512).max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(device="cpu", max_num_batched_tokens=0)

    def no_gpu(device):
        raise RuntimeError("no CUDA GPUs are available")

    # A process that cannot ask the GPU (a Ray driver without one): the small-GPU row.
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_gpu)
    assert default_max_num_batched_tokens("cuda") == 8192
    assert default_max_num_batched_tokens("cuda:1", "server") == 2048
    assert default_max_num_seqs("cuda") == default_max_num_seqs("cuda:1", "server") == 256


def test_max_num_seqs_defaults_follow_vllms_table():
    """vLLM's (max_num_batched_tokens, max_num_seqs): 1024 sequences on GPUs of >= 70 GiB
    other than the A100, 256 on other GPUs and on CPU offline, 128 for a CPU server; the
    default never exceeds the step's tokens."""
    assert batch_defaults_for(80 * GIB, "NVIDIA H100 80GB HBM3") == (16384, 1024)
    assert batch_defaults_for(141 * GIB, "NVIDIA H200", "server") == (8192, 1024)
    assert batch_defaults_for(80 * GIB, "NVIDIA A100-SXM4-80GB") == (8192, 256)
    assert batch_defaults_for(48 * GIB, "NVIDIA L40S", "server") == (2048, 256)
    assert default_max_num_seqs("cpu") == 256 and default_max_num_seqs("cpu", "server") == 128
    assert default_max_num_seqs("cpu", max_num_batched_tokens=100) == 100
    with pytest.raises(ValueError, match="usage"):
        default_max_num_seqs("cpu", "offline")
    assert EngineConfig(device="cpu").max_num_seqs == 256
    assert EngineConfig(device="cpu", max_num_batched_tokens=64).max_num_seqs == 64
    assert EngineConfig(device="cpu", max_num_seqs=8).max_num_seqs == 8
    assert EngineConfig(device="cpu", max_num_seqs=300, max_num_batched_tokens=64).max_num_seqs == 300
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="max_num_seqs"):
            EngineConfig(device="cpu", max_num_seqs=bad)


def test_cli_flags_use_vllm_names_and_reach_the_config():
    parser = argparse.ArgumentParser()
    add_runtime_flags(parser)
    args = parser.parse_args([])
    defaults = EngineConfig.__dataclass_fields__
    assert args.device == "auto"
    assert args.gpu_memory_utilization == defaults["gpu_memory_utilization"].default == 0.9
    assert args.kv_cache_memory_bytes is None
    args = parser.parse_args(["--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", "123456",
                              "--max-num-batched-tokens", "512", "--block-size", "32",
                              "--max-num-seqs", "8", "--device", "cpu"])
    config = EngineConfig(**runtime_options(args))
    assert (config.gpu_memory_utilization, config.kv_cache_memory_bytes) == (0.5, 123456)
    assert (config.max_num_batched_tokens, config.block_size, config.max_num_seqs) == (512, 32, 8)


def test_engine_sizes_from_bytes_and_logs_what_fits(caplog):
    caplog.set_level(logging.INFO, logger="megaserve.engine.engine")
    with LLM(dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=3 << 20) as llm:
        engine = llm.engine
        cfg = engine.model_config
        per_block = memory.kv_bytes_per_block(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim,
                                              torch.float32)
        assert engine.stats().num_kv_blocks == (3 << 20) // per_block
        assert engine.kv_plan.source == "kv_cache_memory_bytes"
    assert any("concurrent requests of max_model_len=128" in r.getMessage() for r in caplog.records)


def test_attention_workers_of_a_disaggregated_layout_size_their_own_pools():
    from megaserve import SamplingParams

    with LLM(dtype="float32", device="cpu", max_model_len=128, attention_replicas=2,
             expert_workers=1, kv_cache_memory_bytes=2 << 20) as llm:
        # Replicas report their stats with their outputs: one request each.
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, SamplingParams(max_tokens=2))
        with LLM(dtype="float32", device="cpu", max_model_len=128,
                 kv_cache_memory_bytes=2 << 20) as single:
            per_replica = single.engine.stats().num_kv_blocks
        assert llm.engine.stats().num_kv_blocks == 2 * per_replica


@pytest.mark.parametrize("num_tokens, num_seqs", [(300, 7), (5, 64), (2048, 64)])
def test_profiling_forward_runs_the_largest_step_with_local_or_remote_experts(num_tokens, num_seqs):
    """The profiling batch (CPU here; its memory is measured on CUDA): long prompts are
    capped at max_model_len, and an attention worker without experts profiles with zeros."""
    from megaserve.models.forward import LocalExperts

    with LLM(dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=16) as llm:
        runner = llm.engine.runner
        for experts in (runner.experts, memory._NoExperts()):
            scratch = memory._profile_forward(runner.attention, experts, num_tokens, num_seqs,
                                              16, 128)
            assert scratch > 0
        assert isinstance(runner.experts, LocalExperts)
