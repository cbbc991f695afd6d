"""course/op_counts.py: the operation counts chapter 01 shows."""

import torch

from moe_tutorial.course import op_counts
from moe_tutorial.moe import config
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.train.loop import TrainSettings, make_optimizer, train_step

SIZES = dict(hidden=32, intermediate=32, top_k=2, tokens=64)


def test_the_loops_op_count_grows_with_the_experts_and_the_grouped_one_does_not():
    naive = [op_counts.aten_ops_per_layer("naive", n, **SIZES) for n in (4, 8, 16)]
    grouped = [op_counts.aten_ops_per_layer("grouped_torch", n, **SIZES) for n in (4, 8, 16)]
    assert naive[0] < naive[1] < naive[2]
    assert naive[2] - naive[1] > 1.5 * (naive[1] - naive[0])  # a fixed count per expert
    assert len(set(grouped)) == 1 and grouped[0] < naive[0]


def test_a_profiled_training_step_counts_the_experts_ops_among_the_steps():
    torch.manual_seed(0)
    cfg = config.preset("tiny")
    model = MoEForCausalLM(cfg, "naive")
    optimizer = make_optimizer(model, TrainSettings(steps=3, batch_size=2, warmup_steps=1))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))

    profile = op_counts.profile_train_steps(model, lambda: train_step(model, [tokens, tokens], optimizer),
                                            steps=1, device="cpu")
    assert 0 < profile.expert_ops < profile.ops and 0 < profile.experts_ms < profile.step_ms
    assert profile.gpu == {} and profile.layers == cfg.num_layers
    assert "top-level ATen ops per training step" in profile.table().rows[0]
    assert all(not hasattr(layer.mlp.experts, "_forward_hooks") or not layer.mlp.experts._forward_hooks
               for layer in model.model.layers), "the profiler's hooks are removed"
