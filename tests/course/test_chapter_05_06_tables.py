"""The tables chapters 05 and 06 draw from the package (`course.backends`, `perf.blackwell`,
`course.step_tables`): compact, each row saying what ran or why not, the published figures quoted with
their ratios, and nothing that labels one run's numbers as another's."""

import re

from moe_tutorial.course import backends, step_tables
from moe_tutorial.perf import bench, blackwell
from moe_tutorial.precision import hardware


def _row(backend, precision, ms=None, status="ok", **more):
    row = dict(backend=backend, precision=precision, status=status, **more)
    if ms is not None:
        row.update(median_ms=ms)
    return row


def test_the_timing_table_has_one_row_per_variant_and_one_column_per_shape():
    timings = {"small": [_row("naive", "bf16", 10.0, speedup_vs_loop=1.0),
                         _row("te_ops", "bf16", 4.0, speedup_vs_loop=2.5),
                         _row("te_ops", "bf16", 5.0, speedup_vs_loop=2.0, cutlass=True),
                         _row("te_ops", "Float8BlockScaling", status="unsupported", error="CUBLAS")],
               "mixtral": [_row("naive", "bf16", 50.0, speedup_vs_loop=1.0),
                           _row("te_ops", "bf16", 25.0, speedup_vs_loop=2.0)]}
    table = backends.timing_table(timings, title="t")
    assert table.headers == ["variant", "small: ms (vs loop)", "mixtral: ms (vs loop)"]
    rows = {r[0]: r[1:] for r in table.rows}
    assert rows["te_ops bf16"] == ["4.00 (2.50x)", "25.00 (2.00x)"]
    assert rows["te_ops bf16 (CUTLASS)"] == ["5.00 (2.00x)", ""], "the CUTLASS row keeps a label of its own"
    assert rows["te_ops Float8BlockScaling"] == ["UNSUPPORTED", ""]


def test_the_fusion_table_names_each_case_and_what_te_runs():
    cases = blackwell.fusion_cases(hardware.capabilities(), 128, 256)[1:]
    table = blackwell.fusion_table(cases)
    assert len(table.rows) == len(cases) and table.headers[-1] == "TE runs"
    assert not any(row[0].startswith("B200 (hypothetical)") for row in table.rows), "the header says B200"
    assert {row[1] for row in table.rows} == {"fused", "fused, then RAISES", "unfused (silently)"}
    assert any(row[0].startswith("H200") for row in table.rows)


def test_the_published_table_quotes_the_files_and_keeps_their_machines_apart():
    published = step_tables.show_published()  # prints its table outside a notebook
    like = published["comparisons"]["hf_like_for_like"]["tokens_per_s_per_gpu"]
    headline = published["comparisons"]["mxfp8_headline"]["tokens_per_s_per_gpu"]
    assert round(like["TE MXFP8"] / like["HF transformers bf16"], 2) == 1.57
    assert round(like["TE bf16"] / like["HF transformers bf16"], 2) == 1.07
    assert round(headline["TE MXFP8"] / headline["TE bf16"], 3) == 2.217


def test_the_summary_says_why_a_variant_did_not_run_and_invents_nothing(capsys):
    ok = {"hf_eager": dict(median_ms=100.0, tokens_per_s=1000.0),
          "ours_te_ops_bf16": dict(median_ms=50.0, tokens_per_s=2000.0)}
    not_run = {"ours_te_ops_fp8": "FP8 needs Transformer Engine on a CUDA GPU"}
    step_tables.show_summary(ok, not_run, {"hf_eager": 2.5}, "t")
    text = capsys.readouterr().out
    assert re.search(r"ours_te_ops_bf16 .*2\.00x", text)
    assert "not run: FP8 needs" in text and "did not pass" in text  # hf_grouped_mm: no row, no reason
    step_tables.show_summary({}, {}, {}, "no run")
    empty = capsys.readouterr().out
    assert "did not pass" not in empty and "—" in empty
    assert not re.search(r"not (run|trained|compared) here", text + empty, re.I)


def test_variants_here_keeps_every_variant_or_its_reason():
    from moe_tutorial.precision import recipes

    caps = hardware.capabilities()
    variants, not_run = step_tables.variants_here(caps, False, False, recipes.recipe_for(caps, "fastest"))
    assert set(variants) | set(not_run) == set(bench.TRAIN_VARIANTS) and not set(variants) & set(not_run)
    assert "hf_grouped_mm_compiled" in not_run
