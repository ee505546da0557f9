"""Efficiency factors of the roofline model, per GPU type, and their profile file.

A profile is written by ``megaserve plan calibrate`` (see planner/calibrate.py) and read
by ``megaserve plan --profile``. Format (YAML)::

    version: 1
    default: {hbm_eff: 0.8, flops_eff: 0.7, ...}   # fields of Efficiency; any subset
    gpus:
      H20: {hbm_eff: 0.83}                          # per-GPU overrides of the default
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from planner.errors import InputError


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

    def __post_init__(self) -> None:
        for name in ("hbm_eff", "flops_eff", "link_eff", "net_eff"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        for name in ("link_alpha_us", "net_alpha_us", "msg_half_kb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


_FIELDS = [f.name for f in dataclasses.fields(Efficiency)]


@dataclass(frozen=True)
class Profile:
    """Efficiency for every GPU type: ``gpus[name]`` if present, else ``default``."""

    default: Efficiency = Efficiency()
    gpus: Mapping[str, Efficiency] = field(default_factory=dict)

    def for_gpu(self, name: str) -> Efficiency:
        return self.gpus.get(name, self.default)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "default": dataclasses.asdict(self.default),
            "gpus": {k: dataclasses.asdict(v) for k, v in sorted(self.gpus.items())},
        }


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


def parse_profile(data: Any) -> Profile:
    """Build a Profile from parsed YAML; raises InputError naming the bad field."""
    if not isinstance(data, Mapping) or data.get("version") != 1:
        raise InputError("profile: expected a mapping with 'version: 1'")
    default = _efficiency(Efficiency(), data.get("default") or {}, "default")
    gpus = {str(k): _efficiency(default, v, f"gpus.{k}") for k, v in (data.get("gpus") or {}).items()}
    return Profile(default, gpus)


def load_profile(path: str | Path) -> Profile:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise InputError(f"cannot read profile {str(path)!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise InputError(f"malformed YAML in profile {str(path)!r}: {getattr(e, 'problem', e)}") from None
    return parse_profile(data)


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(profile.to_dict(), sort_keys=False))
