"""The Hugging Face baseline: transformers' `MixtralForCausalLM` with the same weights as ours.

transformers 5 runs Mixtral's experts by one of several implementations: `eager` (the module's
own loop) and those registered in `ExpertsInterface` — `grouped_mm`, `batched_mm`, `deepgemm`
and `sonicmoe` in 5.17 to 5.25 (transformers/integrations/moe.py:543-548 in 5.25.0). A fair
comparison names which one ran. The course compares with two of them, and with one compiled:

* `eager` — a Python loop over the experts that received tokens (what `experts.naive_experts`
  reproduces step for step): the naive baseline;
* `grouped_mm` — sort tokens by expert, `torch._grouped_mm` per projection (HF's default where
  available): the strong baseline;
* and `grouped_mm` under `torch.compile`, the strongest (the recipe's own comparison point):
  `compile_for_training`.

(`batched_mm` runs a batched matmul over a copy of its expert's weights for every token copy;
`deepgemm` and `sonicmoe` load kernels from the Hub through the `kernels` package:
integrations/deepgemm.py:15-23, integrations/sonicmoe.py:15-18.)

Attention is `sdpa` in every case, the optimizer torch's fused AdamW.
"""

from __future__ import annotations

import torch

from .hf import to_hf_state_dict
from .model import MoEForCausalLM

EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm")


def hf_mixtral(model, experts_implementation: str = "grouped_mm"):
    """A transformers `MixtralForCausalLM` with `model`'s config and weights, on its device."""
    if not isinstance(model, MoEForCausalLM):
        raise ValueError(f"hf_mixtral takes our model (a MoEForCausalLM), got a "
                         f"{type(model).__name__}: build it first, MoEForCausalLM(config)")
    if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"experts_implementation must be one of {EXPERTS_IMPLEMENTATIONS}, "
                         f"got {experts_implementation!r}")
    import transformers

    config = transformers.MixtralConfig(**model.config.to_hf_config_kwargs())
    device = next(model.parameters()).device
    with torch.device(device):  # allocate (and initialise) directly where the weights will live
        hf = transformers.MixtralForCausalLM._from_config(
            config, attn_implementation="sdpa", experts_implementation=experts_implementation,
            dtype=model.config.torch_dtype)
    hf.load_state_dict(to_hf_state_dict(model))
    actual = hf.config._experts_implementation
    if actual != experts_implementation:  # never benchmark something other than what was named
        raise RuntimeError(f"transformers chose experts_implementation={actual!r}, "
                           f"not {experts_implementation!r}")
    return hf


def hf_training_loss(hf_model, input_ids: torch.Tensor) -> torch.Tensor:
    """HF's training loss (next-token cross-entropy + router_aux_loss_coef × aux loss); HF shifts
    the labels itself."""
    return hf_model(input_ids=input_ids, labels=input_ids, output_router_logits=True).loss


# Under torch.compile, transformers before torch 2.14 never drops the causal mask (its
# `_ignore_causal_mask_sdpa` cannot tell compiling from exporting there: before pytorch#176499
# dynamo replaced `torch.compiler.is_exporting()` by `True`; transformers/masking_utils.py:276-281
# in 5.25.0), so sdpa receives a
# materialised [B, 1, S, S] mask, which FlashAttention cannot take: the compiled step then runs
# the much slower memory-efficient attention kernels, and compiling buys nothing (seen with
# mixtral-2l on the H200; torch.profiler shows it). Our inputs have no padding,
# so the mask is exactly `is_causal=True`; this attention implementation says so to the compiled
# model, which then runs FlashAttention like the eager one.
CAUSAL_SDPA = "sdpa_causal_no_mask"


def _register_causal_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)  # mask None → is_causal
    AttentionMaskInterface.register(CAUSAL_SDPA, lambda *args, **kwargs: None)


def compile_for_training(hf_model):
    """`hf_model` with its forward compiled by torch.compile, attending with `is_causal=True`
    and no mask tensor (see `CAUSAL_SDPA`): right for unpadded causal training batches only."""
    _register_causal_sdpa()
    hf_model.set_attn_implementation(CAUSAL_SDPA)
    hf_model.forward = torch.compile(hf_model.forward)
    return hf_model
