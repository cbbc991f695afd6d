"""Bad and unusual inputs to the config, the model's forward pass and the HF conversion: each
gets the right result or one ValueError that names the bad value (or field) and the fix."""

import re

import pytest
import torch

from moe_tutorial.course.lesson import course_mode
from moe_tutorial.moe import hf_baseline
from moe_tutorial.moe.batch import IGNORE_INDEX, next_token_targets
from moe_tutorial.moe.config import MoEConfig, preset
from moe_tutorial.moe.hf import from_hf
from moe_tutorial.moe.model import MoEForCausalLM

transformers = pytest.importorskip("transformers", minversion="5.0")

TINY = preset("tiny")  # vocab_size 24, max_seq_len 64


def assert_clear_error(action, *patterns):
    """`action()` raises a ValueError whose one-line message matches every pattern (the bad value
    and the fix)."""
    with pytest.raises(ValueError) as caught:
        action()
    message = str(caught.value)
    assert "\n" not in message, message
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in: {message}"


# --- MoEConfig --------------------------------------------------------------------------------
CONFIG_PROBES = [
    (dict(init_std=float("inf")), [r"MoEConfig\.init_std=inf", r"finite", r"> 0"]),
    (dict(init_std=float("nan")), [r"MoEConfig\.init_std=nan", r"finite"]),
    (dict(init_std="0.02"), [r"MoEConfig\.init_std='0\.02'", r"number"]),
    (dict(aux_loss_coef=float("inf")), [r"MoEConfig\.aux_loss_coef=inf", r"finite", r">= 0"]),
    (dict(aux_loss_coef=float("nan")), [r"MoEConfig\.aux_loss_coef=nan", r"finite"]),
    (dict(aux_loss_coef=-0.1), [r"MoEConfig\.aux_loss_coef=-0\.1", r">= 0"]),
    (dict(rope_theta=0.0), [r"MoEConfig\.rope_theta=0\.0", r"> 0"]),
    (dict(rope_theta=-1e4), [r"MoEConfig\.rope_theta=-10000\.0", r"> 0"]),
    (dict(rope_theta=float("inf")), [r"MoEConfig\.rope_theta=inf", r"finite"]),
    (dict(norm_eps=0.0), [r"MoEConfig\.norm_eps=0\.0", r"> 0"]),
    (dict(norm_eps=-1e-5), [r"MoEConfig\.norm_eps=-1e-05", r"> 0"]),
    (dict(norm_eps=float("nan")), [r"MoEConfig\.norm_eps=nan", r"finite"]),
    (dict(dtype="fp16"), [r"MoEConfig\.dtype='fp16'", r"bfloat16"]),
    (dict(dtype=torch.bfloat16), [r"MoEConfig\.dtype=torch\.bfloat16", r"'bfloat16'"]),
    (dict(hidden_size=64.0), [r"MoEConfig\.hidden_size=64\.0", r"positive integer"]),
    (dict(num_layers=True), [r"MoEConfig\.num_layers=True", r"positive integer"]),
    (dict(vocab_size=0), [r"MoEConfig\.vocab_size=0", r"positive integer"]),
    (dict(top_k=3, num_experts=2), [r"MoEConfig\.top_k=3", r"lower top_k or add experts"]),
    (dict(num_heads=4, num_kv_heads=3), [r"num_kv_heads=3", r"divides num_heads|multiple"]),
]


@pytest.mark.parametrize(
    "fields, patterns", CONFIG_PROBES,
    ids=[",".join(f"{k}={v!r}" for k, v in f.items()) for f, _ in CONFIG_PROBES])
def test_config_refuses_bad_field(fields, patterns):
    assert_clear_error(lambda: MoEConfig(**fields), *patterns)


def test_unknown_preset_names_the_presets():
    assert_clear_error(lambda: preset("nope"), r"'nope'", r"mixtral-2l", r"tiny")


def test_unknown_override_names_the_fields():
    assert_clear_error(lambda: preset("tiny").with_overrides(experts=8), r"experts", r"num_experts")


def test_unknown_course_mode_names_the_modes():
    assert_clear_error(lambda: course_mode("medium"), r"'medium'", r"small", r"full")


# --- MoEForCausalLM.forward -------------------------------------------------------------------
def _ids(*shape):
    return torch.randint(0, TINY.vocab_size, shape)


FORWARD_PROBES = {
    "id >= vocab_size": (lambda: (torch.tensor([[1, 2, 30]]), None),
                         [r"token id 30", r"vocab_size=24", r"tokeni[sz]e|vocab_size"]),
    "negative id": (lambda: (torch.tensor([[1, -1, 3]]), None), [r"token id -1", r"\[0, 24\)"]),
    "1-D input_ids": (lambda: (_ids(8), None), [r"shape \(8,\)", r"unsqueeze\(0\)"]),
    "3-D input_ids": (lambda: (_ids(1, 2, 8), None), [r"shape \(1, 2, 8\)", r"\[batch, seq\]"]),
    "float ids": (lambda: (_ids(2, 8).float(), None), [r"torch\.float32", r"\.long\(\)"]),
    "bool ids": (lambda: (_ids(2, 8).bool(), None), [r"torch\.bool", r"\.long\(\)"]),
    "list ids": (lambda: ([[1, 2, 3]], None), [r"list", r"torch\.tensor"]),
    "too long": (lambda: (torch.zeros(1, 65, dtype=torch.long), None),
                 [r"exceeds config\.max_seq_len=64", r"at most 64"]),
    "empty sequence": (lambda: (torch.zeros(2, 0, dtype=torch.long), None),
                       [r"shape \(2, 0\)", r"at least one"]),
    "empty batch": (lambda: (torch.zeros(0, 8, dtype=torch.long), None),
                    [r"shape \(0, 8\)", r"at least one"]),
    "targets of another shape": (lambda: (_ids(2, 8), _ids(2, 7)),
                                 [r"targets.*\(2, 7\)", r"\(2, 8\)", r"next_token_targets"]),
    "flat targets": (lambda: (_ids(2, 8), _ids(16)), [r"targets.*\(16,\)", r"next_token_targets"]),
    "float targets": (lambda: (_ids(2, 8), _ids(2, 8).float()), [r"targets.*torch\.float32",
                                                                  r"\.long\(\)"]),
    "target >= vocab_size": (lambda: (_ids(2, 8), torch.full((2, 8), 99)),
                             [r"targets.*99", r"IGNORE_INDEX|-100"]),
    # The training path used to clamp these to token 0 and train on them without a word.
    "negative target": (lambda: (_ids(2, 8), torch.full((2, 8), -5)),
                        [r"targets.*-5", r"-100"]),
    "list targets": (lambda: (_ids(1, 3), [[1, 2, 3]]), [r"targets.*list", r"torch\.tensor"]),
}


@pytest.mark.parametrize("case", sorted(FORWARD_PROBES))
def test_forward_refuses_bad_batch(case):
    model = MoEForCausalLM(TINY)
    make_batch, patterns = FORWARD_PROBES[case]
    input_ids, targets = make_batch()
    assert_clear_error(lambda: model(input_ids, targets), *patterns)


def test_forward_takes_int32_ids_and_targets_in_training_and_evaluation():
    model = MoEForCausalLM(TINY)
    ids = _ids(2, 8)
    ref = model(ids, next_token_targets(ids)).loss
    ids32 = ids.int()
    torch.testing.assert_close(model(ids32, next_token_targets(ids32)).loss, ref)
    with torch.no_grad():  # evaluation takes torch's cross_entropy, which wants int64 targets
        torch.testing.assert_close(model(ids32, next_token_targets(ids32)).loss, ref.detach())


def test_ignored_targets_are_still_skipped():
    model = MoEForCausalLM(TINY)
    ids = _ids(2, 8)
    targets = next_token_targets(ids)
    assert (targets[:, -1] == IGNORE_INDEX).all()
    assert torch.isfinite(model(ids, targets).loss)


# --- from_hf: every MixtralConfig field that changes the arithmetic ---------------------------
def _hf_mixtral(model_class=None, **overrides):
    kwargs = TINY.to_hf_config_kwargs() | overrides
    config = transformers.MixtralConfig(**kwargs)
    model_class = model_class or transformers.MixtralForCausalLM
    return model_class._from_config(config, attn_implementation="sdpa", dtype=torch.float32)


REFUSED_HF_FIELDS = {
    "hidden_act=gelu": (dict(hidden_act="gelu"), [r"hidden_act='gelu'", r"'silu'"]),
    "rope linear": (dict(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 1e6}),
                    [r"rope_type='linear'", r"'default'"]),
    "legacy rope_scaling": (dict(rope_parameters=None,
                                 rope_scaling={"rope_type": "linear", "factor": 2.0}),
                            [r"rope_type='linear'", r"'default'"]),
    "attention_dropout": (dict(attention_dropout=0.1), [r"attention_dropout=0\.1", r"0\.0"]),
    "router_jitter_noise": (dict(router_jitter_noise=0.1), [r"router_jitter_noise=0\.1", r"0\.0"]),
    "sliding_window": (dict(sliding_window=8), [r"sliding_window=8", r"None"]),
    "head_dim": (dict(head_dim=16), [r"head_dim=16", r"hidden_size / num_attention_heads = 8"]),
    "tie_word_embeddings": (dict(tie_word_embeddings=True), [r"tie_word_embeddings=True",
                                                            r"False"]),
    "several at once": (dict(hidden_act="relu", router_jitter_noise=0.5),
                        [r"hidden_act='relu'", r"router_jitter_noise=0\.5"]),
    "top_k > experts": (dict(num_experts_per_tok=5), [r"num_experts_per_tok=5",
                                                      r"num_local_experts=4"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED_HF_FIELDS))
def test_from_hf_refuses_a_field_it_does_not_implement(case):
    overrides, patterns = REFUSED_HF_FIELDS[case]
    hf = _hf_mixtral(**overrides)
    assert_clear_error(lambda: from_hf(hf), *patterns)


SUPPORTED_HF_FIELDS = {
    "hidden_act=swish": dict(hidden_act="swish"),  # transformers' other name for silu
    "rms_norm_eps": dict(rms_norm_eps=1e-2),
    "rope_theta": dict(rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
    "head_dim given": dict(head_dim=8),
    "output_router_logits": dict(output_router_logits=True),
    "sliding_window covering the context": dict(sliding_window=64),
    "pad_token_id": dict(pad_token_id=0),  # that row gets no gradient, in both models
}


@pytest.mark.parametrize("case", sorted(SUPPORTED_HF_FIELDS))
def test_from_hf_converts_a_supported_field_exactly(case):
    hf = _hf_mixtral(**SUPPORTED_HF_FIELDS[case])
    ours = from_hf(hf)
    ids = _ids(2, 16)
    ref = hf(ids, labels=ids, output_router_logits=True)
    out = ours(ids, next_token_targets(ids))
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)


def test_from_hf_names_another_model_type():
    config = transformers.GraniteMoeConfig(  # a MoE family without a converter here
        vocab_size=32, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    hf = transformers.GraniteMoeForCausalLM._from_config(config, dtype=torch.float32)
    assert_clear_error(lambda: from_hf(hf), r"model_type='granitemoe'",
                       r"MixtralForCausalLM")


def test_from_hf_names_a_dense_model_type():
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2)
    hf = transformers.LlamaForCausalLM._from_config(config, dtype=torch.float32)
    assert_clear_error(lambda: from_hf(hf), r"model_type='llama'",
                       r"MixtralForCausalLM")


def test_from_hf_wants_the_causal_lm_not_the_body():
    hf = _hf_mixtral(transformers.MixtralModel)
    assert_clear_error(lambda: from_hf(hf), r"MixtralModel",
                       r"MixtralForCausalLM")


def test_from_hf_wants_a_model_not_a_config():
    config = transformers.MixtralConfig(**TINY.to_hf_config_kwargs())
    assert_clear_error(lambda: from_hf(config), r"MixtralConfig",
                       r"MixtralForCausalLM")


def test_from_hf_names_an_unsupported_dtype():
    hf = _hf_mixtral().to(torch.float64)
    assert_clear_error(lambda: from_hf(hf), r"torch\.float64", r"\.to\(")


def test_hf_baseline_wants_our_model():
    assert_clear_error(lambda: hf_baseline.hf_mixtral(TINY), r"MoEConfig", r"MoEForCausalLM")


def test_hf_baseline_names_the_experts_implementations():
    model = MoEForCausalLM(TINY)
    assert_clear_error(lambda: hf_baseline.hf_mixtral(model, "compiled"), r"'compiled'",
                       r"grouped_mm")
