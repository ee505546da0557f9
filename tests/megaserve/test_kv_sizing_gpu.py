"""On a GPU: ``gpu_memory_utilization`` sizing leaves the requested headroom.

The engine process may use ``utilization x total`` of the device's memory: after startup
and a full batch of decode steps (CUDA graphs captured), what it took from the device
stays within that (plus a small allowance for allocations made after sizing), and the
KV cache really got the rest (the budget is not left mostly unused).
"""

from __future__ import annotations

import gc

import pytest
import torch

from megaserve import LLM, SamplingParams
from megaserve.engine.config import EngineConfig, default_max_num_batched_tokens

pytestmark = pytest.mark.gpu

GIB = 1 << 30
# Allocations after the sizing that the profile cannot see exactly (allocator rounding,
# kernels compiled for new shapes): the engine may exceed its budget by at most this.
ALLOWANCE = GIB // 2


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 4,
                                                 "prompt_lookup_max": 3}])
def test_gpu_memory_utilization_leaves_the_requested_headroom(speculative):
    """Also with speculative decoding, whose verification graphs have a log-prob buffer of
    their own (counted by the sizing)."""
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the CUDA context exists before the measurement
    # An earlier engine's blocks still cached by torch's allocator would be reused
    # unseen: measure from a device that holds none of them.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    free_before, total = torch.cuda.mem_get_info()
    # Half of what is free now, so the test also runs on a GPU that others use.
    utilization = round(0.5 * free_before / total, 3)
    budget = int(utilization * total)
    with LLM(model="builtin:tiny-moe", dtype="bfloat16", device="cuda", max_model_len=512,
             max_num_seqs=32, gpu_memory_utilization=utilization,
             speculative_config=speculative) as llm:
        plan = llm.engine.kv_plan
        assert plan.source == "gpu_memory_utilization"
        prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 1 for j in range(40)]} for i in range(32)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        used = free_before - free_after
        print(f"budget {budget / GIB:.2f} GiB, used {used / GIB:.2f} GiB, "
              f"KV {plan.memory_bytes / GIB:.2f} GiB ({plan.num_tokens} tokens)")
        assert used <= budget + ALLOWANCE, (used, budget)
        assert plan.memory_bytes >= 0.8 * budget - GIB, (plan.memory_bytes, budget)


def test_kv_cache_memory_bytes_overrides_utilization():
    with LLM(model="builtin:tiny-moe", dtype="bfloat16", device="cuda", max_model_len=512,
             kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.01) as llm:
        plan = llm.engine.kv_plan
        assert plan.source == "kv_cache_memory_bytes"
        assert plan.memory_bytes <= 256 << 20 < plan.memory_bytes + plan.bytes_per_block


def test_max_num_batched_tokens_default_reads_this_gpu():
    """vLLM's table, from the device's own memory and name (an H100 / H200: 16384 tokens
    offline, 8192 for a server, 1024 sequences)."""
    props = torch.cuda.get_device_properties(0)
    big = props.total_memory >= 70 * GIB and "a100" not in props.name.lower()
    assert EngineConfig(device="cuda").max_num_batched_tokens == (16384 if big else 8192)
    assert default_max_num_batched_tokens("cuda:0", "server") == (8192 if big else 2048)
    assert EngineConfig(device="cuda").max_num_seqs == (1024 if big else 256)
