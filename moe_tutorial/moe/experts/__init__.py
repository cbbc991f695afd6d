"""The experts of a MoE layer: one contract, one backend per file, one registry.

Read in this order:

    naive.py                  the reference loop: each expert's rows through its SwiGLU MLP
    base.py                   the contract every backend keeps (`Experts`), the stacked weights
    grouped_torch.py          two grouped GEMMs over all experts (`torch._grouped_mm`)
    te_permute_grouped_mm.py  the same GEMMs, fed by TE's fused permutation
    te_base.py                what the TE backends share; TE's CUTLASS grouped GEMM option
    te_grouped_linear.py      two `te.GroupedLinear`
    te_ops.py                 `te.ops.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)`
    te_stand_ins.py           TE's modules in plain PyTorch, where TE does not run
    registry.py               name -> backend, what runs here, conversion, the course's default

An experts module takes token copies already sorted by expert, one block of rows per expert,
and the block lengths: `experts(rows [R, H], rows_per_expert [E], row_weights [R] | None)`. The
dispatcher (`moe.dispatch`) permutes once before them and merges once after them; expert
parallelism swaps only the dispatcher (`parallel.distributed.AllToAllDispatcher`).
"""

from .base import PERMUTATIONS, Experts, StackedExperts, check_expert_inputs, swiglu
from .grouped_torch import GroupedTorchExperts, grouped_mm, grouped_mm_unusable
from .naive import NaiveExperts
from .registry import (
    BACKENDS,
    EXPERT_BACKENDS,
    SMALL_EXPERT_ELEMENTS,
    STACKED_BACKENDS,
    TE_BACKENDS,
    availability,
    backend_label,
    convert_experts,
    create,
    default_backend,
)
from .te_base import CUTLASS_GROUPED_GEMM_ENV, TEExperts, cutlass_grouped_gemm
from .te_grouped_linear import TEGroupedLinearExperts
from .te_ops import (
    FUSED_MLP_FEATURE_MULTIPLE,
    FUSED_MLP_GLU_INTERLEAVE,
    FUSED_MLP_RECIPES,
    FUSED_MLP_ROWS_PER_EXPERT,
    FUSED_MLP_TOTAL_ROWS_MULTIPLE,
    TEOpsExperts,
    deinterleave_glu,
    interleave_glu,
    why_fused_raises,
    why_unfused,
)
from .te_permute_grouped_mm import TEPermuteGroupedMMExperts
from .te_stand_ins import (
    StandInGroupedLinear,
    StandInScaledSwiGLU,
    StandInSequential,
    scaled_swiglu,
    torch_ops,
)

__all__ = [
    "BACKENDS", "CUTLASS_GROUPED_GEMM_ENV", "EXPERT_BACKENDS", "FUSED_MLP_FEATURE_MULTIPLE",
    "FUSED_MLP_GLU_INTERLEAVE", "FUSED_MLP_RECIPES", "FUSED_MLP_ROWS_PER_EXPERT",
    "FUSED_MLP_TOTAL_ROWS_MULTIPLE", "PERMUTATIONS",
    "SMALL_EXPERT_ELEMENTS", "STACKED_BACKENDS", "TE_BACKENDS", "Experts", "GroupedTorchExperts", "NaiveExperts",
    "StandInGroupedLinear", "StandInScaledSwiGLU", "StandInSequential", "StackedExperts",
    "TEExperts", "TEGroupedLinearExperts", "TEOpsExperts",
    "TEPermuteGroupedMMExperts", "availability", "backend_label", "check_expert_inputs",
    "convert_experts", "create", "cutlass_grouped_gemm", "deinterleave_glu", "default_backend",
    "grouped_mm", "grouped_mm_unusable", "interleave_glu", "scaled_swiglu", "swiglu",
    "torch_ops", "why_fused_raises", "why_unfused",
]
