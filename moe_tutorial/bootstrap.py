"""Set up an environment for the course's commands, then run one: what `make course`,
`make test` and `make lab` call, with only the system's `python3` (standard library only here:
nothing of the course is installed yet when this runs).

    python3 -m moe_tutorial.bootstrap --extras test -- -m pytest

1. Which Python: the active virtual or conda environment if there is one; otherwise `.venv` in
   the repository, created on first use (uv when it is installed, else `python3 -m venv`). A
   Debian/Ubuntu system Python is "externally managed" and refuses `pip install`; a venv is not.
2. torch first, if the environment lacks it: on a machine without an NVIDIA GPU the CPU build
   (PyTorch's CPU wheel index; where that index cannot be reached, the pinned version from the
   configured index), so pip never pulls the multi-GB CUDA build there. With a GPU, PyPI's build.
3. The course itself, editable, with the extras the command needs (`pip install -e .[extras]`).
4. The command, run with that environment's Python (its exit code is this one's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
# The CPU build CI and the course's CPU machines run; GPU machines take PyPI's (CUDA) torch.
CPU_TORCH = "torch==2.13.0"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def active_environment() -> Path | None:
    """The prefix of the active virtual or conda environment, or None (the system Python)."""
    for variable in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        if os.environ.get(variable):
            return Path(os.environ[variable])
    return None


def environment_python(prefix: Path) -> Path:
    return prefix / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def has_nvidia_gpu() -> bool:
    """An NVIDIA driver is present (the CUDA build of torch could use it)."""
    return Path("/proc/driver/nvidia/gpus").is_dir() or shutil.which("nvidia-smi") is not None


def create_venv(path: Path, base_python: str = sys.executable) -> None:
    """A fresh virtual environment with pip in it (uv's venvs have no pip unless asked)."""
    uv = shutil.which("uv")
    if uv:
        _run([uv, "venv", "--seed", "--python", base_python, str(path)])
    else:
        _run([base_python, "-m", "venv", str(path)])


def torch_install_commands(python: Path, gpu: bool) -> list[list[str]]:
    """The pip commands to try, in order, until one succeeds."""
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    if gpu:
        return [pip + ["torch"]]
    return [pip + ["--retries", "0", "--timeout", "10", "--index-url", CPU_TORCH_INDEX, CPU_TORCH],
            pip + [CPU_TORCH]]


def _run(command: list[str], check: bool = True) -> int:
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, check=check).returncode


def _imports(python: Path, module: str) -> bool:
    return subprocess.run([str(python), "-c", f"import {module}"],
                          capture_output=True).returncode == 0


def ensure_environment(extras: str) -> Path:
    """Steps 1-3 of the module doc; returns the Python to run the command with."""
    prefix = active_environment()
    if prefix is None:
        prefix = VENV
        if not environment_python(prefix).exists():
            print(f"no virtual environment is active: creating {prefix}", flush=True)
            create_venv(prefix)
    python = environment_python(prefix)
    if not _imports(python, "torch"):
        commands = torch_install_commands(python, has_nvidia_gpu())
        for i, command in enumerate(commands):
            if _run(command, check=i == len(commands) - 1) == 0:
                break
            print("(that index is not reachable from here; trying the next)", flush=True)
    target = f"{ROOT}[{extras}]" if extras else str(ROOT)
    _run([str(python), "-m", "pip", "install", "--quiet", "-e", target])
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m moe_tutorial.bootstrap",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--extras", default="", help="the package's extras, e.g. 'course,hf'")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after '--': arguments for the environment's python")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if sys.version_info < (3, 11):
        parser.error(f"Python {sys.version.split()[0]} is too old: the course needs 3.11 or newer")
    python = ensure_environment(args.extras)
    if not command:
        print(f"ready: {python}")
        return 0
    os.chdir(ROOT)
    return subprocess.run([str(python), *command]).returncode


if __name__ == "__main__":
    sys.exit(main())
