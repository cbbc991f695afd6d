"""What can befall a write, for the tests that a result, checkpoint or notebook is written whole
or not at all: a full disk, a link into the course's own folders, a folder another process
holds; and `leftovers`, the temporary or lock files a write may leave behind.

The fixtures here are imported by name into the test modules that use them."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from moe_tutorial import safe_io


def leftovers(folder: Path) -> list[str]:
    """Temporary or lock files a write left behind in `folder`."""
    return sorted(p.name for p in Path(folder).iterdir()
                  if p.name.endswith(".tmp") or p.name == safe_io.LOCK_NAME)


@pytest.fixture
def course_dir(tmp_path, monkeypatch) -> Path:
    """A stand-in for the course's own folders: links into it must never be written through."""
    root = tmp_path / "course"
    for name in ("notebooks", "solutions", "moe_tutorial"):
        (root / name).mkdir(parents=True)
    (root / "solutions" / "01_router.ipynb").write_text("the solution")
    monkeypatch.setattr(safe_io, "course_folders", lambda *near: [
        (root / name).resolve() for name in ("notebooks", "solutions", "moe_tutorial")])
    return root


@pytest.fixture
def full_disk(monkeypatch):
    """Every fsync fails as on a full disk."""
    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safe_io.os, "fsync", fsync)


HOLDER = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"what": "training run", "pid": os.getpid(), "host": "here",
                         "command": "holder", "started": time.time()}).encode())
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding tmp_path/held, as a running `train` would."""
    folder = tmp_path / "held"
    folder.mkdir()
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder / safe_io.LOCK_NAME)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    yield folder, process
    process.kill()
    process.wait()
