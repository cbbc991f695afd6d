"""Run the course headless: execute the notebooks in order with papermill, write one HTML report.

    python -m moe_tutorial run [--mode small|full] [--notebooks 00 01 ...] [--out DIR] [--replace]

executes `notebooks/NN_*.ipynb` in order, each in a fresh kernel of this Python interpreter, with
the parameters `MODE`, `LIVE` (and `DEVICE` when given) injected by papermill after the cell
tagged `parameters` (the same values are also in the kernel's environment as
`MOE_TUTORIAL_MODE`, `MOE_TUTORIAL_LIVE`, `MOE_TUTORIAL_DEVICE`). It stops at the first notebook
that fails and prints its error. While it runs it prints a line as each code cell starts (which
notebook, which cell, its first line, the time in that notebook and in the whole run) and, every
HEARTBEAT_S seconds a cell runs on, a line saying it still runs: plain lines, readable in a CI log.

It writes to DIR the executed notebooks, next to each an HTML rendering of it (`NN_name.html`,
nbconvert's HTML exporter: readable in a browser without Jupyter; its plotly figures are drawn by
`plotly.min.js`, written once next to them) and, last and atomically, `DIR/report.html`: one
self-contained page (plotly.js inlined, no network needed) with this machine's capability table,
every notebook's closing outputs (the cells tagged `closing`: a table and a figure), run times
(the slowest cells too), links to the HTML renderings and the versions of everything that ran.

DIR must be new or empty and outside the course's own folders (notebooks/, exercises/,
solutions/, the package): a run never overwrites results or sources. `--replace` accepts the
folder of an earlier run instead: it removes the files that run wrote, as listed in its
`.moe-tutorial-run.json` (report first), and nothing else. `-p NAME=VALUE` sets a parameter the
selected notebooks' `parameters` cells define; MODE, LIVE and DEVICE come from --mode, --live
and --device only. Bad inputs are refused before anything runs, with one line: a parameter of
another kind than its default, or a size the notebook's `lesson.setup` would refuse (STEPS=-3).
The Python API (`run_course`, `prepare_run`, `build_exercises`) names its own arguments in
these messages (`replace=True`), the command line its flags (`--replace`).

Widgets: headless nobody watches a live dashboard, so the runner passes `LIVE=False` and
`MOE_TUTORIAL_LIVE=0` (`--live` draws them anyway, e.g. to test them), and papermill runs with
`store_widget_state=False`, so an executed notebook (and its HTML rendering) stays small instead of
embedding plotly.js in widget state: a displayed `FigureWidget` stores ~5 MB of it otherwise.

Exercises from solutions
------------------------

    python -m moe_tutorial build [--check]

writes `exercises/NN_*.ipynb` from `solutions/NN_*.ipynb`, the single source of both. In a
solutions notebook, a *solution region* is a block of lines inside a function body (indented),
opened by `### BEGIN SOLUTION`, followed at once by a one-line `### HINT: <text>`, and closed by
`### END SOLUTION`:

    def route(logits, top_k):
        ### BEGIN SOLUTION
        ### HINT: softmax in float32 over the experts, torch.topk, divide the k weights by their sum
        probs = torch.softmax(logits.float(), dim=-1)
        ...
        ### END SOLUTION

In the exercise each region becomes two lines at the region's indentation,

        # YOUR CODE HERE (replace this line and the next; then run the check below)
        raise NotImplementedError("softmax in float32 over the experts, torch.topk, divide ...")

so the exercise notebook still runs top to bottom: defining the function raises nothing, calling it
raises NotImplementedError, which `moe_tutorial.course.checks` reports as "not implemented yet".
Two cell tags keep what only the solution should hold out of the exercise: a markdown cell tagged
`answer` (the model answer to an open question) becomes, in place, a cell that invites the
learner's own answer (`ANSWER_STUB`); a cell tagged `solution-only` (a note for the course's
authors) is left out. Every other cell, line and piece of metadata is copied unchanged, except what
running a notebook leaves behind: outputs, execution counts, cell timings (`execution`) and the notebook's `widgets` /
`papermill` metadata are stripped. The output is deterministic (byte-identical on every run). A
region outside a function body, without its hint, unclosed or nested is an error that names the
notebook, cell and line. `--check` writes nothing and fails (exit 1) when `exercises/` differs from
what the build would write, saying which file and how to fix it; CI runs it (tests/test_build.py).

A learner's work is never overwritten. Each exercise carries, in its metadata (`moe_tutorial_build`),
a hash of its cells' sources as the build wrote them; the build replaces an exercise only while
its cells still match (outputs do not count), and otherwise writes nothing and says which
notebook holds edits (`--replace` overwrites them). It never writes into solutions/, notebooks/
or the package, nor into a folder that holds files it did not write. Stale exercises (no solution
of that name any more) are deleted by the build when unchanged, kept otherwise; --check reports both.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime as _dt
import hashlib
import html
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..locations import checkout_root, checkout_roots, import_root, package_dir
from ..moe.config import COURSE_MODES, MODE_ENV, course_mode
from ..precision.hardware import DEVICE_ENV, capabilities
from ..precision.hardware import check_device as check
from ..safe_io import LOCK_NAME, FolderBusy, WriteFailed, hold_folder, write_text
from .lesson import size_problem

NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"
CLOSING_TAG = "closing"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
BUDGET_S = {"small": 120, "full": 300}  # per notebook: 2 CPU cores / one H200
CELL_TIMEOUT_S = {"small": 300, "full": 600}
KERNEL_NAME = "python3"
HEARTBEAT_S = 30.0  # a cell running longer than this gets a "still running" line this often
PLOTLY_JS = "plotly.min.js"  # next to the HTML renderings, which load it (report.html inlines it)
ENGINE_NAME = "moe_tutorial"  # papermill's nbclient engine, reporting each cell as it starts
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class NotebookRun:
    name: str
    source: Path
    output: Path
    status: str = "not run"  # ok | failed | not run
    seconds: float = 0.0
    error: str = ""  # the failing cell's error, traceback included (ANSI colours removed)
    failed_cell: int | None = None  # execution count of the failing cell
    html_error: str = ""  # why the HTML rendering could not be written, when it could not

    @property
    def html(self) -> Path:
        """The HTML rendering of the executed notebook, next to it."""
        return self.output.with_suffix(".html")


@dataclass
class CourseRun:
    mode: str
    out_dir: Path
    parameters: dict
    runs: list[NotebookRun] = field(default_factory=list)
    started: str = ""
    seconds: float = 0.0
    kernel: str = KERNEL_NAME
    note: str = ""
    cell_timeout: int = CELL_TIMEOUT_S["small"]  # seconds one cell may run
    # The hold on out_dir (`safe_io.hold_folder`) from `prepare_run` until `release`.
    holding: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    @property
    def ok(self) -> bool:
        return all(r.status == "ok" for r in self.runs)

    def release(self) -> None:
        """Let another run write into out_dir (`execute_run` does this when it ends)."""
        self.holding.close()

    @property
    def report(self) -> Path:
        return self.out_dir / "report.html"


# ---------------------------------------------------------------------------------------------
# Which notebooks

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


# ---------------------------------------------------------------------------------------------
# The kernel

def _same_interpreter(argv0: str) -> bool:
    major, minor = sys.version_info[:2]
    if argv0 in {"python", f"python{major}", f"python{major}.{minor}"}:
        return True  # jupyter_client starts sys.executable for these names
    try:
        return Path(argv0).resolve() == Path(sys.executable).resolve()
    except OSError:
        return False


@contextlib.contextmanager
def kernel_for_this_python():
    """Yield the name of a kernelspec that starts this interpreter (`sys.executable`).

    `python3` when it does (the usual case: its argv[0] is `python`, which jupyter_client
    replaces by sys.executable); otherwise a temporary kernelspec, made visible through
    JUPYTER_PATH for the duration, so the notebooks never run in some other environment.
    """
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
        if spec.argv and _same_interpreter(spec.argv[0]):
            yield KERNEL_NAME
            return
    except NoSuchKernel:
        pass
    name = "moe-tutorial-python"
    with tempfile.TemporaryDirectory(prefix="moe-kernel-") as tmp:
        spec_dir = Path(tmp) / "kernels" / name
        spec_dir.mkdir(parents=True)
        (spec_dir / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"Python {platform.python_version()} ({sys.executable})",
            "language": "python"}))
        with _environment(JUPYTER_PATH=os.pathsep.join(
                p for p in (tmp, os.environ.get("JUPYTER_PATH")) if p)):
            yield name


@contextlib.contextmanager
def _environment(**values):
    """Set environment variables (None removes one) for the duration; kernels inherit them."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------------------------------
# Running

def _strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def _describe_error(exc: BaseException) -> tuple[str, int | None]:
    """A readable error and the failing cell's execution count, from papermill's exception."""
    ename = getattr(exc, "ename", None)
    if ename is not None:  # papermill.PapermillExecutionError: the error the cell raised
        trace = _strip_ansi("\n".join(getattr(exc, "traceback", None) or [])).rstrip()
        last = f"{ename}: {_strip_ansi(str(exc.evalue))}"
        if not trace.endswith(last):
            trace = f"{trace}\n{last}".strip()
        return trace, getattr(exc, "exec_count", None)
    return f"{type(exc).__name__}: {_strip_ansi(str(exc))}", None


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

    def given(self, what: str, value) -> str:
        """How `value` is given for the input `what`: `--out runs/mine` or `out_dir='runs/mine'`;
        a switch as `--replace` or `replace=True`."""
        name = getattr(self, what)
        value = str(value) if isinstance(value, Path) else value
        if self.command_line:
            return name if value is True else f"{name} {value}"
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
    its default where that is a literal, else `COMPUTED`."""
    cells = _code_cells(notebook, names)
    defaults: dict[str, object] = {}
    for cell in cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            with contextlib.suppress(SyntaxError):
                for node in ast.walk(ast.parse(_text(cell.get("source", "")))):
                    if isinstance(node, ast.Assign):
                        for target in node.targets:
                            if isinstance(target, ast.Name):
                                defaults[target.id] = _literal(node.value)
                    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                        defaults.setdefault(node.id, COMPUTED)
    return defaults


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
            tree = ast.parse(_text(cell.get("source", "")))
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


def prepare_run(notebooks: list[Path], out_dir: Path, *, mode: str | None = None,
                device: str | None = None, live: bool = False, cell_timeout: int | None = None,
                parameters: dict | None = None, replace: bool = False,
                names: InputNames = PYTHON_API) -> CourseRun:
    """Check a run's inputs and make its folder ready (`prepare_out_dir`); raise RunError (or
    ValueError for the mode) before anything runs. `execute_run` runs what this returns.
    `names`: how the messages name the inputs (the command line passes `COMMAND_LINE`)."""
    mode = course_mode(mode, name=names.mode if names.command_line else f"argument {names.mode}")
    out_dir = Path(out_dir)
    out = names.given("out", out_dir)
    if cell_timeout is not None and (isinstance(cell_timeout, bool) or not isinstance(cell_timeout, int)
                                     or cell_timeout <= 0):
        raise RunError(f"{names.given('cell_timeout', cell_timeout)} is not a positive number of "
                       f"seconds; give e.g. {names.given('cell_timeout', CELL_TIMEOUT_S[mode])}")
    if not isinstance(live, bool):  # the command line's switch is True or False, nothing else
        raise RunError(f"{names.given('live', live)} is not True or False; pass "
                       f"{names.given('live', True)} to draw the live widgets, or leave it out")
    if device:
        check_device(device, names.device)
    elif os.environ.get(DEVICE_ENV):  # what the notebooks' `parameters` cells read instead
        check_device(os.environ[DEVICE_ENV], f"${DEVICE_ENV}")
    files = [nb.name for nb in notebooks]
    twice = sorted({n for n in files if files.count(n) > 1})
    if twice:
        raise RunError(f"two selected notebooks are named {twice[0]}, and both would be written to "
                       f"{out_dir / twice[0]}; run them in separate runs")
    check_parameters({} if parameters is None else parameters, notebooks, mode, names)
    written = [name for nb in notebooks for name in (nb.name, nb.with_suffix(".html").name)]
    params = {"MODE": mode, "LIVE": bool(live)}
    if device:
        params["DEVICE"] = device
    params.update(parameters or {})
    course = CourseRun(mode=mode, out_dir=out_dir, parameters=params,
                       cell_timeout=cell_timeout or CELL_TIMEOUT_S[mode])
    course.runs = [NotebookRun(nb.stem, nb, out_dir / nb.name) for nb in notebooks]
    check_out_dir(out_dir, notebooks, names)  # refused before hold_folder would make the folder
    try:
        # One run per folder, from here until execute_run ends: a second run would remove
        # this one's files (--replace) or mix its notebooks with them.
        course.holding.enter_context(hold_folder(out_dir, "course run"))
    except FolderBusy as exc:
        raise RunError(f"{out}: {exc}") from None
    except WriteFailed as exc:
        raise RunError(f"{out} cannot be written "
                       f"({os.strerror(exc.errno) if exc.errno else exc}); "
                       "give a folder you can write to") from None
    try:
        prepare_out_dir(out_dir, written + [PLOTLY_JS, "report.html"], notebooks, replace=replace,
                        names=names)
    except BaseException:
        course.release()
        raise
    return course


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"


class CellProgress:
    """The lines a run prints while it runs: one as each code cell starts, and one every
    HEARTBEAT_S seconds while a cell runs on, so that a long cell never looks like a hang. Plain
    lines through `echo`, flushed: a CI log without a terminal shows them as they come."""

    def __init__(self, echo=print, clock=time.monotonic):
        self.echo, self.clock = echo, clock
        self.run_start = clock()
        self.prefix, self.where = "", ""
        self.notebook_start = self.cell_start = self.next_beat = None
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None

    def _times(self, now: float) -> str:
        return (f"{_duration(now - self.notebook_start)} in this notebook, "
                f"{_duration(now - self.run_start)} in all")

    @contextlib.contextmanager
    def notebook(self, prefix: str):
        """Report on the cells of one notebook (`prefix`: e.g. "[2/9] 02_grouped_linear")."""
        self.prefix, self.notebook_start, self.cell_start = prefix, self.clock(), None
        self._stop = threading.Event()
        beats = threading.Thread(target=self._beat, args=(self._stop,), daemon=True,
                                 name="moe-tutorial-progress")
        beats.start()
        try:
            yield self
        finally:
            self._stop.set()
            beats.join()
            self.cell_start = None

    def cell_started(self, nb, cell, index: int) -> None:
        """papermill starts cell `index` of `nb` (markdown cells say nothing)."""
        if cell.get("cell_type") != "code":
            return
        code = [i for i, c in enumerate(nb.cells) if c.get("cell_type") == "code"]
        first = next((line.strip() for line in _text(cell.get("source", "")).splitlines()
                      if line.strip()), "")
        with self._lock:
            now = self.clock()
            self.where = f"cell {code.index(index) + 1}/{len(code)}"
            self.cell_start, self.next_beat = now, now + HEARTBEAT_S
            shown = first if len(first) <= 60 else first[:57] + "..."
            self.echo(f"{self.prefix} · {self.where} · {self._times(now)} · {shown}", flush=True)

    def beat(self) -> None:
        """Say so when the current cell has run HEARTBEAT_S seconds more since the last line."""
        with self._lock:
            now = self.clock()
            if self.cell_start is None or now < self.next_beat:
                return
            self.next_beat = now + HEARTBEAT_S
            self.echo(f"{self.prefix} · {self.where} still running, "
                      f"{_duration(now - self.cell_start)} so far · {self._times(now)}", flush=True)

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(min(1.0, HEARTBEAT_S / 4)):
            self.beat()


def _progress_engine():
    """papermill's nbclient engine, calling `on_cell_start(nb, cell, index)` as each cell starts
    (registered as ENGINE_NAME; papermill passes the keyword through to it)."""
    from papermill.engines import NBClientEngine

    class ProgressEngine(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, on_cell_start=None, **kwargs):
            if on_cell_start is not None:
                start = nb_man.cell_start

                def cell_start(cell, cell_index=None, **more):
                    on_cell_start(nb_man.nb, cell, cell_index)
                    return start(cell, cell_index, **more)

                nb_man.cell_start = cell_start
            return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)

    return ProgressEngine


def plotly_html(spec: dict, div: str) -> str:
    """A plotly figure's JSON (PLOTLY_MIME) as a div and the script that draws it (plotly.js must
    be loaded before it)."""
    payload = json.dumps([spec.get("data", []), spec.get("layout", {}),
                          {"displaylogo": False, "responsive": True}]).replace("</", "<\\/")
    return (f'<div id="{div}" class="plot"></div><script>'
            f'Plotly.newPlot("{div}", ...{payload});</script>')


def write_html(run: NotebookRun) -> Path:
    """Write `run.html`, the executed notebook rendered by nbconvert's HTML exporter, atomically.

    nbconvert has no renderer for plotly's JSON, so each figure is given an HTML form that
    draws it with PLOTLY_JS, the file next to the page; images the markdown links to (the
    notebook's `figures/`) are embedded, since the page does not live next to them."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(run.output, as_version=4)
    figures = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            spec = output.get("data", {}).get(PLOTLY_MIME)
            if spec is not None:
                figures += 1
                output["data"]["text/html"] = plotly_html(spec, f"figure-{figures}")
    exporter = HTMLExporter(embed_images=True)
    page, _ = exporter.from_notebook_node(
        nb, resources={"metadata": {"name": run.name, "path": str(run.source.parent)}})
    if figures:
        page = page.replace("</head>", f'<script src="{PLOTLY_JS}"></script>\n</head>', 1)
    write_text(run.html, page, replace=True)
    return run.html


def _write_plotly_js(out_dir: Path) -> str:
    """Write PLOTLY_JS into `out_dir` for the HTML renderings; "" or why it could not be."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        return "plotly is not installed: the HTML renderings show their figures as text"
    write_text(out_dir / PLOTLY_JS, get_plotlyjs(), replace=True)
    return ""


def execute_run(course: CourseRun, *, log_output: bool = False, echo=print) -> CourseRun:
    """Execute a prepared run's notebooks in order with papermill; stop at the first failure.
    Writes the executed notebooks, each one's HTML rendering and, last, `report.html`; prints a
    line as each cell starts (`CellProgress`); returns `course`, filled in. Its folder is
    released for another run when this returns or raises."""
    try:
        return _execute(course, log_output=log_output, echo=echo)
    finally:
        course.release()


def _execute(course: CourseRun, *, log_output: bool, echo) -> CourseRun:
    import papermill
    from papermill.engines import papermill_engines

    papermill_engines.register(ENGINE_NAME, _progress_engine())
    progress = CellProgress(echo)
    if course.runs:
        missing_js = _write_plotly_js(course.out_dir)
        if missing_js:
            echo(missing_js)
    course.started = _dt.datetime.now().isoformat(timespec="seconds")
    params = course.parameters
    pythonpath = os.pathsep.join(p for p in (str(import_root()), os.environ.get("PYTHONPATH")) if p)
    env = {MODE_ENV: course.mode, "MOE_TUTORIAL_LIVE": "always" if params["LIVE"] else "0",
           DEVICE_ENV: params.get("DEVICE") or os.environ.get(DEVICE_ENV),
           "PYTHONPATH": pythonpath,
           "JPY_SESSION_NAME": None}  # headless, even when started from a Jupyter kernel
    start = time.perf_counter()
    with _environment(**env), kernel_for_this_python() as kernel:
        course.kernel = kernel
        for i, run in enumerate(course.runs, start=1):
            echo(f"[{i}/{len(course.runs)}] {run.name} ...", flush=True)
            t0 = time.perf_counter()
            try:
                with progress.notebook(f"[{i}/{len(course.runs)}] {run.name}"):
                    papermill.execute_notebook(
                        str(run.source), str(run.output), parameters=params, kernel_name=kernel,
                        cwd=str(run.source.parent), execution_timeout=course.cell_timeout,
                        store_widget_state=False, progress_bar=False, log_output=log_output,
                        engine_name=ENGINE_NAME, on_cell_start=progress.cell_started)
                run.status = "ok"
            except Exception as exc:  # papermill raises on the first error output of a cell
                run.status = "failed"
                run.error, run.failed_cell = _describe_error(exc)
            run.seconds = time.perf_counter() - t0
            if run.output.exists():  # the failing cell's error in place, too
                try:
                    write_html(run)
                except Exception as exc:  # the run's results stand without their rendering
                    run.html_error = f"{type(exc).__name__}: {_strip_ansi(str(exc))}"
                    echo(f"[{i}/{len(course.runs)}] {run.name}: no HTML rendering "
                         f"({run.html_error}); the executed notebook is {run.output}")
            if run.status == "ok":
                echo(f"[{i}/{len(course.runs)}] {run.name}: ok in {run.seconds:.1f} s"
                     + (f" → {run.html}" if run.html.exists() else ""))
                continue
            where = f" in cell [{run.failed_cell}]" if run.failed_cell else ""
            echo(f"[{i}/{len(course.runs)}] {run.name}: FAILED after {run.seconds:.1f} s{where}")
            echo(run.error)
            rest = [r.name for r in course.runs[i:]]
            echo(f"Stopped at {run.name}" + (f"; not run: {', '.join(rest)}" if rest else "")
                 + f". The executed notebook, with the error in place: {run.output}")
            break
    course.seconds = time.perf_counter() - start
    write_report(course)
    return course


def run_course(notebooks: list[Path], out_dir: Path, *, mode: str | None = None,
               device: str | None = None, live: bool = False, cell_timeout: int | None = None,
               parameters: dict | None = None, log_output: bool = False, replace: bool = False,
               echo=print) -> CourseRun:
    """Execute `notebooks` in order into `out_dir` with papermill; stop at the first failure.

    Injected parameters: MODE, LIVE, DEVICE (when given) and `parameters`. Writes the executed
    notebooks and, last, `out_dir/report.html`; returns what happened (see `CourseRun`).
    `out_dir` must be new or empty, or, with `replace`, an earlier run's (`prepare_out_dir`).
    Raises RunError for a bad folder, device, parameter or timeout before anything runs.
    """
    course = prepare_run(notebooks, out_dir, mode=mode, device=device, live=live,
                         cell_timeout=cell_timeout, parameters=parameters, replace=replace)
    return execute_run(course, log_output=log_output, echo=echo)


# ---------------------------------------------------------------------------------------------
# The report

REPORT_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1150px;
 padding:0 1em;color:#1f2328;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em} h2{margin-top:2em;border-bottom:1px solid #d0d7de;padding-bottom:.2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em} caption{text-align:left;font-weight:600;padding:.3em 0}
th,td{border:1px solid #d0d7de;padding:.25em .6em;vertical-align:top} th{background:#f6f8fa}
pre{background:#f6f8fa;padding:.6em;overflow-x:auto;font-size:.85em;white-space:pre-wrap}
pre.error{background:#fff0f0;border-left:4px solid #d1242f}
.ok{color:#1a7f37;font-weight:600} .failed{color:#d1242f;font-weight:600} .notrun{color:#6e7781}
.native{color:#1a7f37} .fallback{color:#9a6700} .unavailable{color:#d1242f}
.muted{color:#6e7781;font-size:.9em} .moe-table-note{color:#6e7781;font-size:.85em;margin-top:0}
"""


def closing_outputs(nb) -> list[dict]:
    """The outputs of the cells tagged `closing`, in order."""
    outputs = []
    for cell in nb.cells:
        if cell.cell_type == "code" and CLOSING_TAG in cell.get("metadata", {}).get("tags", []):
            outputs.extend(cell.get("outputs", []))
    return outputs


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


class _FigureCounter:
    def __init__(self):
        self.count = 0


def render_output(output: dict, figures: _FigureCounter) -> str:
    """One notebook output as HTML for the report (plotly JSON becomes a live plot)."""
    kind = output.get("output_type")
    if kind == "stream":
        return f'<pre class="stream">{html.escape(_strip_ansi(_text(output.get("text", ""))))}</pre>'
    if kind == "error":
        trace = _strip_ansi("\n".join(output.get("traceback", [])))
        return f'<pre class="error">{html.escape(trace)}</pre>'
    data = output.get("data", {})
    if PLOTLY_MIME in data:
        figures.count += 1
        return plotly_html(data[PLOTLY_MIME], f"figure-{figures.count}")
    if "text/html" in data:
        return _text(data["text/html"])
    for image in ("image/png", "image/jpeg"):
        if image in data:
            b64 = _text(data[image]).replace("\n", "")
            return f'<img alt="figure" src="data:{image};base64,{b64}">'
    if "image/svg+xml" in data:
        return _text(data["image/svg+xml"])
    if WIDGET_MIME in data:
        return ""  # a live widget: its final state is the static output that follows it
    if "text/plain" in data:
        return f"<pre>{html.escape(_strip_ansi(_text(data['text/plain'])))}</pre>"
    return ""


def _versions() -> list[tuple[str, str]]:
    rows = [("python", f"{platform.python_version()} ({sys.executable})"),
            ("platform", f"{platform.platform()}, {os.cpu_count()} CPU cores")]
    for dist in ("moe_tutorial", "torch", "transformers", "transformer_engine", "papermill",
                 "nbclient", "nbformat", "ipykernel", "plotly", "ipywidgets", "anywidget",
                 "jupyterlab"):
        version = None
        for name in (dist, dist.replace("_", "-")):
            try:
                version = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        rows.append((dist, version or "not installed"))
    root = checkout_root()
    if root is None:  # an installed package run outside a clone has no commit to name
        return rows
    try:
        commit = subprocess.run(["git", "-C", str(root), "describe", "--always",
                                 "--dirty"], capture_output=True, text=True, timeout=10)
        if commit.returncode == 0 and commit.stdout.strip():
            rows.append(("course commit", commit.stdout.strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    return rows


def _capability_html() -> str:
    caps = capabilities()
    rows = "".join(
        f'<tr><td>{html.escape(f.title)}</td><td class="{f.status}">{f.status}</td>'
        f"<td>{html.escape(f.runs)}</td><td>{html.escape(f.reason)}</td></tr>"
        for f in caps.features.values())
    return (f"<pre>{html.escape(caps.describe_machine())}</pre>"
            '<table class="capabilities"><thead><tr><th>feature</th><th>status</th>'
            f"<th>what runs</th><th>why</th></tr></thead><tbody>{rows}</tbody></table>")


def _cell_times(nb, top: int = 3) -> list[tuple[float, int, str]]:
    times = []
    for cell in nb.cells:
        duration = cell.get("metadata", {}).get("papermill", {}).get("duration")
        if cell.cell_type == "code" and duration:
            first = next((line for line in cell.source.splitlines() if line.strip()), "")
            times.append((float(duration), cell.get("execution_count") or 0, first[:80]))
    return sorted(times, reverse=True)[:top]


def write_report(course: CourseRun) -> Path:
    """Write `report.html` for a course run (also for a failed or empty one)."""
    import nbformat

    figures = _FigureCounter()
    budget = BUDGET_S[course.mode]
    summary, sections = [], []
    for run in course.runs:
        status_class = {"ok": "ok", "failed": "failed"}.get(run.status, "notrun")
        within = ("" if run.status == "not run"
                  else ("yes" if run.seconds <= budget else f"no (> {budget} s)"))
        link = (f'<a href="{html.escape(run.html.name)}">{html.escape(run.html.name)}</a>'
                if run.html.exists() else
                f"not rendered ({html.escape(run.html_error)}): {html.escape(run.output.name)}"
                if run.html_error else "")
        summary.append(f"<tr><td>{html.escape(run.name)}</td><td class='{status_class}'>"
                       f"{run.status}</td><td style='text-align:right'>"
                       f"{run.seconds:.1f}</td><td>{within}</td><td>{link}</td></tr>")
        if run.status == "not run":
            continue
        body = [f"<h2 id='{html.escape(run.name)}'>{html.escape(run.name)} "
                f"<span class='{status_class}'>{run.status}</span> "
                f"<span class='muted'>{run.seconds:.1f} s</span></h2>"]
        if run.error:
            cell = f" in cell [{run.failed_cell}]" if run.failed_cell else ""
            body.append(f"<p class='failed'>Failed{cell}:</p>"
                        f"<pre class='error'>{html.escape(run.error)}</pre>")
        if run.output.exists():
            nb = nbformat.read(run.output, as_version=4)
            slow = _cell_times(nb)
            if slow:
                body.append("<p class='muted'>slowest cells: " + "; ".join(
                    f"[{count}] {seconds:.1f} s <code>{html.escape(first)}</code>"
                    for seconds, count, first in slow) + "</p>")
            outputs = closing_outputs(nb)
            if outputs:
                body.extend(render_output(o, figures) for o in outputs)
            elif run.status == "ok":
                body.append(f"<p class='muted'>(no cell tagged '{CLOSING_TAG}')</p>")
        sections.append("\n".join(body))

    plotly_js = ""
    if figures.count:
        try:
            from plotly.offline import get_plotlyjs

            plotly_js = f"<script>{get_plotlyjs()}</script>"
        except ImportError:
            plotly_js = ("<p class='failed'>plotly is not installed where the report was written:"
                         " figures cannot be drawn.</p>")
    n_ok = sum(r.status == "ok" for r in course.runs)
    verdict = ("<span class='ok'>all notebooks ran</span>" if course.runs and course.ok
               else f"<span class='failed'>{n_ok} of {len(course.runs)} notebooks ran</span>"
               if course.runs else "<span class='notrun'>no notebooks</span>")
    params = ", ".join(f"{k}={v!r}" for k, v in course.parameters.items())
    versions = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>"
                       for k, v in _versions())
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>MoE course run {html.escape(course.started)} ({course.mode})</title>
<style>{REPORT_CSS}</style>{plotly_js}</head><body>
<h1>Training MoE models fast with Transformer Engine — course run</h1>
<p>{html.escape(course.started)} · mode <b>{course.mode}</b> · {verdict} · {course.seconds:.0f} s in total
 · kernel <code>{html.escape(course.kernel)}</code> · parameters <code>{html.escape(params)}</code></p>
{f"<p>{html.escape(course.note)}</p>" if course.note else ""}
<h2>What this machine can run</h2>
{_capability_html()}
<h2>Notebooks</h2>
<table><thead><tr><th>notebook</th><th>status</th><th>seconds</th>
<th>within the {course.mode}-mode budget ({budget} s)?</th><th>the executed notebook</th></tr></thead>
<tbody>{"".join(summary)}</tbody></table>
<p class="muted">Seconds include starting the notebook's kernel. Each link opens the executed
notebook as a web page (its <code>.ipynb</code>, next to it, opens in Jupyter). Every number below was
computed in this run, on this machine; figures quoted from elsewhere name their source in the notebooks.</p>
{"".join(sections)}
<h2>Versions</h2>
<table><tbody>{versions}</tbody></table>
<p class="muted">Written by <code>python -m moe_tutorial run</code>.</p>
</body></html>
"""
    write_text(course.report, page, replace=True)  # whole or not at all: a stopped run leaves no half page
    return course.report


# ---------------------------------------------------------------------------------------------
# Command line

def _parse_param(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value  # a plain string


def add_run_command(subparsers) -> argparse.ArgumentParser:
    """Add `run` to the `python -m moe_tutorial` command line."""
    run = subparsers.add_parser(
        "run", help="execute the course notebooks headless (papermill) and write an HTML report")
    run.add_argument("--mode", choices=COURSE_MODES, default=None,
                     help=f"course mode (default: ${MODE_ENV}, else full on a GPU, small on CPU)")
    run.add_argument("--notebooks", nargs="+", default=None, metavar="NB",
                     help="which notebooks, in this order: names (01_naive_moe), numbers (01) or "
                          "paths (default: every notebooks/NN_*.ipynb, in order)")
    run.add_argument("--out", default=None,
                     help="a new or empty folder for the executed notebooks and report.html, "
                          "outside notebooks/, exercises/, solutions/ (default: runs/<timestamp>/)")
    run.add_argument("--device", default=None, help="device for the notebooks (default: cuda if "
                                                     "available, else cpu)")
    run.add_argument("--live", action="store_true",
                     help="draw the live widgets anyway (headless nobody sees them, and they cost "
                          "CPU time next to the measurements; off by default)")
    run.add_argument("--cell-timeout", type=int, default=None,
                     help=f"seconds one cell may run (default: {CELL_TIMEOUT_S})")
    run.add_argument("-p", "--param", action="append", default=[], type=_parse_param,
                     metavar="NAME=VALUE", help="another parameter to inject (Python literal or text)")
    run.add_argument("--log-output", action="store_true", help="echo the notebooks' output")
    run.add_argument("--replace", action="store_true",
                     help="--out may hold an earlier run: remove the files that run wrote (and "
                          "nothing else) before this one (default: --out must be new or empty)")
    run.set_defaults(run=_run_command)
    return run


def _run_command(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else Path("runs") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        mode = course_mode(args.mode)
        notebooks = find_notebooks(args.notebooks)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    missing = [m for m in ("papermill", "nbformat", "ipykernel") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: {', '.join(missing)} not installed; install the course's extras: "
              "pip install -e '.[course,hf]' (or make course)", file=sys.stderr)
        return 2
    try:
        course = prepare_run(notebooks, out, mode=mode, device=args.device, live=args.live,
                             cell_timeout=args.cell_timeout, parameters=dict(args.param),
                             replace=args.replace, names=COMMAND_LINE)
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    caps = capabilities()
    print(caps.describe_machine())
    print(caps.table())
    print(f"\ncourse mode {mode}: {len(notebooks)} notebook(s) → {out}/")
    if not notebooks:
        course.started = _dt.datetime.now().isoformat(timespec="seconds")
        course.note = (f"No course notebooks found (looked for {default_notebooks_dir()}"
                       f"/{NOTEBOOK_GLOB}).")
        print(course.note)
        try:
            print(f"report: {write_report(course)}")
        finally:
            course.release()
        return 0
    course = execute_run(course, log_output=args.log_output)
    print(f"report: {course.report}")
    return 0 if course.ok else 1


# ---------------------------------------------------------------------------------------------
# Exercises from solutions (`python -m moe_tutorial build`; the convention is in the docstring)

SOLUTION_BEGIN = "### BEGIN SOLUTION"
SOLUTION_END = "### END SOLUTION"
HINT_PREFIX = "### HINT:"
STUB_COMMENT = "# YOUR CODE HERE (replace this line and the next; then run the check below)"
ANSWER_TAG = "answer"  # a model answer: the exercise gets ANSWER_STUB in its place
SOLUTION_ONLY_TAG = "solution-only"  # left out of the exercise
ANSWER_STUB = "**Your answer:** *(double-click this cell and write it here)*"
_MARKER_LIKE = re.compile(r"^\s*###\s*(BEGIN|END)\s+SOLUTION|^\s*###\s*HINT\b", re.IGNORECASE)
_RUN_LEFTOVERS = {"cell": ("execution",), "notebook": ("widgets", "papermill")}
# The exercise notebook's metadata key under which the build records what it wrote: the hash of
# its cells' sources (`sources_digest`), so that the next build can tell a learner's edits.
BUILD_STAMP = "moe_tutorial_build"


class BuildError(ValueError):
    """A solution region the build cannot turn into a stub (the message says where and why)."""


def stub_source(source: str, where: str = "cell") -> tuple[str, int]:
    """A code cell's source with every solution region replaced by its stub, and how many
    regions there were. `where` names the cell in error messages."""
    lines = source.split("\n")
    out: list[str] = []
    regions = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped != SOLUTION_BEGIN:
            if _MARKER_LIKE.match(line):
                what = (f"{SOLUTION_END} without {SOLUTION_BEGIN}" if stripped == SOLUTION_END
                        else f"{HINT_PREFIX} outside a solution region" if stripped.startswith(HINT_PREFIX)
                        else f"{stripped!r} looks like a solution marker but is not "
                             f"{SOLUTION_BEGIN!r} / {SOLUTION_END!r} / {HINT_PREFIX!r}")
                raise BuildError(f"{where}, line {i + 1}: {what}")
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        if not indent:
            raise BuildError(
                f"{where}, line {i + 1}: {SOLUTION_BEGIN} must sit inside a function body "
                "(indented), so that the exercise still runs: the stub raises only when called")
        hint_line = lines[i + 1].strip() if i + 1 < len(lines) else ""
        hint = hint_line[len(HINT_PREFIX):].strip() if hint_line.startswith(HINT_PREFIX) else ""
        if not hint:
            raise BuildError(f"{where}, line {i + 2}: {SOLUTION_BEGIN} must be followed by a "
                             f"one-line '{HINT_PREFIX} <text>' (the stub's NotImplementedError "
                             "message)")
        end = i + 2
        while end < len(lines) and lines[end].strip() != SOLUTION_END:
            if _MARKER_LIKE.match(lines[end]):
                raise BuildError(f"{where}, line {end + 1}: {lines[end].strip()!r} inside the "
                                 f"solution region opened at line {i + 1} (regions do not nest; "
                                 "one hint per region)")
            end += 1
        if end == len(lines):
            raise BuildError(f"{where}, line {i + 1}: {SOLUTION_BEGIN} is never closed by "
                             f"{SOLUTION_END}")
        if not any(body.strip() for body in lines[i + 2:end]):
            raise BuildError(f"{where}, line {i + 1}: the solution region is empty")
        message = json.dumps(hint, ensure_ascii=False)  # a valid Python string literal
        out += [f"{indent}{STUB_COMMENT}", f"{indent}raise NotImplementedError({message})"]
        regions += 1
        i = end + 1
    return "\n".join(out), regions


def _lines(text: str) -> list[str]:
    """A source string as the list of lines Jupyter stores (each but the last keeps its \\n)."""
    return text.splitlines(keepends=True)


def exercise_notebook(solution: dict, where: str = "notebook") -> dict:
    """The exercise version of a solutions notebook (its JSON, as a dict): regions become stubs,
    run leftovers are stripped, everything else is copied. Raises BuildError for bad markers or
    a notebook without any solution region."""
    exercise = json.loads(json.dumps(solution))  # a deep copy that stays plain JSON
    regions = 0
    kept = []
    for number, cell in enumerate(exercise.get("cells", []), start=1):
        tags = cell.get("metadata", {}).get("tags", [])
        if SOLUTION_ONLY_TAG in tags:
            continue
        kept.append(cell)
        for key in _RUN_LEFTOVERS["cell"]:
            cell.get("metadata", {}).pop(key, None)
        if ANSWER_TAG in tags:
            if cell.get("cell_type") != "markdown":
                raise BuildError(f"{where}, cell {number}: a cell tagged {ANSWER_TAG!r} holds a "
                                 "model answer in prose: make it a markdown cell")
            cell["source"] = _lines(ANSWER_STUB)
            continue
        if cell.get("cell_type") != "code":
            continue
        source, found = stub_source(_text(cell.get("source", "")), f"{where}, cell {number}")
        regions += found
        cell["source"] = _lines(source)
        cell["outputs"] = []
        cell["execution_count"] = None
    exercise["cells"] = kept
    for key in (*_RUN_LEFTOVERS["notebook"], BUILD_STAMP):  # the stamp is the build's to write
        exercise.get("metadata", {}).pop(key, None)
    if not regions:
        raise BuildError(f"{where}: no solution region ({SOLUTION_BEGIN} ... {SOLUTION_END}); "
                         "an exercise notebook needs at least one")
    return exercise


def notebook_json(nb: dict) -> str:
    """A notebook as Jupyter and nbformat write it: sorted keys, one-space indent, a final newline."""
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def default_solutions_dir() -> Path:
    """`solutions/` of the current directory, else that of the clone the current directory is in."""
    return _course_folder("solutions")


def sources_digest(nb: dict) -> str:
    """What a learner writes in a notebook, hashed: every cell's type and source, in order.
    Running or opening a notebook (outputs, execution counts, metadata) leaves it unchanged."""
    cells = [[cell["cell_type"], _text(cell["source"])] for cell in nb["cells"]]
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode()).hexdigest()


def stamp(exercise: dict, built_from: str) -> dict:
    """The exercise with the build's stamp in its metadata (see BUILD_STAMP)."""
    exercise.setdefault("metadata", {})[BUILD_STAMP] = {
        "built_from": built_from, "sources_sha256": sources_digest(exercise),
        "note": "written by `python -m moe_tutorial build`, which overwrites this notebook only "
                "while its cells are as it wrote them"}
    return exercise


def exercise_state(path: Path) -> str:
    """`generated`: the build wrote it and its cells are as written (overwriting it loses nothing);
    `edited`: the build wrote it and its cells changed since (a learner's work); `foreign`: not
    written by the build (no stamp, or not notebook JSON)."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
        written = nb["metadata"][BUILD_STAMP]["sources_sha256"]
        current = sources_digest(nb)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return "foreign"
    return "generated" if current == written else "edited"


@dataclass
class BuildResult:
    written: list[Path] = field(default_factory=list)  # created or changed (not in --check)
    unchanged: list[Path] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)  # stale exercises without a solution
    kept: list[str] = field(default_factory=list)  # stale notebooks the build leaves: why
    problems: list[str] = field(default_factory=list)  # --check: what is out of date
    refused: list[str] = field(default_factory=list)  # a learner's notebook the build would replace

    @property
    def ok(self) -> bool:
        return not self.problems and not self.refused


def _differing_cells(old_text: str, new_text: str) -> str:
    try:
        old, new = json.loads(old_text), json.loads(new_text)
    except json.JSONDecodeError:
        return "it is not valid notebook JSON"
    old_cells, new_cells = old.get("cells", []), new.get("cells", [])
    differ = [n for n, (a, b) in enumerate(zip(old_cells, new_cells), start=1) if a != b]
    parts = []
    if differ:
        shown = ", ".join(map(str, differ[:8])) + (", ..." if len(differ) > 8 else "")
        parts.append(f"cell{'s' if len(differ) > 1 else ''} {shown} differ")
    if len(old_cells) != len(new_cells):
        parts.append(f"it has {len(old_cells)} cells, the build writes {len(new_cells)}")
    if not parts:
        parts.append("the notebook metadata or formatting differs")
    return "; ".join(parts)


def _check_build_folders(solutions_dir: Path, exercises_dir: Path, expected: set[str],
                         names: InputNames = PYTHON_API) -> None:
    """Refuse a solutions folder without notebooks, and an exercises folder the build must not
    write into: the solutions, the course's notebooks or package, a file, or a folder that holds
    things the build did not write (none of them an exercise of this course)."""
    if not solutions_dir.is_dir():
        raise BuildError(f"{names.given('solutions', solutions_dir)} "
                         f"{'is not a folder' if solutions_dir.exists() else 'does not exist'}; "
                         f"give the folder that holds the solutions notebooks ({NOTEBOOK_GLOB})")
    if not expected:
        raise BuildError(f"no solutions notebooks ({NOTEBOOK_GLOB}) in {solutions_dir}; give the "
                         f"folder that holds them with {names.solutions}")
    where = exercises_dir.resolve()
    clone = [root / name for root in checkout_roots(where)
             for name in ("solutions", "notebooks", "moe_tutorial")]
    for folder in (solutions_dir, *clone, default_notebooks_dir(), package_dir()):
        folder = folder.resolve()
        if where == folder or where.is_relative_to(folder):
            raise BuildError(f"{names.given('exercises', exercises_dir)} is inside "
                             f"{folder.name}/, which the build never writes into; give the "
                             "exercises/ folder (the default) or a new one")
    if exercises_dir.exists() and not exercises_dir.is_dir():
        raise BuildError(f"{names.given('exercises', exercises_dir)} is a file, not a folder; "
                         "give a folder")
    present = sorted(p for p in exercises_dir.iterdir() if not p.name.startswith(".")) \
        if exercises_dir.is_dir() else []
    ours = [p for p in present if p.name in expected
            or (p.suffix == ".ipynb" and exercise_state(p) != "foreign")]
    if present and not ours:
        listed = ", ".join(p.name for p in present[:3]) + (", ..." if len(present) > 3 else "")
        raise BuildError(f"{names.given('exercises', exercises_dir)} holds files the build did "
                         f"not write ({listed}); give the exercises/ folder (the default) or a "
                         "new or empty one")


def _check_build_writable(exercises_dir: Path, names: InputNames = PYTHON_API) -> None:
    """Refuse, before the first notebook is written, an exercises folder the build cannot write
    in (or make): all or nothing."""
    try:
        exercises_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"{names.given('exercises', exercises_dir)} cannot be made "
                         f"({exc.strerror or exc}); give a folder you can write in") from None
    if not os.access(exercises_dir, os.W_OK | os.X_OK):
        raise BuildError(f"{names.given('exercises', exercises_dir)}: no permission to write "
                         f"in it; make it writable (`chmod u+w {exercises_dir}`) or give "
                         "another folder")


def _read_solution(source: Path, where: str) -> dict:
    try:
        nb = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise BuildError(f"{where} cannot be read ({exc}); restore it, e.g. from git") from None
    except json.JSONDecodeError as exc:
        raise BuildError(f"{where}, line {exc.lineno}: not valid notebook JSON ({exc.msg}); "
                         "fix it there or restore it, e.g. from git") from None
    if (not isinstance(nb, dict) or not isinstance(nb.get("cells"), list)
            or not all(isinstance(c, dict) and "cell_type" in c and "source" in c for c in nb["cells"])):
        raise BuildError(f"{where} is JSON but not a notebook (it needs a list of cells, each with "
                         "cell_type and source); restore it, e.g. from git")
    return nb


def build_exercises(solutions_dir: Path | None = None, exercises_dir: Path | None = None, *,
                    check: bool = False, replace: bool = False,
                    names: InputNames = PYTHON_API) -> BuildResult:
    """Generate `exercises_dir/NN_*.ipynb` from `solutions_dir/NN_*.ipynb` (see the docstring).

    Every notebook written carries the build's stamp (BUILD_STAMP). An exercise whose cells a
    learner changed since (or a notebook the build did not write) is never overwritten: the build
    writes nothing and lists each in `refused`, unless `replace`. Stale exercises (no solution)
    are deleted only when unchanged; others are listed in `kept`. With `check`, write nothing
    and list in `problems` every exercise that is missing, differs from what the build would
    write, or has no solution any more, each with a fix that loses no work. Raises BuildError
    for bad folders, solution notebooks or markers. `names`: how the messages name the inputs
    (the command line passes `COMMAND_LINE`)."""
    solutions_dir = Path(solutions_dir) if solutions_dir else default_solutions_dir()
    exercises_dir = Path(exercises_dir) if exercises_dir else solutions_dir.parent / "exercises"
    sources = sorted(solutions_dir.glob(NOTEBOOK_GLOB)) if solutions_dir.is_dir() else []
    expected = {s.name for s in sources}
    _check_build_folders(solutions_dir, exercises_dir, expected, names)
    result = BuildResult()
    build = names.build()
    fix = f"run {build} and commit exercises/"
    keep_work = (f"it holds your edits, which {build} keeps: copy your work out of "
                 f"{exercises_dir.name}/, then run {names.build(replace=True)}")
    foreign = (f"the build did not write it, and {build} leaves it: move it away, or run "
               f"{names.build(replace=True)} to overwrite it")
    to_write: list[tuple[Path, str]] = []
    for source in sources:
        where = f"{solutions_dir.name}/{source.name}"
        exercise = exercise_notebook(_read_solution(source, where), where)
        text = notebook_json(stamp(exercise, where))
        target = exercises_dir / source.name
        shown = f"{exercises_dir.name}/{target.name}"
        if target.is_symlink():  # the learner's own arrangement, and what it points to is theirs
            problem = (f"{shown} is a link to {os.readlink(target)}; the build never writes "
                       f"through a link (it would overwrite what the link points to): remove "
                       f"the link (`rm {target}`) and run {build} again")
            (result.problems if check else result.refused).append(problem)
            continue
        if not target.exists():
            state, existing = "missing", None
        else:
            state = exercise_state(target)
            existing = target.read_text(encoding="utf-8") if state != "foreign" else None
        if existing == text:
            result.unchanged.append(target)
        elif check:
            why = ("is missing" if state == "missing" else
                   f"is out of date with {where} ({_differing_cells(existing, text)})"
                   if state == "generated" else f"is out of date with {where}")
            advice = {"edited": keep_work, "foreign": foreign}.get(state, fix)
            result.problems.append(f"{shown} {why}: {advice}")
        elif state in ("missing", "generated") or replace:
            to_write.append((target, text))
        else:
            result.refused.append(f"{shown}: {keep_work if state == 'edited' else foreign}")
    to_remove: list[Path] = []
    for stale in sorted(exercises_dir.glob(NOTEBOOK_GLOB)) if exercises_dir.is_dir() else []:
        if stale.name in expected:
            continue
        shown = f"{exercises_dir.name}/{stale.name}"
        state = exercise_state(stale)
        if check:
            advice = (f"{fix} (it deletes it)" if state == "generated"
                      else "the build leaves it; delete it or move it out of "
                           f"{exercises_dir.name}/ yourself")
            result.problems.append(f"{shown} has no {solutions_dir.name}/{stale.name}: {advice}")
        elif state == "generated":
            to_remove.append(stale)
        else:
            result.kept.append(f"{shown} has no {solutions_dir.name}/{stale.name}, but "
                               f"{'it holds your edits' if state == 'edited' else 'the build did not write it'}"
                               ", so the build leaves it")
    if result.refused:  # all or nothing: a build that stops half way would mix two versions
        return result
    from .. import safe_io  # here: the one writer of the build's notebooks

    if not (to_write or to_remove):
        return result
    _check_build_writable(exercises_dir, names)
    try:
        with safe_io.hold_folder(exercises_dir, "exercise build"):  # one build at a time
            for target, text in to_write:  # each whole or not at all (safe_io.atomic_file)
                safe_io.write_text(target, text, replace=True)
                result.written.append(target)
            for stale in to_remove:
                stale.unlink()
                result.removed.append(stale)
    except safe_io.FolderBusy as exc:
        raise BuildError(str(exc)) from None
    except safe_io.WriteFailed as exc:
        raise BuildError(f"{exc.strerror}; the exercises written before it are "
                         f"{', '.join(p.name for p in result.written) or 'none'}") from None
    return result


def add_build_command(subparsers) -> argparse.ArgumentParser:
    """Add `build` to the `python -m moe_tutorial` command line."""
    build = subparsers.add_parser(
        "build", help="generate exercises/ from solutions/ (--check: fail when out of date)")
    what = build.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 when exercises/ is not what the build writes")
    what.add_argument("--replace", action="store_true",
                      help="overwrite exercises you edited (your edits are lost; without it the "
                           "build refuses and writes nothing)")
    build.add_argument("--solutions", default=None, metavar="DIR",
                       help="the solutions notebooks (default: ./solutions, else the checkout's)")
    build.add_argument("--exercises", default=None, metavar="DIR",
                       help="where the exercises go (default: exercises/ next to solutions/)")
    build.set_defaults(run=_build_command)
    return build


def _build_command(args: argparse.Namespace) -> int:
    try:
        result = build_exercises(args.solutions, args.exercises, check=args.check,
                                 replace=args.replace, names=COMMAND_LINE)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        for problem in result.problems:
            print(problem, file=sys.stderr)
        if result.ok:
            print(f"exercises up to date ({len(result.unchanged)} notebooks)")
        return 0 if result.ok else 1
    if result.refused:
        for refusal in result.refused:
            print(f"error: {refusal}", file=sys.stderr)
        print("nothing written", file=sys.stderr)
        return 1
    for path in result.written:
        print(f"wrote {path}")
    for path in result.removed:
        print(f"removed {path} (no solution notebook)")
    for kept in result.kept:
        print(kept)
    print(f"{len(result.written)} written, {len(result.unchanged)} unchanged, "
          f"{len(result.removed)} removed")
    return 0
