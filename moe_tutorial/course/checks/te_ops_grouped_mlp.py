"""Exercise 05's checks: the te.ops grouped MLP, built with the ops it is handed
(`experts.torch_ops` here) and wired into an expert layer."""

from __future__ import annotations

import torch

from ...moe import dispatch, experts, routing
from ...precision import hardware
from .harness import (
    Case,
    Failure,
    expect_shape,
    expect_tensor,
    generator,
    is_close,
    max_rel_difference,
    random_expert_weights,
    random_routing,
    run_check,
    sizes,
    tolerance,
)

# The package's implementation with the exercise's signature (`checks.reference`)

def reference_build_grouped_mlp(ops, num_experts, hidden_size, intermediate_size,
                                glu_interleave_size=None, dtype=torch.float32, device="cpu"):
    """experts.TEOpsExperts(...).mlp: te.ops on a GPU with TE, else experts.torch_ops"""
    return experts.TEOpsExperts(num_experts, hidden_size, intermediate_size, dtype=dtype,
                                device=device, glu_interleave_size=glu_interleave_size).mlp


def reference_te_ops_expert_layer(mlp, hidden, indices, weights, num_experts, align):
    """the dispatcher's permutation → the op chain → merge, as the te_ops backend runs"""
    te = hardware.transformer_engine() if hidden.is_cuda else None
    d = (dispatch.te_dispatch(hidden, indices, weights, num_experts, align, te) if te is not None
         else dispatch.sort_dispatch(hidden, indices, weights, num_experts, align))
    return d.combine(mlp(d.rows, d.rows_per_expert, d.row_weights, d.rows_per_expert), False)


_MLP_KINDS = ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]


def _build_cases() -> list[Case]:
    # The notebook builds the chain on its GPU: the "meta" device (no memory, no data) shows on
    # a CPU whether the device argument reaches the parameters.
    return [
        Case("4 experts, hidden 32, width 64", (4, 32, 64, None, torch.float32, "cpu")),
        Case("8 experts, hidden 64, width 64, glu_interleave_size=32 (the fused kernel's layout)",
             (8, 64, 64, 32, torch.float32, "cpu")),
        Case("bf16 parameters, 3 experts, hidden 32, width 48",
             (3, 32, 48, None, torch.bfloat16, "cpu")),
        Case("another device (device='meta', as the notebook passes 'cuda' on a GPU)",
             (2, 16, 32, None, torch.float32, "meta")),
    ]


def _groups(op) -> int:
    return sum(1 for name, _ in op.named_parameters(recurse=False) if name.startswith("weight"))


def _verify_build(case: Case, call) -> None:
    num_experts, hidden, inter, glu, dtype, device = case.args
    mlp = call(experts.torch_ops, num_experts, hidden, inter, glu, dtype, device)
    if not isinstance(mlp, experts.torch_ops.Sequential):
        raise Failure(f"return ops.Sequential(...) (one op chain), yours is {type(mlp).__name__}")
    kinds = [type(op).__name__.removeprefix("StandIn") for op in mlp]
    if kinds != _MLP_KINDS:
        raise Failure(f"your chain is [{', '.join(kinds)}]; the grouped MLP is [GroupedLinear "
                      "(gate-up), ScaledSwiGLU (SwiGLU × routing weights), GroupedLinear (down)]")
    fc1, act, fc2 = mlp
    for which, op, (n_out, n_in) in (("first", fc1, (2 * inter, hidden)),
                                     ("second", fc2, (hidden, inter))):
        if _groups(op) != num_experts:
            raise Failure(f"your {which} GroupedLinear has {_groups(op)} groups; one per expert "
                          f"({num_experts})")
        got = (op.out_features, op.in_features)
        if got != (n_out, n_in):
            if which == "first" and got == (inter, hidden):
                raise Failure(f"your first GroupedLinear has {inter} outputs; it computes gate and "
                              f"up together: 2 × intermediate_size = {2 * inter}")
            raise Failure(f"your {which} GroupedLinear maps {got[1]} → {got[0]} features, "
                          f"expected {n_in} → {n_out}")
    if fc1.use_bias or fc2.use_bias:
        raise Failure("your GroupedLinears have biases (ops.GroupedLinear's default is bias=True): "
                      "the expert GEMMs are bias-free, pass bias=False")
    if act.glu_interleave_size != glu:
        raise Failure(f"your ScaledSwiGLU has glu_interleave_size={act.glu_interleave_size}, "
                      f"expected {glu}: pass the argument through")
    for which, op in (("first", fc1), ("second", fc2)):
        if op.weight0.dtype != dtype:
            raise Failure(f"your {which} GroupedLinear's weights are {op.weight0.dtype}: create "
                          f"both GroupedLinears with dtype={dtype}")
        if op.weight0.device != torch.device(device):
            raise Failure(f"your {which} GroupedLinear's weights are on {op.weight0.device}, asked "
                          f"for device={device!r}: create both GroupedLinears with device=device")
    if device == "meta":
        return  # parameters without data: nothing to compute
    g = generator(110)
    gate_up, down = random_expert_weights(g, num_experts, hidden, inter, dtype)
    ref = experts.TEOpsExperts(num_experts, hidden, inter, dtype=dtype, device="cpu",
                               glu_interleave_size=glu)
    ref.load_hf_weights(gate_up, down)
    with torch.no_grad():
        for mine, theirs in ((fc1, ref.mlp[0]), (fc2, ref.mlp[2])):
            for e in range(num_experts):
                getattr(mine, f"weight{e}").copy_(getattr(theirs, f"weight{e}"))
    _, indices = random_routing(g, 29, num_experts, 2)
    rows, row_weights, perm = routing.permute(torch.randn(29, hidden, generator=g).to(dtype),
                                              indices, torch.rand(29, 2, generator=g),
                                              num_experts, 1)
    want = ref.mlp(rows, perm.m_splits, row_weights, perm.m_splits)
    got = mlp(rows, perm.m_splits, row_weights, perm.m_splits)
    if not is_close(got.detach(), want.detach(), tolerance(dtype)):
        raise Failure(f"your op chain's output differs from experts.TEOpsExperts' chain's by "
                      f"{max_rel_difference(got.detach(), want.detach()):.1e} with the same weights")


def check_build_grouped_mlp(learner_fn) -> bool:
    """`build_grouped_mlp(ops, num_experts, hidden_size, intermediate_size, glu_interleave_size,
    dtype, device)` -> ops.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear), checked with
    `experts.torch_ops` against `experts.TEOpsExperts`' op chain (structure, then outputs)."""
    return run_check("check_build_grouped_mlp", learner_fn, _build_cases(), _verify_build,
                     against="experts.TEOpsExperts' op chain",
                     error_hints=(("unexpected keyword argument 'gate_interleave_size'",
                                   "ScaledSwiGLU's argument is glu_interleave_size"),))


class _RecordingChain:
    """Wraps an op chain and records how it was called."""

    def __init__(self, chain):
        self.chain = chain
        self.calls: list[tuple] = []

    def __call__(self, x, *extra):
        self.calls.append((x, extra))
        return self.chain(x, *extra)

    def __getattr__(self, name):
        return getattr(self.chain, name)

    def __getitem__(self, index):
        return self.chain[index]


def _layer_cases() -> list[Case]:
    g = generator(111)

    def make(name, tokens, num_experts, top_k, align, hidden=32, inter=64, dtype=torch.float32,
             skip=None):
        weights, indices = random_routing(g, tokens, num_experts, top_k, skip_expert=skip,
                                          scale=2.0)
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        gate_up, down = random_expert_weights(g, num_experts, hidden, inter, dtype)
        module = experts.TEOpsExperts(num_experts, hidden, inter, dtype=dtype, device="cpu",
                                      align=align)
        module.load_hf_weights(gate_up, down)
        return Case(name, (x, indices, weights, num_experts, align), {"module": module})

    return [
        make(f"{sizes(37, 4, 2, align=8)}", 37, 4, 2, 8),
        make(f"expert 3 receives no tokens ({sizes(30, 4, 2, align=16)})", 30, 4, 2, 16, skip=3),
        make(f"row counts not multiples of 32 ({sizes(45, 6, 2, align=32)})", 45, 6, 2, 32),
        make(f"bf16 ({sizes(33, 4, 2, align=16)})", 33, 4, 2, 16, dtype=torch.bfloat16),
    ]


def _verify_layer(case: Case, call) -> None:
    hidden, indices, weights, num_experts, align = case.args
    module = case.info["module"]
    chain = _RecordingChain(module.mlp)
    out = expect_tensor(call(chain, hidden, indices, weights, num_experts, align), "your output")
    if not chain.calls:
        raise Failure("you never called the op chain: run mlp(rows, m_splits, row_weights, "
                      "m_splits) once on the permuted rows")
    if len(chain.calls) > 1:
        raise Failure(f"you called the op chain {len(chain.calls)} times: one call runs every "
                      "expert (its GroupedLinears split the rows by m_splits)")
    rows, extra = chain.calls[0]
    fc1_splits, scales, fc2_splits = extra
    if fc1_splits is not fc2_splits:
        raise Failure("pass the same split object to both GroupedLinears, mlp(rows, splits, "
                      "scales, splits): TE reads the split sizes once for the whole chain")
    splits = torch.as_tensor(fc1_splits).reshape(-1).tolist()
    if any(s % align for s in splits):
        raise Failure(f"the op chain got m_splits {splits}: with align={align} every expert's rows "
                      f"must be padded to a multiple of {align} (routing.permute(..., align=align))"
                      " - FP8 and MXFP8 GEMMs need it")
    scales = expect_tensor(scales, "ScaledSwiGLU's scales")
    if scales.dtype != torch.float32:
        raise Failure(f"ScaledSwiGLU's scales are {scales.dtype}: pass the routing weights in "
                      "float32 (row_weights from routing.permute)")
    real = scales[scales != 0]
    if real.numel() and torch.all(real == 1) and not torch.all(weights == 1):
        raise Failure("ScaledSwiGLU got scales of 1: give it each row's routing weight "
                      "(row_weights from routing.permute) so the weights act inside the op chain, "
                      "then unpermute with weights=None")
    expect_shape(out, hidden.shape, "your output", "[tokens, hidden]")
    if out.dtype != hidden.dtype:
        raise Failure(f"your output is {out.dtype} but the hidden states are {hidden.dtype}: "
                      "return hidden's dtype (routing.unpermute casts back)")
    ref = dispatch.run_experts(module, hidden, indices, weights)[0]
    tol = tolerance(hidden.dtype)
    if is_close(out, ref.detach(), tol):
        return
    if is_close(out, dispatch.run_experts(module, hidden, indices, weights * weights)[0].detach(),
                tol):
        raise Failure("your output weights every expert's output twice (w²): ScaledSwiGLU already "
                      "multiplied by the routing weights, so unpermute with weights=None")
    raise Failure(f"your output differs from experts.TEOpsExperts' by "
                  f"{max_rel_difference(out, ref.detach()):.1e} (relative): permute with the weights and "
                  "align, run the chain once, unpermute with weights=None")


def check_te_ops_expert_layer(learner_fn) -> bool:
    """`te_ops_expert_layer(mlp, hidden, indices, weights, num_experts, align) -> [T, H]`:
    permute (padding to align) → the op chain with the routing weights in ScaledSwiGLU →
    unpermute, against `experts.TEOpsExperts`; how the chain is called is recorded and checked."""
    return run_check("check_te_ops_expert_layer", learner_fn, _layer_cases(), _verify_layer,
                     against="experts.TEOpsExperts")
