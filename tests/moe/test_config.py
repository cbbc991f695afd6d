import pytest
import torch

from moe_tutorial.course.lesson import MODE_ENV, course_mode
from moe_tutorial.moe.config import PRESETS, MoEConfig, preset
from moe_tutorial.moe.model import MoEForCausalLM, is_expert_parameter
from moe_tutorial.train.data import VOCAB_SIZE


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid(name):
    cfg = preset(name)
    assert cfg.hidden_size % cfg.num_heads == 0 and cfg.top_k <= cfg.num_experts


def test_protein_presets_use_the_tokenizer_vocabulary():
    assert preset("tiny").vocab_size == preset("small").vocab_size == VOCAB_SIZE


def test_mixtral_presets_have_mixtral_width():
    cfg = preset("mixtral-8x7b")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k) == (4096, 14336, 8, 2)
    # 12.9B active parameters per token is Mixtral's published figure (12.75B without lm_head
    # and router counted the recipe's way); ours counts attention, 2 experts, router and lm_head.
    assert 12.7e9 < cfg.active_params_per_token() < 13.0e9
    assert preset("mixtral-2l").num_layers == 2


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_parameter_counts_match_the_model(name):
    """Split the way expert parallelism splits gradients; active per token: the dense matmul
    weights (not the embedding lookup, not the norms' scales) and top_k of the experts."""
    config = preset(name)
    params = dict(MoEForCausalLM(config).named_parameters())
    expert = sum(p.numel() for n, p in params.items() if is_expert_parameter(n))
    total = sum(p.numel() for p in params.values())
    counts = config.parameter_counts()
    assert (counts["expert"], counts["dense"], counts["total"]) == (expert, total - expert,
                                                                    total)
    lookup_and_scales = sum(p.numel() for n, p in params.items() if "embed" in n or "norm" in n)
    active = counts["dense"] - lookup_and_scales + config.top_k * expert // config.num_experts
    assert counts["active_per_token"] == config.active_params_per_token() == active


def test_mixtral_8x7b_has_its_published_size():
    counts = preset("mixtral-8x7b").parameter_counts()
    assert counts["total"] == 46_702_792_704  # Mixtral 8x7B's 46.7 B parameters
    assert counts["expert"] / counts["total"] > 0.96


@pytest.mark.parametrize("overrides, field", [
    (dict(top_k=3, num_experts=2), "top_k=3"),
    (dict(hidden_size=30, num_heads=4), "hidden_size=30"),
    (dict(num_heads=4, num_kv_heads=3), "num_heads=4"),
    (dict(hidden_size=36, num_heads=4), "hidden_size / num_heads = 9"),
    (dict(num_layers=0), "num_layers=0"),
    (dict(num_experts=2.0), "num_experts=2.0"),
    (dict(dtype="fp8"), "dtype='fp8'"),
    (dict(norm_eps=0.0), "norm_eps=0.0"),
    (dict(aux_loss_coef=-1.0), "aux_loss_coef=-1.0"),
])
def test_invalid_configs_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"MoEConfig.{field}".replace("(", r"\(").replace("/", "/")):
        MoEConfig(**overrides)


def test_with_overrides_validates_and_rejects_unknown_fields():
    assert preset("tiny").with_overrides(num_experts=8).num_experts == 8
    with pytest.raises(ValueError, match="no field"):
        preset("tiny").with_overrides(experts=8)
    with pytest.raises(ValueError, match="top_k"):
        preset("tiny").with_overrides(num_experts=1)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'.*tiny"):
        preset("huge")


def test_course_mode(monkeypatch):
    monkeypatch.delenv(MODE_ENV, raising=False)
    assert course_mode() == ("full" if torch.cuda.is_available() else "small")
    monkeypatch.setenv(MODE_ENV, "full")
    assert course_mode() == "full"
    assert course_mode("small") == "small"
    monkeypatch.setenv(MODE_ENV, "medium")
    with pytest.raises(ValueError, match=r"medium.*\$MOE_TUTORIAL_MODE"):
        course_mode()
