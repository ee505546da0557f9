"""The layering contracts of ``.importlinter`` hold (import-linter, run as in CI).

kernels/ and comm/ never import the runtime; planner/ never imports torch (directly or
through anything it imports); the engine and the models never import the runtime, the
servers or the entrypoints.

import-linter walks a package's folder, and comm/, kernels/, planner/ and deploy/ live
beside megaserve/ in the repository, so the check runs on the installed layout: a copy of
the tree arranged by pyproject's package-dir mapping (what a wheel holds).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def installed_layout(dest: Path) -> Path:
    """Copy the import root as pip installs it: megaserve/ with each package-dir folder
    (comm/ -> megaserve/comm, ...) placed under it."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "megaserve", dest / "megaserve", ignore=skip)
    for package, folder in mapping.items():
        shutil.copytree(ROOT / folder, dest.joinpath(*package.split(".")), ignore=skip)
    return dest


def lint_imports(config: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or pytest.fail("import-linter is not installed "
                                                      "(pip install -e '.[test]')")
    layout = installed_layout(tmp_path / "layout")
    env = {**os.environ, "PYTHONPATH": str(layout)}  # found before the editable install
    return subprocess.run([exe, "--config", str(config), "--no-cache"], cwd=layout, env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept(tmp_path):
    result = lint_imports(ROOT / ".importlinter", tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    contracts = (ROOT / ".importlinter").read_text().count("[importlinter:contract:")
    assert f"{contracts} kept, 0 broken" in result.stdout


def test_a_broken_contract_is_reported(tmp_path):
    """The checker sees through the package layout: megaserve does import torch."""
    config = tmp_path / "broken.ini"
    config.write_text((ROOT / ".importlinter").read_text() + (
        "\n[importlinter:contract:runtime-without-torch]\nname = megaserve without torch\n"
        "type = forbidden\nsource_modules =\n    megaserve\nforbidden_modules =\n    torch\n"))
    result = lint_imports(config, tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout[-2000:]
