"""Set up an environment for the course's commands, then run one: what `make course`,
`make test` and `make lab` call, with only the system's `python3` (standard library only here:
nothing of the course is installed yet when this runs).

    python3 -m tools.bootstrap --extras test -- -m pytest

1. Which Python: the active virtual or conda environment if there is one (never conda's own
   `base`: one line says so and the course goes to `.venv`); else `.venv` in the repository, created on first use (`python3 -m venv`, or uv where the system lacks the venv
   module). When the system's Python already has torch, as in NVIDIA's NGC PyTorch container,
   `.venv` sees its packages (`--system-site-packages`): that torch and its Transformer Engine
   are used as they are. A Debian/Ubuntu system Python is "externally managed" and refuses
   `pip install`; nothing is ever installed into it.
2. Nothing more when the environment already holds the course at this `pyproject.toml` (and
   lock file), with the extras asked for: a stamp written after the last install says so, and
   the command runs without the network.
3. torch, only if the environment lacks it: on a machine without an NVIDIA GPU the CPU build
   (PyTorch's CPU wheel index; where that index cannot be reached, the pinned version from the
   configured index if pip's dry run shows it is a CPU build there, else one line on pointing
   pip at a CPU index), so pip never pulls the multi-GB CUDA build there; with a GPU, the CUDA
   build the course was checked with. A torch already there is never replaced: the install
   below is constrained to its exact version.
4. The course itself, editable, with the extras the command needs (`pip install -e .[extras]`),
   on a CPU machine constrained to `cpu-lock.txt` (what CI installs); with the notebook extra,
   a Jupyter kernel named `moe-tutorial` for VS Code and other Jupyter front ends.
5. The command, run with that environment's Python (its exit code is this one's). Before it, on
   a machine with an NVIDIA GPU and no Transformer Engine, one line says how to get it.

`--gpu` installs Transformer Engine instead (see docs/gpu.md): the CUDA torch if none is there,
TE's build tools, then `transformer_engine[pytorch]` built against that torch, after checking
that nvcc is there and of torch's CUDA major, for the GPU's own architecture and with parallel
jobs bounded by memory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
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
# Memory one parallel job of TE's build may take: MAX_JOBS defaults to MemAvailable over this
# (TE's README, "Build Resource Issues": parallel jobs can exhaust memory; limit them with
# MAX_JOBS). An assumption with headroom, not a measured figure.
GIB_PER_BUILD_JOB = 4
# The Pythons the course installs on, oldest first (cpu-lock.txt is resolved for the first,
# 3.11.0 up, and checked for the others: tools/lock.py); the README names the same range.
SUPPORTED_PYTHONS = ("3.11", "3.12", "3.13", "3.14")
LOCK = ROOT / "cpu-lock.txt"
STAMP = "moe_tutorial-install.json"  # in the environment's prefix
# What only the test suite imports, kept out of the course's environment: `--test-only`
# installs it into a folder of its own beside the environment and puts that folder on the
# command's PYTHONPATH. torchao (the MXFP8 tests' independent MX reference; a prototype API, so
# pinned) is imported by transformers wherever it is installed, and its import prints warnings
# (its native extension, torch's pytree) into the chapters' outputs.
TEST_ONLY = ["torchao==0.18.0"]
TEST_ONLY_DIR = "moe_tutorial-test-only"  # in the environment's prefix
KERNEL_NAME = "moe-tutorial"  # the Jupyter kernel `make lab` and `make course` install


def is_conda_base(prefix: Path) -> bool:
    """conda's own `base` environment (auto-activated by conda's shell hook): the course is never
    installed there, where it would add about 1.7 GB under every other conda environment's tools.
    A base prefix holds conda itself (`condabin/`); conda names it `base` when it is active."""
    return os.environ.get("CONDA_DEFAULT_ENV") == "base" or (prefix / "condabin").is_dir()


def active_environment() -> Path | None:
    """The prefix of the active virtual or conda environment, or None (the system Python, or
    conda's base environment, with one line saying so)."""
    if os.environ.get("VIRTUAL_ENV"):
        return Path(os.environ["VIRTUAL_ENV"])
    conda = os.environ.get("CONDA_PREFIX")
    if not conda:
        return None
    if is_conda_base(Path(conda)):
        print(f"conda's base environment is active ({conda}): the course is never installed "
              f"there, so it uses {VENV} (for a conda environment of its own: `conda env create "
              f"-f environment.yml && conda activate moe-tutorial`)", flush=True)
        return None
    return Path(conda)


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
    """The pip commands to try, in order: with a GPU the checked CUDA build; without one the CPU
    build from PyTorch's CPU index, then the same version from the configured index (which
    `install_torch` takes only where it is a CPU build)."""
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    if gpu:
        return [pip + ["--index-url", GPU_TORCH_INDEX, GPU_TORCH]]
    return [pip + ["--retries", "0", "--timeout", "10", "--index-url", CPU_TORCH_INDEX, CPU_TORCH],
            pip + [CPU_TORCH]]


def cuda_packages_pip_would_add(python: Path, requirement: str) -> list[str]:
    """The CUDA wheels (nvidia-*, cuda-*, triton) `pip install requirement` would add, from
    pip's own dry run; a CPU build adds none."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        command = [str(python), "-m", "pip", "install", "--quiet", "--dry-run", "--report",
                   str(report), requirement]
        if _run(command, check=False) != 0 or not report.exists():
            raise SystemExit(f"error: torch cannot be installed: neither PyTorch's CPU index "
                             f"({CPU_TORCH_INDEX}) nor pip's configured index answers; connect to "
                             f"the network, or point pip at an index that has {requirement} "
                             f"(PIP_INDEX_URL=...), and run the command again")
        names = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    return [n for n in names if n.lower().startswith(("nvidia-", "cuda-", "triton"))]


def install_torch(python: Path, gpu: bool) -> None:
    """torch into an environment that has none: the CUDA build with a GPU, else a CPU build, or
    one line on how to get one: never the multi-GB CUDA build on a machine without a GPU."""
    if gpu:
        (command,) = torch_install_commands(python, gpu=True)
        _run(command)
        return
    from_cpu_index, from_configured_index = torch_install_commands(python, gpu=False)
    if _run(from_cpu_index, check=False) == 0:
        return
    print(f"(PyTorch's CPU index {CPU_TORCH_INDEX} is not reachable from here; trying pip's "
          f"configured index, where its {CPU_TORCH} must be a CPU build)", flush=True)
    if cuda := cuda_packages_pip_would_add(python, CPU_TORCH):
        raise SystemExit(f"error: pip's configured index offers only the CUDA build of "
                         f"{CPU_TORCH} ({len(cuda)} CUDA wheels, {cuda[0]} first), which this "
                         f"machine without an NVIDIA GPU cannot use: point pip at a CPU index, e.g. "
                         f"`PIP_EXTRA_INDEX_URL=<a mirror of {CPU_TORCH_INDEX}> make lab`, and run "
                         f"the command again")
    _run(from_configured_index)


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


def finds_the_course(python: Path) -> bool:
    """Whether `python` starts and finds torch and the course: the stamp says what was installed,
    not what is still there (a removed package, an interpreter whose base Python is gone).
    Finding, not importing: torch's import would cost every command seconds."""
    probe = ("import importlib.util as u, sys; "
             "sys.exit(0 if all(map(u.find_spec, ('torch', 'moe_tutorial'))) else 1)")
    try:
        return subprocess.run([str(python), "-c", probe], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


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
        install_torch(python, gpu)
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
    if installed is not None and not finds_the_course(python):
        print(f"{prefix} was set up for the course, but its Python no longer finds torch or the "
              f"course there: installing them again", flush=True)
        installed = None
    if installed is not None and extras <= installed:
        return python  # the course is there at these inputs: no install, no network
    extras = extras | (installed or set())
    lock = install_course(python, extras, has_nvidia_gpu())
    if "course" in extras:
        register_kernel(python, prefix)
    (prefix / STAMP).write_text(json.dumps(stamp_of(extras, lock), indent=1) + "\n")
    return python


def register_kernel(python: Path, prefix: Path) -> None:
    """A Jupyter kernel named KERNEL_NAME that starts this environment's Python, in the user's
    Jupyter folder: VS Code, or a JupyterLab of another environment, can then run the chapters
    in the course's environment by picking it by name."""
    command = [str(python), "-m", "ipykernel", "install", "--user", "--name", KERNEL_NAME,
               "--display-name", f"Python (moe-tutorial: {prefix})"]
    if _run(command, check=False) != 0:
        print(f"(the Jupyter kernel {KERNEL_NAME!r} could not be registered; the make commands "
              f"do not need it: see the output above)", flush=True)


def ensure_test_only(python: Path) -> Path:
    """TEST_ONLY installed (once) into its folder beside the environment; returns the folder."""
    target = python.parent.parent / TEST_ONLY_DIR
    stamp = target / "moe_tutorial-installed.txt"
    if stamp.is_file() and stamp.read_text().split() == TEST_ONLY:
        return target  # there at these versions: no network
    shutil.rmtree(target, ignore_errors=True)
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
          *TEST_ONLY])
    target.mkdir(exist_ok=True)
    stamp.write_text("\n".join(TEST_ONLY) + "\n")
    return target


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


LOCAL_CUDA_NVCC = Path("/usr/local/cuda/bin/nvcc")  # where CUDA's installers put it


def find_nvcc() -> Path | None:
    """The CUDA compiler TE's build finds (TE 2.20's `build_tools/utils.py` `nvcc_path`, in its
    order, less its pip-installed `nvidia-cuda-nvcc` lookups): $CUDA_HOME/bin, the PATH,
    /usr/local/cuda/bin."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
    if on_path := shutil.which("nvcc"):
        candidates.append(Path(on_path))
    candidates.append(LOCAL_CUDA_NVCC)
    return next((path for path in candidates if path.is_file()), None)


def nvcc_cuda_version(nvcc: Path) -> str:
    """`13.0` from `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True)
    match = re.search(r"release (\d+\.\d+)", out.stdout)
    if out.returncode != 0 or match is None:
        raise SystemExit(f"error: `{nvcc} --version` did not say its CUDA release (exit status "
                         f"{out.returncode}); point CUDA_HOME at a working CUDA toolkit")
    return match.group(1)


def memory_available_gib() -> float | None:
    """MemAvailable from /proc/meminfo, in GiB; None where there is none (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def te_build_environment(python: Path, cuda: str) -> dict[str, str]:
    """The environment TE is built in: the torch's CUDA major checked against nvcc's, the GPU's
    own architecture (NVTE_CUDA_ARCHS) and parallel jobs bounded by memory (MAX_JOBS), each kept
    where the user set it. Each problem stops with one line."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise SystemExit(f"error: no nvcc (the CUDA toolkit's compiler) in $CUDA_HOME/bin, on the "
                         f"PATH or in /usr/local/cuda/bin: building TE's PyTorch extension needs "
                         f"the CUDA {cuda.split('.')[0]} toolkit; install it and put its bin/ on "
                         f"the PATH (or set CUDA_HOME), or use NVIDIA's NGC container (docs/gpu.md)")
    toolkit = nvcc_cuda_version(nvcc)
    if toolkit.split(".")[0] != cuda.split(".")[0]:
        raise SystemExit(f"error: {nvcc} is CUDA {toolkit} but the torch in {python} is built "
                         f"for CUDA {cuda}: TE must be built with the same CUDA major; set "
                         f"CUDA_HOME to a CUDA {cuda.split('.')[0]} toolkit (or install the torch "
                         f"built for CUDA {toolkit.split('.')[0]})")
    env = {**os.environ, "NVTE_FRAMEWORK": "pytorch"}
    if "NVTE_CUDA_ARCHS" not in env:
        arch = _ask(python, "import torch; print('%d%d' % torch.cuda.get_device_capability())")
        if arch:
            env["NVTE_CUDA_ARCHS"] = arch
    if "MAX_JOBS" not in env and "NVTE_BUILD_MAX_JOBS" not in env:
        gib = memory_available_gib()
        if gib is not None:
            env["MAX_JOBS"] = str(max(1, min(os.cpu_count() or 1, int(gib // GIB_PER_BUILD_JOB))))
    print(f"building TE with {nvcc} (CUDA {toolkit}), NVTE_CUDA_ARCHS="
          f"{env.get('NVTE_CUDA_ARCHS', '(TE default: every architecture)')}, MAX_JOBS="
          f"{env.get('MAX_JOBS', env.get('NVTE_BUILD_MAX_JOBS', '(TE default: every core)'))}",
          flush=True)
    return env


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
    env = te_build_environment(python, cuda)
    pin = _pin_torch(python, torch_version(python))
    constraints = [arg for path in [*configured_constraints(python), str(pin)]
                   for arg in ("-c", path)]
    pip = [str(python), "-m", "pip", "install"]
    _run(pip + ["--quiet", *TE_BUILD_TOOLS, *constraints])
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
    parser.add_argument("--test-only", action="store_true",
                        help="also the test suite's own packages (TEST_ONLY), beside the "
                             "environment, on the command's PYTHONPATH")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after '--': arguments for the environment's python")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if f"{sys.version_info[0]}.{sys.version_info[1]}" not in SUPPORTED_PYTHONS:
        parser.error(f"Python {sys.version.split()[0]} is not one the course installs on "
                     f"({SUPPORTED_PYTHONS[0]} to {SUPPORTED_PYTHONS[-1]}): run it with one of "
                     f"those, e.g. `make lab PYTHON=python{SUPPORTED_PYTHONS[0]}`")
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
    env = None
    if args.test_only:
        folders = [str(ensure_test_only(python)), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(f for f in folders if f)}
    os.chdir(ROOT)
    return subprocess.run([str(python), *command], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
