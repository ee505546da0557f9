"""One import root: everything installs under ``megaserve``, nothing imports the
repository's folders by their own top-level names.

Top-level ``comm`` is Jupyter's package (ipykernel depends on it) and ``kernels``,
``planner`` and ``deploy`` are taken names too; pyproject's package-dir mapping installs
the folders as megaserve.comm, megaserve.kernels, ... Running from the repository root,
``import comm`` would still work, and would load a second copy of every module (two
CommError classes), so these tests read the sources instead of trusting the import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("comm", "kernels", "planner", "deploy")


def setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def source_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    return [ROOT / name for name in tracked]


def test_package_dir_maps_every_folder_under_megaserve():
    mapping = setuptools_config()["package-dir"]
    assert mapping == {f"megaserve.{name}": name for name in FOLDERS}


def test_every_package_folder_is_listed_and_nothing_installs_at_top_level():
    config = setuptools_config()
    listed = set(config["packages"])
    folders = {"megaserve": ROOT / "megaserve"}
    folders |= {package: ROOT / folder for package, folder in config["package-dir"].items()}
    found = set()
    for package, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((package, *rel)))
    assert listed == found
    assert all(name == "megaserve" or name.startswith("megaserve.") for name in listed)


def test_no_source_imports_a_folder_by_its_top_level_name():
    offenders = []
    for path in source_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] in FOLDERS:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not offenders, "\n".join(offenders)


def test_the_installed_package_resolves_the_mapped_folders(tmp_path):
    """From a directory that is not the repository root, megaserve.comm (and the others)
    import from the repository's folders and no top-level ``comm`` is importable from it."""
    code = (
        "import importlib.util, sys\n"
        "import megaserve.comm, megaserve.kernels, megaserve.planner, megaserve.deploy\n"
        f"root = {str(ROOT)!r}\n"
        "for name in ('comm', 'kernels', 'planner', 'deploy'):\n"
        "    mod = sys.modules['megaserve.' + name]\n"
        "    assert mod.__file__ == f'{root}/{name}/__init__.py', mod.__file__\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    assert spec is None or not (spec.origin or '').startswith(root), spec\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_wheel_installs_one_import_root_with_the_kernel_sources(tmp_path):
    """A non-editable install: the wheel holds ``megaserve/`` only (no top-level ``comm``,
    ``kernels``, ``planner`` or ``deploy``), with the C++ sources the CPU kernels compile
    on first use, the shipped planner profile and the gRPC proto."""
    import zipfile

    result = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                             "-q", "-w", str(tmp_path)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("megaserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"megaserve"}
    for needed in ("megaserve/comm/relay.py", "megaserve/kernels/cpu_src/common.h",
                   "megaserve/kernels/cpu_src/gemm.cpp", "megaserve/planner/profiles/hopper.yaml",
                   "megaserve/server/generation.proto", "megaserve/deploy/k8s.py"):
        assert needed in names, needed
