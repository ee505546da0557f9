"""Plan atoms as a struct of arrays, and the helpers both layouts' searches share.

A *plan atom* is a deployment unit (a disaggregated unit from planner/search.py or a
co-located one from planner/colocated.py) with a GPU usage vector and a predicted
throughput. The searches build :class:`Atoms`; the ILP, the report, ``--explain`` and the
plan file read them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

TP_CHOICES = (1, 2, 4, 8)
BOTTLENECKS = ("attention", "expert", "comm", "memory", "batch cap")
LAYOUTS = ("disaggregated", "colocated")


@dataclass(frozen=True)
class Atoms:
    """A struct of arrays, one row per plan atom (all arrays have length N).

    ``usage[i, t]`` = GPUs of type ``types[t]`` used by atom i; ``throughput`` in output
    tokens/s; times in seconds per micro-batch per MoE layer; memory in bytes per GPU.
    A ``colocated`` atom (planner/colocated.py) runs attention and experts on the same
    ``tp_a * n_a`` GPUs: ``n_a`` data-parallel attention ranks of ``tp_a`` GPUs, experts
    split over ``n_e = n_a`` ranks; its ``ga == ge`` and ``m == 1``.
    """

    types: tuple[str, ...]
    ga: np.ndarray  # attention GPU type index into types
    ge: np.ndarray  # expert GPU type index
    tp_a: np.ndarray
    n_a: np.ndarray
    tp_e: np.ndarray
    n_e: np.ndarray
    m: np.ndarray
    b: np.ndarray  # sequences per micro-batch per replica; max batch per replica = m * b
    t_a: np.ndarray
    t_e: np.ndarray
    t_c: np.ndarray
    tpot: np.ndarray
    ttft: np.ndarray
    throughput: np.ndarray
    mem_a: np.ndarray
    mem_e: np.ndarray
    bottleneck: np.ndarray  # index into BOTTLENECKS
    usage: np.ndarray  # [N, len(types)] int
    cost: np.ndarray  # relative price per hour
    power: np.ndarray  # board power of its GPUs, watts
    layout: np.ndarray  # index into LAYOUTS

    def __len__(self) -> int:
        return len(self.ga)

    def take(self, index: np.ndarray) -> Atoms:
        """Rows selected by a boolean mask or an index array."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        return Atoms(**{k: (v if k == "types" else v[index]) for k, v in kw.items()})

    @staticmethod
    def concat(parts: Sequence[Atoms]) -> Atoms:
        """Rows of several Atoms over the same ``types``, in order."""
        assert parts and all(p.types == parts[0].types for p in parts)
        names = [f.name for f in fields(Atoms) if f.name != "types"]
        return Atoms(types=parts[0].types, **{k: np.concatenate([getattr(p, k) for p in parts]) for k in names})

    def row(self, i: int) -> dict[str, object]:
        """Atom i as plain Python values (for reports and plan files)."""
        out = {f.name: getattr(self, f.name)[i] for f in fields(self) if f.name not in ("types", "usage")}
        out = {k: (v.item() if hasattr(v, "item") else v) for k, v in out.items()}
        out["attn_gpu"], out["expert_gpu"] = self.types[out.pop("ga")], self.types[out.pop("ge")]
        out["bottleneck"] = BOTTLENECKS[out["bottleneck"]]
        out["layout"] = LAYOUTS[out["layout"]]
        out["gpus"] = int(self.usage[i].sum())
        return out


def binary_search_batch(tpot_of, slo_s: float, b_cap: np.ndarray) -> np.ndarray:
    """Largest b in [1, b_cap] with ``tpot_of(b) <= slo_s``, for every config at once.

    ``tpot_of`` maps an integer array of batches to TPOT seconds, elementwise and rising
    with b. Callers guarantee b = 1 is feasible."""
    lo, hi = np.ones_like(b_cap), b_cap.copy()
    while np.any(lo < hi):
        mid = (lo + hi + 1) // 2
        ok = tpot_of(mid) <= slo_s
        lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid - 1)
    return lo


def prune_dominated(atoms: Atoms) -> Atoms:
    """Drop atoms for which another uses no more GPUs of every type and has at least the
    throughput (ties keep the lowest TPOT, then the first)."""
    if len(atoms) == 0:
        return atoms
    order = np.lexsort((atoms.tpot, -atoms.throughput))  # best first
    # 1. among atoms with identical usage, keep the best (np.unique keeps first occurrences)
    _, first = np.unique(atoms.usage[order], axis=0, return_index=True)
    order = order[np.sort(first)]
    # 2. every kept atom has throughput >= the current one: dominated if one uses <= GPUs
    usage = atoms.usage[order]
    kept: list[int] = []
    kept_usage = np.empty((0, usage.shape[1]), dtype=usage.dtype)
    for i in range(len(order)):
        if len(kept) and np.any(np.all(kept_usage <= usage[i], axis=1)):
            continue
        kept.append(i)
        kept_usage = np.vstack([kept_usage, usage[i]])
    return atoms.take(order[np.array(kept, dtype=np.int64)])
