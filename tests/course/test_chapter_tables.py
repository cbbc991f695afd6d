"""The tables chapters 04 and 05 draw from the package (`course.fp8_training`, `course.backends`,
`perf.blackwell`): what each row says follows from the decision it shows, and a row that did not
run says why."""

import json

import torch

from moe_tutorial.course import backends, fp8_training
from moe_tutorial.moe import experts, model, routing
from moe_tutorial.perf import bench, blackwell
from moe_tutorial.precision import hardware


def test_padding_shares_match_the_permutation_and_grow_with_the_alignment():
    shape = bench.ExpertShape("tiny", 64, 8, 16, 8, 2)
    shares = fp8_training.padding_shares([shape], (16, 32), seed=0)
    assert set(shares) == {("tiny", how) for how in bench.ROUTINGS}
    _, idx = bench.make_routing(shape, "skewed", seed=0)
    rows = routing.permute(torch.zeros(64, 1), idx, None, 8, align=32)[2].num_rows
    assert shares[("tiny", "skewed")][32] == (rows - 128) / 128
    assert all(s[16] <= s[32] for s in shares.values())
    table = fp8_training.padding_table([shape], shares, (16, 32))
    assert table.headers[-2:] == ["align 16", "align 32"] and len(table.rows) == 2


def test_recipe_choices_cover_this_machine_and_the_hypothetical_ones():
    choices = fp8_training.recipe_choices(hardware.capabilities())
    machines = {m for m, _ in choices}
    assert machines == {"this machine", *fp8_training.HYPOTHETICAL}
    assert choices[("Blackwell B200 (hypothetical)", "fastest")].name == "MXFP8BlockScaling"
    assert choices[("Hopper H200 (hypothetical)", "fastest")].align == 16
    table = fp8_training.recipe_table(choices)  # one row per machine, one column per preference
    hopper = next(r for r in table.rows if r[0] == "Hopper H200 (hypothetical)")
    assert len(table.rows) == 1 + len(fp8_training.HYPOTHETICAL)
    assert hopper[1:] == ["DelayedScaling", "Float8BlockScaling", "16"]


def test_the_training_table_compares_with_bf16_of_the_same_run_and_says_why_a_row_failed():
    ok = dict(status="ok", ms_per_step=10.0, tokens_per_s=100.0, peak_memory_gb=None,
              losses=[3.0, 2.0], path="te_ops")
    rows = [dict(ok, variant="bf16"), dict(ok, variant="DelayedScaling", ms_per_step=20.0,
                                           losses=[3.0, 2.5]),
            dict(variant="MXFP8BlockScaling", status="unavailable", error="needs compute capability 10.x")]
    table = fp8_training.training_table(rows, title="t")
    assert table.rows[1][3] == "0.50x" and table.rows[1][6] == "+0.2500"
    assert table.rows[2][1] == "UNAVAILABLE" and "10.x" in table.rows[2][-1]
    # the closing table's plain summary: speed against bf16 of the same run, losses only where judged
    kept = fp8_training.summary(rows, "small") + fp8_training.summary(rows, "mixtral-2l", losses_judged=False)
    assert json.loads(json.dumps(kept)) == kept
    lines = fp8_training.speed_summary(kept)
    assert lines["small"] == ("bf16 10.0 ms/step; DelayedScaling 0.50x, loss +0.250 · "
                              "MXFP8BlockScaling unavailable")
    assert "loss" not in lines["mixtral-2l"]


def test_every_backend_agrees_with_the_loop_and_says_what_ran():
    torch.manual_seed(0)
    ref = experts.NaiveExperts(4, 16, 32)
    torch.nn.init.normal_(ref.gate_up_proj, std=0.1)
    torch.nn.init.normal_(ref.down_proj, std=0.1)
    x = torch.randn(12, 16)
    w, idx = model.route(torch.randn(12, 4), 2)
    cases = {"naive": ("naive", {}), "grouped_torch": ("grouped_torch", {}),
             "te_ops, GLU interleave 32": ("te_ops", dict(glu_interleave_size=32))}
    checked = backends.check_backends(ref, cases, x, idx, w, torch.randn_like(x))
    assert ref.backend == "naive", "the reference stays the loop"
    errors = backends.errors_against(checked)
    assert max(max(e.values()) for e in errors.values()) < 1e-5
    assert "pure-PyTorch counterpart" in checked["te_ops, GLU interleave 32"]["path"]
    assert len(backends.agreement_table(checked, errors, title="t").rows) == 3


def test_the_fusion_cases_fall_back_raise_or_fuse_as_te_decides():
    rows = {r[0]: r for r in blackwell.fusion_cases(hardware.capabilities(), 128, 256)}
    runs = {case: r[2] for case, r in rows.items()}
    b200 = "B200 (hypothetical)"
    assert runs[f"{b200}: MXFP8 (E4M3), interleave 32, 256-row padding"] == "fused"
    assert runs[f"{b200}: MXFP8, rows padded only to MXFP8's 32"] == "fused, then RAISES"
    assert runs[f"{b200}: MXFP8 with Format.HYBRID (E5M2 gradients)"] == "unfused (silently)"
    assert runs["H200 (hypothetical): its fastest recipe"] == "unfused (silently)"
    assert "compute capability 10.x" in rows["H200 (hypothetical): its fastest recipe"][3]


def test_the_committed_dry_run_reads_back_with_every_case_agreeing():
    from moe_tutorial.perf import results

    report = results.read("h200_blackwell_dry_run.json")
    table = blackwell.dry_run_table(report)
    assert table.rows and all(row[-1] == "yes" for row in table.rows)
    assert "no Blackwell kernel ran" in table.title
    assert any("raises ValueError" in row[1] for row in blackwell.env_variable_table(report).rows)
