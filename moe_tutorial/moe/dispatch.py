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
  `routing.permute`, with the same result;
* "te_host_counts": the same TE kernels, with the per-expert counts read to the host once
  first and handed on as the experts' `rows_per_expert` (a CPU tensor), for a backend that
  needs them on the host anyway (`te.GroupedLinear` takes its split sizes as a list): one host
  sync per layer instead of TE's wrapper's two plus the backend's own;
* "static": `routing.permute_static`, a buffer sized by the shapes alone (no host read).

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
from .routing import permute, permute_static, unpermute


@dataclass
class Dispatched:
    """Token copies sorted by expert, ready for the experts, and how to put them back."""

    rows: torch.Tensor  # [R, H], each expert's rows padded to the alignment with zero rows
    row_weights: torch.Tensor | None  # [R] routing weight of each row (0 on padding)
    rows_per_expert: torch.Tensor  # [E] int64 rows per expert (padded)
    combine: Callable[[torch.Tensor, bool], torch.Tensor]  # (expert rows, apply weights?) -> [T, H]
    path: str  # which permutation ran


def te_dispatch(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                num_experts: int, align: int, te, host_counts: bool = False) -> Dispatched:
    """Permute token copies to their experts with TE's fused kernels (`te`: the
    transformer_engine.pytorch module): `moe_permute_and_pad_with_probs` sorts and pads in one
    pass, `moe_unpermute` merges (with the routing weights, or without).

    `host_counts`: read the per-expert counts to the host once and run TE's permutation kernel
    (`torch.ops.te_moe.permute_mask_map_fwd`, with its autograd) on them directly; the rows per
    expert come back as a CPU tensor the experts reuse. TE's wrapper instead reads the device
    counts twice, a `torch.equal` (padding needed?) and an `.item()` (the output's rows)
    (`moe_permute_and_pad_with_probs`, transformer_engine/pytorch/permutation.py:1014-1024,
    TE 2.20.2); the padding offsets are computed here as it computes them, on the device."""
    num_tokens, indices = hidden.shape[0], indices.long()  # scatter takes int64 indices only
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.int32, device=hidden.device)
    routing_map.scatter_(1, indices, 1)
    probs = torch.zeros(num_tokens, num_experts, dtype=torch.float32,
                        device=hidden.device).scatter(1, indices, weights.float())
    if host_counts:
        rows, row_weights, row_id_map, pad_offsets, m_splits = _te_permute_with_host_counts(
            hidden, probs, routing_map, align)
        path = "te_moe.permute_mask_map_fwd (counts read once)"
    else:
        rows, row_weights, row_id_map, pad_offsets, m_splits = te.moe_permute_and_pad_with_probs(
            hidden, probs, routing_map, routing_map.sum(0), align)
        path = "te.moe_permute_and_pad_with_probs"

    def combine(y, merge):
        return te.moe_unpermute(y, row_id_map, merging_probs=probs if merge else None,
                                restore_shape=hidden.shape, pad_offsets=pad_offsets)

    return Dispatched(rows, row_weights, m_splits, combine, path)


def _te_permute_with_host_counts(hidden, probs, routing_map, align: int, permute_op=None):
    """TE's permute-and-pad from counts read to the host once: (rows, row weights, row_id_map,
    pad_offsets or None, padded rows per expert on the CPU). `permute_op`: TE's
    `permute_mask_map_fwd` (the default) or a stand-in with its signature (tests)."""
    counts_on_device = routing_map.sum(0)
    counts = counts_on_device.cpu()  # the layer's one host sync
    padded = (counts + align - 1) // align * align
    pad_offsets = None
    if not torch.equal(padded, counts):  # host tensors: no sync
        pad = (counts_on_device + align - 1) // align * align - counts_on_device
        pad_offsets = torch.cat([pad.new_zeros(1), pad.cumsum(0)[:-1]])
    permute_op = permute_op or torch.ops.te_moe.permute_mask_map_fwd
    rows, row_id_map, row_weights = permute_op(hidden, routing_map, int(padded.sum()), probs,
                                               pad_offsets)
    return rows, row_weights, row_id_map, pad_offsets, padded


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


def static_dispatch(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                    num_experts: int, align: int) -> Dispatched:
    """Permute token copies to their experts with `routing.permute_static` (no host read; no
    row weights: the sync-free backends leave the weights to the merge)."""
    rows, perm = permute_static(hidden, indices, num_experts, align)
    return Dispatched(rows, None, perm.m_splits,
                      lambda y, merge: unpermute(y, perm, weights if merge else None),
                      f"permute_static ({perm.num_rows} rows, align {align})")


def dispatch(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
             experts: Experts) -> Dispatched:
    """Sort the token copies as `experts` asks (`experts.permutation`), each expert's rows padded
    to its `rows_alignment` under the active recipe."""
    align = experts.rows_alignment(recipes.active_recipe())
    if experts.permutation == "static":
        return static_dispatch(hidden, indices, weights, experts.num_experts, align)
    if experts.permutation in ("te", "te_host_counts") and experts.uses_te:
        d = te_dispatch(hidden, indices, weights, experts.num_experts, align,
                        hardware.transformer_engine(),
                        host_counts=experts.permutation == "te_host_counts")
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
