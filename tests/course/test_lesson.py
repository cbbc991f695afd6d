"""`lesson.setup`: what every notebook's setup cell makes of its `parameters` cell."""

import pytest
import torch

from moe_tutorial.course.lesson import MODE_ENV, setup
from moe_tutorial.precision.hardware import check_device

DEFAULTS = {"small": {"steps": 60, "sizes": [1, 2], "warmup": 2},
            "full": {"steps": 400, "sizes": [1, 2, 4], "warmup": 5}}


def test_empty_parameters_take_the_modes_defaults():
    run = setup("small", "cpu", DEFAULTS, steps=0, sizes=[])
    assert (run.mode, run.device, run.on_gpu) == ("small", "cpu", False)
    assert run.values == DEFAULTS["small"]
    assert setup("full", "cpu", DEFAULTS, steps=None)["steps"] == 400


def test_set_parameters_win_over_the_defaults():
    run = setup("full", "cpu", DEFAULTS, steps=7, sizes=[3])
    assert (run["steps"], run["sizes"], run["warmup"]) == (7, [3], 5)


def test_mode_and_device_come_from_the_environment_and_the_hardware(monkeypatch):
    monkeypatch.setenv(MODE_ENV, "full")
    run = setup("", "")
    assert run.mode == "full" and run.values == {}
    assert run.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert run.on_gpu == torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with 2 GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device.cache_clear()
    assert setup("small", "cuda:1").on_gpu
    check_device.cache_clear()
    monkeypatch.undo()
    monkeypatch.setenv(MODE_ENV, "full")
    monkeypatch.setenv(MODE_ENV, "medium")
    with pytest.raises(ValueError, match=r"medium.*\$MOE_TUTORIAL_MODE"):
        setup("", "cpu")


def test_mistakes_are_named():
    with pytest.raises(ValueError, match=r"parameters \['step'\] have no default"):
        setup("small", "cpu", DEFAULTS, step=3)
    with pytest.raises(ValueError, match="needs exactly"):
        setup("small", "cpu", {"small": {}})
    with pytest.raises(ValueError, match="different sizes"):
        setup("small", "cpu", {"small": {"steps": 1}, "full": {"iters": 1}})
    with pytest.raises(KeyError, match="no value 'iters'"):
        setup("small", "cpu", DEFAULTS)["iters"]
