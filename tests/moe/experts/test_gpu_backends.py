"""The TE paths on a real GPU, against the references (run with `pytest -m gpu` on the GPU)."""

import pytest
import torch

from moe_tutorial.moe.config import preset
from moe_tutorial.moe.dispatch import run_experts, te_dispatch
from moe_tutorial.moe.experts import convert_experts, create, interleave_glu
from moe_tutorial.moe.hf import to_hf_state_dict
from moe_tutorial.moe.model import MoEForCausalLM, route
from moe_tutorial.moe.routing import permute
from moe_tutorial.precision import hardware
from moe_tutorial.precision.recipes import recipe_for, supported_recipes

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def te():
    module = hardware.transformer_engine()
    if module is None:
        pytest.skip(f"Transformer Engine not usable here: {hardware.capabilities().env.te_import_error}")
    return module


def _relerr(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _problem(E=8, H=256, I=512, T=1024, k=2, skew=False):
    torch.manual_seed(0)
    ref = create("naive", E, H, I, dtype=torch.bfloat16, device="cuda")
    torch.nn.init.normal_(ref.gate_up_proj, std=0.05)
    torch.nn.init.normal_(ref.down_proj, std=0.05)
    logits = torch.randn(T, E)
    if skew:
        logits[:, -2:] -= 100.0  # the last two experts receive no tokens
    w, idx = route(logits, k)
    return ref, torch.randn(T, H, dtype=torch.bfloat16, device="cuda"), w.cuda(), idx.cuda()


def _fwd_bwd(module, x, idx, w, recipe=None):
    """(output, input grad, routing-weight grad, what the dispatcher and experts ran)"""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    ctx = (hardware.transformer_engine().autocast(enabled=True, recipe=recipe) if recipe
           else torch.autocast("cuda", enabled=False))
    with ctx:
        out, path = run_experts(module, x, idx, w)
    out.float().square().sum().backward()
    return out, x.grad, w.grad, path


def test_te_dispatch_equals_the_reference_permutation(te):
    _, x, w, idx = _problem(skew=True)
    for align in (1, 16, 128):
        d = te_dispatch(x, idx, w, 8, align, te)
        rows, row_w, perm = permute(x, idx, w, 8, align)
        assert d.rows_per_expert.tolist() == perm.m_splits.tolist()
        assert d.rows_per_expert.device.type == "cuda"
        assert torch.equal(d.rows, rows), f"align {align}"
        torch.testing.assert_close(d.row_weights, row_w)
        y = rows * 2
        torch.testing.assert_close(d.combine(y, True).float(),
                                   (x.float() * 2 * w.sum(-1, keepdim=True)).to(x.dtype).float(),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend, options", [("grouped_torch", {}), ("te_permute_grouped_mm", {}),
                                              ("te_grouped_linear", {}),
                                              ("te_ops", {}), ("te_ops", dict(glu_interleave_size=32))])
@pytest.mark.parametrize("skew", [False, True])
def test_bf16_backends_match_the_loop(te, backend, options, skew):
    ref, x, w, idx = _problem(skew=skew)
    expected = _fwd_bwd(ref, x, idx, w)
    module = convert_experts(create("grouped_torch", 8, 256, 512, dtype=torch.bfloat16,
                                    device="cuda"), backend, **options)
    module.load_hf_weights(ref.gate_up_proj, ref.down_proj)
    got = _fwd_bwd(module, x, idx, w)
    for a, b, what in zip(expected, got, ("output", "input grad", "routing-weight grad")):
        assert _relerr(b, a) < 2e-2, f"{backend} {what}: {_relerr(b, a):.2e}"
    if backend.startswith("te"):
        assert "te." in got[3] and "pure-PyTorch" not in got[3]


def test_our_interleave_is_tes(te):
    w = torch.randn(2 * 128, 64, device="cuda")
    assert torch.equal(interleave_glu(w, 32), te.interleave_glu_tensor(w, 32))


def _fp8_cases():
    caps = hardware.capabilities()
    cases = []
    for recipe in supported_recipes(caps):
        cases.append(("te_grouped_linear", recipe))
        if recipe != "Float8BlockScaling":  # cuBLAS has no algorithm for it in te.ops (TE 2.20)
            cases.append(("te_ops", recipe))
    return cases


@pytest.mark.parametrize("backend, recipe_name", _fp8_cases())
def test_fp8_backends_within_fp8_tolerance(te, backend, recipe_name):
    choice = recipe_for(hardware.capabilities(), recipe_name)
    ref, x, w, idx = _problem(skew=True)
    expected = _fwd_bwd(ref, x, idx, w)
    module = convert_experts(ref, backend)  # its alignment comes from the recipe under autocast
    got = _fwd_bwd(module, x, idx, w, recipe=choice.build())
    # FP8 E4M3 keeps 3 mantissa bits: ~3.6% RMS error per quantised operand, ~7-9% after two
    # GEMMs; 0.15 catches wrong answers (~100%) while allowing FP8's rounding.
    for a, b, what in zip(expected, got, ("output", "input grad", "routing-weight grad")):
        assert _relerr(b, a) < 0.15, f"{backend}/{recipe_name} {what}: {_relerr(b, a):.3f}"
    assert f"align {choice.align}" in got[3]


def test_hopper_runs_te_ops_unfused_and_says_why(te):
    caps = hardware.capabilities()
    if caps.env.compute_capability[0] == 10:
        pytest.skip("Blackwell: the fused path is tested by test_fused_path_on_blackwell")
    ref, x, w, idx = _problem()
    module = convert_experts(ref, "te_ops", glu_interleave_size=32)
    run_experts(module, x, idx, w)
    assert module.fused is False
    assert "unfused" in module.last_path and "compute capability 10.x" in module.last_path
    module.require_fused = True
    with pytest.raises(RuntimeError, match="require_fused=True"):
        run_experts(module, x, idx, w)


def test_fused_path_on_blackwell(te):
    caps = hardware.capabilities()
    if caps.env.compute_capability[0] != 10 or not caps.is_native("fused_grouped_mlp"):
        pytest.skip(f"needs Blackwell with the fused grouped MLP enabled: "
                    f"{caps['fused_grouped_mlp'].reason}")

    ref, x, w, idx = _problem(H=1024, I=1024)
    choice = recipe_for(caps, "MXFP8BlockScaling")
    module = convert_experts(ref, "te_ops", glu_interleave_size=32, require_fused=True)
    expected = _fwd_bwd(ref, x, idx, w)
    got = _fwd_bwd(module, x, idx, w, recipe=choice.build())
    assert module.fused, module.last_path
    assert _relerr(got[0], expected[0]) < 0.15


def test_model_fp8_keeps_router_and_lm_head_in_bf16(te):
    cfg = preset("tiny", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                 num_experts=8, dtype="bfloat16", max_seq_len=128)
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg, device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (4, 128), device="cuda")
    targets = torch.roll(ids, -1, 1)
    bf16_loss = model(ids, targets).loss.item()
    model.set_expert_backend("te_ops").set_precision("fp8")
    layer = model.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
        assert type(proj).__name__ == "Linear" and "transformer_engine" in type(proj).__module__
    assert isinstance(layer.mlp.gate, torch.nn.Module) and type(model.lm_head) is torch.nn.Linear
    out = model(ids, targets)
    out.loss.backward()
    assert abs(out.loss.item() - bf16_loss) < 0.05
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert f"align {model.precision.align}" in model.expert_paths()[0]
    # the HF-layout export still works after the TE conversion
    state = to_hf_state_dict(model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    assert not any(k.endswith("_extra_state") for k in state)


def test_hf_baseline_same_weights_same_loss(te):
    from moe_tutorial.moe.batch import next_token_targets
    from moe_tutorial.moe.hf_baseline import hf_mixtral, hf_training_loss

    cfg = preset("tiny", hidden_size=256, intermediate_size=512, dtype="bfloat16", max_seq_len=128)
    model = MoEForCausalLM(cfg, device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (2, 128), device="cuda")
    ours = model(ids, next_token_targets(ids)).loss.item()
    for impl in ("eager", "grouped_mm"):
        hf = hf_mixtral(model, impl)
        assert abs(hf_training_loss(hf, ids).item() - ours) < 0.02, impl


def test_capability_table_on_this_gpu(te):
    caps = hardware.capabilities()
    assert caps.is_native("te_grouped_linear") and caps.is_native("te_ops_grouped_mlp")
    assert caps.is_native("grouped_mm")


def test_scaled_swiglu_counterpart_equals_te(te):
    """experts.scaled_swiglu computes what TE's ScaledSwiGLU computes: routing weights cast to
    the compute dtype first (ops/basic/swiglu.py), bit for bit, plain and interleaved."""
    torch.manual_seed(0)
    from moe_tutorial.moe.experts import scaled_swiglu

    x = torch.randn(512, 2 * 256, dtype=torch.bfloat16, device="cuda")
    scales = torch.rand(512, device="cuda")  # fp32, as the router makes them
    for interleave in (None, 32):
        op = te.ops.ScaledSwiGLU(glu_interleave_size=interleave)
        seq = te.ops.Sequential(op)
        got = seq(x, scales)
        expected = scaled_swiglu(x, scales, interleave)
        mismatched = (got != expected).sum().item()
        assert mismatched == 0, (f"interleave {interleave}: {mismatched} of {got.numel()} differ, "
                                 f"max {(got.float() - expected.float()).abs().max().item():.3g}")


def test_te_fuser_chooses_the_fused_mlp_for_the_course_construction(te):
    """TE's own fusion pass, with the machine checks answered as on a B200, fuses the course's
    te_ops chain under MXFP8 and NVFP4, and every broken condition agrees with why_unfused."""
    from moe_tutorial.perf.blackwell import dry_run

    report = dry_run(shapes=("fine_grained",), log=lambda line: None)
    summary = report["summary"]["fine_grained"]
    assert summary["fused_selected_mxfp8"] and summary["fused_selected_nvfp4"]
    bad = [c for c in report["shapes"]["fine_grained"]["cases"] if not c["agrees"]]
    assert not bad, bad
    assert summary["row_check_raises_on_100_rows"]


def test_the_torch_grouped_paths_give_the_loops_weight_gradients(te):
    """`grouped_torch` and `te_permute_grouped_mm` train the HF-layout weights themselves: their
    weight gradients (torch._grouped_mm's backward) are the loop's."""
    ref, x, w, idx = _problem(skew=True)
    _fwd_bwd(ref, x, idx, w)
    for backend in ("grouped_torch", "te_permute_grouped_mm"):
        module = create("grouped_torch", 8, 256, 512, dtype=torch.bfloat16, device="cuda")
        module.load_hf_weights(ref.gate_up_proj, ref.down_proj)
        module = convert_experts(module, backend)
        _fwd_bwd(module, x, idx, w)
        for name in ("gate_up_proj", "down_proj"):
            got, expected = getattr(module, name).grad, getattr(ref, name).grad
            assert _relerr(got, expected) < 2e-2, f"{backend} {name}.grad: {_relerr(got, expected):.2e}"


def test_auto_picks_the_small_expert_path_and_trains_like_grouped_torch(te):
    """`set_expert_backend("auto")` on a GPU with TE: small bf16 experts run TE's permutation
    around torch._grouped_mm (`experts.default_backend`), and three AdamW steps give the losses
    of the pure-PyTorch grouped path from the same weights."""
    cfg = preset("tiny", hidden_size=256, intermediate_size=512, num_experts=8, dtype="bfloat16",
                 max_seq_len=128)
    ids = torch.randint(0, cfg.vocab_size, (4, 128), device="cuda")
    targets = torch.roll(ids, -1, 1)
    losses = {}
    for backend in ("grouped_torch", "auto"):
        torch.manual_seed(0)
        model = MoEForCausalLM(cfg, device="cuda").set_expert_backend(backend)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[backend] = []
        for _ in range(3):
            loss = model(ids, targets).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[backend].append(loss.item())
        if backend == "auto":
            assert all(p.startswith("te.moe_permute") and "torch._grouped_mm" in p
                       for p in model.expert_paths()), model.expert_paths()
    for a, b in zip(losses["grouped_torch"], losses["auto"]):
        assert abs(a - b) < 0.02, losses
    assert losses["auto"][-1] < losses["auto"][0]
