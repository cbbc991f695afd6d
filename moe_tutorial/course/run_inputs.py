"""What a course run is given, checked before anything runs: which notebooks (`find_notebooks`),
their parameters (`check_parameters`: the names their `parameters` cells define, each value of its
default's kind and of a size `lesson.setup` accepts), the device and the output folder
(`prepare_out_dir`: new or empty, or an earlier run's with `replace`, never inside the course's
own folders). Each refusal is one `RunError` line naming the input as it was given: the Python
API by its arguments (`PYTHON_API`), the command line by its flags (`COMMAND_LINE`), `make course`
by its variables (`MAKE_COURSE`).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ..locations import checkout_root, checkout_roots, package_dir
from ..precision.hardware import check_device as check
from ..safe_io import LOCK_NAME, write_text
from .lesson import COURSE_MODES, size_problem
from .report import source_text

NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"


def _course_folder(name: str) -> Path:
    """`name/` of the current directory, else that of the clone the current directory is in."""
    root = checkout_root()
    for candidate in (Path.cwd() / name, *([root / name] if root else [])):
        if candidate.is_dir():
            return candidate
    return Path.cwd() / name


def default_notebooks_dir() -> Path:
    """`notebooks/` of the current directory, else that of the clone the current directory is in."""
    return _course_folder("notebooks")


def find_notebooks(selection: list[str] | None = None, notebooks_dir: Path | None = None) -> list[Path]:
    """The course notebooks (`NN_*.ipynb`, in order), or the selected ones.

    A selection entry is a path to a notebook, or a name in the notebooks folder given in full
    (`01_naive_moe`, `01_naive_moe.ipynb`) or by its number (`01`).
    """
    folder = Path(notebooks_dir) if notebooks_dir else default_notebooks_dir()
    available = sorted(folder.glob(NOTEBOOK_GLOB)) if folder.is_dir() else []
    if not selection:
        return available
    chosen = []
    for entry in selection:
        path = Path(entry)
        if path.suffix == ".ipynb" and path.is_file():
            match = [path]
        else:
            stem = path.name.removesuffix(".ipynb")
            match = [nb for nb in available if nb.stem == stem or nb.stem.split("_", 1)[0] == stem]
        if len(match) != 1:
            names = ", ".join(nb.stem for nb in available) or f"none (no {folder})"
            raise ValueError(f"notebook {entry!r} not found{' uniquely' if match else ''}; "
                             f"course notebooks: {names}")
        if match[0] not in chosen:
            chosen.append(match[0])
    return chosen


class RunError(ValueError):
    """A run the runner refuses to start (the message says what is wrong and how to fix it)."""


@dataclass(frozen=True)
class InputNames:
    """How a run's messages name its inputs: the Python API by its arguments (`PYTHON_API`), the
    command line by its flags (`COMMAND_LINE`), so that each message names the fix in the words
    of whoever called."""

    notebooks: str
    out: str
    mode: str
    device: str
    live: str
    cell_timeout: str
    replace: str
    parameters: str
    solutions: str  # the builder's inputs
    exercises: str
    command_line: bool
    separator: str = " "  # between a flag and its value: `--out runs/mine`, `RUN_DIR=runs/mine`

    def given(self, what: str, value) -> str:
        """How `value` is given for the input `what`: `--out runs/mine` or `out_dir='runs/mine'`;
        a switch as `--replace` or `replace=True`."""
        name = getattr(self, what)
        value = str(value) if isinstance(value, Path) else value
        if self.command_line:
            return name if value is True else f"{name}{self.separator}{value}"
        return f"{name}={value!r}"

    def build(self, replace: bool = False) -> str:
        """How to run the build (again)."""
        if self.command_line:
            return f"`python -m moe_tutorial build{' --replace' if replace else ''}`"
        return f"`build_exercises({'replace=True' if replace else ''})`"

    def parameter(self, name: str, value) -> str:
        """One injected parameter: `-p STEPS=-5` or `parameters={'STEPS': -5}`."""
        return (f"-p {name}={value!r}" if self.command_line
                else f"{self.parameters}={{{name!r}: {value!r}}}")


PYTHON_API = InputNames(notebooks="notebooks", out="out_dir", mode="mode", device="device",
                        live="live", cell_timeout="cell_timeout", replace="replace",
                        parameters="parameters", solutions="solutions_dir",
                        exercises="exercises_dir", command_line=False)


COMMAND_LINE = InputNames(notebooks="--notebooks", out="--out", mode="--mode", device="--device",
                          live="--live", cell_timeout="--cell-timeout", replace="--replace",
                          parameters="-p", solutions="--solutions", exercises="--exercises",
                          command_line=True)


# `make course`, whose learner gives the folder as RUN_DIR and the flags in RUN_FLAGS (the
# Makefile sets $MOE_TUTORIAL_STARTED_BY=make on that command, so the runner knows).
STARTED_BY_ENV = "MOE_TUTORIAL_STARTED_BY"


MAKE_COURSE = dataclasses.replace(COMMAND_LINE, out="RUN_DIR", replace="RUN_FLAGS=--replace",
                                  separator="=")


# Parameters the runner sets itself, each from one input of its own (one source of truth: a
# `-p MODE=full` next to `--mode small` would run full under a report that says small).
RUNNER_PARAMETERS = {"MODE": "mode", "LIVE": "live", "DEVICE": "device"}


# What a run folder holds besides its files: which of them the runner wrote, so that --replace
# removes exactly those and nothing the learner put there.
RUN_MANIFEST = ".moe-tutorial-run.json"


def source_folders(*near: Path) -> list[Path]:
    """The course's own folders, which a run never writes into (those of the clone the current
    directory or `near` is in, its package source included)."""
    clone = [root / name for root in checkout_roots(*near)
             for name in ("notebooks", "exercises", "solutions", "moe_tutorial")]
    return [f.resolve() for f in (*clone, package_dir(), default_notebooks_dir())]


COMPUTED = object()  # a parameter whose default is not a literal (e.g. read from the environment)


# How a parameter's kind is named (bool before int: True is an int to isinstance).
KINDS = {bool: "True or False", int: "an integer", float: "a number", str: "text",
         list: "a list"}


def _code_cells(notebook: Path, names: InputNames = PYTHON_API) -> list[dict]:
    try:
        nb = json.loads(notebook.read_text(encoding="utf-8"))
        cells = [c for c in nb["cells"] if c.get("cell_type") == "code"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            AttributeError) as exc:
        raise RunError(f"{notebook} is not a readable notebook ({type(exc).__name__}: {exc}); "
                       f"open it in Jupyter and save it again, or leave it out of "
                       f"{names.notebooks}") from None
    return cells


def parameter_defaults(notebook: Path, names: InputNames = PYTHON_API) -> dict[str, object]:
    """The names a notebook's `parameters` cell assigns (what papermill can override), each with
    its default where that is a literal, else `COMPUTED`. The cell is the first one tagged
    `parameters`, the one papermill injects after: a name only a later cell assigns would undo
    the override, so it is not a parameter.

    Read with `ast`, not papermill's reader (`papermill.inspect_notebook`): papermill reads the
    cell a line at a time with a pattern that skips a chained assignment (`MODE = DEVICE = LIVE =
    ""`, in every chapter), gives each default as source text, and does not check that the cell
    is Python (one that is not would stop the notebook at its first cell: refused here in one
    line)."""
    cell = next((c for c in _code_cells(notebook, names)
                 if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if cell is None:
        return {}
    try:
        tree = ast.parse(source_text(cell.get("source", "")))
    except SyntaxError as exc:
        raise RunError(f"{notebook}: its parameters cell is not valid Python (line "
                       f"{exc.lineno}: {exc.msg}); fix that cell in Jupyter, or leave "
                       f"the notebook out of {names.notebooks}") from None
    defaults: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    defaults[target.id] = _literal(node.value)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defaults.setdefault(node.id, COMPUTED)
    return defaults


class _ParametersAlreadyChecked(logging.Filter):
    """papermill's two warnings about a notebook's parameters, which `check_parameters` has
    already checked against the names the cell assigns: papermill's reader skips a chained
    assignment ("Unable to parse line ...") and then calls its names unknown ("Passed unknown
    parameter ...")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(("Unable to parse line",
                                                   "Passed unknown parameter"))


@contextlib.contextmanager
def parameters_already_checked():
    """Within the block, papermill says nothing about parameters `check_parameters` passed."""
    loggers = [logging.getLogger("papermill"), logging.getLogger("papermill.translators")]
    quiet = _ParametersAlreadyChecked()
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def _literal_dicts(node: ast.AST) -> object:
    """A literal, where a dict may also be written `dict(name=literal, ...)`."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict"
            and not node.args and all(kw.arg for kw in node.keywords)):
        return {kw.arg: _literal_dicts(kw.value) for kw in node.keywords}
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_literal(k): _literal_dicts(v) for k, v in zip(node.keys, node.values)}
    return _literal(node)


def _literal(node: ast.AST) -> object:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return COMPUTED


def parameter_names(notebook: Path) -> set[str]:
    """The names a notebook's `parameters` cell assigns (what papermill can override)."""
    return set(parameter_defaults(notebook))


def _kind(value) -> type | None:
    return next((kind for kind in KINDS if isinstance(value, kind)), None)


def size_parameters(notebook: Path) -> dict[str, tuple[str, dict]]:
    """The parameters a notebook hands to `lesson.setup` as sizes: parameter name -> (the size's
    name, the notebook's literal `DEFAULTS` by mode), read from its code without running it, so
    that a run checks them (`lesson.size_problem`) before any notebook starts."""
    defaults, sizes = None, {}
    for cell in _code_cells(notebook):
        try:
            tree = ast.parse(source_text(cell.get("source", "")))
        except SyntaxError:  # IPython magics: not the cell that calls setup
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "DEFAULTS"):
                value = _literal_dicts(node.value)
                defaults = value if isinstance(value, dict) else defaults
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "setup"):
                sizes.update({kw.value.id: kw.arg for kw in node.keywords
                              if kw.arg and isinstance(kw.value, ast.Name)})
                sizes.update({kw.value.args[0].id: kw.arg for kw in node.keywords
                              if kw.arg and isinstance(kw.value, ast.Call) and kw.value.args
                              and isinstance(kw.value.args[0], ast.Name)})  # list(EXPERT_COUNTS)
    if not isinstance(defaults, dict) or sorted(defaults) != sorted(COURSE_MODES):
        return {}
    return {param: (size, defaults) for param, size in sizes.items()
            if all(isinstance(defaults[m], dict) and size in defaults[m] for m in COURSE_MODES)}


def check_parameter_size(name: str, value, mode: str, notebooks: list[Path],
                         names: InputNames = PYTHON_API) -> None:
    """Refuse a parameter value `lesson.setup` would refuse inside the notebook (a count below 1,
    a list of the wrong things), now, before any notebook runs."""
    if value in (0, "", [], None) or isinstance(value, bool):
        return  # empty: the mode's default, as setup reads it
    for notebook in notebooks:
        size, defaults = size_parameters(notebook).get(name, (None, None))
        if size is None:
            continue
        problem = size_problem(value, [defaults[m][size] for m in (mode, *COURSE_MODES)])
        if problem:
            wrong, example = problem
            raise RunError(f"{names.parameter(name, value)}: {name} {wrong} (in {notebook.name}); "
                           f"give e.g. {names.parameter(name, example)}, or 0 / empty for the "
                           f"{mode} mode's default {defaults[mode][size]!r}")


def check_parameter_kind(name: str, value, defaults: list, names: InputNames = PYTHON_API) -> None:
    """Refuse a -p value of another kind than the parameter's literal default in the notebooks
    (where they agree on one): `-p STEPS=ten` would reach the notebook as text."""
    kinds = {_kind(d) for d in defaults if d is not COMPUTED and d is not None}
    if len(kinds) != 1 or None in kinds:
        return
    kind = kinds.pop()
    fits = _kind(value) is kind or (kind is float and _kind(value) is int)
    if not fits:
        example = next(d for d in defaults if _kind(d) is kind)
        raise RunError(f"{names.parameter(name, value)}: {name} takes {KINDS[kind]}, like its "
                       f"default: {names.parameter(name, example)}")


def check_parameters(parameters: dict, notebooks: list[Path], mode: str = "small",
                     names: InputNames = PYTHON_API) -> None:
    """Refuse a parameter the runner sets from its own input, one no selected notebook has (it
    would be injected and silently ignored), one of another kind than its default, or a size
    `lesson.setup` would refuse in `mode`."""
    if not isinstance(parameters, dict) or not all(isinstance(n, str) for n in parameters):
        raise RunError(f"{names.parameters} {parameters!r} is not a set of NAME=VALUE pairs; "
                       f"give e.g. {names.parameter('SEED', 1)}")
    for name, value in parameters.items():
        if name in RUNNER_PARAMETERS:
            own = RUNNER_PARAMETERS[name]
            if names.command_line:
                drop = f"drop -p {name} and " + (f"leave {names.live} out" if own == "live" and not value
                                                 else f"use {names.given(own, value)}")
            else:
                drop = f"drop {name!r} from {names.parameters} and pass {names.given(own, value)}"
            setter = getattr(names, own) if names.command_line else f"the argument {getattr(names, own)}"
            raise RunError(f"{names.parameter(name, value)}: {name} is set by {setter}, "
                           f"not by {names.parameters}; {drop}")
    defaults = [parameter_defaults(nb, names) for nb in notebooks]
    known = set().union(*defaults) - set(RUNNER_PARAMETERS)
    unknown = sorted(set(parameters) - known)
    if unknown:
        raise RunError(f"{names.parameter(unknown[0], parameters[unknown[0]])}: no selected "
                       f"notebook has a parameter {unknown[0]!r}; their parameters are "
                       f"{', '.join(sorted(known)) or 'none'}")
    for name, value in parameters.items():
        check_parameter_kind(name, value, [d[name] for d in defaults if name in d], names)
        check_parameter_size(name, value, mode, notebooks, names)


def check_device(device: str, name: str = "device") -> None:
    """Refuse a device the notebooks cannot run on here, before any of them starts
    (`hardware.check_device`, as a RunError)."""
    try:
        check(device, name)
    except ValueError as exc:
        raise RunError(str(exc)) from None


def check_out_dir(out_dir: Path, sources: list[Path] = (), names: InputNames = PYTHON_API) -> None:
    """Refuse an `out_dir` a run must never write into: inside the course's own folders, the
    folder of a notebook it runs, or a file."""
    out_dir = Path(out_dir)
    where = out_dir.resolve()
    out, mine = names.given("out", out_dir), names.given("out", "runs/mine")
    for folder in source_folders(where):
        if where == folder or where.is_relative_to(folder):
            raise RunError(f"{out} is inside the course's own {folder.name}/ folder, "
                           f"which a run never writes into; give a folder of its own, e.g. {mine}")
    for source in sources:
        if (where / source.name).resolve() == source.resolve():
            raise RunError(f"{out} would overwrite the notebook {source} it runs; "
                           f"give another folder, e.g. {mine}")
    if out_dir.exists() and not out_dir.is_dir():
        raise RunError(f"{out} is a file, not a folder; give a new folder, e.g. {mine}")


def prepare_out_dir(out_dir: Path, files: list[str], sources: list[Path] = (), *,
                    replace: bool = False, names: InputNames = PYTHON_API) -> None:
    """Make `out_dir` ready for a run that writes `files` (names in it), or refuse.

    A run writes into a new or empty folder outside the course's own folders (`check_out_dir`).
    With `replace`, a folder of an earlier run is accepted: the files that run wrote (its
    manifest) are removed, its report first, so no old report outlives the notebooks it
    describes; nothing else is touched. The manifest of this run is written before any
    notebook. The folder's lock file (`safe_io.hold_folder`) is not a file of a run."""
    check_out_dir(out_dir, sources, names)
    out_dir = Path(out_dir)
    out, mine, again = names.given("out", out_dir), names.given("out", "runs/mine"), names.given("replace", True)
    present = sorted(p.name for p in out_dir.iterdir() if p.name != LOCK_NAME) if out_dir.is_dir() else []
    if present:
        manifest = out_dir / RUN_MANIFEST
        if not replace:
            raise RunError(f"{out} is not empty (it holds {', '.join(present[:3])}"
                           f"{', ...' if len(present) > 3 else ''}); give a new folder, or add "
                           f"{again} to replace an earlier run there")
        try:
            made = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            raise RunError(f"{out} is not a folder this runner wrote (no readable "
                           f"{RUN_MANIFEST}), so {again} leaves it alone; give a new folder, "
                           f"e.g. {mine}") from None
        foreign = sorted(set(files) & (set(present) - set(made)))
        if foreign:
            raise RunError(f"{out} holds {foreign[0]}, which the runner did not write "
                           f"and {again} does not overwrite; move it away or give a new folder")
        # report.html first: a run stopped from here on leaves no report of the old run
        for name in sorted(made, key=lambda n: n != "report.html"):
            if Path(name).name == name:  # a plain name in this folder, never a path elsewhere
                (out_dir / name).unlink(missing_ok=True)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_text(out_dir / RUN_MANIFEST, json.dumps(
            {"written_by": "python -m moe_tutorial run", "files": sorted(files)}, indent=1) + "\n",
            replace=True)
    except OSError as exc:
        raise RunError(f"{out} cannot be written ({exc.strerror or exc}); "
                       "give a folder you can write to") from None
