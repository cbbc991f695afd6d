"""Weights convert to and from HF models exactly, or are refused naming the fix: weights of
mixed dtypes, a narrower dtype that would round, a dtype given as text, a model without weights
(on the meta device), a base model without its head, and float64 are refused by name; a wider
dtype, or a narrower one that holds every value exactly, converts exactly."""

from __future__ import annotations

import re

import pytest
import torch
from refused_on_one_line import refused
from tiny_model_training import tiny_model  # noqa: F401  (a fixture)

from moe_tutorial.moe.config import preset
from moe_tutorial.moe.hf import from_hf, to_hf_state_dict
from moe_tutorial.moe.model import MoEForCausalLM

transformers = pytest.importorskip("transformers")


def _hf_mixtral(dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**preset("tiny").to_hf_config_kwargs())
    return transformers.MixtralForCausalLM(config).to(dtype)


def test_from_hf_refuses_weights_of_mixed_dtypes_by_name():
    hf = _hf_mixtral()
    hf.lm_head.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"lm_head.weight is torch.bfloat16.*one dtype"):
        from_hf(hf)


def test_weights_for_an_hf_model_of_a_narrower_dtype_are_refused_by_name(tiny_model):  # noqa: F811
    message = refused(lambda: to_hf_state_dict(tiny_model, torch.bfloat16), ValueError,
                      "torch.bfloat16", "torch.float32", "would round")
    assert re.search(r"model\.\S+ \(torch\.float32\)", message), message


def test_weights_for_an_hf_model_of_a_wider_dtype_convert_exactly():
    torch.manual_seed(0)
    bf16 = MoEForCausalLM(preset("tiny").with_overrides(dtype="bfloat16"))
    ours = to_hf_state_dict(bf16)
    wide = to_hf_state_dict(bf16, torch.float32)
    hf = _hf_mixtral(torch.float32)
    hf.load_state_dict(wide, strict=True)
    for name, value in hf.state_dict().items():
        assert value.dtype == torch.float32
        assert torch.equal(value.to(torch.bfloat16), ours[name]), name


def test_weights_that_a_narrower_dtype_holds_exactly_convert(tiny_model):  # noqa: F811
    model = MoEForCausalLM(preset("tiny"))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # every value a bf16 value
    hf = _hf_mixtral(torch.bfloat16)
    hf.load_state_dict(to_hf_state_dict(model, torch.bfloat16), strict=True)
    for name, value in to_hf_state_dict(model).items():
        assert torch.equal(hf.state_dict()[name].float(), value), name


def test_a_dtype_that_is_no_float_dtype_is_refused(tiny_model):  # noqa: F811
    refused(lambda: to_hf_state_dict(tiny_model, "bfloat16"), ValueError, "'bfloat16'",
            "hf_model.dtype")


def test_an_hf_model_without_weights_is_refused():
    with torch.device("meta"):
        hf = _hf_mixtral()
    refused(lambda: from_hf(hf), ValueError, "meta", "from_pretrained")


def test_an_hf_base_model_without_its_head_is_named():
    refused(lambda: from_hf(_hf_mixtral().model), ValueError, "lm_head",
            "MixtralForCausalLM")


def test_an_hf_model_in_float64_is_refused_with_the_cast():
    refused(lambda: from_hf(_hf_mixtral(torch.float64)), ValueError,
            "torch.float64", "hf_model.to(torch.float32)")
