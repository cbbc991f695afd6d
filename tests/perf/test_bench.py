"""The benchmark harness, at CPU size (the numbers themselves come from GPU runs)."""

import json
import os

import pytest
import torch

from moe_tutorial.cli import main
from moe_tutorial.moe.config import preset
from moe_tutorial.perf import bench, results, timing


def test_skewed_routing_is_skewed():
    shape = bench.EXPERT_SHAPES["tiny"]
    _, balanced = bench.make_routing(shape, "balanced")
    _, skewed = bench.make_routing(shape, "skewed")
    counts = lambda idx: torch.bincount(idx.flatten(), minlength=shape.experts).float()  # noqa: E731
    assert counts(skewed).std() > 3 * counts(balanced).std()
    assert counts(skewed)[0] > counts(skewed)[-1]


def test_expert_layer_bench_checks_before_timing():
    rows = bench.bench_expert_layer(bench.EXPERT_SHAPES["tiny"], "skewed", device="cpu",
                                    warmup=0, iters=2)
    assert [r["backend"] for r in rows] == ["naive", "grouped_torch", "te_permute_grouped_mm",
                                            "te_grouped_linear", "te_ops"]
    # Without TE on a GPU the course's default is the pure-PyTorch grouped path
    assert [r["backend"] for r in rows if r["default"]] == ["grouped_torch"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["rel_error"] <= r["tolerance"] and r["median_ms"] > 0 and r["precision"] == "fp32"
        assert r["speedup_vs_loop"] > 0
    assert "pure-PyTorch counterpart" in rows[-1]["path"]


def test_cutlass_variant_sets_tes_switch_for_forward_and_backward(monkeypatch):
    """A TE backend built with `cutlass=True` runs its GEMMs' forward and backward with
    NVTE_USE_CUTLASS_GROUPED_GEMM=1 (TE reads it at each GEMM call), says so in the path, and
    restores the environment after; the benchmark's row records the option."""
    from moe_tutorial.moe import experts

    monkeypatch.delenv(experts.CUTLASS_GROUPED_GEMM_ENV, raising=False)
    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", os.environ.get(experts.CUTLASS_GROUPED_GEMM_ENV)))
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(("backward", os.environ.get(experts.CUTLASS_GROUPED_GEMM_ENV)))
            return grad

    real = experts.TEOpsExperts.grouped_mlp
    monkeypatch.setattr(experts.TEOpsExperts, "grouped_mlp",
                        lambda self, rows, counts, w: real(self, Spy.apply(rows), counts, w))
    rows = bench.bench_expert_layer(bench.EXPERT_SHAPES["tiny"], device="cpu", warmup=0, iters=1,
                                    variants=[("naive", "bf16"), ("te_ops", "bf16", {"cutlass": True})])
    assert rows[1]["status"] == "ok" and rows[1]["backend"] == "te_ops" and rows[1]["cutlass"]
    assert rows[1]["path"].endswith("[NVTE_USE_CUTLASS_GROUPED_GEMM=1]")
    assert seen and set(seen) == {("forward", "1"), ("backward", "1")}
    assert experts.CUTLASS_GROUPED_GEMM_ENV not in os.environ


def test_cutlass_variants_only_on_hopper_with_te():
    from moe_tutorial.precision import hardware

    hopper = hardware.evaluate(hardware.fake_environment("hopper"))
    blackwell = hardware.evaluate(hardware.fake_environment("blackwell"))
    assert ("te_ops", "bf16", {"cutlass": True}) in bench.expert_variants(hopper)
    assert not any(v[2:] for v in bench.expert_variants(blackwell))
    cpu = hardware.capabilities(import_te=False)
    assert not any(v[2:] for v in bench.expert_variants(cpu))


def test_a_wrong_variant_is_reported_not_timed(monkeypatch):
    from moe_tutorial.moe import experts

    real = experts.GroupedTorchExperts.forward
    monkeypatch.setattr(experts.GroupedTorchExperts, "forward",
                        lambda self, *a: real(self, *a) * 1.5)  # a plausible bug: a wrong scale
    rows = bench.bench_expert_layer(bench.EXPERT_SHAPES["tiny"], device="cpu", warmup=0, iters=1,
                                    variants=[("naive", "bf16"), ("grouped_torch", "bf16")])
    assert rows[1]["status"] == "wrong" and "median_ms" not in rows[1]


def test_oom_and_errors_do_not_stop_the_run(monkeypatch):
    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(bench.Variant, "build", oom)
    rows = bench.bench_train_step(preset("tiny"), ["hf_eager", "ours_grouped_torch_bf16"],
                                  batch=1, seq_len=16, device="cpu", warmup=0, iters=1)
    assert [r["status"] for r in rows] == ["OOM", "OOM"]
    assert bench.classify_error(RuntimeError("... CUBLAS_STATUS_NOT_SUPPORTED ..."))["status"] == "unsupported"
    assert bench.classify_error(RuntimeError("boom"))["status"] == "error"


def test_summary_ratios():
    results = [
        dict(part="expert", shape="mixtral", routing="balanced", backend="naive", precision="bf16", status="ok", median_ms=50.0),
        dict(part="expert", shape="mixtral", routing="balanced", backend="te_ops", precision="bf16", status="ok", median_ms=25.0),
        dict(part="expert", shape="mixtral", routing="balanced", backend="te_ops", precision="DelayedScaling", status="ok", median_ms=20.0),
        dict(part="expert", shape="mixtral", routing="skewed", backend="te_ops", precision="bf16", status="ok", median_ms=1.0),
        dict(part="train", variant="hf_eager", status="ok", tokens_per_s=100.0, peak_memory_gb=30.0),
        dict(part="train", variant="hf_grouped_mm", status="ok", tokens_per_s=150.0, peak_memory_gb=20.0),
        dict(part="train", variant="ours_te_ops_fp8", status="ok", tokens_per_s=300.0, peak_memory_gb=18.0),
        dict(part="train", variant="ours_te_ops_bf16", status="OOM"),
    ]
    s = bench.summarize(results)
    assert s["expert_mixtral_best_bf16_speedup_vs_loop"] == 2.0
    assert s["expert_mixtral_best_fp8_speedup_vs_loop"] == 2.5
    assert s["expert_finegrained_best_speedup_vs_loop"] is None
    assert s["train_step_best_variant"] == "ours_te_ops_fp8"
    assert s["train_step_speedup_vs_hf_eager"] == 3.0 and s["train_step_speedup_vs_hf_grouped_mm"] == 2.0
    assert s["train_step_speedup_vs_hf_grouped_mm_compiled"] is None
    assert s["train_step_peak_mem_ratio_vs_hf_grouped_mm"] == pytest.approx(0.9)
    assert s["train_step_best_bf16_speedup_vs_hf_grouped_mm_compiled"] is None  # bf16 ran OOM
    assert s["train_step_fraction_of_speed_of_light"] is None  # no speed_of_light section
    compiled = dict(part="train", variant="hf_grouped_mm_compiled", status="ok",
                    tokens_per_s=160.0)
    bf16 = dict(part="train", variant="ours_grouped_torch_bf16", status="ok", tokens_per_s=200.0)
    fp8 = dict(results[6], median_ms=80.0)
    floors = {"floors": {"bf16": {"total_ms": 70.0}, "fp8": {"total_ms": 56.0}}}
    s = bench.summarize([results[4], compiled, bf16, fp8], floors)
    assert s["train_step_best_bf16_speedup_vs_hf_grouped_mm_compiled"] == 1.25
    assert s["train_step_fraction_of_speed_of_light"] == pytest.approx(0.7)  # the FP8 floor


def test_ratios_against_hf_compare_like_with_like():
    """Our step that compiles AdamW is compared with HF's compiled model given the same compiled
    AdamW; a step that compiles no AdamW with HF's compiled model as HF users run it."""
    assert bench.hf_twin("ours_te_ops_fp8_compiled") == "hf_grouped_mm_compiled_compiled_adamw"
    assert bench.hf_twin("ours_te_ops_bf16_compiled_loss") == "hf_grouped_mm_compiled"
    rows = [dict(part="train", variant=name, status="ok", tokens_per_s=tps) for name, tps in [
        ("hf_grouped_mm_compiled", 100.0), ("hf_grouped_mm_compiled_compiled_adamw", 110.0),
        ("ours_te_ops_fp8_compiled", 143.0), ("ours_te_ops_bf16_compiled", 116.6)]]
    s = bench.summarize(rows)
    assert s["train_step_like_for_like_hf"] == "hf_grouped_mm_compiled_compiled_adamw"
    assert s["train_step_speedup_vs_like_for_like_hf"] == pytest.approx(1.3)
    assert s["train_step_speedup_vs_hf_grouped_mm_compiled"] == pytest.approx(1.43)  # the unlike pair
    assert s["train_step_best_bf16_speedup_vs_like_for_like_hf"] == pytest.approx(1.06)
    s = bench.summarize(rows[:1] + rows[2:])  # the twin did not run: no like-for-like ratio
    assert s["train_step_speedup_vs_like_for_like_hf"] is None


def test_merging_a_speed_of_light_part():
    """The section `speed-of-light --out` writes joins the report of the step it describes,
    summary recomputed against its floor; a section for another workload, or one that records
    none, is refused."""
    env = {"gpu": "test device", "torch": torch.__version__}
    train = {"environment": env, "results": [dict(
        part="train", variant="ours_te_ops_bf16", status="ok", batch=2, seq_len=32,
        tokens_per_s=100.0, median_ms=10.0)]}
    section = {"workload": {"preset": "tiny", "num_layers": 2, "batch": 2, "seq_len": 32,
                            "optimizer": "adamw"},
               "floors": {"bf16": {"total_ms": 4.0}, "fp8": {"total_ms": 3.0}}}
    part = {"environment": env, "results": [], "speed_of_light": section}
    merged = bench.merge_reports([train, part])
    assert merged["speed_of_light"] == section and merged["results"] == train["results"]
    assert merged["summary"]["train_step_fraction_of_speed_of_light"] == pytest.approx(0.4)
    other = dict(section, workload=dict(section["workload"], seq_len=64))
    with pytest.raises(ValueError, match="batch 2 × 64"):
        bench.merge_reports([train, dict(part, speed_of_light=other)])
    with pytest.raises(ValueError, match="records no workload"):
        bench.merge_reports([train, dict(part, speed_of_light={"floors": section["floors"]})])


@pytest.mark.slow
def test_bench_command_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--routings", "balanced", "--iters", "1", "--warmup", "0",
                 "--train-variants", "hf_grouped_mm", "ours_grouped_torch_bf16",
                 "--seq-len", "32", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and set(report) >= {"environment", "results", "summary"}
    assert report["environment"]["torch"] == torch.__version__
    train = [r for r in report["results"] if r["part"] == "train"]
    assert [r["variant"] for r in train] == ["hf_grouped_mm", "ours_grouped_torch_bf16"]
    assert all(r["status"] == "ok" and r["loss_diff"] < 0.02 for r in train)
    printed = capsys.readouterr().out
    assert "TFLOP/s = (6 ×" in printed and "summary:" in printed


def test_merging_the_parts_of_a_run(tmp_path):
    """`bench --merge` joins a --no-train and a --no-expert part into one report whose summary
    covers both; parts from different environments or cut short are refused."""
    expert, train, merged = (tmp_path / f"{n}.json" for n in ("expert", "train", "merged"))
    common = ["--iters", "1", "--warmup", "0", "--routings", "balanced"]
    assert main(["bench", "--no-train", *common, "--out", str(expert)]) == 0
    assert main(["bench", "--no-expert", *common, "--seq-len", "32", "--train-variants",
                 "hf_grouped_mm", "ours_grouped_torch_bf16", "--out", str(train)]) == 0
    assert main(["bench", "--merge", str(expert), str(train), "--out", str(merged)]) == 0
    report = json.loads(merged.read_text())
    parts = [json.loads(p.read_text()) for p in (expert, train)]
    assert report["results"] == parts[0]["results"] + parts[1]["results"]
    assert report["summary"] == bench.summarize(report["results"])
    assert report["summary"]["train_step_speedup_vs_hf_grouped_mm"] is not None
    assert [p["results"] for p in report["parts"]] == [len(p["results"]) for p in parts]
    assert report["environment"] == parts[0]["environment"]  # with its date, as notebook 06 reads

    other = dict(parts[1], environment=dict(parts[1]["environment"], torch="0.0"))
    with pytest.raises(ValueError, match=r"different environments \(differ in \['torch'\]\)"):
        bench.merge_reports([parts[0], other])
    with pytest.raises(ValueError, match="did not finish"):
        bench.merge_reports([parts[0], dict(parts[1], complete=False)])


def test_fp8_rows_quote_mfu_against_the_fp8_peak_and_say_which():
    peaks = timing.Peaks(bf16_measured=800.0, bf16_datasheet=1000.0, fp8_measured=1600.0,
                        fp8_datasheet=2000.0)
    row = dict(variant="ours_te_ops_fp8", status="ok", median_ms=80.0, tokens_per_s=1e5,
               tflops=400.0, peak_memory_gb=20.0, loss_diff=0.0, precision="fp8")
    line = bench.format_train_row(row, peaks)
    assert "25.0% / 20.0%" in line and "50.0% / 40.0%" in line  # own (FP8) peak, then bf16
    assert "fp8" in line and "own peak" in bench.TRAIN_HEADER
    old = timing.Peaks.from_dict({"dense_bf16_tflops_measured": 800.0, "datasheet_bf16_tflops": 1000.0})
    assert "- / -" in bench.format_train_row(row, old)  # a file without FP8 peaks: not invented
    assert bench.VARIANTS["hf_eager"].precision_kind == "bf16"
    assert bench.VARIANTS["ours_te_ops_fp8"].precision_kind == "fp8"
    assert timing.datasheet_tflops("NVIDIA H200", "fp8") == 1978.9


def test_family_shapes_are_the_shipped_configs():
    """The expert-layer benchmark's Qwen3-MoE and OLMoE shapes are those of the configs the
    course ships (moe_tutorial/configs/), as `analyze` reads them: one source of truth."""
    from moe_tutorial.perf import analyze, model_numbers

    for shape, config in (("qwen3_30b_a3b", "qwen3-moe-30b-a3b"), ("olmoe_1b_7b", "olmoe-1b-7b")):
        bench_shape = bench.EXPERT_SHAPES[shape]
        want = model_numbers.expert_shape(analyze.load_model(config).config, bench_shape.tokens)
        assert (bench_shape.hidden, bench_shape.intermediate, bench_shape.experts,
                bench_shape.top_k) == (want.hidden, want.intermediate, want.experts, want.top_k)
    assert set(bench.FAMILY_SHAPES) <= set(bench.EXPERT_SHAPES)


def test_candidates_are_named_not_run_by_default():
    """The compile options, alone or together, are accepted by name but stay out of the course's
    ladder (bench's default run and notebook 06 iterate TRAIN_VARIANTS)."""
    assert bench.CANDIDATE_VARIANTS and not set(bench.CANDIDATE_VARIANTS) & set(bench.TRAIN_VARIANTS)
    for name in bench.CANDIDATE_VARIANTS:
        assert bench.variant(name).changes
    # a GPU run adds the best candidates and HF's twin after the ladder, no other
    assert set(bench.GPU_EXTRA_VARIANTS) <= set(bench.CANDIDATE_VARIANTS)


def test_compiled_candidates_take_the_same_step():
    """The torch.compile candidates (on a CPU Inductor makes C++ kernels from the same graphs):
    the compiled loss and the compiled AdamW step move the weights as the eager ones do, and a
    learning-rate schedule reaches the compiled step through its tensor learning rate."""
    from moe_tutorial.train.loop import set_learning_rate

    config = preset("tiny").with_overrides(dtype="float32")
    ids = torch.randint(0, config.vocab_size, (1, 17))
    after = {}
    for name in ("ours_te_ops_bf16", "ours_te_ops_bf16_compiled_loss",
                 "ours_te_ops_bf16_compiled_adamw", "ours_te_ops_bf16_compiled",
                 "ours_te_ops_bf16_compiled_compiled_norms"):
        model, forward = bench.variant(name).build(config, "cpu")
        optimizer = bench.variant(name).optimizer(model, 1e-2)
        for lr in (1e-2, 3e-3):
            set_learning_rate(optimizer, lr)
            bench.timed_step(model, forward, optimizer, (ids[:, :-1], ids[:, 1:]))()
        after[name] = [p.detach().clone() for p in model.parameters()]
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)
    assert optimizer.param_groups[0]["lr"].item() == pytest.approx(3e-3)
    for name in ("ours_te_ops_bf16_compiled_loss", "ours_te_ops_bf16_compiled_adamw",
                 "ours_te_ops_bf16_compiled", "ours_te_ops_bf16_compiled_compiled_norms"):
        for got, want in zip(after[name], after["ours_te_ops_bf16"]):
            # a step moves a weight by ~lr (Adam): 5e-5 is a two-hundredth of one, where a step
            # missed or taken twice moves it by ~1e-2. The compiled kernels sum in another order
            # (which also depends on the thread count: 2.07e-5 was seen on 2 cores), and Adam
            # divides a near-zero gradient's rounding by that gradient's own RMS
            torch.testing.assert_close(got, want, rtol=0, atol=5e-5)
    with pytest.raises(ValueError, match="does not apply"):
        bench.variant("ours_te_ops_bf16_compiled_adamw").optimizer(model, 1e-2, "te_fused_adam")


def test_candidate_gains_pair_each_candidate_with_its_base_from_the_same_run():
    """Every candidate changes one ladder variant (the same model, precision and compilation),
    and the committed runs that timed candidates are found by what they hold, each holding both
    sides of every gain it reports."""
    for name in bench.CANDIDATE_VARIANTS:
        base = bench.variant(bench.candidate_base(name))
        v = bench.variant(name)
        assert bench.candidate_base(name) in bench.TRAIN_VARIANTS
        assert (base.backend, base.precision, base.hf) == (v.backend, v.precision, v.hf)
        assert bench.technique(name)
    rows = [{"variant": "ours_te_ops_fp8", "status": "ok", "median_ms": 80.0,
             "peak_memory_gb": 28.0, "precision": "Float8CurrentScaling"},
            {"variant": "ours_te_ops_fp8_compiled", "status": "ok", "median_ms": 75.0,
             "peak_memory_gb": 28.5, "precision": "Float8CurrentScaling"},
            {"variant": "ours_te_ops_bf16_compiled", "status": "ok", "median_ms": 90.0,
             "peak_memory_gb": 26.0, "precision": "bf16"}]  # its base did not run: no gain
    (gain,) = bench.candidate_gains(rows)
    assert (gain["base"], gain["speedup"]) == ("ours_te_ops_fp8", pytest.approx(80 / 75))
    committed = bench.committed_candidate_gains()
    assert {f"benchmarks/results/{name}" for name in (
        "h200_compiled_candidates.json", "h200_compiled_candidates_rerun.json", "h200.json")
    } <= {g["run"] for g in committed}
    for gain in committed:
        rows = {r["variant"]: r for r in results.read(gain["run"])["results"]
                if r.get("part") == "train"}
        assert rows[gain["base"]]["median_ms"] == gain["base_ms"] > 0
        assert rows[gain["variant"]]["median_ms"] == gain["ms"] > 0 and gain["gpu"]
    dates = [results.read(g["run"])["environment"]["date"] for g in committed]
    assert dates == sorted(dates)  # oldest run first


def test_variant_names_are_derived_from_their_options():
    """The names are built from the options, and they are the names every committed result and
    the docs use: a committed row of a variant still named finds it, and the only committed rows
    without one are the measured and not adopted candidates, whose code left the package."""
    assert bench.Variant.of("grouped_mm", hf=True, compiled=True, compiled_adamw=True).name == (
        "hf_grouped_mm_compiled_compiled_adamw")
    assert bench.Variant.of("te_ops", "fp8", compiled_loss=True, compiled_adamw=True).name == (
        "ours_te_ops_fp8_compiled")
    assert bench.Variant.of("te_ops", "bf16", compiled_loss=True, compiled_adamw=True,
                            compiled_norms=True).name == "ours_te_ops_bf16_compiled_compiled_norms"
    assert all(bench.Variant.of(v.backend, v.precision, hf=v.hf, compiled=v.compiled,
                                compiled_loss=v.compiled_loss, compiled_adamw=v.compiled_adamw,
                                compiled_norms=v.compiled_norms) == v
               for v in bench.VARIANTS.values())
    assert len(bench.VARIANTS) == len(bench.LADDER + bench.COMPILED_STEPS + bench.COMPILED_ALONE
                                      + bench.COMPILED_GROUPED_LINEAR
                                      + bench.COMPILED_NORMS)  # one name each
    committed = {r["variant"] for _, report in bench.committed_train_runs()
                 for r in report["results"] if r.get("part") == "train"}
    assert {name for name in committed if name not in bench.VARIANTS} == {
        "hf_grouped_mm_compiled_step_in_backward", "ours_te_ops_bf16_step_in_backward",
        "ours_te_ops_fp8_step_in_backward", "hf_grouped_mm_compiled_compiled_adamw_step_in_backward",
        "ours_te_ops_bf16_compiled_step_in_backward",
        "ours_te_ops_fp8_compiled_loss_step_in_backward",
        "ours_te_ops_fp8_compiled_step_in_backward",
        "ours_te_grouped_linear_fp8_host_counts_compiled",
        "ours_sync_free_bf16", "ours_sync_free_bf16_graphed", "ours_sync_free_fp8",
        "ours_sync_free_fp8_graphed", "ours_sync_free_fp8_wgrad_graphed"}
    assert set(bench.TRAIN_VARIANTS + bench.GPU_EXTRA_VARIANTS) <= committed


def test_an_unknown_variant_is_refused_in_one_line_naming_the_choices(capsys):
    assert main(["bench", "--no-expert", "--train-variants", "ours_te_ops_fp8_step_in_backward"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "unknown training variant 'ours_te_ops_fp8_step_in_backward'" in err
    assert all(name in err for name in bench.VARIANTS)


def test_the_hf_twin_of_a_committed_variant_that_left_the_package_is_read_by_its_name():
    """A committed row whose variant left the package still meets HF's step with its own
    optimizer: the compiled AdamW where its name says the loss and AdamW were compiled."""
    assert bench.hf_twin("ours_te_grouped_linear_fp8_host_counts_compiled") == (
        "hf_grouped_mm_compiled_compiled_adamw")
    assert bench.hf_twin("ours_sync_free_bf16_graphed_compiled_loss") == "hf_grouped_mm_compiled"
    assert bench.hf_twin("ours_te_ops_fp8_compiled_loss_step_in_backward") == "hf_grouped_mm_compiled"
    assert bench.hf_twin("hf_grouped_mm_compiled_step_in_backward") == "hf_grouped_mm_compiled"
    assert bench.hf_twin("ours_te_ops_fp8_compiled") == "hf_grouped_mm_compiled_compiled_adamw"
