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

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = textwrap.dedent('''\
    #!{python}
    """A stand-in for a Python interpreter: state.json next to bin/ says what it holds."""
    import json, shutil, sys
    from pathlib import Path

    me = Path(__file__)
    prefix = me.parent.parent
    state = json.loads((prefix / "state.json").read_text())
    args = sys.argv[1:]
    with open(state["log"], "a") as log:
        log.write(json.dumps({{"python": str(me), "args": args}}) + "\\n")

    def save():
        (prefix / "state.json").write_text(json.dumps(state))

    if args[:1] == ["-c"]:
        code = args[1]
        if "transformer_engine" in code:
            sys.exit(print(state["te"]) if state.get("te") else 1)
        if "import torch" in code:
            if not state.get("torch"):
                sys.exit(1)
            print(state["cuda"] if "torch.version.cuda" in code else state["torch"])
        sys.exit(0)
    if args[:2] == ["-m", "venv"]:
        if state.get("no_venv_module"):
            sys.exit("No module named venv")
        inherit = "--system-site-packages" in args
        target = Path(args[-1])
        (target / "bin").mkdir(parents=True)
        shutil.copy2(me, target / "bin" / "python")
        child = {{"log": state["log"], "offline": state.get("offline", False)}}
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
    """A fake interpreter at prefix/bin/python holding `state` (torch, te, cuda, offline,
    externally_managed, no_venv_module)."""
    python = prefix / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON.format(python=sys.executable))
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
    monkeypatch.delenv("PIP_CONSTRAINT", raising=False)
    for name in ("VIRTUAL_ENV", "CONDA_PREFIX"):
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


def test_the_lock_file_pins_the_bootstraps_cpu_torch_and_the_gpu_extra_its_te():
    lock = (ROOT / "cpu-lock.txt").read_text().splitlines()
    assert bootstrap.CPU_TORCH in lock  # without +cpu: either index's build satisfies it
    assert not [line for line in lock if line.startswith(("nvidia-", "triton"))], \
        "the CPU lock holds CUDA packages: regenerate it with `make lock`"
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["gpu"] == [f"transformer-engine[pytorch]>={bootstrap.TE_SERIES},<2.21"]
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
    assert [c["args"] for c in calls(log)] == [["-m", "pytest", "-q"]]  # straight to it
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
    bootstrap.install_te(python)
    torch_install, _, tools, te = pip_installs(log)
    assert torch_install["args"][-1] == bootstrap.GPU_TORCH
    assert set(bootstrap.TE_BUILD_TOOLS) <= set(tools["args"])
    assert "--no-build-isolation" in te["args"]
    assert f"transformer_engine[pytorch,core_cu13]=={bootstrap.TE_SERIES}.*" in te["args"]
    assert str(bootstrap.VENV / "moe_tutorial-torch-pin.txt") in te["args"]
    assert state(bootstrap.VENV)["te"].startswith(bootstrap.TE_SERIES)
