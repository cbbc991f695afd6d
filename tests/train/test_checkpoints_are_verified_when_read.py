"""A checkpoint is saved with its checksum and checked against it when read: a flipped bit, a
missing or garbled checksum, a truncated file, another format or a file that is no checkpoint at
all is refused on one line, naming the newest intact checkpoint or saying none is left."""

from __future__ import annotations

import pytest
import torch
from course_helpers import save_checkpoint
from refused_on_one_line import refused

from moe_tutorial import safe_io
from moe_tutorial.train import checkpoint
from moe_tutorial.train.checkpoint import CheckpointError


def test_a_checkpoint_is_saved_with_its_checksum_and_nothing_else(tmp_path):
    path = save_checkpoint(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".sha256"]
    assert checkpoint.verify(path) is None


def test_a_flipped_bit_is_damage_naming_the_newest_intact_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 2)
    newest = save_checkpoint(tmp_path, 4)
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 1
    newest.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"step_00000004.pt is damaged.*newest intact one "
                                              r"is .*step_00000002.pt"):
        checkpoint.load_latest(tmp_path)


def test_a_checkpoint_without_its_checksum_is_not_trusted(tmp_path):
    path = save_checkpoint(tmp_path, 2)
    checkpoint.checksum_path(path).unlink()
    with pytest.raises(CheckpointError, match="checksum file .* is missing.*start a new run"):
        checkpoint.load_latest(tmp_path)


def test_a_truncated_only_checkpoint_says_none_is_left(tmp_path):
    path = save_checkpoint(tmp_path, 2)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="damaged.*no intact checkpoint is left"):
        checkpoint.load_latest(tmp_path)


def test_a_checkpoint_of_another_format_is_refused_by_name(tmp_path):
    path = save_checkpoint(tmp_path, 2)
    state = torch.load(path, weights_only=True)
    state["format"] = checkpoint.FORMAT + 1
    with safe_io.atomic_file(path, replace=True) as f:
        writer = safe_io.HashingWriter(f)
        torch.save(state, writer)
    checkpoint.checksum_path(path).write_text(writer.digest.hexdigest() + "\n")
    refused(lambda: checkpoint.load_latest(tmp_path), CheckpointError, "format",
            "start a new run")


def test_a_step_file_that_is_no_checkpoint_is_refused_not_a_traceback(tmp_path):
    path = checkpoint.path_for(tmp_path, 4)
    torch.save([1, 2, 3], path)
    checkpoint.checksum_path(path).write_text(safe_io.sha256_of(path) + "\n")
    refused(lambda: checkpoint.load_latest(tmp_path), CheckpointError, str(path),
            "not a checkpoint")


def test_a_checksum_file_of_garbage_is_damage_naming_the_intact_one(tmp_path):
    save_checkpoint(tmp_path, 2)
    newest = save_checkpoint(tmp_path, 4)
    checkpoint.checksum_path(newest).write_text("garbage\n")
    refused(lambda: checkpoint.load_latest(tmp_path), CheckpointError, "step_00000004.pt",
            "damaged", "step_00000002.pt")


def test_a_leftover_temporary_file_is_not_a_checkpoint(tmp_path):
    (tmp_path / "step_00000002.pt.tmp").write_bytes(b"half")
    refused(lambda: checkpoint.load_latest(tmp_path), CheckpointError, "nothing to resume")
