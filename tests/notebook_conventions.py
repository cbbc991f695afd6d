"""What every notebook of the course must satisfy, and how the tests run one under nbval: shared
by tests/integration/test_notebooks.py (the walkthrough) and tests/notebooks/test_exercise_notebooks.py (the exercises).

nbval runs in a child pytest so that its kernels get a known environment: MOE_TUTORIAL_MODE=small
(whatever the machine; the notebooks' `parameters` cells read it), no $JPY_SESSION_NAME (a headless
run: the dashboards draw once, at the end), no $MOE_TUTORIAL_DEVICE, and this checkout first on
PYTHONPATH."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV_PARAMETERS = ("MOE_TUTORIAL_MODE", "MOE_TUTORIAL_DEVICE", "MOE_TUTORIAL_LIVE")


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def tagged(path: Path, tag: str) -> list[dict]:
    return [c for c in cells(path) if tag in c.get("metadata", {}).get("tags", [])]


# Chapters whose `%%needs_gpu` cells the committed GPU run does not hold yet, each with why: the
# tests that demand a committed output (and no cell that did not run) accept only these.
GPU_RECORD_PENDING: dict[str, str] = {}
NOT_RUN = r"not (run|trained|compared) here|did not run"

MAX_PARAMETER_LINES = 4  # the environment is read by lesson.setup, not by the cell


def parameter_lines(source: str) -> int:
    """A parameters cell's lines a reader reads: not blank, not a comment."""
    return sum(1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#"))


def assert_parameters_and_no_outputs(notebook: Path) -> None:
    """One `parameters` cell of at most `MAX_PARAMETER_LINES` lines that defines MODE, DEVICE
    and LIVE (empty: `lesson.setup` reads the environment); nothing that raises on purpose; no
    outputs in git."""
    import ast

    params = tagged(notebook, "parameters")
    assert len(params) == 1, "exactly one cell tagged 'parameters' (papermill injects after it)"
    source = "".join(params[0]["source"])
    assigned = {node.id for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    for name in ("MODE", "DEVICE", "LIVE"):
        assert name in assigned, f"the parameters cell should define {name}"
    assert parameter_lines(source) <= MAX_PARAMETER_LINES, (
        f"the parameters cell has {parameter_lines(source)} lines (at most {MAX_PARAMETER_LINES}): "
        f"leave the environment to lesson.setup and the sizes' defaults to its DEFAULTS")
    assert not tagged(notebook, "raises-exception"), "papermill fails on any error output"
    for cell in cells(notebook):
        assert not cell.get("outputs") and not cell.get("execution_count"), "commit without outputs"


def assert_runs_under_nbval(target: str, *, cell_timeout: int, timeout: int) -> None:
    """`pytest --nbval-lax --nbval-current-env target` (a notebook or a folder, relative to the
    checkout) in small mode passes."""
    pytest.importorskip("nbval")
    env = {**os.environ, "MOE_TUTORIAL_MODE": "small",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("JPY_SESSION_NAME", None)  # headless, even when pytest is started from a notebook
    env.pop("MOE_TUTORIAL_DEVICE", None)
    cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider",
           f"--nbval-cell-timeout={cell_timeout}", "-q", target]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    # The first failing cell's own error first: the later cells' failures often only follow from it.
    first = result.stdout.find("Cell execution caused an exception")
    first_failure = result.stdout[max(0, first - 300):first + 6000] if first >= 0 else ""
    assert result.returncode == 0, (f"{target} failed under nbval ({' '.join(cmd[2:])}):\n"
                                    f"{first_failure}\n...\n{result.stdout[-3000:]}\n"
                                    f"{result.stderr[-2000:]}")
    assert " passed" in result.stdout and "failed" not in result.stdout.splitlines()[-1]


# CI runs `make course` before the tests and names its run here: the chapters then run once, and
# their tests check that execution (assert_executed_in_small_mode) instead of running them again.
EXECUTED_RUN_ENV = "MOE_TUTORIAL_EXECUTED_RUN"


def assert_executed_in_small_mode(notebook: Path, run_dir: Path) -> None:
    """The copy of `notebook` that `make course` executed into `run_dir` ran this very source top
    to bottom in small mode without an error: what `assert_runs_under_nbval` checks by running it."""
    executed = run_dir / notebook.name
    assert executed.is_file(), (f"{executed} is missing: the course run in {run_dir} did not "
                                f"execute {notebook.name} (it stops at the first failing notebook)")
    ran = [c for c in cells(executed) if c["cell_type"] == "code"]
    injected = [c for c in ran if "injected-parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(injected) == 1 and re.search(r"^MODE = [\"']small[\"']$", source(injected[0]), re.M), \
        f"{executed} was not run in small mode"
    ran = [c for c in ran if c not in injected]
    assert [source(c) for c in ran] == [source(c) for c in cells(notebook) if c["cell_type"] == "code"], \
        f"{executed} was run from another version of {notebook.name}; run the course again"
    counts = [c.get("execution_count") for c in ran if source(c).strip()]
    assert None not in counts and counts == sorted(counts), f"{executed}: not every cell ran, in order"
    errors = [o for c in ran for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{executed}: {errors[0].get('ename')}: {errors[0].get('evalue')}"


IMAGE = re.compile(r"!\[(?P<alt>(?:[^\[\]]|\[[^\[\]]*\])*)\]\((?P<path>[^)\s]+)\)")  # alt text may hold [i] (balanced, as CommonMark allows)


def source(cell: dict) -> str:
    return "".join(cell["source"])


def figures_shown(notebook: Path) -> list[tuple[str, str]]:
    """(alt text, path) of every markdown image of the notebook."""
    return [(m["alt"], m["path"]) for c in cells(notebook) if c["cell_type"] == "markdown"
            for m in IMAGE.finditer(source(c))]


def assert_teaching_conventions(notebook: Path) -> None:
    """A chapter teaches the same way everywhere: exactly one code cell tagged `recap` (its step
    in a few lines of plain PyTorch/TE), at least one `predict` cell that a measurement later
    grades, a link to its exercise, and figures that exist and say in words what they show."""
    recap = tagged(notebook, "recap")
    assert len(recap) == 1 and recap[0]["cell_type"] == "code", "exactly one code cell tagged 'recap'"
    # The step's own lines: imports, comments and blank lines do not count
    lines = [line for line in source(recap[0]).splitlines() if line.strip()
             and not line.lstrip().startswith(("#", "import ", "from "))]
    assert 5 <= len(lines) <= 15, f"the recap is {len(lines)} lines of code (imports aside); keep it 5-15"
    predicts = tagged(notebook, "predict")
    assert predicts and all("widgets.predict(" in source(c) for c in predicts), \
        "at least one code cell tagged 'predict' that calls widgets.predict("
    after = cells(notebook)[cells(notebook).index(predicts[0]) + 1:]
    assert any(".grade(" in source(c) for c in after), "a measurement after the prediction grades it"
    for alt, path in figures_shown(notebook):
        assert len(alt.split()) >= 6, f"{path}: the alt text should say what the figure shows"
        assert (notebook.parent / path).is_file(), f"{notebook.name} shows {path}, which is missing"
