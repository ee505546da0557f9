"""What the launchers need from a ``megaserve plan`` file: its units and their GPU types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class UnitGpus:
    """The GPUs one copy of a plan unit runs on.

    ``attention_gpu`` / ``expert_gpu``: GPU type names as the plan writes them ("H100");
    ``attention_gpus`` = replicas x tp_a, ``expert_gpus`` = workers x tp_e (a colocated
    unit puts both roles on the same GPUs, so ``expert_gpus`` is 0 there)."""

    attention_gpu: str
    expert_gpu: str
    attention_gpus: int
    expert_gpus: int
    attention_tp: int
    expert_tp: int

    def gpus_by_type(self) -> dict[str, int]:
        """GPUs per type for one copy of the unit, e.g. ``{"H100": 2, "L40S": 4}``."""
        counts: dict[str, int] = {}
        for gpu, n in ((self.attention_gpu, self.attention_gpus), (self.expert_gpu, self.expert_gpus)):
            if n:
                counts[gpu] = counts.get(gpu, 0) + n
        return counts


def load_units(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The plan and its units. Raises ValueError for an unreadable or malformed plan."""
    from megaserve.planner.errors import InputError
    from megaserve.planner.plan_file import load_plan

    try:
        plan = load_plan(path)
    except InputError as e:
        raise ValueError(f"plan: {e}") from None
    return plan, list(plan["units"])


def unit_gpus(unit: dict[str, Any]) -> UnitGpus:
    """GPU types and counts of one plan unit (see :class:`UnitGpus`)."""
    attention, experts = unit["attention"], unit["experts"]
    colocated = unit.get("layout") == "colocated"
    return UnitGpus(
        attention_gpu=str(attention["gpu"]),
        expert_gpu=str(experts["gpu"]),
        attention_gpus=int(attention["replicas"]) * int(attention["tp"]),
        expert_gpus=0 if colocated else int(experts["workers"]) * int(experts["tp"]),
        attention_tp=int(attention["tp"]),
        expert_tp=int(experts["tp"]),
    )


def plan_gpu_options(path: str, unit_index: int = 0) -> dict[str, str]:
    """EngineConfig options placing a plan unit's roles by GPU type (for ``--launcher ray``).
    Raises ValueError for a bad plan or unit index."""
    _, units = load_units(path)
    if not 0 <= unit_index < len(units):
        raise ValueError(f"plan_unit: {unit_index} out of range, {path} has {len(units)} units")
    gpus = unit_gpus(units[unit_index])
    return {"attention_gpu_type": gpus.attention_gpu, "expert_gpu_type": gpus.expert_gpu}
