"""Efficiency factors of the roofline model, per GPU type, and their profile file.

A profile is written by ``megaserve plan calibrate`` (see planner/calibrate.py) and read
by ``megaserve plan --profile`` (a path, a shipped name in ``SHIPPED``, or ``none``).
Format (YAML)::

    version: 1
    default: {hbm_eff: 0.8, flops_eff: 0.7, ...}   # fields of Efficiency; any subset
    gpus:
      H20: {hbm_eff: 0.83}                          # per-GPU overrides of the default
    fits:                                           # optional: how each GPU was obtained
      H20: {points: 9, max_err: 0.04, mean_err: 0.02, before_max_err: 3.5, files: [...]}
      H800: {transferred_from: H200}                # copied, not measured
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from megaserve.planner.errors import InputError


@dataclass(frozen=True)
class Efficiency:
    """Fractions of datasheet peaks reached in practice, and communication constants.

    Communication time of ``n`` bytes in messages of ``s`` bytes over a link of peak
    bandwidth ``B`` is ``alpha + n / (B * eff * s / (s + msg_half))``: ``alpha`` is the
    fixed latency, and messages smaller than ``msg_half`` get less than half the bandwidth.
    """

    hbm_eff: float = 0.80  # achieved / peak HBM bandwidth for streaming weights and KV
    flops_eff: float = 0.70  # achieved / peak dense BF16 tensor FLOP/s for large GEMMs
    link_eff: float = 0.80  # achieved / peak NVLink or PCIe bandwidth (TP all-reduce)
    net_eff: float = 0.80  # achieved / peak NIC bandwidth (attention <-> expert traffic)
    link_alpha_us: float = 5.0  # fixed latency of one intra-node collective
    net_alpha_us: float = 10.0  # fixed latency of one dispatch or combine over the network
    msg_half_kb: float = 16.0  # message size reaching half of the achievable bandwidth
    # Fixed costs a pure roofline misses (0 = uncalibrated). Fitted from engine
    # measurements by planner/calibrate.py; see docs/planner.md "Calibration".
    step_overhead_us: float = 0.0  # per decode iteration: scheduler, sampler, graph launch
    seq_overhead_us: float = 0.0  # per sequence per decode iteration (sampling, bookkeeping)
    layer_overhead_us: float = 0.0  # per layer per micro-batch per worker: kernel launches, tails
    token_overhead_us: float = 0.0  # per token per layer on the attention side (per-row kernels)
    # per (token, expert) assignment per MoE layer on the expert side: routing permute, the
    # grouped GEMM's per-row cost at the small row counts of decode, the weighted combine
    expert_row_overhead_us: float = 0.0
    # per MoE layer per micro-batch, paid only where tokens cross processes (a disaggregated
    # unit, co-located EP over several GPUs): packing, flag hops, the remote side's preparation
    split_overhead_us: float = 0.0

    def __post_init__(self) -> None:
        for name in ("hbm_eff", "flops_eff", "link_eff", "net_eff"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        for name in ("link_alpha_us", "net_alpha_us", "msg_half_kb", "step_overhead_us", "seq_overhead_us",
                     "layer_overhead_us", "token_overhead_us", "expert_row_overhead_us", "split_overhead_us"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


_FIELDS = [f.name for f in dataclasses.fields(Efficiency)]


@dataclass(frozen=True)
class Profile:
    """Efficiency for every GPU type: ``gpus[name]`` if present, else ``default``.

    ``fits[name]`` records how a GPU's factors were obtained (written by calibration):
    ``points`` (measurements fitted), ``max_err`` / ``mean_err`` (|predicted / measured - 1|
    after the fit), ``before_max_err`` (the same with the datasheet defaults), ``files``;
    or ``transferred_from`` for factors copied from a similar GPU without a measurement.
    ``source`` names where the profile was read from (for the report).
    """

    default: Efficiency = Efficiency()
    gpus: Mapping[str, Efficiency] = field(default_factory=dict)
    fits: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    source: str = "datasheet defaults"

    def for_gpu(self, name: str) -> Efficiency:
        return self.gpus.get(name, self.default)

    def describe(self, gpu_names: Sequence[str]) -> str:
        """One line per GPU type: calibrated (with its measured error), transferred or default."""
        lines = [f"profile: {self.source}"]
        for name in gpu_names:
            fit = self.fits.get(name)
            if name not in self.gpus:
                what = ("datasheet efficiency defaults" if self.default == Efficiency()
                        else "the profile's default factors")
                lines.append(f"  {name}: {what}, not calibrated (error unknown)")
            elif fit and "max_err" in fit:
                lines.append(
                    f"  {name}: calibrated on {fit.get('points', '?')} measurements; measured error "
                    f"max {fit['max_err']:.1%}, mean {fit.get('mean_err', float('nan')):.1%} "
                    f"(datasheet defaults: max {fit.get('before_max_err', float('nan')):.1%})")
            elif fit and "transferred_from" in fit:
                lines.append(f"  {name}: factors of {fit['transferred_from']} (not measured on {name}; error unknown)")
            else:
                lines.append(f"  {name}: profile factors without a recorded fit (error unknown)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": 1,
            "default": dataclasses.asdict(self.default),
            "gpus": {k: dataclasses.asdict(v) for k, v in sorted(self.gpus.items())},
        }
        if self.fits:
            out["fits"] = {k: dict(v) for k, v in sorted(self.fits.items())}
        return out


def _efficiency(base: Efficiency, fields: Any, where: str) -> Efficiency:
    if not isinstance(fields, Mapping):
        raise InputError(f"profile {where}: expected a mapping of efficiency fields")
    bad = sorted(set(fields) - set(_FIELDS))
    if bad:
        raise InputError(f"profile {where}: unknown field(s) {bad}; valid: {_FIELDS}")
    try:
        return dataclasses.replace(base, **{k: float(v) for k, v in fields.items()})
    except (TypeError, ValueError) as e:
        raise InputError(f"profile {where}: {e}") from None


def parse_profile(data: Any, source: str = "profile") -> Profile:
    """Build a Profile from parsed YAML; raises InputError naming the bad field."""
    if not isinstance(data, Mapping) or data.get("version") != 1:
        raise InputError("profile: expected a mapping with 'version: 1'")
    default = _efficiency(Efficiency(), data.get("default") or {}, "default")
    gpus = {str(k): _efficiency(default, v, f"gpus.{k}") for k, v in (data.get("gpus") or {}).items()}
    fits = data.get("fits") or {}
    if not isinstance(fits, Mapping) or not all(isinstance(v, Mapping) for v in fits.values()):
        raise InputError("profile fits: expected a mapping of GPU name -> fit record")
    return Profile(default, gpus, {str(k): dict(v) for k, v in fits.items()}, source)


SHIPPED_DIR = Path(__file__).resolve().parent / "profiles"
SHIPPED = {"hopper": SHIPPED_DIR / "hopper.yaml"}  # --profile NAME -> file in the package
NO_PROFILE = "none"  # --profile none: datasheet defaults for every GPU


def load_profile(path: str | Path) -> Profile:
    """A profile file, a shipped profile's name (``SHIPPED``), or ``none`` (datasheet defaults)."""
    if str(path) == NO_PROFILE:
        return Profile()
    named = SHIPPED.get(str(path))
    file = named or Path(path)
    try:
        data = yaml.safe_load(Path(file).read_text())
    except OSError as e:
        raise InputError(f"cannot read profile {str(path)!r}: {e.strerror} "
                         f"(shipped profiles: {', '.join(SHIPPED)}, or 'none')") from None
    except yaml.YAMLError as e:
        raise InputError(f"malformed YAML in profile {str(path)!r}: {getattr(e, 'problem', e)}") from None
    return parse_profile(data, f"{path} (shipped: {file.relative_to(SHIPPED_DIR.parent.parent)})" if named
                         else str(path))


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(profile.to_dict(), sort_keys=False))
