"""The learner's working copy of the course: `work/` at the repository root (git-ignored), where
`make lab` opens JupyterLab.

The chapters (`notebooks/`, with their figures), the exercises and their solutions are copied
into `work/` side by side, as in the repository, and with them the glossary the chapters link
(`docs/glossary.md`), so every relative link between them (`../exercises/01_router_and_loop.ipynb`,
`../docs/glossary.md#router`) resolves inside Lab. What a learner saves there, outputs
and edits alike, never touches a tracked file: `make test` stays green after a day of learning and
`git pull` never conflicts with it. A file already in `work/` is never overwritten; one the
repository gained since (a new chapter after `git pull`) is added. To get a fresh copy of one
chapter, delete or rename it in `work/` and run `make lab` again.

Committed results are read through `perf.results`, which finds the clone from the current directory
up (work/ holds no package source, so from work/notebooks/ it finds the clone around it): the
notebooks run the same from `work/` as from the repository.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from ..locations import CLONE_MARKER, checkout_root, outside_checkout

WORKSPACE_NAME = "work"
# What is copied: a folder of the repository, mirrored under the same name in the workspace;
# and single files the notebooks link, at the same path.
COPIED_FOLDERS = ("notebooks", "exercises", "solutions")
COPIED_FILES = ("docs/glossary.md",)


def _course_files(repo: Path) -> list[Path]:
    """The files of the copied folders, relative to `repo`: everything but hidden files and
    Python's caches (a checkpoint folder or `__pycache__` is nobody's work); then the copied
    single files the repository has."""
    files = []
    for folder in COPIED_FOLDERS:
        for path in sorted((repo / folder).rglob("*")):
            relative = path.relative_to(repo)
            if path.is_file() and not any(part.startswith(".") or part == "__pycache__"
                                           for part in relative.parts):
                files.append(relative)
    return files + [Path(name) for name in COPIED_FILES if (repo / name).is_file()]


def prepare_workspace(repo: Path | None = None, workspace: Path | None = None) -> Path:
    """Create or top up the working copy and return its root (`repo / "work"` by default; `repo`:
    the clone the current directory is in).

    Copies each course file that the workspace lacks; keeps every file already there as it is,
    and says which it added and that it kept the rest."""
    repo = Path(repo) if repo is not None else checkout_root()
    if repo is None:
        raise FileNotFoundError(f"no course notebooks to copy: {outside_checkout()} (git clone "
                                f"..., then `make lab` there)")
    workspace = Path(workspace) if workspace is not None else repo / WORKSPACE_NAME
    missing = [folder for folder in COPIED_FOLDERS if not (repo / folder).is_dir()]
    if missing:
        raise FileNotFoundError(
            f"{repo} has no {' or '.join(f'{m}/' for m in missing)}: the working copy is made "
            f"from a clone of the course's repository (git clone ..., then `make lab` there)")
    if workspace.exists() and not workspace.is_dir():
        raise FileExistsError(f"{workspace} is a file, not the course's working folder; move it "
                              f"away and run `make lab` again")
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / CLONE_MARKER).write_text(f"{repo.resolve()}\n")  # ours, not the learner's
    added, kept = [], 0
    for relative in _course_files(repo):
        target = workspace / relative
        if target.exists():
            kept += 1
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / relative, target)
        added.append(relative)
    if added:
        names = [str(r) for r in added if r.suffix == ".ipynb"]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        print(f"{workspace}: added {len(added)} file(s)" + (f" ({shown})" if names else ""))
    if kept:
        print(f"{workspace}: kept your {kept} file(s) already there, as they are (to get a fresh "
              f"copy of one, delete or rename it there and run `make lab` again)")
    return workspace


def running_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def lab_argv(workspace: Path, extra: Sequence[str] = ()) -> list[str]:
    """The command line that starts JupyterLab on `workspace` with this Python, `extra` appended.

    As root (the default user in NVIDIA's containers) it adds `--allow-root`: Jupyter refuses to
    start as root without it."""
    # `-m jupyterlab`, not `-m jupyter lab`: the latter looks for a `jupyter-lab` script on PATH,
    # which an environment that was never activated (make, a container) does not have there
    argv = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={Path(workspace)}"]
    if running_as_root():
        argv.append("--allow-root")
    return argv + list(extra)
