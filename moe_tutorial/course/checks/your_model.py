"""Exercise 08's checks: DeepSeek-V3's routing (sigmoid scores, a correction bias that only
chooses, group-limited top-k, the routed scaling factor) and its aux-loss-free bias update."""

from __future__ import annotations

import math

import torch

from ...moe import routing
from .harness import (
    Case,
    Failure,
    expect_shape,
    expect_tensor,
    expect_tuple,
    generator,
    is_close,
    run_check,
    sizes,
)

# ---------------------------------------------------------------------------------------------
# route_sigmoid(logits, top_k, correction_bias=None, n_group=1, topk_group=1, normalize=True,
#               scaling_factor=1.0) -> (weights [T, k] fp32, indices [T, k] int64)


def _route_cases() -> list[Case]:
    g = generator(801)

    def logits(tokens, num_experts, scale=2.0):
        return torch.randn(tokens, num_experts, generator=g) * scale

    def bias(num_experts, scale):
        return torch.randn(num_experts, generator=g) * scale

    saturated = logits(6, 8)
    saturated[:3] = -200.0  # sigmoid(-200) is exactly 0 in float32: every chosen score is 0
    ties = torch.tensor([[2.0, 2.0, 1.0, 0.0], [1.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0],
                         [5.0, 1.0, 1.0, -1.0]])

    def case(name, args, **info):
        return Case(name, args, info)

    return [
        case(f"sigmoid scores, no bias ({sizes(37, 8, 2)})", (logits(37, 8), 2)),
        case(f"a correction bias that changes the choice ({sizes(40, 8, 2)}, bias of size ~0.3)",
             (logits(40, 8), 2, bias(8, 0.3))),
        case(f"routed scaling factor 2.5 ({sizes(33, 16, 4)}, normalised)",
             (logits(33, 16), 4, bias(16, 0.2), 1, 1, True, 2.5)),
        case(f"normalize=False, scaling factor 2.0 ({sizes(30, 8, 3)}, HF's "
             "norm_topk_prob=False)", (logits(30, 8), 3, bias(8, 0.2), 1, 1, False, 2.0),
             grad=True),
        case(f"group-limited top-k, DeepSeek-V3's routing at 1/8 scale ({sizes(48, 32, 8)}, "
             "8 groups, the best 4 groups, scaling factor 2.5)",
             (logits(48, 32), 8, bias(32, 0.1), 8, 4, True, 2.5), grad=True),
        case(f"one group per token ({sizes(40, 16, 2)}, 4 groups, the best 1)",
             (logits(40, 16), 2, bias(16, 0.2), 4, 1)),
        case(f"a negative bias on every expert ({sizes(24, 16, 3)}, 4 groups, the best 2, "
             "every biased score below 0)",
             (logits(24, 16), 3, bias(16, 0.1) - 1.5, 4, 2)),
        case(f"bf16 logits ({sizes(33, 8, 2)}, 2 groups, the best 1)",
             (logits(33, 8, 3.0).bfloat16(), 2, bias(8, 0.2), 2, 1)),
        case(f"saturated sigmoids ({sizes(6, 8, 2)}, 3 tokens with logits -200: every chosen "
             "score is 0)", (saturated, 2, bias(8, 0.3)), saturated=True),
        case("ties in top-k (4 tokens whose logits repeat, 4 experts, top-2, no bias)", (ties, 2)),
    ]


def _route_args(case: Case) -> tuple:
    """The case's arguments with route_sigmoid's defaults filled in."""
    defaults = (None, 1, 1, True, 1.0)  # correction_bias ... scaling_factor
    return case.args + defaults[len(case.args) - 2:]


def _group_mask(for_choice: torch.Tensor, n_group: int, topk_group: int,
                rule: str = "top2") -> torch.Tensor:
    """[T, E] bool: the experts of each token's `topk_group` best groups, a group scored by
    `rule` (DeepSeek-V3: the sum of its two best; the wrong rules a learner may use: its best
    one, the sum of all)."""
    tokens, num_experts = for_choice.shape
    if n_group == 1:
        return torch.ones_like(for_choice, dtype=torch.bool)
    grouped = for_choice.view(tokens, n_group, -1)
    group_scores = {"top2": lambda: grouped.topk(2, dim=-1).values.sum(-1),
                    "max": lambda: grouped.amax(-1), "sum": lambda: grouped.sum(-1)}[rule]()
    best = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros(tokens, n_group, dtype=torch.bool).scatter_(1, best, True)
    return keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, num_experts)


def _chooses(indices: torch.Tensor, key: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T] bool: the tokens whose chosen experts have the k largest `key` values (any order,
    ties either way)."""
    got = key.gather(1, indices).sort(dim=-1, descending=True).values
    want = key.topk(top_k, dim=-1).values
    return ((got == want) | ((got - want).abs() <= 1e-6)).all(-1)


def _weights_for(indices: torch.Tensor, scores: torch.Tensor, normalize: bool,
                 scale: float) -> torch.Tensor:
    """Routing weights of the given experts from `scores` [T, E]: gathered, normalised as HF
    does (+1e-20), scaled. The unbiased sigmoid scores give routing.route_sigmoid's weights
    (the verifier makes sure of that on the package's own choice)."""
    weights = scores.gather(1, indices)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale


def _expected_route(logits, correction_bias):
    scores = torch.sigmoid(logits.float())
    for_choice = scores if correction_bias is None else scores + correction_bias
    return scores, for_choice


def _choice_variants(logits, top_k, correction_bias, n_group, topk_group):
    """(key [T, E], diagnosis) for the plausible wrong ways to choose: a learner whose choice
    is the top-k of a key chose that way."""
    scores, for_choice = _expected_route(logits, correction_bias)
    bias = torch.zeros_like(scores[0]) if correction_bias is None else correction_bias

    def limited(values, groups_on=None, rule="top2", fill=-math.inf):
        mask = _group_mask(values if groups_on is None else groups_on, n_group, topk_group, rule)
        return values.masked_fill(~mask, fill)

    grouped = n_group > 1
    variants = [(-for_choice if not grouped else None,
                 "you took the least biased scores: keep the largest (torch.topk(..., "
                 "largest=True))")]
    if correction_bias is not None:
        variants.append((limited(scores), "you chose the experts on the unbiased scores: choose "
                         "on sigmoid(logits) + correction_bias (the bias steers the choice; only "
                         "the weights stay unbiased)"))
    variants.append((limited(torch.softmax(logits.float(), -1) + bias),
                     "you scored the experts with a softmax over them: DeepSeek-V3 scores each "
                     "expert on its own, sigmoid(logit), and chooses on sigmoid + bias"))
    if logits.dtype != torch.float32:
        variants.append((limited(torch.sigmoid(logits).float() + bias),
                         f"your choice follows a sigmoid computed in {logits.dtype}: compute "
                         "it in float32 (logits.float() first), as the router does"))
    if grouped:
        variants += [
            (for_choice, f"you took the top-{top_k} of all experts: first keep each token's "
                         f"topk_group={topk_group} best of its n_group={n_group} groups (a "
                         "group scored by the sum of its two best biased scores), then the "
                         "top-k experts within them"),
            (limited(for_choice, rule="max"), "you ranked the groups by their best expert: "
                                              "DeepSeek-V3 ranks them by the sum of their two "
                                              "best biased scores (topk(2).values.sum(-1))"),
            (limited(for_choice, rule="sum"), "you ranked the groups by the sum of all their "
                                              "experts' scores: DeepSeek-V3 ranks them by the "
                                              "sum of their two best (topk(2).values.sum(-1))"),
            (limited(for_choice, fill=0.0), "the experts outside the chosen groups competed "
                                            "with a score of 0, which beats a negative biased "
                                            "score: mask them with -inf "
                                            "(masked_fill(~mask, float('-inf')))"),
        ]
        if correction_bias is not None:
            variants.append((limited(for_choice, groups_on=scores),
                             "you ranked the groups on the unbiased scores: the groups, like "
                             "the experts, are chosen on sigmoid(logits) + correction_bias"))
    return [(key, why) for key, why in variants if key is not None]


def _verify_route(case: Case, call) -> None:
    logits, top_k, correction_bias, n_group, topk_group, normalize, scale = _route_args(case)
    tokens, num_experts = logits.shape
    weights, indices = expect_tuple(call(*case.args), 2, "(weights, indices)")
    weights = expect_tensor(weights, "your weights")
    indices = expect_tensor(indices, "your indices")
    expect_shape(weights, (tokens, top_k), "your weights", "[tokens, top_k]")
    expect_shape(indices, (tokens, top_k), "your indices", "[tokens, top_k]")
    if indices.dtype != torch.int64:
        raise Failure(f"your indices are {indices.dtype}, expected torch.int64: return "
                      "torch.topk(...).indices as it is (or .long())")
    if weights.dtype != torch.float32:
        raise Failure(f"your weights are {weights.dtype}, the router's are float32: compute "
                      "the sigmoid in float32 (logits.float()) whatever the logits' dtype")
    if ((indices < 0) | (indices >= num_experts)).any():
        bad = indices[(indices < 0) | (indices >= num_experts)][0].item()
        raise Failure(f"your indices contain {bad}, but the experts are 0..{num_experts - 1}")
    ordered = indices.sort(dim=-1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(-1)
    if repeated.any():
        t = int(repeated.nonzero()[0])
        raise Failure(f"token {t} picks the same expert twice ({indices[t].tolist()}): take "
                      f"{top_k} different experts (torch.topk)")

    ref_weights, ref_indices = routing.route_sigmoid(*_route_args(case))
    scores, for_choice = _expected_route(logits, correction_bias)
    if not is_close(_weights_for(ref_indices, scores, normalize, scale), ref_weights, 1e-6):
        raise RuntimeError("the check's weights differ from routing.route_sigmoid's")
    eligible = routing.group_limited_top_k(  # all experts of each token's best groups
        for_choice, topk_group * (num_experts // n_group), n_group, topk_group)
    key = torch.full_like(for_choice, -math.inf).scatter(1, eligible, for_choice.gather(1, eligible))
    _verify_choice(indices, ref_indices, key, case)

    if case.info.get("saturated"):
        zero = (scores.gather(1, indices) == 0).all(-1) & torch.isnan(weights).any(-1)
        if zero.any():
            t = int(zero.nonzero()[0])
            raise Failure(f"token {t}'s chosen experts all score sigmoid = 0 (saturated) and "
                          "your weights are 0 / 0 = NaN: add a tiny constant to the sum, as HF "
                          "does (weights.sum(-1, keepdim=True) + 1e-20)")
    if torch.isnan(weights).any():
        t = int(torch.isnan(weights).any(-1).nonzero()[0])
        raise Failure(f"token {t}'s weights contain NaN: the weights are the chosen experts' "
                      "sigmoid scores (finite, in [0, 1]), normalised and scaled")
    expected = _weights_for(indices, scores, normalize, scale)
    if not is_close(weights, expected, 1e-5):
        _diagnose_weights(weights, expected, indices, case)
    if case.info.get("grad"):
        _verify_gradient(case, call)


def _verify_choice(indices, ref_indices, key, case) -> None:
    logits, top_k, correction_bias, n_group, topk_group, _, _ = _route_args(case)
    right = _chooses(indices, key, top_k)
    if right.all():
        return
    for variant, diagnosis in _choice_variants(logits, top_k, correction_bias, n_group,
                                               topk_group):
        if _chooses(indices, variant, top_k).all():
            raise Failure(diagnosis)
    t = int((~right).nonzero()[0])
    outside = [int(e) for e in indices[t] if key[t, e] == -math.inf]
    if outside:
        per_group = logits.shape[1] // n_group
        best = sorted({int(e) // per_group for e in (key[t] > -math.inf).nonzero()})
        raise Failure(f"token {t} picks expert {outside[0]} of group {outside[0] // per_group}, "
                      f"which is not one of its topk_group={topk_group} best groups (the "
                      f"reference chooses in groups {best}): choose the groups first, then the "
                      "experts within them")
    raise Failure(f"token {t} picks experts {sorted(indices[t].tolist())} but the reference "
                  f"picks {sorted(ref_indices[t].tolist())}: choose the top-{top_k} of "
                  "sigmoid(logits) + correction_bias within the token's best groups")


def _diagnose_weights(weights, expected, indices, case) -> None:
    logits, top_k, correction_bias, _, _, normalize, scale = _route_args(case)
    scores, for_choice = _expected_route(logits, correction_bias)
    variants = []
    if correction_bias is not None:
        variants.append((_weights_for(indices, for_choice, normalize, scale),
                         "your weights include the correction bias: the bias only chooses the "
                         "experts; weight them by their unbiased sigmoid scores"))
    variants.append((_weights_for(indices, torch.softmax(logits.float(), -1), normalize, scale),
                     "your weights are softmax probabilities: DeepSeek-V3 weights each chosen "
                     "expert by its own sigmoid score, sigmoid(logit)"))
    if logits.dtype != torch.float32:
        variants.append((_weights_for(indices, torch.sigmoid(logits).float(), normalize, scale),
                         f"your weights come from a sigmoid computed in {logits.dtype}: compute "
                         "it in float32 (logits.float() first)"))
    if scale != 1.0:
        variants += [(_weights_for(indices, scores, normalize, 1.0),
                      f"your weights {'sum to 1' if normalize else 'are the raw scores'}, "
                      f"without the routed scaling factor: multiply them by scaling_factor="
                      f"{scale:g}{' after normalising' if normalize else ''}"),
                     (_weights_for(indices, scores, normalize, scale) * scale,
                      f"you multiplied by scaling_factor={scale:g} twice: once, at the end")]
    variants.append((_weights_for(indices, scores, not normalize, scale),
                     "your weights are normalised to sum to 1 (times the scaling factor), but "
                     "normalize=False asks for the chosen experts' scores as they are (HF's "
                     "norm_topk_prob=False)" if not normalize else
                     "your weights are the raw sigmoid scores: normalize=True asks you to "
                     "divide the k chosen scores by their sum (then scale)"))
    for variant, diagnosis in variants:
        if is_close(weights, variant, 1e-5):
            raise Failure(diagnosis)
    t = int((weights - expected).abs().amax(-1).argmax())
    raise Failure(f"token {t}'s weights are {[round(v, 4) for v in weights[t].tolist()]} but its "
                  f"experts' are {[round(v, 4) for v in expected[t].tolist()]}: the unbiased "
                  "sigmoid scores of the chosen experts, divided by their sum (normalize=True), "
                  "times scaling_factor")


def _verify_gradient(case: Case, call) -> None:
    """The weights carry the gradient to the logits: without a balancing loss, this is how a
    DeepSeek-V3 router learns."""
    logits = case.args[0]
    rest = case.args[1:]
    leaf = logits.detach().clone().requires_grad_()
    weights, indices = call(leaf, *(r.clone() if isinstance(r, torch.Tensor) else r for r in rest),
                            copy=False)
    if not torch.equal(leaf.detach(), logits):
        raise Failure("your function changed its argument `logits` in place: the cells below "
                      "use that tensor again - work on a new tensor")
    if not isinstance(weights, torch.Tensor) or not weights.requires_grad:
        raise Failure("your weights carry no gradient back to the logits (no torch.no_grad or "
                      ".detach() on the scores): without a balancing loss, the weights are how a "
                      "DeepSeek-V3 router learns")
    upstream = torch.randn(logits.shape, generator=generator(803))  # one value per expert
    (weights * upstream.gather(1, indices.long())).sum().backward()
    ref_leaf = logits.detach().clone().requires_grad_()
    ref_weights, ref_indices = routing.route_sigmoid(ref_leaf, *_route_args(case)[1:])
    (ref_weights * upstream.gather(1, ref_indices)).sum().backward()
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    if not is_close(grad, ref_leaf.grad, 1e-4):
        raise Failure("your weights have the right values but the wrong gradient: compute them "
                      "from the sigmoid scores (differentiable, no detach); only the choice "
                      "(top-k on the biased scores) carries no gradient")


def check_route_sigmoid(learner_fn) -> bool:
    """`route_sigmoid(logits [T, E], top_k, correction_bias=None, n_group=1, topk_group=1,
    normalize=True, scaling_factor=1.0) -> (weights [T, k] fp32, indices [T, k] int64)` against
    `routing.route_sigmoid` (HF's DeepseekV3TopkRouter): the choice, the weights, their
    gradient."""
    return run_check("check_route_sigmoid", learner_fn, _route_cases(), _verify_route,
                     against="routing.route_sigmoid",
                     error_hints=(("NoneType", "correction_bias may be None (no bias): then "
                                               "choose on the scores alone"),))


# ---------------------------------------------------------------------------------------------
# update_correction_bias(bias [E] fp32, tokens_per_expert [E] int64, rate) -> None, in place


def _update_cases() -> list[Case]:
    g = generator(802)
    random_counts = torch.randint(0, 40, (16,), generator=g)
    no_tokens = torch.randint(1, 30, (8,), generator=g)
    no_tokens[5] = 0
    return [
        Case("one overloaded expert (4 experts, tokens [10, 2, 2, 2], rate 0.01, bias 0)",
             (torch.zeros(4), torch.tensor([10, 2, 2, 2]), 0.01)),
        Case("a bias that has moved before (16 experts, random loads, rate 0.001)",
             (torch.randn(16, generator=g) * 0.01, random_counts, 1e-3)),
        Case("a balanced load (8 experts, 6 tokens each, rate 0.01): the bias stays",
             (torch.randn(8, generator=g) * 0.01, torch.full((8,), 6), 0.01)),
        Case("expert 5 received no tokens (8 experts, rate 0.001)",
             (torch.randn(8, generator=g) * 0.01, no_tokens, 1e-3)),
        Case("the router's counts (64 experts, int64 loads of a 4096-token batch, top-8, "
             "rate 0.001)",
             (torch.zeros(64),
              torch.bincount(torch.multinomial(torch.linspace(0.2, 1.0, 64), 4096 * 8,
                                               replacement=True, generator=g), minlength=64),
              1e-3)),
    ]


def _verify_update(case: Case, call) -> None:
    bias, tokens_per_expert, rate = case.args
    mine, counts = bias.clone(), tokens_per_expert.clone()
    returned = call(mine, counts, rate, copy=False)
    if not torch.equal(counts, tokens_per_expert):
        raise Failure("your function changed its argument `tokens_per_expert` in place: the "
                      "router counts into it - read it, don't change it")
    want = bias.clone()
    routing.update_correction_bias(want, tokens_per_expert, rate)
    if torch.allclose(mine, want, rtol=1e-6, atol=1e-9):
        return
    load = tokens_per_expert.float()
    step = want - bias
    if torch.equal(mine, bias):
        if isinstance(returned, torch.Tensor) and torch.allclose(returned.detach().float(), want,
                                                                 rtol=1e-6, atol=1e-9):
            raise Failure("you returned the updated bias but left the one passed in unchanged: "
                          "update it in place (bias += ... or bias.add_(...)); the router keeps "
                          "that tensor and ignores what you return")
        raise Failure("your function left the bias unchanged: add rate · sign(mean load − load) "
                      "to it in place (bias += ... or bias.add_(...); bias = bias + ... only "
                      "rebinds the name inside your function)")
    moved = mine - bias
    if torch.allclose(moved, -step, rtol=1e-6, atol=1e-9):
        e = int(load.argmax())
        raise Failure(f"the bias moves the wrong way: expert {e}, the most loaded "
                      f"({int(load[e])} tokens, mean {load.mean().item():.3g}), got "
                      f"{moved[e].item():+.3g}; an overloaded expert's bias must drop so that "
                      "fewer tokens choose it: add rate · sign(mean load − load)")
    if torch.allclose(moved, rate * (load.mean() - load), rtol=1e-5, atol=1e-9):
        raise Failure("your bias moves in proportion to the load difference: DeepSeek-V3 moves "
                      "each expert's bias by exactly ±rate, rate · sign(mean load − load)")
    if torch.allclose(mine, step, rtol=1e-6, atol=1e-9):
        raise Failure("you replaced the bias by this step's change: add the change to the bias "
                      "(it accumulates over training: bias += rate · sign(mean load − load))")
    at_mean = load == load.mean()
    if at_mean.any() and (moved[at_mean] != 0).any():
        e = int((at_mean & (moved != 0)).nonzero()[0])
        raise Failure(f"expert {e} has exactly the mean load, yet its bias moved by "
                      f"{moved[e].item():+.3g}: sign(0) = 0 leaves it (torch.sign, not "
                      "torch.where(load > mean, -rate, rate))")
    e = int((mine - want).abs().argmax())
    raise Failure(f"expert {e}'s bias moved by {moved[e].item():+.3g}, expected "
                  f"{step[e].item():+.3g} (load {int(load[e])}, mean {load.mean().item():.3g}): "
                  "bias += rate · sign(mean load − load)")


def check_update_correction_bias(learner_fn) -> bool:
    """`update_correction_bias(bias [E] fp32, tokens_per_expert [E] int64, rate)`, in place,
    against `routing.update_correction_bias` (DeepSeek-V3's aux-loss-free balancing)."""
    return run_check("check_update_correction_bias", learner_fn, _update_cases(), _verify_update,
                     against="routing.update_correction_bias",
                     error_hints=(("could not infer output dtype",
                                   "tokens_per_expert holds int64 counts: take "
                                   "tokens_per_expert.float() before the mean"),))
