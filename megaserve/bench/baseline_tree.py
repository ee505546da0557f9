"""``--baseline-tree DIR`` of ``megaserve bench cpu`` and ``megaserve bench host``: the same
benchmark with another source tree's megaserve (e.g. ``git archive REV | tar -x -C DIR``),
in fresh processes, alternating with this checkout.

The child puts the tree first on ``sys.path`` and, before anything of megaserve is
imported, a finder that maps ``megaserve.<folder>`` to ``tree/<folder>`` for the folders
pyproject's package-dir installs under megaserve (kernels, comm, planner, deploy): without
it the tree's megaserve would take them from the editable install, i.e. from this
checkout. This file imports nothing of megaserve, so the child runs it by path.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[2]  # the tree this file belongs to


class TreePackages(importlib.abc.MetaPathFinder):
    """Imports ``megaserve.<name>`` from ``tree/<name>/`` for every top-level package folder
    of ``tree`` other than megaserve itself."""

    def __init__(self, tree: Path) -> None:
        self.folders = {f"megaserve.{d.name}": d for d in tree.iterdir()
                        if d.name != "megaserve" and (d / "__init__.py").is_file()}

    def find_spec(self, name, path, target=None):
        folder = self.folders.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)])


def passthrough(argv: list[str]) -> list[str]:
    """``argv`` without ``--baseline-tree DIR`` and ``--repeat N`` (the parent's business)."""
    skip = {"--baseline-tree", "--repeat"}
    return [a for i, a in enumerate(argv)
            if a not in skip and (i == 0 or argv[i - 1] not in skip)]


def run(tree: Path, script: str, prog: str, argv: list[str]) -> Any:
    """Run the bench module ``script`` (its file) as ``prog`` with ``argv --worker`` in a
    fresh process on ``tree``'s megaserve; returns its last line of output, parsed as JSON.
    Raises ValueError with the child's error output if it fails."""
    code = ("import runpy, sys; from pathlib import Path; "
            f"finder = runpy.run_path({__file__!r})['TreePackages']; "
            f"sys.meta_path.insert(0, finder(Path({str(tree)!r}))); "
            f"sys.argv = [{prog!r}] + sys.argv[1:]; "
            f"runpy.run_path({str(Path(script).resolve())!r}, run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code, *argv, "--worker"], env=env,
                         cwd=tempfile.gettempdir(), capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise ValueError(f"run with {tree} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
