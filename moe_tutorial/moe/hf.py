"""Between the course's model and HF transformers': module and parameter names follow
transformers 5's (`MixtralForCausalLM`, `Qwen3MoeForCausalLM`, ...), so a state dict moves
between the two unchanged but for the experts' and TE's layouts, which this module converts.

`from_hf(hf_model)` builds an equivalent `MoEForCausalLM` (weights copied); `to_hf_state_dict(
model)` gives the state dict the family's transformers model loads; `hf_gradients(model)` the
gradients under those names, for comparing with the HF model's own. The families and their
key mapping are `families.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..precision.te_projections import QKV_PROJECTIONS
from . import families
from .config import DTYPES, MoEConfig
from .model import MoEForCausalLM


def from_hf(hf_model, expert_backend: str = "grouped_torch", **backend_options) -> MoEForCausalLM:
    """An equivalent model from a transformers causal LM of a supported family
    (`families.FAMILIES`: MixtralForCausalLM, Qwen3MoeForCausalLM, ...; weights copied), its
    experts on `expert_backend` with `backend_options` (`set_expert_backend`'s: e.g. the
    fused grouped MLP's `align=256, glu_interleave_size=32`).

    A model it cannot represent exactly is refused, every differing field named
    (`families.unsupported_hf_options`). The loss is HF's with `output_router_logits=True`
    (HF adds the load-balancing loss only when asked; this model always does)."""
    _check_is_causal_lm(hf_model)
    first = next(hf_model.parameters())
    if first.is_meta:  # shapes without values: the copy would be of nothing
        raise ValueError("the HF model's weights are on the meta device (shapes, no values): "
                         "load them first, e.g. <Class>.from_pretrained(...), or build the "
                         "model outside torch.device('meta')")
    dtype = str(first.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"the HF model's weights are {first.dtype}; this model runs in "
                         f"{sorted(DTYPES)}: convert them first, e.g. "
                         f"hf_model.to(torch.float32)")
    mixed = next(((name, p.dtype) for name, p in hf_model.named_parameters()
                  if p.dtype != first.dtype), None)
    if mixed:  # loading into one dtype would round the others silently
        raise ValueError(f"the HF model's weights mix dtypes: {mixed[0]} is {mixed[1]}, "
                         f"the first weight {first.dtype}; give them one dtype first, e.g. "
                         f"hf_model.to({first.dtype})")
    config = MoEConfig.from_hf_config(hf_model.config, dtype=dtype)
    model = MoEForCausalLM(config, "grouped_torch", device=first.device)  # HF layout, then convert
    state = {families.hf_key_to_ours(k): v for k, v in hf_model.state_dict().items()}
    ours = set(model.state_dict())
    missing, unexpected = ours - set(state), set(state) - ours
    if missing or unexpected:  # e.g. a model with adapters added
        name = families.FAMILIES[config.family].causal_lm
        raise ValueError(f"the HF model's weights are not a {name}'s: missing "
                         f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}; convert "
                         f"a plain {name} (merge any adapters first)")
    model.load_state_dict(state)
    return model.set_expert_backend(expert_backend, **backend_options)


def to_hf_state_dict(model: MoEForCausalLM,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A state dict that the family's transformers model (`MixtralForCausalLM`, ...)
    `load_state_dict` accepts (TE experts are converted back to the stacked HF layout, the
    attention's fused TE projection split into q, k and v; TE's `_extra_state` is dropped).

    `dtype`: that of the HF model it is for, when it differs from this model's (torch's
    `load_state_dict` would cast every weight silently): the weights are converted when the
    conversion is exact (e.g. bfloat16 to float32), else refused, naming the first weight it
    would round.

    With the experts sharded over an ep group (`distributed.shard_experts`) every layer's
    experts are all-gathered from the group: a collective, so every rank of the group must
    call it (each gets the full state dict; let one rank save it)."""
    state = {k: v for k, v in model.state_dict().items()
             if ".mlp.experts." not in k and ".self_attn.qkv_proj." not in k
             and not k.endswith("_extra_state")}
    for i, layer in enumerate(model.model.layers):
        for name, weight in _projection_weights(layer.self_attn).items():
            state[f"model.layers.{i}.self_attn.{name}"] = weight.detach()
        gate_up, down = layer.mlp.dispatcher.full_hf_weights(layer.mlp.experts)
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gate_up
        state[f"model.layers.{i}.mlp.experts.down_proj"] = down
    if dtype is not None:
        state = _converted_exactly(state, dtype)
    return {families.our_key_to_hf(k, model.config.family): v for k, v in state.items()}


def _converted_exactly(state: dict[str, torch.Tensor], dtype) -> dict[str, torch.Tensor]:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating-point torch dtype; pass the HF "
                         f"model's, e.g. to_hf_state_dict(model, hf_model.dtype)")
    converted = {}
    for name, value in state.items():
        if value.is_floating_point() and value.dtype != dtype:
            exact = value.to(dtype)
            if not torch.equal(exact.to(value.dtype), value):
                raise ValueError(
                    f"to_hf_state_dict(model, dtype={dtype}) would round {name} ({value.dtype}): "
                    f"an HF model in {dtype} cannot hold these weights exactly; load them into "
                    f"one in {value.dtype} (hf_model.to({value.dtype})), or round them yourself "
                    f"where that is meant: {{k: v.to({dtype}) for k, v in "
                    f"to_hf_state_dict(model).items()}}")
            value = exact
        converted[name] = value
    return converted


def hf_gradients(model: MoEForCausalLM) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under its name in `to_hf_state_dict(model)` (after a backward
    pass), experts in HF's stacked layout whatever the backend: what a comparison with the
    HF model's own gradients reads. The experts must not be sharded."""
    grads = {name: p.grad for name, p in model.named_parameters()
             if ".mlp.experts." not in name}
    for i, layer in enumerate(model.model.layers):
        gate_up, down = layer.mlp.experts.hf_gradients()
        grads[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gate_up
        grads[f"model.layers.{i}.mlp.experts.down_proj"] = down
    return {families.our_key_to_hf(k, model.config.family): v for k, v in grads.items()}


def _projection_weights(attention: nn.Module) -> dict[str, torch.Tensor]:
    """The q, k, v weights under HF's names ('q_proj.weight', ...) when they live in the fused
    TE projection `qkv_proj` (`precision.te_modules.fuse_attention_projections`); empty when they
    do not (the state dict then has them under those names)."""
    if attention.qkv_proj is None:
        return {}
    return {f"{name}.weight": getattr(attention.qkv_proj, f"{name}_weight") for name in QKV_PROJECTIONS}


def _check_is_causal_lm(hf_model) -> None:
    supported = families.supported_classes()
    if not isinstance(hf_model, nn.Module):
        raise ValueError(f"from_hf takes a transformers causal LM, a model with weights "
                         f"({supported}); got a {type(hf_model).__name__}: build one with "
                         f"<Class>(config) or load one with from_pretrained")
    family = families.family_of(getattr(hf_model, "config", None))
    if not isinstance(getattr(hf_model, "lm_head", None), nn.Module):
        raise ValueError(f"from_hf takes a {family.causal_lm} (with its lm_head); got a "
                         f"{type(hf_model).__name__}: load {family.causal_lm}"
                         f".from_pretrained(...)")
