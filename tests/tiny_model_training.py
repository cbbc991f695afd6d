"""The tiny model, and a few steps of training it on a handful of random batches, for the tests
that the training loop and the model refuse bad input or report a failed training.

The `tiny_model` fixture is imported by name into the test modules that use it."""

from __future__ import annotations

import pytest
import torch

from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.train.loop import TrainSettings

_BATCH_RANDOM = torch.Generator().manual_seed(0)  # the same batches whatever ran before
BATCHES = [(torch.randint(0, 24, (2, 16), generator=_BATCH_RANDOM),
            torch.randint(0, 24, (2, 16), generator=_BATCH_RANDOM)) for _ in range(3)]
FEW_STEPS = TrainSettings(steps=3, batch_size=2, warmup_steps=0, eval_every=0)


def fresh_tiny_model() -> MoEForCausalLM:
    """A new model of the tiny preset, the same weights every time."""
    torch.manual_seed(0)
    return MoEForCausalLM(preset("tiny"))


@pytest.fixture(scope="module")
def tiny_model() -> MoEForCausalLM:
    """One tiny model shared by a module's tests that only call it."""
    return fresh_tiny_model()
