"""What GPU users start from: `info` says when Transformer Engine is not the release the course
was checked with, and the Dockerfile's course steps work (run here in a fresh venv)."""

import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest
from checkout_copy import ROOT, copy_tracked_files

from moe_tutorial.cli import main
from moe_tutorial.precision import hardware


@pytest.mark.parametrize("te_version, cuda, expected", [
    ("2.20.2", True, None),
    ("2.20.0+6f3a2c1", False, None),
    ("2.19.0", True, "Transformer Engine 2.19.0 is installed; the course was checked with 2.20.x"),
    ("2.2.0", False, "Transformer Engine 2.2.0 is installed; the course was checked with 2.20.x"),
    (None, True, "`make gpu` installs TE 2.20"),
    (None, False, None),  # a CPU machine: the stand-ins are the course's plan there
])
def test_info_warns_when_te_is_not_the_checked_release(monkeypatch, capsys, te_version, cuda,
                                                       expected):
    real = hardware.capabilities

    def faked(import_te=True):
        caps = real(import_te=False)
        gpu = dict(cuda_available=True, gpu_name="NVIDIA H200", compute_capability=(9, 0),
                   gpu_count=1, cuda_version="13.0") if cuda else {}
        return replace(caps, env=replace(caps.env, te_version=te_version, **gpu))

    monkeypatch.setattr(hardware, "capabilities", faked)
    assert main(["info"]) == 0
    err = capsys.readouterr().err
    assert (expected in err) if expected else err == "", err


def dockerfile_course_steps() -> tuple[list[str], list[str]]:
    """The Dockerfile's RUN steps that set up the course, and its CMD."""
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", "").splitlines()
    runs = [line.removeprefix("RUN ") for line in lines if line.startswith("RUN ")]
    command = json.loads(next(line for line in lines if line.startswith("CMD ")).removeprefix("CMD "))
    return [run for run in runs if "tools.bootstrap" in run], command


@pytest.mark.slow
def test_the_dockerfiles_course_steps_keep_the_torch_a_python_already_has(tmp_path):
    """The image's steps, run here: a base Python on the PATH as `python3` whose packages
    (torch among them) come from $PYTHONPATH plays the container's, and a copy of this checkout
    plays the image's /workspace/moe-tutorial."""
    steps, command = dockerfile_course_steps()
    assert steps and command[:3] == ["python3", "-m", "tools.bootstrap"]
    repo = copy_tracked_files(tmp_path / "image")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys._base_executable)
    # the container's packages: this environment's (torch among them), less the course itself
    system_packages = tmp_path / "site-packages"
    system_packages.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("moe_tutorial", "__editable__")):
            (system_packages / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=str(system_packages))
    for step in steps:
        done = subprocess.run(step, shell=True, cwd=repo, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "--system-site-packages" in done.stdout
    venv_python = repo / ".venv" / "bin" / "python"
    where = subprocess.run([str(venv_python), "-c", "import torch, moe_tutorial; "
                            "print(torch.__file__); print(moe_tutorial.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True,
                           check=True).stdout.split()
    assert where[0].startswith(str(system_packages))  # the Python's own torch, not a new one
    assert where[1] == str(repo / "moe_tutorial" / "__init__.py")
    assert not list((repo / ".venv").rglob("torch/__init__.py"))
    stamp = json.loads((repo / ".venv" / "moe_tutorial-install.json").read_text())
    assert set(stamp["extras"]) == {"course", "hf"}
    # the image's command: Lab through the same code path, asked only for its version
    started = subprocess.run([*command, "--version"], cwd=repo, env=env, capture_output=True,
                             text=True, timeout=300)
    assert started.returncode == 0, started.stderr[-2000:]
    assert started.stdout.strip().splitlines()[-1][0].isdigit()  # JupyterLab's version
    assert "+ " not in started.stdout  # no install: the stamp says the course is there
