"""One fact, one place: the model is resolved, and its config read, in exactly one place.

The package turns a model name into a checkpoint directory (``resolve_model``) and reads
its ``config.json`` (``ModelConfig.from_dir``) only in
``megaserve.models.resolved.ResolvedModel.resolve``; everything else receives the frozen
``ResolvedModel`` from its caller (a worker process in its spec). This walks the AST of
the code that ships (the folders pyproject maps into the package) and counts the calls,
under any name they are imported as. Tests may call both.
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = ("megaserve", "comm", "kernels", "planner", "deploy")
THE_PLACE = "megaserve/models/resolved.py"


def _calls(tree: ast.AST) -> dict[str, list[int]]:
    """Line numbers of calls of ``resolve_model`` and ``ModelConfig.from_dir`` in ``tree``,
    also through ``import ... as`` aliases and module attributes (``builtin.resolve_model``)."""
    aliases = {"resolve_model": "resolve_model", "ModelConfig": "ModelConfig"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for name in node.names:
                if name.name in ("resolve_model", "ModelConfig") and name.asname:
                    aliases[name.asname] = name.name
    found: dict[str, list[int]] = {"resolve_model": [], "ModelConfig.from_dir": []}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and aliases.get(func.id) == "resolve_model":
            found["resolve_model"].append(node.lineno)
        elif isinstance(func, ast.Attribute):
            if func.attr == "resolve_model":
                found["resolve_model"].append(node.lineno)
            elif func.attr == "from_dir" and (
                    (isinstance(func.value, ast.Name) and aliases.get(func.value.id) == "ModelConfig")
                    or (isinstance(func.value, ast.Attribute) and func.value.attr == "ModelConfig")):
                found["ModelConfig.from_dir"].append(node.lineno)
    return found


def _package_calls() -> dict[str, list[str]]:
    sites: dict[str, list[str]] = {"resolve_model": [], "ModelConfig.from_dir": []}
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for what, lines in _calls(ast.parse(path.read_text(), rel)).items():
                sites[what] += [f"{rel}:{line}" for line in lines]
    return sites


def test_the_walk_sees_every_spelling():
    """The counter itself: plain, aliased and attribute calls count; other from_dir do not."""
    code = ("from megaserve.models.builtin import resolve_model as rm\n"
            "from megaserve.models.config import ModelConfig as MC\n"
            "from megaserve.models import builtin, config\n"
            "rm('x'); builtin.resolve_model('y'); MC.from_dir('p'); config.ModelConfig.from_dir('q')\n"
            "Tokenizer.from_dir('t')\n")
    assert _calls(ast.parse(code)) == {"resolve_model": [4, 4], "ModelConfig.from_dir": [4, 4]}


@pytest.mark.parametrize("what", ["resolve_model", "ModelConfig.from_dir"])
def test_called_in_one_place(what):
    sites = _package_calls()[what]
    assert len(sites) == 1 and sites[0].startswith(THE_PLACE + ":"), (
        f"{what} is called at {sites}: resolve the model once (ResolvedModel.resolve) and "
        "pass the ResolvedModel down")


def test_resolved_model_crosses_a_process_boundary(tmp_path):
    """A worker process receives the ResolvedModel itself: it pickles, frozen and whole."""
    from megaserve.models.resolved import ResolvedModel

    model = ResolvedModel.resolve("builtin:tiny-moe")
    again = pickle.loads(pickle.dumps(model))
    assert again == model and again.config.num_experts == model.config.num_experts > 0
    assert again.path.is_dir() and again.name == "builtin:tiny-moe"
    with pytest.raises(AttributeError):
        model.path = tmp_path  # frozen
    with pytest.raises(ValueError, match="not an existing directory"):
        ResolvedModel.resolve(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        ResolvedModel.resolve(str(tmp_path))
