"""The tests sit in folders that mirror what they test: one folder per sub-package of the
package (`tests/moe/experts/` for `moe_tutorial/moe/experts/`), the package's top-level modules at
`tests/` itself, then `tools/`, `benchmarks/` and `notebooks/` for the repository's folders of
those names, `project/` for the repository as a whole and `integration/` for the whole-course and
browser runs. A file is named for the behaviour it tests, never for how the work was organised."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PACKAGE = ROOT / "moe_tutorial"
REPOSITORY_FOLDERS = {"tools", "benchmarks", "notebooks", "project", "integration"}
TOP_LEVEL_MODULES = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
# what a name or a docstring may not cite: a review round, a finding, a probe
ORGANISATION = re.compile(r"\bround ?\d|\bfinding ?\d|\bprobe ?\d", re.IGNORECASE)


def _sub_packages() -> set[str]:
    return {path.parent.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("__init__.py")
            if path.parent != PACKAGE}


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_every_test_folder_mirrors_a_sub_package_or_a_repository_folder():
    allowed = _sub_packages() | REPOSITORY_FOLDERS
    folders = {path.parent.relative_to(TESTS).as_posix() for path in _test_files()} - {"."}
    assert not folders - allowed, (f"tests in folders that mirror nothing: {sorted(folders - allowed)}; "
                                   f"a folder is a sub-package of moe_tutorial/ or one of "
                                   f"{sorted(REPOSITORY_FOLDERS)}")


def _tested(sub_package: str) -> bool:
    """Tests of its own folder, or (a package of one idea, like `perf/bench`) test files named
    after it in its parent's folder."""
    parent, _, name = sub_package.rpartition("/")
    return (any((TESTS / sub_package).glob("test_*.py"))
            or any((TESTS / parent).glob(f"test_{name}*.py")))


def test_every_sub_package_with_code_has_its_tests():
    with_code = {name for name in _sub_packages()
                 if any(p.name != "__init__.py" for p in (PACKAGE / name).glob("*.py"))}
    missing = sorted(name for name in with_code if not _tested(name))
    assert not missing, (f"no tests/<sub-package>/ (or tests/<parent>/test_<name>*.py) for "
                         f"these sub-packages: {missing}")


def test_the_top_level_tests_are_of_the_packages_top_level_modules():
    """A test at `tests/` itself is named after a top-level module it tests (`test_cli_...`)."""
    stray = [path.name for path in TESTS.glob("test_*.py")
             if not any(path.stem == f"test_{m}" or path.stem.startswith(f"test_{m}_")
                        for m in TOP_LEVEL_MODULES)]
    assert not stray, (f"these tests sit at tests/ but name no top-level module of the package "
                       f"({sorted(TOP_LEVEL_MODULES)}): move them to the folder of what they "
                       f"test: {stray}")


def test_safe_io_has_its_own_tests():
    assert (TESTS / "test_safe_io.py").is_file()


def test_no_test_file_or_docstring_cites_how_the_work_was_organised():
    cited = []
    for path in _test_files():
        if ORGANISATION.search(path.stem.replace("_", " ")):
            cited.append(path.relative_to(TESTS).as_posix())
        tree = ast.parse(path.read_text())
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node) or ""
                if ORGANISATION.search(doc):
                    cited.append(f"{path.relative_to(TESTS).as_posix()}:{getattr(node, 'name', '')}")
    assert not cited, f"name the behaviour, not a review round or finding: {sorted(set(cited))}"
