import copy
import math

import pytest
import torch

from moe_tutorial.config import preset
from moe_tutorial.data import load_protein_data
from moe_tutorial.model import MoEForCausalLM
from moe_tutorial.train import (
    StepInBackward,
    TrainingDiverged,
    TrainSettings,
    evaluate,
    learning_rate,
    make_optimizer,
    make_step_in_backward,
    train,
    train_step,
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
    with pytest.raises(TrainingDiverged, match=r"step 0: loss=nan.*Lower TrainSettings.lr"):
        train(model, data.train, TrainSettings(steps=3, batch_size=4, warmup_steps=1),
              progress=False)


def test_data_outside_the_vocabulary_is_refused_before_the_first_step():
    model = MoEForCausalLM(preset("tiny"))
    packed = torch.randint(0, model.config.vocab_size, (8, 17))
    packed[5, 3] = model.config.vocab_size + 7  # e.g. ids from another tokenizer
    with pytest.raises(ValueError, match=f"token id {model.config.vocab_size + 7}, outside"):
        train(model, packed, TrainSettings(steps=2, batch_size=2, warmup_steps=0), progress=False)


def _tiny_model_and_batches(steps=3):
    torch.manual_seed(0)
    model = MoEForCausalLM(preset("tiny").with_overrides(dtype="float32"))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (steps, 2, 17), generator=gen)
    return model, [(b[:, :-1], b[:, 1:]) for b in ids]


def test_step_in_backward_is_adamw_stepped_early():
    """The same AdamW update (groups, weight decay, a learning rate set between steps through
    param_groups) as make_optimizer's, applied as each gradient completes; the gradients are freed
    by the end of the backward pass."""
    _check_step_in_backward("cpu")


@pytest.mark.gpu
def test_step_in_backward_on_a_side_stream_is_adamw_stepped_early():
    """On a GPU the updates run on a side stream: still the same AdamW, and the next step sees
    every update (`step()` orders the streams)."""
    _check_step_in_backward("cuda")


def _check_step_in_backward(device):
    settings = TrainSettings(lr=1e-2, steps=3, warmup_steps=0)
    model, batches = _tiny_model_and_batches()
    model = model.to(device)
    batches = [tuple(t.to(device) for t in b) for b in batches]
    early = copy.deepcopy(model)
    reference, stepped = make_optimizer(model, settings), make_step_in_backward(early, settings)
    assert isinstance(stepped, StepInBackward)
    for i, batch in enumerate(batches):
        for opt in (reference, stepped):
            for group in opt.param_groups:
                group["lr"] = settings.lr / (i + 1)
        train_step(model, batch, reference, grad_clip=None)
        train_step(early, batch, stepped, grad_clip=None)
        assert all(p.grad is None for p in early.parameters())
    assert (stepped._stream is not None) == (device == "cuda")
    for (name, want), got in zip(model.named_parameters(), early.parameters()):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), name
    stepped.remove()
    before = [p.detach().clone() for p in early.parameters()]
    early(*batches[0]).loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(before, early.parameters())), "hooks removed"


def test_step_in_backward_refuses_what_it_cannot_do():
    model, batches = _tiny_model_and_batches(1)
    stepped = make_step_in_backward(model, TrainSettings(steps=1, warmup_steps=0))
    with pytest.raises(ValueError, match="global-norm clipping cannot run"):
        train_step(model, batches[0], stepped, grad_clip=1.0)
    with pytest.raises(ValueError, match="after_backward would run after the updates"):
        train_step(model, batches[0], stepped, grad_clip=None, after_backward=lambda: None)
