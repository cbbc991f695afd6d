"""The (dp, ep) benchmark matrix driver (`benchmarks.matrix`): which runs it plans, the commands
it prints, a real run on CPU (2 gloo processes, the tiny preset, HF baseline included) and the
table it renders; and the arithmetic behind the 8-GPU preset."""

import importlib.metadata
import importlib.util
import json
from argparse import Namespace
from dataclasses import replace

import pytest
import torch

from benchmarks import matrix
from moe_tutorial.moe.config import preset
from moe_tutorial.parallel import distributed
from moe_tutorial.perf import results, train_dist


def _has_transformers_5() -> bool:
    # find_spec, not import: importing transformers costs seconds, and the ranks import it anyway
    return (importlib.util.find_spec("transformers") is not None
            and int(importlib.metadata.version("transformers").split(".")[0]) >= 5)


def test_layouts_are_every_factorisation_whose_ep_divides_the_experts():
    assert distributed.layouts(8, 8) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert distributed.layouts(2, 4) == [(1, 2), (2, 1)]
    assert distributed.layouts(8, 6) == [(4, 2), (8, 1)]  # ep 4 and 8 would split 6 experts unevenly
    assert distributed.layouts(6, 8) == [(3, 2), (6, 1)]
    assert distributed.layouts(1, 8) == [(1, 1)]
    # the walk is over the experts' divisors, not the GPU count: a huge count answers at once
    assert distributed.layouts(10**12, 4) == [(10**12 // 4, 4), (10**12 // 2, 2), (10**12, 1)]
    with pytest.raises(ValueError, match="--gpus must be >= 1"):
        distributed.layouts(0, 8)


def test_requested_layouts_are_checked():
    assert matrix.chosen_layouts(8, 8, ["2x4", "8×1"]) == [(2, 4), (8, 1)]
    assert matrix.chosen_layouts(8, 8, None) == distributed.layouts(8, 8)
    with pytest.raises(ValueError, match=r"layout 2x2 uses 4 GPUs, not --gpus 8"):
        matrix.chosen_layouts(8, 8, ["2x2"])
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep=4"):
        matrix.chosen_layouts(8, 6, ["2x4"])
    with pytest.raises(ValueError, match="'2-4' is not DPxEP"):
        matrix.chosen_layouts(8, 8, ["2-4"])


def test_the_plan_runs_ours_in_every_layout_and_precision_then_hf_data_parallel():
    runs = matrix.plan(8, distributed.layouts(8, 8), ["bf16", "fp8"], "te_ops")
    assert [(r.model, r.layout, r.precision) for r in runs] == [
        ("ours", "dp1×ep8", "bf16"), ("ours", "dp1×ep8", "fp8"),
        ("ours", "dp2×ep4", "bf16"), ("ours", "dp2×ep4", "fp8"),
        ("ours", "dp4×ep2", "bf16"), ("ours", "dp4×ep2", "fp8"),
        ("ours", "dp8×ep1", "bf16"), ("ours", "dp8×ep1", "fp8"),
        ("hf", "dp8×ep1", "bf16")]
    assert runs[-1].label == "HF grouped_mm" and runs[0].label == "ours (te_ops)"
    assert len(matrix.plan(8, [(8, 1)], ["bf16"], "te_ops", hf=False)) == 1
    assert {r.engine for r in runs} == {"fsdp2"}
    # the replicated baseline, on request: every row again, HF's too
    both = matrix.plan(8, [(4, 2)], ["bf16"], "te_ops", engines=("fsdp2", "replicated"))
    assert [(r.label, r.engine) for r in both] == [
        ("ours (te_ops)", "fsdp2"), ("ours (te_ops), replicated", "replicated"),
        ("HF grouped_mm", "fsdp2"), ("HF grouped_mm, replicated", "replicated")]
    with pytest.raises(ValueError, match=r"unknown engine\(s\) \['ddp'\]"):
        matrix.plan(8, [(8, 1)], ["bf16"], "te_ops", engines=("ddp",))
    with pytest.raises(ValueError, match=r"unknown precision\(s\) \['fp4'\]"):
        matrix.plan(8, [(8, 1)], ["fp4"], "te_ops")


def test_the_hf_baseline_refuses_expert_parallelism_and_fp8():
    with pytest.raises(ValueError, match="--model hf has no expert parallelism.*--ep 1"):
        train_dist.check_hf_args(Namespace(dp=1, ep=2, precision="bf16"))
    with pytest.raises(ValueError, match="--model hf trains in bf16 only"):
        train_dist.check_hf_args(Namespace(dp=2, ep=1, precision="fp8"))
    train_dist.check_hf_args(Namespace(dp=2, ep=1, precision="bf16"))


def test_dry_run_prints_the_8_gpu_commands(capsys, tmp_path):
    out = tmp_path / "h200x8.json"
    assert matrix.main(["--gpus", "8", "--preset", "mixtral-7l", "--backend", "te_ops",
                        "--dry-run", "--out", str(out)]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines()
                if not line.startswith("#")]
    assert len(commands) == 9 and not out.exists()  # nothing ran, nothing written
    for command in commands:
        assert "-m torch.distributed.run --standalone --nproc_per_node=8 -m " \
               "moe_tutorial.perf.train_dist --mode bench" in command
        assert "--preset mixtral-7l --batch 2 --seq-len 4096" in command
    assert "--model ours --engine fsdp2 --dp 1 --ep 8 --precision fp8 --backend te_ops" \
        in commands[1]
    assert commands[-1].split("train_dist ")[1].startswith(
        "--mode bench --model hf --engine fsdp2 --dp 8 --ep 1 --precision bf16 --preset")


def test_layout_errors_stop_the_driver_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        matrix.main(["--gpus", "8", "--preset", "mixtral-7l", "--layouts", "3x2", "--dry-run"])
    assert "layout 3x2 uses 6 GPUs, not --gpus 8" in capsys.readouterr().err


def test_the_8_layer_matrix_s_memory_and_what_it_does_not_explain():
    """memory.predict for the committed 8-layer matrix on 2 × H200: dp2×ep1 bf16 within 2% of
    its measured peak; FP8 predicted no higher (TE frees its weight copies layer by layer in the
    backward pass, before the all-reduce: dp1×ep2 measured the same peak in both precisions),
    so memory does not explain that row's timeout; and mixtral-7l (7 of those layers) fits an
    H200 at dp8 × ep1 in both precisions with room to spare."""
    report = results.read("h200x2_matrix_mixtral-8l.json")
    rows = {(r["layout"], r["precision"]): r for r in report["rows"]}
    settings = matrix.Settings.from_report(report)
    config = preset("mixtral-7l", num_layers=report["model"]["layers"])
    assert config.parameter_counts()["total"] == report["model"]["total_params"]
    dp2 = matrix.Run("ours", 2, 1, "bf16", report["settings"]["backend"], "replicated")
    predicted = matrix.predicted_peak_gib(config, dp2, settings)
    assert predicted == pytest.approx(rows["dp2×ep1", "bf16"]["peak_memory_gb"], rel=0.02)
    assert rows["dp2×ep1", "fp8"]["status"] == "timeout"
    assert matrix.predicted_peak_gib(config, replace(dp2, precision="fp8"), settings) == (
        pytest.approx(predicted, rel=0.01))
    assert rows["dp1×ep2", "fp8"]["peak_memory_gb"] == pytest.approx(
        rows["dp1×ep2", "bf16"]["peak_memory_gb"], rel=0.01)
    for precision in ("bf16", "fp8"):
        dp8 = matrix.Run("ours", 8, 1, precision, "te_ops", "replicated")
        assert matrix.predicted_peak_gib(preset("mixtral-7l"), dp8, settings) < 0.75 * 140


@pytest.mark.skipif(not _has_transformers_5(),
                    reason="the HF baseline row needs transformers >= 5 (pip install -e '.[hf]')")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test (gloo, fp32, no FP8); on GPUs "
                    "run the matrix itself: python -m benchmarks.matrix --gpus 2")
def test_a_real_matrix_on_cpu_records_every_row(tmp_path, capsys):
    """2 gloo processes, tiny preset, 1 step per run, one layout (dp2 × ep1: FSDP2 over both
    processes for ours and HF's; test_distributed benches dp1 × ep2). Without TE the FP8 row
    fails — recorded with the ranks' error, and the matrix goes on to the HF baseline."""
    out = tmp_path / "matrix.json"
    code = matrix.main(["--gpus", "2", "--preset", "tiny", "--warmup", "0", "--iters", "1",
                        "--layouts", "2x1", "--out", str(out)])
    assert code == 1  # some rows failed: the FP8 ones
    report = json.loads(out.read_text())
    assert report["complete"] and report["environment"]["gpus_used"] == 2
    assert report["model"]["preset"] == "tiny" and report["model"]["total_params"] == 57248
    rows = {(r["model"], r["layout"], r["precision"]): r for r in report["rows"]}
    assert list(rows) == [("ours", "dp2×ep1", "bf16"), ("ours", "dp2×ep1", "fp8"),
                          ("hf", "dp2×ep1", "bf16")]
    for key in [("ours", "dp2×ep1", "bf16"), ("hf", "dp2×ep1", "bf16")]:
        row = rows[key]
        assert row["status"] == "ok" and row["dtype"] == "float32", row
        assert row["tokens_per_s_per_gpu"] > 0 and row["pflops_per_gpu"] > 0
        assert len(row["ranks"]) == 2 and row["mfu"] is None  # no datasheet peak for a CPU
        assert row["engine"] == "fsdp2" and row["predicted_peak_gib"] > 0
    assert rows[("ours", "dp2×ep1", "bf16")]["path"] == "routing.permute → torch._grouped_mm"
    assert rows[("hf", "dp2×ep1", "bf16")]["path"].startswith("HF transformers MixtralForCausalLM")
    assert rows[("hf", "dp2×ep1", "bf16")]["backend"] == "hf_grouped_mm"
    fp8 = rows[("ours", "dp2×ep1", "fp8")]
    assert fp8["status"] == "error" and "needs Transformer Engine FP8 on a GPU" in fp8["error"]
    table = capsys.readouterr().out.split("\n\n| model")[1]
    assert table.count("| ours (grouped_torch) |") == 2
    assert "| HF grouped_mm | dp2×ep1 | fp32 |" in table


def _report(rows):
    return {"environment": {"gpu": "NVIDIA H200", "gpus_used": 8, "torch": "2.11.0",
                            "transformer_engine": "2.20.2", "transformers": "5.3.0"},
            "model": {"preset": "mixtral-7l", "layers": 7, "hidden_size": 4096,
                      "intermediate_size": 14336, "num_experts": 8, "top_k": 2,
                      "total_params": 10_421_039_104, "active_params_per_token": 2_891_153_408},
            "settings": {"batch": 2, "seq_len": 4096, "warmup": 2, "iters": 6,
                         "backend": "te_ops", "backend_reason": "TE 2.20.2 on NVIDIA H200"},
            "rows": rows, "complete": False}


def _ok(model, dp, ep, precision, tokens_per_s, **extra):
    run = matrix.Run(model, dp, ep, precision, "te_ops" if model == "ours" else "hf_grouped_mm")
    return {"model": model, "precision": precision, "label": run.label, "layout": run.layout,
            "status": "ok", "median_ms": 16384 / tokens_per_s * 1e3,
            "tokens_per_s_per_gpu": tokens_per_s, "pflops_per_gpu": 0.25, "mfu": 0.2527,
            "peak_memory_gb": 40.0, "all_to_all_ms": 12.0, "all_reduce_ms": 3.5,
            "dtype": "bfloat16", "path": "EP 0/8 (experts 0..0): te.ops unfused", **extra}


def test_the_table_shows_every_row_failures_included(tmp_path, capsys):
    oom = {"model": "ours", "precision": "fp8", "label": "ours (te_ops)", "layout": "dp8×ep1",
           "status": "OOM", "error": "python -m torch.distributed.run ... failed (exit 1):\n"
           "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 21.0 GiB\n"}
    report = _report([_ok("ours", 1, 8, "bf16", 12000.0), oom, _ok("hf", 8, 1, "bf16", 8000.0)])
    path = tmp_path / "h200x8.json"
    path.write_text(json.dumps(report))
    assert matrix.main(["--table", str(path)]) == 0
    table = capsys.readouterr().out
    assert "mixtral-7l: 7 layers, hidden 4096, 8 experts × 14336, top-2, 10.42 B parameters " \
           "(2.89 B active per token); batch 2 × 4096 tokens per GPU; 8 × NVIDIA H200" in table
    assert ("| ours (te_ops) | dp1×ep8 | bf16 | 1365.3 | 12,000 | 0.250 | 25.3% | 1.50 | 40.0 "
            "| 12.0 | 3.5 | ok |") in table
    failed = "| ours (te_ops) | dp8×ep1 | fp8 | " + "– | " * 8 + "**OOM** (1) |"
    assert failed in table
    assert "| HF grouped_mm | dp8×ep1 | bf16 |" in table
    assert ("(1) ours (te_ops) dp8×ep1 fp8: [rank3]: torch.OutOfMemoryError: CUDA out of "
            "memory. Tried to allocate 21.0 GiB") in table
    assert "(incomplete: the matrix was interrupted)" in table


def test_failures_are_classified_and_summarised():
    assert matrix.classify_failure("[rank0]: torch.OutOfMemoryError: CUDA out of memory.") == "OOM"
    assert matrix.classify_failure("... timed out after 300 s and was stopped") == "timeout"
    assert matrix.classify_failure("[rank1]: ValueError: bad") == "error"
    timeout = {"command": "torchrun x", "error": "torchrun x timed out after 300 s and was "
               "stopped:\nstep 3\ntorch...SignalException: Process 7 got signal: 15\n"}
    assert matrix.failure_reason(timeout) == ("the run timed out after 300 s and was stopped: "
                                              "torch...SignalException: Process 7 got signal: 15")
