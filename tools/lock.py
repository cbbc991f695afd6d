"""`make lock`: regenerate cpu-lock.txt, the CPU environment CI and every CPU learner installs,
so that it holds for every Python the README promises, and record what each pin needs of Python.

    python3 -m tools.lock [--find-links DIR] [--torch-index URL]

1. uv (from the package index, in a throwaway venv) resolves pyproject.toml's extras for the
   oldest Python the course supports (`--python-version 3.11`, which uv reads as 3.11.0): no pin
   may need a newer 3.11 than Debian 12's 3.11.2. Pip-tools cannot resolve for another Python
   than the one running it, so a lock made on 3.11.7 once pinned soupsieve 4.1.4, which needs
   Python >= 3.11.5. The pins already in the lock are kept where they still fit (uv reads the
   output file as its preferences), so a re-lock moves only what must move.
2. The same requirements resolve again for every newer Python the course supports, constrained
   to the lock: a pin that does not fit one of them stops the lock with that Python named.
3. cpu-lock-python.txt records, per pin, its Requires-Python and the CPython versions its wheels
   cover (from the index's PEP 691 JSON), so tests/tools/test_lock.py checks the floor offline.

uv reads its own settings (UV_DEFAULT_INDEX, UV_INDEX, ...), not pip's: behind a mirror, set
those, or pass `--torch-index` and `--find-links`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

from tools.bootstrap import CPU_TORCH, CPU_TORCH_INDEX, ROOT, SUPPORTED_PYTHONS

LOCK = ROOT / "cpu-lock.txt"
TABLE = ROOT / "cpu-lock-python.txt"
# The oldest Python the README promises (resolved for its .0 release: Debian 12 ships 3.11.2),
# then the newer ones each pin must also fit.
OLDEST_PYTHON, *NEWER_PYTHONS = SUPPORTED_PYTHONS
EXTRAS = ("test", "course", "hf")
INDEX_JSON = "https://pypi.org/simple/{name}/"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)")


def pins(lock_text: str) -> dict[str, str]:
    """`name -> version` for every `name==version` line of a lock file."""
    return {m.group(1).lower(): m.group(2) for line in lock_text.splitlines()
            if (m := PIN.match(line))}


def _run(command: list[str]) -> None:
    print("+", " ".join(command), flush=True)
    if subprocess.run(command).returncode != 0:
        raise SystemExit(f"error: `{' '.join(command[:4])} ...` failed; see its output above")


def compile_lock(uv: str, python: str, output: Path, constraints: list[Path],
                 extra_args: list[str]) -> None:
    command = [uv, "pip", "compile", "--quiet", "--python-version", python,
               "--custom-compile-command", "make lock", "-o", str(output)]
    for extra in EXTRAS:
        command += ["--extra", extra]
    for path in constraints:
        command += ["-c", str(path)]
    _run(command + extra_args + [str(ROOT / "pyproject.toml")])


def wheel_pythons(filenames: list[str]) -> str:
    """The CPython versions a release's wheels install on: `any` for pure-Python or abi3 wheels,
    else their cpXY tags (`cp311 cp312`); `sdist only` where it has no wheel."""
    tags = set()
    for name in filenames:
        if not name.endswith(".whl"):
            continue
        python_tag, abi_tag = name[:-4].split("-")[-3:-1]
        if abi_tag in ("none", "abi3"):
            return "any"
        tags |= {t for t in python_tag.split(".") if t.startswith("cp")}
    return " ".join(sorted(tags)) or "sdist only"


def release_facts(name: str, version: str) -> tuple[str, str]:
    """(Requires-Python, wheel_pythons) of one release, from the index's PEP 691 JSON."""
    request = urllib.request.Request(INDEX_JSON.format(name=name),
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        files = json.load(response)["files"]
    public = version.split("+")[0]
    mine = [f for f in files if re.match(rf"{re.escape(name)}-{re.escape(public)}[-.]",
                                         f["filename"].lower().replace("_", "-"))]
    if not mine:
        raise SystemExit(f"error: the index lists no files of {name} {version}")
    requires = {f.get("requires-python") or "" for f in mine}
    return (sorted(requires)[-1] or "any"), wheel_pythons([f["filename"] for f in mine])


def write_table(lock_pins: dict[str, str]) -> None:
    lines = ["# What each pin of cpu-lock.txt needs of Python: its Requires-Python and the CPython",
             "# versions its wheels cover (`any`: pure Python or abi3). Written by `make lock`",
             "# (tools/lock.py); tests/tools/test_lock.py checks it against the README's Pythons."]
    for name, version in sorted(lock_pins.items()):
        requires, wheels = release_facts(name, version)
        lines.append(f"{name}=={version} | {requires} | {wheels}")
    TABLE.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.lock", description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-index", default=CPU_TORCH_INDEX,
                        help="where the CPU build of torch comes from")
    parser.add_argument("--find-links", action="append", default=[],
                        help="a folder of wheels to resolve from as well (e.g. a local torch)")
    args = parser.parse_args(argv)
    work = ROOT / ".lock-venv"
    shutil.rmtree(work, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(work)])
    _run([str(work / "bin" / "python"), "-m", "pip", "install", "--quiet", "uv"])
    uv = str(work / "bin" / "uv")
    sources = ["--extra-index-url", args.torch_index, "--index-strategy", "unsafe-best-match"]
    for folder in args.find_links:
        sources += ["--find-links", folder]
    torch_cpu = work / "torch-cpu.txt"
    torch_cpu.write_text(f"{CPU_TORCH}+cpu\n")
    compile_lock(uv, OLDEST_PYTHON, LOCK, [torch_cpu], sources)
    # torch without its +cpu label: the CPU wheel index's build and the same version from
    # another index (the bootstrap's fallback) both satisfy it
    LOCK.write_text(re.sub(r"^torch==(.*)\+cpu$", r"torch==\1", LOCK.read_text(), flags=re.M))
    for python in NEWER_PYTHONS:
        compile_lock(uv, python, work / f"check-{python}.txt", [LOCK], sources)
    write_table(pins(LOCK.read_text()))
    shutil.rmtree(work)
    print(f"wrote {LOCK.name} (for Python {OLDEST_PYTHON}.0 up, checked for "
          f"{', '.join(NEWER_PYTHONS)}) and {TABLE.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
