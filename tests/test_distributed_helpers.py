"""The cost arithmetic of a (dp, ep) layout (`training_state_per_rank`, `communication_per_step`,
both from `MoEConfig.parameter_counts`): checked against real models and against the bytes
`AllToAllDispatcher` really hands to its collectives (recorded in one process, with the
collectives replaced by recording fakes: no process group needed)."""

import pytest
import torch

from moe_tutorial import distributed
from moe_tutorial.config import preset
from moe_tutorial.model import MoEForCausalLM


def test_training_state_shards_the_experts_over_ep_only():
    config = preset("mixtral-8x7b")
    counts = config.parameter_counts()
    dp8 = distributed.training_state_per_rank(config, dp=8, ep=1)
    ep8 = distributed.training_state_per_rank(config, dp=1, ep=8)
    assert dp8["params"] == counts["total"]
    assert ep8["params"] == counts["expert"] // 8 + counts["dense"]
    assert dp8["bytes_per_param"] == 8 and dp8["state_bytes"] == 8 * counts["total"]  # bf16
    assert distributed.training_state_per_rank(preset("tiny"), 1, 2)["bytes_per_param"] == 16  # fp32
    assert distributed.training_state_per_rank(config, 1, 8, bytes_per_param=16)["state_bytes"] == (
        16 * ep8["params"])
    with pytest.raises(ValueError, match="not divisible by ep=3"):
        distributed.training_state_per_rank(config, 1, 3)


def test_fsdp_shards_every_parameter_over_all_ranks():
    config = preset("mixtral-8x7b")
    counts = config.parameter_counts()
    ep8 = distributed.training_state_per_rank(config, dp=1, ep=8)
    for dp, ep in ((8, 1), (4, 2), (1, 8)):
        fsdp = distributed.training_state_per_rank(config, dp, ep, fsdp=True)
        assert fsdp["fsdp"] and fsdp["allreduce_buffer_bytes"] == 0
        assert fsdp["params"] * 8 == pytest.approx(counts["total"], abs=16)  # 1/8 of everything
        assert fsdp["expert_params"] == counts["expert"] // 8
        assert fsdp["state_bytes"] == 8 * fsdp["params"]  # weights, gradients, 2 moments in bf16
    fsdp8 = distributed.training_state_per_rank(config, 8, 1, fsdp=True)
    assert fsdp8["state_bytes"] < ep8["state_bytes"]  # EP keeps the dense 1.6 B on every rank
    # One decoder layer's full weights are gathered while it runs: 8 experts + attention, router.
    layer = (counts["total"] - 2 * config.vocab_size * config.hidden_size - config.hidden_size) // 32
    assert fsdp8["gathered_layer_bytes"] == 2 * layer
    assert distributed.training_state_per_rank(config, 4, 2, fsdp=True)["gathered_layer_bytes"] < (
        fsdp8["gathered_layer_bytes"])  # with ep2 a layer holds only its 4 local experts
    assert distributed.training_state_per_rank(config, 8, 1)["gathered_layer_bytes"] == 0


def test_allreduce_volumes_per_layout():
    config = preset("mixtral-2l")
    counts = config.parameter_counts()
    single = distributed.communication_per_step(config, 8192, 1, 1)
    assert all(v == 0 for v in single.values())
    dp2 = distributed.communication_per_step(config, 8192, 2, 1)
    assert dp2["all_to_all_bytes"] == 0
    assert dp2["allreduce_bytes"] == 2 * counts["total"]  # bf16 gradients: the README's 6.3 GB
    assert round(dp2["allreduce_bytes"] / 1e9, 1) == 6.3
    assert dp2["allreduce_sent_bytes"] == dp2["allreduce_bytes"]  # ring over 2: 2 (n-1)/n = 1
    ep2 = distributed.communication_per_step(config, 8192, 1, 2)
    assert ep2["allreduce_bytes"] == ep2["dense_allreduce_bytes"] == 2 * counts["dense"]
    assert ep2["expert_allreduce_bytes"] == 0
    assert ep2["all_to_all_remote_bytes"] == ep2["all_to_all_bytes"] / 2
    dp2ep2 = distributed.communication_per_step(config, 8192, 2, 2)
    assert dp2ep2["expert_allreduce_bytes"] == 2 * counts["expert"] // 2
    assert dp2ep2["allreduce_sent_bytes"] == pytest.approx(
        1.5 * dp2ep2["dense_allreduce_bytes"] + dp2ep2["expert_allreduce_bytes"])


class _Record(torch.autograd.Function):
    """Identity that counts the bytes passing through it, forward and backward."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.log = log
        log.append(x.numel() * x.element_size())
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(grad.numel() * grad.element_size())
        return grad, None


def test_all_to_all_volume_is_what_the_layer_exchanges(monkeypatch):
    """Rank 0 of an ep=2 layout, with every exchange replaced by a recording identity (as if
    the peer sent back exactly what it received): the bytes through the collectives in one
    forward + backward pass equal `communication_per_step`'s all-to-all volume."""
    log = []

    def counts_exchange(output, input, group=None):
        log.append(input.numel() * input.element_size())
        output.copy_(input)

    monkeypatch.setattr(distributed.dist, "all_to_all_single", counts_exchange)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: 2)  # no real group
    monkeypatch.setattr(distributed, "all_to_all_single_autograd",
                        lambda x, out_splits, in_splits, group: _Record.apply(x, log))
    config = preset("tiny")
    torch.manual_seed(0)
    model = MoEForCausalLM(config)
    layout = distributed.Layout(dp=1, ep=2, dp_rank=0, ep_rank=0, dp_group=None, ep_group=None)
    distributed.shard_experts(model, layout)
    batch, seq = 3, 16
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    model(ids, ids).loss.backward()
    expected = distributed.communication_per_step(config, batch * seq, 1, 2)["all_to_all_bytes"]
    assert sum(log) == expected
    # per layer: counts, rows and weights out, outputs back (forward); three gradients (backward)
    assert len(log) == 7 * config.num_layers
