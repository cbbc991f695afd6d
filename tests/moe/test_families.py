"""Our model against HF transformers' other MoE families (Qwen3-MoE, OLMoE, Qwen2-MoE, and
DeepSeek-V3's MoE block): same weights, same logits, loss and every gradient — with both of
transformers' experts implementations, with every expert backend of ours, and for a second
config per family of other shapes (the "hidden" configs: scaled-down published configs with
other heads, kv heads, experts, top-k and options switched on).

Mixtral's parity is tests/moe/test_model.py's. Every HF config is built in code (no network)."""

import zlib

import pytest
import torch
import torch.distributed as dist

from moe_tutorial.moe import families
from moe_tutorial.moe.batch import next_token_targets
from moe_tutorial.moe.config import MoEConfig
from moe_tutorial.moe.experts import EXPERT_BACKENDS, convert_experts
from moe_tutorial.moe.hf import from_hf, hf_gradients, to_hf_state_dict
from moe_tutorial.moe.model import MoEBlock, MoEForCausalLM, Router
from moe_tutorial.moe.routing import group_limited_top_k, route_sigmoid, update_correction_bias
from moe_tutorial.parallel import ranks

transformers = pytest.importorskip("transformers", minversion="5.0")

HF_EXPERTS = ("eager", "grouped_mm")  # transformers' CPU-capable experts implementations
TOLERANCE = 1e-4  # relative: max |ours - HF| / max |HF| for outputs, norm ratio for gradients

SHARED = dict(vocab_size=128, num_hidden_layers=2, max_position_embeddings=64,
              router_aux_loss_coef=0.02)
# family -> config name -> HF config kwargs. "tiny": the family's own features at their
# defaults; "hidden": other shapes (published ratios scaled down) and the options switched on.
HF_CONFIGS = {
    "qwen3_moe": {  # head_dim twice hidden / heads, as in Qwen3-30B-A3B (2048 / 32 heads, 128)
        "tiny": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                     intermediate_size=64, norm_topk_prob=False),
        "hidden": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                       num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                       intermediate_size=64, norm_topk_prob=True, attention_bias=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    },
    "olmoe": {  # q and k normalised over the whole projection; clip_qkv clamps; "tiny" keeps
        # OLMoE's padding token (pad_token_id=1: that embedding row gets no gradient)
        "tiny": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                     num_experts=8, num_experts_per_tok=2, intermediate_size=16,
                     norm_topk_prob=False),
        "hidden": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                       num_experts=4, num_experts_per_tok=1, intermediate_size=32,
                       norm_topk_prob=True, pad_token_id=None, clip_qkv=0.5,
                       attention_bias=True),
    },
    "qwen2_moe": {  # a gated shared expert, q/k/v biases
        "tiny": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                     shared_expert_intermediate_size=32, intermediate_size=64,
                     norm_topk_prob=False),
        "hidden": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=8,
                       num_experts=6, num_experts_per_tok=4, moe_intermediate_size=24,
                       shared_expert_intermediate_size=48, intermediate_size=64,
                       norm_topk_prob=True, qkv_bias=False),
    },
}
DEEPSEEK_MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8,
                    qk_nope_head_dim=8, intermediate_size=64, first_k_dense_replace=0)
DEEPSEEK_CONFIGS = {  # the MoE block: sigmoid, bias-corrected, group-limited, scaled
    "tiny": dict(hidden_size=32, num_attention_heads=4, n_routed_experts=8, n_group=4,
                 topk_group=2, num_experts_per_tok=2, moe_intermediate_size=16,
                 n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True),
    "hidden": dict(hidden_size=64, num_attention_heads=8, n_routed_experts=8, n_group=2,
                   topk_group=1, num_experts_per_tok=3, moe_intermediate_size=24,
                   n_shared_experts=2, routed_scaling_factor=1.0, norm_topk_prob=False),
}
CASES = [(family, name) for family, configs in HF_CONFIGS.items() for name in configs]


def _hf_config(family, name):
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(**SHARED, **DEEPSEEK_MLA, **DEEPSEEK_CONFIGS[name])
    config_class = getattr(transformers, families.FAMILIES[family].config_class)
    return config_class(**SHARED, **HF_CONFIGS[family][name])


@torch.no_grad()
def _randomise(module, seed):
    """Weights far from HF's small initialisation (norm scales and biases too), so that a
    missing scale, bias or normalisation shows in the outputs."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1 + 0.3 * noise if "norm" in name else 0.15 * noise)


def _hf_model(family, name):
    config = _hf_config(family, name)
    causal_lm = getattr(transformers, families.FAMILIES[family].causal_lm)
    model = causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    _randomise(model, seed=zlib.crc32(f"{family}/{name}".encode()))
    return model


@pytest.fixture(scope="module")
def hf_models():
    """One HF model per (family, config), built on first use and shared by every test."""
    cache = {}

    def get(family, name):
        if (family, name) not in cache:
            cache[family, name] = _hf_model(family, name)
        return cache[family, name]

    return get


def _use_experts(hf, implementation):
    hf.set_experts_implementation(implementation)
    assert hf.config._experts_implementation == implementation
    hf.zero_grad(set_to_none=True)
    return hf


def _relative(ours, ref):
    return ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def _gradient_errors(ours: dict, hf_params: dict) -> dict[str, float]:
    assert set(ours) == set(hf_params), set(ours) ^ set(hf_params)
    return {name: ((grad - hf_params[name].grad).norm()
                   / hf_params[name].grad.norm().clamp_min(1e-12)).item()
            for name, grad in ours.items()}


def _compare_with_hf(hf, ours):
    """Relative errors of ours against HF: logits, loss, worst parameter gradient."""
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = hf(ids, labels=ids, output_router_logits=True)
    out = ours(ids, next_token_targets(ids))
    ref.loss.backward()
    out.loss.backward()
    grads = _gradient_errors(hf_gradients(ours), dict(hf.named_parameters()))
    worst = max(grads, key=grads.get)
    return {"logits": _relative(out.logits, ref.logits), "loss": _relative(out.loss, ref.loss),
            "aux_loss": _relative(out.aux_loss, ref.aux_loss), "gradient": grads[worst],
            "worst gradient": worst}


def _assert_within_tolerance(errors):
    for what in ("logits", "loss", "aux_loss", "gradient"):
        assert errors[what] <= TOLERANCE, f"{what}: relative difference {errors[what]:.2e} {errors}"


@pytest.mark.parametrize("hf_experts", HF_EXPERTS)
@pytest.mark.parametrize("family, name", CASES)
def test_logits_loss_and_gradients_match_hf(hf_models, family, name, hf_experts):
    hf = _use_experts(hf_models(family, name), hf_experts)
    ours = from_hf(hf)
    assert ours.config.family == family
    _assert_within_tolerance(_compare_with_hf(hf, ours))


@pytest.mark.parametrize("backend", EXPERT_BACKENDS)
@pytest.mark.parametrize("family", HF_CONFIGS)
def test_every_expert_backend_runs_every_family(hf_models, family, backend):
    """The routed experts take (hidden, indices, weights) whatever the router and whatever
    sits beside them: every backend (the TE ones through their CPU reference modules) gives
    HF's numbers."""
    hf = _use_experts(hf_models(family, "tiny"), "eager")
    ours = from_hf(hf, expert_backend=backend)
    assert ours.expert_backend == backend
    _assert_within_tolerance(_compare_with_hf(hf, ours))


def test_from_hf_passes_the_backend_options(hf_models):
    """The fused grouped MLP's options (rows per expert, the GLU interleave) reach the experts
    in one call, and the numbers stay HF's."""
    hf = _use_experts(hf_models("qwen3_moe", "tiny"), "eager")
    width = hf.config.moe_intermediate_size  # the interleave block must divide the expert width
    ours = from_hf(hf, expert_backend="te_ops", align=32, glu_interleave_size=width)
    experts = ours.model.layers[0].mlp.experts
    assert (experts.align, experts.glu_interleave_size) == (32, width)
    _assert_within_tolerance(_compare_with_hf(hf, ours))


@pytest.mark.parametrize("family, name", CASES)
def test_our_weights_load_into_hf(family, name):
    """to_hf_state_dict of a model built here (our initialisation) loads strictly into the HF
    model of the same config, which then computes our logits; and the config round-trips."""
    config = MoEConfig.from_hf_config(_hf_config(family, name))
    ours = MoEForCausalLM(config)
    family_info = families.FAMILIES[family]
    hf_config = getattr(transformers, family_info.config_class)(**config.to_hf_config_kwargs())
    assert MoEConfig.from_hf_config(hf_config) == config
    hf = getattr(transformers, family_info.causal_lm)._from_config(
        hf_config, attn_implementation="sdpa", dtype=torch.float32)
    hf.load_state_dict(to_hf_state_dict(ours), strict=True)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    assert _relative(ours(ids).logits, hf(ids).logits) <= TOLERANCE


ALL_CASES = CASES + [("deepseek_v3", name) for name in DEEPSEEK_CONFIGS]


def _our_config(family, name):
    return MoEConfig.from_hf_config(_hf_config(family, name),
                                    moe_block_only=family == "deepseek_v3")


@pytest.mark.parametrize("family, name", ALL_CASES)
def test_parameter_counts_match_the_model(family, name):
    """Shared experts, q/k norms and biases counted: the expert / dense split is the one expert
    parallelism shards by (only the routed experts are sharded)."""
    config = _our_config(family, name)
    params = dict(MoEForCausalLM(config).named_parameters())
    counts = config.parameter_counts()
    expert = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    assert (counts["expert"], counts["total"]) == (expert, sum(p.numel() for p in params.values()))


@pytest.mark.parametrize("family", [*HF_CONFIGS, "deepseek_v3"])
def test_every_family_trains_in_bf16(family):
    model = MoEForCausalLM(_our_config(family, "hidden").with_overrides(dtype="bfloat16"))
    ids = torch.randint(0, 128, (2, 16))
    loss = model(ids, next_token_targets(ids)).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


# --- DeepSeek-V3: the MoE block (MLA attention is not implemented) ---------------------------
@pytest.fixture(scope="module")
def deepseek_models():
    cache = {}

    def get(name):
        if name not in cache:
            hf = _hf_model("deepseek_v3", name)
            with torch.no_grad():  # a trained model's bias: it must steer the choice alone
                for layer in hf.model.layers:
                    layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
            cache[name] = hf
        return cache[name]

    return get


def _our_block(hf_block, hf_config, backend):
    config = MoEConfig.from_hf_config(hf_config, moe_block_only=True)
    block = MoEBlock(config, "grouped_torch")
    block.load_state_dict({families.hf_key_to_ours(k): v for k, v in hf_block.state_dict().items()})
    block.experts = convert_experts(block.experts, backend)
    return block


def _block_gradients(block) -> dict:
    grads = {families.our_key_to_hf(name, "deepseek_v3"): p.grad
             for name, p in block.named_parameters() if not name.startswith("experts.")}
    grads["experts.gate_up_proj"], grads["experts.down_proj"] = block.experts.hf_gradients()
    return grads


@pytest.mark.parametrize("hf_experts, backend", [(impl, "grouped_torch") for impl in HF_EXPERTS]
                         + [("eager", backend) for backend in EXPERT_BACKENDS
                            if backend != "grouped_torch"])
@pytest.mark.parametrize("name", DEEPSEEK_CONFIGS)
def test_deepseek_v3_moe_block_matches_hf(deepseek_models, name, hf_experts, backend):
    hf = _use_experts(deepseek_models(name), hf_experts)
    hf_block = hf.model.layers[0].mlp
    block = _our_block(hf_block, hf.config, backend)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 24, hf.config.hidden_size, generator=gen)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, _ = block(x_ours)
    ref = hf_block(x_ref)
    grad_out = torch.randn(ref.shape, generator=gen)
    (out * grad_out).sum().backward()
    (ref * grad_out).sum().backward()
    assert _relative(out, ref) <= TOLERANCE
    assert _relative(x_ours.grad, x_ref.grad) <= TOLERANCE
    errors = _gradient_errors(_block_gradients(block), dict(hf_block.named_parameters()))
    assert max(errors.values()) <= TOLERANCE, errors


def test_deepseek_v3_full_model_is_refused_naming_mla(deepseek_models):
    with pytest.raises(ValueError, match=r"kv_lora_rank=16 .*multi-head latent attention \(MLA\)"):
        from_hf(deepseek_models("tiny"))
    with pytest.raises(ValueError, match=r"MLA\) is not implemented"):
        _our_config("deepseek_v3", "tiny").to_hf_config_kwargs()


# --- what is refused, by name ----------------------------------------------------------------
REFUSED = {
    "qwen3 dense layers listed": ("qwen3_moe", dict(mlp_only_layers=[1]), r"mlp_only_layers=\[1\]"),
    "qwen3 sparse every 2nd layer": ("qwen3_moe", dict(decoder_sparse_step=2),
                                     r"decoder_sparse_step=2"),
    "qwen3 sliding window": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8),
                             r"sliding_window=8"),
    "qwen2 sliding layers": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8,
                                               max_window_layers=2), r"layer_types="),
    "olmoe tied embeddings": ("olmoe", dict(tie_word_embeddings=True),
                              r"tie_word_embeddings=True"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_unsupported_option_is_refused_by_its_hf_name(case):
    family, overrides, pattern = REFUSED[case]
    kwargs = SHARED | HF_CONFIGS[family]["tiny"] | overrides
    config = getattr(transformers, families.FAMILIES[family].config_class)(**kwargs)
    with pytest.raises(ValueError, match=pattern):
        MoEConfig.from_hf_config(config)


def test_the_padding_row_gets_no_gradient_as_in_hf(hf_models):
    """OLMoE's pad_token_id=1, converted exactly: the row starts as HF's init leaves it (zero),
    a batch full of padding tokens still reads its row, and neither model's row gets a gradient."""
    hf = _use_experts(hf_models("olmoe", "tiny"), "eager")
    assert hf.config.pad_token_id == 1
    ours = from_hf(hf)
    assert ours.config.pad_token_id == 1 and ours.model.embed_tokens.padding_idx == 1
    assert ours.config.to_hf_config_kwargs()["pad_token_id"] == 1
    ids = torch.tensor([[1, 5, 1, 7, 1, 1, 9, 2]])
    ref = hf(ids, labels=ids)
    out = ours(ids, next_token_targets(ids))
    assert _relative(out.logits, ref.logits) <= TOLERANCE
    ref.loss.backward()
    out.lm_loss.backward()
    for model in (hf, ours):
        grad = model.model.embed_tokens.weight.grad
        assert grad[1].abs().max() == 0 and grad[5].abs().max() > 0
    fresh = MoEForCausalLM(ours.config)
    assert fresh.model.embed_tokens.weight[1].abs().max() == 0
    assert fresh.model.embed_tokens.weight[2].abs().max() > 0


FAMILY_DEFAULTS = {"mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig",
                   "olmoe": "OlmoeConfig", "qwen2_moe": "Qwen2MoeConfig"}


@pytest.mark.parametrize("family", sorted(FAMILY_DEFAULTS))
def test_each_familys_default_config_converts_with_no_field_changed(family):
    """transformers' own default config of each family converts as published, each field read
    as it is (pad_token_id included) and written back the same."""
    hf = getattr(transformers, FAMILY_DEFAULTS[family])()
    config = MoEConfig.from_hf_config(hf)
    assert config.family == family
    assert config.pad_token_id == hf.pad_token_id
    kwargs = config.to_hf_config_kwargs()
    for name, hf_name in families.FAMILIES[family].fields.items():
        assert kwargs[hf_name] == getattr(hf, hf_name), name


def test_deepseek_v3s_default_config_converts_its_moe_block():
    """DeepSeek-V3's MLA attention is what this model cannot represent: refused by name whole,
    its MoE block converted with no field changed."""
    hf = transformers.DeepseekV3Config()
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MoEConfig.from_hf_config(hf)
    block = MoEConfig.from_hf_config(hf, moe_block_only=True)
    assert (block.num_experts, block.top_k, block.n_group) == (
        hf.n_routed_experts, hf.num_experts_per_tok, hf.n_group)


@pytest.mark.parametrize("name", ["olmoe-1b-7b", "qwen3-moe-30b-a3b", "deepseek-v3"])
def test_every_shipped_config_converts_with_no_field_changed(name):
    from moe_tutorial.perf import analyze

    model = analyze.load_model(name)
    assert model.notes == (), model.notes  # nothing read other than it is written
    assert model.moe_block_only == (name == "deepseek-v3")


def test_a_config_its_family_cannot_express_is_refused():
    qwen3 = MoEConfig.from_hf_config(_hf_config("qwen3_moe", "tiny"))
    with pytest.raises(ValueError, match=r"qkv_bias=True and o_proj_bias=False differ"):
        qwen3.with_overrides(qkv_bias=True).to_hf_config_kwargs()
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size=8"):
        MoEConfig(shared_expert_intermediate_size=8).to_hf_config_kwargs()  # Mixtral has none


# --- routing: group-limited choice and the aux-loss-free bias ---------------------------------
def test_group_limited_top_k_chooses_within_the_best_groups():
    scores = torch.rand(64, 8)
    indices = group_limited_top_k(scores, top_k=3, n_group=4, topk_group=2)
    group_scores = scores.view(64, 4, 2).sum(-1)  # two experts per group: both are its best two
    best = group_scores.topk(2, dim=-1).indices
    assert all(set((indices[t] // 2).tolist()) <= set(best[t].tolist()) for t in range(64))


def test_correction_bias_changes_the_choice_not_the_weights():
    logits = torch.randn(32, 8, requires_grad=True)
    bias = torch.zeros(8)
    bias[5] = 10.0  # far above any sigmoid score difference: expert 5 is always chosen
    weights, indices = route_sigmoid(logits, 2, bias, normalize=False, scaling_factor=2.0)
    assert (indices == 5).any(-1).all()
    scores = torch.sigmoid(logits.detach())
    torch.testing.assert_close(weights.detach(), 2.0 * scores.gather(1, indices))
    weights.sum().backward()  # the gradient flows to the logits, never to the bias
    assert logits.grad.abs().sum() > 0


def test_bias_update_moves_towards_balance():
    bias = torch.zeros(4)
    update_correction_bias(bias, torch.tensor([10, 2, 2, 2]), rate=0.01)
    torch.testing.assert_close(bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    update_correction_bias(bias, torch.tensor([4, 4, 4, 4]), rate=0.01)  # balanced: stays
    torch.testing.assert_close(bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))


def test_model_balances_its_sigmoid_routers_after_each_step():
    """A skewed router (one expert favoured by its weights) gets that expert's bias lowered and
    the others' raised; the counts restart after the update, and no gradient reaches the bias."""
    config = _our_config("deepseek_v3", "tiny")
    model = MoEForCausalLM(config.with_overrides(router_bias_update_rate=1e-3, num_layers=1))
    router = model.model.layers[0].mlp.gate
    with torch.no_grad():
        router.weight[3] += 1.0  # expert 3's score rises for every token
    ids = torch.randint(0, config.vocab_size, (4, 16))
    model(ids, next_token_targets(ids)).loss.backward()
    load = router.tokens_since_bias_update.clone()
    assert load.sum() == 4 * 16 * config.top_k and load.argmax() == 3
    model.update_router_biases()
    bias = router.e_score_correction_bias
    assert bias[3] < 0 and torch.equal(torch.sign(bias), torch.sign(load.float().mean() - load))
    assert router.tokens_since_bias_update.sum() == 0
    assert "model.layers.0.mlp.gate.e_score_correction_bias" in model.state_dict()
    assert not any("tokens_since" in key for key in model.state_dict())
    assert not bias.requires_grad


def _one_step_of_bias_update_on_this_rank():
    """Each rank routes its own tokens with the same skewed router, then updates the bias."""
    config = _our_config("deepseek_v3", "tiny")
    torch.manual_seed(0)
    model = MoEForCausalLM(config.with_overrides(router_bias_update_rate=1e-3, num_layers=1))
    router = model.model.layers[0].mlp.gate
    with torch.no_grad():
        router.weight[dist.get_rank()] += 1.0  # rank r's tokens favour expert r
    ids = torch.randint(0, config.vocab_size, (2, 16),
                        generator=torch.Generator().manual_seed(dist.get_rank()))
    model(ids, next_token_targets(ids)).loss.backward()
    load = router.tokens_since_bias_update.clone()
    model.update_router_biases()
    return load, router.e_score_correction_bias.clone()


def test_ranks_update_one_bias_from_all_their_tokens():
    """Under data parallelism the bias follows the load of every rank's tokens, the same on each
    rank (the counts are all-reduced): from its own counts alone each rank would move another
    way."""
    (load0, bias0), (load1, bias1) = ranks.run(_one_step_of_bias_update_on_this_rank, 2,
                                               timeout_s=120)
    total = (load0 + load1).float()
    assert torch.equal(bias0, bias1)
    assert torch.equal(bias0, 1e-3 * torch.sign(total.mean() - total))
    assert not torch.equal(torch.sign(bias0), torch.sign(load0.float().mean() - load0))


def test_router_keeps_softmax_routers_free_of_sigmoid_state():
    router = Router(16, 4, 2)
    assert router.e_score_correction_bias is None and set(router.state_dict()) == {"weight"}
