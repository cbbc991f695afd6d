"""A bad flag is refused on one line naming the flag and what it takes, before any work starts;
a training that diverges is one line and exit 1; and a Python API names its own arguments where
the command line names its flags."""

from __future__ import annotations

import pytest
import torch
from course_helpers import one_line_error

from moe_tutorial.train import data
from moe_tutorial.train.loop import TrainingDiverged


@pytest.mark.parametrize("argv, words", [
    (["train", "--steps", "1.5"], ["--steps", "1.5"]),
    (["train", "--lr", "nan"], ["--lr=nan must be a finite number"]),
    (["train", "--backend", "nope"], ["--backend 'nope'", "grouped_torch"]),
    (["train", "--device", "tpu"], ["--device 'tpu'", "cpu or cuda"]),
    (["train", "--json", "nodir/x.json"], ["--json nodir/x.json", "does not exist"]),
    (["train", "--checkpoint-dir", "ck", "--checkpoint-every", "0"],
     ["--checkpoint-every=0 must be an integer >= 1"]),
    (["train", "--checkpoint-dir", "ck", "--keep-checkpoints", "0"],
     ["--keep-checkpoints=0 must be an integer >= 1"]),
    (["bench", "--iters", "0"], ["--iters=0 must be an integer >= 1"]),
    (["bench", "--warmup", "-1"], ["--warmup=-1 must be an integer >= 0"]),
    (["bench", "--layers", "0"], ["--layers=0 must be an integer >= 1"]),
    (["bench", "--batch", "0"], ["--batch=0 must be an integer >= 1"]),
    (["bench", "--merge", "missing.json"], ["--merge missing.json", "bench --out"]),
    (["analyze", "small", "--gpus", "0"], ["--gpus=0"]),
    (["speed-of-light", "--committed", "missing.json"], ["--committed missing.json"]),
    (["idle-gaps", "--variants", "nope"], ["'nope'"]),
    (["run", "--cell-timeout", "0", "--out", "r"], ["--cell-timeout 0", "--cell-timeout 300"]),
    (["run", "-p", "STEPS", "--out", "r"], ["NAME=VALUE"]),
])
def test_a_bad_flag_is_one_line_naming_the_flag(capsys, tmp_path, monkeypatch, no_work, argv,
                                                words):
    monkeypatch.chdir(tmp_path)
    one_line_error(capsys, argv, *words)


def test_train_flags_are_named_as_flags(capsys, no_work):
    one_line_error(capsys, ["train", "--preset", "tiny", "--lr", "-1"], "--lr=-1.0 must be")


def test_analyze_names_its_api_arguments_and_its_flags(capsys):
    from moe_tutorial.perf import analyze

    with pytest.raises(ValueError, match=r"^batch=0 must be an integer >= 1"):
        analyze.analyze("tiny", batch=0, sweep=False)
    one_line_error(capsys, ["analyze", "tiny", "--batch", "0"], "--batch=0")


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
