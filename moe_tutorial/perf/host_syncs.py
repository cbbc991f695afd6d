"""Counting the host's waits for the GPU in a training step. On a GPU, torch's own sync debug
mode (`count_host_syncs`); on a CPU, the step runs on the meta device (whose tensors hold no
values, so any read of one raises) with the Python entry points that read values or sync
patched to raise (`host_sync_entry_points`), so a sync added later fails a CPU test."""

from __future__ import annotations

import contextlib
import functools
import traceback
import warnings
from collections.abc import Callable, Iterator

import torch


class HostSync(RuntimeError):
    """A host read or device synchronisation where the step must have none."""


def _on_host(*args, **kwargs) -> bool:
    """Whether the call reads only tensors in host memory (no wait for a device)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def _refuse(name: str, original: Callable, allow: Callable[..., bool] | None) -> Callable:
    @functools.wraps(original)
    def refused(*args, **kwargs):
        if _on_host(*args, **kwargs) or (allow is not None and allow(*args, **kwargs)):
            return original(*args, **kwargs)
        raise HostSync(f"{name} on a device tensor: the host reads its values (waits for the "
                       f"device); the sync-free step must not call it")
    return refused


def _is_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


# (owner, attribute, when it is allowed anyway): the Python entry points that read values or
# sync. Each one, on a device tensor, copies to the host and waits: scalars and lists (`item`,
# `tolist`, `__bool__` of `if t:`, `int(t)`), copies (`cpu`, `numpy`), ops whose output size
# depends on the values (nonzero, masked_select, unique, bincount, repeat_interleave without
# output_size, boolean-mask indexing), comparisons returning a Python bool (equal, allclose),
# and explicit synchronisation. Calls on host tensors only are let through (no device waits).
_ENTRY_POINTS = [
    (torch.Tensor, "item", None), (torch.Tensor, "tolist", None), (torch.Tensor, "numpy", None),
    (torch.Tensor, "cpu", None), (torch.Tensor, "__bool__", None), (torch.Tensor, "__int__", None),
    (torch.Tensor, "__float__", None), (torch.Tensor, "__index__", None),
    (torch.Tensor, "nonzero", None), (torch, "nonzero", None), (torch, "argwhere", None),
    (torch.Tensor, "masked_select", None), (torch, "masked_select", None),
    (torch.Tensor, "unique", None), (torch, "unique", None), (torch, "unique_consecutive", None),
    (torch.Tensor, "bincount", None), (torch, "bincount", None),
    (torch.Tensor, "repeat_interleave", lambda *a, **k: k.get("output_size") is not None),
    (torch, "repeat_interleave", lambda *a, **k: k.get("output_size") is not None),
    (torch, "where", lambda *a, **k: len(a) + len(k) > 1),  # where(cond) alone is nonzero
    (torch, "equal", None), (torch.Tensor, "equal", None), (torch, "allclose", None),
    (torch.Tensor, "__getitem__", lambda self, index: not _is_mask(index)),
    (torch.Tensor, "__setitem__", lambda self, index, value: not _is_mask(index)),
    (torch.cuda, "synchronize", None), (torch.cuda.Stream, "synchronize", None),
    (torch.cuda.Event, "synchronize", None),
]


@contextlib.contextmanager
def host_sync_entry_points() -> Iterator[None]:
    """Inside this block every Python entry point that reads a device tensor's values on the
    host or synchronises with the device raises `HostSync` (the list: `_ENTRY_POINTS`; reads of
    host tensors pass). Run a step on the meta device inside it, meta standing for the GPU: meta tensors hold no values, so an op that reads them outside
    these entry points (a sync inside a kernel's host code, e.g. an output sized by the data)
    raises too. Together: a CPU test that fails when a host read enters the step."""
    # (owner, name, its own attribute or None where it inherits the entry point)
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in _ENTRY_POINTS]
    try:
        for owner, name, allow in _ENTRY_POINTS:
            label = f"{getattr(owner, '__name__', owner)}.{name}"
            setattr(owner, name, _refuse(label, getattr(owner, name), allow))
        yield
    finally:
        for owner, name, own in saved:
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


# torch's warning for a synchronising call in sync debug mode "warn" (c10/cuda/CUDAFunctions.cpp,
# `warn_or_error_on_sync`). Any other warning in the counted call is not a sync: among them the
# one-time notice `set_sync_debug_mode` itself gives ("Synchronization debug mode is a prototype
# feature ..."), which a run's first count used to record as a sync.
SYNC_WARNING = "called a synchronizing CUDA operation"


def count_host_syncs(fn: Callable[[], object]) -> tuple[int, list[str]]:
    """Run `fn()` once on a GPU with torch's sync debug mode warning at every synchronising call
    it detects (`torch.cuda.set_sync_debug_mode`: copies to the host, stream and device
    synchronisation, ops sized by the data; not `torch.distributed` or `torch.sparse`) and
    return (how many, where: the innermost frame of the package or the library that made each).
    Only the mode's sync warnings count (`SYNC_WARNING`). Work queued before `fn` is finished
    first, outside the count."""
    torch.cuda.synchronize()
    places: list[str] = []
    previous = torch.cuda.get_sync_debug_mode()
    original_show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "warnings.py" not in f.filename]
        places.append(" <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                                  for f in frames[-3:][::-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            warnings.showwarning = original_show
    torch.cuda.synchronize()
    return len(places), places
