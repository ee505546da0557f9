"""Engine options from a ``megaserve plan`` file (see docs/planner.md for its schema)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def engine_options_from_plan(path: str, unit_index: int = 0) -> dict[str, Any]:
    """The layout of one deployment unit of a plan, as EngineConfig keyword arguments:
    ``attention_replicas``, ``expert_workers``, ``microbatches``, ``expert_placement`` and
    ``max_num_seqs`` (the planned batch per replica); a ``colocated`` unit over several GPUs
    adds ``data_parallel_size`` and ``enable_expert_parallel`` (co-located expert
    parallelism, one worker per GPU), over one GPU it is the one-process engine.

    The plan's model and GPU types are the planner's; the weights served are ``--model``'s.
    Raises ``ValueError`` for an unreadable or malformed plan or a unit index out of range.
    """
    from megaserve.planner.errors import InputError
    from megaserve.planner.plan_file import load_plan

    try:
        plan = load_plan(path)
    except InputError as e:
        raise ValueError(f"plan: {e}") from None
    units = plan["units"]
    if not 0 <= unit_index < len(units):
        raise ValueError(f"plan_unit: {unit_index} out of range, {path} has {len(units)} units")
    unit = units[unit_index]
    attention, experts = unit["attention"], unit["experts"]
    if attention["tp"] != 1 or experts["tp"] != 1:
        # NOTE: the runtime has no tensor parallelism yet; each worker runs on one device.
        logger.warning("plan unit %d asks for tp_a=%s, tp_e=%s: running every worker at tp=1",
                       unit_index, attention["tp"], experts["tp"])
    options = {
        "attention_replicas": int(attention["replicas"]),
        "expert_workers": int(experts["workers"]),
        "microbatches": int(unit["microbatches"]),
        "expert_placement": tuple(tuple(int(e) for e in worker) for worker in experts["placement"]),
        "max_num_seqs": int(attention["max_batch_per_replica"]),
    }
    if unit.get("layout") == "colocated":
        return _colocated_options(options, unit_index)
    return options


def _colocated_options(options: dict[str, Any], unit_index: int) -> dict[str, Any]:
    """A co-located unit (attention and experts on the same GPUs, ``ep`` of them) is
    co-located expert parallelism over ``ep`` workers, or one engine where ``ep == 1``."""
    size = options["attention_replicas"]
    if options["expert_workers"] != size:
        raise ValueError(f"plan unit {unit_index}: a colocated unit has as many expert workers "
                         f"as attention replicas, got {options['expert_workers']} and {size}")
    if size == 1:  # every expert in the one engine: no placement to honour
        return {**options, "expert_placement": None}
    return {**options, "data_parallel_size": size, "enable_expert_parallel": True}
