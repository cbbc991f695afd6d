"""The learner's minimal reading path through the package: the MoE block, its router and token
dispatcher, the naive experts (the reference loop) and one training step. It must stay short
enough to read in one sitting, spread over few files, and be findable from the package's
docstring, which is where `help(moe_tutorial)` starts."""

import importlib
import inspect
from pathlib import Path

import moe_tutorial

# (module, object) in reading order.
READING_PATH = [
    ("moe_tutorial.moe.model", "MoEBlock"),
    ("moe_tutorial.moe.model", "LocalDispatcher"),
    ("moe_tutorial.moe.model", "Router"),
    ("moe_tutorial.moe.model", "route"),
    ("moe_tutorial.moe.experts.naive", "NaiveExperts"),
    ("moe_tutorial.train.loop", "train_step"),
]
REFERENCE_LOOP = ("moe_tutorial.moe.experts.naive", "NaiveExperts")
MAX_LINES, MAX_FILES = 400, 3


def _objects():
    return [getattr(importlib.import_module(module), name) for module, name in READING_PATH]


def _files() -> set[str]:
    root = Path(moe_tutorial.__file__).parent
    return {str(Path(inspect.getsourcefile(o)).relative_to(root)) for o in _objects()}


def test_the_reading_path_is_at_most_400_lines():
    lines = {name: len(inspect.getsource(o).splitlines())
             for (_, name), o in zip(READING_PATH, _objects())}
    assert sum(lines.values()) <= MAX_LINES, f"{sum(lines.values())} lines: {lines}"


def test_the_reading_path_spans_at_most_3_files():
    files = _files()
    assert len(files) <= MAX_FILES, f"{len(files)} files: {sorted(files)}"


def test_the_package_docstring_names_the_reading_path():
    doc = moe_tutorial.__doc__
    missing = [f"{module.removeprefix('moe_tutorial.')}.{name}" for module, name in READING_PATH
               if f"{module.removeprefix('moe_tutorial.')}.{name}" not in doc]
    assert not missing, f"moe_tutorial's docstring does not name {missing}"
    module, name = REFERENCE_LOOP
    assert f"`{module.removeprefix('moe_tutorial.')}.{name}` (the reference loop" in doc
