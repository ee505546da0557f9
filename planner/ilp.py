"""Choosing how many copies of each plan atom to deploy within the inventory.

ILP (PuLP + its bundled CBC), with x_i = copies of atom i, u_it = GPUs of type t it uses:

* ``throughput``: maximise sum_i x_i tput_i  s.t.  sum_i x_i u_it <= count_t for every t.
* ``cost`` with a target rate R: minimise sum_i x_i cost_i  s.t.  sum_i x_i tput_i >= R and
  the inventory. Without R: maximise tokens per unit cost. A mix of atoms never beats the
  best atom's ratio (a ratio of sums is at most the largest ratio), so the plan is as many
  copies of the best-ratio atom as the inventory holds; no ILP is needed.

Packing into nodes needs no constraint: tensor-parallel groups are powers of two no larger
than the node, so any multiset of them with total <= nodes * gpus_per_node packs exactly.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import numpy as np
import pulp

from megaserve.planner.errors import InfeasibleError
from megaserve.planner.search import Atoms

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Selection:
    """Copies of each atom chosen (only nonzero ones), with solver diagnostics."""

    atom_ids: tuple[int, ...]
    copies: tuple[int, ...]
    throughput: float  # output tokens/s of the whole plan
    cost: float  # relative price per hour
    power: float  # board power of the GPUs used, watts
    gpus_used: dict[str, int]
    status: str  # "optimal", "time limit", or "greedy"
    gap: float  # relative gap to the LP relaxation bound (0 when proven optimal)
    solver: str


def _selection(atoms: Atoms, x: np.ndarray, status: str, gap: float, solver: str) -> Selection:
    ids = np.flatnonzero(x > 0)
    used = (x[:, None] * atoms.usage).sum(axis=0)
    return Selection(
        atom_ids=tuple(int(i) for i in ids), copies=tuple(int(x[i]) for i in ids),
        throughput=float(x @ atoms.throughput), cost=float(x @ atoms.cost), power=float(x @ atoms.power),
        gpus_used={t: int(u) for t, u in zip(atoms.types, used)}, status=status, gap=gap, solver=solver,
    )


def solve(atoms: Atoms, counts: np.ndarray, objective: str = "throughput", target_rate: float | None = None,
          time_limit_s: float = 1.0) -> Selection:
    """Pick integer copies of atoms within ``counts`` (GPUs per type, aligned with atoms.types).

    Raises InfeasibleError when the target rate cannot be reached with the inventory.
    """
    if objective not in ("throughput", "cost"):
        raise ValueError(f"objective must be 'throughput' or 'cost', got {objective!r}")
    if objective == "cost" and target_rate is None:
        return best_ratio(atoms, counts)
    n = len(atoms)
    ub = np.min(np.where(atoms.usage > 0, counts // np.maximum(atoms.usage, 1), np.iinfo(np.int64).max), axis=1)
    sense = pulp.LpMaximize if objective == "throughput" else pulp.LpMinimize
    prob = pulp.LpProblem("megaserve_plan", sense)
    x = [_variable(prob, f"x{i}", int(ub[i])) for i in range(n)]
    value = atoms.throughput if objective == "throughput" else atoms.cost
    prob += pulp.lpSum(float(value[i]) * x[i] for i in range(n))
    for t in range(len(atoms.types)):
        users = np.flatnonzero(atoms.usage[:, t])
        if len(users):
            prob += pulp.lpSum(int(atoms.usage[i, t]) * x[i] for i in users) <= int(counts[t]), f"inv_{t}"
    if target_rate is not None:
        prob += pulp.lpSum(float(atoms.throughput[i]) * x[i] for i in range(n)) >= float(target_rate), "rate"
    prob.solve(_cbc(timeLimit=time_limit_s))
    status = pulp.LpStatus[prob.status]
    if status == "Infeasible" or (status != "Optimal" and prob.sol_status != pulp.LpSolutionIntegerFeasible):
        if target_rate is not None:
            best = float(np.max(atoms.throughput * ub))
            raise InfeasibleError(
                f"target rate {target_rate:g} tokens/s unreachable with this inventory "
                f"(one atom type alone reaches at most {best:.0f}); lower --target-rate or add GPUs"
            )
        raise InfeasibleError(f"inventory ILP found no solution (CBC status {status})")
    sol = np.array([int(round(v.value() or 0)) for v in x], dtype=np.int64)
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    bound = _lp_bound(prob, x) if not optimal else None
    obj = float(sol @ value)
    gap = 0.0 if optimal or not bound else abs(bound - obj) / max(abs(bound), 1e-12)
    return _selection(atoms, sol, "optimal" if optimal else "time limit", gap, "CBC")


def _variable(prob: pulp.LpProblem, name: str, upper: int):
    if hasattr(prob, "add_variable"):  # PuLP >= 3.3
        return prob.add_variable(name, lowBound=0, upBound=upper, cat="Integer")
    return pulp.LpVariable(name, lowBound=0, upBound=upper, cat="Integer")


def _cbc(**options):
    """PuLP's bundled CBC (works offline). PuLP 3.3 deprecates the class name, not the solver."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, **options)


def _lp_bound(prob: pulp.LpProblem, x: list) -> float | None:
    """Objective of the LP relaxation: a bound for the optimality gap of a timed-out ILP."""
    for v in x:
        v.cat = pulp.LpContinuous
    prob.solve(_cbc())
    return pulp.value(prob.objective) if prob.status == pulp.LpStatusOptimal else None


def best_ratio(atoms: Atoms, counts: np.ndarray) -> Selection:
    """Most tokens per unit cost: as many copies of the best-ratio atom as fit (exact)."""
    ratio = atoms.throughput / atoms.cost
    best = int(np.lexsort((-atoms.throughput, -ratio))[0])
    copies = int(np.min(counts[atoms.usage[best] > 0] // atoms.usage[best][atoms.usage[best] > 0]))
    x = np.zeros(len(atoms), dtype=np.int64)
    x[best] = copies
    return _selection(atoms, x, "optimal", 0.0, "ratio")


def greedy(atoms: Atoms, counts: np.ndarray) -> Selection:
    """Baseline: take atoms by throughput per GPU, as many copies as fit, until none fits."""
    left = counts.astype(np.int64).copy()
    x = np.zeros(len(atoms), dtype=np.int64)
    for i in np.argsort(-atoms.throughput / atoms.usage.sum(axis=1), kind="stable"):
        need = atoms.usage[i]
        k = int(np.min(left[need > 0] // need[need > 0]))
        if k > 0:
            x[i] += k
            left -= k * need
    return _selection(atoms, x, "greedy", float("nan"), "greedy")
