"""The exercises' checks test the contract the later cells rely on: an answer that passes its
check is one the notebook can use (dtypes, shapes, contiguity, Python types), and one that
cannot gets one line naming what was returned and what is expected. Answers that are correct
but unusual (a non-contiguous result, int32 where int32 works downstream) pass.

`pick` and the harness are probed with bad arguments too: a non-callable, the unedited stub,
a `passed` that is not a check's result, a function redefined after its check passed."""

import numpy as np
import pytest
import torch

from moe_tutorial.course import checks
from moe_tutorial.moe import routing
from moe_tutorial.precision import quant

ref = checks.reference


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in column-major memory: not contiguous, equal everywhere."""
    return t.T.contiguous().T


# ---------------------------------------------------------------------------------------------
# Wrong answers (must fail, naming the problem) and unusual right ones (must pass)

def route_int32_indices(logits, top_k):  # finding 5: passed, then the expert loop's cell raised
    weights, indices = ref.route(logits, top_k)
    return weights, indices.int()


def route_as_list(logits, top_k):
    return list(ref.route(logits, top_k))


def route_noncontiguous_weights(logits, top_k):
    weights, indices = ref.route(logits, top_k)
    return _noncontiguous(weights), indices


def route_subtracts_max_in_place(logits, top_k):
    logits -= logits.max(-1, keepdim=True).values  # "for stability", on the caller's tensor
    return ref.route(logits, top_k)


def lb_returns_python_float(router_logits, top_k):
    return ref.load_balancing_loss(router_logits, top_k).item()


def lb_shape_one(router_logits, top_k):
    return ref.load_balancing_loss(router_logits, top_k).reshape(1)


def loop_noncontiguous_output(hidden, indices, weights, gate_up_proj, down_proj):
    return _noncontiguous(ref.expert_loop(hidden, indices, weights, gate_up_proj, down_proj))


def loop_accumulates_into_hidden(hidden, indices, weights, gate_up_proj, down_proj):
    out = ref.expert_loop(hidden, indices, weights, gate_up_proj, down_proj)
    return hidden.copy_(out)  # reuses the input as the output buffer


def permute_splits_as_list(hidden, indices, num_experts, align=1):
    rows, m_splits, row_of = ref.permute(hidden, indices, num_experts, align)
    return rows, m_splits.tolist(), row_of


def permute_splits_int32(hidden, indices, num_experts, align=1):
    rows, m_splits, row_of = ref.permute(hidden, indices, num_experts, align)
    return rows, m_splits.int(), row_of


def permute_row_of_int32(hidden, indices, num_experts, align=1):
    rows, m_splits, row_of = ref.permute(hidden, indices, num_experts, align)
    return rows, m_splits, row_of.int()


def permute_rows_column_major(hidden, indices, num_experts, align=1):
    rows, m_splits, row_of = ref.permute(hidden, indices, num_experts, align)
    return _noncontiguous(rows), m_splits, row_of


def permute_splits_row_vector(hidden, indices, num_experts, align=1):
    rows, m_splits, row_of = ref.permute(hidden, indices, num_experts, align)
    return rows, m_splits[None], row_of


def permute_splits_float(hidden, indices, num_experts, align=1):
    rows, m_splits, row_of = ref.permute(hidden, indices, num_experts, align)
    return rows, m_splits.float(), row_of


def grouped_noncontiguous_output(rows, m_splits, gate_up_proj, down_proj):
    return _noncontiguous(ref.grouped_mlp(rows, m_splits, gate_up_proj, down_proj))


def grouped_float64_output(rows, m_splits, gate_up_proj, down_proj):
    return ref.grouped_mlp(rows, m_splits, gate_up_proj, down_proj).double()


def quantize_int64_scales(x):
    data, scales = ref.quantize(x)
    return data, scales.long()


def quantize_column_major_data(x):
    data, scales = ref.quantize(x)
    return _noncontiguous(data), scales


def quantize_scale_values(x):
    data, scales = ref.quantize(x)
    return data, torch.exp2(scales.float() - 127)


def build_ignores_device(ops, num_experts, hidden_size, intermediate_size,
                         glu_interleave_size=None, dtype=torch.float32, device="cpu"):
    kw = dict(bias=False, dtype=dtype)
    return ops.Sequential(ops.GroupedLinear(num_experts, hidden_size, 2 * intermediate_size, **kw),
                          ops.ScaledSwiGLU(glu_interleave_size=glu_interleave_size),
                          ops.GroupedLinear(num_experts, intermediate_size, hidden_size, **kw))


def build_dtype_on_first_only(ops, num_experts, hidden_size, intermediate_size,
                              glu_interleave_size=None, dtype=torch.float32, device="cpu"):
    return ops.Sequential(
        ops.GroupedLinear(num_experts, hidden_size, 2 * intermediate_size, bias=False,
                          dtype=dtype, device=device),
        ops.ScaledSwiGLU(glu_interleave_size=glu_interleave_size),
        ops.GroupedLinear(num_experts, intermediate_size, hidden_size, bias=False, device=device))


def layer_returns_float32(mlp, hidden, indices, weights, num_experts, align):
    rows, row_weights, perm = routing.permute(hidden, indices, weights, num_experts, align)
    y = mlp(rows, perm.m_splits, row_weights, perm.m_splits)
    return routing.unpermute(y.float(), perm, None)


def _quantize_per_tensor(t, fp8_dtype):
    """Exercise 04's given quantizer: the package's per-tensor FP8 (a scale from the amax)."""
    return quant.per_tensor_quantize(t, {torch.float8_e4m3fn: quant.E4M3,
                                         torch.float8_e5m2: quant.E5M2}[fp8_dtype])


class _ScalesOnContext(torch.autograd.Function):
    """Exercise 04's layer with the scales kept as Python floats on ctx, not saved tensors."""

    @staticmethod
    def forward(ctx, x, w):
        x_q, x_inv = _quantize_per_tensor(x, torch.float8_e4m3fn)
        w_q, w_inv = _quantize_per_tensor(w, torch.float8_e4m3fn)
        ctx.save_for_backward(x_q, w_q)
        ctx.x_inv, ctx.w_inv = float(x_inv), float(w_inv)
        return (x_q.float() * ctx.x_inv) @ (w_q.float() * ctx.w_inv).T

    @staticmethod
    def backward(ctx, grad_out):
        x_q, w_q = ctx.saved_tensors
        g_q, g_inv = _quantize_per_tensor(grad_out, torch.float8_e5m2)
        g = g_q.float() * g_inv
        return g @ (w_q.float() * ctx.w_inv), g.T @ (x_q.float() * ctx.x_inv)


def linear_scales_on_ctx(x, w):
    return _ScalesOnContext.apply(x, w)


def linear_detached(x, w):
    return ref.fp8_linear(x, w).detach()


def linear_returns_bf16(x, w):
    return ref.fp8_linear(x, w).bfloat16()


def _model(num_experts, tokens, top_k, hidden, intermediate, launch_us, gflops):
    """A speedup model that behaves (exercise 06's, as a Python float)."""
    compute_us = 6 * tokens * top_k * hidden * intermediate / (gflops * 1e3)
    loop_us = 8 * min(num_experts, tokens * top_k) * launch_us + compute_us
    return loop_us / (12 * launch_us + compute_us)


def predict_tensor_of_shape_one(*args):
    return torch.tensor([_model(*args)])


def predict_zero_dim_tensor(*args):
    return torch.tensor(_model(*args), dtype=torch.float64)


def predict_numpy_float(*args):
    return np.float64(_model(*args))


def received_int32(recv_counts):
    return ref.received_experts(recv_counts).int()


def received_as_list(recv_counts):
    return ref.received_experts(recv_counts).tolist()


PASSES = None  # the expected outcome of an unusual but correct answer

# (check, the learner's answer, None when it must pass, else what the one line must say)
PROBES = [
    ("check_route", route_int32_indices, ["your indices are torch.int32, expected torch.int64",
                                          ".long()"]),
    ("check_route", route_as_list, PASSES),
    ("check_route", route_noncontiguous_weights, PASSES),
    ("check_route", route_subtracts_max_in_place, ["changed its argument `logits` in place",
                                                   "x.clone() first"]),
    ("check_load_balancing_loss", lb_returns_python_float, ["as a torch tensor", "not float"]),
    ("check_load_balancing_loss", lb_shape_one, PASSES),
    ("check_expert_loop", loop_noncontiguous_output, PASSES),
    ("check_expert_loop", loop_accumulates_into_hidden, ["changed its argument `hidden` in place"]),
    ("check_permute", permute_splits_as_list, ["m_splits is a list", "1-D int64 tensor"]),
    ("check_permute", permute_splits_int32, PASSES),
    ("check_permute", permute_row_of_int32, PASSES),
    ("check_permute", permute_rows_column_major, ["rows are not contiguous", ".contiguous()"]),
    ("check_permute", permute_splits_row_vector, ["m_splits has shape [1, 4]", "1-D tensor [E]"]),
    ("check_permute", permute_splits_float, ["m_splits is torch.float32", "int64 tensor"]),
    ("check_grouped_mlp", grouped_noncontiguous_output, PASSES),
    ("check_grouped_mlp", grouped_float64_output, ["torch.float64", "keep the rows' dtype"]),
    ("check_quantize", quantize_int64_scales, PASSES),
    ("check_quantize", quantize_column_major_data, PASSES),
    ("check_quantize", quantize_scale_values, ["scales are torch.float32", "E8M0 bytes"]),
    ("check_build_grouped_mlp", build_ignores_device, ["weights are on cpu, asked for "
                                                       "device='meta'", "device=device"]),
    ("check_build_grouped_mlp", build_dtype_on_first_only,
     ["second GroupedLinear's weights are torch.float32", "dtype=torch.bfloat16"]),
    ("check_te_ops_expert_layer", layer_returns_float32,
     ["output is torch.float32 but the hidden states are torch.bfloat16"]),
    ("check_fp8_linear", linear_scales_on_ctx, PASSES),
    ("check_fp8_linear", linear_detached, ["your output carries no gradient"]),
    ("check_fp8_linear", linear_returns_bf16, ["your output is torch.bfloat16: return float32"]),
    ("check_predict_speedup", predict_tensor_of_shape_one, ["tensor of shape [1]",
                                                            "one number"]),
    ("check_predict_speedup", predict_zero_dim_tensor, PASSES),
    ("check_predict_speedup", predict_numpy_float, PASSES),
    ("check_received_experts", received_int32, PASSES),
    ("check_received_experts", received_as_list, ["should be a torch.Tensor", "list"]),
]


@pytest.mark.parametrize("check,answer,expected", PROBES, ids=[p[1].__name__ for p in PROBES])
def test_a_check_tests_what_the_later_cells_use(check, answer, expected, capsys):
    ok = getattr(checks, check)(answer)
    out = capsys.readouterr().out
    if expected is PASSES:
        assert ok and out.startswith(f"✓ {check}"), out
        return
    assert not ok and out.startswith(f"✗ {check}"), out
    assert len(out.strip().splitlines()) == 1, out
    for phrase in expected:
        assert phrase in out, out


# ---------------------------------------------------------------------------------------------
# The harness and `pick` with bad arguments

def route(logits, top_k):
    return ref.route(logits, top_k)


def route_stub(logits, top_k):
    raise NotImplementedError("softmax over the experts in float32, torch.topk, renormalise")


def route_missing_kernel(logits, top_k):
    raise NotImplementedError("\"topk_cpu\" not implemented for 'Float8_e4m3fn'")


def test_a_check_given_the_functions_result(capsys):
    logits = torch.randn(4, 8)
    assert not checks.check_route(route(logits, 2))  # called instead of passed
    out = capsys.readouterr().out
    assert "expected your function itself, got tuple" in out
    assert "pass it without calling it, check_route(my_function)" in out


def test_a_check_given_the_unedited_stub(capsys):
    ok = checks.check_route(route_stub)
    out = capsys.readouterr().out
    assert not ok and "not implemented yet" in out and "(hint: softmax over the experts" in out
    assert checks.pick(route_stub, ref.route, ok) is ref.route
    assert "until your `route_stub` passes its check" in capsys.readouterr().out


def test_a_torch_not_implemented_error_is_a_bug_not_a_stub(capsys):
    assert not checks.check_route(route_missing_kernel)
    out = capsys.readouterr().out
    assert "raised NotImplementedError: \"topk_cpu\" not implemented" in out
    assert "not implemented yet" not in out


def test_pick_hands_over_the_function_that_passed(capsys):
    assert checks.check_route(route)
    capsys.readouterr()
    assert checks.pick(route, ref.route, True) is route
    assert "use your `route`" in capsys.readouterr().out


def test_pick_a_non_callable(capsys):
    assert checks.pick("route", ref.route, True) is ref.route
    assert "expected your function as the first argument, got str 'route'" in (
        capsys.readouterr().out)


@pytest.mark.parametrize("passed", ["yes", None, 1, checks.check_route],
                         ids=["a string", "None", "the number 1", "the check function"])
def test_pick_with_passed_not_a_checks_result(passed, capsys):
    assert checks.check_route(route)
    capsys.readouterr()
    assert checks.pick(route, ref.route, passed) is ref.route
    out = capsys.readouterr().out
    assert "the third argument should be what your check returned (True or False)" in out, out


def _define_route():
    """What running the cell `def route(...)` does: a new function object each time."""
    def route(logits, top_k):
        return ref.route(logits, top_k)
    return route


def test_pick_a_function_redefined_after_its_check_passed(capsys):
    checked = _define_route()
    assert checks.check_route(checked)
    capsys.readouterr()
    edited = _define_route()  # the def cell ran again, its check cell did not
    assert checks.pick(edited, ref.route, True) is ref.route
    assert "has not passed its check (was it edited after the check ran?)" in (
        capsys.readouterr().out)


def test_pick_told_true_for_a_function_that_failed(capsys):
    assert checks.check_route(route_int32_indices) is False
    capsys.readouterr()
    assert checks.pick(route_int32_indices, ref.route, True) is ref.route
    assert "`route_int32_indices` has not passed its check" in capsys.readouterr().out
