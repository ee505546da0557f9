"""The plan file (YAML, ``version: 1``) read by ``megaserve serve --plan`` and ``deploy/``.

Schema (docs/planner.md has the full description)::

    version: 1
    model: mixtral-8x22b            # built-in name or config.json path given to the planner
    objective: throughput           # or cost
    workload: {input_len, output_len, tpot_ms, ttft_ms, expert_skew}
    summary: {throughput_tok_s, cost_per_hour, tokens_per_cost, tokens_per_joule, gpus: {TYPE: n},
              ilp_status, ilp_gap, solver}   # solver: CBC, ratio, or greedy (+ note)
    units:                          # deployment units; each is `copies` identical deployments
      - copies: 2
        layout: disaggregated       # or colocated: attention and experts on the same GPUs
        attention: {gpu: H20, tp: 4, replicas: 4, max_batch_per_replica: 632}
        experts: {gpu: L40S, tp: 2, workers: 8, placement: [[0], [1], ...]}  # expert ids per worker
        microbatches: 2
        predicted: {tpot_ms, ttft_ms, throughput_tok_s, ...}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import yaml

from megaserve.planner.errors import InputError
from megaserve.planner.ilp import Selection
from megaserve.planner.model_spec import ModelSpec
from megaserve.planner.perf import Workload
from megaserve.planner.atoms import Atoms

PLAN_VERSION = 1


def placement(num_experts: int, n_e: int) -> list[list[int]]:
    """Contiguous, balanced expert ids per worker (the same for every MoE layer)."""
    per = -(-num_experts // n_e)
    return [list(range(w * per, min((w + 1) * per, num_experts))) for w in range(n_e)]


def unit_dict(model: ModelSpec, atoms: Atoms, i: int, copies: int = 1) -> dict[str, Any]:
    """One deployment unit (atom i) as plan-file data."""
    r = atoms.row(i)
    return {
        "copies": copies,
        "layout": r["layout"],
        "attention": {"gpu": r["attn_gpu"], "tp": r["tp_a"], "replicas": r["n_a"],
                      "max_batch_per_replica": r["m"] * r["b"]},
        "experts": {"gpu": r["expert_gpu"], "tp": r["tp_e"], "workers": r["n_e"],
                    "placement": placement(model.num_experts, r["n_e"])},
        "microbatches": r["m"],
        "predicted": {
            "tpot_ms": round(r["tpot"] * 1e3, 3),
            "ttft_ms": round(r["ttft"] * 1e3, 1),
            "throughput_tok_s": round(r["throughput"], 1),
            "t_attention_us": round(r["t_a"] * 1e6, 2),
            "t_expert_us": round(r["t_e"] * 1e6, 2),
            "t_comm_us": round(r["t_c"] * 1e6, 2),
            "memory_attention_gb": round(r["mem_a"] / 1e9, 2),
            "memory_expert_gb": round(r["mem_e"] / 1e9, 2),
            "bottleneck": r["bottleneck"],
            "cost_per_hour": round(r["cost"], 3),
        },
    }


def plan_dict(model_arg: str, model: ModelSpec, work: Workload, objective: str, atoms: Atoms,
              sel: Selection) -> dict[str, Any]:
    """The whole plan file content for a selection of atoms."""
    return {
        "version": PLAN_VERSION,
        "model": model_arg,
        "objective": objective,
        "workload": {"input_len": work.input_len, "output_len": work.output_len, "tpot_ms": work.tpot_ms,
                     "ttft_ms": work.ttft_ms, "expert_skew": work.expert_skew},
        "summary": {
            "throughput_tok_s": round(sel.throughput, 1),
            "cost_per_hour": round(sel.cost, 3),
            "tokens_per_cost": round(sel.throughput * 3600 / sel.cost, 1) if sel.cost else 0.0,
            "tokens_per_joule": round(sel.throughput / sel.power, 3) if sel.power else 0.0,
            "gpus": {k: v for k, v in sel.gpus_used.items() if v},
            "ilp_status": sel.status,
            "ilp_gap": None if sel.gap != sel.gap else round(sel.gap, 6),
            "solver": sel.solver,
            **({"note": sel.note} if sel.note else {}),
        },
        "units": [unit_dict(model, atoms, i, c) for i, c in zip(sel.atom_ids, sel.copies)],
    }


def write_plan(plan: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(dict(plan), sort_keys=False, default_flow_style=None))


_UNIT_KEYS = {"attention": ("gpu", "tp", "replicas", "max_batch_per_replica"),
              "experts": ("gpu", "tp", "workers", "placement")}


def load_plan(path: str | Path) -> dict[str, Any]:
    """Read and check a plan file; raises InputError naming the first missing or bad key."""
    try:
        plan = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise InputError(f"cannot read plan {str(path)!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise InputError(f"malformed YAML in plan {str(path)!r}: {getattr(e, 'problem', e)}") from None
    if not isinstance(plan, dict) or plan.get("version") != PLAN_VERSION:
        raise InputError(f"plan {str(path)!r}: expected a mapping with 'version: {PLAN_VERSION}'")
    if "model" not in plan or not isinstance(plan.get("units"), list) or not plan["units"]:
        raise InputError(f"plan {str(path)!r}: needs 'model' and a non-empty 'units' list")
    for n, unit in enumerate(plan["units"]):
        for side, keys in _UNIT_KEYS.items():
            missing = [k for k in keys if k not in (unit.get(side) or {})]
            if missing:
                raise InputError(f"plan {str(path)!r}: units[{n}].{side} lacks {missing}")
        ids = sorted(e for worker in unit["experts"]["placement"] for e in worker)
        if ids != list(range(len(ids))) or len(unit["experts"]["placement"]) != unit["experts"]["workers"]:
            raise InputError(f"plan {str(path)!r}: units[{n}].experts.placement must list every expert once, "
                             "one list per worker")
        if "microbatches" not in unit:
            raise InputError(f"plan {str(path)!r}: units[{n}] lacks 'microbatches'")
    return plan
