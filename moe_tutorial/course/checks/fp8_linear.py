"""Exercise 04's check: the FP8 linear layer on per-tensor FP8 with a scale from each tensor's
amax (E4M3 forward operands, E5M2 for the incoming gradient), its output, dgrad and wgrad against
`quant.per_tensor_quantize` and against float32."""

from __future__ import annotations

import torch

from ...precision import quant
from ...precision.quant import rel_error
from .harness import (
    Case,
    Failure,
    expect_shape,
    generator,
    is_close,
    learner_step,
    max_rel_difference,
    run_check,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_FORMAT = {E4M3: quant.E4M3, E5M2: quant.E5M2}
_LINEAR_TOL = 1e-5  # the learner's GEMM order against the reference's: float32 rounding only


# ---------------------------------------------------------------------------------------------
# The package's implementation with the exercise's signature (`checks.reference`)

def _dequantized(t: torch.Tensor, fp8_dtype, scale=None) -> torch.Tensor:
    """t through per-tensor FP8 and back, in float32 (`scale`: another tensor's, for a variant)."""
    data, scale_inv = quant.per_tensor_quantize(t, _FORMAT[fp8_dtype], scale)
    return quant.per_tensor_dequantize(data, scale_inv)


class _ReferenceFP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        x_q, w_q = _dequantized(x, E4M3), _dequantized(w, E4M3)
        ctx.save_for_backward(x_q, w_q)  # what the forward GEMM read
        return x_q @ w_q.T

    @staticmethod
    def backward(ctx, grad_out):
        x_q, w_q = ctx.saved_tensors
        g_q = _dequantized(grad_out, E5M2)
        return g_q @ w_q, g_q.T @ x_q


def reference_fp8_linear(x, w):
    """a per-tensor FP8 linear layer on quant.per_tensor_quantize (E4M3 forward, E5M2 gradient)"""
    return _ReferenceFP8Linear.apply(x, w)


# ---------------------------------------------------------------------------------------------
# fp8_linear(x [T, in], w [out, in]) -> y [T, out], differentiable (FP8Linear.apply)

def _linear_cases() -> list[Case]:
    g = generator(402)

    def layer(tokens, n_in=48, n_out=80):
        return (torch.randn(tokens, n_in, generator=g), torch.randn(n_out, n_in, generator=g) * 0.05,
                torch.randn(tokens, n_out, generator=g) * 1e-3)

    outlier = layer(32)
    outlier[0][:, 7] *= 50
    x, w, _ = layer(24)
    spread = torch.randn(24, 80, generator=g) * torch.logspace(-8, 0, 80)
    return [
        Case("a linear layer (32 tokens, 48 → 80 features)", layer(32)),
        Case("activations with an outlier channel (x[:, 7] × 50)", outlier),
        Case("a gradient whose values spread over 8 decades (24 tokens, 48 → 80)", (x, w, spread)),
        Case("one token (1 × 48 → 80)", layer(1)),
    ]


def _pieces(x, w, g) -> dict:
    """Every operand the layer (or a plausible wrong version of it) may use, in float32: `q*`
    quantized and dequantized, `c*` the FP8 values with their scales not undone, `inv*` the
    scale_inv."""
    out = {"x": x.float(), "w": w.float(), "g": g.float()}
    for name, t, fp8_dtype in (("x", x, E4M3), ("w", w, E4M3), ("g", g, E5M2), ("g4", g, E4M3),
                               ("x5", x, E5M2), ("w5", w, E5M2)):
        data, scale_inv = quant.per_tensor_quantize(t, _FORMAT[fp8_dtype])
        out[f"c{name}"] = quant.fp8_decode(data, _FORMAT[fp8_dtype])
        out[f"inv{name}"] = scale_inv
        out[f"q{name}"] = out[f"c{name}"] * scale_inv
    out["qw_by_x"] = _dequantized(w, E4M3, 1 / out["invx"])
    return out


def _diagnose_output(y, p) -> None:
    cx, cw = p["cx"], p["cw"]
    variants = [
        (p["x"] @ p["w"].T, "your output is float32's x @ w.T: quantize x and w to E4M3 (each "
                            "with its own scale) and multiply the FP8 values"),
        (cx @ cw.T, "your output is the GEMM of the FP8 values with their scales still in: "
                    "multiply it by both scale_inv (x's and w's) to undo them"),
        (cx @ cw.T / (p["invx"] * p["invw"]), "you multiplied by the scales instead of undoing "
                                              "them: multiply the FP8 GEMM by x's and w's "
                                              "scale_inv (amax / 448)"),
        (cx @ cw.T * p["invx"], "you undid x's scale but not w's: multiply the FP8 GEMM by both "
                                "scale_inv"),
        (cx @ cw.T * p["invw"], "you undid w's scale but not x's: multiply the FP8 GEMM by both "
                                "scale_inv"),
        (p["qx"] @ p["w"].T, "you quantized x but not w: both operands of the FP8 GEMM are "
                             "E4M3"),
        (p["x"] @ p["qw"].T, "you quantized w but not x: both operands of the FP8 GEMM are "
                             "E4M3"),
        (p["qx5"] @ p["qw5"].T, "you quantized x and w to E5M2: the forward operands are E4M3 "
                                "(one more mantissa bit; activations and weights need precision "
                                "more than range)"),
        (p["qx"] @ p["qw_by_x"].T, "you quantized w with x's scale: every tensor gets its own "
                                   "scale, from its own amax"),
    ]
    for variant, diagnosis in variants:
        if is_close(y, variant, _LINEAR_TOL):
            raise Failure(diagnosis)


def _diagnose_gradient(got, want, p, which: str) -> None:
    """dgrad = g_q @ w_q, wgrad = g_q.T @ x_q: the plausible wrong versions of one of them."""
    if which == "dgrad":
        def gemm(g, other):
            return g @ other
        operand, other_name, other_inv, wrong_inv = "w", "w", p["invw"], p["invx"]
    else:
        def gemm(g, other):
            return g.T @ other
        operand, other_name, other_inv, wrong_inv = "x", "x", p["invx"], p["invw"]
    q_other, raw_other, c_other = p[f"q{operand}"], p[operand], p[f"c{operand}"]
    wrong_name = "x" if other_name == "w" else "w"
    variants = [
        (gemm(p["g"], raw_other), f"your {which} is float32's: the backward GEMMs run on FP8 "
                                  f"operands too - grad_out quantized to E5M2, and the "
                                  f"{other_name}_q the forward saved"),
        (gemm(p["g"], q_other), "you did not quantize the incoming gradient: quantize grad_out "
                                "to E5M2 (its own scale, from its own amax) before dgrad and "
                                "wgrad"),
        (gemm(p["qg"], raw_other), f"your {which} reads the unquantized {other_name}: save the "
                                   f"quantized {other_name}_q (and its scale_inv) in forward "
                                   "and use it - the backward multiplies what the forward "
                                   "multiplied"),
        (gemm(p["qg4"], q_other), "you quantized the incoming gradient to E4M3: gradients go to "
                                  "E5M2 (torch.float8_e5m2), whose range (57344 down to 2^-16) "
                                  "holds their spread, which E4M3 (448 down to 2^-9) flushes to "
                                  "zero"),
        (gemm(p["cg"], c_other), f"your {which} is the GEMM of the FP8 values with their scales "
                                 f"still in: multiply it by grad_out's and {other_name}'s "
                                 "scale_inv"),
        (gemm(p["cg"], c_other) / (p["invg"] * other_inv),
         f"you multiplied your {which} by the scales instead of undoing them: multiply by "
         f"grad_out's and {other_name}'s scale_inv"),
        (gemm(p["cg"], c_other) * p["invg"] * wrong_inv,
         f"your {which} undoes {wrong_name}'s scale instead of {other_name}'s: {which} reads "
         f"grad_out and {other_name}, so multiply by their two scale_inv"),
    ]
    for variant, diagnosis in variants:
        if is_close(got, variant, _LINEAR_TOL):
            raise Failure(diagnosis)
    formula = "g_q @ w_q" if which == "dgrad" else "g_q.T @ x_q"
    raise Failure(f"your {which} differs from the FP8 reference by {max_rel_difference(got, want):.1e} "
                  f"(relative): {which} = {formula}, grad_out quantized to E5M2 with its own "
                  f"scale, {other_name}_q the E4M3 copy the forward saved, both scale_inv undone")


def _verify_linear(case: Case, call) -> None:
    x, w, g = case.args
    x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = call(x_leaf, w_leaf, copy=False)
    for name, leaf, original in (("x", x_leaf, x), ("w", w_leaf, w)):
        if not torch.equal(leaf.detach(), original):
            raise Failure(f"your layer changed its input `{name}` in place: quantize a copy "
                          f"({name} * scale makes one)")
    if not isinstance(y, torch.Tensor):
        raise Failure(f"your layer returned {type(y).__name__}: return y = x @ w.T, one tensor")
    expect_shape(y, (x.shape[0], w.shape[0]), "your output", "x @ w.T: [tokens, out]")
    if y.dtype != torch.float32:
        raise Failure(f"your output is {y.dtype}: return float32 (the FP8 values .float(), "
                      "multiplied and rescaled)")
    p = _pieces(x, w, g)
    want_y = p["qx"] @ p["qw"].T
    if not is_close(y.detach(), want_y, _LINEAR_TOL):
        _diagnose_output(y.detach(), p)
        raise Failure(f"your output differs from the FP8 reference by "
                      f"{max_rel_difference(y.detach(), want_y):.1e} (relative): y = "
                      "(x_q @ w_q.T) times x's and w's scale_inv, x and w quantized to E4M3")
    if not y.requires_grad:
        raise Failure("your output carries no gradient: return what FP8Linear.apply(x, w) "
                      "returns (no torch.no_grad, no .detach())")
    learner_step(y.backward, g)
    grads = {"dgrad": (x_leaf.grad, p["qg"] @ p["qw"], "x"),
             "wgrad": (w_leaf.grad, p["qg"].T @ p["qx"], "w")}
    errors = {"output": rel_error(y.detach(), p["x"] @ p["w"].T)}
    for which, (got, want, name) in grads.items():
        if got is None:
            raise Failure(f"your backward returned no gradient for {name}: return (grad_x, "
                          "grad_w), one per input of forward, in their order")
        if not is_close(got, want, _LINEAR_TOL):
            _diagnose_gradient(got.float(), want, p, which)
        errors[which] = rel_error(got, (p["g"] @ p["w"]) if which == "dgrad" else p["g"].T @ p["x"])
    case.info["errors"] = errors


_SHAPE_ADVICE = ("dgrad has x's shape [tokens, in], grad_x = g_q @ w_q; wgrad has w's shape [out, "
                 "in], grad_w = g_q.T @ x_q - return them in the order forward took (x, w)")


def check_fp8_linear(learner_fn) -> bool:
    """`fp8_linear(x [T, in], w [out, in]) -> y [T, out]`, differentiable: the output and the two
    gradients against the same layer on `quant.per_tensor_quantize` (E4M3 forward operands, the
    incoming gradient in E5M2); prints how far each is from float32."""
    cases = _linear_cases()
    ok = run_check("check_fp8_linear", learner_fn, cases, _verify_linear,
                   against="quant.per_tensor_quantize",
                   error_hints=(("returned an invalid gradient", _SHAPE_ADVICE),
                                ("cannot be multiplied", "x is [tokens, in], w [out, in] and "
                                 "grad_out [tokens, out]: y = x_q @ w_q.T, dgrad = g_q @ w_q, "
                                 "wgrad = g_q.T @ x_q"),
                                ("incorrect number of gradients", "backward returns one gradient "
                                 "per input of forward: (grad_x, grad_w)"),
                                ("save_for_backward can only save", "save tensors only; keep a "
                                 "Python number as an attribute of ctx (ctx.x_scale_inv = ...)")))
    if ok:
        errors = cases[0].info["errors"]
        print("  vs float32 on " + cases[0].name.split(" (")[0] + ": "
              + ", ".join(f"{k} {v:.1%}" for k, v in errors.items())
              + " relative error - what FP8's 3 and 2 mantissa bits cost")
    return ok
