"""The communication arithmetic of a (dp, ep) layout (`communication_per_step`, from
`MoEConfig.parameter_counts`; the memory arithmetic is tests/perf/test_memory.py's): checked against real models and against the bytes
`AllToAllDispatcher` really hands to its collectives (recorded in one process, with the
collectives replaced by recording fakes: no process group needed)."""

import pytest
import torch

from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.parallel import distributed


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


@pytest.mark.parametrize("backend", ["naive", "grouped_torch", "te_permute_grouped_mm", "te_ops"])
def test_expert_parallelism_sorts_the_token_copies_once(monkeypatch, backend):
    """Under ep=2 (one process, the exchanges replaced by identities as above) every MoE layer
    sorts its token copies once, before the exchange: the arrivals are regrouped by the
    exchanged counts, and the experts sort nothing."""
    from moe_tutorial.moe import routing

    sorts, permutes = [], []
    sort_by_expert, permute = routing.sort_by_expert, distributed.permute
    monkeypatch.setattr(routing, "sort_by_expert",
                        lambda *a, **k: (sorts.append(1), sort_by_expert(*a, **k))[1])
    monkeypatch.setattr(distributed, "permute",
                        lambda *a, **k: (permutes.append(1), permute(*a, **k))[1])
    monkeypatch.setattr(distributed.dist, "all_to_all_single",
                        lambda output, input, group=None: output.copy_(input))
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(distributed, "all_to_all_single_autograd",
                        lambda x, out_splits, in_splits, group: x.clone())
    config = preset("tiny")
    torch.manual_seed(0)
    model = MoEForCausalLM(config).set_expert_backend(backend)
    layout = distributed.Layout(dp=1, ep=2, dp_rank=0, ep_rank=0, dp_group=None, ep_group=None)
    distributed.shard_experts(model, layout)
    ids = torch.randint(0, config.vocab_size, (2, 8))
    model(ids, ids).loss.backward()
    assert len(sorts) == len(permutes) == config.num_layers
    assert "regroup by expert" in model.expert_paths()[0]


@pytest.mark.parametrize("align", [1, 4])
def test_regrouping_by_the_counts_is_the_sort_by_expert(align):
    """The arrivals regrouped from the exchanged counts alone land where sorting them by local
    expert (stable, padded to `align`) would put them: the sort the experts used to run again."""
    from moe_tutorial.moe import routing

    recv_counts = torch.tensor([[3, 0, 2], [1, 4, 0]])  # 2 source ranks, 3 local experts
    arrivals = distributed.received_experts(recv_counts).unsqueeze(1)
    rows = torch.randn(arrivals.shape[0], 5)
    sorted_rows, _, by_sort = routing.permute(rows, arrivals, None, 3, align)
    by_counts = distributed.regroup_by_expert(recv_counts, align)
    for field in ("token_index", "row_index", "assignment_rows", "tokens_per_expert", "m_splits"):
        assert torch.equal(getattr(by_counts, field), getattr(by_sort, field)), field
    assert by_counts.num_rows == by_sort.num_rows
    assert torch.equal(routing.permute_rows(rows, None, by_counts)[0], sorted_rows)
