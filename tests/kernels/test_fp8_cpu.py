"""The block-FP8 kernel API on CPU: the weights are dequantized (float32 product, one
rounding) and the CPU backend's float kernels run; rows stay independent."""

from __future__ import annotations

import dataclasses

import torch

from megaserve import kernels
from megaserve.kernels.fp8 import dequantize
from megaserve.models.quantization import dequantize as model_dequantize
from megaserve.models.quantization import quantize


def test_kernel_dequantize_equals_the_loader_s():
    w = torch.randn(300, 200)
    q, s = quantize(w)
    assert torch.equal(dequantize(q, s, torch.float32), model_dequantize(q, s, (128, 128), torch.float32))


def test_fp8_linear_and_experts_on_cpu():
    g = torch.Generator().manual_seed(0)
    q, s = quantize(torch.randn(96, 160, generator=g))
    x = torch.randn(9, 160, generator=g)
    out = kernels.fp8_linear(x, q, s)
    assert torch.equal(out, kernels.linear(x, dequantize(q, s, torch.float32)))
    assert torch.equal(kernels.fp8_linear(x[:4], q, s), out[:4])
    gu = [quantize(torch.randn(64, 160, generator=g)) for _ in range(3)]
    dn = [quantize(torch.randn(160, 32, generator=g)) for _ in range(3)]
    wgu, sgu = torch.stack([a for a, _ in gu]), torch.stack([b for _, b in gu])
    wd, sd = torch.stack([a for a, _ in dn]), torch.stack([b for _, b in dn])
    ids = torch.tensor([0, 2, 1, 1, 2, 0, 0, 1, 2, 2, 1, 0, 0, 0, 1, 2, 2, 1])
    got = kernels.fp8_expert_ffn(x, ids, wgu, sgu, wd, sd, rows_per_token=2)
    ref = kernels.expert_ffn(x, ids, dequantize(wgu, sgu, torch.float32),
                             dequantize(wd, sd, torch.float32), rows_per_token=2)
    assert torch.equal(got, ref)


def test_fp8_launch_configs_are_validated_and_the_split_depends_on_weights_only(monkeypatch):
    """Launch configs refuse shapes the kernels do not take (ValueError); the K split is a
    function of (N, K) alone and the decode plans follow their tuning variables."""
    import pytest

    from megaserve.kernels.triton_impl.fp8_gemm import LinearLaunch, plan_linear, split_groups
    from megaserve.kernels.triton_impl.fp8_moe import Fp8MoeLaunch, plan_moe

    with pytest.raises(ValueError, match="block_m"):
        LinearLaunch(block_m=32)
    with pytest.raises(ValueError, match="num_warps"):
        LinearLaunch(num_warps=2)
    with pytest.raises(ValueError, match="column tile"):
        Fp8MoeLaunch(up_n=48)
    with pytest.raises(ValueError, match="h_in_loop"):
        Fp8MoeLaunch(fused=False, h_in_loop=True)
    assert split_groups(2048, 4096) == 8  # Qwen3-30B-A3B o_proj: 4 splits of 8 groups
    assert split_groups(5120, 2048) == 16  # qkv: one split
    assert split_groups(576, 7168) == 4  # DeepSeek-V3 kv_a: 14 splits
    assert plan_linear(1, 2048, 4096).parts and not plan_linear(4096, 2048, 4096).parts
    assert plan_linear(256, 2048, 4096).parts and not plan_linear(256, 5120, 2048).parts
    assert not any(plan_linear(m, 2048, 4096).quant_a for m in (1, 64, 256, 4096))
    # the Gluon linear where its tiles fill a quarter of the GPU's SMs (the launch's count)
    assert plan_linear(256, 2048, 4096).gluon and not plan_linear(256, 2048, 4096, sms=300).gluon
    assert plan_moe(8, 128) == plan_moe(4096, 128) == Fp8MoeLaunch(
        64, 128, 128, 4, 4, x_in_loop=False, h_in_loop=False, fused=False, gluon=True)
    assert plan_moe(8192, 128) == dataclasses.replace(plan_moe(8, 128), gluon=False)
    assert plan_moe(8193, 128).block_m == 128
    monkeypatch.setenv("MEGASERVE_FP8_MOE", "64,32,64,4,4,1,0,1")
    assert plan_moe(512, 128) == Fp8MoeLaunch(64, 32, 64, 4, 4, True, False, True)
    monkeypatch.setenv("MEGASERVE_FP8_LINEAR", "64,128,4,3,0,0")
    assert plan_linear(1, 2048, 4096) == LinearLaunch(64, 128, 4, 3, False, False)
