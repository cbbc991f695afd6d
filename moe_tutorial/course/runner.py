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

Exercises are built from the solutions by `exercise_build` (`python -m moe_tutorial build`).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime as _dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..locations import import_root
from ..precision.hardware import DEVICE_ENV, capabilities
from ..safe_io import FolderBusy, WriteFailed, hold_folder
from .lesson import COURSE_MODES, MODE_ENV, course_mode
from .report import (
    PLOTLY_JS,
    source_text,
    strip_ansi,
    write_html,
    write_plotly_js,
    write_report,
)
from .run_inputs import (
    COMMAND_LINE,
    MAKE_COURSE,
    NOTEBOOK_GLOB,
    PYTHON_API,
    STARTED_BY_ENV,
    InputNames,
    RunError,
    check_device,
    check_out_dir,
    check_parameters,
    default_notebooks_dir,
    find_notebooks,
    parameters_already_checked,
    prepare_out_dir,
)

CELL_TIMEOUT_S = {"small": 300, "full": 600}
KERNEL_NAME = "python3"
HEARTBEAT_S = 30.0  # a cell running longer than this gets a "still running" line this often
ENGINE_NAME = "moe_tutorial"  # papermill's nbclient engine, reporting each cell as it starts


@dataclass(frozen=True)
class CpuShare:
    """The CPU one notebook's kernel was given: the cores this process may use, how many of them
    other processes kept busy just before it started (None where /proc/stat is absent), the
    1-minute load average then, and the threads torch was given (OMP_NUM_THREADS), which are the
    cores left free unless the learner set OMP_NUM_THREADS."""

    cores: int
    busy: float | None
    load_1min: float | None
    threads: int
    threads_set_by_user: bool

    def describe(self) -> str:
        busy = "busy cores unknown" if self.busy is None else f"{self.busy:.1f} busy"
        load = "" if self.load_1min is None else f", load {self.load_1min:.2f}"
        who = " (OMP_NUM_THREADS)" if self.threads_set_by_user else ""
        return f"{self.threads} thread(s){who} of {self.cores} cores ({busy}{load})"


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat; None where there is none."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_share(sample_s: float = 0.3) -> CpuShare:
    """The cores free for the next notebook, sampled over `sample_s` while the runner itself
    waits: a load average would count the notebook that just finished as someone else's."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    before = _cpu_times()
    time.sleep(sample_s if before else 0)
    after = _cpu_times()
    busy = None
    if before and after and after[1] > before[1]:
        busy = (after[0] - before[0]) / (after[1] - before[1]) * (os.cpu_count() or cores)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    user = os.environ.get("OMP_NUM_THREADS", "")
    if user.isdigit() and int(user) > 0:
        return CpuShare(cores, busy, load, int(user), True)
    free = cores if busy is None else int(cores - busy + 0.5)
    return CpuShare(cores, busy, load, max(1, min(cores, free)), False)


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
    # The CPU its kernel had (`CpuShare`): torch's threads, and what others used as it started.
    cpu: CpuShare | None = None

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


def _describe_error(exc: BaseException) -> tuple[str, int | None]:
    """A readable error and the failing cell's execution count, from papermill's exception."""
    ename = getattr(exc, "ename", None)
    if ename is not None:  # papermill.PapermillExecutionError: the error the cell raised
        trace = strip_ansi("\n".join(getattr(exc, "traceback", None) or [])).rstrip()
        last = f"{ename}: {strip_ansi(str(exc.evalue))}"
        if not trace.endswith(last):
            trace = f"{trace}\n{last}".strip()
        return trace, getattr(exc, "exec_count", None)
    return f"{type(exc).__name__}: {strip_ansi(str(exc))}", None


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
        first = next((line.strip() for line in source_text(cell.get("source", "")).splitlines()
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


def execute_run(course: CourseRun, *, log_output: bool = False, echo=print) -> CourseRun:
    """Execute a prepared run's notebooks in order with papermill; stop at the first failure.
    Writes the executed notebooks, each one's HTML rendering and, last, `report.html`; prints a
    line as each cell starts (`CellProgress`); returns `course`, filled in. Its folder is
    released for another run when this returns or raises."""
    try:
        return _execute(course, log_output=log_output, echo=echo)
    finally:
        course.release()


def local_kernel_config(sockets_dir: str):
    """The traitlets config that has a kernel talk to its client over local (IPC) sockets in
    `sockets_dir` (a private folder, never the notebooks' own) rather than TCP ports: nothing else
    on the machine can reach them; no two kernels started at once can race for a port (TCP's
    free-port pick is closed before the kernel binds it); and ipykernel (7+) prints its "Kernel
    is running over TCP without encryption" warning at every notebook's start otherwise.
    papermill passes it on to nbclient (`config=`), whose kernel manager reads `transport` and
    `ip` (for IPC, the sockets' path prefix) from it. Windows has no IPC sockets in ZeroMQ, so
    there the kernels keep TCP on localhost."""
    from traitlets.config import Config

    if os.name == "nt":
        return Config({"KernelManager": {"transport": "tcp"}})
    return Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(sockets_dir, "kernel")}})


def _execute(course: CourseRun, *, log_output: bool, echo) -> CourseRun:
    import papermill
    from papermill.engines import papermill_engines

    sockets = tempfile.TemporaryDirectory(prefix="moe-kernels-")
    local_transport = local_kernel_config(sockets.name)

    papermill_engines.register(ENGINE_NAME, _progress_engine())
    progress = CellProgress(echo)
    if course.runs:
        missing_js = write_plotly_js(course.out_dir)
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
    with sockets, _environment(**env), kernel_for_this_python() as kernel, \
            parameters_already_checked():
        course.kernel = kernel
        for i, run in enumerate(course.runs, start=1):
            run.cpu = cpu_share()
            echo(f"[{i}/{len(course.runs)}] {run.name} ... ({run.cpu.describe()})", flush=True)
            t0 = time.perf_counter()
            try:
                with progress.notebook(f"[{i}/{len(course.runs)}] {run.name}"), \
                        _environment(OMP_NUM_THREADS=run.cpu.threads):
                    papermill.execute_notebook(
                        str(run.source), str(run.output), parameters=params, kernel_name=kernel,
                        cwd=str(run.source.parent), execution_timeout=course.cell_timeout,
                        store_widget_state=False, progress_bar=False, log_output=log_output,
                        engine_name=ENGINE_NAME, on_cell_start=progress.cell_started,
                        config=local_transport)
                run.status = "ok"
            except Exception as exc:  # papermill raises on the first error output of a cell
                run.status = "failed"
                run.error, run.failed_cell = _describe_error(exc)
            run.seconds = time.perf_counter() - t0
            if run.output.exists():  # the failing cell's error in place, too
                try:
                    write_html(run, {r.source.name for r in course.runs})
                except Exception as exc:  # the run's results stand without their rendering
                    run.html_error = f"{type(exc).__name__}: {strip_ansi(str(exc))}"
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
                             replace=args.replace,
                             names=MAKE_COURSE if os.environ.get(STARTED_BY_ENV) == "make"
                             else COMMAND_LINE)
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
