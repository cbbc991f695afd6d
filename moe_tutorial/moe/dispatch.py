"""The token dispatcher: it takes every token's k copies to their experts and brings the weighted
outputs back, so that the experts only ever see rows already sorted by expert.

    hidden [T, H], indices [T, k], weights [T, k]
      → permute once (the sort the experts' backend asks for, `Experts.permutation`)
      → experts(rows [R, H], rows_per_expert [E], row_weights [R] or None) → [R, H]
      → merge once: each token's k output rows, weighted by its routing weights (unless the
        backend applied them itself, `Experts.applies_routing_weights`), summed

The permutations (`experts.PERMUTATIONS`):
* "sort" and "sort_by_slot": `routing.permute`, padding each expert's block to the backend's
  `rows_alignment` under the active TE recipe;
* "te": TE's fused `moe_permute_and_pad_with_probs` / `moe_unpermute` where the backend runs
  TE (`uses_te`: a GPU with TE), which pads each expert's rows in the same kernel; elsewhere
  `routing.permute`, with the same result.

`run_experts` is one layer's experts behind this dispatch: the MoE block's `model.LocalDispatcher`
(a process that holds all the experts) runs it; expert parallelism swaps that dispatcher for
`parallel.distributed.AllToAllDispatcher`, which permutes once, exchanges the rows and regroups
what arrives by the exchanged counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..precision import hardware, recipes
from .experts import Experts, TEExperts, check_expert_inputs
from .routing import permute, unpermute


@dataclass
class Dispatched:
    """Token copies sorted by expert, ready for the experts, and how to put them back."""

    rows: torch.Tensor  # [R, H], each expert's rows padded to the alignment with zero rows
    row_weights: torch.Tensor | None  # [R] routing weight of each row (0 on padding)
    rows_per_expert: torch.Tensor  # [E] int64 rows per expert (padded)
    combine: Callable[[torch.Tensor, bool], torch.Tensor]  # (expert rows, apply weights?) -> [T, H]
    path: str  # which permutation ran


def te_dispatch(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                num_experts: int, align: int, te) -> Dispatched:
    """Permute token copies to their experts with TE's fused kernels (`te`: the
    transformer_engine.pytorch module): `moe_permute_and_pad_with_probs` sorts and pads in one
    pass, `moe_unpermute` merges (with the routing weights, or without)."""
    num_tokens, indices = hidden.shape[0], indices.long()  # scatter takes int64 indices only
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.int32, device=hidden.device)
    routing_map.scatter_(1, indices, 1)
    probs = torch.zeros(num_tokens, num_experts, dtype=torch.float32,
                        device=hidden.device).scatter(1, indices, weights.float())
    rows, row_weights, row_id_map, pad_offsets, m_splits = te.moe_permute_and_pad_with_probs(
        hidden, probs, routing_map, routing_map.sum(0), align)

    def combine(y, merge):
        return te.moe_unpermute(y, row_id_map, merging_probs=probs if merge else None,
                                restore_shape=hidden.shape, pad_offsets=pad_offsets)

    return Dispatched(rows, row_weights, m_splits, combine, "te.moe_permute_and_pad_with_probs")


def sort_dispatch(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                  num_experts: int, align: int, slot_major: bool = False,
                  row_weights: bool = True) -> Dispatched:
    """Permute token copies to their experts with `routing.permute` (the reference); each row's
    routing weight too where `row_weights` (a backend that applies them itself needs them)."""
    rows, weights_of_rows, perm = permute(hidden, indices, weights if row_weights else None,
                                          num_experts, align, slot_major=slot_major)
    return Dispatched(rows, weights_of_rows, perm.m_splits,
                      lambda y, merge: unpermute(y, perm, weights if merge else None),
                      "routing.permute" + (" (by slot)" if slot_major else ""))


def dispatch(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
             experts: Experts) -> Dispatched:
    """Sort the token copies as `experts` asks (`experts.permutation`), each expert's rows padded
    to its `rows_alignment` under the active recipe."""
    align = experts.rows_alignment(recipes.active_recipe())
    if experts.permutation == "te" and experts.uses_te:
        d = te_dispatch(hidden, indices, weights, experts.num_experts, align,
                        hardware.transformer_engine())
    else:
        d = sort_dispatch(hidden, indices, weights, experts.num_experts, align,
                          slot_major=experts.permutation == "sort_by_slot",
                          row_weights=experts.applies_routing_weights)
    if isinstance(experts, TEExperts):
        d.path += f" (align {align})"
    return d


def run_experts(experts: Experts, hidden: torch.Tensor, indices: torch.Tensor,
                weights: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The routed experts' output for every token: permute once, the experts, merge once.
    hidden [T, H], indices [T, k] chosen experts, weights [T, k] their routing weights.
    Returns (output [T, H], what ran: the permutation, then the experts' `last_path`)."""
    check_expert_inputs(experts, hidden, indices, weights)
    d = dispatch(hidden, indices, weights, experts)
    applies = experts.applies_routing_weights
    # the row weights in the routing weights' dtype, as the backend multiplies them
    row_weights = d.row_weights.to(weights.dtype) if applies else None
    out = d.combine(experts(d.rows, d.rows_per_expert, row_weights), not applies)
    return out, f"{d.path} → {experts.last_path}"
