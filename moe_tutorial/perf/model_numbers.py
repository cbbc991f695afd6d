"""A MoE model under analysis (`Model`) and the numbers `analyze` reports first: 1 its parameters,
2 one MoE layer's expert GEMMs per tokens per GPU, 3 the padding each alignment adds at balanced
and skewed routing, 4 the fused grouped MLP's conditions on a Hopper and a Blackwell GPU. Each
number comes from the module that owns its rule (`perf/analyze.py`'s docstring lists them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..moe import experts
from ..moe.config import MoEConfig
from ..precision import hardware, recipes
from . import decide, memory, skew
from .bench import ExpertShape, make_routing

COMPUTE_DTYPE = "bfloat16"  # what the course trains in on a GPU
TOKENS_PER_GPU = (1024, 4096, 16384)
FUSED_RECIPE = "MXFP8BlockScaling"  # the fused grouped MLP's recipe on a Blackwell GPU


# ---------------------------------------------------------------------------------------------
# The model

@dataclass(frozen=True)
class Model:
    """The config under analysis, where it came from, and what the analysis leaves out.

    `moe_block_only`: the config describes one MoE block over `config.num_layers` MoE layers
    (its attention is a placeholder), so only the experts' parts are analysed."""

    name: str
    source: str
    config: MoEConfig
    moe_block_only: bool = False
    out_of_scope: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # how the input was read where it was not taken as it is



# ---------------------------------------------------------------------------------------------
# 1-4: parameters, the expert GEMMs, padding, the fused grouped MLP's conditions

def parameters(model: Model) -> dict:
    """The parameter counts of `MoEConfig.parameter_counts`, and the routed experts' share. The
    active experts are top_k of num_experts in every MoE layer. A MoE block alone has no
    whole-model counts (its attention is a placeholder)."""
    config = model.config
    counts = config.parameter_counts()
    active_experts = counts["expert"] * config.top_k // config.num_experts
    out = {"experts": counts["expert"], "experts_active_per_token": active_experts}
    if not model.moe_block_only:
        out.update(total=counts["total"], dense=counts["dense"],
                   active_per_token=counts["active_per_token"],
                   experts_share_of_total=counts["expert"] / counts["total"],
                   experts_share_of_active=active_experts / counts["active_per_token"])
    return out


def expert_shape(config: MoEConfig, tokens: int) -> ExpertShape:
    """One MoE layer's expert problem at `tokens` tokens per GPU (all experts local)."""
    return ExpertShape(f"t{tokens}", tokens, config.hidden_size, config.intermediate_size,
                       config.num_experts, config.top_k)


def expert_gemms(config: MoEConfig, tokens_per_gpu=TOKENS_PER_GPU) -> list[dict]:
    """Per token count: the rows each expert gets at balanced routing and the two grouped GEMMs
    each expert runs, gate-up [rows, H] x [H, 2I] and down [rows, I] x [I, H], with one layer's
    expert FLOPs (forward + backward)."""
    h, i = config.hidden_size, config.intermediate_size
    out = []
    for tokens in tokens_per_gpu:
        shape = expert_shape(config, tokens)
        rows = decide.tokens_per_expert(shape)
        out.append({"tokens_per_gpu": tokens, "rows_per_expert": rows,
                    "gate_up": [[rows, h], [h, 2 * i]], "down": [[rows, i], [i, h]],
                    "flops_per_layer": shape.flops()})
    return out


def alignments() -> dict[int, str]:
    """The rows-per-expert multiples the course's paths pad to, and who asks for each
    (TE's rule, `recipes.alignment`, and the fused grouped MLP's kernel)."""
    return {recipes.alignment("DelayedScaling"): "FP8 recipes (TE's rule)",
            recipes.alignment(FUSED_RECIPE): "MXFP8 (TE's rule)",
            recipes.alignment("NVFP4BlockScaling"): "NVFP4 (TE's rule)",
            experts.FUSED_MLP_ROWS_PER_EXPERT: "fused grouped MLP (cuDNN kernel)"}


def skewed_routing_splits(config: MoEConfig, tokens: int) -> list[int]:
    """Token copies per expert (the `m_splits` before padding) of the course's skewed benchmark
    routing (`bench.make_routing(shape, "skewed")`: router logits with a Zipf-like bias) on this
    model's experts and top-k, counted. Counted, not summarised by one hot expert: with top-8 of
    128 experts nearly every token picks the hottest one, while the tail decides the padding."""
    _, indices = make_routing(expert_shape(config, tokens), "skewed")
    return torch.bincount(indices.flatten(), minlength=config.num_experts).tolist()


def balanced_splits(config: MoEConfig, tokens: int) -> list[int]:
    """Token copies per expert at balanced routing (`skew.skewed_splits` at skew 0)."""
    return skew.skewed_splits(tokens, config.num_experts, config.top_k, 0.0)


def load_imbalance(splits: list[int]) -> float:
    """The hottest expert's token copies over the mean (1.0: balanced)."""
    return max(splits) * len(splits) / sum(splits)


def padding_fractions(splits: list[int]) -> dict[int, float]:
    """Per alignment of `alignments()`: the share of the grouped GEMMs' rows that are padding
    (`skew.padding_waste`) with these token copies per expert."""
    return {align: waste["fraction"]
            for align, waste in skew.padding_waste(splits, tuple(alignments())).items()}


def padding_at(config: MoEConfig, tokens: int) -> tuple[dict[int, float], dict[int, float], float]:
    """At `tokens` tokens per GPU: the padding shares per alignment at balanced and at the
    course's skewed routing, and that skewed routing's load imbalance (hottest over mean)."""
    skewed_splits = skewed_routing_splits(config, tokens)
    return (padding_fractions(balanced_splits(config, tokens)), padding_fractions(skewed_splits),
            load_imbalance(skewed_splits))


def padding(config: MoEConfig, tokens_per_gpu=TOKENS_PER_GPU) -> list[dict]:
    """Per token count: the skewed routing's load imbalance (hottest expert over the mean), and
    per alignment the padding share at balanced and at skewed routing."""
    rows = []
    for tokens in tokens_per_gpu:
        balanced, skewed, imbalance = padding_at(config, tokens)
        rows.append({"tokens_per_gpu": tokens, "skewed_max_over_mean": imbalance,
                     "alignments": [{"align": a, "for": who, "balanced": balanced[a],
                                     "skewed": skewed[a]} for a, who in alignments().items()]})
    return rows


def arch_capabilities(arch: str) -> hardware.Capabilities:
    """The course's capability table of a GPU of `arch` ("hopper": H200, "blackwell": B200 with
    TE and the fused MLP enabled), as `hardware.fake_environment` describes it."""
    return hardware.evaluate(hardware.fake_environment(arch))


def fused_conditions(config: MoEConfig, tokens_per_gpu=TOKENS_PER_GPU) -> dict:
    """Which of the fused grouped MLP's conditions this model meets: the shape conditions
    (`experts.why_unfused` on a Blackwell GPU under MXFP8, where only they can fail), per arch
    everything that keeps TE's fuser from fusing with the recipe `recipes.resolve("fp8")` picks there,
    and per token count whether MXFP8's own padding of balanced rows already satisfies the fused
    kernel's row rules (`experts.why_fused_raises`; if not, te_ops pads to
    `experts.FUSED_MLP_ROWS_PER_EXPERT`, section 3's last column)."""
    h, i = config.hidden_size, config.intermediate_size
    interleave = experts.FUSED_MLP_GLU_INTERLEAVE
    shape_reasons = experts.why_unfused(arch_capabilities("blackwell"), FUSED_RECIPE, interleave,
                                        h, i)
    archs = {}
    for arch in memory.ARCHS:
        caps = arch_capabilities(arch)
        recipe = recipes.resolve("fp8", caps).name
        reasons = experts.why_unfused(caps, recipe, interleave, h, i)
        archs[arch] = {"gpu": caps.env.gpu_name, "recipe": recipe, "fuses": not reasons,
                       "why_not": [r for r in reasons if r not in shape_reasons]}
    align = recipes.alignment(FUSED_RECIPE)
    rows = [{"tokens_per_gpu": tokens, "align": align,
             "why_fused_raises": experts.why_fused_raises(skew.padded_splits(
                 skew.skewed_splits(tokens, config.num_experts, config.top_k, 0.0), align))}
            for tokens in tokens_per_gpu]
    return {"glu_interleave_size": interleave, "shape_reasons": shape_reasons, "archs": archs,
            "rows": rows}


