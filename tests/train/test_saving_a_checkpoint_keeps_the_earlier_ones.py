"""Saving a checkpoint keeps what it should: pruning removes only older checkpoints, never the
one just written or a newer one, `keep=1` leaves exactly the newest, and a full disk midway
leaves the previous checkpoints intact and no temporary file."""

from __future__ import annotations

import pytest
from course_helpers import save_checkpoint
from write_mishaps import leftovers

from moe_tutorial import safe_io
from moe_tutorial.train import checkpoint


def test_pruning_keeps_the_checkpoint_just_written_and_newer_ones(tmp_path):
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step)
    save_checkpoint(tmp_path, 1, keep=1)
    assert checkpoint.saved_steps(tmp_path) == [1, 2, 4, 6]


def test_keep_one_leaves_exactly_the_newest(tmp_path):
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, keep=1)
    assert checkpoint.saved_steps(tmp_path) == [6]


def test_a_full_disk_while_checkpointing_leaves_the_previous_one(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 2)

    def save(obj, f):
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(checkpoint.torch, "save", save)
    with pytest.raises(safe_io.WriteFailed, match="step_00000004.pt could not be written.*"
                                                  "previous checkpoints are intact"):
        save_checkpoint(tmp_path, 4)
    assert checkpoint.saved_steps(tmp_path) == [2] and leftovers(tmp_path) == []
    assert checkpoint.verify(checkpoint.path_for(tmp_path, 2)) is None
