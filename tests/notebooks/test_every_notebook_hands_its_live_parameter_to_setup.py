"""Every chapter notebook (in notebooks/, solutions/ and exercises/) that has a LIVE parameter
hands it to its setup cell, which checks it: LIVE = "no" would otherwise draw the live widgets
(a non-empty string is true) without a word."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

COURSE = Path(__file__).resolve().parents[2]


def _python(cell: dict) -> str:
    """A code cell's Python: IPython's magic lines (`%%needs_gpu ...`) left out."""
    return "\n".join(line for line in "".join(cell["source"]).splitlines()
                     if not line.lstrip().startswith("%"))


@pytest.mark.parametrize("path", sorted(
    p.relative_to(COURSE).as_posix() for folder in ("notebooks", "solutions", "exercises")
    for p in (COURSE / folder).glob("[0-9][0-9]_*.ipynb")))
def test_every_notebook_hands_its_live_parameter_to_setup(path):
    """A notebook's LIVE reaches setup, which checks it: LIVE = "no" would otherwise draw the
    live widgets (a non-empty string is true) without a word."""
    cells = [c for c in json.loads((COURSE / path).read_text())["cells"] if c["cell_type"] == "code"]
    parameters = next(c for c in cells if "parameters" in c["metadata"].get("tags", []))
    if "LIVE" not in {node.id for node in ast.walk(ast.parse(_python(parameters)))
                      if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}:
        pytest.skip("no LIVE parameter")
    calls = [node for cell in cells for node in ast.walk(ast.parse(_python(cell)))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"]
    assert calls, "no setup(...) call"
    first, *later = calls
    live = [k.value for k in first.keywords if k.arg == "live"]
    assert [getattr(v, "id", None) for v in live] == ["LIVE"], ast.unparse(first)[:200]
    for call in later:  # a second setup takes the first one's checked value, or LIVE again
        live = [ast.unparse(k.value) for k in call.keywords if k.arg == "live"]
        assert live in (["LIVE"], ["SETUP.live"]), ast.unparse(call)[:200]
