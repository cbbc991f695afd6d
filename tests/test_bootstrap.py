"""The README's commands set themselves up from the system's python3 (moe_tutorial/bootstrap.py)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from moe_tutorial import bootstrap

ROOT = Path(__file__).resolve().parents[1]


def test_bootstrap_needs_only_the_standard_library():
    tree = ast.parse((ROOT / "moe_tutorial" / "bootstrap.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported
    # and it starts with site-packages switched off (-S): nothing installed is needed to run it
    out = subprocess.run([sys.executable, "-S", "-m", "moe_tutorial.bootstrap", "--help"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "--extras" in out.stdout, out.stderr


def test_cpu_machines_get_the_cpu_build_of_torch():
    python = Path("/env/bin/python")
    first, fallback = bootstrap.torch_install_commands(python, gpu=False)
    assert first[-3:] == ["--index-url", bootstrap.CPU_TORCH_INDEX, bootstrap.CPU_TORCH]
    assert fallback[-1] == bootstrap.CPU_TORCH and "--index-url" not in fallback
    (gpu,) = bootstrap.torch_install_commands(python, gpu=True)
    assert gpu[-1] == "torch"


@pytest.mark.parametrize("variables, expected", [
    ({"VIRTUAL_ENV": "/work/venv"}, Path("/work/venv")),
    ({"CONDA_PREFIX": "/opt/conda/envs/moe"}, Path("/opt/conda/envs/moe")),
    ({}, None),
])
def test_the_active_environment_is_used_else_none(monkeypatch, variables, expected):
    for name in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert bootstrap.active_environment() == expected


def test_without_an_active_environment_it_creates_the_repo_venv_and_installs_torch_first(
        monkeypatch, tmp_path):
    for name in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(bootstrap, "VENV", tmp_path / ".venv")
    created, ran = [], []
    monkeypatch.setattr(bootstrap, "create_venv", created.append)
    monkeypatch.setattr(bootstrap, "_imports", lambda python, module: False)
    monkeypatch.setattr(bootstrap, "has_nvidia_gpu", lambda: False)

    def run(command, check=True):  # the CPU wheel index is unreachable here: the fallback runs
        ran.append(command)
        return 1 if bootstrap.CPU_TORCH_INDEX in command else 0

    monkeypatch.setattr(bootstrap, "_run", run)
    python = bootstrap.ensure_environment("test")
    assert created == [tmp_path / ".venv"] and python == tmp_path / ".venv" / "bin" / "python"
    assert [c[-1] for c in ran] == [bootstrap.CPU_TORCH, bootstrap.CPU_TORCH, f"{ROOT}[test]"]
    assert ran[-1][-2:] == ["-e", f"{ROOT}[test]"]
