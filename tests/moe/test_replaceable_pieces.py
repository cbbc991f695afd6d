"""The model's replaceable pieces are set on the model, never patched into a module: the attention
kernels (`MoEForCausalLM.set_attention_backends`) and the routing rule (`set_routing`, which `train_dist.starve_experts` wraps and restores)."""

import pytest
import torch
from torch.nn.attention import SDPBackend

from moe_tutorial.moe import model as moe_model
from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import ATTENTION_BACKENDS, MoEForCausalLM
from moe_tutorial.perf.dist_model import starve_experts


def test_attention_backends_narrow_every_layer_and_restore():
    model = MoEForCausalLM(preset("tiny"))
    narrowed = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    model.set_attention_backends(narrowed)
    assert all(layer.self_attn.backends == tuple(narrowed) for layer in model.model.layers)
    assert SDPBackend.CUDNN_ATTENTION not in model.attention_backends
    model.set_attention_backends()
    assert model.attention_backends == tuple(ATTENTION_BACKENDS)
    assert moe_model.ATTENTION_BACKENDS[0] == SDPBackend.CUDNN_ATTENTION  # the module's own, as it was


def test_attention_backends_are_refused_unless_sdpa_backends():
    model = MoEForCausalLM(preset("tiny"))
    with pytest.raises(ValueError, match="SDPBackend"):
        model.set_attention_backends(["flash"])
    with pytest.raises(ValueError, match="non-empty"):
        model.set_attention_backends([])


def test_starved_experts_are_restored_after_the_block():
    torch.manual_seed(0)
    model = MoEForCausalLM(preset("tiny"))
    rule = model.routing_rule
    with starve_experts([0], model):
        assert model.routing_rule is not rule
    assert model.routing_rule is rule
