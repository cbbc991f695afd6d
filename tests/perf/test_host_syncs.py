"""Counting a step's host syncs on a GPU: only torch's sync warnings count."""

import warnings

import torch

from moe_tutorial.perf import host_syncs


def test_the_gpu_counter_counts_only_sync_warnings(monkeypatch):
    """`count_host_syncs` records torch's sync warnings and nothing else: the one-time notice
    that `set_sync_debug_mode` gives ("a prototype feature") made a committed run count 5 syncs
    for HF's step where there were 4. Torch's CUDA calls are stood in for on a CPU."""
    mode = {"now": 0}

    def set_mode(value):
        if value == "warn":
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet "
                          "detect all synchronizing operations")
        mode["now"] = value

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)

    def step():
        for _ in range(4):
            warnings.warn(host_syncs.SYNC_WARNING)
        warnings.warn("some other warning of the step", DeprecationWarning)

    count, places = host_syncs.count_host_syncs(step)
    assert count == 4 and len(places) == 4 and all("step" in place for place in places)
    assert mode["now"] == 0  # the mode it found is back
