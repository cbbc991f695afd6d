"""A notebook's setup cell checks its settings as the command line checks its flags, and names
where each came from: a device or mode from the parameters or from the environment, the LIVE
parameter and $MOE_TUTORIAL_LIVE, and each size against the kind and range of its default."""

from __future__ import annotations

import os
import re

import pytest
import torch
from refused_on_one_line import refused

from moe_tutorial.course import lesson


def test_a_device_from_the_environment_is_named_as_the_environment(monkeypatch):
    monkeypatch.setenv("MOE_TUTORIAL_DEVICE", "gpu")
    with pytest.raises(ValueError, match=r"^\$MOE_TUTORIAL_DEVICE 'gpu' is not a device the "
                                         r"course runs on; give cpu or cuda"):
        lesson.setup("small", os.environ["MOE_TUTORIAL_DEVICE"])


def test_a_device_parameter_is_named_as_the_parameter(monkeypatch):
    monkeypatch.delenv("MOE_TUTORIAL_DEVICE", raising=False)
    with pytest.raises(ValueError, match=r"^parameter DEVICE 'tpu' is not a device"):
        lesson.setup("small", "tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_a_cuda_device_on_a_cpu_machine_is_refused_in_the_setup_cell(monkeypatch):
    monkeypatch.delenv("MOE_TUTORIAL_DEVICE", raising=False)
    with pytest.raises(ValueError, match=r"no CUDA GPU; set parameter DEVICE to cpu, or leave "
                                         r"it empty"):
        lesson.setup("small", "cuda")


def test_a_mode_parameter_is_named_as_the_parameter(monkeypatch):
    monkeypatch.delenv("MOE_TUTORIAL_MODE", raising=False)
    with pytest.raises(ValueError, match=r"'medium' \(from the parameter MODE\).*small or full"):
        lesson.setup("medium", "cpu")


@pytest.mark.parametrize("value, ok", [("off", False), ("yes", False), ("always", True),
                                       ("0", True), ("", True)])
def test_the_live_setting_in_the_environment_is_checked(monkeypatch, value, ok):
    monkeypatch.setenv("MOE_TUTORIAL_LIVE", value)
    if ok:
        assert lesson.setup("small", "cpu").mode == "small"
    else:
        with pytest.raises(ValueError, match=rf"\$MOE_TUTORIAL_LIVE='{value}' is not a setting"):
            lesson.setup("small", "cpu")


def test_setup_refuses_a_live_setting_in_the_environment_with_the_flags_values(monkeypatch):
    monkeypatch.setenv("MOE_TUTORIAL_LIVE", "yes")
    refused(lambda: lesson.setup("small", "cpu", live=True), ValueError,
            "$MOE_TUTORIAL_LIVE='yes'", "always")


@pytest.mark.parametrize("live", ["no", 1, None])
def test_setup_checks_the_live_parameter(live):
    if live is None:
        assert lesson.setup("small", "cpu", live=None).mode == "small"
        return
    refused(lambda: lesson.setup("small", "cpu", live=live), ValueError,
            f"LIVE={live!r} is not True or False", "LIVE = True")


def test_setup_accepts_the_live_parameter_as_the_parameters_cell_reads_it(monkeypatch):
    monkeypatch.setenv("MOE_TUTORIAL_LIVE", "0")
    live = os.environ.get("MOE_TUTORIAL_LIVE", "1") not in ("0", "false")
    assert lesson.setup("small", "cpu", live=live).mode == "small"


SIZES = {"small": dict(steps=60, experts=[2, 4], preset="small"),
         "full": dict(steps=400, experts=[2, 4, 8], preset="mixtral-2l")}
BAD_SIZES = {
    "negative steps (would train nothing)": (dict(steps=-5), "steps=-5 must be an integer >= 1"),
    "steps as text": (dict(steps="10"), "steps='10' must be an integer >= 1"),
    "steps a float": (dict(steps=2.5), "steps=2.5 must be an integer >= 1"),
    "a list item not a count": (dict(experts=[2, "x"]), "experts=[2, 'x'] holds 'x'"),
    "a list given as a number": (dict(experts=8), "experts=8 must be a list"),
    "a preset given as a number": (dict(preset=3), "preset=3 must be a name"),
}


@pytest.mark.parametrize("case", sorted(BAD_SIZES))
def test_a_notebook_size_is_checked_against_its_default(case):
    values, message = BAD_SIZES[case]
    with pytest.raises(ValueError, match=re.escape(message) + r".*0 / empty for the small mode"):
        lesson.setup("small", "cpu", SIZES, **values)
