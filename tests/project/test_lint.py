"""The code keeps the lint rules configured in pyproject.toml ([tool.ruff])."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check_is_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: install the test extra (pip install -e '.[test]')")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
