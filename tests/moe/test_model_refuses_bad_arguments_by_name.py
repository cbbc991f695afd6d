"""The model's Python API refuses on one line what it cannot run: a GPU device on a machine
without one, an unknown expert backend, token ids given as floats."""

from __future__ import annotations

import pytest
import torch
from refused_on_one_line import refused
from tiny_model_training import tiny_model  # noqa: F401  (a fixture)

from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM


def test_a_gpu_model_on_a_machine_without_one_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    refused(lambda: MoEForCausalLM(preset("tiny"), device="cuda"), ValueError, "device",
            "no CUDA GPU")


def test_an_unknown_expert_backend_is_named():
    refused(lambda: MoEForCausalLM(preset("tiny"), "nope"), ValueError, "'nope'", "grouped_torch")


def test_token_ids_as_floats_are_named(tiny_model):  # noqa: F811
    refused(lambda: tiny_model(torch.rand(1, 4)), ValueError, "torch.float32", ".long()")
