"""What the benchmarks print and record about the device they ran on."""

from __future__ import annotations

import platform

# GPU names as torch reports them -> planner catalog names (first match wins)
CATALOG_NAMES = (("H200", "H200"), ("H100", "H100-SXM"), ("H800", "H800"), ("H20", "H20"),
                 ("A100", "A100-80G"), ("L40S", "L40S"), ("L20", "L20"), ("B200", "B200"))


def device_name(device: str) -> str:
    """A readable name of ``device``: the CUDA device's name (``"NVIDIA H200"``) for
    ``cuda`` / ``cuda:N`` (the current device), else ``"CPU (<processor>)"``."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()})"


def catalog_gpu(name: str) -> str | None:
    """The planner catalog name of a CUDA device name (``"NVIDIA H100 80GB HBM3"`` ->
    ``"H100-SXM"``), or None if the catalog has no such GPU."""
    return next((cat for key, cat in CATALOG_NAMES if key in name), None)
