"""FSDP2, train_dist's data-parallel engine, on CPU with gloo: `train_dist`'s `check` mode in
`ranks.run` processes, each with its own batch, must compute the loss, logits and every gradient
(gathered from FSDP2's shards) that the single-process model computes on all the batches
together — for a layout whose expert shards' dp group is not the world (dp2×ep2), one GPU's
worth (world 1), activation checkpointing and a mixed-precision policy. test_distributed runs
the same mode through torchrun for the other layouts and backends."""

import pytest
import torch

from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.parallel import distributed, ranks
from moe_tutorial.perf import train_dist

# As in test_distributed: fp32 sums in another order (~1e-7); a gradient divided by dp instead
# of the world size, or reduced over the wrong group, is off by >= 1e-1.
TOLERANCE = 1e-5
# bf16 compute with fp32 state against the bf16 model: the same forward, gradients rounded to
# bf16 once per micro-batch (~2e-3 seen). Routing weights cast to bf16 on their way to the
# experts (FSDP2's default input cast) put the router's gradient ~1e-1 off.
BF16_TOLERANCE = 1e-2


def _check(*argv: str) -> dict:
    return train_dist.run(train_dist.parse_args(["--mode", "check", *argv]), torch.device("cpu"))


@pytest.mark.parametrize("world, argv, tolerance", [
    # dp2×ep2: an expert shard's gradients are divided by a factor other than its group's size
    (4, ("--dp", "2", "--ep", "2"), TOLERANCE),
    (1, ("--dp", "1", "--ep", "1"), TOLERANCE),
    (2, ("--dp", "2", "--ep", "1", "--activation-checkpointing"), TOLERANCE),
    (2, ("--dp", "1", "--ep", "2", "--activation-checkpointing"), TOLERANCE),
    (2, ("--dp", "2", "--ep", "1", "--dtype", "bfloat16", "--state-dtype", "float32",
         "--seq-len", "64"), BF16_TOLERANCE),
], ids=["dp2xep2", "world1", "dp2-checkpointed", "ep2-checkpointed", "bf16-compute-fp32-state"])
def test_fsdp_equals_single_process(world, argv, tolerance):
    results = ranks.run(_check, world, *argv, timeout_s=120)
    for r in results:
        assert r["engine"] == "fsdp2" and r["sharded"], r
        assert r["compared"] > 10  # loss, logits, the norm and every parameter were compared
        assert r["max_rel_error"] < tolerance, (r["worst"], r["max_rel_error"])
        # the sharded training state stays in the state dtype (the default: the compute dtype)
        assert r["parameter_dtypes"] == ["float32"], r
    print({f"{' '.join(argv)} rank{rank}": (r["worst"], r["max_rel_error"])
           for rank, r in enumerate(results)})


def test_a_separate_state_dtype_needs_fsdp2():
    args = train_dist.parse_args(["--engine", "replicated", "--state-dtype", "float32",
                                  "--dtype", "bfloat16"])
    with pytest.raises(ValueError, match="only --engine fsdp2 keeps the training state"):
        train_dist.dtypes(args, preset("tiny"))


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


def test_model_output_is_a_pytree_fsdp2_can_hook():
    """FSDP2 unshards the root's weights (embedding, lm_head) before the backward pass through
    hooks on the tensors it finds in the root's output; torch 2.11 finds them with tree_flatten,
    which sees an unregistered dataclass as one leaf (then the backward read freed storage:
    "setStorage ... storage of size 0", seen on the H200). The output's tensors must be leaves."""
    model = MoEForCausalLM(preset("tiny"))
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    out = model(ids, ids)
    leaves = torch.utils._pytree.tree_leaves(out)
    assert any(leaf is out.logits for leaf in leaves) and any(leaf is out.loss for leaf in leaves)
