"""What the notebooks share, so that none defines its own: the package's code shown as it runs,
and the course's one relative error."""

from __future__ import annotations

import inspect

import torch


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius norms, in fp32): how far an output or a gradient is
    from its reference — the measure every notebook, check and benchmark of the course quotes."""
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def show_source(obj) -> None:
    """Display the package's own code for `obj` (a function or class): what runs is exactly this."""
    from IPython.display import Code, display  # only a notebook needs IPython

    display(Code(inspect.getsource(obj), language="python"))
