"""Block-FP8 weights: what a checkpoint's ``quantization_config`` may say, and the
quantize / dequantize arithmetic of DeepSeek's block format.

The format (DeepSeek-V3, the Qwen3 FP8 releases): a linear weight `[N, K]` is stored as
``float8_e4m3fn`` with a ``<module>.weight_scale_inv`` tensor `[ceil(N / bn), ceil(K / bk)]`
float32, one scale per ``weight_block_size = [bn, bk]`` block (ragged blocks at the edges);
the real weight is ``fp8 * scale_inv`` of its block. Anything else in
``quantization_config`` (another ``quant_method``, per-tensor scales, static activation
scales, another fp8 format) is refused at load: a checkpoint the loader does not fully
understand must never load wrong.

Shape legend: N = output features, K = input features, bn / bk = block rows / columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# `--quantization` values (None: the checkpoint's own weights).
QUANTIZATION_METHODS = ("fp8",)
DEFAULT_BLOCK = (128, 128)
# Every float8 storage dtype: a checkpoint tensor in any of them needs a quantization_config.
_FP8_STORAGE = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2",
                                                 "float8_e4m3fnuz", "float8_e5m2fnuz")
                     if hasattr(torch, n))


@dataclass(frozen=True)
class QuantConfig:
    """Block-FP8 weights (validated): e4m3 values, one float32 scale per block."""

    method: str = "fp8"
    weight_block_size: tuple[int, int] = DEFAULT_BLOCK
    # Module-name fragments whose weights stay unquantized (``modules_to_not_convert``).
    not_converted: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization: method must be one of {QUANTIZATION_METHODS}, "
                             f"got {self.method!r}")
        block = self.weight_block_size
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError("quantization: weight_block_size must be two positive integers, "
                             f"got {block!r}")


def quant_config_from_hf(raw: dict[str, Any]) -> QuantConfig | None:
    """The ``quantization_config`` of an HF config dict, or None where it has none.

    Raises ``ValueError`` naming the field for anything but dynamic block-FP8 e4m3.
    """
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError("model: config.json 'quantization_config' must be an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"model: quantization_config.quant_method {method!r} is not supported "
                         "(supported: 'fp8' with weight_block_size)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"model: quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"model: quantization_config.activation_scheme {scheme!r} is not "
                         "supported (only 'dynamic')")
    block = q.get("weight_block_size")
    if block is None:
        raise ValueError("model: quantization_config.weight_block_size is missing (per-tensor "
                         "FP8 scales are not supported; block-FP8 checkpoints name it)")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError("model: quantization_config.weight_block_size must be two positive "
                         f"integers, got {block!r}")
    keep = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    if not isinstance(keep, (list, tuple)) or not all(isinstance(m, str) for m in keep):
        raise ValueError("model: quantization_config.modules_to_not_convert must be a list of "
                         f"module names, got {keep!r}")
    return QuantConfig("fp8", (block[0], block[1]), tuple(keep))


def is_fp8(t: torch.Tensor) -> bool:
    """True for a tensor stored in any float8 dtype."""
    return t.dtype in _FP8_STORAGE


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Shape of the ``weight_scale_inv`` of a `[N, K]` weight: one scale per block."""
    n, k = shape
    return -(-n // block[0]), -(-k // block[1])


def _blocks(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``t`` `[N, K]` zero-padded to whole blocks, viewed `[N/bn, bn, K/bk, bk]`."""
    n, k = t.shape
    rows, cols = scale_shape((n, k), block)
    padded = torch.nn.functional.pad(t, (0, cols * block[1] - k, 0, rows * block[0] - n))
    return padded.view(rows, block[0], cols, block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype) -> torch.Tensor:
    """``weight * scale_inv`` of its block, computed in float32 and rounded once to
    ``dtype`` (DeepSeek's ``weight_dequant``). weight: `[N, K]` float8; scale_inv:
    :func:`scale_shape` float32. Returns `[N, K]` in ``dtype``."""
    n, k = weight.shape
    if tuple(scale_inv.shape) != scale_shape((n, k), block):
        raise ValueError(f"quantization: scale_inv has shape {tuple(scale_inv.shape)}, a "
                         f"[{n}, {k}] weight in {list(block)} blocks needs "
                         f"{list(scale_shape((n, k), block))}")
    w = _blocks(weight.float(), block) * scale_inv.float()[:, None, :, None]
    rows, bn, cols, bk = w.shape
    return w.reshape(rows * bn, cols * bk)[:n, :k].to(dtype).contiguous()


def quantize(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize ``weight`` `[N, K]` (any float dtype) to e4m3: returns ``(fp8 [N, K],
    scale_inv [N/bn, K/bk] float32)`` with ``scale_inv = amax(|block|) / 448`` (1 for an
    all-zero block), the scaling DeepSeek's and the Qwen3 FP8 checkpoints use."""
    n, k = weight.shape
    w = _blocks(weight.float(), block)  # [N/bn, bn, K/bk, bk]
    amax = w.abs().amax(dim=(1, 3))  # [N/bn, K/bk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    rows, bn, cols, bk = q.shape
    return q.reshape(rows * bn, cols * bk)[:n, :k].contiguous(), scale
