"""Block-FP8 GEMMs (kernel API): CUDA runs the batch-invariant Triton kernels of
:mod:`kernels.triton_impl.fp8_gemm` (linears) and :mod:`kernels.triton_impl.fp8_moe`
(experts); other devices dequantize the weights and run the backend's float kernels
(the bits differ from CUDA's, as everywhere between devices).

Weights are e4m3 `[N, K]` (experts `[E, N, K]`) with float32 ``scale_inv`` of one value per
128 x 128 block, the DeepSeek-V3 / Qwen3-FP8 checkpoint format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 128


@dataclass(frozen=True)
class BlockFp8:
    """A block-FP8 weight as the GEMMs take it: ``weight`` e4m3 `[..., N, K]` and
    ``scale_inv`` float32 `[..., ceil(N/128), ceil(K/128)]`, on one device.
    :func:`kernels.linear`, :func:`kernels.linear_rms_norm` and :func:`kernels.expert_ffn`
    accept it in place of a float weight."""

    weight: torch.Tensor
    scale_inv: torch.Tensor

    def __post_init__(self) -> None:
        n, k = self.weight.shape[-2:]
        expected = (*self.weight.shape[:-2], -(-n // BLOCK), -(-k // BLOCK))
        if tuple(self.scale_inv.shape) != expected:
            raise ValueError(f"BlockFp8: scale_inv {list(self.scale_inv.shape)} does not fit a "
                             f"{list(self.weight.shape)} weight in 128 x 128 blocks ({list(expected)})")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.scale_inv, dtype)

    @staticmethod
    def cat(parts: list[BlockFp8]) -> BlockFp8:
        """Stack ``parts`` along N (each but the last a whole number of 128-row blocks);
        ValueError otherwise."""
        if any(p.weight.shape[-2] % BLOCK for p in parts[:-1]):
            raise ValueError("BlockFp8.cat: a part that is not the last has N % 128 != 0")
        return BlockFp8(torch.cat([p.weight for p in parts], dim=-2),
                        torch.cat([p.scale_inv for p in parts], dim=-2))

    @staticmethod
    def stack(parts: list[BlockFp8]) -> BlockFp8:
        """Stack ``parts`` (experts) along a new leading dim."""
        return BlockFp8(torch.stack([p.weight for p in parts]),
                        torch.stack([p.scale_inv for p in parts]))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight * scale_inv`` of its 128 x 128 block, in float32, rounded once to ``dtype``.
    weight `[..., N, K]` e4m3; scale_inv `[..., ceil(N/128), ceil(K/128)]`."""
    n, k = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(BLOCK, -2)[..., :n, :]
    scale = scale.repeat_interleave(BLOCK, -1)[..., :k]
    return (weight.float() * scale).to(dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for a block-FP8 weight: x `[M, K]`; returns `[M, N]` in x.dtype.
    CUDA: activations quantized per token and 128-group, fp32 accumulation, row-invariant."""
    if x.is_cuda:
        from .triton_impl.fp8_gemm import fp8_linear as gpu_linear

        return gpu_linear(x, weight, scale_inv)
    from .api import linear

    return linear(x, dequantize(weight, scale_inv, x.dtype))


def fp8_expert_ffn(x: torch.Tensor, expert_ids: torch.Tensor, w_gate_up: torch.Tensor,
                   s_gate_up: torch.Tensor, w_down: torch.Tensor, s_down: torch.Tensor,
                   *, rows_per_token: int = 1) -> torch.Tensor:
    """``kernels.expert_ffn`` on block-FP8 expert weights (w_gate_up `[E, 2I, D]`, w_down
    `[E, D, I]` e4m3 with their scales). Returns `[R, D]` in x.dtype; each routed row's
    result is independent of the other rows."""
    if x.is_cuda:
        from .triton_impl.fp8_moe import fp8_expert_ffn as gpu_ffn

        return gpu_ffn(x, expert_ids, w_gate_up, s_gate_up, w_down, s_down, rows_per_token)
    from .api import expert_ffn

    return expert_ffn(x, expert_ids, dequantize(w_gate_up, s_gate_up, x.dtype),
                      dequantize(w_down, s_down, x.dtype), rows_per_token=rows_per_token)
