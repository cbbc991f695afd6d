"""The decision sweep (`moe_tutorial.perf.decide`): the grid, which variants run where (and why not),
a real sweep of tiny shapes on this CPU, the map's thresholds on hand-built speedups whose
answer is known, the one-line rule, the committed H200 map, and the display."""

import json

import pytest

from moe_tutorial import display
from moe_tutorial.perf import decide, results
from moe_tutorial.perf.bench import ExpertShape
from moe_tutorial.precision import hardware


def _caps(kind, **overrides):
    return hardware.evaluate(hardware.fake_environment(kind, **overrides))


# ---------------------------------------------------------------------------------------------
# The grid

def test_grid_points_have_the_stated_top_k_ratio_and_tokens_per_expert():
    for mode in ("small", "full"):
        shapes = decide.sweep_grid(mode)
        grid = decide.GRIDS[mode]
        assert len(shapes) == len(grid["hidden"]) * len(grid["experts"]) * len(
            grid["tokens_per_expert"])
        for s in shapes:
            assert s.top_k == decide.TOP_K and s.intermediate == round(3.5 * s.hidden)
            assert decide.tokens_per_expert(s) in grid["tokens_per_expert"]
            assert s.name == f"h{s.hidden}_e{s.experts}_t{decide.tokens_per_expert(s)}"
    full = decide.sweep_grid("full")
    assert any((s.hidden, s.intermediate, s.experts) == (4096, 14336, 8) for s in full)  # Mixtral
    assert max(s.hidden for s in decide.sweep_grid("small")) <= 128  # the CPU protein model's


def test_bad_grid_and_shape_input_is_refused():
    shape = decide.sweep_shape(64, 4, 16)  # 16 rows per expert × 4 experts / top-2
    assert isinstance(shape, ExpertShape) and (shape.tokens, shape.intermediate) == (32, 224)
    with pytest.raises(ValueError, match="mode 'huge' is not a course mode"):
        decide.sweep_grid("huge")
    with pytest.raises(ValueError, match="hidden=0 must be a positive integer"):
        decide.sweep_shape(0, 8, 16)
    with pytest.raises(ValueError, match="top_k=4 exceeds experts=2"):
        decide.sweep_shape(64, 2, 16, top_k=4)
    with pytest.raises(ValueError, match="not divisible by top_k=2"):
        decide.sweep_shape(64, 3, 5)


# ---------------------------------------------------------------------------------------------
# What runs where

def test_a_hopper_with_te_runs_groupedlinear_te_ops_and_the_fastest_fp8_recipe():
    variants = {v.name: v for v in decide.sweep_variants(_caps("hopper"), "cuda")}
    assert list(variants) == ["loop", "grouped", "te_ops", "fp8"]
    assert all(v.unavailable is None for v in variants.values())
    assert (variants["grouped"].backend, variants["fp8"].backend) == ("te_grouped_linear",) * 2
    assert variants["fp8"].precision == "DelayedScaling"  # resolve("fp8", hopper)
    blackwell = {v.name: v for v in decide.sweep_variants(_caps("blackwell"), "cuda")}
    assert blackwell["fp8"].precision == "MXFP8BlockScaling"


def test_without_te_or_a_gpu_the_te_variants_say_why():
    no_te = _caps("hopper", te_version=None, te_import_error="ImportError: no TE")
    variants = {v.name: v for v in decide.sweep_variants(no_te, "cuda")}
    assert variants["grouped"].backend == "grouped_torch" and variants["grouped"].unavailable is None
    assert "ImportError: no TE" in variants["te_ops"].unavailable
    assert "no TE FP8 recipe runs here" in variants["fp8"].unavailable
    for caps in (_caps("cpu"), _caps("hopper")):  # a CPU run, even where TE is installed
        variants = {v.name: v for v in decide.sweep_variants(caps, "cpu")}
        assert variants["grouped"].backend == "grouped_torch"
        for name in ("te_ops", "fp8"):
            assert variants[name].unavailable == ("device cpu: Transformer Engine runs on CUDA "
                                                  "GPUs only")


# ---------------------------------------------------------------------------------------------
# A real sweep on this CPU

def test_sweep_of_tiny_shapes_times_the_loop_and_grouped_and_says_why_not_the_rest():
    shapes = [decide.sweep_shape(16, 4, 8), decide.sweep_shape(32, 8, 16)]
    calls = []
    rows = decide.run_sweep(shapes, device="cpu", caps=_caps("cpu"), warmup=0, iters=2,
                            progress=lambda i, n, row: calls.append((i, n, row["variant"])))
    assert [i for i, _, _ in calls] == list(range(1, 9)) and {n for _, n, _ in calls} == {8}
    assert [(r["shape"], r["variant"]) for r in rows] == [
        (s.name, v) for s in shapes for v in ("loop", "grouped", "te_ops", "fp8")]
    for r in rows:
        assert r["hidden"] in (16, 32) and r["tokens_per_expert"] in (8, 16)
        if r["variant"] in ("loop", "grouped"):
            assert r["status"] == "ok", r
            assert r["median_ms"] > 0 and r["tflops"] > 0 and r["precision"] == "fp32"
            assert r["speedup_vs_loop"] == pytest.approx(
                next(x for x in rows if x["shape"] == r["shape"] and x["variant"] == "loop")
                ["median_ms"] / r["median_ms"])
        else:
            assert r["status"].startswith("unavailable: device cpu") and r["path"] is None
    grouped = [r for r in rows if r["variant"] == "grouped"]
    assert all(r["speedup_vs_bf16_grouped"] == 1.0 for r in grouped)
    assert all(r["path"] == "torch._grouped_mm" or "grouped" in r["path"] for r in grouped)
    decisions = decide.decision_map(rows)
    assert decisions["grouped_gemm"].kind != "not measurable"
    assert set(decisions["grouped_gemm"].speedups) == {s.name for s in shapes}
    assert decisions["fp8"].kind == decisions["te_ops"].kind == "not measurable"


def test_bad_sweep_input_is_refused():
    with pytest.raises(ValueError, match="no shapes to sweep"):
        decide.run_sweep([], device="cpu", caps=_caps("cpu"))
    with pytest.raises(ValueError, match="is not a bench.ExpertShape"):
        decide.run_sweep([(64, 8, 16)], device="cpu", caps=_caps("cpu"))
    with pytest.raises(ValueError, match=r"shape names repeat \(\['h16_e4_t8'\]\)"):
        decide.run_sweep([decide.sweep_shape(16, 4, 8)] * 2, device="cpu", caps=_caps("cpu"))
    with pytest.raises(ValueError, match="--device 'tpu' is not a device"):
        decide.run_sweep([decide.sweep_shape(16, 4, 8)], device="tpu", caps=_caps("cpu"))


# ---------------------------------------------------------------------------------------------
# The map and the rule, on speedups whose answer is known

def _rows(grouped=None, fp8=None, te_ops=None, unavailable="device cpu: no TE here"):
    """Sweep rows with the speedups given per (hidden, experts, tokens_per_expert); a technique
    given None is unavailable on every shape."""
    points = sorted({p for given in (grouped, fp8, te_ops) if given for p in given})
    rows = []
    for hidden, experts, tpe in points:
        shape = decide.sweep_shape(hidden, experts, tpe)
        base = dict(shape=shape.name, hidden=hidden, experts=experts, tokens_per_expert=tpe,
                    backend="b", precision="bf16")
        rows += [dict(base, variant="loop", status="ok", median_ms=1.0),
                 dict(base, variant="grouped", status="ok",
                      speedup_vs_loop=grouped[(hidden, experts, tpe)] if grouped else 1.0)]
        for name, given in (("fp8", fp8), ("te_ops", te_ops)):
            rows.append(dict(base, variant=name, status="ok",
                             speedup_vs_bf16_grouped=given[(hidden, experts, tpe)])
                        if given else dict(base, variant=name,
                                           status=f"unavailable: {unavailable}"))
    return rows


def test_always_never_and_even():
    points = [(64, 4, 16), (64, 16, 16), (256, 4, 64), (256, 16, 64)]
    decisions = decide.decision_map(_rows(grouped=dict.fromkeys(points, 1.5),
                                          fp8=dict(zip(points, (0.6, 0.7, 0.98, 1.02))),
                                          te_ops=dict(zip(points, (0.97, 1.0, 1.03, 0.96)))))
    assert decisions["grouped_gemm"].kind == "always" and decisions["grouped_gemm"].threshold is None
    assert decisions["fp8"].kind == "never"
    assert decisions["fp8"].loses == ["h64_e4_t16", "h64_e16_t16"]
    assert decisions["fp8"].even == ["h256_e4_t64", "h256_e16_t64"] and not decisions["fp8"].pays
    assert decisions["te_ops"].kind == "even"
    rule = decide.decision_rule(decisions)
    assert rule.startswith("On this machine (4 shapes): group the experts always (1.50× vs the loop)")
    assert "stay in bf16 (FP8 0.60–1.02× vs bf16)" in rule
    assert "te.ops ≈ GroupedLinear here (0.96–1.03×)" in rule and rule.count("\n") == 0


def test_from_a_size_on_with_the_threshold_read_off_the_data():
    # FP8 pays from tokens/expert × hidden = 256 × 64 = 2^14 on; grouping from 16 experts on
    points = {(64, 4, 16): (0.9, 0.7), (64, 16, 16): (2.0, 0.8), (64, 4, 256): (1.0, 1.2),
              (64, 16, 256): (3.0, 1.3), (256, 16, 256): (1.8, 1.5)}
    decisions = decide.decision_map(_rows(grouped={p: g for p, (g, _) in points.items()},
                                          fp8={p: f for p, (_, f) in points.items()}))
    grouped, fp8 = decisions["grouped_gemm"], decisions["fp8"]
    assert (grouped.kind, grouped.threshold) == ("from", 16)
    assert (fp8.kind, fp8.threshold) == ("from", 2 ** 14)
    assert fp8.sizes["h256_e16_t256"] == 2 ** 16
    rule = decide.decision_rule(decisions)
    assert "group the experts only when experts ≥ 16 (1.80–3.00× vs the loop; below it " \
           "0.90–1.00×)" in rule
    assert "use FP8 only when tokens per expert × hidden ≥ 2^14 (1.20–1.50× vs bf16; below " \
           "it 0.70–0.80×)" in rule
    assert "te.ops: not measurable here (device cpu: no TE here) — see decide.committed_map()" \
           in rule


def test_up_to_a_size_and_mixed():
    assert decide.boundary([(1, 2.0), (2, 1.5), (4, 1.0), (8, 0.5)]) == ("up_to", 2)
    assert decide.boundary([(1, 1.0), (2, 1.5), (4, 1.0)]) == ("mixed", None)
    # equal sizes: the size pays only if every shape of that size does
    assert decide.boundary([(1, 0.5), (4, 1.2), (4, 1.0), (8, 1.3)]) == ("from", 8)
    assert decide.boundary([]) == ("not measurable", None)
    points = [(64, 4, 16), (64, 8, 16), (64, 16, 16)]
    decisions = decide.decision_map(_rows(grouped=dict(zip(points, (1.0, 1.3, 0.9)))))
    assert decisions["grouped_gemm"].kind == "mixed"
    assert "grouping pays on 1 of 3 shapes with no single threshold in experts" in \
           decide.decision_rule(decisions)


def test_a_technique_that_ran_but_never_timed_says_so():
    rows = [r if r["variant"] != "fp8" else dict(r, status="wrong") for r in
            _rows(grouped={(64, 4, 16): 1.2}, fp8={(64, 4, 16): 1.0})]
    rows = [{k: v for k, v in r.items() if k != "speedup_vs_bf16_grouped" or r["status"] == "ok"}
            for r in rows]
    verdict = decide.decision_map(rows)["fp8"]
    assert verdict.kind == "not measurable" and "statuses: wrong" in verdict.reason


def test_bad_map_and_rule_input_is_refused():
    with pytest.raises(ValueError, match="no rows to decide from"):
        decide.decision_map([])
    with pytest.raises(ValueError, match=r"lacks \['variant', 'status'"):
        decide.decision_map([dict(shape="x", experts=4, hidden=64, tokens_per_expert=16)])
    with pytest.raises(ValueError, match="decision_rule takes decision_map"):
        decide.decision_rule({"fp8": 1.2})


def test_sizes_are_stated_as_powers_of_two():
    assert decide.format_size(2 ** 22, "tokens per expert × hidden") == "2^22"
    assert decide.format_size(3 * 2 ** 20, "tokens per expert × hidden") == "3,145,728"
    assert decide.format_size(512, "tokens per expert × hidden") == "512"
    assert decide.format_size(16, "experts") == "16"


# ---------------------------------------------------------------------------------------------
# The committed H200 results

def test_committed_map_reads_the_h200_expert_rows():
    report = results.read(results.H200)
    ms = {(r["shape"], r["backend"], r["precision"]): r["median_ms"] for r in report["results"]
          if r["part"] == "expert" and r["routing"] == "balanced" and r["status"] == "ok"}
    decisions = decide.committed_map()
    shapes = {shape for shape, _, _ in ms}  # every expert shape the committed run measured
    assert {"mixtral", "fine_grained", "small"} <= shapes
    assert set(decisions["fp8"].speedups) == shapes
    for shape in shapes:
        grouped = ms[(shape, "te_grouped_linear", "bf16")]
        assert decisions["grouped_gemm"].speedups[shape] == pytest.approx(
            ms[(shape, "naive", "bf16")] / grouped)
        assert decisions["fp8"].speedups[shape] == pytest.approx(
            grouped / ms[(shape, "te_grouped_linear", "DelayedScaling")])
        assert decisions["te_ops"].speedups[shape] == pytest.approx(
            grouped / ms[(shape, "te_ops", "bf16")])
    assert decisions["fp8"].sizes["mixtral"] == 2048 * 4096  # 8192 tokens × top-2 / 8 experts
    rule = decide.decision_rule(decisions, "the committed H200 run", see_also="")
    assert rule.startswith(f"On the committed H200 run ({len(shapes)} shapes): ")
    assert "not measurable" not in rule


def test_committed_map_refuses_files_it_cannot_read(tmp_path):
    with pytest.raises(ValueError, match="no such results file"):
        decide.committed_map(tmp_path / "missing.json")
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"environment": {"gpu": None}, "results": []}))
    with pytest.raises(ValueError, match="committed_rows reads Hopper"):
        decide.committed_map(cpu)
    train_only = tmp_path / "train.json"
    train_only.write_text(json.dumps({"environment": {"gpu": "NVIDIA H200",
                                                      "compute_capability": "9.0"},
                                      "results": [{"part": "train"}]}))
    with pytest.raises(ValueError, match="holds no expert-layer rows"):
        decide.committed_map(train_only)


# ---------------------------------------------------------------------------------------------
# The display

def test_show_decision_draws_a_heat_map_and_a_table(capsys):
    rows = _rows(grouped={(64, 4, 16): 2.0, (64, 16, 16): 0.5}, fp8=None)
    decisions = decide.decision_map(rows)
    fig = decide.show_decision(rows, decisions)
    heat = fig.data[0]
    assert heat.type == "heatmap" and heat.zmid == 0 and list(heat.x) == ["h64_e4_t16", "h64_e16_t16"]
    assert list(heat.z[0]) == [1.0, -1.0]  # log2 of the speedups: diverging at 1.0
    assert list(heat.text[1]) == ["n/a", "n/a"]  # FP8 was not measurable
    out = capsys.readouterr().out
    assert decide.decision_rule(decisions) in out
    assert "fp8 = unavailable: device cpu: no TE here" in out


def test_without_plotly_the_table_only(monkeypatch, capsys):
    monkeypatch.setattr(display, "plotly_go", lambda: None)
    rows = _rows(grouped={(64, 4, 16): 2.0})
    assert decide.show_decision(rows, title="my title") is None
    out = capsys.readouterr().out
    assert "plotly is not installed" in out and "my title" in out and "h64_e4_t16" in out


def test_the_table_names_shapes_whose_timings_were_disturbed():
    rows = _rows(grouped={(64, 4, 16): 2.0, (64, 16, 16): 1.5})
    for r in rows:
        if r["status"] == "ok":
            r.update(median_ms=1.0, min_ms=0.9)
    rows[0]["min_ms"] = 0.5  # the first shape's loop: median 2× its fastest iteration
    note = decide.decision_table(rows, decide.decision_map(rows)).note
    assert "1 of 2 shapes had a timing whose median exceeds 1.5× its fastest iteration " \
           "(h64_e4_t16)" in note
    rows[0]["min_ms"] = 0.9
    assert "fastest iteration" not in decide.decision_table(rows, decide.decision_map(rows)).note
