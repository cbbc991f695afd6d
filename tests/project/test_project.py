"""The project around the package: environment.yml, pyproject extras, CI entry, notebooks."""

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tools import notebook_outputs

ROOT = Path(__file__).resolve().parents[2]


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_environment_yml_is_a_python_the_make_commands_install_into():
    """conda's environment holds Python and pip only: the `make` commands install torch (the CPU
    build without an NVIDIA GPU) and the course into the active environment, as into a venv."""
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    deps = env["dependencies"]
    assert deps == ["python=3.11", "pip"]  # the oldest Python cpu-lock.txt was resolved for
    assert _pyproject()["project"]["requires-python"] == ">=3.11"


def test_pyproject_extras():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert set(extras) >= {"hf", "course", "test"}
    assert "gpu" not in extras  # TE comes from `make gpu` alone (tools/bootstrap.py --gpu)
    names = {k: {re.split(r"[<>=\[ ]", d)[0] for d in v} for k, v in extras.items()}
    assert names["course"] >= {"jupyterlab", "ipykernel", "ipywidgets", "anywidget", "plotly",
                               "papermill", "tqdm"}
    assert names["test"] >= {"pytest", "nbval", "papermill", "nbformat"}
    assert any(d.startswith("transformers>=5") for d in extras["hf"])


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "pip install" not in ci  # everything is set up by the README's commands themselves
    assert "make test" in ci and "make course" in ci
    assert "make test" in readme and "make course" in readme
    start = readme.index("## Start")  # the commands come first, right after the introduction
    assert start == readme.index("## ")
    assert readme.index("make course", start) < readme.index("## ", start + 1)


def test_shipped_data_is_packaged_with_its_notice():
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]["moe_tutorial"]
    assert "assets/*.fa.gz" in package_data and "assets/NOTICE" in package_data
    assert (ROOT / "NOTICE").read_text() == (ROOT / "moe_tutorial/assets/NOTICE").read_text()
    assert "CC BY 4.0" in (ROOT / "README.md").read_text()


def test_notebooks_in_git_have_no_outputs():
    tracked = subprocess.run(["git", "ls-files", "*.ipynb"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    dirty = notebook_outputs.with_outputs(ROOT / path for path in tracked)
    assert not dirty, f"commit these notebooks without outputs: {dirty}"


def test_notebooks_use_the_shared_helpers_instead_of_their_own():
    """`moe_tutorial.course.lesson` holds what the notebooks share; none defines a copy of it."""
    import inspect

    from moe_tutorial.course import lesson

    shared = [name for name, obj in vars(lesson).items()
              if inspect.isfunction(obj) and obj.__module__ == lesson.__name__]
    copies = []
    for path in sorted(ROOT.glob("notebooks/*.ipynb")) + sorted(ROOT.glob("solutions/*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"]) if cell["cell_type"] == "code" else ""
            copies += [f"{path.name}: {name}" for name in shared
                       if re.search(rf"^def {name}\(", source, re.M)]
    assert shared and not copies, copies


def test_rel_error_is_the_frobenius_ratio():
    import torch

    from moe_tutorial.precision.quant import rel_error

    want = torch.tensor([3.0, 4.0])
    assert rel_error(want + torch.tensor([0.3, 0.4]), want) == pytest.approx(0.1)
    assert rel_error(torch.zeros(2), torch.zeros(2)) == 0.0
