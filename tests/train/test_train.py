import math

import pytest
import torch

from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.train.data import load_protein_data
from moe_tutorial.train.loop import (
    TrainingDiverged,
    TrainSettings,
    evaluate,
    learning_rate,
    train,
)


@pytest.fixture(scope="module")
def data():
    return load_protein_data(64, max_sequences=400)


def test_learning_rate_schedule():
    s = TrainSettings(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [learning_rate(i, s) for i in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))  # warm-up rises
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # cosine falls
    assert lrs[-1] == pytest.approx(1e-4)


@pytest.mark.parametrize("bad, words", [(dict(steps=0), "steps=0"),
                                        (dict(steps=10, warmup_steps=10), "warmup_steps=10"),
                                        (dict(lr=0.0), "lr=0.0")])
def test_settings_validation(bad, words):
    with pytest.raises(ValueError, match=words):
        TrainSettings(**bad)


def test_training_lowers_the_loss_and_is_reproducible(data):
    settings = TrainSettings(steps=25, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=25,
                             eval_batches=4)
    records = []
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = MoEForCausalLM(preset("tiny"))
        before = evaluate(model, data.val, 8, 4)
        runs.append(train(model, data.train, settings, val=data.val, progress=False,
                          on_step=records.append))
    history = runs[0]
    assert [r["loss"] for r in history] == [r["loss"] for r in runs[1]]  # seeded
    assert len(records) == 50 and records[0]["step"] == 1
    assert history[-1]["val_loss"] < before - 0.1
    assert all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in history)
    assert history[-1]["tokens"] == 25 * 8 * 64


def test_divergence_stops_with_a_clear_message(data):
    model = MoEForCausalLM(preset("tiny"))
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(TrainingDiverged, match=r"step 0: loss=nan.*Lower the learning rate \(TrainSettings.lr"):
        train(model, data.train, TrainSettings(steps=3, batch_size=4, warmup_steps=1),
              progress=False)


def test_data_outside_the_vocabulary_is_refused_before_the_first_step():
    model = MoEForCausalLM(preset("tiny"))
    packed = torch.randint(0, model.config.vocab_size, (8, 17))
    packed[5, 3] = model.config.vocab_size + 7  # e.g. ids from another tokenizer
    with pytest.raises(ValueError, match=f"token id {model.config.vocab_size + 7}, outside"):
        train(model, packed, TrainSettings(steps=2, batch_size=2, warmup_steps=0), progress=False)
