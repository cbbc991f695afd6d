"""Exercise 01's checks: the router, the load-balancing loss, the expert loop."""

from __future__ import annotations

import math

import torch

from ...moe import experts, model, routing
from ...moe.dispatch import run_experts
from .harness import (
    Case,
    Failure,
    expect_shape,
    expect_tensor,
    expect_tuple,
    generator,
    is_close,
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

def reference_expert_loop(hidden, indices, weights, gate_up_proj, down_proj):
    """experts.NaiveExperts behind the dispatcher, HF's eager loop"""
    num_experts, two_i, hidden_size = gate_up_proj.shape
    module = experts.NaiveExperts(num_experts, hidden_size, two_i // 2,
                                  dtype=gate_up_proj.dtype, device=gate_up_proj.device)
    module.load_hf_weights(gate_up_proj, down_proj)
    return run_experts(module, hidden, indices, weights)[0]


def _route_cases() -> list[Case]:
    g = generator(101)
    ties = torch.tensor([[2.0, 2.0, 1.0, 0.0], [1.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0],
                         [5.0, 1.0, 1.0, -1.0]])
    return [
        Case(f"random logits ({sizes(37, 8, 2)})", (torch.randn(37, 8, generator=g) * 2, 2)),
        Case(f"top-1 routing ({sizes(20, 4, 1)})", (torch.randn(20, 4, generator=g), 1)),
        Case("ties in top-k (4 tokens whose logits repeat, 4 experts, top-2)", (ties, 2)),
        Case(f"bf16 logits ({sizes(33, 8, 2)})",
             ((torch.randn(33, 8, generator=g) * 3).bfloat16(), 2)),
        Case("large logits (10 tokens, 6 experts, top-2, logits of size ~100)",
             (torch.randn(10, 6, generator=g) * 100, 2)),
        Case("top-k = every expert (5 tokens, 4 experts, top-4)", (torch.randn(5, 4, generator=g), 4)),
    ]


def _verify_route(case: Case, call) -> None:
    logits, top_k = case.args
    tokens, num_experts = logits.shape
    weights, indices = expect_tuple(call(logits, top_k), 2, "(weights, indices)")
    weights = expect_tensor(weights, "your weights")
    indices = expect_tensor(indices, "your indices")
    expect_shape(weights, (tokens, top_k), "your weights", "[tokens, top_k]")
    expect_shape(indices, (tokens, top_k), "your indices", "[tokens, top_k]")
    if indices.dtype != torch.int64:
        raise Failure(f"your indices are {indices.dtype}, expected torch.int64: the expert loop "
                      "and F.one_hot index with int64 - return torch.topk(...).indices as it is "
                      "(or .long())")
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
    _, ref_indices = model.route(logits, top_k)
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
    `model.route`: softmax in fp32, top-k, renormalise."""
    return run_check("check_route", learner_fn, _route_cases(), _verify_route,
                     against="model.route")


def _lb_cases() -> list[Case]:
    g = generator(102)
    layers = [torch.randn(21, 6, generator=g) + torch.linspace(-1, 1, 6) * s for s in (0.0, 1.5, 3.0)]
    never = torch.randn(30, 4, generator=g)
    never[:, 3] = -20.0
    return [
        Case(f"one layer ({sizes(37, 8, 2)})", ([torch.randn(37, 8, generator=g)], 2)),
        Case("3 layers pooled (3 × 21 tokens, 6 experts, top-2, each layer skewed differently)",
             (layers, 2)),
        Case("uniform logits (16 tokens, 4 experts, top-2: every expert tied, the loss is top_k)",
             ([torch.zeros(16, 4)], 2)),
        Case("expert 3 never chosen (30 tokens, 4 experts, top-2)", ([never], 2)),
        Case(f"bf16 logits ({sizes(24, 8, 2)})", ([torch.randn(24, 8, generator=g).bfloat16()], 2)),
        Case(f"top-1, Switch Transformer ({sizes(25, 5, 1)})", ([torch.randn(25, 5, generator=g)], 1)),
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
    if any(not is_close(g, r.grad, 1e-3) for g, r in zip(grads, ref_leaves)):
        raise Failure("your loss has the right value but the wrong gradient: the counts f_e are "
                      "constants (from the top-k indices, no gradient); the gradient flows "
                      "through P_e only")


def check_load_balancing_loss(learner_fn) -> bool:
    """`load_balancing_loss(router_logits: list of [T, E], top_k) -> scalar` against
    `routing.load_balancing_loss` (HF Mixtral's): value and gradient."""
    return run_check("check_load_balancing_loss", learner_fn, _lb_cases(), _verify_lb,
                     against="routing.load_balancing_loss")


def _loop_cases() -> list[Case]:
    g = generator(103)

    def make(name, tokens, num_experts, top_k, hidden=24, inter=40, dtype=torch.float32, skip=None):
        weights, indices = random_routing(g, tokens, num_experts, top_k, skip_expert=skip)
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        gate_up, down = random_expert_weights(g, num_experts, hidden, inter, dtype)
        return Case(name, (x, indices, weights, gate_up, down))

    return [
        make(f"top-1 routing ({sizes(29, 4, 1, hidden=24, width=40)})", 29, 4, 1),
        make(f"random routing ({sizes(37, 4, 2, hidden=24, width=40)})", 37, 4, 2),
        make(f"expert 3 receives no tokens ({sizes(30, 4, 2)})", 30, 4, 2, skip=3),
        make(f"bf16 inputs ({sizes(33, 4, 2, hidden=32, width=48)})", 33, 4, 2, 32, 48,
             torch.bfloat16),
        make(f"many experts, few tokens each ({sizes(11, 16, 2)})", 11, 16, 2),
    ]


def _expert_tokens(indices: torch.Tensor, expert: int) -> torch.Tensor:
    return (indices == expert).any(-1)


def _verify_loop(case: Case, call) -> None:
    hidden, indices, weights, gate_up, down = case.args
    out = expect_tensor(call(*case.args), "your output")
    expect_shape(out, hidden.shape, "your output", "[tokens, hidden]")
    if out.dtype != hidden.dtype:
        raise Failure(f"your output is {out.dtype} but the hidden states are {hidden.dtype}: "
                      "return hidden's dtype (cast each expert's output before adding it)")
    ref = reference_expert_loop(*case.args)
    tol = tolerance(hidden.dtype)
    if is_close(out, ref, tol):
        return
    variants = [
        (reference_expert_loop(hidden, indices, torch.ones_like(weights), gate_up, down),
         "your output ignores the routing weights: multiply each expert's output by the token's "
         "routing weight for that expert"),
        (reference_expert_loop(hidden, indices, weights, swap_gate_up(gate_up), down),
         "you swapped gate and up: rows 0..I-1 of gate_up_proj[e] are the gate, and SwiGLU is "
         "silu(gate) * up"),
    ]
    if indices.shape[1] > 1:
        last = indices.argmax(-1, keepdim=True)  # the highest-numbered expert: last in the loop
        variants.append((reference_expert_loop(hidden, indices.gather(1, last),
                                               weights.gather(1, last), gate_up, down),
                         "each token keeps only the last expert's output: add the k expert "
                         "contributions (out.index_add_ or out[tokens] += ...), don't overwrite"))
    for variant, diagnosis in variants:
        if is_close(out, variant, tol):
            raise Failure(diagnosis)
    token_err = mismatch(out, ref, tol).any(-1)
    for e in range(gate_up.shape[0]):
        mine = _expert_tokens(indices, e)
        if mine.any() and torch.equal(token_err, mine):
            raise Failure(f"exactly the tokens routed to expert {e} come out wrong: check how you "
                          f"gather expert {e}'s tokens and index its weights")
    t = int(token_err.nonzero()[0]) if token_err.any() else 0
    raise Failure(f"token {t} (experts {indices[t].tolist()}) differs from the reference loop by "
                  f"{max_rel_difference(out, ref):.1e} (relative): for each expert, gather its tokens, "
                  "down_proj[e] @ (silu(gate) * up) with gate, up = halves of gate_up_proj[e] @ x, "
                  "times the routing weight, added into the token's output")


def check_expert_loop(learner_fn) -> bool:
    """`expert_loop(hidden, indices, weights, gate_up_proj, down_proj) -> [T, H]` against
    `experts.NaiveExperts` (HF transformers' eager experts loop)."""
    return run_check("check_expert_loop", learner_fn, _loop_cases(), _verify_loop,
                     against="experts.NaiveExperts")
