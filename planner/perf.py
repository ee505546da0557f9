"""Performance model: roofline times per micro-batch, ping-pong pipeline, memory.

Every function is elementwise over numpy arrays (or plain floats): the search evaluates
whole grids of configurations at once, and the unit tests call the same code on scalars.

Legend: ``b`` = sequences of one micro-batch on one attention replica, ``m`` = micro-batches,
``n_a`` / ``n_e`` = attention replicas / expert workers of a deployment unit, ``tp_a`` /
``tp_e`` = GPUs per replica / per worker, ``E`` experts, top-``k`` routing, ``H`` hidden,
``L`` MoE layers. Times are seconds, sizes bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megaserve.planner.catalog import GpuSpec
from megaserve.planner.model_spec import ModelSpec
from megaserve.planner.profile import Profile


@dataclass(frozen=True)
class Workload:
    """Request shape, SLOs and modelling knobs of one planning run."""

    input_len: int = 2048
    output_len: int = 256
    tpot_ms: float = 150.0
    ttft_ms: float | None = None  # None: no TTFT constraint
    expert_skew: float = 1.0  # load of the busiest expert worker / the mean (>= 1)
    reserve_frac: float = 0.10  # GPU memory kept free for activations, buffers, fragmentation
    act_bytes: float = 2.0  # bytes per activation element sent between sides (bf16)
    max_batch_per_replica: int = 1024
    max_microbatches: int = 8
    # the engine's default on CUDA: the host schedules step n + 1 while the GPU runs step n
    # (:func:`engine_step`); False models synchronous scheduling (host, then GPU)
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")
        if not self.tpot_ms > 0 or (self.ttft_ms is not None and not self.ttft_ms > 0):
            raise ValueError("SLOs must be positive milliseconds")
        if self.expert_skew < 1:
            raise ValueError(f"expert_skew must be >= 1, got {self.expert_skew}")
        if not 0 <= self.reserve_frac < 1:
            raise ValueError(f"reserve_frac must be in [0, 1), got {self.reserve_frac}")
        if self.max_batch_per_replica < 1 or self.max_microbatches < 1:
            raise ValueError("max_batch_per_replica and max_microbatches must be >= 1")

    @property
    def ctx_avg(self) -> float:
        """Mean cached tokens per sequence over its decode phase."""
        return self.input_len + self.output_len / 2

    @property
    def ctx_max(self) -> int:
        """KV tokens reserved per sequence (its full length)."""
        return self.input_len + self.output_len


class Hw:
    """Hardware numbers of one side (attention or expert) for each evaluated config.

    Attributes are floats or arrays broadcastable with the config arrays; bandwidths are
    already multiplied by their efficiency factor.
    """

    def __init__(self, gpus: Sequence[GpuSpec], profile: Profile, idx: np.ndarray | int = 0) -> None:
        def col(fn):
            return np.asarray([fn(g, profile.for_gpu(g.name)) for g in gpus], dtype=np.float64)[idx]

        self.mem = col(lambda g, e: g.memory_bytes)
        self.hbm = col(lambda g, e: g.hbm_bytes_per_s * e.hbm_eff)
        self.flops = col(lambda g, e: g.flops_per_s * e.flops_eff)
        self.link = col(lambda g, e: g.link_gbps * 1e9 * e.link_eff)
        self.net = col(lambda g, e: g.net_gbps * 1e9 * e.net_eff)
        self.link_alpha = col(lambda g, e: e.link_alpha_us * 1e-6)
        self.net_alpha = col(lambda g, e: e.net_alpha_us * 1e-6)
        self.msg_half = col(lambda g, e: e.msg_half_kb * 1024)
        self.step_oh = col(lambda g, e: e.step_overhead_us * 1e-6)
        self.seq_oh = col(lambda g, e: e.seq_overhead_us * 1e-6)
        self.layer_oh = col(lambda g, e: e.layer_overhead_us * 1e-6)
        self.token_oh = col(lambda g, e: e.token_overhead_us * 1e-6)
        self.row_oh = col(lambda g, e: e.expert_row_overhead_us * 1e-6)
        self.split_oh = col(lambda g, e: e.split_overhead_us * 1e-6)


def roofline(hw: Hw, nbytes, flops):
    """max(memory time, compute time): the knee is where flops / bytes = hw.flops / hw.hbm."""
    return np.maximum(nbytes / hw.hbm, flops / hw.flops)


def transfer(nbytes, msg_bytes, bw, alpha, msg_half):
    """alpha + bytes / (bw * s / (s + msg_half)); zero when nothing is sent."""
    msg = np.maximum(msg_bytes, 1e-9)
    t = alpha + nbytes * (msg + msg_half) / (bw * msg)
    return np.where(nbytes > 0, t, 0.0)


def allreduce(model: ModelSpec, work: Workload, hw: Hw, tp, rows):
    """Ring all-reduce of ``rows`` hidden vectors across ``tp`` GPUs over the intra-node link."""
    row = model.hidden * work.act_bytes
    per_gpu = 2 * (tp - 1) / tp * rows * row
    return transfer(per_gpu, rows * row / tp, hw.link, hw.link_alpha, hw.msg_half)


def attention_time(model: ModelSpec, work: Workload, hw: Hw, tp_a, tokens, kv_tokens, ctx_flops):
    """One MoE layer's attention side (attention, router, shared expert) on one replica.

    tokens: query tokens; kv_tokens: cached tokens read; ctx_flops: FLOPs of QK^T and PV.
    KV is sharded over min(tp_a, kv_heads) ranks (MLA's latent KV is replicated).
    """
    shard = np.minimum(tp_a, model.kv_heads)
    nbytes = model.attn_params_per_layer * model.weight_bytes / tp_a
    nbytes = nbytes + kv_tokens * model.kv_elems_per_token_layer * model.kv_bytes / shard
    flops = (2 * tokens * model.attn_params_per_layer + ctx_flops) / tp_a
    return roofline(hw, nbytes, flops) + allreduce(model, work, hw, tp_a, tokens)


def dense_mlp_time(model: ModelSpec, work: Workload, hw: Hw, tp_a, tokens):
    """The MLP of one dense (non-MoE) layer, run on the attention side."""
    if model.dense_mlp_params == 0:
        return 0.0 * tokens
    nbytes = model.dense_mlp_params * model.weight_bytes / tp_a
    flops = 2 * tokens * model.dense_mlp_params / tp_a
    return roofline(hw, nbytes, flops) + allreduce(model, work, hw, tp_a, tokens)


def head_time(model: ModelSpec, hw: Hw, tp_a, tokens):
    """Final LM head over ``tokens`` rows (vocabulary-parallel over tp_a)."""
    return roofline(hw, model.head_params * model.weight_bytes / tp_a, 2 * tokens * model.head_params / tp_a)


def layer_overhead(hw: Hw, tokens):
    """Fixed cost of one layer's kernels for one micro-batch of ``tokens`` on one worker,
    beyond the roofline: ``layer_overhead + tokens * token_overhead`` (calibrated)."""
    return hw.layer_oh + tokens * hw.token_oh


def step_overhead(hw: Hw, seqs):
    """Host time of one engine step of ``seqs`` sequences on one attention worker
    (scheduler, sampler bookkeeping, outputs, graph launch): calibrated."""
    return hw.step_oh + seqs * hw.seq_oh


def engine_step(gpu, host, async_scheduling: bool):
    """Wall time of one engine step from its GPU time and its host time (:func:`step_overhead`).

    Synchronous scheduling runs them in series (``gpu + host``); async scheduling prepares
    step n + 1 on the host while the GPU runs step n, so the slower of the two sets the
    pace (``max(gpu, host)``). Elementwise over arrays."""
    return np.maximum(gpu, host) if async_scheduling else gpu + host


def experts_per_worker(model: ModelSpec, n_e):
    return np.ceil(model.num_experts / n_e)


def worker_rows(model: ModelSpec, work: Workload, n_e, tokens):
    """Token rows the busiest expert worker receives: each token goes once per worker it
    needs, P(token needs a worker) = 1 - (1 - e_w/E)^k, times the load skew."""
    p = 1 - (1 - experts_per_worker(model, n_e) / model.num_experts) ** model.top_k
    return np.minimum(tokens, tokens * p * work.expert_skew)


def expert_time(model: ModelSpec, work: Workload, hw: Hw, tp_e, n_e, tokens):
    """One MoE layer on the busiest expert worker, for ``tokens`` tokens of all replicas.

    Reads the weights of its active experts (expected e_w * (1 - (1 - k/E)^tokens)) and runs
    2 * assignments * expert_params FLOPs, assignments = tokens * k * e_w / E * skew; plus the
    calibrated cost per assignment (``expert_row_overhead_us``: permute, the grouped GEMM's
    per-row cost at decode's few rows per expert, the weighted combine), which the roofline
    misses and which a worker pays per assignment, not per token it receives.
    """
    e_w = experts_per_worker(model, n_e)
    active = e_w * (1 - (1 - model.top_k / model.num_experts) ** tokens)
    assign = np.minimum(tokens * model.top_k * e_w / model.num_experts * work.expert_skew,
                        tokens * np.minimum(model.top_k, e_w))
    nbytes = active * model.expert_bytes / tp_e
    flops = 2 * assign * model.expert_params / tp_e
    rows = worker_rows(model, work, n_e, tokens)
    return roofline(hw, nbytes, flops) + assign / tp_e * hw.row_oh + allreduce(model, work, hw, tp_e, rows)


def dispatch_time(model: ModelSpec, work: Workload, hw_a: Hw, hw_e: Hw, tp_a, n_a, tp_e, n_e, b,
                  intra_node=False):
    """One-way time of a dispatch (or combine: same bytes, reversed) of one micro-batch.

    A replica sends each token once per destination worker, spread over its tp_a NICs; the
    busiest worker receives from all n_a replicas over its tp_e NICs. The slower end wins.
    ``intra_node`` (bool or array): the unit's GPUs share a node, and the bytes move over
    the intra-node link (NVLink peer memory: the runtime's ``cuda_ipc``) instead of the NICs.
    Plus half the calibrated split overhead (the other half is the combine's): the fixed
    cost of crossing processes (pack, flag hop, the remote side's preparation).
    """
    row = model.hidden * work.act_bytes
    p = 1 - (1 - experts_per_worker(model, n_e) / model.num_experts) ** model.top_k
    send = b * n_e * p * row / tp_a
    bw_a, alpha_a = np.where(intra_node, hw_a.link, hw_a.net), np.where(intra_node, hw_a.link_alpha, hw_a.net_alpha)
    bw_e, alpha_e = np.where(intra_node, hw_e.link, hw_e.net), np.where(intra_node, hw_e.link_alpha, hw_e.net_alpha)
    t_send = transfer(send, send / n_e, bw_a, alpha_a, hw_a.msg_half)
    recv = worker_rows(model, work, n_e, n_a * b) * row / tp_e
    t_recv = transfer(recv, recv / n_a, bw_e, alpha_e, hw_e.msg_half)
    return np.maximum(t_send, t_recv) + hw_a.split_oh / 2


def attention_memory(model: ModelSpec, work: Workload, tp_a, batch):
    """Bytes per attention GPU: attention-side weights / tp_a + KV of ``batch`` sequences."""
    shard = np.minimum(tp_a, model.kv_heads)
    return model.attn_side_bytes / tp_a + batch * work.ctx_max * model.kv_bytes_per_token / shard


def expert_memory(model: ModelSpec, tp_e, n_e):
    """Bytes per expert GPU: e_w experts of every MoE layer / tp_e."""
    return experts_per_worker(model, n_e) * model.num_moe_layers * model.expert_bytes / tp_e


def max_batch_by_memory(model: ModelSpec, work: Workload, hw_a: Hw, tp_a):
    """Largest per-replica batch whose KV fits next to the weights and the reserve (may be <= 0)."""
    shard = np.minimum(tp_a, model.kv_heads)
    free = hw_a.mem * (1 - work.reserve_frac) - model.attn_side_bytes / tp_a
    return np.floor(free / (work.ctx_max * model.kv_bytes_per_token / shard))


@dataclass(frozen=True)
class StepTimes:
    """Decode-iteration breakdown (arrays or floats, same shape as the inputs)."""

    t_a: object  # attention side, one micro-batch, one MoE layer
    t_e: object  # busiest expert worker, one micro-batch, one MoE layer
    t_c: object  # one-way dispatch (= combine) of one micro-batch
    t_extra: object  # per micro-batch, not pipelined: dense layers + LM head
    t_f: object  # max(t_a, t_e)
    round_trip: object  # t_a + t_e + 2 t_c
    full: object  # bool: m * t_f >= round_trip (MegaScale-Infer: m >= 2(1 + t_c/t_f))
    t_total: object  # one decode iteration = TPOT


def decode_step(model: ModelSpec, work: Workload, hw_a: Hw, hw_e: Hw, tp_a, n_a, tp_e, n_e, m, b,
                intra_node=False) -> StepTimes:
    """Time of one decode iteration with m micro-batches of b sequences per replica.

    Ping-pong (MegaScale-Infer §4): a micro-batch goes round attention -> dispatch -> experts
    -> combine in ``round_trip``; the other m - 1 fill the gaps. One MoE layer takes a cycle
    ``C = max(m t_f, round_trip)`` for all m micro-batches, and
    ``T_total = round_trip + (C / m)(m L - 1) + m t_extra``, which equals the paper's
    ``(T_a + T_e + 2 T_c) + T_f (m L - 1)`` when the pipeline is full and ``L round_trip``
    when m = 1: the GPU time; with the attention worker's host time (:func:`step_overhead`)
    it makes one engine step under ``work.async_scheduling`` (:func:`engine_step`). T_a and
    T_e include the per-layer overheads (:func:`layer_overhead`); ``intra_node`` as in
    :func:`dispatch_time`.
    """
    kv_tokens = b * work.ctx_avg
    attn = attention_time(model, work, hw_a, tp_a, b, kv_tokens, kv_tokens * model.attn_flops_per_ctx_token)
    # NOTE: each side pays the whole calibrated per-layer overhead (measured co-located,
    # where one GPU runs both): an upper bound for a disaggregated worker.
    t_a = attn + layer_overhead(hw_a, b)
    t_e = expert_time(model, work, hw_e, tp_e, n_e, n_a * b) + layer_overhead(hw_e, 0)
    t_c = dispatch_time(model, work, hw_a, hw_e, tp_a, n_a, tp_e, n_e, b, intra_node)
    dense = model.num_dense_layers * (attn + dense_mlp_time(model, work, hw_a, tp_a, b) + layer_overhead(hw_a, b))
    t_extra = dense + head_time(model, hw_a, tp_a, b)
    t_f = np.maximum(t_a, t_e)
    round_trip = t_a + t_e + 2 * t_c
    cycle = np.maximum(m * t_f, round_trip)
    gpu = round_trip + cycle / m * (m * model.num_moe_layers - 1) + m * t_extra
    t_total = engine_step(gpu, step_overhead(hw_a, m * b), work.async_scheduling)
    return StepTimes(t_a, t_e, t_c, t_extra, t_f, round_trip, m * t_f >= round_trip, t_total)


def prefill_time(model: ModelSpec, work: Workload, hw_a: Hw, hw_e: Hw, tp_a, tp_e, n_e, intra_node=False):
    """One request's prefill (input_len tokens) through the whole model, alone on a unit
    (one step, GPU then host: nothing to overlap it with)."""
    t = work.input_len
    ctx_flops = t * t / 2 * model.attn_flops_per_ctx_token  # causal
    t_a = attention_time(model, work, hw_a, tp_a, t, t, ctx_flops) + layer_overhead(hw_a, t)
    t_e = expert_time(model, work, hw_e, tp_e, n_e, t) + layer_overhead(hw_e, 0)
    t_c = dispatch_time(model, work, hw_a, hw_e, tp_a, 1, tp_e, n_e, t, intra_node)
    dense = model.num_dense_layers * (t_a + dense_mlp_time(model, work, hw_a, tp_a, t))
    return (model.num_moe_layers * (t_a + t_e + 2 * t_c) + dense + head_time(model, hw_a, tp_a, 1)
            + step_overhead(hw_a, 1))
