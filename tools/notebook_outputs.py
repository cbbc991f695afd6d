"""Notebooks are committed without outputs or execution counts: which of the given ones hold any.

    python -m tools.notebook_outputs NOTEBOOK...   # exit 1 naming each notebook that holds some

The pre-commit hook runs it on the notebooks of a commit; tests/project/test_project.py on every
tracked one. Standard library only.
"""

import json
import sys
from pathlib import Path


def with_outputs(paths) -> list[str]:
    """The notebooks among `paths` with a cell that has outputs or an execution count."""
    return [str(path) for path in paths
            if any(cell.get("outputs") or cell.get("execution_count")
                   for cell in json.loads(Path(path).read_text(encoding="utf-8"))["cells"])]


def main(argv: list[str] | None = None) -> int:
    dirty = with_outputs(sys.argv[1:] if argv is None else argv)
    for path in dirty:
        print(f"{path}: holds outputs; clear them (Jupyter: Edit > Clear Outputs of All Cells) "
              f"and commit again", file=sys.stderr)
    return 1 if dirty else 0


if __name__ == "__main__":
    sys.exit(main())
