"""The package's import graph, read from the source (every import, inside functions too): a DAG
whose arrows point down the declared layers, and a package map (docs/package.md) that names
every module."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moe_tutorial"

# Lowest first. A module may import modules of its own layer or below, never above.
LAYERS = [
    ("foundations: no imports from the package",
     {"hardware", "data", "hf_baseline", "ranks", "bootstrap", "workspace", "safe_io", "families",
      "__init__"}),
    ("configuration", {"config"}),
    ("measuring: clocks, FLOP counts, peaks, memory", {"timing"}),
    ("what the notebooks share: a run's mode and sizes come from the config", {"lesson"}),
    ("numerics and token movement", {"quant", "routing"}),
    ("which recipe runs here", {"recipes"}),
    ("the experts", {"experts"}),
    ("the model, expert parallelism", {"model", "distributed"}),
    ("training (and resuming it), probes of a real step, what a step holds",
     {"train", "checkpoint", "dist_checkpoint", "sharded_init", "probes", "memory"}),
    ("measurement", {"bench", "skew"}),
    ("harnesses and presentation", {"train_dist", "blackwell", "widgets", "checks", "course",
                                  "step_profile", "idle_gaps", "speed_of_light"}),
    ("the benchmark matrix, the decision sweep", {"matrix", "decide"}),
    ("the analysis of a learner's own model", {"analyze"}),
    ("the README's numbers", {"docs"}),
    ("the command line", {"__main__"}),
]
LAYER_OF = {module: i for i, (_, modules) in enumerate(LAYERS) for module in modules}


def _module_of(path: Path) -> str:
    """The package module a source file belongs to: `x.py` is module x, and every file of a
    subpackage `x/` (a directory with an `__init__.py`) is part of module x."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _is_module(name: str) -> bool:
    return (PACKAGE / f"{name}.py").exists() or (PACKAGE / name / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """The package modules `path` imports, at module level or inside functions; imports between
    the files of one subpackage are internal to it."""
    # a relative import of this many dots starts at moe_tutorial/ (fewer: inside the subpackage)
    package_level = len(path.relative_to(PACKAGE).parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == package_level:
            found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_tutorial"):
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("moe_tutorial.")}
    return {m for m in found if _is_module(m)} - {_module_of(path)}


GRAPH: dict[str, set[str]] = {}
for _path in sorted(PACKAGE.rglob("*.py")):
    if _is_module(_module_of(_path)):  # not a script in a folder that is no subpackage
        GRAPH.setdefault(_module_of(_path), set()).update(_imports(_path))


def test_every_module_has_a_declared_layer():
    undeclared = sorted(set(GRAPH) - set(LAYER_OF))
    assert not undeclared, f"add these modules to LAYERS in tests/test_architecture.py: {undeclared}"
    assert not sorted(set(LAYER_OF) - set(GRAPH)), "LAYERS names modules that no longer exist"


def test_imports_point_down_the_layers():
    upward = [f"{a} ({LAYERS[LAYER_OF[a]][0]}) imports {b} ({LAYERS[LAYER_OF[b]][0]})"
              for a, targets in GRAPH.items() for b in sorted(targets) if LAYER_OF[b] > LAYER_OF[a]]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    state, cycles = {}, []

    def visit(module, path):
        state[module] = "open"
        for target in sorted(GRAPH[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in GRAPH:
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_package_map_names_every_module():
    table = (ROOT / "docs" / "package.md").read_text()
    spelled = {m: f"`{m}/`" if (PACKAGE / m).is_dir() else f"`{m}.py`" for m in GRAPH}
    missing = [m for m in GRAPH if not m.startswith("__") and spelled[m] not in table]
    assert not missing, f"the package map, docs/package.md, lacks {missing}"
