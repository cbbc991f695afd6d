"""Where the package finds files, so that an installed wheel runs as a checkout does: its own data
through `importlib.resources`, a clone's folders from the current directory up, and the folder
it is imported from (for the processes it starts). No module locates a file from its own
`__file__` (tests/project/test_architecture.py fails on one), since a wheel holds no repository folders."""

from __future__ import annotations

import importlib.resources
import importlib.util
from pathlib import Path

PACKAGE = __name__.split(".")[0]


def package_data(*parts: str) -> Path:
    """A file or folder shipped inside the package (`assets/`, `configs/`: pyproject's
    package-data), as a path."""
    return Path(str(importlib.resources.files(PACKAGE).joinpath(*parts)))


def package_dir() -> Path:
    """The package's own folder, resolved."""
    return package_data().resolve()


def import_root() -> Path:
    """The folder the package is imported from (a checkout or site-packages): what a child process
    needs on its PYTHONPATH to import this same package."""
    return Path(importlib.util.find_spec(PACKAGE).origin).resolve().parents[1]


# What a clone of the course's repository holds at its root (make lab's work/ copy has no
# moe_tutorial/, so a notebook run there finds the clone above it).
CHECKOUT_FOLDERS = ("moe_tutorial", "notebooks", "solutions")


def checkout_root(start: Path | None = None) -> Path | None:
    """The clone of the course's repository the current directory (or `start`) is in: that
    directory or the nearest one above it holding `CHECKOUT_FOLDERS`; None outside any. A
    notebook runs in notebooks/ (or work/notebooks/), the commands at the root: all find the
    same clone."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if _is_checkout(folder):
            return folder
        marker = folder / CLONE_MARKER
        if marker.is_file() and _is_checkout(clone := Path(marker.read_text().strip())):
            return clone  # a working copy made elsewhere (make lab's, the browser test's)
    return None


# What `make lab`'s working copy holds at its root: the path of the clone it was copied from, so
# a notebook run in a working copy outside the clone still finds the clone's results.
CLONE_MARKER = ".moe-tutorial-clone"


def _is_checkout(folder: Path) -> bool:
    return all((folder / name).is_dir() for name in CHECKOUT_FOLDERS)


def checkout_roots(*paths: Path) -> list[Path]:
    """The clones the current directory and `paths` (which need not exist) are in, each once: a
    guard on a target path sees the clone it lies in wherever the command runs."""
    found = [checkout_root(), *(checkout_root(Path(p)) for p in paths)]
    return list(dict.fromkeys(root for root in found if root is not None))


def outside_checkout() -> str:
    """Why a clone's folder was not found, for the one line of an error."""
    return (f"no clone of the course's repository in {Path.cwd()} or any folder above it (an "
            f"installed package holds no notebooks or results); run inside a clone")
