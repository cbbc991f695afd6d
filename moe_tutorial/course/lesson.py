"""What the notebooks share, so that none defines its own: the run's mode, device, live setting
and sizes from the `parameters` cell (where the cell leaves them empty, from the environment:
$MOE_TUTORIAL_MODE, $MOE_TUTORIAL_DEVICE, $MOE_TUTORIAL_LIVE), the `%%needs_gpu` cell magic
(`gpu_replay`), and the package's code shown as it runs. (The course's one relative
error is `precision.quant.rel_error`.)"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass

import torch

from ..precision.hardware import DEVICE_ENV, check_device
from . import gpu_replay
from .dashboard import LIVE_ENV, check_live_setting

# The course runs in one of two modes: `small` (CPU-sized, minutes on 2 cores) or `full`
# (GPU-sized).
COURSE_MODES = ("small", "full")
MODE_ENV = "MOE_TUTORIAL_MODE"


def course_mode(mode: str | None = None, name: str = "argument") -> str:
    """Resolve the course mode: the argument, else $MOE_TUTORIAL_MODE, else `full` when a CUDA
    GPU is present and `small` otherwise. `name`: where `mode` came from, named in the error."""
    chosen = mode or os.environ.get(MODE_ENV) or ("full" if torch.cuda.is_available() else "small")
    if chosen not in COURSE_MODES:
        source = name if mode else f"${MODE_ENV}"
        raise ValueError(f"course mode {chosen!r} (from the {source}) is not one of "
                         f"{COURSE_MODES}; set it to small or full, or leave it empty")
    return chosen


@dataclass(frozen=True)
class Setup:
    """What a notebook runs with: the course mode, the device, and its sizes for that mode,
    read by name (`SETUP["steps"]`)."""

    mode: str
    device: str
    values: dict  # size name -> the notebook's parameter, or the mode's default where it was empty
    live: bool = True  # draw live widgets (where a Jupyter frontend is attached)

    @property
    def on_gpu(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def __getitem__(self, name: str):
        if name not in self.values:
            raise KeyError(f"this setup has no value {name!r}; it has {sorted(self.values)}")
        return self.values[name]


def setup(mode: str, device: str, defaults: dict[str, dict] | None = None, *,
          live: bool | str | None = None, **parameters) -> Setup:
    """Resolve a notebook's `parameters` cell. The mode: `mode`, else $MOE_TUTORIAL_MODE, else
    full on a GPU and small otherwise (`course_mode`). The device: `device`, else
    $MOE_TUTORIAL_DEVICE, else cuda when available, else cpu. Live widgets: `live` (True or
    False), else on unless $MOE_TUTORIAL_LIVE is 0 or false. Each size: its parameter, or where
    that is left empty (0, "", [], None) the mode's default. In a notebook it also registers the
    `%%needs_gpu` cell magic for the resolved device (`gpu_replay`). `defaults` maps "small" and "full" to the sizes by name;
    `parameters` are the notebook's values by the same names.

    Every value is checked as its command-line flag is, naming where it came from (the notebook's
    parameter, or the environment variable the `parameters` cell read it from): the mode, the
    device (`hardware.check_device`), $MOE_TUTORIAL_LIVE and the notebook's `live` (its LIVE
    parameter, True or False as the command line's --live switch), and each size against the
    type of its default (a count an integer >= 1, a list a list, a name a string)."""
    mode = course_mode(mode or None, name=_named(mode, MODE_ENV, "MODE"))
    device = device or os.environ.get(DEVICE_ENV, "")
    if device:
        check_device(device, _named(device, DEVICE_ENV, "DEVICE"))
    check_live_setting()
    if live in (None, ""):
        live = os.environ.get(LIVE_ENV, "1") not in ("0", "false")
    if not isinstance(live, bool):
        raise ValueError(f"parameter LIVE={live!r} is not True or False (the notebook's --live); "
                         f"set LIVE = True to draw the live widgets, or False to draw them once")
    defaults = defaults or {m: {} for m in COURSE_MODES}
    if sorted(defaults) != sorted(COURSE_MODES):
        raise ValueError(f"defaults has modes {sorted(defaults)}; "
                         f"it needs exactly {sorted(COURSE_MODES)}")
    if set(defaults["small"]) != set(defaults["full"]):
        raise ValueError(f"the modes' defaults name different sizes: small "
                         f"{sorted(defaults['small'])}, full {sorted(defaults['full'])}")
    unknown = set(parameters) - set(defaults[mode])
    if unknown:
        raise ValueError(f"parameters {sorted(unknown)} have no default; "
                         f"the defaults name {sorted(defaults[mode])}")
    for name, value in parameters.items():
        if value:  # empty: the mode's default
            _check_size(name, value, [defaults[m][name] for m in (mode, *COURSE_MODES)], mode)
    values = {name: parameters.get(name) or default for name, default in defaults[mode].items()}
    # torch.profiler's own start/stop log lines would land in the chapters' outputs
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    resolved = Setup(mode, device or ("cuda" if torch.cuda.is_available() else "cpu"), values, live)
    gpu_replay.register(resolved.device)
    return resolved


def _named(value: str, env: str, parameter: str) -> str:
    """Where a `parameters` cell's value came from: the environment variable the cell reads
    (when it holds exactly this value), else the notebook's parameter."""
    return f"${env}" if value and os.environ.get(env) == value else f"parameter {parameter}"


def _check_size(name: str, value, defaults: list, mode: str) -> None:
    problem = size_problem(value, defaults)
    if problem:
        wrong, example = problem
        raise ValueError(f"{name}={value!r} {wrong}; give e.g. {example!r}, or 0 / empty for the "
                         f"{mode} mode's default {defaults[0]!r}")


def size_problem(value, defaults: list) -> tuple[str, object] | None:
    """What is wrong with `value` as a size whose defaults (the mode's first) are `defaults`, and
    an example of a right value; None when it fits. It has the kind of the first default that is
    not empty: an integer >= 1 for a count, a list of such for a list, a string for a name.
    (The runner applies this to `-p` values before any notebook starts.)"""
    example = next((d for d in defaults if d not in (None, [], "")), None)
    if example is None or isinstance(example, bool):
        return None
    if isinstance(example, (list, tuple)):
        wrong = ("must be a list" if not isinstance(value, (list, tuple)) else
                 next((f"holds {item!r}, which {_kind_error(item, example[0])}" for item in value
                       if _kind_error(item, example[0])), None))
    else:
        wrong = _kind_error(value, example)
    return (wrong, example) if wrong else None


def _kind_error(value, example) -> str | None:
    """What is wrong with `value` as a value of `example`'s kind, or None."""
    if isinstance(example, int):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return "must be an integer >= 1"
    elif isinstance(example, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not (math.isfinite(value) and value > 0):
            return "must be a finite number > 0"
    elif isinstance(example, str) and not isinstance(value, str):
        return "must be a name (a string)"
    return None


def show_source(obj) -> None:
    """Display the package's own code for `obj` (a function or class): what runs is exactly this."""
    from IPython.display import Code, display  # only a notebook needs IPython

    display(Code(inspect.getsource(obj), language="python"))
