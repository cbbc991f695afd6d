"""Experts refuse input of another dtype than their weights, naming both and the cast to make;
input of their own dtype (bf16 into bf16 experts) runs."""

from __future__ import annotations

import pytest
import torch

from moe_tutorial.moe.dispatch import run_experts
from moe_tutorial.moe.experts import GroupedTorchExperts


def _routed(dtype):
    hidden = torch.randn(6, 16, dtype=dtype)
    return hidden, torch.randint(0, 4, (6, 2)), torch.rand(6, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_input_dtypes_to_fp32_experts_name_the_cast(dtype):
    with pytest.raises(ValueError, match=rf"experts got input in {dtype} but its weights are "
                                         r"torch.float32: cast the input"):
        run_experts(GroupedTorchExperts(4, 16, 32), *_routed(dtype))


def test_bf16_experts_take_bf16_input():
    out, _ = run_experts(GroupedTorchExperts(4, 16, 32).to(torch.bfloat16), *_routed(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (6, 16)
