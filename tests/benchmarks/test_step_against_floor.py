"""benchmarks/step_against_floor.py on a CPU at the tiny preset: a row per variant with its step
split by part beside that part's floor, a variant that cannot run here kept as a row with its
reason, and an existing --out refused."""

import json

import pytest

from benchmarks import step_against_floor as saf
from moe_tutorial.perf.step_parts import PARTS

COMMITTED = "benchmarks/results/h100_like_for_like.json"  # rates of a real GPU run


def test_each_variant_is_split_by_part_beside_the_floor(tmp_path):
    out = tmp_path / "parts.json"
    assert saf.main(["--out", str(out), "--preset", "tiny", "--batch", "1", "--seq-len", "16",
                     "--device", "cpu", "--warmup", "0", "--iters", "1", "--profile-steps", "1",
                     "--committed", COMMITTED,
                     "--variants", "ours_te_ops_bf16", "ours_te_ops_fp8"]) == 0
    report = json.loads(out.read_text())
    assert {"torch", "python"} <= set(report["environment"])
    assert report["floors_ms"]["bf16"] > 0 and report["floors_ms"]["fp8"] > 0
    ok, fp8 = report["rows"]
    assert ok["status"] == "ok" and ok["median_ms"] > 0 and ok["loss_diff"] is None
    rows = ok["against_floor"]["rows"]
    assert {r["part"] for r in rows} == set(PARTS)
    assert sum(r["measured_ms"] for r in rows) == pytest.approx(ok["profiled"]["step_ms"])
    assert ok["against_floor"]["floor_ms"] == pytest.approx(report["floors_ms"]["bf16"])
    # FP8 needs TE on a GPU: a row that says so, not a missing one
    assert fp8["variant"] == "ours_te_ops_fp8" and fp8["status"] != "ok" and fp8.get("error")


def test_an_existing_out_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "parts.json"
    out.write_text("{}")
    with pytest.raises(SystemExit) as stop:
        saf.main(["--out", str(out), "--device", "cpu", "--variants", "ours_te_ops_bf16"])
    assert stop.value.code == 2 and out.read_text() == "{}"
    assert "--replace" in capsys.readouterr().err


def test_kernels_are_summed_by_name_within_their_part_largest_first(monkeypatch):
    """What a GPU profile gives (kernels, each with the part `step_parts` assigns it), summed per
    kernel name within a part, per step, largest first, at most KERNELS_PER_PART a part."""
    from moe_tutorial.perf.step_parts import Kernel, Unit

    kernels = ([Kernel("nvjet_gemm", 0.0, 3000.0, 1)] * 2 + [Kernel("cast_transpose", 0.0, 500.0, 2)]
               + [Kernel(f"elementwise_{i}", 0.0, 100.0 * (i + 1), 3) for i in range(10)])
    parts = ["GEMMs"] * 2 + ["quantization"] + ["norms & elementwise"] * 10
    monkeypatch.setattr(saf, "cuda_kernels", lambda prof: kernels)
    monkeypatch.setattr(saf, "kernel_units",
                        lambda events, ks: [Unit(k.start, k.end, 0, p) for k, p in zip(ks, parts)])

    class Profile:
        def events(self):
            return []

    by_part = saf.kernels_by_part(Profile(), steps=2)
    assert by_part["GEMMs"] == [{"kernel": "nvjet_gemm", "ms_per_step": 3.0, "launches_per_step": 1.0}]
    assert by_part["quantization"][0]["ms_per_step"] == pytest.approx(0.25)
    elementwise = by_part["norms & elementwise"]
    assert len(elementwise) == saf.KERNELS_PER_PART
    assert [k["kernel"] for k in elementwise[:2]] == ["elementwise_9", "elementwise_8"]
