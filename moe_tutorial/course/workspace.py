"""The learner's working copy of the course: `work/` at the repository root (git-ignored), where
`make lab` opens JupyterLab.

The chapters (`notebooks/`, with their figures), the exercises and their solutions are copied
into `work/` side by side, as in the repository, and with them the glossary the chapters link
(`docs/glossary.md`), so every relative link between them (`../exercises/01_router_and_loop.ipynb`,
`../docs/glossary.md#router`) resolves inside Lab. What a learner saves there, outputs
and edits alike, never touches a tracked file: `make test` stays green after a day of learning and
`git pull` never conflicts with it.

Each file is copied whole or not at all (`safe_io.atomic_file`: a temporary file, then a
rename), so a killed copy or a full disk leaves the file absent, never half a chapter; the next
`make lab` copies it. The copy records the sha256 of every file it made (`RECORD`), and so
tells a file the learner never edited from their work: one they never edited is refreshed when
the course changed it (after `git pull`), one they edited is kept, saying so. A file the
repository gained since (a new chapter) is added. Never through a link: a link in `work/`, to a
file or a folder, is left as it is, and said. A `work/` that cannot be written (read-only, full)
or read in part still opens in Lab, with one line for what could not be done. To get a fresh
copy of one chapter, delete or rename it in `work/` and run `make lab` again.

Committed results are read through `perf.results`, which finds the clone from the current directory
up (work/ holds no package source, so from work/notebooks/ it finds the clone around it): the
notebooks run the same from `work/` as from the repository.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import safe_io
from ..locations import CLONE_MARKER, checkout_root, outside_checkout

WORKSPACE_NAME = "work"
# What is copied: a folder of the repository, mirrored under the same name in the workspace;
# and single files the notebooks link, at the same path.
COPIED_FOLDERS = ("notebooks", "exercises", "solutions")
COPIED_FILES = ("docs/glossary.md",)
# In the workspace: {"files": {relative path: sha256 of the copy made}}, ours, not the learner's
RECORD = ".moe-tutorial-copies.json"
RECORD_LIMIT = 16 << 20
# safe_io.temporary_name's names: what a copy killed before its rename leaves
TEMPORARY = re.compile(r"\..+\.(\d+)\.[0-9a-f]{8}\.tmp")


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


@dataclass
class _Outcome:
    """What `prepare_workspace` did with each file, for its report."""

    added: list[str] = field(default_factory=list)
    refreshed: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    kept: int = 0
    kept_stale: list[str] = field(default_factory=list)  # edited; the course changed since
    links: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    why_failed: str = ""
    unwritable: str | None = None  # why work/ itself cannot be written, if it cannot
    notes: list[str] = field(default_factory=list)

    def fail(self, relative: str, exc: Exception) -> None:
        self.failed.append(relative)
        self.why_failed = self.why_failed or _why(exc)


def _why(exc: Exception) -> str:
    """The reason in a few words ("No space left on device"), not safe_io's whole sentence."""
    code = getattr(exc, "errno", None)
    return os.strerror(code) if code else str(exc)


def _names(items: list[str]) -> str:
    return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_record(workspace: Path, outcome: _Outcome) -> dict[str, str]:
    try:
        with safe_io.open_regular(workspace / RECORD, limit=RECORD_LIMIT) as (f, size):
            files = json.loads(f.read(size).decode("utf-8"))["files"]
        if isinstance(files, dict) and all(isinstance(v, str) for v in files.values()):
            return files
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    outcome.notes.append(f"its record of the files it copied ({RECORD}) is unreadable: every "
                         f"file there is kept as yours")
    return {}


def _damaged(data: bytes, relative: Path, course: bytes) -> bool:
    """A copy cut short by an earlier, non-atomic copy: empty where the course's is not, or a
    notebook that is not JSON (Jupyter saves whole files)."""
    if not data:
        return bool(course)
    if relative.suffix == ".ipynb":
        try:
            json.loads(data)
        except ValueError:
            return True
    return False


def _linked(workspace: Path, folder: Path) -> bool:
    """Whether the workspace's `folder` (relative), or a folder above it, is a link."""
    return any((workspace / part).is_symlink() for part in (folder, *folder.parents)
               if part != Path("."))


def _remove_dead_temporaries(folder: Path) -> None:
    """The temporary files copies killed before their rename left in `folder` (their process
    is gone; a live one's is its own)."""
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            if (m := TEMPORARY.fullmatch(entry.name)) and not _alive(int(m.group(1))):
                with contextlib.suppress(OSError):
                    entry.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


def _sync(repo: Path, workspace: Path, relative: Path, copies: dict[str, str],
          outcome: _Outcome) -> None:
    """Copy, refresh, repair or keep one file (the module docstring's rules)."""
    name, target = str(relative), workspace / relative
    if _linked(workspace, relative.parent) or target.is_symlink():
        outcome.links.append(name)
        return
    course = (repo / relative).read_bytes()
    try:
        with safe_io.open_regular(target, what=name) as (f, size):
            data = f.read(size)
    except FileNotFoundError:
        data = None
    except (OSError, safe_io.UnsafeRead):
        outcome.unreadable.append(name)
        return
    if data is None:
        done, replace = outcome.added, False
    elif _sha256(data) == _sha256(course):
        copies[name] = _sha256(course)  # the course's file as it is, whoever copied it
        outcome.kept += 1
        return
    elif copies.get(name) == _sha256(data):  # never edited; the course changed it since
        done, replace = outcome.refreshed, True
    elif _damaged(data, relative, course):
        done, replace = outcome.repaired, False
    else:
        outcome.kept += 1
        if name in copies and copies[name] != _sha256(course):
            outcome.kept_stale.append(name)
        return
    try:
        if done is outcome.repaired:  # kept beside the fresh copy: nothing is lost
            os.replace(target, target.with_name(f"{target.name}.damaged"))
        target.parent.mkdir(parents=True, exist_ok=True)
        with safe_io.atomic_file(target, replace=replace) as f:
            f.write(course)
    except (OSError, ValueError) as exc:  # WriteFailed, PermissionError; UnsafeWrite, FileBusy
        outcome.fail(name, exc)
        return
    copies[name] = _sha256(course)
    done.append(name)


def _report(workspace: Path, outcome: _Outcome) -> None:
    def say(line: str) -> None:
        print(f"{workspace}: {line}")

    notebooks = [n for n in outcome.added if n.endswith(".ipynb")]
    if outcome.added:
        say(f"added {len(outcome.added)} file(s)" + (f" ({_names(notebooks)})" if notebooks
                                                      else ""))
    if outcome.refreshed:
        say(f"refreshed {len(outcome.refreshed)} file(s) you had not edited, which the course "
            f"has changed since they were copied ({_names(outcome.refreshed)})")
    if outcome.repaired:
        say(f"replaced {len(outcome.repaired)} copy(ies) cut short by an earlier copy (empty, "
            f"or a notebook that is not whole) with fresh ones; the cut ones are beside them as "
            f"*.damaged ({_names(outcome.repaired)})")
    if outcome.kept:
        say(f"kept your {outcome.kept} file(s) already there, as they are (to get a fresh copy "
            f"of one, delete or rename it there and run `make lab` again)")
    if outcome.kept_stale:
        say(f"kept your edited {_names(outcome.kept_stale)}, which the course has changed since "
            f"you got it: to see the new version, rename yours and run `make lab` again")
    if outcome.links:
        say(f"left {len(outcome.links)} link(s) as they are ({_names(outcome.links)}): the "
            f"course never writes through a link; replace one with a file or folder to get the "
            f"course's copy")
    if outcome.unreadable:
        say(f"could not read {_names(outcome.unreadable)} (no permission?): left as they are")
    if outcome.failed:
        say(f"could not write {len(outcome.failed)} file(s) ({outcome.why_failed}: "
            f"{_names(outcome.failed)}): Lab starts on what is there; free some space or make "
            f"it writable, then run `make lab` again")
    for note in outcome.notes:
        say(note)
    if outcome.unwritable and not outcome.failed and not outcome.notes:
        say(f"cannot be written ({outcome.unwritable}): Lab starts on it as it is")


def prepare_workspace(repo: Path | None = None, workspace: Path | None = None) -> Path:
    """Create or bring up to date the working copy and return its root (`repo / "work"` by
    default; `repo`: the clone the current directory is in), as the module docstring says,
    printing one line for each kind of thing it did or could not do. `FileNotFoundError`,
    `FileExistsError` or `OSError` (one line) only when there is no working copy to open."""
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
    inside = [f for f in safe_io.course_folders(repo) if workspace.resolve().is_relative_to(f)]
    if inside:
        raise FileExistsError(f"{workspace} leads into the course's own {inside[0].name}/ "
                              f"folder, where a learner's work must not go; remove the link "
                              f"and run `make lab` again")
    try:
        workspace.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"{workspace} cannot be made ({exc.strerror}): no working copy "
                                 f"to open; make its folder writable, or run `make lab` in a "
                                 f"clone you can write to") from None
    outcome = _Outcome()
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(safe_io.hold_folder(workspace, "`make lab`'s copy"))
        except safe_io.WriteFailed as exc:  # read-only: the copies below say what they could not
            outcome.unwritable = _why(exc)
        marker = f"{repo.resolve()}\n"
        with contextlib.suppress(OSError, ValueError):  # missing, a link, not a plain file
            with safe_io.open_regular(workspace / CLONE_MARKER, limit=1 << 16) as (f, size):
                if f.read(size).decode("utf-8") == marker:
                    marker = None
        if marker is not None:
            try:
                safe_io.write_text(workspace / CLONE_MARKER, marker, replace=True)
            except (OSError, ValueError) as exc:  # said with the copies that failed
                outcome.fail(CLONE_MARKER, exc)
        copies = _read_record(workspace, outcome)
        before = dict(copies)
        files = _course_files(repo)
        for folder in sorted({relative.parent for relative in files}):
            if (workspace / folder).is_dir() and not _linked(workspace, folder):
                _remove_dead_temporaries(workspace / folder)
        for relative in files:
            _sync(repo, workspace, relative, copies, outcome)
        if copies != before:
            try:  # if not, the next `make lab` recognises the copies by their contents
                safe_io.write_json(workspace / RECORD, {"files": copies}, replace=True)
            except (OSError, ValueError) as exc:
                outcome.fail(RECORD, exc)
    _report(workspace, outcome)
    return workspace


def lab_command(jupyter_args: Sequence[str]) -> list[str]:
    """`make lab`: the working copy prepared (`prepare_workspace`), the command line that
    starts JupyterLab on it, with what the learner should know printed. `FileNotFoundError`
    when JupyterLab or the course is missing; `OSError` when no working copy can be made."""
    import importlib.util

    if importlib.util.find_spec("jupyterlab") is None:
        raise FileNotFoundError("JupyterLab is not installed in this environment; run `make "
                                "lab` (it installs it), or `pip install -e '.[course]'`")
    root = prepare_workspace()
    extra = jupyter_args[1:] if jupyter_args[:1] == ["--"] else jupyter_args
    argv = lab_argv(root, extra)
    if "--allow-root" in argv:
        print("running as root (as in NVIDIA's containers): JupyterLab starts with --allow-root")
    print(f"JupyterLab on {root}: start with notebooks/01_naive_moe.ipynb", flush=True)
    return argv


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
