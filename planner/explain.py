"""``megaserve plan --explain``: one deployment unit's arithmetic, step by step."""

from __future__ import annotations

import numpy as np

from megaserve.planner import perf
from megaserve.planner.catalog import Cluster
from megaserve.planner.errors import InfeasibleError
from megaserve.planner.model_spec import ModelSpec
from megaserve.planner.profile import Profile
from megaserve.planner.atoms import LAYOUTS, Atoms


def _fmt_bytes(x: float) -> str:
    return f"{x / 1e9:.2f} GB" if x >= 1e8 else f"{x / 1e6:.2f} MB"


def _intra_node(cluster: Cluster, r: dict) -> bool:
    """Whether a disaggregated unit's sides share a node (one GPU type, within its node size):
    then they exchange over the intra-node link, as planner/search.py models it."""
    per_node = {e.gpu: e.gpus_per_node for e in cluster.available()}
    gpus = r["n_a"] * r["tp_a"] + r["n_e"] * r["tp_e"]
    return r["attn_gpu"] == r["expert_gpu"] and gpus <= per_node.get(r["attn_gpu"], 0)


def _host_line(work: perf.Workload, hw: perf.Hw, seqs: float, gpu_s: float, step_s: float) -> str:
    """How the GPU time and the host time make one step (perf.engine_step)."""
    host = float(perf.step_overhead(hw, seqs))
    if work.async_scheduling:
        how = f"max(GPU, host) (async scheduling, the engine's default on CUDA) = max({gpu_s * 1e3:.3f}, {host * 1e3:.3f})"
    else:
        how = f"GPU + host (synchronous scheduling) = {gpu_s * 1e3:.3f} + {host * 1e3:.3f}"
    return (f"  host per step {float(hw.step_oh) * 1e6:.0f} us + {seqs:g} seq x {float(hw.seq_oh) * 1e6:.1f} us = "
            f"{host * 1e3:.3f} ms; step = {how} = {step_s * 1e3:.2f} ms")


def explain(model: ModelSpec, work: perf.Workload, cluster: Cluster, profile: Profile, atoms: Atoms,
            i: int) -> str:
    """Multi-line text recomputing atom i's times, pipeline regime and memory."""
    r = atoms.row(i)
    if r["layout"] == "colocated":
        return _explain_colocated(model, work, cluster, profile, r)
    ga, ge = cluster.gpus[r["attn_gpu"]], cluster.gpus[r["expert_gpu"]]
    hw_a, hw_e = perf.Hw([ga], profile), perf.Hw([ge], profile)
    tp_a, n_a, tp_e, n_e, m, b = (r[k] for k in ("tp_a", "n_a", "tp_e", "n_e", "m", "b"))
    ea = profile.for_gpu(ga.name)
    shard = min(tp_a, model.kv_heads)
    kv_tokens = b * work.ctx_avg
    w_bytes = model.attn_params_per_layer * model.weight_bytes / tp_a
    kv_bytes = kv_tokens * model.kv_elems_per_token_layer * model.kv_bytes / shard
    a_flops = (2 * b * model.attn_params_per_layer + kv_tokens * model.attn_flops_per_ctx_token) / tp_a
    e_w = int(perf.experts_per_worker(model, n_e))
    tokens = n_a * b
    active = e_w * (1 - (1 - model.top_k / model.num_experts) ** tokens)
    assign = min(tokens * model.top_k * e_w / model.num_experts * work.expert_skew,
                 tokens * min(model.top_k, e_w))
    e_mem = active * model.expert_bytes / tp_e / float(hw_e.hbm)
    e_cmp = 2 * assign * model.expert_params / tp_e / float(hw_e.flops)
    intra = _intra_node(cluster, r)
    step = perf.decode_step(model, work, hw_a, hw_e, tp_a, n_a, tp_e, n_e, m, b, intra)
    t_f, rt = float(step.t_f), float(step.round_trip)
    gpu_s = rt + max(t_f, rt / m) * (m * model.num_moe_layers - 1) + m * float(step.t_extra)
    m_min = 2 * (1 + float(step.t_c) / t_f)
    mem_w = model.attn_side_bytes / tp_a
    mem_kv = m * b * work.ctx_max * model.kv_bytes_per_token / shard
    us = 1e6
    lines = [
        f"unit: attention {ga.name} tp={tp_a} x {n_a} replicas | experts {ge.name} tp={tp_e} x {n_e} workers "
        f"({e_w} experts each) | m={m}, b={b} per micro-batch, batch {m * b} per replica",
        f"model {model.name}: {model.num_moe_layers} MoE + {model.num_dense_layers} dense layers, "
        f"E={model.num_experts}, top-{model.top_k}, H={model.hidden}",
        "",
        "attention, one micro-batch, one layer (roofline: max(bytes / BW, FLOPs / peak)):",
        f"  weights {_fmt_bytes(w_bytes)} + KV {b} seq x {work.ctx_avg:g} tok = {_fmt_bytes(kv_bytes)} "
        f"over {ga.hbm_tbps} TB/s x {ea.hbm_eff} -> {(w_bytes + kv_bytes) / float(hw_a.hbm) * us:.1f} us",
        f"  {a_flops / 1e9:.2f} GFLOP over {ga.bf16_tflops} TFLOP/s x {ea.flops_eff} -> "
        f"{a_flops / float(hw_a.flops) * us:.1f} us; with TP all-reduce and {_overheads(hw_a, b)}: "
        f"T_a = {float(step.t_a) * us:.1f} us",
        f"experts, busiest worker, one layer: {tokens} tokens x top-{model.top_k} -> {assign:.0f} expert rows"
        f" (skew {work.expert_skew:g}), {active:.2f} of {e_w} experts active",
        f"  weights {_fmt_bytes(active * model.expert_bytes / tp_e)} -> {e_mem * us:.1f} us; "
        f"{2 * assign * model.expert_params / tp_e / 1e9:.2f} GFLOP -> {e_cmp * us:.1f} us "
        f"({'compute' if e_cmp > e_mem else 'memory'}-bound); with layer overhead "
        f"{float(hw_e.layer_oh) * us:.1f} us: T_e = {float(step.t_e) * us:.1f} us",
        f"communication, one way: T_c = {float(step.t_c) * us:.1f} us "
        + (f"(alpha {ea.link_alpha_us:g} us + bytes / (intra-node link {ga.link_gbps:g} GB/s x eff x size "
           f"utilisation): one node, cuda_ipc)" if intra else
           f"(alpha {ea.net_alpha_us:g} us + bytes / (NIC {ga.net_gbps:g}|{ge.net_gbps:g} GB/s x eff x size "
           f"utilisation))"),
        "",
        f"ping-pong: T_f = max(T_a, T_e) = {t_f * us:.1f} us, round trip T_a + T_e + 2 T_c = {rt * us:.1f} us",
        f"  full pipeline needs m >= 2(1 + T_c/T_f) = {m_min:.2f}: m = {m} -> "
        f"{'full (experts or attention never wait on the round trip)' if bool(step.full) else 'NOT full (round trip binds)'}",
        f"  GPU time = round_trip + max(T_f, round_trip/m) (m L - 1) + m (dense layers + LM head)",
        f"          = {rt * 1e3:.3f} + {max(t_f, rt / m) * 1e3:.4f} x {m * model.num_moe_layers - 1} + "
        f"{m} x {float(step.t_extra) * 1e3:.3f} = {gpu_s * 1e3:.3f} ms",
        _host_line(work, hw_a, m * b, gpu_s, float(step.t_total)) + f" = T_total (TPOT SLO {work.tpot_ms:g} ms)",
        f"  throughput = n_a m b / T_total = {n_a} x {m} x {b} / {float(step.t_total):.4f} s = "
        f"{r['throughput']:.0f} tok/s",
        "",
        f"memory per attention GPU ({ga.memory_gb:g} GB, reserve {work.reserve_frac:.0%}): weights "
        f"{_fmt_bytes(mem_w)} + KV {m * b} seq x {work.ctx_max} tok = {_fmt_bytes(mem_kv)} -> "
        f"{(mem_w + mem_kv) / 1e9:.1f} GB of {ga.memory_gb * (1 - work.reserve_frac):.1f} GB usable",
        f"memory per expert GPU ({ge.memory_gb:g} GB): {e_w} experts x {model.num_moe_layers} layers / tp {tp_e} = "
        f"{r['mem_e'] / 1e9:.1f} GB of {ge.memory_gb * (1 - work.reserve_frac):.1f} GB usable",
        f"bottleneck: {r['bottleneck']}",
    ]
    return "\n".join(lines)


def _overheads(hw: perf.Hw, tokens: float) -> str:
    return (f"layer overhead {float(hw.layer_oh) * 1e6:.1f} us + {tokens:g} tok x "
            f"{float(hw.token_oh) * 1e6:.2f} us")


def _explain_colocated(model: ModelSpec, work: perf.Workload, cluster: Cluster, profile: Profile, r: dict) -> str:
    """The arithmetic of a co-located unit (planner/colocated.py)."""
    from megaserve.planner.colocated import all_to_all_time, colocated_max_batch, colocated_step

    g = cluster.gpus[r["attn_gpu"]]
    hw = perf.Hw([g], profile)
    tp, ep, b = r["tp_a"], r["n_a"], r["b"]
    kv_tokens = b * work.ctx_avg
    attn = float(perf.attention_time(model, work, hw, tp, b, kv_tokens, kv_tokens * model.attn_flops_per_ctx_token))
    step = colocated_step(model, work, hw, tp, ep, b)
    gpu_s = model.num_moe_layers * float(step.round_trip) + float(step.t_extra)
    rows = ep * b * model.top_k / model.num_experts
    us = 1e6
    return "\n".join([
        f"unit: co-located on {tp * ep} x {g.name}: {ep} attention rank(s) of tp={tp}, experts split over "
        f"{ep} rank(s) ({int(perf.experts_per_worker(model, ep))} each); batch {b} per rank",
        f"per MoE layer: attention roofline {attn * us:.1f} us + {_overheads(hw, b)} = "
        f"T_a {float(step.t_a) * us:.1f} us",
        f"  experts: {ep * b} tokens x top-{model.top_k} over {model.num_experts} experts = {rows:.1f} rows per "
        f"expert GEMM -> T_e {float(step.t_e) * us:.1f} us",
        f"  all-to-all one way T_c {float(all_to_all_time(model, work, hw, ep, b)) * us:.1f} us (0 when ep = 1)",
        f"GPU time = L (T_a + T_e + 2 T_c) + dense + LM head = {model.num_moe_layers} x "
        f"{float(step.round_trip) * us:.1f} us + {float(step.t_extra) * us:.1f} us = {gpu_s * 1e3:.3f} ms",
        _host_line(work, hw, b, gpu_s, float(step.t_total)) + f" = T_total (TPOT SLO {work.tpot_ms:g} ms)",
        f"  throughput = ranks x b / T_total = {ep} x {b} / {float(step.t_total):.4f} s = {r['throughput']:.0f} tok/s",
        f"memory per GPU ({g.memory_gb:g} GB, reserve {work.reserve_frac:.0%}): {r['mem_a'] / 1e9:.1f} GB "
        f"(weights + KV of {b} seq x {work.ctx_max} tok); KV room for "
        f"{int(colocated_max_batch(model, work, hw, tp, ep))} sequences per rank",
        f"bottleneck: {r['bottleneck']}",
    ])


def _unit_facts(model: ModelSpec, atoms: Atoms, i: int) -> dict:
    r = atoms.row(i)
    tokens = r["n_a"] * r["b"]  # tokens of one expert GEMM tick (all replicas / ranks)
    return {
        "row": r, "seqs_per_gpu": r["n_a"] * r["m"] * r["b"] / r["gpus"],
        "rows_per_expert": tokens * model.top_k / model.num_experts,
        "comm_share": 2 * r["t_c"] / max(r["t_a"] + r["t_e"] + 2 * r["t_c"], 1e-15),
        "kv_gb": r["mem_a"] / 1e9, "per_gpu": r["throughput"] / r["gpus"],
    }


def compare_layouts(model: ModelSpec, work: perf.Workload, cluster: Cluster, atoms: Atoms, counts: np.ndarray,
                    objective: str, target_rate: float | None, time_limit_s: float,
                    profile: Profile = Profile()) -> str:
    """Best plan of each layout alone (same ILP: disaggregated, co-located single-GPU or TP,
    co-located EP), which wins, by how much, and why: batch and KV memory per GPU at the SLO,
    expert GEMM size, communication share of a layer; where disaggregation loses, why
    (:func:`disaggregation_loss`)."""
    from megaserve.planner import ilp

    best = {}
    colocated = atoms.layout == LAYOUTS.index("colocated")
    groups = {"disaggregated": atoms.layout == LAYOUTS.index("disaggregated"),
              "colocated": colocated & (atoms.n_a == 1), "colocated EP": colocated & (atoms.n_a > 1)}
    for name, mask in groups.items():
        if mask.any():
            sub = atoms.take(mask)
            try:
                best[name] = (sub, ilp.solve(sub, counts, objective, target_rate, time_limit_s))
            except InfeasibleError:
                pass
    lines = [f"layouts compared (each alone, same inventory, objective {objective}):"]
    for name in groups:
        if name not in best:
            lines.append(f"  {name}: no feasible unit (memory, SLO or inventory) after pruning")
            continue
        sub, sel = best[name]
        f = _unit_facts(model, sub, sel.atom_ids[0])
        r = f["row"]
        lines.append(
            f"  {name}: {sel.throughput:,.0f} tok/s on {sum(sel.gpus_used.values())} GPUs, cost {sel.cost:.2f}/h; "
            f"main unit {r['attn_gpu']}/{r['expert_gpu']}, {r['gpus']} GPU(s), TPOT {r['tpot'] * 1e3:.1f} ms")
        lines.append(
            f"    {f['seqs_per_gpu']:.0f} sequences per GPU (limit: {r['bottleneck']}), {f['kv_gb']:.1f} GB used per "
            f"attention GPU (weights + KV); {f['rows_per_expert']:.1f} rows per expert GEMM; communication "
            f"{f['comm_share']:.0%} of a layer's round trip; {f['per_gpu']:,.0f} tok/s per GPU")
    if len(best) < 2:
        return "\n".join(lines)
    key = (lambda s: s.throughput) if objective == "throughput" and target_rate is None else \
        (lambda s: s.throughput / max(s.cost, 1e-12))
    ranked = sorted(best.items(), key=lambda kv: -key(kv[1][1]))
    (w, (ws, wsel)), (l, (ls, lsel)) = ranked[0], ranked[1]
    wf, lf = _unit_facts(model, ws, wsel.atom_ids[0]), _unit_facts(model, ls, lsel.atom_ids[0])
    what = "throughput" if key(wsel) == wsel.throughput else "tokens per cost"
    lines.append(f"winner: {w}, {key(wsel) / max(key(lsel), 1e-12):.2f}x the {what} of {l}")
    lines.append(
        f"  {w} vs {l}: {wf['seqs_per_gpu']:.0f} vs {lf['seqs_per_gpu']:.0f} sequences per GPU within the SLO "
        f"({wf['per_gpu']:,.0f} vs {lf['per_gpu']:,.0f} tok/s per GPU); KV + weights {wf['kv_gb']:.1f} vs "
        f"{lf['kv_gb']:.1f} GB per attention GPU; expert GEMMs of {wf['rows_per_expert']:.1f} vs "
        f"{lf['rows_per_expert']:.1f} rows per expert; communication {wf['comm_share']:.0%} vs "
        f"{lf['comm_share']:.0%} of a layer")
    if w != "disaggregated" and "disaggregated" in best:
        ds, dsel = best["disaggregated"]
        lines.extend(disaggregation_loss(model, work, cluster, profile, ds.row(dsel.atom_ids[0]), w,
                                         key(wsel) / max(key(dsel), 1e-12), what,
                                         winner_facts=wf))
    return "\n".join(lines)


def disaggregation_loss(model: ModelSpec, work: perf.Workload, cluster: Cluster, profile: Profile, r: dict,
                        winner: str, ratio: float, what: str,
                        winner_facts: dict | None = None) -> list[str]:
    """Why the disaggregated unit ``r`` (an Atoms row) loses: its per-GPU throughput against
    one co-located GPU of its attention type running the same batch, and what the split adds
    per MoE layer (dispatch + combine, the split overhead, the expert side's fixed costs).
    Where the model does not fit one GPU, the per-GPU comparison is with the winner
    (``winner_facts``: its ``_unit_facts``), not with that hypothetical GPU."""
    from megaserve.planner.colocated import colocated_max_batch, colocated_step

    g = cluster.gpus[r["attn_gpu"]]
    hw = perf.Hw([g], profile)
    batch = r["m"] * r["b"]  # sequences of one attention replica
    one = colocated_step(model, work, hw, 1, 1, batch)
    fits = float(colocated_max_batch(model, work, hw, 1, 1)) >= 1
    L = model.num_moe_layers
    t_one, t_split = float(one.t_total), r["tpot"]
    per_layer_us = (t_split - t_one) / L * 1e6
    unit_gpus = r["gpus"] / max(r["n_a"], 1)  # GPUs per attention replica's share of the unit
    lines = [f"disaggregation loses here: {winner} gets {ratio:.2f}x its {what}"]
    if fits:
        lines.append(
            f"  the model fits one {g.name}: a co-located GPU runs a replica's batch of {batch} in {t_one * 1e3:.2f} ms "
            f"a step ({batch / t_one:,.0f} tok/s per GPU); the split unit spends {unit_gpus:g} GPUs per replica "
            f"on the same batch, so per GPU its throughput is divided by {unit_gpus:g} before any cost of the split")
    else:
        lines.append(f"  the model does not fit one {g.name}: the co-located alternative is EP or TP over several GPUs")
    lines.append(
        f"  the split {'adds' if per_layer_us >= 0 else 'saves'} {abs(per_layer_us):.0f} us per MoE layer "
        f"(step {t_split * 1e3:.2f} vs {t_one * 1e3:.2f} ms{'' if fits else ' of a GPU that could hold it'} "
        f"over {L} layers at m={r['m']}"
        f"{'' if per_layer_us >= 0 else ', by overlapping the two sides'}): dispatch + combine 2 x T_c = {2 * r['t_c'] * 1e6:.0f} us (calibrated split "
        f"overhead {float(hw.split_oh) * 1e6:.0f} us included), the expert side's fixed layer cost, and "
        f"{'the pipeline of ' + str(r['m']) + ' micro-batches (each reads the experts again)' if r['m'] > 1 else 'no overlap (m = 1: each side waits for the other)'}")
    if fits or winner_facts is None:
        lines.append(
            f"  per GPU: {r['throughput'] / r['gpus']:,.0f} (split) vs {batch / t_one:,.0f} tok/s (one co-located "
            f"GPU); disaggregation wins only where one GPU cannot hold the model or its KV at the SLO's batch, or "
            f"where the split step falls below 1/{unit_gpus:g} of the co-located one ({t_one / unit_gpus * 1e3:.2f} "
            f"ms here)")
        return lines
    wf, wr = winner_facts, winner_facts["row"]
    need = batch / (unit_gpus * wf["per_gpu"])  # the split step that would match the winner per GPU
    lines.append(
        f"  per GPU: {r['throughput'] / r['gpus']:,.0f} (split) vs {wf['per_gpu']:,.0f} tok/s ({winner}: "
        f"{wf['seqs_per_gpu']:.0f} sequences per GPU in {wr['tpot'] * 1e3:.2f} ms a step, every GPU running "
        f"attention and its share of the experts); the split's {batch} sequences share {unit_gpus:g} GPUs, of "
        f"which only the attention GPU holds KV, so it wins only where its step falls below {need * 1e3:.2f} ms "
        f"(it takes {t_split * 1e3:.2f})")
    return lines
