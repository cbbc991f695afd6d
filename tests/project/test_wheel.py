"""The package as a learner installs it: a wheel built from the repository, installed into a fresh
virtual environment outside it, runs `info`, `train` on the tiny preset and `analyze` on a shipped
config, importing the installed copy (not the checkout) from a folder outside the checkout."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What pyproject.toml builds the wheel from (the package, its readme and license files).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "NOTICE", "moe_tutorial")

pytestmark = pytest.mark.slow


def _run(argv, *, cwd, env, timeout=300) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (f"{' '.join(map(str, argv))} exited {done.returncode}:\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def _dependencies_dir() -> Path:
    """The folder torch and tqdm are installed in (the test's environment), which the fresh
    environment sees as a plain path: its .pth files, among them an editable install of the
    checkout, are not run."""
    folders = {Path(importlib.util.find_spec(name).origin).parents[1] for name in ("torch", "tqdm")}
    assert len(folders) == 1, f"torch and tqdm are installed in different folders: {folders}"
    (folder,) = folders
    assert not (folder / "moe_tutorial").exists(), f"{folder} holds a moe_tutorial of its own"
    return folder


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, site-packages, a working folder outside the checkout) of a fresh virtual
    environment with the wheel installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy: an in-tree build leaves build/ and *.egg-info in the checkout.
    source = tmp / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", str(tmp / "dist"), str(source)], cwd=tmp, env=env)
    (wheel,) = (tmp / "dist").glob("moe_tutorial-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp, env=env)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "-q", str(wheel)], cwd=tmp, env=env)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=tmp, env=env).stdout.strip())
    assert site.is_relative_to(venv) and site.name == Path(sysconfig.get_path("purelib")).name
    (site / "dependencies.pth").write_text(f"{_dependencies_dir()}\n")
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    return python, site, elsewhere, env


def test_the_wheel_imports_the_installed_package_from_outside_the_checkout(installed):
    python, site, elsewhere, env = installed
    probe = ("import sys, moe_tutorial, moe_tutorial.moe.model as m; "
             "print(moe_tutorial.__file__); print(m.__file__); print(*sys.path, sep='\\n')")
    first, second, *path = _run([str(python), "-c", probe], cwd=elsewhere,
                                env=env).stdout.splitlines()
    assert Path(first).is_relative_to(site) and Path(second).is_relative_to(site)
    # The dependencies' folder may lie in the checkout (make's .venv): what must not be on the
    # path is the checkout's own source, the folder holding its moe_tutorial/
    dependencies = _dependencies_dir().resolve()
    inside = [p for p in path if p and Path(p).resolve().is_relative_to(ROOT)
              and Path(p).resolve() != dependencies]
    assert not inside, f"the checkout is on the installed environment's sys.path: {inside}"
    assert not elsewhere.resolve().is_relative_to(ROOT)
    shipped = sorted(p.name for p in (site / "moe_tutorial" / "configs").glob("*.json"))
    assert shipped == sorted(p.name for p in (ROOT / "moe_tutorial" / "configs").glob("*.json"))


def test_the_wheel_runs_info_train_and_analyze(installed):
    python, site, elsewhere, env = installed
    cli = [str(python), "-m", "moe_tutorial"]

    info = json.loads(_run([*cli, "info", "--json"], cwd=elsewhere, env=env).stdout)
    assert info["environment"]["torch_version"] and info["features"]

    # One step, a large batch: the run's cost is its passes over all validation windows (before,
    # after the step, at the end), which a large batch makes in few calls.
    _run([*cli, "train", "--preset", "tiny", "--steps", "1", "--batch-size", "512", "--device",
          "cpu", "--json", "train.json"], cwd=elsewhere, env=env)
    run = json.loads((elsewhere / "train.json").read_text())
    assert run["preset"] == "tiny" and [r["step"] for r in run["history"]] == [1]
    assert 0 < run["val_loss_final"] < float("inf")

    _run([*cli, "analyze", "qwen3-moe-30b-a3b", "--json", "analyze.json"], cwd=elsewhere, env=env)
    report = json.loads((elsewhere / "analyze.json").read_text())
    assert report["model"]["name"].startswith("qwen3-moe-30b-a3b")
    assert Path(report["model"]["source"]).is_relative_to(site), "the wheel's own configs/"
    # Outside a clone there are no committed results: the report says so, in one line.
    assert "no clone of the course's repository" in report["recommendation"]["sweep"]["verdicts_from"]
