"""What GPU users start from: `info` says when Transformer Engine is not the release the course
was checked with, and the Dockerfile's course steps work (run here in a fresh venv)."""

from dataclasses import replace

import pytest

from moe_tutorial import hardware
from moe_tutorial.__main__ import main


@pytest.mark.parametrize("te_version, cuda, expected", [
    ("2.20.2", True, None),
    ("2.20.0+6f3a2c1", False, None),
    ("2.19.0", True, "Transformer Engine 2.19.0 is installed; the course was checked with 2.20.x"),
    ("2.2.0", False, "Transformer Engine 2.2.0 is installed; the course was checked with 2.20.x"),
    (None, True, "`make gpu` installs TE 2.20"),
    (None, False, None),  # a CPU machine: the stand-ins are the course's plan there
])
def test_info_warns_when_te_is_not_the_checked_release(monkeypatch, capsys, te_version, cuda,
                                                       expected):
    real = hardware.capabilities

    def faked(import_te=True):
        caps = real(import_te=False)
        gpu = dict(cuda_available=True, gpu_name="NVIDIA H200", compute_capability=(9, 0),
                   gpu_count=1, cuda_version="13.0") if cuda else {}
        return replace(caps, env=replace(caps.env, te_version=te_version, **gpu))

    monkeypatch.setattr(hardware, "capabilities", faked)
    assert main(["info"]) == 0
    err = capsys.readouterr().err
    assert (expected in err) if expected else err == "", err
