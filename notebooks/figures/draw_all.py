"""Redraw every figure of the course: each `<name>.py` in this folder writes `<name>.svg`, except
svg.py (the shared primitives), routing_example.py (data) and this file.

    python notebooks/figures/draw_all.py [OUT_DIR]

OUT_DIR defaults to this folder; tests/notebooks/test_figures.py draws into a temporary one and compares.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOT_FIGURES = {"svg", "draw_all", "routing_example"}


def figure_scripts() -> list[str]:
    """The module names of the figure scripts, sorted."""
    return sorted(p.stem for p in HERE.glob("*.py") if p.stem not in NOT_FIGURES)


def main(out_dir: str | Path | None = None) -> list[Path]:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return [importlib.import_module(name).main(out_dir) for name in figure_scripts()]


if __name__ == "__main__":
    for path in main(sys.argv[1] if len(sys.argv) > 1 else None):
        print(f"wrote {path}")
