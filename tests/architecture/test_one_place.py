"""One fact, one place: the model is resolved, its config read and a prompt checked in one place each.

The package turns a model name into a checkpoint directory (``resolve_model``) and reads
its ``config.json`` (``ModelConfig.from_dir``) only in
``megaserve.models.resolved.ResolvedModel.resolve``; everything else receives the frozen
``ResolvedModel`` from its caller (a worker process in its spec). This walks the AST of
the code that ships (the folders pyproject maps into the package) and counts the calls,
under any name they are imported as. Tests may call both. Likewise a prompt is checked in
one function, ``megaserve.engine.engine.validate_prompt``, which every engine's
``validate`` calls or reaches through another engine.
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


def _validate_methods() -> dict[str, ast.FunctionDef]:
    """``"path:Class.validate"`` -> the method, for every class in the package."""
    found = {}
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef) and item.name == "validate":
                            found[f"{rel}:{node.name}.validate"] = item
    return found


def _checks_prompt_in_the_one_place(method: ast.FunctionDef) -> bool:
    """The method calls ``validate_prompt`` or hands the prompt to another engine's
    ``validate``, or is abstract (a body of a docstring only)."""
    body = [s for s in method.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not body:
        return True
    for node in ast.walk(method):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "validate_prompt":
                return True
            if isinstance(func, ast.Attribute) and func.attr == "validate" and not (
                    isinstance(func.value, ast.Name) and func.value.id == "self"):
                return True
    return False


def test_prompt_checks_live_in_validate_prompt():
    """Every engine's ``validate`` is ``megaserve.engine.engine.validate_prompt`` (or hands
    the prompt to an engine that calls it): the checks of a prompt's type, tokens and length
    are written once. The server adds only guards in front of it (tests/server)."""
    sites = []
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            sites += [path.relative_to(ROOT).as_posix() for node in ast.walk(tree)
                      if isinstance(node, ast.FunctionDef) and node.name == "validate_prompt"]
    assert sites == ["megaserve/engine/engine.py"], f"validate_prompt defined at {sites}"
    methods = _validate_methods()
    assert "megaserve/engine/engine.py:LLMEngine.validate" in methods  # the walk sees them
    stray = sorted(name for name, method in methods.items()
                   if not _checks_prompt_in_the_one_place(method))
    assert not stray, f"{stray} check prompts themselves: call validate_prompt"


def test_validate_prompt_refuses_bad_prompts_by_field():
    from megaserve import SamplingParams
    from megaserve.engine.engine import validate_prompt

    params = SamplingParams(max_tokens=4)
    assert validate_prompt([1, 2, 3], params, None, vocab_size=10, max_model_len=8) == [1, 2, 3]
    for prompt, message in (([], "prompt: empty"), ([1, 10], "prompt_token_ids: \\[10\\]"),
                            ([1, True], "prompt_token_ids"), (list(range(8)), "no room"),
                            ("text", "no tokenizer.json"), (3, "expected text")):
        with pytest.raises(ValueError, match=message):
            validate_prompt(prompt, params, None, vocab_size=10, max_model_len=8)
