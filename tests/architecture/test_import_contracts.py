"""The layering contracts of ``.importlinter`` hold (import-linter, run as in CI).

kernels/ and comm/ never import the runtime; planner/ never imports torch (directly or
through anything it imports); the engine and the models never import the runtime, the
servers or the entrypoints.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def lint_imports(config: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or pytest.fail("import-linter is not installed "
                                                      "(pip install -e '.[test]')")
    return subprocess.run([exe, "--config", str(config), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept():
    result = lint_imports(ROOT / ".importlinter")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    contracts = (ROOT / ".importlinter").read_text().count("[importlinter:contract:")
    assert f"{contracts} kept, 0 broken" in result.stdout


def test_a_broken_contract_is_reported(tmp_path):
    """The checker sees through the package layout: megaserve does import torch."""
    config = tmp_path / "broken.ini"
    config.write_text((ROOT / ".importlinter").read_text() + (
        "\n[importlinter:contract:runtime-without-torch]\nname = megaserve without torch\n"
        "type = forbidden\nsource_modules =\n    megaserve\nforbidden_modules =\n    torch\n"))
    result = lint_imports(config)
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout[-2000:]
