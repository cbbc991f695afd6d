"""A softmax router in fp32 refuses bf16 input naming the dtype; a sigmoid router takes it."""

from __future__ import annotations

import pytest
import torch

from moe_tutorial.moe.model import Router


def test_bf16_input_to_an_fp32_softmax_router_names_the_cast():
    with pytest.raises(ValueError, match="router got input in torch.bfloat16"):
        Router(16, 4, 2)(torch.randn(6, 16, dtype=torch.bfloat16))


def test_a_sigmoid_router_takes_bf16_input():
    router = Router(16, 4, 2, scoring="sigmoid")
    assert router(torch.randn(6, 16, dtype=torch.bfloat16)).indices.shape == (6, 2)
