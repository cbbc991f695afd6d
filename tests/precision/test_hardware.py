import json

import pytest

from moe_tutorial.precision.hardware import (
    FALLBACK,
    FEATURES,
    NATIVE,
    capabilities,
    evaluate,
    fake_environment,
    simulated_gpu,
    te_recipe_gates,
)


def test_this_machine_never_raises_and_covers_every_feature():
    caps = capabilities()
    assert list(caps.features) == list(FEATURES)
    for f in caps.features.values():
        assert f.status in ("native", "fallback", "unavailable")
        assert f.runs
        assert f.status == NATIVE or f.reason, f"{f.key} falls back without saying why"
    json.dumps(caps.to_dict())  # plain data all the way down
    assert "feature" in caps.table().splitlines()[0]


def test_cpu_machine():
    caps = evaluate(fake_environment("cpu"))
    assert caps.device == "cpu" and not caps.has_te
    assert all(f.status == FALLBACK for f in caps.features.values())
    assert "CPU kernel" in caps["grouped_mm"].runs
    assert "emulated" in caps["mxfp8"].runs
    assert "not importable" in caps["te_grouped_linear"].reason


def test_hopper_machine():
    caps = evaluate(fake_environment("hopper"))
    native = {k for k, f in caps.features.items() if f.status == NATIVE}
    assert native == {"grouped_mm", "te_grouped_linear", "fp8_current", "fp8_delayed",
                      "fp8_block", "te_ops_grouped_mlp"}
    assert "10.0 or higher" in caps["mxfp8"].reason
    assert caps["mxfp8"].runs.startswith("FP8 block scaling")
    fused = caps["fused_grouped_mlp"]
    assert fused.status == FALLBACK and fused.runs == "te.ops grouped MLP, unfused"
    assert "compute capability 10.x" in fused.reason and "9.0" in fused.reason
    assert caps["multi_gpu"].status == FALLBACK


def test_blackwell_machine_and_each_fused_condition():
    caps = evaluate(fake_environment("blackwell", gpu_count=8))
    assert caps.is_native("mxfp8") and caps.is_native("fused_grouped_mlp")
    assert caps.is_native("multi_gpu")
    for override, words in [(dict(fused_mlp_env_set=False), "NVTE_CUTEDSL_FUSED_GROUPED_MLP=1"),
                            (dict(cudnn_frontend_version="1.22.1"), "found 1.22.1"),
                            (dict(compute_capability=(12, 0)), "this is 12.0")]:
        fused = evaluate(fake_environment("blackwell", **override))["fused_grouped_mlp"]
        assert fused.status == FALLBACK and words in fused.reason


def test_te_reasons_are_passed_through():
    env = fake_environment("hopper", te_support={
        "fp8": (True, ""), "fp8_block_scaling": (False, "CUDA 12.9 or newer is required"),
        "mxfp8": (False, "needs sm_100")})
    caps = evaluate(env)
    assert caps["fp8_block"].status == FALLBACK
    assert caps["fp8_block"].reason == "CUDA 12.9 or newer is required"
    assert caps["mxfp8"].reason == "needs sm_100"


def test_old_gpu_and_old_torch():
    caps = evaluate(fake_environment("hopper", compute_capability=(7, 5), gpu_name="Tesla T4"))
    assert caps["grouped_mm"].status == FALLBACK and "7.5" in caps["grouped_mm"].reason
    caps = evaluate(fake_environment("cpu", has_grouped_mm=False))
    assert "no torch._grouped_mm" in caps["grouped_mm"].reason


def test_grouped_mm_is_one_kernel_on_compute_capability_9_and_10_only():
    """torch's `_grouped_mm_cuda` takes its CUTLASS kernel for major 9 or 10 only; an A100 (8.0)
    or an RTX-class Blackwell (12.0) loops over the experts after copying the offsets to the host."""
    for kind, cc in (("hopper", (9, 0)), ("blackwell", (10, 0))):
        assert evaluate(fake_environment(kind, compute_capability=cc)).is_native("grouped_mm")
    for kind, cc in (("hopper", (8, 0)), ("hopper", (8, 9)), ("rtx_blackwell", (12, 0))):
        feature = evaluate(fake_environment(kind, compute_capability=cc))["grouped_mm"]
        assert feature.status == FALLBACK and "9.x and 10.x" in feature.reason
        assert f"{cc[0]}.{cc[1]}" in feature.reason and "host" in feature.runs


def test_unknown_fake_kind():
    with pytest.raises(ValueError, match="choose cpu, ampere, ampere_rtx, ada, hopper, blackwell"):
        fake_environment("tpu")
    with pytest.raises(ValueError, match=r"compute capability \(7, 5\); choose one of 8.0, 8.6"):
        simulated_gpu((7, 5))


def test_rtx_blackwell_runs_no_mxfp8_and_no_fused_mlp():
    """TE 2.20 allows MXFP8 on compute capability 10.x-11.x only (_compute_mxfp8_support)."""
    caps = evaluate(fake_environment("rtx_blackwell"))
    assert caps["mxfp8"].status == FALLBACK and "12.0+" in caps["mxfp8"].reason
    assert caps.is_native("fp8_block")
    assert caps["fused_grouped_mlp"].status == FALLBACK
    assert "this is 12.0" in caps["fused_grouped_mlp"].reason


@pytest.mark.parametrize("value, enabled", [(None, False), ("0", False), ("1", True),
                                            ("2", True), ("-1", False), ("yes", False)])
def test_fused_mlp_env_is_read_as_te_reads_it(value, enabled):
    from moe_tutorial.precision.hardware import fused_mlp_env_enabled
    assert fused_mlp_env_enabled(value) is enabled


# What TE 2.20.2 itself answers, per compute capability (quantization.py's _compute_*_support),
# and so what each GPU generation runs: (native features, expected fallback reasons).
GENERATIONS = {
    (8, 0): (set(), {"fp8_current": "8.9 or higher required for FP8"}),
    (8, 6): (set(), {"fp8_current": "8.9 or higher required for FP8"}),
    (8, 9): ({"fp8_current", "fp8_delayed"},
             {"fp8_block": "compute capability 9.0 or higher", "mxfp8": "10.0 or higher"}),
    (9, 0): ({"grouped_mm", "fp8_current", "fp8_delayed", "fp8_block"},
             {"mxfp8": "10.0 or higher"}),
    (10, 0): ({"grouped_mm", "fp8_current", "fp8_delayed", "fp8_block", "mxfp8"}, {}),
}
TE_ON_ANY_GPU = {"te_grouped_linear", "te_ops_grouped_mlp"}  # bf16: Ampere and newer


@pytest.mark.parametrize("cc", list(GENERATIONS), ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
def test_each_gpu_generation_runs_what_tes_own_gates_allow(cc):
    native, reasons = GENERATIONS[cc]
    caps = evaluate(simulated_gpu(cc))
    assert {k for k in FEATURES if caps.is_native(k)} == native | TE_ON_ANY_GPU
    for key, words in reasons.items():
        assert caps[key].status == FALLBACK and words in caps[key].reason, caps[key]
    for key in set(FEATURES) - native - TE_ON_ANY_GPU:
        assert caps[key].reason, f"{key} falls back on sm_{cc[0]}{cc[1]} without saying why"


def test_ada_trains_in_te_fp8_only_with_a_cuda_12_1_torch():
    assert te_recipe_gates((8, 9), "12.1")["fp8"] == (True, "")
    ok, reason = te_recipe_gates((8, 9), "12.0")["fp8"]
    assert not ok and reason == "Cuda version 12.1 or higher required for FP8 execution on Ada."
    assert not te_recipe_gates((9, 0), "12.8")["fp8_block_scaling"][0]  # block scaling: 12.9+
    assert te_recipe_gates((12, 0), "13.0")["mxfp8"][0] is False


@pytest.mark.parametrize("kind, cc", [("ampere", (8, 0)), ("ampere_rtx", (8, 6)), ("ada", (8, 9)),
                                      ("hopper", (9, 0)), ("blackwell", (10, 0))])
def test_every_chapter_says_what_runs_on_each_gpu(kind, cc):
    caps = evaluate(fake_environment(kind))
    assert caps.env.compute_capability == cc
    plan = caps.chapters()
    assert list(plan) == [f"0{i}_{name}" for i, name in enumerate(
        ["naive_moe", "grouped_linear", "fp8_numerics", "fp8_training", "fused_grouped_mlp",
         "end_to_end", "expert_parallel", "your_model"], start=1)]
    assert plan["01_naive_moe"] == "plain PyTorch: runs as written"
    assert "native: te.ops grouped MLP" in plan["05_fused_grouped_mlp"]
    fp8 = plan["04_fp8_training"]
    if cc < (8, 9):  # Ampere: TE in bf16, every FP8 recipe emulated
        assert "native" not in fp8 and "FP8 numerics emulated" in fp8
        assert "torch._grouped_mm's own loop" in plan["02_grouped_linear"]
    elif cc == (8, 9):  # Ada: TE's per-tensor FP8 recipes, block scaling emulated
        assert fp8.startswith("native: TE FP8 current scaling, TE FP8 delayed scaling;")
        assert "TE FP8 block scaling -> FP8 numerics emulated" in fp8
    else:
        assert "TE FP8 block scaling" in fp8.split("; instead")[0]
    if cc == (10, 0):
        assert "instead" not in fp8 and "native: " in plan["05_fused_grouped_mlp"]
