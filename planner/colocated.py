"""Co-located deployment units: attention and experts on the same GPUs.

The baseline disaggregation has to beat. A co-located unit of ``tp * ep`` GPUs of one type
runs ``ep`` data-parallel attention ranks of ``tp`` GPUs each (tensor parallel within a
rank) and splits the experts of every MoE layer over the ``ep`` ranks (expert parallel):

* one GPU (``tp = ep = 1``): data-parallel replicas of the whole model, the engine's
  single-GPU path and what calibration measures;
* DP attention + EP over the same GPUs (``tp = 1``, ``ep > 1``; the runtime's
  ``--data-parallel-size N --enable-expert-parallel``), always a candidate: tokens go to
  the ranks holding their experts and back with an all-to-all over the intra-node link;
* where no single GPU of the type can serve the model (memory, or the TPOT SLO at batch
  1): TP groups (``ep = 1``).

There is no ping-pong (m = 1): one layer is ``attention + dispatch + experts + combine``
in series on the same GPU, plus the calibrated overheads, which a co-located GPU pays once
per layer (a disaggregated unit pays them on both sides).

Legend as in planner/perf.py: ``b`` sequences per attention rank, ``L`` MoE layers.
"""

from __future__ import annotations

import numpy as np

from megaserve.planner import perf
from megaserve.planner.catalog import Cluster
from megaserve.planner.model_spec import ModelSpec
from megaserve.planner.profile import Profile
from megaserve.planner.atoms import TP_CHOICES, Atoms, binary_search_batch

EP_CHOICES = (1, 2, 4, 8)


def all_to_all_time(model: ModelSpec, work: perf.Workload, hw: perf.Hw, ep, b):
    """One-way dispatch (= combine) of ``b`` tokens of one rank to the ``ep - 1`` other
    ranks over the intra-node link, plus half the calibrated split overhead (the fixed cost
    of crossing processes; zero when ``ep == 1``)."""
    row = model.hidden * work.act_bytes
    p = 1 - (1 - perf.experts_per_worker(model, ep) / model.num_experts) ** model.top_k
    send = b * np.maximum(ep - 1, 0) * p * row
    t = perf.transfer(send, send / np.maximum(ep - 1, 1), hw.link, hw.link_alpha, hw.msg_half)
    return t + np.where(ep > 1, hw.split_oh / 2, 0.0)


def colocated_step(model: ModelSpec, work: perf.Workload, hw: perf.Hw, tp, ep, b) -> perf.StepTimes:
    """One decode iteration of a co-located unit, ``b`` sequences per attention rank.

    GPU time ``L (T_a + 2 T_c + T_e) + dense layers + LM head``, and with the host time
    (the step overhead) one engine step under ``work.async_scheduling`` (perf.engine_step), where
    ``T_a`` = attention of b sequences (+ the layer's fixed and per-token overheads),
    ``T_e`` = the rank's experts for the ``ep * b`` tokens of all ranks, ``T_c`` = the
    all-to-all. Elementwise over arrays like perf.decode_step.
    """
    kv_tokens = b * work.ctx_avg
    attn = perf.attention_time(model, work, hw, tp, b, kv_tokens, kv_tokens * model.attn_flops_per_ctx_token)
    t_a = attn + perf.layer_overhead(hw, b)
    t_e = perf.expert_time(model, work, hw, tp, ep, ep * b)
    t_c = all_to_all_time(model, work, hw, ep, b)
    dense = model.num_dense_layers * (attn + perf.dense_mlp_time(model, work, hw, tp, b) + perf.layer_overhead(hw, b))
    t_extra = dense + perf.head_time(model, hw, tp, b)
    round_trip = t_a + t_e + 2 * t_c
    t_total = perf.engine_step(model.num_moe_layers * round_trip + t_extra, perf.step_overhead(hw, b),
                               work.async_scheduling)
    return perf.StepTimes(t_a, t_e, t_c, t_extra, np.maximum(t_a, t_e), round_trip, False, t_total)


def colocated_prefill(model: ModelSpec, work: perf.Workload, hw: perf.Hw, tp, ep, seqs=1):
    """Prefill of ``seqs`` prompts of ``input_len`` tokens in one forward on one rank."""
    t = seqs * work.input_len
    ctx_flops = seqs * work.input_len**2 / 2 * model.attn_flops_per_ctx_token  # causal
    attn = perf.attention_time(model, work, hw, tp, t, t, ctx_flops) + perf.layer_overhead(hw, t)
    layer = attn + perf.expert_time(model, work, hw, tp, ep, ep * t) + 2 * all_to_all_time(model, work, hw, ep, t)
    dense = model.num_dense_layers * (attn + perf.dense_mlp_time(model, work, hw, tp, t))
    return model.num_moe_layers * layer + dense + perf.head_time(model, hw, tp, seqs) + perf.step_overhead(hw, seqs)


def colocated_memory(model: ModelSpec, work: perf.Workload, tp, ep, batch):
    """Bytes per GPU: attention side / tp + the rank's experts / tp + KV of ``batch`` sequences."""
    return perf.attention_memory(model, work, tp, batch) + perf.expert_memory(model, tp, ep)


def colocated_max_batch(model: ModelSpec, work: perf.Workload, hw: perf.Hw, tp, ep):
    """Largest batch per rank whose KV fits beside all weights and the reserve (may be <= 0)."""
    shard = np.minimum(tp, model.kv_heads)
    free = hw.mem * (1 - work.reserve_frac) - model.attn_side_bytes / tp - perf.expert_memory(model, tp, ep)
    return np.floor(free / (work.ctx_max * model.kv_bytes_per_token / shard))


def _grid(model: ModelSpec, cluster: Cluster) -> dict[str, np.ndarray]:
    """(GPU type, tp, ep) with ``tp == 1 or ep == 1``, ep dividing E, within node and inventory."""
    rows = []
    for t, entry in enumerate(cluster.available()):
        for tp in TP_CHOICES:
            for ep in EP_CHOICES:
                gpus = tp * ep
                if (tp > 1 and ep > 1) or model.num_experts % ep or gpus > entry.gpus_per_node or gpus > entry.count:
                    continue
                rows.append((t, tp, ep))
    arr = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return {"g": arr[:, 0], "tp": arr[:, 1], "ep": arr[:, 2]}


def find_colocated(model: ModelSpec, work: perf.Workload, cluster: Cluster, profile: Profile = Profile()) -> Atoms:
    """Every feasible co-located unit (memory, TPOT and TTFT SLOs), as Atoms rows with
    ``layout == colocated``; empty when none is feasible (never raises)."""
    entries = cluster.available()
    gpus = [cluster.gpus[e.gpu] for e in entries]
    g = _grid(model, cluster)
    hw = perf.Hw(gpus, profile, g["g"])
    b_cap = np.minimum(colocated_max_batch(model, work, hw, g["tp"], g["ep"]), work.max_batch_per_replica)
    ok = b_cap >= 1
    if ok.any():
        t1 = colocated_step(model, work, perf.Hw(gpus, profile, g["g"][ok]), g["tp"][ok], g["ep"][ok], 1).t_total
        ok[ok] = t1 <= work.tpot_ms / 1e3
    # NOTE: TP groups only where a single GPU of the type cannot serve the model (memory or
    # SLO); co-located EP (tp = 1, ep > 1) is always a candidate beside single-GPU replicas:
    # it trades an all-to-all and the split overhead for expert memory freed for KV.
    single = ok & (g["tp"] * g["ep"] == 1)
    ok &= (g["tp"] == 1) | ~np.isin(g["g"], g["g"][single])
    g, b_cap = {k: v[ok] for k, v in g.items()}, b_cap[ok].astype(np.int64)
    hw = perf.Hw(gpus, profile, g["g"])
    b = binary_search_batch(lambda b_: colocated_step(model, work, hw, g["tp"], g["ep"], b_).t_total,
                            work.tpot_ms / 1e3, b_cap)
    step = colocated_step(model, work, hw, g["tp"], g["ep"], b)
    ttft = colocated_prefill(model, work, hw, g["tp"], g["ep"]) + step.t_total
    keep = np.ones(len(b), dtype=bool) if work.ttft_ms is None else ttft <= work.ttft_ms / 1e3
    g, b, b_cap, ttft = {k: v[keep] for k, v in g.items()}, b[keep], b_cap[keep], ttft[keep]
    hw = perf.Hw(gpus, profile, g["g"])
    step = colocated_step(model, work, hw, g["tp"], g["ep"], b)
    b_mem = colocated_max_batch(model, work, hw, g["tp"], g["ep"])
    at_cap = b == b_cap
    bottleneck = np.where(at_cap, np.where(b_mem <= work.max_batch_per_replica, 3, 4),
                          np.argmax(np.stack([step.t_a, step.t_e, step.t_c]), axis=0))
    n = len(b)
    usage = np.zeros((n, len(entries)), dtype=np.int64)
    usage[np.arange(n), g["g"]] = g["tp"] * g["ep"]
    prices = np.array([x.price for x in gpus])
    watts = np.array([x.power_w for x in gpus])
    mem = colocated_memory(model, work, g["tp"], g["ep"], b)
    return Atoms(
        types=tuple(e.gpu for e in entries), ga=g["g"], ge=g["g"], tp_a=g["tp"], n_a=g["ep"], tp_e=g["tp"],
        n_e=g["ep"], m=np.ones(n, dtype=np.int64), b=b, t_a=step.t_a, t_e=step.t_e, t_c=step.t_c,
        tpot=step.t_total, ttft=ttft, throughput=g["ep"] * b / step.t_total, mem_a=mem, mem_e=mem,
        bottleneck=bottleneck, usage=usage, cost=usage @ prices, power=usage @ watts,
        layout=np.ones(n, dtype=np.int64),
    )
