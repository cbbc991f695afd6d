import json

import pytest

from moe_tutorial.precision.hardware import (
    FALLBACK,
    FEATURES,
    NATIVE,
    capabilities,
    evaluate,
    fake_environment,
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
    with pytest.raises(ValueError, match="cpu, hopper, blackwell or rtx_blackwell"):
        fake_environment("tpu")


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
