"""``megaserve bench device-layouts`` on CPU: layouts, cases, the rows and the planner's file."""

from __future__ import annotations

import json

import pytest

from megaserve.bench import device_layouts as dl
from megaserve.bench import layouts_report
from megaserve.planner.measurements import parse_runs


def test_layout_names_give_the_processes_and_gpus_a_gpu_run_would_place() -> None:
    base = dict(model="builtin:tiny-moe", max_num_seqs=4)
    config, gpus, replicas = dl.layout_config("ep:2", base, "cuda")
    assert (gpus, replicas, config.expert_workers, config.transport) == (2, 2, 2, "cuda_ipc")
    assert config.enable_expert_parallel
    config, gpus, replicas = dl.layout_config("attn2:1", base, "cuda")
    assert (gpus, replicas, config.attention_gpus, config.expert_gpus) == (2, 2, (0, 0), (1,))
    config, gpus, replicas = dl.layout_config("split:3", base, "cpu")
    assert (gpus, replicas, config.microbatches, config.transport) == (2, 1, 3, "tcp")
    config, gpus, replicas = dl.layout_config("dp:2", base, "cuda")
    assert (gpus, replicas, config.data_parallel, config.expert_workers) == (2, 2, True, 1)
    for bad in ("ep:1", "ep:x", "split:x", "attn2", "tp:2", "colocated:2"):
        with pytest.raises(ValueError, match="unknown layout"):
            dl.layout_config(bad, base, "cuda")


def test_cases_parse_and_split_over_replicas() -> None:
    assert dl.parse_cases("64x256,2048x128") == [dl.Case(64, 256), dl.Case(2048, 128)]
    for bad in ("64", "64x", "x8", "64x0", ""):
        with pytest.raises(ValueError):
            dl.parse_cases(bad)
    assert dl.per_replica(dl.Case(64, 255), 2, total=True) == 128
    assert dl.per_replica(dl.Case(64, 255), 2, total=False) == 255


def test_a_colocated_cpu_run_times_steady_decode_and_the_whole_workload(tmp_path) -> None:
    base = dict(model="builtin:tiny-moe", dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    rows = dl.measure_layout("colocated", base, [dl.Case(8, 4), dl.Case(16, 2)], {"8x4"}, 12, "cpu", 0)
    assert [(r["input_len"], r["batch"], r["seqs"]) for r in rows] == [(8, 4, 4), (16, 2, 2)]
    for r in rows:
        assert r["ms_step"] > 0 and r["tok_s"] == pytest.approx(r["seqs"] / r["ms_step"] * 1e3)
    assert rows[0]["generated"] == 4 * 12 and rows[0]["whole_tok_s"] > 0
    assert "whole_tok_s" not in rows[1]
    # The planner reads the rows back as its runs: two decode-only runs and one with prefill.
    payload = {"model": "random:qwen3-30b-a3b:2", "device": "NVIDIA H200", "dtype": "bfloat16",
               "tree": "t", "rows": rows, "kv_cache_memory_bytes": 64 << 20}
    data = json.loads(json.dumps(layouts_report.measurements_file(payload)))
    runs = parse_runs(data, "rows")
    assert [(r.batch, r.num_prompts, r.step_ms is None) for r in runs] == [
        (4, 0, False), (0, 4, True), (2, 0, False)]
    # each run says how the engine ran: its scheduling (CPU: synchronous) and the KV pool
    assert all(not r.async_scheduling and r.kv_cache_memory_bytes == 64 << 20 for r in runs)
    assert data["gpu"] == "H200" and runs[0].tok_s == pytest.approx(rows[0]["tok_s"], rel=1e-3)


def test_a_steady_step_is_counted_by_the_tokens_each_sequence_received() -> None:
    """One engine gives every sequence a token a step: the timed steps are its calls. The
    row also reports the collector's passes during them (gc_heap.collections_during)."""
    base = dict(model="builtin:tiny-moe", dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    rows = dl.measure_layout("colocated", base, [dl.Case(8, 3)], set(), 40, "cpu", 0)
    assert rows[0]["decode_steps"] == dl.TIMED_STEPS
    assert len(rows[0]["gc_passes"]) == 3 and all(n >= 0 for n in rows[0]["gc_passes"])
    assert rows[0]["gc_ms"] >= 0


def test_planner_runs_name_the_layout_of_each_row() -> None:
    common = dict(input_len=64, output_len=256, ms_step=10.0, tok_s=100.0, replicas=1, batch=3, seqs=3)
    rows = [dict(common, layout="ep:2", m=1, seqs=6, replicas=2), dict(common, layout="split:3", m=3),
            dict(common, layout="dp:2", m=1), dict(common, layout="attn2:1", m=1)]
    rows[2].update(seqs=6, replicas=2)  # dp:2: two one-GPU engines of 3 sequences
    runs = layouts_report.measurement_runs(rows)
    assert [(r["layout"], r.get("ep"), r.get("m"), r["batch"], r["tok_s"]) for r in runs] == [
        ("colocated", 2, None, 6, 100.0), ("disaggregated", None, 3, 3, 100.0), ("colocated", None, None, 3, 50.0)]


def test_merge_joins_per_layout_runs_and_names_a_run_that_left_no_file(tmp_path, capsys) -> None:
    common = dict(model="random:qwen3-30b-a3b:2", output_len=256, cases=["64x4"], batch_is="replica",
                  device="NVIDIA H200", gpus_visible=2, dtype="bfloat16", tree="t")
    row = dict(input_len=64, output_len=256, batch=4, seqs=4, replicas=1, gpus=1, m=1, ms_step=10.0,
               tok_s=400.0, tok_s_gpu=400.0)
    files = []
    for name, gpus in (("colocated", 1), ("split:1", 2)):
        path = tmp_path / f"{name.replace(':', '')}.json"
        path.write_text(json.dumps(dict(common, baseline=name, failed={},
                                        rows=[dict(row, layout=name, gpus=gpus, tok_s_gpu=400.0 / gpus)])))
        files.append(str(path))
    out = tmp_path / "all.json"
    assert dl.main(["--merge", *files, str(tmp_path / "ep2.json"), "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["baseline"] == "colocated" and [r["layout"] for r in merged["rows"]] == ["colocated", "split:1"]
    assert "ep2.json" in merged["failed"]
    table = capsys.readouterr().out
    assert "0.50x" in table  # split:1's tok/s per GPU against the first file's baseline
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps(dict(common, cases=["64x8"], baseline="x", failed={}, rows=[])))
    with pytest.raises(ValueError, match="different"):
        dl.main(["--merge", files[0], str(bad)])
