"""course/expert_sweep.py: the backends chapter 02 checks, times and quotes."""

import math

import pytest

from moe_tutorial.course import expert_sweep

SIZES = dict(hidden=32, intermediate=64, top_k=2, dtype="float32", device="cpu")


def test_the_grouped_backends_agree_with_the_loop_and_an_unknown_one_is_said_not_run():
    layer = expert_sweep.one_layer(4, **SIZES)
    agreement = expert_sweep.compare_backends(layer, ["naive", "grouped_torch", "no_such_backend"], tokens=64)
    assert set(agreement.errors) == {"naive", "grouped_torch"}
    assert agreement.worst < 1e-5 and not math.isnan(agreement.errors["grouped_torch"][3])
    assert "no_such_backend" in agreement.skipped and agreement.skipped["no_such_backend"]
    rows = agreement.table().rows
    assert rows[-1][0] == "no_such_backend" and rows[-1][1] == "not run"


def test_timed_backends_report_what_ran_and_the_sweep_table_their_speedup():
    by_experts = {n: expert_sweep.time_backends(["naive", "grouped_torch"], n, 64, warmup=0, iters=1, **SIZES)
                  for n in (2, 4)}
    for result in by_experts.values():
        assert result["naive"]["ms"] > 0 and result["grouped_torch"]["path"]
    table = expert_sweep.sweep_table(by_experts, ["naive", "grouped_torch"], tokens=64, top_k=2, title="t")
    assert [row[0] for row in table.rows] == ["2", "4"] and table.rows[0][-1].endswith("x")


def test_the_quoted_h200_table_names_the_courses_default():
    table = expert_sweep.quoted_expert_table("fine_grained")
    if table is None:
        pytest.skip("benchmarks/results/h200.json is not in this checkout")
    default = [row[0] for row in table.rows if row[-1] == "yes"]
    assert default == ["te_permute_grouped_mm"]
    assert "benchmarks/results/h200.json" in table.title
