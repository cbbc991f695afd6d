"""Routing: which experts each token visits, and moving tokens to their experts and back.

A router scores every token against every expert (one linear layer) and turns the scores into
the top-k experts of each token and their weights, by one of two rules. The router of the MoE
block and its softmax rule (Mixtral, Qwen-MoE, OLMoE) are part of the architecture, in
`model.py` (`model.Router`, `model.route`); this module holds what the router builds on and what
the dispatcher runs:

* `route_sigmoid` (DeepSeek-V3): independent sigmoid scores; a per-expert correction bias is
  added for *choosing* the experts only (`group_limited_top_k`: within each token's best groups
  of experts), while the weights are the unbiased scores, renormalised and scaled. Training moves
  the bias towards balance (`update_correction_bias`). DeepSeek-V3's technical report
  (arXiv:2412.19437, §2.1.2 and §4.2) does that and keeps a small sequence-wise balance loss
  beside it (α = 0.0001), which this package does not implement; transformers' DeepSeek-V3 does
  neither (nothing updates its `e_score_correction_bias`, and its loss is the language-modelling
  loss alone: `modeling_deepseek_v3.py:130`, `:690` in transformers 5.25.0);
* `load_balancing_loss`, the Switch-Transformer auxiliary loss over all layers' router logits;
* the checks both rules and the experts share (`check_top_k`, `check_logits`,
  `check_expert_indices`, `check_compute_dtype`, `check_routed_shapes`).

Experts are fast when each one sees its tokens as one contiguous block of rows. `permute`
sorts the T x k token copies by expert, so expert e owns rows
`[offsets[e], offsets[e] + m_splits[e])` of one buffer (`m_splits` is what TE's GroupedLinear
calls the per-expert row counts). Low-precision GEMMs also need every block's row count to be a
multiple of an alignment (`recipes.alignment`, TE 2.20's rule: 16 for the FP8 recipes, block
scaling included, 32 for MXFP8, 128 for NVFP4; 256 for the fused grouped MLP): `align` pads each
block with zero rows. `unpermute` is the exact
inverse: it gathers each token's k expert outputs (never a padding row), weights them by the
routing probabilities and sums them. The dispatcher (`dispatch.py`) runs `permute` once per
layer, and the experts take its sorted rows.

Everything here is plain differentiable torch with no Python loop over tokens or experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def check_top_k(top_k: int, num_experts: int) -> None:
    """Refuse a top_k that is not a whole number of experts between 1 and num_experts."""
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} must be a whole number from 1 to the number of "
                         f"experts ({num_experts}): each token picks that many experts")


def check_expert_indices(indices: torch.Tensor, num_experts: int) -> None:
    """Refuse expert indices that are not integers, or, where they are on the host, that fall
    outside [0, num_experts). Reading a GPU tensor's values costs a host sync, so there the range
    is checked only where the values are read anyway (`sort_by_expert`)."""
    _check_integer_indices(indices)
    if indices.device.type == "cpu" and indices.numel():
        lowest, highest = int(indices.min()), int(indices.max())
        if lowest < 0 or highest >= num_experts:
            raise _expert_out_of_range(lowest if lowest < 0 else highest, num_experts)


_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _check_integer_indices(indices: torch.Tensor) -> None:
    if indices.dtype not in _INTEGER_DTYPES:
        raise ValueError(f"expert indices must be an integer tensor (what torch.topk returns), "
                         f"got {indices.dtype}: pass the router's indices, or indices.long()")


def _expert_out_of_range(expert: int, num_experts: int) -> ValueError:
    return ValueError(f"indices name expert {expert}, but there are only {num_experts} experts: "
                      f"expert indices run from 0 to {num_experts - 1}")


def check_logits(logits: torch.Tensor, top_k: int, rule: str) -> None:
    """Refuse router logits without an expert dimension, or a top_k they cannot give (`rule`
    names the routing rule in the message)."""
    if logits.dim() == 0:
        raise ValueError(f"{rule} needs router logits of shape [T, E] (or [E] for one token), "
                         f"got a 0-d tensor: pass one score per expert")
    check_top_k(top_k, logits.shape[-1])


def group_limited_top_k(scores: torch.Tensor, top_k: int, n_group: int,
                        topk_group: int) -> torch.Tensor:
    """The top_k experts of each token, chosen only among its `topk_group` best of `n_group`
    equal groups of experts, a group scored by the sum of its two best experts (DeepSeek-V3's
    node-limited routing: a group is the experts of one node, so each token's copies travel to
    at most topk_group nodes). scores [..., E]; returns indices [..., top_k]."""
    if n_group == 1:
        return torch.topk(scores, top_k, dim=-1).indices
    grouped = scores.unflatten(-1, (n_group, -1))  # [..., groups, experts per group]
    group_scores = torch.topk(grouped, 2, dim=-1).values.sum(-1)
    best_groups = torch.topk(group_scores, topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best_groups, True)
    eligible = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
    return torch.topk(eligible, top_k, dim=-1).indices


def route_sigmoid(logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor | None = None,
                  n_group: int = 1, topk_group: int = 1, normalize: bool = True,
                  scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (HF's `DeepseekV3TopkRouter`). Sigmoid scores in fp32; the experts
    are chosen on score + `correction_bias` (group-limited: `group_limited_top_k`), but weighted
    by their unbiased scores, renormalised to sum to one (`normalize`), times `scaling_factor`.
    The bias only steers which experts are chosen, so balancing with it leaves the weights, and
    the gradient, alone. Returns (weights fp32, indices)."""
    check_logits(logits, top_k, "route_sigmoid")
    scores = torch.sigmoid(logits.float())
    for_choice = scores.detach() if correction_bias is None else scores.detach() + correction_bias
    indices = group_limited_top_k(for_choice, top_k, n_group, topk_group)
    weights = scores.gather(-1, indices)
    if normalize:  # HF's 1e-20 keeps all-zero scores (saturated sigmoids) from dividing by 0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, indices


def update_correction_bias(bias: torch.Tensor, tokens_per_expert: torch.Tensor,
                           rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, in place: bias += rate * sign(mean load -
    load). An overloaded expert's bias drops, so fewer tokens choose it next step, an idle
    expert's rises, with no gradient through a balancing loss (the report keeps only a small
    sequence-wise one beside it, α = 0.0001: arXiv:2412.19437, §2.1.2, §4.2).
    """
    load = tokens_per_expert.float()
    bias.add_(torch.sign(load.mean() - load), alpha=rate)


def load_balancing_loss(router_logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss over all layers, as HF Mixtral computes it.

    With f_e the number of (token, slot) assignments to expert e divided by the number of tokens
    (the f_e sum to top_k, each is at most 1) and P_e the mean router probability of expert e,
    both pooled over all layers' tokens, the loss is E * sum_e f_e P_e. It is top_k when routing
    is uniform, grows as experts are over-used, and is at most E.
    """
    if isinstance(router_logits, torch.Tensor) or not router_logits:
        what = "a tensor" if isinstance(router_logits, torch.Tensor) else "no layers"
        raise ValueError(f"load_balancing_loss takes a list of every layer's router logits "
                         f"[T, E], got {what}: pass [logits] for one layer")
    num_experts = router_logits[0].shape[-1] if router_logits[0].dim() else 0
    for layer, layer_logits in enumerate(router_logits):
        if layer_logits.dim() != 2 or layer_logits.shape[-1] != num_experts:
            raise ValueError(f"router logits of layer {layer} have shape "
                             f"{tuple(layer_logits.shape)}; every layer's must be [T, "
                             f"{num_experts}] (tokens × experts, as the router returns them)")
    check_top_k(top_k, num_experts)
    logits = torch.cat([layer.float() for layer in router_logits], dim=0)  # [layers*T, E]
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    # Counting is not differentiable (and need not be): the gradient flows through P_e. index_add
    # of ones, unlike bincount, needs no host sync (bincount must read the largest index first).
    flat = chosen.reshape(-1)
    assignments = probs.new_zeros(num_experts).index_add_(0, flat, probs.new_ones(flat.shape))
    tokens_per_expert = assignments / logits.shape[0]
    return num_experts * torch.sum(tokens_per_expert * probs.mean(dim=0))


@dataclass(frozen=True)
class Permutation:
    """Where every routed token copy went; everything `unpermute` needs to undo `permute`."""

    token_index: torch.Tensor  # [N] source token of each copy, in expert-sorted order (N = T*k)
    row_index: torch.Tensor  # [N] row of each sorted copy in the (padded) expert buffer
    assignment_rows: torch.Tensor  # [T, k] buffer row of each token's k-th expert output
    tokens_per_expert: torch.Tensor  # [E] int64 real rows per expert
    m_splits: torch.Tensor  # [E] int64 rows per expert after padding to `align`
    num_rows: int  # total rows of the buffer (sum of m_splits)
    align: int

    @property
    def offsets(self) -> torch.Tensor:
        """[E] int32 cumulative row ends: the `offs` argument of torch._grouped_mm."""
        return torch.cumsum(self.m_splits, 0).to(torch.int32)

    @property
    def padded(self) -> bool:
        return self.num_rows != self.token_index.numel()


def sort_by_expert(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The order that sorts the T x k token copies by expert, and the copies per expert.

    Copy `t * k + j` is token t's j-th choice, so `indices.reshape(-1)[order]` is sorted; the sort
    is stable (tokens stay in order within an expert). Returns (order [T*k] int64,
    tokens_per_expert [E] int64, one entry per expert, zeros included).
    """
    _check_integer_indices(indices)
    flat_experts = indices.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    # bincount reads the indices' minimum and maximum anyway (on a GPU, a host sync): checking
    # the range here costs nothing until it fails.
    try:
        tokens_per_expert = torch.bincount(flat_experts, minlength=num_experts)
    except RuntimeError:  # bincount refuses negative values
        tokens_per_expert = None
    if tokens_per_expert is None or tokens_per_expert.numel() != num_experts:
        bad = flat_experts.min() if tokens_per_expert is None else flat_experts.max()
        raise _expert_out_of_range(int(bad), num_experts)
    return order, tokens_per_expert


def check_compute_dtype(what: str, x: torch.Tensor, weight_dtype: torch.dtype) -> None:
    """Refuse input of another floating-point dtype than the weights it meets (outside CUDA
    autocast, which casts both; CPU autocast does not cover torch._grouped_mm): torch's matmul
    would fail with "expected m1 and m2 to have the same dtype" deep inside."""
    if x.dtype == weight_dtype or (x.is_cuda and torch.is_autocast_enabled("cuda")):
        return
    raise ValueError(f"{what} got input in {x.dtype} but its weights are {weight_dtype}: cast "
                     f"the input (x.to({weight_dtype})), make the module in {x.dtype} "
                     f"(.to({x.dtype})), or run it under torch.autocast")


def check_routed_shapes(hidden: torch.Tensor, indices: torch.Tensor,
                        weights: torch.Tensor | None) -> None:
    """Refuse hidden states, expert indices and routing weights whose shapes do not fit
    together: hidden [T, H], indices [T, k], weights [T, k] floating point (or None)."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H] (one row per token), got shape "
                         f"{tuple(hidden.shape)}: flatten the batch with hidden.reshape(-1, H)")
    if indices.dim() != 2:
        raise ValueError(f"indices must be [T, k] (k experts per token), got shape "
                         f"{tuple(indices.shape)}: for top-1 routing use indices.unsqueeze(1)")
    if hidden.shape[0] != indices.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} rows but indices has "
                         f"{indices.shape[0]}: pass one row of indices per token")
    if weights is not None and (weights.shape != indices.shape
                                or not weights.dtype.is_floating_point):
        raise ValueError(f"routing weights of shape {tuple(weights.shape)} and dtype "
                         f"{weights.dtype} do not fit indices of shape {tuple(indices.shape)}: "
                         f"pass one floating-point weight per chosen expert, [T, k]")


def padded_rows(tokens_per_expert: torch.Tensor, align: int) -> torch.Tensor:
    """Rows per expert once each expert's block is padded with zero rows up to a multiple of
    `align` (the `m_splits` that `permute` builds; 0 stays 0)."""
    return (tokens_per_expert + align - 1) // align * align


def permute(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None,
            num_experts: int, align: int = 1, *, slot_major: bool = False):
    """Sort token copies by expert, padding each expert's block of rows to a multiple of `align`.

    hidden [T, H], indices [T, k] (expert of each token's k-th slot), weights [T, k] or None.
    Returns (rows [R, H], row_weights [R] fp32 or None, Permutation); padding rows are zero and
    carry weight zero. Tokens keep their original order within an expert (a stable sort);
    `slot_major=True` orders each expert's copies by slot first, then token: the order in which
    HF's eager experts loop visits them (`torch.where` over its [k, T] mask), which the naive
    backend keeps so that its sums run in HF's order.
    """
    _check_align(align)
    check_routed_shapes(hidden, indices, weights)
    num_tokens, top_k = indices.shape
    if slot_major:  # sort the [k, T] copies, then name each copy as the [T, k] order does
        by_slot, tokens_per_expert = sort_by_expert(indices.t(), num_experts)
        sort_order = by_slot % num_tokens * top_k + by_slot // num_tokens
    else:
        sort_order, tokens_per_expert = sort_by_expert(indices, num_experts)
    perm = sorted_permutation(sort_order, indices.reshape(-1)[sort_order], tokens_per_expert,
                              num_tokens, top_k, align)
    rows = _Dispatch.apply(hidden, perm)
    row_weights = None
    if weights is not None:
        row_weights = _scatter_rows(weights.float().reshape(-1)[sort_order], perm)
    return rows, row_weights, perm


def _check_align(align) -> None:
    if not isinstance(align, int) or isinstance(align, bool) or align < 1:
        raise ValueError(f"align={align!r} must be a positive whole number of rows "
                         f"(1 = no padding)")


def sorted_permutation(sort_order: torch.Tensor, sorted_experts: torch.Tensor,
                       tokens_per_expert: torch.Tensor, num_tokens: int, top_k: int,
                       align: int = 1) -> Permutation:
    """The `Permutation` that puts the T·k copies in `sort_order` (copy numbers t·k + j, sorted
    by expert: `sorted_experts` [T·k] are their experts) into a buffer where each expert's block
    is padded to a multiple of `align`. Reads the buffer's size on the host (one sync)."""
    m_splits = padded_rows(tokens_per_expert, align)
    real_starts = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert
    padded_starts = torch.cumsum(m_splits, 0) - m_splits
    rank_in_expert = (torch.arange(sort_order.numel(), device=sort_order.device)
                      - real_starts[sorted_experts])
    row_index = padded_starts[sorted_experts] + rank_in_expert
    num_rows = int(m_splits.sum())  # one host sync: the buffer's size decides kernel shapes
    assignment_rows = torch.empty_like(row_index).scatter_(0, sort_order, row_index)
    return Permutation(sort_order // top_k, row_index,
                       assignment_rows.view(num_tokens, top_k), tokens_per_expert, m_splits,
                       num_rows, align)


def permute_rows(rows: torch.Tensor, weights: torch.Tensor | None,
                 perm: Permutation) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply `perm`, a permutation of rows that have one expert each (k = 1, e.g. the rows
    another rank sent: `distributed.regroup_by_expert`), to rows [N, H] and their weights [N]
    (or None). Returns (rows [R, H], row weights [R] in the weights' dtype, or None), padding
    zero, as `unpermute` inverts."""
    if perm.assignment_rows.shape[1] != 1:
        raise ValueError("permute_rows applies a permutation of one-expert rows (k = 1); "
                         "permute token copies with permute")
    row_weights = None if weights is None else _scatter_rows(weights[perm.token_index], perm)
    return _Dispatch.apply(rows, perm), row_weights


def _scatter_rows(sorted_values: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """Place expert-sorted values into their (padded) buffer rows; padding stays zero."""
    if not perm.padded:  # row_index is then 0..N-1: the sorted order is the buffer
        return sorted_values
    buffer = sorted_values.new_zeros((perm.num_rows, *sorted_values.shape[1:]))
    return buffer.index_copy(0, perm.row_index, sorted_values)


def unpermute(rows: torch.Tensor, perm: Permutation, weights: torch.Tensor | None) -> torch.Tensor:
    """Inverse of `permute`: out[t] = sum_j weights[t, j] * rows[row of (t, j)].

    Pass `weights=None` when the expert outputs are already scaled by their routing weights
    (the te.ops path applies them inside ScaledSwiGLU). The k outputs of a token are summed in
    fp32, in slot order (deterministic, unlike index_add's atomics on a GPU), then cast back.
    """
    if rows.shape[0] != perm.num_rows:
        raise ValueError(f"expected {perm.num_rows} expert-output rows (the permuted buffer), "
                         f"got {rows.shape[0]}")
    if weights is not None and weights.shape != perm.assignment_rows.shape:
        raise ValueError(f"routing weights of shape {tuple(weights.shape)} do not fit the "
                         f"permutation's {tuple(perm.assignment_rows.shape)} [T, k]: pass the "
                         f"weights that were routed with these indices")
    return _Combine.apply(rows, perm.assignment_rows, weights)


# permute and unpermute are each other's adjoints, and their gradients say so. Plain autograd
# through `hidden.index_select(0, token_index)` would scatter-add the k copies of every token
# back with atomics (slow and nondeterministic on a GPU); the backward of dispatching is instead
# the unweighted combine (gather each token's k rows and sum), and the backward of combining is
# dispatching the output gradient (every row gets its token's gradient, times its weight).

def _sum_rows(rows: torch.Tensor, assignment_rows: torch.Tensor,
              weights: torch.Tensor | None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * rows[assignment_rows[t, j]] (weights None: all ones),
    accumulated in (at least) fp32 one slot at a time, so no [T, k, H] temporary is made."""
    num_tokens, top_k = assignment_rows.shape
    acc = rows.new_zeros((num_tokens, rows.shape[1]),
                         dtype=torch.promote_types(rows.dtype, torch.float32))
    for j in range(top_k):  # k, the experts per token: a small constant, not a data size
        slot = rows.index_select(0, assignment_rows[:, j])
        if weights is None:
            acc += slot
        else:
            acc.addcmul_(slot, weights[:, j:j + 1].to(acc.dtype))
    return acc.to(rows.dtype)


def _spread_rows(values: torch.Tensor, assignment_rows: torch.Tensor, num_rows: int,
                 weights: torch.Tensor | None) -> torch.Tensor:
    """rows[assignment_rows[t, j]] = weights[t, j] * values[t] (weights None: all ones); the rows
    no token was assigned to (padding) are zero."""
    num_tokens, top_k = assignment_rows.shape
    if num_rows == num_tokens * top_k:  # no padding: every row is written below
        rows = values.new_empty((num_rows, values.shape[1]))
    else:
        rows = values.new_zeros((num_rows, values.shape[1]))
    for j in range(top_k):
        slot = values if weights is None else (values * weights[:, j:j + 1]).to(values.dtype)
        rows.index_copy_(0, assignment_rows[:, j], slot)  # distinct rows: no accumulation
    return rows


class _Dispatch(torch.autograd.Function):
    """rows = each token's hidden state copied to its k buffer rows (padding zero)."""

    @staticmethod
    def forward(ctx, hidden, perm):
        ctx.assignment_rows = perm.assignment_rows
        return _scatter_rows(hidden.index_select(0, perm.token_index), perm)

    @staticmethod
    def backward(ctx, grad_rows):
        return _sum_rows(grad_rows, ctx.assignment_rows, None), None


class _Combine(torch.autograd.Function):
    """out[t] = sum_j weights[t, j] * rows[row of (t, j)]; weights fp32, or None for all ones."""

    @staticmethod
    def forward(ctx, rows, assignment_rows, weights):
        kept_rows = rows if ctx.needs_input_grad[2] else None  # only the weights' gradient reads them
        ctx.save_for_backward(kept_rows, assignment_rows, weights)
        ctx.num_rows = rows.shape[0]
        return _sum_rows(rows, assignment_rows, weights)

    @staticmethod
    def backward(ctx, grad_out):
        rows, assignment_rows, weights = ctx.saved_tensors
        grad_rows = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_rows = _spread_rows(grad_out, assignment_rows, ctx.num_rows, weights)
        if ctx.needs_input_grad[2]:  # d out[t] / d weights[t, j] = rows[row of (t, j)], in fp32
            accumulate = torch.promote_types(grad_out.dtype, torch.float32)
            grad = grad_out.to(accumulate)
            grad_weights = torch.stack(
                [(rows.index_select(0, assignment_rows[:, j]).to(accumulate) * grad).sum(-1)
                 for j in range(assignment_rows.shape[1])], dim=1).to(weights.dtype)
        return grad_rows, None, grad_weights
