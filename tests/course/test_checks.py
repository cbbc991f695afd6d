"""moe_tutorial.course.checks: every check passes the solution, says "not implemented yet" for the stub,
and diagnoses plausible wrong answers in one sentence; no check ever raises.

The solution and the stub of every exercise are taken from the notebooks themselves
(`solutions/` and the generated `exercises/`), so these tests follow the single source.
"""

import json
import linecache
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_tutorial.course import checks
from moe_tutorial.moe import model, routing
from moe_tutorial.perf import timing
from moe_tutorial.precision import quant

ROOT = Path(__file__).resolve().parents[2]

# (notebook number, the learner's function, its check)
EXERCISES = [
    ("01", "route", "check_route"),
    ("01", "load_balancing_loss", "check_load_balancing_loss"),
    ("01", "expert_loop", "check_expert_loop"),
    ("02", "permute", "check_permute"),
    ("02", "grouped_mlp", "check_grouped_mlp"),
    ("03", "quantize", "check_quantize"),
    ("04", "fp8_linear", "check_fp8_linear"),
    ("05", "build_grouped_mlp", "check_build_grouped_mlp"),
    ("05", "te_ops_expert_layer", "check_te_ops_expert_layer"),
    ("06", "predict_speedup", "check_predict_speedup"),
    ("07", "exchange_counts", "check_exchange_counts"),
    ("07", "received_experts", "check_received_experts"),
    ("08", "route_sigmoid", "check_route_sigmoid"),
    ("08", "update_correction_bias", "check_update_correction_bias"),
]


def _notebook(folder: str, number: str) -> Path:
    (path,) = sorted((ROOT / folder).glob(f"{number}_*.ipynb"))
    return path


def _code_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def notebook_functions(folder: str, number: str) -> dict:
    """The namespace after running a notebook's parameters and setup cells and every cell that
    defines a function or a class (the exercises), as a learner's kernel would have it: like IPython, it
    keeps every cell's source in linecache, so that `inspect.getsource` finds the functions
    (exercise 07's check sends them to other processes by their source)."""
    cells = _code_cells(_notebook(folder, number))
    first = next(i for i, c in enumerate(cells) if "parameters" in c["metadata"].get("tags", []))
    namespace: dict = {}
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        if i in (first, first + 1) or source.startswith(("def ", "class ")):
            filename = f"{folder}/{number} cell {i}"
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            exec(compile(source, filename, "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def solutions():
    return {n: notebook_functions("solutions", n) for n in sorted({e[0] for e in EXERCISES})}


@pytest.fixture(scope="module")
def stubs():
    return {n: notebook_functions("exercises", n) for n in sorted({e[0] for e in EXERCISES})}


def _run(check: str, fn, capsys) -> tuple[bool, str]:
    ok = getattr(checks, check)(fn)
    return ok, capsys.readouterr().out


def test_every_exercise_has_a_check_a_cell_that_calls_it_and_a_fallback():
    for folder in ("solutions", "exercises"):
        for number, name, check in EXERCISES:
            text = "\n".join("".join(c["source"]) for c in _code_cells(_notebook(folder, number)))
            assert f"def {name}(" in text
            assert f"checks.{check}({name})" in text, f"{folder}/{number}: no cell runs {check}"
            assert f"checks.pick({name}, checks.reference.{name}," in text
    # a cell with solution regions defines the exercise's function at its top level (exercise 04's
    # regions sit in the methods of an autograd.Function, which the function beside it applies)
    defined = {name for number in {e[0] for e in EXERCISES}
               for cell in _code_cells(_notebook("solutions", number))
               if "### BEGIN SOLUTION" in "".join(cell["source"])
               for name in re.findall(r"^def (\w+)\(", "".join(cell["source"]), re.M)}
    assert defined == {name for _, name, _ in EXERCISES}, "every solution region is an exercise"
    assert {c for _, _, c in EXERCISES} == {n for n in dir(checks) if n.startswith("check_")}


@pytest.mark.parametrize("number,name,check", EXERCISES, ids=[e[1] for e in EXERCISES])
def test_the_solution_passes(number, name, check, solutions, capsys):
    ok, out = _run(check, solutions[number][name], capsys)
    assert ok, out
    assert out.startswith(f"✓ {check}")


@pytest.mark.parametrize("number,name,check", EXERCISES, ids=[e[1] for e in EXERCISES])
def test_the_stub_is_not_implemented_yet(number, name, check, stubs, capsys):
    ok, out = _run(check, stubs[number][name], capsys)
    assert not ok
    assert f"{check}: not implemented yet" in out and "(hint: " in out, out
    assert checks.RESULTS[check] == checks.NOT_IMPLEMENTED


# Not here: predict_speedup (no reference model: the fallback answers NaN) and build_grouped_mlp
# (the fallback is the package's own chain, experts.TEOpsExperts(...).mlp, whatever `ops` the
# check hands it; test_the_grouped_mlp_fallback covers it).
SELF_CHECKED = [e for e in EXERCISES if e[1] not in ("predict_speedup", "build_grouped_mlp")]


@pytest.mark.parametrize("number,name,check", SELF_CHECKED, ids=[e[1] for e in SELF_CHECKED])
def test_the_reference_passes_its_own_check(number, name, check, capsys):
    """`pick`'s fallback has the exercise's signature and the exercise's semantics."""
    ok, out = _run(check, getattr(checks.reference, name), capsys)
    assert ok, out


def test_the_grouped_mlp_fallback():
    """reference.build_grouped_mlp builds the package's chain; wired into the layer it computes
    the expert loop's result."""
    mlp = checks.reference.build_grouped_mlp(checks.torch_ops, 4, 32, 64, None, torch.float32, "cpu")
    for e in range(4):
        for k in (0, 2):
            torch.nn.init.normal_(mlp[k].get_parameter(f"weight{e}"), std=0.1)
    gate_up, down = (torch.stack([mlp[k].get_parameter(f"weight{e}") for e in range(4)]).detach()
                     for k in (0, 2))
    x = torch.randn(20, 32)
    weights, indices = model.route(torch.randn(20, 4), 2)
    out = checks.reference.te_ops_expert_layer(mlp, x, indices, weights, 4, 8)
    torch.testing.assert_close(out, checks.reference.expert_loop(x, indices, weights, gate_up, down),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Plausible wrong answers, and the diagnosis each must get

def route_not_renormalised(logits, top_k):
    return torch.topk(torch.softmax(logits.float(), -1), top_k, -1)


def route_softmax_in_bf16(logits, top_k):
    w, i = torch.topk(torch.softmax(logits, -1), top_k, -1)
    return w / w.sum(-1, keepdim=True), i


def route_bf16_then_float(logits, top_k):
    w, i = torch.topk(torch.softmax(logits, -1).float(), top_k, -1)
    return w / w.sum(-1, keepdim=True), i


def route_naive_exp(logits, top_k):
    e = logits.float().exp()
    w, i = (e / e.sum(-1, keepdim=True)).topk(top_k, -1)
    return w / w.sum(-1, keepdim=True), i


def route_smallest(logits, top_k):
    w, i = torch.softmax(logits.float(), -1).topk(top_k, -1, largest=False)
    return w / w.sum(-1, keepdim=True), i


def _lb(router_logits, top_k, *, per_slot=False, times_e=True, detach=False):
    logits = torch.cat([layer.float() for layer in router_logits])
    tokens, num_experts = logits.shape
    probs = logits.softmax(-1)
    chosen = probs.topk(top_k, -1).indices
    f = torch.bincount(chosen.flatten(), minlength=num_experts).float() / tokens
    f = f / top_k if per_slot else f
    loss = (f * probs.mean(0)).sum() * (num_experts if times_e else 1)
    return loss.detach() if detach else loss


def lb_divides_by_tokens_times_k(router_logits, top_k):
    return _lb(router_logits, top_k, per_slot=True)


def lb_without_e(router_logits, top_k):
    return _lb(router_logits, top_k, times_e=False)


def lb_mean_over_layers(router_logits, top_k):
    return sum(_lb([layer], top_k) for layer in router_logits) / len(router_logits)


def lb_detached(router_logits, top_k):
    return _lb(router_logits, top_k, detach=True)


def lb_differentiable_counts(router_logits, top_k):
    logits = torch.cat([layer.float() for layer in router_logits])
    tokens, num_experts = logits.shape
    probs = logits.softmax(-1)
    mask = torch.zeros_like(probs).scatter(1, probs.topk(top_k, -1).indices, 1.0)
    f = (mask * probs / probs.detach()).sum(0) / tokens  # the right value, a gradient it must not have
    return num_experts * (f * probs.mean(0)).sum()


def _loop(hidden, indices, weights, gate_up, down, *, weighted=True, swap=False, overwrite=False,
          dtype=None):
    out = torch.zeros_like(hidden, dtype=dtype or hidden.dtype)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(indices == e)
        gate, up = (hidden[token] @ gate_up[e].T).chunk(2, -1)
        if swap:
            gate, up = up, gate
        y = (F.silu(gate) * up) @ down[e].T
        if weighted:
            y = y * weights[token, slot, None]
        if overwrite:
            out[token] = y.to(out.dtype)
        else:
            out.index_add_(0, token, y.to(out.dtype))
    return out


def loop_unweighted(*args):
    return _loop(*args, weighted=False)


def loop_gate_up_swapped(*args):
    return _loop(*args, swap=True)


def loop_overwrites(*args):
    return _loop(*args, overwrite=True)


def loop_float32_output(*args):
    return _loop(*args, dtype=torch.float32)


def permute_drops_empty_experts(hidden, indices, num_experts, align=1):
    rows, m_splits, row_of = checks.reference.permute(hidden, indices, num_experts, align)
    return rows, m_splits[m_splits > 0], row_of


def permute_ignores_align(hidden, indices, num_experts, align=1):
    return checks.reference.permute(hidden, indices, num_experts, 1)


def permute_rounds_down(hidden, indices, num_experts, align=1):
    rows, _, row_of = checks.reference.permute(hidden, indices, num_experts, align)
    return rows, torch.bincount(indices.flatten(), minlength=num_experts) // align * align, row_of


def permute_inclusive_starts(hidden, indices, num_experts, align=1):
    """Block e placed at cumsum(m_splits)[e] (the end of block e) instead of its start."""
    tokens, top_k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    m_splits = (counts + align - 1) // align * align
    rank = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    row_of = torch.empty_like(flat)
    row_of[order] = (torch.cumsum(m_splits, 0)[flat[order]] + rank) % int(m_splits.sum())
    rows = hidden.new_zeros(int(m_splits.sum()), hidden.shape[1])
    rows[row_of] = hidden.repeat_interleave(top_k, 0)
    return rows, m_splits, row_of.view(tokens, top_k)


def _grouped(rows, m_splits, gate_up, down, offsets_of, act=lambda g, u: F.silu(g) * u, w_t=True):
    offs = offsets_of(torch.as_tensor(m_splits))
    h = torch._grouped_mm(rows, gate_up.transpose(-2, -1) if w_t else gate_up, offs=offs)
    gate, up = h.chunk(2, -1)
    return torch._grouped_mm(act(gate, up), down.transpose(-2, -1), offs=offs)


def grouped_block_starts(rows, m_splits, gate_up, down):
    return _grouped(rows, m_splits, gate_up, down,
                    lambda s: (torch.cumsum(s, 0) - s).to(torch.int32))


def grouped_splits_as_offsets(rows, m_splits, gate_up, down):
    return _grouped(rows, m_splits, gate_up, down, lambda s: s.to(torch.int32))


def grouped_splits_as_offsets_in_a_reused_buffer(rows, m_splits, gate_up, down):
    """The same mistake where the rows it leaves undefined happen to hold the right answer (a
    buffer the allocator hands back still holding an earlier result): CI once saw this."""
    out = grouped_splits_as_offsets(rows, m_splits, gate_up, down)
    defined = int(torch.as_tensor(m_splits).max())
    right = _grouped(rows, m_splits, gate_up, down, lambda s: torch.cumsum(s, 0).to(torch.int32))
    out[defined:] = right[defined:]
    return out


def grouped_without_silu(rows, m_splits, gate_up, down):
    return _grouped(rows, m_splits, gate_up, down, lambda s: torch.cumsum(s, 0).to(torch.int32),
                    act=lambda g, u: g * u)


def grouped_int64_offsets(rows, m_splits, gate_up, down):
    return _grouped(rows, m_splits, gate_up, down, lambda s: torch.cumsum(s, 0))


def grouped_untransposed(rows, m_splits, gate_up, down):
    return _grouped(rows, m_splits, gate_up, down, lambda s: torch.cumsum(s, 0).to(torch.int32),
                    w_t=False)


def _quantize(x, rounding=torch.ceil, per_tensor=False, blocks_of=32, *, exponent_of=None,
              signed=False, bias=127, multiply=False, zero_guard=True, fp8=True):
    """Exercise 03's quantize with one thing changed (a keyword that is not at its default)."""
    rows, n = x.shape
    blocks = F.pad(x.float(), (0, -n % blocks_of)).view(rows, -1, blocks_of)
    amax = (blocks if signed else blocks.abs()).amax(-1, keepdim=True)
    if per_tensor:
        amax = amax.amax().expand_as(amax)
    if exponent_of is None:
        e = rounding(torch.log2(amax / 448))
    else:
        e = exponent_of(amax)
    e = e.clamp(-127, 127) if zero_guard else e
    scaled = blocks * torch.exp2(e if multiply else -e)
    data = (scaled.to(torch.float8_e4m3fn) if fp8 else scaled).view(rows, -1)[:, :n]
    return data, (e + bias).squeeze(-1).to(torch.uint8)


def quantize_ocp_rule(x):
    return _quantize(x, exponent_of=lambda amax: torch.floor(torch.log2(amax)) - 8)


def quantize_divides_by_256(x):
    return _quantize(x, exponent_of=lambda amax: torch.ceil(torch.log2(amax / 256)))


def quantize_unbiased_byte(x):
    return _quantize(x, bias=0)


def quantize_log2_of_zero(x):
    """No clamp: an all-zero block's exponent stays -inf, and 0 / 2^-inf is NaN."""
    return _quantize(x, zero_guard=False)


def quantize_signed_max(x):
    return _quantize(x, signed=True)


def quantize_multiplies(x):
    return _quantize(x, multiply=True)


def quantize_float32_data(x):
    return _quantize(x, fp8=False)


def quantize_drops_the_tail(x):
    n = x.shape[1] // 32 * 32
    data, scales = _quantize(x[:, :n])
    tail = torch.zeros(x.shape[0], x.shape[1] - n, dtype=torch.uint8)
    return torch.cat([data.view(torch.uint8), tail], 1).view(torch.float8_e4m3fn), scales


def quantize_per_tensor(x):
    return _quantize(x, per_tensor=True)


def quantize_along_columns(x):
    data, scales = _quantize(x.T.contiguous())
    return data.T.contiguous(), scales.T.contiguous()


def quantize_floor(x):
    return _quantize(x, rounding=torch.floor)


def _chain(ops, e, h, i, glu, dtype, device, *, bias=False, gate_up_out=None, swiglu=True):
    kw = dict(bias=bias, device=device, dtype=dtype)
    parts = [ops.GroupedLinear(e, h, gate_up_out or 2 * i, **kw)]
    if swiglu:
        parts.append(ops.ScaledSwiGLU(glu_interleave_size=glu))
    parts.append(ops.GroupedLinear(e, i if swiglu else 2 * i, h, **kw))
    return ops.Sequential(*parts)


def build_with_bias(ops, e, h, i, glu=None, dtype=torch.float32, device="cpu"):
    return _chain(ops, e, h, i, glu, dtype, device, bias=True)


def build_gate_up_of_width_i(ops, e, h, i, glu=None, dtype=torch.float32, device="cpu"):
    return _chain(ops, e, h, i, glu, dtype, device, gate_up_out=i)


def build_without_swiglu(ops, e, h, i, glu=None, dtype=torch.float32, device="cpu"):
    return _chain(ops, e, h, i, glu, dtype, device, swiglu=False)


def build_ignores_interleave(ops, e, h, i, glu=None, dtype=torch.float32, device="cpu"):
    return _chain(ops, e, h, i, None, dtype, device)


def _layer(mlp, hidden, indices, weights, num_experts, align, *, scales="weights",
           merge_weights=False, splits="same", calls=1):
    rows, row_weights, perm = routing.permute(hidden, indices, weights, num_experts, align)
    row_scales = torch.ones_like(row_weights) if scales == "ones" else row_weights
    for _ in range(calls):
        if splits == "lists":
            y = mlp(rows, perm.m_splits.tolist(), row_scales, perm.m_splits.tolist())
        else:
            y = mlp(rows, perm.m_splits, row_scales, perm.m_splits)
    return routing.unpermute(y, perm, weights if merge_weights else None)


def layer_weights_twice(mlp, hidden, indices, weights, num_experts, align):
    return _layer(mlp, hidden, indices, weights, num_experts, align, merge_weights=True)


def layer_without_padding(mlp, hidden, indices, weights, num_experts, align):
    return _layer(mlp, hidden, indices, weights, num_experts, 1)


def layer_scales_of_one(mlp, hidden, indices, weights, num_experts, align):
    return _layer(mlp, hidden, indices, weights, num_experts, align, scales="ones",
                  merge_weights=True)


def layer_two_split_lists(mlp, hidden, indices, weights, num_experts, align):
    return _layer(mlp, hidden, indices, weights, num_experts, align, splits="lists")


def layer_calls_twice(mlp, hidden, indices, weights, num_experts, align):
    return _layer(mlp, hidden, indices, weights, num_experts, align, calls=2)


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8_linear(name, *, forward_format=E4M3, gradient_format=E5M2, quantize_gradient=True,
                backward_reads="quantized", rescale="both", w_with_x_scale=False,
                swap_scales=False, wgrad="g.T @ x", dgrad="g @ w"):
    """Exercise 04's FP8Linear with one thing changed (the keyword that is not at its default),
    on the package's quantizer."""
    def quantize(t, fp8_dtype):
        return quant.per_tensor_quantize(t, {E4M3: quant.E4M3, E5M2: quant.E5M2}[fp8_dtype])

    class Layer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            x_q, x_inv = quantize(x, forward_format)
            w_q, w_inv = quantize(w, forward_format)
            if w_with_x_scale:
                w_q, w_inv = (w / x_inv).to(forward_format), x_inv
            ctx.save_for_backward(x, w, x_q, x_inv, w_q, w_inv)
            y = x_q.float() @ w_q.float().T
            return {"both": y * (x_inv * w_inv), "none": y, "inverted": y / (x_inv * w_inv),
                    "float32": x @ w.T}[rescale]

        @staticmethod
        def backward(ctx, grad_out):
            x, w, x_q, x_inv, w_q, w_inv = ctx.saved_tensors
            g_q, g_inv = quantize(grad_out, gradient_format) if quantize_gradient else \
                (grad_out, torch.tensor(1.0))
            if backward_reads == "unquantized":
                x_q, x_inv, w_q, w_inv = x, torch.tensor(1.0), w, torch.tensor(1.0)
            if swap_scales:
                x_inv, w_inv = w_inv, x_inv
            g, xs, ws = g_q.float(), x_q.float(), w_q.float()
            grad_x = (g @ ws if dgrad == "g @ w" else g @ ws.T) * (g_inv * w_inv)
            grad_w = (g.T @ xs if wgrad == "g.T @ x" else xs.T @ g) * (g_inv * x_inv)
            return grad_x, grad_w

    def fp8_linear(x, w):
        return Layer.apply(x, w)

    fp8_linear.__name__ = name
    return fp8_linear


linear_in_float32 = _fp8_linear("linear_in_float32", rescale="float32")
linear_scales_not_undone = _fp8_linear("linear_scales_not_undone", rescale="none")
linear_scales_inverted = _fp8_linear("linear_scales_inverted", rescale="inverted")
linear_e5m2_forward = _fp8_linear("linear_e5m2_forward", forward_format=E5M2)
linear_w_with_x_scale = _fp8_linear("linear_w_with_x_scale", w_with_x_scale=True)
linear_e4m3_gradient = _fp8_linear("linear_e4m3_gradient", gradient_format=E4M3)
linear_gradient_unquantized = _fp8_linear("linear_gradient_unquantized", quantize_gradient=False)
linear_backward_reads_unquantized = _fp8_linear("linear_backward_reads_unquantized", backward_reads="unquantized")
linear_scales_swapped_in_backward = _fp8_linear("linear_scales_swapped_in_backward", swap_scales=True)
linear_wgrad_transposed = _fp8_linear("linear_wgrad_transposed", wgrad="x.T @ g")
linear_dgrad_transposed = _fp8_linear("linear_dgrad_transposed", dgrad="g @ w.T")


def _loop_and_grouped_us(num_experts, tokens, top_k, hidden, intermediate, launch_us, gflops):
    compute_us = timing.expert_mlp_flops(tokens, top_k, hidden, intermediate, backward=False) / (gflops * 1e3)
    return 8 * min(num_experts, tokens * top_k) * launch_us + compute_us, 12 * launch_us + compute_us


def predict_forgets_return(num_experts, tokens, top_k, hidden, intermediate, launch_us, gflops):
    _ = num_experts * launch_us


def predict_negative(num_experts, tokens, top_k, hidden, intermediate, launch_us, gflops):
    return 1 - num_experts


def predict_divides_by_launch(num_experts, tokens, top_k, hidden, intermediate, launch_us, gflops):
    return (8 * num_experts * launch_us) / (12 * launch_us)


def predict_a_constant(num_experts, tokens, top_k, hidden, intermediate, launch_us, gflops):
    return 2.0


def predict_grouped_over_loop(*args):
    loop_us, grouped_us = _loop_and_grouped_us(*args)
    return grouped_us / loop_us


def predict_compute_per_expert(num_experts, tokens, top_k, hidden, intermediate, launch_us, gflops):
    """Each expert charged the whole layer's FLOPs: right with the experts, wrong without launches."""
    compute_us = timing.expert_mlp_flops(tokens, top_k, hidden, intermediate, backward=False) / (gflops * 1e3)
    return num_experts * (8 * launch_us + compute_us) / (12 * launch_us + compute_us)


def predict_launches_only(num_experts, tokens, top_k, hidden, intermediate, launch_us, gflops):
    return 1 + 8 * num_experts / 12


def predict_caps_the_experts(num_experts, tokens, top_k, hidden, intermediate, launch_us, gflops):
    loop_us, grouped_us = _loop_and_grouped_us(min(num_experts, 16), tokens, top_k, hidden,
                                               intermediate, launch_us, gflops)
    return loop_us / grouped_us


# The count exchange's wrong answers run in other processes, which import them from this module
# by name (ranks.run gives them this process's sys.path); a notebook's travel as their source.

def _received(tokens_per_expert, group):
    received = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(received, tokens_per_expert, group=group)
    return received


def exchange_transposed(tokens_per_expert, group):
    return _received(tokens_per_expert, group).view(dist.get_world_size(group), -1).T


def exchange_viewed_by_columns(tokens_per_expert, group):
    """[E/ep, ep]: right when ep == E/ep, wrong on the ep=3 group."""
    return _received(tokens_per_expert, group).view(-1, dist.get_world_size(group))


def exchange_all_reduce(tokens_per_expert, group):
    total = tokens_per_expert.clone()
    dist.all_reduce(total, group=group)
    return total.view(dist.get_world_size(group), -1)


def exchange_all_gather(tokens_per_expert, group):
    ep = dist.get_world_size(group)
    everyone = tokens_per_expert.new_empty(ep * tokens_per_expert.numel())
    dist.all_gather_into_tensor(everyone, tokens_per_expert, group=group)
    return everyone.view(ep, -1)


def exchange_all_gather_then_slice(tokens_per_expert, group):
    """The right counts, by moving ep times more than needed."""
    ep = dist.get_world_size(group)
    return exchange_all_gather(tokens_per_expert, group).view(ep, ep, -1)[:, dist.get_rank(group)]


def exchange_own_counts(tokens_per_expert, group):
    return tokens_per_expert.view(dist.get_world_size(group), -1)


def exchange_without_group(tokens_per_expert, group):
    received = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(received, tokens_per_expert)  # the whole world, not the ep group
    return received.view(dist.get_world_size(group), -1)


def received_grouped_by_expert(recv_counts):
    return torch.repeat_interleave(torch.arange(recv_counts.shape[1]), recv_counts.sum(0))


def received_source_ranks(recv_counts):
    return torch.repeat_interleave(torch.arange(recv_counts.shape[0]), recv_counts.sum(1))


def received_transposed_counts(recv_counts):
    ep, per_rank = recv_counts.shape
    return torch.repeat_interleave(torch.arange(per_rank).repeat(ep), recv_counts.T.flatten())


def _route_sigmoid(logits, top_k, correction_bias=None, n_group=1, topk_group=1, normalize=True,
                   scaling_factor=1.0, *, softmax=False, bias_chooses=True, bias_weighs=False,
                   groups=True, group_score="top2", groups_on_biased=True, fill=-math.inf,
                   scale=True, norm=None, eps=1e-20, detach=False, in_bf16=False):
    """DeepSeek-V3's routing with one thing changed (the keyword that is not at its default)."""
    scores = (torch.softmax if softmax else torch.sigmoid)(
        logits if in_bf16 else logits.float(), **({"dim": -1} if softmax else {})).float()
    scores = scores.detach() if detach else scores
    bias = torch.zeros(logits.shape[-1]) if correction_bias is None else correction_bias
    for_choice = scores + bias if bias_chooses else scores
    if groups and n_group > 1:
        on = (for_choice if groups_on_biased else scores).unflatten(-1, (n_group, -1))
        group_scores = {"top2": lambda: on.topk(2, -1).values.sum(-1), "max": lambda: on.amax(-1),
                        "sum": lambda: on.sum(-1)}[group_score]()
        best = group_scores.topk(topk_group, -1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, best, True)
        mask = keep.unsqueeze(-1).expand(*keep.shape, logits.shape[-1] // n_group).flatten(-2)
        for_choice = for_choice.masked_fill(~mask, fill)
    indices = for_choice.detach().topk(top_k, -1).indices
    weights = (scores + bias if bias_weighs else scores).gather(-1, indices)
    if normalize if norm is None else norm:
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return (weights * scaling_factor if scale else weights), indices


def route_sigmoid_bias_in_the_weights(*args):
    return _route_sigmoid(*args, bias_weighs=True)


def route_sigmoid_softmax(*args):
    return _route_sigmoid(*args, softmax=True)


def route_sigmoid_without_the_group_limit(*args):
    return _route_sigmoid(*args, groups=False)


def route_sigmoid_unscaled(*args):
    return _route_sigmoid(*args, scale=False)


def route_sigmoid_always_normalised(*args):
    return _route_sigmoid(*args, norm=True)


def route_sigmoid_never_normalised(*args):
    return _route_sigmoid(*args, norm=False)


def route_sigmoid_bias_ignored(*args):
    return _route_sigmoid(*args, bias_chooses=False)


def route_sigmoid_groups_by_their_best(*args):
    return _route_sigmoid(*args, group_score="max")


def route_sigmoid_groups_by_their_sum(*args):
    return _route_sigmoid(*args, group_score="sum")


def route_sigmoid_groups_unbiased(*args):
    return _route_sigmoid(*args, groups_on_biased=False)


def route_sigmoid_masks_with_zero(*args):
    return _route_sigmoid(*args, fill=0.0)


def route_sigmoid_without_epsilon(*args):
    return _route_sigmoid(*args, eps=0.0)


def route_sigmoid_detached(*args):
    return _route_sigmoid(*args, detach=True)


def route_sigmoid_in_bf16(*args):
    return _route_sigmoid(*args, in_bf16=True)


def route_sigmoid_scaled_twice(*args):
    weights, indices = _route_sigmoid(*args)
    return weights * (args[6] if len(args) > 6 else 1.0), indices


def route_sigmoid_adds_none(logits, top_k, correction_bias=None, n_group=1, topk_group=1,
                            normalize=True, scaling_factor=1.0):
    scores = torch.sigmoid(logits.float())
    indices = (scores + correction_bias).topk(top_k, -1).indices
    return scores.gather(-1, indices), indices


def bias_update_the_wrong_way(bias, tokens_per_expert, rate):
    load = tokens_per_expert.float()
    bias += rate * torch.sign(load - load.mean())


def bias_update_proportional(bias, tokens_per_expert, rate):
    load = tokens_per_expert.float()
    bias += rate * (load.mean() - load)


def bias_update_returned(bias, tokens_per_expert, rate):
    load = tokens_per_expert.float()
    return bias + rate * torch.sign(load.mean() - load)


def bias_update_rebinds(bias, tokens_per_expert, rate):
    load = tokens_per_expert.float()
    bias = bias + rate * torch.sign(load.mean() - load)  # noqa: F841 (a new tensor; the caller's stays)


def bias_update_replaces(bias, tokens_per_expert, rate):
    load = tokens_per_expert.float()
    bias.copy_(rate * torch.sign(load.mean() - load))


def bias_update_moves_the_balanced(bias, tokens_per_expert, rate):
    load = tokens_per_expert.float()
    bias += torch.where(load > load.mean(), -rate, rate)


def bias_update_integer_mean(bias, tokens_per_expert, rate):
    bias += rate * torch.sign(tokens_per_expert.mean() - tokens_per_expert)


def bias_update_counts_in_place(bias, tokens_per_expert, rate):
    load = tokens_per_expert.float()
    bias += rate * torch.sign(load.mean() - load)
    tokens_per_expert.zero_()  # the router restarts its count itself


WRONG = [
    ("check_route", route_not_renormalised, "not 1: renormalise the top-k probabilities"),
    ("check_route", route_softmax_in_bf16, "compute the softmax in float32"),
    ("check_route", route_bf16_then_float, "do the softmax in float32 (logits.float() first)"),
    ("check_route", route_naive_exp, "exp() of large logits overflows"),
    ("check_route", route_smallest, "its least probable ones"),
    ("check_load_balancing_loss", lb_divides_by_tokens_times_k, "not by T·k"),
    ("check_load_balancing_loss", lb_without_e, "by the number of experts E = 8"),
    ("check_load_balancing_loss", lb_mean_over_layers, "the mean of the per-layer losses"),
    ("check_load_balancing_loss", lb_detached, "carries no gradient back to the router logits"),
    ("check_load_balancing_loss", lb_differentiable_counts, "right value but the wrong gradient"),
    ("check_expert_loop", loop_unweighted, "ignores the routing weights"),
    ("check_expert_loop", loop_gate_up_swapped, "you swapped gate and up"),
    ("check_expert_loop", loop_overwrites, "add the k expert contributions"),
    ("check_expert_loop", loop_float32_output, "return hidden's dtype"),
    ("check_permute", permute_drops_empty_experts,
     "expert 3 received no tokens and your permutation dropped its split"),
    ("check_permute", permute_ignores_align, "are the raw token counts: pad each to a multiple"),
    ("check_permute", permute_rounds_down, "round up, not down"),
    ("check_permute", permute_inclusive_starts, "(an exclusive cumulative sum)"),
    ("check_grouped_mlp", grouped_block_starts, "you passed the block starts"),
    ("check_grouped_mlp", grouped_splits_as_offsets,
     "you passed m_splits itself as offs: torch._grouped_mm's offs are the cumulative"),
    ("check_grouped_mlp", grouped_splits_as_offsets_in_a_reused_buffer,
     "you passed m_splits itself as offs"),
    ("check_grouped_mlp", grouped_without_silu, "without silu"),
    ("check_grouped_mlp", grouped_int64_offsets, "the offsets must be int32"),
    ("check_grouped_mlp", grouped_untransposed, "transpose the weights"),
    ("check_quantize", quantize_drops_the_tail, "need ceil(100/32) = 4 blocks, your scales have 3"),
    ("check_quantize", quantize_per_tensor, "gets its own scale from its own amax"),
    ("check_quantize", quantize_along_columns, "blocks run along the last dim"),
    ("check_quantize", quantize_floor,
     "scale is 2^0 but its largest value 480 needs 2^1: 480 / 2^0 = 480 > 448 would saturate - "
     "round the exponent up (ceil), not down"),
    ("check_quantize", quantize_ocp_rule, "round the exponent up (ceil), not down"),
    ("check_quantize", quantize_divides_by_256, "the smallest power of two"),
    ("check_quantize", quantize_unbiased_byte, "E8M0 stores it biased: E + 127 = 128"),
    ("check_quantize", quantize_log2_of_zero, "an all-zero block has amax 0"),
    ("check_quantize", quantize_signed_max, "take the amax of the absolute values"),
    ("check_quantize", quantize_multiplies, "was multiplied by the scale: divide by 2^1"),
    ("check_quantize", quantize_float32_data, "return them as torch.float8_e4m3fn"),
    ("check_build_grouped_mlp", build_with_bias, "pass bias=False"),
    ("check_build_grouped_mlp", build_gate_up_of_width_i, "2 × intermediate_size = 128"),
    ("check_build_grouped_mlp", build_without_swiglu, "your chain is [GroupedLinear, GroupedLinear]"),
    ("check_build_grouped_mlp", build_ignores_interleave, "glu_interleave_size=None, expected 32"),
    ("check_te_ops_expert_layer", layer_weights_twice, "twice (w²)"),
    ("check_te_ops_expert_layer", layer_without_padding, "padded to a multiple of 8"),
    ("check_te_ops_expert_layer", layer_scales_of_one, "ScaledSwiGLU got scales of 1"),
    ("check_te_ops_expert_layer", layer_two_split_lists, "the same split object"),
    ("check_te_ops_expert_layer", layer_calls_twice, "you called the op chain 2 times"),
    ("check_fp8_linear", linear_in_float32, "your output is float32's x @ w.T: quantize x and w"),
    ("check_fp8_linear", linear_scales_not_undone,
     "your output is the GEMM of the FP8 values with their scales still in"),
    ("check_fp8_linear", linear_scales_inverted, "you multiplied by the scales instead of undoing them"),
    ("check_fp8_linear", linear_e5m2_forward, "you quantized x and w to E5M2: the forward operands are E4M3"),
    ("check_fp8_linear", linear_w_with_x_scale, "you quantized w with x's scale"),
    ("check_fp8_linear", linear_e4m3_gradient,
     "you quantized the incoming gradient to E4M3: gradients go to E5M2"),
    ("check_fp8_linear", linear_gradient_unquantized, "you did not quantize the incoming gradient"),
    ("check_fp8_linear", linear_backward_reads_unquantized,
     "your dgrad reads the unquantized w: save the quantized w_q"),
    ("check_fp8_linear", linear_scales_swapped_in_backward,
     "your dgrad undoes x's scale instead of w's"),
    ("check_fp8_linear", linear_wgrad_transposed,
     "returned an invalid gradient at index 1 - got [48, 80] but expected shape compatible with "
     "[80, 48] - dgrad has x's shape [tokens, in], grad_x = g_q @ w_q; wgrad has w's shape [out, "
     "in], grad_w = g_q.T @ x_q"),
    ("check_fp8_linear", linear_dgrad_transposed,
     "mat1 and mat2 shapes cannot be multiplied (32x80 and 48x80) - x is [tokens, in]"),
    ("check_predict_speedup", predict_forgets_return, "your function returned None"),
    ("check_predict_speedup", predict_negative, "a finite number > 0"),
    ("check_predict_speedup", predict_divides_by_launch, "raised ZeroDivisionError"),
    ("check_predict_speedup", predict_a_constant,
     "your prediction is 2× at 2 experts and 2× at 128: it must grow with the number of experts"),
    ("check_predict_speedup", predict_grouped_over_loop,
     "your prediction falls as the experts grow (0.941× at 2, 0.0591× at 128)"),
    ("check_predict_speedup", predict_compute_per_expert,
     "as launch_us goes to 0 your prediction goes 30× at 10 µs, 32× at 0.01 µs, 32× at 0 µs, not to 1"),
    ("check_predict_speedup", predict_launches_only, "at 0 µs, not to 1: without launch costs"),
    ("check_predict_speedup", predict_caps_the_experts,
     "your prediction does not grow from 16 to 32 experts"),
    ("check_exchange_counts", exchange_transposed,
     "on ep rank 0 your counts are transposed: your row e holds what every source rank sends to "
     "local expert e"),
    ("check_exchange_counts", exchange_viewed_by_columns,
     "your counts are arranged as [E/ep, ep] = [2, 3]: the received buffer holds one block"),
    ("check_exchange_counts", exchange_all_reduce,
     "on ep rank 0 your counts are all ranks' counts summed (all_reduce)"),
    ("check_exchange_counts", exchange_all_gather,
     "on ep rank 0 you hold every rank's full counts ([ep, E] = [2, 4], what all_gather gives)"),
    ("check_exchange_counts", exchange_all_gather_then_slice,
     "right counts, but through all_gather_into_tensor"),
    ("check_exchange_counts", exchange_own_counts,
     "on ep rank 0 you returned this rank's own counts"),
    ("check_exchange_counts", exchange_without_group,
     "raised RuntimeError: in->size % context->size == 0. - pass group=group"),
    ("check_received_experts", received_grouped_by_expert,
     "your ids assume the rows arrive grouped by expert; they arrive grouped by source rank"),
    ("check_received_experts", received_source_ranks, "these are the source ranks of the rows"),
    ("check_received_experts", received_transposed_counts,
     "you paired the counts with the wrong experts"),
    ("check_route_sigmoid", route_sigmoid_bias_in_the_weights,
     "your weights include the correction bias: the bias only chooses the experts"),
    ("check_route_sigmoid", route_sigmoid_softmax, "your weights are softmax probabilities"),
    ("check_route_sigmoid", route_sigmoid_without_the_group_limit,
     "you took the top-8 of all experts: first keep each token's topk_group=4 best of its "
     "n_group=8 groups"),
    ("check_route_sigmoid", route_sigmoid_unscaled,
     "without the routed scaling factor: multiply them by scaling_factor=2.5 after normalising"),
    ("check_route_sigmoid", route_sigmoid_always_normalised, "but normalize=False asks for"),
    ("check_route_sigmoid", route_sigmoid_never_normalised,
     "your weights are the raw sigmoid scores: normalize=True asks you to divide"),
    ("check_route_sigmoid", route_sigmoid_bias_ignored,
     "you chose the experts on the unbiased scores"),
    ("check_route_sigmoid", route_sigmoid_groups_by_their_best,
     "you ranked the groups by their best expert"),
    ("check_route_sigmoid", route_sigmoid_groups_by_their_sum,
     "you ranked the groups by the sum of all their experts' scores"),
    ("check_route_sigmoid", route_sigmoid_groups_unbiased,
     "you ranked the groups on the unbiased scores"),
    ("check_route_sigmoid", route_sigmoid_masks_with_zero,
     "competed with a score of 0, which beats a negative biased score: mask them with -inf"),
    ("check_route_sigmoid", route_sigmoid_without_epsilon, "are 0 / 0 = NaN"),
    ("check_route_sigmoid", route_sigmoid_detached,
     "your weights carry no gradient back to the logits"),
    ("check_route_sigmoid", route_sigmoid_in_bf16,
     "your weights come from a sigmoid computed in torch.bfloat16"),
    ("check_route_sigmoid", route_sigmoid_scaled_twice, "you multiplied by scaling_factor=2.5 twice"),
    ("check_route_sigmoid", route_sigmoid_adds_none,
     "raised TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType' - "
     "correction_bias may be None"),
    ("check_update_correction_bias", bias_update_the_wrong_way,
     "the bias moves the wrong way: expert 0, the most loaded (10 tokens, mean 4), got +0.01"),
    ("check_update_correction_bias", bias_update_proportional,
     "your bias moves in proportion to the load difference"),
    ("check_update_correction_bias", bias_update_returned,
     "you returned the updated bias but left the one passed in unchanged"),
    ("check_update_correction_bias", bias_update_rebinds, "your function left the bias unchanged"),
    ("check_update_correction_bias", bias_update_replaces,
     "you replaced the bias by this step's change"),
    ("check_update_correction_bias", bias_update_moves_the_balanced,
     "has exactly the mean load, yet its bias moved by +0.01: sign(0) = 0 leaves it"),
    ("check_update_correction_bias", bias_update_integer_mean,
     "tokens_per_expert holds int64 counts: take tokens_per_expert.float() before the mean"),
    ("check_update_correction_bias", bias_update_counts_in_place,
     "changed its argument `tokens_per_expert` in place"),
]


def test_every_exercise_has_at_least_two_wrong_answers():
    for number, _, check in EXERCISES:
        diagnosed = sum(w[0] == check for w in WRONG)
        # exercises 04, 06 and 08 have the learner write a chapter's idea: at least three each
        assert diagnosed >= (3 if number in ("04", "06", "08") else 2), check


@pytest.mark.parametrize("check,wrong,diagnosis", WRONG, ids=[w[1].__name__ for w in WRONG])
def test_a_wrong_answer_gets_its_diagnosis(check, wrong, diagnosis, capsys):
    ok, out = _run(check, wrong, capsys)
    assert not ok
    assert out.startswith(f"✗ {check}")
    assert diagnosis in out, out
    assert len(out.strip().splitlines()) == 1, "one line per check"


def exchange_only_on_rank_0(tokens_per_expert, group):
    """Rank 0 waits in an all-to-all that no peer joins."""
    if dist.get_rank(group) == 0:
        _received(tokens_per_expert, group)
    return exchange_own_counts(tokens_per_expert, group)


def exchange_with_split_sizes_that_differ(tokens_per_expert, group):
    """Each rank sends as many counts as it has rows for a rank: the peers disagree on sizes."""
    ep = dist.get_world_size(group)
    sizes = tokens_per_expert.view(ep, -1).sum(1).tolist()
    received = tokens_per_expert.new_empty(sum(sizes))
    dist.all_to_all_single(received, torch.zeros_like(received), sizes, sizes, group=group)
    return received


def test_a_deadlocked_exchange_is_reported_not_waited_for(capsys, monkeypatch):
    monkeypatch.setattr(checks.expert_parallel_dispatch, "EXCHANGE_TIMEOUT_S", 2.0)
    ok, out = _run("check_exchange_counts", exchange_only_on_rank_0, capsys)
    assert not ok and "ep rank 0 waited in a collective that its peers never joined" in out, out
    ok, out = _run("check_exchange_counts", exchange_with_split_sizes_that_differ, capsys)
    # gloo aborts the process that receives more than it expects (or, by timing, its peer waits)
    assert not ok and ("a process died in the exchange (gloo: op.preamble.length <= op.nbytes"
                       in out or "waited in a collective that its peers never joined" in out), out
    assert len(out.strip().splitlines()) == 1


def test_a_function_that_cannot_travel_is_explained(capsys):
    ok, out = _run("check_exchange_counts", lambda counts, group: counts, capsys)
    assert not ok and "cannot send it there: a lambda cannot travel by its source" in out, out


# ---------------------------------------------------------------------------------------------
# The harness: never raises, pick, summary, torch_ops

def test_a_check_never_raises_into_the_notebook(capsys):
    def raises(*args):
        raise RuntimeError("boom\nsecond line")

    def kernel_missing(*args):
        raise NotImplementedError('"abs_cpu" not implemented for \'Float8_e4m3fn\'')

    def wrong_signature():
        return None

    assert not checks.check_route(raises)
    assert "raised RuntimeError: boom" in capsys.readouterr().out
    assert not checks.check_quantize(kernel_missing)
    out = capsys.readouterr().out
    assert "raised NotImplementedError" in out and "not implemented yet" not in out
    assert not checks.check_permute(wrong_signature)
    assert "raised TypeError" in capsys.readouterr().out
    assert not checks.check_expert_loop(42)
    assert "expected your function itself, got int" in capsys.readouterr().out
    assert not checks.check_quantize(lambda x: None)
    assert "return 2 values" in capsys.readouterr().out


def test_a_failing_check_reports_itself_instead_of_raising(capsys, monkeypatch):
    monkeypatch.setattr(checks.router_and_loop, "_verify_route", lambda case, call: 1 / 0)
    assert not checks.check_route(checks.reference.route)
    out = capsys.readouterr().out
    assert "the check itself failed" in out and "ZeroDivisionError" in out
    assert checks.RESULTS["check_route"] == checks.CHECK_ERROR


def test_the_learner_gets_copies_of_the_inputs(capsys):
    """An in-place edit never reaches the reference's inputs, and fails the check: the later
    cells use those tensors again."""
    def route_in_place(logits, top_k):
        out = checks.reference.route(logits, top_k)
        logits.zero_()  # vandalism the reference must not see
        return out

    assert not checks.check_route(route_in_place)
    out = capsys.readouterr().out
    assert "changed its argument `logits` in place" in out, out
    assert checks.check_route(checks.reference.route), capsys.readouterr().out


def test_pick(capsys):
    def mine(logits, top_k):
        return checks.reference.route(logits, top_k)

    assert checks.check_route(mine)
    capsys.readouterr()
    assert checks.pick(mine, model.route, True) is mine
    assert "use your `mine`" in capsys.readouterr().out
    assert checks.pick(mine, model.route, False) is model.route
    assert "reference (moe_tutorial.moe.model.route) until your `mine` passes" in capsys.readouterr().out
    checks.pick(mine, checks.reference.expert_loop, False)
    assert "(experts.NaiveExperts" in capsys.readouterr().out


def test_summary(capsys, monkeypatch):
    monkeypatch.setattr(checks.harness, "RESULTS", {})
    checks.summary()
    assert "no checks have run yet" in capsys.readouterr().out
    checks.check_route(checks.reference.route)
    checks.check_permute(lambda *a: (_ for _ in ()).throw(NotImplementedError("hint")))
    capsys.readouterr()
    checks.summary()
    out = capsys.readouterr().out
    assert "check_route    passed" in out and "not implemented yet" in out
    assert "1 of 2 exercises pass" in out


def test_torch_ops_match_te_semantics():
    """checks.torch_ops (experts.torch_ops, what TEOpsExperts runs without TE): TE's constructor
    defaults (bias=True), parameter names and calling convention; the chain runs each expert's
    MLP, scaled SwiGLU in between, on that expert's block of rows."""
    from moe_tutorial.moe import experts

    ops = checks.torch_ops
    assert ops is experts.torch_ops
    gen = torch.Generator().manual_seed(0)
    chain = ops.Sequential(ops.GroupedLinear(3, 16, 64), ops.ScaledSwiGLU(glu_interleave_size=16),
                           ops.GroupedLinear(3, 32, 16, bias=False))
    names = {n for n, _ in chain.named_parameters()}
    assert {"0.weight0", "0.bias2", "2.weight2"} <= names and "2.bias0" not in names
    splits = torch.tensor([4, 0, 6])
    x, scales = torch.randn(10, 16, generator=gen), torch.rand(10, generator=gen)
    want = torch.empty(10, 16)
    with torch.no_grad():
        for e in range(3):
            getattr(chain[0], f"bias{e}").normal_(generator=gen)
        for e, rows in ((0, slice(0, 4)), (2, slice(4, 10))):  # expert 1 gets no rows
            h = x[rows] @ getattr(chain[0], f"weight{e}").T + getattr(chain[0], f"bias{e}")
            want[rows] = experts.scaled_swiglu(h, scales[rows], 16) @ getattr(chain[2], f"weight{e}").T
    torch.testing.assert_close(chain(x, splits, scales, splits), want)
    with pytest.raises(ValueError, match="takes 3 extra inputs"):
        chain(x, splits, scales)


def test_the_measurement_grades_a_speedup_prediction_in_one_sentence():
    """Exercise 06's grading (`checks.grade_speedup`): right within a factor of 1.5, else how far
    off and which way; no prediction yet (NaN) is said, not graded."""
    right = checks.grade_speedup(8, 2.5, 2.0, 4.0, 2.0)
    assert right.startswith("✓ 8 experts: you predicted 2.50×, the measurement says 2.00× (loop "
                            "4.00 ms, grouped 2.00 ms): within a factor of 1.5")
    high = checks.grade_speedup(8, 7.0, 2.0, 4.0, 2.0)
    assert high.startswith("✗ 8 experts") and "3.5× too high" in high
    low = checks.grade_speedup(32, 1.0, 3.0, 6.0, 2.0)
    assert low.startswith("✗ 32 experts") and "3.0× too low" in low
    none = checks.grade_speedup(2, math.nan, 1.1, 2.2, 2.0)
    assert none.startswith("– 2 experts: no prediction to grade") and "1.10×" in none
