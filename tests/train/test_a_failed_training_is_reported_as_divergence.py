"""A training that did not learn is a failure, not a result: a loss that rose, or a validation
loss above guessing uniformly, is `TrainingDiverged` naming the step, the loss and the fix; a
loss within the noise of its start or one that fell is not; and a timing run leaves out only
this check."""

from __future__ import annotations

import math

import pytest
from tiny_model_training import BATCHES, fresh_tiny_model

from moe_tutorial.train.loop import TrainingDiverged, TrainSettings, check_learned, train


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
    train(fresh_tiny_model(), BATCHES, settings, progress=False, check_learning=False)
    assert judged == []
    train(fresh_tiny_model(), BATCHES, settings, progress=False)
    assert judged == [3]


def test_a_huge_learning_rate_in_the_api_is_divergence_with_its_history():
    # 1e6: the loss leaves the numbers in the first steps (at 1e4 it can settle at the uniform
    # guess, within the noise of its start: not divergence by `check_learned`'s rule)
    settings = TrainSettings(steps=3, batch_size=2, warmup_steps=0, eval_every=0, lr=1e6)
    with pytest.raises(TrainingDiverged, match="training diverged") as raised:
        train(fresh_tiny_model(), BATCHES, settings, progress=False)
    assert all("loss" in r for r in raised.value.history)
