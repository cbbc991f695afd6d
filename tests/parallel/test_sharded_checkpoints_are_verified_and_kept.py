"""Sharded checkpoints behave as the plain ones do: a folder of another run's is refused, a
damaged shard is named along with the newest intact checkpoint, pruning keeps the one just
written, the arguments are checked by name, and a folder without checkpoints is one line."""

from __future__ import annotations

import pytest
import torch
from refused_on_one_line import refused

from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.parallel import dist_checkpoint
from moe_tutorial.train.checkpoint import CheckpointError

SINGLE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_sharded_checkpointing_refuses_another_runs_folder(tmp_path):
    (tmp_path / "step_00000006").mkdir()
    with pytest.raises(CheckpointError, match=r"steps \[6\]"):
        with dist_checkpoint.ShardedCheckpointing(tmp_path, None).hold(resume=False):
            pass


@SINGLE_PROCESS
def test_a_damaged_shard_is_damage_naming_the_file_and_the_intact_one(tmp_path):
    model = MoEForCausalLM(preset("tiny"))
    optimizer = torch.optim.AdamW(model.parameters())
    dist_checkpoint.save(model, optimizer, tmp_path, step=1)
    newest = dist_checkpoint.save(model, optimizer, tmp_path, step=2)
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    with pytest.raises(CheckpointError, match=rf"step_00000002 is damaged \(.*{shard.name} does "
                                              rf"not match.*newest intact one is "
                                              rf".*step_00000001"):
        dist_checkpoint.load(model, optimizer, tmp_path)


@SINGLE_PROCESS
def test_sharded_pruning_keeps_the_checkpoint_just_written(tmp_path):
    (tmp_path / "step_00000005").mkdir()  # another run's, newer
    (tmp_path / "step_00000005" / "meta.json").write_text("{}")
    model = MoEForCausalLM(preset("tiny"))
    optimizer = torch.optim.AdamW(model.parameters())
    dist_checkpoint.save(model, optimizer, tmp_path, step=1, keep=1)
    assert dist_checkpoint.complete_steps(tmp_path) == [1, 5]


@pytest.mark.parametrize("arguments, words", [
    (dict(every=0), ["every=0"]), (dict(keep=-1), ["keep=-1"]),
    (dict(directory=""), ["directory=''"])])
def test_sharded_checkpointing_arguments_are_checked(tmp_path, arguments, words):
    arguments = {"directory": tmp_path, "layout": None, **arguments}
    refused(lambda: dist_checkpoint.ShardedCheckpointing(**arguments), ValueError, *words)


def test_a_distributed_checkpoint_folder_without_checkpoints_is_one_line(tmp_path):
    refused(lambda: dist_checkpoint.verified_latest(tmp_path), CheckpointError, str(tmp_path))
