"""Regenerate the screenshots under docs/ from the current course.

    python tools/screenshots.py [PYTEST ARGS]

runs the browser tests (tests/integration/test_browser.py: JupyterLab started as `make lab` starts it, on a
fresh working copy, driven in Debian's headless Chromium) with MOE_TUTORIAL_UPDATE_DOCS=1, so
each test copies its screenshots into docs/ once its checks have passed: a picture in docs/ is
always one of a course that worked. It then lists which pictures were written and fails (exit 1)
when a test failed or a picture in docs/ was not regenerated. Needs `chromium` (apt-get install
chromium) and the test extra (playwright).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def main(pytest_args: list[str]) -> int:
    before = {p.name: p.stat().st_mtime_ns for p in DOCS.glob("*.png")}
    env = {**os.environ, "MOE_TUTORIAL_UPDATE_DOCS": "1", "MOE_TUTORIAL_REQUIRE_BROWSER": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(ROOT / "tests" / "test_browser.py"), *pytest_args],
                           cwd=ROOT, env=env)
    after = {p.name: p.stat().st_mtime_ns for p in DOCS.glob("*.png")}
    written = sorted(name for name, mtime in after.items() if before.get(name) != mtime)
    stale = sorted(set(after) - set(written))
    for name in written:
        print(f"wrote docs/{name} ({(DOCS / name).stat().st_size / 1024:.0f} KiB)")
    for name in stale:
        print(f"not regenerated: docs/{name} (its test failed, was deselected, or no test "
              "writes it any more)", file=sys.stderr)
    if tests.returncode != 0:
        print(f"the browser tests failed (exit {tests.returncode}): the pictures of the tests "
              "that passed are written, the others are left as they were", file=sys.stderr)
        return 1
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
