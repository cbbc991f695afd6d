"""The course notebooks: their structure, and every one of them run top to bottom under nbval in
small mode (`pytest --nbval-lax --nbval-current-env notebooks/NN_*.ipynb`), as CI does.

nbval runs in a child pytest so that its kernels get a known environment: MOE_TUTORIAL_MODE=small
(whatever the machine; the notebooks' `parameters` cells read it), no $JPY_SESSION_NAME (a headless
run: the dashboards draw once, at the end), and this checkout first on PYTHONPATH. By hand:

    MOE_TUTORIAL_MODE=small python -m pytest --nbval-lax --nbval-current-env notebooks/
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
ENV_PARAMETERS = ("MOE_TUTORIAL_MODE", "MOE_TUTORIAL_DEVICE", "MOE_TUTORIAL_LIVE")


def _cells(path):
    return json.loads(path.read_text())["cells"]


def _tagged(path, tag):
    return [c for c in _cells(path) if tag in c.get("metadata", {}).get("tags", [])]


def test_the_course_has_notebooks():
    assert [p.stem for p in NOTEBOOKS][:3] == ["00_setup", "01_naive_moe", "02_grouped_linear"]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_structure(notebook):
    """One `parameters` cell whose defaults come from the environment, a `closing` cell (the
    runner's report shows it), no outputs in git, and nothing that raises on purpose."""
    params = _tagged(notebook, "parameters")
    assert len(params) == 1, "exactly one cell tagged 'parameters' (papermill injects after it)"
    source = "".join(params[0]["source"])
    for name in ENV_PARAMETERS:
        assert name in source, f"the parameters cell should read ${name}"
    for name in ("MODE", "DEVICE", "LIVE"):
        assert f"\n{name} = " in f"\n{source}", f"the parameters cell should define {name}"
    closing = _tagged(notebook, "closing")
    assert closing and all(c["cell_type"] == "code" for c in closing)
    assert not _tagged(notebook, "raises-exception"), "papermill fails on any error output"
    for cell in _cells(notebook):
        assert not cell.get("outputs") and not cell.get("execution_count"), "commit without outputs"


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_under_nbval_in_small_mode(notebook):
    pytest.importorskip("nbval")
    env = {**os.environ, "MOE_TUTORIAL_MODE": "small",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("JPY_SESSION_NAME", None)  # headless, even when pytest is started from a notebook
    env.pop("MOE_TUTORIAL_DEVICE", None)
    cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider",
           "--nbval-cell-timeout=300", "-q", str(notebook.relative_to(ROOT))]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (
        f"{notebook.name} failed under nbval ({' '.join(cmd[2:])}):\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}")
    assert " passed" in result.stdout and "failed" not in result.stdout.splitlines()[-1]
