"""Routing skew and what it costs (moe_tutorial.perf.skew): splits, padding, stragglers, GEMM rate."""

import pytest
import torch

from moe_tutorial.moe.routing import sort_by_expert
from moe_tutorial.perf import skew, timing

SHAPES = [(64, 8, 2), (100, 8, 2), (37, 6, 3), (50, 4, 4), (9, 1, 1), (1000, 16, 1)]


@pytest.mark.parametrize("tokens, experts, top_k", SHAPES)
@pytest.mark.parametrize("level", [0.0, 0.1, 0.37, 0.5, 0.9, 1.0])
def test_splits_keep_every_copy_and_no_expert_exceeds_the_tokens(tokens, experts, top_k, level):
    splits = skew.skewed_splits(tokens, experts, top_k, level)
    assert len(splits) == experts and sum(splits) == tokens * top_k
    assert min(splits) >= 0 and max(splits) <= tokens


@pytest.mark.parametrize("tokens, experts, top_k", SHAPES)
def test_skew_zero_is_balanced_and_one_is_one_hot_expert(tokens, experts, top_k):
    balanced = skew.skewed_splits(tokens, experts, top_k, 0.0)
    assert max(balanced) - min(balanced) <= 1  # the remainder spread one copy at a time
    hot = skew.skewed_splits(tokens, experts, top_k, 1.0)
    assert hot[0] == tokens  # every token picks expert 0, once
    assert max(hot[1:], default=0) - min(hot[1:], default=0) <= 1  # the other k-1 choices spread


def test_the_hot_expert_grows_with_the_skew():
    hot = [skew.skewed_splits(512, 8, 2, level / 20)[0] for level in range(21)]
    assert hot == sorted(hot) and hot[0] == 128 and hot[-1] == 512
    assert skew.skewed_splits(512, 8, 2, 0.5) == [320] + [101] * 4 + [100] * 3  # 128 + (512-128)/2; 704 over 7


@pytest.mark.parametrize("splits, top_k", [([3, 1, 2, 0], 2), ([6, 6, 6, 6], 3), ([7], 1),
                                           (skew.skewed_splits(40, 8, 2, 1.0), 2)])
def test_routing_for_splits_routes_exactly_those_copies(splits, top_k):
    indices = skew.routing_for_splits(splits, top_k)
    assert indices.shape == (sum(splits) // top_k, top_k) and indices.dtype == torch.int64
    assert sort_by_expert(indices, len(splits))[1].tolist() == splits
    assert all(len(set(row)) == top_k for row in indices.tolist())  # no expert twice per token


def test_padding_waste_by_hand():
    # align 16: 20 -> 32, 16 -> 16, 0 -> 0, 3 -> 16: 64 rows, 25 of them padding
    waste = skew.padding_waste([20, 16, 0, 3], alignments=(1, 16, 32))
    assert waste[1] == {"rows": 39, "rows_padded": 39, "padding_rows": 0, "fraction": 0.0}
    assert waste[16] == {"rows": 39, "rows_padded": 64, "padding_rows": 25, "fraction": 25 / 64}
    assert waste[32]["rows_padded"] == 96 and waste[32]["padding_rows"] == 57
    assert skew.padded_splits([20, 16, 0, 3], 16) == [32, 16, 0, 16]
    assert skew.padding_waste([0, 0], alignments=(16,))[16]["fraction"] == 0.0


def test_straggler_wait_by_hand():
    balanced = skew.straggler_wait(skew.skewed_splits(64, 8, 2, 0.0), ep=4)
    assert balanced["wait"] == 0.0 and balanced["rows_per_rank"] == [32] * 4
    uneven = skew.straggler_wait([30, 10, 5, 5], ep=2)  # ranks hold experts {0,1} and {2,3}
    assert uneven["rows_per_rank"] == [40, 10] and uneven["slowest_rank"] == 0
    assert uneven["wait"] == pytest.approx(1 - 25 / 40)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_one_hot_expert_with_top1_leaves_all_but_one_rank_idle(ep):
    one_hot = skew.skewed_splits(256, 8, 1, 1.0)
    assert one_hot == [256] + [0] * 7
    assert skew.straggler_wait(one_hot, ep)["wait"] == pytest.approx(1 - 1 / ep)


def test_the_straggler_wait_grows_with_the_skew():
    waits = [skew.straggler_wait(skew.skewed_splits(512, 8, 2, level / 10), 4)["wait"]
             for level in range(11)]
    assert waits == sorted(waits) and waits[0] == 0.0 and 0 < waits[-1] < 1 - 1 / 4


def test_grouped_gemm_efficiency_is_measured_here():
    splits = skew.skewed_splits(64, 4, 2, 1.0)
    result = skew.grouped_gemm_efficiency(splits, 32, 64, iters=3)
    assert set(result) == {"path", "rows", "skewed_ms", "balanced_ms", "skewed_tflops",
                           "balanced_tflops", "efficiency", "dtype", "timer"}
    assert result["rows"] == 128 and result["dtype"] == "float32" and result["timer"] == "perf_counter"
    assert result["path"] == "torch._grouped_mm"  # fp32 rows of 32 values: 16-byte aligned
    assert all(result[k] > 0 for k in ("skewed_ms", "balanced_ms", "skewed_tflops", "efficiency"))
    assert result["efficiency"] == pytest.approx(result["balanced_ms"] / result["skewed_ms"])
    flops = timing.expert_mlp_flops(128, 1, 32, 64, backward=False)
    assert result["skewed_tflops"] == pytest.approx(timing.tflops(flops, result["skewed_ms"]))


def test_grouped_gemm_efficiency_says_when_the_loop_ran():
    result = skew.grouped_gemm_efficiency([5, 3], 3, 4, iters=1, warmup=0)  # 12-byte rows
    assert result["path"].startswith("per-expert matmul loop (row sizes are not multiples of 16")


@pytest.mark.parametrize("call, match", [
    (lambda: skew.skewed_splits(64, 8, 2, 1.5), "skew=1.5 must be a number from 0"),
    (lambda: skew.skewed_splits(64, 8, 2, float("nan")), "skew=nan"),
    (lambda: skew.skewed_splits(64, 8, 9, 0.5), "top_k=9"),
    (lambda: skew.skewed_splits(0, 8, 2, 0.5), "tokens=0 must be a whole number >= 1"),
    (lambda: skew.routing_for_splits([5, 1], 2), "only 3 tokens"),
    (lambda: skew.routing_for_splits([3, 2], 2), "not a positive multiple of top_k=2"),
    (lambda: skew.padding_waste([4, -1]), r"splits=\[4, -1\] must be"),
    (lambda: skew.padding_waste([4, 4], alignments=16), "alignments=16 must be a non-empty"),
    (lambda: skew.padding_waste([4, 4], alignments=(0,)), "align=0 must be"),
    (lambda: skew.straggler_wait([1] * 6, ep=4), "num_experts=6 is not divisible by ep=4"),
    (lambda: skew.straggler_wait([1] * 6, ep=0), "ep=0 must be"),
    (lambda: skew.grouped_gemm_efficiency([0, 0], 8, 8), "route no rows"),
])
def test_bad_input_is_refused_in_one_line(call, match):
    with pytest.raises(ValueError, match=match) as error:
        call()
    assert "\n" not in str(error.value)
