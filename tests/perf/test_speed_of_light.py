"""speed_of_light: the step's work per part against timing's and config's counts, how it scales,
the floor per part from rates, the committed H200 rates read back, a measured step against its
floor; and timing's bandwidth and attention-rate measurements on this CPU."""

import json
import math
from pathlib import Path

import pytest
import torch

from moe_tutorial.cli import main as cli_main
from moe_tutorial.moe.config import preset
from moe_tutorial.perf import speed_of_light as sol
from moe_tutorial.perf import step_parts, step_profile, timing
from moe_tutorial.perf.step_parts import PARTS
from moe_tutorial.perf.step_profile import StepBreakdown

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "benchmarks" / "results" / "h200.json"
MIXTRAL = preset("mixtral-2l")
TINY = preset("tiny")
GEMM_PARTS = ("expert GEMMs", "attention projections", "router", "lm_head")
# Round numbers, so that each expected floor below is simple arithmetic on them.
RATES = sol.Rates("test device", dense_bf16_tflops=500.0, dense_fp8_tflops=1000.0,
                  expert_bf16_tflops=400.0, expert_fp8_tflops=800.0, hbm_gb_per_s=2000.0,
                  attention_tflops=300.0)


def committed_report() -> dict:
    return json.loads(COMMITTED.read_text())


# ---------------------------------------------------------------------------------------------
# The work

def test_gemm_flops_are_timings_and_configs_counts():
    batch, seq = 2, 4096
    tokens = batch * seq
    work = sol.step_work(MIXTRAL, batch, seq, precision="fp8").parts
    assert work["expert GEMMs"].flops == MIXTRAL.num_layers * timing.expert_mlp_flops(
        tokens, MIXTRAL.top_k, MIXTRAL.hidden_size, MIXTRAL.intermediate_size)
    # Every matmul with a weight: 6 × active parameters per token (config's count) × tokens
    assert sum(work[p].flops for p in GEMM_PARTS) == 6 * MIXTRAL.active_params_per_token() * tokens
    # Attention without the causal mask is model_flops_per_token's attention term
    full = MIXTRAL.num_layers * timing.attention_flops(batch, seq, MIXTRAL.num_heads,
                                                       MIXTRAL.head_dim, causal=False)
    assert (sum(work[p].flops for p in GEMM_PARTS) + full
            == timing.model_flops_per_token(MIXTRAL, seq) * tokens)
    # The causal mask keeps seq·(seq + 1)/2 of the seq² (query, key) pairs
    assert work["attention"].flops * 2 * seq == full * (seq + 1)
    assert all(work[p].flops == 0 for p in sol.PARTS if p not in GEMM_PARTS + ("attention",))


def test_attention_flops_count_the_unmasked_pairs():
    batch, seq, heads, head_dim = 2, 7, 3, 4
    pairs = int(torch.ones(seq, seq).tril().sum())  # a query sees itself and the keys before it
    assert timing.attention_flops(batch, seq, heads, head_dim, backward=False) == (
        batch * heads * pairs * (2 * head_dim + 2 * head_dim))  # q·k, then p·v
    assert timing.attention_flops(batch, seq, heads, head_dim) == 3 * timing.attention_flops(
        batch, seq, heads, head_dim, backward=False)


def test_doubling_the_sequence_doubles_the_linear_parts_and_quadruples_attention():
    short, long = (sol.step_work(MIXTRAL, 1, seq, precision="fp8").parts for seq in (1024, 2048))
    for part in GEMM_PARTS:
        assert long[part].flops == 2 * short[part].flops, part
    for part in ("loss", "permutation", "norms & elementwise", "attention"):
        assert long[part].bytes == 2 * short[part].bytes, part
    # causal pairs: 2048·2049/2 against 1024·1025/2, i.e. 4 × 2049/2050
    assert long["attention"].flops * 1025 == short["attention"].flops * 2 * 2049
    assert long["optimizer"].bytes == short["optimizer"].bytes  # per parameter, not per token
    # the weights' GEMM and quantization traffic does not grow with tokens, the rest does
    for part in ("expert GEMMs", "quantization", "embedding"):
        assert short[part].bytes < long[part].bytes < 2 * short[part].bytes, part


def test_fp8_halves_the_expert_gemm_operands_and_runs_at_the_fp8_rate():
    batch, seq = 1, 512
    bf16, fp8 = (sol.step_work(MIXTRAL, batch, seq, precision=p) for p in ("bf16", "fp8"))
    copies = batch * seq * MIXTRAL.top_k
    h, i, e = MIXTRAL.hidden_size, MIXTRAL.intermediate_size, MIXTRAL.num_experts
    # x, W and dy of gate-up and down, each read twice as a GEMM operand: 2 bytes → 1 byte
    operands = (copies * h + e * 2 * i * h + copies * 2 * i) + (copies * i + e * h * i + copies * h)
    saved = bf16.parts["expert GEMMs"].bytes - fp8.parts["expert GEMMs"].bytes
    assert saved == MIXTRAL.num_layers * 2 * operands * (2 - 1)
    assert fp8.parts["expert GEMMs"].flops == bf16.parts["expert GEMMs"].flops
    assert bf16.parts["quantization"].bytes == 0 < fp8.parts["quantization"].bytes
    # the router and the lm_head stay in bf16
    for part in ("router", "lm_head"):
        assert fp8.parts[part] == bf16.parts[part]
    floors = {p: sol.floor(w, RATES).parts["expert GEMMs"] for p, w in (("bf16", bf16),
                                                                       ("fp8", fp8))}
    flops = bf16.parts["expert GEMMs"].flops
    assert floors["bf16"].compute_ms == pytest.approx(flops / (RATES.expert_bf16_tflops * 1e9))
    assert floors["fp8"].compute_ms == pytest.approx(flops / (RATES.expert_fp8_tflops * 1e9))


def test_adamw_bytes_per_parameter():
    assert sol.adamw_bytes_per_parameter("adamw", 2) == 14  # read p, g, m, v; write p, m, v
    assert sol.adamw_bytes_per_parameter("adamw", 4) == 28
    assert sol.adamw_bytes_per_parameter("adamw_fp32", 2) == 28  # + fp32 master, bf16 copy
    total = MIXTRAL.parameter_counts()["total"]
    for optimizer, per_parameter in (("adamw", 14), ("adamw_fp32", 28)):
        work = sol.step_work(MIXTRAL, 1, 128, optimizer=optimizer)
        assert work.parts["optimizer"].bytes == total * per_parameter


def test_expert_gemm_shapes_are_the_balanced_rows_per_expert():
    # 2 × 4096 tokens × top-2 over 8 experts: 2048 rows each, already a multiple of 16
    assert sol.expert_gemm_shapes(MIXTRAL, 2, 4096) == [(2048, 4096, 2 * 14336),
                                                         (2048, 14336, 4096)]
    # 3 × 5 × 2 copies over 4 experts: 8 rows each, padded to 16
    assert sol.expert_gemm_shapes(TINY, 3, 5)[0][0] == 16


# ---------------------------------------------------------------------------------------------
# The floor

def test_the_floor_is_the_larger_of_compute_and_memory():
    work = sol.step_work(MIXTRAL, 1, 4096, precision="fp8")
    for bandwidth in (2000.0, 1.0):  # the GEMMs compute-bound, then memory-bound
        rates = sol.Rates(**{**RATES.to_dict(), "hbm_gb_per_s": bandwidth})
        fl = sol.floor(work, rates)
        for name, p in fl.parts.items():
            w = work.parts[name]
            assert p.memory_ms == pytest.approx(w.bytes / (bandwidth * 1e6))
            assert p.floor_ms == max(t for t in (p.compute_ms, p.memory_ms) if t is not None)
            assert p.complete and (p.compute_ms is None) == (w.rate is None)
        assert fl.total_ms == pytest.approx(sum(p.floor_ms for p in fl.parts.values()))
    assert fl.parts["expert GEMMs"].bound == "memory"
    assert sol.floor(work, RATES).parts["expert GEMMs"].bound == "compute"
    assert sol.floor(work, RATES).parts["optimizer"].bound == "memory"


def test_missing_rates_are_not_computable_and_stand_ins_are_noted():
    work = sol.step_work(MIXTRAL, 1, 1024, precision="fp8")
    rates = sol.Rates("gpu", dense_bf16_tflops=500.0, dense_fp8_tflops=1000.0)
    fl = sol.floor(work, rates)
    assert fl.parts["optimizer"].floor_ms is None and fl.parts["optimizer"].bound == "not computable"
    assert fl.total_ms is None and not fl.complete
    gemm = fl.parts["expert GEMMs"]  # its rate stands in, its memory term is missing
    assert gemm.memory_ms is None and not gemm.complete
    assert gemm.floor_ms == pytest.approx(work.parts["expert GEMMs"].flops / 1e12)
    assert fl.lower_bound_ms == pytest.approx(sum(p.compute_ms for p in fl.parts.values()
                                                  if p.compute_ms is not None))
    notes = " ".join(fl.notes())
    assert "dense_fp8_tflops stands in for expert_fp8_tflops" in notes
    assert "dense_bf16_tflops stands in for attention_tflops" in notes
    assert "hbm_gb_per_s" in notes
    text = sol.format_table(fl)
    assert "not computable" in text and "at least" in text
    # no FP8 rate at all: the FP8 GEMMs have no compute term either
    no_fp8 = sol.floor(work, sol.Rates("gpu", dense_bf16_tflops=500.0, hbm_gb_per_s=1e3))
    assert no_fp8.parts["expert GEMMs"].compute_ms is None
    assert not no_fp8.parts["expert GEMMs"].complete and no_fp8.total_ms is None


# ---------------------------------------------------------------------------------------------
# The committed H200 rates

def test_from_committed_reads_the_speed_of_light_section():
    report = committed_report()
    rates = sol.Rates.from_committed()
    section = report["speed_of_light"]["rates"]
    assert all(getattr(rates, name) == section[name] for name in sol.RATE_FIELDS)
    assert all(getattr(rates, name) is not None for name in sol.RATE_FIELDS)  # all six measured
    assert rates.device == report["environment"]["gpu"] == section["device"]
    assert rates.sources["hbm_gb_per_s"].endswith(f"({section['sources']['hbm_gb_per_s']})")


def test_a_report_without_a_section_has_only_its_dense_peaks(tmp_path):
    report = committed_report()
    del report["speed_of_light"]
    path = tmp_path / "h200_no_section.json"
    path.write_text(json.dumps(report))
    rates = sol.Rates.from_committed(path)
    assert rates.dense_bf16_tflops == report["dense_bf16_tflops_measured"]
    assert rates.dense_fp8_tflops == report["dense_fp8_tflops_measured"]
    assert rates.hbm_gb_per_s is rates.attention_tflops is rates.expert_fp8_tflops is None
    assert rates.sources["dense_bf16_tflops"].endswith("dense_bf16_tflops_measured")
    assert all(rates.sources[name].startswith("missing:")
               for name in ("hbm_gb_per_s", "attention_tflops", "expert_bf16_tflops"))


def test_the_committed_fp8_step_is_above_its_floor():
    """The committed best step (an FP8 one) against the floor its rates give."""
    from moe_tutorial.perf import bench

    report = committed_report()
    row = bench.best_step([r for r in report["results"] if r.get("part") == "train"])
    assert bench.precision_kind(bench.row_precision(row)) == "fp8"
    fl = sol.floor(sol.step_work(MIXTRAL, row["batch"], row["seq_len"], precision="fp8"),
                   sol.Rates.from_committed())
    assert fl.complete and 0 < fl.total_ms < row["median_ms"]
    # the floor merged into the report is the one these rates give for this step
    assert math.isclose(fl.total_ms, report["speed_of_light"]["floors"]["fp8"]["total_ms"])
    assert math.isclose(report["summary"]["train_step_fraction_of_speed_of_light"],
                        fl.total_ms / row["median_ms"])
    comparison = sol.compare(fl, step_ms=row["median_ms"])
    assert comparison.percent_of_floor > 100 and comparison.rows == ()


def test_a_speed_of_light_section_reads_back(tmp_path):
    work = sol.step_work(TINY, 2, 32)
    comparison = sol.compare(sol.floor(work, RATES), step_ms=5.0)
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"environment": {"gpu": "test device"},
                                "speed_of_light": sol.section(RATES, {"v": comparison})}))
    rates = sol.Rates.from_committed(path)
    assert all(getattr(rates, name) == getattr(RATES, name) for name in sol.RATE_FIELDS)
    assert rates.sources["hbm_gb_per_s"].startswith(f"{path}: speed_of_light.rates.hbm_gb_per_s")


# ---------------------------------------------------------------------------------------------
# Measured against the floor

def synthetic_breakdown(scale: float) -> StepBreakdown:
    part_ms = {part: scale * (i + 1) for i, part in enumerate(PARTS)}
    return StepBreakdown(part_ms, sum(part_ms.values()), 100, "cuda kernels", "cuda", 3)


def test_compare_maps_the_parts_onto_the_profilers():
    fl = sol.floor(sol.step_work(MIXTRAL, 1, 4096, precision="fp8"), RATES)
    breakdown = synthetic_breakdown(1.5)
    comparison = sol.compare(fl, breakdown)
    rows = {r.part: r for r in comparison.rows}
    assert list(rows) == list(PARTS)
    assert all(rows[p].measured_ms == breakdown.part_ms[p] for p in PARTS)
    parts = fl.parts
    assert rows["GEMMs"].floor_ms == pytest.approx(sum(parts[p].floor_ms for p in GEMM_PARTS))
    assert rows["norms & elementwise"].floor_ms == pytest.approx(
        parts["loss"].floor_ms + parts["norms & elementwise"].floor_ms)
    assert rows[step_parts.OTHER].floor_ms == parts["embedding"].floor_ms
    assert rows["optimizer"].ratio == pytest.approx(breakdown.part_ms["optimizer"]
                                                    / parts["optimizer"].floor_ms)
    for part in ("communication", step_parts.IDLE):  # nothing of the step's work is there
        assert rows[part].floor_ms == 0 and rows[part].ratio is None
    assert sum(r.floor_ms for r in comparison.rows) == pytest.approx(fl.total_ms)
    assert comparison.percent_of_floor == pytest.approx(100 * breakdown.total_ms / fl.total_ms)
    timed = sol.compare(fl, breakdown, step_ms=40.0)
    assert timed.measured_ms == 40.0 and timed.percent_of_floor == pytest.approx(4000 / fl.total_ms)
    text = sol.format_table(fl, comparison)
    assert all(p in text for p in sol.PARTS + PARTS) and f"{comparison.percent_of_floor:.0f}%" in text
    json.dumps(sol.section(RATES, {"fp8": comparison}))  # JSON-ready


def test_the_command_line_compares_each_chapter_with_its_precisions_floor(tmp_path,
                                                                          monkeypatch):
    bars = step_profile.ChapterBars({"grouped GEMM": synthetic_breakdown(1.0),
                                     "FP8 te.ops": synthetic_breakdown(0.5)}, {})
    monkeypatch.setattr(sol.comparison, "chapter_breakdowns", lambda *a, **k: bars)
    out = tmp_path / "sol.json"
    assert cli_main(["speed-of-light", "--preset", "tiny", "--batch", "2", "--seq-len", "32",
                     "--device", "cpu", "--committed", str(COMMITTED), "--profile-upto", "fp8",
                     "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    variants = result["speed_of_light"]["variants"]
    assert variants["grouped GEMM"]["floor"]["work"]["precision"] == "bf16"
    assert variants["FP8 te.ops"]["floor"]["work"]["precision"] == "fp8"
    assert result["speed_of_light"]["rates"]["dense_fp8_tflops"] == committed_report()[
        "speed_of_light"]["rates"]["dense_fp8_tflops"]
    assert result["speed_of_light"]["workload"] == {"preset": "tiny", "num_layers": 2, "batch": 2,
                                                    "seq_len": 32, "optimizer": "adamw"}
    assert result["results"] == [] and result["environment"]["torch"] == torch.__version__


# ---------------------------------------------------------------------------------------------
# Measuring the rates (on this CPU: small sizes, a CPU's numbers)

def test_bandwidth_and_attention_rate_measure_on_a_cpu():
    bandwidth = timing.copy_bandwidth_gb_per_s("cpu", 2**20)
    rate = timing.sdpa_tflops("cpu", 1, 32, 4, 2, 8, dtype=torch.float32)
    assert math.isfinite(bandwidth) and bandwidth > 0 and math.isfinite(rate) and rate > 0


def test_measure_rates_on_a_cpu_says_what_it_measured():
    rates = sol.measure_rates("cpu", TINY, 2, 32, matmul_size=128, copy_bytes=2**20)
    assert rates.device == "cpu"
    for name in ("dense_bf16_tflops", "expert_bf16_tflops", "hbm_gb_per_s", "attention_tflops"):
        assert getattr(rates, name) > 0 and rates.sources[name].startswith("measured now"), name
    assert rates.dense_fp8_tflops is None and rates.expert_fp8_tflops is None
    assert "no FP8 tensor cores" in rates.sources["dense_fp8_tflops"]
    assert "CPU's memcpy" in rates.sources["hbm_gb_per_s"]


# ---------------------------------------------------------------------------------------------
# Bad input

@pytest.mark.parametrize("call, match", [
    (lambda: sol.step_work(TINY, 1, 8, precision="fp16"), "precision='fp16'"),
    (lambda: sol.step_work(TINY, 0, 8), "batch=0"),
    (lambda: sol.step_work(TINY, 1, 65), "max_seq_len=64"),
    (lambda: sol.step_work(TINY, 1, 8, optimizer="sgd"), "optimizer='sgd'"),
    (lambda: sol.step_work("tiny", 1, 8), "MoEConfig"),
    (lambda: sol.Rates("gpu", hbm_gb_per_s=-1.0), "hbm_gb_per_s=-1.0"),
    (lambda: sol.Rates("gpu", dense_bf16_tflops=float("nan")), "dense_bf16_tflops=nan"),
    (lambda: sol.Rates.from_dict({"speed": 1}), "Rates.from_dict"),
    (lambda: sol.Rates.from_committed("no/such.json"), "no such results file"),
    (lambda: RATES.rate("hbm"), "unknown rate 'hbm'"),
    (lambda: sol.floor("work", RATES), "floor takes"),
    (lambda: sol.compare(sol.floor(sol.step_work(TINY, 1, 8), RATES)), "needs a measurement"),
    (lambda: sol.compare(sol.floor(sol.step_work(TINY, 1, 8), RATES), step_ms=0), "step_ms=0"),
    (lambda: sol.compare(sol.floor(sol.step_work(TINY, 1, 8), sol.Rates("gpu")), step_ms=1.0),
     "no computable part"),
    (lambda: timing.copy_bandwidth_gb_per_s("cpu", 0), "nbytes=0"),
    (lambda: timing.sdpa_tflops("cpu", 1, 8, 4, 3, 8), "kv_heads=3"),
])
def test_bad_input_is_refused_with_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("argv, words", [
    (["--preset", "mixtral-9l"], ["--preset", "mixtral-9l", "mixtral-2l"]),
    (["--batch", "0"], ["--batch", "0"]),
    (["--seq-len", "1"], ["--seq-len", "1"]),
    (["--committed", "no/such/result.json"], ["--committed", "no/such/result.json", "h200.json"]),
    (["--device", "cuda:7"], ["cuda:7"]),
])
def test_the_command_line_refuses_bad_input_in_one_line(capsys, monkeypatch, argv, words):
    monkeypatch.setattr(sol, "run", lambda **kw: pytest.fail("the work started"))
    assert cli_main(["speed-of-light", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert all(word in err[0] for word in words), err[0]


def test_the_command_line_keeps_an_earlier_result(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sol, "run", lambda **kw: pytest.fail("the work started"))
    out = tmp_path / "sol.json"
    out.write_text("{}")
    assert cli_main(["speed-of-light", "--out", str(out)]) == 2
    assert "--replace" in capsys.readouterr().err and out.read_text() == "{}"


# ---------------------------------------------------------------------------------------------
# Shown in notebook 05

def test_floor_bars_pair_each_profiled_step_with_its_floor():
    section = sol.committed_section()
    bars = sol.floor_bars(section)
    assert list(bars) == [name for label in section["variants"]
                          for name in (label, f"{label}: floor")]
    for label, c in section["variants"].items():
        measured, floor_bar = bars[label], bars[f"{label}: floor"]
        assert math.isclose(sum(measured.part_ms.values()), c["measured_ms"], rel_tol=1e-6)
        assert math.isclose(floor_bar.total_ms, c["floor_ms"])
        # the floor bar's parts are the section's per-part floors, and sum to the step's floor
        assert math.isclose(sum(floor_bar.part_ms.values()), c["floor_ms"], rel_tol=1e-6)
        assert floor_bar.part_ms["launch gaps / idle"] == 0
    with pytest.raises(ValueError, match="no profiled step"):
        sol.floor_bars({"variants": {"v": {"rows": []}}})


def test_show_against_floor_names_each_steps_distance_and_largest_gaps(capsys):
    section = sol.committed_section()
    sol.show_against_floor(section, title="t")
    lines = [line for line in capsys.readouterr().out.splitlines() if "floor of" in line]
    assert len(lines) == len(section["variants"])
    fp8 = section["variants"]["FP8 te.ops"]
    assert f"{fp8['floor_lower_bound_ms'] / fp8['measured_ms']:.0%} of the speed of light" in lines[-1]


def test_a_report_without_a_section_says_how_to_get_one(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"environment": {"gpu": "x"}, "results": []}))
    with pytest.raises(ValueError, match="no speed_of_light section: run"):
        sol.committed_section(path)


def test_for_course_bars_sets_a_notebooks_bars_against_this_machines_floor():
    bars = step_profile.ChapterBars({"grouped GEMM": synthetic_breakdown(1.0)}, {})
    section = sol.for_course_bars(bars, mode="small", device="cpu")
    (label, c), = section["variants"].items()
    name, batch, seq_len = step_profile.COURSE_BARS["small"]
    assert label == "grouped GEMM" and section["rates"]["device"] == "cpu"
    assert c["floor"]["work"]["batch"] == batch and c["floor"]["work"]["seq_len"] == seq_len
    assert c["floor"]["work"]["precision"] == "bf16"
    assert c["measured_ms"] == synthetic_breakdown(1.0).total_ms
