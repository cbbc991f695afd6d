"""The training API checks its arguments as the command line checks its flags, naming the
argument (never a flag): the settings, the checkpointing (plain and sharded) and `resume`."""

from __future__ import annotations

import pytest
import torch
from refused_on_one_line import refused
from tiny_model_training import tiny_model  # noqa: F401  (a fixture)

from moe_tutorial.parallel import dist_checkpoint
from moe_tutorial.train.checkpoint import Checkpointing
from moe_tutorial.train.loop import TrainSettings, train


def test_train_settings_given_as_text_are_one_clear_error():
    with pytest.raises(ValueError, match=r"TrainSettings.lr='3e-3' must be a finite number > 0"):
        TrainSettings(lr="3e-3")


def test_train_settings_of_zero_steps_are_refused():
    refused(lambda: TrainSettings(steps=0), ValueError, "steps=0")


@pytest.mark.parametrize("kind", [Checkpointing, dist_checkpoint.ShardedCheckpointing])
@pytest.mark.parametrize("arguments, words", [
    ({"directory": None}, "directory=None must be a folder's path"),
    ({"directory": "runs/x", "every": "50"}, "every='50' must be an integer >= 1"),
    ({"directory": "runs/x", "keep": 2.5}, "keep=2.5 must be an integer >= 1"),
])
def test_checkpointing_arguments_are_checked_as_the_flags_are(kind, arguments, words):
    if kind is dist_checkpoint.ShardedCheckpointing:
        arguments = {**arguments, "layout": None}
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        kind(**arguments)


def test_resume_without_a_checkpointing_is_one_line(tiny_model):  # noqa: F811
    refused(lambda: train(tiny_model, torch.randint(3, 24, (4, 9)), TrainSettings(steps=1,
            batch_size=2, warmup_steps=0, eval_every=0), resume=True, progress=False),
            ValueError, "resume=True needs checkpoint=Checkpointing(directory)")
