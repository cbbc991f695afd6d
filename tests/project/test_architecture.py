"""The package's shape, read from the source (every import, inside functions too): its
sub-packages are layers by concern, each importing only from the layers below it; no module
imports another in a cycle; perf/ measures and imports no widget or chapter view; no module runs
over 600 lines nor a function over 80 (three listed exceptions, each with its reason); no package
code sets another module's attribute (replaceable pieces are arguments, config fields or
registered choices); docs/package.md names every sub-package and every module."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "moe_tutorial"

# Lowest first. A sub-package (or a module beside them) may import its own layer or those below.
LAYERS = [
    ("beside the sub-packages, below every concern", {"__init__", "locations", "safe_io", "display", "arguments"}),
    ("precision: what this machine runs, the recipes, the numerics", {"precision"}),
    ("moe: the model the course teaches", {"moe"}),
    ("train: the loop, its data, its checkpoints", {"train"}),
    ("parallel: expert parallelism, FSDP2, sharded checkpoints and init", {"parallel"}),
    ("perf: measuring, returning numbers", {"perf"}),
    ("course: what the chapters show (views, dashboard, widgets), lesson helpers, checks, runner",
     {"course"}),
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
    assert not undeclared, f"add these to LAYERS in tests/project/test_architecture.py: {undeclared}"


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


# --- sizes ------------------------------------------------------------------------------------

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# At most three functions may run longer, each for a reason that outlives the next refactor.
LONG_FUNCTIONS = {
    "cli.py:main": "the command line's one dispatcher: one short branch per subcommand, read "
                   "top to bottom",
}
# Files that issue 45 (item 2) cuts along their jobs, each by the session that owns it: an entry
# leaves this list with the cut (`test_the_lists_of_files_and_functions_still_to_cut_are_current`
# fails once it is short enough).
STILL_TO_CUT: dict[str, str] = {}


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _module_lines() -> dict[str, int]:
    return {_relative(p): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}


def _function_lines() -> dict[str, int]:
    """Every function and method, `file:name`, with its length in lines (decorators left out)."""
    found = {}
    for p in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{_relative(p)}:{node.name}"
                found[key] = max(found.get(key, 0), node.end_lineno - node.lineno + 1)
    return found


def test_no_module_runs_over_600_lines():
    long = sorted(f"{path}: {n} lines" for path, n in _module_lines().items()
                  if n > MAX_MODULE_LINES and path not in STILL_TO_CUT)
    assert not long, (f"cut these along their jobs (at most {MAX_MODULE_LINES} lines a "
                      f"module):\n" + "\n".join(long))


def test_no_function_runs_over_80_lines():
    assert len(LONG_FUNCTIONS) <= 3, "at most three long functions, each with its reason"
    long = sorted(f"{key}: {n} lines" for key, n in _function_lines().items()
                  if n > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS
                  and key not in STILL_TO_CUT)
    assert not long, (f"split these (at most {MAX_FUNCTION_LINES} lines a function):\n"
                      + "\n".join(long))


def test_the_lists_of_files_and_functions_still_to_cut_are_current():
    sizes = {**_module_lines(), **_function_lines()}
    limit = {key: MAX_FUNCTION_LINES if ":" in key else MAX_MODULE_LINES
             for key in {**STILL_TO_CUT, **LONG_FUNCTIONS}}
    done = sorted(key for key in limit if sizes.get(key, 0) <= limit[key])
    assert not done, f"these are short enough now (or gone): take them off the lists: {done}"


# --- what perf may import ---------------------------------------------------------------------

WIDGET_LIBRARIES = ("ipywidgets", "anywidget")


def test_perf_measures_and_imports_no_widget_or_chapter_view():
    """perf/ returns numbers (and shows them only through the ground-level `display`); the live
    dashboard, the widgets and each chapter's views are course/'s."""
    found = []
    for p in sorted((PACKAGE / "perf").rglob("*.py")):
        found += [f"{_dotted(p)} imports {m}" for m in sorted(GRAPH[_dotted(p)])
                  if _part(m) == "course"]
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{_dotted(p)} imports {n}" for n in names
                      if n.split(".")[0] in WIDGET_LIBRARIES]
    assert not found, "\n".join(found)


# --- seams, not patches -----------------------------------------------------------------------

def _module_names(tree: ast.AST, path: Path) -> set[str]:
    """The names a file binds to modules of this package (`from ..moe import model`,
    `import moe_tutorial.moe.routing as routing`)."""
    here = _dotted(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = (package[:len(package) - node.level + 1] + (node.module or "").split(".")
                    if node.level else (node.module or "").split("."))
            base = ".".join(p for p in base if p)
            names |= {a.asname or a.name for a in node.names
                      if base.startswith("moe_tutorial") and _exists(f"{base}.{a.name}")}
        elif isinstance(node, ast.Import):
            names |= {a.asname for a in node.names
                      if a.asname and a.name.startswith("moe_tutorial.")}
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_package_code_assigns_no_attribute_of_another_module():
    """A replaceable piece (the routing rule, the attention kernels, the experts' backend) is an
    argument, a config field or a registered choice its module shows (`MoEForCausalLM.set_routing`,
    `set_attention_backends`, `set_expert_backend`), never a module attribute overwritten from
    outside: `model.route = ...`, `setattr(routing, ...)`, `mock.patch.object(model, ...)` or
    `mock.patch("moe_tutorial....")`."""
    found = []
    for p in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(p.read_text())
        modules = _module_names(tree, p)
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            found += [f"{_relative(p)}:{node.lineno} {ast.unparse(t)}" for t in targets
                      if isinstance(t, ast.Attribute) and _root(t) in modules]
            if isinstance(node, ast.Call):
                call = ast.unparse(node.func)
                first = node.args[0] if node.args else None
                if call.split(".")[-1] in ("setattr", "object") and first is not None \
                        and _root(first) in modules:
                    found.append(f"{_relative(p)}:{node.lineno} {call}({ast.unparse(first)}, ...)")
                if call.endswith("patch") and isinstance(first, ast.Constant) \
                        and str(first.value).startswith("moe_tutorial"):
                    found.append(f"{_relative(p)}:{node.lineno} {call}({first.value!r})")
    assert not found, "module attributes set from outside their module:\n" + "\n".join(found)


# --- the package map --------------------------------------------------------------------------

def test_docs_package_md_names_every_module():
    """Every module by its path under moe_tutorial/ (`perf/bench.py`), or by its file name in
    the row of its folder (`moe/experts/`)."""
    text = (ROOT / "docs" / "package.md").read_text()
    rows = text.splitlines()
    missing = []
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = _relative(p)
        if p.name == "__init__.py" or f"`{rel}`" in text:
            continue
        folder = f"`{p.parent.relative_to(PACKAGE).as_posix()}/`"
        if not any(folder in row and p.name in row for row in rows):
            missing.append(rel)
    assert not missing, f"docs/package.md's module table lacks {missing}"
