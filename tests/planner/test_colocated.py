"""Co-located units beside disaggregated ones: formulas, search, and when each wins."""

from __future__ import annotations

import numpy as np
import pytest

from megaserve.planner import colocated, ilp, perf, search
from megaserve.planner.catalog import DEFAULT_GPUS, parse_cluster
from megaserve.planner.model_spec import load_model
from megaserve.planner.profile import Efficiency, Profile, load_profile

H200 = DEFAULT_GPUS["H200"]
QWEN = load_model("qwen3-30b-a3b")
OVERHEADS = Efficiency(step_overhead_us=300, seq_overhead_us=5, layer_overhead_us=100, token_overhead_us=1)


def test_single_gpu_step_is_the_sum_of_its_parts():
    """ep = 1, tp = 1, synchronous scheduling: L (attention + experts + overheads) + LM head
    + step overhead, no comm; async scheduling (the default): the slower of the GPU part and
    the step overhead."""
    work = perf.Workload(input_len=64, output_len=256, async_scheduling=False)
    hw = perf.Hw([H200], Profile(OVERHEADS))
    b = 64
    kv = b * work.ctx_avg
    attn = perf.attention_time(QWEN, work, hw, 1, b, kv, kv * QWEN.attn_flops_per_ctx_token)
    experts = perf.expert_time(QWEN, work, hw, 1, 1, b)
    layer = attn + 100e-6 + b * 1e-6 + experts
    expected = QWEN.num_moe_layers * layer + perf.head_time(QWEN, hw, 1, b) + 300e-6 + b * 5e-6
    step = colocated.colocated_step(QWEN, work, hw, 1, 1, b)
    assert float(step.t_c) == 0.0
    assert float(step.t_total) == pytest.approx(float(expected))
    overlapped = colocated.colocated_step(QWEN, perf.Workload(input_len=64, output_len=256), hw, 1, 1, b)
    host = 300e-6 + b * 5e-6
    assert float(overlapped.t_total) == pytest.approx(max(float(expected) - host, host))


def test_expert_parallel_splits_expert_weights_and_pays_an_all_to_all():
    work = perf.Workload(input_len=128, output_len=128)
    hw = perf.Hw([H200], Profile())
    one, four = (colocated.colocated_step(QWEN, work, hw, 1, ep, 256) for ep in (1, 4))
    assert float(four.t_c) > 0 and float(one.t_c) == 0
    assert float(four.t_e) < float(one.t_e)  # a quarter of the experts' weights per rank
    mem1, mem4 = (colocated.colocated_memory(QWEN, work, 1, ep, 256) for ep in (1, 4))
    assert mem1 - mem4 == pytest.approx(QWEN.expert_side_bytes * 3 / 4)


def test_a_model_too_large_for_one_gpu_gets_only_multi_gpu_colocated_units():
    model = load_model("mixtral-8x22b")  # 281 GB of bf16 weights
    cl = parse_cluster({"inventory": {"H100-SXM": 16}})
    atoms = search.find_atoms(model, perf.Workload(tpot_ms=150), cl, layouts=("colocated",), prune=False)
    assert len(atoms) and np.all(atoms.layout == 1)
    assert np.all(atoms.usage.sum(axis=1) >= 4)  # 80 GB GPUs: at least 4 per unit
    assert np.all(atoms.mem_a <= 80e9 * 0.9)


def _plan_throughput(atoms, counts, layout):
    sub = atoms.take(atoms.layout == search.LAYOUTS.index(layout))
    return ilp.solve(sub, counts).throughput if len(sub) else 0.0


def test_four_h200_example_picks_the_layout_the_calibrated_model_predicts_faster():
    """Issue 18's example: qwen3-30b-a3b on 4 x H200, TPOT 50 ms, 128 in / 128 out."""
    cl = parse_cluster({"inventory": {"H200": {"count": 4, "gpus_per_node": 4}}})
    work = perf.Workload(input_len=128, output_len=128, tpot_ms=50)
    atoms = search.find_atoms(QWEN, work, cl, load_profile("hopper"))
    assert {search.LAYOUTS[k] for k in atoms.layout} == set(search.LAYOUTS)  # both kinds in the table
    counts = np.array([4])
    sel = ilp.solve(atoms, counts)
    by_layout = {name: _plan_throughput(atoms, counts, name) for name in search.LAYOUTS}
    winner = max(by_layout, key=by_layout.get)
    assert {atoms.row(i)["layout"] for i in sel.atom_ids} == {winner}
    assert sel.throughput == pytest.approx(by_layout[winner])


def test_disaggregation_wins_where_expert_gemms_are_starved():
    """MegaScale-Infer's setting (Mixtral-8x22B, H20 + L40S, 2048 in, datasheet roofline):
    pooling the tokens of many attention replicas into expert GEMMs beats co-location."""
    cl = parse_cluster({"inventory": {"H20": 32, "L40S": 32}})
    model = load_model("mixtral-8x22b")
    atoms = search.find_atoms(model, perf.Workload(tpot_ms=150), cl, Profile())
    counts = np.array([32, 32])
    assert _plan_throughput(atoms, counts, "disaggregated") > _plan_throughput(atoms, counts, "colocated") > 0
