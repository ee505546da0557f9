"""``megaserve bench`` as a real process: the list of benchmarks, and ``bench decode``'s
sizes on a CPU (seconds of work, not the GPU's 8192^3 matmul and 4,096-token prefill)."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys

BENCH = [sys.executable, "-m", "megaserve.cli", "bench"]


def test_bench_help_lists_the_benchmarks_and_exits_0():
    from megaserve.cli import BENCHMARKS

    out = subprocess.run([*BENCH, "--help"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    listed = re.findall(r"^  (\S+) +\S", out.stdout, re.M)
    assert listed == list(BENCHMARKS) and "planner" in listed and "decode" in listed
    wrong = subprocess.run([*BENCH, "nope"], capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 2 and "unknown benchmark 'nope'" in wrong.stderr
    assert "planner" in wrong.stderr


def test_bench_decode_on_cpu_picks_small_sizes(tmp_path):
    report = tmp_path / "decode.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([*BENCH, "decode", "--device", "cpu", "--dtype", "float32",
                          "--json-out", str(report)],
                         capture_output=True, text=True, timeout=900)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(report.read_text())
    assert [r["batch"] for r in result["decode"]] == [1, 8, 32]
    assert result["prefill"]["prompt_len"] == 128
    assert "matmul 512^3" in out.stdout
    # CPU seconds (load-independent): ~6 s measured on a 2-core Xeon; the GPU sizes took
    # minutes of CPU before their first line of output.
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu_s < 120, cpu_s
