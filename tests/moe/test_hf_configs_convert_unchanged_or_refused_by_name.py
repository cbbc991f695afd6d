"""An HF config converts unchanged, or is refused naming what is wrong: each family's default
config (OLMoE's padding token included) and DeepSeek-V3's MoE block convert as they are; an
unknown or dense family, a field the model cannot compute (named as HF spells it) and a config
given as a dict are refused by name."""

from __future__ import annotations

import pytest
from refused_on_one_line import refused

from moe_tutorial.moe.config import MoEConfig, preset


def test_an_unknown_family_is_refused_by_name():
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="model_type='llama' is not a family"):
        MoEConfig.from_hf_config(transformers.LlamaConfig())


def test_a_dense_hf_config_is_refused_naming_the_families():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2)
    refused(lambda: MoEConfig.from_hf_config(llama), ValueError, "'llama'", "MixtralForCausalLM")


def test_a_field_the_model_cannot_compute_is_named_as_hf_spells_it():
    transformers = pytest.importorskip("transformers")
    hf = transformers.MixtralConfig(num_hidden_layers=1, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act"):
        MoEConfig.from_hf_config(hf)


def test_an_hf_config_given_as_a_dict_is_named_as_a_dict():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(**preset("tiny").to_hf_config_kwargs()).to_dict()
    refused(lambda: MoEConfig.from_hf_config(config), ValueError, "dict", "mixtral",
            "MixtralConfig")


@pytest.mark.parametrize("name", ["MixtralConfig", "Qwen3MoeConfig", "OlmoeConfig"])
def test_a_familys_default_config_converts_unchanged(name):
    transformers = pytest.importorskip("transformers")
    hf = getattr(transformers, name)()
    config = MoEConfig.from_hf_config(hf)
    assert (config.hidden_size, config.num_experts) == (hf.hidden_size, hf.num_local_experts
                                                        if name == "MixtralConfig" else
                                                        hf.num_experts)
    assert config.pad_token_id == hf.pad_token_id  # OLMoE's 1 included, not dropped


def test_deepseek_v3s_default_block_converts_unchanged():
    transformers = pytest.importorskip("transformers")
    config = MoEConfig.from_hf_config(transformers.DeepseekV3Config(), moe_block_only=True)
    assert config.num_experts == transformers.DeepseekV3Config().n_routed_experts


def test_the_shipped_olmoe_config_converts_with_its_padding_token():
    from moe_tutorial.perf import analyze

    model = analyze.load_model("olmoe-1b-7b")
    assert not model.moe_block_only and model.config.pad_token_id == 1 and model.notes == ()
