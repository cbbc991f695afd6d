"""The README's commands set themselves up from the system's python3 (tools/bootstrap.py).

The environments a learner starts from are played by fake interpreters: small scripts standing in
for `python`, which answer what the bootstrap asks (is torch there? which TE?), create virtual
environments of their own kind, log every call, and fail `pip install` the way the real one does
where it would (offline; an externally managed system Python)."""

import ast
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moe_tutorial.precision import hardware
from tools import bootstrap

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = textwrap.dedent('''\
    #!{python}
    """A stand-in for a Python interpreter: state.json next to bin/ says what it holds."""
    import json, os, shutil, sys
    from pathlib import Path

    me = Path(__file__)
    prefix = me.parent.parent
    state = json.loads((prefix / "state.json").read_text())
    args = sys.argv[1:]
    with open(state["log"], "a") as log:
        build_env = {{k: os.environ.get(k) for k in ("NVTE_CUDA_ARCHS", "MAX_JOBS", "PYTHONPATH")
                  if os.environ.get(k)}}
        log.write(json.dumps({{"python": str(me), "args": args, "env": build_env}}) + "\\n")

    def save():
        (prefix / "state.json").write_text(json.dumps(state))

    if args[:1] == ["-c"]:
        code = args[1]
        if "'moe_tutorial'" in code:  # the check that an installed environment still has the course
            sys.exit(0 if state.get("torch") and state.get("course", True) else 1)
        if "transformer_engine" in code:
            sys.exit(print(state["te"]) if state.get("te") else 1)
        if "import torch" in code:
            if not state.get("torch"):
                sys.exit(1)
            if "get_device_capability" in code:
                sys.exit(print(state["arch"]) if state.get("arch") else 1)
            print(state["cuda"] if "torch.version.cuda" in code else state["torch"])
        sys.exit(0)
    if args[:2] == ["-m", "venv"]:
        if state.get("no_venv_module"):
            sys.exit("No module named venv")
        inherit = "--system-site-packages" in args
        target = Path(args[-1])
        (target / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(me, target / "bin" / "python")
        # the machine's facts (network, GPU) carry over; packages only with the system's
        child = {{"log": state["log"], **{{k: state[k] for k in
                 ("offline", "cpu_index_down", "index_torch", "arch") if k in state}}}}
        if inherit:
            child.update({{k: state.get(k) for k in ("torch", "te", "cuda")}})
        (target / "state.json").write_text(json.dumps(child))
        sys.exit(0)
    if args[:3] == ["-m", "pip", "config"]:
        sys.exit(0)
    if args[:3] == ["-m", "pip", "install"]:
        if state.get("externally_managed"):
            sys.exit("error: externally-managed-environment")
        if state.get("offline"):
            sys.exit("ERROR: No matching distribution found for setuptools>=68")
        if state.get("cpu_index_down") and "{cpu_index}" in args:
            sys.exit("ERROR: Could not find a version that satisfies the requirement torch")
        if "--dry-run" in args:  # pip's report of what the configured index would install
            report = {{"install": [{{"metadata": {{"name": n}}}}
                                   for n in state.get("index_torch", ["torch"])]}}
            Path(args[args.index("--report") + 1]).write_text(json.dumps(report))
            sys.exit(0)
        for arg in args:
            if arg.startswith("torch=="):
                state["torch"] = arg[len("torch=="):]
                state["cuda"] = "13.0" if any("cu130" in a for a in args) else ""
            if arg.startswith("transformer_engine["):
                state["te"] = arg.split("==")[1].replace("*", "2")
        save()
    sys.exit(0)
''')


def fake_python(prefix: Path, log: Path, **state) -> Path:
    """A fake interpreter at prefix/bin/python holding `state` (torch, te, cuda, arch, offline,
    externally_managed, no_venv_module, cpu_index_down, index_torch: the wheels pip's
    configured index would install for torch)."""
    python = prefix / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON.format(python=sys.executable,
                                         cpu_index=bootstrap.CPU_TORCH_INDEX))
    python.chmod(0o755)
    (prefix / "state.json").write_text(json.dumps({"log": str(log), **state}))
    return python


def state(prefix: Path) -> dict:
    return json.loads((prefix / "state.json").read_text())


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def pip_installs(log: Path) -> list[dict]:
    return [c for c in calls(log) if c["args"][:3] == ["-m", "pip", "install"]]


@pytest.fixture()
def checkout(tmp_path, monkeypatch):
    """A checkout of the course for the bootstrap (its pyproject.toml and lock file), no
    environment active, no uv, no GPU; returns the folder with the log every fake writes to."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy2(ROOT / "pyproject.toml", repo / "pyproject.toml")
    shutil.copy2(ROOT / "cpu-lock.txt", repo / "cpu-lock.txt")
    monkeypatch.setattr(bootstrap, "ROOT", repo)
    monkeypatch.setattr(bootstrap, "VENV", repo / ".venv")
    monkeypatch.setattr(bootstrap, "LOCK", repo / "cpu-lock.txt")
    monkeypatch.setattr(bootstrap, "_uv", lambda: None)
    monkeypatch.setattr(bootstrap, "has_nvidia_gpu", lambda: False)
    monkeypatch.setattr(bootstrap, "LOCAL_CUDA_NVCC", tmp_path / "no-cuda" / "bin" / "nvcc")
    monkeypatch.delenv("PIP_CONSTRAINT", raising=False)
    for name in ("VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "CUDA_HOME", "NVTE_CUDA_ARCHS",
                 "MAX_JOBS", "NVTE_BUILD_MAX_JOBS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # main() changes into the checkout; this puts it back
    return tmp_path


def test_bootstrap_needs_only_the_standard_library():
    tree = ast.parse((ROOT / "tools" / "bootstrap.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported
    # and it starts with site-packages switched off (-S): nothing installed is needed to run it
    out = subprocess.run([sys.executable, "-S", "-m", "tools.bootstrap", "--help"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "--extras" in out.stdout, out.stderr


def test_cpu_machines_get_the_cpu_build_of_torch_and_gpu_machines_the_checked_cuda_build():
    python = Path("/env/bin/python")
    first, fallback = bootstrap.torch_install_commands(python, gpu=False)
    assert first[-3:] == ["--index-url", bootstrap.CPU_TORCH_INDEX, bootstrap.CPU_TORCH]
    assert fallback[-1] == bootstrap.CPU_TORCH and "--index-url" not in fallback
    (gpu,) = bootstrap.torch_install_commands(python, gpu=True)
    assert gpu[-3:] == ["--index-url", bootstrap.GPU_TORCH_INDEX, bootstrap.GPU_TORCH]


def test_the_lock_file_pins_the_bootstraps_cpu_torch():
    lock = (ROOT / "cpu-lock.txt").read_text().splitlines()
    assert bootstrap.CPU_TORCH in lock  # without +cpu: either index's build satisfies it
    assert not [line for line in lock if line.startswith(("nvidia-", "triton"))], \
        "the CPU lock holds CUDA packages: regenerate it with `make lock`"
    assert hardware.TE_SERIES == bootstrap.TE_SERIES  # what `info` warns against


def test_an_active_venv_is_used_as_it_is_and_its_torch_never_replaced(checkout, monkeypatch):
    log = checkout / "log"
    venv = checkout / "myvenv"
    python = fake_python(venv, log, torch="2.9.1")
    monkeypatch.setenv("VIRTUAL_ENV", str(venv))
    assert bootstrap.main(["--extras", "test", "--", "-m", "pytest"]) == 0
    assert {c["python"] for c in calls(log)} == {str(python)}  # no .venv, nothing else
    (install,) = pip_installs(log)  # the course only: torch is there
    assert install["args"][4:6] == ["-e", f"{bootstrap.ROOT}[test]"]
    pin = venv / "moe_tutorial-torch-pin.txt"
    assert str(pin) in install["args"] and pin.read_text() == "torch==2.9.1\n"
    assert str(bootstrap.LOCK) not in install["args"]  # the lock's torch is not this one
    assert calls(log)[-1]["args"] == ["-m", "pytest"] and state(venv)["torch"] == "2.9.1"
    assert not (bootstrap.VENV).exists()


def test_an_active_conda_env_gets_the_cpu_torch_and_the_lock(checkout, monkeypatch):
    log = checkout / "log"
    conda = checkout / "conda" / "envs" / "moe"
    python = fake_python(conda, log)
    monkeypatch.setenv("CONDA_PREFIX", str(conda))
    assert bootstrap.main(["--extras", "course,hf"]) == 0
    torch_install, course_install = pip_installs(log)
    assert {c["python"] for c in calls(log)} == {str(python)}
    assert torch_install["args"][-3:] == ["--index-url", bootstrap.CPU_TORCH_INDEX,
                                          bootstrap.CPU_TORCH]
    assert course_install["args"][4:6] == ["-e", f"{bootstrap.ROOT}[course,hf]"]
    assert str(bootstrap.LOCK) in course_install["args"]  # a CPU machine at the lock's torch
    assert json.loads((conda / bootstrap.STAMP).read_text())["extras"] == ["course", "hf"]
    (kernel,) = [c["args"] for c in calls(log) if c["args"][:2] == ["-m", "ipykernel"]]
    assert kernel[2:6] == ["install", "--user", "--name", "moe-tutorial"]  # by name, for VS Code


def test_a_python_that_has_torch_and_te_gets_a_venv_that_sees_them(checkout, monkeypatch, capsys):
    """NVIDIA's NGC PyTorch container: a system Python with a CUDA torch and TE, no venv."""
    log = checkout / "log"
    system = fake_python(checkout / "usr", log, torch="2.10.0a0+b4e4ee81d3", cuda="13.1",
                         te="2.20.0")
    monkeypatch.setattr(bootstrap, "has_nvidia_gpu", lambda: True)
    assert bootstrap.ensure_environment({"course", "hf"}, base_python=str(system)) == \
        bootstrap.VENV / "bin" / "python"
    venv_call = next(c for c in calls(log) if c["args"][:2] == ["-m", "venv"])
    assert "--system-site-packages" in venv_call["args"]
    (install,) = pip_installs(log)  # never torch: only the course, held at the system's torch
    assert install["python"] == str(bootstrap.VENV / "bin" / "python")
    assert (bootstrap.VENV / "moe_tutorial-torch-pin.txt").read_text() == \
        "torch==2.10.0a0+b4e4ee81d3\n"
    assert str(bootstrap.LOCK) not in install["args"]  # the lock is the CPU environment's
    assert "--system-site-packages" in capsys.readouterr().out
    python = bootstrap.VENV / "bin" / "python"
    assert bootstrap.te_advice(python) is None
    venv_state = state(bootstrap.VENV)
    (bootstrap.VENV / "state.json").write_text(json.dumps({**venv_state, "te": "2.19.0"}))
    assert "2.20.x" in bootstrap.te_advice(python) and "2.19.0" in bootstrap.te_advice(python)
    (bootstrap.VENV / "state.json").write_text(json.dumps({**venv_state, "te": None}))
    assert "`make gpu`" in bootstrap.te_advice(python)


def test_an_externally_managed_python_is_never_installed_into(checkout):
    log = checkout / "log"
    system = fake_python(checkout / "usr", log, externally_managed=True)
    python = bootstrap.ensure_environment({"test"}, base_python=str(system))
    assert python == bootstrap.VENV / "bin" / "python"
    assert pip_installs(log) and {c["python"] for c in pip_installs(log)} == {str(python)}
    venv_call = next(c for c in calls(log) if c["args"][:2] == ["-m", "venv"])
    assert "--system-site-packages" not in venv_call["args"]  # the system has no torch to share


def test_a_system_without_the_venv_module_gets_one_line_on_how_to_fix_it(checkout):
    system = fake_python(checkout / "usr", checkout / "log", no_venv_module=True)
    with pytest.raises(SystemExit, match="apt install python3-venv"):
        bootstrap.ensure_environment({"test"}, base_python=str(system))


def test_a_rerun_needs_no_network_until_pyproject_changes(checkout, monkeypatch):
    log = checkout / "log"
    system = fake_python(checkout / "usr", log)
    bootstrap.ensure_environment({"test"}, base_python=str(system))
    assert len(pip_installs(log)) == 2  # torch, the course
    venv_state = state(bootstrap.VENV)
    (bootstrap.VENV / "state.json").write_text(json.dumps({**venv_state, "offline": True}))
    log.unlink()
    assert bootstrap.main(["--extras", "test", "--", "-m", "pytest", "-q"]) == 0
    # straight to it, after finding torch and the course still there
    assert [c["args"][:1] if c["args"][0] == "-c" else c["args"] for c in calls(log)] == [
        ["-c"], ["-m", "pytest", "-q"]]
    # an extra the environment lacks needs an install, and offline that fails with a reason
    with pytest.raises(SystemExit, match="failed"):
        bootstrap.ensure_environment({"course"}, base_python=str(system))
    # so does a changed pyproject.toml
    pyproject = bootstrap.ROOT / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + "\n# changed\n")
    assert bootstrap.installed_extras(bootstrap.VENV) is None


def test_make_gpu_builds_te_against_the_environments_cuda_torch(checkout, monkeypatch):
    log = checkout / "log"
    system = fake_python(checkout / "usr", log)
    monkeypatch.setattr(bootstrap, "has_nvidia_gpu", lambda: True)
    python = bootstrap.ensure_environment({"course"}, base_python=str(system))
    monkeypatch.setenv("CUDA_HOME", str(fake_nvcc(checkout / "cuda", "13.0").parents[1]))
    bootstrap.install_te(python)
    torch_install, _, tools, te = pip_installs(log)
    assert torch_install["args"][-1] == bootstrap.GPU_TORCH
    assert set(bootstrap.TE_BUILD_TOOLS) <= set(tools["args"])
    assert "--no-build-isolation" in te["args"]
    assert f"transformer_engine[pytorch,core_cu13]=={bootstrap.TE_SERIES}.*" in te["args"]
    assert str(bootstrap.VENV / "moe_tutorial-torch-pin.txt") in te["args"]
    assert state(bootstrap.VENV)["te"].startswith(bootstrap.TE_SERIES)


def test_condas_base_environment_is_never_installed_into(checkout, monkeypatch, capsys):
    """conda's shell hook activates `base` in every new shell: the course goes to .venv."""
    log = checkout / "log"
    base = checkout / "miniconda3"
    base_python = fake_python(base, log)
    (base / "condabin").mkdir()
    monkeypatch.setenv("CONDA_PREFIX", str(base))
    monkeypatch.setenv("CONDA_DEFAULT_ENV", "base")
    python = bootstrap.ensure_environment({"course"}, base_python=str(base_python))
    assert python == bootstrap.VENV / "bin" / "python"
    assert {c["python"] for c in pip_installs(log)} == {str(python)}  # never base's pip
    assert not (base / bootstrap.STAMP).exists() and "torch" not in state(base)
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "conda's base" in line]
    assert "conda's base environment is active" in line and str(bootstrap.VENV) in line
    # a conda environment of the learner's own is used as it is
    monkeypatch.setenv("CONDA_DEFAULT_ENV", "moe-tutorial")
    assert bootstrap.active_environment() is None  # the prefix is still base (condabin/)
    own = checkout / "miniconda3" / "envs" / "moe-tutorial"
    own.mkdir(parents=True)
    monkeypatch.setenv("CONDA_PREFIX", str(own))
    assert bootstrap.active_environment() == own


def test_without_the_cpu_index_a_cpu_build_from_the_configured_index_is_installed(checkout):
    log = checkout / "log"
    system = fake_python(checkout / "usr", log, cpu_index_down=True, index_torch=["torch"])
    bootstrap.ensure_environment({"test"}, base_python=str(system))
    installs = [c["args"] for c in pip_installs(log)]
    assert bootstrap.CPU_TORCH_INDEX in installs[0]  # tried first, and failed
    assert "--dry-run" in installs[1]  # what the configured index would bring, looked at
    assert installs[2][-1] == bootstrap.CPU_TORCH and "--dry-run" not in installs[2]
    assert state(bootstrap.VENV)["torch"] == bootstrap.CPU_TORCH.split("==")[1]


def test_without_the_cpu_index_a_cuda_build_is_refused_with_how_to_point_pip_at_one(checkout):
    """PyPI's Linux torch is the CUDA build: about 20 nvidia wheels a CPU machine cannot use."""
    log = checkout / "log"
    system = fake_python(checkout / "usr", log, cpu_index_down=True,
                         index_torch=["torch", "nvidia-cublas", "nvidia-cudnn-cu13", "triton"])
    with pytest.raises(SystemExit) as stop:
        bootstrap.ensure_environment({"test"}, base_python=str(system))
    message = str(stop.value)
    assert "\n" not in message and message.startswith("error: ")
    assert "CUDA build" in message and "3 CUDA wheels" in message
    assert f"PIP_EXTRA_INDEX_URL=<a mirror of {bootstrap.CPU_TORCH_INDEX}>" in message
    assert "torch" not in state(bootstrap.VENV)  # nothing installed
    assert all("--dry-run" in c["args"] or bootstrap.CPU_TORCH_INDEX in c["args"]
               for c in pip_installs(log))


def fake_nvcc(folder: Path, release: str) -> Path:
    """An `nvcc` that answers `--version` as CUDA `release`'s does."""
    nvcc = folder / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(f"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.88'\n")
    nvcc.chmod(0o755)
    return nvcc


@pytest.fixture()
def gpu_machine(checkout, monkeypatch):
    """A GPU machine whose environment has the course's CUDA 13.0 torch and no TE, no nvcc on
    the PATH (nor CUDA_HOME); returns that environment's Python."""
    monkeypatch.setattr(bootstrap, "has_nvidia_gpu", lambda: True)
    monkeypatch.setenv("PATH", str(checkout / "empty-path"))
    monkeypatch.setattr(bootstrap, "memory_available_gib", lambda: 11.5)
    monkeypatch.setattr(bootstrap.os, "cpu_count", lambda: 16)
    system = fake_python(checkout / "usr", checkout / "log", arch="89")
    return bootstrap.ensure_environment({"course"}, base_python=str(system))


def te_installs(log: Path) -> list[dict]:
    return [c for c in pip_installs(log) if any(a.startswith("transformer_engine[") for a in
                                                 c["args"])]


def test_make_gpu_without_nvcc_stops_with_one_line(gpu_machine, checkout, monkeypatch):
    with pytest.raises(SystemExit) as stop:
        bootstrap.install_te(gpu_machine)
    message = str(stop.value)
    assert "\n" not in message and "no nvcc" in message and "CUDA 13 toolkit" in message
    assert not te_installs(checkout / "log")


def test_make_gpu_refuses_an_nvcc_of_another_cuda_major(gpu_machine, checkout, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(fake_nvcc(checkout / "cuda-12.8", "12.8").parents[1]))
    with pytest.raises(SystemExit) as stop:
        bootstrap.install_te(gpu_machine)
    message = str(stop.value)
    assert "\n" not in message
    assert "is CUDA 12.8 but the torch" in message and "built for CUDA 13.0" in message
    assert not te_installs(checkout / "log")


def test_make_gpu_builds_for_this_gpu_with_jobs_bounded_by_memory(gpu_machine, checkout,
                                                                  monkeypatch, capsys):
    nvcc = fake_nvcc(checkout / "cuda", "13.0")
    monkeypatch.setenv("PATH", str(nvcc.parent))
    bootstrap.install_te(gpu_machine)
    (te,) = te_installs(checkout / "log")
    # sm_89 (an L4 or RTX 40xx) only; 11.5 GiB free over 4 GiB a job: 2 jobs, not 16 cores
    assert {k: te["env"].get(k) for k in ("NVTE_CUDA_ARCHS", "MAX_JOBS")} == \
        {"NVTE_CUDA_ARCHS": "89", "MAX_JOBS": "2"}
    assert f"building TE with {nvcc.resolve()} (CUDA 13.0), NVTE_CUDA_ARCHS=89, MAX_JOBS=2" in \
        capsys.readouterr().out.replace(str(nvcc), str(nvcc.resolve()))


def test_make_gpu_keeps_the_architectures_and_jobs_the_user_set(gpu_machine, checkout,
                                                                monkeypatch):
    monkeypatch.setenv("PATH", str(fake_nvcc(checkout / "cuda", "13.0").parent))
    monkeypatch.setenv("NVTE_CUDA_ARCHS", "90;100")
    monkeypatch.setenv("MAX_JOBS", "6")
    bootstrap.install_te(gpu_machine)
    (te,) = te_installs(checkout / "log")
    assert {k: te["env"].get(k) for k in ("NVTE_CUDA_ARCHS", "MAX_JOBS")} == \
        {"NVTE_CUDA_ARCHS": "90;100", "MAX_JOBS": "6"}


@pytest.mark.parametrize("version, accepted", [((3, 10, 12), False), ((3, 11, 2), True),
                                               ((3, 12, 3), True), ((3, 15, 0), False)])
def test_only_the_pythons_the_lock_fits_start_the_course(checkout, monkeypatch, capsys, version,
                                                         accepted):
    monkeypatch.setattr(sys, "version_info", version)
    monkeypatch.setattr(bootstrap, "ensure_environment", lambda extras: Path("/env/bin/python"))
    if accepted:
        assert bootstrap.main(["--extras", "test"]) == 0
        return
    with pytest.raises(SystemExit):
        bootstrap.main(["--extras", "test"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is not one the course installs on (3.11 to 3.14)" in err


def test_what_only_the_tests_import_goes_beside_the_environment(checkout, monkeypatch):
    """torchao, imported by transformers wherever it is installed, would print its warnings in
    every chapter after `make test`: it goes into a folder of its own, on the tests' PYTHONPATH."""
    log = checkout / "log"
    system = fake_python(checkout / "usr", log)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    bootstrap.ensure_environment({"test"}, base_python=str(system))
    log.unlink()
    assert bootstrap.main(["--extras", "test", "--test-only", "--", "-m", "pytest"]) == 0
    target = bootstrap.VENV / bootstrap.TEST_ONLY_DIR
    (install,) = pip_installs(log)
    assert install["args"][-len(bootstrap.TEST_ONLY) - 3:] == \
        ["--no-deps", "--target", str(target), *bootstrap.TEST_ONLY]
    assert calls(log)[-1]["args"] == ["-m", "pytest"]
    assert calls(log)[-1]["env"]["PYTHONPATH"] == str(target)
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [d for deps in extras.values() for d in deps if d.startswith("torchao")]
    # installed once: the next run goes straight to the command, without pip
    log.unlink()
    assert bootstrap.main(["--extras", "test", "--test-only", "--", "-m", "pytest"]) == 0
    assert [c["args"] for c in calls(log) if c["args"][0] != "-c"] == [["-m", "pytest"]]


@pytest.mark.parametrize("broken", ["torch removed", "course removed", "interpreter gone"])
def test_an_environment_whose_stamp_matches_but_lost_its_packages_is_installed_again(
        checkout, capsys, broken):
    log = checkout / "log"
    system = fake_python(checkout / "usr", log)
    bootstrap.ensure_environment({"test"}, base_python=str(system))
    venv_python = bootstrap.environment_python(bootstrap.VENV)
    if broken == "interpreter gone":
        venv_python.unlink()
    else:
        key = "torch" if broken == "torch removed" else "course"
        (bootstrap.VENV / "state.json").write_text(
            json.dumps({**state(bootstrap.VENV), key: None if key == "torch" else False}))
    log.unlink()
    capsys.readouterr()
    bootstrap.ensure_environment({"test"}, base_python=str(system))
    assert pip_installs(log), "an environment without the course was trusted by its stamp"
    if broken != "interpreter gone":  # a new venv: its own line says it is created
        assert "no longer finds torch or the course" in capsys.readouterr().out
