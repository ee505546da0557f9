"""The performance model recomputed by hand on small cases."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megaserve.planner import perf
from megaserve.planner.catalog import DEFAULT_GPUS
from megaserve.planner.model_spec import BUILTIN_CONFIGS, load_model, spec_from_config
from megaserve.planner.profile import Efficiency, Profile

PROFILE = Profile(Efficiency(hbm_eff=0.5, flops_eff=0.5, link_eff=1.0, net_eff=1.0, link_alpha_us=0.0,
                             net_alpha_us=0.0, msg_half_kb=0.0))
H20 = DEFAULT_GPUS["H20"]


def hw(name: str = "H20") -> perf.Hw:
    return perf.Hw([DEFAULT_GPUS[name]], PROFILE)


def test_model_specs_match_public_parameter_counts():
    # total parameter counts the model cards state
    expected = {"mixtral-8x7b": 46.7e9, "mixtral-8x22b": 140.6e9, "qwen3-30b-a3b": 30.5e9,
                "qwen3-235b-a22b": 235e9, "qwen2-57b-a14b": 57.4e9, "deepseek-v3": 671e9}
    for name, total in expected.items():
        assert load_model(name).total_params == pytest.approx(total, rel=0.01), name


def test_kv_bytes_gqa_and_mla():
    mix = load_model("mixtral-8x7b")  # 8 KV heads x 128 dims, K and V, bf16, 32 layers
    assert mix.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2
    ds = load_model("deepseek-v3")  # MLA: kv_lora_rank 512 + qk_rope_head_dim 64 per layer
    assert ds.kv_elems_per_token_layer == 576 and ds.kv_heads == 1
    assert ds.kv_bytes_per_token == 61 * 576 * 2
    assert ds.num_moe_layers == 58 and ds.weight_bytes == 1.0  # 3 dense layers; fp8 release


def test_config_json_path_equals_builtin(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(BUILTIN_CONFIGS["qwen2-57b-a14b"]))
    from_file = load_model(str(tmp_path))
    builtin = load_model("qwen2-57b-a14b")
    assert from_file.attn_side_bytes == builtin.attn_side_bytes
    # the shared expert (3 * H * 20480) lives on the attention side
    no_shared = spec_from_config({**BUILTIN_CONFIGS["qwen2-57b-a14b"], "shared_expert_intermediate_size": 0})
    assert builtin.attn_params_per_layer - no_shared.attn_params_per_layer == 3 * 3584 * 20480 + 3584


def test_roofline_and_transfer_by_hand():
    h = hw()
    assert perf.roofline(h, 1e9, 0.0) == pytest.approx(1e9 / (4.0e12 * 0.5))
    assert perf.roofline(h, 0.0, 1e12) == pytest.approx(1e12 / (148e12 * 0.5))
    # alpha + n (s + s_half) / (bw s)
    assert perf.transfer(1000.0, 100.0, 1e9, 1e-6, 50.0) == pytest.approx(1e-6 + 1000 * 150 / (1e9 * 100))
    assert perf.transfer(0.0, 0.0, 1e9, 1e-6, 50.0) == 0.0


def test_attention_time_by_hand():
    model, work = load_model("mixtral-8x7b"), perf.Workload(input_len=1000, output_len=200)
    b, tp = 8, 2
    kv_tokens = b * 1100
    weights = model.attn_params_per_layer * 2 / tp
    kv = kv_tokens * (2 * 8 * 128) * 2 / 2  # KV heads shard over min(tp, 8) = 2 ranks
    flops = (2 * b * model.attn_params_per_layer + kv_tokens * 4 * 32 * 128) / tp
    compute = max((weights + kv) / (4e12 * 0.5), flops / (148e12 * 0.5))
    allreduce = 2 * (tp - 1) / tp * b * 4096 * 2 / 450e9
    got = perf.attention_time(model, work, hw(), tp, b, kv_tokens, kv_tokens * model.attn_flops_per_ctx_token)
    assert got == pytest.approx(compute + allreduce)


def test_expert_time_memory_then_compute_bound():
    model, work = load_model("mixtral-8x7b"), perf.Workload()
    h = hw("L40S")
    expert_bytes = 3 * 4096 * 14336 * 2
    # one token, 8 workers of 1 expert: P(active) = 2/8, reads 1/4 of the expert on average
    t1 = perf.expert_time(model, work, h, 1, 8, 1)
    assert t1 == pytest.approx(max(0.25 * expert_bytes / (0.864e12 * 0.5), 2 * 0.25 * expert_bytes / 2 / (362e12 * 0.5)))
    # 4096 tokens: all active, 1024 rows; compute-bound on L40S (knee ~ 419 rows)
    t2 = perf.expert_time(model, work, h, 1, 8, 4096)
    assert t2 == pytest.approx(2 * 1024 * 3 * 4096 * 14336 / (362e12 * 0.5))
    # skew 1.5 on the busiest worker scales the compute-bound time
    t3 = perf.expert_time(model, perf.Workload(expert_skew=1.5), h, 1, 8, 4096)
    assert t3 == pytest.approx(1.5 * t2)


def test_ping_pong_total_matches_paper_when_full_and_serial_when_m_is_1():
    model, work = load_model("mixtral-8x7b"), perf.Workload()
    h_a, h_e = hw("H20"), hw("L40S")
    L = model.num_moe_layers
    for m in (1, 2, 3, 4, 6):
        s = perf.decode_step(model, work, h_a, h_e, 2, 4, 1, 8, m, 32)
        t_a, t_e, t_c = float(s.t_a), float(s.t_e), float(s.t_c)
        rt, t_f = t_a + t_e + 2 * t_c, max(t_a, t_e)
        # full pipeline: m T_f >= round trip (= m >= 2(1 + T_c/T_f) when T_a = T_e)
        assert bool(s.full) == (m * t_f >= rt)
        if bool(s.full):  # MegaScale-Infer: (T_a + T_e + 2 T_c) + T_f (m L - 1)
            expected = rt + t_f * (m * L - 1)
        else:  # the round trip binds every layer
            expected = rt + rt / m * (m * L - 1)
        assert float(s.t_total) == pytest.approx(expected + m * float(s.t_extra))
    one = perf.decode_step(model, work, h_a, h_e, 2, 4, 1, 8, 1, 32)
    assert float(one.t_total) == pytest.approx(L * float(one.round_trip) + float(one.t_extra))


def test_memory_formulas_and_batch_limit():
    model, work = load_model("mixtral-8x22b"), perf.Workload(input_len=2048, output_len=256, reserve_frac=0.1)
    h = hw("H20")
    b_max = int(perf.max_batch_by_memory(model, work, h, 4))
    usable = 96e9 * 0.9
    assert perf.attention_memory(model, work, 4, b_max) <= usable < perf.attention_memory(model, work, 4, b_max + 1)
    by_hand = model.attn_side_bytes / 4 + b_max * 2304 * (56 * 2 * 8 * 128 * 2) / 4
    assert perf.attention_memory(model, work, 4, b_max) == pytest.approx(by_hand)
    assert perf.expert_memory(model, 2, 8) == pytest.approx(56 * 3 * 6144 * 16384 * 2 / 2)


def test_a_step_is_gpu_plus_host_when_synchronous_and_the_slower_of_the_two_when_async():
    """perf.engine_step through decode_step and colocated_step: the host time is the step
    overhead; the planner's serving predictions are async (the engine's default on CUDA)."""
    from megaserve.planner.colocated import colocated_step

    model = load_model("qwen3-30b-a3b")
    host_bound = perf.Hw([DEFAULT_GPUS["H200"]],
                         Profile(dataclasses.replace(PROFILE.default, step_overhead_us=400, seq_overhead_us=200)))
    assert perf.Workload().async_scheduling
    for b in (1, 256):
        gpu = float(colocated_step(model, perf.Workload(), hw("H200"), 1, 1, b).t_total)  # no host time
        host = 400e-6 + b * 200e-6
        sync = perf.Workload(async_scheduling=False)
        assert float(colocated_step(model, sync, host_bound, 1, 1, b).t_total) == pytest.approx(gpu + host)
        assert float(colocated_step(model, perf.Workload(), host_bound, 1, 1, b).t_total) == pytest.approx(max(gpu, host))
        split = perf.decode_step(model, perf.Workload(), host_bound, host_bound, 1, 1, 1, 1, 1, b)
        split_sync = perf.decode_step(model, sync, host_bound, host_bound, 1, 1, 1, 1, 1, b)
        assert float(split_sync.t_total) - float(split.t_total) == pytest.approx(
            min(host, float(split_sync.t_total) - host))


def test_a_unit_within_one_node_exchanges_over_the_link():
    """Dispatch between GPUs of one node goes over the intra-node link (cuda_ipc), between
    nodes over the NICs; planner/search.py picks the link for one-type units within a node."""
    from megaserve.planner import search
    from megaserve.planner.catalog import Cluster, InventoryEntry

    model, work = load_model("qwen3-30b-a3b"), perf.Workload(input_len=64, output_len=256)
    h = hw("H200")  # link 450 GB/s, NIC 50 GB/s, no latency or size penalty
    net = float(perf.dispatch_time(model, work, h, h, 1, 1, 1, 1, 256))
    link = float(perf.dispatch_time(model, work, h, h, 1, 1, 1, 1, 256, True))
    assert net == pytest.approx(256 * 2048 * 2 / 50e9) and link == pytest.approx(256 * 2048 * 2 / 450e9)
    for per_node, want in ((2, link), (1, net)):
        cluster = Cluster(DEFAULT_GPUS, (InventoryEntry("H200", 2, per_node),))
        atoms = search.find_disaggregated(model, work, cluster, PROFILE)
        one = (atoms.n_a == 1) & (atoms.n_e == 1) & (atoms.tp_a == 1) & (atoms.tp_e == 1) & (atoms.m == 1)
        i = int((one & (atoms.b == atoms.b[one].max())).nonzero()[0][0])
        b = int(atoms.b[i])
        assert float(atoms.t_c[i]) == pytest.approx(want * b / 256), per_node
