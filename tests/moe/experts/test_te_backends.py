"""The TE expert backends' semantics, checked on any machine.

Without TE (a CPU) `te_grouped_linear` and `te_ops` run pure-PyTorch modules with TE's parameter
layout; these tests pin their semantics to the naive loop. tests/moe/experts/test_gpu_backends.py checks the
real TE modules against the same references on a GPU."""

import pytest
import torch

from moe_tutorial.moe.config import preset
from moe_tutorial.moe.dispatch import run_experts
from moe_tutorial.moe.experts import (
    FUSED_MLP_ROWS_PER_EXPERT,
    NaiveExperts,
    StackedExperts,
    TEOpsExperts,
    convert_experts,
    deinterleave_glu,
    interleave_glu,
    scaled_swiglu,
    swiglu,
    why_fused_raises,
    why_unfused,
)
from moe_tutorial.moe.hf import from_hf, to_hf_state_dict
from moe_tutorial.moe.model import MoEForCausalLM, route
from moe_tutorial.precision import hardware, recipes
from moe_tutorial.precision.recipes import RecipeSpec


def _experts(E=4, H=64, I=64):
    experts = NaiveExperts(E, H, I)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    return experts


def _grads(module, x, idx, w):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    out, module.dispatch_path = run_experts(module, x, idx, w)
    out.square().sum().backward()
    return out, x.grad, w.grad


def _hf_grads(module):
    """Parameter gradients in HF layout, whatever the module's own layout."""
    if isinstance(module, StackedExperts):
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
    assert f"align {options.get('align', 1)}" in te_like.dispatch_path


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
    before = to_hf_state_dict(model)
    ref = model(ids).logits
    for backend, options in [("te_ops", dict(glu_interleave_size=32)), ("te_grouped_linear", {}),
                             ("naive", {})]:
        model.set_expert_backend(backend, **options)
        assert model.expert_backend == backend
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)
        after = to_hf_state_dict(model)
        assert after.keys() == before.keys()
        for k in before:
            assert torch.equal(after[k], before[k]), k


def test_from_hf_into_a_te_backend():
    transformers = pytest.importorskip("transformers", minversion="5.0")
    cfg = preset("tiny")
    hf = transformers.MixtralForCausalLM._from_config(
        transformers.MixtralConfig(**cfg.to_hf_config_kwargs()), dtype=torch.float32,
        experts_implementation="eager")
    model = from_hf(hf, expert_backend="te_ops")
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_why_unfused_names_every_missing_condition():
    hopper = hardware.evaluate(hardware.fake_environment("hopper"))
    text = " | ".join(why_unfused(hopper, "Float8CurrentScaling", None, 4096, 14336))
    assert "compute capability 10.x" in text and "MXFP8 or NVFP4" in text
    assert "glu_interleave_size=32" in text
    blackwell = hardware.evaluate(hardware.fake_environment("blackwell"))
    assert why_unfused(blackwell, "MXFP8BlockScaling", 32, 4096, 14336) == []


# TE 2.20's fuser keeps the unfused ops, silently, when any one of these breaks
# (ops/fused/grouped_mlp.py: is_supported, fuse_glu_ops, fuse_grouped_mlp_ops,
# validate_grouped_mlp_dims). Each case breaks exactly one condition of a fusing setup.
_FUSING = dict(recipe="MXFP8BlockScaling", glu=32, hidden=4096, intermediate=14336)


@pytest.mark.parametrize("env_override, change, words", [
    (dict(fused_mlp_env_set=False), {}, "NVTE_CUTEDSL_FUSED_GROUPED_MLP=1"),
    (dict(compute_capability=(9, 0)), {}, "this is 9.0"),
    (dict(compute_capability=(12, 0)), {}, "this is 12.0"),
    (dict(cudnn_frontend_version="1.22.0"), {}, "found 1.22.0"),
    (dict(te_fused_mlp_registered=False), {}, "has not registered the fusion"),
    ({}, dict(recipe=None), "this runs bf16"),
    ({}, dict(recipe="Float8BlockScaling"), "this runs Float8BlockScaling"),
    ({}, dict(recipe=RecipeSpec("MXFP8BlockScaling", "HYBRID")), "E5M2 backward pass"),
    ({}, dict(recipe=RecipeSpec("NVFP4BlockScaling", disable_rht=True)), "disable_rht=True"),
    ({}, dict(glu=None), "glu_interleave_size=32, this uses None"),
    ({}, dict(glu=16), "this uses 16"),
    ({}, dict(hidden=4000), "multiples of 64"),
    ({}, dict(intermediate=1400), "multiples of 64"),
])
def test_each_fused_condition_alone_falls_back(env_override, change, words):
    caps = hardware.evaluate(hardware.fake_environment("blackwell", **env_override))
    case = {**_FUSING, **change}
    reasons = why_unfused(caps, case["recipe"], case["glu"], case["hidden"], case["intermediate"])
    assert len(reasons) == 1 and words in reasons[0], reasons


def test_nvfp4_with_rht_fuses_and_row_counts_do_not_decide_fusion():
    blackwell = hardware.evaluate(hardware.fake_environment("blackwell"))
    assert why_unfused(blackwell, "NVFP4BlockScaling", 32, 4096, 14336) == []
    assert why_unfused(blackwell, RecipeSpec("MXFP8BlockScaling", "E4M3"), 32, 2048, 768) == []


def test_fused_op_raises_on_row_counts():
    assert why_fused_raises([256, 512, 0, 256]) == []
    # Every local expert empty (a rank under expert parallelism): 0 is a multiple of 128 and 256,
    # yet the kernel cannot run on no rows
    only_reason, = why_fused_raises([0, 0, 0, 0])
    assert "0 rows" in only_reason and "4 experts" in only_reason
    assert why_fused_raises(torch.zeros(8, dtype=torch.int64)) != []
    reasons = why_fused_raises([256, 64])  # 320 rows: not a multiple of 128; expert 1 not of 256
    assert any("320 rows in all" in r for r in reasons) and any("expert(s) [1]" in r for r in reasons)
    only_per_expert, = why_fused_raises([128, 128])  # 256 in all is fine, each expert is not
    assert "expert(s) [0, 1]" in only_per_expert and f"align={FUSED_MLP_ROWS_PER_EXPERT}" in only_per_expert


def test_scaled_swiglu_applies_the_weights_in_the_compute_dtype():
    """TE casts the routing weights to the compute dtype before its kernel (bf16 here), then
    forms silu(gate) * up * weight in fp32: an independent statement of that arithmetic."""
    torch.manual_seed(0)
    gate_up = torch.randn(64, 2 * 96).bfloat16()
    weights = torch.rand(64)  # fp32, as the router makes them
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (gate * torch.sigmoid(gate) * up * weights.bfloat16().float()[:, None]).bfloat16()
    got = scaled_swiglu(gate_up, weights)
    assert torch.equal(got, expected)
    # and it is not the fp32-weight product, which differs in the last bf16 bit for some rows
    unrounded = (gate * torch.sigmoid(gate) * up * weights[:, None]).bfloat16()
    assert not torch.equal(got, unrounded)


def test_fp8_precision_needs_te_on_a_gpu_and_te_experts():
    model = MoEForCausalLM(preset("tiny"))
    with pytest.raises(ValueError, match="needs Transformer Engine FP8 on a GPU"):
        model.set_precision("fp8")
    hopper = hardware.evaluate(hardware.fake_environment("hopper"))
    with pytest.raises(ValueError, match="NVIDIA H200.*cannot run MXFP8BlockScaling"):
        model.set_precision("MXFP8BlockScaling", capabilities=hopper)
    assert model.set_precision("bf16").precision is recipes.BF16


def test_te_ops_require_fused_option_is_kept():
    experts = TEOpsExperts(2, 64, 64, require_fused=True, glu_interleave_size=32)
    assert experts.require_fused and experts.glu_interleave_size == 32
    with pytest.raises(ValueError, match="takes no options"):
        convert_experts(experts, "naive", align=16)


def test_te_ops_with_block_scaling_is_refused_on_hopper():
    from moe_tutorial.precision.recipes import check_backend_runs, recipe_for

    hopper = hardware.evaluate(hardware.fake_environment("hopper"))
    block = recipe_for(hopper, "Float8BlockScaling")
    with pytest.raises(ValueError, match="no cuBLAS GEMM algorithm on NVIDIA H200"):
        check_backend_runs("te_ops", block, hopper)
    check_backend_runs("te_grouped_linear", block, hopper)  # this one works


@pytest.mark.parametrize("backend, options, recipe, rows", [
    ("te_grouped_linear", {}, None, 1),
    ("te_grouped_linear", {}, "DelayedScaling", 16),
    ("te_grouped_linear", {}, "Float8BlockScaling", 16),
    ("te_grouped_linear", {}, "MXFP8BlockScaling", 32),
    ("te_ops", {}, "MXFP8BlockScaling", 32),  # no 32-wide interleave: the fused MLP cannot run
    ("te_ops", dict(glu_interleave_size=32), "MXFP8BlockScaling", 256),
    ("te_ops", dict(glu_interleave_size=32), "NVFP4BlockScaling", 256),
    ("te_ops", dict(glu_interleave_size=32), "DelayedScaling", 16),
    ("te_ops", dict(glu_interleave_size=32), None, 1),
    ("te_ops", dict(glu_interleave_size=32, align=64), "MXFP8BlockScaling", 64),  # fixed by hand
])
def test_experts_work_out_their_rows_alignment_from_the_recipe(backend, options, recipe, rows):
    """The experts read the active recipe themselves (no setter pushes it onto them): TE's
    alignment for the recipe, 256 rows where the fused grouped MLP can run."""
    module = convert_experts(_experts(E=2, H=64, I=64), backend, **options)
    assert module.rows_alignment(RecipeSpec(recipe) if recipe else None) == rows
    assert not hasattr(module, "recipe_name")
