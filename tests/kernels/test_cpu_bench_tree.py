"""``megaserve bench cpu --baseline-tree``: a worker imports megaserve.kernels from the tree
it measures, not from the editable install (the package-dir folders map under megaserve)."""

from __future__ import annotations

import subprocess
import sys


def test_baseline_tree_worker_imports_the_trees_kernels(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("WHERE = 'tree'\n")
    (tmp_path / "kernels" / "cpu.py").write_text("WHERE = 'tree cpu'\n")
    code = (
        "import sys; from pathlib import Path; "
        "from megaserve.bench.baseline_tree import TreePackages; "
        f"sys.meta_path.insert(0, TreePackages(Path({str(tmp_path)!r}))); "
        "import megaserve.kernels, megaserve.kernels.cpu, megaserve.engine; "
        "print(megaserve.kernels.WHERE, '|', megaserve.kernels.cpu.WHERE)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "tree | tree cpu"
