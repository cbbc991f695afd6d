"""Shared test settings: deterministic CPU runs; `gpu`-marked tests skip (with a reason) on CPU;
and, for parallel workers (`make test` runs `pytest -n auto --dist loadscope`), the order and
grouping that keep both cores busy to the end."""

import os
from pathlib import Path

# In a parallel worker (one per core), this process and what it starts (kernels, ranks, Lab) keep
# to one thread each: torch's default, a thread per core in every worker, puts more busy threads
# than cores on the machine, and an oversubscribed CPU kernel waits for threads that are not
# scheduled (a tiny matmul then takes milliseconds instead of microseconds).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(variable, "1")

import pytest  # noqa: E402  (after the thread settings, which torch reads when it loads)
import torch  # noqa: E402
from course_helpers import fake_checkout, fast_papermill, no_work  # noqa: F401  (fixtures for every test module)

# Marks of the tests that take the longest: they start first, so that the many short tests fill
# the other worker around them instead of a long one starting last, on a worker of its own.
LONG = ("slow", "browser")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    items.sort(key=lambda item: not any(mark in item.keywords for mark in LONG))  # stable


def _modules_with_shared_fixtures(root: Path) -> set[str]:
    """The test modules that define a fixture built once per module (a JupyterLab server, a
    trained model): read from their source, since the scheduler runs before collection."""
    return {path.relative_to(root).as_posix() for path in (root / "tests").rglob("test_*.py")
            if 'scope="module"' in path.read_text() or 'scope="class"' in path.read_text()}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope`, with each test its own unit of work except those of a module with a
    module-scoped fixture, which go to one worker together (built once, not once per worker).
    pytest-xdist's own `loadgroup` would do this with marks, but it renames node ids in a way
    pytest 9.2 no longer honours."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    shared = _modules_with_shared_fixtures(config.rootpath)

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in shared else nodeid

    return SharedFixtureScheduling(config, log)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
