"""Loading a checkpoint runs no code and reads nothing outside its folder, whatever is on disk.

Whoever can write a checkpoint's folder can rewrite its checksums as well, so every hostile file
here comes with checksums that match it. Each case asserts what a hostile file would have done
did not happen (a marker file its `__reduce__` would write is absent; a read of /dev/zero or a
FIFO, which would never end, is refused at once) and that the refusal is one line naming the
file. Single-file checkpoints (`train.checkpoint`) and distributed ones (`dist_checkpoint`, in
one process) alike; then checkpoints of the other kind, of an earlier format, of another
backend, and a save that fails inside DCP."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle

import pytest
import torch
from course_helpers import one_line_error, save_checkpoint
from torch.distributed.checkpoint import filesystem as dcp_filesystem

from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.parallel import dist_checkpoint, dist_checkpoint_reader
from moe_tutorial.train import checkpoint
from moe_tutorial.train.checkpoint import CheckpointError, Checkpointing
from moe_tutorial.train.loop import TrainSettings, make_optimizer

# Without a process group DCP warns that it assumes one process: what these tests mean
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class RunsCode:
    """Unpickled by a plain `pickle.load`, it would create `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def one_line(exc_info, *words: str) -> str:
    message = str(exc_info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------
# Single-file checkpoints

def replace_checkpoint(path, data: bytes) -> None:
    """`path` now holds `data`, with the checksum beside it that matches."""
    path.write_bytes(data)
    checkpoint.checksum_path(path).write_text(sha256(data) + "\n")


def saved_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_a_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    path = save_checkpoint(tmp_path, 2)
    marker = tmp_path / "ran"
    replace_checkpoint(path, saved_bytes({"format": checkpoint.FORMAT, "x": RunsCode(marker)}))
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_latest(tmp_path)
    one_line(info, str(path), "objects other than tensors", "posix.system", "start a new run")
    assert not marker.exists()


def test_a_hostile_newest_checkpoint_names_the_intact_one_before_it(tmp_path):
    save_checkpoint(tmp_path, 2)
    path = save_checkpoint(tmp_path, 4)
    marker = tmp_path / "ran"
    replace_checkpoint(path, saved_bytes([RunsCode(marker)]))
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_latest(tmp_path)
    one_line(info, "newest intact one is", "step_00000002.pt")
    assert not marker.exists()


@pytest.mark.parametrize("make", ["link_to_dev_zero", "fifo", "folder"])
def test_a_checkpoint_that_is_no_plain_file_is_refused_without_reading_it(tmp_path, make):
    path = save_checkpoint(tmp_path, 2)
    path.unlink()
    if make == "link_to_dev_zero":
        path.symlink_to("/dev/zero")
    elif make == "fifo":
        os.mkfifo(path)  # opening it for reading would wait for a writer forever
    else:
        path.mkdir()
        (tmp_path / "step_00000002.pt" / "x").write_text("")
    checkpoint.checksum_path(path).write_text(sha256(b"") + "\n")
    if make == "folder":  # a folder of that name is not a checkpoint file at all
        with pytest.raises(CheckpointError, match="no checkpoint"):
            checkpoint.load_latest(tmp_path)
        return
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_latest(tmp_path)
    one_line(info, str(path), "is damaged", "link" if make == "link_to_dev_zero" else "plain file")


@pytest.mark.parametrize("make", ["link_to_dev_zero", "huge", "fifo"])
def test_a_checksum_file_that_would_never_end_is_refused(tmp_path, make):
    path = save_checkpoint(tmp_path, 2)
    checksum = checkpoint.checksum_path(path)
    checksum.unlink()
    if make == "link_to_dev_zero":
        checksum.symlink_to("/dev/zero")
    elif make == "fifo":
        os.mkfifo(checksum)
    else:
        checksum.write_bytes(b"0" * (checkpoint.CHECKSUM_LIMIT + 1))
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_latest(tmp_path)
    one_line(info, "checksum file cannot be read", "no intact checkpoint is left")


def test_a_checkpoint_of_an_earlier_format_is_refused_by_name(tmp_path):
    path = save_checkpoint(tmp_path, 2)
    state = torch.load(path, weights_only=True)
    replace_checkpoint(path, saved_bytes({**state, "format": 0}))
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_latest(tmp_path)
    one_line(info, "format 0", f"this version writes {checkpoint.FORMAT}", "start a new run")


def test_a_checkpoint_that_holds_no_training_state_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, 2)
    replace_checkpoint(path, saved_bytes([1, 2, 3]))
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_latest(tmp_path)
    one_line(info, "holds a list", "not a training state")


def test_a_checkpoint_of_another_expert_backend_names_the_backend_to_resume_with(tmp_path):
    settings = TrainSettings(steps=2, warmup_steps=0)
    saved = MoEForCausalLM(preset("tiny"), "naive")
    Checkpointing(tmp_path).save(saved, make_optimizer(saved, settings), 1, [], {}, {})
    now = MoEForCausalLM(preset("tiny"), "te_ops")
    with pytest.raises(CheckpointError) as info:
        Checkpointing(tmp_path).resume(now, make_optimizer(now, settings), {}, {})
    one_line(info, "does not fit this model", "saved with --backend naive",
             "this run uses te_ops", "resume with --backend naive")


# ---------------------------------------------------------------------------------------------
# Distributed checkpoints

@pytest.fixture()
def saved(tmp_path):
    """(model, optimizer, the folder of a complete distributed checkpoint of step 1)."""
    torch.manual_seed(0)
    model = MoEForCausalLM(preset("tiny")).set_expert_backend("grouped_torch")
    optimizer = make_optimizer(model, TrainSettings(steps=2, warmup_steps=0))
    path = dist_checkpoint.save(model, optimizer, tmp_path / "run", step=1)
    return model, optimizer, path


def reseal(path) -> None:
    """Rewrite meta.json's checksums to match the folder's files, as a forger would."""
    meta = json.loads((path / "meta.json").read_text())
    meta["files"] = {name: sha256((path / name).read_bytes()) for name in meta["files"]}
    (path / "meta.json").write_text(json.dumps(meta))


def edit_meta(path, **changes) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta.update(changes)
    (path / "meta.json").write_text(json.dumps(meta))


def load(saved):
    model, optimizer, path = saved
    return dist_checkpoint.load(model, optimizer, path.parent)


def test_a_distributed_index_that_would_run_code_is_refused_and_runs_nothing(saved, tmp_path):
    path = saved[2]
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    reseal(path)
    with pytest.raises(CheckpointError) as info:
        load(saved)
    one_line(info, ".metadata", "posix.system", "nothing in it ran", "move step_00000001 away")
    assert not marker.exists()


def test_a_distributed_index_of_another_class_is_refused(saved):
    path = saved[2]
    (path / ".metadata").write_bytes(pickle.dumps({"not": "an index"}))
    reseal(path)
    with pytest.raises(CheckpointError) as info:
        load(saved)
    one_line(info, "holds a dict, not a DCP index")


def test_a_distributed_index_cut_short_is_refused(saved):
    path = saved[2]
    (path / ".metadata").write_bytes((path / ".metadata").read_bytes()[:100])
    reseal(path)
    with pytest.raises(CheckpointError) as info:
        load(saved)
    one_line(info, "is not a DCP index the course wrote")


def test_a_shard_entry_that_would_run_code_is_refused_and_runs_nothing(saved, tmp_path):
    """DCP's own planner unpickles the non-tensor entries (the optimizer's hyperparameters)
    with weights_only=False: a forged one is refused here instead."""
    path = saved[2]
    marker = tmp_path / "ran"
    shard = path / "__0_0.distcp"
    hostile = saved_bytes(RunsCode(marker))
    offset = shard.stat().st_size
    shard.write_bytes(shard.read_bytes() + hostile)
    index = pickle.loads((path / ".metadata").read_bytes())  # our own, trusted, file
    key = next(k for k in index.storage_data if k.fqn == "optimizer.param_groups.0.lr")
    index.storage_data[key] = dcp_filesystem._StorageInfo("__0_0.distcp", offset, len(hostile))
    (path / ".metadata").write_bytes(pickle.dumps(index))
    reseal(path)
    with pytest.raises(CheckpointError) as info:
        load(saved)
    one_line(info, "objects other than tensors", "nothing in it ran")
    assert not marker.exists()


@pytest.mark.parametrize("where", [("../outside.bin", 0, 4), ("__0_0.distcp", 0, 10**12),
                                   ("meta.json", 0, 4)])
def test_a_distributed_index_that_points_outside_its_shards_is_refused(saved, tmp_path, where):
    path = saved[2]
    (tmp_path / "run" / "outside.bin").write_bytes(b"1234")
    index = pickle.loads((path / ".metadata").read_bytes())
    key = next(iter(index.storage_data))
    index.storage_data[key] = dcp_filesystem._StorageInfo(*where)
    (path / ".metadata").write_bytes(pickle.dumps(index))
    reseal(path)
    with pytest.raises(CheckpointError) as info:
        load(saved)
    one_line(info, "not within a shard file meta.json lists")


def test_a_distributed_index_with_a_storage_transform_is_refused(saved):
    path = saved[2]
    index = pickle.loads((path / ".metadata").read_bytes())
    key = next(iter(index.storage_data))
    info_ = index.storage_data[key]
    index.storage_data[key] = dcp_filesystem._StorageInfo(
        info_.relative_path, info_.offset, info_.length, ["zstd"])
    (path / ".metadata").write_bytes(pickle.dumps(index))
    reseal(path)
    with pytest.raises(CheckpointError) as info:
        load(saved)
    one_line(info, "not within a shard file meta.json lists")


@pytest.mark.parametrize("name", ["../../outside.bin", "/dev/zero", "", "..", "a/b"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused_without_reading_it(saved,
                                                                                   name):
    path = saved[2]
    meta = json.loads((path / "meta.json").read_text())
    meta["files"][name] = "0" * 64
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as info:
        load(saved)
    one_line(info, "is damaged", "not a file of the checkpoint's own folder")


@pytest.mark.parametrize("make", ["link_to_dev_zero", "fifo", "folder", "link_outside"])
def test_a_manifest_naming_what_is_no_plain_file_is_refused_at_once(saved, tmp_path, make):
    path = saved[2]
    entry = path / "extra"
    if make == "link_to_dev_zero":
        entry.symlink_to("/dev/zero")
    elif make == "fifo":
        os.mkfifo(entry)
    elif make == "folder":
        entry.mkdir()
    else:
        (tmp_path / "secret").write_text("not the checkpoint's")
        entry.symlink_to(tmp_path / "secret")
    edit_meta(path, files={**json.loads((path / "meta.json").read_text())["files"],
                           "extra": "0" * 64})
    with pytest.raises(CheckpointError) as info:
        load(saved)
    one_line(info, str(entry), "link" if "link" in make else "not a plain file")


def test_a_manifest_without_the_index_is_refused(saved):
    path = saved[2]
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"][".metadata"]
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as info:
        load(saved)
    one_line(info, "does not list DCP's index")


@pytest.mark.parametrize("make", ["link", "fifo", "huge", "not_json", "a_list", "utf16"])
def test_a_manifest_that_is_no_manifest_is_refused_at_once(saved, tmp_path, monkeypatch, make):
    path = saved[2]
    meta = path / "meta.json"
    text = meta.read_text()
    meta.unlink()
    if make == "link":
        (tmp_path / "elsewhere.json").write_text(text)
        meta.symlink_to(tmp_path / "elsewhere.json")
    elif make == "fifo":
        os.mkfifo(meta)
    elif make == "huge":
        meta.write_text(text)
        monkeypatch.setattr(dist_checkpoint_reader, "META_LIMIT", len(text) - 1)
    elif make == "not_json":
        meta.write_text(text[:20])
    elif make == "a_list":
        meta.write_text("[1, 2]")
    else:
        meta.write_text(text, encoding="utf-16")
    with pytest.raises(CheckpointError) as info:
        load(saved)
    one_line(info, str(path), "is damaged")


@pytest.mark.parametrize("changes", [{"format": 0}, {"config": "tiny"}, {"step": "1"},
                                     {"run": None}])
def test_a_manifest_of_another_format_or_types_is_refused(saved, changes):
    path = saved[2]
    edit_meta(path, **changes)
    with pytest.raises(CheckpointError) as info:
        load(saved)
    one_line(info, str(path), "format 0" if "format" in changes else "another type there")


def test_a_checkpoint_folder_that_is_a_link_is_refused(saved, tmp_path):
    path = saved[2]
    path.rename(tmp_path / "elsewhere")
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError) as info:
        load(saved)
    one_line(info, "it is a link", "not a folder the course saved")


def test_forged_optimizer_hyperparameters_of_another_type_are_refused(saved):
    model, optimizer, path = saved
    original = torch.load  # the hyperparameter entries: plain values, loaded weights_only
    lr = optimizer.param_groups[0]["lr"]

    def forged(f, *args, **kwargs):
        value = original(f, *args, **kwargs)
        return "fast" if isinstance(value, float) and value == lr else value

    import moe_tutorial.parallel.dist_checkpoint_reader as reader
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reader.torch, "load", forged)
        with pytest.raises(CheckpointError) as info:
            dist_checkpoint.load(model, optimizer, path.parent)
    one_line(info, "lr='fast'", "not a value of the type AdamW takes")


def test_an_intact_checkpoint_still_loads_after_all_these_checks(saved):
    assert load(saved) == 1


# ---------------------------------------------------------------------------------------------
# A save that fails inside DCP: its BaseException becomes one line

def test_a_full_disk_during_a_distributed_save_is_one_line_and_keeps_the_previous(saved,
                                                                                   monkeypatch):
    model, optimizer, path = saved

    def full(self, path, mode):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_filesystem.FileSystem, "create_stream", full)
    with pytest.raises(CheckpointError) as info:  # not DCP's CheckpointException
        dist_checkpoint.save(model, optimizer, path.parent, step=2)
    one_line(info, "step_00000002 could not be saved", "No space left",
             "the checkpoints before it are intact")
    assert dist_checkpoint.complete_steps(path.parent) == [1]


def test_a_failed_background_save_raises_one_line_from_its_result(saved, monkeypatch):
    model, optimizer, path = saved

    def full(self, path, mode):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_filesystem.FileSystem, "create_stream", full)
    future = dist_checkpoint.save(model, optimizer, path.parent, step=2, async_save=True)
    with pytest.raises(CheckpointError) as info:
        future.result()
    dist_checkpoint._background.pending = None  # the next test's save need not wait for it
    one_line(info, "could not be saved", "No space left")


# ---------------------------------------------------------------------------------------------
# One kind of checkpoint per folder; an empty --checkpoint-dir

def test_a_one_process_run_refuses_a_folder_of_distributed_checkpoints(saved):
    with pytest.raises(CheckpointError) as info:
        with Checkpointing(saved[2].parent).hold(resume=True):
            pass
    one_line(info, "distributed checkpoints", "`train_dist`", "choose another directory")


def test_a_distributed_run_refuses_a_folder_of_one_process_checkpoints(tmp_path):
    save_checkpoint(tmp_path, 2)
    with pytest.raises(CheckpointError) as info:
        with dist_checkpoint.ShardedCheckpointing(tmp_path, None).hold(resume=False):
            pass
    one_line(info, "one-process checkpoints", "`train`", "choose another directory")


def test_train_refuses_a_folder_of_distributed_checkpoints_before_training(saved, capsys,
                                                                           no_work):
    one_line_error(capsys, ["train", "--preset", "tiny", "--checkpoint-dir",
                            str(saved[2].parent), "--resume"], "distributed checkpoints")


@pytest.mark.parametrize("value", ["", "  "])
def test_train_refuses_an_empty_checkpoint_dir(capsys, no_work, value):
    one_line_error(capsys, ["train", "--checkpoint-dir", value], "--checkpoint-dir is empty",
                   "leave the flag out")


@pytest.mark.parametrize("run", [{"settings": [1]}, {"history": "all"}])
def test_a_manifest_whose_run_is_of_another_kind_is_refused_on_resume(saved, run):
    model, optimizer, path = saved
    edit_meta(path, run=run)
    with pytest.raises(CheckpointError) as info:
        dist_checkpoint.ShardedCheckpointing(path.parent, None).resume(model, optimizer, {}, {})
    one_line(info, "holds no settings and history of the kind the course writes")


def test_pruning_never_follows_a_link_to_someone_elses_folder(saved, tmp_path):
    model, optimizer, path = saved
    mine = tmp_path / "my_results"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (path.parent / "step_00000000").symlink_to(mine)
    dist_checkpoint.save(model, optimizer, path.parent, step=2, keep=1)
    assert (mine / "notes.txt").read_text() == "mine"
    assert not path.exists() and dist_checkpoint.path_for(path.parent, 2).is_dir()
