"""Set up an environment for the course's commands, then run one: what `make course`,
`make test` and `make lab` call, with only the system's `python3` (standard library only here:
nothing of the course is installed yet when this runs).

    python3 -m tools.bootstrap --extras test -- -m pytest

1. Which Python: the active virtual or conda environment if there is one; else `.venv` in the
   repository, created on first use (`python3 -m venv`, or uv where the system lacks the venv
   module). When the system's Python already has torch, as in NVIDIA's NGC PyTorch container,
   `.venv` sees its packages (`--system-site-packages`): that torch and its Transformer Engine
   are used as they are. A Debian/Ubuntu system Python is "externally managed" and refuses
   `pip install`; nothing is ever installed into it.
2. Nothing more when the environment already holds the course at this `pyproject.toml` (and
   lock file), with the extras asked for: a stamp written after the last install says so, and
   the command runs without the network.
3. torch, only if the environment lacks it: on a machine without an NVIDIA GPU the CPU build
   (PyTorch's CPU wheel index; where that index cannot be reached, the pinned version from the
   configured index), so pip never pulls the multi-GB CUDA build there; with a GPU, the CUDA
   build the course was checked with. A torch already there is never replaced: the install
   below is constrained to its exact version.
4. The course itself, editable, with the extras the command needs (`pip install -e .[extras]`),
   on a CPU machine constrained to `cpu-lock.txt` (what CI installs).
5. The command, run with that environment's Python (its exit code is this one's). Before it, on
   a machine with an NVIDIA GPU and no Transformer Engine, one line says how to get it.

`--gpu` installs Transformer Engine instead (see docs/gpu.md): the CUDA torch if none is there,
TE's build tools, then `transformer_engine[pytorch]` built against that torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
# The CPU build CI and the course's CPU machines run (the lock file pins the same version).
CPU_TORCH = "torch==2.13.0"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# The CUDA build the course's GPU runs were checked with (benchmarks/results/*.json name it).
GPU_TORCH = "torch==2.11.0"
GPU_TORCH_INDEX = "https://download.pytorch.org/whl/cu130"
# The Transformer Engine release the course was checked with.
TE_SERIES = "2.20"
# TE's PyTorch extension is a source distribution built against the installed torch, so pip
# must not build it in an isolated environment (which would fetch another torch); what its
# build imports must then be installed first.
TE_BUILD_TOOLS = ["setuptools", "wheel", "ninja", "pybind11", "packaging"]
LOCK = ROOT / "cpu-lock.txt"
STAMP = "moe_tutorial-install.json"  # in the environment's prefix


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


def _uv() -> str | None:
    return shutil.which("uv")


def create_venv(path: Path, base_python: str, system_site_packages: bool) -> None:
    """A fresh virtual environment with pip in it: `python -m venv`, or uv (with pip seeded)
    where the venv module is missing (Debian without python3-venv)."""
    inherit = ["--system-site-packages"] if system_site_packages else []
    if _run([base_python, "-m", "venv", *inherit, str(path)], check=False) == 0:
        return
    uv = _uv()
    if uv is None:
        raise SystemExit(f"error: {base_python} cannot create a virtual environment (on "
                         f"Debian/Ubuntu: `sudo apt install python3-venv`, or install uv), or "
                         f"activate one of yours and run the command again")
    shutil.rmtree(path, ignore_errors=True)  # what the failed attempt left
    _run([uv, "venv", "--seed", *inherit, "--python", base_python, str(path)])


def torch_install_commands(python: Path, gpu: bool) -> list[list[str]]:
    """The pip commands to try, in order, until one succeeds."""
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    if gpu:
        return [pip + ["--index-url", GPU_TORCH_INDEX, GPU_TORCH]]
    return [pip + ["--retries", "0", "--timeout", "10", "--index-url", CPU_TORCH_INDEX, CPU_TORCH],
            pip + [CPU_TORCH]]


def _run(command: list[str], check: bool = True, env: dict | None = None) -> int:
    print("+", " ".join(command), flush=True)
    returncode = subprocess.run(command, env=env).returncode
    if check and returncode != 0:
        raise SystemExit(f"error: that command failed (exit status {returncode}); see its "
                         f"output above")
    return returncode


def _ask(python: Path, code: str) -> str | None:
    """What `code` prints in `python`, or None where it fails (e.g. a module is missing)."""
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def torch_version(python: Path) -> str | None:
    return _ask(python, "import torch; print(torch.__version__)")


def te_version(python: Path) -> str | None:
    """Transformer Engine's installed version, read from its metadata (nothing imported)."""
    return _ask(python, "import importlib.metadata as m, importlib.util as u\n"
                        "assert u.find_spec('transformer_engine')\n"
                        "for d in ('transformer_engine', 'transformer-engine'):\n"
                        "    try: print(m.version(d)); break\n"
                        "    except m.PackageNotFoundError: pass\n"
                        "else: print('unknown')")


def configured_constraints(python: Path) -> list[str]:
    """Constraint files pip is configured with (e.g. /etc/pip/constraint.txt in NGC containers):
    a `-c` on the command line replaces them, so they are passed again alongside ours."""
    files = os.environ.get("PIP_CONSTRAINT", "").split()
    out = subprocess.run([str(python), "-m", "pip", "config", "list"], capture_output=True,
                         text=True)
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".constraint"):
            files += value.strip().strip("'\"").split()
    return list(dict.fromkeys(files))


def stamp_of(extras: set[str], lock: bool) -> dict:
    """What an install of the course depends on: its pyproject.toml (and the lock file, when the
    install used it), the checkout, the extras."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    if lock:
        digest.update(LOCK.read_bytes())
    return {"root": str(ROOT), "inputs_sha256": digest.hexdigest(), "extras": sorted(extras),
            "lock": lock}


def read_stamp(prefix: Path) -> dict | None:
    try:
        return json.loads((prefix / STAMP).read_text())
    except (OSError, ValueError):
        return None


def installed_extras(prefix: Path) -> set[str] | None:
    """The extras the environment holds the course with at the current inputs, or None when it
    must be installed (again): no stamp, another checkout, or a changed pyproject.toml/lock."""
    stamp = read_stamp(prefix)
    if not stamp:
        return None
    current = stamp_of(set(stamp.get("extras", [])), bool(stamp.get("lock")))
    if {k: stamp.get(k) for k in current} != current:
        return None
    return set(current["extras"])


def _lock_torch() -> str:
    """The torch version the lock file pins (its public part: 2.13.0 for 2.13.0+cpu)."""
    for line in LOCK.read_text().splitlines():
        if line.startswith("torch=="):
            return line.split("==")[1].split("+")[0].split(";")[0].strip()
    raise SystemExit(f"error: {LOCK} pins no torch; regenerate it with `make lock`")


def _pin_torch(python: Path, version: str) -> Path:
    """A constraints file that holds torch at `version`: pip may not replace the torch an
    environment has (an NGC container's, built with its Transformer Engine)."""
    pin = python.parent.parent / "moe_tutorial-torch-pin.txt"
    pin.write_text(f"torch=={version}\n")
    return pin


def install_course(python: Path, extras: set[str], gpu: bool) -> bool:
    """`pip install -e .[extras]`, never replacing the torch there; returns whether the lock
    file constrained it (a CPU machine whose torch is the lock's)."""
    torch = torch_version(python)
    if torch is None:
        for i, command in enumerate(commands := torch_install_commands(python, gpu)):
            if _run(command, check=i == len(commands) - 1) == 0:
                break
            print("(that index is not reachable from here; trying the next)", flush=True)
        torch = torch_version(python)
        if torch is None:
            raise SystemExit(f"error: torch was installed but does not import in {python}")
    use_lock = not gpu and LOCK.exists() and torch.split("+")[0] == _lock_torch()
    constraints = [*configured_constraints(python), str(_pin_torch(python, torch))]
    if use_lock:
        constraints.append(str(LOCK))
    target = f"{ROOT}[{','.join(sorted(extras))}]" if extras else str(ROOT)
    command = [str(python), "-m", "pip", "install", "--quiet", "-e", target]
    for path in constraints:
        command += ["-c", path]
    _run(command)
    return use_lock


def ensure_environment(extras: set[str], base_python: str = sys.executable) -> Path:
    """Steps 1-4 of the module doc; returns the Python to run the command with."""
    prefix = active_environment()
    if prefix is None:
        prefix = VENV
        if not environment_python(prefix).exists():
            system_torch = torch_version(Path(base_python))
            if system_torch:
                print(f"{base_python} has torch {system_torch} already: creating {prefix} with "
                      f"its packages (--system-site-packages); that torch is used, never "
                      f"reinstalled", flush=True)
            else:
                print(f"no virtual environment is active: creating {prefix}", flush=True)
            create_venv(prefix, base_python, system_site_packages=system_torch is not None)
    python = environment_python(prefix)
    if not python.exists():
        raise SystemExit(f"error: the active environment {prefix} has no {python}; activate "
                         f"another one, or deactivate it to use {VENV}")
    installed = installed_extras(prefix)
    if installed is not None and extras <= installed:
        return python  # the course is there at these inputs: no install, no network
    extras = extras | (installed or set())
    lock = install_course(python, extras, has_nvidia_gpu())
    (prefix / STAMP).write_text(json.dumps(stamp_of(extras, lock), indent=1) + "\n")
    return python


def te_advice(python: Path) -> str | None:
    """On a machine with an NVIDIA GPU: one line on Transformer Engine when it is missing or is
    not the release the course was checked with; None otherwise."""
    if not has_nvidia_gpu():
        return None
    version = te_version(python)
    if version is None:
        return (f"Transformer Engine is not installed in {python}: the TE chapters will run "
                f"their pure-PyTorch stand-ins. To install TE {TE_SERIES} (a few minutes; needs "
                f"the CUDA toolkit's nvcc): `make gpu`, or use the Dockerfile (docs/gpu.md)")
    if not version.startswith(TE_SERIES + "."):
        return (f"Transformer Engine {version} is installed; the course was checked with "
                f"{TE_SERIES}.x (docs/gpu.md)")
    return None


def install_te(python: Path) -> None:
    """`--gpu`, after `ensure_environment` (which installed the CUDA torch if the environment
    had none): TE's build tools, then TE built against that torch."""
    cuda = _ask(python, "import torch; print(torch.version.cuda or '')")
    if not cuda:
        raise SystemExit(f"error: the torch in {python} is a CPU build ({torch_version(python)}); "
                         f"Transformer Engine needs a CUDA build (docs/gpu.md)")
    if te_version(python):
        print(f"Transformer Engine {te_version(python)} is already installed in {python}")
        return
    pin = _pin_torch(python, torch_version(python))
    constraints = [arg for path in [*configured_constraints(python), str(pin)]
                   for arg in ("-c", path)]
    pip = [str(python), "-m", "pip", "install"]
    _run(pip + ["--quiet", *TE_BUILD_TOOLS, *constraints])
    env = {**os.environ, "NVTE_FRAMEWORK": "pytorch"}
    core = f"core_cu{cuda.split('.')[0]}"  # TE's core library for this torch's CUDA major
    _run(pip + ["--no-build-isolation", f"transformer_engine[pytorch,{core}]=={TE_SERIES}.*",
                *constraints], env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.bootstrap",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--extras", default="", help="the package's extras, e.g. 'course,hf'")
    parser.add_argument("--gpu", action="store_true",
                        help=f"install Transformer Engine {TE_SERIES} (and the CUDA torch if "
                             f"none is there) into the environment, then stop")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after '--': arguments for the environment's python")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if sys.version_info < (3, 11):
        parser.error(f"Python {sys.version.split()[0]} is too old: the course needs 3.11 or newer")
    extras = {e.strip() for e in args.extras.split(",") if e.strip()}
    python = ensure_environment(extras)
    if args.gpu:
        install_te(python)
        return 0
    if "course" in extras and (advice := te_advice(python)):
        print(advice, flush=True)
    if not command:
        print(f"ready: {python}")
        return 0
    os.chdir(ROOT)
    return subprocess.run([str(python), *command]).returncode


if __name__ == "__main__":
    sys.exit(main())
