"""Choosing how many copies of each plan atom to deploy within the inventory.

ILP (PuLP + its bundled CBC), with x_i = copies of atom i, u_it = GPUs of type t it uses:

* ``throughput``: maximise sum_i x_i tput_i  s.t.  sum_i x_i u_it <= count_t for every t.
* ``cost`` with a target rate R: minimise sum_i x_i cost_i  s.t.  sum_i x_i tput_i >= R and
  the inventory. Without R: maximise tokens per unit cost. A mix of atoms never beats the
  best atom's ratio (a ratio of sums is at most the largest ratio), so the plan is as many
  copies of the best-ratio atom as the inventory holds; no ILP is needed.

For ``throughput`` the greedy baseline (:func:`greedy`) is computed too, and the better of
the two is returned: a time-limited ILP returns its incumbent, which on a large inventory or
a busy CPU can be worse than the greedy choice (the Selection then says so: solver
``greedy``, ``note``). The time limit scales with the problem (:func:`default_time_limit`);
it bounds the search only, CBC stops as soon as it proves optimality.

Packing into nodes needs no constraint: tensor-parallel groups are powers of two no larger
than the node, so any multiset of them with total <= nodes * gpus_per_node packs exactly.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, replace

import numpy as np
import pulp

from megaserve.planner.errors import InfeasibleError
from megaserve.planner.atoms import Atoms

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
    solver: str  # "CBC", "ratio", or "greedy" (the baseline beat the ILP's incumbent)
    note: str = ""  # why this solver's answer was taken, when it is not the ILP's


# Time limit of the ILP: this many seconds per (atom, GPU type) pair, within the bounds. The
# 291 atoms x 4 types of `megaserve bench planner` (1,000 GPUs) get 23 s; CBC proves that one
# optimal in about 1 s on an idle CPU, where a 1 s limit returned an incumbent 7% below it.
ILP_SECONDS_PER_PAIR = 0.02
ILP_TIME_LIMIT_BOUNDS_S = (2.0, 60.0)


def default_time_limit(atoms: Atoms) -> float:
    """Seconds the ILP may search for ``atoms``: grows with atoms x GPU types (module
    docstring), between ILP_TIME_LIMIT_BOUNDS_S."""
    low, high = ILP_TIME_LIMIT_BOUNDS_S
    return float(min(high, max(low, ILP_SECONDS_PER_PAIR * len(atoms) * len(atoms.types))))


def _selection(atoms: Atoms, x: np.ndarray, status: str, gap: float, solver: str) -> Selection:
    ids = np.flatnonzero(x > 0)
    used = (x[:, None] * atoms.usage).sum(axis=0)
    return Selection(
        atom_ids=tuple(int(i) for i in ids), copies=tuple(int(x[i]) for i in ids),
        throughput=float(x @ atoms.throughput), cost=float(x @ atoms.cost), power=float(x @ atoms.power),
        gpus_used={t: int(u) for t, u in zip(atoms.types, used)}, status=status, gap=gap, solver=solver,
    )


def solve(atoms: Atoms, counts: np.ndarray, objective: str = "throughput", target_rate: float | None = None,
          time_limit_s: float | None = None) -> Selection:
    """Pick integer copies of atoms within ``counts`` (GPUs per type, aligned with atoms.types).

    ``time_limit_s``: the ILP's limit (None: :func:`default_time_limit`). For ``throughput``
    the result is never worse than :func:`greedy` (module docstring).
    Raises InfeasibleError when the target rate cannot be reached with the inventory, and
    ValueError for an unknown objective or a time limit that is not > 0.
    """
    if objective not in ("throughput", "cost"):
        raise ValueError(f"objective must be 'throughput' or 'cost', got {objective!r}")
    if time_limit_s is None:
        time_limit_s = default_time_limit(atoms)
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 seconds, got {time_limit_s!r}")
    if objective == "cost" and target_rate is None:
        return best_ratio(atoms, counts)
    if objective == "throughput":
        return _better_of(_solve_ilp(atoms, counts, objective, None, time_limit_s),
                          greedy(atoms, counts), time_limit_s)
    return _solve_ilp(atoms, counts, objective, target_rate, time_limit_s)


def _better_of(found: Selection | None, baseline: Selection, time_limit_s: float) -> Selection:
    """The ILP's selection unless the greedy baseline has more throughput (or the ILP found
    nothing within its limit); then the baseline, saying why, with its gap to the ILP's
    bound where the ILP computed one."""
    if found is not None and found.throughput >= baseline.throughput:
        return found
    if found is None:
        note = f"the ILP found no solution within {time_limit_s:g} s; greedy baseline taken"
        return replace(baseline, note=note)
    bound = found.throughput / (1 - found.gap) if 0 < found.gap < 1 else None
    gap = max(0.0, (bound - baseline.throughput) / bound) if bound else float("nan")
    note = (f"greedy baseline taken: the ILP's incumbent after its {time_limit_s:g} s limit "
            f"reached {found.throughput:,.0f} tok/s, greedy {baseline.throughput:,.0f}")
    logger.info("planner: %s", note)
    return replace(baseline, gap=gap, note=note)


def _solve_ilp(atoms: Atoms, counts: np.ndarray, objective: str, target_rate: float | None,
               time_limit_s: float) -> Selection | None:
    """The ILP (module docstring); None where it found no integer solution in time for the
    throughput objective (the caller falls back), InfeasibleError otherwise."""
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
        if objective == "throughput":  # x = 0 is feasible: CBC ran out of time (it may
            return None                # report that as "Infeasible")
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
