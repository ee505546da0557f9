"""`megaserve plan --explain` on 2 x H200 for a model that fits one GPU: co-located EP is
ranked beside single-GPU co-located and disaggregated units, and the explanation says why
disaggregation loses (per-GPU throughput halves; what the split adds per MoE layer)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
H200X2 = "inventory:\n  H200: {count: 2, gpus_per_node: 2}\n"


def plan(tmp_path: Path, *extra: str) -> str:
    cluster = tmp_path / "c.yaml"
    cluster.write_text(H200X2)
    out = subprocess.run([sys.executable, "-m", "megaserve.cli", "plan", "--model", "qwen3-30b-a3b", "--cluster",
                          str(cluster), "--input-len", "64", "--output-len", "256", "--top", "20", *extra],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_colocated_ep_is_a_candidate_beside_one_gpu_and_disaggregated(tmp_path):
    table = plan(tmp_path).split("deployment units by")[1].split("\n\n")[0]
    rows = [line for line in table.splitlines() if re.match(r"\s+\d+\s", line)]
    assert any(" colocated " in r and "same GPUs, ep1" in r for r in rows)
    assert any(" colocated " in r and "same GPUs, ep2" in r for r in rows)
    assert any(" disaggregated " in r for r in rows)


def test_explain_says_when_and_why_disaggregation_loses(tmp_path):
    for batch in ("256", "1024"):
        out = plan(tmp_path, "--max-batch", batch, "--explain")
        assert "best plan: " in out and "[disaggregated:" not in out.split("best plan:")[1].splitlines()[0]
        text = out.split("disaggregation loses here: ")[1]
        assert re.match(r"colocated( EP)? gets \d+\.\d\dx its throughput", text)
        assert "the model fits one H200" in text and "per GPU its throughput is divided by 2" in text
        split = re.search(r"the split (adds|saves) (\d+) us per MoE layer \(step (\d+\.\d+) vs (\d+\.\d+) ms", text)
        assert split, text
        added = (1 if split[1] == "adds" else -1) * int(split[2])
        assert abs(added - (float(split[3]) - float(split[4])) * 1e3 / 48) <= 1  # 48 MoE layers
        per_gpu = re.search(r"per GPU: ([\d,]+) \(split\) vs ([\d,]+) tok/s \(one co-located GPU\)", text)
        assert per_gpu and int(per_gpu[1].replace(",", "")) < int(per_gpu[2].replace(",", ""))
    # at batch 256, m = 1 (as measured): the split adds time per layer, it does not save it
    out = plan(tmp_path, "--max-batch", "256", "--explain")
    # predictions for serving assume the engine's default, async scheduling, and say so
    assert "scheduling: async" in out
    step = re.search(r"step = max\(GPU, host\) \(async scheduling.*= max\(([\d.]+), ([\d.]+)\) = ([\d.]+) ms", out)
    assert step and float(step[3]) == pytest.approx(max(float(step[1]), float(step[2])), abs=0.01)
    assert re.search(r"the split adds \d+ us per MoE layer \(step [\d.]+ vs [\d.]+ ms over 48 layers at m=1", out)


def test_explain_compares_with_colocated_ep_where_the_model_does_not_fit_one_gpu(tmp_path):
    """Qwen3-235B-A22B's shape at 26 layers (its experts <= 90% of one H200's 141 GB): one GPU
    cannot hold it, so the split is compared per GPU with co-located EP over the same two
    GPUs, and the step it would need to match EP follows from EP's per-GPU throughput."""
    import json

    from megaserve.bench.random_model import hf_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_config("qwen3-235b-a22b", 26)))
    cluster = tmp_path / "c.yaml"
    cluster.write_text(H200X2)
    out = subprocess.run([sys.executable, "-m", "megaserve.cli", "plan", "--model", str(config), "--cluster",
                          str(cluster), "--input-len", "64", "--output-len", "256", "--max-batch", "1024",
                          "--explain"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout.split("disaggregation loses here: ")[1]
    assert text.startswith("colocated EP gets") and "the model does not fit one H200" in text
    m = re.search(r"per GPU: ([\d,]+) \(split\) vs ([\d,]+) tok/s \(colocated EP: .*the split's (\d+) sequences "
                  r"share 2 GPUs.* below (\d+\.\d+) ms \(it takes (\d+\.\d+)\)", text)
    assert m, text
    split_gpu, ep_gpu, seqs, need_ms, takes_ms = (float(g.replace(",", "")) for g in m.groups())
    assert split_gpu < ep_gpu and takes_ms > need_ms
    assert need_ms == pytest.approx(seqs / (2 * ep_gpu) * 1e3, rel=2e-3)
