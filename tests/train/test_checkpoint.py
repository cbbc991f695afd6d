"""Checkpoints: a run killed mid-step and resumed gives the uninterrupted run's losses, bit for
bit (CPU); a damaged or foreign checkpoint is refused with a clear error, never a restart."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from moe_tutorial.cli import main
from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.train import checkpoint
from moe_tutorial.train.checkpoint import CheckpointError, Checkpointing
from moe_tutorial.train.data import load_protein_data
from moe_tutorial.train.loop import TrainSettings, train

STEPS, EVERY, KILL_AT = 12, 4, 7  # killed inside step 7 (0-based): steps 4-6 are lost work
CLI = ["train", "--preset", "tiny", "--steps", str(STEPS), "--batch-size", "64",
       "--checkpoint-every", str(EVERY)]

# The real command line in its own process. With `kill`, the process SIGKILLs itself inside the
# forward pass of step KILL_AT — after its gradients of earlier steps were applied and a
# checkpoint was written, mid-way through a step, like a preempted job.
RUN = """
import os, signal, sys
from moe_tutorial.train import loop
from moe_tutorial.cli import main
kill = sys.argv[1] == "kill"
step_of = loop.train_step
calls = 0
def train_step(model, batch, *args, **kwargs):
    global calls
    calls += 1
    if kill and calls == {kill_at} + 1:
        model(*batch).loss.backward()  # half a step: gradients computed, not applied
        os.kill(os.getpid(), signal.SIGKILL)
    return step_of(model, batch, *args, **kwargs)
loop.train_step = train_step
sys.exit(main(sys.argv[2:]))
""".format(kill_at=KILL_AT)


def _run(tmp_path, how: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUN, how, *CLI, *args], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)


def test_a_killed_run_resumes_to_the_same_losses(tmp_path):
    whole = _run(tmp_path, "run", "--json", "whole.json")
    assert whole.returncode == 0, whole.stderr

    killed = _run(tmp_path, "kill", "--checkpoint-dir", "ckpt", "--json", "resumed.json")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert checkpoint.saved_steps(tmp_path / "ckpt") == [EVERY]  # step 8's was never reached
    assert not (tmp_path / "resumed.json").exists()

    resumed = _run(tmp_path, "run", "--checkpoint-dir", "ckpt", "--resume", "--json",
                   "resumed.json")
    assert resumed.returncode == 0, resumed.stderr
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("whole.json", "resumed.json"))
    keys = ("step", "lr", "loss", "lm_loss", "aux_loss", "grad_norm", "tokens", "val_loss")
    assert [[r.get(k) for k in keys] for r in b["history"]] == \
           [[r.get(k) for k in keys] for r in a["history"]]  # exact floats, every step
    assert b["val_loss_final"] == a["val_loss_final"]
    assert checkpoint.saved_steps(tmp_path / "ckpt") == [4, 8, 12]  # every 4 and the last


@pytest.fixture(scope="module")
def data():
    return load_protein_data(64, max_sequences=200)


SETTINGS = TrainSettings(steps=6, batch_size=4, warmup_steps=1, eval_every=0)


def _model():
    torch.manual_seed(0)
    return MoEForCausalLM(preset("tiny"))


def test_saves_atomically_and_keeps_the_newest(tmp_path, data):
    train(_model(), data.train, SETTINGS, progress=False,
          checkpoint=Checkpointing(tmp_path, every=2, keep=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000004.pt", "step_00000004.pt.sha256", "step_00000006.pt",
        "step_00000006.pt.sha256"]  # no lock file or temporary file left behind
    # a run killed while writing leaves a temporary file behind: never taken for a checkpoint
    (tmp_path / ".step_00000008.pt.123.abcd.tmp").write_bytes(b"half a file")
    assert checkpoint.saved_steps(tmp_path) == [4, 6]


def test_resume_refuses_what_it_cannot_continue(tmp_path, data):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train(_model(), data.train, SETTINGS, progress=False,
              checkpoint=Checkpointing(tmp_path), resume=True)
    train(_model(), data.train, SETTINGS, progress=False,
          checkpoint=Checkpointing(tmp_path, every=3))
    other_lr = TrainSettings(steps=6, batch_size=4, warmup_steps=1, eval_every=0, lr=1e-3)
    with pytest.raises(CheckpointError, match=r"other settings \(lr: checkpoint 0.003, now 0.001\)"):
        train(_model(), data.train, other_lr, progress=False,
              checkpoint=Checkpointing(tmp_path), resume=True)
    torch.manual_seed(0)
    wider = MoEForCausalLM(preset("tiny", num_experts=8))
    with pytest.raises(CheckpointError, match="other model .*num_experts: checkpoint 4, now 8"):
        train(wider, data.train, SETTINGS, progress=False, checkpoint=Checkpointing(tmp_path),
              resume=True)
    newest = tmp_path / "step_00000006.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, e.g. a disk that filled up
    with pytest.raises(CheckpointError, match=r"step_00000006.pt is damaged \(its contents do not "
                                              r"match.*newest intact one is .*step_00000003.pt"):
        train(_model(), data.train, SETTINGS, progress=False,
              checkpoint=Checkpointing(tmp_path), resume=True)


def test_the_command_line_says_what_is_wrong(tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--steps", "2", "--resume"]) == 2
    assert "--resume needs --checkpoint-dir" in capsys.readouterr().err
    os.makedirs(tmp_path / "empty")
    assert main(["train", "--preset", "tiny", "--steps", "2", "--checkpoint-dir",
                 str(tmp_path / "empty"), "--resume"]) == 2
    assert "no checkpoint (step_*.pt) in" in capsys.readouterr().err


def test_a_second_run_into_a_running_runs_directory_is_refused_naming_it(tmp_path, capsys):
    """Two `train` runs started on one --checkpoint-dir: the second is refused before it
    starts, naming the first, whose checkpoints stay its own."""
    first = subprocess.Popen([sys.executable, "-m", "moe_tutorial", *CLI[:3], "--steps", "100000",
                              "--batch-size", "2", "--checkpoint-dir", "ckpt"], cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        lock = tmp_path / "ckpt" / ".moe-tutorial.lock"
        for _ in range(600):  # until the first run holds its directory (data loaded, training)
            if lock.exists() and lock.read_text():
                break
            assert first.poll() is None, "the first run ended early"
            time.sleep(0.2)
        assert main(["train", "--preset", "tiny", "--steps", "2", "--checkpoint-dir",
                     str(tmp_path / "ckpt")]) == 2
        err = capsys.readouterr().err
        assert f"in use by training run (pid {first.pid} " in err and "another folder" in err
    finally:
        first.kill()
        first.wait()
