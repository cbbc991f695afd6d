import pytest
import torch

from moe_tutorial.moe import routing
from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM, Router, route
from moe_tutorial.moe.routing import load_balancing_loss, permute, unpermute


def test_route_matches_softmax_topk_renormalise():
    logits = torch.randn(50, 8)
    weights, idx = route(logits, 2)
    probs = torch.softmax(logits, -1)
    top = probs.topk(2, -1)
    assert torch.equal(idx, top.indices)
    torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    assert weights.dtype == torch.float32


def test_router_computes_softmax_in_fp32_for_bf16_inputs():
    router = Router(16, 4, 2, dtype=torch.bfloat16)
    torch.nn.init.normal_(router.weight)
    out = router(torch.randn(3, 5, 16, dtype=torch.bfloat16))
    assert out.logits.shape == (15, 4) and out.logits.dtype == torch.bfloat16
    assert out.weights.dtype == torch.float32 and out.indices.shape == (15, 2)


def test_a_models_routers_route_and_balance_with_the_rules_set_routing_gives_them():
    """Exercise 08 trains the engine with the learner's route_sigmoid and update_correction_bias
    through `MoEForCausalLM.set_routing`: every router must call them, and None restores the
    package's own."""
    calls = []

    def counted(name):
        original = getattr(routing, name)

        def call(*args):
            calls.append(name)
            return original(*args)
        return call

    config = preset("tiny").with_overrides(router="sigmoid", aux_loss_coef=0.0)
    model = MoEForCausalLM(config).set_routing(counted("route_sigmoid"),
                                               counted("update_correction_bias"))
    hidden = torch.randn(5, config.hidden_size)
    for layer in model.model.layers:
        layer.mlp.gate.train()(hidden)
        layer.mlp.gate.update_correction_bias(0.01)
    assert calls == ["route_sigmoid", "update_correction_bias"] * config.num_layers
    model.set_routing()
    model.model.layers[0].mlp.gate(hidden)
    assert len(calls) == 2 * config.num_layers and model.routing_rule is routing.route_sigmoid
    with pytest.raises(ValueError, match="rule must be a function"):
        model.set_routing("route_sigmoid")


def test_load_balancing_loss_values():
    # Perfectly balanced: every expert equally likely and equally chosen -> loss == top_k.
    uniform = [torch.zeros(64, 4)]
    # topk on ties picks the lowest indices; with zero logits, f is all on experts 0,1 but P is
    # uniform (1/4), so the loss is still E * sum_e f_e * 1/E = sum f = top_k.
    assert load_balancing_loss(uniform, 2).item() == pytest.approx(2.0)
    # Collapsed: every token sends everything to expert 0 with prob ~1 -> loss ~ E * 1 * 1.
    collapsed = torch.full((64, 4), -30.0)
    collapsed[:, 0] = 30.0
    assert load_balancing_loss([collapsed], 1).item() == pytest.approx(4.0, rel=1e-4)


def test_load_balancing_loss_pools_layers():
    a, b = torch.randn(32, 4), torch.randn(32, 4)
    pooled = load_balancing_loss([torch.cat([a, b])], 2)
    torch.testing.assert_close(load_balancing_loss([a, b], 2), pooled)


def _random_routing(tokens, experts, k, hidden=6):
    x = torch.randn(tokens, hidden, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(tokens, experts, dtype=torch.float64, requires_grad=True)
    w, idx = route(logits, k)
    return x, logits, w, idx


@pytest.mark.parametrize("align", [1, 4, 16, 32, 128, 256])
def test_permute_groups_by_expert_and_pads(align):
    x, _, w, idx = _random_routing(37, 5, 2)
    rows, row_w, perm = permute(x, idx, w, 5, align)
    counts = torch.bincount(idx.flatten(), minlength=5)
    assert torch.equal(perm.tokens_per_expert, counts)
    assert torch.all(perm.m_splits % align == 0) and torch.all(perm.m_splits >= counts)
    assert torch.all(perm.m_splits - counts < align)
    assert rows.shape == (int(perm.m_splits.sum()), 6) == (perm.num_rows, 6)
    assert perm.offsets.dtype == torch.int32 and perm.offsets[-1] == perm.num_rows
    # Each expert's block holds exactly its tokens, in token order, followed by zero padding.
    start = 0
    for e in range(5):
        block = rows[start:start + perm.m_splits[e]]
        tokens = torch.nonzero((idx == e).any(-1)).flatten()
        assert torch.equal(block[:len(tokens)], x[tokens])
        assert torch.all(block[len(tokens):] == 0)
        slot_w = w[tokens][idx[tokens] == e]
        assert torch.equal(row_w[start:start + len(tokens)], slot_w.float())
        assert torch.all(row_w[start + len(tokens):start + perm.m_splits[e]] == 0)
        start += int(perm.m_splits[e])


@pytest.mark.parametrize("align", [1, 16])
def test_unpermute_is_the_exact_weighted_inverse(align):
    x, _, w, idx = _random_routing(29, 4, 2)
    rows, _, perm = permute(x, idx, w, 4, align)
    expert_scale = torch.arange(1, 5, dtype=torch.float64)  # expert e multiplies by e+1
    expert_of_row = torch.repeat_interleave(torch.arange(4), perm.m_splits)
    out = unpermute(rows * expert_scale[expert_of_row, None], perm, w)
    expected = (x[:, None, :] * (expert_scale[idx] * w)[..., None]).sum(1)
    torch.testing.assert_close(out, expected)
    # Without weights, identical rows come back summed over the k slots.
    torch.testing.assert_close(unpermute(rows, perm, None), x * 2)


def test_padding_never_leaks_into_outputs_or_gradients():
    x, logits, w, idx = _random_routing(10, 4, 2)
    rows, _, perm = permute(x, idx, w, 4, align=16)
    assert perm.padded
    garbage = torch.zeros(perm.num_rows, dtype=torch.bool)
    garbage[perm.row_index] = True
    # Poison the padding rows: the output must not change, and they must get no gradient.
    poisoned = rows + (~garbage)[:, None] * 1e6
    poisoned.retain_grad()
    out = unpermute(poisoned, perm, w)
    torch.testing.assert_close(out, unpermute(rows, perm, w))
    out.sum().backward()
    assert torch.all(poisoned.grad[~garbage] == 0)
    assert x.grad is not None and logits.grad is not None


def test_expert_with_no_tokens():
    x = torch.randn(6, 4)
    idx = torch.tensor([[0, 2]] * 6)  # experts 1 and 3 receive nothing
    w = torch.full((6, 2), 0.5)
    rows, _, perm = permute(x, idx, w, 4, align=8)
    assert perm.tokens_per_expert.tolist() == [6, 0, 6, 0]
    assert perm.m_splits.tolist() == [8, 0, 8, 0]
    torch.testing.assert_close(unpermute(rows, perm, w), x)


def test_gradients_match_a_dense_reference():
    """d(out)/d(x, router logits) through permute → per-row op → unpermute equals the dense
    formulation out[t] = sum_j w[t, j] * f_{idx[t, j]}(x[t])."""
    x, logits, w, idx = _random_routing(21, 3, 2)
    mats = torch.randn(3, 6, 6, dtype=torch.float64)
    rows, _, perm = permute(x, idx, w, 3, align=4)
    expert_of_row = torch.repeat_interleave(torch.arange(3), perm.m_splits)
    y = torch.einsum("rh,rhg->rg", rows, mats[expert_of_row])
    out = unpermute(y, perm, w)
    gx, gl = torch.autograd.grad(out.square().sum(), (x, logits))

    x2, logits2 = x.detach().clone().requires_grad_(), logits.detach().clone().requires_grad_()
    w2, idx2 = route(logits2, 2)
    dense = sum(w2[:, j, None] * torch.einsum("th,thg->tg", x2, mats[idx2[:, j]]) for j in range(2))
    gx2, gl2 = torch.autograd.grad(dense.square().sum(), (x2, logits2))
    torch.testing.assert_close(gx, gx2)
    torch.testing.assert_close(gl, gl2)


@pytest.mark.parametrize("align", [1, 4])
def test_permute_and_unpermute_pass_gradcheck(align):
    """Their hand-written backward passes (gathers instead of atomic scatter-adds) are the true
    derivatives: finite differences in float64 agree, with and without weights and padding."""
    x, _, w, idx = _random_routing(9, 3, 2)
    perm = permute(x, idx, w, 3, align)[2]
    w = w.detach().double().requires_grad_()  # route() returns fp32 weights
    torch.autograd.gradcheck(lambda x: permute(x, idx, None, 3, align)[0], (x,))
    rows = torch.randn(perm.num_rows, 5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda r, w: unpermute(r, perm, w), (rows, w))
    torch.autograd.gradcheck(lambda r: unpermute(r, perm, None), (rows,))


def test_bad_inputs():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="align=0"):
        permute(x, torch.zeros(4, 1, dtype=torch.long), None, 2, align=0)
    with pytest.raises(ValueError, match="expert 5.*only 2 experts"):
        permute(x, torch.full((4, 1), 5), None, 2)
    with pytest.raises(ValueError, match="hidden has 4 rows but indices has 3"):
        permute(x, torch.zeros(3, 1, dtype=torch.long), None, 2)
    rows, _, perm = permute(x, torch.zeros(4, 1, dtype=torch.long), None, 2, align=8)
    with pytest.raises(ValueError, match="expected 8 expert-output rows"):
        unpermute(rows[:4], perm, None)
