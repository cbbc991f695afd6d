"""Exercise checks: run a learner's function on random and edge-case inputs against the package's
own implementation, and say in one sentence what is wrong.

    ok = checks.check_route(route)        # prints a pass, "not implemented yet" or a diagnosis
    route = checks.pick(route, checks.reference.route, ok)   # later cells go on either way

Every `check_<name>(learner_fn)`:

* builds its inputs from fixed seeds (the same cases on every run): random inputs plus the edge
  cases where MoE code breaks - ties in top-k, an expert that receives no tokens, sizes that are
  not multiples of 32, bf16 inputs, all-zero MXFP8 blocks;
* compares the learner's results with the package (`routing.route`, `routing.permute`,
  `experts.naive_experts`, `quant.mxfp8_quantize(rule="te")`, `recipes.recipe_for`,
  `distributed.exchange_counts`, ...), never with a copy of the solution;
* runs a function that takes a process group on real ones: gloo groups of fresh processes
  (`moe_tutorial.ranks`), where the learner's function arrives as its source;
* prints one line and returns True / False. It never raises into the notebook: a stub's
  NotImplementedError prints "not implemented yet", an exception inside the learner's function
  is reported with the case that caused it, and a failure of the check itself says so.

`reference` holds the package's implementation of every exercise with the exercise's signature
(what `pick` falls back to), `torch_ops` the three `te.ops` the grouped MLP is built from, in
plain PyTorch (for machines without Transformer Engine), and `summary()` prints what every check
in this session reported.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from . import distributed, experts, hardware, quant, ranks, recipes, routing

PASSED, FAILED, NOT_IMPLEMENTED, CHECK_ERROR = "passed", "failed", "not implemented yet", "check error"
RESULTS: dict[str, str] = {}  # check name -> its latest outcome in this session

# torch's own NotImplementedError messages (a kernel missing for a dtype) are the learner's bug,
# not a stub: these phrases tell them apart from a stub's hint.
_TORCH_NOT_IMPLEMENTED = ("not implemented for", "Could not run", "aten::")


# ---------------------------------------------------------------------------------------------
# The harness

@dataclass
class Case:
    name: str  # how the diagnosis names the case, e.g. "ties in top-k (4 tokens, top-2)"
    args: tuple
    info: dict = field(default_factory=dict)  # whatever the verifier needs besides the args


class Failure(Exception):
    """What is wrong and how it shows, in one sentence."""


class _LearnerError(Exception):
    def __init__(self, exc: BaseException):
        super().__init__(str(exc))
        self.exc = exc


def _copy(value):
    """The learner gets copies: an in-place edit must not change the reference's inputs."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def _is_stub(exc: NotImplementedError) -> bool:
    return not any(phrase in str(exc) for phrase in _TORCH_NOT_IMPLEMENTED)


def _call(fn: Callable, *args, copy: bool = True):
    """Call the learner's function; its exceptions become _LearnerError (a stub's propagates)."""
    try:
        return fn(*(_copy(args) if copy else args))
    except NotImplementedError as exc:
        if _is_stub(exc):
            raise
        raise _LearnerError(exc) from exc
    except Exception as exc:  # anything the learner's code raises is reported, never re-raised
        raise _LearnerError(exc) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


def _report(name: str, outcome: str, message: str) -> bool:
    RESULTS[name] = outcome
    mark = {PASSED: "✓", NOT_IMPLEMENTED: "…"}.get(outcome, "✗")
    print(f"{mark} {name}: {message}")
    return outcome == PASSED


def _run(name: str, learner_fn, cases: list[Case], verify: Callable, *, against: str = "",
         error_hints: tuple[tuple[str, str], ...] = (), passed: str = "") -> bool:
    """Run `verify(case, call)` for every case; `call(*args)` runs the learner's function."""
    if not callable(learner_fn):
        return _report(name, FAILED, f"expected your function, got {type(learner_fn).__name__} "
                                     f"{learner_fn!r:.60}")
    label = f"`{getattr(learner_fn, '__name__', 'your function')}`"
    case = None
    try:
        for case in cases:
            verify(case, lambda *args, copy=True: _call(learner_fn, *args, copy=copy))
    except NotImplementedError as exc:
        hint = f" (hint: {exc})" if str(exc) else ""
        return _report(name, NOT_IMPLEMENTED,
                       f"not implemented yet - {label} still raises NotImplementedError{hint}; "
                       "fill it in and run this cell again")
    except _LearnerError as err:
        exc = err.exc
        advice = next((a for pattern, a in error_hints if pattern in f"{type(exc).__name__}: {exc}"),
                      "")
        return _report(name, FAILED, f"on {case.name}, {label} raised {type(exc).__name__}: "
                                     f"{_first_line(exc)}" + (f" - {advice}" if advice else ""))
    except Failure as failure:
        return _report(name, FAILED, f"{case.name}: {failure}")
    except Exception as exc:  # a bug in the check itself: say so, never raise into the notebook
        where = f" on {case.name}" if case else ""
        return _report(name, CHECK_ERROR, f"the check itself failed{where} ({type(exc).__name__}: "
                                          f"{_first_line(exc)}); please report this")
    names = "; ".join(dict.fromkeys(c.name.split(" (")[0].split(",")[0] for c in cases))
    return _report(name, PASSED, passed or f"all {len(cases)} cases agree with "
                                           f"{against or 'the package'} ({names})")


def pick(learner_fn, reference_fn, passed: bool):
    """The learner's function when its check passed, else the package's, so that the rest of
    the notebook runs either way (and says which one it uses)."""
    name = getattr(learner_fn, "__name__", "your function")
    if passed:
        print(f"→ the cells below use your `{name}`")
        return learner_fn
    print(f"→ the cells below use the reference ({_describe(reference_fn)}) until your `{name}` "
          "passes its check")
    return reference_fn


def _describe(fn) -> str:
    """`moe_tutorial.routing.route`, or the first docstring line of an adapter in this module."""
    module = getattr(fn, "__module__", "") or ""
    doc = (getattr(fn, "__doc__", None) or "").strip()
    if module == __name__ and doc:
        return doc.splitlines()[0]
    name = getattr(fn, "__qualname__", None)
    return f"{module}.{name}" if module and name else "the package's implementation"


def summary() -> None:
    """One line per check run in this session, and the tally."""
    if not RESULTS:
        print("no checks have run yet")
        return
    width = max(map(len, RESULTS))
    for name, outcome in RESULTS.items():
        print(f"{name:<{width}}  {outcome}")
    done = sum(o == PASSED for o in RESULTS.values())
    print(f"{done} of {len(RESULTS)} exercises pass")


# ---------------------------------------------------------------------------------------------
# Small helpers shared by the verifiers

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _as_tuple(got, size: int, names: str) -> tuple:
    if not isinstance(got, (tuple, list)) or len(got) != size:
        kind = type(got).__name__ if not isinstance(got, (tuple, list)) else f"{len(got)} values"
        raise Failure(f"return {size} values {names}; yours returned {kind}")
    return tuple(got)


def _tensor(value, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise Failure(f"{what} should be a torch.Tensor, yours is {type(value).__name__}")
    return value.detach()


def _shape(value: torch.Tensor, expected, what: str, meaning: str) -> None:
    if tuple(value.shape) != tuple(expected):
        raise Failure(f"{what} has shape {list(value.shape)}, expected {meaning} = {list(expected)}")


def _max_rel_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (NaN counts as huge)."""
    diff = (got.double() - want.double()).abs()
    if torch.isnan(diff).any() or torch.isinf(diff).any():
        return math.inf
    scale = want.double().abs().max().item() if want.numel() else 0.0
    worst = diff.max().item() if diff.numel() else 0.0
    return worst / max(scale, 1e-30)


def _mismatch(got: torch.Tensor, want: torch.Tensor, tol: float) -> torch.Tensor:
    """Elementwise: farther than tol × the reference's largest magnitude (NaN counts)."""
    limit = tol * max(want.double().abs().max().item() if want.numel() else 0.0, 1e-30)
    return ~((got.double() - want.double()).abs() <= limit)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return tuple(got.shape) == tuple(want.shape) and not _mismatch(got, want, tol).any()


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(v) for v in mask.nonzero()[0])


def _tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5


def _routing(gen, tokens: int, num_experts: int, top_k: int, *, skip_expert: int | None = None,
             scale: float = 1.0):
    """(weights fp32, indices) from random logits; `skip_expert` never gets a token."""
    logits = torch.randn(tokens, num_experts, generator=gen) * scale
    if skip_expert is not None:
        logits[:, skip_expert] = -1e4
    return routing.route(logits, top_k)


def _expert_weights(gen, num_experts: int, hidden: int, intermediate: int, dtype=torch.float32):
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * hidden ** -0.5
    down = torch.randn(num_experts, hidden, intermediate, generator=gen) * intermediate ** -0.5
    return gate_up.to(dtype), down.to(dtype)


def _swap_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-2)
    return torch.cat((up, gate), dim=-2)


def _sizes(tokens, experts_, top_k, **more) -> str:
    extra = "".join(f", {k.replace('_', ' ')} {v}" for k, v in more.items())
    return f"{tokens} tokens, {experts_} experts, top-{top_k}{extra}"


# ---------------------------------------------------------------------------------------------
# The package's implementation of every exercise, with the exercise's signature

def _reference_expert_loop(hidden, indices, weights, gate_up_proj, down_proj):
    """experts.naive_experts, HF's eager loop"""
    num_experts, two_i, hidden_size = gate_up_proj.shape
    module = experts.ExpertMLP(num_experts, hidden_size, two_i // 2, "naive",
                               dtype=gate_up_proj.dtype, device=gate_up_proj.device)
    module.load_hf_weights(gate_up_proj, down_proj)
    return experts.naive_experts(module, hidden, indices, weights)


def _reference_permute(hidden, indices, num_experts, align=1):
    """routing.permute"""
    rows, _, perm = routing.permute(hidden, indices, None, num_experts, align)
    return rows, perm.m_splits, perm.assignment_rows


def _permutation_of(row_of: torch.Tensor, num_rows: int) -> routing.Permutation:
    """A `routing.Permutation` for a buffer of `num_rows` rows whose token copies sit at
    `row_of` [T, k], the buffer taken as one block (all `unpermute` reads is the row map)."""
    flat = row_of.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    rows = torch.tensor([num_rows], device=row_of.device)
    return routing.Permutation(order // row_of.shape[1], flat[order], row_of.long(),
                               torch.tensor([flat.numel()], device=row_of.device), rows,
                               num_rows, 1)


def _reference_unpermute(rows, row_of, weights=None):
    """routing.unpermute"""
    return routing.unpermute(rows, _permutation_of(row_of, rows.shape[0]), weights)


def _offsets(m_splits) -> torch.Tensor:
    return torch.cumsum(torch.as_tensor(m_splits).long(), 0).to(torch.int32)


def _reference_grouped_mlp(rows, m_splits, gate_up_proj, down_proj):
    """experts.grouped_mm → experts.swiglu → experts.grouped_mm"""
    offsets = _offsets(m_splits).to(rows.device)
    h, _ = experts.grouped_mm(rows, gate_up_proj, offsets)
    return experts.grouped_mm(experts.swiglu(h), down_proj, offsets)[0]


def _reference_quantize_block(block):
    """quant.mxfp8_quantize(rule="te") on one block"""
    data, scales = quant.mxfp8_quantize(block.reshape(1, -1), rule="te")
    return data.reshape(-1), int(scales.reshape(-1)[0])


def _reference_quantize(x):
    """quant.mxfp8_quantize(x, rule="te")"""
    return quant.mxfp8_quantize(x, rule="te")


def _reference_dequantize(data, scales):
    """quant.mxfp8_dequantize"""
    return quant.mxfp8_dequantize(data, scales)


def _reference_build_grouped_mlp(ops, num_experts, hidden_size, intermediate_size,
                                 glu_interleave_size=None, dtype=torch.float32, device="cpu"):
    """experts.TEOpsExperts(...).mlp: te.ops on a GPU with TE, else experts.ReferenceGroupedMLP"""
    return experts.TEOpsExperts(num_experts, hidden_size, intermediate_size, dtype=dtype,
                                device=device, glu_interleave_size=glu_interleave_size).mlp


def _reference_te_ops_expert_layer(mlp, hidden, indices, weights, num_experts, align):
    """experts.dispatch → the op chain → combine, as experts.TEOpsExperts runs it"""
    te = hardware.transformer_engine() if hidden.is_cuda else None
    d = experts.dispatch(hidden, indices, weights, num_experts, align, te)
    return d.combine(mlp(d.rows, d.m_splits, d.row_weights, d.m_splits), False)


def _reference_choose_recipe(caps, preference="fastest"):
    """recipes.recipe_for"""
    choice = recipes.recipe_for(caps, preference)
    return choice.name, choice.align


def _no_prediction(*args, **kwargs):
    """no prediction: the course has no reference model, so a missing one shows as NaN"""
    return math.nan


reference = SimpleNamespace(
    route=routing.route,
    load_balancing_loss=routing.load_balancing_loss,
    expert_loop=_reference_expert_loop,
    permute=_reference_permute,
    unpermute=_reference_unpermute,
    grouped_mlp=_reference_grouped_mlp,
    quantize_block=_reference_quantize_block,
    quantize=_reference_quantize,
    dequantize=_reference_dequantize,
    build_grouped_mlp=_reference_build_grouped_mlp,
    te_ops_expert_layer=_reference_te_ops_expert_layer,
    choose_recipe=_reference_choose_recipe,
    predict_speedup=_no_prediction,
    dispatch_order=distributed.dispatch_order,
    exchange_counts=distributed.exchange_counts,
    received_experts=distributed.received_experts,
)


# ---------------------------------------------------------------------------------------------
# te.ops in plain PyTorch: the three ops of the grouped MLP, with TE's constructor arguments,
# parameter names and calling convention, for machines without Transformer Engine

class _TorchGroupedLinear(experts.ReferenceGroupedLinear):
    """`te.ops.GroupedLinear` in PyTorch: parameters `weight{g}` [out, in] (and `bias{g}` with
    bias=True, TE's default); its extra input is the split sizes."""

    num_extra_inputs = 1

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, bias: bool = True,
                 device=None, dtype=None):
        super().__init__(num_groups, in_features, out_features, dtype=dtype, device=device)
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        for g in range(num_groups):
            nn.init.normal_(getattr(self, f"weight{g}"), std=in_features ** -0.5)
            self.register_parameter(f"bias{g}", nn.Parameter(
                torch.zeros(out_features, dtype=dtype, device=device)) if bias else None)

    def forward(self, x: torch.Tensor, split_sizes) -> torch.Tensor:
        y = super().forward(x, split_sizes)
        if not self.use_bias:
            return y
        bias = torch.stack([getattr(self, f"bias{g}") for g in range(self.num_groups)])
        splits = torch.as_tensor(split_sizes, device=x.device)
        return y + bias.repeat_interleave(splits, dim=0, output_size=x.shape[0])


class _TorchScaledSwiGLU(nn.Module):
    """`te.ops.ScaledSwiGLU` in PyTorch (`experts.scaled_swiglu`); its extra input is the
    per-row scales (the routing weights)."""

    num_extra_inputs = 1

    def __init__(self, glu_interleave_size: int | None = None):
        super().__init__()
        self.glu_interleave_size = glu_interleave_size

    def forward(self, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return experts.scaled_swiglu(x, scales, self.glu_interleave_size)

    def extra_repr(self) -> str:
        return f"glu_interleave_size={self.glu_interleave_size}"


class _TorchSequential(nn.Sequential):
    """`te.ops.Sequential` in PyTorch: `seq(x, *extra_inputs)` hands each op as many extra
    inputs as it takes (`num_extra_inputs`), in order."""

    def forward(self, x: torch.Tensor, *extra_inputs):
        wanted = sum(getattr(op, "num_extra_inputs", 0) for op in self)
        if len(extra_inputs) != wanted:
            raise ValueError(f"this op chain takes {wanted} extra inputs (one for each "
                             f"GroupedLinear and ScaledSwiGLU, in order), got {len(extra_inputs)}")
        extra = iter(extra_inputs)
        for op in self:
            x = op(x, *[next(extra) for _ in range(getattr(op, "num_extra_inputs", 0))])
        return x


torch_ops = SimpleNamespace(Sequential=_TorchSequential, GroupedLinear=_TorchGroupedLinear,
                            ScaledSwiGLU=_TorchScaledSwiGLU)


# ---------------------------------------------------------------------------------------------
# 01 · the router, the load-balancing loss, the expert loop

def _route_cases() -> list[Case]:
    g = _gen(101)
    ties = torch.tensor([[2.0, 2.0, 1.0, 0.0], [1.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0],
                         [5.0, 1.0, 1.0, -1.0]])
    return [
        Case(f"random logits ({_sizes(37, 8, 2)})", (torch.randn(37, 8, generator=g) * 2, 2)),
        Case(f"top-1 routing ({_sizes(20, 4, 1)})", (torch.randn(20, 4, generator=g), 1)),
        Case("ties in top-k (4 tokens whose logits repeat, 4 experts, top-2)", (ties, 2)),
        Case(f"bf16 logits ({_sizes(33, 8, 2)})",
             ((torch.randn(33, 8, generator=g) * 3).bfloat16(), 2)),
        Case("large logits (10 tokens, 6 experts, top-2, logits of size ~100)",
             (torch.randn(10, 6, generator=g) * 100, 2)),
        Case("top-k = every expert (5 tokens, 4 experts, top-4)", (torch.randn(5, 4, generator=g), 4)),
    ]


def _verify_route(case: Case, call) -> None:
    logits, top_k = case.args
    tokens, num_experts = logits.shape
    weights, indices = _as_tuple(call(logits, top_k), 2, "(weights, indices)")
    weights, indices = _tensor(weights, "your weights"), _tensor(indices, "your indices")
    _shape(weights, (tokens, top_k), "your weights", "[tokens, top_k]")
    _shape(indices, (tokens, top_k), "your indices", "[tokens, top_k]")
    if indices.is_floating_point():
        raise Failure(f"your indices are {indices.dtype}: return the integer expert ids "
                      "(torch.topk(...).indices, int64)")
    if weights.dtype != torch.float32:
        raise Failure(f"your weights are {weights.dtype}, the router's are float32: compute the "
                      "softmax in float32 (logits.float()) whatever the logits' dtype")
    if torch.isnan(weights).any():
        raise Failure("your weights contain NaN: exp() of large logits overflows to inf - use "
                      "torch.softmax, which subtracts each row's maximum first")
    idx = indices.long()
    if (idx < 0).any() or (idx >= num_experts).any():
        bad = idx[(idx < 0) | (idx >= num_experts)][0].item()
        raise Failure(f"your indices contain {bad}, but the experts are 0..{num_experts - 1}")
    ordered = idx.sort(dim=-1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(-1)
    if repeated.any():
        t = int(repeated.nonzero()[0])
        raise Failure(f"token {t} picks the same expert twice ({idx[t].tolist()}): take the k "
                      "different most probable experts (torch.topk)")
    probs = torch.softmax(logits.float(), dim=-1)
    _, ref_indices = routing.route(logits, top_k)
    ref_top = probs.gather(1, ref_indices)
    chosen = probs.gather(1, idx)
    wrong = ((chosen.sort(-1, descending=True).values - ref_top).abs() > 1e-6).any(-1)
    if wrong.any():
        t = int(wrong.nonzero()[0])
        least = probs.topk(top_k, dim=-1, largest=False).values
        if torch.allclose(chosen.sort(-1).values, least.sort(-1).values, atol=1e-6):
            raise Failure(f"token {t} picks experts {idx[t].tolist()}, its least probable ones: "
                          "keep the largest probabilities (torch.topk(..., largest=True))")
        raise Failure(f"token {t} picks experts {idx[t].tolist()} but its {top_k} most probable "
                      f"experts are {ref_indices[t].tolist()}: take the top-k of the softmax over "
                      "the experts (dim=-1), not over the tokens")
    sums = weights.sum(-1)
    off = (sums - 1).abs()
    if off.max() > 1e-4:
        t = int(off.argmax())
        raise Failure(f"your weights sum to {sums[t].item():.3g} for token {t}, not 1: renormalise "
                      "the top-k probabilities (divide the k weights by their sum)")
    expected = chosen / chosen.sum(-1, keepdim=True)
    err = (weights - expected).abs()
    if err.max() > 1e-5:
        t = int(err.amax(-1).argmax())
        if logits.dtype != torch.float32:
            raise Failure(f"your weights are off by up to {err.max().item():.1e} for {logits.dtype} "
                          "logits: do the softmax in float32 (logits.float() first) - bf16 keeps "
                          "only 8 bits of mantissa")
        raise Failure(f"token {t}'s weights are {[round(v, 4) for v in weights[t].tolist()]} but "
                      f"its top-{top_k} probabilities renormalised are "
                      f"{[round(v, 4) for v in expected[t].tolist()]}: softmax over the experts, "
                      "top-k, then divide by their sum")


def check_route(learner_fn) -> bool:
    """`route(logits [T, E], top_k) -> (weights [T, k] fp32, indices [T, k])` against
    `routing.route`: softmax in fp32, top-k, renormalise."""
    return _run("check_route", learner_fn, _route_cases(), _verify_route,
                against="routing.route")


def _lb_cases() -> list[Case]:
    g = _gen(102)
    layers = [torch.randn(21, 6, generator=g) + torch.linspace(-1, 1, 6) * s for s in (0.0, 1.5, 3.0)]
    never = torch.randn(30, 4, generator=g)
    never[:, 3] = -20.0
    return [
        Case(f"one layer ({_sizes(37, 8, 2)})", ([torch.randn(37, 8, generator=g)], 2)),
        Case("3 layers pooled (3 × 21 tokens, 6 experts, top-2, each layer skewed differently)",
             (layers, 2)),
        Case("uniform logits (16 tokens, 4 experts, top-2: every expert tied, the loss is top_k)",
             ([torch.zeros(16, 4)], 2)),
        Case("expert 3 never chosen (30 tokens, 4 experts, top-2)", ([never], 2)),
        Case(f"bf16 logits ({_sizes(24, 8, 2)})", ([torch.randn(24, 8, generator=g).bfloat16()], 2)),
        Case(f"top-1, Switch Transformer ({_sizes(25, 5, 1)})", ([torch.randn(25, 5, generator=g)], 1)),
    ]


def _verify_lb(case: Case, call) -> None:
    layers, top_k = case.args
    num_experts = layers[0].shape[-1]
    leaves = [layer.detach().clone().requires_grad_() for layer in layers]
    loss = call(leaves, top_k, copy=False)
    if not isinstance(loss, torch.Tensor):
        raise Failure(f"return the loss as a torch tensor (one number that carries a gradient), "
                      f"not {type(loss).__name__}")
    if loss.numel() != 1:
        raise Failure(f"your loss has shape {list(loss.shape)}: return one number for all layers "
                      "together (a 0-dim tensor)")
    ref_leaves = [layer.detach().clone().requires_grad_() for layer in layers]
    ref = routing.load_balancing_loss(ref_leaves, top_k)
    mine, want = loss.detach().float().item(), ref.item()
    if not math.isfinite(mine) or abs(mine - want) > 1e-4 * max(abs(want), 1e-6):
        def near(value):
            return math.isfinite(mine) and abs(mine - value) <= 1e-4 * max(abs(value), 1e-6)
        per_layer = [routing.load_balancing_loss([layer], top_k).item() for layer in layers]
        if len(layers) > 1 and near(sum(per_layer) / len(per_layer)):
            raise Failure(f"your loss {mine:.4f} is the mean of the per-layer losses; the reference "
                          f"pools all layers' tokens first ({want:.4f}): concatenate the layers' "
                          "logits, then compute f and P once")
        if len(layers) > 1 and near(sum(per_layer)):
            raise Failure(f"your loss {mine:.4f} is the sum of the per-layer losses; the reference "
                          f"pools all layers' tokens first ({want:.4f}): concatenate the layers' "
                          "logits, then compute f and P once")
        if top_k > 1 and near(want / top_k):
            raise Failure(f"your loss is {mine:.4f}, 1/top_k of the reference {want:.4f}: f_e divides "
                          "expert e's assignments by the number of tokens T, not by T·k (so "
                          "uniform routing gives top_k)")
        if near(want / num_experts):
            raise Failure(f"your loss is {mine:.4f}, 1/E of the reference {want:.4f}: multiply "
                          f"Σ_e f_e·P_e by the number of experts E = {num_experts}")
        raise Failure(f"your loss is {mine:.4f}, the reference {want:.4f}: the loss is "
                      "E · Σ_e f_e · P_e, f_e = (token slots routed to e) / tokens, P_e = mean "
                      "softmax probability of e, all layers' tokens pooled")
    if not loss.requires_grad:
        raise Failure("your loss carries no gradient back to the router logits: compute P_e from "
                      "torch.softmax(logits) without detaching - the router learns through P_e")
    loss.backward()
    ref.backward()
    grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
    if any(not _close(g, r.grad, 1e-3) for g, r in zip(grads, ref_leaves)):
        raise Failure("your loss has the right value but the wrong gradient: the counts f_e are "
                      "constants (from the top-k indices, no gradient); the gradient flows "
                      "through P_e only")


def check_load_balancing_loss(learner_fn) -> bool:
    """`load_balancing_loss(router_logits: list of [T, E], top_k) -> scalar` against
    `routing.load_balancing_loss` (HF Mixtral's): value and gradient."""
    return _run("check_load_balancing_loss", learner_fn, _lb_cases(), _verify_lb,
                against="routing.load_balancing_loss")


def _loop_cases() -> list[Case]:
    g = _gen(103)

    def make(name, tokens, num_experts, top_k, hidden=24, inter=40, dtype=torch.float32, skip=None):
        weights, indices = _routing(g, tokens, num_experts, top_k, skip_expert=skip)
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        gate_up, down = _expert_weights(g, num_experts, hidden, inter, dtype)
        return Case(name, (x, indices, weights, gate_up, down))

    return [
        make(f"top-1 routing ({_sizes(29, 4, 1, hidden=24, width=40)})", 29, 4, 1),
        make(f"random routing ({_sizes(37, 4, 2, hidden=24, width=40)})", 37, 4, 2),
        make(f"expert 3 receives no tokens ({_sizes(30, 4, 2)})", 30, 4, 2, skip=3),
        make(f"bf16 inputs ({_sizes(33, 4, 2, hidden=32, width=48)})", 33, 4, 2, 32, 48,
             torch.bfloat16),
        make(f"many experts, few tokens each ({_sizes(11, 16, 2)})", 11, 16, 2),
    ]


def _expert_tokens(indices: torch.Tensor, expert: int) -> torch.Tensor:
    return (indices == expert).any(-1)


def _verify_loop(case: Case, call) -> None:
    hidden, indices, weights, gate_up, down = case.args
    out = _tensor(call(*case.args), "your output")
    _shape(out, hidden.shape, "your output", "[tokens, hidden]")
    if out.dtype != hidden.dtype:
        raise Failure(f"your output is {out.dtype} but the hidden states are {hidden.dtype}: "
                      "return hidden's dtype (cast each expert's output before adding it)")
    ref = reference.expert_loop(*case.args)
    tol = _tolerance(hidden.dtype)
    if _close(out, ref, tol):
        return
    variants = [
        (reference.expert_loop(hidden, indices, torch.ones_like(weights), gate_up, down),
         "your output ignores the routing weights: multiply each expert's output by the token's "
         "routing weight for that expert"),
        (reference.expert_loop(hidden, indices, weights, _swap_gate_up(gate_up), down),
         "you swapped gate and up: rows 0..I-1 of gate_up_proj[e] are the gate, and SwiGLU is "
         "silu(gate) * up"),
    ]
    if indices.shape[1] > 1:
        last = indices.argmax(-1, keepdim=True)  # the highest-numbered expert: last in the loop
        variants.append((reference.expert_loop(hidden, indices.gather(1, last),
                                               weights.gather(1, last), gate_up, down),
                         "each token keeps only the last expert's output: add the k expert "
                         "contributions (out.index_add_ or out[tokens] += ...), don't overwrite"))
    for variant, diagnosis in variants:
        if _close(out, variant, tol):
            raise Failure(diagnosis)
    token_err = _mismatch(out, ref, tol).any(-1)
    for e in range(gate_up.shape[0]):
        mine = _expert_tokens(indices, e)
        if mine.any() and torch.equal(token_err, mine):
            raise Failure(f"exactly the tokens routed to expert {e} come out wrong: check how you "
                          f"gather expert {e}'s tokens and index its weights")
    t = int(token_err.nonzero()[0]) if token_err.any() else 0
    raise Failure(f"token {t} (experts {indices[t].tolist()}) differs from the reference loop by "
                  f"{_max_rel_difference(out, ref):.1e} (relative): for each expert, gather its tokens, "
                  "down_proj[e] @ (silu(gate) * up) with gate, up = halves of gate_up_proj[e] @ x, "
                  "times the routing weight, added into the token's output")


def check_expert_loop(learner_fn) -> bool:
    """`expert_loop(hidden, indices, weights, gate_up_proj, down_proj) -> [T, H]` against
    `experts.naive_experts` (HF transformers' eager experts loop)."""
    return _run("check_expert_loop", learner_fn, _loop_cases(), _verify_loop,
                against="experts.naive_experts")


# ---------------------------------------------------------------------------------------------
# 02 · permutation, its inverse, the grouped expert MLP

def _permute_cases() -> list[Case]:
    g = _gen(104)

    def make(name, tokens, num_experts, top_k, align, hidden=24, dtype=torch.float32, skip=None):
        _, indices = _routing(g, tokens, num_experts, top_k, skip_expert=skip)
        return Case(name, (torch.randn(tokens, hidden, generator=g).to(dtype), indices,
                           num_experts, align))

    return [
        make(f"no padding ({_sizes(37, 4, 2, align=1)})", 37, 4, 2, 1),
        make(f"padding ({_sizes(37, 4, 2, align=4)})", 37, 4, 2, 4),
        make(f"expert 3 receives no tokens ({_sizes(30, 4, 2, align=8)})", 30, 4, 2, 8, skip=3),
        make(f"row counts not multiples of 32 ({_sizes(45, 6, 2, align=32)})", 45, 6, 2, 32),
        make(f"bf16 hidden states ({_sizes(33, 4, 2, align=16)})", 33, 4, 2, 16, 32, torch.bfloat16),
        make(f"top-1 ({_sizes(20, 4, 1, align=4)})", 20, 4, 1, 4),
    ]


def _verify_permute(case: Case, call) -> None:
    hidden, indices, num_experts, align = case.args
    rows, m_splits, row_of = _as_tuple(call(*case.args), 3, "(rows, m_splits, row_of)")
    _, _, perm = routing.permute(hidden, indices, None, num_experts, align)
    counts, ref_splits = perm.tokens_per_expert, perm.m_splits
    try:
        splits = torch.as_tensor(m_splits).detach().reshape(-1).long()
    except (TypeError, ValueError, RuntimeError):
        raise Failure(f"m_splits should be one row count per expert (a list or an int tensor), "
                      f"yours is {type(m_splits).__name__}") from None
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
    rows = _tensor(rows, "your rows")
    num_rows = perm.num_rows
    if rows.dim() != 2 or rows.shape[0] != num_rows or rows.shape[1] != hidden.shape[1]:
        raise Failure(f"your buffer has shape {list(rows.shape)}, but the splits add up to "
                      f"{num_rows} rows of {hidden.shape[1]} features: expert e's block is "
                      "m_splits[e] rows, its tokens first, then zero rows")
    if rows.dtype != hidden.dtype:
        raise Failure(f"your rows are {rows.dtype}, the hidden states {hidden.dtype}: copy the "
                      "rows, don't convert them")
    row_of = _tensor(row_of, "your row_of")
    _shape(row_of, indices.shape, "your row_of", "[tokens, top_k]")
    if row_of.is_floating_point():
        raise Failure(f"your row_of is {row_of.dtype}: return integer row numbers")
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


def check_permute(learner_fn) -> bool:
    """`permute(hidden [T, H], indices [T, k], num_experts, align) -> (rows [R, H], m_splits [E],
    row_of [T, k])` against `routing.permute`: every copy in its expert's block, padding zero."""
    return _run("check_permute", learner_fn, _permute_cases(), _verify_permute,
                against="routing.permute")


def _unpermute_cases() -> list[Case]:
    g = _gen(105)

    def make(name, tokens, num_experts, top_k, align, hidden=24, dtype=torch.float32, skip=None,
             weighted=True):
        weights, indices = _routing(g, tokens, num_experts, top_k, skip_expert=skip)
        x = torch.randn(tokens, hidden, generator=g)
        _, _, perm = routing.permute(x, indices, None, num_experts, align)
        outputs = torch.randn(perm.num_rows, hidden, generator=g).to(dtype)  # the experts' rows
        return Case(name, (outputs, perm.assignment_rows, weights if weighted else None),
                    {"perm": perm})

    return [
        make(f"weighted merge ({_sizes(37, 4, 2, align=1)})", 37, 4, 2, 1),
        make(f"padded buffer, expert 3 receives no tokens ({_sizes(30, 4, 2, align=8)})",
             30, 4, 2, 8, skip=3),
        make("weights=None (rows already scaled by ScaledSwiGLU: a plain sum; 25 tokens, top-2)",
             25, 4, 2, 4, weighted=False),
        make(f"bf16 expert outputs ({_sizes(33, 4, 2, align=4)})", 33, 4, 2, 4, 32, torch.bfloat16),
        make(f"top-1 ({_sizes(20, 4, 1, align=1)})", 20, 4, 1, 1),
    ]


def _verify_unpermute(case: Case, call) -> None:
    rows, row_of, weights = case.args
    perm = case.info["perm"]
    tokens, top_k = row_of.shape
    out = _tensor(call(*case.args), "your output")
    if tuple(out.shape) == (tokens, top_k, rows.shape[1]) and top_k > 1:
        raise Failure(f"your output has shape {list(out.shape)}: sum each token's {top_k} expert "
                      "outputs into one row ([tokens, hidden])")
    _shape(out, (tokens, rows.shape[1]), "your output", "[tokens, hidden]")
    if out.dtype != rows.dtype:
        raise Failure(f"your output is {out.dtype}, the expert outputs {rows.dtype}: sum in "
                      "float32 if you like, then cast back to the rows' dtype")
    ref = routing.unpermute(rows, perm, weights)
    tol = _tolerance(rows.dtype)
    if _close(out, ref, tol):
        return
    if weights is not None:
        if top_k > 1 and _close(out, routing.unpermute(rows, perm, None), tol):
            raise Failure("your output ignores the routing weights: multiply each of the k expert "
                          "outputs by its weight before summing")
        averaged = routing.unpermute(rows, perm, torch.full_like(weights, 1 / top_k))
        if top_k > 1 and _close(out, averaged, tol):
            raise Failure("you averaged the k expert outputs: weight each by its routing weight "
                          "weights[t, j] and sum")
        if top_k > 1 and _close(out, routing.unpermute(rows, perm, weights.flip(-1)), tol):
            raise Failure("your weights are paired with the wrong slots: weights[t, j] goes with "
                          "row row_of[t, j]")
    elif _close(out, routing.unpermute(rows, perm, torch.full(row_of.shape, 1 / top_k)), tol):
        raise Failure("with weights=None you averaged the k outputs: they are already scaled, so "
                      "sum them as they are")
    (t,) = _first(_mismatch(out, ref, tol).any(-1))
    raise Failure(f"token {t} differs by {_max_rel_difference(out, ref):.1e} (relative): out[t] = "
                  "Σ_j weights[t, j] · rows[row_of[t, j]] (the plain sum when weights is None)")


def check_unpermute(learner_fn) -> bool:
    """`unpermute(rows [R, H], row_of [T, k], weights [T, k] or None) -> [T, H]` against
    `routing.unpermute`."""
    return _run("check_unpermute", learner_fn, _unpermute_cases(), _verify_unpermute,
                against="routing.unpermute",
                error_hints=(("NoneType", "when weights is None the rows are already weighted "
                                          "(ScaledSwiGLU applied them): sum them as they are"),))


def _grouped_cases() -> list[Case]:
    g = _gen(106)

    def make(name, tokens, num_experts, top_k, align, hidden=24, inter=40, dtype=torch.float32,
             skip=None):
        _, indices = _routing(g, tokens, num_experts, top_k, skip_expert=skip)
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        rows, _, perm = routing.permute(x, indices, None, num_experts, align)
        gate_up, down = _expert_weights(g, num_experts, hidden, inter, dtype)
        return Case(name, (rows, perm.m_splits, gate_up, down))

    return [
        make(f"4 experts ({_sizes(37, 4, 2, hidden=24, width=40)})", 37, 4, 2, 1),
        make(f"expert 2 receives no rows ({_sizes(30, 4, 2)})", 30, 4, 2, 1, skip=2),
        make(f"padded rows ({_sizes(29, 4, 2, align=8)})", 29, 4, 2, 8),
        make(f"bf16 ({_sizes(33, 4, 2, hidden=32, width=48)})", 33, 4, 2, 1, 32, 48, torch.bfloat16),
        make(f"one expert ({_sizes(9, 1, 1)})", 9, 1, 1, 1),
    ]


def _grouped_with(rows, m_splits, gate_up, down, offsets_of, act=experts.swiglu):
    """The grouped MLP computed expert by expert with other offsets or activation; rows past the
    last offset (which torch._grouped_mm leaves undefined) are NaN."""
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
    out = _tensor(call(*case.args), "your output")
    _shape(out, (rows.shape[0], down.shape[1]), "your output", "[rows, hidden]")
    if out.dtype != rows.dtype:
        raise Failure(f"your output is {out.dtype}, the rows are {rows.dtype}: keep the rows' dtype")
    ref = reference.grouped_mlp(*case.args)
    tol = _tolerance(rows.dtype)
    if _close(out, ref, tol):
        return
    cumulative = (lambda s: torch.cumsum(s, 0))
    variants = [
        (_grouped_with(rows, m_splits, _swap_gate_up(gate_up), down, cumulative),
         "you swapped gate and up: the first I outputs of the gate-up GEMM are the gate, "
         "silu(gate) * up"),
        (_grouped_with(rows, m_splits, gate_up, down, cumulative,
                       lambda h: h.chunk(2, -1)[0] * h.chunk(2, -1)[1]),
         "you multiplied gate and up without silu: SwiGLU is silu(gate) * up"),
        (_grouped_with(rows, m_splits, gate_up, down, lambda s: torch.cumsum(s, 0) - s),
         "you passed the block starts (an exclusive cumsum) as offs: torch._grouped_mm wants each "
         "expert's row end, torch.cumsum(m_splits, 0).to(torch.int32)"),
    ]
    for variant, diagnosis in variants:
        covered = ~torch.isnan(variant).any(-1)
        if covered.any() and _close(out.double()[covered], variant[covered], tol):
            raise Failure(diagnosis)
    ends = torch.cumsum(torch.as_tensor(m_splits).long(), 0).tolist()
    starts = [0] + ends[:-1]
    blocks = [(e, s, t) for e, (s, t) in enumerate(zip(starts, ends)) if t > s]
    wrong_rows = _mismatch(out, ref, tol).any(-1).float()
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
    raise Failure(f"your output differs from the grouped MLP by {_max_rel_difference(out, ref):.1e} "
                  "(relative): per expert block, h = rows @ gate_up_proj[e].T, then "
                  "silu(h[:, :I]) * h[:, I:], then @ down_proj[e].T")


def check_grouped_mlp(learner_fn) -> bool:
    """`grouped_mlp(rows [R, H], m_splits [E], gate_up_proj [E, 2I, H], down_proj [E, H, I])
    -> [R, H]` against `experts.grouped_mm` + `experts.swiglu`."""
    return _run("check_grouped_mlp", learner_fn, _grouped_cases(), _verify_grouped,
                against="experts.grouped_mm + swiglu",
                error_hints=(("int32", "the offsets must be int32: .to(torch.int32)"),
                             ("aten::_grouped_mm", "this torch has no CPU kernel for "
                              "torch._grouped_mm (torch >= 2.9 has one): upgrade torch, or call "
                              "experts.grouped_mm, which falls back to a loop of matmuls"),
                             ("strides should be multiple of 16", "torch._grouped_mm reads rows "
                              "as 16-byte vectors; pass contiguous tensors"),
                             ("contraction dim", "transpose the weights: rows @ w[e].T, i.e. "
                              "torch._grouped_mm(rows, w.transpose(-2, -1), offs=...)"),
                             ("mat_a and mat_b", "transpose the weights: rows @ w[e].T, i.e. "
                              "torch._grouped_mm(rows, w.transpose(-2, -1), offs=...)")))


# ---------------------------------------------------------------------------------------------
# 03 · MXFP8

def _e4m3_value(code: int) -> float:
    return float(quant.decode_table(quant.E4M3)[code])


def _scale_diagnosis(amax: float, mine: int, want: int, where: str) -> str:
    """Why a block's scale byte is wrong, in one sentence."""
    e_mine, e_want = mine - 127, want - 127
    if amax == 0:
        return (f"{where} is all zeros: amax 0 gets scale byte 0 (2^-127) under TE's rule, yours "
                f"is {mine} - log2(0) is -inf, so handle amax == 0 and clamp E to [-127, 127]")
    if mine == e_want and mine != want:
        return (f"{where}'s scale byte is {mine}, the exponent E itself; E8M0 stores it biased: "
                f"E + 127 = {want}")
    if mine < want:
        return (f"{where}'s scale is 2^{e_mine} but its largest value {amax:g} needs 2^{e_want}: "
                f"{amax:g} / 2^{e_mine} = {amax / 2.0 ** e_mine:g} > 448 would saturate - round "
                "the exponent up (ceil), not down")
    return (f"{where}'s scale is 2^{e_mine} but 2^{e_want} is enough ({amax:g} / 2^{e_want} = "
            f"{amax / 2.0 ** e_want:g} ≤ 448): TE's rule takes the smallest power of two with "
            "amax / 2^E ≤ 448 (dividing by 256 or 512 instead of 448 is a common slip)")


def _code_diagnosis(x: float, scale_byte: int, mine: int, want: int, where: str) -> str:
    e = scale_byte - 127
    if mine == int(quant.fp8_encode(torch.tensor(x * 2.0 ** e))):
        return (f"{where} = {x:g} was multiplied by the scale: divide by 2^{e} before the cast "
                f"(it should be stored as {_e4m3_value(want):g}, code 0x{want:02X})")
    return (f"{where} = {x:g} should be stored as {x:g} / 2^{e} → E4M3 {_e4m3_value(want):g} "
            f"(code 0x{want:02X}); yours is {_e4m3_value(mine):g} (0x{mine:02X}): divide every "
            "element by the block's scale 2^E, then cast to float8_e4m3fn")


def _block_cases() -> list[Case]:
    g = _gen(107)

    def block(scale=1.0, n=32):
        return torch.randn(n, generator=g) * scale

    worked = (torch.rand(32, generator=g) * 6 - 3)
    worked[:3] = torch.tensor([480.0, -3.3, 0.01])
    exact = block(100).clamp(-400, 400)
    exact[7] = 448.0
    just_above = block(100).clamp(-400, 400)
    just_above[20] = 449.0
    negative = block(10)
    negative[5] = -1000.0
    return [
        Case("the worked example (largest value 480, also -3.3 and 0.01)", (worked,)),
        Case("random normal values", (block(),)),
        Case("largest value exactly 448 (scale 2^0 fits)", (exact,)),
        Case("largest value 449 (just needs 2^1)", (just_above,)),
        Case("small values (amax ~ 1e-3: a negative exponent)", (block(3e-4),)),
        Case("the largest magnitude is negative (-1000)", (negative,)),
        Case("an all-zero block", (torch.zeros(32),)),
        Case("bf16 input (amax ~ 3e4)", (block(1e4).bfloat16(),)),
    ]


def _scale_byte(value) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise Failure(f"return one scale byte for the block, yours has shape {list(value.shape)}")
        if value.is_floating_point() and value.item() != int(value.item()):
            raise Failure(f"your scale is {value.item():g}: return the E8M0 byte, the integer "
                          "E + 127 (the scale is 2^E)")
        return int(value.item())
    if isinstance(value, float) and not value.is_integer():
        raise Failure(f"your scale is {value:g}: return the E8M0 byte, the integer E + 127 "
                      "(the scale is 2^E)")
    if not isinstance(value, (int, float)):
        raise Failure(f"return the scale byte as an int, not {type(value).__name__}")
    return int(value)


def _fp8_codes(data, shape, what: str) -> torch.Tensor:
    data = _tensor(data, what)
    if data.dtype != torch.float8_e4m3fn:
        raise Failure(f"{what} are {data.dtype}: return them as torch.float8_e4m3fn "
                      "((x / 2^E).to(torch.float8_e4m3fn))")
    if tuple(data.shape) != tuple(shape):
        raise Failure(f"{what} have shape {list(data.shape)}, expected {list(shape)} (the "
                      "input's shape; drop any padding)")
    return data.view(torch.uint8).long()


def _verify_block(case: Case, call) -> None:
    (block,) = case.args
    data, scale = _as_tuple(call(block), 2, "(elements as float8_e4m3fn, scale byte)")
    ref_data, ref_byte = reference.quantize_block(block)
    mine = _scale_byte(scale)
    amax = block.float().abs().max().item()
    if mine != ref_byte:
        signed = block.float().max().item()
        if signed < amax and mine == int(quant.mx_scale_from_amax(torch.tensor(signed))):
            raise Failure(f"your scale follows the largest value {signed:g}, but the largest "
                          f"magnitude is {amax:g}: take block.abs().max()")
        raise Failure(_scale_diagnosis(amax, mine, ref_byte, "the block"))
    codes = _fp8_codes(data, block.shape, "your elements")
    want = ref_data.view(torch.uint8).long()
    if not torch.equal(codes, want) and amax == 0:
        raise Failure(f"an all-zero block must stay zeros (codes 0x00), yours has "
                      f"0x{int(codes[codes != 0][0]):02X}: with amax 0 do not divide 0 by a zero "
                      "scale (0 / 0 is NaN, code 0x7F)")
    if not torch.equal(codes, want):
        i = int((codes != want).nonzero()[0])
        raise Failure(_code_diagnosis(block[i].float().item(), ref_byte, int(codes[i]),
                                      int(want[i]), f"element {i}"))


def check_quantize_block(learner_fn) -> bool:
    """`quantize_block(block [32]) -> (elements float8_e4m3fn [32], scale byte int)` against
    `quant.mxfp8_quantize(rule="te")`: the smallest 2^E with amax / 2^E ≤ 448."""
    return _run("check_quantize_block", learner_fn, _block_cases(), _verify_block,
                against="quant.mxfp8_quantize",
                error_hints=(("-inf", "an all-zero block has amax 0: handle it (scale byte 0)"),
                             ("cannot convert float infinity", "an all-zero block has amax 0 and "
                              "log2(0) = -inf: handle it (scale byte 0)")))


def _tensor_cases() -> list[Case]:
    g = _gen(108)
    outlier = torch.randn(4, 96, generator=g)
    outlier[0, 40] = 1000.0
    zero_row = torch.randn(3, 64, generator=g)
    zero_row[1] = 0.0
    return [
        Case("4 rows × 64 values (2 blocks per row)", (torch.randn(4, 64, generator=g),)),
        Case("3 rows × 100 values (not a multiple of 32: the last block holds 4)",
             (torch.randn(3, 100, generator=g) * 5,)),
        Case("an outlier (1000) in row 0's second block", (outlier,)),
        Case("an all-zero row among random ones", (zero_row,)),
        Case("bf16 input, 2 rows × 96 values", ((torch.randn(2, 96, generator=g) * 50).bfloat16(),)),
        Case("5 rows × 33 values (a block of one value)", (torch.randn(5, 33, generator=g),)),
    ]


def _verify_tensor(case: Case, call) -> None:
    (x,) = case.args
    rows, n = x.shape
    blocks = -(-n // quant.MX_BLOCK)
    data, scales = _as_tuple(call(x), 2, "(data float8_e4m3fn, scales uint8)")
    scales = _tensor(scales, "your scales")
    ref_data, ref_scales = reference.quantize(x)
    if tuple(scales.shape) != (rows, blocks):
        if tuple(scales.shape) == (rows, n // quant.MX_BLOCK):
            raise Failure(f"{n} values per row need ceil({n}/32) = {blocks} blocks, your scales "
                          f"have {n // quant.MX_BLOCK}: pad the last block with zeros (zeros do "
                          "not change its amax)")
        if scales.numel() == 1:
            raise Failure("you computed one scale for the whole tensor: every block of 32 "
                          "consecutive values of a row gets its own scale")
        if scales.shape[-1] == n or scales.shape[0] != rows:
            raise Failure(f"your scales have shape {list(scales.shape)}: blocks run along the "
                          f"last dim (32 consecutive values of a row), so expect [rows, "
                          f"ceil(N/32)] = [{rows}, {blocks}]")
        raise Failure(f"your scales have shape {list(scales.shape)}, expected [rows, ceil(N/32)] "
                      f"= [{rows}, {blocks}]")
    if scales.is_floating_point():
        raise Failure(f"your scales are {scales.dtype}: return the E8M0 bytes (uint8, E + 127), "
                      "not the scale values 2^E")
    mine, want = scales.long(), ref_scales.long()
    if not torch.equal(mine, want):
        r, b = (int(v) for v in (mine != want).nonzero()[0])
        amax = x[r, b * 32:(b + 1) * 32].float().abs().max().item()
        if mine.unique().numel() == 1 and want.unique().numel() > 1:
            raise Failure(f"every block got the same scale byte {int(mine[0, 0])}: each block of "
                          "32 values gets its own scale from its own amax (so an outlier only "
                          f"costs its own block; row {r}, block {b} needs byte {int(want[r, b])})")
        raise Failure(_scale_diagnosis(amax, int(mine[r, b]), int(want[r, b]),
                                       f"row {r}, block {b}"))
    data = _tensor(data, "your data")
    if data.dim() == 2 and data.shape[-1] == blocks * quant.MX_BLOCK != n:
        raise Failure(f"your data has {data.shape[-1]} columns, the input {n}: drop the zero "
                      "padding of the last block")
    codes = _fp8_codes(data, x.shape, "your data")
    ref_codes = ref_data.view(torch.uint8).long()
    if not torch.equal(codes, ref_codes):
        r, c = (int(v) for v in (codes != ref_codes).nonzero()[0])
        raise Failure(_code_diagnosis(x[r, c].float().item(), int(want[r, c // 32]),
                                      int(codes[r, c]), int(ref_codes[r, c]),
                                      f"row {r}, column {c}"))


def check_quantize(learner_fn) -> bool:
    """`quantize(x [rows, N]) -> (data float8_e4m3fn [rows, N], scales uint8 [rows, ceil(N/32)])`
    against `quant.mxfp8_quantize(x, rule="te")`."""
    return _run("check_quantize", learner_fn, _tensor_cases(), _verify_tensor,
                against="quant.mxfp8_quantize")


def _dequantize_cases() -> list[Case]:
    g = _gen(109)
    wide = torch.randn(2, 128, generator=g) * (2.0 ** torch.arange(-20, 20, 10).repeat_interleave(32))
    zero_row = torch.randn(3, 64, generator=g)
    zero_row[2] = 0.0
    inputs = [
        ("4 rows × 64 values", torch.randn(4, 64, generator=g)),
        ("3 rows × 100 values (the last block holds 4)", torch.randn(3, 100, generator=g) * 7),
        ("blocks from 2^-20 to 2^10 (a wide dynamic range)", wide),
        ("an all-zero row (scale byte 0)", zero_row),
    ]
    return [Case(name, quant.mxfp8_quantize(x, rule="te")) for name, x in inputs]


def _verify_dequantize(case: Case, call) -> None:
    data, scales = case.args
    out = _tensor(call(data, scales), "your output")
    blocks_cols = scales.shape[-1] * quant.MX_BLOCK
    if out.dim() == 2 and out.shape[-1] == blocks_cols != data.shape[-1]:
        raise Failure(f"your output has {out.shape[-1]} columns, the data {data.shape[-1]}: drop "
                      "the padding of the last block")
    _shape(out, data.shape, "your output", "the data's shape")
    if out.dtype != torch.float32:
        raise Failure(f"your output is {out.dtype}: return float32")
    ref = reference.dequantize(data, scales)
    if _close(out, ref, 1e-6):
        return
    values = quant.fp8_decode(data)  # float32, as a learner's code computes it
    byte = scales.float().repeat_interleave(quant.MX_BLOCK, dim=-1)[..., :data.shape[-1]]
    variants = [
        (values * torch.exp2(byte), "you scaled by 2^byte: the byte is biased, the scale is "
                                    "2^(byte - 127)"),
        (values / torch.exp2(byte - 127), "you divided by the scale: dequantizing multiplies "
                                          "each element by 2^(byte - 127)"),
    ]
    for variant, diagnosis in variants:
        if torch.allclose(out.float(), variant, rtol=1e-6, atol=0.0, equal_nan=True):
            raise Failure(diagnosis)
    r, c = _first(_mismatch(out, ref, 1e-6))
    raise Failure(f"row {r}, column {c} decodes to {out[r, c].item():g} instead of "
                  f"{ref[r, c].item():g}: value = E4M3 element × 2^(scale byte - 127) of its "
                  "block (block = column // 32)")


def check_dequantize(learner_fn) -> bool:
    """`dequantize(data float8_e4m3fn [rows, N], scales uint8 [rows, ceil(N/32)]) -> float32`
    against `quant.mxfp8_dequantize`."""
    return _run("check_dequantize", learner_fn, _dequantize_cases(), _verify_dequantize,
                against="quant.mxfp8_dequantize",
                error_hints=(("must match the size", "cut the repeated scales to the data's N "
                              "columns ([..., :N]): the last block may hold fewer than 32 values"),))


# ---------------------------------------------------------------------------------------------
# 04 · the te.ops grouped MLP

_MLP_KINDS = ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]


def _build_cases() -> list[Case]:
    return [
        Case("4 experts, hidden 32, width 64", (4, 32, 64, None, torch.float32)),
        Case("8 experts, hidden 64, width 64, glu_interleave_size=32 (the fused kernel's layout)",
             (8, 64, 64, 32, torch.float32)),
        Case("bf16 parameters, 3 experts, hidden 32, width 48", (3, 32, 48, None, torch.bfloat16)),
    ]


def _groups(op) -> int:
    return sum(1 for name, _ in op.named_parameters(recurse=False) if name.startswith("weight"))


def _verify_build(case: Case, call) -> None:
    num_experts, hidden, inter, glu, dtype = case.args
    mlp = call(torch_ops, num_experts, hidden, inter, glu, dtype, "cpu")
    if not isinstance(mlp, torch_ops.Sequential):
        raise Failure(f"return ops.Sequential(...) (one op chain), yours is {type(mlp).__name__}")
    kinds = [type(op).__name__.removeprefix("_Torch") for op in mlp]
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
    if fc1.weight0.dtype != dtype:
        raise Failure(f"your weights are {fc1.weight0.dtype}: create the ops with dtype={dtype}")
    g = _gen(110)
    gate_up, down = _expert_weights(g, num_experts, hidden, inter, dtype)
    ref = experts.TEOpsExperts(num_experts, hidden, inter, dtype=dtype, device="cpu",
                               glu_interleave_size=glu)
    ref.load_hf_weights(gate_up, down)
    with torch.no_grad():
        for mine, theirs in ((fc1, ref.mlp[0]), (fc2, ref.mlp[2])):
            for e in range(num_experts):
                getattr(mine, f"weight{e}").copy_(getattr(theirs, f"weight{e}"))
    _, indices = _routing(g, 29, num_experts, 2)
    rows, row_weights, perm = routing.permute(torch.randn(29, hidden, generator=g).to(dtype),
                                              indices, torch.rand(29, 2, generator=g),
                                              num_experts, 1)
    want = ref.mlp(rows, perm.m_splits, row_weights, perm.m_splits)
    got = mlp(rows, perm.m_splits, row_weights, perm.m_splits)
    if not _close(got.detach(), want.detach(), _tolerance(dtype)):
        raise Failure(f"your op chain's output differs from experts.ReferenceGroupedMLP's by "
                      f"{_max_rel_difference(got.detach(), want.detach()):.1e} with the same weights")


def check_build_grouped_mlp(learner_fn) -> bool:
    """`build_grouped_mlp(ops, num_experts, hidden_size, intermediate_size, glu_interleave_size,
    dtype, device)` -> ops.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear), checked with
    `torch_ops` against `experts.TEOpsExperts`' op chain (structure, then outputs)."""
    return _run("check_build_grouped_mlp", learner_fn, _build_cases(), _verify_build,
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
    g = _gen(111)

    def make(name, tokens, num_experts, top_k, align, hidden=32, inter=64, dtype=torch.float32,
             skip=None):
        weights, indices = _routing(g, tokens, num_experts, top_k, skip_expert=skip, scale=2.0)
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        gate_up, down = _expert_weights(g, num_experts, hidden, inter, dtype)
        module = experts.TEOpsExperts(num_experts, hidden, inter, dtype=dtype, device="cpu",
                                      align=align)
        module.load_hf_weights(gate_up, down)
        return Case(name, (x, indices, weights, num_experts, align), {"module": module})

    return [
        make(f"{_sizes(37, 4, 2, align=8)}", 37, 4, 2, 8),
        make(f"expert 3 receives no tokens ({_sizes(30, 4, 2, align=16)})", 30, 4, 2, 16, skip=3),
        make(f"row counts not multiples of 32 ({_sizes(45, 6, 2, align=32)})", 45, 6, 2, 32),
        make(f"bf16 ({_sizes(33, 4, 2, align=16)})", 33, 4, 2, 16, dtype=torch.bfloat16),
    ]


def _verify_layer(case: Case, call) -> None:
    hidden, indices, weights, num_experts, align = case.args
    module = case.info["module"]
    chain = _RecordingChain(module.mlp)
    out = _tensor(call(chain, hidden, indices, weights, num_experts, align), "your output")
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
    scales = _tensor(scales, "ScaledSwiGLU's scales")
    if scales.dtype != torch.float32:
        raise Failure(f"ScaledSwiGLU's scales are {scales.dtype}: pass the routing weights in "
                      "float32 (row_weights from routing.permute)")
    real = scales[scales != 0]
    if real.numel() and torch.all(real == 1) and not torch.all(weights == 1):
        raise Failure("ScaledSwiGLU got scales of 1: give it each row's routing weight "
                      "(row_weights from routing.permute) so the weights act inside the op chain, "
                      "then unpermute with weights=None")
    _shape(out, hidden.shape, "your output", "[tokens, hidden]")
    ref = module(hidden, indices, weights)
    tol = _tolerance(hidden.dtype)
    if _close(out, ref.detach(), tol):
        return
    if _close(out, module(hidden, indices, weights * weights).detach(), tol):
        raise Failure("your output weights every expert's output twice (w²): ScaledSwiGLU already "
                      "multiplied by the routing weights, so unpermute with weights=None")
    raise Failure(f"your output differs from experts.TEOpsExperts' by "
                  f"{_max_rel_difference(out, ref.detach()):.1e} (relative): permute with the weights and "
                  "align, run the chain once, unpermute with weights=None")


def check_te_ops_expert_layer(learner_fn) -> bool:
    """`te_ops_expert_layer(mlp, hidden, indices, weights, num_experts, align) -> [T, H]`:
    permute (padding to align) → the op chain with the routing weights in ScaledSwiGLU →
    unpermute, against `experts.TEOpsExperts`; how the chain is called is recorded and checked."""
    return _run("check_te_ops_expert_layer", learner_fn, _layer_cases(), _verify_layer,
                against="experts.TEOpsExperts")


# ---------------------------------------------------------------------------------------------
# 05 · recipe, alignment, speedup

_ALIGN_WHY = {
    "MXFP8BlockScaling": "its scales cover 32 rows when the weight-gradient GEMM reads the "
                         "activations column-wise",
    "Float8BlockScaling": "TE's get_align_size_for_quantization pads every recipe but MXFP8 and "
                          "NVFP4 to 16 rows; block scaling's 1x128 and 128x128 tiles do not raise it",
    "Float8CurrentScaling": "FP8 tensor-core GEMMs need row counts that are multiples of 16",
    "DelayedScaling": "FP8 tensor-core GEMMs need row counts that are multiples of 16",
    recipes.EMULATED_MXFP8: "MXFP8's blocks are 32 values (the emulation pads like the real recipe)",
}


def _recipe_cases() -> list[Case]:
    env = hardware.fake_environment
    no_block = {"fp8": (True, ""), "fp8_block_scaling": (False, "FP8 block scaling requires CUDA "
                                                                 "12.9 or newer"),
                "mxfp8": (False, "Device compute capability 10.0 or higher required for MXFP8 "
                                 "execution.")}
    machines = [
        ("B200 (Blackwell)", env("blackwell")),
        ("H200 (Hopper)", env("hopper")),
        ("a CPU", env("cpu")),
        ("H100 with CUDA 12.8 (no FP8 block scaling)", env("hopper", gpu_name="NVIDIA H100",
                                                            cuda_version="12.8",
                                                            te_support=no_block)),
        ("L40S (Ada, compute capability 8.9)", env("hopper", gpu_name="NVIDIA L40S",
                                                   compute_capability=(8, 9), te_support=no_block)),
        ("an H200 without Transformer Engine", env("hopper", te_version=None, te_support={},
                                                   te_import_error="ImportError: No module named "
                                                                   "'transformer_engine'")),
        ("RTX PRO 6000 (Blackwell, compute capability 12.0: TE refuses MXFP8)",
         env("rtx_blackwell")),
    ]
    cases = []
    for name, environment in machines:
        caps = hardware.evaluate(environment)
        for preference in recipes.PREFERENCES:
            cases.append(Case(f"{name}, preference {preference!r}", (caps, preference),
                              {"machine": name}))
    return cases


def _verify_recipe(case: Case, call) -> None:
    caps, preference = case.args
    got = call(caps, preference)
    if isinstance(got, recipes.RecipeChoice):
        got = (got.name, got.align)
    name, align = _as_tuple(got, 2, "(recipe name, alignment)")
    want = recipes.recipe_for(caps, preference)
    machine = case.info["machine"]
    supported = recipes.supported_recipes(caps)
    if name != want.name:
        if name not in recipes.TE_RECIPES and name != recipes.EMULATED_MXFP8:
            raise Failure(f"{name!r} is not a recipe name: use a TE recipe class name "
                          f"({', '.join(recipes.TE_RECIPES)}) or {recipes.EMULATED_MXFP8!r}")
        if name in recipes.TE_RECIPES and name not in supported:
            feature = caps[recipes.recipe_capability(name)]
            native = ", ".join(supported) or f"nothing, so MXFP8 is emulated: {recipes.EMULATED_MXFP8}"
            raise Failure(f"{machine} cannot run {name} ({feature.reason}): choose among what "
                          f"caps says runs natively ({native})")
        if name == recipes.EMULATED_MXFP8:
            raise Failure(f"{machine} runs {', '.join(supported)} natively: emulate MXFP8 only "
                          "where no TE FP8 recipe runs")
        raise Failure(f"with preference {preference!r}, {machine} should use {want.name}, yours "
                      f"is {name}: {want.reason}")
    if not isinstance(align, int) or align != want.align:
        raise Failure(f"{want.name} needs every expert's rows padded to a multiple of "
                      f"{want.align} ({_ALIGN_WHY[want.name]}); yours is {align!r}")


def check_choose_recipe(learner_fn) -> bool:
    """`choose_recipe(caps, preference) -> (recipe name, alignment)` against `recipes.recipe_for`
    on fake Blackwell, Hopper, Ada and CPU machines (`hardware.fake_environment`)."""
    return _run("check_choose_recipe", learner_fn, _recipe_cases(), _verify_recipe,
                against="recipes.recipe_for")


def _prediction_cases() -> list[Case]:
    shapes = [(2, 2048, 2, 128, 256, 10.0, 50.0), (64, 2048, 2, 128, 256, 10.0, 50.0),
              (8, 16384, 2, 1024, 2816, 5.0, 500_000.0), (32, 8, 2, 64, 128, 10.0, 50.0),
              (8, 2048, 2, 128, 256, 0.0, 50.0)]
    names = ["2 experts, 2048 tokens", "64 experts, 2048 tokens", "a GPU-sized layer",
             "fewer token copies (16) than experts (32)", "no launch overhead (launch_us=0)"]
    return [Case(name, args) for name, args in zip(names, shapes)]


def _verify_prediction(case: Case, call) -> None:
    got = call(*case.args)
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if got is None:
        raise Failure("your function returned None: return the predicted speedup (loop time / "
                      "grouped time) as a number")
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        raise Failure(f"return the predicted speedup as a number, not {type(got).__name__}")
    if not math.isfinite(got) or got <= 0:
        raise Failure(f"your prediction is {got}: a speedup is a ratio of two times, a finite "
                      "number > 0")
    case.info["prediction"] = got


def check_predict_speedup(learner_fn) -> bool:
    """`predict_speedup(num_experts, tokens, top_k, hidden, intermediate, launch_us, gflops)
    -> float`: only that it answers with a positive finite number for every case. Predictions
    are compared with measurements in the notebook, not graded: a model can be wrong."""
    cases = _prediction_cases()
    ok = _run("check_predict_speedup", learner_fn, cases, _verify_prediction,
              passed="a positive finite prediction for every case (not graded: the notebook "
                     "compares it with measurements)")
    if ok:
        print("  " + "; ".join(f"{c.name}: {c.info['prediction']:.3g}×" for c in cases))
    return ok


# ---------------------------------------------------------------------------------------------
# 06 · expert parallelism: the dispatch order, the count exchange, the received rows' experts

def _dispatch_cases() -> list[Case]:
    g = _gen(112)

    def make(name, tokens, num_experts, top_k, ep, starve=()):
        # low-numbered experts are popular: the ranks get different numbers of rows
        logits = torch.randn(tokens, num_experts, generator=g) + torch.linspace(1, -1, num_experts)
        logits[:, list(starve)] = -1e4
        _, indices = routing.route(logits, top_k)
        return Case(name, (indices, num_experts, ep))

    return [
        make(f"uneven routing ({_sizes(37, 4, 2)}, ep=2)", 37, 4, 2, 2),
        make(f"expert 1 receives no tokens ({_sizes(30, 4, 2)}, ep=2)", 30, 4, 2, 2, (1,)),
        make(f"rank 1's experts 4-7 receive no tokens ({_sizes(26, 8, 2)}, ep=2)", 26, 8, 2, 2,
             (4, 5, 6, 7)),
        make(f"ep=3, 2 experts per rank ({_sizes(33, 6, 2)})", 33, 6, 2, 3),
        make(f"ep=4, 2 experts per rank ({_sizes(45, 8, 2)})", 45, 8, 2, 4),
        make(f"top-1, one expert per rank ({_sizes(20, 4, 1)}, ep=4)", 20, 4, 1, 4),
    ]


def _experts_of(rank: int, per_rank: int) -> str:
    first, last = rank * per_rank, (rank + 1) * per_rank - 1
    return f"expert {first}" if first == last else f"experts {first}-{last}"


def _verify_dispatch_counts(counts, want: torch.Tensor) -> None:
    num_experts = want.numel()
    counts = _tensor(counts, "your tokens_per_expert")
    if counts.is_floating_point():
        raise Failure(f"your tokens_per_expert is {counts.dtype}: count with integers "
                      "(torch.bincount gives int64) - the count exchange sends them as they are")
    if counts.numel() != num_experts:
        empty = [e for e in range(num_experts) if want[e] == 0]
        if empty and counts.numel() < num_experts:
            raise Failure(f"expert {empty[-1]} receives no tokens and your tokens_per_expert has "
                          f"{counts.numel()} entries: one per expert, zeros included "
                          "(torch.bincount(..., minlength=num_experts)) - the receiving rank "
                          "reads expert e's count at position e")
        raise Failure(f"your tokens_per_expert has {counts.numel()} entries; it needs one per "
                      f"expert ({num_experts})")
    counts = counts.reshape(-1).long()
    if not torch.equal(counts, want):
        e = int((counts != want).nonzero()[0])
        raise Failure(f"expert {e} gets {int(want[e])} token copies, your tokens_per_expert says "
                      f"{int(counts[e])}: count every (token, slot) pair, "
                      "torch.bincount(indices.flatten(), minlength=num_experts)")


def _verify_rows_per_rank(sends, indices: torch.Tensor, counts: torch.Tensor,
                          want: torch.Tensor) -> None:
    ep, num_experts = want.numel(), counts.numel()
    per_rank = num_experts // ep
    try:
        sends = torch.as_tensor(sends).detach().reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        raise Failure(f"rows_per_rank should be one row count per rank (a list or an int tensor), "
                      f"yours is {type(sends).__name__}") from None
    if torch.equal(sends.long(), want) and not sends.is_floating_point():
        return
    every_ep_th = counts.view(per_rank, ep).sum(0)  # rank r holding experts r, r + ep, ...
    by_e_over_ep = torch.bincount(indices.flatten() // ep, minlength=ep)  # not e // (E/ep)
    if per_rank > 1 and ep > 1 and torch.equal(sends.long(), every_ep_th):
        raise Failure(f"your rows_per_rank {sends.tolist()} adds up every ep-th expert (rank 0: "
                      f"experts 0, {ep}, …), but rank r owns the contiguous block of experts "
                      "r·E/ep … (r+1)·E/ep − 1: tokens_per_expert.view(ep, E/ep).sum(1)")
    if per_rank != ep and torch.equal(sends.long(), by_e_over_ep):
        raise Failure(f"expert e lives on rank e // (E/ep) = e // {per_rank}, not e // ep = "
                      f"e // {ep}: tokens_per_expert.view(ep, E/ep).sum(1)")
    if sends.numel() != ep:
        raise Failure(f"your rows_per_rank has {sends.numel()} entries; it needs one per rank of "
                      f"the ep group ({ep})")
    if sends.is_floating_point():
        raise Failure(f"your rows_per_rank is {sends.dtype}: the all-to-all's split sizes are "
                      "integers")
    r = int((sends.long() != want).nonzero()[0])
    raise Failure(f"rank {r} owns {_experts_of(r, per_rank)}, which get {int(want[r])} of this "
                  f"rank's copies; your rows_per_rank says {int(sends[r])}: sum tokens_per_expert "
                  "over each rank's block of E/ep experts")


def _verify_dispatch(case: Case, call) -> None:
    indices, num_experts, ep = case.args
    order, counts, sends = _as_tuple(call(*case.args), 3,
                                     "(order, tokens_per_expert, rows_per_rank)")
    want_order, want_counts, want_sends = distributed.dispatch_order(indices, num_experts, ep)
    _verify_dispatch_counts(counts, want_counts)
    _verify_rows_per_rank(sends, indices, want_counts, want_sends)
    order = _tensor(order, "your order")
    copies, top_k = indices.numel(), indices.shape[1]
    if order.is_floating_point():
        raise Failure(f"your order is {order.dtype}: return integer copy numbers (torch.argsort "
                      "gives int64)")
    if order.dim() != 1 or order.numel() != copies:
        raise Failure(f"your order has shape {list(order.shape)}, expected one entry per token "
                      f"copy, [T·k] = [{copies}]: sort indices.flatten()")
    order = order.long()
    if torch.equal(order, want_order):
        return
    if top_k > 1 and torch.equal(order, want_order // top_k):
        raise Failure("your order holds token numbers t; return copy numbers t·k + j: a token's k "
                      "copies go to different experts, and weights.flatten()[order] must find "
                      "each copy's own routing weight")
    if not torch.equal(order.sort().values, torch.arange(copies)):
        raise Failure(f"your order is not a permutation of the copy numbers 0 … T·k − 1 = "
                      f"{copies - 1}: order[i] is the copy (t·k + j) that goes to row i")
    if torch.equal(order, torch.argsort(want_order)):
        raise Failure("your order is the inverse permutation (the row each copy goes to): "
                      "order[i] must be the copy t·k + j that goes to row i, so that "
                      "indices.flatten()[order] is sorted - torch.argsort gives exactly that")
    experts_in_order = indices.reshape(-1)[order]
    if (experts_in_order[1:] < experts_in_order[:-1]).any():
        rank_in_order = experts_in_order // (num_experts // ep)
        if not (rank_in_order[1:] < rank_in_order[:-1]).any():
            r = int(rank_in_order[(experts_in_order[1:] < experts_in_order[:-1]).nonzero()[0]])
            block = experts_in_order[rank_in_order == r].tolist()
            raise Failure(f"your order sorts the copies by destination rank but not by expert "
                          f"within a rank (rank {r}'s rows are for experts {block[:8]}…): the "
                          "receiver splits each sender's rows by expert (recv_counts), so sort by "
                          "expert id - experts being sharded contiguously, that sorts by rank too")
        raise Failure("indices.flatten()[order] is not sorted: order must put the copies in "
                      "order of their expert (torch.argsort(indices.flatten(), stable=True))")
    e = int(experts_in_order[(order != want_order).nonzero()[0]])
    mine = order[experts_in_order == e].tolist()
    raise Failure(f"your order groups the copies by expert but not in token order within an "
                  f"expert (expert {e}: copies {mine[:6]}…, in order {sorted(mine)[:6]}…): sort "
                  "stably, torch.argsort(..., stable=True), as the package does - an unstable "
                  "sort may order them differently from run to run")


def check_dispatch_order(learner_fn) -> bool:
    """`dispatch_order(indices [T, k], num_experts, ep) -> (order [T·k], tokens_per_expert [E],
    rows_per_rank [ep])` against `distributed.dispatch_order`: the stable sort of the copies by
    expert, the counts per expert (zeros included) and per rank's contiguous block of experts."""
    return _run("check_dispatch_order", learner_fn, _dispatch_cases(), _verify_dispatch,
                against="distributed.dispatch_order")


# The count exchange runs on real process groups: `EXCHANGE_WORLD` gloo processes, each case on
# a group of some of them. A collective of the check waits at most EXCHANGE_TIMEOUT_S for its
# peers, so a learner's deadlock costs seconds, not a hang.
EXCHANGE_WORLD = 3
EXCHANGE_TIMEOUT_S = 5.0
# torch.distributed's collectives, recorded when the learner's function calls them
_COLLECTIVES = ("all_to_all_single", "all_to_all", "all_reduce", "all_gather",
                "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
                "gather", "scatter", "send", "recv", "isend", "irecv")


def _exchange_cases() -> list[Case]:
    g = _gen(113)

    def make(name, members, num_experts, tokens, top_k, starve=()):
        counts = []
        for _ in members:  # every rank routes its own tokens
            logits = (torch.randn(tokens, num_experts, generator=g)
                      + torch.linspace(1.5, -1.5, num_experts))
            logits[:, list(starve)] = -1e4
            _, indices = routing.route(logits, top_k)
            counts.append(distributed.dispatch_order(indices, num_experts, len(members))[1])
        return Case(name, (torch.stack(counts), members))

    return [
        make("uneven routing (ep=2, 4 experts: 2 per rank, 23 tokens each, top-2)",
             [0, 1], 4, 23, 2),
        make("ep rank 1's experts 2-3 receive no tokens (ep=2, 4 experts, 19 tokens each, top-2)",
             [0, 1], 4, 19, 2, (2, 3)),
        make("ep=3, 6 experts: 2 per rank (29 tokens each, top-2)", [0, 1, 2], 6, 29, 2),
        make("one expert per rank (ep=3, 3 experts, 17 tokens each, top-1)", [0, 1, 2], 3, 17, 1),
    ]


@contextlib.contextmanager
def _recording_collectives(log: list[str]):
    """Every call of a torch.distributed collective appends its name to `log` (both modules
    that hold them are patched, so `from torch.distributed import ...` is recorded too)."""
    from torch.distributed import distributed_c10d

    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def recording(name, fn):
        @functools.wraps(fn)
        def collective(*args, **kwargs):
            log.append(name)
            return fn(*args, **kwargs)
        return collective

    try:
        for name, fn in originals.items():
            for module in (dist, distributed_c10d):
                setattr(module, name, recording(name, fn))
        yield
    finally:
        for name, fn in originals.items():
            for module in (dist, distributed_c10d):
                setattr(module, name, fn)


def _exchange_on_this_rank(learner: ranks.Shipped, cases: list[tuple[list[int], list[list[int]]]],
                           timeout_s: float) -> dict[int, dict]:
    """One rank of check_exchange_counts (run by `ranks.run`): for every case this rank takes part
    in, the package's exchange and the learner's on process groups of the case's ranks. Returns
    {case number: {"want", "got" (or "got_type"), "collectives"} or {"raised", "stub"}}; stops
    at the learner's first exception (its peers then fail fast: "Connection closed by peer"), or
    when a peer has stopped."""
    rank = dist.get_rank()
    timeout = timedelta(seconds=timeout_s)
    # new_group is collective: every rank creates every group, in the same order. Each case gets
    # its own group for the learner, so a collective of theirs that never completes cannot pair
    # up with a later one.
    groups = [(dist.new_group(members, timeout=timeout), dist.new_group(members, timeout=timeout))
              for members, _ in cases]
    outcomes, log, learner_fn = {}, [], None
    with _recording_collectives(log):
        for number, ((members, counts), (package_group, learner_group)) in enumerate(
                zip(cases, groups)):
            if rank not in members:
                continue
            mine = torch.tensor(counts[members.index(rank)])
            try:
                want = distributed.exchange_counts(mine.clone(), package_group)
            except RuntimeError as exc:
                if ranks.is_peer_failure(str(exc)):
                    break  # a peer stopped after the learner's function failed there: reported
                raise
            log.clear()
            try:
                # rebuilt after the patching, so that collectives it imported are recorded too
                learner_fn = learner_fn or ranks.rebuild(learner)
                got = learner_fn(mine.clone(), learner_group)
            except Exception as exc:  # reported by the parent, with the case
                stub = isinstance(exc, NotImplementedError) and _is_stub(exc)
                message = str(exc).strip() if stub else _first_line(exc)  # a hint, in full
                outcomes[number] = {"raised": (type(exc).__name__, message), "stub": stub}
                break
            outcome = {"want": want, "collectives": list(log)}
            if isinstance(got, torch.Tensor):
                outcome["got"] = got.detach().clone()
            else:
                outcome["got_type"] = type(got).__name__
            outcomes[number] = outcome
    return outcomes


def _exchange_on_ranks(learner_fn, cases: list[Case]) -> list[dict[int, dict]]:
    """Every rank's outcomes: one launch of EXCHANGE_WORLD processes for all the cases."""
    try:
        shipped = ranks.ship(learner_fn)
    except ranks.ShipError as exc:
        raise Failure(f"the check runs your function in {EXCHANGE_WORLD} fresh processes and "
                      f"cannot send it there: {exc}") from None
    plan = [(members, counts.tolist()) for counts, members in (c.args for c in cases)]
    try:
        return ranks.run(_exchange_on_this_rank, EXCHANGE_WORLD, shipped, plan,
                         EXCHANGE_TIMEOUT_S)
    except ranks.RankError as err:
        if err.type_name == ranks.STOPPED:
            raise Failure(f"your function never returned on rank {err.rank} (stopped "
                          f"{ranks.GRACE_S:.0f} s after another rank gave up waiting for it): "
                          "every rank must make the same collective calls and return") from None
        if err.type_name == ranks.PROCESS_DIED:  # gloo aborts a process on mismatched sizes
            raise Failure(f"a process died in the exchange (gloo: {_gloo_message(err.message)}): "
                          "the ranks' split sizes must match - with no split sizes, every rank's "
                          "input and output hold E counts") from None
        raise  # the check's own failure
    except ranks.RunTimeout:
        raise Failure("your function never returned (the processes were stopped): every rank "
                      "must make the same collective calls and return") from None


def _gloo_message(message: str) -> str:
    """gloo's error text without its source locations ("[.../pair.cc:456] ") and C++'s
    "what():", cut after a sentence."""
    text = re.sub(r"\[[^\]]*\.cc:\d+\]|what\(\):", "", message)
    text = " ".join(text.split())
    return text if len(text) <= 160 else text[:text.rfind(". ", 0, 160) + 1 or 160]


def _remote_error(type_name: str, message: str) -> Exception:
    """An exception raised in another process, as `_run` reports it: its type's name, its text."""
    return type(type_name, (Exception,), {})(_gloo_message(message))


def _diagnose_exchange(outcome: dict, counts: torch.Tensor, r: int) -> None:
    ep, num_experts = counts.shape
    per_rank = num_experts // ep
    mine = _experts_of(r, per_rank)
    want = outcome["want"]
    if "got_type" in outcome:
        raise Failure(f"return recv_counts as a torch.Tensor [ep, E/ep]; yours is "
                      f"{outcome['got_type']} (on ep rank {r})")
    got = outcome["got"]
    if got.is_floating_point():
        raise Failure(f"your counts are {got.dtype}: exchange the int64 counts as they are (an "
                      "output buffer made with torch.empty_like(tokens_per_expert))")

    def same(expected: torch.Tensor) -> bool:
        return tuple(got.shape) == tuple(expected.shape) and torch.equal(got.long(), expected)

    if same(want):
        used = list(dict.fromkeys(outcome["collectives"]))
        if "all_to_all_single" not in used:
            raise Failure(f"right counts, but through {', '.join(used) or 'no collective'}: every "
                          f"rank received all ep × E = {ep * num_experts} counts to keep "
                          f"{ep * per_rank}; dist.all_to_all_single sends each rank only its block")
        return
    if same(want.flatten()):
        raise Failure(f"on ep rank {r} you returned the flat [E] = [{num_experts}] buffer "
                      f"all_to_all_single filled: view it as [ep, E/ep] = [{ep}, {per_rank}], "
                      "row s = what ep rank s sends to each local expert")
    if same(want.T) or same(want.flatten().view(per_rank, ep)):
        # With ep == E/ep the shapes agree and only the layout is wrong: say it by rows.
        arranged = ("transposed: your row e holds what every source rank sends to local expert e"
                    if per_rank == ep else
                    f"arranged as [E/ep, ep] = [{per_rank}, {ep}]")
        raise Failure(f"on ep rank {r} your counts are {arranged}: the received buffer holds one "
                      f"block of E/ep counts per source rank, so return [ep, E/ep] = [{ep}, "
                      f"{per_rank}], row s = what ep rank s sends to each of {mine}")
    if same(counts[r]) or same(counts[r].view(ep, per_rank)):
        raise Failure(f"on ep rank {r} you returned this rank's own counts, what it sends; what it "
                      f"receives is block {r} ({mine}) of every rank's counts, one row per source "
                      "rank - dist.all_to_all_single(output, tokens_per_expert, group=group) "
                      "delivers exactly that")
    total = counts.sum(0)
    if same(total) or same(total.view(ep, per_rank)) or same(total.view(ep, per_rank)[r]):
        raise Failure(f"on ep rank {r} your counts are all ranks' counts summed (all_reduce): "
                      f"this rank needs them per source rank, not added up, and only for {mine} "
                      "- an all-to-all sends block j of every rank's counts to rank j")
    if same(counts) or same(counts.flatten()):
        raise Failure(f"on ep rank {r} you hold every rank's full counts ([ep, E] = [{ep}, "
                      f"{num_experts}], what all_gather gives): keep one row per source rank but "
                      f"only {mine} - all_to_all_single sends each rank just that block")
    if tuple(got.shape) != (ep, per_rank):
        raise Failure(f"on ep rank {r} your recv_counts has shape {list(got.shape)}, expected "
                      f"[ep, E/ep] = [{ep}, {per_rank}]")
    raise Failure(f"on ep rank {r} your counts are {got.tolist()}, expected {want.tolist()}: "
                  f"row s = the rows ep rank s sends to each of {mine} (block {r} of ep rank "
                  "s's counts)")


def _verify_exchange(case: Case, outcomes: list[dict[int, dict]], number: int) -> None:
    counts, members = case.args
    results = [outcomes[rank].get(number) for rank in members]
    raised = [(r, o) for r, o in enumerate(results) if o and "raised" in o]
    stub = next((o for _, o in raised if o["stub"]), None)
    if stub:
        raise NotImplementedError(stub["raised"][1])
    causes = [(r, o) for r, o in raised if not ranks.is_peer_failure(o["raised"][1])]
    if causes:
        raise _LearnerError(_remote_error(*causes[0][1]["raised"]))
    if raised:  # only peers' failures: timed out, or the peer left
        raise Failure(f"ep rank {raised[0][0]} waited in a collective that its peers never joined: "
                      "every rank of the group must call all_to_all_single once, with an output as "
                      "large as its input (E counts)")
    if None in results:
        raise RuntimeError(f"no outcome from ep rank {results.index(None)}")
    for r, outcome in enumerate(results):
        _diagnose_exchange(outcome, counts, r)


def check_exchange_counts(learner_fn) -> bool:
    """`exchange_counts(tokens_per_expert [E], group) -> recv_counts [ep, E/ep]` on real gloo
    process groups (ep = 2 and 3, in 3 fresh processes: ~3 s) against
    `distributed.exchange_counts`; the learner's function travels by its source
    (`ranks.ship`), and the collectives it calls are recorded."""
    cases = _exchange_cases()
    outcomes: list[dict[int, dict]] = []

    def verify(case: Case, call) -> None:
        if not outcomes:  # one launch for all the cases, inside _run: it reports what goes wrong
            outcomes.extend(_exchange_on_ranks(learner_fn, cases))
        _verify_exchange(case, outcomes, cases.index(case))

    return _run("check_exchange_counts", learner_fn, cases, verify,
                against="distributed.exchange_counts on gloo process groups",
                error_hints=(("NameError", "the check runs your function in fresh processes with "
                                           "the modules, imported functions and values it names "
                                           "in your notebook: import anything else inside it"),
                             *((pattern, "pass group=group: the exchange runs among the ranks of "
                                         "the ep group, not the whole world")
                               for pattern in ("divide equally", "context->size"))))


def _received_cases() -> list[Case]:
    g = _gen(114)
    silent_rank = torch.randint(0, 5, (3, 2), generator=g)
    silent_rank[1] = 0
    idle_expert = torch.randint(0, 5, (2, 3), generator=g)
    idle_expert[:, 1] = 0
    return [
        Case("2 source ranks, 3 local experts", (torch.tensor([[1, 2, 0], [3, 1, 2]]),)),
        Case("ep rank 1 sends nothing (3 source ranks, 2 local experts)", (silent_rank,)),
        Case("local expert 1 receives nothing (2 source ranks, 3 local experts)", (idle_expert,)),
        Case("one local expert per rank (4 source ranks)",
             (torch.randint(0, 5, (4, 1), generator=g),)),
        Case("4 source ranks, 3 local experts", (torch.randint(0, 6, (4, 3), generator=g),)),
        Case("nothing received (2 source ranks, 2 local experts)",
             (torch.zeros(2, 2, dtype=torch.long),)),
    ]


def _verify_received(case: Case, call) -> None:
    (recv_counts,) = case.args
    ep, per_rank = recv_counts.shape
    want = distributed.received_experts(recv_counts)
    got = _tensor(call(recv_counts), "your expert ids")
    if got.is_floating_point():
        raise Failure(f"your expert ids are {got.dtype}: return integers (the indices the local "
                      "experts are routed by)")
    if tuple(got.shape) != tuple(want.shape):
        raise Failure(f"your expert ids have shape {list(got.shape)}, expected one per received "
                      f"row: [R] = [{want.numel()}], R = recv_counts.sum()")
    got = got.long()
    if torch.equal(got, want):
        return
    variants = [
        (torch.repeat_interleave(torch.arange(per_rank), recv_counts.sum(0)),
         "your ids assume the rows arrive grouped by expert; they arrive grouped by source rank "
         "(ep rank 0's rows for local experts 0, 1, …, then ep rank 1's, …): arange(E/ep) once "
         "per source rank, each id repeated recv_counts[s, e] times"),
        (torch.repeat_interleave(torch.arange(ep), recv_counts.sum(1)),
         "these are the source ranks of the rows; return the local expert each row is for "
         "(0 … E/ep − 1)"),
    ]
    wrong_pairs = ("you paired the counts with the wrong experts: recv_counts.flatten() runs "
                   "source by source (row by row), so its entries go with arange(E/ep) repeated "
                   "ep times (0, 1, …, 0, 1, …)")
    variants += [
        (torch.repeat_interleave(torch.arange(per_rank).repeat(ep), recv_counts.T.flatten()),
         wrong_pairs),
        (torch.repeat_interleave(torch.arange(per_rank).repeat_interleave(ep),
                                 recv_counts.flatten()), wrong_pairs),
    ]
    for variant, diagnosis in variants:
        if torch.equal(got, variant):
            raise Failure(diagnosis)
    if got.numel() and (got.min() < 0 or got.max() >= per_rank):
        raise Failure(f"your ids go from {int(got.min())} to {int(got.max())}, but this rank's "
                      f"local experts are numbered 0 … E/ep − 1 = {per_rank - 1}")
    i = int((got != want).nonzero()[0])
    source = int(torch.searchsorted(torch.cumsum(recv_counts.sum(1), 0), i, right=True))
    raise Failure(f"row {i} (from ep rank {source}) is for local expert {int(want[i])}, yours says "
                  f"{int(got[i])}: the rows arrive source by source, each source's rows expert "
                  "by expert, recv_counts[s, e] rows each")


def check_received_experts(learner_fn) -> bool:
    """`received_experts(recv_counts [ep, E/ep]) -> [R]`: the local expert of every received row,
    in arrival order, against `distributed.received_experts`."""
    return _run("check_received_experts", learner_fn, _received_cases(), _verify_received,
                against="distributed.received_experts")
