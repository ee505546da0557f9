"""``megaserve bench throughput --profile-out``: the file it writes is what calibration reads."""

from __future__ import annotations

import argparse
import json

import pytest

from megaserve.bench import profile_out
from megaserve.planner import measurements
from megaserve.planner.catalog import DEFAULT_GPUS
from megaserve.planner.profile import Efficiency


def test_decode_steps_are_measured_per_batch_on_the_cpu_engine():
    options = dict(model="builtin:tiny-moe", dtype="auto", device="cpu", max_model_len=None, max_num_seqs=8,
                   attention_replicas=1, expert_workers=1, microbatches=1, transport="inproc",
                   aggregation="per_layer", expert_aggregation_wait_ms=0.5, cuda_graphs=False)
    runs = profile_out.measure(options, [1, 3], input_len=4, output_len=20, seed=0, timed_steps=5, num_prompts=2)
    *steps, whole = runs
    assert [r["batch"] for r in steps] == [1, 3]
    # the whole generate: fresh prompts (no prefix-cache hits), the engine's limits recorded
    assert whole["includes_prefill"] and whole["prefix_cache_hits"] is False and whole["tok_s"] > 0
    assert (whole["num_prompts"], whole["max_num_seqs"], whole["output_len"]) == (2, 3, 20)
    # how each ran: steps timed one by one are synchronous; the whole run as the engine ran (CPU: sync)
    assert [r["async_scheduling"] for r in runs] == [False, False, False]
    data = {"format": measurements.FORMAT, "gpu": "H200", "model": "qwen3-30b-a3b", "num_layers": 2, "runs": runs}
    assert [r.step_ms is None for r in measurements.parse_runs(data, "cpu.json")] == [False, False, True]
    for r in steps:
        assert r["tok_s"] == pytest.approx(r["batch"] / (r["step_ms"] / 1e3), rel=1e-2)
        assert r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"] and r["timed_steps"] == 5
        assert (r["input_len"], r["output_len"]) == (4, 20) and r["steps_not_full_batch"] == 0
        # the timed window is centred on the context the planner models (input + output / 2)
        assert r["mean_context"] == pytest.approx(4 + 20 / 2, abs=0.5)
    with pytest.raises(ValueError, match="output-len"):
        profile_out.measure(options, [1], input_len=4, output_len=1, seed=0)


def test_written_file_round_trips_through_the_planner(tmp_path):
    args = argparse.Namespace(model="random:qwen3-30b-a3b:2", dtype="bfloat16", profile_gpu=None,
                              argv=["--model", "random:qwen3-30b-a3b:2", "--profile-out", "x.json"])
    runs = [{"batch": 8, "input_len": 64, "output_len": 32, "step_ms": 1.5, "tok_s": 5333.3},
            {"num_prompts": 16, "max_num_seqs": 8, "input_len": 64, "output_len": 32, "tok_s": 4000.0,
             "includes_prefill": True}]
    link = [{"kind": "link", "bytes": 1 << 20, "seconds": 1e-5}]
    path = tmp_path / "x.json"
    profile_out.write(str(path), args, "NVIDIA H200", runs, link)
    data = json.loads(path.read_text())
    assert data["gpu"] == "H200" and data["measurements"] == link
    assert "--profile-out x.json" in data["source"]["command"] and data["source"]["commit"]
    parsed = measurements.parse_runs(data, "x.json")
    assert [r.step_ms for r in parsed] == [1.5, None] and parsed[0].model.num_layers == 2
    assert all(measurements.predict(r, DEFAULT_GPUS["H200"], Efficiency()).tok_s > 0 for r in parsed)


def test_names_map_to_the_planner_catalog_and_models():
    assert profile_out.catalog_gpu("NVIDIA H100 80GB HBM3") == "H100-SXM"
    assert profile_out.catalog_gpu("NVIDIA H200") == "H200" and profile_out.catalog_gpu("Quadro") is None
    assert profile_out.planner_model("random:qwen3-30b-a3b:48") == ("qwen3-30b-a3b", 48)
    with pytest.raises(ValueError, match="random:<preset>:<layers>"):
        profile_out.planner_model("builtin:tiny-moe")
