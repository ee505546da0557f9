"""The experiments in ``lab/`` name only what the package has.

``lab/`` is outside the package and mostly runs on a GPU machine, so nothing else would
notice when a name it imports is renamed or removed. This walks each script's AST (imports
inside functions too) and checks, on the CPU, that every ``from megaserve... import name``
resolves and that every attribute read through an imported megaserve module
(``mm.SMALL_K_RULE_ENV``) exists, and that the scripts a usage line names
(``source lab/device/setup.sh``) exist.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAB = sorted((ROOT / "lab").rglob("*.py"))
SCRIPT_PATH = re.compile(r"(?<![\w/.])((?:lab|scripts|docs|tests)/[\w./-]+\.(?:py|sh|md))\b")


def _resolve(module: str, name: str) -> object | None:
    """``module.name`` as an attribute or a submodule; None if it is neither."""
    mod = importlib.import_module(module)
    if hasattr(mod, name):
        return getattr(mod, name)
    try:
        return importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
        return None


def missing_names(path: Path) -> list[str]:
    """``"<line>: <what>"`` for each megaserve name ``path`` uses that does not exist."""
    tree = ast.parse(path.read_text(), filename=str(path))
    missing, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and \
                (node.module or "").startswith("megaserve"):
            for alias in node.names:
                value = _resolve(node.module, alias.name)
                if value is None:
                    missing.append(f"{node.lineno}: from {node.module} import {alias.name}")
                elif isinstance(value, types.ModuleType):
                    modules[alias.asname or alias.name] = value
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("megaserve.") and alias.asname:
                    modules[alias.asname] = importlib.import_module(alias.name)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and not hasattr(modules[node.value.id], node.attr)):
            missing.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return missing


def test_the_check_sees_a_renamed_name(tmp_path):
    script = tmp_path / "sample.py"
    script.write_text("from megaserve.kernels.triton_impl import matmul as mm\n"
                      "from megaserve.kernels.testing import time_ms, no_such_helper\n"
                      "x = mm.SMALL_K_RULE_ENV, mm._NO_SUCH_RULE\n")
    assert missing_names(script) == ["2: from megaserve.kernels.testing import no_such_helper",
                                     "3: mm._NO_SUCH_RULE"]


@pytest.mark.parametrize("path", LAB, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_lab_scripts_name_what_exists(path):
    assert not (missing := missing_names(path)), \
        f"{path.relative_to(ROOT)} names what the package lacks:\n" + "\n".join(missing)


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "lab").rglob("*")
                                         if p.suffix in (".py", ".sh", ".md")),
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_paths_named_in_lab_exist(path):
    named = SCRIPT_PATH.findall(path.read_text(errors="replace"))
    missing = sorted({name for name in named if not (ROOT / name).exists()})
    assert not missing, f"{path.relative_to(ROOT)} names files that do not exist: {missing}"


def test_experiments_and_device_scripts_live_in_lab():
    """No ``scripts/`` folder beside the packages: experiments and device entry points are
    in ``lab/`` (``lab/device/`` for a GPU machine), the benchmarks a user runs are
    ``megaserve bench``."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "scripts"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert not listed.stdout.split(), f"files under scripts/: {listed.stdout.split()}"
    assert (ROOT / "lab/device/setup.sh").is_file()
