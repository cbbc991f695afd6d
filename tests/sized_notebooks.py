"""A notebook whose parameters its setup cell checks as sizes, as the chapters do, for the tests
of what the course runner checks before it runs a notebook.

The `sized` fixture is imported by name into the test modules that use it."""

from __future__ import annotations

from pathlib import Path

import pytest
from course_helpers import notebook


def sized_notebook(folder: Path) -> Path:
    """A notebook whose parameters the setup cell checks as sizes, as the chapters do."""
    return notebook(folder / "01_a.ipynb",
                    "from moe_tutorial.course.lesson import setup\n"
                    "DEFAULTS = {'small': dict(steps=60, sizes=[2, 4]), "
                    "'full': dict(steps=400, sizes=[2, 4, 8])}\n"
                    "SETUP = setup(MODE, DEVICE, DEFAULTS, steps=STEPS, sizes=list(SIZES))",
                    parameters="MODE = ''\nDEVICE = ''\nLIVE = False\nSTEPS = 0\nSIZES = []\nSEED = 0")


@pytest.fixture
def sized(fake_checkout, fast_papermill) -> list[Path]:
    """The checkout's notebooks folder holding one sized notebook; the list of it."""
    return [sized_notebook(fake_checkout / "notebooks")]
