"""Fit efficiency factors from measurements: ``megaserve plan calibrate --from bench.json``.

Input (JSON), one GPU type per file::

    {"gpu": "H100-SXM",                      # catalog name the numbers were measured on
     "measurements": [
       {"kind": "gemm", "m": 4096, "n": 4096, "k": 4096, "seconds": 2.1e-4},
       {"kind": "memory", "bytes": 1.0e9, "seconds": 3.6e-4},       # streaming read
       {"kind": "link", "bytes": 6.7e7, "seconds": 2.0e-4},         # per-GPU bytes moved
       {"kind": "net", "bytes": 6.7e7, "seconds": 1.7e-3}]}

Fits: ``flops_eff`` = median achieved/peak FLOP/s over compute-bound GEMMs (arithmetic
intensity above the datasheet knee); ``hbm_eff`` = median achieved/peak bandwidth over
``memory`` entries and memory-bound GEMMs; for ``link`` and ``net``, a least-squares line
``seconds = alpha + bytes / (eff * peak)`` gives the latency and the efficiency (needs two
distinct sizes). Fields with no usable measurement keep their previous value.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from planner.catalog import GpuSpec
from planner.errors import InputError
from planner.profile import Efficiency, Profile

logger = logging.getLogger(__name__)


def _clip(x: float) -> float:
    return float(min(1.0, max(1e-3, x)))


def _line_fit(points: list[tuple[float, float]], peak: float) -> tuple[float, float] | None:
    """(alpha_us, eff) from (bytes, seconds) points, or None without two distinct sizes."""
    sizes = {b for b, _ in points}
    if len(sizes) < 2:
        return None
    x = np.array([b for b, _ in points])
    y = np.array([s for _, s in points])
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:
        return None
    return max(0.0, float(intercept)) * 1e6, _clip(1.0 / slope / peak)


def fit_efficiency(gpu: GpuSpec, measurements: list[Mapping[str, Any]], base: Efficiency) -> Efficiency:
    """Efficiency factors of ``gpu`` from measurements; raises InputError for bad entries."""
    knee = gpu.flops_per_s / gpu.hbm_bytes_per_s
    flops_r, hbm_r, link, net = [], [], [], []
    for n, meas in enumerate(measurements):
        try:
            kind, secs = meas["kind"], float(meas["seconds"])
            if secs <= 0:
                raise ValueError("seconds must be > 0")
            if kind == "gemm":
                m, nn, k = (int(meas[x]) for x in ("m", "n", "k"))
                flops, nbytes = 2.0 * m * nn * k, 2.0 * (m * k + k * nn + m * nn)
                (flops_r if flops / nbytes >= knee else hbm_r).append(
                    flops / secs / gpu.flops_per_s if flops / nbytes >= knee else nbytes / secs / gpu.hbm_bytes_per_s
                )
            elif kind == "memory":
                hbm_r.append(float(meas["bytes"]) / secs / gpu.hbm_bytes_per_s)
            elif kind in ("link", "net"):
                (link if kind == "link" else net).append((float(meas["bytes"]), secs))
            else:
                raise ValueError(f"unknown kind {kind!r} (gemm, memory, link, net)")
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"measurements[{n}]: {e}") from None
    fields: dict[str, float] = {}
    if flops_r:
        fields["flops_eff"] = _clip(float(np.median(flops_r)))
    if hbm_r:
        fields["hbm_eff"] = _clip(float(np.median(hbm_r)))
    for kind, points, peak in (("link", link, gpu.link_gbps * 1e9), ("net", net, gpu.net_gbps * 1e9)):
        fit = _line_fit(points, peak)
        if fit is not None:
            fields[f"{kind}_alpha_us"], fields[f"{kind}_eff"] = fit
    logger.info("calibrated %s: %s", gpu.name, fields)
    return dataclasses.replace(base, **fields)


def calibrate(bench_path: str | Path, gpus: Mapping[str, GpuSpec], profile: Profile,
              gpu_name: str | None = None) -> Profile:
    """``profile`` with the GPU measured in ``bench_path`` recalibrated."""
    try:
        data = json.loads(Path(bench_path).read_text())
    except OSError as e:
        raise InputError(f"cannot read {str(bench_path)!r}: {e.strerror}") from None
    except ValueError as e:
        raise InputError(f"cannot parse {str(bench_path)!r} as JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("measurements"), list):
        raise InputError(f"{str(bench_path)!r}: expected an object with a 'measurements' list")
    name = gpu_name or data.get("gpu")
    if name not in gpus:
        raise InputError(f"unknown GPU {name!r} for calibration; known: {', '.join(sorted(gpus))} (use --gpu)")
    eff = fit_efficiency(gpus[name], data["measurements"], profile.for_gpu(name))
    return Profile(profile.default, {**profile.gpus, name: eff})
