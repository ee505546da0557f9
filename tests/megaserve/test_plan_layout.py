"""Running a `megaserve plan` file: its layout drives the runtime, outputs do not change."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from megaserve import LLM, SamplingParams
from megaserve.models.builtin import resolve_model
from megaserve.runtime.plan import engine_options_from_plan

PROMPTS = [{"prompt_token_ids": [3 + i, 14, 15, 92, 65][: 2 + i]} for i in range(4)]
PARAMS = SamplingParams(max_tokens=8, temperature=0.8, seed=4, ignore_eos=True, logprobs=1)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megaserve.cli", *args], capture_output=True,
                          text=True, timeout=300)


def _hand_plan(path, placement, replicas=2, microbatches=2, tp=1):
    plan = {"version": 1, "model": "tiny", "units": [{
        "copies": 1,
        "attention": {"gpu": "H20", "tp": tp, "replicas": replicas, "max_batch_per_replica": 16},
        "experts": {"gpu": "L40S", "tp": 1, "workers": len(placement), "placement": placement},
        "microbatches": microbatches}]}
    path.write_text(yaml.safe_dump(plan))
    return path


def test_uneven_placement_from_a_plan_gives_identical_outputs(tmp_path):
    plan = _hand_plan(tmp_path / "plan.yaml", [[0, 1, 2], [3, 4], [5, 6, 7]])
    options = engine_options_from_plan(str(plan))
    assert options == {"attention_replicas": 2, "expert_workers": 3, "microbatches": 2,
                       "expert_placement": ((0, 1, 2), (3, 4), (5, 6, 7)), "max_num_seqs": 16}
    with LLM(dtype="float32") as llm:
        expected = llm.generate(PROMPTS, PARAMS)
    with LLM(dtype="float32", transport="tcp", **options) as llm:
        got = llm.generate(PROMPTS, PARAMS)
        assert llm.engine.placement.workers == ((0, 1, 2), (3, 4), (5, 6, 7))
    for e, g in zip(expected, got):
        assert (g.outputs[0].token_ids, g.outputs[0].logprobs) == (e.outputs[0].token_ids, e.outputs[0].logprobs)


def test_plan_written_by_the_planner_runs(tmp_path):
    config = resolve_model("builtin:tiny-moe") / "config.json"
    planned = _cli("plan", "--model", str(config), "--cluster", "examples/cluster.yaml",
                   "--tpot-ms", "150", "-o", str(tmp_path / "plan.yaml"))
    assert planned.returncode == 0, planned.stderr
    alone = _cli("generate", "--dtype", "float32", "--seed", "3", "--temperature", "0.7",
                 "--max-tokens", "6", "Planned")
    placed = _cli("generate", "--dtype", "float32", "--seed", "3", "--temperature", "0.7",
                  "--max-tokens", "6", "--plan", str(tmp_path / "plan.yaml"), "--transport", "tcp",
                  "Planned")
    assert alone.returncode == 0 and placed.returncode == 0, placed.stderr
    assert placed.stdout == alone.stdout


@pytest.mark.parametrize("content, field", [
    ("version: 7\n", "version"),
    ("{not yaml", "YAML"),
])
def test_bad_plan_is_a_clear_usage_error(tmp_path, content, field):
    bad = tmp_path / "plan.yaml"
    bad.write_text(content)
    result = _cli("generate", "--plan", str(bad), "Hello")
    assert result.returncode == 2 and field in result.stderr and "Traceback" not in result.stderr


def test_plan_unit_out_of_range(tmp_path):
    plan = _hand_plan(tmp_path / "plan.yaml", [[0, 1, 2, 3, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match="plan_unit"):
        engine_options_from_plan(str(plan), unit_index=3)
