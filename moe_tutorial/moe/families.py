"""The transformers MoE families the model reproduces exactly, and how their configs and weight
names map onto `MoEConfig` and the model's parameters.

                 attention                              router                      shared expert
    mixtral      GQA                                    softmax top-k, renormalised none
    qwen3_moe    GQA, RMSNorm on q and k per head;      softmax top-k,              none
                 head_dim need not be hidden / heads    norm_topk_prob
    olmoe        GQA, RMSNorm over the whole q and k    softmax top-k,              none
                 projections; clip_qkv                  norm_topk_prob
    qwen2_moe    GQA with q, k, v biases                softmax top-k,              one SwiGLU MLP, scaled by
                                                        norm_topk_prob              sigmoid(shared_expert_gate)
    deepseek_v3  MLA: not implemented; the MoE block    sigmoid, bias-corrected,    n_shared_experts MLPs
                 converts alone (moe_block_only)        group-limited, scaled       (one MLP n times as wide)

A family's HF config is read field by field (`read_hf_config`) and written back the same way
(`hf_config_kwargs`); a value this package does not compute is refused under its HF name, never
approximated. Parameter names are HF's, except DeepSeek-V3's `shared_experts`, which is
`shared_expert` here as in Qwen2-MoE (`hf_key_to_ours`, `our_key_to_hf`).

This module imports nothing from the package (`config` builds on it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# MoEConfig's fields under the same HF name in every family (rope_theta lives in rope_parameters,
# the dtype in the weights).
COMMON_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "top_k": "num_experts_per_tok", "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps", "init_std": "initializer_range",
    # every family's embedding is nn.Embedding(vocab_size, hidden_size, padding_idx=pad_token_id)
    "pad_token_id": "pad_token_id",
}

# The MoEConfig fields that say which architecture variant runs, at their Mixtral values (which
# are MoEConfig's defaults). A family maps some of them to HF fields and fixes the others.
ARCHITECTURE_DEFAULTS = {
    "attention_head_dim": None, "qkv_bias": False, "o_proj_bias": False, "qk_norm": "none",
    "clip_qkv": None, "router": "softmax", "norm_topk_prob": True, "routed_scaling_factor": 1.0,
    "n_group": 1, "topk_group": 1, "shared_expert_intermediate_size": 0,
    "shared_expert_gate": False,
}


@dataclass(frozen=True)
class Family:
    causal_lm: str  # the transformers class this family converts from and to
    config_class: str
    fields: dict[str, str]  # MoEConfig field -> the HF config field holding the same value
    fixed: dict[str, object] = field(default_factory=dict)  # what the family's code hard-wires
    reads_head_dim: bool = False  # HF's `head_dim` may differ from hidden_size / heads


FAMILIES: dict[str, Family] = {
    "mixtral": Family(
        "MixtralForCausalLM", "MixtralConfig",
        COMMON_FIELDS | {"intermediate_size": "intermediate_size",
                         "num_experts": "num_local_experts",
                         "aux_loss_coef": "router_aux_loss_coef"}),
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
        COMMON_FIELDS | {"intermediate_size": "moe_intermediate_size", "num_experts": "num_experts",
                         "aux_loss_coef": "router_aux_loss_coef",
                         "norm_topk_prob": "norm_topk_prob",
                         "qkv_bias": "attention_bias", "o_proj_bias": "attention_bias"},
        fixed={"qk_norm": "per_head"}, reads_head_dim=True),
    "olmoe": Family(
        "OlmoeForCausalLM", "OlmoeConfig",
        COMMON_FIELDS | {"intermediate_size": "intermediate_size", "num_experts": "num_experts",
                         "aux_loss_coef": "router_aux_loss_coef",
                         "norm_topk_prob": "norm_topk_prob", "clip_qkv": "clip_qkv",
                         "qkv_bias": "attention_bias", "o_proj_bias": "attention_bias"},
        fixed={"qk_norm": "across_heads"}),
    "qwen2_moe": Family(
        "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
        COMMON_FIELDS | {"intermediate_size": "moe_intermediate_size", "num_experts": "num_experts",
                         "aux_loss_coef": "router_aux_loss_coef",
                         "norm_topk_prob": "norm_topk_prob", "qkv_bias": "qkv_bias",
                         "shared_expert_intermediate_size": "shared_expert_intermediate_size"},
        fixed={"shared_expert_gate": True}, reads_head_dim=True),
    # transformers' DeepSeek-V3 has no load-balancing loss and never moves its correction bias
    # (modeling_deepseek_v3.py:130, :690 in transformers 5.25.0); the technical report moves the
    # bias between steps and adds a small sequence-wise loss (arXiv:2412.19437, §2.1.2, §4.2).
    # Converted as transformers has it: no loss term (aux_loss_coef 0) and no bias update
    # (router_bias_update_rate 0, MoEConfig's default).
    "deepseek_v3": Family(
        "DeepseekV3ForCausalLM", "DeepseekV3Config",
        COMMON_FIELDS | {"intermediate_size": "moe_intermediate_size",
                         "num_experts": "n_routed_experts", "norm_topk_prob": "norm_topk_prob",
                         "routed_scaling_factor": "routed_scaling_factor"},
        fixed={"router": "sigmoid", "aux_loss_coef": 0.0}),
}


def family_of(hf_config) -> Family:
    """The family of a transformers config, or a ValueError naming its model_type and the
    supported classes."""
    if isinstance(hf_config, dict):  # a config's to_dict(), or a config.json read as JSON
        raise ValueError(f"the HF config is a dict (model_type={hf_config.get('model_type')!r}); "
                         f"give the transformers config object: "
                         f"transformers.AutoConfig.for_model(**config) (e.g. a MixtralConfig)")
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not a family this package converts; "
                         f"supported: {supported_classes()}: convert one of those, or build a "
                         f"model here with MoEConfig")
    return FAMILIES[model_type]


def supported_classes() -> str:
    return ", ".join(family.causal_lm for family in FAMILIES.values())


def read_hf_config(hf_config, *, moe_block_only: bool = False) -> dict[str, tuple[str, object]]:
    """MoEConfig's fields from a transformers config of a supported family, each as (the HF name
    it was read from, value). Refuses (ValueError) a config with a value this package does not
    compute, naming every such field.

    `moe_block_only=True` reads only what a MoE block needs (router, experts, shared experts):
    the attention and layer-stack fields are then not checked, and the attention is one head
    (a placeholder), so a DeepSeek-V3 config (MLA attention, dense first layers) yields the
    config of its MoE block."""
    family = family_of(hf_config)
    unsupported = unsupported_hf_options(hf_config, moe_block_only=moe_block_only)
    if unsupported:
        raise ValueError(f"cannot represent this {family.causal_lm} exactly: "
                         f"{'; '.join(unsupported)}. Convert a model with the supported values, "
                         f"or build one here with MoEConfig")
    read = {name: (hf_name, getattr(hf_config, hf_name)) for name, hf_name in family.fields.items()}
    read |= {name: (f"{hf_config.model_type}'s architecture", value)
             for name, value in family.fixed.items()}
    read["family"] = ("model_type", hf_config.model_type)
    read["rope_theta"] = ("rope_parameters['rope_theta']", _rope(hf_config).get(
        "rope_theta", getattr(hf_config, "default_theta", None)))
    if family.reads_head_dim:
        read["attention_head_dim"] = ("head_dim", _explicit_head_dim(hf_config))
    if hf_config.model_type == "deepseek_v3":
        read["shared_expert_intermediate_size"] = (
            "moe_intermediate_size * n_shared_experts",
            hf_config.moe_intermediate_size * hf_config.n_shared_experts)
        for name in ("n_group", "topk_group"):  # None in an HF config means no grouping
            read[name] = (name, getattr(hf_config, name) or 1)
    if moe_block_only:
        read.pop("attention_head_dim", None)
        read |= {"num_heads": ("(no attention)", 1), "num_kv_heads": ("(no attention)", 1)}
    return read


def hf_config_kwargs(config) -> dict:
    """Keyword arguments for the family's transformers config class describing the same model
    as `config` (a MoEConfig). Refuses a config its family's HF code cannot express."""
    family = FAMILIES[config.family]
    problems = _not_expressible(config, family)
    if problems:
        raise ValueError(f"MoEConfig(family={config.family!r}) cannot be written as a "
                         f"{family.config_class}: {'; '.join(problems)}")
    kwargs = {hf_name: getattr(config, name) for name, hf_name in family.fields.items()}
    kwargs |= dict(rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
                   tie_word_embeddings=False, attention_dropout=0.0,
                   # Generation metadata the model itself never reads. The families' defaults
                   # are their own tokenizers' ids (OLMoE: 50279), outside a protein vocabulary,
                   # and transformers warns about them: none is the honest value here.
                   bos_token_id=None, eos_token_id=None)
    if family.reads_head_dim:
        kwargs["head_dim"] = config.head_dim
    if config.family == "mixtral":
        kwargs |= dict(sliding_window=None, router_jitter_noise=0.0)
    if config.family in ("qwen3_moe", "qwen2_moe"):  # every layer a MoE layer, no window
        kwargs |= dict(use_sliding_window=False, mlp_only_layers=[], decoder_sparse_step=1)
    return kwargs


def _not_expressible(config, family: Family) -> list[str]:
    if config.family == "deepseek_v3":
        return ["its multi-head latent attention (MLA) is not implemented here, so no DeepSeek-V3 "
                "model equals ours (its MoE block does: MoEConfig.from_hf_config(..., "
                "moe_block_only=True))"]
    expected = ARCHITECTURE_DEFAULTS | family.fixed
    problems = [f"{name}={getattr(config, name)!r} (this family has {value!r})"
                for name, value in expected.items()
                if name not in family.fields and getattr(config, name) != value
                and not (name == "attention_head_dim" and family.reads_head_dim)]
    by_hf_name: dict[str, list[str]] = {}
    for name, hf_name in family.fields.items():
        by_hf_name.setdefault(hf_name, []).append(name)
    problems += [f"{' and '.join(f'{n}={getattr(config, n)!r}' for n in names)} differ, but the "
                 f"family's one field {hf_name} sets them all"
                 for hf_name, names in by_hf_name.items()
                 if len({getattr(config, n) for n in names}) > 1]
    return problems


def _rope(hf_config) -> dict:
    return getattr(hf_config, "rope_parameters", None) or {}


def _explicit_head_dim(hf_config) -> int | None:
    """HF's head_dim where it is not hidden_size / heads (None where it is, or is not given)."""
    head_dim = getattr(hf_config, "head_dim", None)
    default = hf_config.hidden_size // hf_config.num_attention_heads
    return None if head_dim in (None, default) else head_dim


def unsupported_hf_options(hf, *, moe_block_only: bool = False) -> list[str]:
    """The values of a supported family's transformers config (transformers 5) that this model
    does not compute, each as 'field=value (what it is; supported: ...)'.

    The fields in `FAMILIES[...].fields` (and rope_parameters' rope_theta, head_dim where the
    family reads it) are mapped onto MoEConfig; the ones below change the arithmetic and have one
    supported value; the rest change nothing this model computes (use_cache, bos/eos_token_id,
    output_attentions, output_hidden_states, output_router_logits)."""
    checks = [("hidden_act", hf.hidden_act, hf.hidden_act in ("silu", "swish"),
               "the experts' activation", "'silu'")]
    if not moe_block_only:
        checks += _attention_and_layer_checks(hf)
    return [f"{name}={value!r} ({what}; supported: {supported})"
            for name, value, ok, what, supported in checks if not ok]


def _attention_and_layer_checks(hf) -> list[tuple]:
    heads_width = hf.hidden_size // hf.num_attention_heads
    rope_type = _rope(hf).get("rope_type", "default")  # legacy rope_scaling too
    checks = [
        ("rope_type", rope_type, rope_type == "default",
         "the RoPE variant in rope_parameters / rope_scaling", "'default' with any rope_theta"),
        ("attention_dropout", hf.attention_dropout, hf.attention_dropout == 0,
         "dropout on the attention weights in training", "0.0"),
        ("tie_word_embeddings", hf.tie_word_embeddings, not hf.tie_word_embeddings,
         "lm_head sharing the embedding matrix", "False"),
    ]
    model_type = hf.model_type
    if model_type in ("mixtral", "olmoe"):  # OLMoE's q_norm is hidden_size wide
        head_dim = getattr(hf, "head_dim", None)
        checks.append(("head_dim", head_dim, head_dim in (None, heads_width),
                       "the attention head width",
                       f"None or hidden_size / num_attention_heads = {heads_width}"))
    # A window at least max_position_embeddings wide covers every sequence this model takes.
    window = getattr(hf, "sliding_window", None)
    if model_type in ("mixtral", "qwen3_moe"):
        checks.append(("sliding_window", window,
                       window is None or window >= hf.max_position_embeddings,
                       "sliding-window attention",
                       f"None (the whole causal context) or >= max_position_embeddings="
                       f"{hf.max_position_embeddings}"))
    if model_type == "qwen2_moe":
        sliding = [i for i, kind in enumerate(hf.layer_types) if kind != "full_attention"]
        checks.append(("layer_types", hf.layer_types, not sliding,
                       f"sliding-window attention in layers {sliding}",
                       "every layer 'full_attention' (use_sliding_window=False)"))
    if model_type == "mixtral":
        checks.append(("router_jitter_noise", hf.router_jitter_noise, hf.router_jitter_noise == 0,
                       "multiplicative noise on the router's input in training", "0.0"))
    if model_type in ("qwen3_moe", "qwen2_moe"):
        checks += _dense_layer_checks(hf)
    if model_type == "deepseek_v3":
        checks += [
            ("kv_lora_rank", hf.kv_lora_rank, False,
             "DeepSeek-V3's multi-head latent attention (MLA), with q_lora_rank, qk_rope_head_dim, "
             "qk_nope_head_dim, v_head_dim", "none: MLA is not implemented here; the MoE block "
             "converts alone (MoEConfig.from_hf_config(..., moe_block_only=True))"),
            ("first_k_dense_replace", hf.first_k_dense_replace, hf.first_k_dense_replace == 0,
             "dense MLP layers before the MoE layers", "0 (every layer a MoE layer)"),
        ]
    return checks


def _dense_layer_checks(hf) -> list[tuple]:
    """Qwen's dense MLP layers: the model here has a MoE block in every layer (the expert
    backends, expert parallelism and checkpoints all assume it)."""
    layers = range(hf.num_hidden_layers)
    listed = [i for i in hf.mlp_only_layers if i in layers]
    step = hf.decoder_sparse_step
    return [
        ("mlp_only_layers", hf.mlp_only_layers, not listed,
         f"layers {listed} with a dense MLP instead of experts", "[] (every layer a MoE layer)"),
        ("decoder_sparse_step", step, step == 1,
         f"a MoE block only every {step}th layer, dense MLPs between", "1 (every layer)"),
    ]


def hf_key_to_ours(key: str) -> str:
    """An HF parameter name as the model here names it: DeepSeek-V3's `shared_experts` is
    `shared_expert` (as in Qwen2-MoE); early transformers 5 releases named Mixtral's MoE block
    `block_sparse_moe`."""
    key = key.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"(^|\.)shared_experts\.", r"\1shared_expert.", key)


def our_key_to_hf(key: str, family: str) -> str:
    """Inverse of `hf_key_to_ours` for `family`'s current transformers names."""
    if family == "deepseek_v3":
        return re.sub(r"(^|\.)shared_expert\.", r"\1shared_experts.", key)
    return key
