"""Import hygiene: no circular imports between modules, no private name taken across modules.

Cycles are found on the installed layout (comm/, kernels/, planner/ and deploy/ placed under
megaserve/ as pyproject's package-dir maps them, as in test_import_contracts), with grimp,
import-linter's graph builder: every import counts, also one inside a function, since a
lazy import still ties the two modules together. Private names are found by walking the
AST of the code that ships or runs as a tool (the packages and ``lab/``); tests
are white-box and may reach into the module they test.

Known exceptions are listed below, each with the reason it is not fixed yet; one that no
longer occurs is reported as a warning (remove it from the list).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

from tests.architecture.test_import_contracts import installed_layout

ROOT = Path(__file__).resolve().parents[2]
CHECKED_FOLDERS = ("megaserve", "comm", "kernels", "planner", "deploy", "lab")

# Import cycles not broken yet: the modules of one cycle -> why.
KNOWN_CYCLES: dict[frozenset[str], str] = {}

# Private names taken across modules: "path: the import or attribute" -> why.
KNOWN_PRIVATE_IMPORTS: dict[str, str] = {}

_CYCLES_SCRIPT = """
import json, sys
import grimp
graph = grimp.build_graph("megaserve", cache_dir=None)
edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
json.dump(edges, sys.stdout)
"""


def strongly_connected(edges: dict[str, list[str]]) -> list[frozenset[str]]:
    """The cycles of a directed graph: its strongly connected components of two or more
    nodes (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(edges.get(nxt, ()))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def test_strongly_connected_finds_cycles_and_only_cycles():
    edges = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["e"], "e": [], "f": ["f"]}
    assert strongly_connected(edges) == [frozenset({"a", "b", "c"})]


def test_no_import_cycles_in_the_installed_layout(tmp_path):
    layout = installed_layout(tmp_path / "layout")
    env = {**os.environ, "PYTHONPATH": str(layout)}
    result = subprocess.run([sys.executable, "-c", _CYCLES_SCRIPT], cwd=layout, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    edges = json.loads(result.stdout)
    assert "megaserve.deploy.k8s" in edges and "megaserve.kernels.api" in edges  # the layout
    cycles = set(strongly_connected(edges))
    new = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not new, f"import cycles: {new}"
    if gone:
        warnings.warn(f"fixed, remove from KNOWN_CYCLES: {gone}")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """``"<path>: <what>"`` for each private name ``path`` takes from a megaserve module:
    ``from m import _x`` (absolute or relative), ``import m._x``, and ``alias._x`` where
    ``alias`` is a module (or name) imported from megaserve."""
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), filename=rel)
    found, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and not module.startswith("megaserve"):
                continue
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{rel}: from {'.' * node.level}{module} import {alias.name}")
                else:
                    aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("megaserve."):
                    if any(_is_private(part) for part in alias.name.split(".")):
                        found.append(f"{rel}: import {alias.name}")
                    aliases.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and _is_private(node.attr)):
            found.append(f"{rel}: {node.value.id}.{node.attr}")
    return sorted(set(found))


def checked_sources() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in listed.stdout.split()
            if name.split("/")[0] in CHECKED_FOLDERS and (ROOT / name).exists()]


def test_private_imports_are_detected(tmp_path):
    sample = tmp_path / "lab" / "sample.py"
    sample.parent.mkdir()
    sample.write_text("from megaserve.kernels.bench import _helper\n"
                      "from megaserve.kernels import matmul as mm\nx = mm._TALL\n"
                      "from megaserve.kernels import api\ny = api.__name__\n")
    assert private_imports(sample, root=tmp_path) == [
        "lab/sample.py: from megaserve.kernels.bench import _helper", "lab/sample.py: mm._TALL"]


def test_no_private_name_is_imported_across_modules():
    found = {entry for path in checked_sources() for entry in private_imports(path)}
    new = sorted(found - set(KNOWN_PRIVATE_IMPORTS))
    gone = sorted(set(KNOWN_PRIVATE_IMPORTS) - found)
    assert not new, "private names imported across modules:\n" + "\n".join(new)
    if gone:
        warnings.warn("fixed, remove from KNOWN_PRIVATE_IMPORTS: " + ", ".join(gone))
