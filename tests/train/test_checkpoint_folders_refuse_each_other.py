"""A training run writes checkpoints only into a folder of its own: the Python API refuses,
before any step, a folder holding another run's checkpoints, one another run holds, a file and a
dangling link; a run frees its folder when it ends, its own folder takes it back on resume, and
resuming with another model names the fields that differ."""

from __future__ import annotations

import pytest
import torch
from course_helpers import save_checkpoint
from refused_on_one_line import refused
from tiny_model_training import BATCHES, FEW_STEPS, fresh_tiny_model
from write_mishaps import leftovers

from moe_tutorial import safe_io
from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.train import checkpoint
from moe_tutorial.train.checkpoint import CheckpointError, Checkpointing
from moe_tutorial.train.loop import TrainSettings, train


def _refused_before_any_step(directory, resume=False, error=CheckpointError, match=""):
    steps = []
    with pytest.raises(error, match=match):
        train(fresh_tiny_model(), BATCHES, FEW_STEPS, progress=False, on_step=steps.append,
              checkpoint=Checkpointing(directory), resume=resume)
    assert steps == []


def test_the_api_refuses_a_folder_of_another_runs_checkpoints(tmp_path):
    save_checkpoint(tmp_path, 50)
    _refused_before_any_step(tmp_path, match=r"already holds the checkpoints of a run "
                                             r"\(steps \[50\]\); resume it")
    assert checkpoint.saved_steps(tmp_path) == [50]


def test_the_api_refuses_a_folder_another_run_holds(tmp_path):
    with safe_io.hold_folder(tmp_path, "training run"):
        _refused_before_any_step(tmp_path, error=safe_io.FolderBusy,
                                 match="in use by training run")


def test_the_api_refuses_a_checkpoint_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("notes")
    _refused_before_any_step(tmp_path / "f", match="is a file, not a directory")


def test_the_api_refuses_a_dangling_link(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    _refused_before_any_step(tmp_path / "link", match="is a link to .*gone, which does not exist")


def test_a_run_frees_its_folder_when_it_ends(tmp_path):
    train(fresh_tiny_model(), BATCHES, FEW_STEPS, progress=False,
          checkpoint=Checkpointing(tmp_path))
    assert checkpoint.saved_steps(tmp_path) == [3] and leftovers(tmp_path) == []
    safe_io.check_folder_free(tmp_path, "training run")


def test_a_resumed_run_into_its_own_folder_is_accepted(tmp_path):
    train(fresh_tiny_model(), BATCHES, FEW_STEPS, progress=False,
          checkpoint=Checkpointing(tmp_path, every=2))
    checkpoint.path_for(tmp_path, 3).unlink()  # as if stopped after step 2
    history = train(fresh_tiny_model(), BATCHES, FEW_STEPS, progress=False,
                    checkpoint=Checkpointing(tmp_path, every=2), resume=True)
    assert [r["step"] for r in history] == [1, 2, 3]


def test_resuming_with_another_model_names_the_fields(tmp_path):
    torch.manual_seed(0)
    model = MoEForCausalLM(preset("tiny"))
    windows = torch.randint(3, 24, (8, 17))
    settings = TrainSettings(steps=1, batch_size=2, warmup_steps=0, eval_every=0)
    train(model, windows, settings, checkpoint=Checkpointing(tmp_path, every=1), progress=False)
    wider = MoEForCausalLM(preset("tiny").with_overrides(num_experts=8))
    refused(lambda: train(wider, windows, settings, checkpoint=Checkpointing(tmp_path, every=1),
                          resume=True, progress=False),
            CheckpointError, "num_experts: checkpoint 4, now 8", absent=("--",))
