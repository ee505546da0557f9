"""The block-FP8 kernel API on CPU: the weights are dequantized (float32 product, one
rounding) and the CPU backend's float kernels run; rows stay independent."""

from __future__ import annotations

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
