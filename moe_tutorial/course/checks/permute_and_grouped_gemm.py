"""Exercise 02's checks: the permutation and the grouped expert MLP."""

from __future__ import annotations

import math

import torch

from ...moe import experts, routing
from .harness import (
    Case,
    Failure,
    expect_shape,
    expect_tensor,
    expect_tuple,
    generator,
    is_close,
    is_integer,
    max_rel_difference,
    mismatch,
    random_expert_weights,
    random_routing,
    run_check,
    sizes,
    swap_gate_up,
    tolerance,
)

# The package's implementation with the exercise's signature (`checks.reference`)

def reference_permute(hidden, indices, num_experts, align=1):
    """routing.permute"""
    rows, _, perm = routing.permute(hidden, indices, None, num_experts, align)
    return rows, perm.m_splits, perm.assignment_rows


def _offsets(m_splits) -> torch.Tensor:
    return torch.cumsum(torch.as_tensor(m_splits).long(), 0).to(torch.int32)


def reference_grouped_mlp(rows, m_splits, gate_up_proj, down_proj):
    """experts.grouped_mm → experts.swiglu → experts.grouped_mm"""
    offsets = _offsets(m_splits).to(rows.device)
    h, _ = experts.grouped_mm(rows, gate_up_proj, offsets)
    return experts.grouped_mm(experts.swiglu(h), down_proj, offsets)[0]


def _permute_cases() -> list[Case]:
    g = generator(104)

    def make(name, tokens, num_experts, top_k, align, hidden=24, dtype=torch.float32, skip=None):
        _, indices = random_routing(g, tokens, num_experts, top_k, skip_expert=skip)
        return Case(name, (torch.randn(tokens, hidden, generator=g).to(dtype), indices,
                           num_experts, align))

    return [
        make(f"no padding ({sizes(37, 4, 2, align=1)})", 37, 4, 2, 1),
        make(f"padding ({sizes(37, 4, 2, align=4)})", 37, 4, 2, 4),
        make(f"expert 3 receives no tokens ({sizes(30, 4, 2, align=8)})", 30, 4, 2, 8, skip=3),
        make(f"row counts not multiples of 32 ({sizes(45, 6, 2, align=32)})", 45, 6, 2, 32),
        make(f"bf16 hidden states ({sizes(33, 4, 2, align=16)})", 33, 4, 2, 16, 32, torch.bfloat16),
        make(f"top-1 ({sizes(20, 4, 1, align=4)})", 20, 4, 1, 4),
    ]


def _check_splits(m_splits, perm, num_experts: int, align: int) -> None:
    """m_splits: one padded row count per expert, as an integer tensor."""
    counts, ref_splits = perm.tokens_per_expert, perm.m_splits
    # the grouped GEMM's offsets are torch.cumsum(m_splits, 0): a tensor of integers, one axis
    if not isinstance(m_splits, torch.Tensor):
        raise Failure(f"your m_splits is a {type(m_splits).__name__}; return a 1-D int64 tensor "
                      "(torch.bincount gives one): the grouped MLP takes torch.cumsum(m_splits, 0)")
    if not is_integer(m_splits):
        raise Failure(f"your m_splits is {m_splits.dtype}: row counts are integers - return an "
                      "int64 tensor")
    if m_splits.dim() != 1:
        raise Failure(f"your m_splits has shape {list(m_splits.shape)}; return a 1-D tensor "
                      f"[E] = [{num_experts}], one row count per expert")
    splits = m_splits.detach().long()
    empty = [e for e in range(num_experts) if counts[e] == 0]
    if splits.numel() != num_experts:
        if empty and splits.numel() == num_experts - len(empty):
            raise Failure(f"expert {empty[0]} received no tokens and your permutation dropped its "
                          "split: m_splits needs one entry per expert, zeros included "
                          "(torch.bincount(..., minlength=num_experts))")
        raise Failure(f"your m_splits has {splits.numel()} entries; it needs one per expert "
                      f"({num_experts})")
    if not torch.equal(splits, ref_splits):
        e = int((splits != ref_splits).nonzero()[0])
        c, want, mine = int(counts[e]), int(ref_splits[e]), int(splits[e])
        if align > 1 and torch.equal(splits, counts):
            raise Failure(f"your m_splits {splits.tolist()} are the raw token counts: pad each to a "
                          f"multiple of align={align} (expert {e}: {c} → {want} rows)")
        if mine == c // align * align:
            raise Failure(f"expert {e} has {c} token copies; with align={align} its block needs "
                          f"ceil({c}/{align})·{align} = {want} rows, yours has {mine}: round up, "
                          "not down")
        raise Failure(f"expert {e} has {c} token copies, so with align={align} its split is "
                      f"{want} rows (ceil({c}/{align})·{align}); yours is {mine}")


def _check_rows(rows, hidden, num_rows: int) -> torch.Tensor:
    """The rows buffer: [num_rows, H], the hidden states' dtype, dense."""
    rows = expect_tensor(rows, "your rows")
    if rows.dim() != 2 or rows.shape[0] != num_rows or rows.shape[1] != hidden.shape[1]:
        raise Failure(f"your buffer has shape {list(rows.shape)}, but the splits add up to "
                      f"{num_rows} rows of {hidden.shape[1]} features: expert e's block is "
                      "m_splits[e] rows, its tokens first, then zero rows")
    if rows.dtype != hidden.dtype:
        raise Failure(f"your rows are {rows.dtype}, the hidden states {hidden.dtype}: copy the "
                      "rows, don't convert them")
    if not rows.is_contiguous():
        raise Failure(f"your rows are not contiguous (strides {list(rows.stride())}): the grouped "
                      "GEMMs (torch._grouped_mm, te.GroupedLinear) read them as dense row-major "
                      "memory - build the buffer with hidden.new_zeros(R, H), or .contiguous()")
    return rows


def _check_row_of(row_of, indices, ref_splits) -> torch.Tensor:
    """row_of: every token copy in a row of its expert's block, no row shared; returns the rows
    flat, copy by copy."""
    row_of = expect_tensor(row_of, "your row_of")
    expect_shape(row_of, indices.shape, "your row_of", "[tokens, top_k]")
    if not is_integer(row_of):
        raise Failure(f"your row_of is {row_of.dtype}: return integer row numbers (int64)")
    row_of = row_of.long()
    starts = torch.cumsum(ref_splits, 0) - ref_splits
    lo, hi = starts[indices], starts[indices] + ref_splits[indices]
    outside = (row_of < lo) | (row_of >= hi)
    if outside.any():
        t, j = (int(v) for v in outside.nonzero()[0])
        e = int(indices[t, j])
        raise Failure(f"token {t}'s copy for expert {e} is in row {int(row_of[t, j])}, outside "
                      f"expert {e}'s rows [{int(lo[t, j])}, {int(hi[t, j])}): expert e's block "
                      "starts at m_splits[0] + … + m_splits[e-1] (an exclusive cumulative sum)")
    flat = row_of.reshape(-1)
    if flat.unique().numel() != flat.numel():
        values, counts_ = flat.unique(return_counts=True)
        raise Failure(f"two token copies share row {int(values[counts_ > 1][0])}: every "
                      "(token, expert) pair needs its own row")
    return flat


def _check_contents(rows, hidden, indices, flat, ref_splits, num_rows: int) -> None:
    """Each copy's row holds its token's hidden state; every other row is zero padding."""
    token_of_copy = torch.arange(indices.shape[0]).repeat_interleave(indices.shape[1])
    wrong = (rows[flat] != hidden[token_of_copy]).any(-1)
    if wrong.any():
        n = int(wrong.nonzero()[0])
        t, j = divmod(n, indices.shape[1])
        raise Failure(f"row {int(flat[n])} should hold token {t} (its copy for expert "
                      f"{int(indices[t, j])}) but holds other values: rows[row_of[t, j]] must "
                      "equal hidden[t]")
    padding = torch.ones(num_rows, dtype=torch.bool)
    padding[flat] = False
    dirty = padding & (rows != 0).any(-1)
    if dirty.any():
        r = int(dirty.nonzero()[0])
        e = int(torch.searchsorted(torch.cumsum(ref_splits, 0), r, right=True))
        raise Failure(f"row {r} is padding in expert {e}'s block but is not zero: fill the "
                      "padding rows with zeros (they go through the GEMMs too)")


def _verify_permute(case: Case, call) -> None:
    hidden, indices, num_experts, align = case.args
    rows, m_splits, row_of = expect_tuple(call(*case.args), 3, "(rows, m_splits, row_of)")
    _, _, perm = routing.permute(hidden, indices, None, num_experts, align)
    _check_splits(m_splits, perm, num_experts, align)
    rows = _check_rows(rows, hidden, perm.num_rows)
    flat = _check_row_of(row_of, indices, perm.m_splits)
    _check_contents(rows, hidden, indices, flat, perm.m_splits, perm.num_rows)


def check_permute(learner_fn) -> bool:
    """`permute(hidden [T, H], indices [T, k], num_experts, align) -> (rows [R, H], m_splits [E],
    row_of [T, k])` against `routing.permute`: every copy in its expert's block, padding zero."""
    return run_check("check_permute", learner_fn, _permute_cases(), _verify_permute,
                     against="routing.permute")


def _grouped_cases() -> list[Case]:
    g = generator(106)

    def make(name, tokens, num_experts, top_k, align, hidden=24, inter=40, dtype=torch.float32,
             skip=None):
        _, indices = random_routing(g, tokens, num_experts, top_k, skip_expert=skip)
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        rows, _, perm = routing.permute(x, indices, None, num_experts, align)
        gate_up, down = random_expert_weights(g, num_experts, hidden, inter, dtype)
        return Case(name, (rows, perm.m_splits, gate_up, down))

    return [
        make(f"4 experts ({sizes(37, 4, 2, hidden=24, width=40)})", 37, 4, 2, 1),
        make(f"expert 2 receives no rows ({sizes(30, 4, 2)})", 30, 4, 2, 1, skip=2),
        make(f"padded rows ({sizes(29, 4, 2, align=8)})", 29, 4, 2, 8),
        make(f"bf16 ({sizes(33, 4, 2, hidden=32, width=48)})", 33, 4, 2, 1, 32, 48, torch.bfloat16),
        make(f"one expert ({sizes(9, 1, 1)})", 9, 1, 1, 1),
    ]


def _grouped_with(rows, m_splits, gate_up, down, offsets_of, act=experts.swiglu):
    """The grouped MLP computed expert by expert with other offsets or activation, each block in
    turn (offsets that step back overwrite earlier rows, as torch's CPU kernel does); rows no
    block covers (which torch._grouped_mm leaves undefined) are NaN."""
    offsets = offsets_of(torch.as_tensor(m_splits).long()).tolist()
    out = torch.full((rows.shape[0], down.shape[1]), math.nan, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets):
        block = rows[start:end].double()
        out[start:end] = act(block @ gate_up[e].double().T) @ down[e].double().T
        start = end
    return out


def _verify_grouped(case: Case, call) -> None:
    rows, m_splits, gate_up, down = case.args
    out = expect_tensor(call(*case.args), "your output")
    expect_shape(out, (rows.shape[0], down.shape[1]), "your output", "[rows, hidden]")
    if out.dtype != rows.dtype:
        raise Failure(f"your output is {out.dtype}, the rows are {rows.dtype}: keep the rows' dtype")
    ref = reference_grouped_mlp(*case.args)
    tol = tolerance(rows.dtype)
    if is_close(out, ref, tol):
        return
    cumulative = (lambda s: torch.cumsum(s, 0))  # noqa: E731
    variants = [
        (_grouped_with(rows, m_splits, swap_gate_up(gate_up), down, cumulative),
         "you swapped gate and up: the first I outputs of the gate-up GEMM are the gate, "
         "silu(gate) * up"),
        (_grouped_with(rows, m_splits, gate_up, down, cumulative,
                       lambda h: h.chunk(2, -1)[0] * h.chunk(2, -1)[1]),
         "you multiplied gate and up without silu: SwiGLU is silu(gate) * up"),
        (_grouped_with(rows, m_splits, gate_up, down, lambda s: torch.cumsum(s, 0) - s),
         "you passed the block starts (an exclusive cumsum) as offs: torch._grouped_mm wants each "
         "expert's row end, torch.cumsum(m_splits, 0).to(torch.int32)"),
        # Judged only on the rows these offsets define: torch._grouped_mm leaves the rest
        # uninitialised, and a reused buffer can happen to hold the right answer there.
        (_grouped_with(rows, m_splits, gate_up, down, lambda s: s),
         "you passed m_splits itself as offs: torch._grouped_mm's offs are the cumulative row "
         "ends torch.cumsum(m_splits, 0).to(torch.int32), expert e owns rows "
         "[offs[e-1], offs[e])"),
    ]
    for variant, diagnosis in variants:
        covered = ~torch.isnan(variant).any(-1)
        if covered.any() and is_close(out.double()[covered], variant[covered], tol):
            raise Failure(diagnosis)
    ends = torch.cumsum(torch.as_tensor(m_splits).long(), 0).tolist()
    starts = [0] + ends[:-1]
    blocks = [(e, s, t) for e, (s, t) in enumerate(zip(starts, ends)) if t > s]
    wrong_rows = mismatch(out, ref, tol).any(-1).float()
    # Wrong offsets leave rows near a block's edge undefined: judge each block by its majority.
    good = [e for e, s, t in blocks if wrong_rows[s:t].mean() < 0.5]
    bad = [e for e, _, _ in blocks if e not in good]
    if bad and good:
        e, s, t = next(b for b in blocks if b[0] == bad[0])
        right = ", ".join(map(str, good))
        raise Failure(f"the rows of expert {e} ([{s}, {t})) are wrong while those of expert"
                      f"{'s' if len(good) > 1 else ''} {right} are right: torch._grouped_mm's "
                      "offs are the cumulative row ends "
                      "torch.cumsum(m_splits, 0).to(torch.int32), expert e owns rows "
                      "[offs[e-1], offs[e])")
    raise Failure(f"your output differs from the grouped MLP by {max_rel_difference(out, ref):.1e} "
                  "(relative): per expert block, h = rows @ gate_up_proj[e].T, then "
                  "silu(h[:, :I]) * h[:, I:], then @ down_proj[e].T")


def check_grouped_mlp(learner_fn) -> bool:
    """`grouped_mlp(rows [R, H], m_splits [E], gate_up_proj [E, 2I, H], down_proj [E, H, I])
    -> [R, H]` against `experts.grouped_mm` + `experts.swiglu`."""
    return run_check("check_grouped_mlp", learner_fn, _grouped_cases(), _verify_grouped,
                     against="experts.grouped_mm + swiglu",
                     error_hints=(("int32", "the offsets must be int32: .to(torch.int32)"),
                                  ("aten::_grouped_mm", "this torch has no CPU kernel for "
                                   "torch._grouped_mm (torch >= 2.9 has one): upgrade torch, or "
                                   "call experts.grouped_mm, which falls back to a loop of "
                                   "matmuls"),
                                  ("strides should be multiple of 16", "torch._grouped_mm reads "
                                   "rows as 16-byte vectors; pass contiguous tensors"),
                                  ("contraction dim", "transpose the weights: rows @ w[e].T, i.e. "
                                   "torch._grouped_mm(rows, w.transpose(-2, -1), offs=...)"),
                                  ("mat_a and mat_b", "transpose the weights: rows @ w[e].T, i.e. "
                                   "torch._grouped_mm(rows, w.transpose(-2, -1), offs=...)")))
