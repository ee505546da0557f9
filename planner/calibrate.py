"""Fit efficiency factors from measurements: ``megaserve plan calibrate FILE... -o profile.yaml``.

Two kinds of content, in the same file or in separate files (one GPU type per file):

1. Engine runs (``runs``, format in planner/measurements.py; ``megaserve bench throughput
   --profile-out`` writes them): fit ``hbm_eff`` and the fixed per-step, per-sequence,
   per-layer and per-token overheads a pure roofline misses (:func:`fit_runs`), reporting
   every run's error before and after.
2. Kernel and transport entries (``measurements``)::

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
distinct sizes). Fields with no usable measurement keep their previous value. Kernel
entries are fitted first; the engine runs then refine (and cap ``flops_eff`` at) them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from megaserve.planner.catalog import GpuSpec
from megaserve.planner.errors import InputError
from megaserve.planner.measurements import Run, load_file, parse_runs, predict, rel_errors
from megaserve.planner.profile import Efficiency, Profile

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


def calibrate(paths: Sequence[str | Path] | str | Path, gpus: Mapping[str, GpuSpec], profile: Profile,
              gpu_name: str | None = None) -> tuple[Profile, dict[str, RunFit]]:
    """``profile`` with every GPU measured in ``paths`` recalibrated, and the run fits.

    Per GPU: kernel and transport entries (``measurements``) first (:func:`fit_efficiency`),
    then engine runs (``runs``, planner/measurements.py) fit ``hbm_eff`` and the overheads
    with ``flops_eff`` capped at the value step one left (:func:`fit_runs`). ``gpu_name``
    overrides the files' ``gpu``. Raises InputError for unreadable or malformed files.
    """
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    by_gpu: dict[str, tuple[list, list, list[str]]] = {}
    for path in paths:
        data = load_file(path)
        if not isinstance(data, dict) or not (isinstance(data.get("measurements"), list) or data.get("runs")):
            raise InputError(f"{str(path)!r}: expected an object with a 'measurements' or 'runs' list")
        name = gpu_name or data.get("gpu")
        if name not in gpus:
            raise InputError(f"unknown GPU {name!r} for calibration; known: {', '.join(sorted(gpus))} (use --gpu)")
        runs = parse_runs(data, Path(path).name) if data.get("runs") else []
        entry = by_gpu.setdefault(name, ([], [], []))
        entry[0].extend(data.get("measurements") or [])
        entry[1].extend(runs)
        entry[2].append(Path(path).name)
    effs, fits_out, records = dict(profile.gpus), {}, dict(profile.fits)
    for name, (meas, runs, files) in by_gpu.items():
        eff = fit_efficiency(gpus[name], meas, profile.for_gpu(name)) if meas else profile.for_gpu(name)
        if runs:  # "before": the profile we started from (datasheet defaults by default)
            fit = fit_runs(gpus[name], runs, eff)
            fits_out[name] = dataclasses.replace(fit, before=run_errors(runs, gpus[name], profile.for_gpu(name)))
            eff = fit.efficiency
            records[name] = fits_out[name].record(files)
        effs[name] = eff
    return Profile(profile.default, effs, records, profile.source), fits_out


# --- engine runs: efficiency and fixed overheads from measured co-located steps -------

HBM_MAX = 0.90  # the most of its datasheet HBM bandwidth a GPU streams (fits may not claim more)
MAX_LINEARISATIONS = 4  # fits of a GPU with async runs (each linearised at the previous one)
# Refits toward the smallest worst error after the least-squares fit (Lawson's reweighting:
# each run's weight times its error): the acceptance is every run within 15 %, and plain least
# squares lets many rows of one kind outvote a few of another
MINIMAX_REWEIGHTS = 2
OVERHEADS = ("step_overhead_us", "seq_overhead_us", "layer_overhead_us", "token_overhead_us",
             "expert_row_overhead_us", "split_overhead_us")


@dataclass(frozen=True)
class RunError:
    """A run's relative errors |predicted / measured - 1| (TPOT None when not measured)."""

    label: str
    tok_s_err: float
    tpot_err: float | None
    predicted_tok_s: float
    measured_tok_s: float

    @property
    def worst(self) -> float:
        return max(self.tok_s_err, self.tpot_err or 0.0)


@dataclass(frozen=True)
class RunFit:
    """Fitted efficiency of one GPU and the errors of every run before and after."""

    gpu: str
    efficiency: Efficiency
    before: tuple[RunError, ...]  # with the efficiency the fit started from
    after: tuple[RunError, ...]

    def record(self, files: Sequence[str]) -> dict[str, Any]:
        """The profile's ``fits`` entry for this GPU."""
        return {"points": len(self.after), "max_err": round(max(e.worst for e in self.after), 4),
                "mean_err": round(float(np.mean([e.worst for e in self.after])), 4),
                "before_max_err": round(max(e.worst for e in self.before), 4),
                "before_mean_err": round(float(np.mean([e.worst for e in self.before])), 4),
                "files": sorted(files)}


def run_errors(runs: Sequence[Run], gpu: GpuSpec, eff: Efficiency) -> tuple[RunError, ...]:
    out = []
    for run in runs:
        pred = predict(run, gpu, eff)
        tok, tpot = rel_errors(run, pred)
        out.append(RunError(run.label, tok, tpot, pred.tok_s, run.tok_s))
    return tuple(out)


def _nnls(a: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """argmin ||a x - y|| over x >= 0, exactly, by trying every support (few columns)."""
    best, best_res = np.zeros(a.shape[1]), float(y @ y)
    for mask in itertools.product((False, True), repeat=a.shape[1]):
        cols = np.flatnonzero(mask)
        if not len(cols):
            continue
        x_s, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if np.any(x_s < 0):
            continue
        x = np.zeros(a.shape[1])
        x[cols] = x_s
        res = float(np.sum((a @ x - y) ** 2))
        if res < best_res:
            best, best_res = x, res
    return best, best_res


def fit_runs(gpu: GpuSpec, runs: Sequence[Run], base: Efficiency, reweights: int = MINIMAX_REWEIGHTS) -> RunFit:
    """Fit ``hbm_eff``, ``flops_eff`` and the overheads (:data:`OVERHEADS`; the split overhead stays 0 without runs that cross processes) of ``gpu``.

    ``flops_eff`` is capped at ``base.flops_eff`` (from GEMM measurements, or the datasheet
    default): engine runs at serving batches rarely reach the compute roof, so they can
    lower it but never credit the GPU with more than a measured GEMM reached. ``hbm_eff``
    stays <= :data:`HBM_MAX`: a fit that wants more is putting fixed time into bandwidth.

    Minimises the sum of squared relative errors of time per generated token over the runs.
    Predicted time is linear in the overheads (piecewise, for runs measured with async
    scheduling: max(GPU, host) per step) and piecewise in the two efficiencies, so: a grid
    over (hbm_eff, flops_eff), coarse then fine, and at each point a non-negative least
    squares for the overheads, exact for synchronous runs and linearised at the previous
    fit for async ones. Then ``reweights`` weighted refits toward the smallest worst error
    (Lawson: each run's weight is multiplied by its relative error, then normalised), since
    every run, not the average one, must be predicted well. Raises InputError without runs.
    """
    if not runs:
        raise InputError(f"no runs measured on {gpu.name} to fit")
    zero = dataclasses.replace(base, **{k: 0.0 for k in OVERHEADS})
    measured = np.array([1.0 / r.tok_s for r in runs])
    sqrt_w = np.ones(len(runs))  # square roots of the runs' weights in the least squares

    def times(eff: Efficiency) -> np.ndarray:
        return np.array([1.0 / predict(r, gpu, eff).tok_s for r in runs])

    def fit_at(ref: Efficiency) -> tuple[float, float, np.ndarray]:
        """Grid over the efficiencies with the overheads' effect linearised at ``ref``."""
        x_ref = np.array([getattr(ref, k) for k in OVERHEADS])
        base_t = times(ref)
        # columns: extra seconds per generated token from 1 us more of each overhead
        cols = np.stack([times(dataclasses.replace(ref, **{k: getattr(ref, k) + 1.0})) - base_t
                         for k in OVERHEADS], axis=1)
        a = cols / measured[:, None]

        def solve(hbm: float, flops: float) -> tuple[float, np.ndarray]:
            t0 = times(dataclasses.replace(ref, hbm_eff=hbm, flops_eff=flops))
            x, res = _nnls(a * sqrt_w[:, None], (1.0 - t0 / measured + a @ x_ref) * sqrt_w)
            return res, x

        cap = base.flops_eff
        grid = [(h, f) for h in np.arange(0.30, HBM_MAX + 1e-4, 0.05) for f in np.geomspace(0.02 * cap, cap, 18)]
        best = min(grid, key=lambda p: solve(*p)[0])
        fine = [(h, f) for h in np.clip(best[0] + np.arange(-0.05, 0.0501, 0.01), 0.05, HBM_MAX)
                for f in np.clip(best[1] * np.geomspace(0.8, 1.25, 11), 1e-3, cap)]
        hbm, flops = min(fine, key=lambda p: solve(*p)[0])
        return float(hbm), float(flops), solve(hbm, flops)[1]

    # Predicted time is linear in the overheads for synchronous runs; an async run's step is
    # max(GPU, host) (perf.engine_step), piecewise linear: linearise at the last fit and refit
    # until the fit stops moving (without async runs the first pass is exact).
    def fit_from(ref: Efficiency) -> Efficiency:
        for _ in range(MAX_LINEARISATIONS):
            hbm, flops, x = fit_at(ref)
            fields = {"hbm_eff": round(hbm, 4), "flops_eff": round(flops, 4),
                      **{k: round(float(v), 4) for k, v in zip(OVERHEADS, x)}}
            eff = dataclasses.replace(base, **fields)
            if not any(r.async_scheduling for r in runs) or eff == ref:
                break
            ref = eff
        return eff

    eff = fit_from(zero)
    weights = np.ones(len(runs))
    for _ in range(reweights):
        err = np.array([e.worst for e in run_errors(runs, gpu, eff)])
        if err.max() < 1e-3:  # already exact (synthetic runs)
            break
        weights = weights * np.maximum(err, 1e-3)
        weights = weights / weights.mean()
        sqrt_w = np.sqrt(weights)
        eff = fit_from(eff)
    fields = {k: getattr(eff, k) for k in ("hbm_eff", "flops_eff", *OVERHEADS)}
    logger.info("calibrated %s on %d runs: %s", gpu.name, len(runs), fields)
    return RunFit(gpu.name, eff, run_errors(runs, gpu, base), run_errors(runs, gpu, eff))


def error_table(fit: RunFit) -> str:
    """Every run's measured and predicted tokens/s and worst relative error, before and after."""
    lines = [f"{fit.gpu}: {len(fit.after)} runs; |predicted / measured - 1| of tok/s (and TPOT where measured)",
             f"  {'run':<76} {'measured':>9} {'before':>9} {'err':>7} {'after':>9} {'err':>6}"]
    for b, a in zip(fit.before, fit.after):
        lines.append(f"  {a.label:<76} {a.measured_tok_s:>9.1f} {b.predicted_tok_s:>9.1f} {b.worst:>7.1%} "
                     f"{a.predicted_tok_s:>9.1f} {a.worst:>6.1%}")
    before, after = max(e.worst for e in fit.before), max(e.worst for e in fit.after)
    lines.append(f"  max error: before {before:.1%}, after {after:.1%}")
    return "\n".join(lines)


def transfer(profile: Profile, pair: str, gpus: Mapping[str, GpuSpec]) -> Profile:
    """``profile`` where GPU DST gets SRC's factors (``pair`` = "DST=SRC"), recorded in
    ``fits`` as ``transferred_from`` (no measured error). Raises InputError for bad names."""
    dst, _, src = pair.partition("=")
    if dst not in gpus or src not in profile.gpus:
        raise InputError(f"--transfer {pair!r}: need DST=SRC with DST a catalog GPU and SRC calibrated in the profile")
    fits = {**profile.fits, dst: {"transferred_from": src}}
    return Profile(profile.default, {**profile.gpus, dst: profile.gpus[src]}, fits, profile.source)
