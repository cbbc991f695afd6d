"""Shared test settings: deterministic CPU runs; `gpu`-marked tests skip (with a reason) on CPU."""

import pytest
import torch
from course_helpers import fake_checkout, fast_papermill  # noqa: F401  (fixtures for every test module)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
