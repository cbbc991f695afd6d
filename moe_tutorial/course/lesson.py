"""What the notebooks share, so that none defines its own: the run's mode, device and sizes
from the `parameters` cell, and the package's code shown as it runs. (The course's one relative
error is `precision.quant.rel_error`.)"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..moe.config import COURSE_MODES, course_mode


@dataclass(frozen=True)
class Setup:
    """What a notebook runs with: the course mode, the device, and its sizes for that mode,
    read by name (`SETUP["steps"]`)."""

    mode: str
    device: str
    values: dict  # size name -> the notebook's parameter, or the mode's default where it was empty

    @property
    def on_gpu(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def __getitem__(self, name: str):
        if name not in self.values:
            raise KeyError(f"this setup has no value {name!r}; it has {sorted(self.values)}")
        return self.values[name]


def setup(mode: str, device: str, defaults: dict[str, dict] | None = None, **parameters) -> Setup:
    """Resolve a notebook's `parameters` cell. The mode: `mode`, else $MOE_TUTORIAL_MODE, else
    full on a GPU and small otherwise (`config.course_mode`). The device: `device`, else cuda
    when available, else cpu. Each size: its parameter, or where that is left empty (0, "", [],
    None) the mode's default. `defaults` maps "small" and "full" to the sizes by name;
    `parameters` are the notebook's values by the same names."""
    mode = course_mode(mode or None)
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
    values = {name: parameters.get(name) or default for name, default in defaults[mode].items()}
    return Setup(mode, device or ("cuda" if torch.cuda.is_available() else "cpu"), values)


def show_source(obj) -> None:
    """Display the package's own code for `obj` (a function or class): what runs is exactly this."""
    from IPython.display import Code, display  # only a notebook needs IPython

    display(Code(inspect.getsource(obj), language="python"))
