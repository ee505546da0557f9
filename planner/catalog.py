"""GPU catalog and cluster inventory.

Every default below is a *per-GPU* figure. Sources:

* memory / HBM bandwidth / dense (non-sparse) BF16 tensor TFLOP/s / NVLink / power: the
  vendor datasheets (NVIDIA H20, L20, L40S, A100, A800, H100, H800, H200, HGX B200 product
  briefs). "Dense" is half the "with sparsity" figure those sheets headline.
* ``price`` is relative, normalised so that L20 = 1.00. H20 = 1.85 and L40S = 1.08 are
  MegaScale-Infer's own table (Zhu et al., 2025, Table 3); H800 = 5.28 is also taken from
  that table. The other prices are ESTIMATES (ratios of typical 2025 rental rates to an L20)
  and should be overridden with your own prices in cluster.yaml.
* ``net_gbps``: scale-out bandwidth per GPU in GB/s (one 400 Gb/s NIC per GPU = 50 GB/s for
  the SXM parts; PCIe parts are assumed to get one 200 Gb/s NIC per GPU = 25 GB/s).
* ``link_gbps``: intra-node GPU-GPU bandwidth per GPU and direction (NVLink, or PCIe 4.0
  x16 = 32 GB/s for the PCIe cards).

Users override any field or add GPUs under ``gpus:`` in cluster.yaml (see
examples/cluster.yaml).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from megaserve.planner.errors import InputError

GB = 1e9


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type. Units are in the field names; ``price`` is per GPU-hour, relative."""

    name: str
    memory_gb: float
    hbm_tbps: float
    bf16_tflops: float
    link: str  # "nvlink" or "pcie": the intra-node interconnect used by tensor parallelism
    link_gbps: float
    net_gbps: float
    power_w: float
    price: float
    source: str = "user"

    def __post_init__(self) -> None:
        for field in ("memory_gb", "hbm_tbps", "bf16_tflops", "link_gbps", "net_gbps", "price"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"GPU {self.name!r}: {field} must be a positive number, got {value!r}")
        if self.link not in ("nvlink", "pcie"):
            raise ValueError(f"GPU {self.name!r}: link must be 'nvlink' or 'pcie', got {self.link!r}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GB

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12

    @property
    def flops_per_s(self) -> float:
        return self.bf16_tflops * 1e12


_DS = "vendor datasheet"
_MSI = "MegaScale-Infer Table 3 (price, L20 = 1.00)"
_EST = "ESTIMATED relative price"

DEFAULT_GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("H20", 96, 4.0, 148, "nvlink", 450, 50, 400, 1.85, f"{_DS}; {_MSI}"),
        GpuSpec("L20", 48, 0.864, 119.5, "pcie", 32, 25, 275, 1.00, f"{_DS}; {_MSI}"),
        GpuSpec("L40S", 48, 0.864, 362, "pcie", 32, 25, 350, 1.08, f"{_DS}; {_MSI}"),
        GpuSpec("A100-80G", 80, 2.039, 312, "nvlink", 300, 25, 400, 2.60, f"{_DS}; {_EST}"),
        GpuSpec("A800", 80, 2.039, 312, "nvlink", 200, 25, 400, 2.60, f"{_DS}; {_EST}"),
        GpuSpec("H100-SXM", 80, 3.35, 989, "nvlink", 450, 50, 700, 5.28, f"{_DS}; {_EST} (as H800)"),
        GpuSpec("H800", 80, 3.35, 989, "nvlink", 200, 50, 700, 5.28, f"{_DS}; {_MSI}"),
        GpuSpec("H200", 141, 4.8, 989, "nvlink", 450, 50, 700, 6.50, f"{_DS}; {_EST}"),
        GpuSpec("B200", 180, 8.0, 2250, "nvlink", 900, 50, 1000, 9.50, f"{_DS}; {_EST}"),
    )
}

_SPEC_FIELDS = [f.name for f in dataclasses.fields(GpuSpec) if f.name != "name"]


@dataclass(frozen=True)
class InventoryEntry:
    """``count`` GPUs of type ``gpu``, in nodes of ``gpus_per_node`` (bounds tensor parallelism)."""

    gpu: str
    count: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or self.count < 0:
            raise ValueError(f"inventory {self.gpu!r}: count must be an integer >= 0, got {self.count!r}")
        if self.gpus_per_node not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"inventory {self.gpu!r}: gpus_per_node must be 1, 2, 4, 8 or 16, got {self.gpus_per_node!r}"
            )


@dataclass(frozen=True)
class Cluster:
    """A GPU catalog (defaults plus overrides) and the inventory available to plan on."""

    gpus: Mapping[str, GpuSpec]
    inventory: tuple[InventoryEntry, ...]

    def __post_init__(self) -> None:
        for entry in self.inventory:
            if entry.gpu not in self.gpus:
                raise ValueError(f"unknown GPU {entry.gpu!r}; known: {', '.join(sorted(self.gpus))}")

    def available(self) -> tuple[InventoryEntry, ...]:
        """Inventory entries with at least one GPU, in file order."""
        return tuple(e for e in self.inventory if e.count > 0)

    def with_counts(self, counts: Mapping[str, int]) -> Cluster:
        """A copy with the given GPU counts replaced (used by tests and benchmarks)."""
        entries = tuple(dataclasses.replace(e, count=counts.get(e.gpu, e.count)) for e in self.inventory)
        return Cluster(self.gpus, entries)


def merge_gpus(overrides: Mapping[str, Any] | None) -> dict[str, GpuSpec]:
    """The default catalog with ``overrides`` applied: partial dicts for known GPUs, full
    specs for new ones. Raises InputError naming the GPU and field that is wrong."""
    gpus = dict(DEFAULT_GPUS)
    for name, fields in (overrides or {}).items():
        if not isinstance(fields, Mapping):
            raise InputError(f"gpus.{name}: expected a mapping of fields, got {type(fields).__name__}")
        unknown = sorted(set(fields) - set(_SPEC_FIELDS))
        if unknown:
            raise InputError(f"gpus.{name}: unknown field(s) {unknown}; valid: {_SPEC_FIELDS}")
        base = dataclasses.asdict(gpus[name]) if name in gpus else {"source": "cluster.yaml"}
        missing = [f for f in _SPEC_FIELDS if f not in base and f not in fields]
        if missing:
            raise InputError(f"gpus.{name}: new GPU type needs field(s) {missing}")
        merged = {**base, **dict(fields), "name": str(name)}
        try:
            gpus[str(name)] = GpuSpec(**merged)
        except (TypeError, ValueError) as e:
            raise InputError(f"gpus.{name}: {e}") from None
    return gpus


def parse_cluster(data: Any) -> Cluster:
    """Build a Cluster from parsed YAML (see examples/cluster.yaml for the format)."""
    if not isinstance(data, Mapping):
        raise InputError("cluster file: expected a mapping with 'inventory' (and optional 'gpus')")
    unknown = sorted(set(data) - {"gpus", "inventory"})
    if unknown:
        raise InputError(f"cluster file: unknown key(s) {unknown}; valid: ['gpus', 'inventory']")
    gpus = merge_gpus(data.get("gpus"))
    raw = data.get("inventory")
    if not isinstance(raw, Mapping):
        raise InputError("cluster file: 'inventory' must map GPU name -> count or {count, gpus_per_node}")
    entries = []
    for name, value in raw.items():
        if str(name) not in gpus:
            raise InputError(f"unknown GPU {name!r} in inventory; known: {', '.join(sorted(gpus))}")
        fields = {"count": value} if not isinstance(value, Mapping) else dict(value)
        bad = sorted(set(fields) - {"count", "gpus_per_node"})
        if bad:
            raise InputError(f"inventory.{name}: unknown field(s) {bad}; valid: ['count', 'gpus_per_node']")
        try:
            entries.append(InventoryEntry(str(name), **fields))
        except (TypeError, ValueError) as e:
            raise InputError(str(e)) from None
    return Cluster(gpus, tuple(entries))


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster YAML file. Raises InputError for a missing or malformed file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise InputError(f"cannot read cluster file {str(path)!r}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise InputError(f"malformed YAML in {str(path)!r}{at}: {getattr(e, 'problem', e)}") from None
    return parse_cluster(data)
