"""Text output of ``megaserve plan``: summary of the chosen plan and the top-N unit table."""

from __future__ import annotations

from typing import Any

import numpy as np

from megaserve.planner import perf
from megaserve.planner.catalog import Cluster
from megaserve.planner.ilp import Selection
from megaserve.planner.model_spec import ModelSpec
from megaserve.planner.atoms import Atoms


def rank(atoms: Atoms, objective: str) -> list[int]:
    """Atom indices, best first: by tokens/s per GPU (throughput) or tokens per cost (cost)."""
    per = atoms.usage.sum(axis=1) if objective == "throughput" else atoms.cost
    return [int(i) for i in np.lexsort((atoms.tpot, -atoms.throughput / per))]


def table_row(model: ModelSpec, atoms: Atoms, i: int) -> dict[str, Any]:
    r = atoms.row(i)
    gpus = r["gpus"]
    colocated = r["layout"] == "colocated"
    return {
        "layout": r["layout"],
        "attention": f"{r['attn_gpu']} tp{r['tp_a']} x{r['n_a']}",
        "experts": f"same GPUs, ep{r['n_e']}" if colocated else f"{r['expert_gpu']} tp{r['tp_e']} x{r['n_e']}",
        "experts_per_worker": int(perf.experts_per_worker(model, r["n_e"])),
        "m": r["m"],
        "batch_per_replica": r["m"] * r["b"],
        "tpot_ms": round(r["tpot"] * 1e3, 1),
        "throughput_tok_s": round(r["throughput"]),
        "gpus": gpus,
        "cost_per_hour": round(r["cost"], 2),
        "tokens_per_cost": round(r["throughput"] * 3600 / r["cost"]),
        "tokens_per_watt": round(r["throughput"] / r["power"], 2),  # tok/s per W = tokens per joule
        "bottleneck": r["bottleneck"],
    }


def table(model: ModelSpec, atoms: Atoms, ranked: list[int], objective: str) -> str:
    key = "tokens/s per GPU" if objective == "throughput" else "tokens per unit cost"
    head = (f"{'#':>3}  {'layout':<13} {'attention':<16} {'experts':<16} {'e/w':>4} {'m':>2} {'batch':>6} "
            f"{'TPOT ms':>8} {'tok/s':>9} {'GPUs':>5} {'cost/h':>8} {'tok/cost':>9} {'tok/J':>6}  bottleneck")
    lines = [f"top {len(ranked)} deployment units by {key}:", head]
    for n, i in enumerate(ranked, 1):
        r = table_row(model, atoms, i)
        lines.append(
            f"{n:>3}  {r['layout']:<13} {r['attention']:<16} {r['experts']:<16} {r['experts_per_worker']:>4} "
            f"{r['m']:>2} {r['batch_per_replica']:>6} {r['tpot_ms']:>8.1f} {r['throughput_tok_s']:>9,} "
            f"{r['gpus']:>5} {r['cost_per_hour']:>8.2f} {r['tokens_per_cost']:>9,} {r['tokens_per_watt']:>6.2f}  "
            f"{r['bottleneck']}"
        )
    return "\n".join(lines)


def binding(atoms: Atoms, sel: Selection, cluster: Cluster) -> str:
    """What stops the plan from being larger or faster, in words."""
    full = []
    for t, entry in enumerate(cluster.available()):
        left = entry.count - sel.gpus_used.get(entry.gpu, 0)
        users = atoms.usage[:, t][atoms.usage[:, t] > 0]
        if len(users) and left < users.min():
            full.append(f"{entry.gpu} ({sel.gpus_used.get(entry.gpu, 0)}/{entry.count} used)")
    bottlenecks = sorted({atoms.row(i)["bottleneck"] for i in sel.atom_ids})
    per_unit = ", ".join(
        "memory (attention KV cache)" if b == "memory" else
        "batch cap (--max-batch)" if b == "batch cap" else f"TPOT SLO, limited by {b}" for b in bottlenecks
    )
    inv = "inventory of " + ", ".join(full) if full else "none in the inventory (GPUs left over)"
    return f"{inv}; per unit: {per_unit}"


def summary(model: ModelSpec, work: perf.Workload, cluster: Cluster, atoms: Atoms, sel: Selection,
            objective: str) -> str:
    gpus = sum(sel.gpus_used.values())
    units = "; ".join(
        f"{c} x [{r['layout']}: {r['attention']} | {r['experts']} | m={r['m']} batch {r['batch_per_replica']}/replica]"
        for c, r in ((c, table_row(model, atoms, i)) for i, c in zip(sel.atom_ids, sel.copies))
    )
    inv = ", ".join(f"{e.gpu} {sel.gpus_used.get(e.gpu, 0)}/{e.count}" for e in cluster.available())
    gap = "n/a" if sel.gap != sel.gap else f"{sel.gap:.2%}"
    ttft = f", TTFT <= {work.ttft_ms:g} ms" if work.ttft_ms else ""
    return "\n".join([
        f"megaserve plan: {model.name}, TPOT <= {work.tpot_ms:g} ms{ttft}, input {work.input_len} / "
        f"output {work.output_len} tokens, objective {objective}",
        f"best plan: {units}",
        f"  throughput {sel.throughput:,.0f} tok/s, {sel.throughput / max(gpus, 1):,.0f} tok/s per GPU, "
        f"cost {sel.cost:,.2f} /h, {sel.throughput * 3600 / max(sel.cost, 1e-12):,.0f} tokens per unit cost, "
        f"{sel.throughput / max(sel.power, 1e-12):,.2f} tokens per joule (board power {sel.power:,.0f} W)",
        f"  GPUs used: {inv}; solver {sel.solver}, {sel.status}, gap {gap}",
        *([f"  note: {sel.note}"] if sel.note else []),
        f"  binding constraint: {binding(atoms, sel, cluster)}",
    ])
