"""Run a function on a real process group: `world` fresh Python processes joined by gloo.

    results = ranks.run(fn, world, *args)   # [what fn(*args) returned on rank 0, rank 1, ...]

Every process initialises the default process group (gloo on the CPU, so `dist.get_rank()`,
`dist.get_world_size()` and `dist.group.WORLD` work as under torchrun), calls `fn(*args)` and
sends back what it returned. `args` are pickled; `fn` travels by `ship`.

A notebook's function cannot be pickled by reference (its module is the kernel's `__main__`), but
IPython keeps every cell's source, so `inspect.getsource` finds it. `ship` sends that source with
the globals the function names: modules are imported again, functions and classes of importable
modules imported by name (the processes get the caller's `sys.path`), the notebook functions it
calls shipped along (the same way, into the same namespace), picklable values copied. Anything
else is left out: using it raises NameError in the process. `rebuild` makes the function again on
the other side.

Each collective of the default group waits at most `timeout_s` for its peers (the group's
timeout); once a rank has failed the others get `GRACE_S` more, and a run that takes longer than
`timeout_s` plus the start-up is killed: a deadlock becomes an error, never a hang. The processes
see no GPU and run one thread each (a CPU core plays one rank, as in notebook 07's CPU runs). They
fork from one launcher that imports torch once, so a run starts in ~2 s of a core whatever
`world` is.
"""

from __future__ import annotations

import importlib
import inspect
import linecache
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import types
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from ..locations import import_root

STARTUP_S = 60.0  # allowance for the launcher to import torch on busy cores
GRACE_S = 5.0  # how long the other ranks may still run once one has failed
_LAUNCH = "import sys; from moe_tutorial.parallel.ranks import _launch; _launch(sys.argv[1])"
# What a rank's collective reports when a *peer* failed or never joined: a consequence, not a cause.
_PEER_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting")


class ShipError(ValueError):
    """A function that cannot be sent to another process, and why."""


class RankError(RuntimeError):
    """An exception raised on one rank: its type's name, message and traceback (as text)."""

    def __init__(self, rank: int, type_name: str, message: str, trace: str):
        super().__init__(f"rank {rank} raised {type_name}: {message}")
        self.rank, self.type_name, self.message, self.trace = rank, type_name, message, trace


class RunTimeout(TimeoutError):
    """The processes did not all finish in time (and were killed)."""


# The type names of what happened to a rank that did not raise an exception of its own
STOPPED = "Stopped"  # still running GRACE_S after another rank failed
PROCESS_DIED = "ProcessDied"  # ended without a result (killed by a signal, an abort in C++)


def is_peer_failure(message: str) -> bool:
    """Whether a collective's error only says that another rank failed or never joined."""
    return any(phrase in message for phrase in _PEER_FAILURES)


# ---------------------------------------------------------------------------------------------
# Functions by source

@dataclass(frozen=True)
class Shipped:
    """A function as another process can make it again: imported by name when its module is
    importable, else executed from its source (and its notebook helpers' sources) in a namespace
    that holds the globals they name."""

    name: str
    module: str = ""
    qualname: str = ""
    sources: tuple[str, ...] = ()
    # name -> ("module", module) | ("import", module, qualname) | ("value", pickled bytes)
    #         | ("function", the __name__ of a shipped function the name refers to)
    names: dict = field(default_factory=dict)


def _import_path(obj) -> tuple[str, str] | None:
    """(module, qualname) when another process can import `obj` by name."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or module not in sys.modules:
        return None
    found = sys.modules[module]
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return (module, qualname) if found is obj else None


def _names_used(code: types.CodeType) -> set[str]:
    """Every global a function's code may read, nested code (comprehensions, inner defs) too."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_used(const)
    return names


def _source(fn: types.FunctionType) -> str:
    if fn.__name__ == "<lambda>":
        raise ShipError("a lambda cannot travel by its source: define the function with def")
    if fn.__closure__:
        raise ShipError(f"`{fn.__name__}` uses variables of the function it is defined in "
                        f"({', '.join(fn.__code__.co_freevars)}): define it at the top level")
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise ShipError(f"the source of `{fn.__name__}` cannot be found ({exc}): define it in "
                        "a notebook cell or a file") from exc


def ship(fn) -> Shipped:
    """`fn` as `rebuild` makes it again in another process (see the module's docstring)."""
    path = _import_path(fn)
    if path:
        return Shipped(fn.__name__, *path)
    if not isinstance(fn, types.FunctionType):
        raise ShipError(f"{fn!r} is neither a function defined with def nor importable by name")
    sources, names, pending, seen = [], {}, [fn], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        sources.append(_source(current))
        for name in sorted(_names_used(current.__code__) & current.__globals__.keys()):
            if name in names:
                continue
            value = current.__globals__[name]
            if isinstance(value, types.ModuleType):
                names[name] = ("module", value.__name__)
            elif path := _import_path(value):
                names[name] = ("import", *path)
            elif isinstance(value, types.FunctionType):
                pending.append(value)
                names[name] = ("function", value.__name__)
            else:
                try:
                    names[name] = ("value", pickle.dumps(value))
                except Exception:  # left out: the process raises NameError if it is used
                    pass
    return Shipped(fn.__name__, sources=tuple(sources), names=names)


def _resolve(module: str, qualname: str):
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def rebuild(shipped: Shipped):
    """The function `ship` sent, made again in this process."""
    if shipped.module:
        return _resolve(shipped.module, shipped.qualname)
    namespace: dict = {"__name__": "__shipped__"}
    aliases = {}
    for name, (kind, *what) in shipped.names.items():
        if kind == "module":
            namespace[name] = importlib.import_module(what[0])
        elif kind == "import":
            namespace[name] = _resolve(*what)
        elif kind == "value":
            namespace[name] = pickle.loads(what[0])
        else:
            aliases[name] = what[0]
    for i, source in enumerate(shipped.sources):
        filename = f"<shipped {shipped.name} {i}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), namespace)  # tracebacks show these lines
    for name, target in aliases.items():
        namespace[name] = namespace[target]
    return namespace[shipped.name]


# ---------------------------------------------------------------------------------------------
# The processes: one launcher imports torch and the function's modules once, then forks the
# ranks (it is single-threaded at that point, so forking is safe, and the ranks start in
# milliseconds instead of importing torch each). The launcher leads a process group of its own:
# stopping the run kills it and every rank at once.

def run(fn, world: int, *args, timeout_s: float = 30.0) -> list:
    """`fn(*args)` on every rank of a fresh gloo process group of `world` processes; what each
    returned, in rank order. Raises RankError (the first rank whose exception is a cause, not a
    peer's failure), RunTimeout, or ShipError (before starting anything)."""
    job = pickle.dumps({"fn": ship(fn), "args": args, "world": world, "timeout_s": timeout_s,
                        "sys_path": sys.path})
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(import_root()),
                                                     os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="moe-ranks-") as tmp:
        folder = Path(tmp)
        (folder / "job.pkl").write_bytes(job)
        with open(folder / "log", "wb") as log:
            launcher = subprocess.Popen([sys.executable, "-c", _LAUNCH, tmp], env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        try:
            stragglers = _wait(launcher, folder, world, STARTUP_S + timeout_s)
        finally:  # whatever happened (an interrupt included), no process outlives the run
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        if stragglers is None:
            raise RunTimeout(f"{world} processes running `{getattr(fn, '__name__', fn)}` did not "
                             f"finish within {STARTUP_S + timeout_s:.0f} s and were stopped")
        outcomes = [("raised", STOPPED, f"rank {rank} was still running {GRACE_S:.0f} s after "
                                          "another rank failed, and was stopped", "")
                    if rank in stragglers else _outcome(folder, rank) for rank in range(world)]
    errors = [(rank, o) for rank, o in enumerate(outcomes) if o[0] == "raised"]
    if errors:
        # The cause: an error of the rank's own first, then a rank that never finished, and
        # only then the errors that merely report a failed peer.
        rank, (_, type_name, message, trace) = min(
            errors, key=lambda e: (is_peer_failure(e[1][2]), e[1][1] == STOPPED, e[0]))
        raise RankError(rank, type_name, message, trace)
    return [value for _, value in outcomes]


def _wait(launcher: subprocess.Popen, folder: Path, world: int, limit_s: float) -> set[int] | None:
    """Wait for the launcher (it waits for its ranks); once a rank has failed, the others get
    GRACE_S more. Returns the ranks without a result then (empty when all finished), None when
    `limit_s` ran out first."""
    deadline, grace_end, done = time.monotonic() + limit_s, None, set()
    while launcher.poll() is None:
        now = time.monotonic()
        finished = {rank for rank in range(world) if (folder / f"rank{rank}.pkl").exists()}
        if grace_end is None and any(_outcome(folder, rank)[0] == "raised"
                                     for rank in finished - done):
            grace_end = now + GRACE_S
        done = finished
        if grace_end is not None and now > grace_end:
            return set(range(world)) - done
        if now > deadline:
            return None
        time.sleep(0.05)
    return set()


def _outcome(folder: Path, rank: int) -> tuple:
    result = folder / f"rank{rank}.pkl"
    if result.exists():
        return pickle.loads(result.read_bytes())
    log = (folder / "log").read_text(errors="replace").strip().splitlines()
    return ("raised", PROCESS_DIED, log[-1] if log else "no output", "\n".join(log[-30:]))


def _write_outcome(folder: Path, rank: int, outcome: tuple) -> None:
    partial = folder / f"rank{rank}.tmp"
    partial.write_bytes(pickle.dumps(outcome))
    partial.rename(folder / f"rank{rank}.pkl")  # the caller never reads half a result


def _raised(exc: BaseException) -> tuple:
    return ("raised", type(exc).__name__, str(exc).strip(), traceback.format_exc())


def _launch(job_dir: str) -> None:
    """The launcher of `run`: import what the function needs once, fork one process per rank,
    wait for them."""
    import torch.distributed  # noqa: F401  (imported once, here, for every rank)

    folder = Path(job_dir)
    job = pickle.loads((folder / "job.pkl").read_bytes())
    # The caller's import path (a notebook's folder, a test's): what it imports by name, so can we.
    sys.path[:0] = [entry for entry in job["sys_path"] if entry not in sys.path]
    try:
        fn = rebuild(job["fn"])
    except Exception as exc:  # every rank would fail the same way
        for rank in range(job["world"]):
            _write_outcome(folder, rank, _raised(exc))
        return
    children = set()
    for rank in range(job["world"]):
        pid = os.fork()
        if pid == 0:
            _serve(folder, rank, fn, job)  # never returns
        children.add(pid)
    while children:
        children.discard(os.wait()[0])


def _serve(folder: Path, rank: int, fn, job: dict) -> None:
    """One rank of `run`: join the group, call the function, leave its outcome in the folder."""
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=(folder / "store").as_uri(), rank=rank,
                                world_size=job["world"],
                                timeout=timedelta(seconds=job["timeout_s"]))
        outcome = ("returned", fn(*job["args"]))
        pickle.dumps(outcome)  # an unpicklable result is this rank's error, reported as such
    except BaseException as exc:
        outcome = _raised(exc)
    try:
        _write_outcome(folder, rank, outcome)
        sys.stdout.flush()  # what the function printed stays in the run's log
        sys.stderr.flush()
    finally:
        # Leaving at once (not destroy_process_group, which may wait) lets peers stuck in a
        # collective with this rank fail fast with "Connection closed by peer".
        os._exit(0)
