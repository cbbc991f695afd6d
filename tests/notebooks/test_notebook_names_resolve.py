"""Every `module.name` a notebook's cells use, of a package module its cells import, exists in that
module: a name moved between modules (perf's measuring, course's views) breaks no chapter, exercise
or solution, and no `%%needs_gpu` cell, whose source may not change."""

import ast
import importlib
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) + sorted(
    (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")) + sorted(
    (ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))


def _python(source: str) -> ast.Module | None:
    """A cell's code with its IPython magics and shell lines left out (None where it does not
    parse: a learner's stub may not)."""
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _package_modules(trees: list[ast.Module]) -> dict[str, str]:
    """name -> the package module a notebook binds it to (`from moe_tutorial.perf import bench`,
    `from moe_tutorial.train import loop as train`, `import moe_tutorial.moe.routing as routing`)."""
    bound = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_tutorial"):
                for alias in node.names:
                    dotted = f"{node.module}.{alias.name}"
                    if _is_module(dotted):
                        bound[alias.asname or alias.name] = dotted
            elif isinstance(node, ast.Import):
                bound |= {a.asname: a.name for a in node.names
                          if a.asname and a.name.startswith("moe_tutorial.")}
    return bound


def _unresolved_imports(trees: list[ast.Module]) -> list[str]:
    """`from moe_tutorial.X import a` where a is neither a module of X nor a name in it."""
    found = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_tutorial"):
                if not _is_module(node.module):
                    found.append(f"{node.module} (no such module)")
                    continue
                module = importlib.import_module(node.module)
                found += [f"{node.module}.{a.name}" for a in node.names
                          if not _is_module(f"{node.module}.{a.name}")
                          and not hasattr(module, a.name)]
    return found


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_module_name_a_notebook_uses_exists(notebook):
    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    trees = [t for t in (_python("".join(c["source"])) for c in cells) if t is not None]
    unresolved = _unresolved_imports(trees)
    assert not unresolved, f"{notebook.name} imports what the package lacks: {unresolved}"
    modules = _package_modules(trees)
    assigned = {t.id for tree in trees for node in ast.walk(tree)
                if isinstance(node, (ast.Assign, ast.For)) for t in ast.walk(node)
                if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
    missing = sorted({f"{node.value.id}.{node.attr} ({modules[node.value.id]})"
                      for tree in trees for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                      and node.value.id in modules and node.value.id not in assigned
                      and not hasattr(importlib.import_module(modules[node.value.id]), node.attr)})
    assert not missing, f"{notebook.name} uses names its modules lack: {missing}"
