"""`megaserve plan` as a real process: outputs, plan file, errors with exit code 2, calibration."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megaserve.planner.plan_file import load_plan

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "megaserve.cli", "plan"]


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_planner_never_imports_torch_and_help_is_fast():
    code = (
        "import sys, megaserve.planner.cli, megaserve.planner.search, megaserve.planner.ilp, megaserve.planner.bench,"
        " megaserve.planner.explain, megaserve.planner.calibrate, megaserve.planner.colocated,"
        " megaserve.planner.measurements;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0
    # CPU seconds, not wall time: a loaded machine delays the process, it does not make it
    # do more work. Measured ~0.3 s (docs/planner.md); torch alone would take seconds.
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = run("--help")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert out.returncode == 0 and "--tpot-ms" in out.stdout
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu_s < 3, cpu_s


def test_plan_writes_a_plan_file_with_placement(tmp_path):
    plan_path = tmp_path / "plan.yaml"
    out = run("--model", "mixtral-8x7b", "--cluster", "examples/cluster.yaml", "--tpot-ms", "100", "--top", "5",
              "-o", str(plan_path), "--explain")
    assert out.returncode == 0, out.stderr
    assert "best plan:" in out.stdout and "top 5 deployment units" in out.stdout
    assert "binding constraint:" in out.stdout and "full pipeline needs m >= 2(1 + T_c/T_f)" in out.stdout
    plan = load_plan(plan_path)
    inventory = yaml.safe_load((REPO / "examples/cluster.yaml").read_text())["inventory"]
    used: dict[str, int] = {}
    for unit in plan["units"]:
        assert sorted(sum(unit["experts"]["placement"], [])) == list(range(8))
        assert unit["predicted"]["tpot_ms"] <= 100
        for side in ("attention", "experts"):
            n = unit[side]["tp"] * unit[side]["replicas" if side == "attention" else "workers"] * unit["copies"]
            used[unit[side]["gpu"]] = used.get(unit[side]["gpu"], 0) + n
    for gpu, n in used.items():
        count = inventory[gpu]["count"] if isinstance(inventory[gpu], dict) else inventory[gpu]
        assert n <= count
    assert plan["summary"]["gpus"] == used


def test_json_output_and_cost_objective(tmp_path):
    cl = write(tmp_path, "c.yaml", "inventory: {H20: 32, L40S: 32}\n")
    out = run("--model", "mixtral-8x22b", "--cluster", cl, "--objective", "cost", "--json", "--top", "3")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    unit = data["plan"]["units"][0]
    assert (unit["attention"]["gpu"], unit["experts"]["gpu"]) == ("H20", "L40S")
    assert len(data["top"]) == 3 and data["plan"]["version"] == 1


@pytest.mark.parametrize(
    "cluster_text, extra, message",
    [
        ("inventory: {H20: 0}\n", [], "empty inventory"),
        ("inventory: {H20: [1, 2\n", [], "malformed YAML"),
        ("inventory: {Z9000: 8}\n", [], "unknown GPU 'Z9000'"),
        ("inventory: {L20: 8}\n", ["--model", "deepseek-v3"], "inventory too small"),
        ("inventory: {H20: 64}\n", ["--input-len", "10000000"], "model fits nowhere"),
        ("inventory: {H20: 16, L40S: 16}\n", ["--tpot-ms", "1"], "TPOT SLO unreachable"),
        ("inventory: {H20: 16, L40S: 16}\n", ["--ttft-ms", "0.5"], "TTFT SLO unreachable"),
        ("inventory: {H20: 16}\n", ["--model", "no-such-model"], "unknown model"),
        ("gpus: {H20: {memory_gb: -1}}\ninventory: {H20: 8}\n", [], "memory_gb must be a positive"),
    ],
)
def test_bad_or_infeasible_input_exits_2_with_one_line(tmp_path, cluster_text, extra, message):
    cl = write(tmp_path, "c.yaml", cluster_text)
    args = ["--model", "mixtral-8x7b", "--cluster", cl, *extra]
    if "--model" in extra:
        args = args[2:]
    out = run(*args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_missing_cluster_file_exits_2(tmp_path):
    out = run("--model", "mixtral-8x7b", "--cluster", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2 and "cannot read cluster file" in out.stderr


def test_calibrate_recovers_efficiencies_and_changes_the_plan(tmp_path):
    peak_bw, peak_flops, net = 4.0e12, 148e12, 50e9  # H20
    meas = [{"kind": "gemm", "m": 8192, "n": 8192, "k": 8192, "seconds": 2 * 8192**3 / (0.6 * peak_flops)},
            {"kind": "memory", "bytes": 4e9, "seconds": 4e9 / (0.9 * peak_bw)}]
    meas += [{"kind": "net", "bytes": n, "seconds": 20e-6 + n / (0.5 * net)} for n in (1e6, 1e7, 1e8)]
    bench = write(tmp_path, "bench.json", json.dumps({"gpu": "H20", "measurements": meas}))
    prof = tmp_path / "profile.yaml"
    out = subprocess.run([*CLI, "calibrate", "--from", bench, "-o", str(prof)], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    eff = yaml.safe_load(prof.read_text())["gpus"]["H20"]
    assert eff["flops_eff"] == pytest.approx(0.6) and eff["hbm_eff"] == pytest.approx(0.9)
    assert eff["net_eff"] == pytest.approx(0.5) and eff["net_alpha_us"] == pytest.approx(20, rel=1e-3)
    cl = write(tmp_path, "c.yaml", "inventory: {H20: 16, L40S: 16}\n")
    base = run("--model", "mixtral-8x7b", "--cluster", cl, "--tpot-ms", "30", "--json")
    tuned = run("--model", "mixtral-8x7b", "--cluster", cl, "--tpot-ms", "30", "--json", "--profile", str(prof))
    assert base.returncode == tuned.returncode == 0
    assert json.loads(base.stdout)["plan"]["summary"] != json.loads(tuned.stdout)["plan"]["summary"]
    bad = write(tmp_path, "bad.json", json.dumps({"gpu": "H20", "measurements": [{"kind": "gemm"}]}))
    out = subprocess.run([*CLI, "calibrate", "--from", bad, "-o", str(prof)], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert out.returncode == 2 and "measurements[0]" in out.stderr


H200X4 = "inventory: {H200: {count: 4, gpus_per_node: 4}}\n"
EXAMPLE = ["--model", "qwen3-30b-a3b", "--tpot-ms", "50", "--input-len", "128", "--output-len", "128"]


def test_issue_example_table_has_both_layouts_and_explain_names_the_winner(tmp_path):
    cl = write(tmp_path, "c.yaml", H200X4)
    out = run(*EXAMPLE, "--cluster", cl, "--explain")
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("deployment units by")[1].split("\n\n")[0]
    assert " colocated " in table and " disaggregated " in table
    assert "profile: hopper" in out.stdout
    assert re.search(r"H200: calibrated on \d+ measurements; measured error max \d+\.\d%", out.stdout)
    winner = out.stdout.split("winner: ")[1].split(",")[0]
    best_line = out.stdout.split("best plan:")[1].splitlines()[0]
    # co-located EP (measured on 2 x H200 since 2026-11-29) is a co-located unit with ep > 1
    assert winner in ("colocated", "colocated EP", "disaggregated")
    assert f"[{winner.split()[0]}:" in best_line and ("ep1 " not in best_line) == (winner == "colocated EP")
    assert f"  {winner} vs " in out.stdout and "sequences per GPU within the SLO" in out.stdout
    assert "rows per expert" in out.stdout
    data = json.loads(run(*EXAMPLE, "--cluster", cl, "--json", "--top", "20").stdout)
    assert {row["layout"] for row in data["top"]} == {"colocated", "disaggregated"}
    assert data["plan"]["units"][0]["layout"] == winner.split()[0]
    assert data["profile"]["fits"]["H200"]["max_err"] <= 0.15
    assert data["plan"]["summary"]["tokens_per_joule"] > 0 and all(r["tokens_per_watt"] > 0 for r in data["top"])


def test_profile_none_and_layout_filter(tmp_path):
    cl = write(tmp_path, "c.yaml", H200X4)
    out = run(*EXAMPLE, "--cluster", cl, "--profile", "none", "--layouts", "disaggregated")
    assert out.returncode == 0, out.stderr
    assert "H200: datasheet efficiency defaults, not calibrated" in out.stdout
    assert " colocated " not in out.stdout.split("deployment units by")[1]
    bad = run(*EXAMPLE, "--cluster", cl, "--layouts", "sideways")
    assert bad.returncode == 2 and "--layouts" in bad.stderr


def test_calibrate_engine_runs_prints_before_and_after(tmp_path):
    files = sorted(str(p) for p in (REPO / "planner/profiles/measurements").glob("*.json"))
    prof = tmp_path / "p.yaml"
    out = subprocess.run([*CLI, "calibrate", *files, "--transfer", "H800=H200", "-o", str(prof)],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "max error: before" in out.stdout and "batch 256, 64 in / 256 out" in out.stdout
    data = yaml.safe_load(prof.read_text())
    for gpu in ("H200", "H100-SXM"):  # both measured
        assert data["fits"][gpu]["max_err"] <= 0.15 < data["fits"][gpu]["before_max_err"]
    assert data["fits"]["H800"] == {"transferred_from": "H200"} and data["gpus"]["H800"] == data["gpus"]["H200"]
    plan = run(*EXAMPLE, "--cluster", write(tmp_path, "c.yaml", H200X4), "--profile", str(prof))
    assert plan.returncode == 0 and f"profile: {prof}" in plan.stdout
