"""Counting the host's waits for the GPU in a training step, with torch's own sync debug mode
(`count_host_syncs`)."""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable

import torch

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
