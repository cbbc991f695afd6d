"""The package's import graph, read from the source (every import, inside functions too): its
sub-packages are layers by concern, each importing only from the layers below it, no module
imports another in a cycle, and docs/package.md's tree names every sub-package."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moe_tutorial"

# Lowest first. A sub-package (or a module beside them) may import its own layer or those below.
LAYERS = [
    ("beside the sub-packages, below every concern", {"__init__", "locations", "safe_io"}),
    ("precision: what this machine runs, the recipes, the numerics", {"precision"}),
    ("moe: the model the course teaches", {"moe"}),
    ("train: the loop, its data, its checkpoints", {"train"}),
    ("parallel: expert parallelism, FSDP2, sharded checkpoints and init", {"parallel"}),
    ("perf: measuring, and the tables, figures and dashboard that show it", {"perf"}),
    ("course: the runner and report, lesson helpers, probes, checks", {"course"}),
    ("the command line", {"cli", "__main__"}),
]
LAYER_OF = {part: i for i, (_, parts) in enumerate(LAYERS) for part in parts}


def _dotted(path: Path) -> str:
    """moe_tutorial/perf/bench.py -> moe_tutorial.perf.bench (a package is its __init__)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """The package's modules `path` imports (dotted), at module level or inside functions."""
    here = _dotted(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = (package[:len(package) - node.level + 1] + (node.module or "").split(".")
                    if node.level else (node.module or "").split("."))
            base = ".".join(p for p in base if p)
            for alias in node.names:  # `from x import y`: y is a module of x, or a name in it
                found.add(f"{base}.{alias.name}" if _exists(f"{base}.{alias.name}") else base)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.startswith("moe_tutorial.") and _exists(m)} - {_dotted(path)}


def _part(dotted: str) -> str:
    """The layer a module belongs to: its sub-package, or its own name beside them."""
    return dotted.split(".")[1]


GRAPH = {_dotted(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_part_has_a_declared_layer():
    undeclared = sorted({_part(m) for m in GRAPH if "." in m} - set(LAYER_OF))
    assert not undeclared, f"add these to LAYERS in tests/test_architecture.py: {undeclared}"


def test_imports_point_down_the_layers():
    upward = [f"{a} ({LAYERS[LAYER_OF[_part(a)]][0]}) imports {b} "
              f"({LAYERS[LAYER_OF[_part(b)]][0]})"
              for a, targets in GRAPH.items() if "." in a for b in sorted(targets)
              if LAYER_OF[_part(b)] > LAYER_OF[_part(a)]]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    """Between modules, not only between layers: two modules of one sub-package that import each
    other are a cycle too."""
    state, cycles = {}, []

    def visit(module, path):
        state[module] = "open"
        for target in sorted(GRAPH.get(module, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in GRAPH:
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_package_imports_no_repository_code():
    """tools/ and benchmarks/ run from a checkout; an installed package has neither."""
    outside = sorted(f"{_dotted(p)} imports {a.name if isinstance(node, ast.Import) else node.module}"
                     for p in PACKAGE.rglob("*.py")
                     for node in ast.walk(ast.parse(p.read_text()))
                     if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
                     for a in node.names
                     if (a.name if isinstance(node, ast.Import) else node.module or "")
                     .split(".")[0] in ("tools", "benchmarks"))
    assert not outside, "\n".join(outside)


def test_the_package_keeps_few_modules_beside_its_sub_packages():
    beside = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(beside) <= 8, f"moe_tutorial/ holds {beside}: move them into a sub-package"


def test_docs_package_tree_names_every_sub_package():
    tree = (ROOT / "docs" / "package.md").read_text()
    parts = {d.name for d in PACKAGE.iterdir() if (d / "__init__.py").is_file()}
    missing = sorted(p for p in parts if f"{p}/" not in tree)
    assert not missing, f"docs/package.md's tree lacks the sub-packages {missing}"


def test_no_module_locates_files_from_its_own_path():
    """An installed wheel holds the package, not the repository: a module that finds files from
    its `__file__` (`Path(__file__).parents[2] / "benchmarks"`) works in a checkout only. The
    package's own data, a clone's folders and the import root are found in locations.py, through
    importlib and the current directory."""
    found = sorted(f"{p.relative_to(ROOT)}:{node.lineno} uses {name}"
                   for p in PACKAGE.rglob("*.py")
                   for node in ast.walk(ast.parse(p.read_text()))
                   for name in [getattr(node, "id", None) or getattr(node, "attr", None)]
                   if isinstance(node, (ast.Name, ast.Attribute))
                   and name in ("__file__", "__path__"))
    assert not found, ("locate files through moe_tutorial/locations.py (package_data, "
                       "checkout_root, import_root), not a module's own path:\n" + "\n".join(found))
