"""Plan atoms: MegaScale-Infer's Algorithm 1, vectorised over a grid of configurations.

For every (attention GPU type, expert GPU type) pair of the inventory it enumerates
``tp_a, tp_e`` in {1, 2, 4, 8} (within GPUs per node), ``n_e`` (divisors of E whose experts
fit), ``n_a`` (the attention replicas; balancing is done by evaluating a grid of them and
keeping what is not dominated) and ``m`` in 1..N_m, then binary-searches the largest
per-replica micro-batch ``b`` meeting the TPOT SLO and memory. Each surviving configuration
is a *plan atom*: a deployment unit with a GPU usage vector and a predicted throughput.
Atoms dominated by another (no more GPUs of any type, at least the throughput) are dropped:
that never changes the optimum of the inventory ILP.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from megaserve.planner import perf
from megaserve.planner.atoms import LAYOUTS, TP_CHOICES, Atoms, binary_search_batch, prune_dominated
from megaserve.planner.catalog import Cluster, GpuSpec
from megaserve.planner.colocated import find_colocated
from megaserve.planner.errors import InfeasibleError
from megaserve.planner.model_spec import ModelSpec
from megaserve.planner.profile import Profile

logger = logging.getLogger(__name__)

NA_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _grid(model: ModelSpec, work: perf.Workload, cluster: Cluster, homogeneous: bool) -> dict[str, np.ndarray]:
    """All (pair, tp_a, tp_e, n_e, n_a, m) within node sizes and inventory, as flat columns."""
    entries = cluster.available()
    counts = np.array([e.count for e in entries])
    n_e_opts = [d for d in range(1, model.num_experts + 1) if model.num_experts % d == 0]
    cols = []
    for ia, ea in enumerate(entries):
        for ie, ee in enumerate(entries):
            if homogeneous and ie != ia:
                continue
            tpa = [t for t in TP_CHOICES if t <= ea.gpus_per_node]
            tpe = [t for t in TP_CHOICES if t <= ee.gpus_per_node]
            g = np.meshgrid(tpa, tpe, n_e_opts, NA_GRID, np.arange(1, work.max_microbatches + 1), indexing="ij")
            g = [x.ravel() for x in g]
            cols.append([np.full(len(g[0]), ia), np.full(len(g[0]), ie), *g])
    ga, ge, tp_a, tp_e, n_e, n_a, m = (np.concatenate(c) for c in zip(*cols))
    usage = np.zeros((len(ga), len(entries)), dtype=np.int64)
    np.add.at(usage, (np.arange(len(ga)), ga), n_a * tp_a)
    np.add.at(usage, (np.arange(len(ga)), ge), n_e * tp_e)
    keep = np.all(usage <= counts, axis=1)
    per_node = np.array([e.gpus_per_node for e in entries])
    # one GPU type, one node: the sides exchange over the intra-node link (the runtime's cuda_ipc)
    intra = (ga == ge) & (n_a * tp_a + n_e * tp_e <= per_node[ga])
    out = dict(ga=ga, ge=ge, tp_a=tp_a, tp_e=tp_e, n_e=n_e, n_a=n_a, m=m, intra=intra)
    out = {k: v[keep] for k, v in out.items()}
    out["usage"] = usage[keep]
    return out


def find_atoms(model: ModelSpec, work: perf.Workload, cluster: Cluster, profile: Profile = Profile(),
               prune: bool = True, homogeneous: bool = False, layouts: Sequence[str] = LAYOUTS) -> Atoms:
    """The plan atoms of the inventory not dominated within their layout: disaggregated
    units (below) and co-located ones (planner/colocated.py), as ``layouts`` asks. Raises InfeasibleError
    naming why none exists (empty inventory, model does not fit, SLO unreachable); when
    no layout is feasible, the disaggregated search's reason is the one given.

    homogeneous: only pairs with the same GPU type on both sides (a baseline).
    """
    bad = sorted(set(layouts) - set(LAYOUTS))
    if bad or not layouts:
        raise ValueError(f"layouts must be a non-empty subset of {LAYOUTS}, got {list(layouts)}")
    parts, error = [], None
    if "disaggregated" in layouts:
        try:
            parts.append(find_disaggregated(model, work, cluster, profile, homogeneous))
        except InfeasibleError as e:
            error = e
    if "colocated" in layouts and cluster.available():
        parts.append(find_colocated(model, work, cluster, profile))
    # NOTE: pruned per layout, so the table can compare layouts; the ILP optimum is the
    # same as pruning the union (pruning only ever drops dominated atoms).
    parts = [prune_dominated(p) if prune else p for p in parts if len(p)]
    if not parts:
        raise error or InfeasibleError(_colocated_message(model, work, cluster))
    return Atoms.concat(parts)


def _colocated_message(model: ModelSpec, work: perf.Workload, cluster: Cluster) -> str:
    if not cluster.available():
        return "empty inventory: the cluster file lists no GPUs with count > 0"
    return (f"no co-located unit of {model.name} fits the inventory or meets TPOT <= {work.tpot_ms:g} ms "
            "(memory for weights and KV, or the SLO); add GPUs or relax the SLO")


def find_disaggregated(model: ModelSpec, work: perf.Workload, cluster: Cluster, profile: Profile = Profile(),
                       homogeneous: bool = False) -> Atoms:
    """Every feasible disaggregated atom (not pruned); raises InfeasibleError naming why
    none exists."""
    entries = cluster.available()
    if not entries:
        raise InfeasibleError("empty inventory: the cluster file lists no GPUs with count > 0")
    gpus: Sequence[GpuSpec] = [cluster.gpus[e.gpu] for e in entries]
    g = _grid(model, work, cluster, homogeneous)
    if len(g["ga"]) == 0:
        raise InfeasibleError("inventory too small: no unit of one attention replica and expert workers fits")
    hw_a, hw_e = perf.Hw(gpus, profile, g["ga"]), perf.Hw(gpus, profile, g["ge"])
    mem_e = perf.expert_memory(model, g["tp_e"], g["n_e"])
    expert_fits = mem_e <= hw_e.mem * (1 - work.reserve_frac)
    b_mem = perf.max_batch_by_memory(model, work, hw_a, g["tp_a"])
    b_cap = np.floor(np.minimum(b_mem, work.max_batch_per_replica) / g["m"]).astype(np.int64)
    fits = expert_fits & (b_cap >= 1)
    if not fits.any():
        raise InfeasibleError(_fit_message(model, work, gpus, cluster, expert_fits.any()))
    g, b_cap, b_mem = {k: v[fits] for k, v in g.items()}, b_cap[fits], b_mem[fits]
    hw_a, hw_e = perf.Hw(gpus, profile, g["ga"]), perf.Hw(gpus, profile, g["ge"])
    args = (g["tp_a"], g["n_a"], g["tp_e"], g["n_e"], g["m"])
    t1 = perf.decode_step(model, work, hw_a, hw_e, *args, np.ones_like(b_cap), g["intra"]).t_total
    ok = t1 <= work.tpot_ms / 1e3
    if not ok.any():
        raise InfeasibleError(
            f"TPOT SLO unreachable: {work.tpot_ms:g} ms requested, the fastest unit needs "
            f"{t1.min() * 1e3:.3g} ms per token even at batch 1; raise --tpot-ms or add faster GPUs"
        )
    g, b_cap, b_mem = {k: v[ok] for k, v in g.items()}, b_cap[ok], b_mem[ok]
    hw_a, hw_e = perf.Hw(gpus, profile, g["ga"]), perf.Hw(gpus, profile, g["ge"])
    args = (g["tp_a"], g["n_a"], g["tp_e"], g["n_e"], g["m"])
    b = binary_search_batch(lambda b_: perf.decode_step(model, work, hw_a, hw_e, *args, b_, g["intra"]).t_total,
                            work.tpot_ms / 1e3, b_cap)
    step = perf.decode_step(model, work, hw_a, hw_e, *args, b, g["intra"])
    ttft = perf.prefill_time(model, work, hw_a, hw_e, g["tp_a"], g["tp_e"], g["n_e"], g["intra"]) + step.t_total
    if work.ttft_ms is not None:
        ok = ttft <= work.ttft_ms / 1e3
        if not ok.any():
            raise InfeasibleError(
                f"TTFT SLO unreachable: {work.ttft_ms:g} ms requested, the best unit needs "
                f"{ttft.min() * 1e3:.0f} ms for a {work.input_len}-token prompt; raise --ttft-ms"
            )
        g, b, b_cap, b_mem, ttft = {k: v[ok] for k, v in g.items()}, b[ok], b_cap[ok], b_mem[ok], ttft[ok]
        hw_a, hw_e = perf.Hw(gpus, profile, g["ga"]), perf.Hw(gpus, profile, g["ge"])
        step = perf.decode_step(model, work, hw_a, hw_e, g["tp_a"], g["n_a"], g["tp_e"], g["n_e"], g["m"], b,
                                g["intra"])
    return _assemble(model, work, gpus, entries, g, b, b_cap, b_mem, step, ttft)


def _assemble(model, work, gpus, entries, g, b, b_cap, b_mem, step, ttft) -> Atoms:
    at_cap = b == b_cap
    mem_limited = np.floor(b_mem / g["m"]) <= np.floor(work.max_batch_per_replica / g["m"])
    times = np.stack([step.t_a, step.t_e, step.t_c])
    bottleneck = np.where(at_cap, np.where(mem_limited, 3, 4), np.argmax(times, axis=0))
    prices = np.array([x.price for x in gpus])
    watts = np.array([x.power_w for x in gpus])
    return Atoms(
        types=tuple(e.gpu for e in entries), ga=g["ga"], ge=g["ge"], tp_a=g["tp_a"], n_a=g["n_a"],
        tp_e=g["tp_e"], n_e=g["n_e"], m=g["m"], b=b, t_a=step.t_a, t_e=step.t_e, t_c=step.t_c,
        tpot=step.t_total, ttft=ttft, throughput=g["n_a"] * g["m"] * b / step.t_total,
        mem_a=perf.attention_memory(model, work, g["tp_a"], g["m"] * b),
        mem_e=perf.expert_memory(model, g["tp_e"], g["n_e"]), bottleneck=bottleneck,
        usage=g["usage"], cost=g["usage"] @ prices, power=g["usage"] @ watts,
        layout=np.zeros(len(b), dtype=np.int64),
    )


def _fit_message(model, work, gpus, cluster, experts_fit: bool) -> str:
    usable = [g.memory_gb * (1 - work.reserve_frac) for g in gpus]
    held = sum(e.count * u for e, u in zip(cluster.available(), usable))
    weights = (model.attn_side_bytes + model.expert_side_bytes) / 1e9
    names = ", ".join(f"{e.count} x {e.gpu}" for e in cluster.available())
    if held < weights:
        return (f"inventory too small: {model.name} needs {weights:.0f} GB of weights, the inventory ({names}) "
                f"holds {held:.0f} GB usable; add GPUs")
    if not experts_fit:
        return (f"model fits nowhere: {model.name}'s experts ({model.expert_side_bytes / 1e9:.0f} GB) fit no split "
                f"over <= {model.num_experts} workers of tp <= 8 within the inventory ({names}); add GPUs")
    best = max(usable)
    return (
        f"model fits nowhere: attention-side weights ({model.attn_side_bytes / 1e9:.1f} GB / tp) plus the KV of "
        f"one {work.ctx_max}-token sequence exceed every attention GPU's usable memory (at most {best:.0f} GB); "
        "shorten --input-len/--output-len or add larger GPUs"
    )
