"""The one reader of the course's committed results (`benchmarks/results/` of the repository), the
measurements the notebooks and the package quote.

They are found in the clone the current directory is in (`locations.checkout_root`), so a
notebook in notebooks/ or work/notebooks/ and a command run at the repository's root read the same
files. They are not shipped in the wheel: they are the repository's record of runs, one file per
run, which tools/docs.py and the tests read there too, and a copy inside the package would drift
from it. An installed package run outside a clone gets one line naming the missing file and where
it was looked for; `analyze` then says which quoted numbers it leaves out."""

from __future__ import annotations

import json
from pathlib import Path

from ..locations import checkout_root, outside_checkout

FOLDER = "benchmarks/results"
H200 = f"{FOLDER}/h200.json"  # the course's committed one-H200 run


def find(name: str | Path) -> Path | None:
    """The committed result file `name` (`h200.json`, or `benchmarks/results/h200.json` as the docs
    write it) of the clone the current directory is in; None outside a clone or where the clone
    has no such file (a notebook then says it quotes nothing)."""
    root = checkout_root()
    given = Path(name)
    prefix = tuple(FOLDER.split("/"))
    relative = Path(*given.parts[len(prefix):]) if given.parts[:len(prefix)] == prefix else given
    found = root / FOLDER / relative if root is not None and not given.is_absolute() else None
    return found if found is not None and found.is_file() else None


def path(name: str | Path) -> Path:
    """A result file: `name` as given where it exists (a run of your own), else the committed file
    of that name (`find`). A ValueError names the file and what to pass instead."""
    given = Path(name)
    if given.is_file():
        return given
    found = find(given)
    if found is not None:
        return found
    fix = f"pass the JSON that `python -m moe_tutorial bench` wrote, e.g. {H200}"
    root = None if given.is_absolute() else checkout_root()
    if root is None and not given.is_absolute():
        raise ValueError(f"{name}: no such results file, and {outside_checkout()}; {fix}")
    where = f" (nor in {root / FOLDER})" if root is not None else ""
    raise ValueError(f"{name}: no such results file{where}; {fix}")


def read(name: str | Path) -> dict:
    """The JSON of a result file (`path`)."""
    return json.loads(path(name).read_text())


def committed() -> list[Path]:
    """Every committed result file (JSON, subfolders included) of the clone the current directory
    is in, by path; none outside a clone. Readers pick runs by what they hold, so a new run needs
    no list of file names updated."""
    root = checkout_root()
    return sorted((root / FOLDER).rglob("*.json")) if root is not None else []


def relative(path: Path) -> str:
    """A committed result file as the docs write it: `benchmarks/results/<name>`."""
    return f"{FOLDER}/{path.relative_to(checkout_root() / FOLDER).as_posix()}"
