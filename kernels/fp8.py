"""Block-FP8 weights (:class:`BlockFp8`) and their dequantization. The GEMMs over them are
``kernels.api.fp8_linear`` / ``fp8_expert_ffn``: CUDA runs the batch-invariant Triton
kernels of :mod:`kernels.triton_impl.fp8_gemm` (linears) and
:mod:`kernels.triton_impl.fp8_moe` (experts); other devices dequantize the weights
(:func:`dequantize`) and run the backend's float kernels (the bits differ from CUDA's, as
everywhere between devices).

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
