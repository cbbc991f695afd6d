"""What an unlucky user does to their results, checkpoints and data, one case each, across the
command line, the Python API, the notebook runner and builder, checkpoints, data and HF
conversion. Each case asserts the right outcome: nothing lost (the earlier file intact, no
temporary file left), nothing silently wrong (a failed training or a DNA file is reported), and
a refusal on one line that names the fix, never a traceback.

No case trains more than a few steps of the tiny model on a handful of batches; the disk that
fills up is simulated by making fsync or torch.save fail with ENOSPC."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from course_helpers import WorkStarted, notebook, one_line_error, save_checkpoint

from moe_tutorial import safe_io
from moe_tutorial.cli import main
from moe_tutorial.moe.config import MoEConfig, preset
from moe_tutorial.moe.dispatch import run_experts
from moe_tutorial.moe.experts import GroupedTorchExperts
from moe_tutorial.moe.hf import from_hf
from moe_tutorial.moe.model import MoEForCausalLM, Router
from moe_tutorial.parallel import dist_checkpoint
from moe_tutorial.perf import train_dist
from moe_tutorial.train import checkpoint, data
from moe_tutorial.train.checkpoint import CheckpointError, Checkpointing
from moe_tutorial.train.loop import (
    TrainingDiverged,
    TrainSettings,
    _settings_dict,
    check_learned,
    train,
)

SINGLE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def leftovers(folder: Path) -> list[str]:
    """Temporary or lock files a write left behind in `folder`."""
    return sorted(p.name for p in Path(folder).iterdir()
                  if p.name.endswith(".tmp") or p.name == safe_io.LOCK_NAME)


@pytest.fixture
def course_dir(tmp_path, monkeypatch) -> Path:
    """A stand-in for the course's own folders: links into it must never be written through."""
    root = tmp_path / "course"
    for name in ("notebooks", "solutions", "moe_tutorial"):
        (root / name).mkdir(parents=True)
    (root / "solutions" / "01_router.ipynb").write_text("the solution")
    monkeypatch.setattr(safe_io, "course_folders", lambda *near: [
        (root / name).resolve() for name in ("notebooks", "solutions", "moe_tutorial")])
    return root


@pytest.fixture
def full_disk(monkeypatch):
    """Every fsync fails as on a full disk."""
    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safe_io.os, "fsync", fsync)


# ---------------------------------------------------------------------------------------------
# safe_io: whole or nothing, never through a link into the course, never over a result unasked

def test_a_new_result_is_written_whole_and_leaves_nothing_else(tmp_path):
    safe_io.write_json(tmp_path / "r.json", {"loss": 1.5}, replace=False)
    assert json.loads((tmp_path / "r.json").read_text()) == {"loss": 1.5}
    assert leftovers(tmp_path) == []


def test_an_earlier_result_is_not_replaced_unasked(tmp_path):
    (tmp_path / "r.json").write_text("earlier")
    with pytest.raises(safe_io.UnsafeWrite, match="already exists.*--replace"):
        safe_io.write_json(tmp_path / "r.json", {}, replace=False)
    assert (tmp_path / "r.json").read_text() == "earlier"


def test_an_earlier_result_is_replaced_when_asked(tmp_path):
    (tmp_path / "r.json").write_text("earlier")
    safe_io.write_json(tmp_path / "r.json", [1], replace=True)
    assert json.loads((tmp_path / "r.json").read_text()) == [1]


def test_an_error_while_writing_keeps_the_earlier_file(tmp_path):
    (tmp_path / "r.json").write_text("earlier")
    with pytest.raises(ZeroDivisionError), safe_io.atomic_file(tmp_path / "r.json",
                                                                replace=True) as f:
        f.write(b"half")
        1 / 0
    assert (tmp_path / "r.json").read_text() == "earlier"
    assert leftovers(tmp_path) == []


def test_a_full_disk_keeps_the_earlier_file_and_says_so(tmp_path, full_disk):
    (tmp_path / "r.json").write_text("earlier")
    with pytest.raises(safe_io.WriteFailed, match="No space left.*nothing was changed"):
        safe_io.write_json(tmp_path / "r.json", {"new": 1}, replace=True)
    assert (tmp_path / "r.json").read_text() == "earlier"
    assert leftovers(tmp_path) == []


def test_a_folder_as_the_target_is_refused(tmp_path):
    with pytest.raises(safe_io.UnsafeWrite, match="is a directory; give a file name"):
        safe_io.write_json(tmp_path, {}, replace=True)


def test_a_link_into_the_course_is_never_written_through(tmp_path, course_dir):
    link = tmp_path / "mine.ipynb"
    link.symlink_to(course_dir / "solutions" / "01_router.ipynb")
    with pytest.raises(safe_io.UnsafeWrite, match="inside the course's own solutions/.*remove "
                                                  "the link"):
        safe_io.write_text(link, "overwritten", replace=True)
    assert (course_dir / "solutions" / "01_router.ipynb").read_text() == "the solution"


def test_a_link_elsewhere_is_refused_and_both_kept(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("kept")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    with pytest.raises(safe_io.UnsafeWrite, match="is a link .*remove the link"):
        safe_io.write_json(link, {"new": 1}, replace=True)
    assert target.read_text() == "kept" and link.is_symlink()


def test_a_missing_folder_is_one_clear_error(tmp_path):
    with pytest.raises(safe_io.WriteFailed, match="cannot be written.*choose a folder"):
        safe_io.write_json(tmp_path / "no" / "r.json", {}, replace=False)


def test_two_writers_never_share_a_temporary_name(tmp_path):
    names = {safe_io.temporary_name(tmp_path / "step_00000002.pt") for _ in range(50)}
    assert len(names) == 50


def test_a_result_that_appears_meanwhile_is_not_overwritten(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    with pytest.raises(safe_io.UnsafeWrite, match="appeared while"):
        with safe_io.atomic_file(path, replace=False) as f:
            f.write(b"mine")
            path.write_text("theirs")  # another program, between the check and the rename
    assert path.read_text() == "theirs" and leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# One folder, one writer

def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    with safe_io.hold_folder(tmp_path, "training run"):
        with pytest.raises(safe_io.FolderBusy, match=rf"training run \(pid {os.getpid()} on "):
            with safe_io.hold_folder(tmp_path, "build"):
                pass
    assert leftovers(tmp_path) == []


def test_a_lock_file_a_crash_left_behind_is_taken_over(tmp_path):
    (tmp_path / safe_io.LOCK_NAME).write_text(json.dumps(
        {"what": "training run", "pid": 999999, "host": "h", "command": "x", "started": 0}))
    with safe_io.hold_folder(tmp_path, "training run"):
        info = json.loads((tmp_path / safe_io.LOCK_NAME).read_text())
        assert info["pid"] == os.getpid()
    assert leftovers(tmp_path) == []


HOLDER = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"what": "training run", "pid": os.getpid(), "host": "here",
                         "command": "holder", "started": time.time()}).encode())
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding tmp_path/held, as a running `train` would."""
    folder = tmp_path / "held"
    folder.mkdir()
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder / safe_io.LOCK_NAME)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    yield folder, process
    process.kill()
    process.wait()


def test_a_running_holder_in_another_process_is_named(holder):
    folder, process = holder
    with pytest.raises(safe_io.FolderBusy, match=rf"pid {process.pid} on here.*`holder`"):
        safe_io.check_folder_free(folder, "training run")


def test_a_holder_killed_mid_run_frees_the_folder(holder):
    folder, process = holder
    process.send_signal(signal.SIGKILL)
    process.wait()
    safe_io.check_folder_free(folder, "training run")  # the kernel released its lock


def test_checking_a_missing_folder_makes_nothing(tmp_path):
    safe_io.check_folder_free(tmp_path / "new", "training run")
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------------------------------------
# Checkpoints: verified when read, pruned only of the run's own, refused before training

def _tiny():
    torch.manual_seed(0)
    return MoEForCausalLM(preset("tiny"))


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


def test_pruning_keeps_the_checkpoint_just_written_and_newer_ones(tmp_path):
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step)
    save_checkpoint(tmp_path, 1, keep=1)
    assert checkpoint.saved_steps(tmp_path) == [1, 2, 4, 6]


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


BATCHES = [(torch.randint(0, 24, (2, 16)), torch.randint(0, 24, (2, 16))) for _ in range(3)]
FEW_STEPS = TrainSettings(steps=3, batch_size=2, warmup_steps=0, eval_every=0)


def _refused_before_any_step(directory, resume=False, error=CheckpointError, match=""):
    steps = []
    with pytest.raises(error, match=match):
        train(_tiny(), BATCHES, FEW_STEPS, progress=False, on_step=steps.append,
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
    train(_tiny(), BATCHES, FEW_STEPS, progress=False, checkpoint=Checkpointing(tmp_path))
    assert checkpoint.saved_steps(tmp_path) == [3] and leftovers(tmp_path) == []
    safe_io.check_folder_free(tmp_path, "training run")


def test_a_resumed_run_into_its_own_folder_is_accepted(tmp_path):
    train(_tiny(), BATCHES, FEW_STEPS, progress=False, checkpoint=Checkpointing(tmp_path,
                                                                                 every=2))
    checkpoint.path_for(tmp_path, 3).unlink()  # as if stopped after step 2
    history = train(_tiny(), BATCHES, FEW_STEPS, progress=False,
                    checkpoint=Checkpointing(tmp_path, every=2), resume=True)
    assert [r["step"] for r in history] == [1, 2, 3]


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


# ---------------------------------------------------------------------------------------------
# A failed training is a failure

def _history(*losses, val=None):
    records = [{"step": i + 1, "loss": loss} for i, loss in enumerate(losses)]
    if val is not None:
        records[-1]["val_loss"] = val
    return records


def test_a_loss_that_rose_is_divergence_naming_step_loss_and_fix():
    with pytest.raises(TrainingDiverged, match=r"step 4: the training loss .* ended at 9.000 "
                                               r"nats, worse than at the start \(3.000\).*"
                                               r"Lower the learning rate .*try 0.1"):
        check_learned(_history(3.0, 5.0, 8.0, 9.0), None, 1.0)


def test_a_validation_loss_above_the_uniform_guess_is_divergence():
    with pytest.raises(TrainingDiverged, match=r"validation loss ended at 4.000.*guessing "
                                               rf"uniformly \(ln 24 = {math.log(24):.3f}\)"):
        check_learned(_history(2.0, 1.9, val=4.0), 24, 1e-3)


def test_a_loss_within_the_noise_of_its_start_is_not_divergence():
    check_learned(_history(3.20, 3.21, 3.22), 24, 1e-3)


def test_a_loss_that_fell_is_not_divergence():
    check_learned(_history(3.2, 2.9, 2.5), 24, 1e-3)


def test_a_timing_run_leaves_out_the_learning_check_and_only_it(monkeypatch):
    from moe_tutorial.train import loop

    judged = []
    monkeypatch.setattr(loop, "check_learned", lambda history, *_: judged.append(len(history)))
    settings = TrainSettings(steps=3, batch_size=2, warmup_steps=0, eval_every=0)
    train(_tiny(), BATCHES, settings, progress=False, check_learning=False)
    assert judged == []
    train(_tiny(), BATCHES, settings, progress=False)
    assert judged == [3]


def test_a_huge_learning_rate_in_the_api_is_divergence_with_its_history():
    settings = TrainSettings(steps=3, batch_size=2, warmup_steps=0, eval_every=0, lr=1e4)
    with pytest.raises(TrainingDiverged, match="training diverged") as raised:
        train(_tiny(), BATCHES, settings, progress=False)
    assert all("loss" in r for r in raised.value.history)


# ---------------------------------------------------------------------------------------------
# The command line

def test_validate_keeps_an_earlier_report(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "report.json").write_text("an earlier B200 report")
    one_line_error(capsys, ["validate"], "report.json already exists", "--replace")
    assert (tmp_path / "report.json").read_text() == "an earlier B200 report"


def test_validate_out_that_is_a_folder_is_refused(capsys, tmp_path):
    one_line_error(capsys, ["validate", "--out", str(tmp_path)], "is a directory")


def test_train_json_through_a_link_into_the_course_is_refused(capsys, tmp_path, course_dir,
                                                              no_work):
    link = tmp_path / "result.json"
    link.symlink_to(course_dir / "solutions" / "01_router.ipynb")
    one_line_error(capsys, ["train", "--json", str(link), "--replace"], "solutions/",
                   "remove the link")
    assert (course_dir / "solutions" / "01_router.ipynb").read_text() == "the solution"


def test_analyze_json_into_a_linked_course_folder_is_refused(capsys, tmp_path, course_dir):
    link = tmp_path / "results"
    link.symlink_to(course_dir / "notebooks")
    one_line_error(capsys, ["analyze", "tiny", "--json", str(link / "x.json")],
                   "leads through a link", "notebooks/")
    assert list((course_dir / "notebooks").iterdir()) == []


def test_train_checkpoint_dir_dangling_link_is_refused_before_training(capsys, tmp_path,
                                                                      no_work):
    (tmp_path / "ckpt").symlink_to(tmp_path / "mounted-disk")
    one_line_error(capsys, ["train", "--checkpoint-dir", str(tmp_path / "ckpt")],
                   "does not exist", "create that folder")


def test_train_into_a_held_checkpoint_dir_names_the_holder(capsys, holder, no_work):
    folder, process = holder
    one_line_error(capsys, ["train", "--checkpoint-dir", str(folder)], f"pid {process.pid}",
                   "another folder")


def test_analyze_json_on_a_full_disk_keeps_the_earlier_report(capsys, tmp_path, full_disk):
    earlier = tmp_path / "a.json"
    earlier.write_text("earlier")
    code = main(["analyze", "tiny", "--no-sweep", "--json", str(earlier), "--replace"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "No space left" in err[0], err
    assert earlier.read_text() == "earlier" and leftovers(tmp_path) == []


def test_bench_merge_on_a_full_disk_keeps_the_earlier_merge(capsys, tmp_path, full_disk):
    part = tmp_path / "part.json"
    part.write_text(json.dumps({"environment": {"torch": "2.13"}, "results": []}))
    earlier = tmp_path / "merged.json"
    earlier.write_text("earlier")
    code = main(["bench", "--merge", str(part), "--out", str(earlier), "--replace"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "nothing was changed" in err[0], err
    assert earlier.read_text() == "earlier" and leftovers(tmp_path) == []


def test_train_lr_that_diverges_is_one_line_and_exit_1(capsys, monkeypatch):
    def diverging(*args, **kwargs):
        raise TrainingDiverged("step 3: loss=nan — training diverged (lr=1e+06). Lower the "
                               "learning rate")

    monkeypatch.setattr("moe_tutorial.train.loop.train", diverging)
    monkeypatch.setattr(data, "load_protein_data", lambda *a, **k: data.ProteinData(
        train=torch.randint(3, 23, (8, 65)), val=torch.randint(3, 23, (4, 65)),
        tokenizer=data.ProteinTokenizer(), num_sequences=8, unigram_nats=3.0, source=None))
    one_line_error(capsys, ["train", "--preset", "tiny", "--steps", "3", "--batch-size", "2",
                            "--lr", "1e6"], "step 3", "Lower the learning rate", code=1)


def test_train_dist_resume_with_another_lr_is_one_line_before_any_rank(capsys, tmp_path):
    step = tmp_path / "step_00000004"
    step.mkdir()
    args = train_dist.parse_args(["--mode", "train", "--checkpoint-dir", str(tmp_path)],
                                 check=False)
    saved = _settings_dict(train_dist.train_settings(args))
    (step / "meta.json").write_text(json.dumps({"format": dist_checkpoint.FORMAT,
                                                "run": {"settings": saved}}))
    with pytest.raises(SystemExit) as exit:
        train_dist.parse_args(["--mode", "train", "--checkpoint-dir", str(tmp_path),
                               "--resume", "--lr", "0.01"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1, err
    assert "lr: checkpoint 0.003, now 0.01" in err[0]


def test_train_dist_launch_refuses_a_held_folder_before_torchrun(holder):
    folder, process = holder
    with pytest.raises(safe_io.FolderBusy, match=f"pid {process.pid}"):
        train_dist.launch(2, "--mode", "train", "--checkpoint-dir", str(folder))


def test_launch_reports_a_ranks_one_line_error_alone(monkeypatch):
    said = ("import sys; print('[rank1]: Traceback (most recent call last):'); "
            "print('error: step 3: the training loss ended at 9.000 nats', file=sys.stderr); "
            "sys.exit(1)")
    monkeypatch.setattr(train_dist, "torchrun_command",
                        lambda nproc, *args: [sys.executable, "-c", said])
    with pytest.raises(RuntimeError, match=r"^step 3: the training loss ended at 9.000 nats$"):
        train_dist.launch(2, "--mode", "check", echo=False)


def test_train_dist_without_resume_refuses_another_runs_folder(capsys, tmp_path):
    (tmp_path / "step_00000002").mkdir()
    with pytest.raises(SystemExit):
        train_dist.parse_args(["--mode", "train", "--checkpoint-dir", str(tmp_path)])
    assert "already holds the checkpoints" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The notebooks' builder and runner

SOLUTION = ("def double(x):\n    ### BEGIN SOLUTION\n    ### HINT: multiply by two\n"
            "    return 2 * x\n    ### END SOLUTION\n")


def _solutions(tmp_path) -> Path:
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    notebook(solutions / "01_router.ipynb", SOLUTION)
    return solutions


def test_build_replace_never_writes_through_a_link_to_a_solution(capsys, tmp_path):
    solutions = _solutions(tmp_path)
    exercises = tmp_path / "exercises"
    exercises.mkdir()
    before = (solutions / "01_router.ipynb").read_text()
    (exercises / "01_router.ipynb").symlink_to(solutions / "01_router.ipynb")
    assert main(["build", "--solutions", str(solutions), "--exercises", str(exercises),
                 "--replace"]) == 1
    assert "is a link to" in capsys.readouterr().err
    assert (solutions / "01_router.ipynb").read_text() == before


def test_build_never_writes_through_a_link_outside_the_course(capsys, tmp_path):
    solutions = _solutions(tmp_path)
    exercises = tmp_path / "exercises"
    exercises.mkdir()
    mine = tmp_path / "my_notes.ipynb"
    mine.write_text("my notes")
    (exercises / "01_router.ipynb").symlink_to(mine)
    assert main(["build", "--solutions", str(solutions), "--exercises", str(exercises)]) == 1
    assert mine.read_text() == "my notes"


def test_build_check_reports_a_link(capsys, tmp_path):
    solutions = _solutions(tmp_path)
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "01_router.ipynb").symlink_to(tmp_path / "gone.ipynb")
    assert main(["build", "--check", "--solutions", str(solutions), "--exercises",
                 str(tmp_path / "exercises")]) == 1
    assert "remove the link" in capsys.readouterr().err


def test_build_leaves_no_temporary_files(tmp_path):
    solutions = _solutions(tmp_path)
    assert main(["build", "--solutions", str(solutions), "--exercises",
                 str(tmp_path / "exercises")]) == 0
    assert sorted(p.name for p in (tmp_path / "exercises").iterdir()) == ["01_router.ipynb"]


def test_build_into_a_path_under_a_file_is_one_line(capsys, tmp_path):
    solutions = _solutions(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert main(["build", "--solutions", str(solutions), "--exercises",
                 str(tmp_path / "afile" / "exercises")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be made" in err[0], err


def test_build_on_a_full_disk_is_one_line_and_writes_nothing(capsys, tmp_path, full_disk):
    solutions = _solutions(tmp_path)
    assert main(["build", "--solutions", str(solutions), "--exercises",
                 str(tmp_path / "exercises")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left" in err[0], err
    assert list((tmp_path / "exercises").iterdir()) == []


def test_a_build_while_another_holds_the_exercises_is_refused_naming_it(capsys, tmp_path):
    solutions = _solutions(tmp_path)
    with safe_io.hold_folder(tmp_path / "exercises", "exercise build"):
        assert main(["build", "--solutions", str(solutions), "--exercises",
                     str(tmp_path / "exercises")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"exercise build (pid {os.getpid()}" in err[0], err
    assert not (tmp_path / "exercises" / "01_router.ipynb").exists()


def test_run_out_through_a_link_to_the_notebooks_is_refused(capsys, fake_checkout,
                                                            fast_papermill):
    (fake_checkout / "runs").mkdir()
    (fake_checkout / "runs" / "mine").symlink_to(fake_checkout / "notebooks")
    before = sorted(p.name for p in (fake_checkout / "notebooks").iterdir())
    assert main(["run", "--out", "runs/mine"]) == 2
    assert "course's own notebooks/" in capsys.readouterr().err
    assert sorted(p.name for p in (fake_checkout / "notebooks").iterdir()) == before


# ---------------------------------------------------------------------------------------------
# Data

def _fasta(tmp_path, raw: bytes) -> Path:
    path = tmp_path / "x.fa"
    path.write_bytes(raw)
    return path


def test_old_mac_line_ends_read_as_records(tmp_path):
    path = _fasta(tmp_path, b">a\rMKVL\rAST\r>b\rWWY\r")
    assert data.load_sequences(path) == ["MKVLAST", "WWY"]


def test_mixed_line_ends_read_as_records(tmp_path):
    path = _fasta(tmp_path, b">a\r\nMKV\n>b\rLLA\r\n")
    assert data.load_sequences(path) == ["MKV", "LLA"]


def test_a_header_without_sequence_names_its_line_under_cr_line_ends(tmp_path):
    path = _fasta(tmp_path, b">a\rMKV\r>b\r>c\rLL\r")
    with pytest.raises(data.FastaFormatError, match=r"line 3: header '>b' has no sequence"):
        data.load_sequences(path)


def test_an_rna_file_is_refused_as_rna(tmp_path):
    path = _fasta(tmp_path, b">r\nAUGGCUACGUAGCUAGCUAGGCAUCG\n")
    with pytest.raises(data.FastaFormatError, match="looks like RNA.*translate it"):
        data.load_sequences(path)


def test_a_lower_case_dna_file_is_refused(tmp_path):
    path = _fasta(tmp_path, b">d\nacgtacgtnnacgtagctagctagc\n>e\nacgtagcatcg\n")
    with pytest.raises(data.FastaFormatError, match="looks like DNA"):
        data.load_sequences(path)


def test_a_glycine_alanine_rich_protein_is_still_protein(tmp_path):
    path = _fasta(tmp_path, b">collagen\nGPPGAPGPAGAPGPPGAPGPAGAPGKDG\n")
    assert data.load_sequences(path) == ["GPPGAPGPAGAPGPPGAPGPAGAPGKDG"]


def test_a_few_residues_are_too_few_to_call_nucleotides(tmp_path):
    assert data.load_sequences(_fasta(tmp_path, b">p\nACGT\n")) == ["ACGT"]


# ---------------------------------------------------------------------------------------------
# Dtypes at the experts and the router

def _routed(dtype):
    hidden = torch.randn(6, 16, dtype=dtype)
    return hidden, torch.randint(0, 4, (6, 2)), torch.rand(6, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_input_dtypes_to_fp32_experts_name_the_cast(dtype):
    with pytest.raises(ValueError, match=rf"experts got input in {dtype} but its weights are "
                                         r"torch.float32: cast the input"):
        run_experts(GroupedTorchExperts(4, 16, 32), *_routed(dtype))


def test_bf16_input_to_an_fp32_softmax_router_names_the_cast():
    with pytest.raises(ValueError, match="router got input in torch.bfloat16"):
        Router(16, 4, 2)(torch.randn(6, 16, dtype=torch.bfloat16))


def test_bf16_experts_take_bf16_input():
    out, _ = run_experts(GroupedTorchExperts(4, 16, 32).to(torch.bfloat16), *_routed(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (6, 16)


def test_a_sigmoid_router_takes_bf16_input():
    router = Router(16, 4, 2, scoring="sigmoid")
    assert router(torch.randn(6, 16, dtype=torch.bfloat16)).indices.shape == (6, 2)


# ---------------------------------------------------------------------------------------------
# HF conversion: exact or refused by name

def test_an_unknown_family_is_refused_by_name():
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="model_type='llama' is not a family"):
        MoEConfig.from_hf_config(transformers.LlamaConfig())


def test_a_field_the_model_cannot_compute_is_named_as_hf_spells_it():
    transformers = pytest.importorskip("transformers")
    hf = transformers.MixtralConfig(num_hidden_layers=1, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act"):
        MoEConfig.from_hf_config(hf)


@pytest.mark.parametrize("name", ["MixtralConfig", "Qwen3MoeConfig", "OlmoeConfig"])
def test_a_familys_default_config_converts_unchanged(name):
    transformers = pytest.importorskip("transformers")
    hf = getattr(transformers, name)()
    config = MoEConfig.from_hf_config(hf)
    assert (config.hidden_size, config.num_experts) == (hf.hidden_size, hf.num_local_experts
                                                        if name == "MixtralConfig" else
                                                        hf.num_experts)
    assert config.pad_token_id == hf.pad_token_id  # OLMoE's 1 included, not dropped


def test_deepseek_v3s_default_block_converts_unchanged():
    transformers = pytest.importorskip("transformers")
    config = MoEConfig.from_hf_config(transformers.DeepseekV3Config(), moe_block_only=True)
    assert config.num_experts == transformers.DeepseekV3Config().n_routed_experts


def test_the_shipped_olmoe_config_converts_with_its_padding_token():
    from moe_tutorial.perf import analyze

    model = analyze.load_model("olmoe-1b-7b")
    assert not model.moe_block_only and model.config.pad_token_id == 1 and model.notes == ()


def _mixtral_hf(dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(**preset("tiny").to_hf_config_kwargs())
    return transformers.MixtralForCausalLM._from_config(config, attn_implementation="sdpa",
                                                        dtype=dtype)


def test_from_hf_refuses_weights_of_mixed_dtypes_by_name():
    hf = _mixtral_hf()
    hf.lm_head.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"lm_head.weight is torch.bfloat16.*one dtype"):
        from_hf(hf)


@pytest.fixture(scope="module")
def bf16_and_fp32_checkpoints(tmp_path_factory):
    """A tiny Mixtral saved by save_pretrained in bf16 and in fp32."""
    folders = {}
    for dtype in (torch.bfloat16, torch.float32):
        folder = tmp_path_factory.mktemp(str(dtype).removeprefix("torch."))
        _mixtral_hf(dtype).save_pretrained(folder, safe_serialization=True)
        folders[dtype] = folder
    return folders


def test_a_bf16_checkpoint_loads_into_fp32_exactly(bf16_and_fp32_checkpoints):
    from safetensors.torch import load_file

    from moe_tutorial.parallel.sharded_init import build_sharded

    folder = bf16_and_fp32_checkpoints[torch.bfloat16]
    model = build_sharded(preset("tiny"), None, "cpu", hf_checkpoint=folder)
    saved = load_file(str(folder / "model.safetensors"))
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"].float())


def test_an_fp32_checkpoint_into_a_bf16_model_is_refused_naming_both(bf16_and_fp32_checkpoints):
    from moe_tutorial.parallel.sharded_init import build_sharded

    with pytest.raises(CheckpointError, match=r"is F32, this model's weights torch.bfloat16: the "
                                              r"cast would change its values"):
        build_sharded(preset("tiny", dtype="bfloat16"), None, "cpu",
                      hf_checkpoint=bf16_and_fp32_checkpoints[torch.float32])


def test_a_sharded_random_init_leaves_the_padding_row_at_zero():
    from moe_tutorial.parallel.sharded_init import build_sharded

    model = build_sharded(preset("tiny", pad_token_id=3), None, "cpu")
    weight = model.model.embed_tokens.weight
    assert weight[3].abs().max() == 0 and weight[4].abs().max() > 0


@pytest.mark.parametrize("pad", [-1, 10**6, True, 1.0])
def test_a_padding_token_outside_the_vocabulary_is_named(pad):
    with pytest.raises(ValueError, match=r"pad_token_id=.* must be a token id in \[0, "):
        preset("tiny", pad_token_id=pad)


# ---------------------------------------------------------------------------------------------
# Settings from anywhere: environment, notebook parameters and the Python API checked as flags

def test_a_device_from_the_environment_is_named_as_the_environment(monkeypatch):
    from moe_tutorial.course.lesson import setup

    monkeypatch.setenv("MOE_TUTORIAL_DEVICE", "gpu")
    with pytest.raises(ValueError, match=r"^\$MOE_TUTORIAL_DEVICE 'gpu' is not a device the "
                                         r"course runs on; give cpu or cuda"):
        setup("small", os.environ["MOE_TUTORIAL_DEVICE"])


def test_a_device_parameter_is_named_as_the_parameter(monkeypatch):
    from moe_tutorial.course.lesson import setup

    monkeypatch.delenv("MOE_TUTORIAL_DEVICE", raising=False)
    with pytest.raises(ValueError, match=r"^parameter DEVICE 'tpu' is not a device"):
        setup("small", "tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_a_cuda_device_on_a_cpu_machine_is_refused_in_the_setup_cell(monkeypatch):
    from moe_tutorial.course.lesson import setup

    monkeypatch.delenv("MOE_TUTORIAL_DEVICE", raising=False)
    with pytest.raises(ValueError, match=r"no CUDA GPU; set parameter DEVICE to cpu, or leave "
                                         r"it empty"):
        setup("small", "cuda")


def test_a_mode_parameter_is_named_as_the_parameter(monkeypatch):
    from moe_tutorial.course.lesson import setup

    monkeypatch.delenv("MOE_TUTORIAL_MODE", raising=False)
    with pytest.raises(ValueError, match=r"'medium' \(from the parameter MODE\).*small or full"):
        setup("medium", "cpu")


@pytest.mark.parametrize("value, ok", [("off", False), ("yes", False), ("always", True),
                                       ("0", True), ("", True)])
def test_the_live_setting_in_the_environment_is_checked(monkeypatch, value, ok):
    from moe_tutorial.course.lesson import setup

    monkeypatch.setenv("MOE_TUTORIAL_LIVE", value)
    if ok:
        assert setup("small", "cpu").mode == "small"
    else:
        with pytest.raises(ValueError, match=rf"\$MOE_TUTORIAL_LIVE='{value}' is not a setting"):
            setup("small", "cpu")


SIZES = {"small": dict(steps=60, experts=[2, 4], preset="small"),
         "full": dict(steps=400, experts=[2, 4, 8], preset="mixtral-2l")}
BAD_SIZES = {
    "negative steps (would train nothing)": (dict(steps=-5), "steps=-5 must be an integer >= 1"),
    "steps as text": (dict(steps="10"), "steps='10' must be an integer >= 1"),
    "steps a float": (dict(steps=2.5), "steps=2.5 must be an integer >= 1"),
    "a list item not a count": (dict(experts=[2, "x"]), "experts=[2, 'x'] holds 'x'"),
    "a list given as a number": (dict(experts=8), "experts=8 must be a list"),
    "a preset given as a number": (dict(preset=3), "preset=3 must be a name"),
}


@pytest.mark.parametrize("case", sorted(BAD_SIZES))
def test_a_notebook_size_is_checked_against_its_default(case):
    from moe_tutorial.course.lesson import setup

    values, message = BAD_SIZES[case]
    with pytest.raises(ValueError, match=re.escape(message) + r".*0 / empty for the small mode"):
        setup("small", "cpu", SIZES, **values)


def test_a_bad_device_in_the_environment_stops_a_run_before_any_notebook(
        capsys, fake_checkout, fast_papermill, monkeypatch):
    monkeypatch.setenv("MOE_TUTORIAL_DEVICE", "gpu")
    assert main(["run", "--out", "runs/mine"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "$MOE_TUTORIAL_DEVICE 'gpu'" in err[0], err
    assert not (fake_checkout / "runs" / "mine").exists()


def test_train_settings_given_as_text_are_one_clear_error():
    with pytest.raises(ValueError, match=r"TrainSettings.lr='3e-3' must be a finite number > 0"):
        TrainSettings(lr="3e-3")


def test_analyze_names_its_api_arguments_and_its_flags(capsys):
    from moe_tutorial.perf import analyze

    with pytest.raises(ValueError, match=r"^batch=0 must be an integer >= 1"):
        analyze.analyze("tiny", batch=0, sweep=False)
    one_line_error(capsys, ["analyze", "tiny", "--batch", "0"], "--batch=0")


def test_train_flags_are_named_as_flags(capsys, no_work):
    one_line_error(capsys, ["train", "--preset", "tiny", "--lr", "-1"], "--lr=-1.0 must be")


# ---------------------------------------------------------------------------------------------
# The course runner holds its folder; the benchmark matrix writes whole or nothing

def test_a_run_into_a_folder_another_process_holds_is_refused_naming_it(
        capsys, fake_checkout, fast_papermill, holder):
    folder, process = holder
    assert main(["run", "--out", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pid {process.pid} on here" in err[0], err
    assert sorted(p.name for p in folder.iterdir()) == [safe_io.LOCK_NAME]


def test_the_runner_holds_its_folder_until_the_run_ends(fake_checkout, fast_papermill):
    from moe_tutorial.course import runner

    notebooks = runner.find_notebooks()
    course = runner.prepare_run(notebooks, Path("runs/mine"))
    with pytest.raises(runner.RunError, match=rf"course run \(pid {os.getpid()}"):
        runner.prepare_run(notebooks, Path("runs/mine"), replace=True)
    runner.execute_run(course, echo=lambda *a, **k: None)
    assert course.ok and leftovers(Path("runs/mine")) == []
    again = runner.run_course(notebooks, Path("runs/mine"), replace=True, echo=lambda *a, **k: None)
    assert again.ok and leftovers(Path("runs/mine")) == []


def test_a_run_refused_for_its_folder_makes_no_folder(capsys, fake_checkout, fast_papermill):
    assert main(["run", "--out", "notebooks/mine"]) == 2
    assert "course's own notebooks/" in capsys.readouterr().err
    assert not (fake_checkout / "notebooks" / "mine").exists()


def test_a_crashed_runs_lock_file_does_not_block_the_next_run(fake_checkout, fast_papermill):
    from moe_tutorial.course import runner

    out = fake_checkout / "runs" / "mine"
    out.mkdir(parents=True)
    (out / safe_io.LOCK_NAME).write_text('{"what": "course run", "pid": 1}')  # no lock held
    course = runner.run_course(runner.find_notebooks(), out, echo=lambda *a, **k: None)
    assert course.ok and leftovers(out) == []


def test_matrix_refuses_an_earlier_result_before_any_run(monkeypatch, tmp_path, capsys):
    from benchmarks import matrix

    def work(*args, **kwargs):
        raise WorkStarted

    monkeypatch.setattr(matrix, "run_matrix", work)
    monkeypatch.setattr(matrix, "_check_gpus", lambda gpus: None)
    earlier = tmp_path / "h200x2.json"
    earlier.write_text('{"rows": []}')
    with pytest.raises(SystemExit) as exit:
        matrix.main(["--gpus", "2", "--preset", "tiny", "--out", str(earlier)])
    assert exit.value.code == 2 and "--replace" in capsys.readouterr().err
    assert earlier.read_text() == '{"rows": []}'
    with pytest.raises(WorkStarted):
        matrix.main(["--gpus", "2", "--preset", "tiny", "--backend", "grouped_torch",
                     "--out", str(earlier), "--replace"])


def test_matrix_report_on_a_full_disk_keeps_the_previous_version(tmp_path, full_disk):
    from benchmarks import matrix

    out = tmp_path / "m.json"
    out.write_text('{"rows": [1]}')
    with pytest.raises(safe_io.WriteFailed, match="No space left"):
        matrix.write_report({"rows": [1, 2]}, str(out))
    assert out.read_text() == '{"rows": [1]}' and leftovers(tmp_path) == []


def test_matrix_table_of_a_missing_file_is_an_error_not_a_traceback(tmp_path, capsys):
    from benchmarks import matrix

    with pytest.raises(SystemExit) as exit:
        matrix.main(["--table", str(tmp_path / "missing.json")])
    assert exit.value.code == 2
    assert "not a readable result JSON" in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [(["--steps", "0"], "--steps=0 must be an integer >= 1"),
                                          (["--lr", "-1"], "--lr=-1.0 must be a finite number"),
                                          (["--seq-len", "0"], "--seq-len=0 must be")])
def test_train_dist_names_a_bad_flag_before_any_rank_starts(capsys, flags, words):
    with pytest.raises(SystemExit) as exit:
        train_dist.parse_args(["--mode", "train", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {words}"), err


@pytest.mark.parametrize("param, words", [
    ("STEPS=ten", "-p STEPS='ten': STEPS takes an integer, like its default: -p STEPS=0"),
    ("FLAG=1", "-p FLAG=1: FLAG takes True or False"),
    ("SIZES=8", "-p SIZES=8: SIZES takes a list"),
])
def test_a_run_parameter_of_another_kind_than_its_default_is_refused_before_running(
        capsys, fake_checkout, fast_papermill, param, words):
    notebook(fake_checkout / "notebooks" / "01_a.ipynb", "print(1)",
             parameters="MODE = ''\nSTEPS = 0\nFLAG = True\nSIZES = []\nRATE = 0.5")
    assert main(["run", "--out", "runs/mine", "-p", param]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (fake_checkout / "runs" / "mine").exists()


def test_a_run_parameter_of_its_defaults_kind_runs(fake_checkout, fast_papermill):
    notebook(fake_checkout / "notebooks" / "01_a.ipynb", "print(1)",
             parameters="MODE = ''\nSTEPS = 0\nRATE = 0.5")
    assert main(["run", "--out", "runs/mine", "-p", "STEPS=5", "-p", "RATE=1"]) == 0
