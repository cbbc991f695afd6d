"""The TE expert backends' semantics, checked on any machine.

Without TE (a CPU) `te_grouped_linear` and `te_ops` run pure-PyTorch modules with TE's parameter
layout; these tests pin their semantics to the naive loop. tests/test_gpu_backends.py checks the
real TE modules against the same references on a GPU."""

import pytest
import torch

from moe_tutorial import hardware
from moe_tutorial.config import preset
from moe_tutorial.experts import (ExpertMLP, TEOpsExperts, convert_experts, deinterleave_glu,
                                  interleave_glu, scaled_swiglu, swiglu, why_unfused)
from moe_tutorial.model import MoEForCausalLM
from moe_tutorial.routing import route


def _experts(E=4, H=64, I=64):
    experts = ExpertMLP(E, H, I, backend="naive")
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    return experts


def _grads(module, x, idx, w):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    out = module(x, idx, w)
    out.square().sum().backward()
    return out, x.grad, w.grad


def _hf_grads(module):
    """Parameter gradients in HF layout, whatever the module's own layout."""
    if isinstance(module, ExpertMLP):
        return module.gate_up_proj.grad, module.down_proj.grad
    fc1, fc2 = module._linears()
    E = module.num_experts
    gate_up = torch.stack([module._fc1_rows_to_hf(getattr(fc1, f"weight{e}").grad) for e in range(E)])
    down = torch.stack([getattr(fc2, f"weight{e}").grad for e in range(E)])
    return gate_up, down


@pytest.mark.parametrize("backend, options", [
    ("te_grouped_linear", {}), ("te_grouped_linear", dict(align=16)),
    ("te_ops", {}), ("te_ops", dict(align=128)), ("te_ops", dict(glu_interleave_size=32, align=256)),
])
def test_te_backends_match_the_naive_loop(backend, options):
    ref = _experts()
    x = torch.randn(40, 64)
    w, idx = route(torch.randn(40, 4), 2)
    idx[:, 0] = torch.where(idx[:, 0] == 3, 0, idx[:, 0])  # expert 3: rarely or never chosen
    te_like = convert_experts(_experts(), backend, **options)
    te_like.load_hf_weights(ref.gate_up_proj, ref.down_proj)
    expected = _grads(ref, x, idx, w)
    got = _grads(te_like, x, idx, w)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for a, b in zip(_hf_grads(ref), _hf_grads(te_like)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert "pure-PyTorch counterpart" in te_like.last_path
    assert f"align {options.get('align', 1)}" in te_like.last_path


def test_glu_interleave_layout():
    w = torch.arange(2 * 64 * 3, dtype=torch.float32).view(128, 3)  # 64 gate rows, 64 up rows
    inter = interleave_glu(w, 32)
    # blocks: gate 0-31, up 0-31, gate 32-63, up 32-63
    assert torch.equal(inter[:32], w[:32]) and torch.equal(inter[32:64], w[64:96])
    assert torch.equal(inter[64:96], w[32:64]) and torch.equal(inter[96:], w[96:])
    assert torch.equal(deinterleave_glu(inter, 32), w)
    x = torch.randn(5, 3)
    torch.testing.assert_close(swiglu(x @ inter.T, 32), swiglu(x @ w.T))
    scales = torch.rand(5)
    torch.testing.assert_close(scaled_swiglu(x @ inter.T, scales, 32),
                               swiglu(x @ w.T) * scales[:, None])
    with pytest.raises(ValueError, match="multiple of the GLU interleave block 32"):
        interleave_glu(torch.zeros(2, 40, 8), 32)


def test_conversion_round_trip_through_a_model():
    model = MoEForCausalLM(preset("tiny"))
    ids = torch.randint(0, 24, (2, 16))
    before = model.to_hf_state_dict()
    ref = model(ids).logits
    for backend, options in [("te_ops", dict(glu_interleave_size=32)), ("te_grouped_linear", {}),
                             ("naive", {})]:
        model.set_expert_backend(backend, **options)
        assert model.expert_backend == backend
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)
        after = model.to_hf_state_dict()
        assert after.keys() == before.keys()
        for k in before:
            assert torch.equal(after[k], before[k]), k


def test_from_hf_into_a_te_backend():
    transformers = pytest.importorskip("transformers", minversion="5.0")
    cfg = preset("tiny")
    hf = transformers.MixtralForCausalLM._from_config(
        transformers.MixtralConfig(**cfg.to_hf_config_kwargs()), dtype=torch.float32,
        experts_implementation="eager")
    model = MoEForCausalLM.from_hf(hf, expert_backend="te_ops")
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_why_unfused_names_every_missing_condition():
    hopper = hardware.evaluate(hardware.fake_environment("hopper"))
    reasons = why_unfused(hopper, "Float8CurrentScaling", None, 4096, 14336, 16)
    text = " | ".join(reasons)
    assert "Blackwell" in text and "MXFP8" in text and "glu_interleave_size=32" in text
    assert "padded to 256" in text
    blackwell = hardware.evaluate(hardware.fake_environment("blackwell"))
    assert why_unfused(blackwell, "MXFP8BlockScaling", 32, 4096, 14336, 256) == []
    assert "multiples of 64" in why_unfused(blackwell, "MXFP8BlockScaling", 32, 4096, 1400, 256)[0]


def test_fp8_precision_needs_te_on_a_gpu_and_te_experts():
    model = MoEForCausalLM(preset("tiny"))
    with pytest.raises(ValueError, match="needs Transformer Engine FP8 on a GPU"):
        model.set_precision("fp8")
    hopper = hardware.evaluate(hardware.fake_environment("hopper"))
    with pytest.raises(ValueError, match="NVIDIA H200.*cannot run MXFP8BlockScaling"):
        model.set_precision("MXFP8BlockScaling", capabilities=hopper)
    assert model.set_precision("bf16").precision is None


def test_te_ops_require_fused_option_is_kept():
    experts = TEOpsExperts(2, 64, 64, require_fused=True, glu_interleave_size=32)
    assert experts.require_fused and experts.glu_interleave_size == 32
    with pytest.raises(ValueError, match="takes no options"):
        convert_experts(experts, "naive", align=16)


def test_te_ops_with_block_scaling_is_refused_on_hopper():
    from moe_tutorial.model import _check_backend_runs_recipe
    from moe_tutorial.quant import recipe_for

    hopper = hardware.evaluate(hardware.fake_environment("hopper"))
    block = recipe_for(hopper, "Float8BlockScaling")
    with pytest.raises(ValueError, match="no cuBLAS GEMM algorithm on NVIDIA H200"):
        _check_backend_runs_recipe("te_ops", block, hopper)
    _check_backend_runs_recipe("te_grouped_linear", block, hopper)  # this one works
