"""FSDP2 on a (dp, ep) layout, on CPU with gloo: 2 `ranks.run` processes, each with its own
batch, must compute the loss and every gradient the single-process model computes on both
batches together (train_dist's `check`, with `fully_shard_layout` instead of
`average_gradients`)."""

import copy

import pytest
import torch
import torch.distributed as dist

from moe_tutorial import distributed, ranks
from moe_tutorial.config import preset
from moe_tutorial.lesson import rel_error
from moe_tutorial.model import MoEForCausalLM, next_token_targets
from moe_tutorial.train_dist import _global_batch

# As in test_distributed: fp32 sums in another order (~1e-7); a gradient divided by dp instead
# of the world size, or reduced over the wrong group, is off by >= 1e-1.
TOLERANCE = 1e-5
BATCH, SEQ_LEN = 2, 16


def _fsdp_against_single_process(dp: int, ep: int) -> dict:
    """One forward + backward of the FSDP2 + EP model on this rank's batch; its loss, logits
    and every full gradient against the full model's on the global batch (relative errors)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = preset("tiny", aux_loss_coef=0.0)  # the aux loss is per rank (local balance)
    layout = distributed.init_layout(dp, ep, config.num_experts)
    torch.manual_seed(0)
    reference = MoEForCausalLM(config)
    model = distributed.fully_shard_layout(
        distributed.shard_experts(copy.deepcopy(reference), layout), layout)
    ids = _global_batch(config, world, BATCH, SEQ_LEN, "cpu")
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    ref_out = reference(ids, next_token_targets(ids))
    ref_out.loss.backward()
    out = model(ids[mine], next_token_targets(ids[mine]))
    out.loss.backward()

    # Every rank's loss is the mean over its equally many tokens: their mean is the global one.
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    errors = {"loss": rel_error(loss / world, ref_out.loss),
              "logits": rel_error(out.logits, ref_out.logits[mine])}
    ref_params = dict(reference.named_parameters())
    per_rank = config.num_experts // ep
    first = layout.ep_rank * per_rank
    sharded = 0
    for name, p in model.named_parameters():
        sharded += isinstance(p, torch.distributed.tensor.DTensor)
        # full_tensor() gathers over the parameter's own mesh: the world's, or the dp group's
        # for an expert shard, which is then this ep rank's experts [first, first + per_rank)
        grad = p.grad.full_tensor()
        want = ref_params[name].grad
        if distributed.is_expert_parameter(name):
            want = want[first:first + per_rank]
        errors[name] = rel_error(grad, want)
    worst = max(errors, key=errors.get)
    return {"errors": errors, "worst": worst, "max_rel_error": errors[worst],
            "all_dtensors": sharded == len(ref_params), "path": model.expert_paths()[0]}


# dp2×ep2 (4 processes) is the case where an expert shard's dp group is not the world: its
# gradients are divided by a factor other than the group's size.
@pytest.mark.parametrize("dp, ep", [(2, 1), (1, 2), (2, 2)])
def test_fsdp_equals_single_process(dp, ep):
    results = ranks.run(_fsdp_against_single_process, dp * ep, dp, ep, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["all_dtensors"], r
        assert len(r["errors"]) > 10  # loss, logits and every parameter were compared
        assert r["max_rel_error"] < TOLERANCE, (r["worst"], r["max_rel_error"])
        if ep == 2:
            ep_rank = rank % ep
            assert r["path"].startswith(f"EP {ep_rank}/2 (experts {2 * ep_rank}..")
    print({f"dp{dp}ep{ep} rank{rank}": (r["worst"], r["max_rel_error"])
           for rank, r in enumerate(results)})


def _bad_layout():
    layout = distributed.Layout(dp=1, ep=1, dp_rank=0, ep_rank=0, dp_group=None, ep_group=None)
    return distributed.fully_shard_layout(MoEForCausalLM(preset("tiny")), layout)


def test_a_bad_layout_is_refused_with_check_layouts_message():
    with pytest.raises(ranks.RankError, match="world size 2 does not factor as dp × ep = 1 × 1"):
        ranks.run(_bad_layout, 2, timeout_s=60)


def _experts_not_sharded():
    config = preset("tiny")
    layout = distributed.init_layout(1, 2, config.num_experts)
    return distributed.fully_shard_layout(MoEForCausalLM(config), layout)


def test_ep_without_shard_experts_is_refused():
    with pytest.raises(ranks.RankError, match="call distributed.shard_experts"):
        ranks.run(_experts_not_sharded, 2, timeout_s=60)
