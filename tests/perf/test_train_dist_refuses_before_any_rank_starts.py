"""The distributed trainer checks what it can before torchrun starts a rank: a bad flag, a
resume with other settings than the checkpoint's, a folder of another run's checkpoints or one
another process holds are refused on one line; and a rank's own one-line error is reported
alone, without the launcher's traceback."""

from __future__ import annotations

import json
import sys

import pytest
from write_mishaps import holder  # noqa: F401  (a fixture)

from moe_tutorial import safe_io
from moe_tutorial.parallel import dist_checkpoint
from moe_tutorial.perf import train_dist
from moe_tutorial.train.loop import _settings_dict


@pytest.mark.parametrize("flags, words", [(["--steps", "0"], "--steps=0 must be an integer >= 1"),
                                          (["--lr", "-1"], "--lr=-1.0 must be a finite number"),
                                          (["--seq-len", "0"], "--seq-len=0 must be")])
def test_train_dist_names_a_bad_flag_before_any_rank_starts(capsys, flags, words):
    with pytest.raises(SystemExit) as exit:
        train_dist.parse_args(["--mode", "train", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {words}"), err


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


def test_train_dist_without_resume_refuses_another_runs_folder(capsys, tmp_path):
    (tmp_path / "step_00000002").mkdir()
    with pytest.raises(SystemExit):
        train_dist.parse_args(["--mode", "train", "--checkpoint-dir", str(tmp_path)])
    assert "already holds the checkpoints" in capsys.readouterr().err


def test_train_dist_launch_refuses_a_held_folder_before_torchrun(holder):  # noqa: F811
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
