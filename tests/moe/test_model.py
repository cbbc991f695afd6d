"""Our model against HF transformers' MixtralForCausalLM: same weights, same outputs."""

import pytest
import torch
import torch.nn.functional as F

from moe_tutorial.moe.batch import IGNORE_INDEX, next_token_targets
from moe_tutorial.moe.config import preset
from moe_tutorial.moe.hf import from_hf, to_hf_state_dict
from moe_tutorial.moe.loss import cross_entropy
from moe_tutorial.moe.model import MoEForCausalLM, RMSNorm
from moe_tutorial.precision.te_projections import fuse_attention_projections

transformers = pytest.importorskip("transformers", minversion="5.0")


def _hf_model(cfg, experts_implementation):
    hf_config = transformers.MixtralConfig(**cfg.to_hf_config_kwargs())
    model = transformers.MixtralForCausalLM._from_config(
        hf_config, attn_implementation="sdpa", experts_implementation=experts_implementation,
        dtype=torch.float32)
    assert model.config._experts_implementation == experts_implementation
    return model


@pytest.mark.parametrize("hf_experts", ["eager", "grouped_mm"])
@pytest.mark.parametrize("backend", ["naive", "grouped_torch"])
def test_parity_with_hf_mixtral(hf_experts, backend):
    cfg = preset("tiny")
    hf = _hf_model(cfg, hf_experts)
    ours = from_hf(hf, expert_backend=backend)
    ids = torch.randint(0, cfg.vocab_size, (3, 24))

    ref = hf(ids, labels=ids, output_router_logits=True)
    out = ours(ids, next_token_targets(ids))
    assert (out.logits - ref.logits).abs().max().item() <= 1e-4
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)

    ref.loss.backward()
    out.loss.backward()
    hf_params = dict(hf.named_parameters())
    assert set(hf_params) == {n for n, _ in ours.named_parameters()}
    for name, p in ours.named_parameters():
        g_ref = hf_params[name].grad
        rel = ((p.grad - g_ref).norm() / g_ref.norm().clamp_min(1e-12)).item()
        assert rel <= 1e-4, f"{name}: relative gradient difference {rel:.2e}"


def test_state_dict_round_trip_into_hf():
    cfg = preset("tiny")
    ours = MoEForCausalLM(cfg)  # our own initialisation
    hf = _hf_model(cfg, "eager")
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(ours), strict=True)
    assert not missing and not unexpected
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    torch.testing.assert_close(ours(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_from_hf_refuses_what_it_cannot_represent():
    cfg = preset("tiny")
    hf = _hf_model(cfg, "eager")
    hf.config.sliding_window = 8
    with pytest.raises(ValueError, match="sliding_window=8"):
        from_hf(hf)


def test_ignored_targets_and_sequence_limit():
    cfg = preset("tiny")
    model = MoEForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, 0] = ids[:, 1]
    out = model(ids, targets)
    manual = torch.nn.functional.cross_entropy(out.logits[:, 0].float(), ids[:, 1])
    torch.testing.assert_close(out.lm_loss, manual)
    assert len(out.router_logits) == cfg.num_layers
    assert model(ids).loss is None
    with pytest.raises(ValueError, match="exceeds config.max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


class _SplitLinear(torch.nn.Module):
    """Stands for `te.Linear` on a CPU: with `parameters_split` its weight is one parameter per
    part (`q_proj_weight`, ...), concatenated in the forward pass, as TE registers them."""

    def __init__(self, in_features, out_features, bias, params_dtype, device,
                 parameters_split=None):
        super().__init__()
        assert not bias
        self.names = [f"{n}_weight" for n in parameters_split] if parameters_split else ["weight"]
        rows = list(parameters_split.values()) if parameters_split else [out_features]
        for name, count in zip(self.names, rows):
            self.register_parameter(name, torch.nn.Parameter(
                torch.full((count, in_features), float("nan"), dtype=params_dtype, device=device)))

    def forward(self, x):
        return F.linear(x, torch.cat([getattr(self, n) for n in self.names]))


def test_fused_te_projections_keep_outputs_and_hf_weights():
    """What FP8 does to the attention (q, k, v as one split TE Linear, o_proj a TE Linear),
    with a stand-in for TE: the same logits, and `to_hf_state_dict` finds q, k, v again."""
    torch.manual_seed(0)
    model = MoEForCausalLM(preset("tiny"))
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    logits, state = model(ids).logits, to_hf_state_dict(model)
    te = type("te", (), {"Linear": _SplitLinear})
    for layer in model.model.layers:
        fuse_attention_projections(layer.self_attn, te)
        assert isinstance(layer.self_attn.o_proj, _SplitLinear) and layer.self_attn.qkv_proj
    torch.testing.assert_close(model(ids).logits, logits, rtol=1e-6, atol=1e-6)
    fused_state = to_hf_state_dict(model)
    assert fused_state.keys() == state.keys()
    assert all(torch.equal(fused_state[k], state[k]) for k in state)


def test_switching_backend_keeps_outputs():
    model = MoEForCausalLM(preset("tiny"), expert_backend="naive")
    ids = torch.randint(0, 24, (2, 16))
    ref = model(ids).logits
    model.set_expert_backend("grouped_torch")
    assert model.expert_backend == "grouped_torch"
    torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)
    assert model.expert_paths() == ["routing.permute → torch._grouped_mm"] * 2


def test_bf16_model_runs_and_is_close_to_fp32():
    cfg = preset("tiny")
    model = MoEForCausalLM(cfg)
    model16 = MoEForCausalLM(cfg.with_overrides(dtype="bfloat16"))
    model16.load_state_dict(model.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = next_token_targets(ids)
    loss, loss16 = model(ids, targets).loss, model16(ids, targets).loss
    assert abs(loss.item() - loss16.item()) < 0.05
    loss16.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model16.parameters())


@pytest.mark.parametrize("compiled", [False, True], ids=["chunked", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_torch_in_value_and_gradient(dtype, compiled):
    """Both ways: the chunked eager loop, and `loss_and_gradient` through torch.compile (on a
    CPU Inductor makes C++ kernels, the same graph the GPU's Triton kernels come from)."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(300, 50, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 50, (300,), generator=gen)
    targets[::7] = IGNORE_INDEX
    mine, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want = F.cross_entropy(ref.float(), targets, ignore_index=IGNORE_INDEX)
    # chunk 64 does not divide 300: a ragged last chunk
    got = cross_entropy(mine, targets, chunk=64, compiled=compiled)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(mine.detach(), logits)  # the logits (the model's output) are left untouched
    (2.0 * want).backward()
    (2.0 * got).backward()
    assert mine.grad.dtype == dtype
    torch.testing.assert_close(mine.grad, ref.grad, rtol=0, atol=1e-7 if dtype == torch.float32 else 0)
    assert mine.grad[::7].abs().max() == 0  # ignored targets get no gradient
    with torch.no_grad():  # evaluation takes torch's path: no gradient computed for nothing
        torch.testing.assert_close(cross_entropy(logits, targets), want.detach(), rtol=1e-6, atol=1e-6)


def test_rms_norm_is_hf_mixtrals_arithmetic():
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    norm = RMSNorm(32, 1e-5, dtype=torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    x32 = x.float()  # HF's MixtralRMSNorm, written out
    hf = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    torch.testing.assert_close(norm(x), hf, rtol=0, atol=0)


def test_compiled_norms_compute_what_the_eager_norms_compute():
    """`compiled_norms` reaches every RMSNorm (the q/k norms of a family that has them too), and
    the compiled kernels (C++ from Inductor on a CPU, Triton on a GPU) give the eager norm's
    output and gradients."""
    model = MoEForCausalLM(preset("tiny").with_overrides(qk_norm="per_head"))
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert not model.compiled_norms and len(norms) > 2 * model.config.num_layers + 1
    model.compiled_norms = True
    assert model.compiled_norms and all(m.compiled for m in norms)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, 32, generator=gen)
    eager, compiled = RMSNorm(32, 1e-6), RMSNorm(32, 1e-6)
    compiled.compiled = True
    for norm in (eager, compiled):
        norm.weight.data.copy_(torch.linspace(0.5, 1.5, 32))
    mine, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = compiled(mine), eager(ref)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    upstream = torch.randn(got.shape, generator=gen)
    got.backward(upstream)
    want.backward(upstream)
    torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled.weight.grad, eager.weight.grad, rtol=1e-5, atol=1e-5)


def test_compiled_hf_baseline_attends_causally_without_a_mask(monkeypatch):
    """`hf_baseline.compile_for_training` switches HF to an attention implementation whose mask
    function returns no mask (so sdpa takes is_causal=True and can use FlashAttention under
    torch.compile) — with the same loss as HF's own sdpa on unpadded batches."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from moe_tutorial.moe import hf_baseline

    cfg = preset("tiny")
    hf = hf_baseline.hf_mixtral(MoEForCausalLM(cfg), "grouped_mm")
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    before = hf_baseline.hf_training_loss(hf, ids)
    monkeypatch.setattr(torch, "compile", lambda fn: fn)  # compiling itself is slow on a CPU
    hf = hf_baseline.compile_for_training(hf)
    assert hf.config._attn_implementation == hf_baseline.CAUSAL_SDPA
    assert ALL_MASK_ATTENTION_FUNCTIONS[hf_baseline.CAUSAL_SDPA](batch_size=2, q_length=24) is None
    torch.testing.assert_close(hf_baseline.hf_training_loss(hf, ids), before)


@pytest.mark.gpu
def test_compiled_cross_entropy_matches_the_chunked_loop_on_the_gpu():
    """The Triton kernels torch.compile makes for `loss_and_gradient` on a GPU, at the
    benchmark's size (8,192 tokens, a 32k vocabulary, bf16 logits), against the eager loop."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(8192, 32000, generator=gen, device="cuda") * 4).to(torch.bfloat16)
    targets = torch.randint(0, 32000, (8192,), generator=gen, device="cuda")
    targets[::7] = IGNORE_INDEX
    grads = []
    for compiled in (False, True):
        mine = logits.clone().requires_grad_()
        loss = cross_entropy(mine, targets, compiled=compiled)
        loss.backward()
        grads.append((loss.detach(), mine.grad))
    (eager_loss, eager_grad), (loss, grad) = grads
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    # both compute in fp32 and round once to bf16: at most one bf16 step apart
    torch.testing.assert_close(grad.float(), eager_grad.float(), rtol=2 ** -7, atol=1e-9)
